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
use oab_relay::testing::{Persistence, RedisServer};
use oab_wire::Outcome;

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
    // The callee reaches the fleet through a TCP proxy standing in for an L4
    // load balancer; the caller connects to instance 1 directly.
    let lb = Proxy::start(relays[1].addr).await.unwrap();
    let exec = Paced::gated(600, Duration::ZERO, 100);
    let b = connector(&env, &env.callee, lb.addr(), Some(exec.clone()));
    let a = connector(&env, &env.caller, relays[0].addr, None);
    a.connected().await.unwrap();
    b.connected().await.unwrap();
    let h = a
        .caller()
        .delegate(&peer(CALLEE), spec("stream across instances"))
        .await
        .unwrap();
    let mut events = a.caller().events(&h, 0).await.unwrap();
    let mut last = 0u64;
    let mut failed_over = false;
    let t = loop {
        let ev = tokio::time::timeout(Duration::from_secs(60), events.next())
            .await
            .unwrap_or_else(|_| panic!("no progress after event {last}"))
            .expect("stream open")
            .expect("no gap");
        assert_eq!(ev.seq, last + 1, "every event exactly once, in order");
        last = ev.seq;
        if !failed_over && last == 101 {
            // Accepted + 100 events, and the executor waits. The balancer
            // sends new connections to instance 3 and drops the existing
            // ones: the callee reconnects there, and the rest of the stream
            // flows instance 3 -> Redis -> instance 1.
            let handle = lb.handle();
            handle.set_upstream(relays[2].addr);
            handle.cut_all();
            handle.wait_until(|s| s.accepted >= 2).await;
            failed_over = true;
            exec.open_gate();
        }
        if let EventKind::Terminal(t) = ev.kind {
            break t;
        }
    };
    assert!(failed_over);
    assert_eq!(t.outcome, Outcome::Completed);
    assert_eq!(last, 602, "accepted + 600 events + terminal");
    a.caller().verify(&h, &t).unwrap();
    assert_eq!(exec.runs(), 1, "the executor ran exactly once");
    assert!(
        lb.handle().stats().accepted >= 2,
        "the callee reconnected through the balancer"
    );
    a.shutdown().await;
    b.shutdown().await;
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
    let exec = Paced::gated(600, Duration::ZERO, 100);
    let b = connector(&env, &env.callee, lb.addr(), Some(exec.clone()));
    let a = connector(&env, &env.caller, relays[0].addr, None);
    a.connected().await.unwrap();
    b.connected().await.unwrap();
    let h = a
        .caller()
        .delegate(&peer(CALLEE), spec("survive the callee's relay crashing"))
        .await
        .unwrap();
    let mut events = a.caller().events(&h, 0).await.unwrap();
    let mut last = 0u64;
    let mut crashed = false;
    let t = loop {
        let ev = tokio::time::timeout(Duration::from_secs(60), events.next())
            .await
            .unwrap_or_else(|_| panic!("no progress after event {last}"))
            .expect("stream open")
            .expect("no gap");
        assert_eq!(ev.seq, last + 1, "every event exactly once, in order");
        last = ev.seq;
        if !crashed && last == 101 {
            // The callee's instance dies; the balancer's health check sends
            // the reconnect to instance 3, and the callee resumes there.
            let handle = lb.handle();
            handle.set_upstream(relays[2].addr);
            relays[1].crash();
            handle.wait_until(|s| s.accepted >= 2).await;
            crashed = true;
            exec.open_gate();
        }
        if let EventKind::Terminal(t) = ev.kind {
            break t;
        }
    };
    assert!(crashed);
    assert_eq!(
        t.outcome,
        Outcome::Completed,
        "not unknown: the callee lived"
    );
    assert_eq!(last, 602, "accepted + 600 events + terminal");
    a.caller().verify(&h, &t).unwrap();
    assert_eq!(exec.runs(), 1, "the executor ran exactly once");
    a.shutdown().await;
    b.shutdown().await;
    for r in &mut relays {
        r.crash();
    }
}
