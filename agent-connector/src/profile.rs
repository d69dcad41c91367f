//! The OAB Delegation Profile: what a caller signs ([`DelegationRequest`]),
//! what a callee signs ([`DelegationResult`]), and the rules for signing and
//! verifying them.
//!
//! **Encoding.** Payloads are JSON objects with **snake_case** member names
//! (the same spelling as the Rust fields, so logs, docs and code agree).
//! Every struct refuses unknown members (`deny_unknown_fields`): a field this
//! version does not understand could carry authority it would ignore. Ids use
//! the `oab-wire` text forms, digests `sha256:<hex>`, the nonce unpadded
//! base64url, times milliseconds since the Unix epoch.
//!
//! **Budgets are explicit.** Every member of [`Budgets`] is required on the
//! wire and **zero means zero**, never "unlimited".
//!
//! **Verify, then parse the same bytes.** [`verify_request`] and
//! [`verify_result`] call [`Envelope::verify`] first and parse only the bytes
//! it hands out; the request digest is SHA-256 of exactly those bytes.
//!
//! **Bindings.** A result is bound to its request by `request_id` and
//! `request_digest`, to its signer by `executor` (peer and key id equal the
//! envelope's signer and key id), and to its content by `result_digest`
//! ([`result_digest`]). Any change to any member breaks the signature; a
//! result re-signed with inconsistent bindings is refused by the binding
//! checks.
//!
//! **No credentials.** A request whose task carries credentials, environment
//! or session handles is refused ([`find_credential_field`]).
//!
//! Never: parses a request or a result that [`Envelope::verify`] has not handed
//! out, and does no I/O: no socket, no file, no clock (every check takes
//! `now_ms`).

use base64::Engine as _;
use oab_wire::envelope::{EnvelopeError, REQUEST_TYPE, RESULT_TYPE};
use oab_wire::identity::{Identity, TrustStore};
use oab_wire::{Digest, KeyId, Open, Outcome, PeerId, RequestId};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

pub use oab_wire::envelope::Envelope;

/// The peers' keys as the connector holds them: swapped whole by a reload,
/// read without a lock by every verification (requests at the callee,
/// results at the caller).
pub type PeerKeys =
    arc_swap::ArcSwap<std::collections::HashMap<PeerId, Vec<oab_wire::identity::PeerKey>>>;

/// A request nonce: 16 random bytes, on the wire as unpadded base64url
/// (22 characters).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Nonce(pub [u8; 16]);

impl Nonce {
    /// A fresh nonce from the operating system's random generator.
    pub fn random() -> Self {
        let mut b = [0u8; 16];
        rand_core::RngCore::fill_bytes(&mut rand_core::OsRng, &mut b);
        Nonce(b)
    }

    /// Parses the unpadded base64url form; `None` unless it is exactly 16 bytes.
    pub fn parse(s: &str) -> Option<Self> {
        let raw = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(s)
            .ok()?;
        let arr: [u8; 16] = raw.try_into().ok()?;
        Some(Nonce(arr))
    }
}

impl std::fmt::Display for Nonce {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(self.0))
    }
}

impl std::fmt::Debug for Nonce {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Nonce({self})")
    }
}

impl Serialize for Nonce {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Nonce {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Nonce::parse(&s).ok_or_else(|| {
            serde::de::Error::custom("nonce: expected 16 bytes in unpadded base64url")
        })
    }
}

/// The profile version this code writes and accepts (the `v` member).
pub const PROFILE_VERSION: u8 = 1;

/// Longest accepted A2A task id, in bytes.
pub const MAX_TASK_ID_LEN: usize = 256;

/// The risk a callee may take on the caller's behalf. Ordered:
/// `low < medium < high`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RiskLevel {
    /// Only actions that are easy to undo.
    Low,
    /// Actions with bounded, reviewable effects.
    Medium,
    /// Anything the capabilities allow.
    High,
}

/// Resource budgets of a delegation. Every member is explicit on the wire;
/// **zero means zero** (no tokens, no cost, no output), never unlimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Budgets {
    /// Model tokens the callee may spend.
    pub tokens: u64,
    /// Cost the callee may incur, in millionths of the billing currency unit.
    pub cost_micros: u64,
    /// The highest risk the callee may take.
    pub risk: RiskLevel,
    /// Bytes of output (result output plus artifacts) the callee may return.
    pub output_bytes: u64,
}

impl Budgets {
    /// The smaller of each member.
    pub fn min_each(&self, other: &Budgets) -> Budgets {
        Budgets {
            tokens: self.tokens.min(other.tokens),
            cost_micros: self.cost_micros.min(other.cost_micros),
            risk: self.risk.min(other.risk),
            output_bytes: self.output_bytes.min(other.output_bytes),
        }
    }

    /// The name of the first member of `self` that is above `limit`
    /// (`tokens`, `cost_micros`, `risk`, `output_bytes`), if any.
    pub fn first_excess(&self, limit: &Budgets) -> Option<&'static str> {
        if self.tokens > limit.tokens {
            Some("tokens")
        } else if self.cost_micros > limit.cost_micros {
            Some("cost_micros")
        } else if self.risk > limit.risk {
            Some("risk")
        } else if self.output_bytes > limit.output_bytes {
            Some("output_bytes")
        } else {
            None
        }
    }
}

/// The task itself.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Task {
    /// The instruction, in natural language.
    pub text: String,
    /// Free-form context for the callee. Must not hold credentials,
    /// environment or session handles ([`find_credential_field`]).
    #[serde(default)]
    pub context: Map<String, Value>,
    /// The caller's original A2A message, when the request came through the
    /// A2A facade. Checked for credential fields like `context`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub a2a_message: Option<Value>,
}

/// Where the delegation comes from on the caller's side (for tracing and
/// reconciliation; carries no authority).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ParentContext {
    /// The caller-side agent that asked for the delegation.
    pub agent: String,
    /// The caller's trace id.
    pub trace_id: String,
    /// The caller-side execution this delegation belongs to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub execution_id: Option<String>,
}

fn read_only_default() -> bool {
    true
}

/// What the caller signs (payload type [`REQUEST_TYPE`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DelegationRequest {
    /// Profile version, [`PROFILE_VERSION`].
    pub v: u8,
    /// The caller's idempotency key; equals the delegation key's request id.
    pub request_id: RequestId,
    /// The caller; equals the envelope's signer.
    pub caller: PeerId,
    /// The callee; equals the `Open`'s target.
    pub callee: PeerId,
    /// 16 random bytes, so the same bytes cannot start two delegations.
    pub nonce: Nonce,
    /// When the caller issued the request.
    pub issued_ms: u64,
    /// The task.
    pub task: Task,
    /// Capabilities requested (exact names, no wildcards), e.g. `read:repo`.
    pub capabilities: Vec<String>,
    /// Delegation depth; 1 for a direct delegation (the only depth allowed).
    pub depth: u8,
    /// Whether the callee must not change anything. Defaults to `true` when
    /// absent.
    #[serde(default = "read_only_default")]
    pub read_only: bool,
    /// Absolute deadline; equals the `Open` header's deadline.
    pub deadline_ms: u64,
    /// Resource budgets, all explicit.
    pub budgets: Budgets,
    /// Caller-side provenance.
    pub parent: ParentContext,
}

/// Who executed a delegation: the callee peer and the key it signed with.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Executor {
    /// The callee peer; equals the envelope's signer.
    pub peer: PeerId,
    /// The signing key; equals the envelope's key id.
    pub key_id: KeyId,
}

/// One output artifact. Exactly one of `text`, `data`, `url` is set.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Artifact {
    /// Unique within the task (A2A `artifactId`).
    pub artifact_id: String,
    /// Human-readable name.
    pub name: String,
    /// Media type, e.g. `text/markdown`.
    pub media_type: String,
    /// Text content.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
    /// Structured content.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<Value>,
    /// A reference to the content.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
}

/// One side effect the callee caused (provenance for reconciliation).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SideEffect {
    /// What kind of effect, e.g. `git_push`, `file_write`, `http_post`.
    pub kind: String,
    /// What it touched, e.g. a repository, path or URL.
    pub target: String,
    /// What happened, for a human.
    pub description: String,
}

/// What the callee consumed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Usage {
    /// Model tokens spent.
    pub tokens: u64,
    /// Cost incurred, in millionths of the billing currency unit.
    pub cost_micros: u64,
    /// Bytes of output returned.
    pub output_bytes: u64,
}

/// What the callee signs (payload type [`RESULT_TYPE`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DelegationResult {
    /// Profile version, [`PROFILE_VERSION`].
    pub v: u8,
    /// The request this answers.
    pub request_id: RequestId,
    /// The A2A task id, minted by the callee.
    pub task_id: String,
    /// The terminal outcome.
    pub outcome: Outcome,
    /// SHA-256 of the exact signed request payload bytes.
    pub request_digest: Digest,
    /// [`result_digest`] of `output` and `artifacts`.
    pub result_digest: Digest,
    /// Who executed it.
    pub executor: Executor,
    /// The capabilities the callee held (a subset of the requested ones).
    pub effective_capabilities: Vec<String>,
    /// Whether the callee ran read-only.
    pub read_only: bool,
    /// Output artifacts.
    pub artifacts: Vec<Artifact>,
    /// Side effects the callee caused.
    pub side_effects: Vec<SideEffect>,
    /// What the callee consumed.
    pub usage: Usage,
    /// When the callee started the work.
    pub started_ms: u64,
    /// When the callee finished the work.
    pub finished_ms: u64,
    /// The structured output, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output: Option<Value>,
    /// Why the work failed, if it did (a human-readable summary).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// Why a request or result was refused. [`ProfileError::code`] gives a
/// stable snake_case code.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProfileError {
    /// The envelope or the verified payload is not valid JSON of the
    /// expected shape (unknown members included).
    #[error("malformed: {0}")]
    Malformed(String),
    /// The envelope's payload type is not the expected one (e.g. a request
    /// presented as a result).
    #[error("payload type {got:?} where {expected:?} was expected")]
    WrongPayloadType {
        /// The expected type.
        expected: String,
        /// The envelope's type.
        got: String,
    },
    /// Signed by, or naming, another peer than the one that must sign.
    #[error("signed by {got}, expected {expected}")]
    WrongSigner {
        /// Who must sign.
        expected: String,
        /// Who signed or is named.
        got: String,
    },
    /// The signer is not a configured peer.
    #[error("signer {0} is not a configured peer")]
    UnknownSigner(String),
    /// The signer has no such key.
    #[error("signer {peer} has no key {key_id}")]
    UnknownKey {
        /// The signer.
        peer: String,
        /// The key id.
        key_id: String,
    },
    /// The signing key was outside its validity window.
    #[error("key {0} is outside its validity window")]
    KeyOutsideWindow(String),
    /// The signature does not verify (the payload was changed, or another
    /// key signed it).
    #[error("signature does not verify")]
    BadSignature,
    /// The payload's `v` is not [`PROFILE_VERSION`].
    #[error("profile version {0} is not supported (this version speaks {PROFILE_VERSION})")]
    UnsupportedVersion(u8),
    /// The request's deadline has passed.
    #[error("request deadline {deadline_ms} passed at {now_ms}")]
    ExpiredRequest {
        /// The request's deadline.
        deadline_ms: u64,
        /// Now.
        now_ms: u64,
    },
    /// The task carries a credential, environment or session field (the path
    /// names it, e.g. `task.context.db.password`).
    #[error("credential field in request: {0}")]
    CredentialField(String),
    /// The signed request id differs from the delegation key's.
    #[error("signed request id {signed} differs from the delegation's {expected}")]
    RequestIdMismatch {
        /// In the signed payload.
        signed: String,
        /// The delegation key's (or the expected) request id.
        expected: String,
    },
    /// The request names another callee than this peer.
    #[error("request is for {got}, this peer is {expected}")]
    WrongCallee {
        /// This peer.
        expected: String,
        /// The request's callee or the `Open`'s target.
        got: String,
    },
    /// The `Open` header disagrees with the signed request.
    #[error("open header {field} disagrees with the signed request")]
    HeaderMismatch {
        /// `deadline_ms`, `depth` or `digest`.
        field: &'static str,
    },
    /// The result answers another request (digest differs).
    #[error("result is bound to another request")]
    RequestDigestMismatch,
    /// The result digest does not match the output and artifacts.
    #[error("result digest does not match output and artifacts")]
    ResultDigestMismatch,
    /// The result's executor is not the envelope's signer.
    #[error("executor {field} differs from the envelope's signer")]
    ExecutorMismatch {
        /// `peer` or `key_id`.
        field: &'static str,
    },
    /// A member has an invalid value.
    #[error("{field}: {reason}")]
    InvalidField {
        /// The member.
        field: &'static str,
        /// What is wrong.
        reason: &'static str,
    },
    /// The result claims more than the request allowed.
    #[error("result exceeds the request: {field}")]
    ResultOutsideRequest {
        /// The member, e.g. `effective_capabilities` or `usage.tokens`.
        field: &'static str,
    },
}

impl ProfileError {
    /// Stable snake_case code for logs, audit records and refusals.
    pub fn code(&self) -> &'static str {
        match self {
            ProfileError::Malformed(_) => "malformed",
            ProfileError::WrongPayloadType { .. } => "wrong_payload_type",
            ProfileError::WrongSigner { .. } => "wrong_signer",
            ProfileError::UnknownSigner(_) => "unknown_signer",
            ProfileError::UnknownKey { .. } => "unknown_key",
            ProfileError::KeyOutsideWindow(_) => "key_outside_window",
            ProfileError::BadSignature => "bad_signature",
            ProfileError::UnsupportedVersion(_) => "unsupported_version",
            ProfileError::ExpiredRequest { .. } => "expired_request",
            ProfileError::CredentialField(_) => "credential_field",
            ProfileError::RequestIdMismatch { .. } => "request_id_mismatch",
            ProfileError::WrongCallee { .. } => "wrong_callee",
            ProfileError::HeaderMismatch { .. } => "header_mismatch",
            ProfileError::RequestDigestMismatch => "request_digest_mismatch",
            ProfileError::ResultDigestMismatch => "result_digest_mismatch",
            ProfileError::ExecutorMismatch { .. } => "executor_mismatch",
            ProfileError::InvalidField { .. } => "invalid_field",
            ProfileError::ResultOutsideRequest { .. } => "result_outside_request",
        }
    }
}

impl From<EnvelopeError> for ProfileError {
    fn from(e: EnvelopeError) -> Self {
        match e {
            EnvelopeError::Malformed(m) | EnvelopeError::Payload(m) => ProfileError::Malformed(m),
            EnvelopeError::WrongType { expected, got } => {
                ProfileError::WrongPayloadType { expected, got }
            }
            EnvelopeError::WrongSigner { expected, got } => {
                ProfileError::WrongSigner { expected, got }
            }
            EnvelopeError::UnknownSigner(p) => ProfileError::UnknownSigner(p),
            EnvelopeError::UnknownKey { peer, key_id } => ProfileError::UnknownKey { peer, key_id },
            EnvelopeError::KeyOutsideWindow(k) => ProfileError::KeyOutsideWindow(k),
            EnvelopeError::BadSignature => ProfileError::BadSignature,
        }
    }
}

/// Key names refused in `task.context` and `task.a2a_message`, written as
/// words. See [`find_credential_field`] for how keys are matched.
pub const CREDENTIAL_KEYS: &[&str] = &[
    "credentials",
    "credential",
    "password",
    "secret",
    "token",
    "api_key",
    "apikey",
    "authorization",
    "env",
    "environment",
    "session",
    "session_id",
    "cookie",
    "private_key",
];

/// Splits a key into lower-case words at `_`, `-`, `.`, spaces and
/// lower-to-upper camelCase boundaries: `apiKey` -> `[api, key]`,
/// `DB_PASSWORD` -> `[db, password]`.
fn key_words(key: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut cur = String::new();
    let mut prev_lower = false;
    for ch in key.chars() {
        if matches!(ch, '_' | '-' | '.' | ' ') {
            if !cur.is_empty() {
                words.push(std::mem::take(&mut cur));
            }
            prev_lower = false;
            continue;
        }
        if ch.is_uppercase() && prev_lower && !cur.is_empty() {
            words.push(std::mem::take(&mut cur));
        }
        prev_lower = ch.is_lowercase() || ch.is_ascii_digit();
        cur.extend(ch.to_lowercase());
    }
    if !cur.is_empty() {
        words.push(cur);
    }
    words
}

/// Whether a JSON object key names a credential, environment or session
/// handle: its words equal, or end with, the words of one of
/// [`CREDENTIAL_KEYS`]. A key splits into lower-case words at `_`, `-`, `.`,
/// spaces and lower-to-upper camelCase boundaries (`apiKey` is `api key`,
/// `DB_PASSWORD` is `db password`). So case and separators do not matter:
/// `Password`,
/// `api-key`, `apiKey`, `API_KEY`, `sessionId`, `github_token` and
/// `DB_PASSWORD` are refused, while `token_count`, `max_tokens` and
/// `sessions_total` are not.
pub fn is_credential_key(key: &str) -> bool {
    let words = key_words(key);
    CREDENTIAL_KEYS.iter().any(|name| {
        let name_words: Vec<&str> = name.split('_').collect();
        words.len() >= name_words.len()
            && words
                .iter()
                .skip(words.len() - name_words.len())
                .zip(&name_words)
                .all(|(w, n)| w == n)
    })
}

/// The path of the first object key anywhere in `value` (objects and arrays,
/// at any depth) that [`is_credential_key`], e.g. `task.context.db.password`
/// or `task.context.items[2].token`.
pub fn find_credential_field(root: &str, value: &Value) -> Option<String> {
    // Depth-first with an explicit stack, so hostile nesting cannot
    // exhaust the call stack.
    let mut stack: Vec<(String, &Value)> = vec![(root.to_string(), value)];
    while let Some((path, v)) = stack.pop() {
        match v {
            Value::Object(map) => {
                for (k, child) in map {
                    let child_path = format!("{path}.{k}");
                    if is_credential_key(k) {
                        return Some(child_path);
                    }
                    stack.push((child_path, child));
                }
            }
            Value::Array(items) => {
                for (i, child) in items.iter().enumerate() {
                    stack.push((format!("{path}[{i}]"), child));
                }
            }
            _ => {}
        }
    }
    None
}

impl DelegationRequest {
    /// Checks what the request says about itself: version, depth at least
    /// one, and no credential fields in the task. Called by
    /// [`verify_request`]; callers should call it before signing.
    pub fn validate(&self) -> Result<(), ProfileError> {
        if self.v != PROFILE_VERSION {
            return Err(ProfileError::UnsupportedVersion(self.v));
        }
        if self.depth == 0 {
            return Err(ProfileError::InvalidField {
                field: "depth",
                reason: "depth starts at 1",
            });
        }
        for (k, child) in &self.task.context {
            let path = format!("task.context.{k}");
            if is_credential_key(k) {
                return Err(ProfileError::CredentialField(path));
            }
            if let Some(found) = find_credential_field(&path, child) {
                return Err(ProfileError::CredentialField(found));
            }
        }
        if let Some(msg) = &self.task.a2a_message
            && let Some(found) = find_credential_field("task.a2a_message", msg)
        {
            return Err(ProfileError::CredentialField(found));
        }
        Ok(())
    }
}

/// The canonical JSON form of `value`: RFC 8785 (JCS), numbers included
/// (ECMAScript's shortest round-trip form, so `1.0` is `1` and `1e21` is
/// `1e+21`), as any JCS implementation writes it. No insignificant
/// whitespace; object members sorted by the UTF-16 code units of their
/// names; strings escaped minimally.
pub fn canonical_json(value: &Value) -> Vec<u8> {
    // A `serde_json::Value` holds only finite numbers, the one thing JCS
    // refuses; an error here would give a digest nothing matches (fail
    // closed), never a panic.
    serde_json_canonicalizer::to_vec(value).unwrap_or_default()
}

fn artifact_value(a: &Artifact) -> Value {
    let mut m = Map::new();
    m.insert("artifact_id".into(), Value::String(a.artifact_id.clone()));
    m.insert("name".into(), Value::String(a.name.clone()));
    m.insert("media_type".into(), Value::String(a.media_type.clone()));
    if let Some(t) = &a.text {
        m.insert("text".into(), Value::String(t.clone()));
    }
    if let Some(d) = &a.data {
        m.insert("data".into(), d.clone());
    }
    if let Some(u) = &a.url {
        m.insert("url".into(), Value::String(u.clone()));
    }
    Value::Object(m)
}

/// The result digest: SHA-256 of the canonical JSON ([`canonical_json`]) of
///
/// ```json
/// {"artifacts": [<artifact>, ...], "output": <output or null>}
/// ```
///
/// where each `<artifact>` is an object with the members `artifact_id`,
/// `name`, `media_type` and those of `text`, `data`, `url` that are set
/// (absent ones are omitted, never `null`), in the result's order.
pub fn result_digest(output: Option<&Value>, artifacts: &[Artifact]) -> Digest {
    let mut m = Map::new();
    m.insert(
        "artifacts".into(),
        Value::Array(artifacts.iter().map(artifact_value).collect()),
    );
    m.insert("output".into(), output.cloned().unwrap_or(Value::Null));
    Digest::of(&canonical_json(&Value::Object(m)))
}

impl DelegationResult {
    /// Sets the bindings a signer must set: `executor` from `identity` and
    /// `result_digest` from `output` and `artifacts`. Call it last, right
    /// before [`sign_result`].
    pub fn bind(&mut self, identity: &Identity) {
        self.executor = Executor {
            peer: identity.peer.clone(),
            key_id: identity.key_id.clone(),
        };
        self.result_digest = result_digest(self.output.as_ref(), &self.artifacts);
    }

    /// Checks what the result says about itself: version, task id, times,
    /// artifact content, and the result digest.
    pub fn validate(&self) -> Result<(), ProfileError> {
        if self.v != PROFILE_VERSION {
            return Err(ProfileError::UnsupportedVersion(self.v));
        }
        if self.task_id.is_empty() || self.task_id.len() > MAX_TASK_ID_LEN {
            return Err(ProfileError::InvalidField {
                field: "task_id",
                reason: "must be 1 to 256 bytes",
            });
        }
        if self.finished_ms < self.started_ms {
            return Err(ProfileError::InvalidField {
                field: "finished_ms",
                reason: "before started_ms",
            });
        }
        for a in &self.artifacts {
            let parts = usize::from(a.text.is_some())
                + usize::from(a.data.is_some())
                + usize::from(a.url.is_some());
            if parts != 1 {
                return Err(ProfileError::InvalidField {
                    field: "artifacts",
                    reason: "exactly one of text, data, url",
                });
            }
        }
        if self.result_digest != result_digest(self.output.as_ref(), &self.artifacts) {
            return Err(ProfileError::ResultDigestMismatch);
        }
        Ok(())
    }
}

fn to_payload<T: Serialize>(value: &T) -> Vec<u8> {
    // These types hold only string-keyed maps and finite numbers, so
    // serialization cannot fail. Were it ever to, the empty payload would
    // fail to parse at every verifier: the failure stays closed.
    serde_json::to_vec(value).unwrap_or_default()
}

/// Signs a request with the caller's key, over its JSON bytes. Call
/// [`DelegationRequest::validate`] first: a verifier refuses what it refuses.
pub fn sign_request(identity: &Identity, request: &DelegationRequest) -> Envelope {
    Envelope::sign(identity, REQUEST_TYPE, to_payload(request))
}

/// Signs a result with the callee's key, exactly as given. Call
/// [`DelegationResult::bind`] first to set `executor` and `result_digest`.
pub fn sign_result(identity: &Identity, result: &DelegationResult) -> Envelope {
    Envelope::sign(identity, RESULT_TYPE, to_payload(result))
}

#[derive(Deserialize)]
struct VersionProbe {
    v: u8,
}

/// Parses the verified bytes: the version first (so a newer version is
/// reported as such, not as unknown members), then the whole payload.
fn parse_versioned<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<T, ProfileError> {
    let probe: VersionProbe =
        serde_json::from_slice(bytes).map_err(|e| ProfileError::Malformed(e.to_string()))?;
    if probe.v != PROFILE_VERSION {
        return Err(ProfileError::UnsupportedVersion(probe.v));
    }
    serde_json::from_slice(bytes).map_err(|e| ProfileError::Malformed(e.to_string()))
}

/// Verifies a signed request and parses the same bytes.
///
/// Checks, in order: the envelope (type, signer == `expected_caller`, key
/// window at `now_ms`, signature); version; `request.caller` == signer;
/// [`DelegationRequest::validate`]; the deadline not passed. Returns the
/// request and the request digest (SHA-256 of the exact payload bytes).
///
/// This does not check the callee, the delegation key or replays: a callee
/// uses [`verify_open_request`] and then a [`crate::nonce::NonceCache`].
pub fn verify_request(
    envelope: &Envelope,
    expected_caller: &PeerId,
    trust: &dyn TrustStore,
    now_ms: u64,
) -> Result<(DelegationRequest, Digest), ProfileError> {
    let verified = envelope.verify(REQUEST_TYPE, expected_caller, trust, now_ms)?;
    let request: DelegationRequest = parse_versioned(verified.bytes())?;
    if &request.caller != verified.signer() {
        return Err(ProfileError::WrongSigner {
            expected: request.caller.to_string(),
            got: verified.signer().to_string(),
        });
    }
    request.validate()?;
    if request.deadline_ms <= now_ms {
        return Err(ProfileError::ExpiredRequest {
            deadline_ms: request.deadline_ms,
            now_ms,
        });
    }
    Ok((request, verified.digest()))
}

/// A request a callee verified against the `Open` that carried it.
#[derive(Debug, Clone)]
pub struct VerifiedRequest {
    /// The parsed request.
    pub request: DelegationRequest,
    /// SHA-256 of the exact signed payload bytes (the result's `request_digest`).
    pub request_digest: Digest,
    /// The key the caller signed with.
    pub key_id: KeyId,
    /// The envelope, kept for the audit trail and reconciliation.
    pub envelope: Envelope,
}

/// The callee's check of an incoming `Open`: parses the envelope from the
/// payload, then [`verify_request`] with the delegation key's caller, then
/// binds the signed request to the header: request id == `open.key`'s
/// ([`ProfileError::RequestIdMismatch`]), callee == target == `me`
/// ([`ProfileError::WrongCallee`]), deadline and depth equal to the header's
/// and the header digest equal to the payload's
/// ([`ProfileError::HeaderMismatch`]).
///
/// Next steps for the callee: [`crate::nonce::NonceCache::check`] with
/// `open.key`, then [`crate::authority::authorize_incoming`].
pub fn verify_open_request(
    open: &Open,
    me: &PeerId,
    trust: &dyn TrustStore,
    now_ms: u64,
) -> Result<VerifiedRequest, ProfileError> {
    if Digest::of(&open.payload) != open.digest {
        return Err(ProfileError::HeaderMismatch { field: "digest" });
    }
    if &open.target != me {
        return Err(ProfileError::WrongCallee {
            expected: me.to_string(),
            got: open.target.to_string(),
        });
    }
    let envelope = Envelope::from_json(&open.payload)?;
    let (request, request_digest) = verify_request(&envelope, &open.key.caller, trust, now_ms)?;
    check_request_id(&request, &open.key.request_id)?;
    if &request.callee != me {
        return Err(ProfileError::WrongCallee {
            expected: me.to_string(),
            got: request.callee.to_string(),
        });
    }
    if request.deadline_ms != open.deadline_ms {
        return Err(ProfileError::HeaderMismatch {
            field: "deadline_ms",
        });
    }
    if request.depth != open.depth {
        return Err(ProfileError::HeaderMismatch { field: "depth" });
    }
    let key_id = envelope.claimed_key_id().clone();
    Ok(VerifiedRequest {
        request,
        request_digest,
        key_id,
        envelope,
    })
}

/// Refuses a request whose signed request id is not `expected` (the
/// delegation key's).
pub fn check_request_id(
    request: &DelegationRequest,
    expected: &RequestId,
) -> Result<(), ProfileError> {
    if &request.request_id != expected {
        return Err(ProfileError::RequestIdMismatch {
            signed: request.request_id.to_string(),
            expected: expected.to_string(),
        });
    }
    Ok(())
}

/// Verifies a signed result and parses the same bytes.
///
/// Checks, in order: the envelope (type, signer == `expected_callee`, key
/// window at `at_ms`, signature); version; request id; request digest;
/// executor peer and key id == the envelope's signer and key id;
/// [`DelegationResult::validate`] (task id, times, artifacts, and the result
/// digest recomputed from output and artifacts).
pub fn verify_result(
    envelope: &Envelope,
    expected_callee: &PeerId,
    expected_request_digest: &Digest,
    expected_request_id: &RequestId,
    trust: &dyn TrustStore,
    at_ms: u64,
) -> Result<DelegationResult, ProfileError> {
    let verified = envelope.verify(RESULT_TYPE, expected_callee, trust, at_ms)?;
    let result: DelegationResult = parse_versioned(verified.bytes())?;
    if &result.request_id != expected_request_id {
        return Err(ProfileError::RequestIdMismatch {
            signed: result.request_id.to_string(),
            expected: expected_request_id.to_string(),
        });
    }
    if &result.request_digest != expected_request_digest {
        return Err(ProfileError::RequestDigestMismatch);
    }
    if &result.executor.peer != verified.signer() {
        return Err(ProfileError::ExecutorMismatch { field: "peer" });
    }
    if &result.executor.key_id != verified.key_id() {
        return Err(ProfileError::ExecutorMismatch { field: "key_id" });
    }
    result.validate()?;
    Ok(result)
}

/// The caller's check that a verified result stays inside what it asked
/// for: effective capabilities a subset of the requested ones, read-only
/// kept when requested, usage within every budget.
pub fn check_result_within_request(
    result: &DelegationResult,
    request: &DelegationRequest,
) -> Result<(), ProfileError> {
    let outside = |field| Err(ProfileError::ResultOutsideRequest { field });
    if result
        .effective_capabilities
        .iter()
        .any(|c| !request.capabilities.contains(c))
    {
        return outside("effective_capabilities");
    }
    if request.read_only && !result.read_only {
        return outside("read_only");
    }
    if result.usage.tokens > request.budgets.tokens {
        return outside("usage.tokens");
    }
    if result.usage.cost_micros > request.budgets.cost_micros {
        return outside("usage.cost_micros");
    }
    if result.usage.output_bytes > request.budgets.output_bytes {
        return outside("usage.output_bytes");
    }
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    use std::collections::HashMap;

    use base64::Engine as _;
    use base64::engine::general_purpose::STANDARD;
    use bytes::Bytes;
    use oab_wire::identity::PeerKey;
    use oab_wire::{DelegationKey, Digest};
    use serde_json::json;

    use super::*;

    pub(crate) const NOW: u64 = 1_800_000_000_000;

    /// One edit of a test table.
    type Edit<T> = Box<dyn Fn(&mut T)>;

    pub(crate) fn peer(s: &str) -> PeerId {
        PeerId::new(s).unwrap()
    }

    pub(crate) fn identity(p: &str, k: &str, seed: u8) -> Identity {
        Identity::from_secret(peer(p), KeyId::new(k).unwrap(), [seed; 32])
    }

    pub(crate) fn trust(ids: &[&Identity]) -> HashMap<PeerId, Vec<PeerKey>> {
        let mut t: HashMap<PeerId, Vec<PeerKey>> = HashMap::new();
        for id in ids {
            t.entry(id.peer.clone()).or_default().push(PeerKey {
                key_id: id.key_id.clone(),
                public_key: id.public_key(),
                not_before_ms: None,
                not_after_ms: None,
            });
        }
        t
    }

    pub(crate) fn budgets() -> Budgets {
        Budgets {
            tokens: 10_000,
            cost_micros: 500_000,
            risk: RiskLevel::Medium,
            output_bytes: 65_536,
        }
    }

    /// A valid request from `acme/a` to `acme/b`, issued at `now`.
    pub(crate) fn sample_request(now: u64) -> DelegationRequest {
        DelegationRequest {
            v: PROFILE_VERSION,
            request_id: RequestId::new("req-1").unwrap(),
            caller: peer("acme/a"),
            callee: peer("acme/b"),
            nonce: Nonce::random(),
            issued_ms: now,
            task: Task {
                text: "summarise the failing tests".into(),
                context: json!({"repo": "acme/app", "branch": "main"})
                    .as_object()
                    .cloned()
                    .unwrap(),
                a2a_message: None,
            },
            capabilities: vec!["read:repo".into(), "run:tests".into()],
            depth: 1,
            read_only: true,
            deadline_ms: now + 60_000,
            budgets: budgets(),
            parent: ParentContext {
                agent: "build-bot".into(),
                trace_id: "trace-1".into(),
                execution_id: None,
            },
        }
    }

    pub(crate) fn sample_result(
        request: &DelegationRequest,
        request_digest: Digest,
        callee: &Identity,
    ) -> DelegationResult {
        let mut r = DelegationResult {
            v: PROFILE_VERSION,
            request_id: request.request_id.clone(),
            task_id: "task-42".into(),
            outcome: Outcome::Completed,
            request_digest,
            result_digest: Digest::default(),
            executor: Executor {
                peer: callee.peer.clone(),
                key_id: callee.key_id.clone(),
            },
            effective_capabilities: request.capabilities.clone(),
            read_only: true,
            artifacts: vec![Artifact {
                artifact_id: "a1".into(),
                name: "report".into(),
                media_type: "text/markdown".into(),
                text: Some("3 tests fail".into()),
                data: None,
                url: None,
            }],
            side_effects: vec![SideEffect {
                kind: "file_read".into(),
                target: "acme/app".into(),
                description: "read the test logs".into(),
            }],
            usage: Usage {
                tokens: 1_200,
                cost_micros: 3_000,
                output_bytes: 12,
            },
            started_ms: NOW,
            finished_ms: NOW + 5_000,
            output: Some(json!({"failing": 3})),
            error: None,
        };
        r.bind(callee);
        r
    }

    struct Fixture {
        caller: Identity,
        callee: Identity,
        trust: HashMap<PeerId, Vec<PeerKey>>,
    }

    fn fixture() -> Fixture {
        let caller = identity("acme/a", "ka", 1);
        let callee = identity("acme/b", "kb", 2);
        let trust = trust(&[&caller, &callee]);
        Fixture {
            caller,
            callee,
            trust,
        }
    }

    /// Rewrites the payload of a signed envelope, keeping the signature.
    fn tamper(env: &Envelope, edit: impl FnOnce(&mut Value)) -> Envelope {
        let mut wire: Value = serde_json::from_slice(&env.to_json()).unwrap();
        let raw = STANDARD.decode(wire["payload"].as_str().unwrap()).unwrap();
        let mut payload: Value = serde_json::from_slice(&raw).unwrap();
        edit(&mut payload);
        wire["payload"] = Value::String(STANDARD.encode(serde_json::to_vec(&payload).unwrap()));
        Envelope::from_json(&serde_json::to_vec(&wire).unwrap()).unwrap()
    }

    #[test]
    fn request_round_trip_and_digest_covers_exact_bytes() {
        let f = fixture();
        let req = sample_request(NOW);
        req.validate().unwrap();
        let env = sign_request(&f.caller, &req);
        let (back, digest) = verify_request(&env, &f.caller.peer, &f.trust, NOW).unwrap();
        assert_eq!(back, req);
        assert_eq!(digest, env.payload_digest());
        assert_eq!(digest, Digest::of(&serde_json::to_vec(&req).unwrap()));
        // Through the JSON wire form too.
        let env2 = Envelope::from_json(&env.to_json()).unwrap();
        assert!(verify_request(&env2, &f.caller.peer, &f.trust, NOW).is_ok());
    }

    #[test]
    fn request_wire_form_is_snake_case_with_explicit_budgets() {
        let req = sample_request(NOW);
        let v: Value = serde_json::to_value(&req).unwrap();
        for member in [
            "v",
            "request_id",
            "caller",
            "callee",
            "nonce",
            "issued_ms",
            "task",
            "capabilities",
            "depth",
            "read_only",
            "deadline_ms",
            "budgets",
            "parent",
        ] {
            assert!(v.get(member).is_some(), "{member}");
        }
        assert_eq!(v["budgets"]["risk"], "medium");
        // A budget member missing on the wire is refused, never defaulted.
        let mut missing = v.clone();
        missing["budgets"].as_object_mut().unwrap().remove("tokens");
        assert!(serde_json::from_value::<DelegationRequest>(missing).is_err());
        // read_only defaults to true when absent.
        let mut no_ro = v.clone();
        no_ro.as_object_mut().unwrap().remove("read_only");
        assert!(
            serde_json::from_value::<DelegationRequest>(no_ro)
                .unwrap()
                .read_only
        );
        // Unknown members are refused at every level.
        for path in [&[][..], &["task"][..], &["budgets"][..], &["parent"][..]] {
            let mut extra = v.clone();
            let mut target = &mut extra;
            for p in path {
                target = target.get_mut(*p).unwrap();
            }
            target
                .as_object_mut()
                .unwrap()
                .insert("grant_all".into(), json!(true));
            assert!(
                serde_json::from_value::<DelegationRequest>(extra).is_err(),
                "{path:?}"
            );
        }
    }

    #[test]
    fn request_refusals() {
        let f = fixture();
        let other = identity("acme/c", "kc", 3);
        let trust_all = trust(&[&f.caller, &f.callee, &other]);
        type Case = (
            &'static str,
            Box<dyn Fn() -> (Envelope, PeerId, u64)>,
            &'static str,
        );
        let cases: Vec<Case> = vec![
            (
                "signed by someone else than the expected caller",
                Box::new(|| {
                    let req = sample_request(NOW);
                    (
                        sign_request(&identity("acme/c", "kc", 3), &req),
                        peer("acme/a"),
                        NOW,
                    )
                }),
                "wrong_signer",
            ),
            (
                "signer names another peer as caller",
                Box::new(|| {
                    let req = sample_request(NOW);
                    (
                        sign_request(&identity("acme/c", "kc", 3), &req),
                        peer("acme/c"),
                        NOW,
                    )
                }),
                "wrong_signer",
            ),
            (
                "deadline passed",
                Box::new(|| {
                    let req = sample_request(NOW);
                    let env = sign_request(&identity("acme/a", "ka", 1), &req);
                    (env, peer("acme/a"), req.deadline_ms)
                }),
                "expired_request",
            ),
            (
                "newer version",
                Box::new(|| {
                    let mut req = sample_request(NOW);
                    req.v = 2;
                    (
                        sign_request(&identity("acme/a", "ka", 1), &req),
                        peer("acme/a"),
                        NOW,
                    )
                }),
                "unsupported_version",
            ),
            (
                "depth zero",
                Box::new(|| {
                    let mut req = sample_request(NOW);
                    req.depth = 0;
                    (
                        sign_request(&identity("acme/a", "ka", 1), &req),
                        peer("acme/a"),
                        NOW,
                    )
                }),
                "invalid_field",
            ),
            (
                "unknown key id",
                Box::new(|| {
                    let req = sample_request(NOW);
                    (
                        sign_request(&identity("acme/a", "k-new", 1), &req),
                        peer("acme/a"),
                        NOW,
                    )
                }),
                "unknown_key",
            ),
            (
                "right key id, wrong secret",
                Box::new(|| {
                    let req = sample_request(NOW);
                    (
                        sign_request(&identity("acme/a", "ka", 9), &req),
                        peer("acme/a"),
                        NOW,
                    )
                }),
                "bad_signature",
            ),
            (
                "a result presented as a request",
                Box::new(|| {
                    let callee = identity("acme/b", "kb", 2);
                    let req = sample_request(NOW);
                    let res = sample_result(&req, Digest::of(b"r"), &callee);
                    (sign_result(&callee, &res), peer("acme/b"), NOW)
                }),
                "wrong_payload_type",
            ),
            (
                "payload changed under the signature",
                Box::new(|| {
                    let req = sample_request(NOW);
                    let env = sign_request(&identity("acme/a", "ka", 1), &req);
                    let env = tamper(&env, |p| p["capabilities"] = json!(["write:repo"]));
                    (env, peer("acme/a"), NOW)
                }),
                "bad_signature",
            ),
        ];
        for (name, make, code) in cases {
            let (env, expected, now) = make();
            let err = verify_request(&env, &expected, &trust_all, now).unwrap_err();
            assert_eq!(err.code(), code, "{name}: {err}");
        }
        // Unknown signer.
        let req = sample_request(NOW);
        let err =
            verify_request(&sign_request(&other, &req), &other.peer, &f.trust, NOW).unwrap_err();
        assert_eq!(err.code(), "unknown_signer");
    }

    #[test]
    fn credential_fields_are_refused_nested_too() {
        let f = fixture();
        let refused: &[(Value, &str)] = &[
            (json!({"password": "x"}), "task.context.password"),
            (json!({"Password": "x"}), "task.context.Password"),
            (json!({"API_KEY": "x"}), "task.context.API_KEY"),
            (json!({"apiKey": "x"}), "task.context.apiKey"),
            (json!({"api-key": "x"}), "task.context.api-key"),
            (json!({"apikey": "x"}), "task.context.apikey"),
            (json!({"credentials": {}}), "task.context.credentials"),
            (json!({"credential": "x"}), "task.context.credential"),
            (json!({"secret": "x"}), "task.context.secret"),
            (json!({"token": "x"}), "task.context.token"),
            (json!({"github_token": "x"}), "task.context.github_token"),
            (
                json!({"Authorization": "Bearer x"}),
                "task.context.Authorization",
            ),
            (json!({"env": {"HOME": "/"}}), "task.context.env"),
            (json!({"environment": "x"}), "task.context.environment"),
            (json!({"session": "x"}), "task.context.session"),
            (json!({"sessionId": "x"}), "task.context.sessionId"),
            (json!({"session_id": "x"}), "task.context.session_id"),
            (json!({"Cookie": "x"}), "task.context.Cookie"),
            (json!({"private_key": "x"}), "task.context.private_key"),
            (json!({"privateKey": "x"}), "task.context.privateKey"),
            (
                json!({"db": {"conn": {"DB_PASSWORD": "x"}}}),
                "task.context.db.conn.DB_PASSWORD",
            ),
            (
                json!({"items": [1, {"ok": 1}, {"token": "x"}]}),
                "task.context.items[2].token",
            ),
            (
                json!({"deep": [[{"a": {"secret": 1}}]]}),
                "task.context.deep[0][0].a.secret",
            ),
        ];
        for (context, path) in refused {
            let mut req = sample_request(NOW);
            req.task.context = context.as_object().cloned().unwrap();
            let err = req.validate().unwrap_err();
            assert_eq!(
                err,
                ProfileError::CredentialField((*path).into()),
                "{context}"
            );
            assert_eq!(err.code(), "credential_field");
            // And at the verifier, even when the caller signed it anyway.
            let env = sign_request(&f.caller, &req);
            let err = verify_request(&env, &f.caller.peer, &f.trust, NOW).unwrap_err();
            assert_eq!(err.code(), "credential_field");
        }
        // In the A2A message too (e.g. message metadata).
        let mut req = sample_request(NOW);
        req.task.a2a_message = Some(json!({
            "messageId": "m1", "role": "ROLE_USER", "parts": [{"text": "hi"}],
            "metadata": {"authorization": "Bearer x"}
        }));
        assert_eq!(
            req.validate().unwrap_err(),
            ProfileError::CredentialField("task.a2a_message.metadata.authorization".into())
        );
        // Keys that merely contain the words are fine.
        let mut req = sample_request(NOW);
        req.task.context = json!({
            "token_count": 3, "max_tokens": 5, "sessions_total": 1, "environmental_impact": "low",
            "secretary": "x", "keyboard": "us", "tokenizer": "bpe",
            "a2a": {"messageId": "m", "contextId": "c", "parts": [{"text": "password is not a key"}]}
        })
        .as_object()
        .cloned()
        .unwrap();
        req.validate().unwrap();
        for k in CREDENTIAL_KEYS {
            assert!(is_credential_key(k), "{k}");
        }
    }

    #[test]
    fn result_round_trip() {
        let f = fixture();
        let req = sample_request(NOW);
        let (_, rd) = verify_request(
            &sign_request(&f.caller, &req),
            &f.caller.peer,
            &f.trust,
            NOW,
        )
        .unwrap();
        let res = sample_result(&req, rd, &f.callee);
        let env = sign_result(&f.callee, &res);
        let env = Envelope::from_json(&env.to_json()).unwrap();
        let back =
            verify_result(&env, &f.callee.peer, &rd, &req.request_id, &f.trust, NOW).unwrap();
        assert_eq!(back, res);
        check_result_within_request(&back, &req).unwrap();
    }

    #[test]
    fn tampering_with_any_result_member_breaks_the_signature() {
        let f = fixture();
        let req = sample_request(NOW);
        let rd = Digest::of(b"request bytes");
        let env = sign_result(&f.callee, &sample_result(&req, rd, &f.callee));
        let edits: Vec<(&str, Edit<Value>)> = vec![
            ("outcome", Box::new(|p| p["outcome"] = json!("failed"))),
            ("task_id", Box::new(|p| p["task_id"] = json!("task-43"))),
            (
                "request_digest",
                Box::new(|p| p["request_digest"] = json!(Digest::of(b"x").to_string())),
            ),
            (
                "result_digest",
                Box::new(|p| p["result_digest"] = json!(Digest::of(b"y").to_string())),
            ),
            (
                "effective_capabilities",
                Box::new(|p| p["effective_capabilities"] = json!(["read:repo", "write:repo"])),
            ),
            ("read_only", Box::new(|p| p["read_only"] = json!(false))),
            ("usage", Box::new(|p| p["usage"]["tokens"] = json!(1))),
            (
                "artifacts",
                Box::new(|p| p["artifacts"][0]["text"] = json!("0 tests fail")),
            ),
            (
                "artifacts removed",
                Box::new(|p| p["artifacts"] = json!([])),
            ),
            ("side_effects", Box::new(|p| p["side_effects"] = json!([]))),
            (
                "executor key id",
                Box::new(|p| p["executor"]["key_id"] = json!("kx")),
            ),
            (
                "executor peer",
                Box::new(|p| p["executor"]["peer"] = json!("acme/c")),
            ),
            ("output", Box::new(|p| p["output"] = json!({"failing": 0}))),
            ("error", Box::new(|p| p["error"] = json!("boom"))),
            ("times", Box::new(|p| p["finished_ms"] = json!(NOW + 1))),
            ("request_id", Box::new(|p| p["request_id"] = json!("req-2"))),
        ];
        for (name, edit) in edits {
            let bad = tamper(&env, edit);
            let err = verify_result(&bad, &f.callee.peer, &rd, &req.request_id, &f.trust, NOW)
                .unwrap_err();
            assert_eq!(err, ProfileError::BadSignature, "{name}");
        }
        // The untouched envelope still verifies (the edits did not leak).
        assert!(verify_result(&env, &f.callee.peer, &rd, &req.request_id, &f.trust, NOW).is_ok());
    }

    #[test]
    fn re_signed_results_with_broken_bindings_are_refused() {
        let f = fixture();
        let req = sample_request(NOW);
        let rd = Digest::of(b"request bytes");
        let cases: Vec<(&str, Edit<DelegationResult>, &str)> = vec![
            (
                "executor key id",
                Box::new(|r| r.executor.key_id = KeyId::new("kx").unwrap()),
                "executor_mismatch",
            ),
            (
                "executor peer",
                Box::new(|r| r.executor.peer = peer("acme/c")),
                "executor_mismatch",
            ),
            (
                "result digest",
                Box::new(|r| r.result_digest = Digest::of(b"other")),
                "result_digest_mismatch",
            ),
            (
                "output changed after bind",
                Box::new(|r| r.output = Some(json!({"failing": 0}))),
                "result_digest_mismatch",
            ),
            (
                "artifact changed after bind",
                Box::new(|r| r.artifacts[0].name = "other".into()),
                "result_digest_mismatch",
            ),
            (
                "request digest",
                Box::new(|r| r.request_digest = Digest::of(b"another request")),
                "request_digest_mismatch",
            ),
            (
                "request id",
                Box::new(|r| r.request_id = RequestId::new("req-2").unwrap()),
                "request_id_mismatch",
            ),
            ("version", Box::new(|r| r.v = 2), "unsupported_version"),
            (
                "finished before started",
                Box::new(|r| r.finished_ms = r.started_ms - 1),
                "invalid_field",
            ),
            (
                "empty task id",
                Box::new(|r| {
                    r.task_id.clear();
                }),
                "invalid_field",
            ),
        ];
        for (name, edit, code) in cases {
            let mut res = sample_result(&req, rd, &f.callee);
            edit(&mut res);
            let env = sign_result(&f.callee, &res);
            let err = verify_result(&env, &f.callee.peer, &rd, &req.request_id, &f.trust, NOW)
                .unwrap_err();
            assert_eq!(err.code(), code, "{name}: {err}");
        }
        // An artifact with two contents is refused even when bound.
        let mut res = sample_result(&req, rd, &f.callee);
        res.artifacts[0].url = Some("https://example.invalid/r".into());
        res.bind(&f.callee);
        let env = sign_result(&f.callee, &res);
        let err =
            verify_result(&env, &f.callee.peer, &rd, &req.request_id, &f.trust, NOW).unwrap_err();
        assert_eq!(err.code(), "invalid_field");
    }

    #[test]
    fn results_signed_by_another_key_or_as_requests_fail() {
        let f = fixture();
        let other = identity("acme/c", "kc", 3);
        let rogue_b = identity("acme/b", "kb", 7); // right names, wrong secret
        let rotated_b = identity("acme/b", "kb2", 8); // untrusted key id
        let t = trust(&[&f.caller, &f.callee, &other]);
        let req = sample_request(NOW);
        let rd = Digest::of(b"request bytes");
        let verify = |env: &Envelope| {
            verify_result(env, &f.callee.peer, &rd, &req.request_id, &t, NOW)
                .unwrap_err()
                .code()
        };
        // Another trusted peer signs (its own executor fields bound).
        assert_eq!(
            verify(&sign_result(&other, &sample_result(&req, rd, &other))),
            "wrong_signer"
        );
        // Same peer and key id, wrong secret.
        let res = sample_result(&req, rd, &f.callee);
        assert_eq!(verify(&sign_result(&rogue_b, &res)), "bad_signature");
        // Same peer, a key id nobody configured.
        assert_eq!(
            verify(&sign_result(
                &rotated_b,
                &sample_result(&req, rd, &rotated_b)
            )),
            "unknown_key"
        );
        // A signed request presented as a result.
        let env = sign_request(&f.callee, &req);
        assert_eq!(verify(&env), "wrong_payload_type");
        // The right bytes, but signed under the request type by the callee.
        let raw = serde_json::to_vec(&res).unwrap();
        let env = Envelope::sign(&f.callee, REQUEST_TYPE, raw);
        assert_eq!(verify(&env), "wrong_payload_type");
        // A key outside its window.
        let mut expired = t.clone();
        for k in expired.get_mut(&f.callee.peer).unwrap() {
            k.not_after_ms = Some(NOW - 1);
        }
        let err = verify_result(
            &sign_result(&f.callee, &res),
            &f.callee.peer,
            &rd,
            &req.request_id,
            &expired,
            NOW,
        )
        .unwrap_err();
        assert_eq!(err.code(), "key_outside_window");
    }

    fn open_for(env: &Envelope, req: &DelegationRequest, key_req_id: &str) -> Open {
        let payload = Bytes::from(env.to_json());
        Open {
            key: DelegationKey::new(req.caller.clone(), RequestId::new(key_req_id).unwrap()),
            target: req.callee.clone(),
            deadline_ms: req.deadline_ms,
            depth: req.depth,
            digest: Digest::of(&payload),
            ceiling: String::new(),
            trace: None,
            payload,
        }
    }

    #[test]
    fn open_requests_are_bound_to_their_header() {
        let f = fixture();
        let me = f.callee.peer.clone();
        let req = sample_request(NOW);
        let env = sign_request(&f.caller, &req);
        let ok = open_for(&env, &req, "req-1");
        let v = verify_open_request(&ok, &me, &f.trust, NOW).unwrap();
        assert_eq!(v.request, req);
        assert_eq!(v.request_digest, env.payload_digest());
        assert_eq!(v.key_id, f.caller.key_id);

        let cases: Vec<(&str, Edit<Open>, &str)> = vec![
            (
                "same signed bytes under a new request id",
                Box::new(|o| o.key.request_id = RequestId::new("req-2").unwrap()),
                "request_id_mismatch",
            ),
            (
                "another caller in the key",
                Box::new(|o| o.key.caller = peer("acme/c")),
                "wrong_signer",
            ),
            (
                "deadline stretched",
                Box::new(|o| o.deadline_ms += 1),
                "header_mismatch",
            ),
            (
                "depth changed",
                Box::new(|o| o.depth = 2),
                "header_mismatch",
            ),
            (
                "digest not of the payload",
                Box::new(|o| o.digest = Digest::of(b"x")),
                "header_mismatch",
            ),
            (
                "routed to another callee",
                Box::new(|o| o.target = peer("acme/c")),
                "wrong_callee",
            ),
            (
                "payload not an envelope",
                Box::new(|o| {
                    o.payload = Bytes::from_static(b"{}");
                    o.digest = Digest::of(&o.payload);
                }),
                "malformed",
            ),
        ];
        for (name, edit, code) in cases {
            let mut open = ok.clone();
            edit(&mut open);
            let err = verify_open_request(&open, &me, &f.trust, NOW).unwrap_err();
            assert_eq!(err.code(), code, "{name}: {err}");
        }
        // A request signed for another callee, routed to us.
        let mut for_c = sample_request(NOW);
        for_c.callee = peer("acme/c");
        let env = sign_request(&f.caller, &for_c);
        let mut open = open_for(&env, &for_c, "req-1");
        open.target = me.clone();
        let err = verify_open_request(&open, &me, &f.trust, NOW).unwrap_err();
        assert_eq!(err.code(), "wrong_callee");
    }

    #[test]
    fn result_must_stay_within_the_request() {
        let f = fixture();
        let req = sample_request(NOW);
        let base = sample_result(&req, Digest::of(b"r"), &f.callee);
        check_result_within_request(&base, &req).unwrap();
        let cases: Vec<(&str, Edit<DelegationResult>)> = vec![
            (
                "effective_capabilities",
                Box::new(|r| r.effective_capabilities.push("write:repo".into())),
            ),
            ("read_only", Box::new(|r| r.read_only = false)),
            ("usage.tokens", Box::new(|r| r.usage.tokens = 10_001)),
            (
                "usage.cost_micros",
                Box::new(|r| r.usage.cost_micros = 500_001),
            ),
            (
                "usage.output_bytes",
                Box::new(|r| r.usage.output_bytes = 65_537),
            ),
        ];
        for (field, edit) in cases {
            let mut r = base.clone();
            edit(&mut r);
            assert_eq!(
                check_result_within_request(&r, &req),
                Err(ProfileError::ResultOutsideRequest { field }),
                "{field}"
            );
        }
    }

    #[test]
    fn canonical_json_and_result_digest_are_exactly_defined() {
        let v = json!({"b": 1, "a": [true, null, "x\"\\\n\u{1}é"], "A": {"z": 1.5, "y": -2}});
        assert_eq!(
            String::from_utf8(canonical_json(&v)).unwrap(),
            r#"{"A":{"y":-2,"z":1.5},"a":[true,null,"x\"\\\n\u0001é"],"b":1}"#
        );
        // Numbers as RFC 8785 writes them (ECMAScript form).
        let v = json!({"n": [1.0, 1e21, 0.1, -0.0, 100, 1.5e-7]});
        assert_eq!(
            String::from_utf8(canonical_json(&v)).unwrap(),
            r#"{"n":[1,1e+21,0.1,0,100,1.5e-7]}"#
        );
        // UTF-16 order: U+FFFD sorts after U+1F600's surrogates in UTF-16 (JCS).
        let v = json!({"\u{fffd}": 1, "\u{1f600}": 2});
        assert_eq!(
            String::from_utf8(canonical_json(&v)).unwrap(),
            "{\"\u{1f600}\":2,\"\u{fffd}\":1}"
        );
        let a = Artifact {
            artifact_id: "a1".into(),
            name: "n".into(),
            media_type: "text/plain".into(),
            text: Some("t".into()),
            data: None,
            url: None,
        };
        let expected = br#"{"artifacts":[{"artifact_id":"a1","media_type":"text/plain","name":"n","text":"t"}],"output":{"k":1}}"#;
        assert_eq!(
            result_digest(Some(&json!({"k": 1})), std::slice::from_ref(&a)),
            Digest::of(expected)
        );
        assert_eq!(
            result_digest(None, &[]),
            Digest::of(br#"{"artifacts":[],"output":null}"#)
        );
        // Member order of the output does not matter.
        let x: Value = serde_json::from_str(r#"{"p":1,"q":{"s":2,"r":3}}"#).unwrap();
        let y: Value = serde_json::from_str(r#"{"q":{"r":3,"s":2},"p":1}"#).unwrap();
        assert_eq!(result_digest(Some(&x), &[]), result_digest(Some(&y), &[]));
    }

    #[test]
    fn budgets_helpers() {
        let a = budgets();
        let mut b = a;
        b.tokens = 1;
        b.risk = RiskLevel::High;
        let m = a.min_each(&b);
        assert_eq!((m.tokens, m.risk), (1, RiskLevel::Medium));
        assert_eq!(a.first_excess(&a), None);
        assert_eq!(a.first_excess(&b), Some("tokens"));
        assert_eq!(b.first_excess(&a), Some("risk"));
        assert!(RiskLevel::Low < RiskLevel::Medium && RiskLevel::Medium < RiskLevel::High);
    }
}
