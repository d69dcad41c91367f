//! A peer's ordinary retry never stops the store for everyone: a caller
//! sends a burst of `Open`s, then resends the same ones on a new session
//! (as a connector does after a reconnect, `docs/protocol.md` §8.12), while
//! the callee streams on another delegation. Every `Open` is acknowledged
//! once on each session, no error comes back, and the callee's stream goes
//! on throughout. The relay runs in this process on a real redis-server, or
//! on a real Redis Cluster.
//!
//! The many-trial runs behind the figures in `BENCHMARKS.md` are ignored
//! tests: `cargo test -p oab-relay --test resent_opens -- --ignored`.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::*;
use oab_relay::store::{RedisStore, Retention};
use oab_testkit::raw_client::RawClient;
use oab_testkit::redis::{Persistence, RedisCluster, RedisServer};
use oab_wire::{DelegationKey, Direction, Frame};

/// Sends `opens` in one burst and returns how many acks each got, once all
/// were acknowledged (an error frame fails the test).
async fn burst(a: &mut RawClient, opens: &[Frame], keys: &[DelegationKey]) -> Vec<u32> {
    for f in opens {
        a.feed(f).await.unwrap();
    }
    a.flush().await.unwrap();
    let index: HashMap<&DelegationKey, usize> =
        keys.iter().enumerate().map(|(i, k)| (k, i)).collect();
    let mut acks = vec![0u32; keys.len()];
    let mut acked = 0;
    while acked < keys.len() {
        match tokio::time::timeout(Duration::from_secs(30), a.recv())
            .await
            .expect("every open is answered")
            .expect("the session stays up")
        {
            Frame::Ack(x) if x.direction == Direction::Down && x.seq == 1 => {
                if let Some(&i) = index.get(&x.key) {
                    if acks[i] == 0 {
                        acked += 1;
                    }
                    acks[i] += 1;
                }
            }
            Frame::Error(e) => panic!("an open was refused: {e:?}"),
            _ => {}
        }
    }
    acks
}

/// One trial: `n` opens, resent on a new session, while the callee streams.
/// Returns the longest wait of the callee's stream for an ack.
async fn trial(relay: &TestRelay, env: &TestEnv, trial: usize, n: usize) -> Duration {
    let tag = format!("t{trial}");
    // The callee's stream: a delegation of its own, one frame at a time,
    // each acknowledged before the next.
    let mut a = relay.client(&env.caller).await;
    let steady = format!("{tag}-steady");
    a.send(&open_frame(&steady, b"{}")).await.unwrap();
    await_ack(&mut a, &steady, Direction::Down, 1).await;
    let mut b = relay.client(&env.callee).await;
    let stop = Arc::new(AtomicBool::new(false));
    let streaming = {
        let stop = stop.clone();
        let steady = steady.clone();
        tokio::spawn(async move {
            let k = key(&steady);
            let (mut seq, mut longest) = (0u64, Duration::ZERO);
            while !stop.load(Ordering::Relaxed) {
                seq += 1;
                let sent = Instant::now();
                b.send(&data(&steady, Direction::Up, seq, None, payload(seq)))
                    .await
                    .unwrap();
                loop {
                    match tokio::time::timeout(Duration::from_secs(30), b.recv())
                        .await
                        .expect("the callee's stream is answered")
                        .expect("the callee's session stays up")
                    {
                        Frame::Ack(x) if x.key == k && x.seq >= seq => break,
                        Frame::Error(e) => panic!("the stream was refused: {e:?}"),
                        _ => {}
                    }
                }
                longest = longest.max(sent.elapsed());
            }
            (seq, longest)
        })
    };
    let keys: Vec<DelegationKey> = (0..n).map(|i| key(&format!("{tag}-{i}"))).collect();
    let opens: Vec<Frame> = (0..n)
        .map(|i| open_frame(&format!("{tag}-{i}"), b"{}"))
        .collect();
    let first = burst(&mut a, &opens, &keys).await;
    assert!(first.iter().all(|&c| c == 1), "each open acked once");
    drop(a);
    // A new session of the caller resends every one.
    let mut a = relay.client(&env.caller).await;
    let again = burst(&mut a, &opens, &keys).await;
    assert!(
        again.iter().all(|&c| c == 1),
        "each resent open acked once on the new session"
    );
    stop.store(true, Ordering::Relaxed);
    let (frames, longest) = streaming.await.unwrap();
    assert!(frames > 1, "the callee streamed meanwhile");
    // The store froze for 5 s per answer when it stalled; a pause that long
    // is a stall, whatever the machine's load.
    assert!(
        longest < Duration::from_secs(4),
        "the callee's stream paused {longest:?}"
    );
    longest
}

async fn trials(store: RedisStore, rounds: &[(usize, usize)]) {
    let mut env = TestEnv::new("");
    // Every trial's delegations stay open: room for all of them.
    env.config.limits.max_open_per_peer = 100_000;
    for r in &mut env.config.routes {
        r.max_open = 100_000;
    }
    let relay = TestRelay::start(&env, Arc::new(store)).await;
    let mut t = 0;
    for &(count, n) in rounds {
        for _ in 0..count {
            let longest = trial(&relay, &env, t, n).await;
            let replaced = relay
                .metrics()
                .await
                .lines()
                .find(|l| l.starts_with("oab_store_connections_replaced_total"))
                .map(str::to_owned)
                .unwrap_or_default();
            eprintln!(
                "trial {t}: {n} opens resent; the callee's stream paused at most {longest:?} ({replaced})"
            );
            t += 1;
        }
    }
    relay.stop().await;
}

async fn single() -> (RedisServer, RedisStore) {
    let server = RedisServer::start(Persistence::None).unwrap();
    let store = RedisStore::connect(&server.url(), Retention::default())
        .await
        .unwrap();
    (server, store)
}

async fn cluster() -> (RedisCluster, RedisStore) {
    let cluster = RedisCluster::start().unwrap();
    let store = RedisStore::connect(&cluster.url(), Retention::default())
        .await
        .unwrap();
    (cluster, store)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resent_opens_never_stop_the_store_on_redis() {
    let (_server, store) = single().await;
    trials(store, &[(2, 1000)]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resent_opens_never_stop_the_store_on_a_cluster() {
    let (_cluster, store) = cluster().await;
    trials(store, &[(1, 1000)]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "20 trials of 1,000 and 5 of 5,000 (minutes); figures in BENCHMARKS.md"]
async fn resent_opens_many_trials_on_redis() {
    let (_server, store) = single().await;
    trials(store, &[(20, 1000), (5, 5000)]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "20 trials of 1,000 and 5 of 5,000 on a cluster (minutes); figures in BENCHMARKS.md"]
async fn resent_opens_many_trials_on_a_cluster() {
    let (_cluster, store) = cluster().await;
    trials(store, &[(20, 1000), (5, 5000)]).await;
}
