//! The HTTP+JSON (REST) binding (SPEC §11) to the local A2A server.
//!
//! | operation | request |
//! |---|---|
//! | `SendMessage` | `POST <url>/message:send` |
//! | `SendStreamingMessage` | `POST <url>/message:stream` (SSE) |
//! | `SubscribeToTask` | `POST <url>/tasks/{id}:subscribe` (SSE); `GET` when the server answers 405 |
//! | `GetTask` | `GET <url>/tasks/{id}` |
//! | `CancelTask` | `POST <url>/tasks/{id}:cancel` |
//!
//! `<url>` is the interface's `url`, followed by `/{tenant}` when the
//! interface names a tenant. Bodies are proto JSON sent as
//! `application/a2a+json`; a stream's SSE `data:` is a bare StreamResponse.
//!
//! Errors come as google.rpc.Status with an HTTP status,
//! `{"error":{"code":404,"status":"NOT_FOUND","message":…,"details":[ErrorInfo]}}`
//! (or the same object in an SSE `error` event). [`status_error`] maps
//! them onto [`DriverError::Rpc`] with the JSON-RPC code of the same A2A
//! error, so the driver treats both bindings' errors alike: the ErrorInfo
//! `reason` decides; without one, the HTTP status (see [`code_of_http`]).

use std::time::Duration;

use reqwest::header::{ACCEPT, CONTENT_TYPE};
use reqwest::{StatusCode, Url};
use serde_json::{Value, json};
use tracing::debug;

use super::DriverError;
use super::call::Call;
use super::sse::SseEvent;
use super::transport::traced;
use crate::a2a::PROTOCOL_VERSION;

/// The media type of HTTP+JSON bodies (SPEC §11, v1.0.1).
const A2A_JSON: &str = "application/a2a+json";
/// What the driver accepts as a unary answer.
const ACCEPT_JSON: &str = "application/a2a+json, application/json";
/// The longest error message kept from the server.
const MAX_MESSAGE_CHARS: usize = 512;

/// An HTTP+JSON interface of the server's card.
#[derive(Debug, Clone)]
pub(super) struct Rest {
    /// The interface's `url`, with its tenant as a last path segment.
    base: Url,
}

impl Rest {
    /// The interface at `url` (an `http://` URL), with `tenant` (empty or
    /// `None`: no tenant).
    pub(super) fn new(url: &str, tenant: Option<&str>) -> Result<Rest, String> {
        let mut base = Url::parse(url).map_err(|e| format!("{url:?} is not a URL: {e}"))?;
        if base.cannot_be_a_base() {
            return Err(format!("{url:?} cannot take a path"));
        }
        if let Some(t) = tenant.filter(|t| !t.is_empty())
            && let Ok(mut p) = base.path_segments_mut()
        {
            p.pop_if_empty().push(t);
        }
        Ok(Rest { base })
    }

    /// `base` followed by `segments` (each percent-encoded as one segment).
    fn url(&self, segments: &[&str]) -> Url {
        let mut u = self.base.clone();
        if let Ok(mut p) = u.path_segments_mut() {
            p.pop_if_empty().extend(segments);
        }
        u
    }

    fn target(&self, call: Call<'_>) -> (reqwest::Method, Url, Option<Value>) {
        use reqwest::Method;
        match call {
            Call::SendMessage(m) => (
                Method::POST,
                self.url(&["message:send"]),
                Some(json!({ "message": m })),
            ),
            Call::SendStreamingMessage(m) => (
                Method::POST,
                self.url(&["message:stream"]),
                Some(json!({ "message": m })),
            ),
            Call::SubscribeToTask(id) => (
                Method::POST,
                self.url(&["tasks", &format!("{id}:subscribe")]),
                Some(json!({})),
            ),
            Call::GetTask(id) => (Method::GET, self.url(&["tasks", id]), None),
            Call::CancelTask(id) => (
                Method::POST,
                self.url(&["tasks", &format!("{id}:cancel")]),
                Some(json!({})),
            ),
        }
    }

    /// Sends `call`; `GetTask`/`CancelTask` are bounded by `timeout`. A
    /// `SubscribeToTask` POST the server refuses with 405 is sent again as
    /// a GET (the specification text says POST, its proto GET).
    pub(super) async fn send(
        &self,
        http: &reqwest::Client,
        call: Call<'_>,
        timeout: Duration,
    ) -> reqwest::Result<reqwest::Response> {
        let (method, url, body) = self.target(call);
        let accept = if call.streams() {
            "text/event-stream"
        } else {
            ACCEPT_JSON
        };
        let mut req = traced(http.request(method, url.clone()))
            .header("A2A-Version", PROTOCOL_VERSION)
            .header(ACCEPT, accept);
        if let Some(body) = &body {
            // Serialising a Value cannot fail.
            let bytes = serde_json::to_vec(body).unwrap_or_default();
            req = req.header(CONTENT_TYPE, A2A_JSON).body(bytes);
        }
        if call.bounded() {
            req = req.timeout(timeout);
        }
        let resp = req.send().await?;
        if matches!(call, Call::SubscribeToTask(_))
            && resp.status() == StatusCode::METHOD_NOT_ALLOWED
        {
            debug!("the local A2A server refused POST :subscribe (405); subscribing with GET");
            return traced(http.get(url))
                .header("A2A-Version", PROTOCOL_VERSION)
                .header(ACCEPT, accept)
                .send()
                .await;
        }
        Ok(resp)
    }

    /// A JSON answer: the body of a 2xx answer (a Task, or a
    /// SendMessageResponse / StreamResponse object), or the error of any
    /// other status.
    pub(super) async fn decode(&self, resp: reqwest::Response) -> Result<Value, DriverError> {
        let status = resp.status();
        let body = resp
            .bytes()
            .await
            .map_err(|e| DriverError::Protocol(e.to_string()))?;
        if !status.is_success() {
            return Err(status_error(Some(status.as_u16()), &body));
        }
        match serde_json::from_slice::<Value>(&body) {
            Ok(v) if v.is_object() => Ok(v),
            Ok(_) => Err(DriverError::Protocol(
                "an answer that is not a JSON object".into(),
            )),
            Err(e) => Err(DriverError::Protocol(e.to_string())),
        }
    }

    /// One SSE event of a stream: its StreamResponse, or why the turn fails
    /// (an `error` event, or an event holding a google.rpc.Status).
    pub(super) fn event(&self, ev: &SseEvent) -> Result<Value, String> {
        let v: Value = serde_json::from_str(&ev.data)
            .map_err(|e| format!("invalid SSE data from the local A2A server: {e}"))?;
        let is_event = ["task", "message", "statusUpdate", "artifactUpdate"]
            .iter()
            .any(|k| v.get(k).is_some());
        if ev.name == "error" || (!is_event && v.get("error").is_some()) {
            return Err(status_error(None, ev.data.as_bytes()).to_string());
        }
        Ok(v)
    }
}

/// The A2A error an HTTP+JSON error answer stands for: `http` is the
/// answer's HTTP status (`None` in an SSE event, where the Status's own
/// `code` stands in), `body` the answer.
pub(super) fn status_error(http: Option<u16>, body: &[u8]) -> DriverError {
    let v: Option<Value> = serde_json::from_slice(body).ok();
    let e = v.as_ref().and_then(|v| v.get("error"));
    let http = http.or_else(|| {
        e.and_then(|e| e.get("code"))
            .and_then(Value::as_u64)
            .and_then(|c| u16::try_from(c).ok())
    });
    let reason = e
        .and_then(|e| e.get("details"))
        .and_then(Value::as_array)
        .and_then(|details| {
            details.iter().find(|d| {
                d.get("@type")
                    .and_then(Value::as_str)
                    .is_some_and(|t| t.ends_with("google.rpc.ErrorInfo"))
                    && d.get("domain")
                        .and_then(Value::as_str)
                        .is_none_or(|d| d == crate::a2a::jsonrpc::A2A_DOMAIN)
            })
        })
        .and_then(|d| d.get("reason"))
        .and_then(Value::as_str);
    let code = reason
        .and_then(code_of_reason)
        .unwrap_or_else(|| code_of_http(http));
    let message = e
        .and_then(|e| e.get("message"))
        .and_then(Value::as_str)
        .filter(|m| !m.is_empty())
        .map(str::to_string)
        .or_else(|| reason.map(str::to_string))
        .unwrap_or_else(|| match http {
            Some(h) => format!("HTTP {h}"),
            None => "error".into(),
        });
    DriverError::Rpc {
        code,
        message: message.chars().take(MAX_MESSAGE_CHARS).collect(),
    }
}

/// The JSON-RPC code of the A2A error an ErrorInfo `reason` names (the
/// error's name in UPPER_SNAKE without "Error"; the standard JSON-RPC
/// errors as the official SDKs name them).
fn code_of_reason(reason: &str) -> Option<i64> {
    Some(match reason {
        "TASK_NOT_FOUND" => -32001,
        "TASK_NOT_CANCELABLE" => -32002,
        "PUSH_NOTIFICATION_NOT_SUPPORTED" => -32003,
        "UNSUPPORTED_OPERATION" => -32004,
        "CONTENT_TYPE_NOT_SUPPORTED" => -32005,
        "INVALID_AGENT_RESPONSE" => -32006,
        "EXTENDED_AGENT_CARD_NOT_CONFIGURED" => -32007,
        "EXTENSION_SUPPORT_REQUIRED" => -32008,
        "VERSION_NOT_SUPPORTED" => -32009,
        "PARSE_ERROR" | "JSON_PARSE" => -32700,
        "INVALID_REQUEST" => -32600,
        "METHOD_NOT_FOUND" => -32601,
        "INVALID_PARAMS" => -32602,
        "INTERNAL_ERROR" | "INTERNAL" => -32603,
        _ => return None,
    })
}

/// The JSON-RPC code for an error answer without a known ErrorInfo reason,
/// by HTTP status: 404/405/501 (no such route) -> method not found -32601;
/// 409 and 415 (v1.0.0's statuses for TaskNotCancelable and
/// ContentTypeNotSupported) -> -32002 and -32005; another 4xx -> invalid
/// request -32600; anything else -> internal error -32603.
fn code_of_http(http: Option<u16>) -> i64 {
    match http {
        Some(404 | 405 | 501) => -32601,
        Some(409) => -32002,
        Some(415) => -32005,
        Some(400..=499) => -32600,
        _ => -32603,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn status(http: u16, status: &str, reason: Option<&str>, message: &str) -> Vec<u8> {
        let mut e = json!({ "code": http, "status": status, "message": message });
        if let Some(r) = reason {
            e["details"] = json!([{
                "@type": "type.googleapis.com/google.rpc.ErrorInfo",
                "reason": r,
                "domain": "a2a-protocol.org",
                "metadata": {},
            }]);
        }
        serde_json::to_vec(&json!({ "error": e })).unwrap()
    }

    fn code(e: DriverError) -> i64 {
        match e {
            DriverError::Rpc { code, .. } => code,
            other => panic!("not an A2A error: {other:?}"),
        }
    }

    #[test]
    fn every_a2a_reason_maps_to_its_json_rpc_code() {
        for (reason, http, want) in [
            ("TASK_NOT_FOUND", 404, -32001),
            ("TASK_NOT_CANCELABLE", 400, -32002),
            ("PUSH_NOTIFICATION_NOT_SUPPORTED", 400, -32003),
            ("UNSUPPORTED_OPERATION", 400, -32004),
            ("CONTENT_TYPE_NOT_SUPPORTED", 400, -32005),
            ("INVALID_AGENT_RESPONSE", 500, -32006),
            ("EXTENDED_AGENT_CARD_NOT_CONFIGURED", 400, -32007),
            ("EXTENSION_SUPPORT_REQUIRED", 400, -32008),
            ("VERSION_NOT_SUPPORTED", 400, -32009),
            ("INVALID_PARAMS", 400, -32602),
            ("INVALID_REQUEST", 400, -32600),
            ("METHOD_NOT_FOUND", 404, -32601),
            ("INTERNAL_ERROR", 500, -32603),
        ] {
            let e = status_error(Some(http), &status(http, "X", Some(reason), "why"));
            assert_eq!(
                e,
                DriverError::Rpc {
                    code: want,
                    message: "why".into()
                },
                "{reason}"
            );
        }
    }

    #[test]
    fn the_reason_wins_over_the_http_status() {
        // v1.0.0 answered TaskNotCancelable with 409, v1.0.1 with 400; a
        // reason that says "not found" is not found whatever the status.
        let body = status(409, "FAILED_PRECONDITION", Some("TASK_NOT_CANCELABLE"), "x");
        assert_eq!(code(status_error(Some(409), &body)), -32002);
        let body = status(400, "FAILED_PRECONDITION", Some("TASK_NOT_CANCELABLE"), "x");
        assert_eq!(code(status_error(Some(400), &body)), -32002);
        let body = status(500, "INTERNAL", Some("TASK_NOT_FOUND"), "x");
        assert_eq!(code(status_error(Some(500), &body)), -32001);
    }

    #[test]
    fn without_a_known_reason_the_http_status_decides() {
        // No details, a reason of another domain, an unknown reason.
        let plain = status(409, "ABORTED", None, "conflict");
        assert_eq!(code(status_error(Some(409), &plain)), -32002);
        let foreign = serde_json::to_vec(&json!({ "error": {
            "code": 415, "message": "no", "details": [{
                "@type": "type.googleapis.com/google.rpc.ErrorInfo",
                "reason": "TASK_NOT_FOUND", "domain": "example.com" }] } }))
        .unwrap();
        assert_eq!(code(status_error(Some(415), &foreign)), -32005);
        let unknown = status(400, "INVALID_ARGUMENT", Some("SOMETHING_NEW"), "new");
        assert_eq!(code(status_error(Some(400), &unknown)), -32600);
        // Not JSON at all: a framework's plain 404 / 405 / 500 page.
        for (http, want) in [
            (404, -32601),
            (405, -32601),
            (501, -32601),
            (400, -32600),
            (500, -32603),
            (502, -32603),
        ] {
            let e = status_error(Some(http), b"Not Found");
            assert_eq!(
                e,
                DriverError::Rpc {
                    code: want,
                    message: format!("HTTP {http}")
                }
            );
        }
    }

    #[test]
    fn the_message_is_bounded_and_never_empty() {
        let long = "x".repeat(5000);
        let body = status(404, "NOT_FOUND", Some("TASK_NOT_FOUND"), &long);
        match status_error(Some(404), &body) {
            DriverError::Rpc { message, .. } => assert_eq!(message.len(), MAX_MESSAGE_CHARS),
            other => panic!("{other:?}"),
        }
        let body = status(404, "NOT_FOUND", Some("TASK_NOT_FOUND"), "");
        match status_error(Some(404), &body) {
            DriverError::Rpc { message, .. } => assert_eq!(message, "TASK_NOT_FOUND"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn stream_events_and_errors() {
        let rest = Rest::new("http://127.0.0.1:1/a2a", None).unwrap();
        let ev = |name: &str, data: &[u8]| SseEvent {
            name: name.into(),
            data: String::from_utf8(data.to_vec()).unwrap(),
        };
        let ok = rest
            .event(&ev("message", br#"{"statusUpdate":{"taskId":"t"}}"#))
            .unwrap();
        assert_eq!(ok["statusUpdate"]["taskId"], "t");
        // The SDKs' mid-stream error: an `error` event holding a Status.
        let body = status(
            400,
            "FAILED_PRECONDITION",
            Some("UNSUPPORTED_OPERATION"),
            "done",
        );
        let e = rest.event(&ev("error", &body)).unwrap_err();
        assert_eq!(
            e,
            DriverError::Rpc {
                code: -32004,
                message: "done".into()
            }
            .to_string()
        );
        // A Status sent as a plain event is an error too.
        assert!(rest.event(&ev("message", &body)).is_err());
        assert!(
            rest.event(&ev("message", b"not json"))
                .unwrap_err()
                .starts_with("invalid SSE data")
        );
    }

    /// A server whose `:subscribe` takes only GET (as the proto says)
    /// answers the POST with 405; the driver subscribes again with GET.
    #[tokio::test]
    async fn subscribe_falls_back_to_get_on_405() {
        use axum::routing::get;
        let seen = std::sync::Arc::new(parking_lot::Mutex::new(Vec::new()));
        let log = seen.clone();
        let app = axum::Router::new().route(
            "/a2a/tasks/{segment}",
            get(
                move |axum::extract::Path(segment): axum::extract::Path<String>| {
                    let log = log.clone();
                    async move {
                        log.lock().push(segment);
                        (
                            [(CONTENT_TYPE, "text/event-stream")],
                            "data: {\"task\":{\"id\":\"t\"}}\n\n",
                        )
                    }
                },
            ),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move { axum::serve(listener, app).await });
        let rest = Rest::new(&format!("http://{addr}/a2a"), None).unwrap();
        let http = reqwest::Client::new();
        let resp = rest
            .send(&http, Call::SubscribeToTask("t"), Duration::from_secs(5))
            .await
            .unwrap();
        assert_eq!(resp.status(), StatusCode::OK);
        assert_eq!(
            resp.text().await.unwrap(),
            "data: {\"task\":{\"id\":\"t\"}}\n\n"
        );
        assert_eq!(
            *seen.lock(),
            ["t:subscribe"],
            "one GET, after the refused POST"
        );
        // Another refusal is an error answer like any other.
        let resp = rest
            .send(&http, Call::CancelTask("t"), Duration::from_secs(5))
            .await
            .unwrap();
        assert_eq!(
            rest.decode(resp).await.unwrap_err(),
            DriverError::Rpc {
                code: -32601,
                message: "HTTP 405".into()
            }
        );
        server.abort();
    }

    #[test]
    fn paths_follow_the_interface_url_and_tenant() {
        let rest = Rest::new("http://127.0.0.1:9/a2a/rest/", None).unwrap();
        let m = json!({});
        let url = |c| rest.target(c).1.to_string();
        assert_eq!(
            url(Call::SendStreamingMessage(&m)),
            "http://127.0.0.1:9/a2a/rest/message:stream"
        );
        assert_eq!(
            url(Call::SendMessage(&m)),
            "http://127.0.0.1:9/a2a/rest/message:send"
        );
        assert_eq!(
            url(Call::SubscribeToTask("t-1")),
            "http://127.0.0.1:9/a2a/rest/tasks/t-1:subscribe"
        );
        assert_eq!(
            url(Call::CancelTask("t-1")),
            "http://127.0.0.1:9/a2a/rest/tasks/t-1:cancel"
        );
        assert_eq!(rest.target(Call::GetTask("t-1")).0, reqwest::Method::GET);
        // A task id is one path segment, whatever it holds.
        assert_eq!(
            url(Call::GetTask("a/b?c")),
            "http://127.0.0.1:9/a2a/rest/tasks/a%2Fb%3Fc"
        );
        let tenant = Rest::new("http://127.0.0.1:9", Some("acme")).unwrap();
        assert_eq!(
            tenant.target(Call::GetTask("t")).1.to_string(),
            "http://127.0.0.1:9/acme/tasks/t"
        );
        assert!(Rest::new("not a url", None).is_err());
    }
}
