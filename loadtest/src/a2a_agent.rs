//! An A2A 1.0 agent that answers at once, for the callee connector's A2A
//! driver (`a2a.driver_url`): its card announces one JSON-RPC interface and
//! no streaming, so the driver sends one blocking `SendMessage` per
//! delegation, and every `SendMessage` is answered with a task already
//! `TASK_STATE_COMPLETED`. It keeps nothing per request but a counter, so a
//! long run measures the connectors, not the agent.
//!
//! Dropping an [`InstantAgent`] stops it.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use anyhow::Context as _;
use axum::extract::State;
use axum::routing::{get, post};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

/// A running agent on a loopback port.
#[derive(Debug)]
pub struct InstantAgent {
    url: String,
    answered: Arc<AtomicU64>,
    stop: CancellationToken,
}

impl InstantAgent {
    /// Binds 127.0.0.1 on a free port and serves until dropped.
    pub async fn start() -> anyhow::Result<InstantAgent> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .context("binding the A2A agent")?;
        let addr: SocketAddr = listener.local_addr()?;
        let url = format!("http://{addr}");
        let answered = Arc::new(AtomicU64::new(0));
        let state = AgentState {
            card: card(&url),
            answered: answered.clone(),
        };
        let app = axum::Router::new()
            .route("/.well-known/agent-card.json", get(agent_card))
            .route("/", post(rpc))
            .with_state(state);
        let stop = CancellationToken::new();
        let stopped = stop.clone();
        tokio::spawn(async move {
            let served = axum::serve(listener, app)
                .with_graceful_shutdown(async move { stopped.cancelled().await })
                .await;
            if let Err(e) = served {
                tracing::warn!(error = %e, "the A2A agent stopped");
            }
        });
        Ok(InstantAgent {
            url,
            answered,
            stop,
        })
    }

    /// Its base URL (`a2a.driver_url`).
    pub fn url(&self) -> &str {
        &self.url
    }

    /// `SendMessage` requests answered so far.
    pub fn answered(&self) -> u64 {
        self.answered.load(Ordering::Relaxed)
    }
}

impl Drop for InstantAgent {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

#[derive(Clone)]
struct AgentState {
    card: Arc<Value>,
    answered: Arc<AtomicU64>,
}

fn card(url: &str) -> Arc<Value> {
    Arc::new(json!({
        "name": "oab-loadtest instant agent",
        "description": "Answers every message with a completed task at once.",
        "version": "1.0.0",
        "supportedInterfaces": [
            { "url": format!("{url}/"), "protocolBinding": "JSONRPC", "protocolVersion": "1.0" }
        ],
        "capabilities": { "streaming": false, "pushNotifications": false },
        "defaultInputModes": ["text/plain"],
        "defaultOutputModes": ["text/plain"],
        "skills": [],
    }))
}

async fn agent_card(State(s): State<AgentState>) -> axum::Json<Value> {
    axum::Json((*s.card).clone())
}

/// Any JSON-RPC request: a completed task for `SendMessage` (its id from
/// the counter), -32601 for anything else.
async fn rpc(State(s): State<AgentState>, body: axum::body::Bytes) -> axum::Json<Value> {
    let req: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let id = req.get("id").cloned().unwrap_or(Value::Null);
    if req.get("method").and_then(Value::as_str) != Some("SendMessage") {
        return axum::Json(json!({
            "jsonrpc": "2.0",
            "id": id,
            "error": { "code": -32601, "message": "method not found" },
        }));
    }
    let n = s.answered.fetch_add(1, Ordering::Relaxed);
    let context = req
        .pointer("/params/message/contextId")
        .and_then(Value::as_str)
        .map_or_else(|| format!("ctx-{n}"), str::to_string);
    axum::Json(json!({
        "jsonrpc": "2.0",
        "id": id,
        "result": { "task": {
            "id": format!("task-{n}"),
            "contextId": context,
            "status": {
                "state": "TASK_STATE_COMPLETED",
                "message": {
                    "messageId": format!("answer-{n}"),
                    "role": "ROLE_AGENT",
                    "parts": [{ "text": "done" }],
                },
            },
        }},
    }))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[tokio::test]
    async fn answers_send_message_with_a_completed_task() {
        let agent = InstantAgent::start().await.unwrap();
        let http = reqwest::Client::new();
        let card: Value = http
            .get(format!("{}/.well-known/agent-card.json", agent.url()))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(card["supportedInterfaces"][0]["protocolBinding"], "JSONRPC");
        let answer: Value = http
            .post(format!("{}/", agent.url()))
            .json(&json!({"jsonrpc": "2.0", "id": 3, "method": "SendMessage",
                          "params": {"message": {"messageId": "m", "role": "ROLE_USER",
                                                 "parts": [{"text": "x"}]}}}))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(answer["id"], 3);
        assert_eq!(
            answer["result"]["task"]["status"]["state"],
            "TASK_STATE_COMPLETED"
        );
        assert_eq!(agent.answered(), 1);
    }
}
