//! The relay's shared state: who is online, and for every active delegation
//! where its logs stand and who receives them.
//!
//! **Delivery model.** Each delegation direction has at most one receiver
//! subscription (the receiving peer's current session) with a cursor
//! `delivered`. A durable append delivers the frame directly when it is the
//! next one for a *live* subscription; otherwise the subscription is (or
//! becomes) *replaying*: a task reads the log from the cursor, sends in order,
//! and switches back to live under the delegation's lock once it caught up
//! with the tail. Appends and the live/replay switch take the same lock, so
//! the seam has no loss, duplicate or reordering.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use bytes::Bytes;
use oab_wire::frame::FLAG_RELAY_ORIGIN;
use oab_wire::{
    Cancel, CloseCode, Data, DelegationKey, Direction, ErrorCode, Frame, Gap, GapReason,
    InstanceId, Outcome, PeerEntry, PeerId, SessionId, encode,
};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{Instrument as _, debug, info, warn};

use crate::config::{Config, Directory};
use crate::metrics::Metrics;
use crate::outbox::{Outbox, Pushed};
use crate::store::{AppendOutcome, AppendRequest, DelegationMeta, EventStore, Origin, ReadOutcome};

/// Entries read from the store per replay step.
const REPLAY_BATCH: usize = 256;

/// A live session as the hub sees it.
#[derive(Debug, Clone)]
pub struct SessionRef {
    /// Session id.
    pub id: SessionId,
    /// Authenticated peer.
    pub peer: PeerId,
    /// The peer's process instance.
    pub instance: InstanceId,
    /// Its queue.
    pub outbox: Outbox,
}

#[derive(Debug)]
struct Sub {
    session: SessionId,
    /// Unique per subscription: a replay task serves only its own generation,
    /// so a second `Resume` supersedes the first instead of racing it.
    generation: u64,
    outbox: Outbox,
    delivered: u64,
    replaying: bool,
    /// A newer `Resume` of the same session while its replay runs: the
    /// running replay restarts from here (one replay per log and session,
    /// so frames never interleave).
    rewind: Option<u64>,
}

/// The in-memory view of one delegation (a cache of the store's meta plus
/// the receivers). Loaded lazily from the store.
#[derive(Debug)]
pub struct Live {
    /// The caller.
    pub caller: PeerId,
    /// The callee.
    pub callee: PeerId,
    /// Largest payload the route allows.
    pub max_payload: u32,
    tails: [u64; 2],
    terminal: Option<Outcome>,
    subs: [Option<Sub>; 2],
}

impl Live {
    /// The peer that sends on `dir`.
    pub fn sender(&self, dir: Direction) -> &PeerId {
        match dir {
            Direction::Down => &self.caller,
            Direction::Up => &self.callee,
        }
    }

    /// The peer that receives `dir`.
    pub fn receiver(&self, dir: Direction) -> &PeerId {
        self.sender(dir.reverse())
    }

    /// The terminal outcome, if any.
    pub fn terminal(&self) -> Option<Outcome> {
        self.terminal
    }

    fn tail_mut(&mut self, dir: Direction) -> &mut u64 {
        match dir {
            Direction::Down => &mut self.tails[0],
            Direction::Up => &mut self.tails[1],
        }
    }

    fn sub_mut(&mut self, dir: Direction) -> &mut Option<Sub> {
        match dir {
            Direction::Down => &mut self.subs[0],
            Direction::Up => &mut self.subs[1],
        }
    }
}

/// A shared handle to a delegation's live state.
pub type LiveRef = Arc<Mutex<Live>>;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Critical sections hold no await and no fallible step that could leave
    // state half-updated, so a poisoned lock is still consistent.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[derive(Debug, Default)]
struct Counts {
    per_caller: HashMap<PeerId, u32>,
    per_route: HashMap<(PeerId, PeerId), u32>,
    initialised: std::collections::HashSet<PeerId>,
}

/// The shared relay state.
#[derive(Debug)]
pub struct Hub<S> {
    /// The durable store.
    pub store: Arc<S>,
    /// The configuration.
    pub config: Arc<Config>,
    /// Peers and routes.
    pub directory: Arc<Directory>,
    /// Metrics.
    pub metrics: Metrics,
    /// Tracks spawned replay and sweep tasks.
    pub tasks: TaskTracker,
    /// Cancelled on shutdown.
    pub shutdown: CancellationToken,
    sessions: Mutex<HashMap<PeerId, SessionRef>>,
    live: Mutex<HashMap<DelegationKey, LiveRef>>,
    counts: Mutex<Counts>,
    offline_since: Mutex<HashMap<PeerId, u64>>,
    session_subs: Mutex<HashMap<SessionId, HashSet<(DelegationKey, Direction)>>>,
    generations: std::sync::atomic::AtomicU64,
    epoch: std::sync::atomic::AtomicU64,
    epoch_changed: AtomicBool,
}

impl<S: EventStore> Hub<S> {
    /// A hub over a store. `epoch` is the store epoch read at start.
    pub fn new(
        store: Arc<S>,
        config: Arc<Config>,
        metrics: Metrics,
        epoch: u64,
        shutdown: CancellationToken,
    ) -> Arc<Self> {
        let directory = Arc::new(Directory::new(&config));
        let now = oab_wire::identity::now_ms();
        // Every configured peer counts as offline since the relay started, so
        // a callee that never comes back still ends `unknown` after the grace.
        let offline = directory.peers.iter().map(|p| (p.clone(), now)).collect();
        Arc::new(Hub {
            store,
            config,
            directory,
            metrics,
            tasks: TaskTracker::new(),
            shutdown,
            sessions: Mutex::new(HashMap::new()),
            live: Mutex::new(HashMap::new()),
            counts: Mutex::new(Counts::default()),
            offline_since: Mutex::new(offline),
            session_subs: Mutex::new(HashMap::new()),
            generations: std::sync::atomic::AtomicU64::new(1),
            epoch: std::sync::atomic::AtomicU64::new(epoch),
            epoch_changed: AtomicBool::new(false),
        })
    }

    /// The store epoch last seen.
    pub fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Relaxed)
    }

    /// Re-reads the store epoch; on a change, marks the loss and closes every
    /// session so connectors re-handshake and see the new epoch.
    pub async fn check_epoch(&self) {
        let Ok(now) = self.store.epoch().await else {
            return;
        };
        let old = self.epoch.swap(now, Ordering::Relaxed);
        if old != now {
            warn!(
                old,
                new = now,
                "store epoch changed: the store lost its data"
            );
            self.epoch_changed.store(true, Ordering::Relaxed);
            lock(&self.live).clear();
            let sessions: Vec<SessionRef> = lock(&self.sessions).values().cloned().collect();
            for s in sessions {
                s.outbox.close(
                    CloseCode::StoreUnavailable,
                    "the relay's store lost data; reconnect and reconcile",
                );
            }
        }
    }

    /// Whether a peer holds a session now.
    pub fn is_online(&self, peer: &PeerId) -> bool {
        lock(&self.sessions).contains_key(peer)
    }

    /// Records a newly authenticated session; the older session of the same
    /// peer, if any, is closed with `replaced`.
    pub fn register(self: &Arc<Self>, session: SessionRef) {
        let old = lock(&self.sessions).insert(session.peer.clone(), session.clone());
        lock(&self.offline_since).remove(&session.peer);
        if let Some(old) = old {
            self.metrics.replaced.inc();
            info!(peer = %session.peer, old = %old.id, new = %session.id, "session replaced");
            old.outbox.close(
                CloseCode::Replaced,
                "a newer session of this peer replaced this one",
            );
        } else {
            self.metrics
                .peer_sessions
                .with_label_values(&[session.peer.as_str()])
                .set(1);
        }
        self.metrics.sessions.inc();
        self.announce_presence(&session.peer);
    }

    /// Forgets a session that ended and drops its subscriptions.
    pub fn unregister(self: &Arc<Self>, session: &SessionRef) {
        let subscribed = lock(&self.session_subs)
            .remove(&session.id)
            .unwrap_or_default();
        self.metrics.sessions.dec();
        let went_offline = {
            let mut sessions = lock(&self.sessions);
            if sessions
                .get(&session.peer)
                .is_some_and(|s| s.id == session.id)
            {
                sessions.remove(&session.peer);
                true
            } else {
                false
            }
        };
        for (key, dir) in subscribed {
            let live = lock(&self.live).get(&key).cloned();
            if let Some(live) = live {
                let mut l = lock(&live);
                let slot = l.sub_mut(dir);
                if slot.as_ref().is_some_and(|s| s.session == session.id) {
                    *slot = None;
                }
            }
        }
        if went_offline {
            self.metrics
                .peer_sessions
                .with_label_values(&[session.peer.as_str()])
                .set(0);
            lock(&self.offline_since).insert(session.peer.clone(), oab_wire::identity::now_ms());
            self.announce_presence(&session.peer);
        }
    }

    /// The live view of a delegation, loading it from the store if needed.
    pub async fn live(
        &self,
        key: &DelegationKey,
    ) -> Result<Option<LiveRef>, crate::store::StoreError> {
        if let Some(l) = lock(&self.live).get(key) {
            return Ok(Some(l.clone()));
        }
        let started = Instant::now();
        let meta = self.store.meta(key).await;
        self.observe_store("meta", started, meta.is_ok());
        let Some(meta) = meta? else {
            return Ok(None);
        };
        let fresh = Arc::new(Mutex::new(self.live_from_meta(&meta)));
        Ok(Some(
            lock(&self.live).entry(key.clone()).or_insert(fresh).clone(),
        ))
    }

    fn live_from_meta(&self, meta: &DelegationMeta) -> Live {
        let max_payload = self
            .directory
            .route(&meta.key.caller, &meta.callee)
            .and_then(|r| r.max_payload)
            .unwrap_or(self.config.limits.max_payload);
        Live {
            caller: meta.key.caller.clone(),
            callee: meta.callee.clone(),
            max_payload,
            tails: [meta.down_tail, meta.up_tail],
            terminal: meta.terminal,
            subs: [None, None],
        }
    }

    fn new_sub(
        &self,
        key: &DelegationKey,
        dir: Direction,
        session: &SessionRef,
        delivered: u64,
        replaying: bool,
    ) -> Sub {
        lock(&self.session_subs)
            .entry(session.id)
            .or_default()
            .insert((key.clone(), dir));
        Sub {
            session: session.id,
            generation: self.generations.fetch_add(1, Ordering::Relaxed),
            outbox: session.outbox.clone(),
            delivered,
            replaying,
            rewind: None,
        }
    }

    /// Inserts the live view of a delegation that was just created, with the
    /// caller subscribed to its up log and the callee (if online) to its down log.
    pub fn created(
        self: &Arc<Self>,
        meta: &DelegationMeta,
        caller: &SessionRef,
        open_frame: Bytes,
    ) -> LiveRef {
        let mut live = self.live_from_meta(meta);
        *live.sub_mut(Direction::Up) =
            Some(self.new_sub(&meta.key, Direction::Up, caller, 0, false));
        let callee = lock(&self.sessions).get(&meta.callee).cloned();
        if let Some(callee) = &callee {
            *live.sub_mut(Direction::Down) =
                Some(self.new_sub(&meta.key, Direction::Down, callee, 0, false));
        }
        let live = Arc::new(Mutex::new(live));
        lock(&self.live).insert(meta.key.clone(), live.clone());
        {
            let mut l = lock(&live);
            self.deliver(&mut l, &meta.key, Direction::Down, 1, open_frame);
        }
        self.metrics.delegations_opened.inc();
        self.count_open(&meta.key.caller, &meta.callee, 1);
        live
    }

    /// Adjusts open-delegation counts.
    fn count_open(&self, caller: &PeerId, callee: &PeerId, delta: i32) {
        let mut c = lock(&self.counts);
        let a = c.per_caller.entry(caller.clone()).or_insert(0);
        *a = a.saturating_add_signed(delta);
        let b = c
            .per_route
            .entry((caller.clone(), callee.clone()))
            .or_insert(0);
        *b = b.saturating_add_signed(delta);
    }

    /// Seeds the open counts of a caller from the store, once per relay process.
    pub fn seed_counts(&self, caller: &PeerId, metas: &[DelegationMeta]) {
        let mut c = lock(&self.counts);
        if !c.initialised.insert(caller.clone()) {
            return;
        }
        for m in metas
            .iter()
            .filter(|m| &m.key.caller == caller && m.terminal.is_none())
        {
            *c.per_caller.entry(caller.clone()).or_insert(0) += 1;
            *c.per_route
                .entry((caller.clone(), m.callee.clone()))
                .or_insert(0) += 1;
        }
    }

    /// Whether a caller may open one more delegation on a route.
    pub fn may_open(&self, caller: &PeerId, callee: &PeerId, route_max: u32) -> bool {
        let c = lock(&self.counts);
        let per_caller = c.per_caller.get(caller).copied().unwrap_or(0);
        let per_route = c
            .per_route
            .get(&(caller.clone(), callee.clone()))
            .copied()
            .unwrap_or(0);
        per_caller < self.config.limits.max_open_per_peer && per_route < route_max
    }

    /// Applies a durable append to the live view and delivers the frame.
    pub fn appended(
        self: &Arc<Self>,
        live: &LiveRef,
        key: &DelegationKey,
        dir: Direction,
        seq: u64,
        frame: Bytes,
        terminal: Option<Outcome>,
    ) {
        let mut l = lock(live);
        let tail = l.tail_mut(dir);
        *tail = (*tail).max(seq);
        if let Some(outcome) = terminal
            && l.terminal.is_none()
        {
            l.terminal = Some(outcome);
            self.metrics
                .terminals
                .with_label_values(&[outcome.name()])
                .inc();
            let (caller, callee) = (l.caller.clone(), l.callee.clone());
            self.count_open(&caller, &callee, -1);
        }
        self.deliver(&mut l, key, dir, seq, frame);
    }

    /// Delivers entry `seq` to the receiver of `dir` if it is the next one for
    /// a live subscription; starts a catch-up replay if the receiver is behind.
    fn deliver(
        self: &Arc<Self>,
        l: &mut Live,
        key: &DelegationKey,
        dir: Direction,
        seq: u64,
        frame: Bytes,
    ) {
        let slot = l.sub_mut(dir);
        let Some(sub) = slot.as_mut() else {
            return;
        };
        if sub.replaying || seq <= sub.delivered {
            return;
        }
        if seq == sub.delivered + 1 {
            match sub.outbox.push_data(frame) {
                Pushed::Queued => {
                    sub.delivered = seq;
                    self.metrics.hot.data_out.inc();
                    return;
                }
                Pushed::Closed => {
                    *slot = None;
                    return;
                }
                // The receiver's queue is full: it is fed from the log
                // instead, at its own pace (below).
                Pushed::Full => {}
            }
        }
        sub.replaying = true;
        let (generation, outbox, from) = (sub.generation, sub.outbox.clone(), sub.delivered);
        self.spawn_replay(key.clone(), dir, generation, outbox, from);
    }

    /// Subscribes a session to a log from `after` and starts its replay.
    /// `false` if the session may not read that log (or it does not exist).
    pub fn subscribe(
        self: &Arc<Self>,
        live: &LiveRef,
        key: &DelegationKey,
        dir: Direction,
        session: &SessionRef,
        after: u64,
    ) -> bool {
        let generation = {
            let mut l = lock(live);
            if l.receiver(dir) != &session.peer {
                return false;
            }
            if let Some(sub) = l.sub_mut(dir).as_mut()
                && sub.session == session.id
                && sub.replaying
            {
                sub.rewind = Some(after);
                sub.delivered = after;
                return true;
            }
            let sub = self.new_sub(key, dir, session, after, true);
            let generation = sub.generation;
            *l.sub_mut(dir) = Some(sub);
            generation
        };
        self.metrics.replays.inc();
        self.spawn_replay(key.clone(), dir, generation, session.outbox.clone(), after);
        true
    }

    fn spawn_replay(
        self: &Arc<Self>,
        key: DelegationKey,
        dir: Direction,
        generation: u64,
        outbox: Outbox,
        from: u64,
    ) {
        let hub = self.clone();
        let span = tracing::debug_span!("replay", %key, dir = dir.name(), generation, from);
        self.tasks.spawn(
            async move { hub.replay(key, dir, generation, outbox, from).await }.instrument(span),
        );
    }

    /// Sends a `Gap` and logs it.
    #[allow(clippy::too_many_arguments)] // one per field of the frame
    pub fn gap(
        &self,
        outbox: &Outbox,
        key: &DelegationKey,
        dir: Direction,
        after: u64,
        first: u64,
        terminal: Option<Outcome>,
        reason: GapReason,
    ) {
        self.metrics.gaps.with_label_values(&[reason.name()]).inc();
        let frame = Frame::Gap(Gap {
            key: key.clone(),
            direction: dir,
            after,
            first_available: first,
            terminal,
            reason,
        });
        if let Ok(bytes) = encode(&frame) {
            outbox.push(bytes);
        }
    }

    /// The reason to give for a delegation the store does not have.
    pub fn missing_reason(&self) -> GapReason {
        if self.epoch_changed.load(Ordering::Relaxed) {
            GapReason::EpochChanged
        } else {
            GapReason::Unknown
        }
    }

    async fn replay(
        self: Arc<Self>,
        key: DelegationKey,
        dir: Direction,
        generation: u64,
        outbox: Outbox,
        mut cursor: u64,
    ) {
        let start = cursor;
        loop {
            let started = Instant::now();
            let read = self.store.read(&key, dir, cursor, REPLAY_BATCH).await;
            self.observe_store("read", started, read.is_ok());
            let (entries, tail) = match read {
                Err(e) => {
                    warn!(error = %e, "replay read failed");
                    outbox.close(
                        CloseCode::StoreUnavailable,
                        "store unavailable during replay",
                    );
                    return;
                }
                Ok(ReadOutcome::Unknown) => {
                    self.gap(&outbox, &key, dir, start, 0, None, self.missing_reason());
                    self.drop_sub(&key, dir, generation);
                    return;
                }
                Ok(ReadOutcome::Trimmed {
                    first_available,
                    terminal,
                }) => {
                    self.gap(
                        &outbox,
                        &key,
                        dir,
                        cursor,
                        first_available,
                        terminal,
                        GapReason::Trimmed,
                    );
                    self.drop_sub(&key, dir, generation);
                    return;
                }
                Ok(ReadOutcome::Lost { tail, terminal }) => {
                    warn!(
                        cursor,
                        tail, "receiver is ahead of the store: data was lost"
                    );
                    self.gap(
                        &outbox,
                        &key,
                        dir,
                        cursor,
                        u64::from(tail > 0),
                        terminal,
                        GapReason::EpochChanged,
                    );
                    self.drop_sub(&key, dir, generation);
                    return;
                }
                Ok(ReadOutcome::Entries { entries, tail, .. }) => (entries, tail),
            };
            let Ok(Some(live)) = self.live(&key).await else {
                return;
            };
            let mut rewound = false;
            for (seq, frame) in entries {
                // Stop as soon as another subscription took over; restart
                // from a newer cursor of the same session.
                {
                    let mut l = lock(&live);
                    match l.sub_mut(dir).as_mut() {
                        Some(sub) if sub.generation == generation => {
                            if let Some(r) = sub.rewind.take() {
                                cursor = r;
                                rewound = true;
                            }
                        }
                        _ => return,
                    }
                }
                if rewound {
                    break;
                }
                if seq != cursor + 1 {
                    warn!(seq, cursor, "store returned a non-contiguous entry");
                    outbox.close(
                        CloseCode::InternalError,
                        "store returned a non-contiguous log",
                    );
                    return;
                }
                if !outbox.send_data(frame).await {
                    return;
                }
                cursor = seq;
                self.metrics.replayed_frames.inc();
            }
            if rewound {
                continue;
            }
            let mut l = lock(&live);
            let t = l.tail_mut(dir);
            *t = (*t).max(tail);
            let caught_up = *t <= cursor;
            let slot = l.sub_mut(dir);
            match slot.as_mut() {
                Some(sub) if sub.generation == generation => {
                    if let Some(r) = sub.rewind.take() {
                        cursor = r;
                        sub.delivered = r;
                        continue;
                    }
                    sub.delivered = cursor;
                    if caught_up {
                        sub.replaying = false;
                        debug!(cursor, "replay caught up; live");
                        return;
                    }
                }
                // Superseded by a newer subscription (reconnect) or dropped.
                _ => return,
            }
        }
    }

    fn drop_sub(&self, key: &DelegationKey, dir: Direction, generation: u64) {
        let live = lock(&self.live).get(key).cloned();
        if let Some(live) = live {
            let mut l = lock(&live);
            let slot = l.sub_mut(dir);
            if slot.as_ref().is_some_and(|s| s.generation == generation) {
                *slot = None;
            }
        }
    }

    /// Appends a relay-originated entry at `tail + 1` (compare-and-set,
    /// retried on conflict): the `expired`/`unknown` terminal on the up log,
    /// or the cancel sent down after expiry. Returns whether it was appended.
    pub async fn relay_append(
        self: &Arc<Self>,
        key: &DelegationKey,
        dir: Direction,
        outcome: Option<Outcome>,
        reason: &str,
    ) -> bool {
        for _ in 0..64 {
            let Ok(Some(live)) = self.live(key).await else {
                return false;
            };
            let seq = {
                let mut l = lock(&live);
                if outcome.is_some() && l.terminal.is_some() {
                    return false;
                }
                *l.tail_mut(dir) + 1
            };
            let payload = Bytes::from(
                serde_json::json!({
                    "origin": "relay",
                    "outcome": outcome.map(Outcome::name),
                    "reason": reason,
                })
                .to_string(),
            );
            let frame = match dir {
                Direction::Up => Frame::Data(Data {
                    key: key.clone(),
                    direction: Direction::Up,
                    seq,
                    terminal: outcome,
                    flags: FLAG_RELAY_ORIGIN,
                    payload,
                }),
                Direction::Down => Frame::Cancel(Cancel {
                    key: key.clone(),
                    seq,
                    flags: FLAG_RELAY_ORIGIN,
                    payload,
                }),
            };
            let Ok(bytes) = encode(&frame) else {
                return false;
            };
            let req = AppendRequest {
                key: key.clone(),
                dir,
                seq,
                terminal: outcome,
                origin: Origin::Relay,
                frame: bytes.clone(),
                now_ms: oab_wire::identity::now_ms(),
            };
            let started = Instant::now();
            let res = self.store.append(vec![req]).await;
            self.observe_store("append", started, res.is_ok());
            match res.ok().and_then(|v| v.into_iter().next()) {
                Some(AppendOutcome::Appended { seq }) => {
                    info!(%key, dir = dir.name(), seq, outcome = outcome.map(Outcome::name), reason, "relay appended");
                    self.appended(&live, key, dir, seq, bytes, outcome);
                    return true;
                }
                Some(AppendOutcome::Conflict { tail }) => {
                    let mut l = lock(&live);
                    let t = l.tail_mut(dir);
                    *t = (*t).max(tail);
                }
                Some(AppendOutcome::AlreadyTerminal { outcome: o }) => {
                    let mut l = lock(&live);
                    l.terminal.get_or_insert(o);
                    return false;
                }
                _ => return false,
            }
        }
        warn!(%key, "relay append kept conflicting; giving up this round");
        false
    }

    /// Ends every accepted, unfinished delegation of `callee` accepted by an
    /// instance other than `current` (or any instance when `current` is
    /// `None`: the callee stayed away past the grace period) as `unknown`.
    pub async fn end_lost_work(
        self: &Arc<Self>,
        callee: &PeerId,
        current: Option<InstanceId>,
        metas: &[DelegationMeta],
    ) {
        for m in metas {
            let lost = &m.callee == callee
                && m.terminal.is_none()
                && m.accepted_by.is_some_and(|a| Some(a) != current);
            if lost {
                let reason = if current.is_some() {
                    "the callee restarted after accepting the work; side effects are unknown"
                } else {
                    "the callee did not come back within the grace period; side effects are unknown"
                };
                self.relay_append(&m.key, Direction::Up, Some(Outcome::Unknown), reason)
                    .await;
            }
        }
    }

    /// One sweep: deadlines, callees gone past the grace period, retention.
    pub async fn sweep(self: &Arc<Self>) {
        let now = oab_wire::identity::now_ms();
        let started = Instant::now();
        let due = self.store.due(now, 256).await;
        self.observe_store("due", started, due.is_ok());
        for key in due.unwrap_or_default() {
            if self
                .relay_append(
                    &key,
                    Direction::Up,
                    Some(Outcome::Expired),
                    "the deadline passed with no terminal",
                )
                .await
            {
                self.relay_append(&key, Direction::Down, None, "the deadline passed")
                    .await;
            }
        }
        let grace = self.config.lifecycle.unknown_grace_ms;
        let gone: Vec<(PeerId, u64)> = lock(&self.offline_since)
            .iter()
            .filter(|(_, since)| now.saturating_sub(**since) >= grace)
            .map(|(p, since)| (p.clone(), *since))
            .collect();
        for (peer, since) in gone {
            if let Ok(metas) = self.store.delegations_of(&peer).await {
                self.end_lost_work(&peer, None, &metas).await;
                // Forget the peer only if it did not come back meanwhile.
                let mut off = lock(&self.offline_since);
                if off.get(&peer) == Some(&since) {
                    off.remove(&peer);
                }
            }
        }
        let started = Instant::now();
        let expired = self.store.expire_finished(now).await;
        self.observe_store("expire", started, expired.is_ok());
        // Evict finished delegations nobody is reading from the cache.
        lock(&self.live).retain(|_, l| {
            let l = lock(l);
            l.terminal.is_none() || l.subs.iter().any(Option::is_some)
        });
        self.check_epoch().await;
    }

    /// Records a store operation's latency and result.
    pub fn observe_store(&self, op: &str, started: Instant, ok: bool) {
        self.metrics
            .store_latency
            .with_label_values(&[op])
            .observe(started.elapsed().as_secs_f64());
        if !ok {
            self.metrics.store_errors.with_label_values(&[op]).inc();
        }
    }

    /// The `Peers` payload for `peer`: every peer it may reach, its online
    /// state and its published descriptor.
    pub async fn peers_payload(&self, peer: &PeerId) -> Bytes {
        let mut entries = Vec::new();
        for target in self.directory.reachable_from(peer) {
            let descriptor = self
                .store
                .descriptor(&target)
                .await
                .ok()
                .flatten()
                .and_then(|b| serde_json::from_slice(&b).ok());
            entries.push(PeerEntry {
                online: self.is_online(&target),
                peer: target,
                descriptor,
            });
        }
        Bytes::from(serde_json::to_vec(&entries).unwrap_or_default())
    }

    /// Pushes a fresh `Peers` frame to every online peer that may reach `peer`.
    pub fn announce_presence(self: &Arc<Self>, peer: &PeerId) {
        let hub = self.clone();
        let peer = peer.clone();
        self.tasks.spawn(async move {
            for caller in hub.directory.callers_of(&peer) {
                let session = lock(&hub.sessions).get(&caller).cloned();
                if let Some(s) = session {
                    let payload = hub.peers_payload(&caller).await;
                    if let Ok(bytes) = encode(&Frame::Peers(payload)) {
                        s.outbox.push(bytes);
                    }
                }
            }
        });
    }

    /// Sends a typed error frame about a log position.
    pub fn error(
        &self,
        outbox: &Outbox,
        code: ErrorCode,
        key: Option<&DelegationKey>,
        dir: Direction,
        seq: u64,
        message: &str,
    ) {
        self.metrics.errors.with_label_values(&[code.name()]).inc();
        let frame = Frame::Error(oab_wire::ErrorFrame {
            code: code.as_u16(),
            key: key.cloned(),
            direction: dir,
            seq,
            message: message.to_string(),
        });
        if let Ok(bytes) = encode(&frame) {
            outbox.push(bytes);
        }
    }
}
