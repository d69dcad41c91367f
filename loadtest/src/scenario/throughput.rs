//! `throughput`: how many frames per second, and how many payload megabytes
//! per second, go from the caller to the callee for each payload size:
//! through the relay on each store, and over a direct WSS connection between
//! the same two endpoints (the physical baseline), in the same run.
//!
//! Each case opens a fresh delegation and pipelines `Data` frames on its down
//! log for `seconds` (or `max_frames`): the sender keeps at most `window`
//! frames beyond the highest sequence that is both acknowledged and received
//! (see [`pipelined_sender`]); the receiver checks every frame. The rate is
//! frames received / (time of the last frame received - time of the first
//! frame sent). After the case the callee sends a terminal, so the relay
//! releases the delegation before the next case.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use oab_testkit::raw_client::RawClient;
use oab_wire::{DelegationKey, Direction, InstanceId, Limits, RequestId};
use serde::Serialize;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::{Common, Path, cpu_seconds, relay_bin, run_header};
use crate::direct::DirectListener;
use crate::endpoint::{
    CalleeRole, PipelineSpec, Ws, counting_receiver, finish_delegation, open_delegation,
    pipelined_sender,
};
use crate::relay::{RelayUnderTest, StoreKind};
use crate::report::{Percentiles, Report, Table, fmt_count, fmt_size, fmt_us};
use crate::setup::Setup;
use crate::traffic::{CheckReport, DataTemplate, Progress, StreamCheck};
use crate::xadd::Via;

/// Options of the throughput scenario.
#[derive(Debug, Clone, Serialize)]
pub struct ThroughputOptions {
    /// Payload sizes, bytes (each at least 24).
    pub sizes: Vec<usize>,
    /// Relay stores to measure (the direct baseline always runs).
    pub stores: Vec<StoreKind>,
    /// Sending time per case.
    pub seconds: f64,
    /// Frames per case at most.
    pub max_frames: u64,
    /// Unconfirmed frames in flight at most (capped by the relay's
    /// announced `max_in_flight`).
    pub window: u64,
}

/// One case's figures.
#[derive(Debug, Clone, Serialize)]
pub struct CaseResult {
    /// Direct or relay on a store.
    pub path: Path,
    /// Payload bytes per frame.
    pub payload_bytes: usize,
    /// Bytes per frame on the wire (8-byte prefix, header, payload), before
    /// WebSocket and TLS framing.
    pub frame_bytes: usize,
    /// The window used.
    pub window: u64,
    /// Frames sent.
    pub sent: u64,
    /// The last sequence sent (the first is 2: the `Open` is 1).
    pub last_seq: u64,
    /// Highest sequence acknowledged at the end.
    pub acked_seq: u64,
    /// First send to last receipt, seconds.
    pub seconds: f64,
    /// Distinct frames received per second.
    pub frames_per_sec: f64,
    /// Payload megabytes (10^6 bytes) per second.
    pub payload_mb_per_sec: f64,
    /// Frame megabytes per second.
    pub frame_mb_per_sec: f64,
    /// Relay frames/s divided by direct frames/s for this size.
    pub vs_direct: Option<f64>,
    /// Redis store only: relay frames/s divided by the same `redis-server`'s
    /// own pipelined `XADD` rate for entries of this frame length, measured
    /// in the same run ([`crate::xadd`]).
    pub vs_xadd: Option<f64>,
    /// One-way delay under this saturating load (send stamp to receipt).
    pub one_way: Percentiles,
    /// Times the sender waited for the window.
    pub window_waits: u64,
    /// Whether all frames were acknowledged and received within the drain.
    pub drained: bool,
    /// The correctness check.
    pub check: CheckReport,
    /// Protocol errors, gaps and closes seen.
    pub errors: Vec<String>,
    /// CPU seconds the relay process used during the case (process mode;
    /// every relay instance together in the cross-instance scenario).
    pub relay_cpu_s: Option<f64>,
    /// CPU seconds this tool used during the case.
    pub tool_cpu_s: Option<f64>,
    /// Relay CPU per frame, µs (process mode).
    pub relay_cpu_us_per_frame: Option<f64>,
}

/// Runs the scenario.
pub async fn run(opts: &ThroughputOptions, common: &Common) -> anyhow::Result<Report> {
    let mut tuning = common.tuning.clone();
    let largest = opts.sizes.iter().copied().max().unwrap_or(0);
    tuning.max_payload = tuning
        .max_payload
        .max(u32::try_from(largest).unwrap_or(u32::MAX));
    let setup = Setup::new(0, tuning)?;
    let limits = setup.config.wire_limits();
    let mut results: Vec<CaseResult> = Vec::new();
    let mut relay_pids = serde_json::Map::new();
    let mut xadds: Vec<(usize, crate::xadd::XaddResult)> = Vec::new();
    // The same XADDs from a script that does nothing else.
    let mut floors: Vec<(usize, crate::xadd::XaddResult)> = Vec::new();

    let direct = Arc::new(DirectListener::bind(&setup, &setup.config).await?);
    for &size in &opts.sizes {
        let r = Box::pin(direct_case(&direct, &setup, size, opts, common, &limits))
            .await
            .with_context(|| format!("direct case, {size} B"))?;
        log_case(&r);
        results.push(r);
    }
    for &store in &opts.stores {
        let relay = RelayUnderTest::start(&setup, &common.relay, store, common.redis_persistence)
            .await
            .with_context(|| format!("starting the relay on the {} store", store.name()))?;
        tracing::info!(store = store.name(), pid = ?relay.pid(), addr = %relay.addr(), "relay started");
        relay_pids.insert(store.name().into(), serde_json::json!(relay.pid()));
        for (n, &size) in opts.sizes.iter().enumerate() {
            let r = Box::pin(relay_case(&relay, &setup, size, n, opts, common, &limits))
                .await
                .with_context(|| {
                    format!(
                        "relay case, {} store, {size} B; relay log:\n{}",
                        store.name(),
                        relay.log_tail()
                    )
                })?;
            log_case(&r);
            results.push(r);
        }
        if let Some(socket) = relay.redis_socket() {
            // Redis on its own, on the same server, right after the relay's
            // cases (the relay idles meanwhile).
            for &size in &opts.sizes {
                let frame_bytes = results
                    .iter()
                    .find(|r| r.path == Path::Relay(store) && r.payload_bytes == size)
                    .map_or(size, |r| r.frame_bytes);
                for via in [Via::Commands, Via::Script] {
                    let x = crate::xadd::measure(
                        via,
                        &socket,
                        &format!("oab:bench:xadd:{size}"),
                        frame_bytes,
                        setup.tuning.max_log_entries,
                        opts.window,
                        opts.seconds,
                        opts.max_frames,
                    )
                    .await
                    .with_context(|| format!("redis XADD baseline ({via:?}), {size} B"))?;
                    tracing::info!(
                        payload = size,
                        ?via,
                        per_sec = x.per_sec.round(),
                        "redis XADD baseline done"
                    );
                    match via {
                        Via::Commands => xadds.push((size, x)),
                        Via::Script => floors.push((size, x)),
                    }
                }
            }
        }
        relay.stop().await;
    }
    for r in results
        .iter_mut()
        .filter(|r| r.path == Path::Relay(StoreKind::Redis))
    {
        r.vs_xadd = xadds
            .iter()
            .find(|(s, x)| *s == r.payload_bytes && x.per_sec > 0.0)
            .map(|(_, x)| r.frames_per_sec / x.per_sec);
    }

    // Ratios against the direct baseline of the same size.
    let direct_fps: Vec<(usize, f64)> = results
        .iter()
        .filter(|r| r.path == Path::Direct)
        .map(|r| (r.payload_bytes, r.frames_per_sec))
        .collect();
    for r in results.iter_mut().filter(|r| r.path != Path::Direct) {
        r.vs_direct = direct_fps
            .iter()
            .find(|(s, _)| *s == r.payload_bytes)
            .filter(|(_, d)| *d > 0.0)
            .map(|(_, d)| r.frames_per_sec / d);
    }

    let mut violations = Vec::new();
    for r in &results {
        let what = format!("{} {}", r.path.name(), fmt_size(r.payload_bytes));
        violations.extend(r.check.violations(&what));
    }

    let mut table = Table::new(
        format!(
            "throughput: pipelined Data frames caller -> callee, {} s per case, window {}",
            opts.seconds, opts.window
        ),
        &[
            "payload",
            "path",
            "frames/s",
            "MB/s",
            "vs direct",
            "vs XADD",
            "frames",
            "one-way p50",
            "one-way p99",
            "relay CPU/frame",
            "lost",
            "dup",
            "reord",
            "errors",
        ],
    );
    let mut sorted: Vec<&CaseResult> = results.iter().collect();
    sorted.sort_by_key(|r| (r.payload_bytes, r.path != Path::Direct));
    for r in sorted {
        table.row(vec![
            fmt_size(r.payload_bytes),
            r.path.name().into(),
            fmt_count(r.frames_per_sec),
            format!("{:.1}", r.payload_mb_per_sec),
            r.vs_direct.map_or("-".into(), |v| format!("{v:.2}x")),
            r.vs_xadd.map_or("-".into(), |v| format!("{v:.2}x")),
            fmt_count(r.check.received as f64),
            fmt_us(r.one_way.p50_us),
            fmt_us(r.one_way.p99_us),
            r.relay_cpu_us_per_frame
                .map_or("-".into(), |v| format!("{v:.1}µs")),
            r.check.lost.to_string(),
            r.check.duplicated.to_string(),
            r.check.reordered.to_string(),
            r.errors.len().to_string(),
        ]);
        if r.path == Path::Relay(StoreKind::Redis)
            && let Some((_, x)) = xadds.iter().find(|(s, _)| *s == r.payload_bytes)
        {
            table.row(baseline_row(
                r.payload_bytes,
                "redis XADD alone",
                x,
                Some(1.0),
            ));
            if let Some((_, f)) = floors.iter().find(|(s, _)| *s == r.payload_bytes) {
                let vs = ratio(f.per_sec, x.per_sec);
                table.row(baseline_row(r.payload_bytes, "XADD in a script", f, vs));
            }
        }
    }
    let mut json = run_header("throughput", common, relay_bin(common).as_deref());
    if let Some(obj) = json.as_object_mut() {
        obj.insert("params".into(), serde_json::to_value(opts)?);
        obj.insert("relay_pids".into(), relay_pids.into());
        obj.insert("cases".into(), serde_json::to_value(&results)?);
        let xadd: Vec<serde_json::Value> = xadds
            .iter()
            .map(|(size, x)| {
                let relay = results
                    .iter()
                    .find(|r| r.path == Path::Relay(StoreKind::Redis) && r.payload_bytes == *size);
                let floor = floors.iter().find(|(s, _)| s == size).map(|(_, f)| f);
                serde_json::json!({
                    "payload_bytes": size,
                    "xadd": x,
                    "script_xadd": floor,
                    "script_xadd_vs_xadd": floor.and_then(|f| ratio(f.per_sec, x.per_sec)),
                    "relay_frames_per_sec": relay.map(|r| r.frames_per_sec),
                    "relay_vs_xadd": relay.and_then(|r| r.vs_xadd),
                })
            })
            .collect();
        obj.insert("redis_xadd_baseline".into(), xadd.into());
    }
    Ok(Report {
        scenario: "throughput",
        tables: vec![table],
        notes: vec![
            "frames/s: distinct frames received / (last receipt - first send). MB/s: payload \
             bytes (10^6). vs direct: relay frames/s / direct frames/s for the same size."
                .into(),
            "one-way: send stamp to receipt on one clock, under this saturating load (queueing \
             included). relay CPU/frame: relay process CPU time / frames (process mode)."
                .into(),
            "vs XADD (Redis store): relay frames/s / the same redis-server's own pipelined XADD \
             rate (one stream, entries as long as the frames, MAXLEN as the relay's, chunks of \
             256, the same window), measured right after the relay's cases. XADD in a script: \
             the same XADDs made by a Lua script that does nothing else (one EVAL per chunk, \
             the chunk's entries as its arguments): what any script-based append reaches on \
             this server."
                .into(),
            "the window is advanced by acks (relay: durable; direct: received) and bounded by \
             the receiver's progress; all endpoints and the relay share this machine's CPUs."
                .into(),
        ],
        json,
        violations,
    })
}

fn log_case(r: &CaseResult) {
    tracing::info!(
        path = r.path.name(),
        payload = r.payload_bytes,
        frames_per_sec = r.frames_per_sec.round(),
        mb_per_sec = format!("{:.1}", r.payload_mb_per_sec),
        lost = r.check.lost,
        errors = r.errors.len(),
        "throughput case done"
    );
}

fn request_id(text: String) -> anyhow::Result<RequestId> {
    RequestId::new(&text).with_context(|| format!("request id {text:?}"))
}

async fn direct_case(
    direct: &Arc<DirectListener>,
    setup: &Setup,
    size: usize,
    opts: &ThroughputOptions,
    common: &Common,
    limits: &Limits,
) -> anyhow::Result<CaseResult> {
    let key = DelegationKey::new(
        setup.caller.peer.clone(),
        request_id(format!("tp-direct-{size}"))?,
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
    let (_a, _b, result) = pair(
        a,
        b,
        key,
        size,
        opts.window,
        Path::Direct,
        CalleeRole::AckAsRelay,
        opts,
        common,
        limits,
        &[],
    )
    .await?;
    Ok(result)
}

/// One relay case (also the latency scenario's probe of the maximum).
pub(crate) async fn relay_case(
    relay: &RelayUnderTest,
    setup: &Setup,
    size: usize,
    n: usize,
    opts: &ThroughputOptions,
    common: &Common,
    limits: &Limits,
) -> anyhow::Result<CaseResult> {
    let pids: Vec<u32> = relay.pid().into_iter().collect();
    let ends = RelayEnds {
        caller: relay,
        callee: relay,
        cpu_pids: &pids,
        label: relay.store().name(),
    };
    Box::pin(relay_case_between(
        &ends, setup, size, n, opts, common, limits,
    ))
    .await
}

/// Where a relay case's two endpoints connect, and which relay processes
/// its CPU figure covers.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RelayEnds<'a> {
    /// The instance the caller connects to.
    pub caller: &'a RelayUnderTest,
    /// The instance the callee connects to (the caller's for one relay).
    pub callee: &'a RelayUnderTest,
    /// Relay processes whose CPU time is summed (empty: none measured).
    pub cpu_pids: &'a [u32],
    /// Part of the delegation's request id.
    pub label: &'a str,
}

/// One relay case with caller and callee on the instances `ends` names.
pub(crate) async fn relay_case_between(
    ends: &RelayEnds<'_>,
    setup: &Setup,
    size: usize,
    n: usize,
    opts: &ThroughputOptions,
    common: &Common,
    limits: &Limits,
) -> anyhow::Result<CaseResult> {
    let store = ends.caller.store();
    let key = DelegationKey::new(
        setup.caller.peer.clone(),
        request_id(format!(
            "tp-{}-{size}-{n}-{}",
            ends.label,
            oab_wire::identity::now_ms()
        ))?,
    );
    let callee = RawClient::connect(&ends.callee.target(), &setup.callee, InstanceId::random())
        .await
        .context("callee connect")?;
    let caller = RawClient::connect(&ends.caller.target(), &setup.caller, InstanceId::random())
        .await
        .context("caller connect")?;
    let window = opts
        .window
        .min(u64::from(caller.welcome.max_in_flight))
        .max(1);
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
    let (a, mut b, result) = pair(
        a,
        b,
        key.clone(),
        size,
        window,
        Path::Relay(store),
        CalleeRole::BehindRelay,
        opts,
        common,
        limits,
        ends.cpu_pids,
    )
    .await?;
    if let Err(e) = finish_delegation(&mut b, &key, 1, limits).await {
        tracing::warn!(error = %format!("{e:#}"), "could not end the benchmark delegation");
    }
    close(a).await;
    close(Some(b)).await;
    Ok(result)
}

async fn close<W: Ws>(ws: Option<W>) {
    use futures_util::SinkExt as _;
    if let Some(mut ws) = ws {
        let _ = tokio::time::timeout(Duration::from_secs(2), ws.close()).await;
    }
}

/// CPU seconds of the relay processes `pids` together (`None`: none given,
/// or one not readable).
fn relays_cpu_seconds(pids: &[u32]) -> Option<f64> {
    if pids.is_empty() {
        return None;
    }
    pids.iter().map(|p| cpu_seconds(&p.to_string())).sum()
}

/// Runs the sender on `a` and the counting receiver on `b`.
#[allow(clippy::too_many_arguments)]
async fn pair<A: Ws, B: Ws>(
    a: A,
    b: B,
    key: DelegationKey,
    size: usize,
    window: u64,
    path: Path,
    role: CalleeRole,
    opts: &ThroughputOptions,
    common: &Common,
    limits: &Limits,
    relay_pids: &[u32],
) -> anyhow::Result<(Option<A>, B, CaseResult)> {
    let template = DataTemplate::new(&key, Direction::Down, size)?;
    let received = Arc::new(Progress::new(1));
    let (last_tx, last_rx) = watch::channel(u64::MAX);
    let stop = CancellationToken::new();
    let mut receiver = tokio::spawn(counting_receiver(
        b,
        key.clone(),
        StreamCheck::new(2, size, 0),
        received.clone(),
        role,
        last_rx,
        stop.clone(),
        *limits,
    ));
    let relay_cpu0 = relays_cpu_seconds(relay_pids);
    let tool_cpu0 = cpu_seconds("self");
    let frame_bytes = template.frame_len();
    let spec = PipelineSpec {
        template,
        first_seq: 2,
        window,
        deadline: Instant::now() + Duration::from_secs_f64(opts.seconds),
        max_frames: opts.max_frames,
        drain: common.drain,
    };
    // On the relay path the receiver's progress bounds the window too.
    let e2e = (role == CalleeRole::BehindRelay).then(|| received.clone());
    let (a, sent) = pipelined_sender(a, spec, e2e, last_tx, *limits).await;
    let joined = match tokio::time::timeout(common.drain, &mut receiver).await {
        Ok(r) => r,
        Err(_) => {
            stop.cancel();
            receiver.await
        }
    };
    let (b, recv) = joined.context("the receiver task failed")?;
    let relay_cpu = relays_cpu_seconds(relay_pids)
        .zip(relay_cpu0)
        .map(|(b, a)| b - a);
    let tool_cpu = cpu_seconds("self").zip(tool_cpu0).map(|(b, a)| b - a);
    let frames = recv.check.received();
    let seconds = recv
        .last_at
        .map_or(0.0, |t| t.duration_since(sent.started).as_secs_f64());
    let per_sec = |n: f64| if seconds > 0.0 { n / seconds } else { 0.0 };
    let mut errors = sent.errors;
    errors.extend(recv.errors);
    Ok((
        a,
        b,
        CaseResult {
            path,
            payload_bytes: size,
            frame_bytes,
            window,
            sent: (sent.last_seq + 1).saturating_sub(2),
            last_seq: sent.last_seq,
            acked_seq: sent.acked,
            seconds,
            frames_per_sec: per_sec(frames as f64),
            payload_mb_per_sec: per_sec(recv.payload_bytes as f64) / 1e6,
            frame_mb_per_sec: per_sec((frames * frame_bytes as u64) as f64) / 1e6,
            vs_direct: None,
            vs_xadd: None,
            one_way: Percentiles::of(&recv.one_way),
            window_waits: sent.window_waits,
            drained: sent.drained,
            check: recv.check.report(2, sent.last_seq),
            errors,
            relay_cpu_s: relay_cpu,
            tool_cpu_s: tool_cpu,
            relay_cpu_us_per_frame: relay_cpu
                .filter(|_| frames > 0)
                .map(|c| c * 1e6 / frames as f64),
        },
    ))
}

/// A table row for one of Redis's own rates: frames/s, MB/s, its ratio
/// to the plain `XADD`s, the entries appended.
fn baseline_row(
    payload: usize,
    name: &str,
    x: &crate::xadd::XaddResult,
    vs_xadd: Option<f64>,
) -> Vec<String> {
    let mut row = vec![
        fmt_size(payload),
        name.into(),
        fmt_count(x.per_sec),
        format!("{:.1}", x.per_sec * payload as f64 / 1e6),
        "-".into(),
        vs_xadd.map_or("-".into(), |v| format!("{v:.2}x")),
        fmt_count(x.appended as f64),
    ];
    row.extend(std::iter::repeat_n("-".to_string(), 6));
    row
}

/// `a / b`, when `b` is a rate.
fn ratio(a: f64, b: f64) -> Option<f64> {
    (b > 0.0).then(|| a / b)
}
