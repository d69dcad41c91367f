//! The callee side: a [`TaskExecutor`] that forwards each delegation to a
//! local A2A 1.0 server, so any A2A server can be reached through the relay
//! unchanged.
//!
//! Per delegation: resolve the server's agent card (cached), pick its first
//! JSON-RPC 1.0 interface, send the caller's message with
//! `SendStreamingMessage` (or a blocking `SendMessage` when the card does
//! not stream), and map the server's events onto the [`EventSink`]:
//! status updates become `status` events, artifact updates `artifact`
//! events. The turn ends at a terminal state (the [`Execution`] is built
//! from it) or at an interrupted one: then the driver waits for the
//! caller's follow-up message (sent with the server's task id) or a cancel,
//! at most [`DriverOptions::input_timeout`]: a caller that never answers
//! does not hold the callee's concurrency slot until the deadline. When the
//! wait runs out the driver cancels the server's task and the delegation
//! ends `failed` ("limit exceeded: input_timeout ...").
//! A stream that drops mid-task is resumed with `SubscribeToTask` (and
//! `GetTask` once the task is finished). When `run.cancel` fires the driver
//! sends `CancelTask` and waits a bounded time for the server's terminal.
//!
//! Plain HTTP only (the server is on loopback; no TLS code is linked in).
//!
//! Never: sends the terminal or signs anything: it returns an [`Execution`],
//! and the callee runtime signs the result and appends the terminal. Never
//! forwards the caller's signed envelope to the local server: the server gets
//! the task's message, with the effective authority in its metadata.

use parking_lot::Mutex;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use futures_util::StreamExt as _;
use serde_json::{Map, Value, json};
use tracing::{debug, warn};

use super::model::{TaskState, artifact_from_a2a, fresh_id, normalise_message};
use super::profile::PROFILE_URI;
use super::{PROTOCOL_BINDING, PROTOCOL_VERSION};
use crate::callee::{EventSink, Execution, StopReason, TaskExecutor, TaskRun};
use crate::profile::{Artifact, Usage};

/// Idle connections to the local server kept for reuse; more are closed
/// when they fall idle. About the callee's usual concurrency.
const MAX_IDLE_CONNECTIONS: usize = 16;
/// An idle connection to the local server is closed after this.
const IDLE_CONNECTION_TIMEOUT: Duration = Duration::from_secs(30);
/// After the terminal event of a stream, how long the driver reads on until
/// the server ends the response, so the connection goes back to the pool
/// instead of being closed (a server ends the stream right after the
/// terminal). Past this, or past [`TERMINAL_DRAIN_MAX_BYTES`], the
/// connection is closed, as before.
const TERMINAL_DRAIN: Duration = Duration::from_millis(200);
/// At most this many bytes are read after the terminal event of a stream.
const TERMINAL_DRAIN_MAX_BYTES: usize = 64 << 10;

/// Where the local A2A server is and how to talk to it.
#[derive(Debug, Clone)]
pub struct DriverOptions {
    /// The server's base URL (`http://127.0.0.1:9999`): its card is at
    /// `<url>/.well-known/agent-card.json`. A URL ending in `.json` is taken
    /// as the card's own URL.
    pub url: String,
    /// Bound on connecting to the server.
    pub connect_timeout: Duration,
    /// Bound on unary calls (card, `GetTask`, `CancelTask`).
    pub request_timeout: Duration,
    /// After `CancelTask`, how long to wait for the server's terminal.
    pub cancel_grace: Duration,
    /// How many times a dropped stream is resumed per turn.
    pub resubscribe_attempts: u32,
    /// How long a resolved card is reused.
    pub card_ttl: Duration,
    /// How long a task in `input-required` (or `auth-required`) waits for
    /// the caller's follow-up before the delegation ends `failed`, its
    /// concurrency slot freed. Default [`DriverOptions::DEFAULT_INPUT_TIMEOUT`].
    pub input_timeout: Duration,
}

impl DriverOptions {
    /// Default wait for the caller's answer to `input-required`: two
    /// minutes, time for a person at an A2A client to answer, short enough
    /// that abandoned tasks free their slots long before a typical deadline.
    pub const DEFAULT_INPUT_TIMEOUT: Duration = Duration::from_secs(120);

    /// Defaults for a server at `url`.
    pub fn new(url: impl Into<String>) -> Self {
        DriverOptions {
            url: url.into(),
            connect_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(30),
            cancel_grace: Duration::from_secs(10),
            resubscribe_attempts: 5,
            card_ttl: Duration::from_secs(60),
            input_timeout: Self::DEFAULT_INPUT_TIMEOUT,
        }
    }
}

/// Why the driver could not talk to the local server.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DriverError {
    /// The URL is not a plain `http://` URL.
    #[error("the A2A server URL {0:?} must start with http://")]
    Url(String),
    /// Transport failure.
    #[error("HTTP: {0}")]
    Http(String),
    /// The card is missing, malformed, or has no JSON-RPC 1.0 interface.
    #[error("agent card: {0}")]
    Card(String),
    /// The server answered with a JSON-RPC error.
    #[error("the A2A server answered {code}: {message}")]
    Rpc {
        /// The JSON-RPC error code.
        code: i64,
        /// Its message.
        message: String,
    },
    /// The server's answer is not valid A2A 1.0.
    #[error("invalid answer from the A2A server: {0}")]
    Protocol(String),
}

#[derive(Debug, Clone)]
struct ResolvedCard {
    card: Value,
    rpc_url: String,
    tenant: Option<String>,
    streaming: bool,
}

#[derive(Debug)]
struct DriverInner {
    http: reqwest::Client,
    options: DriverOptions,
    card: Mutex<Option<(Instant, ResolvedCard)>>,
}

/// The A2A driver. Cheap to clone.
#[derive(Debug, Clone)]
pub struct A2aDriver {
    inner: Arc<DriverInner>,
}

impl A2aDriver {
    /// A driver for the server at `options.url`.
    pub fn new(options: DriverOptions) -> Result<Self, DriverError> {
        if !options.url.starts_with("http://") {
            return Err(DriverError::Url(options.url));
        }
        let http = reqwest::Client::builder()
            .connect_timeout(options.connect_timeout)
            .pool_max_idle_per_host(MAX_IDLE_CONNECTIONS)
            .pool_idle_timeout(IDLE_CONNECTION_TIMEOUT)
            .build()
            .map_err(|e| DriverError::Http(e.to_string()))?;
        Ok(A2aDriver {
            inner: Arc::new(DriverInner {
                http,
                options,
                card: Mutex::new(None),
            }),
        })
    }

    /// The local server's agent card as it serves it: publish it with
    /// [`crate::Connector::publish`] so callers' facades can show it.
    pub async fn agent_card(&self) -> Result<Value, DriverError> {
        Ok(self.inner.resolve(true).await?.card)
    }
}

/// First pause between attempts of [`publish_card`].
const PUBLISH_RETRY_INITIAL: Duration = Duration::from_secs(1);
/// Longest pause between attempts of [`publish_card`]: a local A2A server
/// that comes up later is published within this.
const PUBLISH_RETRY_MAX: Duration = Duration::from_secs(30);

/// Publishes the local A2A server's card through `connector` (its callers'
/// facades then show it instead of a stand-in), retrying with backoff
/// ([`PUBLISH_RETRY_INITIAL`] doubling to [`PUBLISH_RETRY_MAX`]) while the
/// server cannot be read or the relay does not take it: a connector started
/// before its A2A server publishes the card once the server answers.
/// Returns once the card is published; the first failure is logged as a
/// warning, the following ones at debug.
pub async fn publish_card(connector: &crate::Connector, driver: &A2aDriver) {
    let mut pause = PUBLISH_RETRY_INITIAL;
    let mut failures = 0u64;
    loop {
        let failure = match driver.agent_card().await {
            Ok(card) => match connector.publish(&card).await {
                Ok(()) => {
                    tracing::info!(attempts = failures + 1, "agent card published");
                    return;
                }
                Err(e) => format!("the relay did not take it: {e}"),
            },
            Err(e) => format!("could not read the local A2A server's card: {e}"),
        };
        failures += 1;
        if failures == 1 {
            tracing::warn!(error = %failure, retry_in_ms = pause.as_millis(), "agent card not published yet; retrying until it is");
        } else {
            tracing::debug!(error = %failure, attempts = failures, "agent card still not published");
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(PUBLISH_RETRY_MAX);
    }
}

impl TaskExecutor for A2aDriver {
    fn execute(&self, run: TaskRun) -> Pin<Box<dyn Future<Output = Execution> + Send + 'static>> {
        let inner = self.inner.clone();
        Box::pin(async move { inner.run(run).await })
    }
}

/// How one exchange with the server ended.
enum TurnEnd {
    /// The task reached a terminal state.
    Terminal(TaskState, Option<Value>),
    /// The task waits for the client.
    Interrupted,
    /// The server answered with a message, no task.
    Message(Value),
    /// The stream ended early; resume it.
    Dropped,
    /// The exchange failed.
    Failed(String),
}

/// What the driver knows about the server's task.
#[derive(Debug, Default)]
struct Session {
    task_id: Option<String>,
    context_id: Option<String>,
    state: Option<TaskState>,
    artifacts: Vec<Artifact>,
    /// Artifact ids already sent up.
    sent: std::collections::HashSet<String>,
    cancel_sent: bool,
    /// The grace ran out before the server confirmed the cancel.
    cancel_unconfirmed: bool,
}

/// A cancel under way during a streaming turn.
struct CancelInFlight<'a> {
    /// The end of `cancel_grace`.
    until: tokio::time::Instant,
    /// The `CancelTask` call, once the server's task id is known.
    call: Option<Pin<Box<dyn Future<Output = Option<Value>> + Send + 'a>>>,
    /// What it answered.
    answer: Option<Value>,
}

/// SSE framing: splits a byte stream into events (`event:` name, joined
/// `data:` lines).
#[derive(Default)]
pub(crate) struct SseParser {
    buf: BytesMut,
}

pub(crate) struct SseEvent {
    pub(crate) name: String,
    pub(crate) data: String,
}

impl SseParser {
    /// Largest event accepted (the server is local, but bounds are bounds).
    const MAX_EVENT: usize = 16 << 20;

    pub(crate) fn push(&mut self, chunk: &Bytes) -> Result<Vec<SseEvent>, String> {
        self.buf.extend_from_slice(chunk);
        let mut out = Vec::new();
        loop {
            let text = &self.buf[..];
            let end = find_blank_line(text);
            let Some((end, sep)) = end else {
                if self.buf.len() > Self::MAX_EVENT {
                    return Err("an SSE event is larger than 16 MiB".into());
                }
                return Ok(out);
            };
            let raw = self.buf.split_to(end + sep);
            let block = String::from_utf8_lossy(&raw[..end]);
            let mut name = String::from("message");
            let mut data: Vec<&str> = Vec::new();
            for line in block.lines() {
                if line.starts_with(':') {
                    continue;
                }
                let (k, v) = line.split_once(':').unwrap_or((line, ""));
                let v = v.strip_prefix(' ').unwrap_or(v);
                match k {
                    "event" => name = v.to_string(),
                    "data" => data.push(v),
                    _ => {}
                }
            }
            if !data.is_empty() {
                out.push(SseEvent {
                    name,
                    data: data.join("\n"),
                });
            }
        }
    }
}

/// Reads what is left of a stream after its terminal event (see
/// [`TERMINAL_DRAIN`]), so hyper can reuse the connection.
async fn drain_after_terminal<S>(body: &mut std::pin::Pin<&mut S>)
where
    S: futures_util::Stream<Item = reqwest::Result<Bytes>>,
{
    let drain = async {
        let mut read = 0usize;
        while let Some(Ok(chunk)) = body.next().await {
            read = read.saturating_add(chunk.len());
            if read > TERMINAL_DRAIN_MAX_BYTES {
                return;
            }
        }
    };
    let _ = tokio::time::timeout(TERMINAL_DRAIN, drain).await;
}

fn find_blank_line(b: &[u8]) -> Option<(usize, usize)> {
    let mut i = 0;
    while i + 1 < b.len() {
        if b[i] == b'\n' && b[i + 1] == b'\n' {
            return Some((i, 2));
        }
        if b[i] == b'\r' && b.get(i + 1..i + 4) == Some(b"\n\r\n") {
            return Some((i, 4));
        }
        i += 1;
    }
    None
}

fn rpc_body(method: &str, mut params: Map<String, Value>, tenant: Option<&str>) -> Value {
    if let Some(t) = tenant {
        params.insert("tenant".into(), json!(t));
    }
    json!({ "jsonrpc": "2.0", "id": fresh_id("rpc"), "method": method, "params": params })
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

/// A message from the server, ready to go up: its ids are the server's,
/// which mean nothing to the caller, so they are removed.
fn upward_message(m: Option<&Value>) -> Option<Value> {
    m.and_then(|m| normalise_message(m, "ROLE_AGENT"))
}

fn text_of(m: Option<&Value>) -> Option<String> {
    let t = super::model::message_text(m?);
    (!t.is_empty()).then_some(t)
}

impl DriverInner {
    fn card_url(&self) -> String {
        let u = self.options.url.trim_end_matches('/');
        if u.ends_with(".json") {
            u.to_string()
        } else {
            format!("{u}/.well-known/agent-card.json")
        }
    }

    async fn resolve(&self, fresh: bool) -> Result<ResolvedCard, DriverError> {
        if !fresh
            && let Some((at, c)) = self.card.lock().as_ref()
            && at.elapsed() < self.options.card_ttl
        {
            return Ok(c.clone());
        }
        let resp = self
            .http
            .get(self.card_url())
            .timeout(self.options.request_timeout)
            .send()
            .await
            .map_err(|e| DriverError::Http(e.to_string()))?;
        if !resp.status().is_success() {
            return Err(DriverError::Card(format!("HTTP {}", resp.status())));
        }
        let card: Value = resp
            .json()
            .await
            .map_err(|e| DriverError::Card(e.to_string()))?;
        let iface = card
            .get("supportedInterfaces")
            .and_then(Value::as_array)
            .and_then(|list| {
                list.iter().find(|i| {
                    i.get("protocolBinding").and_then(Value::as_str) == Some(PROTOCOL_BINDING)
                        && i.get("protocolVersion")
                            .and_then(Value::as_str)
                            .is_some_and(|v| v == PROTOCOL_VERSION || v.starts_with("1.0."))
                })
            })
            .ok_or_else(|| DriverError::Card("no JSON-RPC interface for protocol 1.0".into()))?;
        let rpc_url = iface
            .get("url")
            .and_then(Value::as_str)
            .filter(|u| u.starts_with("http://"))
            .ok_or_else(|| DriverError::Card("the JSON-RPC interface has no http:// url".into()))?
            .to_string();
        let resolved = ResolvedCard {
            rpc_url,
            tenant: iface
                .get("tenant")
                .and_then(Value::as_str)
                .filter(|t| !t.is_empty())
                .map(str::to_string),
            streaming: card
                .pointer("/capabilities/streaming")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            card,
        };
        *self.card.lock() = Some((Instant::now(), resolved.clone()));
        Ok(resolved)
    }

    fn post(&self, card: &ResolvedCard, body: &Value, stream: bool) -> reqwest::RequestBuilder {
        let req = self
            .http
            .post(&card.rpc_url)
            .header("A2A-Version", PROTOCOL_VERSION)
            .json(body);
        if stream {
            req.header(reqwest::header::ACCEPT, "text/event-stream")
        } else {
            req.header(reqwest::header::ACCEPT, "application/json")
                .timeout(self.options.request_timeout)
        }
    }

    async fn unary(
        &self,
        card: &ResolvedCard,
        method: &str,
        params: Map<String, Value>,
    ) -> Result<Value, DriverError> {
        let body = rpc_body(method, params, card.tenant.as_deref());
        let resp = self
            .post(card, &body, false)
            .send()
            .await
            .map_err(|e| DriverError::Http(e.to_string()))?;
        let v: Value = resp
            .json()
            .await
            .map_err(|e| DriverError::Protocol(e.to_string()))?;
        if let Some(e) = rpc_error(&v) {
            return Err(e);
        }
        v.get("result")
            .cloned()
            .ok_or_else(|| DriverError::Protocol("a response without result".into()))
    }

    /// The first message to the server: the caller's A2A message when the
    /// request came through a facade (its `messageId`, parts and metadata
    /// kept; ids the server did not make removed), else the task text.
    /// `metadata[profile]` carries the effective authority, for information.
    fn first_message(run: &TaskRun) -> Value {
        let task = &run.request.task;
        let mut m = match task.a2a_message.as_ref().and_then(Value::as_object) {
            Some(o) => o.clone(),
            None => {
                let mut parts = vec![json!({ "text": task.text })];
                if !task.context.is_empty() {
                    parts.push(json!({ "data": Value::Object(task.context.clone()) }));
                }
                let mut o = Map::new();
                o.insert("parts".into(), Value::Array(parts));
                o
            }
        };
        m.remove("taskId");
        m.remove("contextId");
        m.insert("role".into(), json!("ROLE_USER"));
        if m.get("messageId")
            .and_then(Value::as_str)
            .is_none_or(str::is_empty)
        {
            m.insert("messageId".into(), json!(fresh_id("msg")));
        }
        let a = &run.authority;
        let mut meta = m
            .get("metadata")
            .and_then(Value::as_object)
            .cloned()
            .unwrap_or_default();
        meta.insert(
            PROFILE_URI.into(),
            json!({
                "requestId": run.key.request_id.as_str(),
                "caller": run.key.caller.as_str(),
                "capabilities": a.capabilities,
                "readOnly": a.read_only,
                "depth": a.depth,
                "deadlineMs": a.deadline_ms,
                "budgets": {
                    "tokens": a.budgets.tokens,
                    "costMicros": a.budgets.cost_micros,
                    "risk": a.budgets.risk,
                    "outputBytes": a.budgets.output_bytes,
                },
            }),
        );
        m.insert("metadata".into(), Value::Object(meta));
        Value::Object(m)
    }

    async fn run(self: Arc<Self>, mut run: TaskRun) -> Execution {
        let card = match self.resolve(false).await {
            Ok(c) => c,
            Err(e) => {
                warn!(error = %e, "the local A2A server is not reachable");
                return Execution::stopped(StopReason::Error(format!("local A2A server: {e}")));
            }
        };
        let mut s = Session::default();
        let mut outgoing = Some(Self::first_message(&run));
        let mut resumes = 0u32;
        loop {
            let end = self.turn(&card, &mut s, outgoing.take(), &run).await;
            match end {
                TurnEnd::Terminal(state, message) => {
                    return self.execution(&run, s, state, message);
                }
                TurnEnd::Message(m) => {
                    return Execution {
                        stop: StopReason::EndTurn,
                        output: Some(
                            json!({ "a2a": { "kind": "message", "state": TaskState::Completed.as_str(), "message": upward_message(Some(&m)) } }),
                        ),
                        artifacts: Vec::new(),
                        side_effects: Vec::new(),
                        usage: Usage::default(),
                    };
                }
                TurnEnd::Failed(reason) => {
                    let mut e = self.execution(&run, s, TaskState::Failed, None);
                    e.stop = StopReason::Error(reason);
                    return e;
                }
                TurnEnd::Dropped => {
                    resumes += 1;
                    if s.task_id.is_none() || resumes > self.options.resubscribe_attempts {
                        let mut e = self.execution(&run, s, TaskState::Failed, None);
                        e.stop = StopReason::Error("lost the local A2A server's stream".into());
                        return e;
                    }
                    // Bounded backoff before resuming a dropped stream.
                    let pause = Duration::from_millis(100 * u64::from(resumes));
                    tokio::select! {
                        () = tokio::time::sleep(pause) => {}
                        () = run.cancel.cancelled() => {}
                    }
                }
                TurnEnd::Interrupted => {
                    resumes = 0;
                    let waited = self.options.input_timeout;
                    tokio::select! {
                        () = tokio::time::sleep(waited) => {
                            warn!(waited_ms = waited.as_millis() as u64, "no follow-up from the caller in time; cancelling the local task");
                            let (state, message) = self.cancel_now(&card, &mut s, &run).await;
                            let mut e = self.execution(&run, s, state, message);
                            e.stop = StopReason::LimitExceeded(format!(
                                "input_timeout: no follow-up message within {} ms",
                                waited.as_millis()
                            ));
                            return e;
                        }
                        m = run.messages.recv() => match m {
                            Some(m) => outgoing = Some(Self::follow_up(&s, m)),
                            None => {
                                let mut e = self.execution(&run, s, TaskState::Failed, None);
                                e.stop = StopReason::Error("the delegation ended while input was required".into());
                                return e;
                            }
                        },
                        () = run.cancel.cancelled() => {
                            let (state, message) = self.cancel_now(&card, &mut s, &run).await;
                            return self.execution(&run, s, state, message);
                        }
                    }
                }
            }
        }
    }

    fn follow_up(s: &Session, m: Value) -> Value {
        let mut o = m.as_object().cloned().unwrap_or_default();
        if let Some(t) = &s.task_id {
            o.insert("taskId".into(), json!(t));
        }
        match &s.context_id {
            Some(c) => {
                o.insert("contextId".into(), json!(c));
            }
            None => {
                o.remove("contextId");
            }
        }
        o.insert("role".into(), json!("ROLE_USER"));
        if !o.get("messageId").is_some_and(Value::is_string) {
            o.insert("messageId".into(), json!(fresh_id("msg")));
        }
        if !o.get("parts").is_some_and(Value::is_array) {
            o.insert("parts".into(), json!([{ "text": "" }]));
        }
        Value::Object(o)
    }

    /// Cancels the server's task when no stream is open (the task waits
    /// for input, or the server does not stream) and waits (bounded) for its
    /// terminal. Returns the final state and status message.
    async fn cancel_now(
        &self,
        card: &ResolvedCard,
        s: &mut Session,
        run: &TaskRun,
    ) -> (TaskState, Option<Value>) {
        match self.settle_cancel(card, s, run, None).await {
            TurnEnd::Terminal(state, message) => (state, message),
            _ => (TaskState::Canceled, None),
        }
    }

    /// `CancelTask` for the server's task: the task it answers with, or
    /// (when the task is no longer cancelable) the task as `GetTask` reads
    /// it; `None` when neither answered.
    async fn cancel_call(&self, card: &ResolvedCard, task_id: String) -> Option<Value> {
        let mut p = Map::new();
        p.insert("id".into(), json!(task_id));
        match self.unary(card, "CancelTask", p).await {
            Ok(t) => Some(t),
            Err(DriverError::Rpc { code: -32002, .. }) => self.get_task(card, &task_id).await.ok(),
            Err(e) => {
                warn!(error = %e, "CancelTask failed");
                None
            }
        }
    }

    /// Waits for `next` (the server's response, or the next chunk of its
    /// stream) while watching `run.cancel`. Once the cancel fired,
    /// `CancelTask` is sent as soon as the server's task id is known and
    /// runs alongside the stream, which keeps being read: everything the
    /// server streams before its terminal still goes up. `None` when
    /// `cancel_grace` ran out first.
    async fn next_watching_cancel<'a, F: Future + Unpin>(
        &'a self,
        card: &'a ResolvedCard,
        s: &mut Session,
        run: &TaskRun,
        cancel: &mut Option<CancelInFlight<'a>>,
        next: &mut F,
    ) -> Option<F::Output> {
        loop {
            if run.cancel.is_cancelled() {
                let c = cancel.get_or_insert_with(|| CancelInFlight {
                    until: tokio::time::Instant::now() + self.options.cancel_grace,
                    call: None,
                    answer: None,
                });
                if !s.cancel_sent
                    && let Some(id) = s.task_id.clone()
                {
                    s.cancel_sent = true;
                    c.call = Some(Box::pin(self.cancel_call(card, id)));
                }
            }
            let until = cancel.as_ref().map(|c| c.until);
            let call = cancel.as_mut().and_then(|c| c.call.as_mut());
            // Unbiased: a server that keeps streaming cannot hold off the
            // cancel's answer or the end of the grace.
            tokio::select! {
                item = &mut *next => return Some(item),
                answer = async {
                    match call {
                        Some(call) => call.await,
                        None => std::future::pending().await,
                    }
                } => {
                    if let Some(c) = cancel.as_mut() {
                        c.call = None;
                        c.answer = answer;
                    }
                }
                () = run.cancel.cancelled(), if until.is_none() => {}
                () = async {
                    match until {
                        Some(until) => tokio::time::sleep_until(until).await,
                        None => std::future::pending().await,
                    }
                } => return None,
            }
        }
    }

    /// Ends a cancelled turn whose stream gave no terminal (it ended, broke,
    /// or the grace ran out): sends `CancelTask` if it was not sent yet,
    /// takes its answer (bounded), and polls `GetTask` until the server's
    /// task is terminal or the grace ends. A task the server never
    /// confirmed within the grace is reported `canceled` and marked so in
    /// the execution's output (`cancelConfirmed: false`): what the server
    /// emits after that is not forwarded.
    async fn settle_cancel(
        &self,
        card: &ResolvedCard,
        s: &mut Session,
        run: &TaskRun,
        cancel: Option<CancelInFlight<'_>>,
    ) -> TurnEnd {
        let (until, call, answer) = match cancel {
            Some(c) => (c.until, c.call, c.answer),
            None => (
                tokio::time::Instant::now() + self.options.cancel_grace,
                None,
                None,
            ),
        };
        let mut task = match (answer, call) {
            (Some(a), _) => Some(a),
            (None, Some(call)) => tokio::time::timeout_at(until, call).await.ok().flatten(),
            (None, None) => match s.task_id.clone() {
                Some(id) if !s.cancel_sent => {
                    s.cancel_sent = true;
                    tokio::time::timeout_at(until, self.cancel_call(card, id))
                        .await
                        .ok()
                        .flatten()
                }
                _ => None,
            },
        };
        s.cancel_sent = true;
        let Some(task_id) = s.task_id.clone() else {
            // The server never named a task: nothing runs there to stop.
            return TurnEnd::Terminal(TaskState::Canceled, None);
        };
        loop {
            let state = task
                .as_ref()
                .and_then(|t| t.pointer("/status/state"))
                .and_then(Value::as_str)
                .and_then(TaskState::parse);
            if let (Some(st), Some(t)) = (state, &task)
                && st.is_terminal()
            {
                self.absorb_artifacts(s, t, &run.sink).await;
                return TurnEnd::Terminal(st, t.pointer("/status/message").cloned());
            }
            if tokio::time::Instant::now() >= until {
                warn!("the local A2A server did not confirm the cancel in time");
                s.cancel_unconfirmed = true;
                return TurnEnd::Terminal(TaskState::Canceled, None);
            }
            // Poll the server's task at a bounded rate until the grace ends.
            tokio::time::sleep(Duration::from_millis(100)).await;
            task = self.get_task(card, &task_id).await.ok();
        }
    }

    async fn get_task(&self, card: &ResolvedCard, id: &str) -> Result<Value, DriverError> {
        let mut p = Map::new();
        p.insert("id".into(), json!(id));
        self.unary(card, "GetTask", p).await
    }

    /// Sends the task's artifacts not sent up yet.
    async fn absorb_artifacts(&self, s: &mut Session, task: &Value, sink: &EventSink) {
        let arts = task
            .get("artifacts")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        for a in arts {
            if let Some(art) = artifact_from_a2a(&a)
                && !s.sent.contains(&art.artifact_id)
            {
                s.sent.insert(art.artifact_id.clone());
                merge(&mut s.artifacts, &art, false);
                if let Err(e) = sink.artifact(art, false, true).await {
                    debug!(error = %e, "artifact not sent up");
                }
            }
        }
    }

    /// One exchange: sends `outgoing` (or resubscribes when `None`) and
    /// consumes the answer until the turn ends.
    async fn turn(
        &self,
        card: &ResolvedCard,
        s: &mut Session,
        outgoing: Option<Value>,
        run: &TaskRun,
    ) -> TurnEnd {
        if !card.streaming {
            return self.blocking_turn(card, s, outgoing, run).await;
        }
        let body = match (&outgoing, &s.task_id) {
            (Some(m), _) => {
                let mut p = Map::new();
                p.insert("message".into(), m.clone());
                rpc_body("SendStreamingMessage", p, card.tenant.as_deref())
            }
            (None, Some(id)) => {
                let mut p = Map::new();
                p.insert("id".into(), json!(id));
                rpc_body("SubscribeToTask", p, card.tenant.as_deref())
            }
            (None, None) => return TurnEnd::Failed("nothing to resume".into()),
        };
        let mut cancel = None;
        let resubscribe = outgoing.is_none();
        // A message to a task the server already has: the answer to an
        // interrupted state.
        let follow_up = outgoing.is_some() && s.task_id.is_some();
        let end = self
            .stream_turn(card, s, &body, resubscribe, follow_up, run, &mut cancel)
            .await;
        match end {
            TurnEnd::Terminal(..) | TurnEnd::Message(_) => {
                // The stream gave the terminal: let a `CancelTask` still
                // under way finish (bounded) rather than cut it off.
                if let Some(CancelInFlight {
                    until,
                    call: Some(call),
                    ..
                }) = cancel
                {
                    let _ = tokio::time::timeout_at(until, call).await;
                }
                end
            }
            // The cancel is under way and the stream gave no terminal.
            _ if cancel.is_some() => self.settle_cancel(card, s, run, cancel).await,
            end => end,
        }
    }

    /// Posts `body` and consumes the server's answer (an SSE stream, or one
    /// JSON response) until the turn ends. The cancel never cuts the
    /// stream short: see [`DriverInner::next_watching_cancel`].
    ///
    /// On a `follow_up` turn, a leading `task` event still in the
    /// interrupted state the follow-up answers is the server's stored task
    /// (the JavaScript SDK starts every stream with one, follow-ups
    /// included): it is not a new state, so it is neither sent up nor ends
    /// the turn; its artifacts are taken. A leading task in another state is
    /// an ordinary event.
    #[allow(clippy::too_many_arguments)]
    async fn stream_turn<'a>(
        &'a self,
        card: &'a ResolvedCard,
        s: &mut Session,
        body: &Value,
        resubscribe: bool,
        follow_up: bool,
        run: &TaskRun,
        cancel: &mut Option<CancelInFlight<'a>>,
    ) -> TurnEnd {
        let send = self.post(card, body, true).send();
        tokio::pin!(send);
        let Some(resp) = self
            .next_watching_cancel(card, s, run, cancel, &mut send)
            .await
        else {
            return TurnEnd::Dropped;
        };
        let resp = match resp {
            Ok(r) => r,
            Err(e) if resubscribe => {
                debug!(error = %e, "resubscribe failed");
                return TurnEnd::Dropped;
            }
            Err(e) => return TurnEnd::Failed(format!("local A2A server: {e}")),
        };
        let is_sse = resp
            .headers()
            .get(reqwest::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("text/event-stream"));
        if !is_sse {
            let v: Value = match resp.json().await {
                Ok(v) => v,
                Err(e) => return TurnEnd::Failed(format!("local A2A server: {e}")),
            };
            return match rpc_error(&v) {
                // The task finished: resubscribing is refused; read it.
                Some(DriverError::Rpc { code: -32004, .. }) if resubscribe => {
                    self.finished(card, s, run).await
                }
                Some(e) => TurnEnd::Failed(e.to_string()),
                None => match v.get("result") {
                    Some(r) => self
                        .on_result(s, r, &run.sink)
                        .await
                        .unwrap_or(TurnEnd::Dropped),
                    None => TurnEnd::Failed("invalid answer from the local A2A server".into()),
                },
            };
        }
        let body = resp.bytes_stream();
        tokio::pin!(body);
        let mut parser = SseParser::default();
        let mut interrupted = false;
        let mut leading = follow_up;
        loop {
            let mut next = body.next();
            let Some(chunk) = self
                .next_watching_cancel(card, s, run, cancel, &mut next)
                .await
            else {
                // The grace ran out before the server's terminal.
                return TurnEnd::Dropped;
            };
            let chunk = match chunk {
                Some(Ok(c)) => c,
                Some(Err(e)) => {
                    debug!(error = %e, "stream from the local A2A server broke");
                    return if interrupted {
                        TurnEnd::Interrupted
                    } else {
                        TurnEnd::Dropped
                    };
                }
                None => {
                    return if interrupted {
                        TurnEnd::Interrupted
                    } else {
                        TurnEnd::Dropped
                    };
                }
            };
            let events = match parser.push(&chunk) {
                Ok(e) => e,
                Err(e) => return TurnEnd::Failed(e),
            };
            for ev in events {
                let v: Value = match serde_json::from_str(&ev.data) {
                    Ok(v) => v,
                    Err(e) => {
                        return TurnEnd::Failed(format!(
                            "invalid SSE data from the local A2A server: {e}"
                        ));
                    }
                };
                if let Some(e) = rpc_error(&v)
                    && (ev.name == "error" || v.get("result").is_none())
                {
                    return TurnEnd::Failed(e.to_string());
                }
                let Some(result) = v.get("result") else {
                    return TurnEnd::Failed("an SSE event without result".into());
                };
                if std::mem::take(&mut leading)
                    && let Some(task) = result.get("task")
                    && self.on_snapshot(s, task, &run.sink).await
                {
                    continue;
                }
                match self.on_result(s, result, &run.sink).await {
                    Some(TurnEnd::Interrupted) => interrupted = true,
                    Some(end) => {
                        drain_after_terminal(&mut body).await;
                        return end;
                    }
                    None => {}
                }
            }
        }
    }

    /// A server that does not stream: one blocking `SendMessage` per turn.
    async fn blocking_turn(
        &self,
        card: &ResolvedCard,
        s: &mut Session,
        outgoing: Option<Value>,
        run: &TaskRun,
    ) -> TurnEnd {
        let Some(m) = outgoing else {
            return match &s.task_id {
                Some(_) => self.finished(card, s, run).await,
                None => TurnEnd::Failed("nothing to resume".into()),
            };
        };
        let mut p = Map::new();
        p.insert("message".into(), m);
        let body = rpc_body("SendMessage", p, card.tenant.as_deref());
        let req = self
            .http
            .post(&card.rpc_url)
            .header("A2A-Version", PROTOCOL_VERSION)
            .json(&body);
        let resp = tokio::select! {
            r = req.send() => r,
            () = run.cancel.cancelled() => {
                let (state, message) = self.cancel_now(card, s, run).await;
                return TurnEnd::Terminal(state, message);
            }
        };
        let v: Value = match resp {
            Ok(r) => match r.json().await {
                Ok(v) => v,
                Err(e) => return TurnEnd::Failed(format!("local A2A server: {e}")),
            },
            Err(e) => return TurnEnd::Failed(format!("local A2A server: {e}")),
        };
        if let Some(e) = rpc_error(&v) {
            return TurnEnd::Failed(e.to_string());
        }
        match v.get("result") {
            // Still running (the server returned early): follow it.
            Some(r) => self
                .on_result(s, r, &run.sink)
                .await
                .unwrap_or(TurnEnd::Dropped),
            None => TurnEnd::Failed("invalid answer from the local A2A server".into()),
        }
    }

    /// The task finished while the driver was not listening: read it.
    async fn finished(&self, card: &ResolvedCard, s: &mut Session, run: &TaskRun) -> TurnEnd {
        let Some(id) = s.task_id.clone() else {
            return TurnEnd::Failed("no task to read".into());
        };
        match self.get_task(card, &id).await {
            Ok(t) => {
                let mut wrapped = Map::new();
                wrapped.insert("task".into(), t);
                self.on_result(s, &Value::Object(wrapped), &run.sink)
                    .await
                    .unwrap_or(TurnEnd::Dropped)
            }
            Err(e) => TurnEnd::Failed(e.to_string()),
        }
    }

    /// Maps one StreamResponse (or SendMessageResponse) onto the sink.
    /// `Some` when the turn ends with it.
    async fn on_result(&self, s: &mut Session, r: &Value, sink: &EventSink) -> Option<TurnEnd> {
        if let Some(task) = r.get("task") {
            if let Some(id) = task.get("id").and_then(Value::as_str) {
                s.task_id = Some(id.to_string());
            }
            if let Some(c) = task.get("contextId").and_then(Value::as_str) {
                s.context_id = Some(c.to_string());
            }
            self.absorb_artifacts(s, task, sink).await;
            return self.on_status(s, task.get("status"), sink).await;
        }
        if let Some(u) = r.get("statusUpdate") {
            if s.task_id.is_none() {
                s.task_id = u.get("taskId").and_then(Value::as_str).map(str::to_string);
                s.context_id = u
                    .get("contextId")
                    .and_then(Value::as_str)
                    .map(str::to_string);
            }
            return self.on_status(s, u.get("status"), sink).await;
        }
        if let Some(u) = r.get("artifactUpdate") {
            let Some(art) = u.get("artifact").and_then(artifact_from_a2a) else {
                return Some(TurnEnd::Failed(
                    "an artifact update without a valid artifact".into(),
                ));
            };
            let append = u.get("append").and_then(Value::as_bool).unwrap_or(false);
            let last = u.get("lastChunk").and_then(Value::as_bool).unwrap_or(false);
            s.sent.insert(art.artifact_id.clone());
            merge(&mut s.artifacts, &art, append);
            if let Err(e) = sink.artifact(art, append, last).await {
                debug!(error = %e, "artifact not sent up");
            }
            return None;
        }
        if let Some(m) = r.get("message") {
            if s.task_id.is_none() {
                return Some(TurnEnd::Message(m.clone()));
            }
            // A message inside a task's stream: show it as progress.
            let state = s.state.unwrap_or(TaskState::Working);
            if let Err(e) = sink
                .status(state.as_str(), upward_message(Some(m)), None)
                .await
            {
                debug!(error = %e, "status not sent up");
            }
            return None;
        }
        Some(TurnEnd::Failed(
            "a result that is neither task, message, statusUpdate nor artifactUpdate".into(),
        ))
    }

    /// The leading task snapshot of a follow-up turn (see
    /// [`DriverInner::stream_turn`]): when it shows the interrupted state
    /// the follow-up answers, its ids and artifacts are taken and its state
    /// is not a new one (`true`). Any other state is news: `false`, and it
    /// is an ordinary event.
    async fn on_snapshot(&self, s: &mut Session, task: &Value, sink: &EventSink) -> bool {
        let state = task
            .get("status")
            .and_then(|st| st.get("state"))
            .and_then(Value::as_str)
            .and_then(TaskState::parse);
        match state {
            Some(st) if st.is_interrupted() && s.state == Some(st) => {}
            _ => return false,
        }
        if let Some(c) = task.get("contextId").and_then(Value::as_str) {
            s.context_id = Some(c.to_string());
        }
        self.absorb_artifacts(s, task, sink).await;
        debug!(
            "the follow-up's stream starts with the stored task, still interrupted; not a new state"
        );
        true
    }

    async fn on_status(
        &self,
        s: &mut Session,
        status: Option<&Value>,
        sink: &EventSink,
    ) -> Option<TurnEnd> {
        let status = status?;
        let state = status
            .get("state")
            .and_then(Value::as_str)
            .and_then(TaskState::parse)?;
        let message = status.get("message");
        // The caller's task starts submitted.
        let changed = s.state.unwrap_or(TaskState::Submitted) != state;
        s.state = Some(state);
        if state.is_terminal() {
            return Some(TurnEnd::Terminal(state, message.cloned()));
        }
        // A status that neither moves the state nor says anything (the
        // server's first task, still submitted) is no event for the caller:
        // a stream through the relay carries what a direct one does.
        if (changed || message.is_some())
            && let Err(e) = sink
                .status(state.as_str(), upward_message(message), None)
                .await
        {
            debug!(error = %e, "status not sent up");
        }
        // Input-required closes the server's stream; auth-required keeps it
        // open (SPEC §7.6.1), and its end then means the same.
        state.is_interrupted().then_some(TurnEnd::Interrupted)
    }

    /// The execution for a terminal state of the server's task.
    fn execution(
        &self,
        run: &TaskRun,
        s: Session,
        state: TaskState,
        message: Option<Value>,
    ) -> Execution {
        let text = text_of(message.as_ref());
        let stop = match state {
            TaskState::Completed => StopReason::EndTurn,
            TaskState::Canceled => StopReason::Cancelled,
            TaskState::Rejected => {
                StopReason::Rejected(text.unwrap_or_else(|| "the agent rejected the task".into()))
            }
            _ if run.cancel.is_cancelled() && s.cancel_sent => StopReason::Cancelled,
            _ => StopReason::Error(text.unwrap_or_else(|| "the agent's task failed".into())),
        };
        let mut output = json!({ "a2a": {
            "kind": "task",
            "state": state.as_str(),
            "message": upward_message(message.as_ref()),
            "taskId": s.task_id,
            "contextId": s.context_id,
        }});
        if s.cancel_unconfirmed
            && let Some(a2a) = output.get_mut("a2a").and_then(Value::as_object_mut)
        {
            a2a.insert("cancelConfirmed".into(), json!(false));
        }
        let mut artifacts = s.artifacts;
        let size = |v: &Value| serde_json::to_vec(v).map_or(0, |b| b.len() as u64);
        let mut bytes = size(&output)
            + artifacts
                .iter()
                .map(|a| serde_json::to_vec(a).map_or(0, |b| b.len() as u64))
                .sum::<u64>();
        let budget = run.authority.budgets.output_bytes;
        let (stop, output) = if bytes > budget {
            warn!(
                bytes,
                budget, "the local agent's output is over the output budget"
            );
            let reason = format!("output of {bytes} bytes is over the budget of {budget}");
            artifacts.clear();
            bytes = 0;
            (StopReason::LimitExceeded(reason), None)
        } else {
            (stop, Some(output))
        };
        Execution {
            stop,
            output,
            artifacts,
            side_effects: Vec::new(),
            usage: Usage {
                tokens: 0,
                cost_micros: 0,
                output_bytes: bytes,
            },
        }
    }
}

/// Merges an artifact (or chunk) into the result's artifacts: an appended
/// text chunk extends the text, an appended parts chunk extends the parts;
/// anything else replaces the artifact with the same id.
fn merge(list: &mut Vec<Artifact>, a: &Artifact, append: bool) {
    let Some(existing) = list.iter_mut().find(|x| x.artifact_id == a.artifact_id) else {
        list.push(a.clone());
        return;
    };
    if append {
        if let (Some(t), Some(more)) = (existing.text.as_mut(), a.text.as_ref()) {
            t.push_str(more);
            return;
        }
        let parts_of = |x: &Artifact| -> Vec<Value> {
            let v = super::model::artifact_to_a2a(x);
            v.get("parts")
                .and_then(Value::as_array)
                .cloned()
                .unwrap_or_default()
        };
        let mut parts = parts_of(existing);
        parts.extend(parts_of(a));
        let mut merged = super::model::artifact_to_a2a(existing);
        if let Some(o) = merged.as_object_mut() {
            o.insert("parts".into(), Value::Array(parts));
        }
        if let Some(m) = artifact_from_a2a(&merged) {
            *existing = m;
        }
        return;
    }
    *existing = a.clone();
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn sse_framing() {
        let mut p = SseParser::default();
        let evs = p
            .push(&Bytes::from_static(
                b": keep-alive\n\ndata: {\"a\":1}\n\nid: 3\ndata: x",
            ))
            .unwrap();
        assert_eq!(evs.len(), 1);
        assert_eq!(evs[0].data, "{\"a\":1}");
        let evs = p
            .push(&Bytes::from_static(
                b"\ndata: y\r\n\r\nevent: error\ndata: z\n\n",
            ))
            .unwrap();
        assert_eq!(evs.len(), 2);
        assert_eq!(evs[0].data, "x\ny");
        assert_eq!(evs[1].name, "error");
    }

    #[test]
    fn merging_chunks() {
        let text = |t: &str| Artifact {
            artifact_id: "a".into(),
            name: String::new(),
            media_type: "text/plain".into(),
            text: Some(t.into()),
            data: None,
            url: None,
        };
        let mut list = Vec::new();
        merge(&mut list, &text("chunk-1 "), true);
        merge(&mut list, &text("chunk-2"), true);
        assert_eq!(list, vec![text("chunk-1 chunk-2")]);
        merge(&mut list, &text("new"), false);
        assert_eq!(list, vec![text("new")]);
    }
}
