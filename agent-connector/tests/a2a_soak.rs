//! Blocking `SendMessage` soak: many blocking sends through connector A's
//! A2A facade, a fixed number at a time, with no fault injected, on a relay
//! backed by a real redis-server:
//!
//! ```text
//! JSON-RPC client -> connector A facade -> relay (TLS, Redis) -> connector B driver -> sample_agent.py
//! ```
//!
//! Every send must come back `TASK_STATE_COMPLETED`. A send that does not
//! (within [`SEND_BOUND`]) is reported with its delegation key and what the
//! relay's store holds for it: sends activate the delegation profile, so a
//! send's delegation key follows from its message id.
//!
//! The acceptance run (10,000 sends, 8 at a time) is ignored in normal test
//! runs:
//!
//! ```text
//! cargo test --release -p oab-connector --test a2a_soak -- --ignored --nocapture
//! ```
//!
//! `A2A_SOAK_SENDS` and `A2A_SOAK_CONCURRENCY` change its size. The relay
//! runs as its own process (the `oab-relay` binary of the same build
//! profile; build it first with `cargo build [--release] -p oab-relay`), as
//! in production, with `OAB_LOG` passed on (its log is printed when a send
//! fails); `A2A_SOAK_RELAY=in-process` runs it in this process instead.
//!
//! A short variant (a few hundred sends, relay in this process) runs with
//! the normal tests.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod a2a_support;
mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use a2a_support::*;
use common::*;
use futures_util::StreamExt as _;
use oab_relay::store::{EventStore as _, RedisStore, Retention};
use oab_testkit::redis::{Persistence, RedisServer};
use oab_wire::{DelegationKey, Digest, RequestId};
use serde_json::json;

/// How long one blocking send may take before it counts as hung. The
/// sample agent answers at once, so this only bounds a hang.
const SEND_BOUND: Duration = Duration::from_secs(30);

fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The delegation key the facade derives for a message id when the client
/// activates the profile (`a2a-` + the first 128 bits of
/// SHA-256(`peer` "\n" `messageId`)).
fn key_of(message_id: &str) -> DelegationKey {
    let d = Digest::of(format!("{CALLEE}\n{message_id}").as_bytes());
    let request_id =
        RequestId::new(&format!("a2a-{}", &oab_wire::digest::hex(&d.0)[..32])).unwrap();
    DelegationKey::new(peer(CALLER), request_id)
}

/// One blocking send; `None` when it completed, else what went wrong.
async fn send(rpc: &Rpc, message_id: &str) -> Option<String> {
    let body = json!({
        "jsonrpc": "2.0",
        "id": 1,
        "method": "SendMessage",
        "params": { "message": message(message_id, "echo") },
    });
    let mut req = rpc
        .http
        .post(&rpc.url)
        .header("content-type", "application/json")
        .body(body.to_string());
    for (k, v) in with_profile(&[]) {
        req = req.header(k, v);
    }
    let answer = tokio::time::timeout(SEND_BOUND, async {
        let resp = req.send().await.map_err(|e| e.to_string())?;
        resp.json::<serde_json::Value>()
            .await
            .map_err(|e| e.to_string())
    })
    .await;
    match answer {
        Err(_) => Some(format!("no answer within {SEND_BOUND:?}")),
        Ok(Err(e)) => Some(format!("transport: {e}")),
        Ok(Ok(r)) => {
            let state = &r["result"]["task"]["status"]["state"];
            (state != "TASK_STATE_COMPLETED").then(|| format!("answered {r}"))
        }
    }
}

/// Runs `sends` blocking sends, `concurrency` at a time, on a fresh Redis
/// backed topology (the relay as a process unless `in_process`); panics
/// with the list of sends that did not complete.
async fn soak(sends: usize, concurrency: usize, in_process: bool) {
    let (mut agent, port) = sample_agent().await;
    let agent_url = format!("http://127.0.0.1:{port}");
    let redis = RedisServer::start(Persistence::None).unwrap();
    let store = Arc::new(
        RedisStore::connect(&redis.url(), Retention::default())
            .await
            .unwrap(),
    );
    let env = Env::new("");
    let relay = if in_process {
        SoakRelay::InProcess(Relay::start(&env, store.clone()).await)
    } else {
        SoakRelay::process(&env, &redis.url()).await
    };
    let (a, b, _card) = driver_topology_at(&env, relay.addr(), &agent_url).await;
    let facade = FacadeServer::start(a.caller().clone(), facade_options()).await;
    let rpc = Arc::new(Rpc::new(facade.url(CALLEE)));

    let run = format!("{:08x}", rand_u32());
    let started = Instant::now();
    let failures: Vec<(String, String)> = futures_util::stream::iter(0..sends)
        .map(|i| {
            let rpc = rpc.clone();
            let id = format!("soak-{run}-{i}");
            async move { send(&rpc, &id).await.map(|why| (id, why)) }
        })
        .buffer_unordered(concurrency)
        .filter_map(|f| async move { f })
        .collect()
        .await;
    let wall = started.elapsed();

    let mut report = Vec::new();
    for (id, why) in &failures {
        let key = key_of(id);
        let meta = store.meta(&key).await;
        report.push(format!("{id} key {key}: {why}; relay store: {meta:?}"));
    }
    println!(
        "a2a soak: {sends} blocking sends, {concurrency} at a time, Redis store, relay {}: \
         {} completed, {} did not, in {:.1} s",
        if in_process { "in process" } else { "process" },
        sends - failures.len(),
        failures.len(),
        wall.as_secs_f64()
    );
    assert!(
        failures.is_empty(),
        "{} of {sends} sends did not complete:\n{}\nrelay log (tail):\n{}",
        failures.len(),
        report.join("\n"),
        relay.log_tail()
    );

    facade.stop().await;
    a.shutdown().await;
    b.shutdown().await;
    relay.stop().await;
    agent.kill().await.unwrap();
}

/// The relay of a soak run.
enum SoakRelay {
    InProcess(Relay),
    Process(Box<RelayProcess>),
}

impl SoakRelay {
    /// Starts the `oab-relay` binary next to this test's executable on the
    /// Redis store at `redis_url` (`cargo build [--release] -p oab-relay`
    /// first, or set A2A_SOAK_RELAY=in-process).
    async fn process(env: &Env, redis_url: &str) -> SoakRelay {
        SoakRelay::Process(Box::new(RelayProcess::start(env, redis_url).await))
    }

    fn addr(&self) -> std::net::SocketAddr {
        match self {
            SoakRelay::InProcess(r) => r.addr,
            SoakRelay::Process(p) => p.addr,
        }
    }

    fn log_tail(&self) -> String {
        match self {
            SoakRelay::InProcess(_) => "(in this process)".into(),
            SoakRelay::Process(p) => {
                let text = p.log();
                let lines: Vec<&str> = text.lines().collect();
                lines[lines.len().saturating_sub(200)..].join("\n")
            }
        }
    }

    async fn stop(self) {
        match self {
            SoakRelay::InProcess(r) => r.stop().await,
            SoakRelay::Process(mut p) => p.kill().await,
        }
    }
}

fn rand_u32() -> u32 {
    let mut b = [0u8; 4];
    rand_core::RngCore::fill_bytes(&mut rand_core::OsRng, &mut b);
    u32::from_be_bytes(b)
}

/// The acceptance run: 10,000 blocking sends, 8 at a time, every one
/// completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "soak: cargo test --release -p oab-connector --test a2a_soak -- --ignored --nocapture"]
async fn ten_thousand_blocking_sends_all_complete() {
    soak(
        env_or("A2A_SOAK_SENDS", 10_000),
        env_or("A2A_SOAK_CONCURRENCY", 8),
        std::env::var("A2A_SOAK_RELAY").as_deref() == Ok("in-process"),
    )
    .await;
}

/// The short variant: 400 blocking sends, 8 at a time, every one completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocking_sends_on_redis_all_complete() {
    soak(400, 8, true).await;
}
