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
//!   dropped with [`EventError::Lagged`] and resubscribes from its cursor.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::{SinkExt as _, StreamExt as _};
use oab_wire::handshake::{ChannelBinding, answer_challenge};
use oab_wire::identity::{Identity, now_ms};
use oab_wire::{
    Cancel, Data, DelegationCursor, DelegationKey, Direction, ErrorCode, Frame, GapReason,
    InstanceId, Limits, Open, Outcome, PeerEntry, PeerId, RelayId, Resume, decode_message, encode,
};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot, watch};
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::client::IntoClientRequest as _;
use tokio_tungstenite::tungstenite::http::HeaderValue;
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::trust::RelayTrust;

/// `list_peers` calls waiting for one answer, at most.
const MAX_PEER_WAITERS: usize = 1_024;

/// Pause before resending what the relay refused with a retryable code
/// (`store_unavailable`, `rate_limited`, `too_many_delegations`). A deadline
/// set by the first refusal and kept until it fires: other traffic does not
/// push it back, so a log refused during a store outage goes out again at
/// most this long after the outage ends.
const RETRY_AFTER: Duration = Duration::from_millis(250);

/// Where the relay is and how to reach it.
#[derive(Debug, Clone)]
pub struct LinkSettings {
    /// `wss://host:port/` (or `ws://` only for a relay behind a TLS-terminating
    /// load balancer reached over a private network, and tests).
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
    /// Capacity of the command channel and of each subscriber channel.
    pub queue: usize,
    /// Finished delegations kept (for `events`/`get` after the end); older
    /// ones are forgotten.
    pub max_finished: usize,
}

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
            max_finished: 10_000,
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
    /// This request id is already in use with another payload.
    #[error("request id {0} already used in this connector")]
    Duplicate(String),
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
    state: watch::Receiver<LinkState>,
    /// This connector's peer id.
    pub peer: PeerId,
    /// This process's instance id.
    pub instance: InstanceId,
}

impl LinkHandle {
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
    let tls = crate::trust::client_config(&settings.trust)?;
    let (tx, rx) = mpsc::channel(settings.queue.max(1));
    let (state_tx, state_rx) = watch::channel(LinkState::Connecting { attempt: 0 });
    let handle = LinkHandle {
        tx,
        state: state_rx,
        peer: settings.identity.peer.clone(),
        instance: settings.instance,
    };
    let link = Link {
        settings,
        tls,
        commands: rx,
        incoming,
        state: state_tx,
        delegations: HashMap::new(),
        buffered: 0,
        peers: Vec::new(),
        peer_waiters: Vec::new(),
        epoch: None,
        max_in_flight: 1024,
        limits: Limits::default(),
        drain_hint: None,
        control: Vec::new(),
        descriptor: None,
        retry_at: None,
        retry: std::collections::HashSet::new(),
        heartbeat: Duration::from_secs(15),
        online: false,
        ready: std::collections::HashSet::new(),
        finished: VecDeque::new(),
    };
    let span = tracing::info_span!("link", peer = %handle.peer, instance = %handle.instance);
    let task = tokio::spawn(tracing::Instrument::instrument(link.run(shutdown), span));
    Ok((handle, task))
}

type Ws = WebSocketStream<
    tokio_util::either::Either<tokio_rustls::client::TlsStream<TcpStream>, TcpStream>,
>;

/// The sending half of one delegation (our log towards the relay).
#[derive(Debug, Default)]
struct Outgoing {
    next: u64,
    acked: u64,
    /// Sequence up to which frames were written on the current connection.
    sent: u64,
    unacked: VecDeque<(u64, Bytes)>,
    waiters: Vec<(u64, oneshot::Sender<Result<u64, LinkError>>)>,
}

struct Delegation {
    is_caller: bool,
    counterpart: PeerId,
    out: Outgoing,
    /// Last sequence received on our receiving log.
    cursor: u64,
    /// A resume is in flight on this session (do not send another for a
    /// hole). Void on the next session.
    resuming: bool,
    /// The relay refused our resume with a retryable code: resend it when
    /// the retry deadline fires.
    resume_retry: bool,
    terminal: Option<Outcome>,
    events: VecDeque<UpEvent>,
    subscribers: Vec<(mpsc::Sender<Result<UpEvent, EventError>>, u64)>,
    open_reply: Option<oneshot::Sender<Result<(), LinkError>>>,
    /// Send a resume of the up log once the open is acknowledged (the relay
    /// subscribes the caller by itself only when it creates the delegation).
    resume_after_open: bool,
}

impl Delegation {
    fn new(is_caller: bool, counterpart: PeerId) -> Self {
        Delegation {
            is_caller,
            counterpart,
            out: Outgoing::default(),
            cursor: 0,
            resuming: false,
            resume_retry: false,
            terminal: None,
            events: VecDeque::new(),
            subscribers: Vec::new(),
            open_reply: None,
            resume_after_open: false,
        }
    }

    fn send_dir(&self) -> Direction {
        if self.is_caller {
            Direction::Down
        } else {
            Direction::Up
        }
    }

    fn recv_dir(&self) -> Direction {
        self.send_dir().reverse()
    }

    fn notify(&mut self, item: &Result<UpEvent, EventError>) {
        self.subscribers.retain_mut(|(tx, last)| match item {
            Ok(ev) if ev.seq <= *last => true,
            _ => match tx.try_send(item.clone()) {
                Ok(()) => {
                    if let Ok(ev) = item {
                        *last = ev.seq;
                    }
                    true
                }
                Err(mpsc::error::TrySendError::Full(_)) => {
                    let lagged = EventError::Lagged { last: *last };
                    // Best effort: the receiver sees the channel close either way.
                    let _ = tx.try_send(Err(lagged));
                    false
                }
                Err(mpsc::error::TrySendError::Closed(_)) => false,
            },
        });
    }
}

struct Link {
    settings: LinkSettings,
    tls: Arc<rustls::ClientConfig>,
    commands: mpsc::Receiver<Command>,
    incoming: mpsc::Sender<Incoming>,
    state: watch::Sender<LinkState>,
    delegations: HashMap<DelegationKey, Delegation>,
    buffered: usize,
    peers: Vec<PeerEntry>,
    peer_waiters: Vec<oneshot::Sender<Vec<PeerEntry>>>,
    epoch: Option<u64>,
    max_in_flight: u32,
    limits: Limits,
    drain_hint: Option<Duration>,
    /// Unsequenced frames to send once connected (peer queries, publish).
    control: Vec<Bytes>,
    descriptor: Option<Bytes>,
    /// When to resend what the relay refused with a retryable code (see
    /// [`RETRY_AFTER`]); `None` while nothing waits.
    retry_at: Option<tokio::time::Instant>,
    /// Logs refused with a retryable code, resent from their last ack when
    /// `retry_at` fires. Emptied then, and on every new session.
    retry: std::collections::HashSet<DelegationKey>,
    /// Ping interval asked by the relay.
    heartbeat: Duration,
    /// Whether a session is up (control frames are queued only then; the
    /// welcome path re-sends what matters).
    online: bool,
    /// Delegations with frames to send.
    ready: std::collections::HashSet<DelegationKey>,
    /// Finished delegations, oldest first (bounded by `max_finished`).
    finished: VecDeque<DelegationKey>,
}

enum Exit {
    Reconnect(String),
    Fatal(String),
    Shutdown,
}

fn jitter(max: Duration) -> Duration {
    let mut b = [0u8; 8];
    rand_core::RngCore::fill_bytes(&mut rand_core::OsRng, &mut b);
    let max_ms = u64::try_from(max.as_millis()).unwrap_or(u64::MAX).max(1);
    Duration::from_millis(u64::from_be_bytes(b) % max_ms)
}

impl Link {
    async fn run(mut self, shutdown: CancellationToken) {
        let mut attempt: u32 = 0;
        loop {
            let _ = self.state.send(LinkState::Connecting { attempt });
            let connected = tokio::select! {
                () = shutdown.cancelled() => break,
                r = tokio::time::timeout(self.settings.connect_timeout, self.connect()) => r,
            };
            let exit = match connected {
                Ok(Ok((ws, welcome_list))) => {
                    attempt = 0;
                    self.online = true;
                    let exit = self.session(ws, welcome_list, &shutdown).await;
                    self.online = false;
                    exit
                }
                Ok(Err(Exit::Fatal(r))) => Exit::Fatal(r),
                Ok(Err(e)) => e,
                Err(_) => Exit::Reconnect("connect timed out".into()),
            };
            match exit {
                Exit::Shutdown => break,
                Exit::Fatal(reason) => {
                    warn!(%reason, "link stopped for good");
                    self.stop(&reason);
                    return;
                }
                Exit::Reconnect(reason) => {
                    attempt = attempt.saturating_add(1);
                    let cap = self
                        .settings
                        .backoff_initial
                        .saturating_mul(2u32.saturating_pow(attempt.min(16)))
                        .min(self.settings.backoff_max);
                    // Full jitter; a drain hint sets the floor.
                    let wait = self.drain_hint.take().unwrap_or_default() + jitter(cap);
                    info!(%reason, attempt, wait_ms = wait.as_millis() as u64, "link down; reconnecting");
                    let _ = self.state.send(LinkState::Connecting { attempt });
                    if !self.wait_offline(wait, &shutdown).await {
                        break;
                    }
                }
            }
        }
        self.stop("connector shut down");
    }

    fn stop(&mut self, reason: &str) {
        let _ = self.state.send(LinkState::Stopped(reason.to_string()));
        for d in self.delegations.values_mut() {
            d.notify(&Err(EventError::Stopped(reason.to_string())));
            for (_, w) in d.out.waiters.drain(..) {
                let _ = w.send(Err(LinkError::Stopped(reason.to_string())));
            }
        }
        self.commands.close();
    }

    /// While disconnected: keep taking commands (frames queue as unacked)
    /// until the backoff elapses. `false` on shutdown.
    async fn wait_offline(&mut self, wait: Duration, shutdown: &CancellationToken) -> bool {
        let until = tokio::time::Instant::now() + wait;
        loop {
            let room = self.buffered < self.settings.max_buffered_frames;
            tokio::select! {
                () = shutdown.cancelled() => return false,
                () = tokio::time::sleep_until(until) => return true,
                cmd = self.commands.recv(), if room => match cmd {
                    Some(cmd) => self.command(cmd),
                    None => return false,
                },
            }
        }
    }

    async fn connect(&mut self) -> Result<(Ws, Vec<DelegationCursor>), Exit> {
        let reconnect = |e: &dyn std::fmt::Display| Exit::Reconnect(e.to_string());
        let url = url_parts(&self.settings.url).map_err(Exit::Fatal)?;
        let tcp = TcpStream::connect((url.host.as_str(), url.port))
            .await
            .map_err(|e| reconnect(&e))?;
        let _ = tcp.set_nodelay(true);
        let (io, binding) = if url.tls {
            let name = rustls::pki_types::ServerName::try_from(url.host.clone())
                .map_err(|e| Exit::Fatal(format!("relay host name: {e}")))?;
            let tls = tokio_rustls::TlsConnector::from(self.tls.clone())
                .connect(name, tcp)
                .await
                .map_err(|e| reconnect(&format!("TLS: {e}")))?;
            let binding = if self.settings.challenge_only {
                ChannelBinding::ChallengeOnly
            } else {
                let value = tls
                    .get_ref()
                    .1
                    .export_keying_material(
                        [0u8; 32],
                        oab_wire::handshake::TLS_EXPORTER_LABEL,
                        None,
                    )
                    .map_err(|e| reconnect(&e))?;
                ChannelBinding::TlsExporter(value)
            };
            (tokio_util::either::Either::Left(tls), binding)
        } else {
            (
                tokio_util::either::Either::Right(tcp),
                ChannelBinding::ChallengeOnly,
            )
        };
        let mut req = self
            .settings
            .url
            .as_str()
            .into_client_request()
            .map_err(|e| Exit::Fatal(format!("relay url: {e}")))?;
        req.headers_mut().insert(
            "sec-websocket-protocol",
            HeaderValue::from_static(oab_wire::SUBPROTOCOL),
        );
        let limits = Limits::default();
        let cfg = WebSocketConfig::default()
            .read_buffer_size(16 * 1024)
            .write_buffer_size(32 * 1024)
            .max_write_buffer_size(4 * limits.max_frame())
            .max_message_size(Some(oab_wire::limits::MAX_PAYLOAD_CEILING as usize * 2))
            .max_frame_size(Some(oab_wire::limits::MAX_PAYLOAD_CEILING as usize * 2));
        let (mut ws, _) = tokio_tungstenite::client_async_with_config(req, io, Some(cfg))
            .await
            .map_err(|e| reconnect(&format!("upgrade: {e}")))?;
        let challenge = match recv_handshake(&mut ws).await? {
            Frame::Challenge(c) => c,
            other => {
                return Err(Exit::Reconnect(format!(
                    "expected challenge, got {:?}",
                    other.frame_type()
                )));
            }
        };
        let hello = answer_challenge(
            &self.settings.identity,
            &challenge,
            self.settings.relay_id.as_ref(),
            self.settings.instance,
            now_ms(),
            &binding,
        )
        .map_err(|e| Exit::Fatal(e.to_string()))?;
        let bytes = encode(&Frame::Hello(hello)).map_err(|e| Exit::Fatal(e.to_string()))?;
        ws.send(Message::Binary(bytes))
            .await
            .map_err(|e| reconnect(&e))?;
        let welcome = match recv_handshake(&mut ws).await? {
            Frame::Welcome(w) => w,
            other => {
                return Err(Exit::Reconnect(format!(
                    "expected welcome, got {:?}",
                    other.frame_type()
                )));
            }
        };
        let list: Vec<DelegationCursor> =
            serde_json::from_slice(&welcome.payload).unwrap_or_default();
        self.max_in_flight = welcome.max_in_flight.max(1);
        self.heartbeat = Duration::from_millis(u64::from(welcome.heartbeat_ms.max(100)));
        self.limits = Limits {
            max_header: welcome.max_header,
            max_payload: welcome.max_payload,
        };
        if let Some(old) = self.epoch.replace(welcome.epoch)
            && old != welcome.epoch
        {
            warn!(
                old,
                new = welcome.epoch,
                "relay store epoch changed: its logs may be lost"
            );
            self.epoch_changed(&list);
        }
        let _ = self.state.send(LinkState::Connected {
            epoch: welcome.epoch,
        });
        info!(session = %welcome.session, delegations = list.len(), "connected to relay");
        Ok((ws, list))
    }

    /// The relay's store lost data: every delegation it no longer lists and
    /// that is not finished locally ends with a gap for its subscribers.
    fn epoch_changed(&mut self, list: &[DelegationCursor]) {
        for (key, d) in self.delegations.iter_mut() {
            if d.terminal.is_none() && !list.iter().any(|c| &c.key == key) {
                d.notify(&Err(EventError::Gap {
                    after: d.cursor,
                    reason: GapReason::EpochChanged,
                }));
            }
        }
    }

    async fn session(
        &mut self,
        mut ws: Ws,
        list: Vec<DelegationCursor>,
        shutdown: &CancellationToken,
    ) -> Exit {
        let mut out: Vec<Bytes> = Vec::new();
        self.after_welcome(&list, &mut out);
        for (key, d) in self.delegations.iter_mut() {
            d.out.sent = d.out.acked;
            if !d.out.unacked.is_empty() {
                self.ready.insert(key.clone());
            }
        }
        self.pump(&mut out);
        if let Err(e) = write_all(&mut ws, &mut out).await {
            return Exit::Reconnect(e);
        }
        let heartbeat = self.heartbeat;
        let dead = heartbeat * self.settings.dead_after_heartbeats.max(2);
        let mut ping = tokio::time::interval(heartbeat);
        ping.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last_rx = tokio::time::Instant::now();
        let mut token = 0u64;
        loop {
            let room = self.buffered < self.settings.max_buffered_frames;
            tokio::select! {
                () = shutdown.cancelled() => {
                    let _ = ws.close(None).await;
                    return Exit::Shutdown;
                }
                cmd = self.commands.recv(), if room => {
                    let Some(cmd) = cmd else { return Exit::Shutdown };
                    self.command(cmd);
                    // Take whatever else is queued without waiting.
                    while self.buffered < self.settings.max_buffered_frames {
                        let Ok(cmd) = self.commands.try_recv() else { break };
                        self.command(cmd);
                    }
                    self.pump(&mut out);
                }
                msg = ws.next() => {
                    last_rx = tokio::time::Instant::now();
                    match msg {
                        None => return Exit::Reconnect("relay closed the connection".into()),
                        Some(Err(e)) => return Exit::Reconnect(e.to_string()),
                        Some(Ok(Message::Close(c))) => {
                            let (code, reason) = c.map(|c| (u16::from(c.code), c.reason.to_string())).unwrap_or((1005, String::new()));
                            return if oab_wire::code::close_code_should_reconnect(code) {
                                Exit::Reconnect(format!("closed by relay: {code} {reason}"))
                            } else {
                                Exit::Fatal(format!("closed by relay: {code} {reason}"))
                            };
                        }
                        Some(Ok(Message::Binary(b))) => match decode_message(b, &self.limits_in()) {
                            Ok(frame) => self.frame(frame, &mut out).await,
                            Err(e) => return Exit::Reconnect(format!("undecodable frame from relay: {e}")),
                        },
                        Some(Ok(_)) => {}
                    }
                    self.pump(&mut out);
                }
                () = tokio::time::sleep_until(self.retry_at.unwrap_or_else(tokio::time::Instant::now)), if self.retry_at.is_some() => {
                    self.retry_now(&mut out);
                    self.pump(&mut out);
                }
                _ = ping.tick() => {
                    if last_rx.elapsed() > dead {
                        return Exit::Reconnect("no frame from the relay within the heartbeat deadline".into());
                    }
                    token += 1;
                    if let Ok(b) = encode(&Frame::Ping(oab_wire::Ping { token })) {
                        out.push(b);
                    }
                }
            }
            if let Err(e) = write_all(&mut ws, &mut out).await {
                return Exit::Reconnect(e);
            }
        }
    }

    /// Frames from the relay may carry a larger payload than we would send.
    fn limits_in(&self) -> Limits {
        Limits {
            max_header: u16::MAX,
            max_payload: oab_wire::limits::MAX_PAYLOAD_CEILING,
        }
    }

    fn after_welcome(&mut self, list: &[DelegationCursor], out: &mut Vec<Bytes>) {
        self.control.clear();
        // Everything goes out again from its last ack on this session.
        self.retry_at = None;
        self.retry.clear();
        if let Some(d) = &self.descriptor
            && let Ok(b) = encode(&Frame::Publish(d.clone()))
        {
            out.push(b);
        }
        if !self.peer_waiters.is_empty()
            && let Ok(b) = encode(&Frame::PeersQuery)
        {
            out.push(b);
        }
        // New work for us that arrived while we were away.
        for c in list {
            if !c.is_caller && c.terminal.is_none() && !self.delegations.contains_key(&c.key) {
                self.delegations
                    .insert(c.key.clone(), Delegation::new(false, c.counterpart.clone()));
            }
        }
        // The receiver decides what to resume, not the welcome: every
        // delegation without a terminal here is resumed from its cursor on
        // every new session, listed or not (a delegation that finished while
        // we were away is not listed, and its terminal must still arrive).
        // A resume of an earlier session is void on this one.
        for (key, d) in self.delegations.iter_mut() {
            d.resuming = false;
            d.resume_retry = false;
            if d.terminal.is_some() {
                continue;
            }
            if d.is_caller && d.out.acked == 0 {
                // The open goes out again; resume once it is acknowledged (a
                // resume before the open lands would be answered with a gap,
                // and a relay that already had the open does not subscribe
                // us by itself).
                d.resume_after_open = true;
                continue;
            }
            d.resuming = true;
            resume_frame(key, d.recv_dir(), d.cursor, out);
        }
    }

    /// The retry deadline fired: refused logs go out again from their last
    /// ack, refused resumes are sent again.
    fn retry_now(&mut self, out: &mut Vec<Bytes>) {
        self.retry_at = None;
        self.ready.extend(self.retry.drain());
        for (key, d) in self.delegations.iter_mut() {
            if std::mem::take(&mut d.resume_retry) && d.terminal.is_none() {
                d.resuming = true;
                resume_frame(key, d.recv_dir(), d.cursor, out);
            }
        }
    }

    /// Schedules a retry (keeps an earlier deadline).
    fn retry_later(&mut self) {
        self.retry_at
            .get_or_insert_with(|| tokio::time::Instant::now() + RETRY_AFTER);
    }

    /// Moves unsent frames into `out`, within each log's in-flight window.
    /// Logs waiting for the retry deadline stay put; the others go on.
    fn pump(&mut self, out: &mut Vec<Bytes>) {
        out.append(&mut self.control);
        let window = u64::from(self.max_in_flight);
        // Only logs with something new to send (or a window that opened).
        for key in self.ready.drain() {
            if self.retry.contains(&key) {
                continue;
            }
            let Some(d) = self.delegations.get_mut(&key) else {
                continue;
            };
            for (seq, bytes) in d.out.unacked.iter() {
                if *seq <= d.out.sent {
                    continue;
                }
                if *seq > d.out.acked + window {
                    // Window full: the next ack makes this log ready again.
                    break;
                }
                out.push(bytes.clone());
                d.out.sent = *seq;
            }
        }
    }

    /// Remembers a finished delegation; the oldest beyond
    /// `max_finished` are forgotten (their events can no longer be replayed
    /// locally).
    fn finished(&mut self, key: &DelegationKey) {
        self.finished.push_back(key.clone());
        while self.finished.len() > self.settings.max_finished {
            let Some(old) = self.finished.pop_front() else {
                break;
            };
            if self
                .delegations
                .get(&old)
                .is_some_and(|d| d.terminal.is_some() && d.out.unacked.is_empty())
            {
                self.delegations.remove(&old);
            }
        }
    }

    fn command(&mut self, cmd: Command) {
        match cmd {
            Command::Open {
                open,
                cursor,
                existing,
                reply,
            } => {
                if self.delegations.contains_key(&open.key) {
                    let _ = reply.send(Err(LinkError::Duplicate(open.key.request_id.to_string())));
                    return;
                }
                let key = open.key.clone();
                let target = open.target.clone();
                let bytes = match encode(&Frame::Open(open)) {
                    Ok(b) => b,
                    Err(e) => {
                        let _ = reply.send(Err(LinkError::Frame(e.to_string())));
                        return;
                    }
                };
                let mut d = Delegation::new(true, target);
                d.cursor = cursor;
                d.resume_after_open = existing;
                d.out.next = 2;
                d.out.unacked.push_back((1, bytes));
                d.open_reply = Some(reply);
                self.buffered += 1;
                self.ready.insert(key.clone());
                self.delegations.insert(key, d);
            }
            Command::Send {
                key,
                kind,
                payload,
                acked,
            } => {
                let Some(d) = self.delegations.get_mut(&key) else {
                    if let Some(a) = acked {
                        let _ = a.send(Err(LinkError::UnknownDelegation(key.to_string())));
                    }
                    return;
                };
                if let Some(t) = d.terminal {
                    if let Some(a) = acked {
                        let _ = a.send(Err(LinkError::AlreadyTerminal(t)));
                    }
                    return;
                }
                if d.out.next == 0 {
                    d.out.next = 1;
                }
                let seq = d.out.next;
                let frame = match kind {
                    SendKind::Cancel => Frame::Cancel(Cancel {
                        key: key.clone(),
                        seq,
                        flags: 0,
                        payload,
                    }),
                    SendKind::Data | SendKind::Terminal(_) => Frame::Data(Data {
                        key: key.clone(),
                        direction: d.send_dir(),
                        seq,
                        terminal: match kind {
                            SendKind::Terminal(o) => Some(o),
                            _ => None,
                        },
                        flags: 0,
                        payload,
                    }),
                };
                match encode(&frame) {
                    Ok(bytes) => {
                        d.out.next += 1;
                        d.out.unacked.push_back((seq, bytes));
                        self.buffered += 1;
                        self.ready.insert(key.clone());
                        if let SendKind::Terminal(o) = kind {
                            d.terminal = Some(o);
                        }
                        if let Some(a) = acked {
                            d.out.waiters.push((seq, a));
                        }
                    }
                    Err(e) => {
                        if let Some(a) = acked {
                            let _ = a.send(Err(LinkError::Frame(e.to_string())));
                        }
                    }
                }
            }
            Command::Subscribe { key, after, tx } => {
                let Some(d) = self.delegations.get_mut(&key) else {
                    let _ = tx.try_send(Err(EventError::Gap {
                        after,
                        reason: GapReason::Unknown,
                    }));
                    return;
                };
                let first = d.events.front().map_or(d.cursor + 1, |e| e.seq);
                if after + 1 < first {
                    let _ = tx.try_send(Err(EventError::Gap {
                        after,
                        reason: GapReason::Trimmed,
                    }));
                    return;
                }
                let mut last = after;
                for ev in d.events.iter().filter(|e| e.seq > after) {
                    if tx.try_send(Ok(ev.clone())).is_err() {
                        let _ = tx.try_send(Err(EventError::Lagged { last }));
                        return;
                    }
                    last = ev.seq;
                }
                d.subscribers.push((tx, last));
            }
            Command::Snapshot { key, reply } => {
                let snap = self.delegations.get(&key).map(|d| Snapshot {
                    key: key.clone(),
                    counterpart: d.counterpart.clone(),
                    is_caller: d.is_caller,
                    sent: d.out.next.saturating_sub(1),
                    acked: d.out.acked,
                    received: d.cursor,
                    terminal: d.terminal,
                });
                let _ = reply.send(snap);
            }
            Command::Peers { reply } => {
                // Bounded: past MAX_PEER_WAITERS, answer from the last list.
                if self.peer_waiters.len() >= MAX_PEER_WAITERS {
                    let _ = reply.send(self.peers.clone());
                    return;
                }
                if self.peer_waiters.is_empty()
                    && self.online
                    && let Ok(b) = encode(&Frame::PeersQuery)
                {
                    self.control.push(b);
                }
                self.peer_waiters.push(reply);
            }
            Command::Publish { descriptor } => {
                // Not sequenced: sent now if connected, and on every connect.
                if self.online
                    && let Ok(b) = encode(&Frame::Publish(descriptor.clone()))
                {
                    self.control.push(b);
                }
                self.descriptor = Some(descriptor);
            }
        }
    }

    /// Handles one frame from the relay.
    async fn frame(&mut self, frame: Frame, out: &mut Vec<Bytes>) {
        match frame {
            Frame::Ack(a) => {
                self.ack(&a.key, a.direction, a.seq);
                // A caller's open is durable: start its up log (after the
                // cursor a restored delegation already processed).
                if let Some(d) = self.delegations.get_mut(&a.key)
                    && d.is_caller
                    && d.resume_after_open
                    && d.out.acked >= 1
                {
                    d.resume_after_open = false;
                    d.resuming = true;
                    resume_frame(&a.key, Direction::Up, d.cursor, out);
                }
            }
            Frame::Data(d) => self.data(d, out).await,
            Frame::Open(o) => {
                let key = o.key.clone();
                let entry = self
                    .delegations
                    .entry(key.clone())
                    .or_insert_with(|| Delegation::new(false, o.key.caller.clone()));
                if entry.is_caller || entry.cursor >= 1 {
                    return;
                }
                entry.cursor = 1;
                entry.resuming = false;
                let _ = self.incoming.send(Incoming::Open(o)).await;
            }
            Frame::Cancel(c) => {
                let Some(d) = self.delegations.get_mut(&c.key) else {
                    return;
                };
                if d.is_caller || !in_order(d, c.seq, &c.key, out) {
                    return;
                }
                let relay_origin = c.flags & oab_wire::frame::FLAG_RELAY_ORIGIN != 0;
                let _ = self
                    .incoming
                    .send(Incoming::Cancel {
                        key: c.key,
                        relay_origin,
                        payload: c.payload,
                    })
                    .await;
            }
            Frame::Gap(g) => {
                let Some(d) = self.delegations.get_mut(&g.key) else {
                    return;
                };
                d.resuming = false;
                warn!(key = %g.key, reason = g.reason.name(), after = g.after, "relay reports a gap");
                if d.is_caller {
                    d.notify(&Err(EventError::Gap {
                        after: g.after,
                        reason: g.reason,
                    }));
                    if let Some(t) = g.terminal {
                        d.terminal.get_or_insert(t);
                    }
                } else {
                    let _ = self
                        .incoming
                        .send(Incoming::Ended {
                            key: g.key,
                            terminal: g.terminal,
                        })
                        .await;
                }
            }
            Frame::Error(e) => self.error(e),
            Frame::Peers(payload) => {
                self.peers = serde_json::from_slice(&payload).unwrap_or_default();
                for w in self.peer_waiters.drain(..) {
                    let _ = w.send(self.peers.clone());
                }
            }
            Frame::Ping(p) => {
                if let Ok(b) = encode(&Frame::Pong(p)) {
                    out.push(b);
                }
            }
            Frame::Drain(d) => {
                info!(
                    reconnect_after_ms = d.reconnect_after_ms,
                    "relay is draining"
                );
                self.drain_hint = Some(Duration::from_millis(u64::from(d.reconnect_after_ms)));
            }
            Frame::Pong(_)
            | Frame::Challenge(_)
            | Frame::Hello(_)
            | Frame::Welcome(_)
            | Frame::Resume(_)
            | Frame::PeersQuery
            | Frame::Publish(_) => {}
        }
    }

    fn ack(&mut self, key: &DelegationKey, dir: Direction, seq: u64) {
        let Some(d) = self.delegations.get_mut(key) else {
            return;
        };
        if dir != d.send_dir() || seq <= d.out.acked {
            return;
        }
        d.out.acked = seq;
        d.out.sent = d.out.sent.max(seq);
        while d.out.unacked.front().is_some_and(|(s, _)| *s <= seq) {
            d.out.unacked.pop_front();
            self.buffered = self.buffered.saturating_sub(1);
        }
        if let Some(r) = d.open_reply.take() {
            let _ = r.send(Ok(()));
        }
        let (done, waiting): (Vec<_>, Vec<_>) =
            d.out.waiters.drain(..).partition(|(s, _)| *s <= seq);
        d.out.waiters = waiting;
        for (s, w) in done {
            let _ = w.send(Ok(s));
        }
        let sent_all = d.out.unacked.is_empty();
        let our_terminal_durable = sent_all && d.terminal.is_some() && !d.is_caller;
        if !sent_all {
            // The window moved: more may go out.
            self.ready.insert(key.clone());
        }
        if our_terminal_durable {
            self.finished(key);
        }
    }

    async fn data(&mut self, f: Data, out: &mut Vec<Bytes>) {
        let Some(d) = self.delegations.get_mut(&f.key) else {
            return;
        };
        if f.direction != d.recv_dir() || !in_order(d, f.seq, &f.key, out) {
            return;
        }
        if d.is_caller {
            let ev = UpEvent {
                seq: f.seq,
                terminal: f.terminal,
                relay_origin: f.flags & oab_wire::frame::FLAG_RELAY_ORIGIN != 0,
                payload: f.payload,
            };
            if let Some(t) = ev.terminal {
                d.terminal.get_or_insert(t);
                // Nothing more will be accepted on our down log.
                self.buffered = self.buffered.saturating_sub(d.out.unacked.len());
                d.out.unacked.clear();
            }
            d.events.push_back(ev.clone());
            while d.events.len() > self.settings.max_events_per_delegation {
                d.events.pop_front();
            }
            let done = ev.terminal.is_some();
            d.notify(&Ok(ev));
            if done {
                self.finished(&f.key);
            }
        } else {
            let _ = self
                .incoming
                .send(Incoming::Message {
                    key: f.key,
                    seq: f.seq,
                    payload: f.payload,
                })
                .await;
        }
    }

    fn error(&mut self, e: oab_wire::ErrorFrame) {
        let code = ErrorCode::from_u16(e.code);
        let name = code.map_or_else(|| format!("error_{}", e.code), |c| c.name().to_string());
        let Some(key) = e.key.clone() else {
            warn!(code = %name, message = %e.message, "relay error");
            return;
        };
        let Some(d) = self.delegations.get_mut(&key) else {
            return;
        };
        debug!(%key, code = %name, seq = e.seq, message = %e.message, "relay refused a frame");
        match code {
            Some(ErrorCode::SequenceGap) => {
                // The relay holds up to e.seq: everything after is resent.
                let tail = e.seq;
                while d.out.unacked.front().is_some_and(|(s, _)| *s <= tail) {
                    d.out.unacked.pop_front();
                    self.buffered = self.buffered.saturating_sub(1);
                }
                d.out.acked = d.out.acked.max(tail);
                d.out.sent = d.out.acked;
                self.ready.insert(key.clone());
            }
            Some(
                ErrorCode::StoreUnavailable
                | ErrorCode::RateLimited
                | ErrorCode::TooManyDelegations,
            ) => {
                if e.direction == d.recv_dir() {
                    // Our resume was refused: ask again after the pause.
                    d.resuming = false;
                    d.resume_retry = true;
                } else {
                    // Resend from the acked point after the pause.
                    d.out.sent = d.out.acked;
                    self.retry.insert(key.clone());
                }
                self.retry_later();
            }
            Some(ErrorCode::AlreadyTerminal) => {
                let won = Outcome::ALL
                    .iter()
                    .copied()
                    .find(|o| e.message.ends_with(o.name()));
                d.terminal.get_or_insert(won.unwrap_or(Outcome::Unknown));
                self.buffered = self.buffered.saturating_sub(d.out.unacked.len());
                d.out.unacked.clear();
                for (_, w) in d.out.waiters.drain(..) {
                    let _ = w.send(Err(LinkError::AlreadyTerminal(
                        won.unwrap_or(Outcome::Unknown),
                    )));
                }
            }
            _ => {
                let refused = LinkError::Refused {
                    code: name.clone(),
                    message: e.message.clone(),
                };
                if let Some(r) = d.open_reply.take() {
                    let _ = r.send(Err(refused.clone()));
                }
                for (_, w) in d.out.waiters.drain(..) {
                    let _ = w.send(Err(refused.clone()));
                }
                d.notify(&Err(EventError::Refused {
                    code: name,
                    message: e.message,
                }));
                if e.direction == d.send_dir() && e.seq <= 1 && d.is_caller {
                    // The open itself was refused: nothing of this delegation exists.
                    self.buffered = self.buffered.saturating_sub(d.out.unacked.len());
                    self.delegations.remove(&key);
                }
            }
        }
    }
}

/// Queues a `Resume` of `dir` after `after`.
fn resume_frame(key: &DelegationKey, dir: Direction, after: u64, out: &mut Vec<Bytes>) {
    if let Ok(b) = encode(&Frame::Resume(Resume {
        key: key.clone(),
        direction: dir,
        after,
    })) {
        out.push(b);
    }
}

/// Checks a received sequence against the cursor: `true` to process it.
/// A hole asks the relay to resume from the cursor (once).
fn in_order(d: &mut Delegation, seq: u64, key: &DelegationKey, out: &mut Vec<Bytes>) -> bool {
    if seq <= d.cursor {
        return false;
    }
    if seq > d.cursor + 1 {
        if !d.resuming {
            d.resuming = true;
            resume_frame(key, d.recv_dir(), d.cursor, out);
        }
        return false;
    }
    d.cursor = seq;
    d.resuming = false;
    true
}

async fn recv_handshake(ws: &mut Ws) -> Result<Frame, Exit> {
    loop {
        match ws.next().await {
            None => return Err(Exit::Reconnect("relay closed during the handshake".into())),
            Some(Err(e)) => return Err(Exit::Reconnect(e.to_string())),
            Some(Ok(Message::Binary(b))) => {
                return decode_message(
                    b,
                    &Limits {
                        max_header: u16::MAX,
                        max_payload: oab_wire::limits::MAX_PAYLOAD_CEILING,
                    },
                )
                .map_err(|e| Exit::Reconnect(e.to_string()));
            }
            Some(Ok(Message::Close(c))) => {
                let (code, reason) = c
                    .map(|c| (u16::from(c.code), c.reason.to_string()))
                    .unwrap_or((1005, String::new()));
                let msg = format!("relay refused the session: {code} {reason}");
                return Err(if oab_wire::code::close_code_should_reconnect(code) {
                    Exit::Reconnect(msg)
                } else {
                    Exit::Fatal(msg)
                });
            }
            Some(Ok(_)) => {}
        }
    }
}

async fn write_all(ws: &mut Ws, out: &mut Vec<Bytes>) -> Result<(), String> {
    if out.is_empty() {
        return Ok(());
    }
    for b in out.drain(..) {
        ws.feed(Message::Binary(b))
            .await
            .map_err(|e| e.to_string())?;
    }
    ws.flush().await.map_err(|e| e.to_string())
}

struct UrlParts {
    host: String,
    port: u16,
    tls: bool,
}

fn url_parts(url: &str) -> Result<UrlParts, String> {
    let (tls, rest) = if let Some(r) = url.strip_prefix("wss://") {
        (true, r)
    } else if let Some(r) = url.strip_prefix("ws://") {
        (false, r)
    } else {
        return Err(format!(
            "relay url {url:?} must start with wss:// (or ws://)"
        ));
    };
    let authority = rest.split('/').next().unwrap_or_default();
    let (host, port) = match authority.rsplit_once(':') {
        Some((h, p)) => (
            h,
            p.parse::<u16>()
                .map_err(|_| format!("relay url {url:?}: bad port"))?,
        ),
        None => (authority, if tls { 443 } else { 80 }),
    };
    if host.is_empty() {
        return Err(format!("relay url {url:?} has no host"));
    }
    Ok(UrlParts {
        host: host.trim_matches(['[', ']']).to_string(),
        port,
        tls,
    })
}
