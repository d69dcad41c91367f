//! Several relay instances over one shared store: presence, wake-up
//! subscriptions, instance liveness and the sweeper lease.
//!
//! With a store that is not shared (the memory store) the fleet is
//! *disabled* and everything here is a no-op: one instance, as before.
//!
//! With Redis, every instance:
//!
//! - subscribes to the wake channel of each peer whose session it holds
//!   (before that session's `Welcome`), over one RESP3 connection of its own;
//!   a lost connection is re-established (seed URLs in turn, with backoff),
//!   every channel subscribed again, and every subscribed log re-checked
//!   against the store (a message published while the connection was down is
//!   never needed: the resynchronisation reads what it would have said);
//! - claims the peer's presence record (the claim's generation orders
//!   sessions fleet-wide: the newest wins, an older one anywhere is closed
//!   with `replaced`); a claim is above every generation this instance saw
//!   for the peer and above the store's clock, so a store that lost its data
//!   cannot hand out a generation that loses to one from before the loss;
//! - renews its liveness in `oab:nodes` every third of `node_lease_ms`,
//!   under its name and its *incarnation* (random per process start); a
//!   presence record naming a node that stopped renewing, or an earlier
//!   incarnation of it, counts as offline. An instance that stops renewing,
//!   comes back as a new incarnation (a restart within the lease), or leaves
//!   cleanly is a [`Departure`]: the others resynchronise from the store;
//! - competes for the sweeper lease; the holder runs the fleet-wide lifecycle
//!   work (deadlines, `unknown` after the grace period, retention).
//!
//! Never: touches a delegation's log, view or payload: it knows peers,
//! sessions, claim generations and instances only, and the hub acts on what it
//! reports. Never blocks the Redis client's reader: a wake message that finds
//! its link's queue full is dropped and the link flagged
//! (`Fleet::take_overflow`), and the wake loop then resynchronises from the
//! store.

use parking_lot::Mutex;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use oab_wire::{PeerId, SessionId};
use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, IntoConnectionInfo, ProtocolVersion, PushInfo};
use tokio::sync::mpsc;
use tracing::{debug, info, warn};

use crate::config::Config;
use crate::store::redis::RedactedUrl;
use crate::store::{Liveness, StoreError, wake_channel};

/// The name of the fleet-wide sweeper lease.
pub const SWEEPER_LEASE: &str = "sweeper";
/// Longest wait between two attempts to reach the wake subscriber's Redis.
const MAX_RECONNECT_DELAY: Duration = Duration::from_secs(2);
/// How long a subscribe (or a connection attempt) may take.
const SUBSCRIBE_TIMEOUT: Duration = Duration::from_secs(5);

/// How a relay instance left the fleet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DepartureKind {
    /// It stopped renewing its liveness (a crash, a hang, a lost network).
    Lapsed,
    /// A new process renews under its name: the old one died (a crash and
    /// a restart within the lease).
    Restarted,
    /// It shut down cleanly (SIGTERM: drained, then left).
    Left,
}

/// A relay instance (one process of it) that left the fleet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Departure {
    /// Its name.
    pub node: String,
    /// The incarnation that left.
    pub incarnation: String,
    /// How.
    pub kind: DepartureKind,
}

/// One wake subscriber connection and its store URL (shown redacted).
#[derive(Debug)]
struct Link {
    url: RedactedUrl,
    /// `None` while it is (re)connecting.
    conn: Mutex<Option<MultiplexedConnection>>,
    /// Messages were dropped on a full queue since the last check.
    overflowed: Arc<AtomicBool>,
}

/// This instance's view of the fleet.
#[derive(Debug)]
pub struct Fleet {
    /// This instance's name.
    pub node: String,
    /// This process's incarnation: random per start, so that a restart under
    /// the same name reads as the loss of the previous process.
    pub incarnation: String,
    /// Whether the store is shared (fleet coordination runs).
    pub enabled: bool,
    /// Liveness lease, ms.
    pub node_lease_ms: u64,
    /// Sweeper lease, ms.
    pub sweeper_lease_ms: u64,
    wake_queue: usize,
    /// One subscriber connection per store URL (every master of a Redis
    /// Cluster), so a wake-up is taken from the node whose script published
    /// it, never after a hop over the cluster bus.
    links: Vec<Link>,
    /// Subscriber connections up now (subscribes wait for one).
    connected: tokio::sync::watch::Sender<usize>,
    /// Wake channels subscribed (peers held now or recently).
    subscribed: tokio::sync::Mutex<HashSet<PeerId>>,
    /// Peers whose session this instance holds: session and claim generation.
    held: Mutex<HashMap<PeerId, (SessionId, u64)>>,
    /// Highest claim generation announced per peer (from `T` messages).
    /// At most one entry per configured peer: only their wake channels are
    /// subscribed. Entries are never pruned; the next claim of the peer on
    /// this instance takes its value as the floor (see [`Fleet::floor`]).
    latest: Mutex<HashMap<PeerId, u64>>,
    /// Live instances by name, with their incarnation (`""`: not recorded),
    /// as of the last liveness renewal; replaced whole by each renewal.
    live_nodes: Mutex<HashMap<String, String>>,
    multi: AtomicBool,
    leader: AtomicBool,
}

impl Fleet {
    /// The fleet for `config`; `urls` are the store's wake URLs (empty: not
    /// shared, fleet disabled).
    pub fn new(config: &Config, urls: Vec<String>) -> Fleet {
        let node = config.fleet.node.clone().unwrap_or_else(|| {
            let id = SessionId::random().to_string();
            format!("relay-{}", id.get(..12).unwrap_or(&id))
        });
        let incarnation = {
            let id = SessionId::random().to_string();
            id.get(..16).unwrap_or(&id).to_owned()
        };
        Fleet {
            enabled: !urls.is_empty(),
            live_nodes: Mutex::new(HashMap::from([(node.clone(), incarnation.clone())])),
            node,
            incarnation,
            node_lease_ms: config.fleet.node_lease_ms,
            sweeper_lease_ms: config.fleet.sweeper_lease_ms,
            wake_queue: config.fleet.wake_queue,
            links: urls
                .into_iter()
                .map(|url| Link {
                    url: RedactedUrl(url),
                    conn: Mutex::new(None),
                    overflowed: Arc::new(AtomicBool::new(false)),
                })
                .collect(),
            connected: tokio::sync::watch::Sender::new(0),
            subscribed: tokio::sync::Mutex::new(HashSet::new()),
            held: Mutex::new(HashMap::new()),
            latest: Mutex::new(HashMap::new()),
            multi: AtomicBool::new(false),
            leader: AtomicBool::new(false),
        }
    }

    /// Whether other live instances share the store.
    pub fn multi(&self) -> bool {
        self.multi.load(Ordering::Relaxed)
    }

    /// Whether this instance holds the sweeper lease (always, when disabled).
    pub fn is_leader(&self) -> bool {
        !self.enabled || self.leader.load(Ordering::Relaxed)
    }

    /// Records the sweeper lease state.
    pub fn set_leader(&self, leader: bool) {
        let was = self.leader.swap(leader, Ordering::Relaxed);
        if was != leader {
            info!(node = %self.node, leader, "sweeper lease {}", if leader { "taken" } else { "lost" });
        }
    }

    /// Records the live nodes from a liveness renewal. Returns the instance
    /// processes that were live before and are not any more: lapsed,
    /// replaced by a new incarnation of the same name, or left cleanly.
    pub fn set_live_nodes(&self, view: Liveness) -> Vec<Departure> {
        let mut now: HashMap<String, String> = view.live.into_iter().collect();
        now.insert(self.node.clone(), self.incarnation.clone());
        let multi = now.len() > 1;
        let mut live = self.live_nodes.lock();
        let mut gone = Vec::new();
        for (node, incarnation) in live.iter() {
            if *node == self.node {
                continue;
            }
            let kind = match now.get(node) {
                // Same process; or one of them records no incarnation (an
                // older relay version), so only its name can be compared.
                Some(inc) if inc == incarnation || inc.is_empty() || incarnation.is_empty() => {
                    continue;
                }
                Some(_) => DepartureKind::Restarted,
                None => DepartureKind::Lapsed,
            };
            let left = view.left.iter().any(|(n, i)| n == node && i == incarnation);
            gone.push(Departure {
                node: node.clone(),
                incarnation: incarnation.clone(),
                kind: if left { DepartureKind::Left } else { kind },
            });
        }
        let resized = now.len() != live.len();
        if self.multi.swap(multi, Ordering::Relaxed) != multi || resized {
            info!(nodes = now.len(), "fleet size changed");
        }
        *live = now;
        gone
    }

    /// The live instances (this one included), as last seen: name and
    /// incarnation (`""`: not recorded), sorted by name.
    pub fn live_nodes(&self) -> Vec<(String, String)> {
        let mut nodes: Vec<(String, String)> = self
            .live_nodes
            .lock()
            .iter()
            .map(|(n, i)| (n.clone(), i.clone()))
            .collect();
        nodes.sort();
        nodes
    }

    /// Wake subscriber connections up now, of [`Fleet::links`].
    pub fn links_connected(&self) -> usize {
        *self.connected.borrow()
    }

    /// How many instances are live (this one included), as last seen.
    pub fn live_count(&self) -> usize {
        self.live_nodes.lock().len()
    }

    /// Whether the process `incarnation` of `node` renewed its liveness
    /// lately (`""`: any process of that name, for records that do not name
    /// one).
    pub fn node_alive(&self, node: &str, incarnation: &str) -> bool {
        if node == self.node {
            return incarnation.is_empty() || incarnation == self.incarnation;
        }
        self.live_nodes
            .lock()
            .get(node)
            .is_some_and(|live| incarnation.is_empty() || live.is_empty() || live == incarnation)
    }

    /// Subscribes to `peer`'s wake channel for its new `session`; returns
    /// once Redis confirmed it. The peer counts as held from here on (until
    /// [`Fleet::release`]), so a concurrent prune keeps the channel.
    /// While the subscriber is reconnecting (a Redis restart, say) this
    /// waits for it, up to a bound, instead of failing at once.
    ///
    /// Subscribed on every connected link; one confirmation is enough (any
    /// node of a cluster receives every message, the others only sooner).
    pub async fn subscribe(&self, peer: &PeerId, session: SessionId) -> Result<(), StoreError> {
        // Claimed by nobody yet: no announcement can supersede it until
        // `hold` records the claim's generation.
        self.held.lock().insert(peer.clone(), (session, u64::MAX));
        let mut up = self.connected.subscribe();
        if tokio::time::timeout(SUBSCRIBE_TIMEOUT, up.wait_for(|c| *c > 0))
            .await
            .is_err()
        {
            return Err(StoreError::unavailable(
                "redis SUBSCRIBE",
                "wake subscriber not connected",
            ));
        }
        let mut subscribed = self.subscribed.lock().await;
        subscribed.insert(peer.clone());
        let conns: Vec<MultiplexedConnection> = self
            .links
            .iter()
            .filter_map(|l| l.conn.lock().clone())
            .collect();
        let channel = wake_channel(peer);
        let results = futures_util::future::join_all(conns.into_iter().map(|mut c| {
            let channel = channel.clone();
            async move { tokio::time::timeout(SUBSCRIBE_TIMEOUT, c.subscribe(channel)).await }
        }))
        .await;
        let mut cause = "wake subscriber not connected".to_owned();
        let mut confirmed = false;
        for r in results {
            match r {
                Ok(Ok(())) => confirmed = true,
                Ok(Err(e)) => cause = e.to_string(),
                Err(_) => cause = "timed out".into(),
            }
        }
        debug!(%peer, confirmed, links = self.links.len(), "subscribed");
        if confirmed {
            Ok(())
        } else {
            Err(StoreError::unavailable("redis SUBSCRIBE", cause))
        }
    }

    /// Unsubscribes channels of peers no longer held here.
    pub async fn prune_subscriptions(&self) {
        let mut subscribed = self.subscribed.lock().await;
        let stale: Vec<PeerId> = {
            let held = self.held.lock();
            subscribed
                .iter()
                .filter(|p| !held.contains_key(*p))
                .cloned()
                .collect()
        };
        if stale.is_empty() {
            return;
        }
        let channels: Vec<String> = stale.iter().map(wake_channel).collect();
        for link in &self.links {
            let conn = link.conn.lock().clone();
            if let Some(mut conn) = conn {
                // A link that fails here is reconnecting, and subscribes
                // only what is held when it is back.
                let _ = conn.unsubscribe(channels.clone()).await;
            }
        }
        for p in stale {
            subscribed.remove(&p);
        }
    }

    /// Records that this instance holds `peer`'s `session` with claim
    /// `generation`. `false` if a newer claim was already announced (this
    /// session lost the race and must close).
    pub fn hold(&self, peer: &PeerId, session: SessionId, generation: u64) -> bool {
        self.held.lock().insert(peer.clone(), (session, generation));
        self.latest
            .lock()
            .get(peer)
            .is_none_or(|&g| g <= generation)
    }

    /// The highest generation this instance has seen for `peer` (announced,
    /// or held here): a new claim of the peer from here must be above it,
    /// whatever the store remembers. A store that lost its data restarts the
    /// peer's record empty; without this floor, an instance that saw
    /// generation `n` before the loss would take every new session of the
    /// peer for an older one until the store's generation got past `n`.
    pub fn floor(&self, peer: &PeerId) -> u64 {
        let announced = self.latest.lock().get(peer).copied().unwrap_or(0);
        // `u64::MAX` marks a session not claimed yet, not a generation.
        let held = self
            .held
            .lock()
            .get(peer)
            .map(|&(_, g)| g)
            .filter(|&g| g != u64::MAX)
            .unwrap_or(0);
        announced.max(held)
    }

    /// Forgets `peer` if `session` is the one held. Returns whether it was.
    pub fn release(&self, peer: &PeerId, session: SessionId) -> bool {
        let mut held = self.held.lock();
        if held.get(peer).is_some_and(|(s, _)| *s == session) {
            held.remove(peer);
            true
        } else {
            false
        }
    }

    /// A claim was announced for `peer`: returns the session held here that
    /// it supersedes, if any.
    pub fn announced(&self, peer: &PeerId, generation: u64) -> Option<SessionId> {
        {
            let mut latest = self.latest.lock();
            let g = latest.entry(peer.clone()).or_insert(0);
            *g = (*g).max(generation);
        }
        let held = self.held.lock();
        match held.get(peer) {
            Some((session, g)) if *g < generation => Some(*session),
            _ => None,
        }
    }

    /// How many subscriber links there are (one per store URL).
    pub fn links(&self) -> usize {
        self.links.len()
    }

    /// Connects subscriber link `i` to its URL, with backoff until `stop`,
    /// and subscribes every held channel on it. Returns the connection's
    /// message receiver.
    pub async fn connect(
        &self,
        i: usize,
        stop: &tokio_util::sync::CancellationToken,
    ) -> Option<mpsc::Receiver<PushInfo>> {
        let mut delay = Duration::from_millis(50);
        let link = self.links.get(i)?;
        loop {
            match self.open(link).await {
                Ok((conn, rx)) => {
                    // Every channel again, on the new connection; a subscribe
                    // racing with this waits for the lock and then uses it.
                    let subscribed = self.subscribed.lock().await;
                    *link.conn.lock() = Some(conn.clone());
                    let channels: Vec<String> = subscribed.iter().map(wake_channel).collect();
                    let mut conn = conn;
                    let ok = channels.is_empty()
                        || matches!(
                            tokio::time::timeout(SUBSCRIBE_TIMEOUT, conn.subscribe(channels)).await,
                            Ok(Ok(()))
                        );
                    if ok {
                        info!(node = %self.node, link = i, channels = subscribed.len(), "wake subscriber connected");
                        self.connected.send_modify(|n| *n += 1);
                        return Some(rx);
                    }
                    *link.conn.lock() = None;
                }
                Err(e) => {
                    warn!(error = %e, "wake subscriber cannot reach Redis; retrying");
                }
            }
            tokio::select! {
                () = stop.cancelled() => return None,
                () = tokio::time::sleep(delay) => {}
            }
            delay = (delay * 2).min(MAX_RECONNECT_DELAY);
        }
    }

    /// Whether subscriber link `i` answers.
    pub async fn ping(&self, i: usize) -> bool {
        let Some(link) = self.links.get(i) else {
            return false;
        };
        let conn = link.conn.lock().clone();
        let Some(mut conn) = conn else {
            return false;
        };
        let cmd = redis::cmd("PING");
        let ping = cmd.query_async::<redis::Value>(&mut conn);
        matches!(
            tokio::time::timeout(SUBSCRIBE_TIMEOUT, ping).await,
            Ok(Ok(_))
        )
    }

    /// Marks subscriber link `i` disconnected.
    pub fn disconnected(&self, i: usize) {
        if let Some(link) = self.links.get(i)
            && link.conn.lock().take().is_some()
        {
            self.connected.send_modify(|n| *n = n.saturating_sub(1));
        }
    }

    /// Whether link `i` dropped messages since the last call (its queue
    /// overflowed).
    pub fn take_overflow(&self, i: usize) -> bool {
        self.links
            .get(i)
            .is_some_and(|l| l.overflowed.swap(false, Ordering::Relaxed))
    }

    async fn open(
        &self,
        link: &Link,
    ) -> Result<(MultiplexedConnection, mpsc::Receiver<PushInfo>), String> {
        let info = link
            .url
            .as_str()
            .into_connection_info()
            .map_err(|e| format!("wake subscriber URL: {e}"))?;
        let settings = info
            .redis_settings()
            .clone()
            .set_protocol(ProtocolVersion::RESP3);
        let client = redis::Client::open(info.set_redis_settings(settings))
            .map_err(|e| format!("wake subscriber: {e}"))?;
        let (tx, rx) = mpsc::channel(self.wake_queue);
        let overflowed = link.overflowed.clone();
        let sender = move |msg: PushInfo| -> Result<(), ()> {
            if let Err(e) = tx.try_send(msg) {
                match e {
                    mpsc::error::TrySendError::Full(_) => {
                        // Dropped: the receiver resynchronises from the store.
                        overflowed.store(true, Ordering::Relaxed);
                    }
                    mpsc::error::TrySendError::Closed(_) => return Err(()),
                }
            }
            Ok(())
        };
        let config = AsyncConnectionConfig::new()
            .set_push_sender(sender)
            .set_connection_timeout(Some(SUBSCRIBE_TIMEOUT))
            .set_response_timeout(Some(SUBSCRIBE_TIMEOUT));
        let conn = client
            .get_multiplexed_async_connection_with_config(&config)
            .await
            .map_err(|e| format!("wake subscriber: {e}"))?;
        Ok((conn, rx))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fleet() -> Fleet {
        let config = crate::config::Config::from_toml_with_overrides(
            "[relay]\nid = \"r\"\ntls_mode = \"behind-load-balancer\"\n[fleet]\nnode = \"n1\"\n",
            "test",
            &[],
        )
        .unwrap_or_else(|e| panic!("{e}"));
        Fleet::new(&config, vec!["redis://127.0.0.1:1/".into()])
    }

    #[test]
    fn debug_of_the_fleet_shows_no_subscriber_password() {
        let config = crate::config::Config::from_toml_with_overrides(
            "[relay]\nid = \"r\"\ntls_mode = \"behind-load-balancer\"\n",
            "test",
            &[],
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let urls = vec![
            "redis://:hunter2@127.0.0.1:7001".to_owned(),
            "redis://user:hunter2@127.0.0.1:7002".to_owned(),
        ];
        let shown = format!("{:?}", Fleet::new(&config, urls));
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(shown.contains("127.0.0.1:7002"), "{shown}");
    }

    #[test]
    fn the_newest_claim_wins_whatever_order_the_announcements_arrive_in() {
        let f = fleet();
        let peer = PeerId::new("acme/callee").unwrap_or_else(|_| unreachable!());
        let (s1, s2) = (SessionId::random(), SessionId::random());
        // Our claim is generation 3; our own announcement supersedes nothing.
        assert!(f.hold(&peer, s1, 3));
        assert_eq!(f.announced(&peer, 3), None);
        // An older claim elsewhere (announced late) does not close ours.
        assert_eq!(f.announced(&peer, 2), None);
        // A newer one does, once.
        assert_eq!(f.announced(&peer, 4), Some(s1));
        // A claim that loses to an announcement already seen reports it.
        assert!(!f.hold(&peer, s2, 4 - 1));
        // Releasing only forgets the session named.
        assert!(!f.release(&peer, s1));
        assert!(f.release(&peer, s2));
    }

    #[test]
    fn the_claim_floor_covers_every_generation_seen_here() {
        let f = fleet();
        let peer = PeerId::new("acme/callee").unwrap_or_else(|_| unreachable!());
        assert_eq!(f.floor(&peer), 0);
        let s = SessionId::random();
        assert!(f.hold(&peer, s, 7));
        assert_eq!(f.floor(&peer), 7, "the claim held here");
        assert_eq!(f.announced(&peer, 9), Some(s));
        assert_eq!(f.floor(&peer), 9, "a claim announced elsewhere");
        // Neither a release nor an older announcement lowers it.
        assert!(f.release(&peer, s));
        assert_eq!(f.announced(&peer, 2), None);
        assert_eq!(f.floor(&peer), 9);
    }

    fn view(live: &[(&str, &str)], left: &[(&str, &str)]) -> Liveness {
        let pairs = |v: &[(&str, &str)]| {
            v.iter()
                .map(|(n, i)| ((*n).to_owned(), (*i).to_owned()))
                .collect()
        };
        Liveness {
            live: pairs(live),
            left: pairs(left),
        }
    }

    fn departure(node: &str, incarnation: &str, kind: DepartureKind) -> Departure {
        Departure {
            node: node.into(),
            incarnation: incarnation.into(),
            kind,
        }
    }

    #[test]
    fn liveness_decides_multi_and_node_alive() {
        let f = fleet();
        let me = f.incarnation.clone();
        assert_eq!(me.len(), 16);
        assert!(f.enabled);
        assert!(!f.multi());
        assert!(f.node_alive("n1", ""));
        assert!(f.node_alive("n1", &me));
        assert!(
            !f.node_alive("n1", "an-earlier-one"),
            "a previous process of this node"
        );
        assert!(
            f.set_live_nodes(view(&[("n1", &me), ("n2", "a")], &[]))
                .is_empty()
        );
        assert!(f.multi());
        assert!(f.node_alive("n2", "a") && f.node_alive("n2", ""));
        assert!(!f.node_alive("n2", "b"));
        assert_eq!(
            f.set_live_nodes(view(&[], &[])),
            vec![departure("n2", "a", DepartureKind::Lapsed)]
        );
        assert!(!f.multi(), "this node counts itself");
        assert!(!f.node_alive("n2", ""));
        assert!(
            !Fleet::new(
                &crate::config::Config::from_toml_with_overrides(
                    "[relay]\nid = \"r\"\ntls_mode = \"behind-load-balancer\"\n",
                    "test",
                    &[],
                )
                .unwrap_or_else(|e| panic!("{e}")),
                Vec::new()
            )
            .enabled
        );
    }

    #[test]
    fn a_new_incarnation_or_a_clean_leave_is_a_departure() {
        let f = fleet();
        let me = f.incarnation.clone();
        f.set_live_nodes(view(
            &[("n1", &me), ("n2", "a"), ("n3", "x"), ("old", "")],
            &[],
        ));
        // n2 restarted within its lease, n3 left cleanly, and a node that
        // records no incarnation is compared by name only.
        let mut gone = f.set_live_nodes(view(&[("n2", "b"), ("old", "")], &[("n3", "x")]));
        gone.sort_by(|a, b| a.node.cmp(&b.node));
        assert_eq!(
            gone,
            vec![
                departure("n2", "a", DepartureKind::Restarted),
                departure("n3", "x", DepartureKind::Left),
            ]
        );
        assert!(f.node_alive("n2", "b") && !f.node_alive("n2", "a"));
        // Renewing the same view again: nothing more left.
        assert!(
            f.set_live_nodes(view(&[("n2", "b"), ("old", "")], &[("n3", "x")]))
                .is_empty()
        );
        // A node that left and came back under its name within the lease:
        // the old process left cleanly, the new one is simply live.
        f.set_live_nodes(view(&[("n2", "b"), ("n3", "y")], &[("n3", "x")]));
        assert_eq!(
            f.set_live_nodes(view(&[("n2", "b")], &[("n3", "x"), ("n3", "y")])),
            vec![departure("n3", "y", DepartureKind::Left)]
        );
    }
}
