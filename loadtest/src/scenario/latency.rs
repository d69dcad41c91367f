//! `latency`: round-trip time at several offered loads, through the relay
//! and over a direct WSS connection.
//!
//! **Round trip, as measured here.** The caller sends down `Data` frame n
//! stamped with its send time; the callee echoes it at once as up `Data`
//! n - 1 with the same payload; the caller records `receipt - send` on the
//! same monotonic clock (both endpoints live in this process). Through the
//! relay a round trip is four WebSocket hops and two durable appends (caller
//! -> relay -> callee -> relay -> caller); directly it is two hops.
//!
//! The sender is open-loop: frame i is due at `start + i / rate` whatever
//! the answers do, so the offered load is the rate. Besides the round trip
//! from the actual send, each frame's round trip from its *scheduled* send
//! is recorded: it includes any time the sender fell behind (a full window,
//! a late timer), so saturation shows up instead of being hidden
//! (coordinated omission).
//!
//! Offered loads are the given rates plus a fraction (default 50%) of the
//! maximum pipelined throughput of the first relay path, measured in a short
//! probe at the same payload size. Every path gets the same loads.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use futures_util::StreamExt as _;
use oab_testkit::raw_client::RawClient;
use oab_wire::{DelegationKey, Direction, InstanceId, Limits, RequestId};
use serde::Serialize;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::throughput::{self, ThroughputOptions};
use super::{Common, Path, relay_bin, run_header};
use crate::direct::DirectListener;
use crate::endpoint::{
    CalleeRole, PaceSpec, Ws, echo_reader, echoer, finish_delegation, open_delegation, paced_sender,
};
use crate::relay::{RelayUnderTest, StoreKind};
use crate::report::{Percentiles, Report, Table, fmt_count, fmt_size, fmt_us};
use crate::setup::Setup;
use crate::traffic::{CheckReport, DataTemplate, Progress};

/// Options of the latency scenario.
#[derive(Debug, Clone, Serialize)]
pub struct LatencyOptions {
    /// Payload size, bytes (at least 24).
    pub size: usize,
    /// Fixed offered loads, frames per second.
    pub rates: Vec<f64>,
    /// Also offer this fraction of the measured maximum (`None`: do not).
    pub max_fraction: Option<f64>,
    /// The maximum to take the fraction of; `None` measures it.
    pub max_rate: Option<f64>,
    /// Length of the probe that measures the maximum.
    pub probe_seconds: f64,
    /// Sending time per load level.
    pub seconds: f64,
    /// Relay stores to measure (the direct baseline always runs).
    pub stores: Vec<StoreKind>,
    /// Frames sent and not yet echoed at most.
    pub window: u64,
}

/// One load level on one path.
#[derive(Debug, Clone, Serialize)]
pub struct LevelResult {
    /// Direct or relay on a store.
    pub path: Path,
    /// Offered load, frames/s.
    pub offered_per_sec: f64,
    /// Frames actually sent per second.
    pub achieved_per_sec: f64,
    /// Frames sent.
    pub sent: u64,
    /// Round trip from the actual send.
    pub rtt: Percentiles,
    /// Round trip from the scheduled send (coordinated-omission corrected).
    pub rtt_from_schedule: Percentiles,
    /// How late the sender was against its schedule.
    pub send_lateness: Percentiles,
    /// Check of the down log at the callee.
    pub down_check: CheckReport,
    /// Check of the echoes at the caller.
    pub echo_check: CheckReport,
    /// Protocol errors, gaps and closes.
    pub errors: Vec<String>,
}

/// Runs the scenario.
pub async fn run(opts: &LatencyOptions, common: &Common) -> anyhow::Result<Report> {
    let setup = Setup::new(0, common.tuning.clone())?;
    let limits = setup.config.wire_limits();
    let mut levels: Vec<f64> = opts.rates.iter().copied().filter(|r| *r > 0.0).collect();
    let mut probe = serde_json::Value::Null;
    if let Some(fraction) = opts.max_fraction {
        let (max, probed) = match (opts.max_rate, opts.stores.first()) {
            (Some(m), _) => (m, "given".to_string()),
            (None, Some(&store)) => {
                let t = ThroughputOptions {
                    sizes: vec![opts.size],
                    stores: vec![store],
                    seconds: opts.probe_seconds,
                    max_frames: u64::MAX,
                    window: opts.window,
                };
                let relay =
                    RelayUnderTest::start(&setup, &common.relay, store, common.redis_persistence)
                        .await
                        .with_context(|| {
                            format!("starting the relay on the {} store", store.name())
                        })?;
                let case = Box::pin(throughput::relay_case(
                    &relay, &setup, opts.size, 0, &t, common, &limits,
                ))
                .await
                .context("probing the maximum throughput")?;
                relay.stop().await;
                anyhow::ensure!(case.frames_per_sec > 0.0, "the probe measured nothing");
                probe = serde_json::json!({
                    "path": Path::Relay(store).name(),
                    "frames_per_sec": case.frames_per_sec,
                    "seconds": opts.probe_seconds,
                    "check": case.check,
                });
                (case.frames_per_sec, Path::Relay(store).name().to_string())
            }
            (None, None) => anyhow::bail!("--max-fraction needs a relay store or --max-rate"),
        };
        tracing::info!(max_frames_per_sec = max.round(), from = %probed, "maximum for the load levels");
        levels.push((max * fraction).round().max(1.0));
    }
    levels.sort_by(f64::total_cmp);
    levels.dedup();
    anyhow::ensure!(!levels.is_empty(), "no offered load given");

    let mut results = Vec::new();
    let direct = Arc::new(DirectListener::bind(&setup, &setup.config).await?);
    for (i, &rate) in levels.iter().enumerate() {
        let r = Box::pin(direct_level(
            &direct, &setup, rate, i, opts, common, &limits,
        ))
        .await
        .with_context(|| format!("direct, {rate}/s"))?;
        log_level(&r);
        results.push(r);
    }
    for &store in &opts.stores {
        let relay = RelayUnderTest::start(&setup, &common.relay, store, common.redis_persistence)
            .await
            .with_context(|| format!("starting the relay on the {} store", store.name()))?;
        tracing::info!(store = store.name(), pid = ?relay.pid(), addr = %relay.addr(), "relay started");
        for (i, &rate) in levels.iter().enumerate() {
            let r = Box::pin(relay_level(&relay, &setup, rate, i, opts, common, &limits))
                .await
                .with_context(|| {
                    format!(
                        "relay, {} store, {rate}/s; relay log:\n{}",
                        store.name(),
                        relay.log_tail()
                    )
                })?;
            log_level(&r);
            results.push(r);
        }
        relay.stop().await;
    }

    let mut violations = Vec::new();
    for r in &results {
        let what = format!("{} at {}/s", r.path.name(), r.offered_per_sec);
        violations.extend(r.down_check.violations(&format!("{what}, down log")));
        violations.extend(r.echo_check.violations(&format!("{what}, echoes")));
    }
    let mut table = Table::new(
        format!(
            "latency: round trip caller -> callee -> caller, {} payload, {} s per level",
            fmt_size(opts.size),
            opts.seconds
        ),
        &[
            "offered/s",
            "path",
            "achieved/s",
            "p50",
            "p90",
            "p99",
            "p99.9",
            "max",
            "p99 (sched)",
            "lost",
            "errors",
        ],
    );
    let mut sorted: Vec<&LevelResult> = results.iter().collect();
    sorted.sort_by(|a, b| {
        a.offered_per_sec
            .total_cmp(&b.offered_per_sec)
            .then((a.path != Path::Direct).cmp(&(b.path != Path::Direct)))
    });
    for r in sorted {
        table.row(vec![
            fmt_count(r.offered_per_sec),
            r.path.name().into(),
            fmt_count(r.achieved_per_sec),
            fmt_us(r.rtt.p50_us),
            fmt_us(r.rtt.p90_us),
            fmt_us(r.rtt.p99_us),
            fmt_us(r.rtt.p999_us),
            fmt_us(r.rtt.max_us),
            fmt_us(r.rtt_from_schedule.p99_us),
            (r.down_check.lost + r.echo_check.lost).to_string(),
            r.errors.len().to_string(),
        ]);
    }
    let mut json = run_header("latency", common, relay_bin(common).as_deref());
    if let Some(obj) = json.as_object_mut() {
        obj.insert("params".into(), serde_json::to_value(opts)?);
        obj.insert(
            "definition".into(),
            serde_json::json!(
                "round trip: caller sends down Data n stamped with its send time; the callee \
                 echoes it as up Data n-1 with the same payload; rtt = caller receipt - send, \
                 one monotonic clock. Relay: 4 WebSocket hops and 2 durable appends; direct: \
                 2 hops. rtt_from_schedule measures from the frame's scheduled send \
                 (coordinated-omission corrected)."
            ),
        );
        obj.insert("probe".into(), probe);
        obj.insert("levels".into(), serde_json::to_value(&levels)?);
        obj.insert("results".into(), serde_json::to_value(&results)?);
    }
    Ok(Report {
        scenario: "latency",
        tables: vec![table],
        notes: vec![
            "round trip: caller sends down Data n (stamped), callee echoes it as up Data n-1, \
             caller measures receipt - send on one clock. Relay path: 4 WebSocket hops and 2 \
             durable appends; direct: 2 hops."
                .into(),
            "p99 (sched): from the frame's scheduled send time, so a sender held back by a full \
             window or a late timer shows (no coordinated omission). Timers tick per ms."
                .into(),
        ],
        json,
        violations,
    })
}

fn log_level(r: &LevelResult) {
    tracing::info!(
        path = r.path.name(),
        offered = r.offered_per_sec,
        p50_us = r.rtt.p50_us,
        p99_us = r.rtt.p99_us,
        lost = r.down_check.lost + r.echo_check.lost,
        "latency level done"
    );
}

async fn direct_level(
    direct: &Arc<DirectListener>,
    setup: &Setup,
    rate: f64,
    i: usize,
    opts: &LatencyOptions,
    common: &Common,
    limits: &Limits,
) -> anyhow::Result<LevelResult> {
    let key = DelegationKey::new(
        setup.caller.peer.clone(),
        RequestId::new(&format!("lat-direct-{i}")).context("request id")?,
    );
    let (mut a, mut b) = Box::pin(direct.pair()).await?;
    open_delegation(
        &mut a,
        &mut b,
        &key,
        &setup.callee.peer,
        CalleeRole::AckAsRelay,
        limits,
    )
    .await?;
    let (_a, _b, _up, r) = level(a, b, key, Path::Direct, rate, opts, common, limits).await?;
    Ok(r)
}

async fn relay_level(
    relay: &RelayUnderTest,
    setup: &Setup,
    rate: f64,
    i: usize,
    opts: &LatencyOptions,
    common: &Common,
    limits: &Limits,
) -> anyhow::Result<LevelResult> {
    let label = relay.store().name();
    relay_level_between(relay, relay, label, setup, rate, i, opts, common, limits).await
}

/// One load level with the caller on `caller_relay` and the callee on
/// `callee_relay` (the same instance, or two instances of one fleet);
/// `label` is part of the delegation's request id.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn relay_level_between(
    caller_relay: &RelayUnderTest,
    callee_relay: &RelayUnderTest,
    label: &str,
    setup: &Setup,
    rate: f64,
    i: usize,
    opts: &LatencyOptions,
    common: &Common,
    limits: &Limits,
) -> anyhow::Result<LevelResult> {
    let store = caller_relay.store();
    let key = DelegationKey::new(
        setup.caller.peer.clone(),
        RequestId::new(&format!("lat-{label}-{i}-{}", oab_wire::identity::now_ms()))
            .context("request id")?,
    );
    let callee = RawClient::connect(&callee_relay.target(), &setup.callee, InstanceId::random())
        .await
        .context("callee connect")?;
    let caller = RawClient::connect(&caller_relay.target(), &setup.caller, InstanceId::random())
        .await
        .context("caller connect")?;
    let (mut a, mut b) = (caller.ws, callee.ws);
    open_delegation(
        &mut a,
        &mut b,
        &key,
        &setup.callee.peer,
        CalleeRole::BehindRelay,
        limits,
    )
    .await?;
    let (_a, mut b, up, r) = level(
        a,
        b,
        key.clone(),
        Path::Relay(store),
        rate,
        opts,
        common,
        limits,
    )
    .await?;
    if let Err(e) = finish_delegation(&mut b, &key, up + 1, limits).await {
        tracing::warn!(error = %format!("{e:#}"), "could not end the benchmark delegation");
    }
    Ok(r)
}

/// Runs one load level: the paced sender and the echo reader on `a`, the
/// echoer on `b`. Returns `b` and its last up sequence, for the terminal.
#[allow(clippy::too_many_arguments)]
async fn level<A: Ws, B: Ws>(
    a: A,
    b: B,
    key: DelegationKey,
    path: Path,
    rate: f64,
    opts: &LatencyOptions,
    common: &Common,
    limits: &Limits,
) -> anyhow::Result<(Option<A>, B, u64, LevelResult)> {
    let template = DataTemplate::new(&key, Direction::Down, opts.size)?;
    let echoed = Arc::new(Progress::new(1));
    let (last_tx, last_rx) = watch::channel(u64::MAX);
    let stop = CancellationToken::new();
    let callee = tokio::spawn(echoer(b, key.clone(), opts.size, stop.clone(), *limits));
    let (sink, stream) = a.split();
    let mut reader = tokio::spawn(echo_reader(
        stream,
        key.clone(),
        opts.size,
        echoed.clone(),
        last_rx,
        stop.clone(),
        *limits,
    ));
    let spec = PaceSpec {
        template,
        first_seq: 2,
        rate,
        duration: Duration::from_secs_f64(opts.seconds),
        window: opts.window.max(1),
    };
    let (sink, sent) = paced_sender(sink, spec, echoed, last_tx).await;
    let read = match tokio::time::timeout(common.drain, &mut reader).await {
        Ok(r) => r,
        Err(_) => {
            stop.cancel();
            reader.await
        }
    };
    stop.cancel();
    let (stream, echoes) = read.context("the echo reader task failed")?;
    let (b, down) = callee.await.context("the echoer task failed")?;
    let a = stream.reunite(sink).ok();
    let mut errors = echoes.errors;
    errors.extend(down.errors);
    if sent.failed {
        errors.push("the caller's connection failed while sending".into());
    }
    let achieved = if sent.elapsed.is_zero() {
        0.0
    } else {
        sent.sent as f64 / sent.elapsed.as_secs_f64()
    };
    let result = LevelResult {
        path,
        offered_per_sec: rate,
        achieved_per_sec: achieved,
        sent: sent.sent,
        rtt: Percentiles::of(&echoes.rtt),
        rtt_from_schedule: Percentiles::of(&echoes.rtt_from_schedule),
        send_lateness: Percentiles::of(&sent.lateness),
        down_check: down.check.report(2, sent.last_seq),
        echo_check: echoes.check.report(1, sent.last_seq.saturating_sub(1)),
        errors,
    };
    Ok((a, b, down.up_seq, result))
}
