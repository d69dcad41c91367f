//! The OAB Delegation Profile as an A2A extension (`docs/delegation-profile.md`).
//!
//! - **URI** [`PROFILE_URI`], declared in the agent card with
//!   `required: false`, so plain clients (and the TCK) work without it.
//! - **Activation** per request: the `A2A-Extensions` header lists the URI
//!   (the 0.3 name `X-A2A-Extensions` is read too); the response echoes it.
//! - **When active**: every stream event carries `metadata[URI].seq` (and
//!   the SSE `id:` field); `SubscribeToTask` resumes after the cursor in
//!   `Last-Event-ID` (or [`CURSOR_HEADER`]) and replays finished tasks; the
//!   delegation contract is read from `message.metadata[URI]`; the final
//!   task carries the outcome and the signed result envelope.
//!
//! Without activation none of this is read or written: the facade is plain
//! A2A 1.0.
//!
//! Never: grants anything: a contract only states what the client asks for (the
//! caller's `authorize_outgoing` decides), a contract member this version does
//! not know is refused, and so is a depth other than 1.

use std::time::Duration;

use axum::http::HeaderMap;
use serde::Deserialize;
use serde_json::{Map, Value, json};

use super::jsonrpc::A2aError;
use crate::profile::{Budgets, RiskLevel};

/// The profile's extension URI. Versioned: a breaking change gets a new URI.
pub const PROFILE_URI: &str = "https://oab.dev/a2a/ext/delegation/v1";

/// The request header that activates extensions (SPEC §3.2.6, §4.6).
pub const EXTENSIONS_HEADER: &str = "A2A-Extensions";

/// The 0.3 name of [`EXTENSIONS_HEADER`], still read.
pub const LEGACY_EXTENSIONS_HEADER: &str = "X-A2A-Extensions";

/// The standard SSE resume header: the cursor of `SubscribeToTask`.
pub const LAST_EVENT_ID_HEADER: &str = "Last-Event-ID";

/// The profile's own cursor header, for clients or proxies that do not pass
/// `Last-Event-ID` on a POST. `Last-Event-ID` wins when both are sent.
pub const CURSOR_HEADER: &str = "OAB-Cursor";

/// Whether the request activates the profile.
pub fn requested(headers: &HeaderMap) -> bool {
    [EXTENSIONS_HEADER, LEGACY_EXTENSIONS_HEADER]
        .iter()
        .flat_map(|name| headers.get_all(*name))
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|uri| uri.trim() == PROFILE_URI)
}

/// The cursor of a resuming subscriber: the last event sequence it
/// processed. `None` when no cursor header was sent; a header that is not a
/// decimal number is invalid params.
pub fn cursor(headers: &HeaderMap) -> Result<Option<u64>, A2aError> {
    let raw = headers
        .get(LAST_EVENT_ID_HEADER)
        .or_else(|| headers.get(CURSOR_HEADER));
    let Some(raw) = raw else {
        return Ok(None);
    };
    let text = raw
        .to_str()
        .map_err(|_| A2aError::InvalidParams("cursor header is not ASCII".into()))?
        .trim();
    if text.is_empty() {
        return Ok(None);
    }
    text.parse::<u64>().map(Some).map_err(|_| {
        A2aError::InvalidParams(format!(
            "cursor {text:?} is not an event sequence number of this profile"
        ))
    })
}

/// The `AgentExtension` declared in every card the facade serves.
pub fn agent_extension() -> Value {
    json!({
        "uri": PROFILE_URI,
        "description": "OAB Delegation Profile: per-event sequence numbers, SubscribeToTask \
            resume after a cursor (Last-Event-ID or OAB-Cursor) with replay of finished tasks, \
            the delegation contract in message metadata, outcomes expired/unknown, and the \
            callee-signed result envelope.",
        "required": false,
        "params": {
            "version": 1,
            "cursorHeaders": [LAST_EVENT_ID_HEADER, CURSOR_HEADER],
            "outcomes": ["completed", "failed", "cancelled", "rejected", "expired", "unknown"],
        },
    })
}

/// Budgets as the contract carries them; a member left out takes the
/// facade's default. Zero is zero, never unlimited.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ContractBudgets {
    /// Model tokens.
    pub tokens: Option<u64>,
    /// Cost in millionths of the billing currency unit.
    pub cost_micros: Option<u64>,
    /// `low`, `medium` or `high`.
    pub risk: Option<RiskLevel>,
    /// Bytes of output.
    pub output_bytes: Option<u64>,
}

impl ContractBudgets {
    /// These budgets over `defaults`.
    pub fn over(&self, defaults: &Budgets) -> Budgets {
        Budgets {
            tokens: self.tokens.unwrap_or(defaults.tokens),
            cost_micros: self.cost_micros.unwrap_or(defaults.cost_micros),
            risk: self.risk.unwrap_or(defaults.risk),
            output_bytes: self.output_bytes.unwrap_or(defaults.output_bytes),
        }
    }
}

/// Caller-side provenance in the contract.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ContractParent {
    /// The caller-side agent.
    pub agent: Option<String>,
    /// The caller's trace id.
    pub trace_id: Option<String>,
    /// The caller-side execution.
    pub execution_id: Option<String>,
}

/// The delegation contract a client puts in `message.metadata[URI]` (or the
/// request's `metadata[URI]`). Every member is optional: the facade's
/// defaults fill the gaps, and the connector's authority rules refuse (never
/// narrow) anything the caller may not have.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Contract {
    /// Idempotency key of the delegation (`[A-Za-z0-9._:-]`, at most 128
    /// bytes). Default: derived from the peer and the `messageId`, so a
    /// re-sent message is the same delegation.
    pub request_id: Option<String>,
    /// Capabilities requested, exact names.
    pub capabilities: Option<Vec<String>>,
    /// Whether the callee must not change anything.
    pub read_only: Option<bool>,
    /// Time from receipt until the deadline, in milliseconds.
    pub timeout_ms: Option<u64>,
    /// Delegation depth; only 1 exists.
    pub depth: Option<u8>,
    /// Budgets.
    pub budgets: Option<ContractBudgets>,
    /// Caller-side provenance.
    pub parent: Option<ContractParent>,
}

impl Contract {
    /// The deadline as a duration, if given.
    pub fn timeout(&self) -> Option<Duration> {
        self.timeout_ms.map(Duration::from_millis)
    }
}

/// Reads the contract from `message.metadata[URI]`, else from the request's
/// `metadata[URI]`. Unknown members, wrong types and a depth other than 1
/// are invalid params.
pub fn contract(message: &Value, request_metadata: Option<&Value>) -> Result<Contract, A2aError> {
    let raw = message
        .get("metadata")
        .and_then(|m| m.get(PROFILE_URI))
        .or_else(|| request_metadata.and_then(|m| m.get(PROFILE_URI)));
    let Some(raw) = raw else {
        return Ok(Contract::default());
    };
    let c: Contract = serde_json::from_value(raw.clone())
        .map_err(|e| A2aError::InvalidParams(format!("metadata[{PROFILE_URI}]: {e}")))?;
    if c.depth.is_some_and(|d| d != 1) {
        return Err(A2aError::Refused {
            code: "nested_delegation".into(),
            message: "only depth 1 exists: a delegation cannot be delegated further".into(),
        });
    }
    Ok(c)
}

/// `{URI: fields}`: the metadata object of an event or task.
pub fn metadata(fields: Map<String, Value>) -> Value {
    let mut m = Map::new();
    m.insert(PROFILE_URI.into(), Value::Object(fields));
    Value::Object(m)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use axum::http::HeaderValue;

    use super::*;

    #[test]
    fn activation_and_cursor() {
        let mut h = HeaderMap::new();
        assert!(!requested(&h));
        h.insert(
            EXTENSIONS_HEADER,
            HeaderValue::from_str(&format!("urn:x, {PROFILE_URI}")).unwrap(),
        );
        assert!(requested(&h));
        assert_eq!(cursor(&h).unwrap(), None);
        h.insert(CURSOR_HEADER, HeaderValue::from_static("7"));
        assert_eq!(cursor(&h).unwrap(), Some(7));
        h.insert(LAST_EVENT_ID_HEADER, HeaderValue::from_static("9"));
        assert_eq!(cursor(&h).unwrap(), Some(9));
        h.insert(LAST_EVENT_ID_HEADER, HeaderValue::from_static("x"));
        assert_eq!(cursor(&h).unwrap_err().code(), -32602);
    }

    #[test]
    fn contract_is_strict() {
        let m = json!({"metadata": {PROFILE_URI: {"capabilities": ["read:repo"], "timeoutMs": 5000,
            "budgets": {"tokens": 10, "risk": "low"}}}});
        let c = contract(&m, None).unwrap();
        assert_eq!(
            c.capabilities.clone().unwrap(),
            vec!["read:repo".to_string()]
        );
        assert_eq!(c.timeout(), Some(Duration::from_secs(5)));
        assert_eq!(c.budgets.unwrap().risk, Some(RiskLevel::Low));
        let bad = json!({"metadata": {PROFILE_URI: {"capability": []}}});
        assert_eq!(contract(&bad, None).unwrap_err().code(), -32602);
        let deep = json!({"metadata": {PROFILE_URI: {"depth": 2}}});
        assert_eq!(contract(&deep, None).unwrap_err().code(), -32602);
        let from_request = contract(&json!({}), Some(&json!({PROFILE_URI: {"readOnly": true}})));
        assert_eq!(from_request.unwrap().read_only, Some(true));
    }
}
