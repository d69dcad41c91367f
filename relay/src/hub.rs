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
use crate::fleet::Fleet;
use crate::metrics::Metrics;
use crate::outbox::{Outbox, Pushed};
use crate::store::{
    AppendOutcome, AppendRequest, DelegationMeta, EventStore, Origin, ReadOutcome, StoreError,
};

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
    /// Dropped from the hub's cache: holders must look it up again.
    evicted: bool,
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

    /// Whether the hub dropped this view from its cache.
    pub fn evicted(&self) -> bool {
        self.evicted
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
    /// Presence, wake-ups and leases shared with other instances.
    pub fleet: Arc<Fleet>,
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
        let fleet = Arc::new(Fleet::new(&config, store.wake_urls()));
        Arc::new(Hub {
            fleet,
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
        if !self.fleet.enabled {
            self.announce_presence(&session.peer);
        }
    }

    /// Makes a registered session the peer's session fleet-wide: subscribes
    /// its wake channel, claims its presence record, and announces the claim
    /// so an older session of the peer on another instance is closed. Runs
    /// before the `Welcome`. A no-op without a shared store.
    pub async fn hold(self: &Arc<Self>, me: &SessionRef) -> Result<(), StoreError> {
        if !self.fleet.enabled {
            return Ok(());
        }
        self.fleet.subscribe(&me.peer, me.id).await?;
        let generation = self
            .store
            .claim_presence(&me.peer, &self.fleet.node, me.id)
            .await?;
        if !self.fleet.hold(&me.peer, me.id, generation) {
            info!(peer = %me.peer, session = %me.id, "a newer session of this peer holds it elsewhere");
            me.outbox.close(
                CloseCode::Replaced,
                "a newer session of this peer replaced this one",
            );
        }
        let claim = format!("T{generation}|{}|{}", me.id, self.fleet.node);
        self.store
            .publish(vec![(me.peer.clone(), Bytes::from(claim))])
            .await?;
        self.announce_presence(&me.peer);
        Ok(())
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
        let mut nudges = Vec::new();
        for (key, dir) in subscribed {
            let live = lock(&self.live).get(&key).cloned();
            if let Some(live) = live {
                let mut l = lock(&live);
                let tail = *l.tail_mut(dir);
                let slot = l.sub_mut(dir);
                if slot.as_ref().is_some_and(|s| s.session == session.id) {
                    *slot = None;
                    // Entries delivered only to this session may be what the
                    // peer's new session on another instance replayed just
                    // before: tell it where the log stands.
                    if self.fleet.enabled {
                        nudges.push((session.peer.clone(), nudge(&key, dir, tail)));
                    }
                }
            }
        }
        if went_offline {
            self.metrics
                .peer_sessions
                .with_label_values(&[session.peer.as_str()])
                .set(0);
            lock(&self.offline_since).insert(session.peer.clone(), oab_wire::identity::now_ms());
        }
        if self.fleet.enabled {
            let released = went_offline && self.fleet.release(&session.peer, session.id);
            let hub = self.clone();
            let (peer, id) = (session.peer.clone(), session.id);
            self.tasks.spawn(async move {
                if !nudges.is_empty() {
                    let _ = hub.store.publish(nudges).await;
                }
                if released {
                    if let Err(e) = hub.store.release_presence(&peer, id).await {
                        warn!(error = %e, %peer, "could not release the presence record");
                    }
                    hub.announce_presence(&peer);
                    // Stop taking the peer's wake-ups at once (they would be
                    // dropped here anyway), unless it came back meanwhile.
                    hub.fleet.prune_subscriptions().await;
                }
            });
        } else if went_offline {
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
            evicted: false,
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
        // With a shared store, a wake-up about this delegation (the callee's
        // first entry, or the open echoed back) can arrive before this runs
        // and load the view first: reuse that view, never replace it.
        let live = {
            let mut map = lock(&self.live);
            match map.get(&meta.key) {
                Some(l)
                    if {
                        let g = lock(l);
                        g.terminal.is_none() && !g.evicted
                    } =>
                {
                    l.clone()
                }
                stale => {
                    if let Some(old) = stale {
                        lock(old).evicted = true;
                    }
                    let fresh = Arc::new(Mutex::new(self.live_from_meta(meta)));
                    map.insert(meta.key.clone(), fresh.clone());
                    fresh
                }
            }
        };
        let callee = lock(&self.sessions).get(&meta.callee).cloned();
        {
            let mut l = lock(&live);
            if l.subs[1].as_ref().is_none_or(|s| s.session != caller.id) {
                l.subs[1] = Some(self.new_sub(&meta.key, Direction::Up, caller, 0, false));
            }
            if let Some(callee) = &callee
                && l.subs[0].is_none()
            {
                l.subs[0] = Some(self.new_sub(&meta.key, Direction::Down, callee, 0, false));
            }
            let _ = self.deliver(&mut l, &meta.key, Direction::Down, 1, open_frame);
        }
        // Up entries that arrived before the caller's subscription existed.
        let up_tail = lock(&live).tails[1];
        if up_tail > 0 {
            self.nudged(&live, &meta.key, Direction::Up, up_tail, None);
        }
        self.metrics.delegations_opened.inc();
        self.count_open(&meta.key.caller, &meta.callee, 1);
        live
    }

    /// An open the store already had (a resend after a lost ack, a retry
    /// after a store error that did commit, a restarted caller): both ends
    /// get the delegation as if it had just been created here. The caller's
    /// session reads the up log from its start unless it already does; the
    /// callee, when its session is here and reads nothing of it, gets the
    /// down log from its start (the open included). Receivers drop what they
    /// already processed by sequence.
    pub async fn reopened(
        self: &Arc<Self>,
        key: &DelegationKey,
        caller: &SessionRef,
    ) -> Result<(), StoreError> {
        let Some(live) = self.live(key).await? else {
            return Ok(());
        };
        let (read_up, callee) = {
            let l = lock(&live);
            let read_up = l.subs[1].as_ref().is_none_or(|s| s.session != caller.id);
            let callee = (l.subs[0].is_none() && l.terminal.is_none()).then(|| l.callee.clone());
            (read_up, callee)
        };
        if read_up {
            self.subscribe(&live, key, Direction::Up, caller, 0);
        }
        let callee = callee.and_then(|c| lock(&self.sessions).get(&c).cloned());
        if let Some(callee) = callee {
            self.subscribe(&live, key, Direction::Down, &callee, 0);
        }
        Ok(())
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

    /// Sets the open counts of a caller from the store (at each handshake:
    /// delegations may have ended on another instance meanwhile).
    pub fn seed_counts(&self, caller: &PeerId, metas: &[DelegationMeta]) {
        let mut c = lock(&self.counts);
        c.per_caller.remove(caller);
        c.per_route.retain(|(from, _), _| from != caller);
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

    /// The peer to wake for an entry about to be appended on `dir`: with a
    /// shared store, the receiver, unless it is subscribed here (then local
    /// delivery is enough; if its session has in fact moved, the unsubscribe
    /// here nudges it, and if this instance dies first, the new one
    /// resynchronises when it sees this one's liveness lapse).
    pub fn wake_for(&self, l: &Live, dir: Direction) -> Option<PeerId> {
        if !self.fleet.enabled {
            return None;
        }
        let subscribed = match dir {
            Direction::Down => l.subs[0].is_some(),
            Direction::Up => l.subs[1].is_some(),
        };
        (!subscribed).then(|| l.receiver(dir).clone())
    }

    /// The peer to wake for a new delegation's `Open`: the callee, unless it
    /// is held here.
    pub fn open_wake(&self, callee: &PeerId) -> Option<PeerId> {
        (self.fleet.enabled && !self.is_online(callee)).then(|| callee.clone())
    }

    fn note_terminal(&self, l: &mut Live, outcome: Option<Outcome>) {
        if let Some(outcome) = outcome
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
    }

    /// Applies a durable append to the live view and delivers the frame.
    /// `woke`: the append was published to the receiver's wake channel; if
    /// not and the receiver is not subscribed here, it gets a nudge instead.
    #[allow(clippy::too_many_arguments)] // the entry's fields
    pub fn appended(
        self: &Arc<Self>,
        live: &LiveRef,
        key: &DelegationKey,
        dir: Direction,
        seq: u64,
        frame: Bytes,
        terminal: Option<Outcome>,
        woke: bool,
    ) {
        let mut l = lock(live);
        let tail = l.tail_mut(dir);
        *tail = (*tail).max(seq);
        self.note_terminal(&mut l, terminal);
        let subscribed = self.deliver(&mut l, key, dir, seq, frame);
        if self.fleet.enabled && !woke && !subscribed {
            // The receiver went away between the decision and the append.
            let receiver = l.receiver(dir).clone();
            drop(l);
            let hub = self.clone();
            let msg = nudge(key, dir, seq);
            self.tasks.spawn(async move {
                let _ = hub.store.publish(vec![(receiver, msg)]).await;
            });
        }
    }

    /// Delivers entry `seq` to the receiver of `dir` if it is the next one for
    /// a live subscription; starts a catch-up replay if the receiver is behind.
    /// Returns whether the receiver is subscribed here.
    fn deliver(
        self: &Arc<Self>,
        l: &mut Live,
        key: &DelegationKey,
        dir: Direction,
        seq: u64,
        frame: Bytes,
    ) -> bool {
        let slot = l.sub_mut(dir);
        let Some(sub) = slot.as_mut() else {
            return false;
        };
        if sub.replaying || seq <= sub.delivered {
            return true;
        }
        if seq == sub.delivered + 1 {
            match sub.outbox.push_data(frame) {
                Pushed::Queued => {
                    sub.delivered = seq;
                    self.metrics.hot.data_out.inc();
                    return true;
                }
                Pushed::Closed => {
                    *slot = None;
                    return false;
                }
                // The receiver's queue is full: it is fed from the log
                // instead, at its own pace (below).
                Pushed::Full => {}
            }
        }
        sub.replaying = true;
        let (generation, outbox, from) = (sub.generation, sub.outbox.clone(), sub.delivered);
        self.spawn_replay(key.clone(), dir, generation, outbox, from);
        true
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
            let (seq, wake) = {
                let mut l = lock(&live);
                if outcome.is_some() && l.terminal.is_some() {
                    return false;
                }
                (*l.tail_mut(dir) + 1, self.wake_for(&l, dir))
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
                wake: wake.clone(),
            };
            let started = Instant::now();
            let res = self.store.append(vec![req]).await;
            self.observe_store("append", started, res.is_ok());
            match res.ok().and_then(|v| v.into_iter().next()) {
                Some(AppendOutcome::Appended { seq }) => {
                    info!(%key, dir = dir.name(), seq, outcome = outcome.map(Outcome::name), reason, "relay appended");
                    self.appended(&live, key, dir, seq, bytes, outcome, wake.is_some());
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
    /// With a shared store only the holder of the sweeper lease does this
    /// fleet-wide work; every instance evicts its cache and checks the epoch.
    pub async fn sweep(self: &Arc<Self>) {
        if self.fleet.enabled {
            let held = self
                .store
                .acquire_lease(
                    crate::fleet::SWEEPER_LEASE,
                    &self.fleet.node,
                    self.fleet.sweeper_lease_ms,
                )
                .await;
            // A store error drops the lease here: another instance may hold
            // it by now, and the work is safe to skip a round.
            self.fleet.set_leader(held.unwrap_or(false));
        }
        self.metrics
            .sweeper_leader
            .set(i64::from(self.fleet.is_leader()));
        if self.fleet.is_leader() {
            self.sweep_fleet().await;
        }
        // Evict delegations nobody here reads: finished ones, and with a
        // shared store any (their receivers may have moved to another
        // instance; the store has them). A session holding an evicted view
        // sees the mark and looks the delegation up again.
        let shared = self.fleet.enabled;
        lock(&self.live).retain(|_, l| {
            let mut l = lock(l);
            let keep = l.subs.iter().any(Option::is_some) || (l.terminal.is_none() && !shared);
            if !keep {
                l.evicted = true;
            }
            keep
        });
        self.check_epoch().await;
    }

    async fn sweep_fleet(self: &Arc<Self>) {
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
        if !gone.is_empty() && self.fleet.enabled {
            // Fresh liveness before acting on anyone.
            if let Ok(nodes) = self
                .store
                .renew_node(&self.fleet.node, self.fleet.node_lease_ms)
                .await
            {
                self.live_nodes(nodes).await;
            }
        }
        for (peer, since) in gone {
            if self.fleet.enabled && self.online_elsewhere(&peer).await != Some(false) {
                // Held by a live instance (or unknown): not gone.
                let mut off = lock(&self.offline_since);
                if off.get(&peer) == Some(&since) {
                    off.remove(&peer);
                }
                continue;
            }
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
    }

    /// Records the live instances from a liveness renewal.
    async fn live_nodes(self: &Arc<Self>, nodes: Vec<String>) {
        self.metrics.fleet_nodes.set(nodes.len() as i64);
        let lost = self.fleet.set_live_nodes(nodes);
        if !lost.is_empty() {
            // A lost instance may have delivered entries only to sessions
            // that had already moved here: re-read every log served here.
            warn!(?lost, "relay instances stopped renewing; resynchronising");
            self.resync().await;
        }
    }

    /// Whether `peer`'s session is held by another live instance (`None`
    /// when the store could not say).
    async fn online_elsewhere(&self, peer: &PeerId) -> Option<bool> {
        let presence = self.store.presence(std::slice::from_ref(peer)).await.ok()?;
        Some(
            presence
                .into_iter()
                .next()
                .flatten()
                .is_some_and(|p| self.fleet.node_alive(&p.node)),
        )
    }

    /// The fleet's periodic upkeep (every third of the node lease): renews
    /// this instance's liveness, drops wake subscriptions no longer needed,
    /// and on the sweeper lease holder refreshes which peers are offline
    /// fleet-wide (the start of their grace period).
    pub async fn fleet_tick(self: &Arc<Self>) {
        match self
            .store
            .renew_node(&self.fleet.node, self.fleet.node_lease_ms)
            .await
        {
            Ok(nodes) => self.live_nodes(nodes).await,
            Err(e) => warn!(error = %e, "could not renew this instance's liveness"),
        }
        self.fleet.prune_subscriptions().await;
        if !self.fleet.is_leader() {
            return;
        }
        let peers: Vec<PeerId> = self.directory.peers.to_vec();
        let Ok(presence) = self.store.presence(&peers).await else {
            return;
        };
        let now = oab_wire::identity::now_ms();
        let mut off = lock(&self.offline_since);
        for (peer, p) in peers.into_iter().zip(presence) {
            let online =
                self.is_online(&peer) || p.as_ref().is_some_and(|p| self.fleet.node_alive(&p.node));
            if online {
                off.remove(&peer);
            } else {
                off.entry(peer).or_insert(now);
            }
        }
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
        let targets: Vec<PeerId> = self.directory.reachable_from(peer).into_iter().collect();
        let elsewhere: Vec<bool> = if self.fleet.enabled {
            match self.store.presence(&targets).await {
                Ok(p) => p
                    .iter()
                    .map(|p| p.as_ref().is_some_and(|p| self.fleet.node_alive(&p.node)))
                    .collect(),
                Err(_) => vec![false; targets.len()],
            }
        } else {
            vec![false; targets.len()]
        };
        let mut entries = Vec::new();
        for (target, elsewhere) in targets.into_iter().zip(elsewhere) {
            let descriptor = self
                .store
                .descriptor(&target)
                .await
                .ok()
                .flatten()
                .and_then(|b| serde_json::from_slice(&b).ok());
            entries.push(PeerEntry {
                online: elsewhere || self.is_online(&target),
                peer: target,
                descriptor,
            });
        }
        Bytes::from(serde_json::to_vec(&entries).unwrap_or_default())
    }

    /// Pushes a fresh `Peers` frame to every online peer that may reach
    /// `peer` (fleet-wide: through their wake channels).
    pub fn announce_presence(self: &Arc<Self>, peer: &PeerId) {
        let hub = self.clone();
        let peer = peer.clone();
        self.tasks.spawn(async move {
            if hub.fleet.enabled {
                let msg = Bytes::from(format!("P{peer}"));
                let messages = hub
                    .directory
                    .callers_of(&peer)
                    .into_iter()
                    .map(|c| (c, msg.clone()))
                    .collect::<Vec<_>>();
                if let Err(e) = hub.store.publish(messages).await {
                    warn!(error = %e, %peer, "could not announce presence");
                }
                return;
            }
            for caller in hub.directory.callers_of(&peer) {
                hub.push_peers(&caller).await;
            }
        });
    }

    /// Sends `peer` a fresh `Peers` frame if its session is here.
    async fn push_peers(&self, peer: &PeerId) {
        let session = lock(&self.sessions).get(peer).cloned();
        if let Some(s) = session {
            let payload = self.peers_payload(peer).await;
            if let Ok(bytes) = encode(&Frame::Peers(payload)) {
                s.outbox.push(bytes);
            }
        }
    }

    /// Handles a message from `peer`'s wake channel (see
    /// [`crate::store::fleet`] for the kinds). Malformed messages are logged
    /// and dropped: the channel is written only by relay instances.
    pub fn on_wake(self: &Arc<Self>, peer: PeerId, payload: Bytes) {
        let Some((&kind, _)) = payload.split_first() else {
            return;
        };
        debug!(%peer, kind = %char::from(kind), "wake-up");
        let body = payload.slice(1..);
        match kind {
            b'W' => {
                let limits = self.config.wire_limits();
                let (key, dir, seq, terminal) =
                    match oab_wire::decode_message(body.clone(), &limits) {
                        Ok(Frame::Open(o)) => (o.key, Direction::Down, 1, None),
                        Ok(Frame::Data(d)) => (d.key, d.direction, d.seq, d.terminal),
                        Ok(Frame::Cancel(c)) => (c.key, Direction::Down, c.seq, None),
                        _ => {
                            warn!(%peer, "undecodable wake-up entry dropped");
                            return;
                        }
                    };
                self.metrics.wakes.with_label_values(&["entry"]).inc();
                self.remote_appended(&peer, key, dir, seq, body, terminal);
            }
            b'N' => {
                let Some((key, dir, tail)) = parse_nudge(&body) else {
                    warn!(%peer, "malformed nudge dropped");
                    return;
                };
                self.metrics.wakes.with_label_values(&["nudge"]).inc();
                let live = lock(&self.live).get(&key).cloned();
                if let Some(live) = live {
                    self.nudged(&live, &key, dir, tail, None);
                }
            }
            b'T' => {
                let generation = std::str::from_utf8(&body)
                    .ok()
                    .and_then(|t| t.split('|').next())
                    .and_then(|g| g.parse::<u64>().ok());
                let Some(generation) = generation else {
                    warn!(%peer, "malformed claim dropped");
                    return;
                };
                self.metrics.wakes.with_label_values(&["claim"]).inc();
                if let Some(old) = self.fleet.announced(&peer, generation) {
                    let session = lock(&self.sessions).get(&peer).cloned();
                    if let Some(s) = session.filter(|s| s.id == old) {
                        self.metrics.replaced.inc();
                        info!(%peer, session = %s.id, "session replaced by a newer one on another instance");
                        s.outbox.close(
                            CloseCode::Replaced,
                            "a newer session of this peer replaced this one",
                        );
                    }
                }
            }
            b'P' => {
                self.metrics.wakes.with_label_values(&["presence"]).inc();
                let hub = self.clone();
                self.tasks.spawn(async move { hub.push_peers(&peer).await });
            }
            _ => warn!(%peer, kind, "unknown wake-up message dropped"),
        }
    }

    /// A durable entry appended by another instance (or echoed back).
    fn remote_appended(
        self: &Arc<Self>,
        peer: &PeerId,
        key: DelegationKey,
        dir: Direction,
        seq: u64,
        frame: Bytes,
        terminal: Option<Outcome>,
    ) {
        let cached = lock(&self.live).get(&key).cloned();
        let adopt = dir == Direction::Down && seq == 1 && self.is_online(peer);
        match cached {
            Some(live) if !adopt || lock(&live).subs[0].is_some() => {
                self.appended(&live, &key, dir, seq, frame, terminal, true);
            }
            // Nobody reads it here.
            None if !self.is_online(peer) => {}
            // The receiver is here but the view is not (yet): load it. A new
            // delegation for a callee held here gets it subscribed, as
            // `created` does on the caller's instance; an entry that beat
            // `created` to the caller's instance is kept in the loaded view,
            // which `created` then reuses.
            _ => {
                let hub = self.clone();
                self.tasks.spawn(async move {
                    if let Ok(Some(live)) = hub.live(&key).await {
                        if adopt {
                            hub.adopt(&live, &key, Some(frame), 1);
                        } else {
                            hub.appended(&live, &key, dir, seq, frame, terminal, true);
                        }
                    }
                });
            }
        }
    }

    /// Subscribes the callee's local session to a delegation's down log from
    /// the start, unless it is subscribed already; delivers `open` if given,
    /// else catches up to `tail` from the store.
    fn adopt(
        self: &Arc<Self>,
        live: &LiveRef,
        key: &DelegationKey,
        open: Option<Bytes>,
        tail: u64,
    ) {
        let mut l = lock(live);
        if l.subs[0].is_none() {
            let session = lock(&self.sessions).get(&l.callee).cloned();
            let Some(session) = session else {
                return;
            };
            l.subs[0] = Some(self.new_sub(key, Direction::Down, &session, 0, false));
        }
        match open {
            Some(frame) => {
                let _ = self.deliver(&mut l, key, Direction::Down, 1, frame);
            }
            None => {
                drop(l);
                self.nudged(live, key, Direction::Down, tail, None);
            }
        }
    }

    /// The log `dir` has entries up to `tail`: a live subscription behind it
    /// catches up from the store.
    pub(crate) fn nudged(
        self: &Arc<Self>,
        live: &LiveRef,
        key: &DelegationKey,
        dir: Direction,
        tail: u64,
        terminal: Option<Outcome>,
    ) {
        let mut l = lock(live);
        let t = l.tail_mut(dir);
        *t = (*t).max(tail);
        self.note_terminal(&mut l, terminal);
        if let Some(sub) = l.sub_mut(dir).as_mut()
            && !sub.replaying
            && sub.delivered < tail
        {
            sub.replaying = true;
            let (generation, outbox, from) = (sub.generation, sub.outbox.clone(), sub.delivered);
            self.spawn_replay(key.clone(), dir, generation, outbox, from);
        }
    }

    /// After wake-ups may have been missed (the subscriber reconnected or its
    /// queue overflowed): re-checks every log read here against the store,
    /// and subscribes local callees to delegations opened meanwhile.
    pub async fn resync(self: &Arc<Self>) {
        self.metrics.wakes.with_label_values(&["resync"]).inc();
        let lives: Vec<(DelegationKey, LiveRef)> = lock(&self.live)
            .iter()
            .map(|(k, l)| (k.clone(), l.clone()))
            .collect();
        for (key, live) in lives {
            if !lock(&live).subs.iter().any(Option::is_some) {
                continue;
            }
            if let Ok(Some(meta)) = self.store.meta(&key).await {
                for dir in [Direction::Down, Direction::Up] {
                    self.nudged(&live, &key, dir, meta.tail(dir), meta.terminal);
                }
            }
        }
        let sessions: Vec<PeerId> = lock(&self.sessions).keys().cloned().collect();
        for peer in sessions {
            let Ok(metas) = self.store.delegations_of(&peer).await else {
                continue;
            };
            for m in metas
                .iter()
                .filter(|m| m.callee == peer && m.terminal.is_none())
            {
                if let Ok(Some(live)) = self.live(&m.key).await {
                    self.adopt(&live, &m.key, None, m.down_tail);
                }
            }
        }
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

/// A nudge message: the log `dir` of `key` has entries up to `tail`.
fn nudge(key: &DelegationKey, dir: Direction, tail: u64) -> Bytes {
    let d = match dir {
        Direction::Down => 'd',
        Direction::Up => 'u',
    };
    Bytes::from(format!("N{d}|{tail}|{key}"))
}

/// Parses a nudge body (after the kind byte).
fn parse_nudge(body: &[u8]) -> Option<(DelegationKey, Direction, u64)> {
    let text = std::str::from_utf8(body).ok()?;
    let mut parts = text.splitn(3, '|');
    let dir = match parts.next()? {
        "d" => Direction::Down,
        "u" => Direction::Up,
        _ => return None,
    };
    let tail = parts.next()?.parse().ok()?;
    let (caller, rid) = parts.next()?.split_once('#')?;
    let key = DelegationKey::new(
        PeerId::new(caller).ok()?,
        oab_wire::RequestId::new(rid).ok()?,
    );
    Some((key, dir, tail))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nudges_round_trip_and_malformed_ones_are_refused() {
        let key = DelegationKey::new(
            PeerId::new("acme/caller").unwrap_or_else(|_| unreachable!()),
            oab_wire::RequestId::new("r-1").unwrap_or_else(|_| unreachable!()),
        );
        for (dir, tail) in [(Direction::Down, 0), (Direction::Up, u64::MAX)] {
            let msg = nudge(&key, dir, tail);
            assert_eq!(msg.first(), Some(&b'N'));
            assert_eq!(parse_nudge(&msg[1..]), Some((key.clone(), dir, tail)));
        }
        for bad in [
            &b""[..],
            b"x|1|acme/caller#r-1",
            b"d|-1|acme/caller#r-1",
            b"d|1|acme/caller",
            b"u|1|#r",
            b"d|1",
            b"\xff|1|a#b",
        ] {
            assert_eq!(parse_nudge(bad), None, "{bad:?}");
        }
    }
}
