//! The listener: accepts TCP, runs TLS and the WebSocket upgrade under one
//! deadline in a task per connection (a slow client never blocks `accept`),
//! caps connections and handshakes (in total and per source, shedding the
//! oldest unauthenticated connection of the largest holder when all
//! handshake slots are held, see [`crate::admission`]), rate-limits
//! sources, and hands authenticated sessions to [`crate::session`]. Also
//! the admin listener and the lifecycle sweeper.
//!
//! It owns the tasks that live as long as the relay: the wake subscriber loops
//! (`wake_loop`, one per store URL), the fleet liveness tick, the sweeper, the
//! pruning of the rate limiters' per-address and per-peer state, and the drain
//! at shutdown.
//!
//! Never: waits in the accept loop for anything a client controls: TLS, the
//! upgrade and the session handshake run in the connection's own task under one
//! deadline, and a connection over the per-source rate, the connection cap or
//! its source's handshake share is dropped at once (never a queue); one that
//! finds every handshake slot held takes the slot of a connection that has
//! not authenticated (that one is closed) or is dropped.
//! Never reads a frame: the handshake and the frame loop are the session's.

use parking_lot::Mutex;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use oab_wire::handshake::{ChannelBinding, HandshakePolicy, NonceLedger};
use rustls::ServerConfig;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio_tungstenite::tungstenite::handshake::server::{ErrorResponse, Request, Response};
use tokio_tungstenite::tungstenite::http::HeaderValue;
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{Instrument as _, debug, info, warn};

use crate::admission::{
    HandshakePermit, HandshakeSlots, PRE_AUTH_READ_BYTES, PreAuthLimit, Source,
};
use crate::config::{Config, TlsMode};
use crate::hub::Hub;
use crate::metrics::Metrics;
use crate::proxy_protocol::Admission;
use crate::reload::{ConfigSource, LiveConfig, Reloader};
use crate::session::{self, SessionEnv};
use crate::store::{EventStore, StoreError};

/// Why the relay could not start.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The store did not answer at start.
    #[error("store: {0}")]
    Store(#[from] StoreError),
    /// `tls_mode = "terminate"` without a TLS config.
    #[error("tls_mode is \"terminate\" but no TLS configuration was given")]
    MissingTls,
}

/// The WebSocket settings of a relay session: message and frame caps equal
/// to the largest valid frame, a 2 KiB read buffer (idle sessions stay near
/// 20 KiB each; measured cost: about +5% relay CPU per 16-64 KiB frame),
/// a 32 KiB write buffer (frames fed in one batch leave in few TLS records
/// and one `writev` instead of one each: +31% frames/s at 256 B measured),
/// and a bounded write buffer cap. Before the session is authenticated,
/// reads are capped far lower by [`PreAuthLimit`] (tokio-tungstenite 0.29
/// cannot change these caps on a live stream, so the budget sits under it).
pub fn ws_config(config: &Config) -> WebSocketConfig {
    let max = config.wire_limits().max_frame();
    WebSocketConfig::default()
        .read_buffer_size(2 * 1024)
        .write_buffer_size(32 * 1024)
        .max_write_buffer_size(2 * max + crate::session::MAX_WELCOME_BYTES + 64 * 1024)
        .max_message_size(Some(max))
        .max_frame_size(Some(max))
}

/// How a running relay reloads its configuration (see [`crate::reload`]).
#[derive(Debug)]
pub struct Reload {
    /// The file and the overrides to read again.
    pub source: ConfigSource,
    /// Each notification reloads once (`main` notifies it on `SIGHUP`;
    /// notifications that come during a reload make one more).
    pub trigger: Arc<tokio::sync::Notify>,
}

/// Runs the relay until `shutdown` is cancelled, then drains.
///
/// `listener` is where connectors connect; `admin` (optional) serves
/// `/metrics`, `/healthz`, `/readyz`, `/status` and the status page
/// (`/status.html`, `/`). Nothing here binds a port itself.
/// The configuration cannot be reloaded (`POST /reload` answers 500);
/// see [`run_reloadable`].
pub async fn run<S: EventStore>(
    listener: TcpListener,
    admin: Option<TcpListener>,
    config: Arc<Config>,
    store: Arc<S>,
    tls: Option<Arc<ServerConfig>>,
    shutdown: CancellationToken,
) -> Result<(), RunError> {
    run_reloadable(listener, admin, config, store, tls, shutdown, None).await
}

/// [`run`], and reloads the configuration from `reload`'s file at each of
/// its triggers and at each `POST /reload` on the admin listener.
pub async fn run_reloadable<S: EventStore>(
    listener: TcpListener,
    admin: Option<TcpListener>,
    config: Arc<Config>,
    store: Arc<S>,
    tls: Option<Arc<ServerConfig>>,
    shutdown: CancellationToken,
    reload: Option<Reload>,
) -> Result<(), RunError> {
    if config.relay.tls_mode == TlsMode::Terminate && tls.is_none() {
        return Err(RunError::MissingTls);
    }
    let metrics = Metrics::new(&crate::config::Directory::new(&config).peers);
    if let Err(e) = store.register_metrics(&metrics.registry) {
        tracing::warn!(error = %e, "the store's metrics are not exported");
    }
    let epoch = store.epoch().await?;
    let hub = Hub::new(store, config.clone(), metrics, epoch, shutdown.clone());
    hub.install(crate::reload::LiveConfig::first(config.clone(), tls));
    let (source, trigger) = match reload {
        Some(r) => (Some(r.source), Some(r.trigger)),
        None => (None, None),
    };
    let reloader = Arc::new(Reloader::new(source, &hub.metrics));
    let tracker = TaskTracker::new();
    if let Some(trigger) = trigger {
        let (hub, reloader, stop) = (hub.clone(), reloader.clone(), shutdown.clone());
        tracker.spawn(
            async move {
                loop {
                    tokio::select! {
                        () = stop.cancelled() => break,
                        () = trigger.notified() => {
                            // Logged and counted by the reloader.
                            let _ = reloader.reload(&hub).await;
                        }
                    }
                }
            }
            .instrument(tracing::info_span!("reload")),
        );
    }

    if hub.fleet.enabled {
        // Liveness first, and the wake subscriber connected, before any
        // session can be accepted.
        hub.fleet_tick().await;
        let Some(rx) = hub.fleet.connect(0, &shutdown).await else {
            return Ok(());
        };
        info!(node = %hub.fleet.node, "fleet member (shared store)");
        let mut first = Some(rx);
        for i in 0..hub.fleet.links() {
            let (hub, stop) = (hub.clone(), shutdown.clone());
            // Link 0 is up already; the others connect in their loop.
            let rx = first.take();
            tracker.spawn(
                wake_loop(hub, i, rx, stop).instrument(tracing::info_span!("wake", link = i)),
            );
        }
        {
            let (hub, stop) = (hub.clone(), shutdown.clone());
            let every = Duration::from_millis((config.fleet.node_lease_ms / 3).max(100));
            tracker.spawn(async move {
                let mut tick = tokio::time::interval(every);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                loop {
                    tokio::select! {
                        () = stop.cancelled() => break,
                        _ = tick.tick() => hub.fleet_tick().await,
                    }
                }
            });
        }
    }

    if let Some(admin) = admin {
        let (hub, hub_for_reload, reloader) = (hub.clone(), hub.clone(), reloader.clone());
        let stop = shutdown.clone();
        tracker.spawn(async move {
            let app =
                admin_router(hub).merge(crate::reload::admin_routes(hub_for_reload, reloader));
            let _ = axum::serve(admin, app)
                .with_graceful_shutdown(async move { stop.cancelled().await })
                .await;
        });
    }

    {
        let hub = hub.clone();
        let stop = shutdown.clone();
        let every = Duration::from_millis(config.lifecycle.sweep_interval_ms);
        tracker.spawn(
            async move {
                let mut tick = tokio::time::interval(every);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                loop {
                    tokio::select! {
                        () = stop.cancelled() => break,
                        _ = tick.tick() => hub.sweep().await,
                    }
                }
            }
            .instrument(tracing::info_span!("sweeper")),
        );
    }

    tracker.spawn(
        hub.clone()
            .run_releases()
            .instrument(tracing::info_span!("releases")),
    );

    let nonces = Arc::new(Mutex::new(NonceLedger::new(
        config.relay.max_handshakes,
        config.relay.handshake_timeout_ms,
    )));
    {
        // Keyed limiters keep an entry per key until pruned: bound their
        // memory. Those a reload replaced are dropped with their config.
        let (hub, stop) = (hub.clone(), shutdown.clone());
        tracker.spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(10));
            loop {
                tokio::select! {
                    () = stop.cancelled() => break,
                    _ = tick.tick() => {
                        let live = hub.live();
                        let l = &live.limiters;
                        l.connects.retain_recent();
                        l.connects.shrink_to_fit();
                        l.peer_frames.retain_recent();
                        l.requests.retain_recent();
                    }
                }
            }
        });
    }
    let connections = Arc::new(Semaphore::new(config.relay.max_connections));
    let handshakes = HandshakeSlots::new(
        config.relay.max_handshakes,
        config.relay.max_handshakes_per_source,
    );
    let ws_cfg = ws_config(&config);
    let conn_tasks = TaskTracker::new();
    info!(listen = %listener.local_addr().map(|a| a.to_string()).unwrap_or_default(), relay = %config.relay.id, "relay listening");

    loop {
        let (tcp, addr) = tokio::select! {
            () = shutdown.cancelled() => break,
            r = listener.accept() => match r {
                Ok(x) => x,
                Err(e) => {
                    // Out of file descriptors and the like: back off briefly.
                    warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let source = Source::of(
            addr.ip(),
            config.relay.source_prefix_v4,
            config.relay.source_prefix_v6,
        );
        // Read once per connection: the TLS certificate, the handshake's
        // peers and keys, and the limits in force now.
        let live = hub.live();
        // From a trusted load balancer, the source comes in the PROXY
        // header: the per-source checks run once it is read.
        let proxied = config.relay.proxy_protocol.expects_header(addr.ip());
        if !proxied && live.limiters.connects.check_key(&source.addr()).is_err() {
            hub.metrics
                .refused
                .with_label_values(&["rate_limited"])
                .inc();
            continue;
        }
        let Ok(conn_permit) = connections.clone().try_acquire_owned() else {
            hub.metrics
                .refused
                .with_label_values(&["max_connections"])
                .inc();
            continue;
        };
        let admission = if proxied {
            handshakes.try_reserve().map(Admission::Proxied)
        } else {
            handshakes.try_admit(source).map(Admission::Direct)
        };
        let admission = match admission {
            Ok(a) => a,
            Err(why) => {
                hub.metrics
                    .refused
                    .with_label_values(&[why.metric_label()])
                    .inc();
                continue;
            }
        };
        if let Err(e) = crate::admission::tune_accepted(
            &tcp,
            config.relay.tcp_keepalive_ms,
            config.relay.tcp_user_timeout_ms,
        ) {
            debug!(error = %e, "socket options not set");
        }
        let env = SessionEnv {
            nonces: nonces.clone(),
            policy: HandshakePolicy {
                max_skew_ms: live.config.relay.max_clock_skew_ms,
                deadline_ms: config.relay.handshake_timeout_ms,
                require_tls_binding: config.relay.tls_mode == TlsMode::Terminate,
            },
            peer_limiter: live.limiters.peer_frames.clone(),
        };
        let acceptor = live.tls.clone().map(tokio_rustls::TlsAcceptor::from);
        // A proxied connection's client is charged the per-source rate of
        // this config once its header is read; then the config is let go.
        let limiter = live;
        let hub = hub.clone();
        let span = tracing::debug_span!("conn", %addr, client = tracing::field::Empty);
        let fut = async move {
            hub.metrics.connections.inc();
            let admitted = (admission, addr, limiter);
            connection(hub.clone(), env, tcp, acceptor, ws_cfg, admitted).await;
            hub.metrics.connections.dec();
            drop(conn_permit);
        }
        .instrument(span);
        conn_tasks.spawn(fut);
    }

    info!("draining sessions");
    conn_tasks.close();
    let drain = Duration::from_millis(config.relay.drain_timeout_ms);
    if tokio::time::timeout(drain, conn_tasks.wait())
        .await
        .is_err()
    {
        warn!("drain timeout: cutting remaining sessions");
    }
    hub.tasks.close();
    let _ = tokio::time::timeout(Duration::from_secs(1), hub.tasks.wait()).await;
    if hub.fleet.enabled {
        // Hand the fleet-wide work over now rather than after the lease.
        let node = &hub.fleet.node;
        let _ = hub
            .store
            .release_lease(crate::fleet::SWEEPER_LEASE, node)
            .await;
        let _ = hub
            .store
            .retire_node(node, &hub.fleet.incarnation, hub.fleet.node_lease_ms)
            .await;
        info!(%node, "left the fleet");
    }
    tracker.close();
    let _ = tokio::time::timeout(Duration::from_secs(2), tracker.wait()).await;
    info!("relay stopped");
    Ok(())
}

/// Takes wake-channel messages from subscriber link `i` until shutdown;
/// connects it first if `rx` is `None`, reconnects it when its connection is
/// lost, and resynchronises after anything may have been missed.
async fn wake_loop<S: EventStore>(
    hub: Arc<Hub<S>>,
    i: usize,
    rx: Option<tokio::sync::mpsc::Receiver<redis::PushInfo>>,
    stop: CancellationToken,
) {
    let mut rx = match rx {
        Some(rx) => rx,
        None => match hub.fleet.connect(i, &stop).await {
            Some(rx) => rx,
            None => return,
        },
    };
    loop {
        loop {
            let msg = tokio::select! {
                () = stop.cancelled() => return,
                msg = rx.recv() => msg,
            };
            let Some(msg) = msg else { break };
            match msg.kind {
                redis::PushKind::Message => {
                    let mut data = msg.data.into_iter();
                    let (
                        Some(redis::Value::BulkString(channel)),
                        Some(redis::Value::BulkString(payload)),
                    ) = (data.next(), data.next())
                    else {
                        continue;
                    };
                    if let Some(peer) = crate::store::peer_of_channel(&channel) {
                        hub.on_wake(peer, bytes::Bytes::from(payload));
                    }
                }
                redis::PushKind::Disconnection => break,
                _ => {}
            }
            if hub.fleet.take_overflow(i) {
                warn!("wake queue overflowed; resynchronising from the store");
                hub.resync(crate::hub::ResyncCause::WakeQueueOverflow).await;
                if !hub.fleet.ping(i).await {
                    break;
                }
            }
        }
        warn!(
            link = i,
            "wake subscriber lost its connection; reconnecting"
        );
        hub.fleet.disconnected(i);
        rx = match hub.fleet.connect(i, &stop).await {
            Some(rx) => rx,
            None => return,
        };
        hub.resync(crate::hub::ResyncCause::SubscriberReconnected)
            .await;
    }
}

async fn connection<S: EventStore>(
    hub: Arc<Hub<S>>,
    env: SessionEnv,
    mut tcp: TcpStream,
    acceptor: Option<tokio_rustls::TlsAcceptor>,
    ws_cfg: WebSocketConfig,
    // How it was admitted at accept, its peer address, the per-source
    // connection rate (applied here to a proxied connection's client).
    (admission, peer, live): (Admission, SocketAddr, Arc<LiveConfig>),
) {
    let deadline =
        tokio::time::Instant::now() + Duration::from_millis(hub.config.relay.handshake_timeout_ms);
    let Some(hs_permit) = crate::proxy_protocol::admit(
        admission,
        &mut tcp,
        peer,
        crate::proxy_protocol::AdmitRules {
            proxy_protocol: hub.config.relay.proxy_protocol.enabled,
            source_prefix_v4: hub.config.relay.source_prefix_v4,
            source_prefix_v6: hub.config.relay.source_prefix_v6,
        },
        &live.limiters.connects,
        &hub.metrics,
        deadline,
    )
    .await
    else {
        return;
    };
    drop(live);
    match acceptor {
        Some(acceptor) => {
            let accepted = tokio::select! {
                biased;
                () = hs_permit.shed() => {
                    hub.metrics.handshakes.with_label_values(&["shed"]).inc();
                    return;
                }
                r = tokio::time::timeout_at(deadline, Box::pin(acceptor.accept(tcp))) => r,
            };
            let tls = match accepted {
                Ok(Ok(s)) => s,
                Ok(Err(e)) => {
                    debug!(error = %e, "TLS handshake failed");
                    hub.metrics.handshakes.with_label_values(&["tls"]).inc();
                    return;
                }
                Err(_) => {
                    hub.metrics.handshakes.with_label_values(&["timeout"]).inc();
                    return;
                }
            };
            let Some(exporter) = crate::tls::exporter_value(tls.get_ref().1) else {
                hub.metrics.handshakes.with_label_values(&["tls"]).inc();
                return;
            };
            let io = PreAuthLimit::new(tls, PRE_AUTH_READ_BYTES);
            let Some(ws) = Box::pin(upgrade(&hub, io, ws_cfg, deadline, &hs_permit)).await else {
                return;
            };
            session::serve(
                hub,
                env,
                ws,
                ChannelBinding::TlsExporter(exporter),
                deadline,
                hs_permit,
            )
            .await;
        }
        None => {
            let io = PreAuthLimit::new(tcp, PRE_AUTH_READ_BYTES);
            let Some(ws) = Box::pin(upgrade(&hub, io, ws_cfg, deadline, &hs_permit)).await else {
                return;
            };
            session::serve(
                hub,
                env,
                ws,
                ChannelBinding::ChallengeOnly,
                deadline,
                hs_permit,
            )
            .await;
        }
    }
}

/// The WebSocket upgrade, under `deadline`; `None` (counted) when it fails,
/// times out or the connection is shed meanwhile.
async fn upgrade<S, IO>(
    hub: &Hub<S>,
    io: IO,
    ws_cfg: WebSocketConfig,
    deadline: tokio::time::Instant,
    permit: &HandshakePermit,
) -> Option<tokio_tungstenite::WebSocketStream<IO>>
where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    // tungstenite's callback signature fixes the error type.
    #[allow(clippy::result_large_err)]
    let callback = |req: &Request, mut resp: Response| -> Result<Response, ErrorResponse> {
        let offered = req
            .headers()
            .get_all("sec-websocket-protocol")
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .any(|p| p.trim() == oab_wire::SUBPROTOCOL);
        if !offered {
            let mut err = ErrorResponse::new(Some(format!(
                "the OAB relay protocol needs the WebSocket subprotocol {}",
                oab_wire::SUBPROTOCOL
            )));
            *err.status_mut() = tokio_tungstenite::tungstenite::http::StatusCode::BAD_REQUEST;
            return Err(err);
        }
        resp.headers_mut().insert(
            "sec-websocket-protocol",
            HeaderValue::from_static(oab_wire::SUBPROTOCOL),
        );
        Ok(resp)
    };
    let upgraded = tokio::select! {
        biased;
        () = permit.shed() => {
            hub.metrics.handshakes.with_label_values(&["shed"]).inc();
            return None;
        }
        r = tokio::time::timeout_at(
            deadline,
            tokio_tungstenite::accept_hdr_async_with_config(io, callback, Some(ws_cfg)),
        ) => r,
    };
    match upgraded {
        Ok(Ok(ws)) => Some(ws),
        Ok(Err(e)) => {
            debug!(error = %e, "WebSocket upgrade failed");
            hub.metrics.handshakes.with_label_values(&["upgrade"]).inc();
            None
        }
        Err(_) => {
            hub.metrics.handshakes.with_label_values(&["timeout"]).inc();
            None
        }
    }
}

fn admin_router<S: EventStore>(hub: Arc<Hub<S>>) -> Router {
    Router::new()
        .route("/metrics", get(metrics_handler::<S>))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(ready_handler::<S>))
        .route("/status", get(status_handler::<S>))
        .route("/delegation", get(delegation_handler::<S>))
        .route("/delegations", get(delegations_handler::<S>))
        .route("/status.html", get(status_page))
        .route("/", get(status_page))
        .with_state(hub)
}

async fn status_handler<S: EventStore>(
    State(hub): State<Arc<Hub<S>>>,
) -> axum::Json<crate::status::RelayStatus> {
    axum::Json(crate::status::status(&hub).await)
}

/// `GET /delegation?id=<key | A2A task id | CP delegation id>`: where one
/// delegation is (`oab-relay inspect`). 200 with the inspection; 400 for an
/// id of no known form; 404 when no delegation has it; 409 when a CP
/// delegation id names several; 503 when the store does not answer. Errors
/// are JSON `{"error": "..."}`.
async fn delegation_handler<S: EventStore>(
    State(hub): State<Arc<Hub<S>>>,
    axum::extract::Query(q): axum::extract::Query<std::collections::HashMap<String, String>>,
) -> axum::response::Response {
    use crate::inspect::InspectError;
    use axum::response::IntoResponse as _;
    let Some(id) = q.get("id") else {
        return json_error(
            StatusCode::BAD_REQUEST,
            "missing query parameter id (a delegation key, A2A task id or CP delegation id)",
        );
    };
    match crate::inspect::inspect(&hub, id).await {
        Ok(i) => axum::Json(i).into_response(),
        Err(e) => {
            let status = match &e {
                InspectError::BadId(_) => StatusCode::BAD_REQUEST,
                InspectError::NotFound(_) => StatusCode::NOT_FOUND,
                InspectError::Ambiguous { .. } => StatusCode::CONFLICT,
                InspectError::Store(_) => StatusCode::SERVICE_UNAVAILABLE,
            };
            json_error(status, &e.to_string())
        }
    }
}

/// `GET /delegations?limit=N`: the configured callers' open delegations,
/// oldest first (at most `inspect::MAX_OLDEST`; default 10). One store read
/// per open delegation. 503 when the store does not answer.
async fn delegations_handler<S: EventStore>(
    State(hub): State<Arc<Hub<S>>>,
    axum::extract::Query(q): axum::extract::Query<std::collections::HashMap<String, String>>,
) -> axum::response::Response {
    use axum::response::IntoResponse as _;
    let limit = match q.get("limit").map(|l| l.parse::<usize>()) {
        None => 10,
        Some(Ok(n)) => n,
        Some(Err(_)) => {
            return json_error(StatusCode::BAD_REQUEST, "limit must be a whole number");
        }
    };
    match crate::inspect::oldest_open(&hub, limit).await {
        Ok(o) => axum::Json(o).into_response(),
        Err(e) => json_error(StatusCode::SERVICE_UNAVAILABLE, &e.to_string()),
    }
}

fn json_error(status: StatusCode, error: &str) -> axum::response::Response {
    use axum::response::IntoResponse as _;
    (status, axum::Json(serde_json::json!({ "error": error }))).into_response()
}

async fn status_page() -> impl axum::response::IntoResponse {
    (
        [
            (axum::http::header::CONTENT_TYPE, "text/html; charset=utf-8"),
            // The page's own inline script and style only, and fetches to
            // this origin.
            (
                axum::http::header::CONTENT_SECURITY_POLICY,
                "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'",
            ),
        ],
        crate::status::STATUS_PAGE,
    )
}

async fn metrics_handler<S: EventStore>(
    State(hub): State<Arc<Hub<S>>>,
) -> impl axum::response::IntoResponse {
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4",
        )],
        hub.metrics.render(),
    )
}

/// 200 `ready`; 503 `draining`, or 503 `store unreachable: <what is down>`
/// (on a Redis Cluster, every master that does not answer, with its slots).
async fn ready_handler<S: EventStore>(State(hub): State<Arc<Hub<S>>>) -> (StatusCode, String) {
    if hub.shutdown.is_cancelled() {
        return (StatusCode::SERVICE_UNAVAILABLE, "draining\n".into());
    }
    match hub.store.ping().await {
        Ok(()) => (StatusCode::OK, "ready\n".into()),
        Err(e) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("store unreachable: {e}\n"),
        ),
    }
}
