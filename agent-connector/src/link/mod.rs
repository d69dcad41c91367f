//! The link: the one task that owns the connection to the relay.
//!
//! It dials the relay over WSS, runs the session handshake, pings on the
//! relay's heartbeat and treats a silent link as dead after
//! [`LinkSettings::dead_after_heartbeats`] intervals, reconnects with
//! exponential backoff and full jitter (honouring a `Drain` hint), resends
//! every unacknowledged frame and resumes every open delegation from its
//! cursor. Handles talk to it over a bounded command channel
//! ([`LinkHandle`]); nothing else touches the socket.
//!
//! **Bounds and overflow policies**
//! - commands: a bounded channel; senders wait (back-pressure);
//! - unacknowledged frames: at most `max_buffered_frames` across delegations;
//!   while full the link stops taking commands (senders wait);
//! - frames in flight per log: at most the relay's `max_in_flight`; the rest
//!   wait in the unacked buffer until acks make room;
//! - events kept per delegation for replay to local subscribers:
//!   `max_events_per_delegation`, oldest dropped (a subscriber asking for a
//!   dropped event gets [`EventError::Gap`]);
//! - subscriber channels: bounded; a subscriber that does not keep up is
//!   dropped with [`EventError::Lagged`] (sent in its last free slot) and
//!   resubscribes from its cursor;
//! - the callee side's channel (`incoming`, capacity `queue`): never waited
//!   on; a frame that finds it full is left in the relay's log and its log
//!   resumed from the cursor after the retry pause;
//! - callee-side delegations: forgotten once their terminal is settled;
//! - caller-side finished delegations kept for replay after their end: at
//!   most `max_finished`, weighing at most `max_finished_bytes`; the oldest
//!   are forgotten (a subscriber then gets [`EventError::Gap`]).
//!
//! **Layout.** This module owns the public types, the handle, [`spawn`] and
//! the state of the link task; each part adds its own `impl Link` block:
//!
//! | module | owns |
//! |---|---|
//! | `connection` | dial, TLS, upgrade, handshake; the session loop (heartbeat, dead-link detection); reconnect with backoff and jitter |
//! | `relay_url` | reading the relay URL: scheme, host, port |
//! | `commands` | commands from handles: opens and sends into the outgoing logs, subscriptions, snapshots, peer queries, publish |
//! | `window` | the outgoing log per delegation: sequence numbers, unacked frames, the in-flight window, acks, retries after retryable refusals |
//! | `dispatch` | frames from the relay: acks, data, opens, cancels, gaps, refusals, peers, pings, drain hints |
//! | `resume` | the receive cursor per delegation and resumes: in-order checks, what a new session resumes, a new store epoch |
//! | `delegation` | the state kept per delegation, local subscribers, retention of finished delegations |
//! | [`stats`] | counters, gauges and session facts for operators (`/metrics`, `/status`, `/readyz`) |

mod commands;
mod connection;
mod delegation;
mod dispatch;
mod frames;
mod relay_url;
mod resume;
pub mod stats;
mod window;

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use oab_wire::identity::Identity;
use oab_wire::{
    DelegationKey, GapReason, InstanceId, Limits, Open, Outcome, PeerEntry, PeerId, RelayId,
};
use tokio::sync::{mpsc, oneshot, watch};
use tokio_util::sync::CancellationToken;

use self::delegation::Delegation;
use crate::trust::RelayTrust;

/// Where the relay is and how to reach it. `Debug` shows the URL without
/// its user info (`***`).
#[derive(Clone)]
pub struct LinkSettings {
    /// `wss://host:port/` (or `ws://` only for a relay behind a TLS-terminating
    /// load balancer reached over a private network, and tests). The port
    /// defaults to 443 (80 for `ws://`); an IPv6 address goes in brackets,
    /// `wss://[2001:db8::1]/`.
    pub url: String,
    /// Trust anchor for the relay's certificate.
    pub trust: RelayTrust,
    /// Pin the relay id the relay must present (recommended).
    pub relay_id: Option<RelayId>,
    /// Bind the handshake to the challenge only (relay behind a TLS-terminating
    /// load balancer). Default: bind to the TLS session.
    pub challenge_only: bool,
    /// This peer's identity.
    pub identity: Identity,
    /// This process start.
    pub instance: InstanceId,
    /// First reconnect backoff.
    pub backoff_initial: Duration,
    /// Largest reconnect backoff.
    pub backoff_max: Duration,
    /// TCP + TLS + upgrade + handshake must finish within this.
    pub connect_timeout: Duration,
    /// The link is dead when nothing arrived for this many heartbeats.
    pub dead_after_heartbeats: u32,
    /// Unacknowledged frames kept across all delegations.
    pub max_buffered_frames: usize,
    /// Events kept per delegation for local replay.
    pub max_events_per_delegation: usize,
    /// Capacity of the command channel, of each subscriber channel and of
    /// the channel to the callee runtime.
    pub queue: usize,
    /// Finished delegations kept (for `events`/`get` after the end); older
    /// ones are forgotten. The caller side keeps its records and state files
    /// of finished delegations within the same bound
    /// ([`crate::caller::FinishedRetention`]).
    pub max_finished: usize,
    /// Bytes the finished delegations kept may weigh together (the link
    /// counts the payloads of their kept events; the caller counts its
    /// state files); past this the oldest are forgotten.
    pub max_finished_bytes: u64,
}

impl std::fmt::Debug for LinkSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LinkSettings")
            .field("url", &relay_url::redacted(&self.url))
            .field("trust", &self.trust)
            .field("relay_id", &self.relay_id)
            .field("challenge_only", &self.challenge_only)
            .field("identity", &self.identity)
            .field("instance", &self.instance)
            .field("backoff_initial", &self.backoff_initial)
            .field("backoff_max", &self.backoff_max)
            .field("connect_timeout", &self.connect_timeout)
            .field("dead_after_heartbeats", &self.dead_after_heartbeats)
            .field("max_buffered_frames", &self.max_buffered_frames)
            .field("max_events_per_delegation", &self.max_events_per_delegation)
            .field("queue", &self.queue)
            .field("max_finished", &self.max_finished)
            .field("max_finished_bytes", &self.max_finished_bytes)
            .finish()
    }
}

/// Refused opens remembered for late subscribers (see `Link::refused`):
/// a subscriber comes right after the open, so a short memory is enough.
const REFUSALS_KEPT: usize = 1_024;

/// Default of [`LinkSettings::max_finished`]: a finished delegation is kept
/// for a late `events`/`wait`/`get` and an idempotent re-send; the A2A
/// facade keeps its own copy of a finished task, so a thousand is plenty.
pub const DEFAULT_MAX_FINISHED: usize = 1_000;

/// Default of [`LinkSettings::max_finished_bytes`]: 8 MiB, a thousand
/// finished delegations of 8 KiB each.
pub const DEFAULT_MAX_FINISHED_BYTES: u64 = 8 * 1024 * 1024;

impl LinkSettings {
    /// Settings with the defaults for everything but where and who.
    pub fn new(url: impl Into<String>, trust: RelayTrust, identity: Identity) -> Self {
        LinkSettings {
            url: url.into(),
            trust,
            relay_id: None,
            challenge_only: false,
            identity,
            instance: InstanceId::random(),
            backoff_initial: Duration::from_millis(100),
            backoff_max: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(10),
            dead_after_heartbeats: 3,
            max_buffered_frames: 65_536,
            max_events_per_delegation: 10_000,
            queue: 1_024,
            max_finished: DEFAULT_MAX_FINISHED,
            max_finished_bytes: DEFAULT_MAX_FINISHED_BYTES,
        }
    }
}

/// One event of a delegation's up log, as the caller sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UpEvent {
    /// Position in the up log (from 1).
    pub seq: u64,
    /// Set on the one terminal.
    pub terminal: Option<Outcome>,
    /// Appended by the relay (`expired`, `unknown`), not by the callee.
    pub relay_origin: bool,
    /// The event bytes.
    pub payload: Bytes,
}

/// Why an event stream ended early.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EventError {
    /// Events after `after` are gone (trimmed, or the store lost them).
    #[error("events after {after} are not available ({reason:?}); reconcile")]
    Gap {
        /// The cursor that was asked for.
        after: u64,
        /// Why.
        reason: GapReason,
    },
    /// The subscriber fell behind and was dropped; resubscribe after `last`.
    #[error("subscriber fell behind after event {last}; resubscribe from there")]
    Lagged {
        /// Last event delivered to it.
        last: u64,
    },
    /// The relay refused the delegation.
    #[error("the relay refused: {code} ({message})")]
    Refused {
        /// The error code name.
        code: String,
        /// The relay's message.
        message: String,
    },
    /// The link stopped for good (identity replaced, auth failed, shutdown).
    #[error("the connector stopped: {0}")]
    Stopped(String),
}

/// What the callee side receives from the relay.
#[derive(Debug, Clone)]
pub enum Incoming {
    /// A new delegation for this peer (the `Open` as stamped by the relay).
    Open(Open),
    /// The `Open` of a delegation whose up log already held `up` entries
    /// when this process's link first saw it: accepted by an earlier run of
    /// this connector (same instance, see [`crate::reattach`]). Never run
    /// again: re-attached or ended.
    Reopened {
        /// The `Open` as stamped by the relay.
        open: Open,
        /// The up log's tail: the next entry sent is `up + 1`.
        up: u64,
    },
    /// A follow-up message from the caller (down log).
    Message {
        /// The delegation.
        key: DelegationKey,
        /// Down-log sequence.
        seq: u64,
        /// The payload.
        payload: Bytes,
    },
    /// The caller (or the relay, after expiry) asks to stop.
    Cancel {
        /// The delegation.
        key: DelegationKey,
        /// Sent by the relay after the deadline passed.
        relay_origin: bool,
        /// The reason payload.
        payload: Bytes,
    },
    /// The delegation's down log is gone or ended elsewhere.
    Ended {
        /// The delegation.
        key: DelegationKey,
        /// The terminal the relay holds, if known.
        terminal: Option<Outcome>,
    },
}

/// Where the link stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LinkState {
    /// Connecting or waiting to reconnect.
    Connecting {
        /// Consecutive failed attempts.
        attempt: u32,
    },
    /// Authenticated.
    Connected {
        /// The relay's store epoch.
        epoch: u64,
    },
    /// Stopped for good.
    Stopped(String),
}

/// A snapshot of one delegation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    /// The delegation.
    pub key: DelegationKey,
    /// The other peer.
    pub counterpart: PeerId,
    /// Whether this peer is the caller.
    pub is_caller: bool,
    /// Last sequence sent on our sending log.
    pub sent: u64,
    /// Last sequence the relay acknowledged.
    pub acked: u64,
    /// Last sequence received on our receiving log.
    pub received: u64,
    /// The terminal, once known.
    pub terminal: Option<Outcome>,
}

/// Errors of link commands.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LinkError {
    /// The link task has stopped.
    #[error("the connector stopped: {0}")]
    Stopped(String),
    /// No such delegation in this connector.
    #[error("unknown delegation {0}")]
    UnknownDelegation(String),
    /// The delegation already ended.
    #[error("the delegation already ended ({0})")]
    AlreadyTerminal(Outcome),
    /// The relay refused a frame.
    #[error("the relay refused: {code} ({message})")]
    Refused {
        /// Error code name.
        code: String,
        /// Message.
        message: String,
    },
    /// A frame could not be encoded (a field over its limit).
    #[error("frame: {0}")]
    Frame(String),
    /// The frame would be over the relay's size limits (learnt from its
    /// `Welcome`): it is never sent, and the delegation and the link go on.
    #[error(
        "the {part} of {size} bytes is over the relay's limit of {limit} bytes (payload_too_large)"
    )]
    TooLarge {
        /// `payload` or `header`.
        part: &'static str,
        /// The frame's size of that part.
        size: u64,
        /// The relay's limit.
        limit: u64,
    },
    /// This request id is already in use with another payload.
    #[error("request id {0} already used in this connector")]
    Duplicate(String),
    /// The relay's store lost events of this delegation after acknowledging
    /// them (it restarted without its latest writes): nothing more can be
    /// sent on it.
    #[error(
        "the relay's store lost acknowledged events of this delegation (it holds {held} of {acked}); nothing more can be sent on it"
    )]
    StoreLost {
        /// Events the relay had acknowledged.
        acked: u64,
        /// Events its store still holds.
        held: u64,
    },
}

pub(crate) enum Command {
    Open {
        open: Open,
        /// Events already processed (0 for a new delegation; a restored
        /// delegation resumes its up log after this).
        cursor: u64,
        /// The relay may already hold this delegation (restored after a
        /// restart, or re-attached): resume its up log once the open is
        /// acknowledged, since the relay subscribes us by itself only when it
        /// creates the delegation.
        existing: bool,
        reply: oneshot::Sender<Result<(), LinkError>>,
    },
    Send {
        key: DelegationKey,
        kind: SendKind,
        payload: Bytes,
        /// Resolved once the relay acknowledged this frame.
        acked: Option<oneshot::Sender<Result<u64, LinkError>>>,
    },
    Subscribe {
        key: DelegationKey,
        after: u64,
        tx: mpsc::Sender<Result<UpEvent, EventError>>,
    },
    Snapshot {
        key: DelegationKey,
        reply: oneshot::Sender<Option<Snapshot>>,
    },
    Peers {
        reply: oneshot::Sender<Vec<PeerEntry>>,
    },
    Publish {
        descriptor: Bytes,
    },
    Held {
        reply: oneshot::Sender<usize>,
    },
    Release {
        key: DelegationKey,
        after: u64,
    },
    Trace {
        key: DelegationKey,
        trace: oab_wire::TraceId,
    },
    OpenList {
        max: usize,
        reply: oneshot::Sender<(Vec<OpenDelegation>, usize)>,
    },
}

/// What a sending peer appends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SendKind {
    /// A data event (up for callees, down for callers).
    Data,
    /// The one terminal (callee only).
    Terminal(Outcome),
    /// A cancel (caller only).
    Cancel,
}

/// A cloneable handle to the link task.
#[derive(Debug, Clone)]
pub struct LinkHandle {
    tx: mpsc::Sender<Command>,
    /// How the relay's certificate is trusted at the next connect; a
    /// configuration reload replaces it (the session up keeps its TLS).
    tls: Arc<arc_swap::ArcSwap<rustls::ClientConfig>>,
    /// Wakes a link waiting to reconnect when the trust changed.
    trust_changed: Arc<tokio::sync::Notify>,
    state: watch::Receiver<LinkState>,
    stats: Arc<stats::LinkStats>,
    /// The relay URL without its user info, the pinned relay id and the
    /// dead-link rule, for operators.
    relay: Arc<RelayFacts>,
    /// This connector's peer id.
    pub peer: PeerId,
    /// This connector's instance id (its state folder's, or this
    /// process's, see [`crate::reattach`]).
    pub instance: InstanceId,
}

/// Where the link goes, as operators see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RelayFacts {
    /// The relay URL without user info.
    pub url: String,
    /// The relay id the relay must present, if pinned.
    pub relay_id: Option<RelayId>,
    /// The link is dead after this many silent heartbeats.
    pub dead_after_heartbeats: u32,
}

/// An open delegation as `/status` lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpenDelegation {
    /// The delegation.
    pub key: DelegationKey,
    /// The other peer.
    pub counterpart: PeerId,
    /// This host's side.
    pub side: stats::Side,
    /// Last sequence sent on our sending log.
    pub sent: u64,
    /// Last sequence the relay acknowledged.
    pub acked: u64,
    /// Last sequence received on our receiving log.
    pub received: u64,
}

impl LinkError {
    /// The wire error code name this error stands for, where there is one
    /// (`payload_too_large` for a frame over the relay's limits).
    pub fn code(&self) -> Option<&str> {
        match self {
            LinkError::TooLarge { .. } => Some(oab_wire::ErrorCode::PayloadTooLarge.name()),
            LinkError::Refused { code, .. } => Some(code),
            _ => None,
        }
    }
}

impl LinkHandle {
    /// The largest payload the relay takes, as its last `Welcome` said (the
    /// protocol's ceiling, 16 MiB, before the first one). A frame with a
    /// larger payload is refused with [`LinkError::TooLarge`] and never
    /// sent; callers check it early to refuse before they save anything.
    pub fn max_payload(&self) -> usize {
        self.stats.max_payload()
    }

    /// Trusts the relay's certificate as `trust` says from the next
    /// connection on; the session up now keeps its TLS session. Nothing
    /// changes when the trust cannot be set up (a CA file without a
    /// certificate).
    pub fn set_relay_trust(&self, trust: &RelayTrust) -> Result<(), crate::trust::TrustError> {
        self.tls.store(crate::trust::client_config(trust)?);
        // A link waiting out its backoff (the old trust refused the
        // relay's certificate) tries again now.
        self.trust_changed.notify_one();
        Ok(())
    }

    /// The link's counters, gauges and session facts.
    pub fn stats(&self) -> &stats::LinkStats {
        &self.stats
    }

    /// Where the link goes.
    pub fn relay(&self) -> &RelayFacts {
        &self.relay
    }

    /// Whether the relay answers on the current session (see
    /// [`stats::LinkStats::relay_reachable`]).
    pub fn relay_reachable(&self) -> bool {
        self.stats.relay_reachable(
            oab_wire::identity::now_ms(),
            self.relay.dead_after_heartbeats,
        )
    }

    /// Up to `max` open delegations (no terminal yet), in no particular
    /// order, and how many are open in all. Asks the link task, so it waits
    /// while the link's resend buffer is full (callers put a deadline on it).
    pub async fn open_delegations(
        &self,
        max: usize,
    ) -> Result<(Vec<OpenDelegation>, usize), LinkError> {
        let (reply, rx) = oneshot::channel();
        self.command(Command::OpenList { max, reply }).await?;
        rx.await
            .map_err(|_| LinkError::Stopped(self.stopped_reason()))
    }

    pub(crate) async fn command(&self, cmd: Command) -> Result<(), LinkError> {
        self.tx
            .send(cmd)
            .await
            .map_err(|_| LinkError::Stopped(self.stopped_reason()))
    }

    fn stopped_reason(&self) -> String {
        match &*self.state.borrow() {
            LinkState::Stopped(r) => r.clone(),
            _ => "link task ended".into(),
        }
    }

    /// The current link state.
    pub fn state(&self) -> LinkState {
        self.state.borrow().clone()
    }

    /// The link state as it changes (a receiver that has seen the current
    /// state: `changed` waits for the next one).
    pub fn watch_state(&self) -> watch::Receiver<LinkState> {
        let mut rx = self.state.clone();
        rx.borrow_and_update();
        rx
    }

    /// Returns once the link has been down (connecting or stopped) for
    /// `patience` without a break; never while it stays connected.
    pub async fn down_for(&self, patience: std::time::Duration) {
        let mut rx = self.state.clone();
        let mut down_since = None;
        loop {
            let up = matches!(*rx.borrow_and_update(), LinkState::Connected { .. });
            down_since = match (up, down_since) {
                (true, _) => None,
                (false, None) => Some(tokio::time::Instant::now()),
                (false, since) => since,
            };
            match down_since {
                Some(since) => tokio::select! {
                    () = tokio::time::sleep_until(since + patience) => return,
                    r = rx.changed() => if r.is_err() {
                        // The link task ended: down for good.
                        tokio::time::sleep_until(since + patience).await;
                        return;
                    },
                },
                None => {
                    if rx.changed().await.is_err() {
                        std::future::pending::<()>().await;
                    }
                }
            }
        }
    }

    /// Waits until the link is connected (or stopped).
    pub async fn connected(&self) -> Result<u64, LinkError> {
        let mut rx = self.state.clone();
        loop {
            match &*rx.borrow_and_update() {
                LinkState::Connected { epoch } => return Ok(*epoch),
                LinkState::Stopped(r) => return Err(LinkError::Stopped(r.clone())),
                LinkState::Connecting { .. } => {}
            }
            if rx.changed().await.is_err() {
                return Err(LinkError::Stopped("link task ended".into()));
            }
        }
    }

    /// How many delegations the link holds: open ones, and finished ones
    /// within `max_finished` and `max_finished_bytes`.
    pub async fn delegations_held(&self) -> Result<usize, LinkError> {
        let (reply, rx) = oneshot::channel();
        self.command(Command::Held { reply }).await?;
        rx.await
            .map_err(|_| LinkError::Stopped(self.stopped_reason()))
    }

    /// Tells the relay that this caller has processed `key`'s up log
    /// through `after`, its terminal (a `Resume` after the tail, protocol
    /// §8.10), so the relay may drop the delegation's logs and keep only
    /// its outcome for the rest of the retention. Best effort: sent at once
    /// when the link is up, else not at all (retention then drops the
    /// delegation whole). Nothing answers it.
    pub async fn release(&self, key: &DelegationKey, after: u64) -> Result<(), LinkError> {
        self.command(Command::Release {
            key: key.clone(),
            after,
        })
        .await
    }

    /// Names the trace of a delegation this connector serves (known once
    /// its request verified), so the link's own lines about it carry it.
    /// Never waits: with the link's queue full, its lines go without it.
    pub fn note_trace(&self, key: &DelegationKey, trace: oab_wire::TraceId) {
        let _ = self.tx.try_send(Command::Trace {
            key: key.clone(),
            trace,
        });
    }

    /// A snapshot of a delegation.
    pub async fn snapshot(&self, key: &DelegationKey) -> Result<Option<Snapshot>, LinkError> {
        let (reply, rx) = oneshot::channel();
        self.command(Command::Snapshot {
            key: key.clone(),
            reply,
        })
        .await?;
        rx.await
            .map_err(|_| LinkError::Stopped(self.stopped_reason()))
    }
}

/// Starts the link task. `incoming` receives what arrives for this peer as a
/// callee; `shutdown` stops the link (after a best-effort close).
pub fn spawn(
    settings: LinkSettings,
    incoming: mpsc::Sender<Incoming>,
    shutdown: CancellationToken,
) -> Result<(LinkHandle, tokio::task::JoinHandle<()>), crate::trust::TrustError> {
    let tls = Arc::new(arc_swap::ArcSwap::new(crate::trust::client_config(
        &settings.trust,
    )?));
    let (tx, rx) = mpsc::channel(settings.queue.max(1));
    let (state_tx, state_rx) = watch::channel(LinkState::Connecting { attempt: 0 });
    let trust_changed = Arc::new(tokio::sync::Notify::new());
    let stats = Arc::new(stats::LinkStats::default());
    let handle = LinkHandle {
        tx,
        tls: tls.clone(),
        trust_changed: trust_changed.clone(),
        state: state_rx,
        stats: stats.clone(),
        relay: Arc::new(RelayFacts {
            url: relay_url::redacted(&settings.url),
            relay_id: settings.relay_id.clone(),
            dead_after_heartbeats: settings.dead_after_heartbeats,
        }),
        peer: settings.identity.peer.clone(),
        instance: settings.instance,
    };
    let link = Link {
        settings,
        stats,
        tls,
        trust_changed,
        commands: rx,
        incoming,
        state: state_tx,
        delegations: HashMap::new(),
        buffered: 0,
        peers: Vec::new(),
        peer_waiters: Vec::new(),
        epoch: None,
        max_in_flight: 1024,
        session_version: oab_wire::handshake::MIN_VERSION,
        limits: connection::ceiling(),
        drain_hint: None,
        control_frames: Vec::new(),
        descriptor: None,
        retry_at: None,
        retry_logs: std::collections::HashSet::new(),
        heartbeat: Duration::from_secs(15),
        online: false,
        ready_to_send: std::collections::HashSet::new(),
        finished: VecDeque::new(),
        finished_bytes: 0,
        refused: VecDeque::new(),
    };
    let span = tracing::info_span!("link", peer = %handle.peer, instance = %handle.instance);
    let task = tokio::spawn(tracing::Instrument::instrument(link.run(shutdown), span));
    Ok((handle, task))
}

/// The link task's state: settings, the command channel, every delegation
/// this connector takes part in, and what the current session asked for.
struct Link {
    settings: LinkSettings,
    /// What operators see (`/metrics`, `/status`); shared with the handles.
    stats: Arc<stats::LinkStats>,
    /// Read at each connect (see [`LinkHandle::set_relay_trust`]).
    tls: Arc<arc_swap::ArcSwap<rustls::ClientConfig>>,
    /// Notified by [`LinkHandle::set_relay_trust`]: ends the backoff wait.
    /// (A notification while connected ends the next wait at once.)
    trust_changed: Arc<tokio::sync::Notify>,
    commands: mpsc::Receiver<Command>,
    incoming: mpsc::Sender<Incoming>,
    state: watch::Sender<LinkState>,
    delegations: HashMap<DelegationKey, Delegation>,
    buffered: usize,
    peers: Vec<PeerEntry>,
    peer_waiters: Vec<oneshot::Sender<Vec<PeerEntry>>>,
    epoch: Option<u64>,
    max_in_flight: u32,
    /// The protocol version of the current session (of the last one while
    /// offline): below `handshake::TRACE_VERSION` an `Open` is sent
    /// without its trace id, which that relay would not decode.
    session_version: u8,
    /// What the relay takes, from its last `Welcome` (the protocol's
    /// ceilings before the first one): a frame over them is never sent.
    limits: Limits,
    /// Delegations whose open was refused (by the relay, or here as too
    /// large), newest last, so a subscriber that comes after the refusal
    /// still learns it rather than reading an unknown delegation. At most
    /// [`REFUSALS_KEPT`]; the oldest is forgotten first.
    refused: VecDeque<(DelegationKey, EventError)>,
    drain_hint: Option<Duration>,
    /// Unsequenced frames to send once connected (peer queries, publish).
    control_frames: Vec<Bytes>,
    descriptor: Option<Bytes>,
    /// When to resend what the relay refused with a retryable code (see
    /// [`RETRY_AFTER`]); `None` while nothing waits.
    retry_at: Option<tokio::time::Instant>,
    /// Logs refused with a retryable code, resent from their last ack when
    /// `retry_at` fires. Emptied then, and on every new session.
    retry_logs: std::collections::HashSet<DelegationKey>,
    /// Ping interval asked by the relay.
    heartbeat: Duration,
    /// Whether a session is up (control frames are queued only then; the
    /// welcome path re-sends what matters).
    online: bool,
    /// Delegations with frames to send.
    ready_to_send: std::collections::HashSet<DelegationKey>,
    /// Finished delegations, oldest first, with the bytes of their kept
    /// events (bounded by `max_finished` and `max_finished_bytes`; overflow
    /// forgets the oldest, `Link::record_finished`).
    finished: VecDeque<(DelegationKey, u64)>,
    /// Sum of the bytes in `finished`.
    finished_bytes: u64,
}
