//! The caller side: a loopback A2A 1.0 server per remote peer, so any A2A
//! client can delegate through the relay unchanged.
//!
//! Routes (axum), for the peer `namespace/name`:
//! - `GET /peers/{namespace}/{name}/.well-known/agent-card.json`: the card
//!   the peer published through the relay (or a synthesized one), with
//!   `supportedInterfaces` = this facade's JSON-RPC, then HTTP+JSON,
//!   interface for the peer (one URL, the peer base);
//! - `POST /peers/{namespace}/{name}/` (and without the trailing slash):
//!   the JSON-RPC 2.0 binding with every 1.0 method;
//! - `/peers/{namespace}/{name}/{route}`: the HTTP+JSON binding
//!   (`message:send`, `tasks/{id}`, … see `rest`), every method again;
//! - `GET /peers`: the reachable peers and their card URLs.
//!
//! Every route first passes the browser-safety checks of `guard` (`Host`,
//! `Origin`, `Sec-Fetch-Site`, the optional bearer token).
//!
//! Each `SendMessage` without a `taskId` starts one delegation; a message
//! with a `taskId` goes down as a follow-up ([`Caller::send_message`]). One
//! tracker task per delegation folds the connector's event log (replay, then
//! live) into the task table; every read (`GetTask`, `ListTasks`, streams)
//! is answered from that table, so reads work while the callee or the relay
//! is away. A client that disconnects never cancels anything.
//!
//! This module owns the [`Facade`] handle, its options and delegation
//! defaults, the routes, and the restore of a previous process's tasks. It
//! never answers an A2A method itself: each method lives in its own module.
//!
//! | module | concern |
//! |---|---|
//! | `guard` | browser safety: `Host`, `Origin`, the optional bearer token |
//! | `card` | agent cards and the peer list (`GET` routes) |
//! | `rpc` | the JSON-RPC endpoint: envelope checks, the method table, replies |
//! | `rest` | the HTTP+JSON endpoint: routes to methods, query and body params, `google.rpc.Status` errors |
//! | `params` | reading typed members out of a method's params |
//! | `send_message` | `SendMessage` and `SendStreamingMessage`: new task, follow-up |
//! | `get_task` | `GetTask` |
//! | `list_tasks` | `ListTasks`: filters and pages |
//! | `cancel_task` | `CancelTask` |
//! | `subscribe_to_task` | `SubscribeToTask`, with the profile's cursor |
//! | `push_config` | the four push notification config methods, and a send's config |
//! | `push` | push configs, their delivery to webhooks, cursors and persistence |
//! | `webhook` | the webhook client (one HTTP/1.1 `POST` per notification) and URL rule |
//! | `stream` | the SSE producer of one stream, fed from the task table |
//! | `tracker` | the task that folds one delegation's events into the task table |

use parking_lot::Mutex;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::routing::{any, get, post};
use oab_wire::{PeerEntry, PeerId};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;

use super::defaults::DelegationDefaults;
use super::model::{fresh_id, normalise_message};
use super::tasks::{NewTask, TaskBounds, TaskTable};
use crate::a2a::jsonrpc::A2aError;
use crate::caller::{Caller, CallerError};
use tracker::track_delegation;

/// The largest request body the facade reads: twice the largest payload a
/// relay may take (a request's text travels inside its signed envelope),
/// plus 64 KiB. A larger body is refused `payload_too_large` (HTTP 413)
/// before it is read whole; a smaller one that still makes a request over
/// the relay's limit is refused the same way once its envelope is built.
pub(super) const MAX_REQUEST_BYTES: usize =
    2 * oab_wire::limits::MAX_PAYLOAD_CEILING as usize + 64 * 1024;

/// The refusal of a request body over [`MAX_REQUEST_BYTES`] (or one that
/// could not be read whole).
pub(super) fn body_refusal(e: &axum::extract::rejection::BytesRejection) -> A2aError {
    A2aError::Refused {
        code: oab_wire::ErrorCode::PayloadTooLarge.name().to_string(),
        message: format!(
            "the request body could not be read within the facade's limit of {MAX_REQUEST_BYTES} bytes ({e}); send large content by reference (a URL part)"
        ),
    }
}

mod cancel_task;
mod card;
mod get_task;
mod guard;
mod list_tasks;
mod params;
mod push;
mod push_config;
mod rest;
mod rpc;
mod send_message;
mod stream;
mod subscribe_to_task;
mod tracker;
mod webhook;

pub use card::build_card;
pub use guard::{FacadeToken, TokenError};
pub use push::{PushConfigCounts, PushOptions, PushStats};

/// Facade settings.
#[derive(Debug, Clone)]
pub struct FacadeOptions {
    /// The base URL clients reach the facade at (e.g.
    /// `http://127.0.0.1:7070`), used in agent cards. `None`: taken from
    /// each request's `Host` header, with `http://`.
    pub public_url: Option<String>,
    /// The local bearer token every request must carry
    /// (`Authorization: Bearer <token>`); `None`: no token is asked for
    /// (the `Host`, `Origin` and media-type checks apply either way).
    pub token: Option<FacadeToken>,
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
    /// A blocking `SendMessage` whose relay link stays down this long
    /// while it waits returns the task as it stands (its delegation stays
    /// queued and goes out when the relay is back; `GetTask` follows it).
    /// `None`: it waits up to the deadline plus `deadline_grace`.
    pub offline_wait: Option<Duration>,
    /// Tasks remembered; past this the oldest finished task is forgotten
    /// (`GetTask` then answers `TaskNotFound`).
    pub max_tasks: usize,
    /// Bytes the finished tasks may weigh together (their kept events,
    /// history and artifacts as JSON, plus a fixed overhead each); past
    /// this the oldest finished task is forgotten. The heap a task holds is
    /// a few times its JSON length (about 10 KB per small finished task
    /// was measured), so `max_tasks` is usually the bound that acts.
    pub max_finished_task_bytes: u64,
    /// A2A events kept per task for streams and cursor replay; past this
    /// the oldest is dropped (a cursor before it gets a gap).
    pub max_events_per_task: usize,
    /// Messages kept in a task's history; past this the oldest after the
    /// first (the request) is dropped.
    pub max_history_per_task: usize,
    /// Bytes each of a task's events, history and artifacts may weigh:
    /// past it the oldest event or message is dropped, and an artifact
    /// update is streamed but not merged into the task's artifacts
    /// (`"artifactsTruncated": true` in its profile metadata).
    pub max_task_bytes: u64,
    /// Push notifications: bounds, retries, the webhook URL rule.
    pub push: PushOptions,
    /// How long a connection may take to send a request's headers, from
    /// when the facade starts waiting for them (the connection's start, or
    /// the end of its previous response); past it the connection is closed
    /// (a request that has begun gets 408). Bounds what slow or silent
    /// connections hold.
    pub header_read_timeout: Duration,
}

impl Default for FacadeOptions {
    fn default() -> Self {
        FacadeOptions {
            public_url: None,
            token: None,
            defaults: DelegationDefaults::default(),
            first_event_wait: Duration::from_secs(1),
            cancel_wait: Duration::from_secs(10),
            peer_lookup_timeout: Duration::from_secs(2),
            deadline_grace: Duration::from_secs(30),
            offline_wait: None,
            max_tasks: 2_000,
            max_finished_task_bytes: 16 * 1024 * 1024,
            max_events_per_task: 10_000,
            max_history_per_task: 100,
            max_task_bytes: 8 * 1024 * 1024,
            push: PushOptions::default(),
            header_read_timeout: Duration::from_millis(
                crate::config::DEFAULT_FACADE_HEADER_TIMEOUT_MS,
            ),
        }
    }
}

/// The state behind every clone of a [`Facade`].
#[derive(Debug)]
struct Inner {
    caller: Caller,
    options: FacadeOptions,
    /// Bounded by `max_tasks`, `max_finished_task_bytes` and the per-task
    /// bounds (see [`TaskTable`]).
    tasks: TaskTable,
    /// The relay's last peer list, for card requests when a fresh one cannot
    /// be had in time; replaced whole by each fresh list.
    peers: Mutex<Option<Vec<PeerEntry>>>,
    /// When each peer's card was first served with its current content
    /// (by ETag), for `Last-Modified`; bounded: see [`card::CardDates`].
    card_dates: Mutex<card::CardDates>,
    /// Push configs and their delivery; bounded by [`PushOptions`].
    push: push::PushRegistry,
    /// Fired by [`Facade::close`]: stops every tracker, open stream and
    /// push delivery.
    stop: CancellationToken,
}

/// The A2A facade of a connector's caller side. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Facade {
    inner: Arc<Inner>,
}

/// What every route handler gets: the facade and the token that ends its
/// open streams.
#[derive(Clone)]
struct RouterState {
    inner: Arc<Inner>,
    streams_stop: CancellationToken,
}

impl Facade {
    /// A facade over `caller`.
    pub fn new(caller: Caller, options: FacadeOptions) -> Facade {
        let tasks = TaskTable::new(TaskBounds {
            max_tasks: options.max_tasks,
            max_finished_bytes: options.max_finished_task_bytes,
            max_events: options.max_events_per_task,
            max_history: options.max_history_per_task,
            max_task_bytes: options.max_task_bytes,
        });
        let push = push::PushRegistry::new(options.push.clone(), caller.state_dir());
        Facade {
            inner: Arc::new(Inner {
                caller,
                options,
                push,
                tasks,
                peers: Mutex::new(None),
                card_dates: Mutex::new(card::CardDates::default()),
                stop: CancellationToken::new(),
            }),
        }
    }

    /// Takes back the delegations an earlier process of this connector left
    /// open (from the caller's state folder): each gets its task again,
    /// under the same ids, folded anew from the relay's log, so `GetTask`,
    /// `ListTasks` and `SubscribeToTask` (cursors included) work across a
    /// restart. Call it once, before serving. Returns how many were taken
    /// back. Push notification configs saved for those tasks are taken back
    /// too, and resume delivery from their cursors.
    pub async fn restore(&self) -> Result<usize, CallerError> {
        let inner = &self.inner;
        let handles = inner.caller.restore().await?;
        let mut cells = Vec::new();
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
                cells.push(cell);
            }
        }
        // The push configs first: a tracker that folds a terminal then
        // finds the configs still delivering it.
        match inner.push.restore(inner) {
            Ok(n) if n > 0 => tracing::info!(configs = n, "took back push notification configs"),
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(error = %e, "could not read the saved push notification configs")
            }
        }
        let restored = cells.len();
        for cell in cells {
            let span = tracing::info_span!("a2a_task", key = %cell.handle.key);
            tokio::spawn(track_delegation(inner.clone(), cell).instrument(span));
        }
        Ok(restored)
    }

    /// Counts of push deliveries since the facade started.
    pub fn push_stats(&self) -> &PushStats {
        &self.inner.push.stats
    }

    /// The push configs held now, active and ended.
    pub fn push_configs(&self) -> PushConfigCounts {
        self.inner.push.counts()
    }

    /// The push series for `/metrics` ([`PushStats::render_prometheus`]).
    pub fn render_push_metrics(&self) -> String {
        self.push_stats().render_prometheus(self.push_configs())
    }

    /// The routes; open streams end when [`Facade::close`] is called.
    pub fn router(&self) -> Router {
        self.router_until(self.inner.stop.child_token())
    }

    /// The routes; open streams end when `streams_stop` fires (so a
    /// graceful shutdown of the server is not held up by SSE clients).
    pub fn router_until(&self, streams_stop: CancellationToken) -> Router {
        let ctx = RouterState {
            inner: self.inner.clone(),
            streams_stop,
        };
        Router::new()
            .route("/peers", get(card::list_peers))
            .route(
                "/peers/{namespace}/{name}/.well-known/agent-card.json",
                get(card::agent_card),
            )
            .route("/peers/{namespace}/{name}", post(rpc::rpc))
            .route("/peers/{namespace}/{name}/", post(rpc::rpc))
            .route("/peers/{namespace}/{name}/{*route}", any(rest::rest))
            .layer(axum::extract::DefaultBodyLimit::max(MAX_REQUEST_BYTES))
            .layer(axum::middleware::from_fn_with_state(
                ctx.clone(),
                guard::guard,
            ))
            .with_state(ctx)
    }

    /// The URL of `peer` under `base` (e.g. `http://127.0.0.1:7070`): its
    /// JSON-RPC endpoint and the base of its HTTP+JSON routes.
    pub fn interface_url(base: &str, peer: &PeerId) -> String {
        format!("{}/peers/{}/", base.trim_end_matches('/'), peer.as_str())
    }

    /// How long a connection may take to send a request's headers
    /// ([`FacadeOptions::header_read_timeout`]).
    pub fn header_read_timeout(&self) -> Duration {
        self.inner.options.header_read_timeout
    }

    /// Stops every tracker and open stream. Delegations go on at the relay;
    /// the connector keeps their events.
    pub fn close(&self) {
        self.inner.stop.cancel();
    }
}

/// The peer named by a route's `{namespace}/{name}`.
fn peer_of(namespace: &str, name: &str) -> Option<PeerId> {
    PeerId::new(&format!("{namespace}/{name}")).ok()
}
