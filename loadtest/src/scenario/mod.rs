//! The scenarios, and what they share: the run's common options, the targets
//! a case runs against (the relay on a store, or the direct baseline), and
//! the header every JSON document starts with.
//!
//! | scenario | measures |
//! |---|---|
//! | [`throughput`] | frames/s and MB/s per payload size, relay vs direct |
//! | [`latency`] | round-trip percentiles at several offered loads, relay vs direct |
//! | [`sessions`] | relay memory per idle session, handshakes per second |
//! | [`delegations`] | whole delegations per second connector to connector, connector overhead per event |
//! | [`delegations_cp`] | `delegations --mode cp`: OpenAB control-plane round trips through both connectors' CP endpoints and the relay, beside a direct WebSocket |
//! | [`cancel_race`] | cancels racing completion: both sides agree on one terminal |
//! | [`slow_consumer`] | one receiver stalls: cut with 4001, bounded relay memory, exact resume, other pairs' p99 |
//! | [`reconnect_storm`] | link cuts, resets, stalls and away faults on both links, relay kills, Redis kills, caller restarts, library or A2A path: every delegation ends once at the caller, nothing lost, repeated or rerun |
//! | [`cross_instance`] | two relay instances over one Redis: cross-instance throughput and latency against one instance, ratios |
//! | [`a2a_sdk`] | blocking A2A calls, official Python SDK client and agent, direct and through facade, relay and driver processes: delegations/s, CPU per delegation per process |
//! | [`upgrade_drill`] | two relays behind HAProxy, both connectors, the library caller and Redis restarted in turn under load: every delegation's events and outcome against the agent's |
//! | [`soak`] | hundreds of thousands of delegations through the relay (Redis) and two connector processes, library and A2A paths: RSS, `state_dir` and Redis at checkpoints, growth per delegation, the idle plateau |

pub mod a2a_sdk;
pub mod cancel_race;
pub mod cross_instance;
pub mod delegations;
pub mod delegations_cp;
pub mod latency;
pub mod reconnect_storm;
pub mod sessions;
pub mod slow_consumer;
pub mod soak;
pub mod throughput;
pub mod upgrade_drill;

use std::time::Duration;

use serde::Serialize;

use crate::relay::{RedisPersistence, RelayMode, StoreKind};
use crate::setup::Tuning;

/// What a delegation goes through.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DelegationsMode {
    /// The library API: `Caller::delegate` to an in-process executor.
    Library,
    /// OpenAB's control-plane protocol: a CP primary through connector A's
    /// endpoint, the relay and connector B's endpoint to a CP worker, beside
    /// a direct WebSocket ([`delegations_cp`]).
    Cp,
}

/// Options of the delegations scenario.
#[derive(Debug, Clone, Serialize)]
pub struct DelegationsOptions {
    /// Library or CP.
    pub mode: DelegationsMode,
    /// Relay stores to measure.
    pub stores: Vec<StoreKind>,
    /// Delegations in flight at once, one measurement each.
    pub in_flight: Vec<usize>,
    /// Status events each delegation's executor emits.
    pub events: u32,
    /// Time per in-flight level, seconds.
    pub seconds: f64,
    /// Delegations per level at most.
    pub max_delegations: u64,
    /// Time of the raw-frame baseline per store, seconds.
    pub baseline_seconds: f64,
    /// CP mode: the CP clients (primary and worker) behave as OpenAB's own
    /// client: Nagle's algorithm on and each frame in a write of its own;
    /// else they set `TCP_NODELAY` and batch what they have into one write.
    pub cp_nagle: bool,
    /// CP mode: measure an external CP server at this URL instead (the
    /// primary and the worker both connect to it, as to openab-cp), in
    /// place of the direct and relay paths.
    pub cp_url: Option<String>,
}

/// Options every scenario takes.
#[derive(Debug, Clone)]
pub struct Common {
    /// How the relay runs.
    pub relay: RelayMode,
    /// Persistence of the `redis-server` behind a Redis store.
    pub redis_persistence: RedisPersistence,
    /// After a case stops sending, how long it waits for the last frames
    /// before it counts the missing ones as lost.
    pub drain: Duration,
    /// Relay settings changed from the defaults.
    pub tuning: Tuning,
}

impl Common {
    /// These options with the relay settings the connector scenarios need
    /// ([`crate::connectors::FINISHED_TTL_MS`]); the JSON header records
    /// them.
    pub fn for_connectors(&self) -> Common {
        let mut c = self.clone();
        c.tuning.finished_ttl_ms = c
            .tuning
            .finished_ttl_ms
            .max(crate::connectors::FINISHED_TTL_MS);
        c
    }
}

/// Where a case's frames go. Serialized as its [name](Path::name).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Path {
    /// Endpoint A to endpoint B over one direct WSS connection.
    Direct,
    /// Through the relay on this store.
    Relay(StoreKind),
}

impl Path {
    /// Stable name for tables and JSON.
    pub fn name(self) -> &'static str {
        match self {
            Path::Direct => "direct",
            Path::Relay(StoreKind::Memory) => "relay-memory",
            Path::Relay(StoreKind::Redis) => "relay-redis",
        }
    }
}

impl Serialize for Path {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

/// CPU seconds (user + system) a process has used, from `/proc/<pid>/stat`
/// (`self` for this process). Linux counts in USER_HZ ticks, 100 per second
/// on every mainstream architecture.
pub fn cpu_seconds(pid: &str) -> Option<f64> {
    const USER_HZ: f64 = 100.0;
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name is in parentheses and may contain spaces.
    let rest = text.get(text.rfind(')')? + 1..)?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    Some((utime + stime) / USER_HZ)
}

/// The header of every JSON document: what ran, where, when, with what.
pub fn run_header(scenario: &str, common: &Common, relay_bin: Option<&str>) -> serde_json::Value {
    serde_json::json!({
        "scenario": scenario,
        "tool": { "name": "oab-loadtest", "version": env!("CARGO_PKG_VERSION") },
        "started_unix_ms": oab_wire::identity::now_ms(),
        "machine": {
            "cpus": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
            "os": std::env::consts::OS,
            "arch": std::env::consts::ARCH,
        },
        "relay": {
            "mode": common.relay.name(),
            "binary": relay_bin,
            "redis_persistence": common.redis_persistence,
            "tuning": common.tuning,
        },
        "drain_seconds": common.drain.as_secs_f64(),
        "loopback_only": true,
    })
}

/// The relay binary's path, for the JSON header.
pub fn relay_bin(common: &Common) -> Option<String> {
    match &common.relay {
        RelayMode::Process(p) => Some(p.display().to_string()),
        RelayMode::InProcess => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_time_of_this_process_is_readable() {
        assert!(cpu_seconds("self").is_some_and(|s| s >= 0.0));
        assert_eq!(cpu_seconds("999999999"), None);
    }
}
