//! Connectors on a fleet of relay instances over one Redis: the caller's
//! and the callee's links land on different instances; the callee's load
//! balancer (a TCP proxy) fails over to a third instance while the
//! delegation streams, or the callee's instance crashes.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use futures_util::StreamExt as _;
use oab_connector::EventKind;
use oab_loadtest::proxy::Proxy;
use oab_relay::store::{RedisStore, Retention};
use oab_testkit::redis::{Persistence, RedisServer};
use oab_wire::Outcome;

/// Events the callee streams, and after which one the fault lands.
const EVENTS: u64 = 600;
const FAULT_AFTER: u64 = 100;

/// The caller connects to `caller_relay`; the callee reaches the fleet
/// through `lb`, a TCP proxy standing in for an L4 load balancer. The callee
/// streams [`EVENTS`] events; once the caller has seen [`FAULT_AFTER`] of
/// them (the executor then waits), `fault` runs and the callee must come back
/// through the balancer before the rest flows. Checks that every event
/// arrives exactly once and in order, one `completed` terminal, verified,
/// and one execution.
async fn stream_across_a_fault(
    env: &Env,
    caller_relay: std::net::SocketAddr,
    lb: &Proxy,
    fault: impl FnOnce(),
) {
    let exec = Paced::gated(EVENTS, Duration::ZERO, FAULT_AFTER);
    let b = connector(env, &env.callee, lb.addr(), Some(exec.clone()));
    let a = connector(env, &env.caller, caller_relay, None);
    a.connected().await.unwrap();
    b.connected().await.unwrap();
    let h = a
        .caller()
        .delegate(&peer(CALLEE), spec("stream across instances"))
        .await
        .unwrap();
    let mut events = a.caller().events(&h, 0).await.unwrap();
    let mut last = 0u64;
    let mut fault = Some(fault);
    let t = loop {
        let ev = tokio::time::timeout(Duration::from_secs(60), events.next())
            .await
            .unwrap_or_else(|_| panic!("no progress after event {last}"))
            .expect("stream open")
            .expect("no gap");
        assert_eq!(ev.seq, last + 1, "every event exactly once, in order");
        last = ev.seq;
        // `accepted` is event 1.
        if last == FAULT_AFTER + 1
            && let Some(fault) = fault.take()
        {
            let before = lb.handle().stats().accepted;
            fault();
            lb.handle().wait_until(|s| s.accepted > before).await;
            exec.open_gate();
        }
        if let EventKind::Terminal(t) = ev.kind {
            break t;
        }
    };
    assert!(fault.is_none(), "the fault was injected mid-stream");
    assert_eq!(
        t.outcome,
        Outcome::Completed,
        "not unknown: the callee lived"
    );
    assert_eq!(last, EVENTS + 2, "accepted + events + terminal");
    a.caller().verify(&h, &t).unwrap();
    assert_eq!(exec.runs(), 1, "the executor ran exactly once");
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delegation_across_instances_survives_a_load_balancer_failover() {
    let env = Env::new("heartbeat_ms = 100\nidle_timeout_ms = 600\n");
    let redis = RedisServer::start(Persistence::Aof).unwrap();
    let mut relays = Vec::new();
    for _ in 0..3 {
        let store = RedisStore::connect(&redis.url(), Retention::default())
            .await
            .unwrap();
        relays.push(Relay::start(&env, Arc::new(store)).await);
    }
    let lb = Proxy::start(relays[1].addr).await.unwrap();
    // The balancer sends new connections to instance 3 and drops the
    // existing ones: the rest of the stream flows instance 3 -> Redis ->
    // instance 1.
    let handle = lb.handle();
    let third = relays[2].addr;
    stream_across_a_fault(&env, relays[0].addr, &lb, || {
        handle.set_upstream(third);
        handle.cut_all();
    })
    .await;
    for r in relays {
        r.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn callee_instance_crash_mid_delegation_loses_and_repeats_nothing() {
    let env = Env::new("heartbeat_ms = 100\nidle_timeout_ms = 600\n");
    let redis = RedisServer::start(Persistence::Aof).unwrap();
    let mut relays: Vec<Crashable> = (0..3)
        .map(|_| Crashable::start(&env, &redis.url()))
        .collect();
    let lb = Proxy::start(relays[1].addr).await.unwrap();
    // The callee's instance dies; the balancer's health check sends the
    // reconnect to instance 3, where the callee resumes.
    let handle = lb.handle();
    let (caller_relay, third) = (relays[0].addr, relays[2].addr);
    let (_, rest) = relays.split_at_mut(1);
    stream_across_a_fault(&env, caller_relay, &lb, || {
        handle.set_upstream(third);
        rest[0].crash();
    })
    .await;
    for r in &mut relays {
        r.crash();
    }
}
