//! A partial store outage: one master of a three-master Redis Cluster is
//! stopped for a few seconds under a relay process with live sessions.
//! `/readyz` says not ready, naming the unreachable shard, while it is down
//! and ready again once it is back; the relay's log stays a few lines long
//! however many Redis client errors the outage causes.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::Duration;

use common::{LoggedRelay, TestEnv, await_ack, data, http_get, open_frame, payload, recv_until};
use oab_testkit::raw_client::{RawClient, Target};
use oab_testkit::redis::RedisCluster;
use oab_wire::{Direction, Frame, InstanceId};

/// Delegations opened before the outage: spread over the three shards by
/// their hash tags (each shard gets some with this many).
const DELEGATIONS: u64 = 12;

/// Polls `/readyz` until `f` accepts the response (bounded); returns it.
async fn await_readyz(relay: &LoggedRelay, what: &str, f: impl Fn(&str) -> bool) -> String {
    let mut last = String::new();
    for _ in 0..300 {
        last = http_get(relay.admin, "/readyz").await;
        if f(&last) {
            return last;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!(
        "/readyz never {what}; last answer:\n{last}\nlog:\n{}",
        relay.log()
    );
}

/// A master that hangs (SIGSTOP: its port still accepts connections, it
/// answers nothing) makes the instance not ready within the probe timeout,
/// named like a dead one, and ready again once it continues.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_master_is_not_ready_until_it_continues() {
    let mut cluster = tokio::task::spawn_blocking(RedisCluster::start)
        .await
        .unwrap()
        .unwrap();
    let env = TestEnv::new("");
    let relay = LoggedRelay::start(&env, &cluster.url(), &["fleet.node=relay-1"], "warn").await;
    await_readyz(&relay, "ready", |r| r.contains(" 200 OK")).await;
    let hung = cluster.node_urls()[1]
        .trim_start_matches("redis://")
        .to_owned();
    cluster.pause_node(1).unwrap();
    let down = await_readyz(&relay, "not ready", |r| r.contains(" 503 ")).await;
    assert!(
        down.contains(&format!(
            "master {hung} (slots 5461-10921) unreachable: timed out"
        )),
        "{down}"
    );
    cluster.resume_node(1).unwrap();
    await_readyz(&relay, "ready again", |r| r.contains(" 200 OK")).await;
    drop(cluster);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_master_down_is_not_ready_and_logs_little() {
    let mut cluster = tokio::task::spawn_blocking(RedisCluster::start)
        .await
        .unwrap()
        .unwrap();
    let env = TestEnv::new("");
    let relay = LoggedRelay::start(
        &env,
        &cluster.url(),
        &[
            "fleet.node=relay-1",
            "fleet.node_lease_ms=1500",
            "fleet.sweeper_lease_ms=1000",
            "lifecycle.sweep_interval_ms=20",
        ],
        "info",
    )
    .await;
    await_readyz(&relay, "ready", |r| r.contains(" 200 OK")).await;
    let target = Target {
        addr: relay.addr.to_string(),
        server_name: Some("localhost".into()),
        root_der: env.cert_der.clone(),
    };
    let mut caller = RawClient::connect(&target, &env.caller, InstanceId::random())
        .await
        .unwrap();
    let mut callee = RawClient::connect(&target, &env.callee, InstanceId::random())
        .await
        .unwrap();
    for i in 0..DELEGATIONS {
        let r = format!("r{i}");
        caller.send(&open_frame(&r, b"{}")).await.unwrap();
        await_ack(&mut caller, &r, Direction::Down, 1).await;
        recv_until(&mut callee, |f| matches!(f, Frame::Open(_)).then_some(())).await;
    }
    // Load while the master is down: the callee streams events into every
    // delegation (those on the stopped shard fail to append).
    let stop = tokio_util::sync::CancellationToken::new();
    let load = {
        let stop = stop.clone();
        tokio::spawn(async move {
            let mut seq = 0;
            while !stop.is_cancelled() {
                seq += 1;
                for i in 0..DELEGATIONS {
                    let frame = data(&format!("r{i}"), Direction::Up, seq, None, payload(seq));
                    if callee.feed(&frame).await.is_err() {
                        return seq;
                    }
                }
                if callee.flush().await.is_err() {
                    return seq;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            seq
        })
    };
    let before = relay.log().lines().count();

    // Node 2 serves the last third of the slots.
    let dead = cluster.node_urls()[2]
        .trim_start_matches("redis://")
        .to_owned();
    cluster.kill_node(2).unwrap();
    let down = await_readyz(&relay, "not ready", |r| r.contains(" 503 ")).await;
    assert!(
        down.contains(&format!("master {dead} (slots 10922-16383) unreachable")),
        "the answer names the shard that is down:\n{down}"
    );
    // Store errors name the shard that is down (the fleet's liveness key,
    // renewed every 500 ms, is on node 2's slots), never a redirect. The
    // first one comes once the cluster client gave up its retries (up to
    // its 5 s response timeout): the shard stays down until then (bounded).
    let names_it =
        |l: &str| l.contains("the shard of slot") && l.contains(&format!("(master {dead})"));
    let named = tokio::time::timeout(Duration::from_secs(30), async {
        while !relay.log().lines().skip(before).any(names_it) {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    assert!(
        named.is_ok(),
        "no store error named the shard that is down:\n{}",
        relay
            .log()
            .lines()
            .skip(before)
            .collect::<Vec<_>>()
            .join("\n")
    );
    let cluster = tokio::task::spawn_blocking(move || cluster.restart_node(2).map(|()| cluster))
        .await
        .unwrap()
        .unwrap();
    await_readyz(&relay, "ready again", |r| r.contains(" 200 OK")).await;
    stop.cancel();
    eprintln!("load sent {} rounds", load.await.unwrap());
    drop(caller);
    let log = relay.log();
    let during: Vec<&str> = log.lines().skip(before).collect();
    let shown = during.join("\n");
    // Without the rate limit, the Redis client alone wrote 100-300 lines a
    // second here. With it: at most one line per Redis module and level per
    // 10 s, plus the relay's own warnings (a few a second).
    let from_client = during.iter().filter(|l| l.contains(" redis::")).count();
    assert!(
        from_client <= 8,
        "{from_client} Redis client lines:\n{shown}"
    );
    assert!(
        during.len() <= 120,
        "{} lines during the outage:\n{shown}",
        during.len()
    );
    assert!(during.iter().any(|l| names_it(l)), "{shown}");
    assert!(!during.iter().any(|l| l.contains("Moved")), "{shown}");
    eprintln!(
        "{} lines during the outage ({from_client} from the Redis client):\n{shown}",
        during.len()
    );
    drop(cluster);
}

/// `check-config` names the store's kind and address, without the password.
#[test]
fn check_config_says_redis_cluster() {
    let env = TestEnv::new("");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_oab-relay"))
        .arg("check-config")
        .arg(&env.config_path)
        .env(
            "OAB_RELAY_STORE",
            "redis-cluster://u:hunter2@10.0.0.1:7001,10.0.0.2:7002",
        )
        .output()
        .unwrap();
    let shown = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{shown}");
    assert!(
        shown.contains("store redis cluster 10.0.0.1:7001,10.0.0.2:7002)"),
        "{shown}"
    );
    assert!(!shown.contains("hunter2"), "{shown}");
}
