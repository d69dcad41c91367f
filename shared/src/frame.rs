//! The frames of the OAB Relay protocol.
//!
//! One WebSocket binary message carries exactly one frame: an 8-byte prefix,
//! a small typed header the relay reads, and an opaque payload the relay never
//! parses (it forwards the very bytes it received). The byte layout is in
//! [`crate::codec`] and `docs/protocol.md`.
//!
//! It owns the frame types, their header fields and the enums on the wire
//! (directions, outcomes, bindings, gap reasons).
//!
//! Never: encodes or decodes bytes (that is `codec`), and never gives a payload
//! a type: whatever a frame carries, its payload is `Bytes`.

use std::fmt;

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::digest::Digest;
use crate::ids::{DelegationKey, InstanceId, KeyId, PeerId, RelayId, SessionId};
use crate::trace::TraceId;

/// The protocol version this crate speaks, in the frame prefix and the handshake.
pub const PROTOCOL_VERSION: u8 = 1;

/// The WebSocket subprotocol a connector asks for and the relay selects.
pub const SUBPROTOCOL: &str = "oab-relay.v1";

/// The frame type byte.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum FrameType {
    /// Relay -> connector: the handshake challenge.
    Challenge = 1,
    /// Connector -> relay: the signed answer to the challenge.
    Hello = 2,
    /// Relay -> connector: the session is authenticated.
    Welcome = 3,
    /// Caller -> relay -> callee: a new delegation (sequence 1 of the down log).
    Open = 4,
    /// A sequenced event or message in either direction.
    Data = 5,
    /// Caller -> relay -> callee: please stop (a down-log entry).
    Cancel = 6,
    /// Relay -> sender: everything up to `seq` is durable.
    Ack = 7,
    /// Receiver -> relay: send me everything after `after`.
    Resume = 8,
    /// Relay -> receiver: what you asked for is gone.
    Gap = 9,
    /// Either way: a typed error about one frame or delegation.
    Error = 10,
    /// Either way: liveness probe.
    Ping = 11,
    /// Either way: liveness answer.
    Pong = 12,
    /// Relay -> connector: the relay is going away; reconnect after a hint.
    Drain = 13,
    /// Connector -> relay: which peers may I reach?
    PeersQuery = 14,
    /// Relay -> connector: the peers you may reach, their state and descriptors.
    Peers = 15,
    /// Connector -> relay: publish my descriptor (my A2A agent card).
    Publish = 16,
}

impl FrameType {
    /// Every frame type.
    pub const ALL: &'static [FrameType] = &[
        FrameType::Challenge,
        FrameType::Hello,
        FrameType::Welcome,
        FrameType::Open,
        FrameType::Data,
        FrameType::Cancel,
        FrameType::Ack,
        FrameType::Resume,
        FrameType::Gap,
        FrameType::Error,
        FrameType::Ping,
        FrameType::Pong,
        FrameType::Drain,
        FrameType::PeersQuery,
        FrameType::Peers,
        FrameType::Publish,
    ];

    /// Decodes the type byte.
    pub fn from_u8(b: u8) -> Option<Self> {
        FrameType::ALL.iter().copied().find(|t| *t as u8 == b)
    }

    /// Stable snake_case name for logs and metric labels.
    pub const fn name(self) -> &'static str {
        match self {
            FrameType::Challenge => "challenge",
            FrameType::Hello => "hello",
            FrameType::Welcome => "welcome",
            FrameType::Open => "open",
            FrameType::Data => "data",
            FrameType::Cancel => "cancel",
            FrameType::Ack => "ack",
            FrameType::Resume => "resume",
            FrameType::Gap => "gap",
            FrameType::Error => "error",
            FrameType::Ping => "ping",
            FrameType::Pong => "pong",
            FrameType::Drain => "drain",
            FrameType::PeersQuery => "peers_query",
            FrameType::Peers => "peers",
            FrameType::Publish => "publish",
        }
    }
}

/// Which log of a delegation a frame belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[repr(u8)]
pub enum Direction {
    /// Caller -> callee: open, follow-up messages, cancel.
    Down = 0,
    /// Callee -> caller: status, artifacts, the terminal result.
    Up = 1,
}

impl Direction {
    /// Decodes the direction byte.
    pub fn from_u8(b: u8) -> Option<Self> {
        match b {
            0 => Some(Direction::Down),
            1 => Some(Direction::Up),
            _ => None,
        }
    }

    /// Stable name for logs and metric labels.
    pub const fn name(self) -> &'static str {
        match self {
            Direction::Down => "down",
            Direction::Up => "up",
        }
    }

    /// The other direction.
    pub const fn reverse(self) -> Self {
        match self {
            Direction::Down => Direction::Up,
            Direction::Up => Direction::Down,
        }
    }
}

/// The reason an `expired` terminal carries, whoever wrote it (the relay's
/// sweeper, or the callee when the deadline stopped its worker): which of the
/// two wins is a race, so a caller sees the same reason either way.
pub const EXPIRED_REASON: &str = "the deadline passed with no terminal";

/// The one terminal outcome of a delegation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[repr(u8)]
pub enum Outcome {
    /// The callee finished the task.
    Completed = 1,
    /// The callee tried and failed (refusal, limits, error).
    Failed = 2,
    /// The callee stopped the work after a cancel; sent only once the worker stopped.
    Cancelled = 3,
    /// The deadline passed with no terminal: appended by the relay's sweeper,
    /// or by the callee when the deadline stopped its worker.
    Expired = 4,
    /// The callee accepted the work and its process went away: side effects are
    /// unprovable, so the caller must reconcile, never blindly retry.
    Unknown = 5,
    /// The callee declined the work before accepting it.
    Rejected = 6,
}

impl Outcome {
    /// Every outcome.
    pub const ALL: &'static [Outcome] = &[
        Outcome::Completed,
        Outcome::Failed,
        Outcome::Cancelled,
        Outcome::Expired,
        Outcome::Unknown,
        Outcome::Rejected,
    ];

    /// Decodes the outcome byte (0 is "no outcome" and is handled by callers).
    pub fn from_u8(b: u8) -> Option<Self> {
        Outcome::ALL.iter().copied().find(|o| *o as u8 == b)
    }

    /// Stable name for logs, metrics and payloads.
    pub const fn name(self) -> &'static str {
        match self {
            Outcome::Completed => "completed",
            Outcome::Failed => "failed",
            Outcome::Cancelled => "cancelled",
            Outcome::Expired => "expired",
            Outcome::Unknown => "unknown",
            Outcome::Rejected => "rejected",
        }
    }
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// How the handshake signature is bound to the transport.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
#[repr(u8)]
pub enum Binding {
    /// Bound to the TLS session with the RFC 9266 `tls-exporter` value, so a
    /// signed hello cannot be relayed through another TLS connection.
    TlsExporter = 0,
    /// Bound to the challenge only: for relays behind a TLS-terminating load
    /// balancer, where the two ends see different TLS sessions.
    ChallengeOnly = 1,
}

impl Binding {
    /// Decodes the binding byte.
    pub fn from_u8(b: u8) -> Option<Self> {
        match b {
            0 => Some(Binding::TlsExporter),
            1 => Some(Binding::ChallengeOnly),
            _ => None,
        }
    }
}

/// Why a `Gap` was sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[repr(u8)]
pub enum GapReason {
    /// Retention trimmed the entries that were asked for.
    Trimmed = 1,
    /// The store lost data (its epoch changed): entries may be missing.
    EpochChanged = 2,
    /// No such delegation visible to this peer (never existed, expired, or
    /// belongs to someone else: all three are answered alike).
    Unknown = 3,
}

impl GapReason {
    /// Decodes the reason byte.
    pub fn from_u8(b: u8) -> Option<Self> {
        match b {
            1 => Some(GapReason::Trimmed),
            2 => Some(GapReason::EpochChanged),
            3 => Some(GapReason::Unknown),
            _ => None,
        }
    }

    /// Stable name for logs and metric labels.
    pub const fn name(self) -> &'static str {
        match self {
            GapReason::Trimmed => "trimmed",
            GapReason::EpochChanged => "epoch_changed",
            GapReason::Unknown => "unknown",
        }
    }
}

/// Relay -> connector, first frame of a session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Challenge {
    /// Random, single-use; the connector signs it.
    pub nonce: [u8; 32],
    /// The relay's id, signed into the transcript.
    pub relay_id: RelayId,
    /// Relay clock, milliseconds since the Unix epoch (lets a connector warn about skew).
    pub server_time_ms: u64,
    /// Lowest protocol version the relay speaks.
    pub min_version: u8,
    /// Highest protocol version the relay speaks.
    pub max_version: u8,
}

/// Connector -> relay: the signed answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    /// The protocol version the connector chose (inside the relay's range).
    pub version: u8,
    /// Who the connector claims to be.
    pub peer: PeerId,
    /// Which of the peer's keys signed.
    pub key_id: KeyId,
    /// New per connector process start.
    pub instance: InstanceId,
    /// Connector clock, ms since the Unix epoch.
    pub time_ms: u64,
    /// The relay id the connector believes it talks to.
    pub relay_id: RelayId,
    /// The challenge nonce being answered.
    pub nonce: [u8; 32],
    /// How the signature is bound to the transport.
    pub binding: Binding,
    /// Ed25519 signature over the transcript (see [`crate::handshake`]).
    pub signature: [u8; 64],
}

/// Relay -> connector: the session is authenticated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Welcome {
    /// The session id, for logs on both sides.
    pub session: SessionId,
    /// The store epoch: a random value fixed when the durable store was
    /// initialised. A change between two welcomes means the store lost its
    /// data; logs the connector knew about may be gone.
    pub epoch: u64,
    /// How often the connector should ping when idle, ms.
    pub heartbeat_ms: u32,
    /// The frame limits the relay enforces.
    pub max_header: u16,
    /// The payload limit the relay enforces.
    pub max_payload: u32,
    /// Max unacknowledged frames per delegation direction the relay accepts.
    pub max_in_flight: u32,
    /// JSON array of [`DelegationCursor`]: every open delegation of this peer
    /// with the relay's last durable sequence per direction.
    pub payload: Bytes,
}

/// One entry of a `Welcome` payload: where the relay's logs stand.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DelegationCursor {
    /// The delegation.
    pub key: DelegationKey,
    /// The peer on the other side (the callee for a caller, and back).
    pub counterpart: PeerId,
    /// Whether the welcomed peer is the caller of this delegation.
    pub is_caller: bool,
    /// Last durable sequence of the down log.
    pub down: u64,
    /// Last durable sequence of the up log.
    pub up: u64,
    /// The terminal outcome, once there is one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub terminal: Option<Outcome>,
}

/// Caller -> relay -> callee: a new delegation. Always sequence 1 of the down log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Open {
    /// The delegation.
    pub key: DelegationKey,
    /// The callee.
    pub target: PeerId,
    /// Absolute deadline, ms since the Unix epoch.
    pub deadline_ms: u64,
    /// Delegation depth (1 for a direct delegation).
    pub depth: u8,
    /// SHA-256 of the payload; the idempotency check compares it.
    pub digest: Digest,
    /// Capability ceiling stamped by the relay from the route (comma-separated
    /// names, empty when the route sets none). Senders leave it empty; the
    /// relay replaces it.
    pub ceiling: String,
    /// The caller's trace id (protocol version 2), so the relay can log it
    /// without reading the payload. Only a caller sends it, and only on a
    /// session of version 2; the relay keeps it and forwards, stores and
    /// replays the `Open` without it (the callee reads the signed one).
    pub trace: Option<TraceId>,
    /// The signed delegation request (opaque to the relay).
    pub payload: Bytes,
}

/// Frame flag: the relay, not the peer, originated this entry (an `expired`
/// or `unknown` terminal, or the cancel sent down after expiry).
pub const FLAG_RELAY_ORIGIN: u8 = 0x01;

/// A sequenced event in either direction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Data {
    /// The delegation.
    pub key: DelegationKey,
    /// Which log.
    pub direction: Direction,
    /// Position in that log, from 1.
    pub seq: u64,
    /// Set on the one terminal frame (up log only).
    pub terminal: Option<Outcome>,
    /// `FLAG_*` bits.
    pub flags: u8,
    /// The event (opaque to the relay).
    pub payload: Bytes,
}

/// Caller -> relay -> callee: stop the work. A down-log entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cancel {
    /// The delegation.
    pub key: DelegationKey,
    /// Position in the down log.
    pub seq: u64,
    /// `FLAG_*` bits.
    pub flags: u8,
    /// Optional reason (opaque to the relay).
    pub payload: Bytes,
}

/// Relay -> sender: every frame up to and including `seq` is durable.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ack {
    /// The delegation.
    pub key: DelegationKey,
    /// Which log.
    pub direction: Direction,
    /// Cumulative: all of 1..=seq are durable.
    pub seq: u64,
}

/// Receiver -> relay: send every entry after `after`, then continue live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resume {
    /// The delegation.
    pub key: DelegationKey,
    /// Which log (the one this peer receives).
    pub direction: Direction,
    /// The last sequence the receiver processed (0 for none).
    pub after: u64,
}

/// Relay -> receiver: entries you asked for cannot be delivered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gap {
    /// The delegation.
    pub key: DelegationKey,
    /// Which log.
    pub direction: Direction,
    /// The `after` that was asked for.
    pub after: u64,
    /// First sequence still available (0 if none).
    pub first_available: u64,
    /// The terminal outcome, if the relay knows it.
    pub terminal: Option<Outcome>,
    /// Why.
    pub reason: GapReason,
}

/// A typed error about one frame or delegation; the session stays open.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ErrorFrame {
    /// The error code (see [`crate::code::ErrorCode`]); unknown codes are kept.
    pub code: u16,
    /// The delegation concerned, if any.
    pub key: Option<DelegationKey>,
    /// The direction concerned (meaningful with `key`).
    pub direction: Direction,
    /// The sequence concerned (0 if none).
    pub seq: u64,
    /// A human-readable message (at most 255 bytes, never secret material).
    pub message: String,
}

/// Liveness probe and answer; `token` is echoed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ping {
    /// Echoed by the `Pong`.
    pub token: u64,
}

/// Relay -> connector: reconnect (to any instance) after about this long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Drain {
    /// Suggested wait before reconnecting, ms.
    pub reconnect_after_ms: u32,
}

/// One entry of a `Peers` payload.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerEntry {
    /// The peer.
    pub peer: PeerId,
    /// Whether it holds a live session now.
    pub online: bool,
    /// Its published descriptor (an A2A agent card), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub descriptor: Option<serde_json::Value>,
}

/// Any frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    /// See [`Challenge`].
    Challenge(Challenge),
    /// See [`Hello`].
    Hello(Hello),
    /// See [`Welcome`].
    Welcome(Welcome),
    /// See [`Open`].
    Open(Open),
    /// See [`Data`].
    Data(Data),
    /// See [`Cancel`].
    Cancel(Cancel),
    /// See [`Ack`].
    Ack(Ack),
    /// See [`Resume`].
    Resume(Resume),
    /// See [`Gap`].
    Gap(Gap),
    /// See [`ErrorFrame`].
    Error(ErrorFrame),
    /// See [`Ping`].
    Ping(Ping),
    /// See [`Ping`].
    Pong(Ping),
    /// See [`Drain`].
    Drain(Drain),
    /// Connector -> relay: list the peers I may reach.
    PeersQuery,
    /// Relay -> connector: JSON array of [`PeerEntry`].
    Peers(Bytes),
    /// Connector -> relay: my descriptor (opaque JSON, size-capped by the relay).
    Publish(Bytes),
}

impl Frame {
    /// The frame's type.
    pub fn frame_type(&self) -> FrameType {
        match self {
            Frame::Challenge(_) => FrameType::Challenge,
            Frame::Hello(_) => FrameType::Hello,
            Frame::Welcome(_) => FrameType::Welcome,
            Frame::Open(_) => FrameType::Open,
            Frame::Data(_) => FrameType::Data,
            Frame::Cancel(_) => FrameType::Cancel,
            Frame::Ack(_) => FrameType::Ack,
            Frame::Resume(_) => FrameType::Resume,
            Frame::Gap(_) => FrameType::Gap,
            Frame::Error(_) => FrameType::Error,
            Frame::Ping(_) => FrameType::Ping,
            Frame::Pong(_) => FrameType::Pong,
            Frame::Drain(_) => FrameType::Drain,
            Frame::PeersQuery => FrameType::PeersQuery,
            Frame::Peers(_) => FrameType::Peers,
            Frame::Publish(_) => FrameType::Publish,
        }
    }

    /// The payload bytes (empty for frames without one).
    pub fn payload(&self) -> &[u8] {
        match self {
            Frame::Welcome(w) => &w.payload,
            Frame::Open(o) => &o.payload,
            Frame::Data(d) => &d.payload,
            Frame::Cancel(c) => &c.payload,
            Frame::Peers(p) | Frame::Publish(p) => p,
            _ => &[],
        }
    }

    /// The sequenced position of a log entry: its key, direction and sequence.
    pub fn log_position(&self) -> Option<(&DelegationKey, Direction, u64)> {
        match self {
            Frame::Open(o) => Some((&o.key, Direction::Down, 1)),
            Frame::Data(d) => Some((&d.key, d.direction, d.seq)),
            Frame::Cancel(c) => Some((&c.key, Direction::Down, c.seq)),
            _ => None,
        }
    }

    /// A `Error` frame for a code, with a message.
    pub fn error(code: crate::code::ErrorCode, message: impl Into<String>) -> Frame {
        Frame::Error(ErrorFrame {
            code: code.as_u16(),
            key: None,
            direction: Direction::Down,
            seq: 0,
            message: message.into(),
        })
    }
}
