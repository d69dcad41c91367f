//! The in-memory store: one process, lost on restart, otherwise the same
//! semantics as the Redis store (the shared conformance tests run both).
//!
//! Never: awaits while it holds its lock: every operation runs to its end under
//! one `parking_lot` mutex, which is what makes each one atomic. Never
//! publishes a wake-up: a memory store is never shared, so it keeps the
//! `FleetStore` defaults.

use parking_lot::Mutex;
use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};

use bytes::Bytes;
use oab_wire::{DelegationKey, Direction, Outcome, PeerId};

use super::{
    AppendOutcome, AppendRequest, Budget, DelegationMeta, EventStore, OpenOutcome, OpenRequest,
    Origin, ReadOutcome, Retention, StoreError,
};

#[derive(Debug, Default)]
struct Log {
    /// Sequence of the first entry in `entries`.
    first: u64,
    entries: VecDeque<Bytes>,
    /// Bytes of the frames in `entries`.
    bytes: u64,
}

impl Log {
    /// Appends `frame`, trims to `cap` entries and returns the bytes trimmed.
    fn push(&mut self, seq: u64, frame: Bytes, cap: u64) -> u64 {
        if self.entries.is_empty() {
            self.first = seq;
        }
        self.bytes += frame.len() as u64;
        self.entries.push_back(frame);
        let mut trimmed = 0;
        while self.entries.len() as u64 > cap {
            if let Some(old) = self.entries.pop_front() {
                trimmed += old.len() as u64;
            }
            self.first += 1;
        }
        self.bytes -= trimmed;
        trimmed
    }
}

#[derive(Debug)]
struct Delegation {
    meta: DelegationMeta,
    down: Log,
    up: Log,
    /// Bytes counted against the caller's (down) and the callee's (up)
    /// [`Retention::max_peer_bytes`]; given back when the delegation
    /// finishes (or is dropped, whichever comes first).
    charged: [u64; 2],
}

/// Index of a direction in per-direction arrays.
fn slot(dir: Direction) -> usize {
    match dir {
        Direction::Down => 0,
        Direction::Up => 1,
    }
}

impl Delegation {
    fn log_mut(&mut self, dir: Direction) -> &mut Log {
        match dir {
            Direction::Down => &mut self.down,
            Direction::Up => &mut self.up,
        }
    }

    fn log(&self, dir: Direction) -> &Log {
        match dir {
            Direction::Down => &self.down,
            Direction::Up => &self.up,
        }
    }
}

#[derive(Debug, Default)]
struct Inner {
    delegations: HashMap<DelegationKey, Delegation>,
    by_peer: HashMap<PeerId, HashSet<DelegationKey>>,
    /// The same for delegations without a terminal: a key is removed when
    /// its terminal is appended (and a peer's entry when it is empty).
    open_by_peer: HashMap<PeerId, HashSet<DelegationKey>>,
    deadlines: BTreeSet<(u64, DelegationKey)>,
    finished: BTreeSet<(u64, DelegationKey)>,
    descriptors: HashMap<PeerId, Bytes>,
    /// Bytes charged per peer ([`Retention::max_peer_bytes`]): the sum of
    /// `charged` over its open delegations; a peer's entry is removed when
    /// its charge drops to zero.
    peer_bytes: HashMap<PeerId, u64>,
}

/// The in-memory store.
#[derive(Debug)]
pub struct MemoryStore {
    inner: Mutex<Inner>,
    retention: Retention,
    epoch: u64,
}

impl MemoryStore {
    /// An empty store with a fresh random epoch.
    pub fn new(retention: Retention) -> Self {
        MemoryStore {
            inner: Mutex::new(Inner::default()),
            retention,
            epoch: rand_epoch(),
        }
    }

    fn lock(&self) -> parking_lot::MutexGuard<'_, Inner> {
        // A panic while holding the lock cannot leave a half-applied append
        // (every mutation is a few infallible steps), so poisoning is ignored.
        self.inner.lock()
    }
}

/// A random non-zero epoch.
pub(crate) fn rand_epoch() -> u64 {
    let mut b = [0u8; 8];
    rand_core::RngCore::fill_bytes(&mut rand_core::OsRng, &mut b);
    u64::from_be_bytes(b).max(1)
}

impl Inner {
    /// The metas of the delegations in a peer index, sorted by key.
    fn metas_in<'a>(
        &self,
        index: Option<impl IntoIterator<Item = &'a DelegationKey>>,
    ) -> Vec<DelegationMeta> {
        let mut out: Vec<DelegationMeta> = index
            .into_iter()
            .flatten()
            .filter_map(|k| self.delegations.get(k).map(|d| d.meta.clone()))
            .collect();
        out.sort_by(|a, b| a.key.cmp(&b.key));
        out
    }

    fn append_one(&mut self, req: AppendRequest, retention: &Retention) -> AppendOutcome {
        let Some(d) = self.delegations.get_mut(&req.key) else {
            return AppendOutcome::Unknown;
        };
        let m = &mut d.meta;
        let (tail, sender_tail) = match req.dir {
            Direction::Down => (m.down_tail, m.down_sender_tail),
            Direction::Up => (m.up_tail, m.up_sender_tail),
        };
        let len = req.frame.len() as u64;
        let mut charged_to = None;
        match &req.origin {
            Origin::Relay => {
                if req.seq != tail + 1 {
                    return AppendOutcome::Conflict { tail };
                }
                if req.terminal.is_some()
                    && let Some(outcome) = m.terminal
                {
                    return AppendOutcome::AlreadyTerminal { outcome };
                }
            }
            Origin::Peer { peer, instance } => {
                let party = match req.dir {
                    Direction::Down => &req.key.caller,
                    Direction::Up => &m.callee,
                };
                if peer != party {
                    return AppendOutcome::NotParty;
                }
                if req.seq <= tail {
                    return if req.seq <= sender_tail {
                        AppendOutcome::Duplicate { tail: sender_tail }
                    } else {
                        // The slot holds a relay entry written after the terminal.
                        AppendOutcome::AlreadyTerminal {
                            outcome: m.terminal.unwrap_or(Outcome::Unknown),
                        }
                    };
                }
                if req.seq > tail + 1 {
                    return AppendOutcome::Hole { tail };
                }
                if let Some(outcome) = m.terminal {
                    return AppendOutcome::AlreadyTerminal { outcome };
                }
                if d.down.bytes + d.up.bytes + len > retention.max_delegation_bytes {
                    return AppendOutcome::OverBudget {
                        budget: Budget::Delegation,
                    };
                }
                let held = self.peer_bytes.get(peer).copied().unwrap_or(0);
                if held + len > retention.max_peer_bytes {
                    return AppendOutcome::OverBudget {
                        budget: Budget::Peer,
                    };
                }
                charged_to = Some(peer.clone());
                match req.dir {
                    Direction::Down => m.down_sender_tail = req.seq,
                    Direction::Up => {
                        m.up_sender_tail = req.seq;
                        if m.accepted_by.is_none() {
                            m.accepted_by = Some(*instance);
                        }
                    }
                }
            }
        }
        match req.dir {
            Direction::Down => m.down_tail = req.seq,
            Direction::Up => m.up_tail = req.seq,
        }
        let mut finished = None;
        if let Some(outcome) = req.terminal
            && m.terminal.is_none()
        {
            m.terminal = Some(outcome);
            m.terminal_ms = Some(req.now_ms);
            finished = Some((m.deadline_ms, req.now_ms, m.callee.clone()));
        }
        let trimmed = d
            .log_mut(req.dir)
            .push(req.seq, req.frame, retention.max_log_entries);
        if let Some(peer) = charged_to {
            // The entry is charged to its sender, and what the trim dropped
            // of this log (the sender's own entries) is given back.
            let charged = &mut d.charged[slot(req.dir)];
            let back = trimmed.min(*charged + len);
            *charged = *charged + len - back;
            let total = self.peer_bytes.entry(peer).or_insert(0);
            *total = (*total + len).saturating_sub(back);
        }
        if let Some((deadline, at, callee)) = finished {
            // A finished delegation leaves its peers' budgets at once: they
            // bound what a peer holds open, not what retention keeps.
            let charged = std::mem::take(&mut d.charged);
            for (peer, bytes) in [(&req.key.caller, charged[0]), (&callee, charged[1])] {
                if let Some(total) = self.peer_bytes.get_mut(peer) {
                    *total = total.saturating_sub(bytes);
                    if *total == 0 {
                        self.peer_bytes.remove(peer);
                    }
                }
            }
            for peer in [&req.key.caller, &callee] {
                if let Some(open) = self.open_by_peer.get_mut(peer) {
                    open.remove(&req.key);
                    if open.is_empty() {
                        self.open_by_peer.remove(peer);
                    }
                }
            }
            self.deadlines.remove(&(deadline, req.key.clone()));
            self.finished.insert((at, req.key));
        }
        AppendOutcome::Appended { seq: req.seq }
    }

    /// Gives back what a dropped delegation charged to its two peers.
    fn uncharge(&mut self, key: &DelegationKey, d: &Delegation) {
        for (peer, charged) in [(&key.caller, d.charged[0]), (&d.meta.callee, d.charged[1])] {
            if let Some(total) = self.peer_bytes.get_mut(peer) {
                *total = total.saturating_sub(charged);
                if *total == 0 {
                    self.peer_bytes.remove(peer);
                }
            }
        }
    }
}

/// One process: the single-instance defaults.
impl super::FleetStore for MemoryStore {}

impl EventStore for MemoryStore {
    fn kind(&self) -> &'static str {
        "memory"
    }

    async fn open(&self, req: OpenRequest) -> Result<OpenOutcome, StoreError> {
        let mut inner = self.lock();
        if let Some(d) = inner.delegations.get(&req.key) {
            return Ok(if d.meta.digest == req.digest {
                OpenOutcome::Existing(d.meta.clone())
            } else {
                OpenOutcome::Mismatch(d.meta.clone())
            });
        }
        let meta = DelegationMeta::opened(&req);
        let mut down = Log::default();
        down.push(1, req.frame, self.retention.max_log_entries);
        inner.delegations.insert(
            req.key.clone(),
            Delegation {
                meta: meta.clone(),
                down,
                up: Log::default(),
                charged: [0, 0],
            },
        );
        for peer in [&req.key.caller, &req.callee] {
            inner
                .by_peer
                .entry(peer.clone())
                .or_default()
                .insert(req.key.clone());
            inner
                .open_by_peer
                .entry(peer.clone())
                .or_default()
                .insert(req.key.clone());
        }
        inner.deadlines.insert((req.deadline_ms, req.key));
        Ok(OpenOutcome::Created(meta))
    }

    async fn append(&self, reqs: Vec<AppendRequest>) -> Result<Vec<AppendOutcome>, StoreError> {
        let mut inner = self.lock();
        Ok(reqs
            .into_iter()
            .map(|r| inner.append_one(r, &self.retention))
            .collect())
    }

    async fn read(
        &self,
        key: &DelegationKey,
        dir: Direction,
        after: u64,
        limit: usize,
    ) -> Result<ReadOutcome, StoreError> {
        let inner = self.lock();
        let Some(d) = inner.delegations.get(key) else {
            return Ok(ReadOutcome::Unknown);
        };
        let tail = d.meta.tail(dir);
        let terminal = d.meta.terminal;
        if after > tail {
            return Ok(ReadOutcome::Lost { tail, terminal });
        }
        let log = d.log(dir);
        if log.entries.is_empty() && after < tail {
            // Compacted: the entries went with the caller's release.
            return Ok(ReadOutcome::Trimmed {
                first_available: 0,
                terminal,
            });
        }
        if !log.entries.is_empty() && after + 1 < log.first {
            return Ok(ReadOutcome::Trimmed {
                first_available: log.first,
                terminal,
            });
        }
        let skip = usize::try_from((after + 1).saturating_sub(log.first)).unwrap_or(usize::MAX);
        let entries = log
            .entries
            .iter()
            .skip(skip)
            .take(limit)
            .enumerate()
            .map(|(i, b)| (after + 1 + i as u64, b.clone()))
            .collect();
        Ok(ReadOutcome::Entries {
            entries,
            tail,
            terminal,
        })
    }

    async fn meta(&self, key: &DelegationKey) -> Result<Option<DelegationMeta>, StoreError> {
        Ok(self.lock().delegations.get(key).map(|d| d.meta.clone()))
    }

    async fn callee_of(&self, key: &DelegationKey) -> Result<Option<PeerId>, StoreError> {
        Ok(self
            .lock()
            .delegations
            .get(key)
            .map(|d| d.meta.callee.clone()))
    }

    async fn delegations_of(&self, peer: &PeerId) -> Result<Vec<DelegationMeta>, StoreError> {
        let inner = self.lock();
        Ok(inner.metas_in(inner.by_peer.get(peer)))
    }

    async fn delegation_keys_of(&self, peer: &PeerId) -> Result<Vec<DelegationKey>, StoreError> {
        Ok(self
            .lock()
            .by_peer
            .get(peer)
            .map(|keys| keys.iter().cloned().collect())
            .unwrap_or_default())
    }

    async fn open_delegations_of(&self, peer: &PeerId) -> Result<Vec<DelegationMeta>, StoreError> {
        let inner = self.lock();
        Ok(inner.metas_in(inner.open_by_peer.get(peer)))
    }

    async fn release(&self, releases: Vec<super::Release>) -> Result<u64, StoreError> {
        let mut inner = self.lock();
        let mut compacted = 0;
        for r in releases {
            let Some(d) = inner.delegations.get_mut(&r.key) else {
                continue;
            };
            let m = &d.meta;
            if m.terminal.is_none()
                || m.callee != r.callee
                || m.up_sender_tail != m.up_tail
                || r.after != m.up_tail
            {
                continue;
            }
            // The logs go; `first` stays, so nothing else changes meaning.
            for log in [&mut d.down, &mut d.up] {
                log.entries = VecDeque::new();
                log.bytes = 0;
            }
            for peer in [&r.key.caller, &r.callee] {
                if let Some(set) = inner.by_peer.get_mut(peer) {
                    set.remove(&r.key);
                    if set.is_empty() {
                        inner.by_peer.remove(peer);
                    }
                }
            }
            compacted += 1;
        }
        Ok(compacted)
    }

    async fn due(&self, now_ms: u64, limit: usize) -> Result<Vec<DelegationKey>, StoreError> {
        let inner = self.lock();
        Ok(inner
            .deadlines
            .iter()
            .take_while(|(d, _)| *d <= now_ms)
            .take(limit)
            .map(|(_, k)| k.clone())
            .collect())
    }

    async fn expire_finished(&self, now_ms: u64) -> Result<u64, StoreError> {
        let mut inner = self.lock();
        let cutoff = now_ms.saturating_sub(self.retention.finished_ttl_ms);
        let expired: Vec<(u64, DelegationKey)> = inner
            .finished
            .iter()
            .take_while(|(at, _)| *at <= cutoff)
            .cloned()
            .collect();
        for entry in &expired {
            inner.finished.remove(entry);
            let key = &entry.1;
            if let Some(d) = inner.delegations.remove(key) {
                inner.uncharge(key, &d);
                for peer in [&key.caller, &d.meta.callee] {
                    if let Some(set) = inner.by_peer.get_mut(peer) {
                        set.remove(key);
                        if set.is_empty() {
                            inner.by_peer.remove(peer);
                        }
                    }
                }
            }
        }
        Ok(expired.len() as u64)
    }

    async fn put_descriptor(&self, peer: &PeerId, descriptor: Bytes) -> Result<(), StoreError> {
        self.lock().descriptors.insert(peer.clone(), descriptor);
        Ok(())
    }

    async fn descriptor(&self, peer: &PeerId) -> Result<Option<Bytes>, StoreError> {
        Ok(self.lock().descriptors.get(peer).cloned())
    }

    async fn epoch(&self) -> Result<u64, StoreError> {
        Ok(self.epoch)
    }

    async fn ping(&self) -> Result<(), StoreError> {
        Ok(())
    }
}
