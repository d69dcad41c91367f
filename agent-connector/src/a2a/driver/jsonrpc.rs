//! The JSON-RPC 2.0 binding (SPEC §9) to the local A2A server: every call is
//! a POST of a JSON-RPC request to the interface URL; a stream's SSE `data:`
//! lines are complete JSON-RPC responses whose `result` is a StreamResponse.

use std::time::Duration;

use serde_json::{Map, Value, json};

use super::DriverError;
use super::call::Call;
use super::sse::SseEvent;
use super::transport::traced;
use crate::a2a::PROTOCOL_VERSION;
use crate::a2a::model::fresh_id;

/// A JSON-RPC interface of the server's card.
#[derive(Debug, Clone)]
pub(super) struct JsonRpc {
    /// The interface's `url`.
    pub(super) url: String,
    /// The interface's `tenant`, copied into every request's params.
    pub(super) tenant: Option<String>,
}

impl JsonRpc {
    fn body(&self, call: Call<'_>) -> Value {
        let mut params = Map::new();
        let method = match call {
            Call::SendMessage(m) => {
                params.insert("message".into(), m.clone());
                "SendMessage"
            }
            Call::SendStreamingMessage(m) => {
                params.insert("message".into(), m.clone());
                "SendStreamingMessage"
            }
            Call::SubscribeToTask(id) => {
                params.insert("id".into(), json!(id));
                "SubscribeToTask"
            }
            Call::GetTask(id) => {
                params.insert("id".into(), json!(id));
                "GetTask"
            }
            Call::CancelTask(id) => {
                params.insert("id".into(), json!(id));
                "CancelTask"
            }
        };
        if let Some(t) = &self.tenant {
            params.insert("tenant".into(), json!(t));
        }
        json!({ "jsonrpc": "2.0", "id": fresh_id("rpc"), "method": method, "params": params })
    }

    /// Sends `call`; `GetTask`/`CancelTask` are bounded by `timeout`.
    pub(super) async fn send(
        &self,
        http: &reqwest::Client,
        call: Call<'_>,
        timeout: Duration,
    ) -> reqwest::Result<reqwest::Response> {
        let req = traced(http.post(&self.url))
            .header("A2A-Version", PROTOCOL_VERSION)
            .json(&self.body(call));
        let req = if call.streams() {
            req.header(reqwest::header::ACCEPT, "text/event-stream")
        } else if call.bounded() {
            req.header(reqwest::header::ACCEPT, "application/json")
                .timeout(timeout)
        } else {
            req
        };
        req.send().await
    }

    /// A JSON answer: its `result`, or the JSON-RPC error it holds.
    pub(super) async fn decode(&self, resp: reqwest::Response) -> Result<Value, DriverError> {
        let v: Value = resp
            .json()
            .await
            .map_err(|e| DriverError::Protocol(e.to_string()))?;
        if let Some(e) = rpc_error(&v) {
            return Err(e);
        }
        take_result(v).ok_or_else(|| DriverError::Protocol("a response without result".into()))
    }

    /// One SSE event of a stream: its StreamResponse, or why the turn fails.
    pub(super) fn event(&self, ev: &SseEvent) -> Result<Value, String> {
        let v: Value = serde_json::from_str(&ev.data)
            .map_err(|e| format!("invalid SSE data from the local A2A server: {e}"))?;
        if let Some(e) = rpc_error(&v)
            && (ev.name == "error" || v.get("result").is_none())
        {
            return Err(e.to_string());
        }
        take_result(v).ok_or_else(|| "an SSE event without result".into())
    }
}

fn take_result(v: Value) -> Option<Value> {
    match v {
        Value::Object(mut o) => o.remove("result"),
        _ => None,
    }
}

fn rpc_error(v: &Value) -> Option<DriverError> {
    let e = v.get("error")?;
    Some(DriverError::Rpc {
        code: e.get("code").and_then(Value::as_i64).unwrap_or(0),
        message: e
            .get("message")
            .and_then(Value::as_str)
            .unwrap_or("error")
            .chars()
            .take(512)
            .collect(),
    })
}
