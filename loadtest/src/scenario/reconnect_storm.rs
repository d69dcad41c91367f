//! `reconnect-storm`: delegations streaming events while the links of both
//! connectors are cut at random and, optionally, the relay process is killed
//! (SIGKILL) and restarted on the same port and Redis store.
//!
//! Each connector reaches the relay through its own fault proxy
//! ([`crate::proxy`]). `delegations` delegations run at once; the callee's
//! executor emits `events` status events, one every `event_interval`, each
//! carrying its index, then completes. One cutter per proxy (half the cuts
//! each) waits for its connector's next link, lets it live a random time
//! (uniform in `0..2 x` streaming time / `cuts`, so the gaps of one proxy
//! fill about half the expected streaming time) and closes it,
//! until it made its cuts or every delegation ended. Cuts are counted by the
//! proxy (a connection it actually closed).
//!
//! Per delegation the caller reads every event from the start and counts
//! status events lost, duplicated and reordered (by their index), sequence
//! gaps, and terminals (it must get exactly one, `completed`, whose signed
//! result verifies); the callee's audit trail must hold exactly one
//! acknowledged terminal, and the executor must have run exactly once.
//!
//! Reconnect-to-replay time: from the caller proxy accepting a new
//! connection (TCP, after a cut or a relay restart) to the first event any
//! delegation's stream yields after it. It includes the reconnect's TLS
//! handshake, authentication, resume and replay (and, when the callee link is
//! down too, the callee's reconnect).

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context as _, bail};
use futures_util::StreamExt as _;
use hdrhistogram::Histogram;
use oab_connector::callee::{Execution, StopReason, TaskExecutor, TaskRun};
use oab_connector::{Connector, EventKind};
use oab_wire::{DelegationKey, Outcome, PeerId};
use serde::Serialize;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::{Common, relay_bin, run_header};
use crate::connectors::{
    AUDIT_CAPACITY, Rng, WatchedAudit, new_delegation, start_callee, start_caller,
};
use crate::endpoint::latency_histogram;
use crate::proxy::{Proxy, ProxyHandle};
use crate::relay::{RelayUnderTest, StoreKind};
use crate::report::{Percentiles, Report, Table, fmt_us};
use crate::setup::{CALLEE, Setup};

/// Options of the reconnect-storm scenario.
#[derive(Debug, Clone, Serialize)]
pub struct ReconnectStormOptions {
    /// The relay's store (Redis unless measuring the memory store; killing
    /// the relay needs Redis).
    pub store: StoreKind,
    /// Delegations streaming at once.
    pub delegations: u32,
    /// Status events per delegation.
    pub events: u32,
    /// Pause of the executor before each event.
    pub event_interval: Duration,
    /// Link cuts to make (each closes every connection of one proxy).
    pub cuts: u32,
    /// Kill the relay (SIGKILL) and restart it this often; `None`: never.
    pub kill_relay_every: Option<Duration>,
    /// Seed of the random fault timing (0 picks one from the clock).
    pub seed: u64,
    /// The whole run's time limit; delegations unfinished by then count as
    /// missing their terminal.
    pub timeout: Duration,
}

/// What one delegation saw.
#[derive(Debug, Clone, Default, Serialize)]
pub struct DelegationCheck {
    /// The delegation key.
    pub key: String,
    /// Status events received (duplicates included).
    pub received: u64,
    /// Status events never received.
    pub lost: u64,
    /// Status events received more than once.
    pub duplicated: u64,
    /// Status events received after a later one.
    pub reordered: u64,
    /// Events whose sequence did not follow the previous one.
    pub seq_gaps: u64,
    /// Terminals the caller received.
    pub caller_terminals: u64,
    /// Acknowledged terminals the callee recorded.
    pub callee_terminals: u64,
    /// Times the executor ran.
    pub executor_runs: u64,
    /// The caller's terminal outcome.
    pub outcome: Option<String>,
    /// Whether its signed result verified.
    pub verified: bool,
    /// Stream errors, timeouts, verification failures.
    pub errors: Vec<String>,
}

impl DelegationCheck {
    fn violations(&self) -> Vec<String> {
        let mut v = Vec::new();
        let k = &self.key;
        for (what, n) in [
            ("lost", self.lost),
            ("duplicated", self.duplicated),
            ("reordered", self.reordered),
            ("sequence gaps", self.seq_gaps),
        ] {
            if n > 0 {
                v.push(format!("{k}: {n} event(s) {what}"));
            }
        }
        if self.caller_terminals != 1 {
            v.push(format!(
                "{k}: caller got {} terminals",
                self.caller_terminals
            ));
        }
        if self.callee_terminals != 1 {
            v.push(format!(
                "{k}: callee recorded {} terminals",
                self.callee_terminals
            ));
        }
        if self.executor_runs != 1 {
            v.push(format!("{k}: executor ran {} times", self.executor_runs));
        }
        if self.caller_terminals == 1 && !self.verified {
            v.push(format!(
                "{k}: terminal {:?} is not a verified completion",
                self.outcome
            ));
        }
        v.extend(self.errors.iter().map(|e| format!("{k}: {e}")));
        v
    }
}

/// Paces `events` status events, then completes; counts its runs per
/// delegation.
struct Paced {
    events: u32,
    interval: Duration,
    runs: Mutex<HashMap<DelegationKey, u64>>,
}

impl TaskExecutor for Paced {
    fn execute(
        &self,
        run: TaskRun,
    ) -> Pin<Box<dyn std::future::Future<Output = Execution> + Send>> {
        if let Ok(mut runs) = self.runs.lock() {
            *runs.entry(run.key.clone()).or_default() += 1;
        }
        let (n, pause) = (self.events, self.interval);
        Box::pin(async move {
            for i in 1..=n {
                tokio::select! {
                    () = run.cancel.cancelled() => return Execution::stopped(StopReason::Cancelled),
                    () = tokio::time::sleep(pause) => {}
                }
                let data = serde_json::json!({ "i": i });
                if run
                    .sink
                    .status("TASK_STATE_WORKING", None, Some(data))
                    .await
                    .is_err()
                {
                    return Execution::stopped(StopReason::Error("link stopped".into()));
                }
            }
            Execution::stopped(StopReason::EndTurn)
        })
    }
}

/// Reconnect-to-replay measurement shared by the readers: the time of the
/// caller proxy's latest accept not yet followed by an event.
#[derive(Debug, Default)]
struct Replay {
    pending: Mutex<Option<Instant>>,
    samples: Mutex<Option<Histogram<u64>>>,
}

impl Replay {
    fn accepted(&self, at: Instant) {
        if let Ok(mut p) = self.pending.lock() {
            *p = Some(at);
        }
    }

    fn event(&self) {
        let taken = self.pending.lock().ok().and_then(|mut p| p.take());
        if let Some(at) = taken
            && let Ok(mut h) = self.samples.lock()
        {
            let h = h.get_or_insert_with(latency_histogram);
            let _ = h.record(at.elapsed().as_nanos() as u64);
        }
    }

    fn percentiles(&self) -> Percentiles {
        self.samples
            .lock()
            .ok()
            .and_then(|h| h.as_ref().map(Percentiles::of))
            .unwrap_or_default()
    }
}

/// Runs the scenario.
pub async fn run(opts: &ReconnectStormOptions, common: &Common) -> anyhow::Result<Report> {
    let common = &crate::connectors::connector_common(common);
    if opts.kill_relay_every.is_some() && opts.store != StoreKind::Redis {
        bail!("--kill-relay-every needs the Redis store: the memory store dies with the relay");
    }
    let seed = if opts.seed == 0 {
        oab_wire::identity::now_ms() | 1
    } else {
        opts.seed
    };
    let rng = Arc::new(Rng::new(seed));
    let setup = Setup::new(0, common.tuning.clone())?;
    let mut relay =
        RelayUnderTest::start(&setup, &common.relay, opts.store, common.redis_persistence)
            .await
            .with_context(|| format!("starting the relay on the {} store", opts.store.name()))?;
    tracing::info!(store = opts.store.name(), pid = ?relay.pid(), addr = %relay.addr(), seed, "relay started");
    let proxy_a = Proxy::start(relay.addr()).await.context("caller proxy")?;
    let proxy_b = Proxy::start(relay.addr()).await.context("callee proxy")?;
    let exec = Arc::new(Paced {
        events: opts.events,
        interval: opts.event_interval,
        runs: Mutex::new(HashMap::new()),
    });
    let audit = Arc::new(WatchedAudit::new(AUDIT_CAPACITY));
    let callee = start_callee(&setup, proxy_b.addr(), exec.clone(), audit.clone())?;
    let caller = Arc::new(start_caller(&setup, proxy_a.addr())?);
    caller.connected().await.context("caller connect")?;
    callee.connected().await.context("callee connect")?;

    let deadline = Instant::now() + opts.timeout;
    let done = CancellationToken::new();
    let replay = Arc::new(Replay::default());
    let t0 = Instant::now();

    // The readers: one per delegation.
    let callee_peer = PeerId::new(CALLEE).context("callee peer id")?;
    let mut readers = tokio::task::JoinSet::new();
    for d in 0..opts.delegations {
        let (caller, peer, replay) = (caller.clone(), callee_peer.clone(), replay.clone());
        let events = opts.events;
        readers.spawn(async move { read_one(&caller, &peer, d, events, deadline, &replay).await });
    }

    // The caller proxy's accepts, for the reconnect-to-replay time.
    let accepts = {
        let (h, replay, done) = (proxy_a.handle(), replay.clone(), done.clone());
        tokio::spawn(async move {
            let mut seen = h.stats().accepted;
            loop {
                tokio::select! {
                    () = done.cancelled() => return,
                    () = h.wait_until(|s| s.accepted > seen) => {}
                }
                seen = h.stats().accepted;
                replay.accepted(Instant::now());
            }
        })
    };

    let streaming = opts.event_interval.as_secs_f64() * f64::from(opts.events);
    // Aim to finish the cuts in the first half of the streaming time: each
    // cut waits for the link to come back first, so the cuts stretch out.
    let mean_gap = Duration::from_secs_f64(streaming / f64::from(opts.cuts.max(1)));
    // One cutter per proxy, each with half the cuts, so a link that is slow
    // to come back does not hold up the other's faults.
    let half = opts.cuts / 2;
    let cutters = [
        (proxy_a.handle(), opts.cuts - half),
        (proxy_b.handle(), half),
    ]
    .map(|(p, n)| tokio::spawn(cut_links(p, n, mean_gap, rng.clone(), done.clone())));

    // Relay kills run here (the relay is owned by this task) until the
    // readers are done.
    let mut kills = 0u32;
    let mut kill_errors = Vec::new();
    let collect = async {
        let mut out = Vec::new();
        while let Some(j) = readers.join_next().await {
            match j {
                Ok(c) => out.push(c),
                Err(e) => out.push(DelegationCheck {
                    key: "?".into(),
                    errors: vec![format!("reader task: {e}")],
                    ..Default::default()
                }),
            }
        }
        out
    };
    tokio::pin!(collect);
    let mut checks = match opts.kill_relay_every {
        None => collect.await,
        Some(every) => loop {
            let failed = tokio::select! {
                c = &mut collect => break c,
                () = tokio::time::sleep(every) => {
                    match relay.kill_and_restart(&setup, &common.relay).await {
                        Ok(()) => {
                            kills += 1;
                            tracing::info!(kills, pid = ?relay.pid(), "relay killed and restarted");
                            false
                        }
                        Err(e) => {
                            kill_errors.push(format!("{e:#}"));
                            true
                        }
                    }
                }
            };
            if failed {
                break collect.await;
            }
        },
    };
    let elapsed = t0.elapsed();
    done.cancel();
    let mut cuts_made = 0;
    for c in cutters {
        cuts_made += c.await.unwrap_or(0);
    }
    let _ = accepts.await;

    // The callee's acknowledged terminals can trail the caller's view.
    let keys: Vec<String> = checks.iter().map(|c| c.key.clone()).collect();
    let callee_view = audit
        .wait_terminals(
            deadline
                .saturating_duration_since(Instant::now())
                .max(Duration::from_secs(5)),
            |v| keys.iter().all(|k| v.keys().any(|vk| vk.to_string() == *k)),
        )
        .await;
    let by_name: HashMap<String, usize> = callee_view
        .iter()
        .map(|(k, v)| (k.to_string(), v.len()))
        .collect();
    let runs_by_name: HashMap<String, u64> = exec
        .runs
        .lock()
        .map(|r| r.iter().map(|(k, n)| (k.to_string(), *n)).collect())
        .unwrap_or_default();
    for c in &mut checks {
        c.callee_terminals = by_name.get(&c.key).map_or(0, |n| *n as u64);
        c.executor_runs = runs_by_name.get(&c.key).copied().unwrap_or(0);
    }
    let stats_a = proxy_a.handle().stats();
    let stats_b = proxy_b.handle().stats();
    if let Ok(c) = Arc::try_unwrap(caller) {
        c.shutdown().await;
    }
    callee.shutdown().await;
    drop(proxy_a);
    drop(proxy_b);
    relay.stop().await;

    let mut violations: Vec<String> = checks
        .iter()
        .flat_map(DelegationCheck::violations)
        .collect();
    violations.extend(
        kill_errors
            .iter()
            .map(|e| format!("relay restart failed: {e}")),
    );
    if violations.len() > 50 {
        let more = violations.len() - 50;
        violations.truncate(50);
        violations.push(format!("... and {more} more"));
    }
    let sum = |f: fn(&DelegationCheck) -> u64| checks.iter().map(f).sum::<u64>();
    let replay_p = replay.percentiles();
    let mut table = Table::new(
        format!(
            "reconnect-storm: {} delegations x {} events every {:?}, {} store, seed {seed}",
            opts.delegations,
            opts.events,
            opts.event_interval,
            opts.store.name()
        ),
        &[
            "cuts",
            "relay kills",
            "events",
            "lost",
            "dup",
            "reord",
            "terminals!=1",
            "runs!=1",
            "unverified",
            "replay p50",
            "replay p99",
            "seconds",
        ],
    );
    table.row(vec![
        cuts_made.to_string(),
        kills.to_string(),
        sum(|c| c.received).to_string(),
        sum(|c| c.lost).to_string(),
        sum(|c| c.duplicated).to_string(),
        sum(|c| c.reordered).to_string(),
        checks
            .iter()
            .filter(|c| c.caller_terminals != 1 || c.callee_terminals != 1)
            .count()
            .to_string(),
        checks
            .iter()
            .filter(|c| c.executor_runs != 1)
            .count()
            .to_string(),
        checks.iter().filter(|c| !c.verified).count().to_string(),
        fmt_us(replay_p.p50_us),
        fmt_us(replay_p.p99_us),
        format!("{:.1}", elapsed.as_secs_f64()),
    ]);
    let mut notes = vec![
        "replay: caller proxy accepting a new connection -> the first event any stream yields \
         after it (TLS, authentication, resume, replay)."
            .into(),
    ];
    if cuts_made < opts.cuts {
        notes.push(format!(
            "only {cuts_made} of {} cuts were made before every delegation ended: raise \
             --events or the event interval for more",
            opts.cuts
        ));
    }
    let mut json = run_header("reconnect-storm", common, relay_bin(common).as_deref());
    if let Some(obj) = json.as_object_mut() {
        obj.insert("params".into(), serde_json::to_value(opts)?);
        obj.insert("seed".into(), seed.into());
        obj.insert(
            "result".into(),
            serde_json::json!({
                "cuts": cuts_made,
                "relay_kills": kills,
                "seconds": elapsed.as_secs_f64(),
                "reconnect_to_replay": replay_p,
                "caller_proxy": stats_a,
                "callee_proxy": stats_b,
            }),
        );
        obj.insert("delegations".into(), serde_json::to_value(&checks)?);
    }
    Ok(Report {
        scenario: "reconnect-storm",
        tables: vec![table],
        notes,
        json,
        violations,
    })
}

/// Cuts one proxy's links `cuts` times, until `done`: waits for the
/// connector's next link (a new upstream connection since the last cut),
/// lets it live a random gap (uniform in `0..2 x mean_gap`), then closes
/// every connection. Only a cut that closed a connection counts (the link
/// may have died by itself meanwhile). Returns the cuts made.
async fn cut_links(
    proxy: ProxyHandle,
    cuts: u32,
    mean_gap: Duration,
    rng: Arc<Rng>,
    done: CancellationToken,
) -> u32 {
    let mut made = 0u32;
    let gap_us = u64::try_from(mean_gap.as_micros())
        .unwrap_or(u64::MAX / 4)
        .max(1)
        * 2;
    let mut connects = proxy.stats().upstream_connects.saturating_sub(1);
    while made < cuts {
        tokio::select! {
            () = done.cancelled() => break,
            () = proxy.wait_until(|s| s.upstream_connects > connects && s.active > 0) => {}
        }
        let gap = Duration::from_micros(rng.below(gap_us));
        tokio::select! {
            () = done.cancelled() => break,
            () = tokio::time::sleep(gap) => {}
        }
        let before = proxy.stats();
        connects = before.upstream_connects;
        proxy.cut_all();
        tokio::select! {
            () = done.cancelled() => break,
            () = proxy.wait_until(|s| s.cuts > before.cuts || s.active == 0) => {}
        }
        if proxy.stats().cuts > before.cuts {
            made += 1;
        }
    }
    made
}

/// One delegation, read from its first event to its terminal.
async fn read_one(
    caller: &Connector,
    callee: &PeerId,
    d: u32,
    events: u32,
    deadline: Instant,
    replay: &Replay,
) -> DelegationCheck {
    let mut c = DelegationCheck::default();
    let h = match caller
        .caller()
        .delegate(callee, new_delegation(format!("storm {d}")))
        .await
    {
        Ok(h) => h,
        Err(e) => {
            c.key = format!("storm {d} (not started)");
            c.errors.push(format!("delegate: {e}"));
            c.caller_terminals = 0;
            return c;
        }
    };
    c.key = h.key.to_string();
    let mut stream = match caller.caller().events(&h, 0).await {
        Ok(s) => s,
        Err(e) => {
            c.errors.push(format!("events: {e}"));
            return c;
        }
    };
    let n = events as usize;
    let mut seen = vec![0u32; n + 1];
    let (mut last_seq, mut last_i) = (0u64, 0u64);
    loop {
        let next = tokio::time::timeout_at(deadline, stream.next()).await;
        let item = match next {
            Err(_) => {
                c.errors
                    .push("no terminal before the run's time limit".into());
                break;
            }
            Ok(None) => break,
            Ok(Some(item)) => item,
        };
        replay.event();
        let ev = match item {
            Ok(ev) => ev,
            Err(e) => {
                c.errors.push(format!("event stream: {e}"));
                break;
            }
        };
        if ev.seq != last_seq + 1 {
            c.seq_gaps += 1;
        }
        last_seq = ev.seq;
        match ev.kind {
            EventKind::Status { data, .. } => {
                c.received += 1;
                let i = data
                    .as_ref()
                    .and_then(|d| d.get("i"))
                    .and_then(serde_json::Value::as_u64)
                    .unwrap_or(0);
                match usize::try_from(i).ok().and_then(|i| seen.get_mut(i)) {
                    Some(slot) if i > 0 => {
                        *slot += 1;
                        if *slot > 1 {
                            c.duplicated += 1;
                        } else if i < last_i {
                            c.reordered += 1;
                        }
                        last_i = last_i.max(i);
                    }
                    _ => c.errors.push(format!("status event with index {i}")),
                }
            }
            EventKind::Terminal(t) => {
                c.caller_terminals += 1;
                c.outcome = Some(format!("{:?}", t.outcome).to_lowercase());
                match caller.caller().verify(&h, &t) {
                    Ok(_) => c.verified = t.outcome == Outcome::Completed,
                    Err(e) => c.errors.push(format!("verify: {e}")),
                }
            }
            _ => {}
        }
    }
    c.lost = seen.iter().skip(1).filter(|n| **n == 0).count() as u64;
    c
}
