//! `upgrade-drill`: a rolling upgrade of every process of a running
//! topology, one process at a time, while delegations run.
//!
//! ```text
//! library caller (this process) --+
//! A2A client -> connector A -------+--> haproxy --> relay-1, relay-2 --> redis-server (AOF)
//!               connector B <------+                (fleet over one Redis)
//!               connector B -> sample_agent.py (official A2A SDK)
//! ```
//!
//! Every part is a real process: two `oab-relay` instances of one fleet on
//! one `redis-server` with an AOF, HAProxy in front of them as the shipped
//! `deploy/fleet/haproxy.cfg` has it (layer 4, `leastconn`, `/readyz`
//! checks on the admin port, `on-marked-down shutdown-sessions`,
//! redispatch), connector A (`oab-connector run` with its A2A facade and a
//! state folder), connector B (`oab-connector run` with its A2A driver and
//! a state folder) in front of the official-SDK sample agent, and a
//! library caller in this process with a state folder.
//!
//! `delegations` delegations start, half through the library caller and
//! half as A2A `SendStreamingMessage` calls to connector A's facade (with
//! the delegation profile). Each is a `paced-` task of the agent: `ticks`
//! progress updates, one every `tick_ms`, then an artifact and
//! `completed`. Once every delegation has received its first progress
//! update, the processes are restarted one at a time, in this order:
//! relay-1, relay-2, connector B, connector A, the library caller, Redis.
//! Each is stopped as `--stop` says (`kill`: SIGKILL; `term`: SIGTERM, the
//! relay and the connectors drain, Redis syncs its AOF) and started again
//! on the same addresses and folders. The next restart waits until every
//! delegation still running has received an event after the previous one
//! came back (the topology carries traffic again), bounded by
//! `step_timeout`. The library caller is stopped cleanly in both runs (it
//! lives in this process; a SIGKILL of a caller process is connector A's
//! step) and takes its delegations back from its folder (`restore`).
//!
//! A reader follows each delegation from its first event: the library
//! reader subscribes again after the last sequence it read when its
//! connector was replaced; the A2A reader calls `SubscribeToTask` with the
//! profile's cursor (`OAB-Cursor`: the last facade sequence it read) when
//! its stream ends early, retrying while connector A is down.
//!
//! Checked per delegation against what the agent recorded
//! (`GET /test/emitted/<messageId>`): the progress updates received are the
//! agent's, each once and in order (none lost, duplicated or reordered),
//! the outcome is the agent's (`completed`), never `unknown`, and the
//! terminal verifies (the library checks the callee's signature; the
//! facade says it verified). The facade's sequence never skips or repeats.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::{Context as _, bail};
use futures_util::StreamExt as _;
use oab_connector::a2a::PROFILE_URI;
use oab_connector::{Connector, DelegationHandle, EventKind};
use oab_wire::{Outcome, PeerId};
use parking_lot::Mutex;
use serde::Serialize;
use serde_json::{Value, json};
use tokio::time::Instant;

use super::a2a_sdk::start_sample_agent;
use super::soak::{free_loopback_addr, wait_ready};
use super::{Common, relay_bin, run_header};
use crate::connector_process::{ConnectorProcess, ConnectorRole};
use crate::connectors::{new_delegation, start_caller_as_with_state};
use crate::relay::{
    ProcessStop, RedisPersistence, RelayFleet, RelayMode, SharedStoreKind, TERM_TIMEOUT,
};
use crate::report::{Report, Table, fmt_count};
use crate::setup::{CALLEE, CALLER, Setup};

/// How long the processes may take to come up and connect at the start.
const READY_TIMEOUT: Duration = Duration::from_secs(60);

/// Largest SSE event the A2A reader buffers.
const MAX_SSE_BYTES: usize = 4 * 1024 * 1024;

/// The drill's settings.
#[derive(Debug, Clone, Serialize)]
pub struct UpgradeDrillOptions {
    /// Delegations running through the restarts, both paths together.
    pub delegations: u32,
    /// Progress updates per delegation.
    pub ticks: u32,
    /// Milliseconds between two progress updates.
    pub tick_ms: u64,
    /// How every process is stopped.
    pub stop: ProcessStop,
    /// How long the topology may take to carry every running delegation's
    /// traffic again after a restart.
    pub step_timeout: Duration,
    /// The `oab-connector` binary.
    pub connector_bin: PathBuf,
    /// The Python with the official a2a-sdk.
    pub python: PathBuf,
    /// The folder holding `sample_agent.py`.
    pub interop_dir: PathBuf,
    /// The `haproxy` binary.
    pub haproxy: PathBuf,
}

/// What one delegation's reader saw.
#[derive(Debug, Default, Clone, Serialize)]
struct Seen {
    path: &'static str,
    message_id: String,
    key: String,
    /// Progress texts received, in order.
    ticks: Vec<String>,
    /// Artifact updates received (ids).
    artifacts: Vec<String>,
    terminals: u32,
    outcome: Option<String>,
    verified: bool,
    /// Facade sequence numbers that skipped or repeated.
    seq_faults: u32,
    /// Streams that ended early and were followed again.
    resubscribed: u32,
    errors: Vec<String>,
    #[serde(skip)]
    last_event: Option<Instant>,
}

/// One restart of the drill.
#[derive(Debug, Clone, Serialize)]
struct Step {
    process: String,
    stop: &'static str,
    /// It exited cleanly (status 0) after SIGTERM.
    clean_exit: bool,
    /// From the signal to the new process running (listening, connected).
    restart_ms: f64,
    /// From the new process running to every running delegation having an
    /// event after it.
    recovery_ms: f64,
    /// Delegations still running at the restart.
    running: usize,
}

/// The library caller, replaced on its restart.
struct LibrarySlot {
    conn: tokio::sync::RwLock<Option<Connector>>,
    generation: AtomicU64,
}

/// What the readers share.
struct Shared {
    library: LibrarySlot,
    callee: PeerId,
    http: reqwest::Client,
    facade_url: String,
    deadline: Instant,
    seen: Vec<Arc<Mutex<Seen>>>,
}

/// Runs the drill.
pub async fn run(opts: &UpgradeDrillOptions, common: &Common) -> anyhow::Result<Report> {
    let RelayMode::Process(_) = &common.relay else {
        bail!(
            "upgrade-drill restarts relay processes: it needs the oab-relay binary \
             (--relay process, or build it next to oab-loadtest)"
        );
    };
    for (what, path) in [
        ("the oab-connector binary", &opts.connector_bin),
        (
            "the Python with the official a2a-sdk (scripts/python-env)",
            &opts.python,
        ),
        ("haproxy (apt-get install haproxy)", &opts.haproxy),
    ] {
        if !path.is_file() {
            bail!("{what} is not at {}", path.display());
        }
    }
    let mut common = common.for_connectors();
    let setup = Setup::with_callers(0, 0, 1, common.tuning.clone())?;
    let library_id = setup
        .extra_callers
        .first()
        .context("the setup has no extra caller")?
        .clone();
    // A crash of Redis loses nothing acknowledged only when every write is
    // synced (`appendfsync always`); a clean stop syncs the AOF itself.
    let persistence = match opts.stop {
        ProcessStop::Kill => RedisPersistence::AofAlways,
        ProcessStop::Term => RedisPersistence::Aof,
    };
    // (So the run's header says what ran.)
    common.redis_persistence = persistence;
    let mut fleet = RelayFleet::start_store(SharedStoreKind::Redis, persistence).await?;
    let mut admins = Vec::new();
    for _ in 0..2 {
        let admin = free_loopback_addr()?;
        fleet
            .add_instance(
                &setup,
                &common.relay,
                &[("relay.admin_listen".into(), admin.to_string())],
            )
            .await?;
        admins.push(admin);
    }
    fleet.wait_for_nodes(2, READY_TIMEOUT).await?;
    let backends: Vec<(SocketAddr, SocketAddr)> = fleet
        .instances()
        .iter()
        .zip(&admins)
        .map(|(r, a)| (r.addr(), *a))
        .collect();
    let mut balancer = Balancer::start(&opts.haproxy, &setup, &backends).await?;
    let lb = balancer.addr;

    let (mut agent, agent_port) = start_sample_agent(&opts.python, &opts.interop_dir).await?;
    let run_ms = u64::from(opts.ticks) * opts.tick_ms;
    let deadline_ms = run_ms * 3 + 600_000;
    let b_role = ConnectorRole {
        name: "connector-b".into(),
        identity: setup.callee.clone(),
        peers: vec![setup.caller.clone(), library_id.clone()],
        max_concurrent: opts.delegations as usize + 16,
        facade_listen: None,
        driver_url: Some(format!("http://127.0.0.1:{agent_port}")),
        default_timeout_ms: deadline_ms,
    };
    let facade = free_loopback_addr()?;
    let a_role = ConnectorRole {
        name: "connector-a".into(),
        identity: setup.caller.clone(),
        peers: vec![setup.callee.clone()],
        max_concurrent: opts.delegations as usize + 16,
        facade_listen: Some(facade),
        driver_url: None,
        default_timeout_ms: deadline_ms,
    };
    let mut b = ConnectorProcess::start(&setup, &opts.connector_bin, lb, &b_role)?;
    let mut a = ConnectorProcess::start(&setup, &opts.connector_bin, lb, &a_role)?;
    let http = reqwest::Client::new();
    wait_ready(&http, facade, &mut a, &mut b).await?;
    let library_state = setup.dir.path().join("library-state");
    std::fs::create_dir_all(&library_state)?;
    let library = start_caller_as_with_state(&setup, &library_id, lb, &library_state)?;
    tokio::time::timeout(READY_TIMEOUT, library.connected())
        .await
        .context("the library caller did not connect in time")?
        .context("the library caller's link")?;

    let run_id = format!("{:x}", oab_wire::identity::now_ms());
    let seen: Vec<Arc<Mutex<Seen>>> = (0..opts.delegations)
        .map(|d| {
            Arc::new(Mutex::new(Seen {
                path: if d % 2 == 0 { "library" } else { "facade" },
                message_id: format!("paced-{}-{}-{run_id}-{d}", opts.ticks, opts.tick_ms),
                ..Seen::default()
            }))
        })
        .collect();
    let shared = Arc::new(Shared {
        library: LibrarySlot {
            conn: tokio::sync::RwLock::new(Some(library)),
            generation: AtomicU64::new(0),
        },
        callee: PeerId::new(CALLEE).context("callee peer id")?,
        http: http.clone(),
        facade_url: format!("http://{facade}/peers/{CALLEE}/"),
        deadline: Instant::now() + Duration::from_millis(run_ms * 2) + opts.step_timeout * 8,
        seen: seen.clone(),
    });
    let started = Instant::now();
    let mut readers = tokio::task::JoinSet::new();
    for d in 0..opts.delegations as usize {
        let shared = shared.clone();
        readers.spawn(async move {
            if d % 2 == 0 {
                read_library(&shared, d).await;
            } else {
                read_facade(&shared, d).await;
            }
        });
    }
    // Every delegation runs (its first progress update arrived).
    wait_until(
        opts.step_timeout,
        "every delegation has its first progress update",
        || {
            seen.iter().all(|s| {
                let s = s.lock();
                !s.ticks.is_empty() || s.terminals > 0 || !s.errors.is_empty()
            })
        },
    )
    .await?;

    let mut steps = Vec::new();
    let stop = opts.stop;
    for process in [
        "relay-1",
        "relay-2",
        "connector B",
        "connector A",
        "library caller",
        "redis",
    ] {
        let running: Vec<usize> = seen
            .iter()
            .enumerate()
            .filter(|(_, s)| s.lock().terminals == 0)
            .map(|(i, _)| i)
            .collect();
        tracing::info!(
            process,
            stop = stop.name(),
            running = running.len(),
            "restarting"
        );
        let began = Instant::now();
        let clean = match process {
            "relay-1" | "relay-2" => {
                let i = usize::from(process == "relay-2");
                fleet
                    .restart_instance(i, &setup, &common.relay, stop)
                    .await?
                    .clean
            }
            "connector B" => {
                let clean = match stop {
                    ProcessStop::Kill => {
                        b.stop().await;
                        false
                    }
                    ProcessStop::Term => b.terminate(TERM_TIMEOUT).await,
                };
                b = ConnectorProcess::start(&setup, &opts.connector_bin, lb, &b_role)?;
                wait_ready(&http, facade, &mut a, &mut b).await?;
                clean
            }
            "connector A" => {
                let clean = match stop {
                    ProcessStop::Kill => {
                        a.stop().await;
                        false
                    }
                    ProcessStop::Term => a.terminate(TERM_TIMEOUT).await,
                };
                a = ConnectorProcess::start(&setup, &opts.connector_bin, lb, &a_role)?;
                wait_ready(&http, facade, &mut a, &mut b).await?;
                clean
            }
            "library caller" => {
                restart_library(&shared, &setup, &library_id, lb, &library_state).await?;
                true
            }
            _ => fleet.restart_store(stop).await?.clean,
        };
        let back = Instant::now();
        let recovered = wait_until(
            opts.step_timeout,
            &format!("every running delegation has an event after {process} restarted"),
            || {
                running.iter().all(|&i| {
                    let s = seen.get(i).map(|s| s.lock());
                    s.is_none_or(|s| {
                        s.terminals > 0
                            || !s.errors.is_empty()
                            || s.last_event.is_some_and(|t| t > back)
                    })
                })
            },
        )
        .await;
        let step = Step {
            process: process.to_string(),
            // The library caller lives in this process: always a clean stop.
            stop: if process == "library caller" {
                "close"
            } else {
                stop.name()
            },
            clean_exit: clean,
            restart_ms: ms(back - began),
            recovery_ms: ms(back.elapsed()),
            running: running.len(),
        };
        tracing::info!(?step, "restarted");
        steps.push(step);
        if let Err(e) = recovered {
            // Reported with the checks below; the later steps still run.
            tracing::warn!(error = %format!("{e:#}"), "no recovery");
            if let Some(s) = steps.last_mut() {
                s.recovery_ms = f64::NAN;
            }
        }
    }
    let restarts_done = started.elapsed();
    while readers.join_next().await.is_some() {}
    let elapsed = started.elapsed();

    // What the agent emitted, per delegation.
    let agent_url = format!("http://127.0.0.1:{agent_port}");
    let mut violations = Vec::new();
    let mut totals = Totals::default();
    for s in &seen {
        let s = s.lock().clone();
        let (emitted, agent_terminal) = emitted(&http, &agent_url, &s.message_id).await;
        totals.add(&s, &emitted, agent_terminal.as_deref(), &mut violations);
    }
    for step in &steps {
        if step.recovery_ms.is_nan() {
            violations.push(format!(
                "after {} restarted, some running delegation had no event within {:?}",
                step.process, opts.step_timeout
            ));
        }
        if stop == ProcessStop::Term && !step.clean_exit {
            violations.push(format!(
                "{} did not exit cleanly within {TERM_TIMEOUT:?} of SIGTERM",
                step.process
            ));
        }
    }

    let _ = agent.start_kill();
    balancer.stop().await;
    a.stop().await;
    b.stop().await;
    if let Some(l) = shared.library.conn.write().await.take() {
        l.shutdown().await;
    }
    fleet.stop().await;

    let mut steps_table = Table::new(
        format!(
            "upgrade drill: each process restarted in turn ({})",
            stop.name()
        ),
        &[
            "process",
            "stop",
            "clean exit",
            "restart",
            "traffic again",
            "running",
        ],
    );
    for s in &steps {
        steps_table.rows.push(vec![
            s.process.clone(),
            s.stop.to_string(),
            match (s.stop, s.clean_exit) {
                ("kill", _) | ("close", _) => "-".into(),
                (_, true) => "yes".into(),
                (_, false) => "NO".into(),
            },
            format!("{:.0} ms", s.restart_ms),
            if s.recovery_ms.is_nan() {
                "NOT WITHIN BOUND".into()
            } else {
                format!("{:.0} ms", s.recovery_ms)
            },
            fmt_count(s.running as f64),
        ]);
    }
    let mut outcome = Table::new(
        "upgrade drill: delegations against what the agent emitted",
        &[
            "path",
            "delegations",
            "completed",
            "unknown",
            "other",
            "events",
            "lost",
            "duplicated",
            "reordered",
            "resubscribed",
        ],
    );
    for (path, t) in [("library", &totals.library), ("facade", &totals.facade)] {
        outcome.rows.push(vec![
            path.to_string(),
            fmt_count(t.delegations as f64),
            fmt_count(t.completed as f64),
            fmt_count(t.unknown as f64),
            fmt_count(t.other as f64),
            fmt_count(t.events as f64),
            fmt_count(t.lost as f64),
            fmt_count(t.duplicated as f64),
            fmt_count(t.reordered as f64),
            fmt_count(t.resubscribed as f64),
        ]);
    }
    let json = json!({
        "header": run_header("upgrade-drill", &common, relay_bin(&common).as_deref()),
        "options": opts,
        "redis_persistence": persistence,
        "steps": steps,
        "library": totals.library,
        "facade": totals.facade,
        "restarts_s": restarts_done.as_secs_f64(),
        "elapsed_s": elapsed.as_secs_f64(),
    });
    Ok(Report {
        scenario: "upgrade-drill",
        tables: vec![steps_table, outcome],
        notes: vec![
            "restart: from the signal to the new process running (relay: listening; connector: \
             the facade lists the callee online; Redis: answering PING). traffic again: from \
             then until every running delegation had an event."
                .into(),
            format!(
                "Redis: {} ({}); the library caller lives in this process and is stopped \
                 cleanly in both runs.",
                match persistence {
                    RedisPersistence::AofAlways => "AOF, appendfsync always",
                    _ => "AOF, appendfsync everysec",
                },
                match stop {
                    ProcessStop::Kill =>
                        "a crash loses nothing acknowledged only with every write synced",
                    ProcessStop::Term => "a clean stop syncs the AOF",
                }
            ),
        ],
        json,
        violations,
    })
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Polls `done` every 50 ms until it holds, at most `timeout`.
async fn wait_until(
    timeout: Duration,
    what: &str,
    mut done: impl FnMut() -> bool,
) -> anyhow::Result<()> {
    let until = Instant::now() + timeout;
    loop {
        if done() {
            return Ok(());
        }
        if Instant::now() >= until {
            bail!("not within {timeout:?}: {what}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Per-path sums of the checks.
#[derive(Debug, Default, Clone, Serialize)]
struct PathTotals {
    delegations: u64,
    completed: u64,
    unknown: u64,
    other: u64,
    events: u64,
    lost: u64,
    duplicated: u64,
    reordered: u64,
    resubscribed: u64,
}

#[derive(Debug, Default)]
struct Totals {
    library: PathTotals,
    facade: PathTotals,
}

impl Totals {
    /// Compares one delegation with what the agent emitted.
    fn add(
        &mut self,
        s: &Seen,
        emitted: &[String],
        agent_terminal: Option<&str>,
        violations: &mut Vec<String>,
    ) {
        let t = if s.path == "library" {
            &mut self.library
        } else {
            &mut self.facade
        };
        t.delegations += 1;
        t.events += s.ticks.len() as u64;
        t.resubscribed += u64::from(s.resubscribed);
        let who = format!("{} {} ({})", s.path, s.message_id, s.key);
        match s.outcome.as_deref() {
            Some("completed") => t.completed += 1,
            Some("unknown") => t.unknown += 1,
            _ => t.other += 1,
        }
        let (lost, duplicated, reordered) = compare(emitted, &s.ticks);
        t.lost += lost;
        t.duplicated += duplicated;
        t.reordered += reordered;
        if lost + duplicated + reordered > 0 {
            violations.push(format!(
                "{who}: {lost} lost, {duplicated} duplicated, {reordered} reordered progress \
                 updates (received {}, the agent emitted {}; first repeated or unknown: {:?})",
                s.ticks.len(),
                emitted.len(),
                extra(emitted, &s.ticks)
            ));
        }
        let agent_outcome = match agent_terminal {
            Some("completed") => Some("completed"),
            Some("canceled") => Some("cancelled"),
            _ => None,
        };
        if s.terminals != 1 {
            violations.push(format!("{who}: {} terminals at the caller", s.terminals));
        }
        if agent_outcome.is_none() || s.outcome.as_deref() != agent_outcome {
            violations.push(format!(
                "{who}: ended {:?}, the agent's task ended {agent_terminal:?}",
                s.outcome
            ));
        }
        if s.outcome.as_deref() == Some("completed") && !s.verified {
            violations.push(format!("{who}: the completed result did not verify"));
        }
        if s.outcome.as_deref() == Some("completed") && s.artifacts != ["result"] {
            violations.push(format!(
                "{who}: artifacts {:?}, not [\"result\"]",
                s.artifacts
            ));
        }
        if s.seq_faults > 0 {
            violations.push(format!("{who}: {} facade sequence faults", s.seq_faults));
        }
        for e in s.errors.iter().take(3) {
            violations.push(format!("{who}: {e}"));
        }
    }
}

/// Lost, duplicated and reordered entries of `got` against `want` (each
/// entry of `want` is distinct).
fn compare(want: &[String], got: &[String]) -> (u64, u64, u64) {
    let index: HashMap<&str, usize> = want
        .iter()
        .enumerate()
        .map(|(i, w)| (w.as_str(), i))
        .collect();
    let mut seen = vec![false; want.len()];
    let (mut duplicated, mut reordered, mut unexpected) = (0u64, 0u64, 0u64);
    let mut last: Option<usize> = None;
    for g in got {
        match index.get(g.as_str()) {
            Some(&i) => {
                if seen.get(i).copied().unwrap_or(false) {
                    duplicated += 1;
                    continue;
                }
                if let Some(slot) = seen.get_mut(i) {
                    *slot = true;
                }
                if last.is_some_and(|l| i < l) {
                    reordered += 1;
                }
                last = Some(last.map_or(i, |l| l.max(i)));
            }
            None => unexpected += 1,
        }
    }
    let lost = seen.iter().filter(|s| !**s).count() as u64;
    (lost, duplicated + unexpected, reordered)
}

/// The entries of `got` that repeat an earlier one or are not in `want`
/// (the first few, to name them in a violation).
fn extra<'a>(want: &[String], got: &'a [String]) -> Vec<&'a str> {
    let mut seen = HashSet::new();
    got.iter()
        .filter(|g| !want.contains(g) || !seen.insert(g.as_str()))
        .take(5)
        .map(String::as_str)
        .collect()
}

/// What the agent recorded of a `paced-` task.
async fn emitted(
    http: &reqwest::Client,
    agent: &str,
    message_id: &str,
) -> (Vec<String>, Option<String>) {
    let Ok(resp) = http
        .get(format!("{agent}/test/emitted/{message_id}"))
        .send()
        .await
    else {
        return (Vec::new(), None);
    };
    let v: Value = resp.json().await.unwrap_or_default();
    let texts = v["emitted"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|t| t.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    (texts, v["terminal"].as_str().map(str::to_string))
}

/// Stops the library caller cleanly and starts a new one on its folder,
/// which takes its delegations back.
async fn restart_library(
    shared: &Shared,
    setup: &Setup,
    id: &oab_wire::identity::Identity,
    relay: SocketAddr,
    state: &std::path::Path,
) -> anyhow::Result<()> {
    shared.library.generation.fetch_add(1, Ordering::SeqCst);
    let mut g = shared.library.conn.write().await;
    if let Some(old) = g.take() {
        old.shutdown().await;
    }
    let new = start_caller_as_with_state(setup, id, relay, state)?;
    let restored = new
        .caller()
        .restore()
        .await
        .context("restoring the library caller's delegations")?;
    tracing::info!(restored = restored.len(), "library caller restarted");
    tokio::time::timeout(READY_TIMEOUT, new.connected())
        .await
        .context("the restarted library caller did not connect in time")?
        .context("the restarted library caller's link")?;
    *g = Some(new);
    Ok(())
}

/// Takes the text of a status message, if it has one.
fn message_text(message: Option<&Value>) -> Option<String> {
    message?
        .get("parts")?
        .get(0)?
        .get("text")?
        .as_str()
        .map(str::to_string)
}

/// Follows delegation `d` through the library caller.
async fn read_library(shared: &Shared, d: usize) {
    let Some(cell) = shared.seen.get(d) else {
        return;
    };
    let message_id = cell.lock().message_id.clone();
    let mut spec = new_delegation(format!("drill {d}"));
    spec.task.a2a_message = Some(json!({
        "messageId": message_id,
        "role": "ROLE_USER",
        "parts": [{ "text": format!("drill {d}") }],
    }));
    spec.deadline = Duration::from_secs(3600);
    let started = {
        let g = shared.library.conn.read().await;
        match g.as_ref() {
            Some(c) => c
                .caller()
                .delegate(&shared.callee, spec)
                .await
                .map_err(|e| e.to_string()),
            None => Err("the library caller is gone".into()),
        }
    };
    let h: DelegationHandle = match started {
        Ok(h) => h,
        Err(e) => {
            cell.lock().errors.push(format!("delegate: {e}"));
            return;
        }
    };
    cell.lock().key = h.key.to_string();
    let mut last_seq = 0u64;
    'subscribe: loop {
        let generation = shared.library.generation.load(Ordering::SeqCst);
        let subscribed = {
            let g = shared.library.conn.read().await;
            match g.as_ref() {
                Some(c) => c
                    .caller()
                    .events(&h, last_seq)
                    .await
                    .map_err(|e| e.to_string()),
                None => Err("the library caller is gone".into()),
            }
        };
        let mut stream = match subscribed {
            Ok(s) => s,
            Err(e) if shared.library.generation.load(Ordering::SeqCst) != generation => {
                tracing::debug!(error = %e, "subscribing again after the restart");
                continue 'subscribe;
            }
            Err(e) => {
                cell.lock().errors.push(format!("events: {e}"));
                return;
            }
        };
        loop {
            let item = tokio::select! {
                item = stream.next() => item,
                () = tokio::time::sleep_until(shared.deadline) => {
                    cell.lock().errors.push("no terminal before the drill's time limit".into());
                    return;
                }
            };
            let restarted = shared.library.generation.load(Ordering::SeqCst) != generation;
            let ev = match item {
                Some(Ok(ev)) => ev,
                None | Some(Err(_)) if restarted => {
                    cell.lock().resubscribed += 1;
                    // Wait for the new connector (the restart holds the lock).
                    drop(shared.library.conn.read().await);
                    continue 'subscribe;
                }
                None => {
                    cell.lock().errors.push("the event stream ended".into());
                    return;
                }
                Some(Err(e)) => {
                    cell.lock().errors.push(format!("event stream: {e}"));
                    return;
                }
            };
            last_seq = ev.seq;
            cell.lock().last_event = Some(Instant::now());
            match &ev.kind {
                EventKind::Status { message, .. } => {
                    if let Some(text) = message_text(message.as_ref()) {
                        cell.lock().ticks.push(text);
                    }
                }
                EventKind::Artifact { artifact, .. } => {
                    cell.lock().artifacts.push(artifact.artifact_id.clone());
                }
                EventKind::Terminal(t) => {
                    let verified = {
                        let g = shared.library.conn.read().await;
                        g.as_ref().is_some_and(|c| c.caller().verify(&h, t).is_ok())
                    };
                    let mut s = cell.lock();
                    s.terminals += 1;
                    s.outcome = Some(t.outcome.name().to_string());
                    s.verified = verified && t.outcome == Outcome::Completed;
                    return;
                }
                _ => {}
            }
        }
    }
}

/// A JSON-RPC call to the facade with the delegation profile.
async fn post(
    shared: &Shared,
    method: &str,
    params: Value,
    cursor: Option<u64>,
) -> Result<reqwest::Response, String> {
    let body = json!({ "jsonrpc": "2.0", "id": 1, "method": method, "params": params });
    let mut req = shared
        .http
        .post(&shared.facade_url)
        .header("content-type", "application/json")
        .header("A2A-Version", "1.0")
        .header("A2A-Extensions", PROFILE_URI);
    if let Some(c) = cursor {
        req = req.header("OAB-Cursor", c.to_string());
    }
    req.body(body.to_string())
        .send()
        .await
        .map_err(|e| format!("{method}: {e}"))
}

/// Reads SSE events (their `data` JSON) from a response body.
struct SseReader {
    body: Pin<Box<dyn futures_util::Stream<Item = reqwest::Result<bytes::Bytes>> + Send>>,
    buf: String,
}

impl SseReader {
    fn new(resp: reqwest::Response) -> Self {
        SseReader {
            body: Box::pin(resp.bytes_stream()),
            buf: String::new(),
        }
    }

    /// The next event's data; `None` at the end of the stream.
    async fn next(&mut self) -> Option<Result<Value, String>> {
        loop {
            if let Some(pos) = self.buf.find("\n\n") {
                let block: String = self.buf.drain(..pos + 2).collect();
                let data: Vec<&str> = block
                    .lines()
                    .filter_map(|l| l.strip_prefix("data:"))
                    .map(|v| v.strip_prefix(' ').unwrap_or(v))
                    .collect();
                if data.is_empty() {
                    continue;
                }
                return Some(serde_json::from_str(&data.join("\n")).map_err(|e| e.to_string()));
            }
            if self.buf.len() > MAX_SSE_BYTES {
                return Some(Err("an SSE event over 4 MiB".into()));
            }
            match self.body.next().await? {
                Ok(chunk) => self
                    .buf
                    .push_str(&String::from_utf8_lossy(&chunk).replace("\r\n", "\n")),
                Err(e) => return Some(Err(e.to_string())),
            }
        }
    }
}

/// Follows delegation `d` through connector A's facade.
async fn read_facade(shared: &Shared, d: usize) {
    let Some(cell) = shared.seen.get(d) else {
        return;
    };
    let message_id = cell.lock().message_id.clone();
    let message = json!({ "message": {
        "messageId": message_id,
        "role": "ROLE_USER",
        "parts": [{ "text": format!("drill {d}") }],
    }});
    let mut resp = match post(shared, "SendStreamingMessage", message, None).await {
        Ok(r) => Some(r),
        Err(e) => {
            cell.lock().errors.push(e);
            return;
        }
    };
    let mut task_id: Option<String> = None;
    let mut last_fseq = 0u64;
    loop {
        if Instant::now() >= shared.deadline {
            cell.lock()
                .errors
                .push("no terminal before the drill's time limit".into());
            return;
        }
        let Some(r) = resp.take() else {
            // The stream ended early: follow the task again from the cursor
            // (connector A may be restarting: retry until it answers).
            let Some(id) = task_id.clone() else {
                cell.lock()
                    .errors
                    .push("the stream ended before the task was known".into());
                return;
            };
            match post(
                shared,
                "SubscribeToTask",
                json!({ "id": id }),
                Some(last_fseq),
            )
            .await
            {
                Ok(r) if r.status().is_success() => {
                    cell.lock().resubscribed += 1;
                    resp = Some(r);
                }
                Ok(r) => {
                    tracing::debug!(status = %r.status(), "SubscribeToTask refused; retrying");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Err(e) => {
                    tracing::debug!(error = %e, "connector A not reachable; retrying");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
            continue;
        };
        let mut sse = SseReader::new(r);
        loop {
            let item = tokio::select! {
                item = sse.next() => item,
                () = tokio::time::sleep_until(shared.deadline) => None,
            };
            let v = match item {
                Some(Ok(v)) => v,
                // Ended or broken: follow again (above).
                None | Some(Err(_)) => break,
            };
            if let Some(e) = v.get("error") {
                // Connector A restarting may answer before it restored the
                // task; anything else is reported.
                tracing::debug!(error = %e, "JSON-RPC error on the stream");
                if task_id.is_none() {
                    cell.lock().errors.push(format!("JSON-RPC error: {e}"));
                    return;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
                break;
            }
            let r = &v["result"];
            if let Some(task) = r.get("task") {
                // The first event, or a resubscription's snapshot.
                if task_id.is_none() {
                    task_id = task["id"].as_str().map(str::to_string);
                    if let Some(rid) = task["metadata"][PROFILE_URI]["requestId"].as_str() {
                        cell.lock().key = format!("{CALLER}/{rid}");
                    }
                }
                continue;
            }
            let (update, is_status) = match (r.get("statusUpdate"), r.get("artifactUpdate")) {
                (Some(u), _) => (u, true),
                (None, Some(u)) => (u, false),
                _ => continue,
            };
            let meta = &update["metadata"][PROFILE_URI];
            let fseq = meta["seq"].as_u64().unwrap_or(0);
            let mut s = cell.lock();
            if fseq <= last_fseq {
                // Repeated: a resumed stream must start after the cursor.
                s.seq_faults += 1;
                continue;
            }
            if fseq != last_fseq + 1 {
                s.seq_faults += 1;
            }
            last_fseq = fseq;
            s.last_event = Some(Instant::now());
            if is_status {
                if let Some(outcome) = meta["outcome"].as_str() {
                    s.terminals += 1;
                    s.outcome = Some(outcome.to_string());
                    s.verified = meta["verified"] == true;
                    return;
                }
                if let Some(text) = message_text(update["status"].get("message")) {
                    s.ticks.push(text);
                }
            } else if let Some(id) = update["artifact"]["artifactId"].as_str() {
                // Chunks of one artifact count once.
                if s.artifacts.last().map(String::as_str) != Some(id) {
                    s.artifacts.push(id.to_string());
                }
            }
        }
    }
}

/// HAProxy in front of the relay instances, configured as the shipped
/// `deploy/fleet/haproxy.cfg` with checks every 500 ms (production: 2 s),
/// so an instance is taken out within a second.
struct Balancer {
    child: tokio::process::Child,
    addr: SocketAddr,
}

impl Balancer {
    async fn start(
        bin: &std::path::Path,
        setup: &Setup,
        backends: &[(SocketAddr, SocketAddr)],
    ) -> anyhow::Result<Balancer> {
        let addr = free_loopback_addr()?;
        let mut servers = String::new();
        for (i, (relay, admin)) in backends.iter().enumerate() {
            servers.push_str(&format!(
                "    server relay-{} {relay} check port {}\n",
                i + 1,
                admin.port()
            ));
        }
        let cfg = format!(
            "global\n    log stderr format short local0 notice\n\
             defaults\n    mode tcp\n    log global\n    timeout connect 3s\n\
             \x20   timeout client 90s\n    timeout server 90s\n    timeout tunnel 90s\n\
             \x20   timeout client-fin 10s\n    timeout server-fin 10s\n\
             \x20   retries 2\n    option redispatch 1\n\
             frontend oab_relay\n    bind {addr}\n    default_backend oab_relays\n\
             backend oab_relays\n    balance leastconn\n    option httpchk\n\
             \x20   http-check send meth GET uri /readyz\n    http-check expect status 200\n\
             \x20   default-server inter 500ms fall 2 rise 2 on-marked-down shutdown-sessions\n\
             {servers}"
        );
        let path = setup.dir.path().join("haproxy.cfg");
        std::fs::write(&path, cfg).with_context(|| format!("writing {}", path.display()))?;
        let log = setup.dir.path().join("haproxy.log");
        let stderr = std::fs::File::create(&log)?;
        let child = tokio::process::Command::new(bin)
            .arg("-f")
            .arg(&path)
            .arg("-db")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(stderr))
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        let until = Instant::now() + READY_TIMEOUT;
        while tokio::net::TcpStream::connect(addr).await.is_err() {
            if Instant::now() >= until {
                bail!(
                    "haproxy did not listen on {addr}; its log:\n{}",
                    std::fs::read_to_string(&log).unwrap_or_default()
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(Balancer { child, addr })
    }

    async fn stop(&mut self) {
        let _ = self.child.start_kill();
        let _ = tokio::time::timeout(Duration::from_secs(5), self.child.wait()).await;
    }
}

/// Finds `haproxy`: `explicit`, else on `PATH`, else `/usr/sbin/haproxy`.
pub fn find_haproxy(explicit: Option<&std::path::Path>) -> PathBuf {
    if let Some(p) = explicit {
        return p.to_path_buf();
    }
    std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .map(|d| d.join("haproxy"))
        .find(|p| p.is_file())
        .unwrap_or_else(|| PathBuf::from("/usr/sbin/haproxy"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(items: &[&str]) -> Vec<String> {
        items.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn compare_counts_lost_duplicated_and_reordered() {
        let want = v(&["a", "b", "c", "d"]);
        assert_eq!(compare(&want, &want), (0, 0, 0));
        assert_eq!(compare(&want, &v(&["a", "c", "d"])), (1, 0, 0));
        assert_eq!(compare(&want, &v(&["a", "b", "b", "c", "d"])), (0, 1, 0));
        assert_eq!(compare(&want, &v(&["a", "c", "b", "d"])), (0, 0, 1));
        assert_eq!(compare(&want, &v(&["a", "b", "c", "d", "x"])), (0, 1, 0));
    }
}
