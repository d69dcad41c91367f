//! The `[openab]` section of `connector.toml`: the loopback address of the
//! CP-compatible endpoint, the runtimes allowed to register, the map from CP
//! targets to remote peers, and which remote peers may reach which local
//! workers.
//!
//! ```toml
//! [openab]
//! listen = "127.0.0.1:9800"
//!
//! [[openab.runtimes]]            # an OAB runtime allowed to register
//! namespace = "prod"
//! name = "koudu"
//! type = "primary"
//! key_file = "/etc/oab/cp-koudu.key"   # or key_env = "OAB_CP_KEY_KOUDU"
//!
//! [[openab.targets]]             # caller side: CP target -> remote peer
//! name = "reviewer"              # or labels = { role = "review" }
//! peer = "acme/build-bot"
//! remote = { name = "reviewer" } # the target on the peer's side
//! capabilities = ["read:repo"]
//!
//! [[openab.serve]]               # callee side: who may reach which worker
//! peer = "acme/caller"
//! workers = ["prod/reviewer"]
//! ```
//!
//! Never: holds a bearer key. It names the file or the environment
//! variable; [`crate::openab::RuntimeKeys::load`] reads them at start.

use std::collections::{BTreeMap, HashSet};
use std::net::SocketAddr;
use std::path::PathBuf;

use oab_wire::PeerId;
use serde::{Deserialize, Serialize};

use super::proto::{AgentType, TargetSelector};

/// `[openab]`. Every bound is a field here with its default and its
/// overflow policy.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OpenAbSection {
    /// Loopback address of the CP endpoint (`ws://<listen>/`, any path).
    /// Unset: no endpoint.
    #[serde(default)]
    pub listen: Option<SocketAddr>,
    /// Heartbeat interval told to runtimes at registration, s (OAB CP: 15).
    #[serde(default = "default_heartbeat")]
    pub heartbeat_interval_secs: u64,
    /// A registration without a heartbeat for this long is closed (1008
    /// "lease expired"); its served delegations end target_disconnected.
    /// s (OAB CP: 45).
    #[serde(default = "default_lease")]
    pub lease_expiry_secs: u64,
    /// Time from the upgrade to `cp/register`; past it the connection is
    /// closed (1008 "registration timeout"). s (OAB CP: 10).
    #[serde(default = "default_register_timeout")]
    pub register_timeout_secs: u64,
    /// Time from accept to a completed WebSocket upgrade (the request
    /// headers and a known bearer key); past it the TCP connection is
    /// closed without an answer. A connection holds none of
    /// `max_connections` until its upgrade is done, ms.
    #[serde(default = "default_upgrade_timeout")]
    pub upgrade_timeout_ms: u64,
    /// How long `cp/delegate` waits for the remote side to accept or refuse
    /// before it answers; a refusal within it is a JSON-RPC error (NO_TARGET,
    /// SATURATED, POLICY_DENIED), past it the delegation is acknowledged and
    /// its end comes as `cp/delegate_result`. ms.
    #[serde(default = "default_admission_wait")]
    pub admission_wait_ms: u64,
    /// Longest deadline a `cp/delegate` may carry, s (OAB CP: 1800); longer
    /// is POLICY_DENIED.
    #[serde(default = "default_max_deadline")]
    pub max_deadline_secs: u64,
    /// Result text cap, bytes (OAB CP: 256 KiB): a longer result is cut
    /// with a marker inside the cap, as the CP does.
    #[serde(default = "default_max_result")]
    pub max_result_bytes: usize,
    /// `cp/delegate.prompt` cap, bytes (OAB CP: 256 KiB); longer is
    /// INVALID_PARAMS.
    #[serde(default = "default_max_prompt")]
    pub max_prompt_bytes: usize,
    /// Largest WebSocket message read from a runtime, bytes (OAB CP:
    /// 1 MiB); a larger one closes that connection.
    #[serde(default = "default_max_frame")]
    pub max_frame_bytes: usize,
    /// Upgraded connections at once (registered or not), and, separately,
    /// connections waiting for their upgrade. An upgrade over it is refused
    /// with HTTP 503 naming the limit (as the CP refuses an over-quota
    /// upgrade); a new TCP connection when as many wait for their upgrade
    /// closes the one that has waited longest, so silent connections
    /// cannot keep runtimes out.
    #[serde(default = "default_max_connections")]
    pub max_connections: usize,
    /// Connections one identity (`namespace/name`) may hold at once,
    /// counted from the upgrade to the connection's end, registered or not
    /// (OAB CP: `max_connections_per_identity`, 8). An upgrade over it is
    /// refused with HTTP 503 "identity is at its connection quota
    /// (max_connections_per_identity = N)", as on the CP.
    #[serde(default = "default_max_connections_per_identity")]
    pub max_connections_per_identity: usize,
    /// Frames queued towards one runtime. Full: back-pressure (the endpoint
    /// stops reading that runtime's frames, delegation tasks wait for
    /// room), never a disconnect for having many in flight (the CP as
    /// shipped disconnects); a runtime whose single write stalls past
    /// `server::WRITE_TIMEOUT` is closed.
    #[serde(default = "default_outbound_queue")]
    pub outbound_queue: usize,
    /// Delegations started by local primaries and not yet ended, all
    /// runtimes together; beyond it `cp/delegate` is SATURATED.
    #[serde(default = "default_max_delegations")]
    pub max_delegations: usize,
    /// No longer used (results are not kept for a primary that left: its
    /// delegations are cancelled, as on the CP). Accepted so that a
    /// configuration written for an earlier version still loads; a warning
    /// says it is ignored.
    #[serde(default)]
    pub result_retention_secs: Option<u64>,
    /// The runtimes allowed to register.
    #[serde(default)]
    pub runtimes: Vec<OpenAbRuntime>,
    /// Caller side: CP targets mapped to remote peers.
    #[serde(default)]
    pub targets: Vec<OpenAbTarget>,
    /// Callee side: which remote peers may reach which local workers.
    #[serde(default)]
    pub serve: Vec<OpenAbServe>,
    /// Delegation policy per namespace (openab-cp's `[namespaces.<ns>]`);
    /// a namespace not listed has the defaults: depth one, workers do not
    /// initiate.
    #[serde(default)]
    pub namespaces: BTreeMap<String, NamespacePolicy>,
}

/// `[openab.namespaces.<ns>]`: how deep delegations started by this
/// namespace's runtimes may go, and whether its workers may start any
/// (openab-cp's names and defaults).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NamespacePolicy {
    /// Deepest delegation a runtime of the namespace may start: 1 is
    /// primary -> worker only; 2 lets a worker name the delegation it
    /// serves as parent. At most `[policy] max_depth`, since every
    /// delegation this endpoint starts crosses the relay at its depth.
    #[serde(default = "default_ns_max_depth")]
    pub max_depth: u8,
    /// Whether the namespace's workers may start delegations (the depth
    /// still applies).
    #[serde(default)]
    pub allow_worker_initiation: bool,
}

fn default_ns_max_depth() -> u8 {
    1
}

impl Default for NamespacePolicy {
    fn default() -> Self {
        NamespacePolicy {
            max_depth: default_ns_max_depth(),
            allow_worker_initiation: false,
        }
    }
}

fn default_heartbeat() -> u64 {
    15
}
fn default_lease() -> u64 {
    45
}
fn default_register_timeout() -> u64 {
    10
}
/// A runtime on the same host sends its upgrade request at once; 5 s is
/// far beyond a loaded host's scheduling delay.
fn default_upgrade_timeout() -> u64 {
    5_000
}
fn default_admission_wait() -> u64 {
    5_000
}
fn default_max_deadline() -> u64 {
    1_800
}
fn default_max_result() -> usize {
    256 * 1024
}
fn default_max_prompt() -> usize {
    256 * 1024
}
fn default_max_frame() -> usize {
    1024 * 1024
}
fn default_max_connections() -> usize {
    64
}
fn default_max_connections_per_identity() -> usize {
    8
}
fn default_outbound_queue() -> usize {
    256
}
fn default_max_delegations() -> usize {
    1024
}

impl Default for OpenAbSection {
    fn default() -> Self {
        OpenAbSection {
            listen: None,
            heartbeat_interval_secs: default_heartbeat(),
            lease_expiry_secs: default_lease(),
            register_timeout_secs: default_register_timeout(),
            upgrade_timeout_ms: default_upgrade_timeout(),
            admission_wait_ms: default_admission_wait(),
            max_deadline_secs: default_max_deadline(),
            max_result_bytes: default_max_result(),
            max_prompt_bytes: default_max_prompt(),
            max_frame_bytes: default_max_frame(),
            max_connections: default_max_connections(),
            max_connections_per_identity: default_max_connections_per_identity(),
            outbound_queue: default_outbound_queue(),
            max_delegations: default_max_delegations(),
            result_retention_secs: None,
            runtimes: Vec::new(),
            targets: Vec::new(),
            serve: Vec::new(),
            namespaces: BTreeMap::new(),
        }
    }
}

/// `[[openab.runtimes]]`: one identity a bearer key is bound to.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OpenAbRuntime {
    /// Namespace the runtime must claim.
    pub namespace: String,
    /// Name the runtime must claim.
    pub name: String,
    /// Role the runtime must claim.
    #[serde(rename = "type")]
    pub agent_type: AgentType,
    /// A file (mode 0600) holding the bearer key.
    #[serde(default)]
    pub key_file: Option<PathBuf>,
    /// An environment variable holding the bearer key.
    #[serde(default)]
    pub key_env: Option<String>,
    /// Clamp on the worker's advertised `max_delegated_sessions`.
    #[serde(default)]
    pub max_delegated_sessions_cap: Option<u32>,
}

impl OpenAbRuntime {
    /// `namespace/name`.
    pub fn logical_id(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }
}

/// `[[openab.targets]]`: a CP target a primary may name, and where it goes.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OpenAbTarget {
    /// The target name a primary's selector names.
    #[serde(default)]
    pub name: Option<String>,
    /// The labels this target has (a label selector matches when all its
    /// pairs are here).
    #[serde(default)]
    pub labels: Option<BTreeMap<String, String>>,
    /// The remote peer that serves it.
    pub peer: PeerId,
    /// The target on the remote peer's endpoint.
    pub remote: TargetSelector,
    /// Capabilities requested for these delegations.
    #[serde(default)]
    pub capabilities: Vec<String>,
    /// Whether the remote side must not change anything.
    #[serde(default = "yes")]
    pub read_only: bool,
    /// Delegations this endpoint sends to this target at once; beyond it
    /// `cp/delegate` is SATURATED (never queued). `cp/list_agents` reports
    /// it as the target's `max_delegated_sessions`. Unset: no bound of its
    /// own (`max_delegations` applies, and is what is reported).
    #[serde(default)]
    pub max_delegated_sessions: Option<u32>,
}

fn yes() -> bool {
    true
}

impl OpenAbTarget {
    /// Whether a primary's selector names this target.
    pub fn matches(&self, selector: &TargetSelector) -> bool {
        match (&selector.name, &selector.labels) {
            (Some(n), None) => self.name.as_ref() == Some(n),
            (None, Some(want)) => self
                .labels
                .as_ref()
                .is_some_and(|have| want.iter().all(|(k, v)| have.get(k) == Some(v))),
            _ => false,
        }
    }
}

/// `[[openab.serve]]`: a remote peer and the local workers it may reach.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OpenAbServe {
    /// The calling peer.
    pub peer: PeerId,
    /// Local workers (`namespace/name`) its delegations may be served by.
    pub workers: Vec<String>,
}

impl OpenAbSection {
    /// The policy of `namespace` (the defaults when it is not listed).
    pub fn policy_for(&self, namespace: &str) -> NamespacePolicy {
        self.namespaces.get(namespace).copied().unwrap_or_default()
    }

    /// Namespaces that allow deeper delegations than `policy_max_depth`
    /// (`[policy] max_depth`) would let through: refused at load rather
    /// than promised and then refused at each delegation.
    pub fn depth_problems(&self, policy_max_depth: u8) -> Vec<String> {
        self.namespaces
            .iter()
            .filter(|(_, p)| p.max_depth > policy_max_depth)
            .map(|(ns, p)| {
                format!(
                    "openab.namespaces.{ns}.max_depth: {} is deeper than policy.max_depth ({policy_max_depth}); \
                     a delegation deeper than [policy] allows is refused before it is sent. Raise \
                     policy.max_depth here (and the relay route's max_depth, and the callee's \
                     policy.max_depth), or lower this",
                    p.max_depth
                )
            })
            .collect()
    }

    /// Whether this host serves remote delegations through the endpoint.
    pub fn serves(&self) -> bool {
        self.listen.is_some() && !self.serve.is_empty()
    }

    /// Every problem, each naming its field.
    pub fn validate(&self) -> Vec<String> {
        let mut errors = Vec::new();
        if let Some(addr) = self.listen
            && !addr.ip().is_loopback()
        {
            errors.push(format!(
                "openab.listen: {addr} is not a loopback address; the endpoint carries bearer keys without TLS"
            ));
        }
        if self.lease_expiry_secs <= self.heartbeat_interval_secs {
            errors.push(
                "openab.lease_expiry_secs: must be greater than heartbeat_interval_secs".into(),
            );
        }
        if self.heartbeat_interval_secs == 0 {
            errors.push("openab.heartbeat_interval_secs: must be greater than 0".into());
        }
        for (field, v) in [
            ("register_timeout_secs", self.register_timeout_secs),
            ("upgrade_timeout_ms", self.upgrade_timeout_ms),
            ("max_deadline_secs", self.max_deadline_secs),
        ] {
            if v == 0 {
                errors.push(format!("openab.{field}: must be greater than 0"));
            }
        }
        for (field, v) in [
            ("max_result_bytes", self.max_result_bytes),
            ("max_prompt_bytes", self.max_prompt_bytes),
            ("max_frame_bytes", self.max_frame_bytes),
            ("max_connections", self.max_connections),
            (
                "max_connections_per_identity",
                self.max_connections_per_identity,
            ),
            ("outbound_queue", self.outbound_queue),
            ("max_delegations", self.max_delegations),
        ] {
            if v == 0 {
                errors.push(format!("openab.{field}: must be greater than 0"));
            }
        }
        if self.max_result_bytes < 128 {
            errors.push("openab.max_result_bytes: must be at least 128 (the cut marker)".into());
        }
        let mut ids = HashSet::new();
        for (i, r) in self.runtimes.iter().enumerate() {
            for (field, v) in [("namespace", &r.namespace), ("name", &r.name)] {
                if v.is_empty() || v.contains('/') || v.chars().any(char::is_whitespace) {
                    errors.push(format!(
                        "openab.runtimes[{i}].{field}: must be non-empty, without '/' or spaces"
                    ));
                }
            }
            if !ids.insert(r.logical_id()) {
                errors.push(format!(
                    "openab.runtimes[{i}]: {} is listed twice (replicas share one identity)",
                    r.logical_id()
                ));
            }
            if r.key_file.is_some() == r.key_env.is_some() {
                errors.push(format!(
                    "openab.runtimes[{i}]: set exactly one of key_file and key_env"
                ));
            }
            if r.max_delegated_sessions_cap == Some(0) {
                errors.push(format!(
                    "openab.runtimes[{i}].max_delegated_sessions_cap: must be greater than 0"
                ));
            }
        }
        for (i, t) in self.targets.iter().enumerate() {
            if t.max_delegated_sessions == Some(0) {
                errors.push(format!(
                    "openab.targets[{i}].max_delegated_sessions: must be greater than 0"
                ));
            }
            if t.name.is_some() == t.labels.is_some() {
                errors.push(format!(
                    "openab.targets[{i}]: set exactly one of name and labels"
                ));
            }
            if !t.remote.is_valid() {
                errors.push(format!(
                    "openab.targets[{i}].remote: set exactly one of name and labels"
                ));
            }
        }
        for (ns, p) in &self.namespaces {
            let max = crate::authority::MAX_DEPTH;
            if p.max_depth == 0 || p.max_depth > max {
                errors.push(format!(
                    "openab.namespaces.{ns}.max_depth: must be 1 to {max}"
                ));
            }
        }
        for (i, s) in self.serve.iter().enumerate() {
            if s.workers.is_empty() {
                errors.push(format!("openab.serve[{i}].workers: list at least one"));
            }
            for (j, w) in s.workers.iter().enumerate() {
                if !ids.contains(w) {
                    errors.push(format!(
                        "openab.serve[{i}].workers[{j}]: {w} is not one of openab.runtimes"
                    ));
                }
            }
        }
        if self.listen.is_none()
            && (!self.runtimes.is_empty() || !self.targets.is_empty() || !self.serve.is_empty())
        {
            errors.push("openab.listen: required when runtimes, targets or serve are set".into());
        }
        errors
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn parse(text: &str) -> OpenAbSection {
        toml::from_str(text).unwrap()
    }

    #[test]
    fn defaults_are_the_cps() {
        let s = OpenAbSection::default();
        assert_eq!(
            (
                s.heartbeat_interval_secs,
                s.lease_expiry_secs,
                s.register_timeout_secs
            ),
            (15, 45, 10)
        );
        assert_eq!(s.max_result_bytes, 256 * 1024);
        assert!(s.validate().is_empty());
    }

    #[test]
    fn every_bad_field_is_named() {
        let s = parse(
            r#"
listen = "0.0.0.0:9800"
heartbeat_interval_secs = 30
lease_expiry_secs = 30
max_delegations = 0
max_connections_per_identity = 0

[[runtimes]]
namespace = "prod"
name = "koudu"
type = "primary"

[[targets]]
peer = "acme/b"
remote = { name = "w" }
max_delegated_sessions = 0

[[serve]]
peer = "acme/a"
workers = ["prod/nobody"]
"#,
        );
        let errors = s.validate().join("\n");
        for field in [
            "openab.listen",
            "openab.lease_expiry_secs",
            "openab.max_delegations",
            "openab.max_connections_per_identity",
            "openab.targets[0].max_delegated_sessions",
            "openab.runtimes[0]: set exactly one of key_file and key_env",
            "openab.targets[0]: set exactly one of name and labels",
            "openab.serve[0].workers[0]",
        ] {
            assert!(errors.contains(field), "{field} missing from:\n{errors}");
        }
    }

    #[test]
    fn namespace_policies_default_to_depth_one_and_no_worker_initiation() {
        let s = parse(
            r#"
[namespaces.prod]
max_depth = 2
allow_worker_initiation = true

[namespaces.dev]

[namespaces.bad]
max_depth = 0
"#,
        );
        assert_eq!(s.policy_for("other"), NamespacePolicy::default());
        assert_eq!(s.policy_for("dev"), NamespacePolicy::default());
        assert_eq!(
            s.policy_for("prod"),
            NamespacePolicy {
                max_depth: 2,
                allow_worker_initiation: true
            }
        );
        let errors = s.validate().join("\n");
        assert!(
            errors.contains("openab.namespaces.bad.max_depth: must be 1 to 8"),
            "{errors}"
        );
        // Deeper than [policy] lets through: refused at load, naming both.
        let problems = s.depth_problems(1);
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(
            problems[0].starts_with(
                "openab.namespaces.prod.max_depth: 2 is deeper than policy.max_depth (1)"
            ),
            "{problems:?}"
        );
        assert!(s.depth_problems(2).is_empty());
        assert!(
            toml::from_str::<OpenAbSection>("[namespaces.prod]\nmax_dept = 2").is_err(),
            "unknown namespace fields are refused"
        );
    }

    #[test]
    fn unknown_fields_are_refused() {
        assert!(toml::from_str::<OpenAbSection>("listn = \"127.0.0.1:1\"").is_err());
        assert!(
            toml::from_str::<OpenAbSection>(
                "[[runtimes]]\nnamespace=\"a\"\nname=\"b\"\ntype=\"primary\"\nkey=\"inline\""
            )
            .is_err(),
            "a key cannot be written inline"
        );
    }

    #[test]
    fn targets_match_by_name_or_labels() {
        let t = parse(
            r#"
[[targets]]
labels = { role = "review", tier = "1" }
peer = "acme/b"
remote = { name = "w" }
"#,
        );
        let t = &t.targets[0];
        let sel = |pairs: &[(&str, &str)]| TargetSelector {
            name: None,
            labels: Some(
                pairs
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
            ),
        };
        assert!(t.matches(&sel(&[("role", "review")])));
        assert!(!t.matches(&sel(&[("role", "build")])));
        assert!(!t.matches(&TargetSelector {
            name: Some("w".into()),
            labels: None
        }));
    }
}
