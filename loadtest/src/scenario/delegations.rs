//! `delegations`: whole delegations per second through the relay, connector
//! to connector, and what the connector costs per event compared with raw
//! frames through the same relay in the same run.
//!
//! A caller connector delegates to a callee connector whose in-process
//! executor emits `events` status events and completes. One delegation is:
//! `delegate` (sign, `Open`) -> accepted -> `events` status events -> signed
//! result -> `verify()` on the caller; its round trip is from the
//! `delegate` call to the verified terminal. Each in-flight level keeps that
//! many delegations going (a closed loop: each worker starts the next when
//! its last one is verified) for `seconds` or `max_delegations`.
//!
//! The baseline is the throughput scenario's pipelined raw `Data` frames
//! through the same relay, with the payload size of one status event. The
//! connector's overhead per event is `1/(connector events/s) - 1/(raw
//! frames/s)`, where connector events are every up-log entry a delegation
//! carries (accepted, the status events, the terminal): an upper bound, since
//! it also carries the delegation's open, signing and verification.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::Context as _;
use futures_util::StreamExt as _;
use oab_connector::callee::{Execution, StopReason, TaskExecutor, TaskRun};
use oab_connector::events::UpPayload;
use oab_connector::{Connector, EventKind};
use serde::Serialize;
use tokio::time::Instant;

use super::throughput::{ThroughputOptions, relay_case};
use super::{Common, cpu_seconds, relay_bin, run_header};
use crate::connectors::{AUDIT_CAPACITY, WatchedAudit, new_delegation, start_callee, start_caller};
use crate::endpoint::latency_histogram;
use crate::relay::{RelayUnderTest, StoreKind};
use crate::report::{Percentiles, Report, Table, fmt_count, fmt_us};
use crate::setup::{CALLEE, Setup};

/// The A2A state every status event carries.
const WORKING: &str = "TASK_STATE_WORKING";

pub use super::{DelegationsMode, DelegationsOptions};

/// One in-flight level's figures.
#[derive(Debug, Clone, Serialize)]
pub struct LevelResult {
    /// The relay's store.
    pub store: StoreKind,
    /// Delegations in flight.
    pub in_flight: usize,
    /// Delegations that ended with one verified `completed` terminal.
    pub verified: u64,
    /// Delegations that did not (errors, wrong outcome, failed verification).
    pub failed: u64,
    /// First `delegate` to last verified terminal, seconds.
    pub seconds: f64,
    /// Verified delegations per second.
    pub delegations_per_sec: f64,
    /// Up-log entries (accepted, status events, terminal) delivered per second.
    pub events_per_sec: f64,
    /// `delegate` to verified terminal.
    pub round_trip: Percentiles,
    /// `1e6/events_per_sec - 1e6/raw frames_per_sec`, µs.
    pub overhead_us_per_event: Option<f64>,
    /// CPU time each process used over the level, per verified delegation.
    pub cpu_us_per_delegation: CpuSplit,
    /// The first few failures, described.
    pub errors: Vec<String>,
}

/// CPU time (user + system) of each process the level runs on: seconds so
/// far when sampled, µs per verified delegation in a [`LevelResult`] (where
/// a level's cores went). `None` where it could not be read (or, for the
/// relay, when it runs in this process and is part of `loadtest`).
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct CpuSplit {
    /// This process: both connectors (all signing and verification), and
    /// the relay too with `--relay in-process`.
    pub loadtest: Option<f64>,
    /// The relay's process (`--relay process`).
    pub relay: Option<f64>,
    /// The relay's `redis-server` (`INFO cpu`; the Redis store only).
    pub redis: Option<f64>,
}

impl CpuSplit {
    /// CPU seconds so far of this process, the relay's and its Redis.
    async fn sample(relay: &RelayUnderTest) -> Self {
        Self {
            loadtest: cpu_seconds("self"),
            relay: relay.pid().and_then(|p| cpu_seconds(&p.to_string())),
            redis: relay.redis_cpu_seconds().await.ok(),
        }
    }

    /// From this sample to `later`, per delegation, µs.
    fn per_delegation(&self, later: &Self, delegations: u64) -> Self {
        let per = |a: Option<f64>, b: Option<f64>| match (a, b) {
            (Some(a), Some(b)) if delegations > 0 => Some((b - a) * 1e6 / delegations as f64),
            _ => None,
        };
        Self {
            loadtest: per(self.loadtest, later.loadtest),
            relay: per(self.relay, later.relay),
            redis: per(self.redis, later.redis),
        }
    }
}

/// The raw-frame baseline of one store.
#[derive(Debug, Clone, Serialize)]
pub struct Baseline {
    /// The relay's store.
    pub store: StoreKind,
    /// Payload bytes per frame (one status event's payload).
    pub payload_bytes: usize,
    /// Raw frames per second, pipelined caller -> callee.
    pub frames_per_sec: f64,
    /// Frames lost, duplicated or reordered (must be 0).
    pub violations: Vec<String>,
}

/// What the signatures of one delegation cost on this machine, measured in
/// the run: the ceiling no amount of relay or store speed passes.
#[derive(Debug, Clone, Serialize)]
pub struct SignatureCeiling {
    /// Bytes of the signed message (about a request envelope's).
    pub message_bytes: usize,
    /// One ed25519 signature, µs of one core.
    pub sign_us: f64,
    /// One strict verification (`verify_strict`), µs of one core.
    pub verify_us: f64,
    /// Per delegation: two signatures (request, result) and two strict
    /// verifications (by the callee, by the caller), µs of one core.
    pub per_delegation_us: f64,
    /// Cores this process may use (`available_parallelism`).
    pub cores: usize,
    /// `cores / per_delegation`: delegations per second if the machine
    /// did nothing but their signatures.
    pub delegations_per_sec: f64,
}

/// Bytes signed per signature in [`signature_ceiling`]: about the size of a
/// delegation request envelope's signed bytes.
const SIGNED_MESSAGE_BYTES: usize = 512;

/// Times `Identity::sign` and `PublicKey::verify_strict` (what the
/// connectors call) on one core for about `seconds` each.
pub fn signature_ceiling(
    identity: &oab_wire::identity::Identity,
    seconds: f64,
) -> SignatureCeiling {
    let public = identity.public_key();
    let message = vec![0x5au8; SIGNED_MESSAGE_BYTES];
    let budget = Duration::from_secs_f64(seconds.max(0.01));
    let time = |f: &mut dyn FnMut()| {
        let t = std::time::Instant::now();
        let mut n = 0u64;
        while t.elapsed() < budget {
            for _ in 0..64 {
                f();
            }
            n += 64;
        }
        t.elapsed().as_secs_f64() * 1e6 / n as f64
    };
    let mut signature = identity.sign(&message);
    let sign_us = time(&mut || signature = std::hint::black_box(identity.sign(&message)));
    let mut ok = true;
    let verify_us = time(&mut || ok &= public.verify_strict(&message, &signature));
    debug_assert!(ok);
    let per_delegation_us = 2.0 * sign_us + 2.0 * verify_us;
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    SignatureCeiling {
        message_bytes: message.len(),
        sign_us,
        verify_us,
        per_delegation_us,
        cores,
        delegations_per_sec: cores as f64 * 1e6 / per_delegation_us,
    }
}

/// Emits `events` status events, then completes.
struct Streamer {
    events: u32,
}

impl TaskExecutor for Streamer {
    fn execute(
        &self,
        run: TaskRun,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Execution> + Send>> {
        let n = self.events;
        Box::pin(async move {
            for i in 1..=n {
                if run.cancel.is_cancelled() {
                    return Execution::stopped(StopReason::Cancelled);
                }
                let data = serde_json::json!({ "i": i });
                if run.sink.status(WORKING, None, Some(data)).await.is_err() {
                    return Execution::stopped(StopReason::Error("link stopped".into()));
                }
            }
            Execution::stopped(StopReason::EndTurn)
        })
    }
}

/// The payload of one status event as the executor sends it.
fn status_payload_len(i: u32) -> usize {
    UpPayload::Status {
        state: WORKING.into(),
        message: None,
        data: Some(serde_json::json!({ "i": i })),
    }
    .to_bytes()
    .len()
}

/// Runs the scenario.
pub async fn run(opts: &DelegationsOptions, common: &Common) -> anyhow::Result<Report> {
    if opts.mode == DelegationsMode::Cp {
        return super::delegations_cp::run(opts, common).await;
    }
    let common = &common.for_connectors();
    let setup = Setup::new(0, common.tuning.clone())?;
    let limits = setup.config.wire_limits();
    // Raw frames are at least a stamp long.
    let payload = status_payload_len(opts.events.max(1)).max(crate::traffic::STAMP_LEN);
    let mut levels = Vec::new();
    let mut baselines = Vec::new();
    let mut violations = Vec::new();
    // Before any relay runs: the signatures alone, on the same cores.
    let ceiling = tokio::task::spawn_blocking({
        let identity = setup.caller.clone();
        move || signature_ceiling(&identity, 0.5)
    })
    .await
    .context("signature timing task")?;
    tracing::info!(
        sign_us = format!("{:.1}", ceiling.sign_us),
        verify_us = format!("{:.1}", ceiling.verify_us),
        ceiling = ceiling.delegations_per_sec.round(),
        "signature-bound ceiling measured"
    );
    for &store in &opts.stores {
        let relay = RelayUnderTest::start(&setup, &common.relay, store, common.redis_persistence)
            .await
            .with_context(|| format!("starting the relay on the {} store", store.name()))?;
        tracing::info!(store = store.name(), pid = ?relay.pid(), addr = %relay.addr(), "relay started");

        // The raw baseline first, on a fresh relay, with the same payload size.
        let tp = ThroughputOptions {
            sizes: vec![payload],
            stores: vec![store],
            seconds: opts.baseline_seconds,
            max_frames: 5_000_000,
            window: 1024,
        };
        let raw = Box::pin(relay_case(&relay, &setup, payload, 0, &tp, common, &limits))
            .await
            .context("raw-frame baseline")?;
        let what = format!("raw baseline {}", store.name());
        let base = Baseline {
            store,
            payload_bytes: payload,
            frames_per_sec: raw.frames_per_sec,
            violations: raw.check.violations(&what),
        };
        violations.extend(base.violations.iter().cloned());

        let audit = Arc::new(WatchedAudit::new(AUDIT_CAPACITY));
        let callee = start_callee(
            &setup,
            relay.addr(),
            Arc::new(Streamer {
                events: opts.events,
            }),
            audit,
        )?;
        let caller = Arc::new(start_caller(&setup, relay.addr())?);
        caller.connected().await.context("caller connect")?;
        callee.connected().await.context("callee connect")?;
        for &n in &opts.in_flight {
            let before = CpuSplit::sample(&relay).await;
            let mut r = Box::pin(level(&caller, store, n, opts, common.drain)).await;
            r.cpu_us_per_delegation =
                before.per_delegation(&CpuSplit::sample(&relay).await, r.verified);
            r.overhead_us_per_event = (r.events_per_sec > 0.0 && base.frames_per_sec > 0.0)
                .then(|| 1e6 / r.events_per_sec - 1e6 / base.frames_per_sec);
            tracing::info!(
                store = store.name(),
                in_flight = n,
                per_sec = r.delegations_per_sec.round(),
                failed = r.failed,
                "delegations level done"
            );
            if r.failed > 0 {
                violations.push(format!(
                    "{} in flight {n}: {} delegation(s) without exactly one verified terminal \
                     (first: {})",
                    store.name(),
                    r.failed,
                    r.errors.first().map_or("-", String::as_str)
                ));
            }
            levels.push(r);
        }
        baselines.push(base);
        if let Ok(c) = Arc::try_unwrap(caller) {
            c.shutdown().await;
        }
        callee.shutdown().await;
        relay.stop().await;
    }

    let mut table = Table::new(
        format!(
            "delegations: caller connector -> relay -> callee connector, {} status events each, \
             {} s per level",
            opts.events, opts.seconds
        ),
        &[
            "store",
            "in flight",
            "deleg/s",
            "events/s",
            "raw frames/s",
            "overhead/event",
            "vs sig ceiling",
            "rtt p50",
            "rtt p99",
            "verified",
            "failed",
            "cpu µs/d: lt",
            "relay",
            "redis",
        ],
    );
    for r in &levels {
        let raw = baselines
            .iter()
            .find(|b| b.store == r.store)
            .map_or(0.0, |b| b.frames_per_sec);
        table.row(vec![
            r.store.name().into(),
            r.in_flight.to_string(),
            fmt_count(r.delegations_per_sec),
            fmt_count(r.events_per_sec),
            fmt_count(raw),
            r.overhead_us_per_event
                .map_or("-".into(), |v| format!("{v:.1}µs")),
            format!(
                "{:.2}",
                r.delegations_per_sec / ceiling.delegations_per_sec.max(f64::MIN_POSITIVE)
            ),
            fmt_us(r.round_trip.p50_us),
            fmt_us(r.round_trip.p99_us),
            fmt_count(r.verified as f64),
            r.failed.to_string(),
            fmt_cpu(r.cpu_us_per_delegation.loadtest),
            fmt_cpu(r.cpu_us_per_delegation.relay),
            fmt_cpu(r.cpu_us_per_delegation.redis),
        ]);
    }
    let mut json = run_header("delegations", common, relay_bin(common).as_deref());
    if let Some(obj) = json.as_object_mut() {
        obj.insert("params".into(), serde_json::to_value(opts)?);
        obj.insert("baselines".into(), serde_json::to_value(&baselines)?);
        obj.insert("levels".into(), serde_json::to_value(&levels)?);
        obj.insert("signature_ceiling".into(), serde_json::to_value(&ceiling)?);
        let ratios: Vec<serde_json::Value> = levels
            .iter()
            .map(|r| {
                serde_json::json!({
                    "store": r.store,
                    "in_flight": r.in_flight,
                    "delegations_per_sec": r.delegations_per_sec,
                    "vs_signature_ceiling": r.delegations_per_sec / ceiling.delegations_per_sec,
                })
            })
            .collect();
        obj.insert("vs_signature_ceiling".into(), ratios.into());
    }
    Ok(Report {
        scenario: "delegations",
        tables: vec![table],
        notes: vec![
            "deleg/s: delegations with one verified completed terminal per second (closed \
             loop: each in-flight slot starts the next delegation when its last is verified)."
                .into(),
            format!(
                "events/s: up-log entries delivered (accepted + {} status + terminal per \
                 delegation). raw frames/s: pipelined raw Data frames of the same payload size \
                 ({payload} B) through the same relay, window 1024.",
                opts.events
            ),
            format!(
                "vs sig ceiling: deleg/s / (cores / cost of 2 ed25519 signatures + 2 strict \
                 verifications of {} B), measured in this run on one core: sign {:.1} µs, \
                 verify {:.1} µs, {:.1} µs per delegation, {} cores: ceiling {}/s.",
                ceiling.message_bytes,
                ceiling.sign_us,
                ceiling.verify_us,
                ceiling.per_delegation_us,
                ceiling.cores,
                fmt_count(ceiling.delegations_per_sec)
            ),
            "overhead/event: 1/(events/s) - 1/(raw frames/s); an upper bound on the \
             connector's cost per event, as it includes each delegation's open, signing and \
             verification."
                .into(),
            "cpu µs/d: CPU time (user + system) over the level / its verified delegations: lt \
             this process (both connectors, all signing and verification; with --relay \
             in-process the relay too), relay its process, redis its redis-server (INFO cpu). \
             The level's wind-down (the last delegations finishing) is included."
                .into(),
        ],
        json,
        violations,
    })
}

/// Keeps `n` delegations in flight for the level's time or count.
async fn level(
    caller: &Arc<Connector>,
    store: StoreKind,
    n: usize,
    opts: &DelegationsOptions,
    wait: Duration,
) -> LevelResult {
    let deadline = Instant::now() + Duration::from_secs_f64(opts.seconds);
    let started = AtomicU64::new(0);
    let started = Arc::new(started);
    let t0 = Instant::now();
    let mut workers = tokio::task::JoinSet::new();
    for w in 0..n.max(1) {
        let (caller, started) = (caller.clone(), started.clone());
        let (max, events) = (opts.max_delegations, opts.events);
        workers.spawn(async move {
            let mut rtt = latency_histogram();
            let mut errors = Vec::new();
            let (mut ok, mut last) = (0u64, None);
            while Instant::now() < deadline && started.fetch_add(1, Ordering::Relaxed) < max {
                let t = Instant::now();
                match one(&caller, events, w, wait).await {
                    Ok(()) => {
                        ok += 1;
                        let now = Instant::now();
                        let _ = rtt.record(now.duration_since(t).as_nanos() as u64);
                        last = Some(now);
                    }
                    Err(e) => errors.push(format!("{e:#}")),
                }
            }
            (ok, errors, rtt, last)
        });
    }
    let mut rtt = latency_histogram();
    let mut errors = Vec::new();
    let (mut verified, mut failed, mut last) = (0u64, 0u64, None::<Instant>);
    while let Some(joined) = workers.join_next().await {
        match joined {
            Ok((ok, errs, h, l)) => {
                verified += ok;
                failed += errs.len() as u64;
                errors.extend(errs.into_iter().take(5));
                let _ = rtt.add(&h);
                last = last.max(l);
            }
            Err(e) => {
                failed += 1;
                errors.push(format!("worker task: {e}"));
            }
        }
    }
    errors.truncate(10);
    let seconds = last.map_or(0.0, |l| l.duration_since(t0).as_secs_f64());
    let per_sec = |x: f64| if seconds > 0.0 { x / seconds } else { 0.0 };
    LevelResult {
        store,
        in_flight: n,
        verified,
        failed,
        seconds,
        delegations_per_sec: per_sec(verified as f64),
        events_per_sec: per_sec((verified * (u64::from(opts.events) + 2)) as f64),
        round_trip: Percentiles::of(&rtt),
        overhead_us_per_event: None,
        cpu_us_per_delegation: CpuSplit::default(),
        errors,
    }
}

/// One delegation: delegate, read every event to the terminal, verify it.
async fn one(
    caller: &Connector,
    events: u32,
    worker: usize,
    wait_for: Duration,
) -> anyhow::Result<()> {
    let callee = oab_wire::PeerId::new(CALLEE).context("callee peer id")?;
    let h = caller
        .caller()
        .delegate(&callee, new_delegation(format!("bench {worker}")))
        .await
        .context("delegate")?;
    let mut stream = caller.caller().events(&h, 0).await.context("events")?;
    let (mut statuses, mut terminals) = (0u32, 0u32);
    let wait = async {
        while let Some(item) = stream.next().await {
            let ev = item.context("event stream")?;
            match &ev.kind {
                EventKind::Status { .. } => statuses += 1,
                EventKind::Terminal(t) => {
                    terminals += 1;
                    if t.outcome != oab_wire::Outcome::Completed {
                        anyhow::bail!("{}: outcome {:?}", h.key, t.outcome);
                    }
                    caller.caller().verify(&h, t).context("verify")?;
                    // Processed: as an application does, commit it, which
                    // releases the delegation at the relay (compacted).
                    caller.caller().commit(&h, &ev).await.context("commit")?;
                }
                _ => {}
            }
        }
        Ok(())
    };
    tokio::time::timeout(wait_for, wait).await.map_err(|_| {
        anyhow::anyhow!(
            "{}: no terminal within {wait_for:?} (--drain-seconds)",
            h.key
        )
    })??;
    if terminals != 1 || statuses != events {
        anyhow::bail!(
            "{}: {terminals} terminal(s) and {statuses} status event(s), expected 1 and {events}",
            h.key
        );
    }
    Ok(())
}

/// A CPU-per-delegation figure, or `-` where there is none.
fn fmt_cpu(us: Option<f64>) -> String {
    us.map_or_else(|| "-".into(), |v| format!("{v:.0}"))
}
