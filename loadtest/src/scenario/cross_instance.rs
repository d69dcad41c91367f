//! `cross-instance`: what delivery between two relay instances over one
//! store costs, against delivery within one instance, in the same run.
//!
//! One store is started for the run (a `redis-server`, or a three-master
//! Redis Cluster) and relay instances on it, each a fleet member
//! (`--set fleet.node=relay-N`). Three topologies:
//!
//! - **alone** (optional): `relay-1` with no other instance running. The
//!   previous single-relay baseline.
//! - **same-instance**: caller and callee on `relay-1` while `relay-2` runs
//!   (its liveness renewals, sweeper lease, subscriptions). An instance
//!   publishes only appends whose receiver is not subscribed on it, so
//!   nothing is published here.
//! - **cross-instance**: caller on `relay-1`, callee on `relay-2`. A frame
//!   is appended on `relay-1` by the Lua script that also `PUBLISH`es it;
//!   `relay-2`'s subscriber receives it and delivers it. Echoes go the
//!   other way.
//!
//! Before anything is measured with two instances, every instance's
//! `oab_fleet_nodes` must show both (polled on the admin `/metrics`,
//! bounded). Per topology: pipelined throughput at one payload size (the
//! [`throughput`] scenario's windowed method and code) and round-trip
//! latency at fixed offered loads (the [`latency`] scenario's echo). Same
//! and cross alternate for `rounds` rounds, in the other order each round,
//! so drift on a noisy machine hits both; the tables give medians and
//! cross/same ratios. Each case starts once no wake-channel subscription of
//! the benchmark peers is left from the previous one.

use std::time::Duration;

use anyhow::Context as _;
use serde::Serialize;

use super::latency::{self, LatencyOptions, LevelResult};
use super::throughput::{self, CaseResult, RelayEnds, ThroughputOptions};
use super::{Common, relay_bin, run_header};
use crate::relay::{RelayFleet, RelayUnderTest, SharedStoreKind};
use crate::report::{Percentiles, Report, Table, fmt_count, fmt_size, fmt_us};
use crate::setup::Setup;
use crate::traffic::CheckReport;

/// The relay's default `fleet.node_lease_ms`, for the bound on the wait
/// until the instances see each other.
const DEFAULT_NODE_LEASE_MS: u64 = 10_000;

/// A latency level counts as saturated below this share of its offered load.
const SATURATED_BELOW: f64 = 0.95;

/// Options of the cross-instance scenario.
#[derive(Debug, Clone, Serialize)]
pub struct CrossInstanceOptions {
    /// The stores to run on, one fleet each, in order.
    pub stores: Vec<SharedStoreKind>,
    /// Payload size, bytes (at least 24).
    pub size: usize,
    /// Sending time per throughput case.
    pub seconds: f64,
    /// Frames per throughput case at most.
    pub max_frames: u64,
    /// Unconfirmed frames in flight at most (throughput), and frames sent
    /// and not yet echoed at most (latency).
    pub window: u64,
    /// Fixed offered loads of the latency cases, frames per second.
    pub rates: Vec<f64>,
    /// Sending time per latency level.
    pub latency_seconds: f64,
    /// Rounds of same-instance and cross-instance cases.
    pub rounds: u32,
    /// Whether to measure `relay-1` alone first (no other instance).
    pub alone: bool,
    /// `fleet.node_lease_ms` for every instance (`None`: the relay's
    /// default); the instances renew their liveness every third of it.
    pub node_lease_ms: Option<u64>,
}

/// Where caller and callee are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Topology {
    /// One relay instance, no other running.
    Alone,
    /// Both on `relay-1`, `relay-2` running.
    SameInstance,
    /// Caller on `relay-1`, callee on `relay-2`.
    CrossInstance,
}

impl Topology {
    /// Stable name for tables and JSON.
    pub fn name(self) -> &'static str {
        match self {
            Topology::Alone => "alone",
            Topology::SameInstance => "same-instance",
            Topology::CrossInstance => "cross-instance",
        }
    }

    fn order(self) -> u8 {
        match self {
            Topology::Alone => 0,
            Topology::SameInstance => 1,
            Topology::CrossInstance => 2,
        }
    }
}

/// What the fleet looked like around one case.
#[derive(Debug, Clone, Serialize)]
pub struct FleetView {
    /// How long the case waited for the previous case's wake-channel
    /// subscriptions to go (an instance unsubscribes the channel of a peer
    /// it no longer holds once it released the peer's presence), ms.
    pub settled_ms: u64,
    /// Each instance's `oab_fleet_nodes` after the case.
    pub fleet_nodes_after: Vec<Option<f64>>,
    /// Each instance's wake-channel entries taken during the case
    /// (`oab_wake_messages_total{kind="entry"}`).
    pub wake_entries: Vec<Option<f64>>,
}

/// One throughput case.
#[derive(Debug, Clone, Serialize)]
pub struct ThroughputRun {
    /// The store under the fleet.
    pub store: SharedStoreKind,
    /// Where caller and callee were.
    pub topology: Topology,
    /// The round (0-based).
    pub round: u32,
    /// CPU seconds the store's `redis-server` processes used in the case.
    pub redis_cpu_s: Option<f64>,
    /// Redis CPU per frame received, µs.
    pub redis_cpu_us_per_frame: Option<f64>,
    /// The fleet around the case.
    pub fleet: FleetView,
    /// The throughput scenario's figures (its relay CPU is every running
    /// instance together).
    pub case: CaseResult,
}

/// One latency level.
#[derive(Debug, Clone, Serialize)]
pub struct LatencyRun {
    /// The store under the fleet.
    pub store: SharedStoreKind,
    /// Where caller and callee were.
    pub topology: Topology,
    /// The round (0-based).
    pub round: u32,
    /// The fleet around the level.
    pub fleet: FleetView,
    /// The latency scenario's figures.
    pub level: LevelResult,
}

/// Throughput of one topology on one store over all rounds.
#[derive(Debug, Clone, Serialize)]
pub struct ThroughputSummary {
    /// The store.
    pub store: SharedStoreKind,
    /// The topology.
    pub topology: Topology,
    /// Frames/s per round, in round order.
    pub frames_per_sec: Vec<f64>,
    /// Median frames/s.
    pub median_frames_per_sec: f64,
    /// Median frames/s / the same-instance median (same store).
    pub vs_same_instance: Option<f64>,
    /// Per round: frames/s / the same round's same-instance frames/s.
    pub vs_same_instance_per_round: Vec<f64>,
    /// Median one-way p50 under this load, µs.
    pub one_way_p50_us: f64,
    /// Median one-way p99 under this load, µs.
    pub one_way_p99_us: f64,
    /// Median relay CPU per frame (all running instances), µs.
    pub relay_cpu_us_per_frame: Option<f64>,
    /// Median redis CPU per frame, µs.
    pub redis_cpu_us_per_frame: Option<f64>,
    /// The checks of every round added up.
    pub check: CheckReport,
    /// Errors seen in every round.
    pub errors: usize,
}

/// Latency of one topology at one load on one store over all rounds.
#[derive(Debug, Clone, Serialize)]
pub struct LatencySummary {
    /// The store.
    pub store: SharedStoreKind,
    /// The topology.
    pub topology: Topology,
    /// Offered load, frames/s.
    pub offered_per_sec: f64,
    /// Median achieved send rate, frames/s.
    pub achieved_per_sec: f64,
    /// Medians over the rounds of each percentile, µs.
    pub rtt: Percentiles,
    /// p50 of each round, in round order, µs.
    pub p50_per_round_us: Vec<f64>,
    /// Median p99 measured from the scheduled send, µs.
    pub p99_from_schedule_us: f64,
    /// p50 / the same-instance p50 (same store and load).
    pub p50_vs_same_instance: Option<f64>,
    /// p99 / the same-instance p99.
    pub p99_vs_same_instance: Option<f64>,
    /// p50 - the same-instance p50, µs.
    pub p50_added_us: Option<f64>,
    /// p99 - the same-instance p99, µs.
    pub p99_added_us: Option<f64>,
    /// Whether a round achieved less than 95% of the offered load.
    pub saturated: bool,
    /// The down-log and echo checks of every round added up.
    pub check: CheckReport,
    /// Errors seen in every round.
    pub errors: usize,
}

/// Runs the scenario.
pub async fn run(opts: &CrossInstanceOptions, common: &Common) -> anyhow::Result<Report> {
    anyhow::ensure!(!opts.stores.is_empty(), "no store given");
    let rates: Vec<f64> = opts.rates.iter().copied().filter(|r| *r > 0.0).collect();
    let mut tuning = common.tuning.clone();
    tuning.max_payload = tuning
        .max_payload
        .max(u32::try_from(opts.size).unwrap_or(u32::MAX));
    let setup = Setup::new(0, tuning)?;
    let limits = setup.config.wire_limits();
    let tp = ThroughputOptions {
        sizes: vec![opts.size],
        stores: Vec::new(),
        seconds: opts.seconds,
        max_frames: opts.max_frames,
        window: opts.window,
    };
    let lat = LatencyOptions {
        size: opts.size,
        rates: rates.clone(),
        max_fraction: None,
        max_rate: None,
        probe_seconds: 0.0,
        seconds: opts.latency_seconds,
        stores: Vec::new(),
        window: opts.window,
    };
    let extra_sets: Vec<(String, String)> = opts
        .node_lease_ms
        .map(|ms| vec![("fleet.node_lease_ms".to_string(), ms.to_string())])
        .unwrap_or_default();
    let lease_ms = opts.node_lease_ms.unwrap_or(DEFAULT_NODE_LEASE_MS);
    // A new instance is seen by the others at their next renewal (every
    // third of the lease); generous for a loaded machine, still bounded.
    let fleet_wait = Duration::from_millis(lease_ms.saturating_mul(2)) + Duration::from_secs(10);
    // Stale subscriptions go at the next renewal, a third of the lease.
    let settle_bound = Duration::from_millis(lease_ms) + Duration::from_secs(5);

    let mut tp_runs: Vec<ThroughputRun> = Vec::new();
    let mut lat_runs: Vec<LatencyRun> = Vec::new();
    let mut fleets_json = Vec::new();
    for &store in &opts.stores {
        let ctx = Ctx {
            setup: &setup,
            common,
            limits: &limits,
            tp: &tp,
            lat: &lat,
            store,
            settle_bound,
        };
        let mut fleet = RelayFleet::start_store(store, common.redis_persistence)
            .await
            .with_context(|| format!("starting the {} store", store.name()))?;
        fleet
            .add_instance(&setup, &common.relay, &extra_sets)
            .await?;
        let alone_wait = fleet.wait_for_nodes(1, fleet_wait).await?;
        if opts.alone {
            for round in 0..opts.rounds {
                let r = Box::pin(throughput_case(&ctx, &fleet, Topology::Alone, round))
                    .await
                    .with_context(|| fleet_context(&fleet, "alone throughput"))?;
                tp_runs.push(r);
                for (i, &rate) in rates.iter().enumerate() {
                    let r = Box::pin(latency_level(&ctx, &fleet, Topology::Alone, round, rate, i))
                        .await
                        .with_context(|| fleet_context(&fleet, "alone latency"))?;
                    lat_runs.push(r);
                }
            }
        }
        fleet
            .add_instance(&setup, &common.relay, &extra_sets)
            .await?;
        let pair_wait = fleet
            .wait_for_nodes(2, fleet_wait)
            .await
            .with_context(|| fleet_context(&fleet, "waiting for both instances"))?;
        tracing::info!(
            store = store.name(),
            waited_ms = pair_wait.as_millis(),
            "both instances see each other"
        );
        for round in 0..opts.rounds {
            // Same first in even rounds, cross first in odd ones.
            let order = if round % 2 == 0 {
                [Topology::SameInstance, Topology::CrossInstance]
            } else {
                [Topology::CrossInstance, Topology::SameInstance]
            };
            for topology in order {
                let r = Box::pin(throughput_case(&ctx, &fleet, topology, round))
                    .await
                    .with_context(|| {
                        fleet_context(&fleet, &format!("{} throughput", topology.name()))
                    })?;
                tp_runs.push(r);
            }
            for (i, &rate) in rates.iter().enumerate() {
                for topology in order {
                    let r = Box::pin(latency_level(&ctx, &fleet, topology, round, rate, i))
                        .await
                        .with_context(|| {
                            fleet_context(&fleet, &format!("{} latency", topology.name()))
                        })?;
                    lat_runs.push(r);
                }
            }
        }
        fleets_json.push(serde_json::json!({
            "store": store,
            "store_url": fleet.store_url(),
            "relay_pids": fleet.instances().iter().map(RelayUnderTest::pid).collect::<Vec<_>>(),
            "waited_for_one_ms": alone_wait.as_millis() as u64,
            "waited_for_two_ms": pair_wait.as_millis() as u64,
        }));
        fleet.stop().await;
    }

    let tp_summary = summarize_throughput(&tp_runs);
    let lat_summary = summarize_latency(&lat_runs);

    let mut violations = Vec::new();
    for r in &tp_runs {
        let what = format!(
            "{} {} throughput round {}",
            r.store.name(),
            r.topology.name(),
            r.round + 1
        );
        violations.extend(r.case.check.violations(&what));
    }
    for r in &lat_runs {
        let what = format!(
            "{} {} at {}/s round {}",
            r.store.name(),
            r.topology.name(),
            r.level.offered_per_sec,
            r.round + 1
        );
        violations.extend(r.level.down_check.violations(&format!("{what}, down log")));
        violations.extend(r.level.echo_check.violations(&format!("{what}, echoes")));
    }

    let tables = vec![
        throughput_table(opts, &tp_summary),
        latency_table(opts, &lat_summary),
    ];
    let mut notes = vec![
        "same-instance: caller and callee on relay-1 while relay-2 runs (nothing published: \
         the receiver is subscribed on the appending instance); cross-instance: caller on \
         relay-1, callee on relay-2 (relay-1 -> Redis PUBLISH -> relay-2); alone: relay-1 \
         with no other instance."
            .to_string(),
        format!(
            "medians over {} round(s); same and cross alternate, in the other order each \
             round. vs same: cross (or alone) / same-instance on the same store in this run; \
             per round: the same ratio round by round.",
            opts.rounds
        ),
        "relay CPU/frame: every running relay instance together (process mode); redis \
         CPU/frame: INFO cpu of the store's redis-server process(es)."
            .to_string(),
        "each case starts once no wake-channel subscription of the benchmark peers is left \
         from the previous one (an instance drops the channel of a peer it no longer holds \
         once it has released the peer's presence)."
            .to_string(),
    ];
    if opts.stores.contains(&SharedStoreKind::RedisCluster) {
        notes.push(
            "redis-cluster: three masters on loopback TCP with AOF everysec (the harness's \
             cluster); redis: one server on a unix socket, persistence as --redis-persistence."
                .to_string(),
        );
    }
    let unsteady: Vec<String> = tp_runs
        .iter()
        .map(|r| (r.store, r.topology, r.round, &r.fleet))
        .chain(
            lat_runs
                .iter()
                .map(|r| (r.store, r.topology, r.round, &r.fleet)),
        )
        .filter(|(_, t, _, f)| {
            let want = if *t == Topology::Alone { 1.0 } else { 2.0 };
            f.fleet_nodes_after.iter().any(|n| *n != Some(want))
        })
        .map(|(s, t, round, f)| {
            format!(
                "{} {} round {}: {:?}",
                s.name(),
                t.name(),
                round + 1,
                f.fleet_nodes_after
            )
        })
        .collect();
    if !unsteady.is_empty() {
        notes.push(format!(
            "WARNING: the fleet size changed during a case (oab_fleet_nodes after it): {}",
            unsteady.join("; ")
        ));
    }

    let mut json = run_header("cross-instance", common, relay_bin(common).as_deref());
    if let Some(obj) = json.as_object_mut() {
        obj.insert("params".into(), serde_json::to_value(opts)?);
        obj.insert(
            "definition".into(),
            serde_json::json!(
                "throughput: pipelined Data frames caller -> callee (the throughput scenario's \
                 method); latency: caller sends down Data n, callee echoes it as up Data n-1, \
                 rtt = receipt - send on one clock (the latency scenario's method). \
                 same-instance: both endpoints on relay-1 with relay-2 running; \
                 cross-instance: caller on relay-1, callee on relay-2; alone: relay-1 only."
            ),
        );
        obj.insert("fleets".into(), serde_json::Value::Array(fleets_json));
        obj.insert(
            "throughput_summary".into(),
            serde_json::to_value(&tp_summary)?,
        );
        obj.insert(
            "latency_summary".into(),
            serde_json::to_value(&lat_summary)?,
        );
        obj.insert("throughput".into(), serde_json::to_value(&tp_runs)?);
        obj.insert("latency".into(), serde_json::to_value(&lat_runs)?);
    }
    Ok(Report {
        scenario: "cross-instance",
        tables,
        notes,
        json,
        violations,
    })
}

/// What every case of one store shares.
struct Ctx<'a> {
    setup: &'a Setup,
    common: &'a Common,
    limits: &'a oab_wire::Limits,
    tp: &'a ThroughputOptions,
    lat: &'a LatencyOptions,
    store: SharedStoreKind,
    /// How long a case waits for the previous one's subscriptions to go.
    settle_bound: Duration,
}

fn fleet_context(fleet: &RelayFleet, what: &str) -> String {
    let logs: Vec<String> = fleet
        .instances()
        .iter()
        .enumerate()
        .map(|(i, r)| format!("relay-{} log:\n{}", i + 1, r.log_tail()))
        .collect();
    format!("{what}; {}", logs.join("\n"))
}

/// The caller's and the callee's instance for `topology`.
fn ends(
    fleet: &RelayFleet,
    topology: Topology,
) -> anyhow::Result<(&RelayUnderTest, &RelayUnderTest)> {
    let instances = fleet.instances();
    let first = instances.first().context("no relay instance running")?;
    match topology {
        Topology::Alone | Topology::SameInstance => Ok((first, first)),
        Topology::CrossInstance => {
            let second = instances
                .get(1)
                .context("cross-instance needs a second instance")?;
            Ok((first, second))
        }
    }
}

const WAKE_ENTRIES: &str = "oab_wake_messages_total{kind=\"entry\"}";

async fn wake_entries(fleet: &RelayFleet) -> Vec<Option<f64>> {
    let mut out = Vec::new();
    for r in fleet.instances() {
        // An instance without a wake-up yet has no sample for the label.
        out.push(
            r.metrics()
                .await
                .ok()
                .map(|page| crate::relay::metric_value(&page, WAKE_ENTRIES).unwrap_or(0.0)),
        );
    }
    out
}

/// Waits until no wake-channel subscription of the benchmark peers is
/// left from the previous case, so each case starts with exactly the
/// subscribers its own sessions make (a lingering one would be one more
/// fan-out target per frame).
async fn settle(ctx: &Ctx<'_>, fleet: &RelayFleet) -> anyhow::Result<u64> {
    let peers = [&ctx.setup.caller.peer, &ctx.setup.callee.peer];
    let waited = fleet
        .wait_wake_subscribers(&peers, 0, ctx.settle_bound)
        .await
        .context("waiting for the previous case's wake subscriptions to go")?;
    Ok(u64::try_from(waited.as_millis()).unwrap_or(u64::MAX))
}

async fn fleet_view(fleet: &RelayFleet, settled_ms: u64, wake_before: &[Option<f64>]) -> FleetView {
    let mut nodes = Vec::new();
    for r in fleet.instances() {
        nodes.push(r.metric("oab_fleet_nodes").await.ok().flatten());
    }
    let after = wake_entries(fleet).await;
    FleetView {
        settled_ms,
        fleet_nodes_after: nodes,
        wake_entries: after
            .iter()
            .zip(wake_before)
            .map(|(a, b)| a.zip(*b).map(|(a, b)| a - b))
            .collect(),
    }
}

async fn throughput_case(
    ctx: &Ctx<'_>,
    fleet: &RelayFleet,
    topology: Topology,
    round: u32,
) -> anyhow::Result<ThroughputRun> {
    let (caller, callee) = ends(fleet, topology)?;
    let pids: Vec<u32> = fleet
        .instances()
        .iter()
        .filter_map(RelayUnderTest::pid)
        .collect();
    let label = format!("{}-{}", ctx.store.name(), topology.name());
    let relay_ends = RelayEnds {
        caller,
        callee,
        cpu_pids: &pids,
        label: &label,
    };
    let settled = settle(ctx, fleet).await?;
    let wake0 = wake_entries(fleet).await;
    let redis0 = fleet.store_cpu_seconds().await;
    let case = Box::pin(throughput::relay_case_between(
        &relay_ends,
        ctx.setup,
        ctx.tp.sizes.first().copied().unwrap_or(256),
        round as usize,
        ctx.tp,
        ctx.common,
        ctx.limits,
    ))
    .await?;
    let redis_cpu = fleet
        .store_cpu_seconds()
        .await
        .zip(redis0)
        .map(|(b, a)| b - a);
    let view = fleet_view(fleet, settled, &wake0).await;
    let frames = case.check.received;
    tracing::info!(
        store = ctx.store.name(),
        topology = topology.name(),
        round = round + 1,
        frames_per_sec = case.frames_per_sec.round(),
        lost = case.check.lost,
        errors = case.errors.len(),
        "cross-instance throughput case done"
    );
    Ok(ThroughputRun {
        store: ctx.store,
        topology,
        round,
        redis_cpu_s: redis_cpu,
        redis_cpu_us_per_frame: redis_cpu
            .filter(|_| frames > 0)
            .map(|c| c * 1e6 / frames as f64),
        fleet: view,
        case,
    })
}

async fn latency_level(
    ctx: &Ctx<'_>,
    fleet: &RelayFleet,
    topology: Topology,
    round: u32,
    rate: f64,
    i: usize,
) -> anyhow::Result<LatencyRun> {
    let (caller, callee) = ends(fleet, topology)?;
    let label = format!("{}-{}-r{round}", ctx.store.name(), topology.name());
    let settled = settle(ctx, fleet).await?;
    let wake0 = wake_entries(fleet).await;
    let level = Box::pin(latency::relay_level_between(
        caller, callee, &label, ctx.setup, rate, i, ctx.lat, ctx.common, ctx.limits,
    ))
    .await?;
    let view = fleet_view(fleet, settled, &wake0).await;
    tracing::info!(
        store = ctx.store.name(),
        topology = topology.name(),
        round = round + 1,
        offered = rate,
        p50_us = level.rtt.p50_us,
        p99_us = level.rtt.p99_us,
        lost = level.down_check.lost + level.echo_check.lost,
        "cross-instance latency level done"
    );
    Ok(LatencyRun {
        store: ctx.store,
        topology,
        round,
        fleet: view,
        level,
    })
}

/// The median of `v` (the mean of the middle two for an even count).
fn median(v: &[f64]) -> Option<f64> {
    let mut s: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
    if s.is_empty() {
        return None;
    }
    s.sort_by(f64::total_cmp);
    let mid = s.len() / 2;
    if s.len() % 2 == 1 {
        s.get(mid).copied()
    } else {
        Some((s.get(mid - 1)? + s.get(mid)?) / 2.0)
    }
}

fn add_checks(a: CheckReport, b: &CheckReport) -> CheckReport {
    CheckReport {
        received: a.received + b.received,
        lost: a.lost + b.lost,
        duplicated: a.duplicated + b.duplicated,
        reordered: a.reordered + b.reordered,
        corrupt: a.corrupt + b.corrupt,
    }
}

/// The (store, topology) groups present in `keys`, in a stable order.
fn groups(
    keys: impl Iterator<Item = (SharedStoreKind, Topology)>,
) -> Vec<(SharedStoreKind, Topology)> {
    let mut out: Vec<(SharedStoreKind, Topology)> = Vec::new();
    for k in keys {
        if !out.contains(&k) {
            out.push(k);
        }
    }
    out.sort_by_key(|(s, t)| (*s == SharedStoreKind::RedisCluster, t.order()));
    out
}

fn ratio(a: f64, b: f64) -> Option<f64> {
    (b > 0.0 && a.is_finite()).then(|| a / b)
}

/// A store's same-instance median frames/s and its (round, frames/s).
type SameBase = (SharedStoreKind, f64, Vec<(u32, f64)>);

/// Per-topology medians and ratios to same-instance.
pub fn summarize_throughput(runs: &[ThroughputRun]) -> Vec<ThroughputSummary> {
    let mut out: Vec<ThroughputSummary> = Vec::new();
    for (store, topology) in groups(runs.iter().map(|r| (r.store, r.topology))) {
        let mine: Vec<&ThroughputRun> = runs
            .iter()
            .filter(|r| r.store == store && r.topology == topology)
            .collect();
        let fps: Vec<f64> = mine.iter().map(|r| r.case.frames_per_sec).collect();
        let opt_median = |f: &dyn Fn(&ThroughputRun) -> Option<f64>| {
            let v: Vec<f64> = mine.iter().filter_map(|r| f(r)).collect();
            median(&v)
        };
        out.push(ThroughputSummary {
            store,
            topology,
            median_frames_per_sec: median(&fps).unwrap_or(0.0),
            vs_same_instance: None,
            vs_same_instance_per_round: Vec::new(),
            one_way_p50_us: opt_median(&|r| Some(r.case.one_way.p50_us)).unwrap_or(0.0),
            one_way_p99_us: opt_median(&|r| Some(r.case.one_way.p99_us)).unwrap_or(0.0),
            relay_cpu_us_per_frame: opt_median(&|r| r.case.relay_cpu_us_per_frame),
            redis_cpu_us_per_frame: opt_median(&|r| r.redis_cpu_us_per_frame),
            check: mine.iter().fold(CheckReport::default(), |acc, r| {
                add_checks(acc, &r.case.check)
            }),
            errors: mine.iter().map(|r| r.case.errors.len()).sum(),
            frames_per_sec: fps,
        });
    }
    let same: Vec<SameBase> = out
        .iter()
        .filter(|s| s.topology == Topology::SameInstance)
        .map(|s| {
            let per_round = runs
                .iter()
                .filter(|r| r.store == s.store && r.topology == Topology::SameInstance)
                .map(|r| (r.round, r.case.frames_per_sec))
                .collect();
            (s.store, s.median_frames_per_sec, per_round)
        })
        .collect();
    for s in &mut out {
        let Some((_, base, base_rounds)) = same.iter().find(|(st, _, _)| *st == s.store) else {
            continue;
        };
        s.vs_same_instance = ratio(s.median_frames_per_sec, *base);
        s.vs_same_instance_per_round = runs
            .iter()
            .filter(|r| r.store == s.store && r.topology == s.topology)
            .filter_map(|r| {
                let b = base_rounds.iter().find(|(round, _)| *round == r.round)?.1;
                ratio(r.case.frames_per_sec, b)
            })
            .collect();
    }
    out
}

/// Per-topology and load medians and differences to same-instance.
pub fn summarize_latency(runs: &[LatencyRun]) -> Vec<LatencySummary> {
    let mut rates: Vec<f64> = runs.iter().map(|r| r.level.offered_per_sec).collect();
    rates.sort_by(f64::total_cmp);
    rates.dedup();
    let mut out: Vec<LatencySummary> = Vec::new();
    for (store, topology) in groups(runs.iter().map(|r| (r.store, r.topology))) {
        for &rate in &rates {
            let mine: Vec<&LatencyRun> = runs
                .iter()
                .filter(|r| {
                    r.store == store && r.topology == topology && r.level.offered_per_sec == rate
                })
                .collect();
            if mine.is_empty() {
                continue;
            }
            let med = |f: &dyn Fn(&LevelResult) -> f64| {
                let v: Vec<f64> = mine.iter().map(|r| f(&r.level)).collect();
                median(&v).unwrap_or(0.0)
            };
            let rtt = Percentiles {
                count: mine.iter().map(|r| r.level.rtt.count).sum(),
                min_us: med(&|l| l.rtt.min_us),
                p50_us: med(&|l| l.rtt.p50_us),
                p90_us: med(&|l| l.rtt.p90_us),
                p99_us: med(&|l| l.rtt.p99_us),
                p999_us: med(&|l| l.rtt.p999_us),
                max_us: med(&|l| l.rtt.max_us),
                mean_us: med(&|l| l.rtt.mean_us),
            };
            out.push(LatencySummary {
                store,
                topology,
                offered_per_sec: rate,
                achieved_per_sec: med(&|l| l.achieved_per_sec),
                p99_from_schedule_us: med(&|l| l.rtt_from_schedule.p99_us),
                rtt,
                p50_per_round_us: mine.iter().map(|r| r.level.rtt.p50_us).collect(),
                p50_vs_same_instance: None,
                p99_vs_same_instance: None,
                p50_added_us: None,
                p99_added_us: None,
                saturated: mine
                    .iter()
                    .any(|r| r.level.achieved_per_sec < SATURATED_BELOW * rate),
                check: mine.iter().fold(CheckReport::default(), |acc, r| {
                    add_checks(add_checks(acc, &r.level.down_check), &r.level.echo_check)
                }),
                errors: mine.iter().map(|r| r.level.errors.len()).sum(),
            });
        }
    }
    let bases: Vec<(SharedStoreKind, f64, Percentiles)> = out
        .iter()
        .filter(|s| s.topology == Topology::SameInstance)
        .map(|s| (s.store, s.offered_per_sec, s.rtt))
        .collect();
    for s in &mut out {
        let Some((_, _, base)) = bases
            .iter()
            .find(|(st, rate, _)| *st == s.store && *rate == s.offered_per_sec)
        else {
            continue;
        };
        s.p50_vs_same_instance = ratio(s.rtt.p50_us, base.p50_us);
        s.p99_vs_same_instance = ratio(s.rtt.p99_us, base.p99_us);
        s.p50_added_us = Some(s.rtt.p50_us - base.p50_us);
        s.p99_added_us = Some(s.rtt.p99_us - base.p99_us);
    }
    out
}

fn fmt_ratio(r: Option<f64>) -> String {
    r.map_or("-".into(), |v| format!("{v:.2}x"))
}

fn fmt_added(us: Option<f64>) -> String {
    match us {
        Some(v) if v < 0.0 => format!("-{}", fmt_us(-v)),
        Some(v) => format!("+{}", fmt_us(v)),
        None => "-".into(),
    }
}

fn throughput_table(opts: &CrossInstanceOptions, rows: &[ThroughputSummary]) -> Table {
    let mut table = Table::new(
        format!(
            "cross-instance throughput: pipelined {} Data frames caller -> callee, {} s per \
             case, window {}, median of {} round(s)",
            fmt_size(opts.size),
            opts.seconds,
            opts.window,
            opts.rounds
        ),
        &[
            "store",
            "topology",
            "frames/s",
            "min-max",
            "vs same",
            "per round",
            "one-way p50",
            "one-way p99",
            "relay CPU/frame",
            "redis CPU/frame",
            "lost",
            "dup",
            "reord",
            "errors",
        ],
    );
    for s in rows {
        let lo = s
            .frames_per_sec
            .iter()
            .copied()
            .fold(f64::INFINITY, f64::min);
        let hi = s.frames_per_sec.iter().copied().fold(0.0, f64::max);
        table.row(vec![
            s.store.name().into(),
            s.topology.name().into(),
            fmt_count(s.median_frames_per_sec),
            if lo.is_finite() {
                format!("{}-{}", fmt_count(lo), fmt_count(hi))
            } else {
                "-".into()
            },
            fmt_ratio(s.vs_same_instance),
            if s.topology == Topology::SameInstance {
                "-".into()
            } else {
                s.vs_same_instance_per_round
                    .iter()
                    .map(|v| format!("{v:.2}"))
                    .collect::<Vec<_>>()
                    .join(" ")
            },
            fmt_us(s.one_way_p50_us),
            fmt_us(s.one_way_p99_us),
            s.relay_cpu_us_per_frame
                .map_or("-".into(), |v| format!("{v:.1}µs")),
            s.redis_cpu_us_per_frame
                .map_or("-".into(), |v| format!("{v:.1}µs")),
            s.check.lost.to_string(),
            s.check.duplicated.to_string(),
            s.check.reordered.to_string(),
            s.errors.to_string(),
        ]);
    }
    table
}

fn latency_table(opts: &CrossInstanceOptions, rows: &[LatencySummary]) -> Table {
    let mut table = Table::new(
        format!(
            "cross-instance latency: round trip caller -> callee -> caller, {} payload, {} s \
             per level, median of {} round(s)",
            fmt_size(opts.size),
            opts.latency_seconds,
            opts.rounds
        ),
        &[
            "store",
            "offered/s",
            "topology",
            "achieved/s",
            "p50",
            "p90",
            "p99",
            "p99.9",
            "p99 (sched)",
            "p50 per round",
            "p50 vs same",
            "p99 vs same",
            "added p50",
            "added p99",
            "lost",
            "dup",
            "reord",
            "errors",
        ],
    );
    let mut sorted: Vec<&LatencySummary> = rows.iter().collect();
    sorted.sort_by(|a, b| {
        (a.store == SharedStoreKind::RedisCluster)
            .cmp(&(b.store == SharedStoreKind::RedisCluster))
            .then(a.offered_per_sec.total_cmp(&b.offered_per_sec))
            .then(a.topology.order().cmp(&b.topology.order()))
    });
    for s in sorted {
        let same = s.topology == Topology::SameInstance;
        table.row(vec![
            s.store.name().into(),
            fmt_count(s.offered_per_sec),
            s.topology.name().into(),
            format!(
                "{}{}",
                fmt_count(s.achieved_per_sec),
                if s.saturated { " (saturated)" } else { "" }
            ),
            fmt_us(s.rtt.p50_us),
            fmt_us(s.rtt.p90_us),
            fmt_us(s.rtt.p99_us),
            fmt_us(s.rtt.p999_us),
            fmt_us(s.p99_from_schedule_us),
            s.p50_per_round_us
                .iter()
                .map(|v| fmt_us(*v))
                .collect::<Vec<_>>()
                .join(" "),
            if same {
                "-".into()
            } else {
                fmt_ratio(s.p50_vs_same_instance)
            },
            if same {
                "-".into()
            } else {
                fmt_ratio(s.p99_vs_same_instance)
            },
            if same {
                "-".into()
            } else {
                fmt_added(s.p50_added_us)
            },
            if same {
                "-".into()
            } else {
                fmt_added(s.p99_added_us)
            },
            s.check.lost.to_string(),
            s.check.duplicated.to_string(),
            s.check.reordered.to_string(),
            s.errors.to_string(),
        ]);
    }
    table
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn medians_of_odd_and_even_counts() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), Some(2.5));
        assert_eq!(median(&[]), None);
        assert_eq!(median(&[f64::NAN, 1.0]), Some(1.0));
    }

    #[test]
    fn added_latency_is_signed() {
        assert_eq!(fmt_added(Some(120.0)), "+120µs");
        assert_eq!(fmt_added(Some(-1500.0)), "-1.50ms");
        assert_eq!(fmt_added(None), "-");
        assert_eq!(fmt_ratio(Some(0.5)), "0.50x");
    }

    #[test]
    fn groups_are_ordered_by_store_then_topology() {
        let g = groups(
            [
                (SharedStoreKind::RedisCluster, Topology::SameInstance),
                (SharedStoreKind::Redis, Topology::CrossInstance),
                (SharedStoreKind::Redis, Topology::Alone),
                (SharedStoreKind::Redis, Topology::CrossInstance),
            ]
            .into_iter(),
        );
        assert_eq!(
            g,
            vec![
                (SharedStoreKind::Redis, Topology::Alone),
                (SharedStoreKind::Redis, Topology::CrossInstance),
                (SharedStoreKind::RedisCluster, Topology::SameInstance),
            ]
        );
    }
}
