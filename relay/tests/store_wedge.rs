//! The Redis store never freezes for everyone because of one caller, and a
//! connection that stops answering is replaced.
//!
//! The freeze: a caller (a session answering a run of resent opens in
//! order) starts many store calls at once, takes the first answer, and makes
//! another store call while the rest of its calls wait unpolled. The redis
//! crate queues each request for the connection's writer in a bounded,
//! first-come-first-served channel; room that frees up is handed to the
//! oldest waiting request even when nobody polls it, so once the unpolled
//! calls hold all of it, no request of anyone reaches Redis and every one
//! times out, while Redis and the socket sit idle. The store hands each
//! request, at once and in order, to a task of its own that drives them
//! all and is always polled, so no caller can hold the connection's room;
//! the requests still reach Redis in the order they were made.
//!
//! The replacement: a proxy in front of a real `redis-server` holds the
//! replies of the store's connection; the store, and a relay on it, must
//! serve again on a new connection within the response timeout plus one
//! second, and count the replacement.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::future::Future;
use std::sync::Arc;
use std::task::{Context, Waker};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::StreamExt;
use futures_util::stream::FuturesOrdered;
use oab_relay::store::{
    AppendOutcome, AppendRequest, EventStore, OpenOutcome, OpenRequest, Origin, RedisStore,
    Retention,
};
use oab_testkit::redis::{Persistence, RedisServer};
use oab_testkit::reply_proxy::{ReplyProxy, Upstream};
use oab_wire::{DelegationKey, Digest, Direction, InstanceId, PeerId, RequestId};

mod common;

/// The store's response timeout (`RESPONSE_TIMEOUT` in
/// `relay/src/store/redis/mod.rs`).
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a store call on an idle local Redis may take here: well under
/// the response timeout, so a stalled store shows as a stall, not as a
/// timeout error.
const PROMPT: Duration = Duration::from_secs(2);

/// Opens a peer sends, then resends on a new session (the burst).
const OPENS: usize = 1000;

/// The opens of one run a session answers in order (`MAX_BATCH` in
/// `relay/src/session.rs`).
const RUN: usize = 256;

fn peer(s: &str) -> PeerId {
    PeerId::new(s).unwrap()
}

fn key(i: usize) -> DelegationKey {
    DelegationKey::new(
        peer("acme/caller"),
        RequestId::new(&format!("r-{i}")).unwrap(),
    )
}

fn now_ms() -> u64 {
    oab_wire::identity::now_ms()
}

fn open_req(key: &DelegationKey, now_ms: u64) -> OpenRequest {
    OpenRequest {
        key: key.clone(),
        callee: peer("acme/callee"),
        deadline_ms: now_ms + 3_600_000,
        digest: Digest::of(b"payload"),
        trace: None,
        frame: Bytes::from(format!("open {key}")),
        now_ms,
        wake: None,
    }
}

async fn store_on(server: &RedisServer) -> RedisStore {
    RedisStore::connect(&server.url(), Retention::default())
        .await
        .unwrap()
}

/// The most the caller pattern can hold at once: store calls
/// started and then left unpolled (neither driven nor dropped) while the
/// same task waits for another store call. Before the fix the calls left
/// unpolled took all of the connection's request queue and the ping (any
/// caller's request) never reached Redis.
#[tokio::test(flavor = "current_thread")]
async fn store_calls_left_unpolled_do_not_stall_anyone_else() {
    let server = RedisServer::start(Persistence::None).unwrap();
    let store = store_on(&server).await;
    let keys: Vec<DelegationKey> = (0..RUN).map(key).collect();
    let mut parked: Vec<_> = keys.iter().map(|k| Box::pin(store.meta(k))).collect();
    let mut cx = Context::from_waker(Waker::noop());
    for call in &mut parked {
        // Polled once, so under way; never again while the ping waits.
        let _ = call.as_mut().poll(&mut cx);
    }
    let started = Instant::now();
    let ping = tokio::time::timeout(PROMPT, store.ping()).await;
    assert!(
        matches!(ping, Ok(Ok(()))),
        "a ping behind {RUN} store calls left unpolled: {ping:?} after {:?}",
        started.elapsed()
    );
    // The parked calls were answered meanwhile, and still give their answers.
    for call in parked {
        assert_eq!(
            tokio::time::timeout(PROMPT, call).await.unwrap().unwrap(),
            None
        );
    }
}

/// Store calls reach Redis in the order they were made (first polled),
/// which a session's append batches in flight rely on: 500 one-entry
/// batches of one log, all started at once and in order, are all appended,
/// none finding a hole before an earlier one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_calls_reach_redis_in_the_order_they_were_made() {
    const BATCHES: u64 = 500;
    let server = RedisServer::start(Persistence::None).unwrap();
    let store = store_on(&server).await;
    let k = key(0);
    let now = now_ms();
    let opened = store.open(open_req(&k, now)).await;
    assert!(matches!(opened, Ok(OpenOutcome::Created(_))), "{opened:?}");
    let caller = Origin::Peer {
        peer: peer("acme/caller"),
        instance: InstanceId::random(),
    };
    // The open is seq 1 of the down log.
    let batches = (2..BATCHES + 2).map(|seq| {
        store.append(vec![AppendRequest {
            key: k.clone(),
            dir: Direction::Down,
            seq,
            terminal: None,
            origin: caller.clone(),
            frame: Bytes::from(format!("down {seq}")),
            now_ms: now,
            wake: None,
        }])
    });
    let answers = futures_util::future::join_all(batches).await;
    for (seq, answer) in (2..).zip(answers) {
        assert_eq!(
            answer.unwrap(),
            vec![AppendOutcome::Appended { seq }],
            "batch {seq}"
        );
    }
}

/// The trigger, as a session drives it: 1,000 opens, then the same
/// 1,000 again, in runs whose store calls all start at once and whose
/// answers are taken in order, each answer making one more store call (the
/// delegation's view) while the rest of the run waits. Every one of those
/// calls must come back promptly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_resent_opens_answered_in_order_never_stalls_the_store() {
    let server = RedisServer::start(Persistence::None).unwrap();
    let store = Arc::new(store_on(&server).await);
    let keys: Vec<DelegationKey> = (0..OPENS).map(key).collect();
    let now = now_ms();
    for run in keys.chunks(RUN) {
        let created =
            futures_util::future::join_all(run.iter().map(|k| store.open(open_req(k, now)))).await;
        for outcome in created {
            assert!(
                matches!(outcome, Ok(OpenOutcome::Created(_))),
                "{outcome:?}"
            );
        }
    }
    // Another peer's traffic meanwhile: its pings must stay prompt too.
    let resending = tokio_util::sync::CancellationToken::new();
    let other = {
        let (store, resending) = (store.clone(), resending.clone());
        tokio::spawn(async move {
            let mut slowest = Duration::ZERO;
            while !resending.is_cancelled() {
                let started = Instant::now();
                let ping = tokio::time::timeout(PROMPT, store.ping()).await;
                assert!(matches!(ping, Ok(Ok(()))), "another peer's ping: {ping:?}");
                slowest = slowest.max(started.elapsed());
            }
            slowest
        })
    };
    let now = now_ms();
    for run in keys.chunks(RUN) {
        let mut calls: FuturesOrdered<_> = run
            .iter()
            .map(|k| {
                let (store, req) = (store.clone(), open_req(k, now));
                async move { store.open(req).await }
            })
            .collect();
        for k in run {
            let outcome = calls.next().await.unwrap();
            assert!(
                matches!(outcome, Ok(OpenOutcome::Existing(_))),
                "{outcome:?}"
            );
            let started = Instant::now();
            let view = tokio::time::timeout(PROMPT, store.meta(k)).await;
            assert!(
                matches!(view, Ok(Ok(Some(_)))),
                "the view of {k} while the rest of its run waits: {view:?} after {:?}",
                started.elapsed()
            );
        }
    }
    resending.cancel();
    let slowest = other.await.unwrap();
    assert!(slowest < PROMPT, "another peer's slowest ping: {slowest:?}");
}

/// A connection made to stop answering (a proxy holds its replies; Redis
/// itself is fine) is replaced within its timeout plus one second, and the
/// store serves again without a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_that_stops_answering_is_replaced_within_its_timeout_and_a_second() {
    let server = RedisServer::start(Persistence::None).unwrap();
    let proxy = ReplyProxy::start(Upstream::Unix(server.socket_path()))
        .await
        .unwrap();
    let store = RedisStore::connect(&proxy.redis_url(), Retention::default())
        .await
        .unwrap();
    store.ping().await.unwrap();
    proxy.hold_replies();
    let held = Instant::now();
    // The call under way when the connection stopped answering fails...
    let stuck = store.ping().await;
    assert!(stuck.is_err(), "a ping with its reply held: {stuck:?}");
    // ...and the store serves again, on a new connection, in time. Each
    // attempt is cut short, so one sent before the replacement (to the old
    // connection) does not use up the deadline.
    let deadline = held + RESPONSE_TIMEOUT + Duration::from_secs(1);
    let mut attempts = 0;
    loop {
        attempts += 1;
        let ping = tokio::time::timeout(Duration::from_millis(100), store.ping()).await;
        if matches!(ping, Ok(Ok(()))) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "not serving {:?} after the connection stopped answering \
             ({attempts} attempts, last {ping:?})",
            held.elapsed()
        );
    }
    assert!(
        proxy.connections() >= 2,
        "served again on the same connection: the held replies were not held"
    );
    // A delegation opened on the new connection is there.
    let k = key(0);
    let opened = store.open(open_req(&k, now_ms())).await;
    assert!(matches!(opened, Ok(OpenOutcome::Created(_))), "{opened:?}");
    // The held replies, released late, reach no one and confuse nothing.
    proxy.release_replies();
    assert!(store.meta(&k).await.unwrap().is_some());
}

/// The same at the relay: `/readyz` answers 200 again within the response
/// timeout plus one second after the store's connection stopped answering,
/// and `oab_store_connections_replaced_total` counts the replacement.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_is_ready_again_and_counts_the_replacement() {
    const REPLACED: &str = "oab_store_connections_replaced_total";
    let server = RedisServer::start(Persistence::None).unwrap();
    let proxy = ReplyProxy::start(Upstream::Unix(server.socket_path()))
        .await
        .unwrap();
    let store = RedisStore::connect(&proxy.redis_url(), Retention::default())
        .await
        .unwrap();
    let env = common::TestEnv::new("");
    let relay = common::TestRelay::start(&env, Arc::new(store)).await;
    let ready = || async {
        tokio::time::timeout(
            Duration::from_millis(250),
            common::http_get(relay.admin, "/readyz"),
        )
        .await
        .is_ok_and(|page| page.ends_with("ready\n") && page.contains(" 200 "))
    };
    let started = Instant::now();
    while !ready().await {
        assert!(started.elapsed() < PROMPT, "the relay never got ready");
    }
    proxy.hold_replies();
    let held = Instant::now();
    assert!(!ready().await, "ready with the store's replies held");
    let deadline = held + RESPONSE_TIMEOUT + Duration::from_secs(1);
    while !ready().await {
        assert!(
            Instant::now() < deadline,
            "not ready {:?} after the store's connection stopped answering",
            held.elapsed()
        );
    }
    let page = relay.metrics().await;
    assert_eq!(
        common::metric_value(&page, REPLACED),
        1.0,
        "one replacement counted:\n{page}"
    );
    relay.stop().await;
}
