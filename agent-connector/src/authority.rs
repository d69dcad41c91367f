//! Authority: capability names and patterns, policies, and the fail-closed
//! intersection that decides what a delegation may do.
//!
//! ```text
//! effective = caller grants ∩ caller policy ∩ callee policy ∩ requested ∩ route ceiling
//! ```
//!
//! **Refused, never narrowed.** A request that asks for a capability some
//! layer does not cover is refused with [`AuthorityError::CapabilityDenied`]
//! naming exactly the refused capabilities; when it is accepted the effective
//! set *is* the requested set.
//!
//! **Who checks what.** No single process holds all five layers. The caller's
//! connector checks its grant and its policy before signing
//! ([`authorize_outgoing`]); the callee's connector checks its policy and the
//! route ceiling the relay stamped on the `Open` ([`authorize_incoming`]),
//! taking the caller's signed request as the caller's statement of what it
//! may ask. Both together compute the whole intersection
//! ([`authorize_end_to_end`]).
//!
//! **Capability names** are `segment(:segment)*`, each segment of
//! `[A-Za-z0-9._/-]`, at most [`MAX_CAPABILITY_LEN`] bytes, compared
//! case-sensitively: `read:repo`, `write:repo`, `run:tests`. A name whose
//! first segment is `write` is a write capability.
//!
//! **Patterns** (grants, policies, ceilings) are a name, or a name followed by
//! `:*`, which covers every name with that prefix and at least one more
//! segment: `read:*` covers `read:repo` and `read:repo:main`, not `read`.
//! A bare `*` and mid-name wildcards (`rea*`) are refused, so no pattern can
//! grant "everything" by accident. Requests never hold wildcards.
//!
//! **Read-only** is the default. A delegation runs with writes only if the
//! request says `read_only: false` and both policies allow writes; a request
//! with `read_only: false` that a policy forbids is refused
//! ([`AuthorityError::WritesNotAllowed`]), and a `write:` capability under
//! read-only is refused like any other capability that is not covered.
//!
//! **Depth is one by default.** A request deeper than the policy's
//! `max_depth` ([`DEFAULT_MAX_DEPTH`] unless configured, at most
//! [`MAX_DEPTH`]) is refused, on both sides. Code serving a delegation in
//! this process holds a [`DelegationContext`]; asking to delegate with one
//! in hand is refused ([`AuthorityError::NestedDelegation`]) whatever the
//! policy: only the OpenAB endpoint starts deeper delegations, for a worker
//! runtime that names the delegation it serves as parent
//! (`docs/openab.md`).
//!
//! **Budgets** (tokens, cost, risk, output bytes, deadline): see
//! [`clamp_budgets`] for why the caller side refuses and the callee side
//! clamps.
//!
//! Never: narrows a capability set to let a request pass: a capability some
//! layer does not cover is refused by name, never dropped. Never reads a clock
//! or a file: every check takes `now_ms`.

use std::collections::BTreeSet;
use std::fmt;

use oab_wire::DelegationKey;
use serde::{Deserialize, Serialize};

use crate::profile::{Budgets, DelegationRequest, ProfileError};

/// The depth a policy allows unless configured otherwise (DESIGN §9: a
/// callee serving a delegation cannot delegate further).
pub const DEFAULT_MAX_DEPTH: u8 = 1;

/// The deepest delegation any policy may allow. The OpenAB endpoint passes
/// at most this many ancestors along (`task.context.openab.chain`), so a
/// chain never grows past it.
pub const MAX_DEPTH: u8 = 8;

/// Longest capability name or pattern, in bytes. Route ceilings share the
/// `Open` header with everything else, so names stay short.
pub const MAX_CAPABILITY_LEN: usize = 128;

/// Why authority was refused, or a policy or capability is invalid.
/// [`AuthorityError::code`] gives a stable snake_case code.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthorityError {
    /// The request asks for capabilities it may not have: exactly these
    /// (sorted, without duplicates).
    #[error("capabilities refused: {}", refused.join(", "))]
    CapabilityDenied {
        /// The refused capabilities.
        refused: Vec<String>,
    },
    /// The request is not read-only and a policy forbids writes.
    #[error("writes are not allowed")]
    WritesNotAllowed,
    /// The request is deeper than the policy allows.
    #[error("delegation depth {depth} exceeds the maximum {max}")]
    DepthExceeded {
        /// The request's depth.
        depth: u8,
        /// The policy's maximum.
        max: u8,
    },
    /// Code serving a delegation asked to delegate further.
    #[error("code serving a delegation cannot delegate further")]
    NestedDelegation,
    /// The request asks for more than the caller has left, or than the
    /// caller's policy allows.
    #[error("over budget: {field}")]
    OverBudget {
        /// `tokens`, `cost_micros`, `risk`, `output_bytes` or `deadline_ms`.
        field: &'static str,
    },
    /// The request's deadline has passed.
    #[error("deadline {deadline_ms} passed at {now_ms}")]
    DeadlinePassed {
        /// The request's deadline.
        deadline_ms: u64,
        /// Now.
        now_ms: u64,
    },
    /// A capability name or pattern is not valid (a wildcard in a request
    /// included).
    #[error("invalid capability {name:?}: {reason}")]
    InvalidCapability {
        /// The offending text (at most 64 characters).
        name: String,
        /// What rule it broke.
        reason: &'static str,
    },
    /// The route ceiling stamped by the relay cannot be parsed; refused
    /// rather than ignored.
    #[error("invalid route ceiling entry {entry:?}: {reason}")]
    InvalidCeiling {
        /// The offending entry (at most 64 characters).
        entry: String,
        /// What rule it broke.
        reason: &'static str,
    },
    /// A policy value is not valid.
    #[error("policy {field}: {reason}")]
    InvalidPolicy {
        /// The field.
        field: &'static str,
        /// What is wrong.
        reason: &'static str,
    },
    /// The request itself is invalid (credential fields, version, depth 0).
    #[error(transparent)]
    InvalidRequest(#[from] ProfileError),
}

impl AuthorityError {
    /// Stable snake_case code for logs, audit records and refusals.
    pub fn code(&self) -> &'static str {
        match self {
            AuthorityError::CapabilityDenied { .. } => "capability_denied",
            AuthorityError::WritesNotAllowed => "writes_not_allowed",
            AuthorityError::DepthExceeded { .. } => "depth_exceeded",
            AuthorityError::NestedDelegation => "nested_delegation",
            AuthorityError::OverBudget { .. } => "over_budget",
            AuthorityError::DeadlinePassed { .. } => "expired_request",
            AuthorityError::InvalidCapability { .. } => "invalid_capability",
            AuthorityError::InvalidCeiling { .. } => "invalid_ceiling",
            AuthorityError::InvalidPolicy { .. } => "invalid_policy",
            AuthorityError::InvalidRequest(e) => e.code(),
        }
    }
}

fn shown(s: &str) -> String {
    s.chars().take(64).collect()
}

/// Checks the name grammar; returns the reason it fails.
fn name_problem(s: &str) -> Option<&'static str> {
    if s.is_empty() {
        return Some("must not be empty");
    }
    if s.len() > MAX_CAPABILITY_LEN {
        return Some("longer than 128 bytes");
    }
    if s.contains('*') {
        return Some("wildcards only as a trailing `:*` in grants, policies and ceilings");
    }
    if !s
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-' | b'/' | b':'))
    {
        return Some("only A-Z a-z 0-9 . _ - / and : separators are allowed");
    }
    if s.split(':').any(str::is_empty) {
        return Some("empty segment (leading, trailing or double `:`)");
    }
    None
}

/// One exact capability name, as requested and as granted in effect.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Capability(String);

impl Capability {
    /// Validates a name; wildcards are refused.
    pub fn new(name: &str) -> Result<Self, AuthorityError> {
        match name_problem(name) {
            None => Ok(Capability(name.to_string())),
            Some(reason) => Err(AuthorityError::InvalidCapability {
                name: shown(name),
                reason,
            }),
        }
    }

    /// The name.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Whether this is a write capability (first segment `write`).
    pub fn is_write(&self) -> bool {
        self.0.split(':').next() == Some("write")
    }
}

impl fmt::Display for Capability {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A capability pattern: an exact name, or `name:*`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct CapabilityPattern {
    text: String,
    /// For `name:*`, the prefix `name:`; `None` for an exact name.
    prefix: Option<String>,
}

impl CapabilityPattern {
    /// Parses a pattern.
    pub fn parse(s: &str) -> Result<Self, AuthorityError> {
        let invalid = |reason| AuthorityError::InvalidCapability {
            name: shown(s),
            reason,
        };
        if let Some(base) = s.strip_suffix(":*") {
            if let Some(reason) = name_problem(base) {
                return Err(invalid(reason));
            }
            if s.len() > MAX_CAPABILITY_LEN {
                return Err(invalid("longer than 128 bytes"));
            }
            return Ok(CapabilityPattern {
                text: s.to_string(),
                prefix: Some(format!("{base}:")),
            });
        }
        Capability::new(s)?;
        Ok(CapabilityPattern {
            text: s.to_string(),
            prefix: None,
        })
    }

    /// Whether this pattern covers `cap`.
    pub fn covers(&self, cap: &Capability) -> bool {
        match &self.prefix {
            None => self.text == cap.0,
            // `cap` is a valid name, so a remainder after the prefix is a
            // non-empty segment list.
            Some(prefix) => cap.0.len() > prefix.len() && cap.0.starts_with(prefix.as_str()),
        }
    }

    /// The pattern as written.
    pub fn as_str(&self) -> &str {
        &self.text
    }
}

impl fmt::Display for CapabilityPattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

/// A set of capability patterns: a grant, a policy's allowed list, or a
/// stated route ceiling. The empty set covers nothing. In configuration and
/// JSON it is a list of strings.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "Vec<String>", into = "Vec<String>")]
pub struct CapabilitySet {
    patterns: Vec<CapabilityPattern>,
}

impl CapabilitySet {
    /// Parses patterns; the first invalid one is the error.
    pub fn parse<I, S>(items: I) -> Result<Self, AuthorityError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let patterns = items
            .into_iter()
            .map(|s| CapabilityPattern::parse(s.as_ref()))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(CapabilitySet { patterns })
    }

    /// The set that covers nothing.
    pub fn empty() -> Self {
        CapabilitySet::default()
    }

    /// Whether some pattern covers `cap`.
    pub fn covers(&self, cap: &Capability) -> bool {
        self.patterns.iter().any(|p| p.covers(cap))
    }

    /// The patterns.
    pub fn patterns(&self) -> &[CapabilityPattern] {
        &self.patterns
    }
}

impl TryFrom<Vec<String>> for CapabilitySet {
    type Error = AuthorityError;
    fn try_from(v: Vec<String>) -> Result<Self, AuthorityError> {
        CapabilitySet::parse(v)
    }
}

impl From<CapabilitySet> for Vec<String> {
    fn from(s: CapabilitySet) -> Vec<String> {
        s.patterns.into_iter().map(|p| p.text).collect()
    }
}

/// The capability ceiling the relay stamped on an `Open` from its route.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RouteCeiling {
    /// The route states no ceiling (empty `Open.ceiling`): no extra restriction.
    Unstated,
    /// The route's ceiling.
    Stated(CapabilitySet),
}

impl RouteCeiling {
    /// Parses `Open.ceiling`: empty means [`RouteCeiling::Unstated`];
    /// otherwise comma-separated patterns with no spaces and no empty
    /// entries. Anything else is refused (fail closed), never ignored.
    pub fn parse(ceiling: &str) -> Result<Self, AuthorityError> {
        if ceiling.is_empty() {
            return Ok(RouteCeiling::Unstated);
        }
        let mut patterns = Vec::new();
        for entry in ceiling.split(',') {
            let p =
                CapabilityPattern::parse(entry).map_err(|e| AuthorityError::InvalidCeiling {
                    entry: shown(entry),
                    reason: match e {
                        AuthorityError::InvalidCapability { reason, .. } => reason,
                        _ => "invalid entry",
                    },
                })?;
            patterns.push(p);
        }
        Ok(RouteCeiling::Stated(CapabilitySet { patterns }))
    }

    /// The ceiling as a layer of the intersection, if one is stated.
    pub fn as_layer(&self) -> Option<&CapabilitySet> {
        match self {
            RouteCeiling::Unstated => None,
            RouteCeiling::Stated(set) => Some(set),
        }
    }
}

fn default_max_depth() -> u8 {
    DEFAULT_MAX_DEPTH
}

/// One side's policy for delegations with a given peer: the caller's for a
/// callee, or the callee's for a caller. Deserializes from configuration
/// (`deny_unknown_fields`); `allow_writes` defaults to `false`, `max_depth`
/// to 1; `budgets` and `max_deadline_ms` are required (zero means zero).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Policy {
    /// Capability patterns this side allows.
    pub allowed_capabilities: CapabilitySet,
    /// Whether this side allows delegations that are not read-only.
    #[serde(default)]
    pub allow_writes: bool,
    /// Deepest delegation accepted, and started (1 to [`MAX_DEPTH`]).
    #[serde(default = "default_max_depth")]
    pub max_depth: u8,
    /// Budget ceiling per delegation.
    pub budgets: Budgets,
    /// Longest time from now to a delegation's deadline, in milliseconds.
    pub max_deadline_ms: u64,
}

impl Policy {
    /// Checks values serde cannot: `max_depth` in `1..=MAX_DEPTH`.
    pub fn validate(&self) -> Result<(), AuthorityError> {
        if self.max_depth == 0 || self.max_depth > MAX_DEPTH {
            return Err(AuthorityError::InvalidPolicy {
                field: "max_depth",
                reason: "must be 1 to 8",
            });
        }
        Ok(())
    }
}

/// What the caller's principal granted for delegations: capability patterns
/// and the budget it has left.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    /// Capability patterns granted.
    pub capabilities: CapabilitySet,
    /// Budget left.
    pub remaining: Budgets,
}

/// The authority a delegation runs with, after every check.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EffectiveAuthority {
    /// Effective capabilities (sorted, no duplicates); equal to the
    /// requested ones, since anything else is refused.
    pub capabilities: Vec<String>,
    /// Whether the delegation runs read-only.
    pub read_only: bool,
    /// The delegation's depth.
    pub depth: u8,
    /// Budgets the executor must stay within.
    pub budgets: Budgets,
    /// Deadline the executor must meet.
    pub deadline_ms: u64,
}

/// The intersection of `requested` with every layer, refusing rather than
/// narrowing: every requested capability must be covered by every layer
/// and, under `read_only`, not be a write capability. Returns the requested
/// capabilities (sorted, without duplicates) or
/// [`AuthorityError::CapabilityDenied`] listing exactly the refused ones.
/// A requested name that is invalid or holds a wildcard is
/// [`AuthorityError::InvalidCapability`].
pub fn effective_capabilities(
    requested: &[String],
    layers: &[&CapabilitySet],
    read_only: bool,
) -> Result<Vec<Capability>, AuthorityError> {
    let requested = requested
        .iter()
        .map(|s| Capability::new(s))
        .collect::<Result<BTreeSet<_>, _>>()?;
    let refused: Vec<String> = requested
        .iter()
        .filter(|c| (read_only && c.is_write()) || !layers.iter().all(|l| l.covers(c)))
        .map(|c| c.0.clone())
        .collect();
    if !refused.is_empty() {
        return Err(AuthorityError::CapabilityDenied { refused });
    }
    Ok(requested.into_iter().collect())
}

/// Budgets for a delegation: refused when `requested` is over
/// `caller_remaining` in any member ([`AuthorityError::OverBudget`], fail
/// closed: the caller may not promise what it does not have), otherwise the
/// smaller of `requested` and `callee_limit` in each member.
///
/// **Why the callee side clamps instead of refusing.** Capabilities are
/// authority: granting fewer than asked would silently change what the task
/// may do, so that is refused. A budget is a ceiling on consumption, and the
/// callee lowering it to its own limit narrows only *its own promise*: it
/// can never spend more than the caller offered, and the narrower budget is
/// not silent, since the callee states it in its [`EffectiveAuthority`]
/// (sent when it accepts) and its signed result reports `usage`. Refusing
/// instead would force every caller to learn every callee's limits first,
/// for no gain in safety.
pub fn clamp_budgets(
    requested: &Budgets,
    caller_remaining: &Budgets,
    callee_limit: &Budgets,
) -> Result<Budgets, AuthorityError> {
    if let Some(field) = requested.first_excess(caller_remaining) {
        return Err(AuthorityError::OverBudget { field });
    }
    Ok(requested.min_each(callee_limit))
}

fn check_depth(request: &DelegationRequest, policy: &Policy) -> Result<(), AuthorityError> {
    let max = policy.max_depth.min(MAX_DEPTH);
    if request.depth > max {
        return Err(AuthorityError::DepthExceeded {
            depth: request.depth,
            max,
        });
    }
    Ok(())
}

fn check_deadline(request: &DelegationRequest, now_ms: u64) -> Result<(), AuthorityError> {
    if request.deadline_ms <= now_ms {
        return Err(AuthorityError::DeadlinePassed {
            deadline_ms: request.deadline_ms,
            now_ms,
        });
    }
    Ok(())
}

/// The caller's check before it signs and sends a request: not serving a
/// delegation (`serving` must be `None`), the request valid
/// ([`DelegationRequest::validate`]), depth within the policy, writes only if
/// the policy allows them, every capability covered by the grant and the
/// policy, the deadline in the future and within the policy's
/// `max_deadline_ms`, budgets within both the grant's remaining budget and
/// the policy's ceiling (over either is refused).
pub fn authorize_outgoing(
    grant: &Grant,
    policy: &Policy,
    request: &DelegationRequest,
    serving: Option<&DelegationContext>,
    now_ms: u64,
) -> Result<EffectiveAuthority, AuthorityError> {
    if let Some(ctx) = serving {
        ctx.check_can_delegate()?;
    }
    request.validate()?;
    check_depth(request, policy)?;
    if !request.read_only && !policy.allow_writes {
        return Err(AuthorityError::WritesNotAllowed);
    }
    let caps = effective_capabilities(
        &request.capabilities,
        &[&grant.capabilities, &policy.allowed_capabilities],
        request.read_only,
    )?;
    check_deadline(request, now_ms)?;
    if request.deadline_ms - now_ms > policy.max_deadline_ms {
        return Err(AuthorityError::OverBudget {
            field: "deadline_ms",
        });
    }
    // The callee's limit is not known here; the callee clamps to it.
    let budgets = clamp_budgets(
        &request.budgets,
        &grant.remaining.min_each(&policy.budgets),
        &request.budgets,
    )?;
    Ok(EffectiveAuthority {
        capabilities: caps.into_iter().map(|c| c.0).collect(),
        read_only: request.read_only,
        depth: request.depth,
        budgets,
        deadline_ms: request.deadline_ms,
    })
}

/// The callee's check of a verified request: the request valid, depth within
/// the policy, writes only if the policy allows them, every capability
/// covered by the policy and the route ceiling, the deadline in the future.
/// Budgets and the deadline are clamped to the policy (see
/// [`clamp_budgets`]): the caller's signed budgets stand for what it has
/// left.
pub fn authorize_incoming(
    policy: &Policy,
    ceiling: &RouteCeiling,
    request: &DelegationRequest,
    now_ms: u64,
) -> Result<EffectiveAuthority, AuthorityError> {
    request.validate()?;
    check_depth(request, policy)?;
    if !request.read_only && !policy.allow_writes {
        return Err(AuthorityError::WritesNotAllowed);
    }
    let mut layers = vec![&policy.allowed_capabilities];
    if let Some(c) = ceiling.as_layer() {
        layers.push(c);
    }
    let caps = effective_capabilities(&request.capabilities, &layers, request.read_only)?;
    check_deadline(request, now_ms)?;
    let deadline_ms = request
        .deadline_ms
        .min(now_ms.saturating_add(policy.max_deadline_ms));
    let budgets = clamp_budgets(&request.budgets, &request.budgets, &policy.budgets)?;
    Ok(EffectiveAuthority {
        capabilities: caps.into_iter().map(|c| c.0).collect(),
        read_only: request.read_only,
        depth: request.depth,
        budgets,
        deadline_ms,
    })
}

/// Both sides' checks in one process (tests, and a caller and callee in the
/// same host): [`authorize_outgoing`] then [`authorize_incoming`]; the
/// result is the callee's view.
pub fn authorize_end_to_end(
    grant: &Grant,
    caller_policy: &Policy,
    callee_policy: &Policy,
    ceiling: &RouteCeiling,
    request: &DelegationRequest,
    now_ms: u64,
) -> Result<EffectiveAuthority, AuthorityError> {
    authorize_outgoing(grant, caller_policy, request, None, now_ms)?;
    authorize_incoming(callee_policy, ceiling, request, now_ms)
}

/// Held by code that serves a delegation (the callee's executor), for as
/// long as it serves it. Delegating with one in hand is refused
/// ([`AuthorityError::NestedDelegation`]), whatever the policy's depth. Pass it to
/// [`authorize_outgoing`] as `serving`. Deliberately not `Clone`.
#[derive(Debug)]
pub struct DelegationContext {
    key: DelegationKey,
    authority: EffectiveAuthority,
}

impl DelegationContext {
    /// The context for serving `key` with `authority`.
    pub fn new(key: DelegationKey, authority: EffectiveAuthority) -> Self {
        DelegationContext { key, authority }
    }

    /// The delegation being served.
    pub fn key(&self) -> &DelegationKey {
        &self.key
    }

    /// The authority it runs with.
    pub fn authority(&self) -> &EffectiveAuthority {
        &self.authority
    }

    /// Whether code holding this context may delegate further: never. An
    /// executor in this process cannot say which delegation a new one
    /// belongs to, so it cannot carry the ancestry a deeper delegation
    /// needs; the OpenAB endpoint's workers can (`docs/openab.md`).
    pub fn check_can_delegate(&self) -> Result<(), AuthorityError> {
        Err(AuthorityError::NestedDelegation)
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::profile::RiskLevel;
    use crate::profile::tests::{NOW, budgets, sample_request};

    fn set(items: &[&str]) -> CapabilitySet {
        CapabilitySet::parse(items).unwrap()
    }

    fn policy(allowed: &[&str], allow_writes: bool) -> Policy {
        Policy {
            allowed_capabilities: set(allowed),
            allow_writes,
            max_depth: 1,
            budgets: budgets(),
            max_deadline_ms: 3_600_000,
        }
    }

    fn grant(caps: &[&str]) -> Grant {
        Grant {
            capabilities: set(caps),
            remaining: budgets(),
        }
    }

    fn request(caps: &[&str], read_only: bool) -> DelegationRequest {
        let mut r = sample_request(NOW);
        r.capabilities = caps.iter().map(|s| s.to_string()).collect();
        r.read_only = read_only;
        r
    }

    #[test]
    fn names_and_patterns() {
        for ok in [
            "read:repo",
            "run:tests",
            "read:repo:main",
            "x",
            "a.b/c-d_e:f",
        ] {
            assert!(Capability::new(ok).is_ok(), "{ok}");
            assert!(CapabilityPattern::parse(ok).is_ok(), "{ok}");
        }
        for bad in [
            "",
            "read:",
            ":repo",
            "read::repo",
            "read repo",
            "read:*",
            "*",
            "ré:x",
        ] {
            assert!(Capability::new(bad).is_err(), "{bad}");
        }
        for bad in [
            "*", "rea*", "read:*:x", "read:**", ":*", "read:re*", "*:repo",
        ] {
            assert!(CapabilityPattern::parse(bad).is_err(), "{bad}");
        }
        let c = |s| Capability::new(s).unwrap();
        let p = |s| CapabilityPattern::parse(s).unwrap();
        assert!(p("read:*").covers(&c("read:repo")));
        assert!(p("read:*").covers(&c("read:repo:main")));
        assert!(!p("read:*").covers(&c("read")));
        assert!(!p("read:*").covers(&c("readx:repo")));
        assert!(!p("read:*").covers(&c("Read:repo")));
        assert!(p("read:repo:*").covers(&c("read:repo:main")));
        assert!(!p("read:repo:*").covers(&c("read:repo")));
        assert!(p("read:repo").covers(&c("read:repo")));
        assert!(!p("read:repo").covers(&c("read:repo:main")));
        assert!(c("write:repo").is_write());
        assert!(!c("writer:repo").is_write());
        assert!(!c("read:write").is_write());
    }

    #[test]
    fn intersection_table() {
        type Case = (
            &'static str,
            &'static [&'static str],
            &'static [&'static [&'static str]],
            bool,
            Result<&'static [&'static str], &'static [&'static str]>,
        );
        let cases: &[Case] = &[
            (
                "exact match",
                &["read:repo"],
                &[&["read:repo"]],
                true,
                Ok(&["read:repo"]),
            ),
            ("nothing requested", &[], &[&[]], true, Ok(&[])),
            (
                "widening is refused with the exact list",
                &["read:repo", "run:tests", "read:secrets"],
                &[&["read:repo", "run:tests"], &["read:*", "run:tests"]],
                true,
                Err(&["read:secrets"]),
            ),
            (
                "refused by any one layer",
                &["read:repo", "run:tests"],
                &[
                    &["read:*", "run:*"],
                    &["read:*"],
                    &["run:tests", "read:repo"],
                ],
                true,
                Err(&["run:tests"]),
            ),
            (
                "wildcard grants cover",
                &["read:repo", "read:docs:api"],
                &[&["read:*"], &["read:repo", "read:docs:*"]],
                true,
                Ok(&["read:docs:api", "read:repo"]),
            ),
            (
                "empty layer covers nothing",
                &["read:repo"],
                &[&["read:*"], &[]],
                true,
                Err(&["read:repo"]),
            ),
            (
                "write under read-only is refused even when granted",
                &["read:repo", "write:repo"],
                &[&["read:*", "write:*"]],
                true,
                Err(&["write:repo"]),
            ),
            (
                "write allowed when not read-only",
                &["write:repo"],
                &[&["write:*"]],
                false,
                Ok(&["write:repo"]),
            ),
            (
                "duplicates collapse, refusals sorted",
                &["z:b", "a:b", "z:b", "read:x"],
                &[&["read:*"]],
                true,
                Err(&["a:b", "z:b"]),
            ),
        ];
        for (name, requested, layers, read_only, want) in cases {
            let layer_sets: Vec<CapabilitySet> = layers.iter().map(|l| set(l)).collect();
            let refs: Vec<&CapabilitySet> = layer_sets.iter().collect();
            let req: Vec<String> = requested.iter().map(|s| s.to_string()).collect();
            let got = effective_capabilities(&req, &refs, *read_only)
                .map(|v| v.into_iter().map(|c| c.0).collect::<Vec<_>>());
            let want = match want {
                Ok(v) => Ok(v.iter().map(|s| s.to_string()).collect::<Vec<_>>()),
                Err(r) => Err(AuthorityError::CapabilityDenied {
                    refused: r.iter().map(|s| s.to_string()).collect(),
                }),
            };
            assert_eq!(got, want, "{name}");
        }
        // Wildcards never in requests.
        let err =
            effective_capabilities(&["read:*".into()], &[&set(&["read:*"])], true).unwrap_err();
        assert_eq!(err.code(), "invalid_capability");
    }

    #[test]
    fn route_ceiling_parsing() {
        assert_eq!(RouteCeiling::parse("").unwrap(), RouteCeiling::Unstated);
        assert_eq!(
            RouteCeiling::parse("read:repo,run:tests").unwrap(),
            RouteCeiling::Stated(set(&["read:repo", "run:tests"]))
        );
        for bad in [",", "read:repo,", "read:repo, run:tests", "read:", "*"] {
            let err = RouteCeiling::parse(bad).unwrap_err();
            assert_eq!(err.code(), "invalid_ceiling", "{bad}");
        }
    }

    #[test]
    fn authorize_table() {
        let open = policy(&["read:*", "run:*", "write:*"], true);
        let ro = policy(&["read:*", "run:*", "write:*"], false);
        let all = grant(&["read:*", "run:*", "write:*"]);
        let none = RouteCeiling::Unstated;
        let narrow = RouteCeiling::parse("read:repo").unwrap();
        type Case<'a> = (
            &'static str,
            &'a Grant,
            &'a Policy,
            &'a Policy,
            &'a RouteCeiling,
            DelegationRequest,
            Option<&'static str>,
        );
        let mut deep = request(&["read:repo"], true);
        deep.depth = 2;
        let mut late = request(&["read:repo"], true);
        late.deadline_ms = NOW;
        let mut far = request(&["read:repo"], true);
        far.deadline_ms = NOW + 3_600_001;
        let mut rich = request(&["read:repo"], true);
        rich.budgets.tokens += 1;
        let mut risky = request(&["read:repo"], true);
        risky.budgets.risk = RiskLevel::High;
        let mut with_secret = request(&["read:repo"], true);
        with_secret
            .task
            .context
            .insert("password".into(), serde_json::json!("x"));
        let g_read = grant(&["read:repo"]);
        let cases: Vec<Case<'_>> = vec![
            (
                "read-only request passes",
                &all,
                &ro,
                &ro,
                &none,
                request(&["read:repo"], true),
                None,
            ),
            (
                "writes with both policies allowing",
                &all,
                &open,
                &open,
                &none,
                request(&["write:repo"], false),
                None,
            ),
            (
                "writes refused by the caller policy",
                &all,
                &ro,
                &open,
                &none,
                request(&["write:repo"], false),
                Some("writes_not_allowed"),
            ),
            (
                "writes refused by the callee policy",
                &all,
                &open,
                &ro,
                &none,
                request(&["write:repo"], false),
                Some("writes_not_allowed"),
            ),
            (
                "write capability under read-only",
                &all,
                &open,
                &open,
                &none,
                request(&["write:repo"], true),
                Some("capability_denied"),
            ),
            (
                "over the grant",
                &g_read,
                &ro,
                &ro,
                &none,
                request(&["read:repo", "run:tests"], true),
                Some("capability_denied"),
            ),
            (
                "over the route ceiling",
                &all,
                &ro,
                &ro,
                &narrow,
                request(&["read:repo", "read:docs"], true),
                Some("capability_denied"),
            ),
            (
                "depth two",
                &all,
                &ro,
                &ro,
                &none,
                deep,
                Some("depth_exceeded"),
            ),
            (
                "deadline passed",
                &all,
                &ro,
                &ro,
                &none,
                late,
                Some("expired_request"),
            ),
            (
                "deadline beyond the caller policy",
                &all,
                &ro,
                &ro,
                &none,
                far,
                Some("over_budget"),
            ),
            (
                "tokens over budget",
                &all,
                &ro,
                &ro,
                &none,
                rich,
                Some("over_budget"),
            ),
            (
                "risk over budget",
                &all,
                &ro,
                &ro,
                &none,
                risky,
                Some("over_budget"),
            ),
            (
                "credential in context",
                &all,
                &ro,
                &ro,
                &none,
                with_secret,
                Some("credential_field"),
            ),
        ];
        for (name, g, cp, ep, ceiling, req, want) in cases {
            let got = authorize_end_to_end(g, cp, ep, ceiling, &req, NOW);
            assert_eq!(
                got.as_ref().err().map(|e| e.code()),
                want,
                "{name}: {got:?}"
            );
            if let Ok(eff) = got {
                assert_eq!(eff.capabilities, {
                    let mut c = req.capabilities.clone();
                    c.sort();
                    c
                });
                assert_eq!(eff.read_only, req.read_only);
            }
        }
        // The exact refused list through the full stack.
        let err = authorize_end_to_end(
            &all,
            &ro,
            &ro,
            &narrow,
            &request(&["read:repo", "read:docs", "run:tests"], true),
            NOW,
        )
        .unwrap_err();
        assert_eq!(
            err,
            AuthorityError::CapabilityDenied {
                refused: vec!["read:docs".into(), "run:tests".into()]
            }
        );
    }

    #[test]
    fn budgets_refuse_over_remaining_and_clamp_to_the_callee() {
        let requested = budgets();
        let mut remaining = budgets();
        remaining.cost_micros -= 1;
        assert_eq!(
            clamp_budgets(&requested, &remaining, &requested),
            Err(AuthorityError::OverBudget {
                field: "cost_micros"
            })
        );
        let mut limit = budgets();
        limit.tokens = 100;
        limit.risk = RiskLevel::Low;
        let got = clamp_budgets(&requested, &requested, &limit).unwrap();
        assert_eq!(got.tokens, 100);
        assert_eq!(got.risk, RiskLevel::Low);
        assert_eq!(got.cost_micros, requested.cost_micros);
        // Zero means zero: a zero limit clamps to zero, never "unlimited".
        let zero = Budgets {
            tokens: 0,
            cost_micros: 0,
            risk: RiskLevel::Low,
            output_bytes: 0,
        };
        assert_eq!(clamp_budgets(&requested, &requested, &zero).unwrap(), zero);
        assert_eq!(
            clamp_budgets(&requested, &zero, &requested)
                .unwrap_err()
                .code(),
            "over_budget"
        );

        // The callee clamps budgets and deadline to its policy and says so.
        let mut callee = policy(&["read:*"], false);
        callee.budgets = limit;
        callee.max_deadline_ms = 1_000;
        let eff = authorize_incoming(
            &callee,
            &RouteCeiling::Unstated,
            &request(&["read:repo"], true),
            NOW,
        )
        .unwrap();
        assert_eq!(eff.budgets.tokens, 100);
        assert_eq!(eff.deadline_ms, NOW + 1_000);
        // The caller refuses what its grant does not cover.
        let mut poor = grant(&["read:*"]);
        poor.remaining.output_bytes = 0;
        let err = authorize_outgoing(
            &poor,
            &policy(&["read:*"], false),
            &request(&["read:repo"], true),
            None,
            NOW,
        )
        .unwrap_err();
        assert_eq!(
            err,
            AuthorityError::OverBudget {
                field: "output_bytes"
            }
        );
    }

    #[test]
    fn nested_delegation_is_refused() {
        let p = policy(&["read:*"], false);
        let g = grant(&["read:*"]);
        let req = request(&["read:repo"], true);
        let eff = authorize_incoming(&p, &RouteCeiling::Unstated, &req, NOW).unwrap();
        let ctx = DelegationContext::new(
            DelegationKey::new(req.caller.clone(), req.request_id.clone()),
            eff,
        );
        assert_eq!(
            ctx.check_can_delegate(),
            Err(AuthorityError::NestedDelegation)
        );
        let err = authorize_outgoing(&g, &p, &req, Some(&ctx), NOW).unwrap_err();
        assert_eq!(err.code(), "nested_delegation");
        assert!(authorize_outgoing(&g, &p, &req, None, NOW).is_ok());
        assert_eq!(ctx.key().request_id, req.request_id);
        assert!(ctx.authority().read_only);
    }

    #[test]
    fn policy_from_config() {
        let p: Policy = serde_json::from_value(serde_json::json!({
            "allowed_capabilities": ["read:*", "run:tests"],
            "budgets": {"tokens": 1, "cost_micros": 2, "risk": "low", "output_bytes": 3},
            "max_deadline_ms": 60000
        }))
        .unwrap();
        assert!(!p.allow_writes);
        assert_eq!(p.max_depth, 1);
        p.validate().unwrap();
        let back = serde_json::to_value(&p).unwrap();
        assert_eq!(
            back["allowed_capabilities"],
            serde_json::json!(["read:*", "run:tests"])
        );
        let base = serde_json::to_value(&p).unwrap();
        let edits: [(&str, serde_json::Value); 4] = [
            ("/allowed_capabilities", serde_json::json!(["*"])),
            ("/budgets/output_bytes", serde_json::Value::Null),
            ("/max_deadline_ms", serde_json::Value::Null),
            ("/extra", serde_json::json!(1)),
        ];
        for (pointer, value) in edits {
            let mut bad = base.clone();
            let (parent, member) = pointer.rsplit_once('/').unwrap();
            let obj = bad.pointer_mut(parent).unwrap().as_object_mut().unwrap();
            if value.is_null() {
                obj.remove(member);
            } else {
                obj.insert(member.to_string(), value);
            }
            assert!(serde_json::from_value::<Policy>(bad).is_err(), "{pointer}");
        }
        assert!(serde_json::from_value::<Policy>(base).is_ok());
        let mut deep = p;
        deep.max_depth = MAX_DEPTH;
        deep.validate().unwrap();
        for bad in [0, MAX_DEPTH + 1] {
            deep.max_depth = bad;
            assert_eq!(deep.validate().unwrap_err().code(), "invalid_policy");
        }
    }

    fn name_strategy() -> impl Strategy<Value = String> {
        (
            prop::sample::select(vec!["read", "write", "run"]),
            prop::sample::select(vec!["repo", "tests", "docs", "repo:main", "repo:dev"]),
        )
            .prop_map(|(a, b)| format!("{a}:{b}"))
    }

    fn pattern_strategy() -> impl Strategy<Value = String> {
        prop_oneof![
            name_strategy(),
            prop::sample::select(vec!["read:*", "write:*", "run:*", "read:repo:*"])
                .prop_map(str::to_string),
        ]
    }

    fn layer_strategy() -> impl Strategy<Value = Vec<String>> {
        prop::collection::vec(pattern_strategy(), 0..5)
    }

    proptest! {
        #[test]
        fn intersection_never_returns_a_capability_outside_any_set(
            requested in prop::collection::vec(name_strategy(), 0..6),
            layers in prop::collection::vec(layer_strategy(), 0..5),
            read_only in any::<bool>(),
        ) {
            let sets: Vec<CapabilitySet> =
                layers.iter().map(|l| CapabilitySet::parse(l).unwrap()).collect();
            let refs: Vec<&CapabilitySet> = sets.iter().collect();
            match effective_capabilities(&requested, &refs, read_only) {
                Ok(eff) => {
                    for c in &eff {
                        prop_assert!(requested.contains(&c.0));
                        prop_assert!(!(read_only && c.is_write()));
                        for s in &sets {
                            prop_assert!(s.covers(c), "{} outside a layer", c);
                        }
                    }
                    // Never narrowed: every requested capability is in effect.
                    for r in &requested {
                        prop_assert!(eff.iter().any(|c| &c.0 == r));
                    }
                }
                Err(AuthorityError::CapabilityDenied { refused }) => {
                    prop_assert!(!refused.is_empty());
                    for r in &requested {
                        let c = Capability::new(r).unwrap();
                        let bad = (read_only && c.is_write()) || !sets.iter().all(|s| s.covers(&c));
                        // Exactly the uncovered ones are listed.
                        prop_assert_eq!(bad, refused.contains(r));
                    }
                }
                Err(e) => prop_assert!(false, "unexpected {e}"),
            }
        }

        #[test]
        fn end_to_end_stays_inside_every_layer(
            requested in prop::collection::vec(name_strategy(), 0..5),
            grant_l in layer_strategy(),
            caller_l in layer_strategy(),
            callee_l in layer_strategy(),
            ceiling_l in prop::option::of(prop::collection::vec(pattern_strategy(), 1..4)),
            read_only in any::<bool>(),
            writes in any::<(bool, bool)>(),
        ) {
            let g = Grant {
                capabilities: CapabilitySet::parse(&grant_l).unwrap(),
                remaining: budgets(),
            };
            let mut cp = policy(&[], writes.0);
            cp.allowed_capabilities = CapabilitySet::parse(&caller_l).unwrap();
            let mut ep = policy(&[], writes.1);
            ep.allowed_capabilities = CapabilitySet::parse(&callee_l).unwrap();
            let ceiling = RouteCeiling::parse(&ceiling_l.unwrap_or_default().join(",")).unwrap();
            let mut req = sample_request(NOW);
            req.capabilities = requested.clone();
            req.read_only = read_only;
            if let Ok(eff) = authorize_end_to_end(&g, &cp, &ep, &ceiling, &req, NOW) {
                prop_assert!(eff.read_only || (writes.0 && writes.1 && !read_only));
                for c in &eff.capabilities {
                    let c = Capability::new(c).unwrap();
                    prop_assert!(requested.contains(&c.0));
                    prop_assert!(g.capabilities.covers(&c));
                    prop_assert!(cp.allowed_capabilities.covers(&c));
                    prop_assert!(ep.allowed_capabilities.covers(&c));
                    if let Some(l) = ceiling.as_layer() {
                        prop_assert!(l.covers(&c));
                    }
                    prop_assert!(!(eff.read_only && c.is_write()));
                }
            }
        }
    }
}
