//! Short smoke runs of the connector correctness scenarios, in-process (the
//! relay in-process on the Redis store, real connectors over TLS on
//! loopback): the same as `oab-loadtest --check cancel-race --count 200` and
//! `oab-loadtest --check reconnect-storm --delegations 4 --events 100 --cuts 20`,
//! plus a tiny `delegations` run and a tiny `slow-consumer` run. Asserts the correctness checks and the shape
//! of the JSON, never a timing.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::time::Duration;

use oab_loadtest::relay::{RedisPersistence, RelayMode, StoreKind};
use oab_loadtest::scenario::Common;
use oab_loadtest::scenario::cancel_race::{self, CancelRaceOptions};
use oab_loadtest::scenario::delegations::{self, DelegationsMode, DelegationsOptions};
use oab_loadtest::scenario::reconnect_storm::{self, LinkFault, ReconnectStormOptions};
use oab_loadtest::scenario::slow_consumer::{self, SlowConsumerOptions};
use oab_loadtest::setup::Tuning;

/// `delegations` x `events` every `interval_ms`, `cuts` link faults, all
/// at once on the Redis store; no relay or Redis kills.
fn storm(delegations: u32, events: u32, interval_ms: u64, cuts: u32) -> ReconnectStormOptions {
    ReconnectStormOptions {
        store: StoreKind::Redis,
        delegations,
        in_flight: 0,
        events,
        event_interval: Duration::from_millis(interval_ms),
        cuts,
        faults: vec![LinkFault::Cut],
        heartbeat_ms: None,
        away_max: Duration::from_secs(5),
        terminal_grace: Duration::from_secs(15),
        kill_relay_every: None,
        kill_redis_every: None,
        redis_outage: Duration::from_millis(500),
        cancels_per_outage: 0,
        restart_caller_every: None,
        a2a: false,
        seed: 0,
        timeout: Duration::from_secs(60),
    }
}

fn common() -> Common {
    Common {
        relay: RelayMode::InProcess,
        redis_persistence: RedisPersistence::None,
        drain: Duration::from_secs(30),
        tuning: Tuning::default(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_race_smoke_agrees_on_one_terminal_each() {
    let opts = CancelRaceOptions {
        store: StoreKind::Redis,
        count: 200,
        in_flight: 64,
        turns: 400,
        seed: 0,
        wait_seconds: 60.0,
    };
    let report = cancel_race::run(&opts, &common()).await.unwrap();
    assert!(report.violations.is_empty(), "{:?}", report.violations);
    let r = &report.json["result"];
    assert_eq!(r["delegations"], 200, "{r}");
    assert_eq!(r["agreed"], 200, "{r}");
    assert_eq!(r["progress_equal"], 200, "{r}");
    let outcomes = r["outcomes"].as_object().unwrap();
    let total: u64 = outcomes.values().map(|v| v.as_u64().unwrap()).sum();
    assert_eq!(total, 200, "{r}");
    assert!(report.json["seed"].as_u64().unwrap() > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconnect_storm_smoke_loses_repeats_and_reruns_nothing() {
    let opts = ReconnectStormOptions {
        faults: vec![LinkFault::Cut, LinkFault::Reset, LinkFault::Stall],
        ..storm(4, 100, 10, 20)
    };
    let report = reconnect_storm::run(&opts, &common()).await.unwrap();
    assert!(report.violations.is_empty(), "{:?}", report.violations);
    let ds = report.json["delegations"].as_array().unwrap();
    assert_eq!(ds.len(), 4);
    for d in ds {
        assert_eq!(d["received"], 100, "{d}");
        assert_eq!(d["caller_terminals"], 1, "{d}");
        assert_eq!(d["callee_terminals"], 1, "{d}");
        assert_eq!(d["executor_runs"], 1, "{d}");
        assert_eq!(d["verified"], true, "{d}");
    }
    // The cutter stops early only if every delegation already ended.
    assert!(report.json["result"]["cuts"].as_u64().unwrap() > 0);
}

/// The caller's link goes away right after a reconnect (its resumes in
/// flight) while delegations finish at the callee: each must still reach
/// exactly one terminal at the caller, matching the relay's log, with every
/// event the callee emitted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconnect_storm_away_smoke_delegations_finished_while_caller_away_end_at_the_caller() {
    let opts = ReconnectStormOptions {
        faults: vec![LinkFault::Away],
        ..storm(4, 100, 20, 4)
    };
    let report = reconnect_storm::run(&opts, &common()).await.unwrap();
    assert!(report.violations.is_empty(), "{:?}", report.violations);
    let r = &report.json["result"];
    assert!(r["caller_faults"]["away"].as_u64().unwrap() >= 1, "{r}");
    assert!(
        r["finished_while_caller_away"].as_u64().unwrap() >= 1,
        "{r}"
    );
    assert_eq!(r["no_terminal"], 0, "{r}");
    for d in report.json["delegations"].as_array().unwrap() {
        assert_eq!(d["caller_terminals"], 1, "{d}");
        assert_eq!(d["received"], d["emitted"], "{d}");
        assert_eq!(d["store_terminal"], "completed", "{d}");
        assert_eq!(d["store_up_tail"], d["last_seq"], "{d}");
    }
}

/// The caller's connector is stopped and a new one started on the same
/// state folder, twice, while links are reset and held away: every
/// delegation is taken back and ends exactly once at the caller.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconnect_storm_caller_restart_smoke_takes_every_delegation_back() {
    let opts = ReconnectStormOptions {
        faults: vec![LinkFault::Reset, LinkFault::Away],
        restart_caller_every: Some(Duration::from_millis(700)),
        ..storm(4, 100, 20, 4)
    };
    let report = reconnect_storm::run(&opts, &common()).await.unwrap();
    assert!(report.violations.is_empty(), "{:?}", report.violations);
    let r = &report.json["result"];
    assert!(r["caller_restarts"].as_u64().unwrap() >= 1, "{r}");
    for d in report.json["delegations"].as_array().unwrap() {
        assert_eq!(d["caller_terminals"], 1, "{d}");
        assert_eq!(d["received"], d["emitted"], "{d}");
        assert_eq!(d["store_up_tail"], d["last_seq"], "{d}");
    }
}

/// The away faults with an A2A 1.0 client (JSON-RPC over HTTP, SSE,
/// the delegation profile) on the caller connector's facade: the client
/// reads every emitted event and exactly one terminal, matching the relay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconnect_storm_a2a_smoke_the_facade_client_reads_every_terminal() {
    let opts = ReconnectStormOptions {
        faults: vec![LinkFault::Away],
        a2a: true,
        ..storm(4, 100, 20, 4)
    };
    let report = reconnect_storm::run(&opts, &common()).await.unwrap();
    assert!(report.violations.is_empty(), "{:?}", report.violations);
    for d in report.json["delegations"].as_array().unwrap() {
        assert!(d["key"].as_str().unwrap().contains("#a2a-"), "{d}");
        assert_eq!(d["caller_terminals"], 1, "{d}");
        assert_eq!(d["received"], 100, "{d}");
        assert_eq!(d["verified"], true, "{d}");
        assert_eq!(d["store_up_tail"], d["last_seq"], "{d}");
    }
}

/// redis-server (AOF) is killed mid-append and restarted while delegations
/// stream; a delegation cancelled during the outage ends after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconnect_storm_redis_outage_smoke_cancels_take_effect_after_it() {
    let opts = ReconnectStormOptions {
        kill_redis_every: Some(Duration::from_secs(1)),
        redis_outage: Duration::from_secs(1),
        cancels_per_outage: 1,
        timeout: Duration::from_secs(30),
        ..storm(6, 300, 10, 0)
    };
    let mut c = common();
    c.redis_persistence = RedisPersistence::AofAlways;
    let report = reconnect_storm::run(&opts, &c).await.unwrap();
    assert!(report.violations.is_empty(), "{:?}", report.violations);
    let outages = report.json["result"]["redis_outages"].as_array().unwrap();
    assert!(!outages.is_empty());
    assert_eq!(outages[0]["cancels"], 1, "{outages:?}");
    let ds = report.json["delegations"].as_array().unwrap();
    let cancelled: Vec<_> = ds
        .iter()
        .filter(|d| d["cancel_requested"] == true)
        .collect();
    assert!(!cancelled.is_empty());
    for d in cancelled {
        assert_eq!(d["caller_terminals"], 1, "{d}");
        let o = d["outcome"].as_str().unwrap();
        assert!(o == "cancelled" || o == "completed", "{d}");
    }
}

/// CP mode: every delegation ends with one completed result, direct and
/// through the relay, and a primary with more in flight than its
/// endpoint's `outbound_queue` (256) stays connected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delegations_cp_smoke_completes_every_delegation_past_the_outbound_queue() {
    let opts = DelegationsOptions {
        mode: DelegationsMode::Cp,
        stores: vec![StoreKind::Memory],
        in_flight: vec![1, 300],
        events: 0,
        seconds: 0.3,
        max_delegations: 600,
        baseline_seconds: 0.1,
        cp_nagle: false,
        cp_url: None,
    };
    let report = delegations::run(&opts, &common()).await.unwrap();
    assert!(report.violations.is_empty(), "{:?}", report.violations);
    let levels = report.json["levels"].as_array().unwrap();
    let paths: Vec<_> = levels.iter().map(|l| l["path"].as_str().unwrap()).collect();
    assert_eq!(paths, ["direct", "direct", "relay-memory", "relay-memory"]);
    for l in levels {
        assert!(l["completed"].as_u64().unwrap() > 0, "{l}");
        assert_eq!(l["failed"], 0, "{l}");
        assert_eq!(l["disconnected"], false, "{l}");
    }
    // The 300-in-flight level started at least its 300.
    assert!(
        levels[3]["completed"].as_u64().unwrap() >= 300,
        "{}",
        levels[3]
    );
}

/// CP mode with the clients' Nagle's algorithm on (as OpenAB's client):
/// the run says so and every delegation still completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delegations_cp_smoke_with_nagle_on_completes_every_delegation() {
    let opts = DelegationsOptions {
        mode: DelegationsMode::Cp,
        stores: vec![StoreKind::Memory],
        in_flight: vec![1],
        events: 0,
        seconds: 0.3,
        max_delegations: 50,
        baseline_seconds: 0.1,
        cp_nagle: true,
        cp_url: None,
    };
    let report = delegations::run(&opts, &common()).await.unwrap();
    assert!(report.violations.is_empty(), "{:?}", report.violations);
    assert_eq!(report.json["params"]["cp_nagle"], true);
    for l in report.json["levels"].as_array().unwrap() {
        assert!(l["completed"].as_u64().unwrap() > 0, "{l}");
        assert_eq!(l["failed"], 0, "{l}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delegations_smoke_verifies_every_delegation() {
    let opts = DelegationsOptions {
        mode: DelegationsMode::Library,
        stores: vec![StoreKind::Memory],
        in_flight: vec![1, 8],
        events: 10,
        seconds: 0.3,
        max_delegations: 200,
        baseline_seconds: 0.2,
        cp_nagle: false,
        cp_url: None,
    };
    let report = delegations::run(&opts, &common()).await.unwrap();
    assert!(report.violations.is_empty(), "{:?}", report.violations);
    let levels = report.json["levels"].as_array().unwrap();
    assert_eq!(levels.len(), 2);
    for l in levels {
        assert!(l["verified"].as_u64().unwrap() > 0, "{l}");
        assert_eq!(l["failed"], 0, "{l}");
        // Where the level's CPU went: this process's is always readable;
        // the memory store has no redis-server to read.
        let cpu = &l["cpu_us_per_delegation"];
        assert!(cpu["loadtest"].as_f64().is_some_and(|us| us >= 0.0), "{l}");
        assert!(cpu["redis"].is_null(), "{l}");
    }
    assert!(
        report.json["baselines"][0]["frames_per_sec"]
            .as_f64()
            .unwrap()
            > 0.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_consumer_smoke_resumes_every_frame_exactly_once() {
    let opts = SlowConsumerOptions {
        store: StoreKind::Memory,
        pairs: 2,
        rate: 200.0,
        size: 256,
        stalled_rate: 500.0,
        stalled_size: 16 * 1024,
        before_seconds: 0.5,
        stall_seconds: 2.0,
        after_seconds: 0.5,
        slow_consumer_ms: 300,
    };
    let report = slow_consumer::run(&opts, &common()).await.unwrap();
    assert!(report.violations.is_empty(), "{:?}", report.violations);
    assert_eq!(report.json["relay"]["tuning"]["slow_consumer_ms"], 300);
    let rs = report.json["receivers"].as_array().unwrap();
    assert_eq!(rs.len(), 3);
    for r in rs {
        assert!(r["sent"].as_u64().unwrap() > 0, "{r}");
        assert_eq!(r["check"]["received"], r["sent"], "{r}");
    }
    let res = &report.json["result"];
    // Whether the relay cut it or only replayed, the outcome is recorded.
    assert!(res["stalled_disconnect"].as_str().is_some(), "{res}");
    assert!(res["rss"]["samples"].as_u64().unwrap() > 0, "{res}");
}

/// A stand-in for an external CP server such as openab-cp, only as much as
/// `--cp-url` needs: every connection registers; a primary's `cp/delegate`
/// is acked (with an admission and the worker's name) and forwarded to the
/// registered worker, whose `cp/delegate_result` goes back to the primary.
/// Counts the delegations it routed.
async fn stub_cp_hub(
    listener: tokio::net::TcpListener,
    routed: std::sync::Arc<std::sync::atomic::AtomicU64>,
) {
    use futures_util::{SinkExt as _, StreamExt as _};
    use serde_json::{Value, json};
    use std::sync::atomic::Ordering;
    use tokio::sync::mpsc;
    use tokio_tungstenite::tungstenite::Message;

    type Tx = mpsc::UnboundedSender<String>;
    let worker: std::sync::Arc<tokio::sync::Mutex<Option<Tx>>> = Default::default();
    let primary: std::sync::Arc<tokio::sync::Mutex<Option<Tx>>> = Default::default();
    loop {
        let Ok((tcp, _)) = listener.accept().await else {
            return;
        };
        let (worker, primary, routed) = (worker.clone(), primary.clone(), routed.clone());
        tokio::spawn(async move {
            let Ok(ws) = tokio_tungstenite::accept_async(tcp).await else {
                return;
            };
            let (mut sink, mut stream) = ws.split();
            let (tx, mut rx) = mpsc::unbounded_channel::<String>();
            tokio::spawn(async move {
                while let Some(t) = rx.recv().await {
                    if sink.send(Message::text(t)).await.is_err() {
                        return;
                    }
                }
            });
            let mut admission = 0u64;
            while let Some(Ok(msg)) = stream.next().await {
                let Message::Text(t) = msg else { continue };
                let m: Value = serde_json::from_str(t.as_str()).unwrap();
                let (id, params) = (m["id"].clone(), m["params"].clone());
                let answer = |result: Value| json!({"jsonrpc": "2.0", "id": id, "result": result});
                match m["method"].as_str() {
                    Some("cp/register") => {
                        let slot = if params["type"] == "worker" {
                            &worker
                        } else {
                            &primary
                        };
                        *slot.lock().await = Some(tx.clone());
                        let ack = answer(json!({
                            "protocol_version": 1, "heartbeat_interval_secs": 15,
                            "lease_expiry_secs": 45,
                            "effective_max_delegated_sessions": params["max_delegated_sessions"],
                        }));
                        let _ = tx.send(ack.to_string());
                    }
                    Some("cp/delegate") => {
                        admission += 1;
                        let d = params["delegation_id"].clone();
                        let ack = answer(json!({
                            "delegation_id": d, "admission": admission,
                            "assigned_to": "prod/reviewer",
                        }));
                        let _ = tx.send(ack.to_string());
                        let fwd = json!({"jsonrpc": "2.0", "id": admission, "method": "cp/delegate",
                            "params": {"delegation_id": d, "admission": admission,
                                "prompt": params["prompt"], "deadline": params["deadline"],
                                "from": "prod/koudu", "chain": ["prod/koudu"]}});
                        if let Some(w) = worker.lock().await.as_ref() {
                            let _ = w.send(fwd.to_string());
                        }
                    }
                    Some("cp/delegate_result") => {
                        let _ = tx.send(answer(json!({"ok": true})).to_string());
                        routed.fetch_add(1, Ordering::Relaxed);
                        let out = json!({"jsonrpc": "2.0", "id": 0, "method": "cp/delegate_result",
                            "params": params});
                        if let Some(p) = primary.lock().await.as_ref() {
                            let _ = p.send(out.to_string());
                        }
                    }
                    Some(_) => {
                        let _ = tx.send(answer(json!({"ok": true})).to_string());
                    }
                    None => {}
                }
            }
        });
    }
}

/// CP mode against an external CP server (`--cp-url`): the primary and the
/// worker both connect to it, every delegation completes through it, and
/// the run reports that one path only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delegations_cp_smoke_against_an_external_cp_url() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let routed = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    tokio::spawn(stub_cp_hub(listener, routed.clone()));
    let opts = DelegationsOptions {
        mode: DelegationsMode::Cp,
        stores: vec![StoreKind::Memory],
        in_flight: vec![1, 16],
        events: 0,
        seconds: 0.3,
        max_delegations: 200,
        baseline_seconds: 0.1,
        cp_nagle: false,
        cp_url: Some(format!("ws://{addr}/cp")),
    };
    let report = delegations::run(&opts, &common()).await.unwrap();
    assert!(report.violations.is_empty(), "{:?}", report.violations);
    assert_eq!(report.json["params"]["cp_url"], format!("ws://{addr}/cp"));
    let levels = report.json["levels"].as_array().unwrap();
    let paths: Vec<_> = levels.iter().map(|l| l["path"].as_str().unwrap()).collect();
    assert_eq!(paths, ["external", "external"]);
    let mut completed = 0;
    for l in levels {
        assert!(l["completed"].as_u64().unwrap() > 0, "{l}");
        assert_eq!(l["failed"], 0, "{l}");
        completed += l["completed"].as_u64().unwrap();
    }
    assert_eq!(
        routed.load(std::sync::atomic::Ordering::Relaxed),
        completed,
        "every completed round trip went through the external CP"
    );
}
