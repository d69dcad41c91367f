//! One connection: the session handshake, then the frame loop.
//!
//! A single task owns the WebSocket: it reads frames (in batches of whatever
//! is already buffered, so durable appends are pipelined), writes the
//! session's queue, watches the idle timer and the close signal. Frames
//! before authentication, text messages and undecodable frames close the
//! connection with a typed close code; frames that are valid but refused get
//! an `Error` frame and the session continues.
//!
//! It owns the path of a peer's frames into the relay: a batch is decoded
//! (`decode_into_batch`) and rate-checked once, each log frame is checked
//! against its delegation's view (`stage`, `check`) and staged, the staged
//! frames go to the store in one pipelined `EventStore::append` (`flush`), and
//! each durable entry is handed to the hub (`Hub::appended`) and acknowledged
//! with one cumulative `Ack` per log (`answer`). Up to
//! `limits.append_batches_in_flight` batches are in flight at once: the next
//! batch is read and handed to the store while earlier ones are still being
//! made durable; answers are released oldest first, and a failed batch fails
//! the ones in flight behind it (`AppendsInFlight`). An `Open` is answered by `open`:
//! idempotency check, route, depth, deadline, size, digest, caps,
//! `EventStore::open`, `Hub::created`.
//!
//! Never: acknowledges a frame the store has not made durable: an `Ack` follows
//! an `Appended` or `Duplicate` outcome of `EventStore::append`, or a
//! delegation `EventStore::open` created or already held; a failed append is
//! answered with `store_unavailable`, never with an ack. Never reads a
//! delegation payload beyond its length and, for an `Open`, its digest.

use parking_lot::Mutex;
use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::stream::{SplitSink, SplitStream};
use futures_util::{FutureExt as _, SinkExt as _, StreamExt as _};
use governor::DefaultKeyedRateLimiter;
use oab_wire::frame::FLAG_RELAY_ORIGIN;
use oab_wire::handshake::{ChannelBinding, HandshakePolicy, NonceLedger, ServerHandshake};
use oab_wire::{
    Ack, CloseCode, DelegationCursor, DelegationKey, Digest, Direction, Frame, Limits, Outcome,
    PeerId, SessionId, Welcome, decode_message, encode,
};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::protocol::CloseFrame;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode as WsCloseCode;
use tracing::{Instrument as _, debug, info, warn};

use crate::admission::{HandshakePermit, PRE_AUTH_READ_BYTES, PreAuthLimit};
use crate::hub::{DelegationView, Hub, InFlightOpens, SessionRef, Subscribed, ViewRef};
use crate::outbox::{Inbox, outbox_with_control};
use crate::refusal::Refusal;
use crate::store::{AppendOutcome, AppendRequest, EventStore, OpenOutcome, OpenRequest, Origin};
use tokio_util::sync::CancellationToken;

/// Frames read from the socket before a batch is processed.
const MAX_BATCH: usize = 256;

/// The log target of the one line per delegation opened and per delegation
/// finished (`OAB_LOG=info,oab_relay::delegation=warn` leaves them out).
const DELEGATION_LOG: &str = "oab_relay::delegation";

/// Largest welcome payload (JSON list of open delegations), bytes. The
/// session's write buffer cap is sized to hold it.
pub const MAX_WELCOME_BYTES: usize = 4 * 1024 * 1024;
/// Frames written before a flush.
const MAX_WRITE_BATCH: usize = 256;
/// The reader reads the next batch only while at most
/// `read_control_depth(in flight)` control frames wait: a batch of
/// [`MAX_BATCH`] frames queues at most one reply each, so room is kept for
/// the batch about to be read and for every batch still in flight, and
/// [`HUB_CONTROL_HEADROOM`] is left for what the hub queues on its own
/// meanwhile. The peer's own acks and errors then never overflow the
/// control lane; a peer that does not read them is back-pressured instead
/// of cut.
fn read_control_depth(control_capacity: usize, in_flight: usize) -> usize {
    control_capacity.saturating_sub((in_flight + 1) * MAX_BATCH + HUB_CONTROL_HEADROOM)
}

/// The control lane of a session that keeps up to `batches` append batches
/// in flight: the base [`crate::outbox::CONTROL_CAPACITY`] (which holds one
/// batch's replies, the next batch's and the hub's headroom) plus one
/// batch's replies for every further batch in flight.
fn control_capacity(batches: usize) -> usize {
    crate::outbox::CONTROL_CAPACITY + batches.saturating_sub(1) * MAX_BATCH
}
/// Control frames the hub may queue for a session between two of its read
/// batches without a request of its own: at most one `Peers` snapshot
/// (coalesced), and `Gap`s and errors of replays.
const HUB_CONTROL_HEADROOM: usize = 64;
/// How long a closing session gets to write its last control frames and the
/// close frame; then the connection is dropped whether or not the peer
/// reads (a peer that stopped reading would otherwise hold it forever).
pub const CLOSE_DEADLINE: Duration = Duration::from_secs(1);

/// What a connection needs besides the hub.
#[derive(Debug, Clone)]
pub struct SessionEnv {
    /// Outstanding handshake nonces.
    pub nonces: Arc<Mutex<NonceLedger>>,
    /// Handshake rules.
    pub policy: HandshakePolicy,
    /// Per-peer frame rate limiter.
    pub peer_limiter: Arc<DefaultKeyedRateLimiter<PeerId>>,
}

/// Closes a WebSocket with a code and reason (best effort).
pub async fn close_ws<IO>(ws: &mut WebSocketStream<IO>, code: CloseCode, reason: &str)
where
    IO: AsyncRead + AsyncWrite + Unpin,
{
    let frame = CloseFrame {
        code: WsCloseCode::from(code.as_u16()),
        reason: reason.chars().take(120).collect::<String>().into(),
    };
    let _ = tokio::time::timeout(Duration::from_secs(1), ws.close(Some(frame))).await;
}

/// Closes a connection whose handshake slot was shed for a newer
/// connection (all `relay.max_handshakes` were held and this one had not
/// authenticated; see [`crate::admission::HandshakeSlots`]).
async fn shed<IO>(m: &crate::metrics::Metrics, ws: &mut WebSocketStream<IO>)
where
    IO: AsyncRead + AsyncWrite + Unpin,
{
    m.handshakes.with_label_values(&["shed"]).inc();
    close_ws(
        ws,
        CloseCode::Overloaded,
        "handshake slots full; this connection waited longest without a verified hello",
    )
    .await;
}

/// Runs the session handshake and, once authenticated, the frame loop.
/// `deadline` bounds the whole handshake (TLS, upgrade and the `Welcome`
/// write included); `handshake_permit` is held until the `Welcome` is
/// written. The stream's pre-authentication read budget is lifted once the
/// `Hello` verifies.
pub async fn serve<S, IO>(
    hub: Arc<Hub<S>>,
    env: SessionEnv,
    mut ws: WebSocketStream<PreAuthLimit<IO>>,
    binding: ChannelBinding,
    deadline: tokio::time::Instant,
    handshake_permit: HandshakePermit,
) where
    S: EventStore,
    IO: AsyncRead + AsyncWrite + Unpin + Send,
{
    let limits = hub.config.wire_limits();
    // Boxed: the handshake's state is freed when it ends instead of being
    // reserved for the whole life of the session (idle sessions are cheap).
    let handshake = Box::pin(handshake(
        &hub,
        &env,
        &mut ws,
        &binding,
        (deadline, &handshake_permit),
        &limits,
    ));
    let Some(session) = handshake.await else {
        return;
    };
    drop(handshake_permit);
    let (peer, id) = (session.me.peer.clone(), session.me.id);
    let span = tracing::info_span!("session", peer = %peer, session = %id);
    let started = Instant::now();
    let ended = session.run(ws, limits).instrument(span).await;
    // Once per session, outside its span (the fields are on the line).
    let duration = oab_ops::time::short_duration(
        u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX),
    );
    match ended.code {
        Some(code) => info!(
            %peer, session = %id, reason = %ended.reason, code, %duration, "session ended"
        ),
        None => info!(%peer, session = %id, reason = %ended.reason, %duration, "session ended"),
    }
}

/// How a session ended, for its one `session ended` line.
struct SessionEnded {
    /// `closed by peer`, `idle_timeout: ...`, `replaced: ...`,
    /// `shutdown: ...`, `connection lost`...
    reason: String,
    /// The close code the relay sent (none when the connection was gone).
    code: Option<u16>,
}

async fn handshake<S, IO>(
    hub: &Arc<Hub<S>>,
    env: &SessionEnv,
    ws: &mut WebSocketStream<PreAuthLimit<IO>>,
    binding: &ChannelBinding,
    // The handshake's deadline, and its slot: the connection closes if the
    // slot is shed before the `Hello` verifies.
    (deadline, permit): (tokio::time::Instant, &HandshakePermit),
    limits: &Limits,
) -> Option<Session<S>>
where
    S: EventStore,
    IO: AsyncRead + AsyncWrite + Unpin + Send,
{
    let m = &hub.metrics;
    // The configuration in force at this handshake: the session keeps its
    // limits and timers for its whole life (a reload applies to new ones).
    let live = hub.live();
    let now = oab_wire::identity::now_ms();
    let issued = ServerHandshake::start(hub.config.relay.id.clone(), now, &mut env.nonces.lock());
    let (hs, challenge) = match issued {
        Ok(x) => x,
        Err(e) => {
            m.handshakes.with_label_values(&["overloaded"]).inc();
            close_ws(ws, e.close_code(), &e.public_reason()).await;
            return None;
        }
    };
    let forget = |env: &SessionEnv| env.nonces.lock().forget(hs.nonce());
    let Ok(bytes) = encode(&Frame::Challenge(challenge)) else {
        forget(env);
        return None;
    };
    if ws.send(Message::Binary(bytes)).await.is_err() {
        forget(env);
        return None;
    }
    let hello = loop {
        let next = tokio::select! {
            biased;
            () = permit.shed() => {
                forget(env);
                shed(m, ws).await;
                return None;
            }
            next = tokio::time::timeout_at(deadline, ws.next()) => next,
        };
        let msg = match next {
            Err(_) => {
                forget(env);
                m.handshakes.with_label_values(&["timeout"]).inc();
                close_ws(
                    ws,
                    CloseCode::HandshakeTimeout,
                    "no hello before the handshake deadline",
                )
                .await;
                return None;
            }
            Ok(Some(Err(_))) if ws.get_ref().exhausted() => {
                forget(env);
                m.handshakes.with_label_values(&["oversized"]).inc();
                let reason =
                    format!("more than {PRE_AUTH_READ_BYTES} bytes before the hello was verified");
                close_ws(ws, CloseCode::FrameTooLarge, &reason).await;
                return None;
            }
            Ok(None) | Ok(Some(Err(_))) => {
                forget(env);
                m.handshakes.with_label_values(&["transport"]).inc();
                return None;
            }
            Ok(Some(Ok(msg))) => msg,
        };
        match msg {
            Message::Binary(b) => match decode_message(b, limits) {
                Ok(Frame::Hello(h)) => break h,
                Ok(other) => {
                    forget(env);
                    m.handshakes.with_label_values(&["protocol"]).inc();
                    let reason = format!(
                        "{} frame before authentication; send hello first",
                        other.frame_type().name()
                    );
                    close_ws(ws, CloseCode::ProtocolViolation, &reason).await;
                    return None;
                }
                Err(e) => {
                    forget(env);
                    m.handshakes.with_label_values(&["malformed"]).inc();
                    close_ws(ws, e.close_code(), &e.to_string()).await;
                    return None;
                }
            },
            Message::Ping(_) | Message::Pong(_) => continue,
            Message::Close(_) => {
                forget(env);
                m.handshakes.with_label_values(&["transport"]).inc();
                return None;
            }
            _ => {
                forget(env);
                m.handshakes.with_label_values(&["protocol"]).inc();
                close_ws(ws, CloseCode::ProtocolViolation, "binary frames only").await;
                return None;
            }
        }
    };
    let now = oab_wire::identity::now_ms();
    let verified = hs.verify(
        &hello,
        &live.directory,
        &mut env.nonces.lock(),
        &env.policy,
        now,
        binding,
    );
    let auth = match verified {
        Ok(_) if !permit.shield() => {
            // Shed between the `Hello`'s arrival and its check.
            shed(m, ws).await;
            return None;
        }
        Ok(a) => {
            // Authenticated: from here on the session's limits are the
            // WebSocket caps of `server::ws_config`, and its handshake slot
            // cannot be shed.
            ws.get_mut().lift();
            a
        }
        Err(e) => {
            forget(env);
            let result = match e.close_code() {
                CloseCode::UnsupportedVersion => "version",
                CloseCode::ClockSkew => "clock_skew",
                CloseCode::BindingRequired => "binding",
                CloseCode::HandshakeTimeout => "timeout",
                CloseCode::Overloaded => "overloaded",
                _ => "auth_failed",
            };
            m.handshakes.with_label_values(&[result]).inc();
            // The claimed peer id is logged, never used as a metric label.
            warn!(claimed_peer = %hello.peer, error = %e, "handshake refused");
            close_ws(ws, e.close_code(), &e.public_reason()).await;
            return None;
        }
    };
    let settings = live.config.clone();
    drop(live);
    let (out, inbox) = outbox_with_control(
        control_capacity(settings.limits.append_batches_in_flight),
        settings.limits.session_queue,
        settings.limits.session_queue_bytes,
        limits.max_frame() + crate::outbox::CONTROL_HEADROOM_BYTES,
        Duration::from_millis(settings.limits.slow_consumer_ms),
        &hub.shutdown,
    );
    let me = SessionRef {
        id: SessionId::random(),
        peer: auth.peer.clone(),
        instance: auth.instance,
        key_id: auth.key_id.clone(),
        since_ms: oab_wire::identity::now_ms(),
        hello_ms: hello.time_ms,
        outbox: out,
    };
    // A callee back with a new instance lost what it had accepted: end that
    // work as `unknown` before the welcome, so the new instance never sees it
    // as open.
    //
    // The session is registered first, so a delegation opened for this peer
    // while the welcome is being built is either in the welcome's list or
    // delivered on the session (after the welcome); never neither.
    // The store's epoch, read afresh: after the store lost its data, a peer
    // closed by another instance that noticed first may reconnect here
    // before this instance's next sweep; it must get the new epoch in this
    // welcome, not a close a moment later (this closes the sessions here
    // that predate the loss, as the sweep would).
    hub.check_epoch().await;
    if !hub.register(me.clone()) {
        // A later connection of this connector process registered while
        // this one waited (a store outage holds handshakes here): that one is
        // in use, this one was given up.
        m.handshakes.with_label_values(&["superseded"]).inc();
        close_ws(
            ws,
            CloseCode::Superseded,
            "a later connection of this connector is the session",
        )
        .await;
        return None;
    }
    // Verified against the configuration of a moment ago: a reload
    // installed meanwhile must not miss this session.
    hub.close_if_revoked(&me);
    if let Err(e) = hub.claim_presence(&me).await {
        warn!(error = %e, "store unavailable for presence");
        m.handshakes.with_label_values(&["store"]).inc();
        hub.unregister(&me);
        close_ws(ws, CloseCode::StoreUnavailable, "store unavailable; retry").await;
        return None;
    }
    let listed = match hub.store.open_delegations_of(&me.peer).await {
        Ok(list) => list,
        Err(e) => {
            warn!(error = %e, "store unavailable at welcome");
            m.handshakes.with_label_values(&["store"]).inc();
            hub.unregister(&me);
            close_ws(ws, CloseCode::StoreUnavailable, "store unavailable; retry").await;
            return None;
        }
    };
    hub.end_lost_work(&me.peer, Some(me.instance), &listed)
        .await;
    let listed = hub
        .store
        .open_delegations_of(&me.peer)
        .await
        .unwrap_or(listed);
    hub.seed_counts(&me.peer, &listed);
    // Only unfinished delegations (the store's index of open ones, so the
    // cost does not grow with the finished ones retention keeps): finished
    // ones need nothing from a new session (a receiver that still wants
    // their events resumes them).
    let mut cursors: Vec<DelegationCursor> = listed
        .iter()
        .filter(|d| d.terminal.is_none())
        .map(|d| {
            let is_caller = d.key.caller == me.peer;
            DelegationCursor {
                key: d.key.clone(),
                counterpart: if is_caller {
                    d.callee.clone()
                } else {
                    d.key.caller.clone()
                },
                is_caller,
                down: d.down_tail,
                up: d.up_tail,
                terminal: d.terminal,
            }
        })
        .collect();
    // The work this peer accepted as callee first: a cut below keeps it
    // listed, and its `up` tail is how a callee that kept its instance
    // across a restart knows not to run it again (protocol §8.9.3); what
    // is left out follows as fresh `Open`s. Accepted work is bounded by
    // the callee's concurrency, so it fits.
    cursors.sort_by_key(|c| c.is_caller || c.up == 0);
    let mut payload = serde_json::to_vec(&cursors).unwrap_or_default();
    let mut left_out = Vec::new();
    while payload.len() > MAX_WELCOME_BYTES && !cursors.is_empty() {
        // Bounded: what does not fit is delivered on the session after the
        // welcome (below).
        let keep = cursors.len() * MAX_WELCOME_BYTES / payload.len();
        warn!(
            listed = cursors.len(),
            keep, "welcome list over its size bound; the rest follows on the session"
        );
        left_out.extend(cursors.drain(keep..));
        payload = serde_json::to_vec(&cursors).unwrap_or_default();
    }
    let welcome = Frame::Welcome(Welcome {
        session: me.id,
        epoch: hub.epoch(),
        heartbeat_ms: settings.relay.heartbeat_ms,
        max_header: limits.max_header,
        max_payload: limits.max_payload,
        max_in_flight: settings.limits.max_in_flight,
        payload: Bytes::from(payload),
    });
    // Under the handshake deadline: a client that authenticated and then
    // stopped reading must not keep its handshake slot.
    let Ok(bytes) = encode(&welcome) else {
        m.handshakes.with_label_values(&["transport"]).inc();
        hub.unregister(&me);
        return None;
    };
    match tokio::time::timeout_at(deadline, ws.send(Message::Binary(bytes))).await {
        Ok(Ok(())) => {}
        Ok(Err(_)) => {
            m.handshakes.with_label_values(&["transport"]).inc();
            hub.unregister(&me);
            return None;
        }
        Err(_) => {
            m.handshakes.with_label_values(&["timeout"]).inc();
            hub.unregister(&me);
            return None;
        }
    }
    hub.deliver_left_out(&me, left_out);
    m.handshakes.with_label_values(&["ok"]).inc();
    info!(peer = %me.peer, session = %me.id, instance = %me.instance, delegations = cursors.len(), "session authenticated");
    Some(Session {
        hub: hub.clone(),
        env: env.clone(),
        me,
        settings,
        inbox: Some(inbox),
        pending: Vec::new(),
        appends: AppendsInFlight::default(),
        overlap_acks: OverlapAcks::default(),
        acks: PendingAcks::default(),
        batch_at: (Instant::now(), oab_wire::identity::now_ms()),
        batch_limited: false,
        cached_view: None,
    })
}

struct Pending {
    view: ViewRef,
    req: AppendRequest,
    received: Instant,
}

/// What [`Session::check_open`] made of an open.
enum Checked {
    /// Refused whatever the store holds.
    Refused(Refusal),
    /// Refused, unless the store already holds this delegation (an
    /// idempotent retry, answered from the store).
    Unless(Refusal),
    /// To be opened in the store.
    Passed(Box<OpenRequest>),
}

/// One open of a run, once its store call came back.
// Not boxed: each lives from its store call to its answer only, at most one
// run (`MAX_BATCH` opens) of them per session at a time, in the future of
// the call itself.
#[allow(clippy::large_enum_variant)]
enum OpenStep {
    /// Refused by a check; `stored`: whether the store holds the
    /// delegation with the same digest (`None`: not asked).
    Refused {
        refusal: Refusal,
        stored: Option<Result<Option<bool>, crate::store::StoreError>>,
    },
    /// Opened in the store (`res`), with the frame stored; `woke`: whether
    /// the store published it on the callee's wake channel.
    Stored {
        frame: Bytes,
        started: Instant,
        woke: bool,
        res: Result<OpenOutcome, crate::store::StoreError>,
    },
}

/// The store call of one open of a run.
type OpenCall = Pin<Box<dyn Future<Output = OpenStep> + Send>>;

/// What the store answers for one append batch.
type AppendResult = Result<Vec<AppendOutcome>, crate::store::StoreError>;

/// A store call of one append batch.
type AppendCall = Pin<Box<dyn Future<Output = AppendResult> + Send>>;

/// One append batch handed to the store: its staged frames (`T`), the
/// store's call, and the answer once it came.
struct AppendBatch<T> {
    staged: T,
    started: Instant,
    call: AppendCall,
    answer: Option<AppendResult>,
    /// How many batches had been answered when this one was put in flight:
    /// those answered from then on ([`Answered::overlapped`]) were in
    /// flight beside it.
    behind: u64,
}

/// An answered batch: its staged frames, when it was put in flight, how to
/// take its answer, and which batches were in flight beside it.
struct Answered<T> {
    staged: T,
    started: Instant,
    answer: Answer,
    /// The numbers (counted from 0 in the order answered) of the batches
    /// answered while this one was in flight: their store calls ran beside
    /// this one's, in an order the session does not control.
    overlapped: std::ops::Range<u64>,
}

/// How an answered batch is to be taken.
#[derive(Debug)]
enum Answer {
    /// The store's outcomes, one per frame.
    Outcomes(Vec<AppendOutcome>),
    /// The store failed this batch: nothing of it is acknowledged.
    Failed(crate::store::StoreError),
    /// An earlier batch failed while this one was in flight: whatever the
    /// store answered, nothing of it is acknowledged.
    BehindFailure,
}

/// A session's append batches in flight, oldest first.
///
/// Order: the batches' store calls are polled oldest first, every time,
/// so each batch's first commands reach the store's connection after those
/// of the batches staged before it. That does not hold for a call's later
/// steps: on Redis Cluster the store charges the sender's byte budget in
/// one round trip and appends in the next, and a later batch whose budget
/// reply is polled before an earlier batch's can send its appends first (a
/// single Redis server takes a batch in one round trip, so there its
/// batches keep their order; a cluster's resends can still reorder). The store
/// checks every entry against its log's tail, so a batch that overtook an
/// earlier one of the same log gets `Hole`s (never acknowledged), not a
/// wrong ack; the session answers such a hole from what it acknowledged
/// meanwhile ([`OverlapAcks`]). Answers are released oldest first only,
/// and a failed batch fails the batches in flight behind it.
struct AppendsInFlight<T> {
    batches: VecDeque<AppendBatch<T>>,
    /// Batches still to be failed because an earlier one failed while they
    /// were in flight.
    failing: usize,
    /// Batches answered so far.
    answered: u64,
}

impl<T> Default for AppendsInFlight<T> {
    fn default() -> Self {
        AppendsInFlight {
            batches: VecDeque::new(),
            failing: 0,
            answered: 0,
        }
    }
}

impl<T> AppendsInFlight<T> {
    fn len(&self) -> usize {
        self.batches.len()
    }

    fn is_empty(&self) -> bool {
        self.batches.is_empty()
    }

    /// Puts a batch in flight behind the others; its call is first polled
    /// by the next [`Self::oldest`], after theirs.
    fn push(&mut self, staged: T, call: AppendCall) {
        self.batches.push_back(AppendBatch {
            staged,
            started: Instant::now(),
            call,
            answer: None,
            behind: self.answered,
        });
    }

    /// The number the oldest batch in flight will be answered as, if any
    /// is in flight: no batch answered before it overlapped those in
    /// flight (see [`OverlapAcks::forget_before`]).
    fn oldest_behind(&self) -> Option<u64> {
        self.batches.front().map(|b| b.behind)
    }

    /// Drives every unanswered batch, oldest first; ready with the oldest
    /// batch once the store answered it.
    fn poll_oldest(&mut self, cx: &mut std::task::Context<'_>) -> Poll<Answered<T>> {
        for b in self.batches.iter_mut().filter(|b| b.answer.is_none()) {
            if let Poll::Ready(answer) = b.call.as_mut().poll(cx) {
                b.answer = Some(answer);
            }
        }
        if self.batches.front().is_none_or(|b| b.answer.is_none()) {
            return Poll::Pending;
        }
        let Some(AppendBatch {
            staged,
            started,
            answer: Some(answer),
            behind,
            ..
        }) = self.batches.pop_front()
        else {
            return Poll::Pending;
        };
        let overlapped = behind..self.answered;
        self.answered += 1;
        let behind = self.failing > 0;
        self.failing = self.failing.saturating_sub(1);
        let answer = match answer {
            Ok(_) if behind => Answer::BehindFailure,
            Ok(outcomes) => Answer::Outcomes(outcomes),
            Err(e) => {
                // Every batch in flight now was sent before this failure
                // was known.
                self.failing = self.batches.len();
                Answer::Failed(e)
            }
        };
        Poll::Ready(Answered {
            staged,
            started,
            answer,
            overlapped,
        })
    }

    /// The oldest batch, once answered.
    async fn oldest(&mut self) -> Answered<T> {
        std::future::poll_fn(|cx| self.poll_oldest(cx)).await
    }
}

/// Logs whose room [`PendingAcks`] keeps between answers.
const PENDING_ACKS_KEPT_ROOM: usize = 64;

/// The acks a session is about to send: one per log, its highest
/// sequence (acks are cumulative), in the order the logs were first
/// acked. Indexed by log, so an answer that acks the logs of hundreds of
/// delegations records each in constant time (a scan of the list per ack
/// was quadratic in them).
#[derive(Default)]
struct PendingAcks {
    list: Vec<(DelegationKey, Direction, u64)>,
    at: std::collections::HashMap<(DelegationKey, Direction), usize>,
}

impl PendingAcks {
    fn record(&mut self, key: DelegationKey, dir: Direction, seq: u64) {
        // Mostly the log of the ack before (one connection's frames of one
        // delegation in a row): no hashing on that path.
        if let Some(last) = self.list.last_mut()
            && last.1 == dir
            && last.0 == key
        {
            last.2 = last.2.max(seq);
            return;
        }
        match self.at.entry((key, dir)) {
            std::collections::hash_map::Entry::Occupied(e) => {
                if let Some(a) = self.list.get_mut(*e.get()) {
                    a.2 = a.2.max(seq);
                }
            }
            std::collections::hash_map::Entry::Vacant(e) => {
                self.list.push((e.key().0.clone(), dir, seq));
                e.insert(self.list.len() - 1);
            }
        }
    }

    fn iter(&self) -> std::slice::Iter<'_, (DelegationKey, Direction, u64)> {
        self.list.iter()
    }

    /// The acks, in order; none are left. The index keeps its room only
    /// while it is small: a session that once answered a batch of many
    /// delegations does not hold that much memory while idle.
    fn take(&mut self) -> Vec<(DelegationKey, Direction, u64)> {
        if self.at.capacity() > PENDING_ACKS_KEPT_ROOM {
            self.at = std::collections::HashMap::new();
        } else {
            self.at.clear();
        }
        std::mem::take(&mut self.list)
    }
}

/// The acks of answered batches that later batches still in flight
/// overlapped, per log: the highest sequence acknowledged and the number of
/// the last batch that acknowledged it.
///
/// A `Hole` at `tail` in a batch that overlapped one which acknowledged
/// more than `tail` of the same log is that batch having overtaken it in
/// the store (see [`AppendsInFlight`]), not entries the store lost: it is
/// refused as a `sequence_gap` at what the session acknowledged (the peer
/// resends after it), never below an ack the peer already has (which would
/// tell it the store lost acknowledged entries).
///
/// Owned by the session and dropped with it; recorded only while batches
/// are in flight behind the answered one (so with one batch in flight it
/// stays empty), and pruned at every answered batch to what the batches
/// still in flight overlapped (emptied when none is).
#[derive(Default)]
struct OverlapAcks {
    logs: std::collections::HashMap<(DelegationKey, Direction), (u64, u64)>,
}

impl OverlapAcks {
    /// Records that batch number `batch` acknowledged `seq` of a log.
    fn record(&mut self, key: &DelegationKey, dir: Direction, seq: u64, batch: u64) {
        let slot = self.logs.entry((key.clone(), dir)).or_insert((seq, batch));
        if seq >= slot.0 {
            *slot = (seq, batch);
        }
    }

    /// What the session acknowledged of a log, above `tail`, in one of the
    /// `overlapped` batches.
    fn above(
        &self,
        key: &DelegationKey,
        dir: Direction,
        tail: u64,
        overlapped: &std::ops::Range<u64>,
    ) -> Option<u64> {
        let (seq, batch) = *self.logs.get(&(key.clone(), dir))?;
        (seq > tail && overlapped.contains(&batch)).then_some(seq)
    }

    /// Forgets what no batch still in flight overlapped: the acks of
    /// batches answered before number `oldest` (all of them without one).
    fn forget_before(&mut self, oldest: Option<u64>) {
        if self.logs.is_empty() {
            return;
        }
        match oldest {
            Some(oldest) => self.logs.retain(|_, (_, batch)| *batch >= oldest),
            None => self.logs.clear(),
        }
    }
}

struct Session<S> {
    hub: Arc<Hub<S>>,
    env: SessionEnv,
    me: SessionRef,
    /// The configuration in force at the handshake: this session's timers
    /// and queue limits (a reload applies to later sessions).
    settings: Arc<crate::config::Config>,
    /// The receiving side of the queues; `run` hands it to the writer.
    inbox: Option<Inbox>,
    pending: Vec<Pending>,
    /// Append batches handed to the store and not yet answered (at most
    /// `limits.append_batches_in_flight`).
    appends: AppendsInFlight<Vec<Pending>>,
    /// Acks that batches still in flight overlapped.
    overlap_acks: OverlapAcks,
    acks: PendingAcks,
    /// When the current batch was read (monotonic, and ms since the epoch).
    batch_at: (Instant, u64),
    /// The current batch is over the peer's frame rate.
    batch_limited: bool,
    /// The last delegation looked up (consecutive frames mostly share one).
    cached_view: Option<(DelegationKey, ViewRef)>,
}

enum End {
    /// Close the connection with this code and reason.
    Closed(CloseCode, String),
    /// The relay is shutting down: `Drain`, then close with `going_away`.
    Shutdown,
    /// The connection is gone (or unusable): drop it. Why, for the log.
    Transport(&'static str),
    /// Someone closed the session (see `Inbox::close_reason`).
    Cancelled,
}

impl End {
    /// Closes the session's queues (and so stops the other half of the
    /// session) for this end; the first reason recorded wins.
    fn close(&self, outbox: &crate::outbox::Outbox) {
        match self {
            End::Closed(code, reason) => outbox.close(*code, reason),
            End::Shutdown | End::Transport(_) => {
                outbox.close(CloseCode::GoingAway, "session ended");
            }
            End::Cancelled => {}
        }
    }
}

impl<S: EventStore> Session<S> {
    /// Runs the session until it ends, then closes the connection within
    /// [`CLOSE_DEADLINE`].
    ///
    /// The socket is split: the reader (`read_loop`, this session's frames)
    /// and the writer (`write_loop`, the queues) run side by side in this
    /// task, so heavy delivery never stops the peer's own frames from being
    /// read and acknowledged, and a peer that stops reading never stops the
    /// reader, the idle timer or the close signal. Whichever ends first
    /// closes the outbox; the other stops at its next frame boundary.
    ///
    /// Not an `async fn`: the socket is split before the future is built, so
    /// the future holds the two halves, not a second copy of the socket
    /// (idle sessions stay small).
    fn run<IO>(self, ws: WebSocketStream<IO>, limits: Limits) -> impl Future<Output = SessionEnded>
    where
        IO: AsyncRead + AsyncWrite + Unpin + Send,
    {
        let (sink, stream) = ws.split();
        self.run_split(sink, stream, limits)
    }

    async fn run_split<IO>(
        mut self,
        mut sink: SplitSink<WebSocketStream<IO>, Message>,
        mut stream: SplitStream<WebSocketStream<IO>>,
        limits: Limits,
    ) -> SessionEnded
    where
        IO: AsyncRead + AsyncWrite + Unpin + Send,
    {
        let Some(mut inbox) = self.inbox.take() else {
            return SessionEnded {
                reason: "no queues".into(),
                code: None,
            };
        };
        let hub = self.hub.clone();
        let outbox = self.me.outbox.clone();
        let stall = Duration::from_millis(self.settings.limits.slow_consumer_ms);
        // One task polls both halves; the reader's acks wake the writer
        // without rescheduling the task (see `crate::wakes`).
        let (read_end, write_end) = crate::wakes::coalesce_wakes(async {
            tokio::join!(
                async {
                    let end = self.read_loop(&mut stream, &limits).await;
                    end.close(&outbox);
                    end
                },
                async {
                    let end = write_loop(&mut sink, &mut inbox, stall, &hub).await;
                    end.close(&outbox);
                    end
                },
            )
        })
        .await;
        let end = match (read_end, write_end) {
            (End::Cancelled, End::Cancelled) => match inbox.close_reason() {
                Some((code, reason)) => End::Closed(code, reason),
                None => End::Shutdown,
            },
            (End::Cancelled, end) | (end, _) => end,
        };
        // The receiver resumes delegation frames from the log: free them now.
        inbox.discard_data();
        let ended = match &end {
            End::Closed(code, reason) => SessionEnded {
                reason: format!("{}: {reason}", code.name()),
                code: Some(code.as_u16()),
            },
            End::Shutdown => SessionEnded {
                reason: "shutdown: relay shutting down".into(),
                code: Some(CloseCode::GoingAway.as_u16()),
            },
            End::Transport(why) => SessionEnded {
                reason: (*why).to_string(),
                code: None,
            },
            End::Cancelled => SessionEnded {
                reason: "cancelled".into(),
                code: None,
            },
        };
        match end {
            End::Closed(..) | End::Shutdown => {
                let drain = matches!(end, End::Shutdown).then(|| oab_wire::Drain {
                    reconnect_after_ms: hub.live().config.relay.reconnect_hint_ms,
                });
                let (code, reason) = match end {
                    End::Closed(code, reason) => (code, reason),
                    _ => (
                        CloseCode::GoingAway,
                        "relay shutting down; reconnect".to_string(),
                    ),
                };
                debug!(code = code.as_u16(), reason = %reason, "closing session");
                // Counted when decided: the close below may take up to
                // CLOSE_DEADLINE on a peer that is not reading.
                hub.metrics
                    .disconnects
                    .with_label_values(&[code.name()])
                    .inc();
                if let Ok(ws) = sink.reunite(stream) {
                    // Boxed: the reunited socket and the close's state are
                    // then not reserved in the session's future for its
                    // whole (mostly idle) life.
                    let closing = close_with_control(ws, &mut inbox, drain, code, &reason);
                    if tokio::time::timeout(CLOSE_DEADLINE, Box::pin(closing))
                        .await
                        .is_err()
                    {
                        debug!("close deadline passed; dropping the connection");
                    }
                }
            }
            End::Transport(_) | End::Cancelled => {
                debug!("connection ended");
                hub.metrics
                    .disconnects
                    .with_label_values(&["transport"])
                    .inc();
            }
        }
        drop(inbox);
        self.hub.unregister(&self.me);
        ended
    }

    /// Reads and processes the peer's frames until the peer goes away, a
    /// frame ends the session, the idle timeout passes or the session is
    /// closed (`End::Cancelled`). Stops only between batches.
    async fn read_loop<R>(&mut self, stream: &mut R, limits: &Limits) -> End
    where
        R: futures_util::Stream<Item = Result<Message, tokio_tungstenite::tungstenite::Error>>
            + Unpin,
    {
        let idle = Duration::from_millis(self.settings.relay.idle_timeout_ms);
        let cancel = self.me.outbox.cancel_token();
        let batches = self.settings.limits.append_batches_in_flight.max(1);
        let capacity = control_capacity(batches);
        let mut last_rx = tokio::time::Instant::now();
        let end = loop {
            // Reads only with room for another batch in flight and for its
            // replies (back-pressure: the peer's replies are not being taken).
            let reading = self.appends.len() < batches;
            let depth = read_control_depth(capacity, self.appends.len());
            let room = self.me.outbox.control_depth() <= depth;
            tokio::select! {
                biased;
                () = cancel.cancelled() => break End::Cancelled,
                batch = self.appends.oldest(), if !self.appends.is_empty() => {
                    self.answer(batch);
                }
                () = self.me.outbox.control_room(depth), if reading && !room => {
                    last_rx = tokio::time::Instant::now();
                }
                msg = stream.next(), if reading && room => {
                    last_rx = tokio::time::Instant::now();
                    let mut batch = Vec::with_capacity(8);
                    if let Err(end) = self.decode_into_batch(msg, limits, &mut batch) {
                        break end;
                    }
                    // Take whatever else is already buffered, without waiting.
                    let mut stop = None;
                    while batch.len() < MAX_BATCH {
                        let Some(msg) = stream.next().now_or_never() else { break };
                        if let Err(end) = self.decode_into_batch(msg, limits, &mut batch) {
                            stop = Some(end);
                            break;
                        }
                    }
                    // One clock read and one rate-limit check per batch.
                    self.batch_at = (Instant::now(), oab_wire::identity::now_ms());
                    oab_ops::busy_poll::touch(self.batch_at.0);
                    // The lookup cache lives for one batch only, so it never
                    // outlives the hub's eviction of a finished delegation.
                    self.cached_view = None;
                    let log_frames = batch
                        .iter()
                        .filter(|(_, f)| matches!(f, Frame::Data(_) | Frame::Cancel(_) | Frame::Open(_)))
                        .count();
                    self.batch_limited = std::num::NonZeroU32::new(u32::try_from(log_frames).unwrap_or(u32::MAX))
                        .is_some_and(|n| !matches!(self.env.peer_limiter.check_key_n(&self.me.peer, n), Ok(Ok(()))));
                    // Boxed per batch (one allocation for up to MAX_BATCH
                    // frames): the processing state then lives only while a
                    // batch is processed, not for the whole idle life of the
                    // session.
                    Box::pin(self.process(batch)).await;
                    if let Some(end) = stop {
                        break end;
                    }
                }
                () = tokio::time::sleep_until(last_rx + idle), if reading && room => {
                    break End::Closed(CloseCode::IdleTimeout, "no frame within the idle timeout".into());
                }
            }
        };
        // Whatever ends the session, the batches in flight are answered
        // first (their acks queued, their frames delivered), as a batch
        // being processed always was.
        Box::pin(self.settle()).await;
        end
    }

    /// Decodes one read result into the batch. `Err`: the session ends
    /// (`End::Transport` when the peer went away).
    fn decode_into_batch(
        &self,
        msg: Option<Result<Message, tokio_tungstenite::tungstenite::Error>>,
        limits: &Limits,
        batch: &mut Vec<(Bytes, Frame)>,
    ) -> Result<(), End> {
        let m = &self.hub.metrics;
        match msg {
            Some(Ok(Message::Close(_))) => Err(End::Transport("closed by peer")),
            None => Err(End::Transport("connection closed by peer")),
            Some(Err(tokio_tungstenite::tungstenite::Error::Capacity(e))) => Err(End::Closed(
                CloseCode::FrameTooLarge,
                format!("message over the frame limit: {e}"),
            )),
            Some(Err(tokio_tungstenite::tungstenite::Error::Protocol(e))) => Err(End::Closed(
                CloseCode::ProtocolViolation,
                format!("WebSocket protocol error: {e}"),
            )),
            Some(Err(_)) => Err(End::Transport("connection lost")),
            Some(Ok(Message::Binary(bytes))) => {
                m.hot.bytes_in.inc_by(bytes.len() as u64);
                let frame = match decode_message(bytes.clone(), limits) {
                    Ok(frame) => frame,
                    Err(e @ oab_wire::FrameError::PayloadTooLarge { .. }) => {
                        attributable(&bytes, limits)
                            .ok_or_else(|| End::Closed(e.close_code(), e.to_string()))?
                    }
                    Err(e) => return Err(End::Closed(e.close_code(), e.to_string())),
                };
                if let Some(c) = m.hot.frame_in(frame.frame_type()) {
                    c.inc();
                }
                batch.push((bytes, frame));
                Ok(())
            }
            Some(Ok(Message::Ping(_) | Message::Pong(_) | Message::Frame(_))) => Ok(()),
            Some(Ok(Message::Text(_))) => Err(End::Closed(
                CloseCode::ProtocolViolation,
                "text messages are not part of the protocol; send binary frames".into(),
            )),
        }
    }

    async fn process(&mut self, batch: Vec<(Bytes, Frame)>) {
        let mut frames = batch.into_iter().peekable();
        while let Some((raw, frame)) = frames.next() {
            let Frame::Open(open) = frame else {
                self.handle((raw, frame)).await;
                continue;
            };
            // A run of consecutive opens (of distinct delegations) is in
            // flight at once; see `opens`.
            let mut run = vec![(raw, open)];
            while let Some((_, Frame::Open(next))) = frames.peek() {
                if run.iter().any(|(_, o)| o.key == next.key) {
                    break;
                }
                let Some((raw, Frame::Open(next))) = frames.next() else {
                    break;
                };
                run.push((raw, next));
            }
            // Answered after every frame before them, as if no batch were
            // in flight: the staged frames go to the store and every batch
            // in flight is answered first.
            self.flush();
            Box::pin(self.settle()).await;
            // Boxed: rare frames' state does not enlarge every session's
            // task for its whole life.
            Box::pin(self.opens(run)).await;
        }
        self.flush();
    }

    fn push(&self, frame: &Frame) {
        if let Ok(bytes) = encode(frame) {
            self.me.outbox.push(bytes);
        }
    }

    /// Refuses the frame at `seq` of `key`'s `dir` log with an `Error` frame.
    fn refuse(&self, refusal: Refusal, key: Option<&DelegationKey>, dir: Direction, seq: u64) {
        self.hub.refuse(&self.me, refusal, key, dir, seq);
    }

    async fn handle(&mut self, (raw, frame): (Bytes, Frame)) {
        match frame {
            Frame::Data(d) => {
                let (key, dir, seq, terminal, flags) =
                    (d.key, d.direction, d.seq, d.terminal, d.flags);
                let len = d.payload.len();
                self.stage(key, dir, seq, terminal, flags, len, raw).await;
            }
            Frame::Cancel(c) => {
                let len = c.payload.len();
                self.stage(c.key, Direction::Down, c.seq, None, c.flags, len, raw)
                    .await;
            }
            // Rare frames: boxed, so their state does not enlarge every
            // session's task for its whole life.
            // Answered after every frame before them, as if no batch were
            // in flight: the staged frames go to the store and every batch
            // in flight is answered first.
            Frame::Open(open) => {
                self.flush();
                Box::pin(self.settle()).await;
                Box::pin(self.opens(vec![(raw, open)])).await;
            }
            // A caller's release of a finished delegation: queued for the
            // store, answered with nothing (it has everything).
            Frame::Resume(r)
                if self
                    .hub
                    .take_release(&r.key, &self.me.peer, r.direction, r.after) => {}
            Frame::Resume(r) => {
                self.flush();
                Box::pin(self.settle()).await;
                Box::pin(self.resume(r.key, r.direction, r.after)).await;
            }
            Frame::Ping(p) => self.push(&Frame::Pong(p)),
            Frame::Pong(_) => {}
            Frame::PeersQuery => self.peers_query(),
            Frame::Publish(descriptor) => Box::pin(self.publish(descriptor)).await,
            Frame::Hello(_) => self.refuse(Refusal::HelloAgain, None, Direction::Down, 0),
            other => self.refuse(
                Refusal::NotForTheRelay {
                    frame: other.frame_type(),
                },
                None,
                Direction::Down,
                0,
            ),
        }
    }

    /// Authorizes a log frame and queues it for the next pipelined append.
    #[allow(clippy::too_many_arguments)]
    async fn stage(
        &mut self,
        key: DelegationKey,
        dir: Direction,
        seq: u64,
        terminal: Option<Outcome>,
        flags: u8,
        len: usize,
        raw: Bytes,
    ) {
        let received = self.batch_at.0;
        if self.batch_limited {
            self.hub
                .metrics
                .rate_limited
                .with_label_values(&["peer"])
                .inc();
            self.refuse(Refusal::RateLimited, Some(&key), dir, seq);
            return;
        }
        let cached = self
            .cached_view
            .as_ref()
            .filter(|(k, _)| *k == key)
            .map(|(_, l)| l.clone());
        let mut view = match cached {
            Some(l) => l,
            None => match self.lookup(&key, dir, seq).await {
                Some(l) => l,
                None => return,
            },
        };
        let (wake, refusal) = loop {
            let checked = {
                let l = view.lock();
                (!l.evicted()).then(|| self.check(&l, dir, flags, len))
            };
            if let Some(checked) = checked {
                break checked;
            }
            // The hub dropped this view from its cache: look it up again
            // (rare; the check rides on the lock taken anyway).
            match self.lookup(&key, dir, seq).await {
                Some(fresh) => view = fresh,
                None => return,
            }
        };
        if let Some(refusal) = refusal {
            self.refuse(refusal, Some(&key), dir, seq);
            return;
        }
        self.pending.push(Pending {
            view,
            req: AppendRequest {
                key,
                dir,
                seq,
                terminal,
                origin: Origin::Peer {
                    peer: self.me.peer.clone(),
                    instance: self.me.instance,
                },
                frame: raw,
                now_ms: self.batch_at.1,
                wake,
            },
            received,
        });
    }

    /// Whom to wake for a frame on `dir`, and why it is refused, if it is.
    fn check(
        &self,
        l: &DelegationView,
        dir: Direction,
        flags: u8,
        len: usize,
    ) -> (Option<PeerId>, Option<Refusal>) {
        let wake = self.hub.wake_for(l, dir);
        let refusal = if l.sender(dir) != &self.me.peer {
            // Answered exactly like a missing delegation.
            Some(Refusal::NoSuchDelegation)
        } else if flags & FLAG_RELAY_ORIGIN != 0 {
            Some(Refusal::RelayOriginFlag)
        } else if len > l.max_payload as usize {
            Some(Refusal::PayloadTooLarge)
        } else {
            None
        };
        (wake, refusal)
    }

    /// The view of `key` for a frame at `seq` (remembered for the next
    /// frames of the batch); a missing delegation or an unavailable store is
    /// answered with an error frame and `None`.
    async fn lookup(&mut self, key: &DelegationKey, dir: Direction, seq: u64) -> Option<ViewRef> {
        match self.hub.view_for(key, &self.me.peer).await {
            Ok(Some(l)) => {
                self.cached_view = Some((key.clone(), l.clone()));
                Some(l)
            }
            Ok(None) => {
                self.refuse(Refusal::NoSuchDelegation, Some(key), dir, seq);
                None
            }
            Err(e) => {
                warn!(error = %e, "store unavailable");
                self.refuse(Refusal::StoreUnavailable, Some(key), dir, seq);
                None
            }
        }
    }

    /// Hands the staged frames to the store in one pipelined call, in flight
    /// beside the earlier batches still unanswered ([`AppendsInFlight`]);
    /// their answers ack and deliver, in order ([`Self::answer`]).
    fn flush(&mut self) {
        if self.pending.is_empty() {
            self.send_acks();
            return;
        }
        let pending = std::mem::take(&mut self.pending);
        let reqs: Vec<AppendRequest> = pending.iter().map(|p| p.req.clone()).collect();
        let hub = self.hub.clone();
        self.appends.push(
            pending,
            Box::pin(async move { hub.store.append(reqs).await }),
        );
    }

    /// Answers every batch in flight, oldest first.
    async fn settle(&mut self) {
        while !self.appends.is_empty() {
            let batch = self.appends.oldest().await;
            self.answer(batch);
        }
    }

    /// Acks and delivers an answered batch (the oldest in flight). A failed
    /// batch refuses all its frames with `store_unavailable`, and so do the
    /// batches that were in flight behind it, whatever the store answered
    /// them: nothing after a failure is acknowledged before the peer
    /// resends (a resent entry the store holds is a `Duplicate`, acked and
    /// delivered then).
    fn answer(&mut self, answered: Answered<Vec<Pending>>) {
        let Answered {
            staged: pending,
            started,
            answer,
            overlapped,
        } = answered;
        // This batch's number among those answered.
        let number = overlapped.end;
        self.hub
            .metrics
            .hot
            .append_latency
            .observe(started.elapsed().as_secs_f64());
        let outcomes = match answer {
            Answer::Outcomes(o) => o,
            Answer::Failed(e) => {
                self.hub
                    .metrics
                    .store_errors
                    .with_label_values(&["append"])
                    .inc();
                self.hub.store_health.failed("append", Some(&e));
                warn!(error = %e, "append failed; nothing acknowledged");
                self.refuse_all(&pending);
                self.overlap_acks
                    .forget_before(self.appends.oldest_behind());
                return;
            }
            Answer::BehindFailure => {
                warn!("append batch in flight behind a failed one; nothing acknowledged");
                self.refuse_all(&pending);
                self.overlap_acks
                    .forget_before(self.appends.oldest_behind());
                return;
            }
        };
        for (p, outcome) in pending.into_iter().zip(outcomes) {
            let Pending {
                view,
                req,
                received,
            } = p;
            match outcome {
                AppendOutcome::Appended { seq } => {
                    let woke = req.wake.is_some();
                    if let Some(outcome) = req.terminal {
                        // The view's lock is taken only when the line is on.
                        info!(
                            target: DELEGATION_LOG,
                            key = %req.key,
                            trace_id = view.lock().trace.map(tracing::field::display),
                            outcome = outcome.name(),
                            seq,
                            "delegation finished"
                        );
                    }
                    self.hub
                        .appended(&view, &req.key, req.dir, seq, req.frame, req.terminal, woke);
                    self.hub
                        .metrics
                        .ack_latency
                        .observe(received.elapsed().as_secs_f64());
                    self.record_ack(req.key, req.dir, seq);
                }
                AppendOutcome::Duplicate { tail } => {
                    // Stored before (a resend, or a batch the Redis Cluster
                    // client re-sent after a lost connection): make sure a
                    // receiver here did not miss it.
                    self.hub.catch_up(&view, &req.key, req.dir, tail, None);
                    self.record_ack(req.key, req.dir, tail);
                }
                AppendOutcome::Hole { tail } => {
                    match self
                        .overlap_acks
                        .above(&req.key, req.dir, tail, &overlapped)
                    {
                        // Overtook a batch of this session that was
                        // acknowledged since: resend after that ack.
                        Some(acked) => {
                            self.refuse(Refusal::SequenceGap, Some(&req.key), req.dir, acked);
                        }
                        None => {
                            self.hub.hole(&view, &req.key, req.dir, tail);
                            self.refuse(Refusal::SequenceGap, Some(&req.key), req.dir, tail);
                        }
                    }
                }
                AppendOutcome::AlreadyTerminal { outcome } => self.refuse(
                    Refusal::AlreadyTerminal { outcome },
                    Some(&req.key),
                    req.dir,
                    req.seq,
                ),
                AppendOutcome::Unavailable => {
                    self.refuse(Refusal::StoreUnavailable, Some(&req.key), req.dir, req.seq)
                }
                AppendOutcome::OverBudget { budget } => self.refuse(
                    Refusal::OverBudget { budget },
                    Some(&req.key),
                    req.dir,
                    req.seq,
                ),
                AppendOutcome::Unknown
                | AppendOutcome::NotParty
                | AppendOutcome::Conflict { .. } => {
                    self.refuse(Refusal::NoSuchDelegation, Some(&req.key), req.dir, req.seq)
                }
            }
        }
        // Batches in flight behind this one may have overtaken it.
        let oldest = self.appends.oldest_behind();
        if oldest.is_some() {
            for (key, dir, seq) in self.acks.iter() {
                self.overlap_acks.record(key, *dir, *seq, number);
            }
        }
        self.overlap_acks.forget_before(oldest);
        self.send_acks();
    }

    /// Refuses every frame of a batch with `store_unavailable`.
    fn refuse_all(&self, pending: &[Pending]) {
        for p in pending {
            self.refuse(
                Refusal::StoreUnavailable,
                Some(&p.req.key),
                p.req.dir,
                p.req.seq,
            );
        }
    }

    /// Remembers the highest ack per log; acks are cumulative.
    fn record_ack(&mut self, key: DelegationKey, dir: Direction, seq: u64) {
        self.acks.record(key, dir, seq);
    }

    fn send_acks(&mut self) {
        for (key, direction, seq) in self.acks.take() {
            self.push(&Frame::Ack(Ack {
                key,
                direction,
                seq,
            }));
        }
    }

    /// Answers a run of opens (consecutive in one read batch, each of
    /// another delegation; at most [`MAX_BATCH`]): each is checked in
    /// order, then the store calls of those that passed run at once (on
    /// the Redis store, pipelined on its connection), and the answers are
    /// taken in the order of the opens: each open gets its own ack or
    /// error, in order, and one refused or failed does not touch the
    /// others. An open counts against the caps as soon as it passed its
    /// check ([`InFlightOpens`]), so the run as a whole stays within them.
    async fn opens(&mut self, run: Vec<(Bytes, oab_wire::Open)>) {
        let mut keys = Vec::with_capacity(run.len());
        let mut calls = futures_util::stream::FuturesOrdered::<OpenCall>::new();
        let mut reserved: Vec<PeerId> = Vec::new();
        for (raw, open) in run {
            let key = open.key.clone();
            let call: OpenCall = match self.check_open(&open, raw, &reserved) {
                Checked::Refused(refusal) => Box::pin(std::future::ready(OpenStep::Refused {
                    refusal,
                    stored: None,
                })),
                Checked::Unless(refusal) => {
                    // An idempotent retry is answered from the store before
                    // any check that could have changed since the first
                    // attempt (deadline, caps, route).
                    let (hub, digest) = (self.hub.clone(), open.digest);
                    let key = key.clone();
                    Box::pin(async move {
                        let stored = Some(
                            hub.store
                                .meta(&key)
                                .await
                                .map(|m| m.map(|m| m.digest == digest)),
                        );
                        OpenStep::Refused { refusal, stored }
                    })
                }
                Checked::Passed(req) => {
                    reserved.push(req.callee.clone());
                    let hub = self.hub.clone();
                    Box::pin(async move {
                        let frame = req.frame.clone();
                        let woke = req.wake.is_some();
                        let started = Instant::now();
                        let res = hub.store.open(*req).await;
                        OpenStep::Stored {
                            frame,
                            started,
                            woke,
                            res,
                        }
                    })
                }
            };
            keys.push(key);
            calls.push_back(call);
        }
        for key in keys {
            let Some(step) = calls.next().await else {
                break;
            };
            self.answer_open(key, step).await;
        }
    }

    /// The checks of an open that need no store: whether it is refused
    /// outright, refused unless the store already holds it, or passed (with
    /// the store request, its frame stamped with the route's ceiling).
    /// `reserved`: the targets of the opens of this run that passed before
    /// it.
    fn check_open(&self, open: &oab_wire::Open, raw: Bytes, reserved: &[PeerId]) -> Checked {
        let hub = &self.hub;
        if open.key.caller != self.me.peer {
            return Checked::Refused(Refusal::OpenForAnotherCaller);
        }
        let unless = Checked::Unless;
        // The routes in force now: a route a reload removed refuses new
        // opens (its open delegations run on to their terminal).
        let live = hub.live();
        let Some(route) = live.directory.route(&self.me.peer, &open.target) else {
            return unless(Refusal::NoRoute);
        };
        if open.depth == 0 || open.depth > route.max_depth {
            let max_depth = route.max_depth;
            return unless(Refusal::DepthExceeded { max_depth });
        }
        let now = oab_wire::identity::now_ms();
        if open.deadline_ms <= now || open.deadline_ms > now.saturating_add(route.max_deadline_ms) {
            let max_deadline_ms = route.max_deadline_ms;
            return unless(Refusal::InvalidDeadline { max_deadline_ms });
        }
        let max_payload = route.max_payload.unwrap_or(hub.config.limits.max_payload);
        if open.payload.len() > max_payload as usize {
            return unless(Refusal::PayloadTooLarge);
        }
        if Digest::of(&open.payload) != open.digest {
            return unless(Refusal::DigestMismatch);
        }
        if self.batch_limited {
            hub.metrics.rate_limited.with_label_values(&["peer"]).inc();
            return unless(Refusal::RateLimited);
        }
        let ceiling = route.ceiling.join(",");
        let count = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
        let beside = InFlightOpens {
            caller: count(reserved.len()),
            route: count(reserved.iter().filter(|t| **t == open.target).count()),
        };
        if !hub.may_open_beside(&self.me.peer, &open.target, route.max_open, beside) {
            return unless(Refusal::TooManyDelegations);
        }
        // Stored, forwarded and replayed with the route's ceiling and
        // without the caller's trace id (kept in the delegation's record):
        // the callee reads the signed one, and a callee of protocol
        // version 1 decodes it.
        let frame = if open.ceiling == ceiling && open.trace.is_none() {
            raw
        } else {
            let stamped = Frame::Open(oab_wire::Open {
                ceiling,
                trace: None,
                ..open.clone()
            });
            match encode(&stamped) {
                Ok(b) => b,
                Err(_) => return unless(Refusal::CeilingNotStamped),
            }
        };
        Checked::Passed(Box::new(OpenRequest {
            key: open.key.clone(),
            callee: open.target.clone(),
            deadline_ms: open.deadline_ms,
            digest: open.digest,
            trace: open.trace,
            frame,
            now_ms: now,
            wake: hub.open_wake(&open.target),
        }))
    }

    /// Answers one open of a run, once its store call came back.
    async fn answer_open(&mut self, key: DelegationKey, step: OpenStep) {
        let hub = self.hub.clone();
        // An open is refused about seq 1 of its down log.
        let refuse = |s: &Self, refusal: Refusal| {
            s.refuse(refusal, Some(&key), Direction::Down, 1);
        };
        match step {
            OpenStep::Refused { refusal, stored } => match stored {
                None | Some(Ok(None)) => refuse(self, refusal),
                Some(Ok(Some(true))) => self.reopened(key).await,
                Some(Ok(Some(false))) => refuse(self, Refusal::IdempotencyMismatch),
                Some(Err(e)) => {
                    warn!(error = %e, "store unavailable");
                    refuse(self, Refusal::StoreUnavailable);
                }
            },
            OpenStep::Stored {
                frame,
                started,
                woke,
                res,
            } => {
                hub.observe_store("open", started, &res);
                match res {
                    Ok(OpenOutcome::Created(meta)) => {
                        info!(
                            target: DELEGATION_LOG,
                            key = %meta.key,
                            trace_id = meta.trace.map(tracing::field::display),
                            callee = %meta.callee,
                            deadline_ms = meta.deadline_ms,
                            "delegation opened"
                        );
                        hub.created(&meta, &self.me, frame.clone());
                        if !woke {
                            hub.wake_if_gone(&meta.callee, frame);
                        }
                        hub.metrics
                            .ack_latency
                            .observe(started.elapsed().as_secs_f64());
                        self.record_ack(key, Direction::Down, 1);
                        self.send_acks();
                    }
                    Ok(OpenOutcome::Existing(_)) => self.reopened(key).await,
                    Ok(OpenOutcome::Mismatch(_)) => refuse(self, Refusal::IdempotencyMismatch),
                    Err(e) => {
                        warn!(error = %e, "open failed; nothing acknowledged");
                        refuse(self, Refusal::StoreUnavailable);
                    }
                }
            }
        }
    }

    /// Answers an open the store already had: acknowledged, and delivered to
    /// both ends as if created now ([`Hub::reopened`]).
    async fn reopened(&mut self, key: DelegationKey) {
        if let Err(e) = self.hub.reopened(&key, &self.me).await {
            warn!(error = %e, "store unavailable");
            self.refuse(Refusal::StoreUnavailable, Some(&key), Direction::Down, 1);
            return;
        }
        self.record_ack(key, Direction::Down, 1);
        self.send_acks();
    }

    async fn resume(&mut self, key: DelegationKey, dir: Direction, after: u64) {
        let hub = self.hub.clone();
        if !hub.meter_request(&self.me.peer, crate::hub::RESUME_COST) {
            // The peer asks again later (its resume is refused, not lost).
            self.refuse(Refusal::RequestRateLimited, Some(&key), dir, after);
            return;
        }
        loop {
            let view = match hub.view_for(&key, &self.me.peer).await {
                Ok(Some(l)) => l,
                Ok(None) => {
                    hub.gap(
                        &self.me.outbox,
                        &key,
                        dir,
                        after,
                        0,
                        None,
                        hub.missing_reason(),
                    );
                    return;
                }
                Err(e) => {
                    warn!(error = %e, "store unavailable");
                    self.refuse(Refusal::StoreUnavailableOnResume, Some(&key), dir, after);
                    return;
                }
            };
            if hub.release_with(&view, &key, &self.me.peer, dir, after) {
                return;
            }
            match hub.subscribe(&view, &key, dir, &self.me, after) {
                Subscribed::Yes => return,
                // The sweep dropped the view since the lookup: look it up again.
                Subscribed::Evicted => {}
                Subscribed::Refused => {
                    // Not this peer's log: answered exactly like a missing delegation.
                    hub.gap(
                        &self.me.outbox,
                        &key,
                        dir,
                        after,
                        0,
                        None,
                        hub.missing_reason(),
                    );
                    return;
                }
            }
        }
    }

    /// Answers a `PeersQuery` with a `Peers` snapshot, metered and
    /// coalesced with any snapshot still waiting in this session's queue
    /// ([`Hub::send_peers`]).
    fn peers_query(&self) {
        if !self
            .hub
            .meter_request(&self.me.peer, crate::hub::PEERS_REQUEST_COST)
        {
            self.refuse(Refusal::RequestRateLimited, None, Direction::Down, 0);
            return;
        }
        self.hub.send_peers(&self.me.peer);
    }

    async fn publish(&mut self, descriptor: Bytes) {
        let hub = self.hub.clone();
        if !hub.meter_request(&self.me.peer, crate::hub::PEERS_REQUEST_COST) {
            self.refuse(Refusal::RequestRateLimited, None, Direction::Down, 0);
            return;
        }
        if descriptor.len() > hub.live().config.limits.max_descriptor {
            self.refuse(Refusal::DescriptorTooLarge, None, Direction::Down, 0);
            return;
        }
        if serde_json::from_slice::<serde_json::Value>(&descriptor).is_err() {
            self.refuse(Refusal::DescriptorNotJson, None, Direction::Down, 0);
            return;
        }
        // Kept by the store: its own copy, not a slice of the received frame.
        let descriptor = Bytes::copy_from_slice(&descriptor);
        match hub.store.put_descriptor(&self.me.peer, descriptor).await {
            Ok(()) => hub.announce_presence(&self.me.peer),
            Err(_) => self.refuse(Refusal::StoreUnavailableOnPublish, None, Direction::Down, 0),
        }
    }
}

/// Writes the session's queues, control lane first, until the session is
/// closed (`End::Cancelled`), the socket fails (`End::Transport`) or a write
/// makes no progress for `stall` (`slow_consumer`). Every write is raced
/// against that deadline and the close signal.
async fn write_loop<W, S>(sink: &mut W, inbox: &mut Inbox, stall: Duration, hub: &Hub<S>) -> End
where
    W: futures_util::Sink<Message, Error = tokio_tungstenite::tungstenite::Error> + Unpin,
{
    loop {
        let first = tokio::select! {
            biased;
            () = inbox.cancel.cancelled() => return End::Cancelled,
            out = inbox.control.recv() => out,
            out = inbox.data.recv() => out,
        };
        let Some(first) = first else {
            return End::Transport("session queues closed");
        };
        inbox.taken(first.len());
        // Boxed per batch (one allocation for up to MAX_WRITE_BATCH frames):
        // the write's state (its deadline timer) then lives only while a
        // batch is written, not for the whole idle life of the session.
        if let Err(end) = Box::pin(write_batch(sink, inbox, first, stall, hub)).await {
            return end;
        }
    }
}

/// Writes one frame and whatever else is queued, then flushes once.
async fn write_batch<W, S>(
    sink: &mut W,
    inbox: &mut Inbox,
    first: Bytes,
    stall: Duration,
    hub: &Hub<S>,
) -> Result<(), End>
where
    W: futures_util::Sink<Message, Error = tokio_tungstenite::tungstenite::Error> + Unpin,
{
    let mut bytes = first.len();
    bounded_write(sink.feed(Message::Binary(first)), &inbox.cancel, stall).await?;
    // Frames taken since the last report to the queues' counters.
    let mut untold = 0;
    for _ in 1..MAX_WRITE_BATCH {
        let Some(frame) = inbox.try_take() else {
            break;
        };
        bytes += frame.len();
        untold += frame.len();
        let feed = bounded_write(sink.feed(Message::Binary(frame)), &inbox.cancel, stall).await;
        if feed.is_err() {
            inbox.taken(untold);
            return feed;
        }
    }
    inbox.taken(untold);
    hub.metrics.hot.bytes_out.inc_by(bytes as u64);
    bounded_write(sink.flush(), &inbox.cancel, stall).await
}

/// Runs one write (a feed or a flush): at once when the socket takes it,
/// else until it completes, the session is closed, or `stall` passes with
/// the socket taking nothing.
async fn bounded_write<F>(write: F, cancel: &CancellationToken, stall: Duration) -> Result<(), End>
where
    F: std::future::Future<Output = Result<(), tokio_tungstenite::tungstenite::Error>>,
{
    tokio::pin!(write);
    // The common case, a socket with room, needs no timer.
    if let Some(done) = (&mut write).now_or_never() {
        return done.map_err(write_error);
    }
    tokio::select! {
        biased;
        done = &mut write => done.map_err(write_error),
        () = cancel.cancelled() => Err(End::Cancelled),
        () = tokio::time::sleep(stall) => Err(End::Closed(
            CloseCode::SlowConsumer,
            "the connection took nothing for slow_consumer_ms; reconnect and resume".into(),
        )),
    }
}

fn write_error(e: tokio_tungstenite::tungstenite::Error) -> End {
    debug!(error = %e, "write failed");
    End::Transport("connection lost (write failed)")
}

/// The last words of a closing session: `Drain` (on shutdown), the queued
/// control frames (acks, errors), then the close frame. The caller bounds
/// it with [`CLOSE_DEADLINE`].
async fn close_with_control<IO>(
    mut ws: WebSocketStream<IO>,
    inbox: &mut Inbox,
    drain: Option<oab_wire::Drain>,
    code: CloseCode,
    reason: &str,
) where
    IO: AsyncRead + AsyncWrite + Unpin,
{
    if let Some(drain) = drain
        && let Ok(b) = encode(&Frame::Drain(drain))
        && ws.feed(Message::Binary(b)).await.is_err()
    {
        return;
    }
    while let Some(frame) = inbox.try_next() {
        if ws.feed(Message::Binary(frame)).await.is_err() {
            return;
        }
    }
    close_ws(&mut ws, code, reason).await;
}

/// A log frame whose payload is over `max_payload` but whose message fit
/// the WebSocket cap (so at most `max_header` bytes over): decoded anyway,
/// so the payload check of its delegation's route refuses it with an
/// `Error payload_too_large` naming it, and the session stays open. Any
/// other oversized frame cannot be attributed to a delegation and closes the
/// session (`4501`).
fn attributable(bytes: &Bytes, limits: &Limits) -> Option<Frame> {
    let relaxed = Limits {
        max_payload: oab_wire::limits::MAX_PAYLOAD_CEILING,
        ..*limits
    };
    match decode_message(bytes.clone(), &relaxed).ok()? {
        f @ (Frame::Open(_) | Frame::Data(_) | Frame::Cancel(_)) => Some(f),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::StoreError;
    use tokio::sync::oneshot;

    /// A store call that records when it is first polled and answers what
    /// its sender sends.
    fn call(
        id: u32,
        polled: &Arc<Mutex<Vec<u32>>>,
        answer: oneshot::Receiver<AppendResult>,
    ) -> AppendCall {
        let polled = polled.clone();
        Box::pin(async move {
            polled.lock().push(id);
            answer
                .await
                .unwrap_or_else(|_| Err(StoreError::unavailable("test", "dropped")))
        })
    }

    fn appended(seq: u64) -> AppendResult {
        Ok(vec![AppendOutcome::Appended { seq }])
    }

    #[tokio::test]
    async fn batches_are_sent_oldest_first_and_answered_in_order() {
        let polled = Arc::new(Mutex::new(Vec::new()));
        let mut flight = AppendsInFlight::default();
        let mut senders = Vec::new();
        for id in 1..=3 {
            let (tx, rx) = oneshot::channel();
            flight.push(id, call(id, &polled, rx));
            senders.push(tx);
        }
        let mut oldest = Box::pin(flight.oldest());
        assert!((&mut oldest).now_or_never().is_none());
        drop(oldest);
        assert_eq!(*polled.lock(), vec![1, 2, 3], "first polled oldest first");
        // The newest is answered first: nothing is released before the oldest.
        let mut senders = senders.into_iter();
        let (t1, t2, t3) = (senders.next(), senders.next(), senders.next());
        let _ = t3.map(|t| t.send(appended(4)));
        let _ = t2.map(|t| t.send(appended(3)));
        assert!(Box::pin(flight.oldest()).now_or_never().is_none());
        let _ = t1.map(|t| t.send(appended(2)));
        // All three were put in flight before any was answered: each
        // overlapped the ones answered before it.
        for (want_id, want_seq, overlapped) in [(1, 2, 0..0), (2, 3, 0..1), (3, 4, 0..2)] {
            let Answered {
                staged: id,
                answer,
                overlapped: seen,
                ..
            } = flight.oldest().await;
            assert_eq!(id, want_id);
            assert_eq!(seen, overlapped);
            assert!(
                matches!(&answer, Answer::Outcomes(o) if o == &[AppendOutcome::Appended { seq: want_seq }]),
                "{answer:?}"
            );
        }
        assert!(flight.is_empty());
    }

    #[tokio::test]
    async fn a_failed_batch_fails_those_in_flight_behind_it_and_no_later_one() {
        let polled = Arc::new(Mutex::new(Vec::new()));
        let mut flight = AppendsInFlight::default();
        let (t1, r1) = oneshot::channel();
        let (t2, r2) = oneshot::channel();
        let (t3, r3) = oneshot::channel();
        flight.push(1, call(1, &polled, r1));
        flight.push(2, call(2, &polled, r2));
        flight.push(3, call(3, &polled, r3));
        // The later batches were stored; the first failed.
        let _ = t2.send(appended(3));
        let _ = t3.send(appended(4));
        let _ = t1.send(Err(StoreError::unavailable(
            "redis append",
            "connection lost",
        )));
        let Answered {
            staged: id, answer, ..
        } = flight.oldest().await;
        assert_eq!(id, 1);
        assert!(matches!(answer, Answer::Failed(_)), "{answer:?}");
        for want in [2, 3] {
            let Answered {
                staged: id, answer, ..
            } = flight.oldest().await;
            assert_eq!(id, want);
            assert!(matches!(answer, Answer::BehindFailure), "{answer:?}");
        }
        // A batch put in flight after the failure was known is taken as answered.
        let (t4, r4) = oneshot::channel();
        flight.push(4, call(4, &polled, r4));
        let _ = t4.send(appended(5));
        let Answered {
            staged: id, answer, ..
        } = flight.oldest().await;
        assert_eq!(id, 4);
        assert!(matches!(answer, Answer::Outcomes(_)), "{answer:?}");
    }

    #[test]
    fn a_hole_is_answered_from_the_acks_of_the_batches_it_overlapped_only() {
        let key = DelegationKey::new(
            PeerId::new("acme/caller").unwrap(),
            oab_wire::RequestId::new("r1").unwrap(),
        );
        let mut acks = OverlapAcks::default();
        // Batch 3 acknowledged up to 75 of the up log.
        acks.record(&key, Direction::Up, 75, 3);
        // A batch in flight beside it whose entry found the log at 73.
        assert_eq!(acks.above(&key, Direction::Up, 73, &(2..4)), Some(75));
        // Not beside it: the store lost what was acknowledged before.
        assert_eq!(acks.above(&key, Direction::Up, 73, &(4..6)), None);
        // Nothing above the hole's tail, or another log.
        assert_eq!(acks.above(&key, Direction::Up, 75, &(2..4)), None);
        assert_eq!(acks.above(&key, Direction::Down, 73, &(2..4)), None);
        // Lower acks of a later batch do not hide the highest.
        acks.record(&key, Direction::Up, 74, 4);
        assert_eq!(acks.above(&key, Direction::Up, 73, &(2..4)), Some(75));
        acks.forget_before(Some(3));
        assert_eq!(acks.above(&key, Direction::Up, 73, &(2..4)), Some(75));
        acks.forget_before(Some(4));
        assert_eq!(acks.above(&key, Direction::Up, 73, &(2..6)), None);
        acks.record(&key, Direction::Up, 80, 7);
        acks.forget_before(None);
        assert!(acks.logs.is_empty());
    }

    #[test]
    fn pending_acks_keep_one_highest_ack_per_log_in_first_acked_order() {
        let key = |rid: &str| {
            DelegationKey::new(
                PeerId::new("acme/caller").unwrap(),
                oab_wire::RequestId::new(rid).unwrap(),
            )
        };
        let mut acks = PendingAcks::default();
        // The logs of many delegations, each acked several times, out of
        // order, both directions, and in runs of one log.
        for round in [3_u64, 1, 5, 2] {
            for i in 0..300 {
                for seq in [round + i, round + i - 1] {
                    acks.record(key(&format!("r{i}")), Direction::Up, seq);
                }
                if i % 2 == 0 {
                    acks.record(key(&format!("r{i}")), Direction::Down, round);
                }
            }
        }
        let mut want = Vec::new();
        for i in 0..300_u64 {
            want.push((key(&format!("r{i}")), Direction::Up, 5 + i));
            if i % 2 == 0 {
                want.push((key(&format!("r{i}")), Direction::Down, 5));
            }
        }
        assert_eq!(acks.iter().cloned().collect::<Vec<_>>(), want);
        assert_eq!(acks.take(), want);
        // Taken: the next acks start a new list, and the index of 450 logs
        // is not kept.
        assert!(acks.at.capacity() <= PENDING_ACKS_KEPT_ROOM);
        assert!(acks.take().is_empty());
        acks.record(key("r7"), Direction::Up, 2);
        assert_eq!(acks.take(), vec![(key("r7"), Direction::Up, 2)]);
    }

    #[test]
    fn the_control_lane_holds_the_replies_of_every_batch_in_flight() {
        for batches in 1..=crate::config::MAX_APPEND_BATCHES_IN_FLIGHT {
            let capacity = control_capacity(batches);
            // Reading with batches - 1 in flight: room for all of them, the
            // batch read and the hub's headroom.
            let depth = read_control_depth(capacity, batches - 1);
            assert_eq!(depth + batches * MAX_BATCH + HUB_CONTROL_HEADROOM, capacity);
        }
        // One batch in flight: as before append batches overlapped.
        assert_eq!(
            read_control_depth(control_capacity(1), 0),
            crate::outbox::CONTROL_CAPACITY - MAX_BATCH - HUB_CONTROL_HEADROOM
        );
    }
}
