//! `sessions`: what an idle authenticated session costs the relay, and how
//! fast it authenticates new ones.
//!
//! Every session is a different configured peer (its own identity in the
//! generated config), so none replaces another. The relay's resident memory
//! (`VmRSS` of its process) is read before the first session and after the
//! last one is authenticated; the difference divided by the sessions is the
//! memory per idle session. Handshakes per second is sessions / time to open
//! them all, `concurrency` at a time (TCP, TLS 1.3, WebSocket upgrade,
//! challenge, signed hello, welcome). Then every session must answer a
//! `Ping` (a lost session is a correctness failure), they are closed, and
//! the memory is read once more, then sampled for `settle_seconds`: a relay
//! that survived the storm must give most of its memory back
//! ([`MAX_KEPT_FRACTION`]), not keep the peak for ever.

use std::time::Duration;

use anyhow::Context as _;
use futures_util::StreamExt as _;
use oab_testkit::raw_client::RawClient;
use oab_wire::{Frame, InstanceId, Ping};
use serde::Serialize;
use tokio::time::Instant;

use super::{Common, cpu_seconds, relay_bin, run_header};
use crate::endpoint::latency_histogram;
use crate::relay::{RelayUnderTest, StoreKind};
use crate::report::{Percentiles, Report, Table, fmt_bytes, fmt_count, fmt_us};
use crate::setup::Setup;

/// How long all sessions together may take to answer their pings.
const PING_BOUND: Duration = Duration::from_secs(60);

/// Of the memory the open sessions added, the share the relay may still hold
/// `settle_seconds` after they all closed (a `--check` bound, process mode
/// only): 25%, where an allocator that keeps freed memory keeps about all.
pub const MAX_KEPT_FRACTION: f64 = 0.25;

/// How often the relay's RSS is sampled while it settles.
const SETTLE_SAMPLE: Duration = Duration::from_millis(250);

/// Options of the sessions scenario.
#[derive(Debug, Clone, Serialize)]
pub struct SessionsOptions {
    /// Idle sessions to open.
    pub sessions: usize,
    /// Handshakes in progress at once.
    pub concurrency: usize,
    /// The relay's store.
    pub store: StoreKind,
    /// After the last close, seconds the relay's RSS is sampled for.
    pub settle_seconds: f64,
}

/// The scenario's figures.
#[derive(Debug, Clone, Serialize)]
pub struct SessionsResult {
    /// Sessions authenticated.
    pub opened: usize,
    /// Handshakes that failed.
    pub failed: usize,
    /// The first few failures.
    pub failures: Vec<String>,
    /// Seconds to open them all.
    pub open_seconds: f64,
    /// Authenticated sessions per second.
    pub handshakes_per_sec: f64,
    /// Time per connect (TCP + TLS + upgrade + handshake), as seen by a
    /// client while `concurrency` ran at once.
    pub connect: Percentiles,
    /// Relay CPU per handshake, µs (process mode).
    pub relay_cpu_us_per_handshake: Option<f64>,
    /// Relay RSS before the first session, bytes.
    pub rss_before: Option<u64>,
    /// Relay RSS with every session open and idle, bytes.
    pub rss_open: Option<u64>,
    /// (rss_open - rss_before) / opened, bytes.
    pub rss_per_session: Option<f64>,
    /// Relay RSS after every session closed, bytes.
    pub rss_after_close: Option<u64>,
    /// Relay RSS at the end of the settle time, bytes.
    pub rss_settled: Option<u64>,
    /// (rss_settled - rss_before) / (rss_open - rss_before): the share of
    /// the sessions' memory the relay still holds.
    pub kept_fraction: Option<f64>,
    /// Whether the RSS is the relay's own process (else this whole process).
    pub rss_relay_only: bool,
    /// Sessions that answered a ping after all were open.
    pub alive: usize,
}

/// Runs the scenario.
pub async fn run(opts: &SessionsOptions, common: &Common) -> anyhow::Result<Report> {
    let n = opts.sessions;
    tracing::info!(sessions = n, "generating identities and the relay config");
    let setup = Setup::new(n, common.tuning.clone())?;
    let relay = RelayUnderTest::start(&setup, &common.relay, opts.store, common.redis_persistence)
        .await
        .context("starting the relay")?;
    tracing::info!(pid = ?relay.pid(), addr = %relay.addr(), "relay started");
    let target = relay.target();
    // Warm up once (TLS tables, first allocations) so they do not count as
    // per-session memory.
    let warm = RawClient::connect(&target, &setup.caller, InstanceId::random())
        .await
        .context("warm-up session")?;
    warm.close().await;
    let rss_before = relay.rss_bytes();
    let cpu0 = relay.pid().and_then(|p| cpu_seconds(&p.to_string()));

    let started = Instant::now();
    let mut connect_times = latency_histogram();
    let mut clients = Vec::with_capacity(n);
    let mut failures = Vec::new();
    let mut failed = 0usize;
    let mut attempts = futures_util::stream::iter(setup.idle.iter())
        .map(|id| {
            let target = &target;
            async move {
                let t = Instant::now();
                let r = RawClient::connect(target, id, InstanceId::random()).await;
                (r, t.elapsed())
            }
        })
        .buffer_unordered(opts.concurrency.max(1));
    while let Some((r, took)) = attempts.next().await {
        match r {
            Ok(c) => {
                let _ = connect_times.record(u64::try_from(took.as_nanos()).unwrap_or(u64::MAX));
                clients.push(c);
            }
            Err(e) => {
                failed += 1;
                if failures.len() < 10 {
                    failures.push(e.to_string());
                }
            }
        }
    }
    drop(attempts);
    let open_seconds = started.elapsed().as_secs_f64();
    let cpu = relay
        .pid()
        .and_then(|p| cpu_seconds(&p.to_string()))
        .zip(cpu0)
        .map(|(b, a)| b - a);
    let rss_open = relay.rss_bytes();
    tracing::info!(
        opened = clients.len(),
        failed,
        seconds = open_seconds,
        "sessions open"
    );

    // Every session must still be there.
    let alive = tokio::time::timeout(PING_BOUND, async {
        futures_util::stream::iter(clients.iter_mut().enumerate())
            .map(|(i, c)| async move {
                let token = i as u64;
                if c.send(&Frame::Ping(Ping { token })).await.is_err() {
                    return false;
                }
                loop {
                    match c.recv().await {
                        Ok(Frame::Pong(p)) if p.token == token => return true,
                        Ok(_) => {}
                        Err(_) => return false,
                    }
                }
            })
            .buffer_unordered(opts.concurrency.max(1))
            .filter(|ok| std::future::ready(*ok))
            .count()
            .await
    })
    .await
    .unwrap_or(0);

    // Close them all and wait for each close to complete.
    let opened = clients.len();
    futures_util::stream::iter(clients)
        .for_each_concurrent(opts.concurrency.max(1), |c| async move {
            let mut ws = c.ws;
            let _ = tokio::time::timeout(Duration::from_secs(10), async {
                let _ = ws.close(None).await;
                while let Some(Ok(_)) = ws.next().await {}
            })
            .await;
        })
        .await;
    let rss_after_close = relay.rss_bytes();
    let rss_relay_only = relay.rss_is_relay_only();
    let mut rss_settled = rss_after_close;
    let settle_until = Instant::now() + Duration::from_secs_f64(opts.settle_seconds.max(0.0));
    while Instant::now() < settle_until {
        tokio::time::sleep(SETTLE_SAMPLE).await;
        rss_settled = relay.rss_bytes();
    }
    relay.stop().await;
    let kept_fraction = match (rss_before, rss_open, rss_settled) {
        (Some(b), Some(o), Some(s)) if o > b => Some((s as f64 - b as f64) / (o - b) as f64),
        _ => None,
    };

    let result = SessionsResult {
        opened,
        failed,
        failures,
        open_seconds,
        handshakes_per_sec: if open_seconds > 0.0 {
            opened as f64 / open_seconds
        } else {
            0.0
        },
        connect: Percentiles::of(&connect_times),
        relay_cpu_us_per_handshake: cpu.filter(|_| opened > 0).map(|c| c * 1e6 / opened as f64),
        rss_before,
        rss_open,
        rss_per_session: rss_before
            .zip(rss_open)
            .filter(|_| opened > 0)
            .map(|(b, a)| (a as f64 - b as f64) / opened as f64),
        rss_after_close,
        rss_settled,
        kept_fraction,
        rss_relay_only,
        alive,
    };

    let mut violations = Vec::new();
    if failed > 0 {
        violations.push(format!(
            "{failed} of {n} sessions failed to authenticate: {:?}",
            result.failures
        ));
    }
    if alive < opened {
        violations.push(format!(
            "{} of {opened} open sessions did not answer a ping (sessions lost)",
            opened - alive
        ));
    }
    if let Some(kept) = kept_fraction.filter(|_| rss_relay_only && opened > 0)
        && kept > MAX_KEPT_FRACTION
    {
        violations.push(format!(
            "the relay still holds {:.0}% of the memory its {opened} sessions added, {:.1} s \
             after they closed (at most {:.0}%)",
            kept * 100.0,
            opts.settle_seconds,
            MAX_KEPT_FRACTION * 100.0
        ));
    }
    let mut table = Table::new(
        format!(
            "sessions: {n} idle authenticated sessions, each its own peer, {} at a time, {} store",
            opts.concurrency,
            opts.store.name()
        ),
        &[
            "sessions",
            "handshakes/s",
            "connect p50",
            "connect p99",
            "relay CPU/handshake",
            "RSS before",
            "RSS open",
            "per session",
            "RSS after close",
            "RSS settled",
            "alive",
        ],
    );
    let opt_bytes = |b: Option<u64>| b.map_or("-".into(), fmt_bytes);
    table.row(vec![
        opened.to_string(),
        fmt_count(result.handshakes_per_sec),
        fmt_us(result.connect.p50_us),
        fmt_us(result.connect.p99_us),
        result.relay_cpu_us_per_handshake.map_or("-".into(), fmt_us),
        opt_bytes(rss_before),
        opt_bytes(rss_open),
        result
            .rss_per_session
            .map_or("-".into(), |b| fmt_bytes(b.max(0.0) as u64)),
        opt_bytes(rss_after_close),
        opt_bytes(rss_settled),
        alive.to_string(),
    ]);
    let mut notes = vec![
        "per session: (relay VmRSS with all sessions open - before) / sessions. connect: TCP + \
         TLS 1.3 + WebSocket upgrade + challenge/hello/welcome, from this client."
            .to_string(),
        format!(
            "RSS settled: {:.1} s after the last close; the relay holds {} of what the sessions \
             added (--check: at most {:.0}%).",
            opts.settle_seconds,
            kept_fraction.map_or("-".into(), |k| format!("{:.0}%", k * 100.0)),
            MAX_KEPT_FRACTION * 100.0
        ),
    ];
    if !rss_relay_only {
        notes.push(
            "the relay runs in-process: RSS includes the clients; use the relay binary \
             (--relay process) for the relay's own memory."
                .into(),
        );
    }
    let mut json = run_header("sessions", common, relay_bin(common).as_deref());
    if let Some(obj) = json.as_object_mut() {
        obj.insert("params".into(), serde_json::to_value(opts)?);
        obj.insert("result".into(), serde_json::to_value(&result)?);
    }
    Ok(Report {
        scenario: "sessions",
        tables: vec![table],
        notes,
        json,
        violations,
    })
}
