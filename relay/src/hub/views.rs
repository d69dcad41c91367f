//! The in-memory view of a delegation ([`DelegationView`]): a cache of the
//! store's meta (log tails, terminal) plus at most one receiver subscription
//! per direction, loaded from the store on first use and evicted by the
//! sweep when nobody here reads it.
//!
//! Never decides what the store decides (appends are checked there; a view
//! may be stale when another instance appended). Never awaits while holding
//! a view's lock or the view map's. A subscription is only ever added to a
//! view that is not marked evicted, checked under the view's lock.

use parking_lot::Mutex;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use oab_wire::{DelegationKey, Direction, Outcome, PeerId, SessionId};

use super::{Hub, SessionRef};
use crate::outbox::Outbox;
use crate::store::{DelegationMeta, EventStore};

/// A receiver's subscription to one log of a delegation: the session it
/// feeds and its cursor. Removed when the session ends or its queue closes,
/// when a newer subscription replaces it, or when a gap ends the log for it.
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
    pub(super) tails: [u64; 2],
    pub(super) terminal: Option<Outcome>,
    pub(super) subs: [Option<Subscription>; 2],
    /// Dropped from the hub's cache: holders must look it up again.
    pub(super) evicted: bool,
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
        self.observe_store("meta", started, meta.is_ok());
        let Some(meta) = meta? else {
            return Ok(None);
        };
        let fresh = Arc::new(Mutex::new(self.view_from_meta(&meta)));
        Ok(Some(
            self.views
                .lock()
                .entry(key.clone())
                .or_insert(fresh)
                .clone(),
        ))
    }

    pub(super) fn view_from_meta(&self, meta: &DelegationMeta) -> DelegationView {
        let max_payload = self
            .directory
            .route(&meta.key.caller, &meta.callee)
            .and_then(|r| r.max_payload)
            .unwrap_or(self.config.limits.max_payload);
        DelegationView {
            caller: meta.key.caller.clone(),
            callee: meta.callee.clone(),
            max_payload,
            tails: [meta.down_tail, meta.up_tail],
            terminal: meta.terminal,
            subs: [None, None],
            evicted: false,
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
        self.session_subscriptions
            .lock()
            .entry(session.id)
            .or_default()
            .insert((key.clone(), dir));
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
            if slot.as_ref().is_some_and(|s| s.generation == generation) {
                *slot = None;
            }
        }
    }

    /// Evicts the views of delegations nobody here reads: finished ones, and
    /// with a shared store any (their receivers may have moved to another
    /// instance; the store has them). Each is marked under its own lock: a
    /// session holding an evicted view sees the mark and looks the delegation
    /// up again, and nothing subscribes to a marked view.
    pub(super) fn evict_unread(&self) {
        let shared = self.fleet.enabled;
        self.views.lock().retain(|_, l| {
            let mut l = l.lock();
            let keep = l.subs.iter().any(Option::is_some) || (l.terminal.is_none() && !shared);
            if !keep {
                l.evicted = true;
            }
            keep
        });
    }
}
