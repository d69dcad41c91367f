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
//! | `registry` | sessions online here, (un)registering, presence claims, offline times |
//! | `views` | [`DelegationView`]: loading, subscriptions, eviction |
//! | `party` | looking a delegation up for a peer: other pairs' delegations cost what missing ones cost |
//! | `delivery` | live delivery, subscribe and replay from a cursor, gaps, lost entries |
//! | `lifecycle` | created/reopened, terminals, relay-originated appends, the sweep |
//! | `caps` | open-delegation counts per caller and per route |
//! | `wakeups` | wake-ups between instances, nudges, catch-up, resync, live instances |
//! | `peers` | `Peers` payloads and presence announcements |
//! | `reconfigure` | installing a reloaded configuration: closing revoked sessions |
//! | `epoch` | the store epoch: a store that lost its data |
//!
//! **Locks.** Every lock here is a `parking_lot` mutex held for a few statements,
//! never across an await. The order is: the view map before a view; a view
//! before the session table, the subscription index or the counts; the
//! offline times before the session table.

use arc_swap::ArcSwap;
use parking_lot::Mutex;
use std::collections::{HashMap, HashSet};
use std::num::NonZeroU32;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Instant;

use oab_wire::{DelegationKey, Direction, InstanceId, KeyId, PeerId, SessionId};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::Config;
use crate::fleet::Fleet;
use crate::live::LiveConfig;
use crate::metrics::Metrics;
use crate::outbox::Outbox;
use crate::store::EventStore;

mod caps;
mod delivery;
mod epoch;
mod lifecycle;
mod party;
mod peers;
mod reconfigure;
mod registry;
mod releases;
#[cfg(test)]
mod test_support;
mod views;
mod wakeups;

pub use crate::metrics::ResyncCause;
pub use caps::InFlightOpens;
use caps::OpenCounts;
pub use delivery::Subscribed;
pub use peers::{PEERS_REQUEST_COST, RESUME_COST};
pub use releases::{DEFAULT_RELEASE_QUEUE, RELEASE_BATCH};
pub use views::{DelegationView, ViewRef};

/// A live session as the hub sees it.
#[derive(Debug, Clone)]
pub struct SessionRef {
    /// Session id.
    pub id: SessionId,
    /// Authenticated peer.
    pub peer: PeerId,
    /// The peer's process instance.
    pub instance: InstanceId,
    /// The key the session authenticated with (a reload that retires it
    /// closes the session).
    pub key_id: KeyId,
    /// When it was authenticated (ms since the Unix epoch; `/status`).
    pub since_ms: u64,
    /// The connector's clock in its signed `Hello` (ms since the Unix
    /// epoch): which of two connections of one connector process is the
    /// later one.
    pub hello_ms: u64,
    /// Its queue.
    pub outbox: Outbox,
}

/// The result of a store operation, as [`Hub::observe_store`] records it.
pub trait StoreResult {
    /// Whether it succeeded.
    fn is_ok(&self) -> bool;
    /// Its error, when there is one to show.
    fn error(&self) -> Option<&crate::store::StoreError>;
}

impl StoreResult for bool {
    fn is_ok(&self) -> bool {
        *self
    }
    fn error(&self) -> Option<&crate::store::StoreError> {
        None
    }
}

impl<T> StoreResult for &Result<T, crate::store::StoreError> {
    fn is_ok(&self) -> bool {
        Result::is_ok(self)
    }
    fn error(&self) -> Option<&crate::store::StoreError> {
        self.as_ref().err()
    }
}

/// The store's last failure as this instance saw it (`/status`): replaced
/// by each failure, never cleared (the time says how old it is).
#[derive(Debug, Default)]
pub struct StoreHealth {
    last_error: Mutex<Option<StoreFailure>>,
}

/// One failed store operation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreFailure {
    /// When (ms since the Unix epoch).
    pub at_ms: u64,
    /// The operation (`append`, `read`, `ping`, ...).
    pub op: String,
    /// The error (URLs in it are without credentials), or `failed` when
    /// the caller recorded none.
    pub error: String,
}

impl StoreHealth {
    /// Records a failure of `op`.
    pub fn failed(&self, op: &str, error: Option<&crate::store::StoreError>) {
        *self.last_error.lock() = Some(StoreFailure {
            at_ms: oab_wire::identity::now_ms(),
            op: op.to_string(),
            error: error.map_or_else(|| "failed".to_string(), ToString::to_string),
        });
    }

    /// The last failure, if any.
    pub fn last_error(&self) -> Option<StoreFailure> {
        self.last_error.lock().clone()
    }
}

/// How many refusals [`RecentRefusals`] keeps: the latest, for `/status`.
pub const RECENT_REFUSALS: usize = 32;

/// The latest refusals sent to peers here (`/status` and its page): a ring
/// of [`RECENT_REFUSALS`], oldest dropped first.
#[derive(Debug, Default)]
pub struct RecentRefusals {
    ring: Mutex<std::collections::VecDeque<RefusalRecord>>,
}

/// One refusal sent to a peer.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RefusalRecord {
    /// When (ms since the Unix epoch).
    pub at_ms: u64,
    /// The peer refused.
    pub peer: String,
    /// The error code's name (`no_route`, `rate_limited`, ...).
    pub code: String,
    /// The text sent with it.
    pub message: String,
    /// The delegation it was about (`caller#request_id`), if any.
    pub key: Option<String>,
    /// The log (`down`, `up`) and sequence it was about.
    pub dir: String,
    /// The sequence.
    pub seq: u64,
}

impl RecentRefusals {
    fn record(&self, r: RefusalRecord) {
        let mut ring = self.ring.lock();
        if ring.len() == RECENT_REFUSALS {
            ring.pop_front();
        }
        ring.push_back(r);
    }

    /// The refusals kept, newest first.
    pub fn latest(&self) -> Vec<RefusalRecord> {
        self.ring.lock().iter().rev().cloned().collect()
    }
}

/// The shared relay state.
#[derive(Debug)]
pub struct Hub<S> {
    /// The durable store.
    pub store: Arc<S>,
    /// The configuration the relay started with. Read from it only the
    /// fields a reload does not apply (`reload::RELOADABLE` lists the
    /// others): they stay as started. Peers, routes, keys and the reloadable
    /// limits are in [`Hub::live`].
    pub config: Arc<Config>,
    /// The configuration in force, swapped whole by a reload; read once per
    /// handshake, open or request, never per frame.
    live: ArcSwap<LiveConfig>,
    /// Metrics.
    pub metrics: Metrics,
    /// Tracks spawned replay and sweep tasks.
    pub tasks: TaskTracker,
    /// Cancelled on shutdown.
    pub shutdown: CancellationToken,
    /// Presence, wake-ups and leases shared with other instances.
    pub fleet: Arc<Fleet>,
    /// The store's last failure (`/status`).
    pub store_health: StoreHealth,
    /// The latest refusals sent here (`/status`).
    pub refusals: RecentRefusals,
    /// The session of each peer online here (at most one per configured
    /// peer); an entry is removed when that session unregisters.
    sessions: Mutex<HashMap<PeerId, SessionRef>>,
    /// The cached view of each delegation looked up here; pruned by the
    /// sweep (views nobody here reads, and finished ones
    /// `views::FINISHED_VIEW_GRACE` after their terminal, subscribed or
    /// not) and emptied when the store epoch changes.
    views: Mutex<HashMap<DelegationKey, ViewRef>>,
    /// Open-delegation counts, keyed by configured callers and routes; a
    /// caller's entries are reset at each of its handshakes.
    open_counts: Mutex<OpenCounts>,
    /// Since when each configured peer has been offline (ms); an entry is
    /// removed when the peer registers here, when the sweep finds it online
    /// elsewhere or has ended its lost work, and when the fleet upkeep sees
    /// it online.
    offline_since: Mutex<HashMap<PeerId, u64>>,
    /// The logs each session subscribed to, so its subscriptions can be
    /// dropped when it ends; a log is removed when its subscription leaves
    /// the view (gap, closed queue, the finished view evicted), and the
    /// session's entry when it has none left or the session unregisters.
    session_subscriptions: Mutex<HashMap<SessionId, HashSet<(DelegationKey, Direction)>>>,
    /// The next subscription generation.
    generations: std::sync::atomic::AtomicU64,
    /// The store epoch last seen.
    epoch: std::sync::atomic::AtomicU64,
    /// The store epoch changed since start: missing delegations were lost.
    epoch_changed: AtomicBool,
    /// The sizes of the hub's per-delegation state, updated at each sweep.
    gauges: HubGauges,
    /// The `Peers` snapshots owed to each peer's session here (at most one
    /// waiting in its queue); one entry per configured peer that ever got
    /// one, so bounded by the directory.
    peers_pushes: Mutex<HashMap<PeerId, peers::PeersPush>>,
    /// Callers' releases waiting for the store (bounded by
    /// `store.release_queue`).
    releases: releases::Releases,
}

/// Gauges of what the hub keeps per delegation (`/metrics`), kept up to
/// date as it changes, so an operator (and a test) can see it return to its
/// baseline when delegations finish.
#[derive(Debug)]
struct HubGauges {
    /// `oab_hub_views`: delegation views cached here (set from the view
    /// map's size whenever it changes).
    views: prometheus::IntGauge,
    /// `oab_hub_subscriptions`: the logs in the subscription index
    /// (`session_subscriptions`), counted as they enter and leave it.
    subscriptions: prometheus::IntGauge,
}

impl HubGauges {
    fn count_views(&self, cached: usize) {
        self.views.set(i64::try_from(cached).unwrap_or(i64::MAX));
    }

    // Metric names are compile-time constants, so creation can only fail on
    // a programming error (as in `metrics.rs`).
    #[allow(clippy::expect_used)]
    fn new(metrics: &Metrics) -> Self {
        let gauge = |name: &str, help: &str| {
            let g = prometheus::IntGauge::new(name, help).expect("valid metric");
            // A registry that already has the name (a second hub over one
            // `Metrics`) keeps the first.
            let _ = metrics.registry.register(Box::new(g.clone()));
            g
        };
        HubGauges {
            views: gauge("oab_hub_views", "Delegation views cached by the hub."),
            subscriptions: gauge(
                "oab_hub_subscriptions",
                "Receiver subscriptions of the sessions on this instance.",
            ),
        }
    }
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
        let live = LiveConfig::first(config.clone(), None);
        let now = oab_wire::identity::now_ms();
        // Every configured peer counts as offline since the relay started, so
        // a callee that never comes back still ends `unknown` after the grace.
        let offline = live
            .directory
            .peers
            .iter()
            .map(|p| (p.clone(), now))
            .collect();
        let fleet = Arc::new(Fleet::new(&config, store.wake_urls()));
        Arc::new(Hub {
            gauges: HubGauges::new(&metrics),
            peers_pushes: Mutex::new(HashMap::new()),
            fleet,
            store_health: StoreHealth::default(),
            refusals: RecentRefusals::default(),
            store,
            config,
            live: ArcSwap::from_pointee(live),
            metrics,
            tasks: TaskTracker::new(),
            shutdown,
            sessions: Mutex::new(HashMap::new()),
            views: Mutex::new(HashMap::new()),
            open_counts: Mutex::new(OpenCounts::default()),
            offline_since: Mutex::new(offline),
            session_subscriptions: Mutex::new(HashMap::new()),
            generations: std::sync::atomic::AtomicU64::new(1),
            epoch: std::sync::atomic::AtomicU64::new(epoch),
            epoch_changed: AtomicBool::new(false),
            releases: releases::Releases::default(),
        })
    }

    /// Charges `cost` units of `peer`'s request meter. `false`: the peer is
    /// over `rate.peer_requests_per_second` and the request is refused with
    /// `rate_limited` (counted in `oab_rate_limited_total{scope="request"}`).
    /// The meter (`Limiters::requests`) is keyed by authenticated peers
    /// only, so it holds at most one cell per configured peer.
    pub fn meter_request(&self, peer: &PeerId, cost: u32) -> bool {
        let live = self.live.load();
        let allowed = NonZeroU32::new(cost)
            .is_none_or(|n| matches!(live.limiters.requests.check_key_n(peer, n), Ok(Ok(()))));
        if !allowed {
            self.metrics
                .rate_limited
                .with_label_values(&["request"])
                .inc();
        }
        allowed
    }

    /// Records a store operation's latency and result: `ok` is a `bool`,
    /// or the operation's `&Result`, whose error `/status` then shows as the
    /// store's last error.
    pub fn observe_store(&self, op: &str, started: Instant, ok: impl StoreResult) {
        self.metrics
            .store_latency
            .with_label_values(&[op])
            .observe(started.elapsed().as_secs_f64());
        if !ok.is_ok() {
            self.metrics.store_errors.with_label_values(&[op]).inc();
            self.store_health.failed(op, ok.error());
        }
    }
}
