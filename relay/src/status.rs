//! `/status` on the admin port: who is online (here and, in a fleet, on the
//! other instances), open delegations per route, the fleet's members, the
//! store's health and this build, as JSON ([`RelayStatus`]); the same data as
//! a page (`/status.html`, also `/`: [`STATUS_PAGE`]) for a browser, and as
//! tables for `oab-relay status` ([`RelayStatus::render`]).
//!
//! Never: shows a payload, a descriptor, a key or a store URL; lists
//! configured peers and routes only, so its size is bounded by the
//! configuration. Every store read it makes has a deadline
//! ([`STORE_DEADLINE`]): a hung store makes the answer say `reachable:
//! false`, never makes it hang.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use oab_wire::PeerId;

use crate::hub::{Hub, RefusalRecord};
use crate::store::EventStore;

/// How long `/status` waits for each store read (the ping, the presence
/// records).
pub const STORE_DEADLINE: Duration = Duration::from_secs(2);

/// The status page: one HTML file with inline CSS and JS (no external
/// assets) that fetches `/status` every 2 s and renders it.
pub const STATUS_PAGE: &str = include_str!("status_page.html");

/// Everything `/status` answers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RelayStatus {
    /// This relay process.
    pub relay: RelayInfo,
    /// Every configured peer, in configuration order.
    pub peers: Vec<PeerStatus>,
    /// Every configured route, in configuration order.
    pub routes: Vec<RouteStatus>,
    /// The fleet, when the store is shared (Redis); `None` with the memory
    /// store.
    pub fleet: Option<FleetStatus>,
    /// The store.
    pub store: StoreStatus,
    /// The latest refusals this instance sent to peers (error frames), newest
    /// first; at most [`crate::hub::RECENT_REFUSALS`].
    #[serde(default)]
    pub recent_refusals: Vec<RefusalRecord>,
}

/// This relay process.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RelayInfo {
    /// `relay.id`.
    pub id: String,
    /// This instance's name in the fleet (`fleet.node`, or a random name).
    pub node: String,
    /// The version of the build.
    pub version: String,
    /// The git commit of the build (short), or `unknown`.
    pub commit: String,
    /// When it was built (UTC, RFC 3339).
    pub built: String,
    /// When this answer was made (ms since the Unix epoch).
    pub now_ms: u64,
    /// The generation of the configuration in force (`oab_config_generation`:
    /// 1 at start, one more per applied reload).
    #[serde(default)]
    pub config_generation: u64,
}

/// One configured peer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerStatus {
    /// The peer id.
    pub peer: String,
    /// Whether it holds a session (here or on a live instance of the fleet).
    pub online: bool,
    /// The relay instance serving its session (`fleet.node` of that
    /// instance).
    pub served_by: Option<String>,
    /// Its session id.
    pub session: Option<String>,
    /// The connector's process instance id. Known for sessions served here
    /// only (`None` for one served by another instance).
    pub instance: Option<String>,
    /// Since when the session is up (ms since the Unix epoch). Known for
    /// sessions served here only.
    pub since_ms: Option<u64>,
}

/// One configured route.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RouteStatus {
    /// The calling peer.
    pub caller: String,
    /// The called peer.
    pub callee: String,
    /// Open delegations on it, as this instance counts them for its caps:
    /// those of callers whose sessions it served (seeded from the store at
    /// each of the caller's handshakes, lowered at each terminal seen).
    pub open: u32,
    /// The route's `max_open`.
    pub max_open: u32,
}

/// The relay instances sharing the store.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FleetStatus {
    /// This instance's name.
    pub node: String,
    /// Whether this instance holds the sweeper lease.
    pub leader: bool,
    /// Live instances as the last liveness renewal saw them (this one
    /// included), by name.
    pub members: Vec<FleetMember>,
    /// Wake subscriber connections (one per store URL: every master of a
    /// Redis Cluster).
    pub wake_links: usize,
    /// Of those, connected now.
    pub wake_links_connected: usize,
}

/// One live relay instance.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FleetMember {
    /// Its name (`fleet.node`).
    pub node: String,
    /// Its process incarnation (`""`: not recorded).
    pub incarnation: String,
    /// Whether it is the instance that answered.
    pub this: bool,
}

/// The store's health as this instance sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoreStatus {
    /// `memory`, `redis` or `redis cluster`.
    pub kind: String,
    /// Whether it answered a `PING` for this request (within
    /// [`STORE_DEADLINE`]).
    pub reachable: bool,
    /// The last failed store operation seen by this instance, if any.
    pub last_error: Option<StoreErrorStatus>,
}

/// A failed store operation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoreErrorStatus {
    /// When (ms since the Unix epoch).
    pub at_ms: u64,
    /// The operation (`append`, `read`, `ping`, ...).
    pub op: String,
    /// The error, without credentials.
    pub error: String,
}

/// Builds the status of `hub` now.
pub async fn status<S: EventStore>(hub: &Hub<S>) -> RelayStatus {
    let ping = tokio::time::timeout(STORE_DEADLINE, hub.store.ping()).await;
    let reachable = match ping {
        Ok(Ok(())) => true,
        Ok(Err(e)) => {
            hub.store_health.failed("ping", Some(&e));
            false
        }
        Err(_) => {
            hub.store_health.failed("ping", None);
            false
        }
    };
    // The configuration in force (a reload may have changed peers and routes).
    let live = hub.live();
    let peers = peer_statuses(hub, &live.directory.peers, reachable).await;
    let open: std::collections::HashMap<_, _> = hub.open_per_route().into_iter().collect();
    let routes = live
        .config
        .routes
        .iter()
        .map(|r| RouteStatus {
            caller: r.from.to_string(),
            callee: r.to.to_string(),
            open: open
                .get(&(r.from.clone(), r.to.clone()))
                .copied()
                .unwrap_or(0),
            max_open: r.max_open,
        })
        .collect();
    let fleet = hub.fleet.enabled.then(|| FleetStatus {
        node: hub.fleet.node.clone(),
        leader: hub.fleet.is_leader(),
        members: hub
            .fleet
            .live_nodes()
            .into_iter()
            .map(|(node, incarnation)| FleetMember {
                this: node == hub.fleet.node,
                node,
                incarnation,
            })
            .collect(),
        wake_links: hub.fleet.links(),
        wake_links_connected: hub.fleet.links_connected(),
    });
    RelayStatus {
        relay: RelayInfo {
            id: hub.config.relay.id.to_string(),
            node: hub.fleet.node.clone(),
            version: oab_ops::build::VERSION.to_string(),
            commit: oab_ops::build::COMMIT.to_string(),
            built: oab_ops::build::DATE.to_string(),
            now_ms: oab_wire::identity::now_ms(),
            config_generation: live.generation,
        },
        peers,
        routes,
        fleet,
        recent_refusals: hub.refusals.latest(),
        store: StoreStatus {
            kind: hub.store.kind().to_string(),
            reachable,
            last_error: hub.store_health.last_error().map(|e| StoreErrorStatus {
                at_ms: e.at_ms,
                op: e.op,
                error: e.error,
            }),
        },
    }
}

/// Where each of `peers` holds a session: here, on another live instance
/// of the fleet (its presence record, read with [`STORE_DEADLINE`] when the
/// store is `reachable`), or nowhere.
pub async fn peer_statuses<S: EventStore>(
    hub: &Hub<S>,
    peers: &[PeerId],
    reachable: bool,
) -> Vec<PeerStatus> {
    let here: std::collections::HashMap<_, _> = hub
        .sessions_here()
        .into_iter()
        .map(|s| (s.peer.clone(), s))
        .collect();
    // Sessions on other instances: their presence records (fleet only).
    let elsewhere = if hub.fleet.enabled && reachable {
        match tokio::time::timeout(STORE_DEADLINE, hub.store.presence(peers)).await {
            Ok(Ok(p)) => p,
            _ => vec![None; peers.len()],
        }
    } else {
        vec![None; peers.len()]
    };
    peers
        .iter()
        .zip(elsewhere)
        .map(|(peer, presence)| match here.get(peer) {
            Some(s) => PeerStatus {
                peer: peer.to_string(),
                online: true,
                served_by: Some(hub.fleet.node.clone()),
                session: Some(s.id.to_string()),
                instance: Some(s.instance.to_string()),
                since_ms: Some(s.since_ms),
            },
            None => {
                let live = presence.filter(|p| {
                    p.node != hub.fleet.node && hub.fleet.node_alive(&p.node, &p.incarnation)
                });
                PeerStatus {
                    peer: peer.to_string(),
                    online: live.is_some(),
                    served_by: live.as_ref().map(|p| p.node.clone()),
                    session: live.map(|p| p.session),
                    instance: None,
                    since_ms: None,
                }
            }
        })
        .collect()
}

impl RelayStatus {
    /// The status as text tables (what `oab-relay status` prints).
    pub fn render(&self) -> String {
        use oab_ops::table::render;
        use oab_ops::time::{short_duration, utc_rfc3339};
        let now = self.relay.now_ms;
        let ago = |ms: u64| short_duration(now.saturating_sub(ms));
        let when = |ms: u64| utc_rfc3339(i64::try_from(ms / 1_000).unwrap_or(i64::MAX));
        let r = &self.relay;
        let mut out = format!(
            "relay {} (node {}), version {} (commit {}, built {}), config generation {}\n",
            r.id, r.node, r.version, r.commit, r.built, r.config_generation
        );
        let s = &self.store;
        out.push_str(&format!(
            "store: {}, {}",
            s.kind,
            if s.reachable {
                "reachable"
            } else {
                "UNREACHABLE"
            }
        ));
        match &s.last_error {
            Some(e) => out.push_str(&format!(
                "; last error {} ago ({}): {}: {}\n",
                ago(e.at_ms),
                when(e.at_ms),
                e.op,
                e.error
            )),
            None => out.push_str("; no error seen\n"),
        }
        match &self.fleet {
            Some(f) => {
                out.push_str(&format!(
                    "fleet: {} member(s); this node {}; wake links {}/{} connected\n",
                    f.members.len(),
                    if f.leader {
                        "holds the sweeper lease"
                    } else {
                        "is not the sweeper"
                    },
                    f.wake_links_connected,
                    f.wake_links
                ));
                let rows: Vec<Vec<String>> = f
                    .members
                    .iter()
                    .map(|m| {
                        vec![
                            m.node.clone(),
                            m.incarnation.clone(),
                            if m.this {
                                "this one".into()
                            } else {
                                String::new()
                            },
                        ]
                    })
                    .collect();
                out.push('\n');
                out.push_str(&render(&["NODE", "INCARNATION", ""], &rows));
            }
            None => out.push_str("fleet: none (store not shared)\n"),
        }
        let online = self.peers.iter().filter(|p| p.online).count();
        out.push_str(&format!(
            "\npeers: {online} of {} online\n",
            self.peers.len()
        ));
        let dash = || "-".to_string();
        let rows: Vec<Vec<String>> = self
            .peers
            .iter()
            .map(|p| {
                vec![
                    p.peer.clone(),
                    if p.online { "online" } else { "offline" }.into(),
                    p.served_by.clone().unwrap_or_else(dash),
                    p.instance.clone().unwrap_or_else(dash),
                    p.session.clone().unwrap_or_else(dash),
                    p.since_ms
                        .map_or_else(dash, |ms| format!("{} ({} ago)", when(ms), ago(ms))),
                ]
            })
            .collect();
        out.push_str(&render(
            &["PEER", "STATE", "SERVED BY", "INSTANCE", "SESSION", "SINCE"],
            &rows,
        ));
        let rows: Vec<Vec<String>> = self
            .routes
            .iter()
            .map(|r| {
                vec![
                    format!("{} -> {}", r.caller, r.callee),
                    r.open.to_string(),
                    r.max_open.to_string(),
                ]
            })
            .collect();
        out.push_str("\nopen delegations per route (as this instance counts them)\n");
        out.push_str(&render(&["ROUTE", "OPEN", "MAX OPEN"], &rows));
        if self.recent_refusals.is_empty() {
            out.push_str("\nlatest refusals: none since this instance started\n");
        } else {
            let rows: Vec<Vec<String>> = self
                .recent_refusals
                .iter()
                .map(|r| {
                    vec![
                        format!("{} ago", ago(r.at_ms)),
                        r.peer.clone(),
                        r.code.clone(),
                        r.key.clone().unwrap_or_else(dash),
                        r.message.clone(),
                    ]
                })
                .collect();
            out.push_str("\nlatest refusals (newest first; `oab-relay inspect <delegation>`)\n");
            out.push_str(&render(
                &["WHEN", "PEER", "CODE", "DELEGATION", "MESSAGE"],
                &rows,
            ));
        }
        out
    }
}
