//! Nothing acknowledged is lost across a relay kill, a Redis kill with AOF,
//! and a Redis restart without persistence is reported, never silent.
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
use oab_relay::store::{RedisStore, Retention};
use oab_testkit::redis::{Persistence, RedisServer};
use oab_wire::{CloseCode, Direction, ErrorCode, Frame, GapReason, InstanceId, Resume};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_killed_and_restarted_on_redis_loses_nothing() {
    let env = TestEnv::new("");
    let redis = RedisServer::start(Persistence::Aof).unwrap();
    let mut relay = RelayProcess::start(&env, &redis.url()).await;
    let (ia, ib) = (InstanceId::random(), InstanceId::random());
    let mut b = relay.client_as(&env.callee, ib).await;
    let mut a = relay.client_as(&env.caller, ia).await;
    open_and_stream_up(&mut a, &mut b, "k1", 300, 150).await;
    relay.kill();
    let (seen, _) = drain_until_broken(&mut a, "k1", 0, 0).await;
    let (_, acked) = drain_until_broken(&mut b, "k1", 0, 150).await;
    relay.restart().await;
    let mut a = relay.client_as(&env.caller, ia).await;
    let mut b = relay.client_as(&env.callee, ib).await;
    a.send(&Frame::Resume(Resume {
        key: key("k1"),
        direction: Direction::Up,
        after: seen,
    }))
    .await
    .unwrap();
    send_until_acked(&mut b, "k1", acked, 501, true).await;
    read_to_terminal(&mut a, "k1", seen, 501).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_with_aof_loses_no_acknowledged_frame() {
    let env = TestEnv::new("[lifecycle]\nsweep_interval_ms = 20\n");
    let mut redis = RedisServer::start(Persistence::Aof).unwrap();
    let store = RedisStore::connect(&redis.url(), Retention::default())
        .await
        .unwrap();
    let relay = TestRelay::start(&env, Arc::new(store)).await;
    let mut b = relay.client(&env.callee).await;
    let mut a = relay.client(&env.caller).await;
    let epoch = a.welcome.epoch;
    a.send(&open_frame("a1", b"{}")).await.unwrap();
    await_ack(&mut a, "a1", Direction::Down, 1).await;
    recv_until(&mut b, |f| matches!(f, Frame::Open(_)).then_some(())).await;
    let acked = send_until_acked(&mut b, "a1", 0, 200, false).await;
    assert_eq!(acked, 200);
    redis.kill().unwrap();
    // While Redis is down nothing new is acknowledged.
    b.send(&data("a1", Direction::Up, 201, None, payload(201)))
        .await
        .unwrap();
    let code = recv_until(&mut b, |f| match f {
        Frame::Error(e) => Some(e.code),
        Frame::Ack(a) if a.seq > 200 => panic!("acked while the store was down"),
        _ => None,
    })
    .await;
    assert_eq!(code, ErrorCode::StoreUnavailable.as_u16());
    redis.restart().unwrap();
    send_until_acked(&mut b, "a1", 200, 301, true).await;
    // The caller reads everything, and a fresh session sees the same epoch.
    read_to_terminal(&mut a, "a1", 0, 301).await;
    let a2 = relay.client(&env.caller).await;
    assert_eq!(a2.welcome.epoch, epoch, "AOF kept the store's identity");
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_restart_without_persistence_is_reported_as_gap() {
    let env = TestEnv::new("[lifecycle]\nsweep_interval_ms = 20\n");
    let mut redis = RedisServer::start(Persistence::None).unwrap();
    let store = RedisStore::connect(&redis.url(), Retention::default())
        .await
        .unwrap();
    let relay = TestRelay::start(&env, Arc::new(store)).await;
    let mut b = relay.client(&env.callee).await;
    let mut a = relay.client(&env.caller).await;
    let epoch = a.welcome.epoch;
    a.send(&open_frame("n1", b"{}")).await.unwrap();
    await_ack(&mut a, "n1", Direction::Down, 1).await;
    recv_until(&mut b, |f| matches!(f, Frame::Open(_)).then_some(())).await;
    send_until_acked(&mut b, "n1", 0, 10, true).await;
    read_to_terminal(&mut a, "n1", 0, 10).await;
    redis.kill().unwrap();
    redis.restart().unwrap();
    // The relay notices the new epoch and closes sessions so peers reconcile.
    let code = loop {
        match tokio::time::timeout(Duration::from_secs(20), a.recv())
            .await
            .expect("closed")
        {
            Ok(_) => continue,
            Err(oab_testkit::raw_client::ClientError::Closed { code, .. }) => break code,
            Err(e) => panic!("{e}"),
        }
    };
    assert_eq!(code, CloseCode::StoreUnavailable.as_u16());
    let mut a = relay.client(&env.caller).await;
    assert_ne!(
        a.welcome.epoch, epoch,
        "the welcome shows the store changed"
    );
    a.send(&Frame::Resume(Resume {
        key: key("n1"),
        direction: Direction::Up,
        after: 10,
    }))
    .await
    .unwrap();
    let gap = recv_until(&mut a, |f| match f {
        Frame::Gap(g) => Some(g.clone()),
        Frame::Data(_) => panic!("data from a log the store lost"),
        _ => None,
    })
    .await;
    assert_eq!(gap.reason, GapReason::EpochChanged);
    relay.stop().await;
}

/// A caller's release (a `Resume` of the up log after its terminal) is
/// recognised whether or not the relay still has the delegation in memory:
/// here it comes after a restart. The relay answers nothing, compacts the
/// delegation in Redis (only its meta hash is left), and a later `Resume`
/// from before the tail gets `Gap trimmed` with nothing available and the
/// outcome: the entries are gone, the outcome is not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_after_a_restart_compacts_and_keeps_the_outcome() {
    let env = TestEnv::new("");
    let redis = RedisServer::start(Persistence::Aof).unwrap();
    let mut relay = RelayProcess::start(&env, &redis.url()).await;
    let (ia, ib) = (InstanceId::random(), InstanceId::random());
    let mut b = relay.client_as(&env.callee, ib).await;
    let mut a = relay.client_as(&env.caller, ia).await;
    a.send(&open_frame("r1", b"{}")).await.unwrap();
    await_ack(&mut a, "r1", Direction::Down, 1).await;
    recv_until(&mut b, |f| matches!(f, Frame::Open(_)).then_some(())).await;
    send_until_acked(&mut b, "r1", 0, 5, true).await;
    read_to_terminal(&mut a, "r1", 0, 5).await;

    relay.restart().await;
    let mut a = relay.client_as(&env.caller, ia).await;
    let mut raw = redis::Client::open(redis.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let prefix = format!("oab:d:{{{}}}:", key("r1"));
    let logs = |raw: &mut redis::aio::MultiplexedConnection| {
        let (mut raw, prefix) = (raw.clone(), prefix.clone());
        async move {
            let keys: Vec<String> = redis::cmd("KEYS")
                .arg(format!("{prefix}*"))
                .query_async(&mut raw)
                .await
                .unwrap();
            keys.into_iter().filter(|k| !k.ends_with(":meta")).count()
        }
    };
    assert_eq!(
        logs(&mut raw).await,
        2,
        "both logs are kept until the release"
    );
    a.send(&Frame::Resume(Resume {
        key: key("r1"),
        direction: Direction::Up,
        after: 5,
    }))
    .await
    .unwrap();
    tokio::time::timeout(Duration::from_secs(30), async {
        while logs(&mut raw).await > 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the release compacts the delegation");

    a.send(&Frame::Resume(Resume {
        key: key("r1"),
        direction: Direction::Up,
        after: 2,
    }))
    .await
    .unwrap();
    let gap = recv_until(&mut a, |f| match f {
        Frame::Gap(g) if g.key == key("r1") => Some(g.clone()),
        Frame::Data(d) if d.key == key("r1") => panic!("replayed {} after the release", d.seq),
        _ => None,
    })
    .await;
    assert_eq!(
        (gap.reason, gap.first_available, gap.terminal),
        (GapReason::Trimmed, 0, Some(oab_wire::Outcome::Completed))
    );
}
