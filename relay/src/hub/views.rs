//! The in-memory view of a delegation ([`DelegationView`]): a cache of the
//! store's meta (log tails, terminal) plus at most one receiver subscription
//! per direction, loaded from the store on first use and evicted by the
//! sweep when nobody here reads it, or when it is finished: a finished
//! delegation's view and its subscriptions go [`FINISHED_VIEW_GRACE`] after
//! the sweep first saw its terminal, even while its sessions live (late
//! frames, acks and resumes then look it up in the store again).
//!
//! Never decides what the store decides (appends are checked there; a view
//! may be stale when another instance appended). Never awaits while holding
//! a view's lock or the view map's. A subscription is only ever added to a
//! view that is not marked evicted, checked under the view's lock.

use parking_lot::Mutex;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use oab_wire::{DelegationKey, Direction, Outcome, PeerId, SessionId, TraceId};

use super::{Hub, SessionRef};
use crate::outbox::Outbox;
use crate::store::{DelegationMeta, EventStore};

/// How long a finished delegation's view stays cached with its
/// subscriptions after the sweep first saw its terminal. Everything after a
/// terminal (a resent terminal, its ack, a `Resume`, the relay's cancel
/// after expiry) is answered from the store once the view is gone; the
/// grace only spares a reload for the frames that follow a terminal at
/// once. A view whose receiver is still being replayed to stays until the
/// replay caught up (the replay ends with the session at the latest: a
/// receiver that takes nothing is closed as a slow consumer).
pub(crate) const FINISHED_VIEW_GRACE: Duration = Duration::from_secs(1);

/// A receiver's subscription to one log of a delegation: the session it
/// feeds and its cursor. Removed when the session ends or its queue closes,
/// when a newer subscription replaces it, when a gap ends the log for it, or
/// with its view [`FINISHED_VIEW_GRACE`] after the delegation finished.
#[derive(Debug)]
pub(super) struct Subscription {
    pub(super) session: SessionId,
    /// Unique per subscription: a replay task serves only its own generation,
    /// so a second `Resume` supersedes the first instead of racing it.
    pub(super) generation: u64,
    pub(super) outbox: Outbox,
    pub(super) delivered: u64,
    pub(super) replaying: bool,
    /// A newer `Resume` of the same session while its replay runs: the
    /// running replay restarts from here (one replay per log and session,
    /// so frames never interleave).
    pub(super) rewind: Option<u64>,
}

/// The in-memory view of one delegation (a cache of the store's meta plus
/// the receivers). Loaded lazily from the store.
#[derive(Debug)]
pub struct DelegationView {
    /// The caller.
    pub caller: PeerId,
    /// The callee.
    pub callee: PeerId,
    /// Largest payload the route allows.
    pub max_payload: u32,
    /// The caller's trace id, for log lines about this delegation.
    pub trace: Option<TraceId>,
    pub(super) tails: [u64; 2],
    pub(super) terminal: Option<Outcome>,
    pub(super) subs: [Option<Subscription>; 2],
    /// Dropped from the hub's cache: holders must look it up again.
    pub(super) evicted: bool,
    /// When the sweep first saw the terminal (the view is evicted
    /// [`FINISHED_VIEW_GRACE`] later).
    pub(super) finished_seen: Option<Instant>,
}

impl DelegationView {
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

    pub(super) fn tail_mut(&mut self, dir: Direction) -> &mut u64 {
        match dir {
            Direction::Down => &mut self.tails[0],
            Direction::Up => &mut self.tails[1],
        }
    }

    pub(super) fn sub_mut(&mut self, dir: Direction) -> &mut Option<Subscription> {
        match dir {
            Direction::Down => &mut self.subs[0],
            Direction::Up => &mut self.subs[1],
        }
    }
}

/// A shared handle to a delegation's view.
pub type ViewRef = Arc<Mutex<DelegationView>>;

impl<S: EventStore> Hub<S> {
    /// The view of a delegation, loading it from the store if needed.
    pub async fn view(
        &self,
        key: &DelegationKey,
    ) -> Result<Option<ViewRef>, crate::store::StoreError> {
        if let Some(l) = self.views.lock().get(key) {
            return Ok(Some(l.clone()));
        }
        let started = Instant::now();
        let meta = self.store.meta(key).await;
        self.observe_store("meta", started, &meta);
        let Some(meta) = meta? else {
            return Ok(None);
        };
        let fresh = Arc::new(Mutex::new(self.view_from_meta(&meta)));
        let mut views = self.views.lock();
        let live = views.entry(key.clone()).or_insert(fresh).clone();
        self.gauges.count_views(views.len());
        Ok(Some(live))
    }

    /// What this instance delivered of each log of a delegation (down, up)
    /// to a receiver session it holds, from the cached view; `None` for a
    /// log with no subscription here (or no cached view). Never loads.
    pub fn delivered_here(&self, key: &DelegationKey) -> [Option<u64>; 2] {
        let Some(live) = self.views.lock().get(key).cloned() else {
            return [None, None];
        };
        let l = live.lock();
        [
            l.subs[0].as_ref().map(|s| s.delivered),
            l.subs[1].as_ref().map(|s| s.delivered),
        ]
    }

    pub(super) fn view_from_meta(&self, meta: &DelegationMeta) -> DelegationView {
        let max_payload = self
            .live()
            .directory
            .route(&meta.key.caller, &meta.callee)
            .and_then(|r| r.max_payload)
            .unwrap_or(self.config.limits.max_payload);
        DelegationView {
            caller: meta.key.caller.clone(),
            callee: meta.callee.clone(),
            max_payload,
            trace: meta.trace,
            tails: [meta.down_tail, meta.up_tail],
            terminal: meta.terminal,
            subs: [None, None],
            evicted: false,
            finished_seen: None,
        }
    }

    pub(super) fn new_subscription(
        &self,
        key: &DelegationKey,
        dir: Direction,
        session: &SessionRef,
        delivered: u64,
        replaying: bool,
    ) -> Subscription {
        let added = self
            .session_subscriptions
            .lock()
            .entry(session.id)
            .or_default()
            .insert((key.clone(), dir));
        if added {
            self.gauges.subscriptions.inc();
        }
        Subscription {
            session: session.id,
            generation: self.generations.fetch_add(1, Ordering::Relaxed),
            outbox: session.outbox.clone(),
            delivered,
            replaying,
            rewind: None,
        }
    }

    pub(super) fn drop_subscription(&self, key: &DelegationKey, dir: Direction, generation: u64) {
        let live = self.views.lock().get(key).cloned();
        if let Some(live) = live {
            let mut l = live.lock();
            let slot = l.sub_mut(dir);
            if let Some(sub) = slot.take_if(|s| s.generation == generation) {
                self.forget_subscription(sub.session, key, dir);
            }
        }
    }

    /// Removes a subscription that left its view from the session's index.
    pub(super) fn forget_subscription(
        &self,
        session: SessionId,
        key: &DelegationKey,
        dir: Direction,
    ) {
        let mut index = self.session_subscriptions.lock();
        if let Some(logs) = index.get_mut(&session) {
            if logs.remove(&(key.clone(), dir)) {
                self.gauges.subscriptions.dec();
            }
            if logs.is_empty() {
                index.remove(&session);
            }
        }
    }

    /// Evicts the views of delegations nobody here reads: finished ones
    /// without a subscription, finished ones [`FINISHED_VIEW_GRACE`] after
    /// the sweep first saw the terminal (with their subscriptions, unless a
    /// replay still feeds one), and with a shared store any unsubscribed one
    /// (their receivers may have moved to another instance; the store has
    /// them). Each is marked under its own lock: a session holding an
    /// evicted view sees the mark and looks the delegation up again, and
    /// nothing subscribes to a marked view.
    pub(super) fn evict_unread(&self) {
        let shared = self.fleet.enabled;
        let now = Instant::now();
        let mut dropped: Vec<(SessionId, DelegationKey, Direction)> = Vec::new();
        let cached = {
            let mut views = self.views.lock();
            views.retain(|key, l| {
                let mut l = l.lock();
                let subscribed = l.subs.iter().any(Option::is_some);
                let keep = if l.terminal.is_some() {
                    let seen = *l.finished_seen.get_or_insert(now);
                    let replaying = l.subs.iter().flatten().any(|s| s.replaying);
                    replaying || (subscribed && now.duration_since(seen) < FINISHED_VIEW_GRACE)
                } else {
                    subscribed || !shared
                };
                if !keep {
                    l.evicted = true;
                    for dir in [Direction::Down, Direction::Up] {
                        if let Some(sub) = l.sub_mut(dir).take() {
                            dropped.push((sub.session, key.clone(), dir));
                        }
                    }
                }
                keep
            });
            views.len()
        };
        self.gauges.count_views(cached);
        for (session, key, dir) in dropped {
            self.forget_subscription(session, &key, dir);
        }
    }
}
