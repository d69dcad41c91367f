//! Connector A's memory over many delegations through its A2A facade,
//! measured on the process itself: connector A runs as the `oab-connector`
//! binary (`run`, with a state folder and the facade), the relay (on a real
//! redis-server) and connector B run in this process, and a JSON-RPC client
//! sends blocking `SendMessage`s through A's facade.
//!
//! A measurement, not a pass/fail test: it prints A's resident set size
//! (`VmRSS` from `/proc/<pid>/status`) after a warm-up and after the run,
//! the growth per delegation, and the number of files in A's state folder.
//! Ignored in normal runs:
//!
//! ```text
//! cargo test --release -p oab-connector --test caller_memory -- --ignored --nocapture
//! ```
//!
//! `CALLER_MEMORY_SENDS` (default 5,000) and `CALLER_MEMORY_WARMUP`
//! (default 1,000) change its size; `OAB_CONNECTOR_BIN` runs another build
//! of the binary (e.g. an earlier version, for comparison).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::print_stdout
)]

mod a2a_support;
mod common;

use std::sync::Arc;
use std::time::Duration;

use a2a_support::*;
use common::*;
use futures_util::StreamExt as _;
use oab_relay::store::{RedisStore, Retention};
use oab_testkit::redis::{Persistence, RedisServer};
use serde_json::json;

/// Sends in flight at once.
const CONCURRENCY: usize = 8;

fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// `VmRSS` of process `pid`, in kB.
fn rss_kb(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS in /proc/<pid>/status")
}

async fn send_all(rpc: &Rpc, from: usize, n: usize) {
    let send = |i: usize| async move {
        let reply = rpc
            .call(
                "SendMessage",
                json!({ "message": message(&format!("m-{i}"), "work") }),
                V1,
            )
            .await;
        assert_eq!(
            reply["result"]["task"]["status"]["state"], "TASK_STATE_COMPLETED",
            "send {i}: {reply}"
        );
    };
    futures_util::stream::iter(from..from + n)
        .map(send)
        .buffer_unordered(CONCURRENCY)
        .collect::<Vec<()>>()
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "measurement: run with --release -- --ignored --nocapture"]
async fn connector_a_memory_per_delegation() {
    let sends = env_or("CALLER_MEMORY_SENDS", 5_000);
    let warmup = env_or("CALLER_MEMORY_WARMUP", 1_000);
    let env = Env::new("");
    let redis = RedisServer::start(Persistence::None).unwrap();
    let store = RedisStore::connect(&redis.url(), Retention::default())
        .await
        .unwrap();
    let relay = Relay::start(&env, Arc::new(store)).await;
    let b = connector(
        &env,
        &env.callee,
        relay.addr,
        Some(Paced::new(1, Duration::ZERO)),
    );
    b.connected().await.unwrap();

    // Connector A as its own process.
    let dir = tempfile::tempdir().unwrap();
    let identity = dir.path().join("a.identity.toml");
    oab_connector::keyfile::save(&env.caller, &identity).unwrap();
    let ca = dir.path().join("relay-ca.pem");
    std::fs::write(&ca, &env.cert_pem).unwrap();
    let state = dir.path().join("state");
    let facade_port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let config = format!(
        "[connector]\nrelay_url = \"wss://localhost:{}/\"\nidentity = \"{}\"\nrelay_ca = \"{}\"\nstate_dir = \"{}\"\n\n\
         [[peers]]\nid = \"{}\"\nkeys = [{{ key_id = \"k1\", public_key = \"{}\" }}]\n\n\
         [policy]\nallowed_capabilities = [\"read:*\"]\n\n\
         [a2a]\nfacade_listen = \"127.0.0.1:{facade_port}\"\ndefault_capabilities = [\"read:repo\"]\n",
        relay.addr.port(),
        identity.display(),
        ca.display(),
        state.display(),
        env.callee.peer,
        env.callee.public_key(),
    );
    let config_path = dir.path().join("a.toml");
    std::fs::write(&config_path, config).unwrap();
    let bin = std::env::var("OAB_CONNECTOR_BIN")
        .unwrap_or_else(|_| env!("CARGO_BIN_EXE_oab-connector").to_string());
    let mut child = tokio::process::Command::new(&bin)
        .args(["run", "--config"])
        .arg(&config_path)
        .env("OAB_LOG", "warn")
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let pid = child.id().unwrap();

    let rpc = Rpc::new(format!("http://127.0.0.1:{facade_port}/peers/{CALLEE}/"));
    let until = tokio::time::Instant::now() + STEP;
    loop {
        let up = rpc
            .http
            .get(format!("http://127.0.0.1:{facade_port}/peers"))
            .send()
            .await
            .is_ok_and(|r| r.status().is_success());
        if up {
            break;
        }
        assert!(
            tokio::time::Instant::now() < until,
            "connector A's facade never came up"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let start_kb = rss_kb(pid);
    send_all(&rpc, 0, warmup).await;
    let warm_kb = rss_kb(pid);
    let started = std::time::Instant::now();
    send_all(&rpc, warmup, sends).await;
    let elapsed = started.elapsed();
    let end_kb = rss_kb(pid);
    let files = std::fs::read_dir(&state).unwrap().count();
    let per = (end_kb.saturating_sub(warm_kb) * 1024) / u64::try_from(sends).unwrap();
    println!(
        "connector A ({bin}): VmRSS {start_kb} kB at start, {warm_kb} kB after {warmup} delegations, \
         {end_kb} kB after {} ({per} bytes per delegation over the last {sends}); \
         {files} files in state_dir; {:.0} delegations/s",
        warmup + sends,
        sends as f64 / elapsed.as_secs_f64(),
    );
    child.kill().await.unwrap();
    b.shutdown().await;
    relay.stop().await;
}
