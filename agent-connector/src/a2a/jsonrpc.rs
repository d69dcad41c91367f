//! The JSON-RPC 2.0 binding's envelope: parsing requests, building results
//! and errors, the A2A error codes with their `google.rpc.ErrorInfo`
//! detail, the mapping of the connector's refusals to those codes, and the
//! `A2A-Version` service parameter.
//!
//! Every error this module builds is one JSON-RPC error object whose `data`
//! is an array holding one ErrorInfo (`@type`, `reason`, `domain`,
//! `metadata`), as the 1.0 binding asks (SPEC §9.5). Internal details are
//! logged, never sent.
//!
//! Never: answers a method or reads the task table: it parses and builds
//! envelopes and maps errors; the methods live in the facade.

use serde_json::{Map, Value, json};

use super::PROTOCOL_VERSION;
#[cfg(feature = "a2a")]
use crate::caller::CallerError;
#[cfg(feature = "a2a")]
use crate::link::LinkError;

/// The message an [`A2aError::Internal`] is answered with: its detail
/// (store, link or file errors, which may name hosts and paths) is logged,
/// never sent.
pub const INTERNAL_MESSAGE: &str = "internal error (details are in the connector's log)";

/// The `@type` of a `google.rpc.ErrorInfo` detail.
pub const ERROR_INFO_TYPE: &str = "type.googleapis.com/google.rpc.ErrorInfo";

/// The ErrorInfo domain of the errors A2A defines.
pub const A2A_DOMAIN: &str = "a2a-protocol.org";

/// The ErrorInfo domain of the refusals the OAB Delegation Profile adds
/// (authority, idempotency, credentials in the task).
pub const OAB_DOMAIN: &str = "oab.dev";

/// The service parameter (HTTP header or query parameter) naming the
/// protocol version of a request.
pub const VERSION_HEADER: &str = "A2A-Version";

/// An error answered to a JSON-RPC request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum A2aError {
    /// -32700: the body is not JSON.
    #[error("parse error: {0}")]
    Parse(String),
    /// -32600: the body is JSON but not a JSON-RPC 2.0 request.
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// -32601: no such method.
    #[error("method not found: {0}")]
    MethodNotFound(String),
    /// -32602: the params are not valid for the method.
    #[error("invalid params: {0}")]
    InvalidParams(String),
    /// -32603: the facade failed. The detail is for the log only: the
    /// client gets [`INTERNAL_MESSAGE`].
    #[error("internal error: {0}")]
    Internal(String),
    /// -32001: no such task (or not one of this peer's).
    #[error("task not found: {0}")]
    TaskNotFound(String),
    /// -32002: the task already reached a terminal state.
    #[error("task cannot be canceled: {0}")]
    TaskNotCancelable(String),
    /// -32003: push notifications are not supported.
    #[error("push notifications are not supported")]
    PushNotificationNotSupported,
    /// -32004: the operation is not supported in this state.
    #[error("unsupported operation: {0}")]
    UnsupportedOperation(String),
    /// -32005: a part's media type is not accepted.
    #[error("content type not supported: {0}")]
    ContentTypeNotSupported(String),
    /// -32006: the remote agent's answer was not valid A2A.
    #[error("invalid agent response: {0}")]
    InvalidAgentResponse(String),
    /// -32007: no extended agent card is configured.
    #[error("no extended agent card is configured")]
    ExtendedAgentCardNotConfigured,
    /// -32008: a required extension was not activated.
    #[error("extension support required: {0}")]
    ExtensionSupportRequired(String),
    /// -32009: the requested protocol version is not served.
    #[error("A2A version {0} is not supported; this server speaks {PROTOCOL_VERSION}")]
    VersionNotSupported(String),
    /// -32602 with an OAB reason: the delegation profile refused the request
    /// (authority, idempotency, credentials). `code` is the connector's
    /// stable snake_case code.
    #[error("refused ({code}): {message}")]
    Refused {
        /// The connector's code, e.g. `capability_denied`.
        code: String,
        /// What was refused.
        message: String,
    },
}

impl A2aError {
    /// The JSON-RPC error code.
    pub fn code(&self) -> i64 {
        match self {
            A2aError::Parse(_) => -32700,
            A2aError::InvalidRequest(_) => -32600,
            A2aError::MethodNotFound(_) => -32601,
            A2aError::InvalidParams(_) | A2aError::Refused { .. } => -32602,
            A2aError::Internal(_) => -32603,
            A2aError::TaskNotFound(_) => -32001,
            A2aError::TaskNotCancelable(_) => -32002,
            A2aError::PushNotificationNotSupported => -32003,
            A2aError::UnsupportedOperation(_) => -32004,
            A2aError::ContentTypeNotSupported(_) => -32005,
            A2aError::InvalidAgentResponse(_) => -32006,
            A2aError::ExtendedAgentCardNotConfigured => -32007,
            A2aError::ExtensionSupportRequired(_) => -32008,
            A2aError::VersionNotSupported(_) => -32009,
        }
    }

    /// The ErrorInfo `reason`: the error's name in UPPER_SNAKE without
    /// "Error" (SPEC §11), or the connector's code for a refusal.
    pub fn reason(&self) -> String {
        let name = match self {
            A2aError::Parse(_) => "PARSE_ERROR",
            A2aError::InvalidRequest(_) => "INVALID_REQUEST",
            A2aError::MethodNotFound(_) => "METHOD_NOT_FOUND",
            A2aError::InvalidParams(_) => "INVALID_PARAMS",
            A2aError::Internal(_) => "INTERNAL",
            A2aError::TaskNotFound(_) => "TASK_NOT_FOUND",
            A2aError::TaskNotCancelable(_) => "TASK_NOT_CANCELABLE",
            A2aError::PushNotificationNotSupported => "PUSH_NOTIFICATION_NOT_SUPPORTED",
            A2aError::UnsupportedOperation(_) => "UNSUPPORTED_OPERATION",
            A2aError::ContentTypeNotSupported(_) => "CONTENT_TYPE_NOT_SUPPORTED",
            A2aError::InvalidAgentResponse(_) => "INVALID_AGENT_RESPONSE",
            A2aError::ExtendedAgentCardNotConfigured => "EXTENDED_AGENT_CARD_NOT_CONFIGURED",
            A2aError::ExtensionSupportRequired(_) => "EXTENSION_SUPPORT_REQUIRED",
            A2aError::VersionNotSupported(_) => "VERSION_NOT_SUPPORTED",
            A2aError::Refused { code, .. } => return code.to_ascii_uppercase(),
        };
        name.to_string()
    }

    fn domain(&self) -> &'static str {
        match self {
            A2aError::Refused { .. } => OAB_DOMAIN,
            _ => A2A_DOMAIN,
        }
    }

    /// The JSON-RPC error object: `{code, message, data: [ErrorInfo]}`.
    pub fn to_error_object(&self) -> Value {
        let mut metadata = Map::new();
        if let A2aError::VersionNotSupported(v) = self {
            metadata.insert("requestedVersion".into(), Value::String(v.clone()));
            metadata.insert(
                "supportedVersions".into(),
                Value::String(PROTOCOL_VERSION.into()),
            );
        }
        let message = match self {
            A2aError::Internal(_) => INTERNAL_MESSAGE.to_string(),
            other => other.to_string(),
        };
        json!({
            "code": self.code(),
            "message": message,
            "data": [{
                "@type": ERROR_INFO_TYPE,
                "reason": self.reason(),
                "domain": self.domain(),
                "metadata": metadata,
            }],
        })
    }

    /// The HTTP status and `google.rpc.Code` name of this error on the
    /// HTTP+JSON binding (SPEC §5.4, v1.0.1 table; the JSON-RPC envelope
    /// errors as the a2a-python REST server maps them).
    pub fn http_status(&self) -> (u16, &'static str) {
        match self {
            A2aError::TaskNotFound(_) | A2aError::MethodNotFound(_) => (404, "NOT_FOUND"),
            A2aError::Parse(_)
            | A2aError::InvalidRequest(_)
            | A2aError::InvalidParams(_)
            | A2aError::Refused { .. }
            | A2aError::ContentTypeNotSupported(_) => (400, "INVALID_ARGUMENT"),
            A2aError::TaskNotCancelable(_)
            | A2aError::PushNotificationNotSupported
            | A2aError::UnsupportedOperation(_)
            | A2aError::ExtendedAgentCardNotConfigured
            | A2aError::ExtensionSupportRequired(_)
            | A2aError::VersionNotSupported(_) => (400, "FAILED_PRECONDITION"),
            A2aError::Internal(_) | A2aError::InvalidAgentResponse(_) => (500, "INTERNAL"),
        }
    }

    /// The HTTP+JSON binding's error body (SPEC §11.6): a
    /// `google.rpc.Status`, `{"error": {code, status, message, details:
    /// [ErrorInfo]}}`, where `code` is the HTTP status. The ErrorInfo is the
    /// one the JSON-RPC error carries.
    pub fn to_status_body(&self) -> Value {
        let (http, status) = self.http_status();
        let mut obj = self.to_error_object();
        let (message, details) = match obj.as_object_mut() {
            Some(o) => (
                o.remove("message").unwrap_or(Value::Null),
                o.remove("data").unwrap_or(Value::Null),
            ),
            None => (Value::Null, Value::Null),
        };
        json!({
            "error": {
                "code": http,
                "status": status,
                "message": message,
                "details": details,
            }
        })
    }

    /// A complete JSON-RPC error response for request `id`.
    pub fn to_response(&self, id: &Value) -> Value {
        json!({ "jsonrpc": "2.0", "id": id, "error": self.to_error_object() })
    }

    /// A [`Caller`](crate::Caller) failure as answered to an A2A client:
    /// the delegation profile's refusals (authority, profile, idempotency)
    /// as [`A2aError::Refused`] with the connector's code; anything else as
    /// [`A2aError::Internal`].
    #[cfg(feature = "a2a")]
    pub(crate) fn from_caller(e: CallerError) -> A2aError {
        match e {
            CallerError::Authority(_)
            | CallerError::Profile(_)
            | CallerError::IdempotencyMismatch(_) => A2aError::Refused {
                code: e.code().to_string(),
                message: e.to_string(),
            },
            CallerError::Link(ref l @ LinkError::TooLarge { .. }) => A2aError::Refused {
                code: l.code().unwrap_or("payload_too_large").to_string(),
                message: format!(
                    "the request is too large to delegate: {l}; send large content by reference (a URL part)"
                ),
            },
            other => A2aError::Internal(format!("{other:#}")),
        }
    }
}

/// A parsed JSON-RPC 2.0 request.
#[derive(Debug, Clone, PartialEq)]
pub struct RpcRequest {
    /// The request id (a string or a number).
    pub id: Value,
    /// The method name.
    pub method: String,
    /// The params object (`{}` when absent).
    pub params: Map<String, Value>,
}

/// Parses a request body. On failure returns the id to answer with (null
/// when it could not be read) and the error: -32700 for a body that is not
/// JSON, -32600 for one that is not a single JSON-RPC 2.0 request (batches
/// and notifications included: A2A defines neither), -32602 for params
/// that are not an object.
pub fn parse_request(body: &[u8]) -> Result<RpcRequest, (Value, A2aError)> {
    let value: Value = serde_json::from_slice(body).map_err(|e| {
        (
            Value::Null,
            A2aError::Parse(format!("the body is not JSON: {e}")),
        )
    })?;
    let Value::Object(mut obj) = value else {
        return Err((
            Value::Null,
            A2aError::InvalidRequest("a request is a single JSON object".into()),
        ));
    };
    let id = match obj.remove("id") {
        Some(id @ (Value::String(_) | Value::Number(_))) => id,
        Some(Value::Null) | None => {
            return Err((
                Value::Null,
                A2aError::InvalidRequest("a request needs an id (string or number)".into()),
            ));
        }
        Some(_) => {
            return Err((
                Value::Null,
                A2aError::InvalidRequest("id must be a string or a number".into()),
            ));
        }
    };
    if obj.get("jsonrpc").and_then(Value::as_str) != Some("2.0") {
        return Err((
            id,
            A2aError::InvalidRequest("jsonrpc must be \"2.0\"".into()),
        ));
    }
    let method = match obj.remove("method") {
        Some(Value::String(m)) if !m.is_empty() => m,
        _ => {
            return Err((
                id,
                A2aError::InvalidRequest("method must be a non-empty string".into()),
            ));
        }
    };
    let params = match obj.remove("params") {
        None | Some(Value::Null) => Map::new(),
        Some(Value::Object(mut p)) => {
            camelize(&mut p);
            p
        }
        Some(_) => {
            return Err((
                id,
                A2aError::InvalidParams("params must be an object".into()),
            ));
        }
    };
    Ok(RpcRequest { id, method, params })
}

/// Renames `snake_case` members to their `lowerCamelCase` JSON names, at
/// every depth except inside `metadata` and `data` (free-form values):
/// ProtoJSON parsers accept both the JSON name and the proto field name,
/// and some clients send the latter (`history_length`).
pub fn camelize(map: &mut Map<String, Value>) {
    let keys: Vec<String> = map.keys().filter(|k| k.contains('_')).cloned().collect();
    for k in keys {
        let mut camel = String::with_capacity(k.len());
        let mut upper = false;
        for c in k.chars() {
            if c == '_' {
                upper = true;
            } else if upper {
                camel.extend(c.to_uppercase());
                upper = false;
            } else {
                camel.push(c);
            }
        }
        if !map.contains_key(&camel)
            && let Some(v) = map.remove(&k)
        {
            map.insert(camel, v);
        }
    }
    for (k, v) in map.iter_mut() {
        if k == "metadata" || k == "data" {
            continue;
        }
        match v {
            Value::Object(o) => camelize(o),
            Value::Array(items) => {
                for item in items {
                    if let Value::Object(o) = item {
                        camelize(o);
                    }
                }
            }
            _ => {}
        }
    }
}

/// A JSON-RPC success response.
pub fn result_response(id: &Value, result: Value) -> Value {
    json!({ "jsonrpc": "2.0", "id": id, "result": result })
}

/// Checks the `A2A-Version` service parameter: `header` (the HTTP header)
/// wins over `query` (the `A2A-Version` query parameter). Missing or empty
/// means 0.3 (SPEC §3.6), which this server does not serve. Only
/// Major.Minor counts: `1.0` and `1.0.1` are accepted.
pub fn check_version(header: Option<&str>, query: Option<&str>) -> Result<(), A2aError> {
    let given = header
        .map(str::trim)
        .filter(|v| !v.is_empty())
        .or_else(|| query.map(str::trim).filter(|v| !v.is_empty()))
        .unwrap_or("0.3");
    let mut parts = given.split('.');
    let major = parts.next().unwrap_or_default();
    let minor = parts.next().unwrap_or_default();
    let wanted = PROTOCOL_VERSION
        .split_once('.')
        .unwrap_or((PROTOCOL_VERSION, "0"));
    let numeric = |s: &str| s.parse::<u32>().ok();
    match (numeric(major), numeric(minor)) {
        (Some(a), Some(b)) if Some(a) == numeric(wanted.0) && Some(b) == numeric(wanted.1) => {
            Ok(())
        }
        _ => Err(A2aError::VersionNotSupported(
            given.chars().take(32).collect(),
        )),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::indexing_slicing)]

    use super::*;

    #[test]
    fn internal_errors_send_no_detail() {
        let e = A2aError::Internal(
            "state: /var/lib/oab-connector/acme~x.json: permission denied".into(),
        );
        let obj = e.to_error_object();
        assert_eq!(obj["code"], -32603);
        assert_eq!(obj["message"], INTERNAL_MESSAGE);
        assert!(!obj.to_string().contains("/var/lib"), "{obj}");
    }

    #[test]
    fn envelope_errors_have_the_right_codes() {
        let cases: &[(&[u8], i64)] = &[
            (b"{not json", -32700),
            (b"[1,2]", -32600),
            (b"{\"jsonrpc\":\"2.0\",\"method\":\"GetTask\"}", -32600),
            (
                b"{\"jsonrpc\":\"1.0\",\"id\":1,\"method\":\"GetTask\"}",
                -32600,
            ),
            (
                b"{\"jsonrpc\":\"2.0\",\"id\":{},\"method\":\"GetTask\"}",
                -32600,
            ),
            (b"{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":7}", -32600),
            (
                b"{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"GetTask\",\"params\":[1]}",
                -32602,
            ),
        ];
        for (body, code) in cases {
            let (_, e) = parse_request(body).unwrap_err();
            assert_eq!(e.code(), *code, "{}", String::from_utf8_lossy(body));
        }
        let ok =
            parse_request(b"{\"jsonrpc\":\"2.0\",\"id\":\"a\",\"method\":\"GetTask\"}").unwrap();
        assert_eq!(ok.id, Value::String("a".into()));
        assert!(ok.params.is_empty());
    }

    #[test]
    fn proto_field_names_are_accepted() {
        let r = parse_request(
            br#"{"jsonrpc":"2.0","id":1,"method":"GetTask","params":{"id":"t","history_length":1,
            "message":{"message_id":"m","parts":[{"media_type":"x","text":"y"}],"metadata":{"a_b":1}}}}"#,
        )
        .unwrap();
        assert_eq!(r.params["historyLength"], 1);
        assert_eq!(r.params["message"]["messageId"], "m");
        assert_eq!(r.params["message"]["parts"][0]["mediaType"], "x");
        assert_eq!(r.params["message"]["metadata"]["a_b"], 1);
    }

    #[test]
    fn version_rules() {
        assert!(check_version(Some("1.0"), None).is_ok());
        assert!(check_version(Some(" 1.0.1 "), None).is_ok());
        assert!(check_version(None, Some("1.0")).is_ok());
        for bad in [
            None,
            Some(""),
            Some("0.3"),
            Some("1.1"),
            Some("2.0"),
            Some("x"),
        ] {
            let e = check_version(bad, None).unwrap_err();
            assert_eq!(e.code(), -32009);
        }
        assert_eq!(
            check_version(None, None).unwrap_err(),
            A2aError::VersionNotSupported("0.3".into())
        );
    }

    #[test]
    fn rest_errors_are_google_rpc_status() {
        let v = A2aError::TaskNotFound("t1".into()).to_status_body();
        assert_eq!(v["error"]["code"], 404);
        assert_eq!(v["error"]["status"], "NOT_FOUND");
        assert_eq!(v["error"]["details"][0]["@type"], ERROR_INFO_TYPE);
        assert_eq!(v["error"]["details"][0]["reason"], "TASK_NOT_FOUND");
        assert!(v["error"]["message"].as_str().unwrap().contains("t1"));
        let cases = [
            (
                A2aError::TaskNotCancelable(String::new()),
                400,
                "FAILED_PRECONDITION",
            ),
            (
                A2aError::PushNotificationNotSupported,
                400,
                "FAILED_PRECONDITION",
            ),
            (
                A2aError::UnsupportedOperation(String::new()),
                400,
                "FAILED_PRECONDITION",
            ),
            (
                A2aError::ContentTypeNotSupported(String::new()),
                400,
                "INVALID_ARGUMENT",
            ),
            (
                A2aError::InvalidAgentResponse(String::new()),
                500,
                "INTERNAL",
            ),
            (
                A2aError::ExtendedAgentCardNotConfigured,
                400,
                "FAILED_PRECONDITION",
            ),
            (
                A2aError::ExtensionSupportRequired(String::new()),
                400,
                "FAILED_PRECONDITION",
            ),
            (
                A2aError::VersionNotSupported("0.3".into()),
                400,
                "FAILED_PRECONDITION",
            ),
            (
                A2aError::InvalidParams(String::new()),
                400,
                "INVALID_ARGUMENT",
            ),
            (A2aError::MethodNotFound(String::new()), 404, "NOT_FOUND"),
        ];
        for (e, code, status) in cases {
            assert_eq!(e.http_status(), (code, status), "{e}");
        }
        let internal = A2aError::Internal("/var/lib/secret".into()).to_status_body();
        assert_eq!(internal["error"]["message"], INTERNAL_MESSAGE);
    }

    #[test]
    fn errors_carry_error_info() {
        let v = A2aError::TaskNotFound("t1".into()).to_response(&Value::from(3));
        assert_eq!(v["error"]["code"], -32001);
        assert_eq!(v["error"]["data"][0]["@type"], ERROR_INFO_TYPE);
        assert_eq!(v["error"]["data"][0]["reason"], "TASK_NOT_FOUND");
        assert_eq!(v["error"]["data"][0]["domain"], A2A_DOMAIN);
        let r = A2aError::Refused {
            code: "capability_denied".into(),
            message: "no".into(),
        };
        assert_eq!(
            r.to_error_object()["data"][0]["reason"],
            "CAPABILITY_DENIED"
        );
    }
}
