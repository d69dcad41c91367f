//! The caller side: a loopback A2A 1.0 server per remote peer, so any A2A
//! client can delegate through the relay unchanged.
//!
//! Routes (axum), for the peer `namespace/name`:
//! - `GET /peers/{namespace}/{name}/.well-known/agent-card.json`: the card
//!   the peer published through the relay (or a synthesized one), with
//!   `supportedInterfaces[0]` = this facade's JSON-RPC URL for the peer;
//! - `POST /peers/{namespace}/{name}/` (and without the trailing slash):
//!   the JSON-RPC 2.0 binding with every 1.0 method;
//! - `GET /peers`: the reachable peers and their card URLs.
//!
//! Each `SendMessage` without a `taskId` starts one delegation; a message
//! with a `taskId` goes down as a follow-up ([`Caller::send_message`]). One
//! tracker task per delegation folds the connector's event log (replay, then
//! live) into the task table; every read (`GetTask`, `ListTasks`, streams)
//! is answered from that table, so reads work while the callee or the relay
//! is away. A client that disconnects never cancels anything.

use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, RawQuery, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures_util::StreamExt as _;
use oab_wire::{PeerEntry, PeerId, RequestId};
use serde_json::{Map, Value, json};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument as _, debug, warn};

use super::jsonrpc::{A2aError, RpcRequest, check_version, parse_request, result_response};
use super::model::{
    TaskState, fresh_id, message_text, ms_from_iso, normalise_message, validate_user_message,
};
use super::profile::{self, Contract, PROFILE_URI};
use super::tasks::{FacadeEvent, NewTask, TaskCell, TaskTable, TerminalView};
use super::{PROTOCOL_BINDING, PROTOCOL_VERSION};
use crate::caller::{Caller, CallerError, DelegationEvent, EventKind, NewDelegation};
use crate::link::EventError;
use crate::profile::{Budgets, ParentContext, RiskLevel, Task};

/// What a delegation asks for when the client says nothing (a plain A2A
/// client, or a profile contract that leaves members out).
#[derive(Debug, Clone, PartialEq)]
pub struct DelegationDefaults {
    /// Capabilities requested (exact names).
    pub capabilities: Vec<String>,
    /// Whether the callee must not change anything.
    pub read_only: bool,
    /// Time from the request until the deadline.
    pub timeout: Duration,
    /// Budgets (zero is zero).
    pub budgets: Budgets,
    /// The caller-side agent named in the request's provenance.
    pub agent: String,
}

impl Default for DelegationDefaults {
    /// Read-only, no capabilities, ten minutes, small budgets at low risk.
    fn default() -> Self {
        DelegationDefaults {
            capabilities: Vec::new(),
            read_only: true,
            timeout: Duration::from_secs(600),
            budgets: Budgets {
                tokens: 100_000,
                cost_micros: 1_000_000,
                risk: RiskLevel::Low,
                output_bytes: 1_000_000,
            },
            agent: "a2a-facade".into(),
        }
    }
}

/// Facade settings.
#[derive(Debug, Clone)]
pub struct FacadeOptions {
    /// The base URL clients reach the facade at (e.g.
    /// `http://127.0.0.1:7070`), used in agent cards. `None`: taken from
    /// each request's `Host` header, with `http://`.
    pub public_url: Option<String>,
    /// Delegation defaults.
    pub defaults: DelegationDefaults,
    /// How long a new task's stream waits for the callee's first event
    /// before it sends the task (with the facade-minted id when the
    /// callee's id is not known yet). Waiting lets a message-only answer be
    /// streamed as a `message`.
    pub first_event_wait: Duration,
    /// How long `CancelTask` waits for the terminal before it returns the
    /// task as it stands (a cancel never guarantees `canceled`).
    pub cancel_wait: Duration,
    /// How long an agent-card request waits for the relay's peer list.
    pub peer_lookup_timeout: Duration,
    /// Extra wait past a delegation's deadline for a blocking `SendMessage`
    /// (the relay appends `expired` after the deadline).
    pub deadline_grace: Duration,
    /// Tasks remembered; past this the oldest finished task is forgotten.
    pub max_tasks: usize,
    /// A2A events kept per task for streams and cursor replay.
    pub max_events_per_task: usize,
}

impl Default for FacadeOptions {
    fn default() -> Self {
        FacadeOptions {
            public_url: None,
            defaults: DelegationDefaults::default(),
            first_event_wait: Duration::from_secs(1),
            cancel_wait: Duration::from_secs(10),
            peer_lookup_timeout: Duration::from_secs(2),
            deadline_grace: Duration::from_secs(30),
            max_tasks: 10_000,
            max_events_per_task: 10_000,
        }
    }
}

#[derive(Debug)]
struct Inner {
    caller: Caller,
    options: FacadeOptions,
    tasks: TaskTable,
    peers: Mutex<Option<Vec<PeerEntry>>>,
    stop: CancellationToken,
}

/// The A2A facade of a connector's caller side. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Facade {
    inner: Arc<Inner>,
}

#[derive(Clone)]
struct Ctx {
    inner: Arc<Inner>,
    streams_stop: CancellationToken,
}

impl Facade {
    /// A facade over `caller`.
    pub fn new(caller: Caller, options: FacadeOptions) -> Facade {
        let tasks = TaskTable::new(options.max_tasks, options.max_events_per_task);
        Facade {
            inner: Arc::new(Inner {
                caller,
                options,
                tasks,
                peers: Mutex::new(None),
                stop: CancellationToken::new(),
            }),
        }
    }

    /// Takes back the delegations an earlier process of this connector left
    /// open (from the caller's state folder): each gets its task again,
    /// under the same ids, folded anew from the relay's log, so `GetTask`,
    /// `ListTasks` and `SubscribeToTask` (cursors included) work across a
    /// restart. Call it once, before serving. Returns how many were taken
    /// back.
    pub async fn restore(&self) -> Result<usize, CallerError> {
        let inner = &self.inner;
        let handles = inner.caller.restore().await?;
        let mut restored = 0;
        for handle in handles {
            let Some(request) = inner.caller.request(&handle) else {
                continue;
            };
            let message = request.task.a2a_message.clone().unwrap_or_else(|| {
                json!({
                    "messageId": fresh_id("msg"),
                    "role": "ROLE_USER",
                    "parts": [{ "text": request.task.text }],
                })
            });
            let context_id = message
                .get("contextId")
                .and_then(Value::as_str)
                .map_or_else(
                    || {
                        let d = oab_wire::Digest::of(request.request_id.as_str().as_bytes());
                        format!("ctx-{}", &oab_wire::digest::hex(&d.0)[..32])
                    },
                    str::to_string,
                );
            let (cell, fresh) = inner.tasks.insert(NewTask {
                peer: handle.callee.clone(),
                handle,
                context_id,
                first_message: normalise_message(&message, "ROLE_USER").unwrap_or(Value::Null),
                deadline_ms: request.deadline_ms,
                created_ms: request.issued_ms,
            });
            if fresh {
                let span = tracing::info_span!("a2a_task", key = %cell.handle.key);
                tokio::spawn(track(inner.clone(), cell.clone()).instrument(span));
                restored += 1;
            }
        }
        Ok(restored)
    }

    /// The routes; open streams end when [`Facade::close`] is called.
    pub fn router(&self) -> Router {
        self.router_until(self.inner.stop.child_token())
    }

    /// The routes; open streams end when `streams_stop` fires (so a
    /// graceful shutdown of the server is not held up by SSE clients).
    pub fn router_until(&self, streams_stop: CancellationToken) -> Router {
        let ctx = Ctx {
            inner: self.inner.clone(),
            streams_stop,
        };
        Router::new()
            .route("/peers", get(list_peers))
            .route(
                "/peers/{namespace}/{name}/.well-known/agent-card.json",
                get(agent_card),
            )
            .route("/peers/{namespace}/{name}", post(rpc))
            .route("/peers/{namespace}/{name}/", post(rpc))
            .with_state(ctx)
    }

    /// The JSON-RPC URL of `peer` under `base` (e.g. `http://127.0.0.1:7070`).
    pub fn interface_url(base: &str, peer: &PeerId) -> String {
        format!("{}/peers/{}/", base.trim_end_matches('/'), peer.as_str())
    }

    /// Stops every tracker and open stream. Delegations go on at the relay;
    /// the connector keeps their events.
    pub fn close(&self) {
        self.inner.stop.cancel();
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn base_url(inner: &Inner, headers: &HeaderMap) -> String {
    if let Some(u) = &inner.options.public_url {
        return u.trim_end_matches('/').to_string();
    }
    let host = headers
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .filter(|h| {
            !h.is_empty()
                && h.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b".-:[]".contains(&b))
        })
        .unwrap_or("127.0.0.1");
    format!("http://{host}")
}

fn peer_of(namespace: &str, name: &str) -> Option<PeerId> {
    PeerId::new(&format!("{namespace}/{name}")).ok()
}

// ---------------------------------------------------------------------------
// Agent cards and the peer list
// ---------------------------------------------------------------------------

/// What the relay says about a peer.
enum Lookup {
    /// The relay's fresh list has it (with its published descriptor).
    Found(PeerEntry),
    /// The relay's fresh list does not have it.
    Absent,
    /// The list could not be had in time.
    Unknown,
}

async fn lookup(inner: &Inner, peer: &PeerId) -> Lookup {
    let fresh =
        tokio::time::timeout(inner.options.peer_lookup_timeout, inner.caller.list_peers()).await;
    match fresh {
        Ok(Ok(list)) => {
            let found = list.iter().find(|e| &e.peer == peer).cloned();
            *lock(&inner.peers) = Some(list);
            found.map_or(Lookup::Absent, Lookup::Found)
        }
        _ => lock(&inner.peers)
            .as_ref()
            .and_then(|l| l.iter().find(|e| &e.peer == peer).cloned())
            .map_or(Lookup::Unknown, Lookup::Found),
    }
}

/// The card served for `peer`: the published descriptor with this facade's
/// interface, capabilities and the profile declared; what the facade cannot
/// honour (security schemes, signatures, the callee's own extensions,
/// 0.3 connection fields) removed.
pub fn build_card(peer: &PeerId, descriptor: Option<&Value>, interface_url: &str) -> Value {
    let mut card = descriptor
        .and_then(Value::as_object)
        .cloned()
        .unwrap_or_default();
    for k in [
        "url",
        "preferredTransport",
        "additionalInterfaces",
        "protocolVersion",
        "signatures",
        "securitySchemes",
        "securityRequirements",
        "security",
        "supportsAuthenticatedExtendedCard",
    ] {
        card.remove(k);
    }
    let text_or = |card: &Map<String, Value>, k: &str| {
        card.get(k)
            .and_then(Value::as_str)
            .filter(|s| !s.is_empty())
            .is_none()
    };
    if text_or(&card, "name") {
        card.insert("name".into(), json!(peer.as_str()));
    }
    if text_or(&card, "description") {
        card.insert(
            "description".into(),
            json!(format!("OAB peer {peer}, reached through the OAB relay.")),
        );
    }
    if text_or(&card, "version") {
        card.insert("version".into(), json!("1.0.0"));
    }
    for k in ["defaultInputModes", "defaultOutputModes"] {
        if card
            .get(k)
            .and_then(Value::as_array)
            .is_none_or(Vec::is_empty)
        {
            card.insert(k.into(), json!(["text/plain"]));
        }
    }
    let mut skills: Vec<Value> = card
        .get("skills")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default()
        .into_iter()
        .filter(Value::is_object)
        .collect();
    for s in &mut skills {
        if let Some(o) = s.as_object_mut() {
            o.remove("securityRequirements");
            o.remove("security");
        }
    }
    if skills.is_empty() {
        skills.push(json!({
            "id": "delegate",
            "name": "Delegate a task",
            "description": format!("Delegates a bounded task to {peer} through the OAB relay."),
            "tags": ["oab", "delegation"],
        }));
    }
    card.insert("skills".into(), Value::Array(skills));
    card.insert(
        "supportedInterfaces".into(),
        json!([{
            "url": interface_url,
            "protocolBinding": PROTOCOL_BINDING,
            "protocolVersion": PROTOCOL_VERSION,
        }]),
    );
    card.insert(
        "capabilities".into(),
        json!({
            "streaming": true,
            "pushNotifications": false,
            "extendedAgentCard": false,
            "extensions": [profile::agent_extension()],
        }),
    );
    Value::Object(card)
}

async fn agent_card(
    State(ctx): State<Ctx>,
    Path((namespace, name)): Path<(String, String)>,
    headers: HeaderMap,
) -> Response {
    let Some(peer) = peer_of(&namespace, &name) else {
        return (StatusCode::NOT_FOUND, "no such peer\n").into_response();
    };
    let descriptor = match lookup(&ctx.inner, &peer).await {
        Lookup::Found(e) => e.descriptor,
        Lookup::Absent => {
            return (StatusCode::NOT_FOUND, "this host may not reach that peer\n").into_response();
        }
        Lookup::Unknown => None,
    };
    let url = Facade::interface_url(&base_url(&ctx.inner, &headers), &peer);
    let card = build_card(&peer, descriptor.as_ref(), &url);
    let body = serde_json::to_vec(&card).unwrap_or_default();
    let etag = format!("\"{}\"", &oab_wire::Digest::of(&body).to_string()[7..39]);
    let mut resp = if headers
        .get(header::IF_NONE_MATCH)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.split(',').any(|t| t.trim() == etag || t.trim() == "*"))
    {
        StatusCode::NOT_MODIFIED.into_response()
    } else {
        ([(header::CONTENT_TYPE, "application/json")], body).into_response()
    };
    if let Ok(v) = HeaderValue::from_str(&etag) {
        resp.headers_mut().insert(header::ETAG, v);
    }
    // Short-lived: a peer may publish a new card at any time (ETag revalidates).
    resp.headers_mut().insert(
        header::CACHE_CONTROL,
        HeaderValue::from_static("max-age=60"),
    );
    resp
}

async fn list_peers(State(ctx): State<Ctx>, headers: HeaderMap) -> Response {
    let base = base_url(&ctx.inner, &headers);
    let list = tokio::time::timeout(
        ctx.inner.options.peer_lookup_timeout,
        ctx.inner.caller.list_peers(),
    )
    .await;
    let Ok(Ok(list)) = list else {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            "the relay's peer list is not available\n",
        )
            .into_response();
    };
    *lock(&ctx.inner.peers) = Some(list.clone());
    let peers: Vec<Value> = list
        .iter()
        .map(|e| {
            json!({
                "peer": e.peer.as_str(),
                "online": e.online,
                "agentCard": format!("{}.well-known/agent-card.json", Facade::interface_url(&base, &e.peer)),
                "url": Facade::interface_url(&base, &e.peer),
            })
        })
        .collect();
    axum::Json(json!({ "peers": peers })).into_response()
}

// ---------------------------------------------------------------------------
// JSON-RPC
// ---------------------------------------------------------------------------

/// One JSON-RPC call.
struct Call {
    ctx: Ctx,
    peer: PeerId,
    id: Value,
    params: Map<String, Value>,
    profile: bool,
    headers: HeaderMap,
}

/// What a method answers.
enum Reply {
    /// A `result`.
    Result(Value),
    /// An SSE stream of results.
    Stream(mpsc::Receiver<Event>),
}

fn json_response(value: &Value, profile: bool) -> Response {
    let body = serde_json::to_vec(value).unwrap_or_default();
    let mut resp = ([(header::CONTENT_TYPE, "application/json")], body).into_response();
    echo_profile(&mut resp, profile);
    resp
}

fn echo_profile(resp: &mut Response, profile: bool) {
    if profile {
        resp.headers_mut().insert(
            profile::EXTENSIONS_HEADER,
            HeaderValue::from_static(PROFILE_URI),
        );
    }
}

fn query_param<'a>(query: Option<&'a str>, name: &str) -> Option<&'a str> {
    query?
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .find(|(k, _)| k.eq_ignore_ascii_case(name))
        .map(|(_, v)| v)
}

async fn rpc(
    State(ctx): State<Ctx>,
    Path((namespace, name)): Path<(String, String)>,
    RawQuery(query): RawQuery,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let profile = profile::requested(&headers);
    if let Some(ct) = headers.get(header::CONTENT_TYPE) {
        let media = ct
            .to_str()
            .unwrap_or_default()
            .split(';')
            .next()
            .unwrap_or_default()
            .trim()
            .to_ascii_lowercase();
        if !(media == "application/json" || media.ends_with("+json")) {
            let e = A2aError::ContentTypeNotSupported(format!(
                "Content-Type {media:?}; the JSON-RPC binding takes application/json"
            ));
            return json_response(&e.to_response(&Value::Null), profile);
        }
    }
    let RpcRequest { id, method, params } = match parse_request(&body) {
        Ok(r) => r,
        Err((id, e)) => return json_response(&e.to_response(&id), profile),
    };
    let version_header = headers
        .get(super::jsonrpc::VERSION_HEADER)
        .and_then(|v| v.to_str().ok());
    let version_query = query_param(query.as_deref(), super::jsonrpc::VERSION_HEADER);
    if let Err(e) = check_version(version_header, version_query) {
        return json_response(&e.to_response(&id), profile);
    }
    let Some(peer) = peer_of(&namespace, &name) else {
        let e = A2aError::InvalidParams(format!("no peer {namespace}/{name}"));
        return json_response(&e.to_response(&id), profile);
    };
    let span = tracing::debug_span!("a2a", %peer, %method);
    let call = Call {
        ctx,
        peer,
        id: id.clone(),
        params,
        profile,
        headers,
    };
    let reply = async {
        match method.as_str() {
            "SendMessage" => call.send_message(false).await,
            "SendStreamingMessage" => call.send_message(true).await,
            "GetTask" => call.get_task(),
            "ListTasks" => call.list_tasks(),
            "CancelTask" => call.cancel_task().await,
            "SubscribeToTask" => call.subscribe(),
            "GetExtendedAgentCard" => Err(A2aError::ExtendedAgentCardNotConfigured),
            "CreateTaskPushNotificationConfig"
            | "GetTaskPushNotificationConfig"
            | "ListTaskPushNotificationConfigs"
            | "DeleteTaskPushNotificationConfig" => Err(A2aError::PushNotificationNotSupported),
            other => Err(A2aError::MethodNotFound(other.chars().take(64).collect())),
        }
    }
    .instrument(span)
    .await;
    match reply {
        Ok(Reply::Result(v)) => json_response(&result_response(&id, v), profile),
        Ok(Reply::Stream(rx)) => {
            let stream = futures_util::stream::unfold(rx, |mut rx| async move {
                rx.recv().await.map(|ev| (Ok::<_, Infallible>(ev), rx))
            });
            let mut resp = Sse::new(stream)
                .keep_alive(KeepAlive::default())
                .into_response();
            echo_profile(&mut resp, profile);
            resp
        }
        Err(e) => {
            if let A2aError::Internal(detail) = &e {
                warn!(%detail, "a2a call failed");
            }
            json_response(&e.to_response(&id), profile)
        }
    }
}

fn param_str<'a>(params: &'a Map<String, Value>, key: &str) -> Result<Option<&'a str>, A2aError> {
    match params.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.as_str())),
        Some(_) => Err(A2aError::InvalidParams(format!("{key} must be a string"))),
    }
}

fn required_id(params: &Map<String, Value>) -> Result<&str, A2aError> {
    param_str(params, "id")?
        .filter(|s| !s.is_empty())
        .ok_or_else(|| A2aError::InvalidParams("id is required".into()))
}

fn param_bool(params: &Map<String, Value>, key: &str) -> Result<Option<bool>, A2aError> {
    match params.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(_) => Err(A2aError::InvalidParams(format!("{key} must be a boolean"))),
    }
}

fn param_count(params: &Map<String, Value>, key: &str) -> Result<Option<u64>, A2aError> {
    match params.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .or_else(|| v.as_str().and_then(|s| s.parse().ok()))
            .map(Some)
            .ok_or_else(|| {
                A2aError::InvalidParams(format!("{key} must be a non-negative integer"))
            }),
    }
}

fn history_length(params: &Map<String, Value>) -> Result<Option<usize>, A2aError> {
    Ok(param_count(params, "historyLength")?.map(|n| usize::try_from(n).unwrap_or(usize::MAX)))
}

fn caller_error(e: CallerError) -> A2aError {
    match e {
        CallerError::Authority(_)
        | CallerError::Profile(_)
        | CallerError::IdempotencyMismatch(_) => A2aError::Refused {
            code: e.code().to_string(),
            message: e.to_string(),
        },
        other => A2aError::Internal(format!("{other:#}")),
    }
}

/// A sequence of events to stream, and how it starts.
struct StreamPlan {
    cell: Arc<TaskCell>,
    task_id: String,
    first: First,
    /// Events with a sequence above this are streamed.
    after: u64,
}

enum First {
    /// The task as created (state submitted), numbered 0.
    Created,
    /// The task as it stands; `gap` = the cursor asked for and the first
    /// event still kept, when the cursor's events are gone.
    Snapshot { gap: Option<(u64, u64)> },
}

impl Call {
    fn inner(&self) -> &Inner {
        &self.ctx.inner
    }

    fn find(&self, id: &str) -> Result<Arc<TaskCell>, A2aError> {
        self.inner()
            .tasks
            .find(&self.peer, id)
            .ok_or_else(|| A2aError::TaskNotFound(id.chars().take(256).collect()))
    }

    async fn send_message(&self, streaming: bool) -> Result<Reply, A2aError> {
        let message = self
            .params
            .get("message")
            .ok_or_else(|| A2aError::InvalidParams("message is required".into()))?;
        validate_user_message(message)?;
        let config = match self.params.get("configuration") {
            None | Some(Value::Null) => Map::new(),
            Some(Value::Object(c)) => c.clone(),
            Some(_) => {
                return Err(A2aError::InvalidParams(
                    "configuration must be an object".into(),
                ));
            }
        };
        let return_immediately = param_bool(&config, "returnImmediately")?.unwrap_or(false);
        let history = history_length(&config)?;
        if config
            .get("taskPushNotificationConfig")
            .is_some_and(|v| !v.is_null())
        {
            return Err(A2aError::PushNotificationNotSupported);
        }
        let request_metadata = self.params.get("metadata");
        if request_metadata.is_some_and(|m| !m.is_object() && !m.is_null()) {
            return Err(A2aError::InvalidParams("metadata must be an object".into()));
        }
        let (cell, task_id, after, created) = match message.get("taskId").and_then(Value::as_str) {
            Some(task_id) => {
                let (cell, after) = self.follow_up(task_id, message).await?;
                (cell, task_id.to_string(), after, false)
            }
            None => {
                let cell = self.new_task(message, request_metadata).await?;
                let id = cell.public_id();
                (cell, id, 0, true)
            }
        };
        if streaming {
            return Ok(self.start_stream(cell, task_id, after, created).await);
        }
        if !return_immediately {
            let left = cell
                .lock()
                .deadline_ms
                .saturating_sub(super::model::now_ms());
            let wait = Duration::from_millis(left) + self.inner().options.deadline_grace;
            wait_settled(&cell, after, wait, &self.ctx.streams_stop).await;
        }
        let task_id = if created { cell.public_id() } else { task_id };
        let rec = cell.lock();
        if created && let Some(m) = rec.message_response() {
            return Ok(Reply::Result(json!({ "message": m })));
        }
        let task = rec.render_task(&cell, &task_id, history, true, self.profile);
        Ok(Reply::Result(json!({ "task": task })))
    }

    /// Starts a delegation for a message without a task id.
    async fn new_task(
        &self,
        message: &Value,
        request_metadata: Option<&Value>,
    ) -> Result<Arc<TaskCell>, A2aError> {
        let inner = self.inner();
        let defaults = &inner.options.defaults;
        let contract = if self.profile {
            profile::contract(message, request_metadata)?
        } else {
            Contract::default()
        };
        let message_id = message
            .get("messageId")
            .and_then(Value::as_str)
            .unwrap_or_default();
        let request_id = match &contract.request_id {
            Some(r) => Some(RequestId::new(r).map_err(|e| A2aError::InvalidParams(e.to_string()))?),
            // With the profile, a re-sent message is the same delegation.
            None if self.profile => {
                let d = oab_wire::Digest::of(format!("{}\n{message_id}", self.peer).as_bytes());
                RequestId::new(&format!("a2a-{}", &oab_wire::digest::hex(&d.0)[..32])).ok()
            }
            None => None,
        };
        let context_id = match message.get("contextId").and_then(Value::as_str) {
            Some(c) if !c.is_empty() && c.len() <= 256 => c.to_string(),
            Some(c) if !c.is_empty() => {
                return Err(A2aError::InvalidParams(
                    "contextId is longer than 256 bytes".into(),
                ));
            }
            _ => match &request_id {
                Some(r) => {
                    let d = oab_wire::Digest::of(r.as_str().as_bytes());
                    format!("ctx-{}", &oab_wire::digest::hex(&d.0)[..32])
                }
                None => fresh_id("ctx"),
            },
        };
        let mut forwarded = message.clone();
        if let Some(o) = forwarded.as_object_mut() {
            o.insert("contextId".into(), json!(context_id));
            o.remove("taskId");
        }
        let parent = contract.parent.clone().unwrap_or_default();
        let spec = NewDelegation {
            request_id,
            task: Task {
                text: message_text(message),
                context: Map::new(),
                a2a_message: Some(forwarded),
            },
            capabilities: contract
                .capabilities
                .clone()
                .unwrap_or_else(|| defaults.capabilities.clone()),
            read_only: contract.read_only.unwrap_or(defaults.read_only),
            deadline: contract.timeout().unwrap_or(defaults.timeout),
            budgets: contract
                .budgets
                .as_ref()
                .map_or(defaults.budgets, |b| b.over(&defaults.budgets)),
            parent: ParentContext {
                agent: parent.agent.unwrap_or_else(|| defaults.agent.clone()),
                trace_id: parent
                    .trace_id
                    .unwrap_or_else(|| message_id.chars().take(128).collect()),
                execution_id: parent.execution_id,
            },
        };
        let deadline_ms = super::model::now_ms()
            .saturating_add(u64::try_from(spec.deadline.as_millis()).unwrap_or(u64::MAX));
        let handle = inner
            .caller
            .delegate(&self.peer, spec)
            .await
            .map_err(caller_error)?;
        let first = normalise_message(message, "ROLE_USER").unwrap_or(Value::Null);
        let (cell, fresh) = inner.tasks.insert(NewTask {
            peer: self.peer.clone(),
            handle,
            context_id,
            first_message: first,
            deadline_ms,
            created_ms: super::model::now_ms(),
        });
        if fresh {
            let span = tracing::info_span!("a2a_task", key = %cell.handle.key);
            tokio::spawn(track(self.ctx.inner.clone(), cell.clone()).instrument(span));
        }
        Ok(cell)
    }

    /// Sends a follow-up message down; returns the task and the event
    /// sequence before it.
    async fn follow_up(
        &self,
        task_id: &str,
        message: &Value,
    ) -> Result<(Arc<TaskCell>, u64), A2aError> {
        let cell = self.find(task_id)?;
        let (after, context_id, callee_id) = {
            let rec = cell.lock();
            if let Some(c) = message.get("contextId").and_then(Value::as_str)
                && c != rec.context_id
            {
                return Err(A2aError::InvalidParams(format!(
                    "contextId {c:?} does not match the task's context"
                )));
            }
            if rec.is_terminal() {
                return Err(A2aError::UnsupportedOperation(format!(
                    "task {task_id} is in a terminal state; start a new task in its context"
                )));
            }
            (rec.last_seq, rec.context_id.clone(), rec.callee_id.clone())
        };
        let mut down = message.clone();
        if let Some(o) = down.as_object_mut() {
            o.insert("contextId".into(), json!(context_id));
            o.insert(
                "taskId".into(),
                json!(callee_id.unwrap_or_else(|| cell.minted_id.clone())),
            );
        }
        self.inner()
            .caller
            .send_message(&cell.handle, down)
            .await
            .map_err(caller_error)?;
        if let Some(m) = normalise_message(message, "ROLE_USER") {
            cell.lock().history.push(m);
        }
        cell.notify();
        Ok((cell, after))
    }

    async fn start_stream(
        &self,
        cell: Arc<TaskCell>,
        task_id: String,
        after: u64,
        created: bool,
    ) -> Reply {
        let (tx, rx) = mpsc::channel(32);
        if !created {
            let plan = StreamPlan {
                cell,
                task_id,
                first: First::Snapshot { gap: None },
                after,
            };
            self.spawn_stream(plan, tx);
            return Reply::Stream(rx);
        }
        // A new task: give the callee a moment, so a message-only answer
        // can be streamed as a message and the task shows the callee's id.
        let mut watch = cell.subscribe();
        let wait = async {
            loop {
                {
                    let rec = cell.lock();
                    if rec.last_seq > 0 || rec.closed.is_some() {
                        return;
                    }
                }
                if watch.changed().await.is_err() {
                    return;
                }
            }
        };
        let _ = tokio::time::timeout(self.inner().options.first_event_wait, wait).await;
        let answer = cell.lock().message_response();
        if let Some(m) = answer {
            let data = result_response(&self.id, json!({ "message": m }));
            let _ = tx.try_send(sse_event(&data, None));
            return Reply::Stream(rx);
        }
        let plan = StreamPlan {
            task_id: cell.public_id(),
            cell,
            first: First::Created,
            after: 0,
        };
        self.spawn_stream(plan, tx);
        Reply::Stream(rx)
    }

    fn spawn_stream(&self, plan: StreamPlan, tx: mpsc::Sender<Event>) {
        let id = self.id.clone();
        let profile = self.profile;
        let stop = self.ctx.streams_stop.clone();
        tokio::spawn(
            produce(plan, id, profile, tx, stop).instrument(tracing::debug_span!("a2a_stream")),
        );
    }

    fn get_task(&self) -> Result<Reply, A2aError> {
        let id = required_id(&self.params)?;
        let history = history_length(&self.params)?;
        let cell = self.find(id)?;
        let rec = cell.lock();
        Ok(Reply::Result(rec.render_task(
            &cell,
            id,
            history,
            true,
            self.profile,
        )))
    }

    fn list_tasks(&self) -> Result<Reply, A2aError> {
        let p = &self.params;
        let context = param_str(p, "contextId")?;
        let status = match param_str(p, "status")? {
            None | Some("" | "TASK_STATE_UNSPECIFIED") => None,
            Some(s) => Some(
                TaskState::parse(s)
                    .ok_or_else(|| A2aError::InvalidParams(format!("unknown status {s:?}")))?,
            ),
        };
        let page_size = match param_count(p, "pageSize")? {
            None | Some(0) => 50,
            Some(n @ 1..=100) => n as usize,
            Some(n) => {
                return Err(A2aError::InvalidParams(format!(
                    "pageSize {n} is outside 1..=100"
                )));
            }
        };
        let offset = match param_str(p, "pageToken")? {
            None | Some("") => 0,
            Some(t) => t
                .strip_prefix("o")
                .and_then(|n| n.parse::<usize>().ok())
                .ok_or_else(|| {
                    A2aError::InvalidParams("pageToken is not one this server made".into())
                })?,
        };
        let history = history_length(p)?;
        let after_ms = match param_str(p, "statusTimestampAfter")? {
            None | Some("") => None,
            Some(s) => Some(ms_from_iso(s).ok_or_else(|| {
                A2aError::InvalidParams("statusTimestampAfter is not an ISO-8601 timestamp".into())
            })?),
        };
        let include_artifacts = param_bool(p, "includeArtifacts")?.unwrap_or(false);
        let mut rows: Vec<(u64, u64, Value)> = Vec::new();
        for cell in self.inner().tasks.of_peer(&self.peer) {
            let id = cell.public_id();
            let rec = cell.lock();
            if context.is_some_and(|c| c != rec.context_id)
                || status.is_some_and(|s| s != rec.state)
                || after_ms.is_some_and(|t| rec.status_ms <= t)
            {
                continue;
            }
            let task = rec.render_task(&cell, &id, history, include_artifacts, self.profile);
            rows.push((rec.status_ms, rec.created_ms, task));
        }
        rows.sort_by_key(|r| std::cmp::Reverse((r.0, r.1)));
        let total = rows.len();
        let tasks: Vec<Value> = rows
            .into_iter()
            .skip(offset)
            .take(page_size)
            .map(|r| r.2)
            .collect();
        let next = if offset + tasks.len() < total {
            format!("o{}", offset + tasks.len())
        } else {
            String::new()
        };
        Ok(Reply::Result(json!({
            "tasks": tasks,
            "nextPageToken": next,
            "pageSize": page_size,
            "totalSize": total,
        })))
    }

    async fn cancel_task(&self) -> Result<Reply, A2aError> {
        let id = required_id(&self.params)?;
        let cell = self.find(id)?;
        {
            let rec = cell.lock();
            if rec.is_terminal() {
                return Err(A2aError::TaskNotCancelable(format!(
                    "task {id} is already {}",
                    rec.state.as_str()
                )));
            }
        }
        self.inner()
            .caller
            .cancel(&cell.handle, "canceled by the A2A client")
            .await
            .map_err(caller_error)?;
        let mut watch = cell.subscribe();
        let wait = async {
            loop {
                {
                    let rec = cell.lock();
                    if rec.is_terminal() || rec.closed.is_some() {
                        return;
                    }
                }
                if watch.changed().await.is_err() {
                    return;
                }
            }
        };
        let _ = tokio::time::timeout(self.inner().options.cancel_wait, wait).await;
        let rec = cell.lock();
        Ok(Reply::Result(rec.render_task(
            &cell,
            id,
            None,
            true,
            self.profile,
        )))
    }

    fn subscribe(&self) -> Result<Reply, A2aError> {
        let id = required_id(&self.params)?;
        let cell = self.find(id)?;
        let cursor = if self.profile {
            profile::cursor(&self.headers)?
        } else {
            None
        };
        let (after, gap) = {
            let rec = cell.lock();
            if rec.is_terminal() && !self.profile {
                return Err(A2aError::UnsupportedOperation(format!(
                    "task {id} is in a terminal state; it cannot be subscribed to"
                )));
            }
            match cursor {
                Some(c) => {
                    let first = rec.first_kept();
                    let gap = (c + 1 < first).then_some((c, first));
                    (c.min(rec.last_seq), gap)
                }
                None => (rec.last_seq, None),
            }
        };
        let (tx, rx) = mpsc::channel(32);
        self.spawn_stream(
            StreamPlan {
                cell,
                task_id: id.to_string(),
                first: First::Snapshot { gap },
                after,
            },
            tx,
        );
        Ok(Reply::Stream(rx))
    }
}

/// Waits until an event after `after` ends a turn (terminal or
/// input-required), the connector stops, `stop` fires or `limit` passes.
async fn wait_settled(cell: &TaskCell, after: u64, limit: Duration, stop: &CancellationToken) {
    let mut watch = cell.subscribe();
    let wait = async {
        loop {
            {
                let rec = cell.lock();
                if rec.closed.is_some()
                    || rec
                        .events_after(after)
                        .iter()
                        .any(FacadeEvent::closes_stream)
                    || (rec.is_terminal() && rec.last_seq <= after)
                {
                    return;
                }
            }
            if watch.changed().await.is_err() {
                return;
            }
        }
    };
    tokio::select! {
        _ = tokio::time::timeout(limit, wait) => {}
        () = stop.cancelled() => {}
    }
}

fn sse_event(data: &Value, id: Option<u64>) -> Event {
    let ev = Event::default().data(serde_json::to_string(data).unwrap_or_default());
    match id {
        Some(seq) => ev.id(seq.to_string()),
        None => ev,
    }
}

fn sse_error(rpc_id: &Value, e: &A2aError) -> Event {
    Event::default()
        .event("error")
        .data(serde_json::to_string(&e.to_response(rpc_id)).unwrap_or_default())
}

/// Feeds one SSE stream from the task table until the stream closes (a
/// terminal or input-required event), the client goes away, the connector
/// stops or `stop` fires. It never touches the delegation itself.
async fn produce(
    plan: StreamPlan,
    rpc_id: Value,
    profile: bool,
    tx: mpsc::Sender<Event>,
    stop: CancellationToken,
) {
    let StreamPlan {
        cell,
        task_id,
        first,
        after,
    } = plan;
    let mut watch = cell.subscribe();
    let id_of = |seq: u64| profile.then_some(seq);
    let first_event = {
        let rec = cell.lock();
        match first {
            First::Created => sse_event(
                &result_response(
                    &rpc_id,
                    json!({ "task": rec.render_created(&cell, &task_id, profile) }),
                ),
                id_of(0),
            ),
            First::Snapshot { gap } => {
                let mut task = rec.render_task(&cell, &task_id, None, true, profile);
                if let (Some((asked, first_kept)), Some(m)) = (
                    gap,
                    task.get_mut("metadata")
                        .and_then(|m| m.get_mut(PROFILE_URI))
                        .and_then(Value::as_object_mut),
                ) {
                    m.insert(
                        "gap".into(),
                        json!({ "after": asked, "firstSeq": first_kept }),
                    );
                }
                sse_event(
                    &result_response(&rpc_id, json!({ "task": task })),
                    id_of(rec.last_seq),
                )
            }
        }
    };
    if tx.send(first_event).await.is_err() {
        return;
    }
    let mut cursor = after;
    loop {
        let (batch, closed, done, trimmed) = {
            let rec = cell.lock();
            let trimmed = cursor + 1 < rec.first_kept() && cursor < rec.last_seq;
            let batch: Vec<(u64, Value, bool)> = rec
                .events_after(cursor)
                .iter()
                .map(|ev| {
                    (
                        ev.seq,
                        rec.render_event(ev, &task_id, profile),
                        ev.closes_stream(),
                    )
                })
                .collect();
            (batch, rec.closed.clone(), rec.is_terminal(), trimmed)
        };
        if trimmed && after < cursor {
            // Events this stream had not sent yet were dropped: say so.
            let e = A2aError::Internal(format!(
                "events after {cursor} are no longer kept; resubscribe (with the profile, from a cursor)"
            ));
            let _ = tx.send(sse_error(&rpc_id, &e)).await;
            return;
        }
        for (seq, body, closes) in batch {
            if tx
                .send(sse_event(&result_response(&rpc_id, body), id_of(seq)))
                .await
                .is_err()
            {
                return;
            }
            cursor = seq;
            if closes {
                return;
            }
        }
        if done {
            return;
        }
        if let Some(reason) = closed {
            let e = A2aError::Internal(format!("the connector stopped: {reason}"));
            let _ = tx.send(sse_error(&rpc_id, &e)).await;
            return;
        }
        tokio::select! {
            r = watch.changed() => if r.is_err() { return },
            () = tx.closed() => return,
            () = stop.cancelled() => return,
        }
    }
}

/// Folds one delegation's events into its task until the terminal, the end
/// of the connector, or [`Facade::close`].
async fn track(inner: Arc<Inner>, cell: Arc<TaskCell>) {
    let mut after = 0u64;
    loop {
        let events = tokio::select! {
            () = inner.stop.cancelled() => return,
            r = inner.caller.events(&cell.handle, after) => r,
        };
        let mut events = match events {
            Ok(s) => s,
            Err(e) => {
                cell.lock().closed = Some(e.to_string());
                cell.notify();
                return;
            }
        };
        loop {
            let item = tokio::select! {
                () = inner.stop.cancelled() => return,
                i = events.next() => i,
            };
            match item {
                Some(Ok(ev)) => {
                    let terminal = matches!(ev.kind, EventKind::Terminal(_)).then(|| ev.clone());
                    let end = fold(&inner, &cell, ev);
                    cell.notify();
                    if let Some(ev) = terminal {
                        // Finished: a restart no longer takes it back (the
                        // state file stays, so a re-sent request is still the
                        // same delegation).
                        let (caller, handle) = (inner.caller.clone(), cell.handle.clone());
                        let saved =
                            tokio::task::spawn_blocking(move || caller.commit(&handle, &ev)).await;
                        if let Ok(Err(e)) = saved {
                            warn!(error = %e, "could not record the delegation as finished");
                        }
                    }
                    if end {
                        return;
                    }
                }
                Some(Err(EventError::Lagged { last })) => {
                    debug!(last, "tracker lagged; resubscribing");
                    after = last;
                    break;
                }
                Some(Err(EventError::Refused { code, message })) => {
                    cell.lock().observed_end(
                        TaskState::Rejected,
                        "refused",
                        format!("the relay refused the delegation: {code} ({message})"),
                    );
                    cell.notify();
                    return;
                }
                Some(Err(EventError::Gap { after, reason })) => {
                    cell.lock().observed_end(
                        TaskState::Failed,
                        "gap",
                        format!(
                            "the delegation's events after {after} are gone ({reason:?}); reconcile"
                        ),
                    );
                    cell.notify();
                    return;
                }
                Some(Err(EventError::Stopped(reason))) => {
                    cell.lock().closed = Some(reason);
                    cell.notify();
                    return;
                }
                None => {
                    cell.lock().closed = Some("the event stream ended".into());
                    cell.notify();
                    return;
                }
            }
        }
    }
}

/// Folds one event; `true` at the terminal.
fn fold(inner: &Inner, cell: &Arc<TaskCell>, ev: DelegationEvent) -> bool {
    match ev.kind {
        EventKind::Accepted { task_id } => {
            cell.lock().callee_id.get_or_insert_with(|| task_id.clone());
            inner.tasks.alias(cell, &task_id);
            false
        }
        EventKind::Status {
            state,
            message,
            data,
        } => {
            cell.lock().status(ev.seq, &state, message.as_ref(), data);
            false
        }
        EventKind::Artifact {
            artifact,
            append,
            last_chunk,
        } => {
            cell.lock().artifact(ev.seq, &artifact, append, last_chunk);
            false
        }
        EventKind::Terminal(t) => {
            let verified = inner.caller.verify(&cell.handle, &t).map(|v| v.result);
            let view = TerminalView::new(&t, verified);
            cell.lock().terminal(ev.seq, view);
            true
        }
        EventKind::Unrecognised(_) => false,
    }
}
