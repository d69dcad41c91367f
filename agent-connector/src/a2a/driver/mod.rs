//! The callee side: a [`TaskExecutor`] that forwards each delegation to a
//! local A2A 1.0 server, so any A2A server can be reached through the relay
//! unchanged.
//!
//! Per delegation: resolve the server's agent card (cached), pick its first
//! 1.0 interface the driver speaks, JSON-RPC or HTTP+JSON, in the card's
//! order of preference (or the binding [`DriverOptions::binding`] forces;
//! see `card.rs`), send the caller's message with
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
//! `GetTask` once the task is finished); the subscription's leading task
//! snapshot sends up only what the caller has not seen: the status messages
//! its history holds after the last one sent up, then its status unless it
//! is the last one sent up (see `UpStatus`), and the artifacts not sent
//! yet; the live events that repeat the snapshot are skipped (see
//! `snapshot.rs`). When
//! `run.cancel` fires the driver sends `CancelTask` and waits a bounded
//! time for the server's terminal.
//!
//! Both bindings behave alike: the wire format is in `transport.rs`
//! (`jsonrpc.rs`, `rest.rs`), which hands the turns StreamResponse objects
//! and maps each binding's errors onto [`DriverError::Rpc`] with the A2A
//! error's JSON-RPC code; everything else (folding events, follow-ups,
//! resubscribe, cancel, bounds) is written once, here.
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

use futures_util::StreamExt as _;
use oab_wire::TraceId;
use serde_json::{Map, Value, json};
use tracing::{debug, warn};

use super::model::{TaskState, artifact_from_a2a, fresh_id, normalise_message};
use super::profile::PROFILE_URI;
use crate::a2a::AgentBinding;
use crate::callee::{EventSink, Execution, StopReason, TaskExecutor, TaskRun};
use crate::profile::{Artifact, Usage};

mod call;
mod card;
mod jsonrpc;
mod reattach;
mod rest;
mod snapshot;
mod sse;
mod transport;

use call::Call;
use card::ResolvedCard;
pub(crate) use sse::SseParser;

/// Idle connections to the local server kept for reuse; more are closed
/// when they fall idle. About the callee's usual concurrency.
const MAX_IDLE_CONNECTIONS: usize = 16;
/// An idle connection to the local server is closed after this.
const IDLE_CONNECTION_TIMEOUT: Duration = Duration::from_secs(30);
/// After the terminal event of a stream, how long the driver reads on (in
/// the background: the terminal goes up at once) until the server ends the
/// response, so the connection goes back to the pool instead of being
/// closed (a server ends the stream right after the terminal). Past this, or past [`TERMINAL_DRAIN_MAX_BYTES`], the
/// connection is closed, as before.
const TERMINAL_DRAIN: Duration = Duration::from_millis(200);
/// At most this many bytes are read after the terminal event of a stream.
const TERMINAL_DRAIN_MAX_BYTES: usize = 64 << 10;

/// Reads what is left of a stream after its terminal event (see
/// [`TERMINAL_DRAIN`]), so the HTTP client can reuse the connection.
async fn drain_after_terminal<S>(mut body: std::pin::Pin<Box<S>>)
where
    S: futures_util::Stream<Item = reqwest::Result<bytes::Bytes>>,
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
    /// The binding to speak to the server. `None` (the default): the first
    /// interface of the card's `supportedInterfaces` (the server's order of
    /// preference) that is `JSONRPC` or `HTTP+JSON` with protocol version
    /// 1.0. `Some(b)`: the first 1.0 interface with binding `b`; a card
    /// without one fails with [`DriverError::NoInterface`].
    pub binding: Option<AgentBinding>,
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
            binding: None,
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
    /// The card is missing or malformed.
    #[error("agent card: {0}")]
    Card(String),
    /// The card offers no interface the driver can use: none with a binding
    /// it speaks (or the one [`DriverOptions::binding`] forces), protocol
    /// version 1.0 and an `http://` URL. Every delegation fails with it
    /// until the card offers one.
    #[error(
        "the agent card offers no interface the driver can use: wanted {wanted} for protocol 1.0 at an http:// url; the card offers {offered}"
    )]
    NoInterface {
        /// The bindings looked for.
        wanted: String,
        /// The card's interfaces (binding, version, url), at most 8.
        offered: String,
    },
    /// The server answered with an A2A error: a JSON-RPC error, or an
    /// HTTP+JSON error (google.rpc.Status) given the JSON-RPC code of the
    /// same A2A error.
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

    /// The binding the driver speaks to the local server, as chosen from
    /// its card (read now, or as cached for [`DriverOptions::card_ttl`]).
    pub async fn binding(&self) -> Result<AgentBinding, DriverError> {
        Ok(self.inner.resolve(false).await?.transport.binding())
    }
}

/// First pause between attempts of [`publish_card`].
const PUBLISH_RETRY_INITIAL: Duration = Duration::from_secs(1);
/// Longest pause between attempts of [`publish_card`]: a local A2A server
/// that comes up later is published within this.
const PUBLISH_RETRY_MAX: Duration = Duration::from_secs(30);

/// Publishes the local A2A server's card through `connector` (its callers'
/// facades then show it instead of a stand-in), retrying with backoff
/// (1 s doubling to 30 s) while the
/// server cannot be read or the relay does not take it: a connector started
/// before its A2A server publishes the card once the server answers.
/// Returns once the card is published; the first failure is logged as a
/// warning, the following ones at debug.
pub async fn publish_card(connector: &crate::Connector, driver: &A2aDriver) {
    let mut pause = PUBLISH_RETRY_INITIAL;
    let mut failures = 0u64;
    loop {
        let mut unusable = false;
        let failure = match driver.agent_card().await {
            Ok(card) => match connector.publish(&card).await {
                Ok(()) => {
                    tracing::info!(attempts = failures + 1, "agent card published");
                    return;
                }
                Err(e) => format!("the relay did not take it: {e}"),
            },
            Err(e) => {
                unusable = matches!(e, DriverError::NoInterface { .. });
                format!("could not read the local A2A server's card: {e}")
            }
        };
        failures += 1;
        if unusable && failures == 1 {
            tracing::error!(error = %failure, retry_in_ms = pause.as_millis(), "the local A2A server offers no interface the driver speaks: every delegation fails until its card offers one");
        } else if failures == 1 {
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
        let trace = TraceId::of_text(&run.request.parent.trace_id);
        Box::pin(transport::TRACE.scope(trace, async move { inner.run(run).await }))
    }

    fn reattach(
        &self,
        run: TaskRun,
        checkpoint: crate::reattach::Checkpoint,
    ) -> Option<Pin<Box<dyn Future<Output = Execution> + Send + 'static>>> {
        let saved = reattach::Saved::from_checkpoint(checkpoint)?;
        let inner = self.inner.clone();
        let trace = TraceId::of_text(&run.request.parent.trace_id);
        Some(Box::pin(
            transport::TRACE.scope(trace, async move { inner.resume(run, saved).await }),
        ))
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
    /// The agent's output passed the delegation's output budget
    /// (`Session::over_budget` says by how much): the turn ends at once.
    OverBudget,
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
    /// The last status sent up: a resumed stream's leading snapshot that
    /// repeats it is not sent again (see [`UpStatus::repeated_by`]). Replaced
    /// at every status sent up; dropped with the session.
    last_up: Option<UpStatus>,
    /// The id of the last status message sent up: after a re-attach, the
    /// agent's messages in the task's history after it were missed.
    last_message: Option<String>,
    /// A re-attach from a saved state that did not track `last_message`.
    history_unknown: bool,
    /// What the last resumed stream's snapshot held, until the stream
    /// passes it.
    overlap: Option<snapshot::Overlap>,
    cancel_sent: bool,
    /// The grace ran out before the server confirmed the cancel.
    cancel_unconfirmed: bool,
    /// Follow-up messages forwarded to the server (after a re-attach, the
    /// first this many the relay delivers again are not forwarded again).
    follow_ups: u64,
    /// Follow-ups still to skip after a re-attach.
    skip_follow_ups: u64,
    /// A re-attach checkpoint was saved (see [`crate::reattach`]).
    checkpointed: bool,
    /// Re-attached after a restart: say so once the server's stream of the
    /// task is followed again.
    announce: bool,
    /// The delegation's output budget in bytes (`budgets.output_bytes`).
    output_budget: u64,
    /// Bytes of artifacts taken so far (their A2A JSON), against
    /// `output_budget`.
    output_bytes: u64,
    /// Set once an artifact would pass the budget: why the task stops.
    over_budget: Option<String>,
}

/// A status as it was sent up, to recognise it in a resumed stream's
/// leading task snapshot.
#[derive(Debug, Clone, PartialEq)]
struct UpStatus {
    state: TaskState,
    /// The server's `messageId` of the status message, if it gave one.
    message_id: Option<String>,
    /// What the message says: the message without its ids.
    content: Option<Value>,
}

impl UpStatus {
    /// `state` with `message` as the server sent them.
    fn new(state: TaskState, message: Option<&Value>) -> Self {
        let message_id = message
            .and_then(|m| m.get("messageId"))
            .and_then(Value::as_str)
            .filter(|id| !id.is_empty())
            .map(str::to_string);
        let content = message.map(|m| {
            let mut m = m.clone();
            if let Some(o) = m.as_object_mut() {
                for id in ["messageId", "taskId", "contextId"] {
                    o.remove(id);
                }
            }
            m
        });
        UpStatus {
            state,
            message_id,
            content,
        }
    }

    /// Whether `other` is this status again: the same state and the same
    /// message, by `messageId` when both have one, else by content.
    fn repeated_by(&self, other: &UpStatus) -> bool {
        self.state == other.state
            && match (&self.message_id, &other.message_id) {
                (Some(a), Some(b)) => a == b,
                _ => self.content == other.content,
            }
    }
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

/// A message from the server, ready to go up: its ids are the server's,
/// which mean nothing to the caller, so they are removed.
fn upward_message(m: Option<&Value>) -> Option<Value> {
    m.and_then(|m| normalise_message(m, "ROLE_AGENT"))
}

/// The A2A error `TaskNotCancelableError` (JSON-RPC code).
const TASK_NOT_CANCELABLE: i64 = -32002;
/// The A2A error `UnsupportedOperationError` (JSON-RPC code).
const UNSUPPORTED_OPERATION: i64 = -32004;

/// A failed call as a turn's failure reason: an A2A error as the server
/// said it, anything else as a failure of the local server.
fn failure(e: DriverError) -> String {
    match e {
        DriverError::Rpc { .. } => e.to_string(),
        e => format!("local A2A server: {e}"),
    }
}

fn text_of(m: Option<&Value>) -> Option<String> {
    let t = super::model::message_text(m?);
    (!t.is_empty()).then_some(t)
}

impl DriverInner {
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

    async fn run(self: Arc<Self>, run: TaskRun) -> Execution {
        let card = match self.resolve(false).await {
            Ok(c) => c,
            Err(e) => {
                warn!(error = %e, "the local A2A server is not reachable");
                return Execution::stopped(StopReason::Error(format!("local A2A server: {e}")));
            }
        };
        let s = Session {
            output_budget: run.authority.budgets.output_bytes,
            ..Session::default()
        };
        let first = Self::first_message(&run);
        self.drive(&card, s, run, Some(first), None).await
    }

    /// Exchanges with the server until the task ends: `outgoing` first (or
    /// resubscribes when `None`), or `end` when a turn already ended.
    async fn drive(
        &self,
        card: &ResolvedCard,
        mut s: Session,
        mut run: TaskRun,
        mut outgoing: Option<Value>,
        mut end: Option<TurnEnd>,
    ) -> Execution {
        let card = card.clone();
        let mut resumes = 0u32;
        loop {
            let end = match end.take() {
                Some(end) => end,
                None => self.turn(&card, &mut s, outgoing.take(), &run).await,
            };
            if let Some(reason) = s.over_budget.take() {
                return self.over_budget(&card, s, &run, end, reason).await;
            }
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
                TurnEnd::OverBudget => {
                    let mut e = self.execution(&run, s, TaskState::Failed, None);
                    e.stop = StopReason::Error("the output budget ran out".into());
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
                    if !self.skip_repeated_follow_ups(&mut s, &mut run).await {
                        let mut e = self.execution(&run, s, TaskState::Failed, None);
                        e.stop = StopReason::Error(
                            "the delegation ended while input was required".into(),
                        );
                        return e;
                    }
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
                            Some(m) => {
                                s.follow_ups += 1;
                                self.checkpoint(&mut s, &run.sink, None).await;
                                outgoing = Some(Self::follow_up(&s, m));
                            }
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

    /// The agent's output passed the budget: its task is cancelled (unless
    /// it already ended) and the delegation fails with `LimitExceeded`,
    /// without output or artifacts. What was sent up before stays sent;
    /// the rest is never read further, so memory stays within the budget
    /// plus one event.
    async fn over_budget(
        &self,
        card: &ResolvedCard,
        mut s: Session,
        run: &TaskRun,
        end: TurnEnd,
        reason: String,
    ) -> Execution {
        warn!(
            %reason,
            "the local agent's output is over the output budget; cancelling its task"
        );
        if !matches!(end, TurnEnd::Terminal(..) | TurnEnd::Message(_)) && s.task_id.is_some() {
            let _ = self.cancel_now(card, &mut s, run).await;
        }
        // No output in the result: none is counted (a result's usage never
        // claims more than the budget the caller signed).
        Execution {
            stop: StopReason::LimitExceeded(reason),
            output: None,
            artifacts: Vec::new(),
            side_effects: Vec::new(),
            usage: Usage::default(),
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
        match self.call(card, Call::CancelTask(&task_id)).await {
            Ok(t) => Some(t),
            Err(DriverError::Rpc {
                code: TASK_NOT_CANCELABLE,
                ..
            }) => self.get_task(card, &task_id).await.ok(),
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
        self.call(card, Call::GetTask(id)).await
    }

    /// A unary call (`GetTask`, `CancelTask`), bounded by the request
    /// timeout: its result, or the server's A2A error.
    async fn call(&self, card: &ResolvedCard, call: Call<'_>) -> Result<Value, DriverError> {
        let resp = card
            .transport
            .send(&self.http, call, self.options.request_timeout)
            .await
            .map_err(|e| DriverError::Http(e.to_string()))?;
        card.transport.decode(resp).await
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
                if !take_artifact(s, &art, false) {
                    return;
                }
                s.sent.insert(art.artifact_id.clone());
                let pending = reattach::Pending::Artifact {
                    id: art.artifact_id.clone(),
                    new: true,
                };
                self.checkpoint(s, sink, Some(pending)).await;
                if let Err(e) = sink.artifact(art, false, true).await {
                    warn!(error = %e, "artifact not sent up");
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
        let task_id = s.task_id.clone();
        let call = match (&outgoing, &task_id) {
            (Some(m), _) => Call::SendStreamingMessage(m),
            (None, Some(id)) => Call::SubscribeToTask(id),
            (None, None) => return TurnEnd::Failed("nothing to resume".into()),
        };
        let mut cancel = None;
        let resubscribe = outgoing.is_none();
        // A message to a task the server already has: the answer to an
        // interrupted state.
        let follow_up = outgoing.is_some() && s.task_id.is_some();
        let end = self
            .stream_turn(card, s, call, resubscribe, follow_up, run, &mut cancel)
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
        call: Call<'_>,
        resubscribe: bool,
        follow_up: bool,
        run: &TaskRun,
        cancel: &mut Option<CancelInFlight<'a>>,
    ) -> TurnEnd {
        let send = card
            .transport
            .send(&self.http, call, self.options.request_timeout);
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
            return match card.transport.decode(resp).await {
                // The task finished: resubscribing is refused; read it.
                Err(DriverError::Rpc {
                    code: UNSUPPORTED_OPERATION,
                    ..
                }) if resubscribe => self.finished(card, s, run).await,
                Err(e) => TurnEnd::Failed(failure(e)),
                Ok(r) => self
                    .on_result(s, &r, &run.sink, resubscribe)
                    .await
                    .unwrap_or(TurnEnd::Dropped),
            };
        }
        // Boxed, so what is left of it after the terminal can be drained in
        // the background (see `drain_after_terminal`).
        let mut body = Box::pin(resp.bytes_stream());
        let mut parser = SseParser::default();
        let mut interrupted = false;
        let mut leading = follow_up || resubscribe;
        // The follow-up's first event after any stored snapshot.
        let mut answered = follow_up;
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
                let result = match card.transport.event(&ev) {
                    Ok(r) => r,
                    Err(e) => return TurnEnd::Failed(e),
                };
                let first = std::mem::take(&mut leading);
                if first
                    && follow_up
                    && let Some(task) = result.get("task")
                    && self.on_snapshot(s, task, &run.sink).await
                {
                    continue;
                }
                if std::mem::take(&mut answered) {
                    Self::left_interruption(s);
                }
                let resumed = first && resubscribe;
                if resumed && std::mem::take(&mut s.announce) {
                    tracing::info!(
                        task_id = s.task_id.as_deref().unwrap_or_default(),
                        "following the local A2A server's task again after a restart"
                    );
                }
                match self.on_result(s, &result, &run.sink, resumed).await {
                    Some(TurnEnd::Interrupted) => interrupted = true,
                    Some(end) => {
                        tokio::spawn(drain_after_terminal(body));
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
        if s.task_id.is_some() {
            Self::left_interruption(s);
        }
        let send = card.transport.send(
            &self.http,
            Call::SendMessage(&m),
            self.options.request_timeout,
        );
        let resp = tokio::select! {
            r = send => r,
            () = run.cancel.cancelled() => {
                let (state, message) = self.cancel_now(card, s, run).await;
                return TurnEnd::Terminal(state, message);
            }
        };
        let resp = match resp {
            Ok(r) => r,
            Err(e) => return TurnEnd::Failed(format!("local A2A server: {e}")),
        };
        match card.transport.decode(resp).await {
            // Still running (the server returned early): follow it.
            Ok(r) => self
                .on_result(s, &r, &run.sink, false)
                .await
                .unwrap_or(TurnEnd::Dropped),
            Err(e) => TurnEnd::Failed(failure(e)),
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
                self.on_result(s, &Value::Object(wrapped), &run.sink, false)
                    .await
                    .unwrap_or(TurnEnd::Dropped)
            }
            Err(e) => TurnEnd::Failed(e.to_string()),
        }
    }

    /// Maps one StreamResponse (or SendMessageResponse) onto the sink.
    /// `Some` when the turn ends with it. `resumed`: `r` leads a resumed
    /// stream (`SubscribeToTask`), so a task in it is the server's snapshot
    /// of what the driver may have seen already: the status messages in its
    /// history after the last one sent up went by while the stream was down
    /// and go up first, its status goes up only if it is not the last one
    /// sent up, its artifacts only if not sent yet; and the live events
    /// right after it that it already held are skipped
    /// ([`snapshot::Overlap`]).
    async fn on_result(
        &self,
        s: &mut Session,
        r: &Value,
        sink: &EventSink,
        resumed: bool,
    ) -> Option<TurnEnd> {
        if let Some(task) = r.get("task") {
            if let Some(id) = task.get("id").and_then(Value::as_str) {
                s.task_id = Some(id.to_string());
            }
            if let Some(c) = task.get("contextId").and_then(Value::as_str) {
                s.context_id = Some(c.to_string());
            }
            self.absorb_artifacts(s, task, sink).await;
            if s.over_budget.is_some() {
                return Some(TurnEnd::OverBudget);
            }
            if resumed {
                self.send_missed_messages(s, task, sink).await;
                s.overlap = Some(snapshot::Overlap::of(task));
            }
            return self.on_status(s, task.get("status"), sink, resumed).await;
        }
        if let Some(u) = r.get("statusUpdate") {
            if s.task_id.is_none() {
                s.task_id = u.get("taskId").and_then(Value::as_str).map(str::to_string);
                s.context_id = u
                    .get("contextId")
                    .and_then(Value::as_str)
                    .map(str::to_string);
            }
            if let Some(o) = &s.overlap {
                if o.repeats_status(u.get("status")) {
                    debug!("a status the resumed stream's snapshot held; not sent again");
                    return None;
                }
                s.overlap = None;
            }
            return self.on_status(s, u.get("status"), sink, false).await;
        }
        if let Some(u) = r.get("artifactUpdate") {
            let Some(art) = u.get("artifact").and_then(artifact_from_a2a) else {
                return Some(TurnEnd::Failed(
                    "an artifact update without a valid artifact".into(),
                ));
            };
            let append = u.get("append").and_then(Value::as_bool).unwrap_or(false);
            let last = u.get("lastChunk").and_then(Value::as_bool).unwrap_or(false);
            if let Some(o) = &s.overlap {
                if u.get("artifact")
                    .is_some_and(|a| o.repeats_artifact(a, append))
                {
                    debug!("an artifact the resumed stream's snapshot held; not sent again");
                    return None;
                }
                s.overlap = None;
            }
            if !take_artifact(s, &art, append) {
                return Some(TurnEnd::OverBudget);
            }
            let new = s.sent.insert(art.artifact_id.clone());
            let pending = reattach::Pending::Artifact {
                id: art.artifact_id.clone(),
                new,
            };
            self.checkpoint(s, sink, Some(pending)).await;
            if let Err(e) = sink.artifact(art, append, last).await {
                warn!(error = %e, "artifact not sent up");
            }
            return None;
        }
        if let Some(m) = r.get("message") {
            if s.task_id.is_none() {
                return Some(TurnEnd::Message(m.clone()));
            }
            // A message inside a task's stream: show it as progress.
            let state = s.state.unwrap_or(TaskState::Working);
            self.status_up(
                s,
                sink,
                UpStatus::new(state, Some(m)),
                upward_message(Some(m)),
            )
            .await;
            return None;
        }
        Some(TurnEnd::Failed(
            "a result that is neither task, message, statusUpdate nor artifactUpdate".into(),
        ))
    }

    /// A follow-up answered the interrupted state: the server's task works
    /// on it, so the same state entered again (input required once more,
    /// with or without a message) is news for the caller.
    fn left_interruption(s: &mut Session) {
        if s.state.is_some_and(TaskState::is_interrupted) {
            s.state = Some(TaskState::Working);
        }
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

    /// A task's status (from a task or a status update). `resumed`: the
    /// status is a resumed stream's snapshot (see [`DriverInner::on_result`]).
    async fn on_status(
        &self,
        s: &mut Session,
        status: Option<&Value>,
        sink: &EventSink,
        resumed: bool,
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
        let up = UpStatus::new(state, message);
        if resumed && s.last_up.as_ref().is_some_and(|last| last.repeated_by(&up)) {
            // A2A has no replay: a subscription starts with the task as it
            // stands, whose status the caller has seen if nothing happened
            // while the stream was down.
            debug!("the resumed stream starts with the status already sent up; not sent again");
        } else if changed || message.is_some() {
            // (A status that neither moves the state nor says anything, the
            // server's first task still submitted, is no event for the
            // caller: a stream through the relay carries what a direct one
            // does.)
            self.status_up(s, sink, up, upward_message(message)).await;
        }
        if !s.checkpointed {
            // The task runs on: from now on a restart re-attaches to it.
            self.checkpoint(s, sink, None).await;
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

/// Counts `art` against the output budget and merges it into the result's
/// artifacts; `false` (and `over_budget` set, nothing merged) when it would
/// pass the budget.
fn take_artifact(s: &mut Session, art: &Artifact, append: bool) -> bool {
    let size = serde_json::to_vec(&super::model::artifact_to_a2a(art))
        .map_or(0, |b| u64::try_from(b.len()).unwrap_or(u64::MAX));
    let total = s.output_bytes.saturating_add(size);
    if total > s.output_budget {
        s.over_budget = Some(format!(
            "output of at least {total} bytes is over the budget of {} bytes",
            s.output_budget
        ));
        return false;
    }
    s.output_bytes = total;
    merge(&mut s.artifacts, art, append);
    true
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

    /// A resumed stream's snapshot repeats the last status sent up when the
    /// state is the same and so is the message: by `messageId` when both
    /// have one, else by content (the server's ids aside).
    #[test]
    fn a_snapshot_repeating_the_last_status() {
        let working = TaskState::Working;
        let msg = |id: Option<&str>, text: &str| {
            let mut m = json!({ "role": "ROLE_AGENT", "parts": [{ "text": text }], "taskId": "t1", "contextId": "c1" });
            if let Some(id) = id {
                m["messageId"] = json!(id);
            }
            m
        };
        let sent = |id: Option<&str>, text: &str| UpStatus::new(working, Some(&msg(id, text)));
        let cases = [
            // (last sent up, snapshot, repeated)
            (sent(Some("m2"), "step 2"), sent(Some("m2"), "step 2"), true),
            (
                sent(Some("m2"), "step 2"),
                sent(Some("m3"), "step 2"),
                false,
            ),
            (sent(Some("m2"), "step 2"), sent(Some("m2"), "edited"), true),
            (sent(None, "step 2"), sent(None, "step 2"), true),
            (sent(None, "step 2"), sent(None, "step 3"), false),
            (sent(Some("m2"), "step 2"), sent(None, "step 2"), true),
            (sent(None, "step 2"), sent(Some("m3"), "step 3"), false),
            (
                sent(Some("m2"), "step 2"),
                UpStatus::new(TaskState::InputRequired, Some(&msg(Some("m2"), "step 2"))),
                false,
            ),
            (
                UpStatus::new(working, None),
                UpStatus::new(working, None),
                true,
            ),
            (sent(None, "step 2"), UpStatus::new(working, None), false),
        ];
        for (i, (last, snapshot, repeated)) in cases.iter().enumerate() {
            assert_eq!(
                last.repeated_by(snapshot),
                *repeated,
                "case {i}: {last:?} / {snapshot:?}"
            );
        }
        // The ids the server gives the message in a snapshot (its task's)
        // are not content.
        let mut other_task = msg(None, "step 2");
        other_task["taskId"] = json!("t2");
        assert!(sent(None, "step 2").repeated_by(&UpStatus::new(working, Some(&other_task))));
    }
}
