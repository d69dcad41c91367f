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
//!
//! This module owns the [`Hub`] itself (its state and constructor) and the
//! types shared by its parts; each part adds its own `impl Hub` block:
//!
//! | module | owns |
//! |---|---|
//! | `registry` | sessions online here, register/unregister, the fleet-wide presence claim, offline times |
//! | `views` | the cached view of a delegation: loading from the store, subscriptions, eviction |
//! | `delivery` | live delivery of appends, subscribe and replay from a cursor, gaps, store-lost entries |
//! | `lifecycle` | created/reopened delegations, terminals, relay-originated appends, the sweep, lost callees |
//! | `caps` | open-delegation counts per caller and per route |
//! | `wakeups` | wake-ups between instances: targets, nudges, callees subscribed from a wake-up, resync, live instances |
//! | `peers` | `Peers` payloads and presence announcements |
//! | `epoch` | the store epoch: a store that lost its data |
//!
//! **Locks.** Every lock here is a `std` mutex held for a few statements,
//! never across an await. The order is: the view map before a view; a view
//! before the session table, the subscription index or the counts; the
//! offline times before the session table.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use oab_wire::{DelegationKey, Direction, InstanceId, PeerId, SessionId};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::{Config, Directory};
use crate::fleet::Fleet;
use crate::metrics::Metrics;
use crate::outbox::Outbox;
use crate::store::EventStore;

mod caps;
mod delivery;
mod epoch;
mod lifecycle;
mod peers;
mod registry;
#[cfg(test)]
mod test_support;
mod views;
mod wakeups;

use caps::Counts;
pub use delivery::Subscribed;
pub use views::{Live, LiveRef};
pub use wakeups::ResyncCause;

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

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Critical sections hold no await and no fallible step that could leave
    // state half-updated, so a poisoned lock is still consistent.
    m.lock().unwrap_or_else(|p| p.into_inner())
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
}
