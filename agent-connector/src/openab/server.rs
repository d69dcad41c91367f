//! The endpoint's accept loop and one task per connection.
//!
//! A connection is: a place among the connections waiting for their
//! upgrade (`Waiting`: at most `max_connections`; a newcomer past it
//! closes the one that has waited longest), the WebSocket upgrade with
//! `Authorization: Bearer <key>` checked (a missing or unknown key is
//! answered 401 and never upgraded) within `upgrade_timeout_ms` of the
//! accept (else the TCP connection is closed), a place in its identity's
//! quota (`max_connections_per_identity`) and a connection permit
//! (`max_connections`), both taken before the upgrade is answered (either
//! full: HTTP 503 naming the limit, as the CP refuses an over-quota
//! upgrade), `cp/register` within `register_timeout_secs` of the upgrade (else close
//! 1008 "registration timeout"), then frames until the runtime leaves, its
//! lease lapses (close 1008 "lease expired") or the endpoint stops. Its
//! frames go out through one writer task over a bounded queue
//! (`outbound_queue`); every write is raced against [`WRITE_TIMEOUT`].
//!
//! Never: awaits a write in the reading task, or reads a frame larger than
//! `max_frame_bytes` (tungstenite refuses it before buffering it whole).
//! Never lets a connection that has not upgraded (no key shown) hold a
//! connection permit, nor wait without a deadline: silent local
//! connections cannot keep the runtimes out.

use std::collections::BTreeMap;

use std::sync::Arc;
use std::time::Duration;

use futures_util::{SinkExt as _, StreamExt as _};
use parking_lot::Mutex;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio::time::Instant;
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::handshake::server::{ErrorResponse, Request, Response};
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;
use tokio_tungstenite::tungstenite::protocol::frame::CloseFrame;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{Instrument as _, debug, info, warn};

use super::proto::{self, Incoming, RegisterParams, RpcError, codes, methods};
use super::{Conn, OpenAbEndpoint, Outbound, Shared};

/// Longest a single write to a runtime may take; a runtime that does not
/// read for this long is disconnected.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(10);

/// How long the endpoint waits for its connections to end at shutdown.
pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(5);

/// WebSocket close code "policy violation", with the CP's reasons.
pub(crate) const POLICY: u16 = 1008;

/// One of an identity's `max_connections_per_identity` places, held from
/// the upgrade to the connection's end; dropping it gives the place back
/// (and removes the identity's count when it falls to zero).
struct IdentityPermit {
    shared: Arc<Shared>,
    logical: String,
}

impl IdentityPermit {
    /// A place for `logical`, or `None` when it holds its quota.
    fn take(shared: &Arc<Shared>, logical: &str) -> Option<IdentityPermit> {
        let mut held = shared.identities.lock();
        let n = held.entry(logical.to_string()).or_insert(0);
        if *n >= shared.cfg.max_connections_per_identity {
            return None;
        }
        *n += 1;
        Some(IdentityPermit {
            shared: shared.clone(),
            logical: logical.to_string(),
        })
    }
}

impl Drop for IdentityPermit {
    fn drop(&mut self) {
        let mut held = self.shared.identities.lock();
        if let Some(n) = held.get_mut(&self.logical) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                held.remove(&self.logical);
            }
        }
    }
}

/// An HTTP refusal of the upgrade.
fn refusal(status: u16, body: String) -> ErrorResponse {
    let mut err = ErrorResponse::new(Some(body));
    *err.status_mut() = tokio_tungstenite::tungstenite::http::StatusCode::from_u16(status)
        .unwrap_or(tokio_tungstenite::tungstenite::http::StatusCode::SERVICE_UNAVAILABLE);
    err
}

/// The connections waiting for their upgrade: at most `cap`. A newcomer
/// past it sheds the one that has waited longest (its task closes it), so
/// a runtime, which sends its upgrade request at once, gets through however
/// many silent connections are opened; each waits at most
/// `upgrade_timeout_ms` anyway.
#[derive(Debug)]
struct Waiting {
    cap: usize,
    /// Waiting connections, oldest first, each with the token that sheds it.
    /// An entry is removed when its [`WaitingSlot`] is dropped (upgrade done
    /// or failed) or when it is shed.
    queue: Mutex<(u64, BTreeMap<u64, CancellationToken>)>,
}

impl Waiting {
    /// Room for `cap` waiting connections.
    fn new(cap: usize) -> Arc<Waiting> {
        Arc::new(Waiting {
            cap,
            queue: Mutex::new((0, BTreeMap::new())),
        })
    }

    /// A place for a new connection, shedding the oldest when all are taken.
    fn admit(self: &Arc<Self>) -> WaitingSlot {
        let mut q = self.queue.lock();
        while q.1.len() >= self.cap.max(1) {
            match q.1.pop_first() {
                Some((_, oldest)) => oldest.cancel(),
                None => break,
            }
        }
        let order = q.0;
        q.0 += 1;
        let shed = CancellationToken::new();
        q.1.insert(order, shed.clone());
        WaitingSlot {
            waiting: self.clone(),
            order,
            shed,
        }
    }
}

/// A connection's place among those waiting for their upgrade; dropping it
/// leaves.
#[derive(Debug)]
struct WaitingSlot {
    waiting: Arc<Waiting>,
    order: u64,
    shed: CancellationToken,
}

impl WaitingSlot {
    /// Completes when a newer connection took this one's place: close it.
    async fn shed(&self) {
        self.shed.cancelled().await;
    }
}

impl Drop for WaitingSlot {
    fn drop(&mut self) {
        self.waiting.queue.lock().1.remove(&self.order);
    }
}

/// Serves the endpoint on `listener` until `shutdown`.
pub async fn serve(listener: TcpListener, endpoint: OpenAbEndpoint, shutdown: CancellationToken) {
    let shared = endpoint.shared;
    let permits = Arc::new(Semaphore::new(shared.cfg.max_connections));
    let waiting = Waiting::new(shared.cfg.max_connections);
    let tracker = TaskTracker::new();
    loop {
        let (tcp, addr) = tokio::select! {
            () = shutdown.cancelled() => break,
            r = listener.accept() => match r {
                Ok(x) => x,
                Err(e) => {
                    warn!(error = %e, "openab endpoint: accept failed");
                    continue;
                }
            },
        };
        let _ = tcp.set_nodelay(true);
        let slot = waiting.admit();
        let span = tracing::info_span!("openab_conn", %addr, runtime = tracing::field::Empty);
        let (shared, stop, permits) = (shared.clone(), shutdown.child_token(), permits.clone());
        tracker.spawn(connection(shared, tcp, stop, (slot, permits)).instrument(span));
    }
    tracker.close();
    let _ = tokio::time::timeout(DRAIN_TIMEOUT, tracker.wait()).await;
}

fn ws_config(shared: &Shared) -> WebSocketConfig {
    let max = shared.cfg.max_frame_bytes;
    WebSocketConfig::default()
        .max_message_size(Some(max))
        .max_frame_size(Some(max))
        .write_buffer_size(0)
        .max_write_buffer_size(2 * max.max(shared.cfg.max_result_bytes) + 64 * 1024)
}

async fn connection(
    shared: Arc<Shared>,
    tcp: TcpStream,
    stop: CancellationToken,
    // Its place among the connections waiting for their upgrade, and the
    // connection permits it takes one of once upgraded.
    (slot, permits): (WaitingSlot, Arc<Semaphore>),
) {
    let upgrade_by = Instant::now() + Duration::from_millis(shared.cfg.upgrade_timeout_ms);
    let mut who: Option<usize> = None;
    // Taken before the upgrade is answered, held until the connection ends.
    let mut places: Option<(IdentityPermit, OwnedSemaphorePermit)> = None;
    // tungstenite's callback signature fixes the error type.
    #[allow(clippy::result_large_err)]
    let callback = |req: &Request, resp: Response| -> Result<Response, ErrorResponse> {
        let presented = req
            .headers()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        let Some((index, runtime)) = presented
            .and_then(|k| shared.keys.identify(k))
            .and_then(|i| shared.cfg.runtimes.get(i).map(|r| (i, r)))
        else {
            return Err(refusal(401, "missing or unknown bearer key\n".into()));
        };
        let logical = runtime.logical_id();
        let Some(identity) = IdentityPermit::take(&shared, &logical) else {
            warn!(runtime = %logical, max = shared.cfg.max_connections_per_identity,
                "openab upgrade refused: identity is at its connection quota");
            return Err(refusal(
                503,
                format!(
                    "identity is at its connection quota (max_connections_per_identity = {})\n",
                    shared.cfg.max_connections_per_identity
                ),
            ));
        };
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            warn!(
                max = shared.cfg.max_connections,
                "openab upgrade refused: max_connections are open"
            );
            return Err(refusal(
                503,
                format!(
                    "control plane is at its connection limit (max_connections = {})\n",
                    shared.cfg.max_connections
                ),
            ));
        };
        who = Some(index);
        places = Some((identity, permit));
        Ok(resp)
    };
    let accepted = tokio::select! {
        biased;
        () = stop.cancelled() => return,
        () = slot.shed() => {
            debug!("openab connection closed before its upgrade: newer connections took its place");
            return;
        }
        r = tokio::time::timeout_at(
            upgrade_by,
            tokio_tungstenite::accept_hdr_async_with_config(tcp, callback, Some(ws_config(&shared))),
        ) => r,
    };
    drop(slot);
    let ws = match accepted {
        Ok(Ok(ws)) => ws,
        Ok(Err(e)) => {
            debug!(error = %e, "openab upgrade refused");
            return;
        }
        Err(_) => {
            debug!("openab connection closed: no upgrade within upgrade_timeout_ms");
            return;
        }
    };
    let Some(_places) = places else { return };
    let register_by = Instant::now() + Duration::from_secs(shared.cfg.register_timeout_secs);
    let Some(index) = who else { return };
    let Some(runtime) = shared.cfg.runtimes.get(index) else {
        return;
    };
    let logical = runtime.logical_id();
    tracing::Span::current().record("runtime", logical.as_str());
    let (sink, mut stream) = ws.split();
    let (tx, rx) = mpsc::channel(shared.cfg.outbound_queue);
    let close = stop.child_token();
    let writer = tokio::spawn(write_loop(sink, rx, close.clone()).in_current_span());

    // cp/register: the first text frame, before the deadline.
    let first = tokio::select! {
        () = close.cancelled() => None,
        r = tokio::time::timeout_at(register_by, first_text(&mut stream)) => match r {
            Ok(t) => t,
            Err(_) => {
                warn!(runtime = %logical, "no cp/register within the registration deadline");
                let _ = tx.try_send(Outbound::Close(POLICY, "registration timeout"));
                None
            }
        },
    };
    let Some(first) = first else {
        drop(tx);
        let _ = writer.await;
        return;
    };
    let handle = match register(&shared, index, &first, &tx, &close) {
        Ok(h) => h,
        Err((id, e)) => {
            warn!(runtime = %logical, code = e.code, reason = %e.message, "registration refused");
            let _ = tx.try_send(Outbound::Text(proto::error_response(id, &e)));
            let _ = tx.try_send(Outbound::Close(POLICY, "registration refused"));
            drop(tx);
            let _ = writer.await;
            return;
        }
    };
    let lease = Duration::from_secs(shared.cfg.lease_expiry_secs);
    let mut lease_until = Instant::now() + lease;
    loop {
        let reply = tokio::select! {
            () = close.cancelled() => break,
            () = tokio::time::sleep_until(lease_until) => {
                warn!(runtime = %logical, handle, "lease expired");
                if tx.try_send(Outbound::Close(POLICY, "lease expired")).is_err() {
                    close.cancel();
                }
                break;
            }
            msg = stream.next() => match msg {
                Some(Ok(Message::Text(text))) => {
                    let (renewed, reply) = handle_frame(&shared, handle, text.as_str());
                    if renewed {
                        lease_until = Instant::now() + lease;
                    }
                    reply
                }
                Some(Ok(Message::Binary(_))) => {
                    let e = RpcError::new(codes::INVALID_REQUEST, "binary frames are not JSON-RPC");
                    Some(proto::error_response(0, &e))
                }
                Some(Ok(Message::Close(_))) | None => break,
                Some(Ok(_)) => None,
                Some(Err(e)) => {
                    debug!(error = %e, "openab connection read failed");
                    break;
                }
            },
        };
        // Back-pressure: a full queue stops the reading until the writer
        // makes room (raced against the close, which the writer's
        // WRITE_TIMEOUT fires for a runtime that does not read). The time
        // spent here does not count against the runtime's lease: its
        // heartbeats wait unread meanwhile.
        if let Some(frame) = reply {
            let waited = Instant::now();
            let sent = tokio::select! {
                () = close.cancelled() => false,
                r = tx.send(Outbound::Text(frame)) => r.is_ok(),
            };
            if !sent {
                break;
            }
            lease_until += waited.elapsed();
        }
    }
    drop(tx);
    shared.deregister(handle);
    info!(runtime = %logical, handle, "runtime disconnected");
    let _ = writer.await;
}

/// The first text frame (pings and pongs skipped); `None` at the end.
async fn first_text(
    stream: &mut futures_util::stream::SplitStream<WebSocketStream<TcpStream>>,
) -> Option<String> {
    loop {
        match stream.next().await {
            Some(Ok(Message::Text(t))) => return Some(t.as_str().to_string()),
            Some(Ok(Message::Ping(_) | Message::Pong(_))) => {}
            _ => return None,
        }
    }
}

async fn write_loop(
    mut sink: futures_util::stream::SplitSink<WebSocketStream<TcpStream>, Message>,
    mut rx: mpsc::Receiver<Outbound>,
    close: CancellationToken,
) {
    loop {
        let next = tokio::select! {
            () = close.cancelled() => break,
            m = rx.recv() => m,
        };
        let (msg, last) = match next {
            None => break,
            Some(Outbound::Text(t)) => (Message::text(t), false),
            Some(Outbound::Close(code, reason)) => (
                Message::Close(Some(CloseFrame {
                    code: code.into(),
                    reason: reason.into(),
                })),
                true,
            ),
        };
        let sent = tokio::select! {
            () = close.cancelled() => break,
            r = tokio::time::timeout(WRITE_TIMEOUT, sink.send(msg)) => matches!(r, Ok(Ok(()))),
        };
        if !sent {
            close.cancel();
            break;
        }
        if last {
            break;
        }
    }
    let _ = tokio::time::timeout(WRITE_TIMEOUT, sink.close()).await;
    // The reader ends too (it watches the same token).
    close.cancel();
}

/// Checks `cp/register` against the identity the key is bound to and
/// registers the connection; returns its handle, or the error to answer.
fn register(
    shared: &Arc<Shared>,
    index: usize,
    text: &str,
    tx: &mpsc::Sender<Outbound>,
    close: &CancellationToken,
) -> Result<u64, (u64, RpcError)> {
    let msg = Incoming::parse(text).map_err(|e| (0, e))?;
    let id = msg.request_id().map_err(|e| (msg.id.unwrap_or(0), e))?;
    if msg.method.as_deref() != Some(methods::REGISTER) {
        return Err((
            id,
            RpcError::new(codes::NOT_REGISTERED, "first frame must be cp/register"),
        ));
    }
    let p: RegisterParams = msg.params().map_err(|e| (id, e))?;
    if p.protocol_version != proto::PROTOCOL_VERSION {
        return Err((
            id,
            RpcError::new(
                codes::UNSUPPORTED_VERSION,
                format!(
                    "protocol version {} unsupported (this endpoint speaks {})",
                    p.protocol_version,
                    proto::PROTOCOL_VERSION
                ),
            ),
        ));
    }
    let Some(rt) = shared.cfg.runtimes.get(index) else {
        return Err((id, RpcError::new(codes::IDENTITY_MISMATCH, "unknown key")));
    };
    if p.namespace != rt.namespace || p.name != rt.name || p.agent_type != rt.agent_type {
        return Err((
            id,
            RpcError::new(
                codes::IDENTITY_MISMATCH,
                format!(
                    "registration claims {}/{} ({}) do not match the identity bound to this key",
                    p.namespace, p.name, p.agent_type
                ),
            ),
        ));
    }
    let instance_id = p.instance_id.trim();
    if instance_id.is_empty() || instance_id.len() > 256 {
        return Err((
            id,
            RpcError::new(codes::INVALID_PARAMS, "instance_id must be 1 to 256 bytes"),
        ));
    }
    let max_sessions = match rt.max_delegated_sessions_cap {
        Some(cap) => p.max_delegated_sessions.min(cap),
        None => p.max_delegated_sessions,
    };
    let handle = shared.next_id();
    let logical = rt.logical_id();
    let ack = serde_json::json!({
        "protocol_version": proto::PROTOCOL_VERSION,
        "heartbeat_interval_secs": shared.cfg.heartbeat_interval_secs,
        "lease_expiry_secs": shared.cfg.lease_expiry_secs,
        "effective_max_delegated_sessions": max_sessions,
    });
    // The ack is queued before the connection is visible, so it precedes
    // every frame sent to it.
    let _ = tx.try_send(Outbound::Text(proto::response(id, ack)));
    shared.conns.lock().insert(
        handle,
        Conn {
            logical: logical.clone(),
            agent_type: p.agent_type,
            instance_id: instance_id.to_string(),
            labels: p.labels,
            max_sessions,
            active: 0,
            tx: tx.clone(),
            close: close.clone(),
        },
    );
    info!(runtime = %logical, instance = %instance_id, handle, r#type = %p.agent_type, "runtime registered");
    Ok(handle)
}

/// Handles one frame after registration; returns whether it renewed the
/// lease (a heartbeat), and the reply to send, if any.
fn handle_frame(shared: &Arc<Shared>, handle: u64, text: &str) -> (bool, Option<String>) {
    let msg = match Incoming::parse(text) {
        Ok(m) => m,
        Err(e) => return (false, Some(proto::error_response(0, &e))),
    };
    // Responses to the endpoint's own requests carry nothing it needs.
    let Some(method) = msg.method.clone() else {
        return (false, None);
    };
    let id = match msg.request_id() {
        Ok(id) => id,
        Err(e) => return (false, Some(proto::error_response(msg.id.unwrap_or(0), &e))),
    };
    let reply = |r: Result<serde_json::Value, RpcError>| {
        Some(match r {
            Ok(v) => proto::response(id, v),
            Err(e) => proto::error_response(id, &e),
        })
    };
    let answer = match method.as_str() {
        methods::HEARTBEAT => match msg.params::<proto::HeartbeatParams>() {
            Ok(_) => return (true, reply(Ok(serde_json::json!({ "ok": true })))),
            Err(e) => reply(Err(e)),
        },
        // Admitted: the answer (ack or refusal) comes from its task.
        methods::DELEGATE => match msg.params::<proto::DelegateParams>() {
            Ok(p) => match super::caller_side::delegate(shared, handle, id, p) {
                Ok(()) => None,
                Err(e) => reply(Err(e)),
            },
            Err(e) => reply(Err(e)),
        },
        methods::CANCEL => match msg.params::<proto::CancelParams>() {
            Ok(p) => reply(super::caller_side::cancel(shared, handle, &p)),
            Err(e) => reply(Err(e)),
        },
        methods::DELEGATE_RESULT => match msg.params::<proto::DelegateResultParams>() {
            Ok(p) => {
                super::callee_side::worker_result(shared, handle, p);
                reply(Ok(serde_json::json!({ "ok": true })))
            }
            Err(e) => reply(Err(e)),
        },
        methods::LIST_AGENTS => reply(Ok(list_agents(shared, handle))),
        methods::REGISTER => reply(Err(RpcError::new(
            codes::INVALID_REQUEST,
            "this connection is already registered",
        ))),
        other => reply(Err(RpcError::new(
            codes::METHOD_NOT_FOUND,
            format!("unknown method {other}"),
        ))),
    };
    (false, answer)
}

/// `cp/list_agents`: what a runtime may target, as the CP's roster
/// (`{namespace, agents: [{name, type, instance_id, labels,
/// active_sessions, max_delegated_sessions}]}`): the registered runtimes
/// of the caller's namespace, as the CP lists them, then one entry per
/// `[[openab.targets]]` entry, a worker served by a remote host: `name`
/// what a selector names (the target's name, else its peer), `instance_id`
/// and `peer` the remote host, `labels` the target's, `active_sessions`
/// this endpoint's delegations to it in flight, `max_delegated_sessions`
/// its bound here (`max_delegated_sessions`, else `max_delegations`), and
/// `remote` the selector used on the remote host.
fn list_agents(shared: &Shared, handle: u64) -> serde_json::Value {
    let conns = shared.conns.lock();
    let Some(me) = conns.get(&handle) else {
        return serde_json::json!({ "namespace": "", "agents": [] });
    };
    let namespace = me.logical.split('/').next().unwrap_or_default().to_string();
    let mut agents: Vec<serde_json::Value> = conns
        .values()
        .filter_map(|c| {
            let (ns, name) = c.logical.split_once('/')?;
            (ns == namespace).then(|| {
                serde_json::json!({
                    "name": name,
                    "type": c.agent_type,
                    "instance_id": c.instance_id,
                    "labels": c.labels,
                    "active_sessions": c.active,
                    "max_delegated_sessions": c.max_sessions,
                })
            })
        })
        .collect();
    drop(conns);
    let in_flight: Vec<usize> = shared.flights.lock().values().map(|f| f.target).collect();
    let all = u32::try_from(shared.cfg.max_delegations).unwrap_or(u32::MAX);
    for (i, t) in shared.cfg.targets.iter().enumerate() {
        let active = in_flight.iter().filter(|&&x| x == i).count();
        agents.push(serde_json::json!({
            "name": t.name.clone().unwrap_or_else(|| t.peer.to_string()),
            "type": proto::AgentType::Worker,
            "instance_id": t.peer.to_string(),
            "labels": t.labels.clone().unwrap_or_default(),
            "active_sessions": u32::try_from(active).unwrap_or(u32::MAX),
            "max_delegated_sessions": t.max_delegated_sessions.unwrap_or(all),
            "peer": t.peer.to_string(),
            "remote": t.remote,
        }));
    }
    serde_json::json!({ "namespace": namespace, "agents": agents })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_newcomer_past_the_cap_sheds_the_longest_waiting() {
        let waiting = Waiting::new(2);
        let a = waiting.admit();
        let b = waiting.admit();
        let c = waiting.admit();
        assert!(a.shed.is_cancelled() && !b.shed.is_cancelled() && !c.shed.is_cancelled());
        drop(b);
        let d = waiting.admit();
        assert!(!c.shed.is_cancelled() && !d.shed.is_cancelled());
        drop((a, c, d));
        assert!(
            waiting.queue.lock().1.is_empty(),
            "every place is given back"
        );
    }
}
