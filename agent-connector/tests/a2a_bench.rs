//! SSE streaming benchmark: the official Python a2a-sdk client against the
//! official SDK sample server, directly and through the OAB path, in one run:
//!
//! ```text
//! direct:  bench.py ------------------------------------------------------------> sample_agent.py
//! relay:   bench.py -> connector A facade -> relay (TLS) -> connector B driver -> sample_agent.py
//! ```
//!
//! Ignored in normal test runs. Run it with
//!
//! ```text
//! cargo test --release -p oab-connector --test a2a_bench -- --ignored --nocapture
//! ```
//!
//! Needs the virtualenv made by `scripts/python-env`. Writes
//! `loadtest-results/a2a.json`. Parameters can be changed with
//! `A2A_BENCH_EVENTS`, `A2A_BENCH_TASKS`, `A2A_BENCH_CONCURRENCY`,
//! `A2A_BENCH_LATENCY_TASKS`. See `tests/interop/bench.py` for what each
//! number measures.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod a2a_support;
mod common;

use std::sync::Arc;
use std::time::Duration;

use a2a_support::*;
use common::*;
use oab_relay::store::{MemoryStore, Retention};
use serde_json::{Value, json};

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// CPU seconds (user + system) a process has used so far, from
/// `/proc/<pid>/stat` (clock ticks of 1/100 s, the Linux default).
fn cpu_seconds(pid: &str) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return f64::NAN;
    };
    let Some((_, rest)) = stat.rsplit_once(')') else {
        return f64::NAN;
    };
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = f[11].parse::<u64>().unwrap_or(0) + f[12].parse::<u64>().unwrap_or(0);
    ticks as f64 / 100.0
}

struct Run {
    events: u64,
    tasks: u64,
    concurrency: u64,
    warmup: u64,
}

/// Runs bench.py once; adds the CPU the sample agent and this process (relay,
/// both connectors, facade, driver) used meanwhile.
async fn bench(url: &str, label: &str, run: &Run, agent_pid: &str) -> Value {
    let script = repo().join("agent-connector/tests/interop/bench.py");
    let (agent0, own0) = (cpu_seconds(agent_pid), cpu_seconds("self"));
    let out = tokio::time::timeout(
        Duration::from_secs(900),
        tokio::process::Command::new(python())
            .arg(script)
            .args(["--url", url, "--label", label])
            .args(["--events", &run.events.to_string()])
            .args(["--tasks", &run.tasks.to_string()])
            .args(["--concurrency", &run.concurrency.to_string()])
            .args(["--warmup", &run.warmup.to_string()])
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("bench.py finishes in time")
    .unwrap();
    assert!(
        out.status.success(),
        "bench.py failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let mut r: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "bench.py printed no JSON ({e}):\n{}",
            String::from_utf8_lossy(&out.stdout)
        )
    });
    let round = |x: f64| (x * 1000.0).round() / 1000.0;
    // Includes the warm-up tasks; the client's own figure does not.
    r["server_cpu_s"] = json!(round(cpu_seconds(agent_pid) - agent0));
    r["oab_cpu_s"] = json!(round(cpu_seconds("self") - own0));
    assert_eq!(
        r["tasks_failed"], 0,
        "{label}: tasks failed: {}",
        r["failures"]
    );
    r
}

fn num(v: &Value, path: &[&str]) -> Option<f64> {
    path.iter().try_fold(v, |v, k| v.get(*k))?.as_f64()
}

const ROWS: &[(&str, &[&str])] = &[
    ("events/s", &["events_per_s"]),
    ("tasks/s", &["tasks_per_s"]),
    ("wall s", &["wall_s"]),
    ("event latency p50 ms", &["latency_ms", "p50"]),
    ("event latency p90 ms", &["latency_ms", "p90"]),
    ("event latency p99 ms", &["latency_ms", "p99"]),
    ("first event p50 ms", &["ttfe_ms", "p50"]),
    ("first event p90 ms", &["ttfe_ms", "p90"]),
    ("first event p99 ms", &["ttfe_ms", "p99"]),
    ("first bench event p50 ms", &["ttfbe_ms", "p50"]),
    ("task time p50 ms", &["task_ms", "p50"]),
    ("task time p90 ms", &["task_ms", "p90"]),
    ("task time p99 ms", &["task_ms", "p99"]),
    ("client CPU s", &["client_cpu_s"]),
    ("server CPU s", &["server_cpu_s"]),
    ("OAB CPU s (relay+A+B)", &["oab_cpu_s"]),
];

/// Prints the table; returns the ratios (relay / direct).
fn table(title: &str, direct: &Value, relay: &Value) -> Value {
    println!("\n{title}");
    println!(
        "{:<26} {:>12} {:>12} {:>14}",
        "metric", "direct", "via relay", "relay/direct"
    );
    let mut ratios = serde_json::Map::new();
    for (name, path) in ROWS {
        let (d, r) = (num(direct, path), num(relay, path));
        // The direct path runs no OAB code: its OAB CPU is idle noise.
        let ratio = match (d, r) {
            (Some(d), Some(r)) if d > 0.0 && !name.starts_with("OAB") => {
                Some((r / d * 1000.0).round() / 1000.0)
            }
            _ => None,
        };
        let show = |x: Option<f64>| x.map_or("-".to_string(), |x| format!("{x:.2}"));
        println!(
            "{:<26} {:>12} {:>12} {:>14}",
            name,
            show(d),
            show(r),
            show(ratio)
        );
        ratios.insert((*name).to_string(), json!(ratio));
    }
    Value::Object(ratios)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark: cargo test --release -p oab-connector --test a2a_bench -- --ignored --nocapture"]
async fn sse_stream_direct_vs_through_the_relay() {
    let (mut agent, port) = sample_agent().await;
    let agent_pid = agent.id().unwrap().to_string();
    let agent_url = format!("http://127.0.0.1:{port}");

    let env = Env::new("");
    let relay = Relay::start(&env, Arc::new(MemoryStore::new(Retention::default()))).await;
    let (a, b, card) = driver_topology(&env, &relay, &agent_url).await;
    let _ = card;
    let facade = FacadeServer::start(a.caller().clone(), facade_options()).await;
    let facade_url = facade.url(CALLEE);

    let events = env_or("A2A_BENCH_EVENTS", 50);
    let throughput = Run {
        events,
        tasks: env_or("A2A_BENCH_TASKS", 200),
        concurrency: env_or("A2A_BENCH_CONCURRENCY", 8),
        warmup: 8,
    };
    let latency = Run {
        events,
        tasks: env_or("A2A_BENCH_LATENCY_TASKS", 30),
        concurrency: 1,
        warmup: 2,
    };

    let t_direct = bench(&agent_url, "direct", &throughput, &agent_pid).await;
    let t_relay = bench(&facade_url, "relay", &throughput, &agent_pid).await;
    let l_direct = bench(&agent_url, "direct-single", &latency, &agent_pid).await;
    let l_relay = bench(&facade_url, "relay-single", &latency, &agent_pid).await;

    let t_ratio = table(
        &format!(
            "throughput: {} tasks x {} events, concurrency {}",
            throughput.tasks, throughput.events, throughput.concurrency
        ),
        &t_direct,
        &t_relay,
    );
    let l_ratio = table(
        &format!(
            "single task latency: {} tasks x {} events, one at a time",
            latency.tasks, latency.events
        ),
        &l_direct,
        &l_relay,
    );

    let report = json!({
        "benchmark": "a2a-sse-stream",
        "command": "cargo test --release -p oab-connector --test a2a_bench -- --ignored --nocapture",
        "topology": {
            "direct": "bench.py (a2a-sdk client) -> sample_agent.py (a2a-sdk server)",
            "relay": "bench.py -> connector A facade -> relay (TLS, in-process) -> connector B driver -> sample_agent.py",
        },
        "measured": "events_per_s: bench events received / wall time; latency_ms: per event, client receipt (time.time_ns after SDK parse) - server send (time.time_ns when the executor made the event), same machine clock; ttfe_ms: send_message call -> first event (the task); ttfbe_ms: -> first bench event; task_ms: call -> end of stream; percentiles nearest-rank; server/OAB CPU include the warm-up tasks",
        "cpus": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        "throughput": { "direct": t_direct, "relay": t_relay, "ratio_relay_over_direct": t_ratio },
        "single_task": { "direct": l_direct, "relay": l_relay, "ratio_relay_over_direct": l_ratio },
    });
    let dir = repo().join("loadtest-results");
    std::fs::create_dir_all(&dir).unwrap();
    let dir = dir.canonicalize().unwrap();
    let path = dir.join("a2a.json");
    std::fs::write(&path, serde_json::to_string_pretty(&report).unwrap() + "\n").unwrap();
    println!("\nwrote {}", path.display());

    facade.stop().await;
    a.shutdown().await;
    b.shutdown().await;
    relay.stop().await;
    agent.kill().await.unwrap();
}
