//! Durable per-delegation logs behind one interface, with two backends:
//! [`memory`] (the default: one process, lost on restart, same semantics
//! otherwise) and [`redis`] (production: streams, one Lua script per append).
//!
//! Per delegation the store keeps a meta record and two logs, **down**
//! (caller -> callee) and **up** (callee -> caller). Entries are whole frames,
//! stored as the exact bytes the sender sent (the relay forwards and replays
//! those bytes). The rules every backend implements atomically:
//!
//! - `open` creates the delegation with the `Open` frame as down entry 1, or
//!   returns the existing one for the same digest (idempotent retry), or
//!   reports [`OpenOutcome::Mismatch`] for a different digest;
//! - `append` accepts exactly `tail + 1`; a resend at or below the sender's
//!   last entry is a [`AppendOutcome::Duplicate`] (acknowledged again, stored
//!   once); a sequence beyond `tail + 1` is a [`AppendOutcome::Hole`];
//! - the first terminal wins: after it, new entries get
//!   [`AppendOutcome::AlreadyTerminal`];
//! - relay-originated entries (the `expired`/`unknown` terminal, the cancel
//!   sent down after expiry) are compare-and-set on the tail, so they never
//!   take a sequence a peer already used;
//! - the first up entry appended by a callee records its instance id
//!   (`accepted_by`), which is how a restarted callee is detected;
//! - a peer's entry is accepted only from the party that sends on that log
//!   (down: the caller, up: the callee); any other sender gets
//!   [`AppendOutcome::NotParty`] and nothing is stored, whatever the
//!   instance's view of the delegation said;
//! - logs are capped at `max_log_entries` (oldest trimmed; a reader asking
//!   for trimmed entries gets a `Gap`), finished delegations are dropped
//!   `finished_ttl_ms` after their terminal, and **compacted** as soon as
//!   their caller releases them (it processed the callee's terminal): the
//!   logs go, the meta record stays for the rest of the retention
//!   ([`EventStore::release`]);
//! - bytes are budgeted ([`Retention::max_delegation_bytes`],
//!   [`Retention::max_peer_bytes`]): a peer's entry that would take either
//!   over its budget gets [`AppendOutcome::OverBudget`] and nothing is
//!   stored. Relay-originated entries are never refused for bytes (they end
//!   delegations), but they count.
//!
//! Never: parses or changes an entry: frames go in and come out as the exact
//! bytes given. Delivering is the hub's; the session checks senders too, but
//! the store's check is the one that holds across instances.

pub mod fleet;
pub mod memory;
pub mod redis;

use std::future::Future;

use bytes::Bytes;
use oab_wire::{DelegationKey, Digest, Direction, InstanceId, Outcome, PeerId, TraceId};
use serde::{Deserialize, Serialize};

pub use self::fleet::{Connection, FleetStore, Liveness, Presence, peer_of_channel, wake_channel};
pub use self::memory::MemoryStore;
pub use self::redis::RedisStore;

/// Errors of the store itself (not of the data in it).
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The backend could not be reached or refused the command.
    #[error("store unavailable: {operation}: {cause}")]
    Unavailable {
        /// What the store was doing: `redis append`, `redis SCRIPT LOAD`,
        /// `connect to Redis at redis://host:6379` (a URL always without its
        /// credentials).
        operation: String,
        /// Why it failed: the backend's error, or what was missing.
        cause: String,
    },
    /// The backend returned something this version does not understand.
    #[error("store returned unexpected data: {0}")]
    Corrupt(String),
}

impl StoreError {
    /// [`StoreError::Unavailable`] for `operation`, failed because of `cause`.
    pub fn unavailable(operation: impl Into<String>, cause: impl std::fmt::Display) -> Self {
        StoreError::Unavailable {
            operation: operation.into(),
            cause: cause.to_string(),
        }
    }
}

/// Retention and byte bounds every backend applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Retention {
    /// Entries kept per log; older ones are trimmed (readers get a `Gap`).
    pub max_log_entries: u64,
    /// How long a finished delegation stays readable after its terminal, ms.
    pub finished_ttl_ms: u64,
    /// Bytes one delegation's two logs may hold (frames as stored, the
    /// `Open` included; entries trimmed by `max_log_entries` no longer
    /// count). Overflow: the peer's entry that would pass it is refused
    /// ([`AppendOutcome::OverBudget`] with [`Budget::Delegation`]), nothing
    /// is stored, and the sender gets an error frame; relay entries are not
    /// refused.
    pub max_delegation_bytes: u64,
    /// Bytes one peer may hold in its open delegations: the entries it
    /// appended (`Data`, `Cancel`), less those trimmed by `max_log_entries`.
    /// Freed when a delegation finishes (its terminal is stored), so what
    /// `finished_ttl_ms` retains never counts: the budget bounds what a
    /// peer holds open, not its traffic.
    /// Overflow: the entry that would pass it is refused
    /// ([`Budget::Peer`]), nothing is stored. `Open` frames are not counted
    /// here (they are bounded by the open-delegation caps times the payload
    /// limit), only in their delegation's budget.
    pub max_peer_bytes: u64,
}

/// Default [`Retention::max_delegation_bytes`]: 128 MiB, about 128 frames
/// at the default 1 MiB payload limit, or the whole 10,000-entry log at
/// 13 KiB a frame.
pub const DEFAULT_MAX_DELEGATION_BYTES: u64 = 128 << 20;
/// Default [`Retention::max_peer_bytes`]: 512 MiB per peer, so a single
/// peer cannot fill a store sized for a few dozen peers.
pub const DEFAULT_MAX_PEER_BYTES: u64 = 512 << 20;

impl Default for Retention {
    fn default() -> Self {
        Retention {
            max_log_entries: 10_000,
            finished_ttl_ms: 24 * 3600 * 1000,
            max_delegation_bytes: DEFAULT_MAX_DELEGATION_BYTES,
            max_peer_bytes: DEFAULT_MAX_PEER_BYTES,
        }
    }
}

/// Everything the relay knows about a delegation, without its logs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DelegationMeta {
    /// The delegation.
    pub key: DelegationKey,
    /// The callee.
    pub callee: PeerId,
    /// Absolute deadline, ms since the epoch.
    pub deadline_ms: u64,
    /// Digest of the open payload.
    pub digest: Digest,
    /// When it was opened, ms since the epoch.
    pub created_ms: u64,
    /// Last durable sequence of the down log.
    pub down_tail: u64,
    /// Last durable sequence of the up log.
    pub up_tail: u64,
    /// Last down sequence appended by the caller (not the relay).
    pub down_sender_tail: u64,
    /// Last up sequence appended by the callee (not the relay).
    pub up_sender_tail: u64,
    /// The terminal outcome, once there is one.
    pub terminal: Option<Outcome>,
    /// When the terminal was appended, ms since the epoch.
    pub terminal_ms: Option<u64>,
    /// The callee instance that appended the first up entry.
    pub accepted_by: Option<InstanceId>,
    /// The caller's trace id, when its `Open` carried one (protocol
    /// version 2); for logs and `inspect`, never for routing.
    pub trace: Option<TraceId>,
}

impl DelegationMeta {
    /// The meta record of a delegation `req` just created: the open is down
    /// entry 1, nothing else is stored yet.
    pub fn opened(req: &OpenRequest) -> Self {
        DelegationMeta {
            key: req.key.clone(),
            callee: req.callee.clone(),
            deadline_ms: req.deadline_ms,
            digest: req.digest,
            created_ms: req.now_ms,
            down_tail: 1,
            up_tail: 0,
            down_sender_tail: 1,
            up_sender_tail: 0,
            terminal: None,
            terminal_ms: None,
            accepted_by: None,
            trace: req.trace,
        }
    }

    /// The last durable sequence of a log.
    pub fn tail(&self, dir: Direction) -> u64 {
        match dir {
            Direction::Down => self.down_tail,
            Direction::Up => self.up_tail,
        }
    }

    /// Whether `peer` is the caller or the callee.
    pub fn involves(&self, peer: &PeerId) -> bool {
        &self.key.caller == peer || &self.callee == peer
    }
}

/// A request to create a delegation.
#[derive(Debug, Clone)]
pub struct OpenRequest {
    /// The delegation.
    pub key: DelegationKey,
    /// The callee.
    pub callee: PeerId,
    /// Absolute deadline.
    pub deadline_ms: u64,
    /// Digest of the open payload.
    pub digest: Digest,
    /// The caller's trace id from its `Open`, if it sent one.
    pub trace: Option<TraceId>,
    /// The `Open` frame as stored and forwarded (down entry 1).
    pub frame: Bytes,
    /// Now, ms since the epoch.
    pub now_ms: u64,
    /// Set when the callee's session may be on another relay instance: a
    /// backend shared by several instances publishes the created entry on
    /// that peer's wake channel, atomically with the write.
    pub wake: Option<PeerId>,
}

/// What `open` did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OpenOutcome {
    /// A new delegation; down entry 1 is durable.
    Created(DelegationMeta),
    /// It existed with the same digest: an idempotent retry.
    Existing(DelegationMeta),
    /// It existed with another digest.
    Mismatch(DelegationMeta),
}

/// Who originates an entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    /// A peer: the store accepts it only from the party that sends on the
    /// log (down: the caller, up: the callee), else
    /// [`AppendOutcome::NotParty`].
    Peer {
        /// The sending peer (the session's authenticated peer).
        peer: PeerId,
        /// Its instance (recorded on acceptance, for up entries).
        instance: InstanceId,
    },
    /// The relay itself: appended only if `seq == tail + 1` (compare-and-set).
    Relay,
}

/// A request to append one entry.
#[derive(Debug, Clone)]
pub struct AppendRequest {
    /// The delegation.
    pub key: DelegationKey,
    /// Which log.
    pub dir: Direction,
    /// The entry's sequence.
    pub seq: u64,
    /// Set when the entry is the terminal (up log only).
    pub terminal: Option<Outcome>,
    /// Who originates it.
    pub origin: Origin,
    /// The exact frame bytes.
    pub frame: Bytes,
    /// Now, ms since the epoch.
    pub now_ms: u64,
    /// Set when the receiver's session may be on another relay instance: a
    /// shared backend publishes the appended entry on that peer's wake
    /// channel, atomically with the append.
    pub wake: Option<PeerId>,
}

/// What `append` did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AppendOutcome {
    /// Durable at this sequence.
    Appended {
        /// The sequence.
        seq: u64,
    },
    /// Already stored (a resend): acknowledge `tail` again.
    Duplicate {
        /// The sender's last durable sequence.
        tail: u64,
    },
    /// The sequence skips ahead of the log.
    Hole {
        /// The log's last durable sequence.
        tail: u64,
    },
    /// The delegation already ended.
    AlreadyTerminal {
        /// Its outcome.
        outcome: Outcome,
    },
    /// A relay-originated append lost its compare-and-set.
    Conflict {
        /// The log's tail now.
        tail: u64,
    },
    /// No such delegation.
    Unknown,
    /// The sending peer is not the party that sends on this log (down: the
    /// caller, up: the callee). Nothing was stored. Answered to the peer
    /// exactly like [`AppendOutcome::Unknown`], so that delegations of other
    /// peers cannot be probed.
    NotParty,
    /// Storing the entry would pass a byte budget: nothing was stored.
    OverBudget {
        /// Which budget.
        budget: Budget,
    },
    /// The part of the store holding this delegation did not answer (one
    /// shard of a Redis Cluster down): nothing was stored for this entry;
    /// resend later. The other entries of the same call have their own
    /// outcomes, so a shard outage stalls only the delegations on it.
    Unavailable,
}

/// The byte budgets of [`Retention`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Budget {
    /// [`Retention::max_delegation_bytes`].
    Delegation,
    /// [`Retention::max_peer_bytes`].
    Peer,
}

/// A caller's release of a finished delegation ([`EventStore::release`]):
/// it has processed the up log through `after`, the terminal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Release {
    /// The delegation (its caller is the releasing peer).
    pub key: DelegationKey,
    /// Its callee, as the relay's view has it (the store checks it).
    pub callee: PeerId,
    /// The caller's cursor on the up log.
    pub after: u64,
}

/// What a read found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReadOutcome {
    /// Entries after the cursor, in order, possibly none.
    Entries {
        /// `(seq, frame bytes)`, ascending and contiguous.
        entries: Vec<(u64, Bytes)>,
        /// The log's tail at read time.
        tail: u64,
        /// The terminal, if any.
        terminal: Option<Outcome>,
    },
    /// Entries after the cursor were trimmed by retention.
    Trimmed {
        /// First sequence still stored.
        first_available: u64,
        /// The terminal, if any.
        terminal: Option<Outcome>,
    },
    /// The reader has seen more than the store holds: the store lost data.
    Lost {
        /// The log's tail in the store.
        tail: u64,
        /// The terminal, if any.
        terminal: Option<Outcome>,
    },
    /// No such delegation.
    Unknown,
}

/// The durable log interface. Every method is atomic with respect to the
/// others for the same delegation.
pub trait EventStore: FleetStore + Send + Sync + 'static {
    /// Creates a delegation (or finds the existing one).
    fn open(
        &self,
        req: OpenRequest,
    ) -> impl Future<Output = Result<OpenOutcome, StoreError>> + Send;

    /// Appends entries in order; one outcome per request. Backends pipeline
    /// the batch; each entry is still checked on its own.
    fn append(
        &self,
        reqs: Vec<AppendRequest>,
    ) -> impl Future<Output = Result<Vec<AppendOutcome>, StoreError>> + Send;

    /// Reads up to `limit` entries after `after`.
    fn read(
        &self,
        key: &DelegationKey,
        dir: Direction,
        after: u64,
        limit: usize,
    ) -> impl Future<Output = Result<ReadOutcome, StoreError>> + Send;

    /// The delegation's meta record.
    fn meta(
        &self,
        key: &DelegationKey,
    ) -> impl Future<Output = Result<Option<DelegationMeta>, StoreError>> + Send;

    /// The delegation's callee, if it exists: the one field needed to tell
    /// whether a peer is a party. Costs the same whether the delegation
    /// exists or not (one short read), so a lookup for a peer that turns out
    /// not to be a party takes as long as one for a missing delegation.
    fn callee_of(
        &self,
        key: &DelegationKey,
    ) -> impl Future<Output = Result<Option<PeerId>, StoreError>> + Send;

    /// Delegations where `peer` is caller or callee that still exist (open, or
    /// finished and neither expired nor compacted by a release).
    fn delegations_of(
        &self,
        peer: &PeerId,
    ) -> impl Future<Output = Result<Vec<DelegationMeta>, StoreError>> + Send;

    /// Delegations where `peer` is caller or callee that have no terminal
    /// yet: what a handshake reads. Both backends keep an index of them (a
    /// finished delegation leaves it with its terminal), so this costs one
    /// read per open delegation however many finished ones retention keeps;
    /// the default (for other implementations) filters
    /// [`Self::delegations_of`].
    fn open_delegations_of(
        &self,
        peer: &PeerId,
    ) -> impl Future<Output = Result<Vec<DelegationMeta>, StoreError>> + Send {
        async move {
            let mut all = self.delegations_of(peer).await?;
            all.retain(|m| m.terminal.is_none());
            Ok(all)
        }
    }

    /// The keys of the delegations where `peer` is caller or callee that
    /// may still exist (open, or finished within retention), without their
    /// records: what `oab-relay inspect` scans to find a delegation by an id
    /// derived from its key. The Redis store reads the peer's index in steps
    /// (`SSCAN`), so a long index never blocks the server; an entry may name
    /// a delegation that has just expired. The default reads
    /// [`Self::delegations_of`].
    fn delegation_keys_of(
        &self,
        peer: &PeerId,
    ) -> impl Future<Output = Result<Vec<DelegationKey>, StoreError>> + Send {
        async move {
            Ok(self
                .delegations_of(peer)
                .await?
                .into_iter()
                .map(|m| m.key)
                .collect())
        }
    }

    /// Compacts finished delegations whose caller has processed their
    /// terminal (the caller's release, [`Release`]): both logs are dropped
    /// and the meta record stays, with the outcome and the tails, until its
    /// retention ends, leaving the peer and retention indexes. Done only
    /// when the terminal is the callee's own (a relay-originated `expired`
    /// or `unknown` may still owe the callee its cancel) and `after` is the
    /// up log's tail; any other release is ignored. A read of a compacted
    /// log before its tail is [`ReadOutcome::Trimmed`] with
    /// `first_available` 0 and the terminal. Returns how many were
    /// compacted. The default compacts nothing (retention drops the
    /// delegation as before).
    fn release(
        &self,
        releases: Vec<Release>,
    ) -> impl Future<Output = Result<u64, StoreError>> + Send {
        let _ = releases;
        async { Ok(0) }
    }

    /// Open delegations whose deadline is at or before `now_ms` (at most `limit`).
    fn due(
        &self,
        now_ms: u64,
        limit: usize,
    ) -> impl Future<Output = Result<Vec<DelegationKey>, StoreError>> + Send;

    /// Drops finished delegations whose retention passed; returns how many.
    fn expire_finished(&self, now_ms: u64) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// Stores a peer's descriptor (opaque bytes).
    fn put_descriptor(
        &self,
        peer: &PeerId,
        descriptor: Bytes,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// A peer's descriptor.
    fn descriptor(
        &self,
        peer: &PeerId,
    ) -> impl Future<Output = Result<Option<Bytes>, StoreError>> + Send;

    /// The store epoch: random, fixed when the store was initialised. A
    /// different value than before means the store lost its data.
    fn epoch(&self) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// Checks the backend answers (for `/readyz`).
    fn ping(&self) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// What the backend is, for operators (`/status`, `check-config`):
    /// `memory`, `redis`, `redis cluster`.
    fn kind(&self) -> &'static str {
        "other"
    }

    /// Where the delegation lives in the backend, for operators (`oab-relay
    /// inspect`): the Redis store's key names (which may exist or not);
    /// none for a backend without named keys.
    fn keys_of(&self, key: &DelegationKey) -> Vec<String> {
        let _ = key;
        Vec::new()
    }

    /// Registers the backend's own metrics in the relay's registry (the
    /// Redis store: `oab_store_connections_replaced_total`). Called once per
    /// relay at start; the default has none.
    fn register_metrics(&self, registry: &prometheus::Registry) -> prometheus::Result<()> {
        let _ = registry;
        Ok(())
    }
}
