//! The OpenAB control-plane (CP) wire protocol, as the endpoint speaks it:
//! JSON-RPC 2.0, one message per WebSocket text frame, `cp/*` methods.
//!
//! Written from the protocol described in `docs/openab.md` (which names
//! every frame, field and error code): the method names, the error codes
//! and the status names are OpenAB's, so an unmodified OAB runtime talks to
//! this endpoint as to its own control plane.
//!
//! Never: reads more than one message from a frame, or answers a frame that
//! did not parse with anything but a JSON-RPC error.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

/// The only CP protocol version (`cp/register.protocol_version`).
pub const PROTOCOL_VERSION: u32 = 1;

/// The CP's JSON-RPC error codes.
pub mod codes {
    /// A frame before a successful `cp/register` on the connection.
    pub const NOT_REGISTERED: i64 = -32001;
    /// The registration's claims are not the identity bound to the key.
    pub const IDENTITY_MISMATCH: i64 = -32002;
    /// Refused by policy (initiator role, depth, deadline, remote policy).
    pub const POLICY_DENIED: i64 = -32003;
    /// No target matches the selector.
    pub const NO_TARGET: i64 = -32004;
    /// Matching targets exist and all are at capacity (never queued).
    pub const SATURATED: i64 = -32005;
    /// The serving side went away while the delegation was being routed.
    pub const TARGET_DISCONNECTED: i64 = -32007;
    /// The `delegation_id` is already in flight for this runtime.
    pub const DUPLICATE_DELEGATION: i64 = -32008;
    /// `cp/register` carried a protocol version other than 1.
    pub const UNSUPPORTED_VERSION: i64 = -32009;
    /// The envelope is not a JSON-RPC 2.0 request.
    pub const INVALID_REQUEST: i64 = -32600;
    /// Unknown method.
    pub const METHOD_NOT_FOUND: i64 = -32601;
    /// Malformed params.
    pub const INVALID_PARAMS: i64 = -32602;
}

/// The CP's method names.
pub mod methods {
    /// First frame of every connection.
    pub const REGISTER: &str = "cp/register";
    /// Lease renewal.
    pub const HEARTBEAT: &str = "cp/heartbeat";
    /// Start a delegation (runtime -> CP), or serve one (CP -> worker).
    pub const DELEGATE: &str = "cp/delegate";
    /// A delegation's end (worker -> CP, CP -> initiator).
    pub const DELEGATE_RESULT: &str = "cp/delegate_result";
    /// Abort a delegation (initiator -> CP, CP -> worker).
    pub const CANCEL: &str = "cp/cancel";
    /// What a runtime may target: the registered runtimes of its namespace
    /// and the remote targets (any registered runtime may ask).
    pub const LIST_AGENTS: &str = "cp/list_agents";
}

/// The CP's error texts, word for word, for the refusals whose cause is the
/// same here (the code alone would do for a program; an operator reading a
/// runtime's log sees the same sentence as with `openab-cp`).
pub mod texts {
    /// NO_TARGET: nothing matches the selector.
    pub const NO_TARGET: &str = "no registered healthy runtime matches the target selector";
    /// SATURATED: every match is at its capacity.
    pub const SATURATED: &str =
        "all matching runtimes are at capacity (CP does not queue; retry later)";
    /// POLICY_DENIED: the deadline has passed.
    pub const DEADLINE_PAST: &str = "deadline is in the past";

    /// POLICY_DENIED: the deadline is further than `max_deadline_secs`.
    pub fn deadline_too_long(max_secs: u64) -> String {
        format!("deadline exceeds the CP cap of {max_secs}s")
    }

    /// SATURATED: `max_delegations` are in flight.
    pub fn inflight_limit(max: usize) -> String {
        format!(
            "control plane is at its global in-flight limit (max_delegations = {max}); retry later"
        )
    }

    /// DUPLICATE_DELEGATION: the id is in flight.
    pub fn duplicate(delegation_id: &str) -> String {
        format!("delegation {delegation_id} is already in flight")
    }

    /// POLICY_DENIED: a worker initiating where its namespace does not
    /// allow it.
    pub const WORKER_INITIATION: &str = "workers may not initiate delegations in this namespace";

    /// POLICY_DENIED: the new delegation would be deeper than the
    /// namespace's `max_depth`.
    pub fn depth_exceeded(would_be: u32, max: u8) -> String {
        format!("delegation depth {would_be} exceeds namespace max_depth {max}")
    }

    /// POLICY_DENIED: a child asking for more than its parent holds (not
    /// a CP text: openab-cp has no capabilities).
    pub fn beyond_parent(what: &[&str]) -> String {
        format!(
            "the target asks for more than the parent delegation holds: {}",
            what.join(", ")
        )
    }

    /// POLICY_DENIED: a child's deadline after its parent's.
    pub const DEADLINE_EXCEEDS_PARENT: &str =
        "child deadline exceeds the parent's remaining budget";

    /// INVALID_PARAMS: the named parent is not a delegation this
    /// connection serves under that admission (unknown, another's, or
    /// stale: one answer for all).
    pub fn parent_not_in_flight(parent: &str) -> String {
        format!("parent delegation {parent} is not in flight for this instance")
    }

    /// INVALID_PARAMS: a parent id without its admission.
    pub const PARENT_ID_WITHOUT_ADMISSION: &str = "parent_delegation_id requires parent_admission: name the \
         admission token this instance was forwarded for that parent \
         (a delegation id alone is reusable and cannot identify it)";

    /// INVALID_PARAMS: a parent admission without its id.
    pub const PARENT_ADMISSION_WITHOUT_ID: &str = "parent_admission is meaningless without parent_delegation_id: \
         omit both for a root delegation, or send both";
}

/// Any incoming message; requests, responses and errors differ by fields.
#[derive(Debug, Deserialize)]
pub struct Incoming {
    /// Must be `"2.0"` on a request.
    pub jsonrpc: Option<String>,
    /// Request id (the CP's ids are unsigned integers).
    pub id: Option<u64>,
    /// Method (absent on responses).
    pub method: Option<String>,
    /// Params.
    pub params: Option<Value>,
}

/// A JSON-RPC error object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RpcError {
    /// One of [`codes`].
    pub code: i64,
    /// Human-readable reason.
    pub message: String,
}

impl RpcError {
    /// An error with `code`.
    pub fn new(code: i64, message: impl Into<String>) -> Self {
        RpcError {
            code,
            message: message.into(),
        }
    }
}

impl Incoming {
    /// Parses one frame. A frame that is not JSON, or not an object of
    /// this shape, is `INVALID_REQUEST` (answered with id 0).
    pub fn parse(text: &str) -> Result<Incoming, RpcError> {
        serde_json::from_str(text)
            .map_err(|e| RpcError::new(codes::INVALID_REQUEST, format!("malformed frame: {e}")))
    }

    /// The id of a valid request (`jsonrpc` "2.0" and an id).
    pub fn request_id(&self) -> Result<u64, RpcError> {
        if self.jsonrpc.as_deref() != Some("2.0") {
            return Err(RpcError::new(
                codes::INVALID_REQUEST,
                "jsonrpc must be \"2.0\"",
            ));
        }
        self.id.ok_or_else(|| {
            RpcError::new(
                codes::INVALID_REQUEST,
                "cp/* methods are requests and require an id",
            )
        })
    }

    /// The params as `T`, or `INVALID_PARAMS`.
    pub fn params<T: serde::de::DeserializeOwned>(&self) -> Result<T, RpcError> {
        let p = self.params.clone().unwrap_or(Value::Null);
        serde_json::from_value(p)
            .map_err(|e| RpcError::new(codes::INVALID_PARAMS, format!("invalid params: {e}")))
    }
}

/// A response frame.
pub fn response(id: u64, result: Value) -> String {
    json!({ "jsonrpc": "2.0", "id": id, "result": result }).to_string()
}

/// An error response frame.
pub fn error_response(id: u64, error: &RpcError) -> String {
    json!({
        "jsonrpc": "2.0",
        "id": id,
        "error": { "code": error.code, "message": error.message },
    })
    .to_string()
}

/// A request frame (the endpoint's own requests to a runtime).
pub fn request(id: u64, method: &str, params: Value) -> String {
    json!({ "jsonrpc": "2.0", "id": id, "method": method, "params": params }).to_string()
}

/// A runtime's role.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AgentType {
    /// Initiates delegations.
    Primary,
    /// Serves delegations.
    Worker,
}

impl std::fmt::Display for AgentType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            AgentType::Primary => "primary",
            AgentType::Worker => "worker",
        })
    }
}

/// `cp/register` params.
#[derive(Debug, Clone, Deserialize)]
pub struct RegisterParams {
    /// Must be [`PROTOCOL_VERSION`].
    pub protocol_version: u32,
    /// Claimed namespace (checked against the key's identity).
    pub namespace: String,
    /// Claimed name (checked against the key's identity).
    pub name: String,
    /// Claimed role (checked against the key's identity).
    #[serde(rename = "type")]
    pub agent_type: AgentType,
    /// Per-process id of the runtime (replicas share an identity).
    pub instance_id: String,
    /// Labels a label selector matches.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// Advertised concurrency (workers).
    #[serde(default = "one")]
    pub max_delegated_sessions: u32,
}

fn one() -> u32 {
    1
}

/// `cp/heartbeat` params.
#[derive(Debug, Clone, Deserialize)]
pub struct HeartbeatParams {
    /// The registering instance.
    pub instance_id: String,
}

/// A target: a logical name or labels (exactly one).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TargetSelector {
    /// Exact logical name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Every pair must match the runtime's labels.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub labels: Option<BTreeMap<String, String>>,
}

impl TargetSelector {
    /// Exactly one of `name` and `labels` is set.
    pub fn is_valid(&self) -> bool {
        self.name.is_some() != self.labels.is_some()
    }

    /// Whether a runtime named `name` with `labels` matches.
    pub fn matches(&self, name: &str, labels: &BTreeMap<String, String>) -> bool {
        match (&self.name, &self.labels) {
            (Some(n), None) => n == name,
            (None, Some(want)) => want.iter().all(|(k, v)| labels.get(k) == Some(v)),
            _ => false,
        }
    }
}

/// `cp/delegate` params from an initiating runtime.
#[derive(Debug, Clone, Deserialize)]
pub struct DelegateParams {
    /// The runtime's id for the delegation (unique while in flight).
    pub delegation_id: String,
    /// Who should serve it.
    pub target: TargetSelector,
    /// The task text.
    pub prompt: String,
    /// Absolute RFC 3339 deadline.
    pub deadline: String,
    /// Set when the initiator is itself serving a delegation.
    #[serde(default)]
    pub parent_delegation_id: Option<String>,
    /// The admission of that parent.
    #[serde(default)]
    pub parent_admission: Option<u64>,
}

/// How a delegation ended, in the CP's words.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DelegationStatus {
    /// The worker finished its turn.
    Completed,
    /// The worker failed.
    Failed,
    /// The deadline passed.
    Timeout,
    /// Cancelled by the initiator.
    Cancelled,
    /// The serving side went away mid-task.
    TargetDisconnected,
}

/// `cp/delegate_result` params (worker -> endpoint, endpoint -> initiator).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DelegateResultParams {
    /// The delegation.
    pub delegation_id: String,
    /// The admission this result ends (required from a worker that was
    /// sent one; echoed to the initiator).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub admission: Option<u64>,
    /// How it ended.
    pub status: DelegationStatus,
    /// The worker's text (completed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<String>,
    /// Why it did not complete.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// `cp/cancel` params.
#[derive(Debug, Clone, Deserialize)]
pub struct CancelParams {
    /// The delegation.
    pub delegation_id: String,
    /// Its admission (checked when present).
    #[serde(default)]
    pub admission: Option<u64>,
    /// Why.
    #[serde(default)]
    pub reason: Option<String>,
}

/// Cuts `text` to at most `max` bytes the way the CP does: the head, then
/// a marker naming the full size, the marker counted in the cap.
pub fn cap_result(text: String, max: usize) -> String {
    if text.len() <= max {
        return text;
    }
    let marker = format!(
        "\n…[truncated by control plane: {} bytes total]",
        text.len()
    );
    let mut cut = max.saturating_sub(marker.len()).min(text.len());
    while cut > 0 && !text.is_char_boundary(cut) {
        cut -= 1;
    }
    let mut out = format!("{}{marker}", text.get(..cut).unwrap_or_default());
    if out.len() > max {
        let mut end = max;
        while end > 0 && !out.is_char_boundary(end) {
            end -= 1;
        }
        out.truncate(end);
    }
    out
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn envelopes_are_checked() {
        let table = [
            (r#"{"jsonrpc":"2.0","id":7,"method":"cp/heartbeat"}"#, Ok(7)),
            (
                r#"{"id":7,"method":"cp/heartbeat"}"#,
                Err(codes::INVALID_REQUEST),
            ),
            (
                r#"{"jsonrpc":"1.0","id":7,"method":"x"}"#,
                Err(codes::INVALID_REQUEST),
            ),
            (
                r#"{"jsonrpc":"2.0","method":"x"}"#,
                Err(codes::INVALID_REQUEST),
            ),
        ];
        for (text, want) in table {
            let got = Incoming::parse(text)
                .unwrap()
                .request_id()
                .map_err(|e| e.code);
            assert_eq!(got, want, "{text}");
        }
        assert_eq!(
            Incoming::parse("not json").unwrap_err().code,
            codes::INVALID_REQUEST
        );
    }

    #[test]
    fn selectors_match_by_name_or_all_labels() {
        let labels: BTreeMap<String, String> = [("role".to_string(), "review".to_string())].into();
        let by_name = TargetSelector {
            name: Some("w1".into()),
            labels: None,
        };
        assert!(by_name.matches("w1", &labels) && !by_name.matches("w2", &labels));
        let by_labels = TargetSelector {
            name: None,
            labels: Some(labels.clone()),
        };
        assert!(by_labels.matches("any", &labels));
        assert!(!by_labels.matches("any", &BTreeMap::new()));
        assert!(!TargetSelector::default().is_valid());
    }

    #[test]
    fn results_are_capped_with_a_marker_inside_the_cap() {
        assert_eq!(cap_result("short".into(), 10), "short");
        let long = "é".repeat(1000);
        let capped = cap_result(long, 300);
        assert!(capped.len() <= 300);
        assert!(capped.contains("2000 bytes total"));
    }

    #[test]
    fn status_names_are_the_cps() {
        assert_eq!(
            serde_json::to_value(DelegationStatus::TargetDisconnected).unwrap(),
            json!("target_disconnected")
        );
    }
}
