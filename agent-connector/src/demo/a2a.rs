//! `oab-connector demo --a2a`: the same delegation as the plain demo, through
//! the A2A facade and driver, from the connector configs the development
//! relay wrote (`dev-alice.connector.toml`, `dev-bob.connector.toml`).
//!
//! In this process: a small demo A2A 1.0 agent (the [`DemoAgent`], streaming
//! the same steps as [`super::DemoExecutor`]) on bob's `a2a.driver_url`;
//! `dev/bob`'s connector with an [`A2aDriver`] towards it (its agent card
//! published); `dev/alice`'s connector with the [`Facade`] on its
//! `a2a.facade_listen`. The demo is then an ordinary A2A client of the
//! facade: `SendStreamingMessage` to `http://<facade>/peers/dev/bob/` with
//! the OAB Delegation Profile active, each SSE event written as it arrives,
//! and the final event's signed result checked again here against bob's key
//! from his identity file, never against the relay or the facade's word.
//! With `keep`, the facade and both connectors stay up after the delegation
//! for any other A2A client until the `until` future completes.
//!
//! Never: used with anything but a development setup (see [`super`]).

use std::collections::HashMap;
use std::io::Write;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use bytes::Bytes;
use futures_util::StreamExt as _;
use oab_wire::envelope::{Envelope, RESULT_TYPE};
use oab_wire::identity::{Identity, PeerKey};
use oab_wire::{Outcome, PeerId};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use super::{CALLEE, CALLER, CONNECT_TIMEOUT, DemoError, DemoOptions, PROGRESS_STEPS, STEP_PAUSE};
use super::{WAIT_TIMEOUT, bad, connected, dev_file, load_cert, relay_url_from};
use crate::a2a::model::{agent_text_message, fresh_id, message_text};
use crate::a2a::{
    A2aDriver, DelegationDefaults, DriverOptions, Facade, FacadeOptions, PROFILE_URI,
};
use crate::authority::Grant;
use crate::callee::{CalleeOptions, TaskExecutor};
use crate::config::ConnectorConfig;
use crate::connector::{Connector, ConnectorOptions};
use crate::link::LinkSettings;
use crate::profile::DelegationResult;
use crate::trust::RelayTrust;

/// The connector config file the development relay writes for `peer`
/// (`relay::dev::connector_config_path`).
fn connector_config(dir: &Path, peer: &str) -> Result<ConnectorConfig, DemoError> {
    let path = dev_file(dir, &format!("{}.connector.toml", peer.replace('/', "-")))?;
    ConnectorConfig::load(&path).map_err(|e| bad(&path, e))
}

/// The address an `http://host:port[/]` URL names.
fn url_addr(url: &str, field: &str, config: &Path) -> Result<SocketAddr, DemoError> {
    url.strip_prefix("http://")
        .map(|rest| rest.trim_end_matches('/'))
        .and_then(|hostport| hostport.parse().ok())
        .ok_or_else(|| bad(config, format!("{field} {url:?} is not http://<ip>:<port>")))
}

async fn bind(
    what: &str,
    addr: SocketAddr,
    flag: &str,
) -> Result<tokio::net::TcpListener, DemoError> {
    tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| DemoError::Bind {
            what: what.to_string(),
            addr,
            reason: format!("{e}; pass {flag} <ip:port> to use another address"),
        })
}

/// A connector as `oab-connector run` builds it from `config` (relay URL
/// replaced by `url`), with `executor` serving delegations.
fn start_from(
    config: &ConnectorConfig,
    url: &str,
    executor: Option<Arc<dyn TaskExecutor>>,
) -> Result<(Connector, Identity), DemoError> {
    let c = &config.connector;
    let identity = crate::keyfile::load(&c.identity).map_err(|e| bad(&c.identity, e))?;
    let trust = match &c.relay_ca {
        Some(ca) => RelayTrust::Ca(load_cert(ca)?),
        None => RelayTrust::WebPki,
    };
    let mut link = LinkSettings::new(url, trust, identity.clone());
    link.relay_id = c.relay_id.clone();
    let p = &config.policy;
    let policy = p.policy().map_err(|e| bad(Path::new("[policy]"), e))?;
    let connector = Connector::start(ConnectorOptions {
        link,
        trust: config.trust(),
        grant: Grant {
            capabilities: policy.allowed_capabilities.clone(),
            remaining: policy.budgets,
        },
        caller_policy: policy.clone(),
        callee: executor.map(|executor| CalleeOptions {
            executor,
            policy: Arc::new(policy),
            max_concurrent: p.max_concurrent,
            max_concurrent_per_peer: p.max_concurrent_per_peer,
            max_live_requests_per_peer: p.max_live_requests_per_peer,
            replay_window_ms: p.replay_window_ms,
        }),
        audit: None,
        state: None,
    })
    .map_err(|source| DemoError::Start {
        peer: identity.peer.to_string(),
        source,
    })?;
    Ok((connector, identity))
}

/// The demo A2A 1.0 agent behind bob's driver: one JSON-RPC interface at
/// `/`, streaming; `SendStreamingMessage` answers with the task
/// (`WORKING`), [`PROGRESS_STEPS`] `WORKING` status updates
/// [`STEP_PAUSE`] apart, a `summary` text artifact, then `COMPLETED`.
/// Keeps nothing per task (`GetTask` knows none; `CancelTask` answers
/// `CANCELED`).
#[derive(Debug, Clone)]
pub struct DemoAgent {
    url: String,
}

impl DemoAgent {
    /// The agent, reachable at `url` (`http://127.0.0.1:7080/`).
    pub fn new(url: impl Into<String>) -> Self {
        DemoAgent { url: url.into() }
    }

    /// Its agent card.
    pub fn card(&self) -> Value {
        json!({
            "name": "dev/bob demo agent",
            "description": "Counts the words of a task, in three steps (oab-connector demo --a2a)",
            "version": "1.0.0",
            "supportedInterfaces": [
                { "url": self.url, "protocolBinding": "JSONRPC", "protocolVersion": "1.0" }
            ],
            "capabilities": { "streaming": true, "pushNotifications": false },
            "defaultInputModes": ["text/plain"],
            "defaultOutputModes": ["text/plain"],
            "skills": [{
                "id": "summarise",
                "name": "Summarise",
                "description": "Reads the task and says how many words it has",
                "tags": ["demo"]
            }]
        })
    }

    /// Serves the agent on `listener` until `shutdown` fires.
    pub async fn serve(
        self,
        listener: tokio::net::TcpListener,
        shutdown: CancellationToken,
    ) -> std::io::Result<()> {
        let router = axum::Router::new()
            .route("/.well-known/agent-card.json", get(agent_card))
            .route("/", post(agent_rpc))
            .with_state(self);
        axum::serve(listener, router)
            .with_graceful_shutdown(shutdown.cancelled_owned())
            .await
    }
}

async fn agent_card(State(agent): State<DemoAgent>) -> axum::Json<Value> {
    axum::Json(agent.card())
}

fn rpc_result(id: &Value, result: Value) -> Value {
    json!({ "jsonrpc": "2.0", "id": id, "result": result })
}

fn rpc_error(id: &Value, code: i64, message: &str) -> Response {
    axum::Json(json!({ "jsonrpc": "2.0", "id": id, "error": { "code": code, "message": message } }))
        .into_response()
}

/// The events of one task, in order (the pauses are the caller's).
fn task_events(task_id: &str, context_id: &str, text: &str) -> Vec<Value> {
    let words = text.split_whitespace().count();
    let summary = format!("dev/bob read the task: {words} words");
    let status = |state: &str, message: Option<Value>| {
        let mut s = json!({ "state": state });
        if let Some(m) = message {
            s["message"] = m;
        }
        json!({ "statusUpdate": { "taskId": task_id, "contextId": context_id, "status": s } })
    };
    let mut events = vec![json!({ "task": {
        "id": task_id,
        "contextId": context_id,
        "status": {
            "state": "TASK_STATE_WORKING",
            "message": agent_text_message("dev/bob's demo agent took the task"),
        },
    }})];
    for step in 1..=PROGRESS_STEPS {
        let m = agent_text_message(&format!("step {step} of {PROGRESS_STEPS}"));
        events.push(status("TASK_STATE_WORKING", Some(m)));
    }
    events.push(json!({ "artifactUpdate": {
        "taskId": task_id,
        "contextId": context_id,
        "artifact": { "artifactId": "summary", "name": "summary", "parts": [{ "text": summary }] },
        "lastChunk": true,
    }}));
    events.push(status(
        "TASK_STATE_COMPLETED",
        Some(agent_text_message(&summary)),
    ));
    events
}

async fn agent_rpc(State(_agent): State<DemoAgent>, body: Bytes) -> Response {
    let Ok(req) = serde_json::from_slice::<Value>(&body) else {
        return rpc_error(&Value::Null, -32700, "parse error");
    };
    let id = req.get("id").cloned().unwrap_or(Value::Null);
    let params = req.get("params").cloned().unwrap_or(Value::Null);
    let method = req.get("method").and_then(Value::as_str).unwrap_or("");
    let message = params.get("message").cloned().unwrap_or(Value::Null);
    let text = message_text(&message);
    let context_id = message
        .get("contextId")
        .and_then(Value::as_str)
        .map_or_else(|| fresh_id("ctx"), str::to_string);
    match method {
        "SendStreamingMessage" => {
            let events = task_events(&fresh_id("task"), &context_id, &text);
            let stream = futures_util::stream::iter(events.into_iter().enumerate()).then(
                move |(i, event)| {
                    let data = rpc_result(&id, event).to_string();
                    async move {
                        // The task at once, then each step after a pause.
                        if i > 0 {
                            tokio::time::sleep(STEP_PAUSE).await;
                        }
                        Ok::<_, std::convert::Infallible>(Event::default().data(data))
                    }
                },
            );
            Sse::new(stream).into_response()
        }
        "SendMessage" => {
            // The card says it streams, so the driver never asks this; an
            // A2A client might: the finished task, at once.
            let task_id = fresh_id("task");
            let summary = format!(
                "dev/bob read the task: {} words",
                text.split_whitespace().count()
            );
            axum::Json(rpc_result(
                &id,
                json!({ "task": {
                    "id": task_id,
                    "contextId": context_id,
                    "status": { "state": "TASK_STATE_COMPLETED", "message": agent_text_message(&summary) },
                    "artifacts": [{ "artifactId": "summary", "name": "summary", "parts": [{ "text": summary }] }],
                }}),
            ))
            .into_response()
        }
        "CancelTask" => {
            let task_id = params.get("id").cloned().unwrap_or(Value::Null);
            axum::Json(rpc_result(
                &id,
                json!({ "id": task_id, "contextId": context_id, "status": { "state": "TASK_STATE_CANCELED" } }),
            ))
            .into_response()
        }
        "GetTask" | "SubscribeToTask" => rpc_error(&id, -32001, "task not found"),
        _ => rpc_error(&id, -32601, "method not found"),
    }
}

/// The facade URL of `peer`'s agent, with its trailing slash.
pub fn facade_agent_url(facade: SocketAddr, peer: &str) -> String {
    format!("http://{facade}/peers/{peer}/")
}

/// The demo's task text.
const TASK: &str = "Summarise the README of this repository";

/// How long a blocking `SendMessage` to the demo's facade waits with the
/// relay gone before it returns its task as it stands (see
/// [`FacadeOptions::offline_wait`]).
pub const OFFLINE_WAIT: Duration = Duration::from_secs(5);

/// Runs the A2A demo, writing what happens to `out`. With `keep`, once the
/// verified result is written, serves the facade until `stop` is cancelled
/// (`stopped`: what stopped it, e.g. `Ctrl-C`), saying when the relay is
/// lost and when it is back; then shuts everything down and says so.
/// `stop` cancelled before the result: [`DemoError::Interrupted`].
pub async fn run(
    options: &DemoOptions,
    keep: bool,
    stop: CancellationToken,
    stopped: impl Fn() -> String,
    out: &mut dyn Write,
) -> Result<(), DemoError> {
    let dir = &options.dev_dir;
    let relay_config = dev_file(dir, "relay.toml")?;
    let alice_config = connector_config(dir, CALLER)?;
    let bob_config = connector_config(dir, CALLEE)?;
    let url = match &options.relay_url {
        Some(u) => u.clone(),
        None => relay_url_from(&relay_config)?,
    };
    let bob_path = dir.join(format!("{}.connector.toml", CALLEE.replace('/', "-")));
    let alice_path = dir.join(format!("{}.connector.toml", CALLER.replace('/', "-")));
    let agent_addr = match (options.agent_listen, &bob_config.a2a.driver_url) {
        (Some(a), _) => a,
        (None, Some(u)) => url_addr(u, "a2a.driver_url", &bob_path)?,
        (None, None) => return Err(bad(&bob_path, "a2a.driver_url is not set")),
    };
    let facade_addr = match (options.facade_listen, alice_config.a2a.facade_listen) {
        (Some(a), _) | (None, Some(a)) => a,
        (None, None) => return Err(bad(&alice_path, "a2a.facade_listen is not set")),
    };
    let agent_listener = bind("the demo A2A agent", agent_addr, "--agent-listen").await?;
    let facade_listener = bind("the A2A facade", facade_addr, "--facade-listen").await?;
    let local = |l: &tokio::net::TcpListener, addr| l.local_addr().unwrap_or(addr);
    let (agent_addr, facade_addr) = (
        local(&agent_listener, agent_addr),
        local(&facade_listener, facade_addr),
    );
    let agent_url = format!("http://{agent_addr}/");
    let shutdown = CancellationToken::new();
    tokio::spawn(DemoAgent::new(agent_url.clone()).serve(agent_listener, shutdown.child_token()));

    let driver =
        A2aDriver::new(DriverOptions::new(agent_url.clone())).map_err(|e| bad(&bob_path, e))?;
    let (bob_c, bob) = start_from(&bob_config, &url, Some(Arc::new(driver.clone())))?;
    let (alice_c, alice) = match start_from(&alice_config, &url, None) {
        Ok(c) => c,
        Err(e) => {
            bob_c.shutdown().await;
            return Err(e);
        }
    };
    let base = DelegationDefaults::default();
    let facade = Facade::new(
        alice_c.caller().clone(),
        FacadeOptions {
            defaults: DelegationDefaults {
                capabilities: alice_config.a2a.default_capabilities.clone(),
                timeout: alice_config
                    .a2a
                    .default_timeout_ms
                    .map_or(base.timeout, Duration::from_millis),
                agent: "oab-connector-demo".into(),
                ..base
            },
            offline_wait: Some(OFFLINE_WAIT),
            ..FacadeOptions::default()
        },
    );
    tokio::spawn(crate::a2a::serve(
        facade_listener,
        facade.clone(),
        shutdown.child_token(),
    ));
    writeln!(out, "development setup: {}", dir.display())?;
    writeln!(out, "relay:             {url}")?;
    writeln!(
        out,
        "demo A2A agent:    {agent_url} (behind {CALLEE}'s A2A driver)"
    )?;
    let agent = facade_agent_url(facade_addr, CALLEE);
    let (stop_keep, alice_link) = (stop.clone(), alice_c.link().clone());
    let body = async {
        connected(&bob_c, &bob, &url).await?;
        let card = driver.agent_card().await.map_err(|e| bad(&bob_path, e))?;
        let published = match tokio::time::timeout(CONNECT_TIMEOUT, bob_c.publish(&card)).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err(format!("no answer within {} s", CONNECT_TIMEOUT.as_secs())),
        };
        published.map_err(|e| DemoError::Unreachable {
            peer: CALLEE.into(),
            url: url.clone(),
            reason: format!("publishing the agent card: {e}"),
        })?;
        writeln!(
            out,
            "{CALLEE} connected (callee, A2A driver), its agent card published"
        )?;
        connected(&alice_c, &alice, &url).await?;
        writeln!(
            out,
            "{CALLER} connected (caller, A2A facade on http://{facade_addr}/)"
        )?;
        writeln!(out, "A2A agent for {CALLEE} at {CALLER}'s facade: {agent}")?;
        delegate(&agent, &bob, out).await?;
        if keep {
            writeln!(
                out,
                "\nthe facade stays up until Ctrl-C; point any A2A 1.0 client at {agent}, e.g.:"
            )?;
            writeln!(
                out,
                "  curl -s {agent} -H 'A2A-Version: 1.0' -H 'Content-Type: application/json' \\\n    \
                 -d '{{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"SendMessage\",\"params\":{{\"message\":\
                 {{\"messageId\":\"m1\",\"role\":\"ROLE_USER\",\"parts\":[{{\"text\":\"Summarise this\"}}]}}}}}}'"
            )?;
            out.flush()?;
            keep_up(&alice_link, &url, &stop_keep, out).await?;
            writeln!(
                out,
                "demo stopped ({}): the facade is closed and both connectors disconnected",
                stopped()
            )?;
            out.flush()?;
        } else {
            writeln!(
                out,
                "(run it with --keep to leave the facade up for your own A2A client)"
            )?;
        }
        Ok(())
    };
    let result = tokio::select! {
        biased;
        r = body => r,
        () = stop.cancelled() => Err(DemoError::Interrupted { signal: stopped() }),
    };
    shutdown.cancel();
    facade.close();
    alice_c.shutdown().await;
    bob_c.shutdown().await;
    result
}

/// `--keep`: waits for `stop`, saying (at WARN, with what to do) when the
/// relay link goes down and when it is back.
async fn keep_up(
    link: &crate::link::LinkHandle,
    url: &str,
    stop: &CancellationToken,
    out: &mut dyn Write,
) -> Result<(), DemoError> {
    use crate::link::LinkState;
    let mut state = link.watch_state();
    let mut up = matches!(link.state(), LinkState::Connected { .. });
    loop {
        tokio::select! {
            () = stop.cancelled() => return Ok(()),
            changed = state.changed() => {
                if changed.is_err() {
                    // The link task ended; nothing more to report.
                    stop.cancelled().await;
                    return Ok(());
                }
                let now = state.borrow_and_update().clone();
                match now {
                    LinkState::Connected { .. } if !up => {
                        up = true;
                        writeln!(out, "relay back at {url}: {CALLER} reconnected, the facade delegates again")?;
                    }
                    LinkState::Connecting { .. } | LinkState::Stopped(_) if up => {
                        up = false;
                        let reason = link
                            .stats()
                            .facts()
                            .last_disconnect
                            .map(|(_, r)| r)
                            .unwrap_or_else(|| "connection lost".into());
                        writeln!(
                            out,
                            "WARN lost the relay at {url} ({reason}); reconnecting. Start the \
                             development relay again (cargo run -p oab-relay) or stop the demo \
                             with Ctrl-C. Meanwhile a blocking SendMessage returns its task \
                             still submitted after {} s (it goes out when the relay is back; \
                             GetTask follows it)",
                            OFFLINE_WAIT.as_secs()
                        )?;
                    }
                    _ => {}
                }
                out.flush()?;
            }
        }
    }
}

/// The demo's A2A client: one `SendStreamingMessage` with the profile
/// active, each event written as it arrives, the result verified again.
async fn delegate(agent: &str, bob: &Identity, out: &mut dyn Write) -> Result<(), DemoError> {
    let http = reqwest::Client::new();
    let failed = |reason: String| DemoError::NotCompleted {
        outcome: Outcome::Failed,
        reason,
    };
    let body = json!({
        "jsonrpc": "2.0",
        "id": 1,
        "method": "SendStreamingMessage",
        "params": { "message": {
            "messageId": fresh_id("demo"),
            "role": "ROLE_USER",
            "parts": [{ "text": TASK }],
        }},
    });
    writeln!(out, "SendStreamingMessage to {agent}: {TASK:?}")?;
    let resp = http
        .post(agent)
        .header("A2A-Version", "1.0")
        .header("A2A-Extensions", PROFILE_URI)
        .header("Accept", "text/event-stream")
        .json(&body)
        .send()
        .await
        .map_err(|e| failed(format!("the facade did not answer: {e}")))?;
    let mut stream = resp.bytes_stream();
    let mut parser = crate::a2a::driver::SseParser::default();
    let mut last: Option<Value> = None;
    let read = async {
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| failed(format!("the facade's stream broke: {e}")))?;
            for event in parser.push(&chunk).map_err(failed)? {
                let v: Value = serde_json::from_str(&event.data)
                    .map_err(|e| failed(format!("invalid SSE data: {e}")))?;
                if let Some(e) = v.get("error") {
                    return Err(failed(format!("the facade answered {e}")));
                }
                let r = v.get("result").cloned().unwrap_or(Value::Null);
                if let Some(done) = show(&r, out)? {
                    last = Some(done);
                }
            }
        }
        Ok::<(), DemoError>(())
    };
    tokio::time::timeout(WAIT_TIMEOUT, read)
        .await
        .map_err(|_| failed(format!("no terminal within {} s", WAIT_TIMEOUT.as_secs())))??;
    let status = last.ok_or_else(|| failed("the stream ended before a terminal".into()))?;
    let meta = status
        .pointer("/metadata")
        .and_then(|m| m.get(PROFILE_URI))
        .cloned()
        .unwrap_or(Value::Null);
    let outcome = meta.get("outcome").and_then(Value::as_str).unwrap_or("?");
    let verified = meta.get("verified").and_then(Value::as_bool) == Some(true);
    if outcome != "completed" || !verified {
        return Err(failed(format!(
            "the final event says outcome {outcome}, verified {verified}"
        )));
    }
    let envelope = meta
        .get("result")
        .ok_or_else(|| failed("no signed result in the final event".into()))?;
    let envelope = Envelope::from_json(envelope.to_string().as_bytes())
        .map_err(|e| failed(format!("the signed result: {e}")))?;
    let trust: HashMap<PeerId, Vec<PeerKey>> = [(
        bob.peer.clone(),
        vec![PeerKey {
            key_id: bob.key_id.clone(),
            public_key: bob.public_key(),
            not_before_ms: None,
            not_after_ms: None,
        }],
    )]
    .into_iter()
    .collect();
    let checked = envelope
        .verify(RESULT_TYPE, &bob.peer, &trust, crate::a2a::model::now_ms())
        .map_err(|e| failed(format!("the signed result does not verify: {e}")))?;
    let r: DelegationResult = checked
        .parse()
        .map_err(|e| failed(format!("the signed result: {e}")))?;
    writeln!(
        out,
        "verified result (the facade said verified: true; checked again here against {CALLEE}'s key from its identity file):"
    )?;
    writeln!(out, "  outcome:         {}", r.outcome)?;
    writeln!(out, "  task id:         {}", r.task_id)?;
    writeln!(
        out,
        "  executor:        {} key {} ({})",
        r.executor.peer,
        checked.key_id(),
        bob.public_key()
    )?;
    writeln!(
        out,
        "  capabilities:    {} (read-only: {})",
        r.effective_capabilities.join(", "),
        r.read_only
    )?;
    writeln!(out, "  request digest:  {}", r.request_digest)?;
    writeln!(out, "  result digest:   {}", r.result_digest)?;
    for a in &r.artifacts {
        writeln!(
            out,
            "  artifact:        {} ({}): {}",
            a.name,
            a.media_type,
            a.text.as_deref().unwrap_or("")
        )?;
    }
    Ok(())
}

/// Writes one SSE result; returns it when it is the final status update.
fn show(r: &Value, out: &mut dyn Write) -> Result<Option<Value>, DemoError> {
    let seq = |v: &Value| {
        v.pointer("/metadata")
            .and_then(|m| m.get(PROFILE_URI))
            .and_then(|p| p.get("seq"))
            .and_then(Value::as_u64)
            .map_or_else(|| "-".to_string(), |s| s.to_string())
    };
    if let Some(t) = r.get("task") {
        let state = t
            .pointer("/status/state")
            .and_then(Value::as_str)
            .unwrap_or("?");
        let id = t.get("id").and_then(Value::as_str).unwrap_or("?");
        writeln!(out, "  [{}] task {id} {state}", seq(t))?;
    } else if let Some(u) = r.get("statusUpdate") {
        let state = u
            .pointer("/status/state")
            .and_then(Value::as_str)
            .unwrap_or("?");
        let text = u
            .pointer("/status/message")
            .map(message_text)
            .unwrap_or_default();
        let terminal = !matches!(
            state,
            "TASK_STATE_SUBMITTED"
                | "TASK_STATE_WORKING"
                | "TASK_STATE_INPUT_REQUIRED"
                | "TASK_STATE_AUTH_REQUIRED"
        );
        if terminal {
            writeln!(out, "  [{}] terminal {state}: {text}", seq(u))?;
            return Ok(Some(u.clone()));
        }
        writeln!(out, "  [{}] progress {state} {text}", seq(u))?;
    } else if let Some(u) = r.get("artifactUpdate") {
        let name = u
            .pointer("/artifact/name")
            .and_then(Value::as_str)
            .unwrap_or("?");
        writeln!(out, "  [{}] artifact {name}", seq(u))?;
    } else if r.get("message").is_some() {
        writeln!(
            out,
            "  message: {}",
            r.get("message").map(message_text).unwrap_or_default()
        )?;
    }
    Ok(None)
}
