//! `a2a-sdk`: blocking A2A `SendMessage` calls from the official Python SDK
//! client to the official Python SDK agent, directly and through OAB, in one
//! run, with the CPU each process spends per delegation.
//!
//! ```text
//! direct: bench.py ---------------------------------------------------------------------> sample_agent.py
//! relay:  bench.py -> connector A facade (child) -> relay (child, Redis) -> connector B driver (child) -> sample_agent.py
//! ```
//!
//! `bench.py --blocking` (in `agent-connector/tests/interop`) sends
//! `--tasks` blocking `SendMessage` requests, `--concurrency` at a time,
//! after `--warmup` unmeasured ones; the agent (`sample_agent.py`, the
//! SDK's own server) completes each at once with an echo artifact. Both
//! Python programs run in the virtualenv `scripts/python-env` makes.
//!
//! Per path and round it reports delegations per second and the call
//! latency (from the client), and the CPU time (user + system) each process
//! used over the whole `bench.py` run (warm-up included), divided by the
//! delegations of that run: the agent, the relay, connector A, connector B
//! (`/proc/<pid>/stat`) and Redis (`INFO cpu`); plus the Redis commands the
//! relay path issued per delegation (`INFO commandstats`). Rounds alternate
//! the order of the two paths. A failed call is a violation.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context as _, bail};
use serde_json::{Value, json};
use tokio::io::AsyncBufReadExt as _;

use super::soak::{free_loopback_addr, wait_ready};
use super::{Common, cpu_seconds, relay_bin, run_header};
use crate::connector_process::{ConnectorProcess, ConnectorRole};
use crate::relay::{RelayMode, RelayUnderTest, StoreKind};
use crate::report::{Report, Table, fmt_count};
use crate::setup::{CALLEE, Setup};

/// How long the agent may take to start (Python imports the SDK).
const AGENT_START_TIMEOUT: Duration = Duration::from_secs(60);

/// How long one `bench.py` run may take.
const BENCH_TIMEOUT: Duration = Duration::from_secs(1800);

/// What the scenario runs.
#[derive(Debug, Clone)]
pub struct A2aSdkOptions {
    /// Measured delegations per path and round.
    pub tasks: u64,
    /// Calls in flight at once.
    pub concurrency: u64,
    /// Unmeasured calls before each run.
    pub warmup: u64,
    /// Rounds (each runs both paths, alternating the order).
    pub rounds: u32,
    /// The `oab-connector` binary.
    pub connector_bin: PathBuf,
    /// The virtualenv's Python.
    pub python: PathBuf,
    /// The folder holding `bench.py` and `sample_agent.py`.
    pub interop_dir: PathBuf,
}

/// CPU seconds per process so far.
#[derive(Debug, Clone, Copy, Default)]
struct Cpu {
    agent: f64,
    relay: f64,
    a: f64,
    b: f64,
    redis: f64,
}

struct Procs<'a> {
    agent: u32,
    relay: &'a RelayUnderTest,
    a: &'a ConnectorProcess,
    b: &'a ConnectorProcess,
}

impl Procs<'_> {
    async fn cpu(&self) -> anyhow::Result<Cpu> {
        let of = |pid: Option<u32>| -> anyhow::Result<f64> {
            let pid = pid.context("a process without a pid")?;
            cpu_seconds(&pid.to_string()).with_context(|| format!("reading /proc/{pid}/stat"))
        };
        Ok(Cpu {
            agent: of(Some(self.agent))?,
            relay: of(self.relay.pid())?,
            a: of(Some(self.a.pid()))?,
            b: of(Some(self.b.pid()))?,
            redis: self.relay.redis_cpu_seconds().await?,
        })
    }
}

async fn start_agent(opts: &A2aSdkOptions) -> anyhow::Result<(tokio::process::Child, u16)> {
    start_sample_agent(&opts.python, &opts.interop_dir).await
}

/// Starts the official-SDK sample agent (`sample_agent.py` in
/// `interop_dir`, run by `python`) on a free loopback port; returns the
/// child and its port once it serves.
pub async fn start_sample_agent(
    python: &std::path::Path,
    interop_dir: &std::path::Path,
) -> anyhow::Result<(tokio::process::Child, u16)> {
    let mut child = tokio::process::Command::new(python)
        .arg(interop_dir.join("sample_agent.py"))
        .arg("--port=0")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("starting {} sample_agent.py", python.display()))?;
    let stdout = child.stdout.take().context("the agent's stdout")?;
    let mut lines = tokio::io::BufReader::new(stdout).lines();
    let line = tokio::time::timeout(AGENT_START_TIMEOUT, lines.next_line())
        .await
        .context("the sample agent did not start in time")??
        .context("the sample agent exited before it was ready")?;
    let port = line
        .strip_prefix("READY ")
        .and_then(|p| p.trim().parse().ok())
        .with_context(|| format!("the sample agent printed {line:?}, not READY <port>"))?;
    // Keep reading its stdout so it never blocks on a full pipe.
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    Ok((child, port))
}

/// Runs `bench.py --blocking` once against `url`; returns its JSON.
async fn bench(opts: &A2aSdkOptions, url: &str, label: &str) -> anyhow::Result<Value> {
    let out = tokio::time::timeout(
        BENCH_TIMEOUT,
        tokio::process::Command::new(&opts.python)
            .arg(opts.interop_dir.join("bench.py"))
            .args(["--blocking", "--url", url, "--label", label])
            .args(["--tasks", &opts.tasks.to_string()])
            .args(["--concurrency", &opts.concurrency.to_string()])
            .args(["--warmup", &opts.warmup.to_string()])
            .stdin(Stdio::null())
            .kill_on_drop(true)
            .output(),
    )
    .await
    .context("bench.py did not finish in time")?
    .context("running bench.py")?;
    if !out.status.success() {
        bail!(
            "bench.py failed ({}):\n{}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    serde_json::from_slice(&out.stdout).with_context(|| {
        format!(
            "bench.py printed no JSON:\n{}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

fn f(v: &Value, path: &[&str]) -> f64 {
    path.iter()
        .try_fold(v, |v, k| v.get(*k))
        .and_then(Value::as_f64)
        .unwrap_or(f64::NAN)
}

fn us(x: f64) -> String {
    if x.is_nan() {
        "-".into()
    } else {
        format!("{x:.0}")
    }
}

/// Runs the scenario.
pub async fn run(opts: &A2aSdkOptions, common: &Common) -> anyhow::Result<Report> {
    if !matches!(common.relay, RelayMode::Process(_)) {
        bail!(
            "a2a-sdk measures the relay's own CPU: it needs the oab-relay binary as a child \
             process (--relay process, or build it next to oab-loadtest)"
        );
    }
    for (what, p) in [
        ("the oab-connector binary", &opts.connector_bin),
        (
            "the virtualenv's Python (run scripts/python-env)",
            &opts.python,
        ),
    ] {
        if !p.is_file() {
            bail!("{what} {} does not exist", p.display());
        }
    }
    let setup = Setup::new(0, common.tuning.clone())?;
    let relay = RelayUnderTest::start(
        &setup,
        &common.relay,
        StoreKind::Redis,
        common.redis_persistence,
    )
    .await?;
    let (mut agent, port) = start_agent(opts).await?;
    let agent_pid = agent.id().context("the agent's pid")?;
    let agent_url = format!("http://127.0.0.1:{port}");
    let facade_addr = free_loopback_addr()?;
    let mut b = ConnectorProcess::start(
        &setup,
        &opts.connector_bin,
        relay.addr(),
        &ConnectorRole {
            name: "connector-b".into(),
            identity: setup.callee.clone(),
            peers: vec![setup.caller.clone()],
            max_concurrent: 1024,
            facade_listen: None,
            driver_url: Some(agent_url.clone()),
            default_timeout_ms: 60_000,
        },
    )?;
    let mut a = ConnectorProcess::start(
        &setup,
        &opts.connector_bin,
        relay.addr(),
        &ConnectorRole {
            name: "connector-a".into(),
            identity: setup.caller.clone(),
            peers: vec![setup.callee.clone()],
            max_concurrent: 1024,
            facade_listen: Some(facade_addr),
            driver_url: None,
            default_timeout_ms: 60_000,
        },
    )?;
    wait_ready(&reqwest::Client::new(), facade_addr, &mut a, &mut b).await?;
    let facade_url = format!("http://{facade_addr}/peers/{CALLEE}/");
    tracing::info!(
        agent_pid,
        relay_pid = relay.pid(),
        connector_a_pid = a.pid(),
        connector_b_pid = b.pid(),
        "a2a-sdk: everything is up"
    );
    let procs = Procs {
        agent: agent_pid,
        relay: &relay,
        a: &a,
        b: &b,
    };

    let per_run = (opts.tasks + opts.warmup) as f64;
    let mut violations = Vec::new();
    let mut runs = Vec::new();
    let mut table = Table::new(
        format!(
            "a2a-sdk: blocking SendMessage, official Python SDK client and agent, {} calls \
             ({} warm-up) x {} at once, per round and path",
            opts.tasks, opts.warmup, opts.concurrency
        ),
        &[
            "round",
            "path",
            "deleg/s",
            "vs direct",
            "call p50 ms",
            "call p99 ms",
            "agent µs/d",
            "relay µs/d",
            "conn A µs/d",
            "conn B µs/d",
            "redis µs/d",
            "OAB µs/d",
            "redis cmds/d",
        ],
    );
    for round in 0..opts.rounds {
        let order: [&str; 2] = if round % 2 == 0 {
            ["direct", "relay"]
        } else {
            ["relay", "direct"]
        };
        let mut direct_rate = f64::NAN;
        let mut this_round = BTreeMap::new();
        for path in order {
            let url = if path == "direct" {
                &agent_url
            } else {
                &facade_url
            };
            let calls0 = relay.redis_command_calls().await?;
            let c0 = procs.cpu().await?;
            let r = bench(opts, url, path).await?;
            let c1 = procs.cpu().await?;
            let calls1 = relay.redis_command_calls().await?;
            let per = |x0: f64, x1: f64| (x1 - x0) / per_run * 1e6;
            let cmds: BTreeMap<String, f64> = calls1
                .iter()
                .map(|(k, n)| {
                    let before = calls0.get(k).copied().unwrap_or(0);
                    (k.clone(), n.saturating_sub(before) as f64 / per_run)
                })
                .filter(|(_, n)| *n > 0.0)
                .collect();
            let failed = f(&r, &["tasks_failed"]);
            if failed != 0.0 {
                violations.push(format!(
                    "round {round}, {path}: {failed} calls failed: {}",
                    r["failures"]
                ));
            }
            let rec = json!({
                "round": round,
                "path": path,
                "client": r,
                "cpu_us_per_delegation": {
                    "agent": per(c0.agent, c1.agent),
                    "relay": per(c0.relay, c1.relay),
                    "connector_a": per(c0.a, c1.a),
                    "connector_b": per(c0.b, c1.b),
                    "redis": per(c0.redis, c1.redis),
                    "oab": per(c0.relay + c0.a + c0.b, c1.relay + c1.a + c1.b),
                },
                "redis_commands_per_delegation": cmds,
            });
            this_round.insert(path, rec);
        }
        for path in ["direct", "relay"] {
            let Some(rec) = this_round.remove(path) else {
                continue;
            };
            let rate = f(&rec, &["client", "tasks_per_s"]);
            if path == "direct" {
                direct_rate = rate;
            }
            let cpu = |k: &str| f(&rec, &["cpu_us_per_delegation", k]);
            let cmds: f64 = rec["redis_commands_per_delegation"]
                .as_object()
                .map_or(0.0, |m| m.values().filter_map(Value::as_f64).sum());
            let relay_path = path == "relay";
            let oab = |x: f64| if relay_path { us(x) } else { "-".into() };
            table.row(vec![
                round.to_string(),
                path.into(),
                fmt_count(rate),
                format!("{:.2}", rate / direct_rate),
                format!("{:.1}", f(&rec, &["client", "task_ms", "p50"])),
                format!("{:.1}", f(&rec, &["client", "task_ms", "p99"])),
                us(cpu("agent")),
                oab(cpu("relay")),
                oab(cpu("connector_a")),
                oab(cpu("connector_b")),
                oab(cpu("redis")),
                oab(cpu("oab")),
                if relay_path {
                    format!("{cmds:.1}")
                } else {
                    "-".into()
                },
            ]);
            runs.push(rec);
        }
    }

    let mut header = run_header("a2a-sdk", common, relay_bin(common).as_deref());
    if let Some(obj) = header.as_object_mut() {
        obj.insert(
            "options".into(),
            json!({
                "tasks": opts.tasks,
                "concurrency": opts.concurrency,
                "warmup": opts.warmup,
                "rounds": opts.rounds,
                "connector_bin": opts.connector_bin.display().to_string(),
            }),
        );
        obj.insert("runs".into(), json!(runs));
    }
    let notes = vec![
        "µs/d: CPU time (user + system) of the process over the whole bench.py run \
         (warm-up included) / its delegations; OAB = relay + connector A + connector B; \
         redis cmds/d: Redis commands of the run (INFO commandstats) / its delegations."
            .to_string(),
    ];

    a.stop().await;
    b.stop().await;
    let _ = agent.start_kill();
    let _ = tokio::time::timeout(Duration::from_secs(5), agent.wait()).await;
    relay.stop().await;
    Ok(Report {
        scenario: "a2a-sdk",
        tables: vec![table],
        notes,
        json: header,
        violations,
    })
}
