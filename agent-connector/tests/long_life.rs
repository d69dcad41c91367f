//! Long life on the caller side: what connector A keeps per delegation
//! (the caller's records, the link's delegations, the state folder's files,
//! the A2A facade's tasks) returns to a bound that does not grow with the
//! number of delegations run, and a restart cleans what an earlier process
//! left in the state folder.
//!
//! Real parts: a relay on a real redis-server, connector A and connector B
//! over TLS on loopback, and the A2A facade over HTTP.
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
use futures_util::StreamExt as _;
use oab_connector::state::FileState;
use oab_connector::{Caller, Connector};
use oab_relay::store::{RedisStore, Retention};
use oab_testkit::redis::{Persistence, RedisServer};
use oab_wire::{DelegationKey, Outcome, RequestId};
use serde_json::json;

/// How long the whole batch of delegations of one test may take; only
/// bounds a hang.
const BATCH_BOUND: Duration = Duration::from_secs(600);

/// Delegations in flight at once.
const CONCURRENCY: usize = 16;

/// A relay on a fresh redis-server.
async fn relay_on_redis(env: &Env) -> (RedisServer, Relay) {
    let redis = RedisServer::start(Persistence::None).unwrap();
    let store = RedisStore::connect(&redis.url(), Retention::default())
        .await
        .unwrap();
    let relay = Relay::start(env, Arc::new(store)).await;
    (redis, relay)
}

/// Connector A (caller, state folder `dir`, keeping `max_finished` finished
/// delegations) and connector B (callee: one status event, then done).
async fn pair(env: &Env, relay: &Relay, dir: &std::path::Path, max_finished: usize) -> Connector {
    let mut link = settings(&env.caller, relay.addr, &env.cert_der);
    link.max_finished = max_finished;
    let a = caller_with(env, link, dir);
    a.connected().await.unwrap();
    a
}

fn caller_with(
    env: &Env,
    link: oab_connector::link::LinkSettings,
    dir: &std::path::Path,
) -> Connector {
    connector_state(
        env,
        link,
        None,
        policy(),
        None,
        Some(FileState::open(dir).unwrap()),
    )
}

fn callee(env: &Env, relay: &Relay) -> Connector {
    connector(
        env,
        &env.callee,
        relay.addr,
        Some(Paced::new(1, Duration::ZERO)),
    )
}

/// One delegation through the library API, as an application runs it:
/// delegate, read the events to the terminal, verify, commit.
async fn run_one(caller: &Caller) {
    let handle = caller.delegate(&peer(CALLEE), spec("work")).await.unwrap();
    let mut events = caller.events(&handle, 0).await.unwrap();
    while let Some(item) = events.next().await {
        let ev = item.unwrap();
        if let oab_connector::EventKind::Terminal(t) = &ev.kind {
            assert_eq!(t.outcome, Outcome::Completed);
            caller.verify(&handle, t).unwrap();
            caller.commit(&handle, &ev).await.unwrap();
            return;
        }
    }
    panic!("the event stream ended without a terminal");
}

/// Runs `n` delegations, [`CONCURRENCY`] at a time.
async fn run_many(caller: &Caller, n: usize) {
    let work = futures_util::stream::iter(0..n)
        .map(|_| run_one(caller))
        .buffer_unordered(CONCURRENCY)
        .collect::<Vec<()>>();
    tokio::time::timeout(BATCH_BOUND, work)
        .await
        .expect("the delegations finish in time");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finished_delegations_leave_bounded_records_links_and_files() {
    const N: usize = 2_000;
    const KEEP: usize = 25;
    let env = Env::new("");
    let (_redis, relay) = relay_on_redis(&env).await;
    let dir = tempfile::tempdir().unwrap();
    let b = callee(&env, &relay);
    b.connected().await.unwrap();
    let a = pair(&env, &relay, dir.path(), KEEP).await;
    let state = FileState::open(dir.path()).unwrap();

    run_many(a.caller(), N).await;

    let records = a.caller().records_held();
    let held = a.caller().link_delegations_held().await.unwrap();
    let files = state.count().unwrap();
    assert!(
        records <= KEEP,
        "the caller holds {records} records after {N} finished delegations (bound {KEEP})"
    );
    assert!(
        held <= KEEP,
        "the link holds {held} delegations after {N} finished delegations (bound {KEEP})"
    );
    assert!(
        files <= KEEP,
        "the state folder holds {files} files after {N} finished delegations (bound {KEEP})"
    );
    // The newest finished delegations are still known: their files are
    // there and marked finished.
    assert!(files > 0, "the newest finished delegations are kept");
    for s in state.load_all().unwrap() {
        assert!(s.finished, "{} is kept finished", s.key);
    }
    a.shutdown().await;
    b.shutdown().await;
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finished_delegations_are_bounded_in_bytes_when_the_count_is_not() {
    const N: usize = 300;
    // Each finished delegation weighs more than a kilobyte (its state file;
    // the link's kept events carry the signed result).
    const BYTES: u64 = 32 * 1024;
    const MOST: usize = 32;
    let env = Env::new("");
    let (_redis, relay) = relay_on_redis(&env).await;
    let dir = tempfile::tempdir().unwrap();
    let b = callee(&env, &relay);
    b.connected().await.unwrap();
    let mut link = settings(&env.caller, relay.addr, &env.cert_der);
    link.max_finished = 100_000;
    link.max_finished_bytes = BYTES;
    let a = caller_with(&env, link, dir.path());
    a.connected().await.unwrap();
    let state = FileState::open(dir.path()).unwrap();

    run_many(a.caller(), N).await;

    let records = a.caller().records_held();
    let held = a.caller().link_delegations_held().await.unwrap();
    let files = state.count().unwrap();
    assert!(
        records <= MOST && held <= MOST && files <= MOST,
        "after {N} delegations within {BYTES} bytes: {records} records, {held} link delegations, {files} files"
    );
    a.shutdown().await;
    b.shutdown().await;
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_cleans_finished_stale_and_temporary_state_files() {
    const N: usize = 60;
    const KEEP_BEFORE: usize = 1_000;
    const KEEP_AFTER: usize = 10;
    let env = Env::new("");
    let (_redis, relay) = relay_on_redis(&env).await;
    let dir = tempfile::tempdir().unwrap();
    let b = callee(&env, &relay);
    b.connected().await.unwrap();
    let a = pair(&env, &relay, dir.path(), KEEP_BEFORE).await;
    run_many(a.caller(), N).await;
    a.shutdown().await;

    let state = FileState::open(dir.path()).unwrap();
    assert_eq!(
        state.count().unwrap(),
        N,
        "every finished delegation is kept"
    );
    // An unfinished delegation whose deadline passed two days ago (the
    // relay no longer holds it), and a temporary file a crash left.
    let mut stale = state.load_all().unwrap().remove(0);
    stale.key = DelegationKey::new(peer(CALLER), RequestId::new("req-stale").unwrap());
    stale.finished = false;
    stale.request.deadline_ms = oab_wire::identity::now_ms() - 2 * 24 * 3600 * 1000;
    state.save(&stale).await.unwrap();
    std::fs::write(dir.path().join("leftover.json.tmp"), b"{").unwrap();

    // A new process keeping fewer finished delegations.
    let a = pair(&env, &relay, dir.path(), KEEP_AFTER).await;
    let restored = a.caller().restore().await.unwrap();
    assert!(restored.is_empty(), "nothing was left open: {restored:?}");
    assert_eq!(
        state.count().unwrap(),
        KEEP_AFTER,
        "the newest finished delegations are kept, the rest and the stale one deleted"
    );
    assert!(state.load(&stale.key).unwrap().is_none());
    assert!(!dir.path().join("leftover.json.tmp").exists());
    a.shutdown().await;
    b.shutdown().await;
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn facade_keeps_recent_tasks_and_bounded_state() {
    const N: usize = 2_000;
    const MAX_TASKS: usize = 20;
    let env = Env::new("");
    let (_redis, relay) = relay_on_redis(&env).await;
    let dir = tempfile::tempdir().unwrap();
    let b = callee(&env, &relay);
    b.connected().await.unwrap();
    let a = pair(&env, &relay, dir.path(), MAX_TASKS).await;
    let mut options = facade_options();
    options.max_tasks = MAX_TASKS;
    let server = FacadeServer::start(a.caller().clone(), options).await;
    let rpc = Rpc::new(server.url(CALLEE));

    let send = |i: usize| {
        let rpc = &rpc;
        async move {
            let reply = rpc
                .call(
                    "SendMessage",
                    json!({ "message": message(&format!("m-{i}"), "work") }),
                    V1,
                )
                .await;
            let task = &reply["result"]["task"];
            assert_eq!(
                task["status"]["state"], "TASK_STATE_COMPLETED",
                "send {i}: {reply}"
            );
            (i, task["id"].as_str().unwrap().to_string())
        }
    };
    let work = futures_util::stream::iter(0..N)
        .map(send)
        .buffer_unordered(CONCURRENCY)
        .collect::<Vec<_>>();
    let mut ids = tokio::time::timeout(BATCH_BOUND, work)
        .await
        .expect("the sends finish in time");
    ids.sort();

    // The caller's records and the state folder are bounded; the link too.
    let caller = a.caller();
    let state = FileState::open(dir.path()).unwrap();
    let until = tokio::time::Instant::now() + STEP;
    loop {
        // A tracker commits its terminal just after the reply went out.
        let (records, files) = (caller.records_held(), state.count().unwrap());
        if records <= MAX_TASKS && files <= MAX_TASKS {
            break;
        }
        assert!(
            tokio::time::Instant::now() < until,
            "after {N} tasks the caller holds {records} records and the state folder {files} files (bound {MAX_TASKS})"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let held = caller.link_delegations_held().await.unwrap();
    assert!(held <= MAX_TASKS, "the link holds {held} delegations");

    // The newest task is answered; the first one is forgotten, with a
    // typed TaskNotFound.
    let (_, last) = ids.last().unwrap().clone();
    let reply = rpc.call("GetTask", json!({ "id": last }), V1).await;
    assert_eq!(
        reply["result"]["status"]["state"], "TASK_STATE_COMPLETED",
        "{reply}"
    );
    let (_, first) = ids.first().unwrap().clone();
    let reply = rpc.call("GetTask", json!({ "id": first }), V1).await;
    assert_eq!(reply["error"]["code"], -32001, "{reply}");

    server.stop().await;
    a.shutdown().await;
    b.shutdown().await;
    relay.stop().await;
}

/// A caller that commits each terminal releases its delegation at the
/// relay, which compacts it: Redis keeps one small hash per finished
/// delegation (its outcome and tails) instead of its two logs, and the
/// peers' delegation sets no longer list it. A delegation whose terminal
/// the application did not commit keeps its logs for the retention.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn committed_terminals_leave_only_their_outcomes_in_redis() {
    const N: usize = 200;
    let env = Env::new("");
    let (redis, relay) = relay_on_redis(&env).await;
    let dir = tempfile::tempdir().unwrap();
    let b = callee(&env, &relay);
    b.connected().await.unwrap();
    let a = pair(&env, &relay, dir.path(), 25).await;

    run_many(a.caller(), N).await;
    // One more, read to its terminal and not committed.
    let kept = a
        .caller()
        .delegate(&peer(CALLEE), spec("kept"))
        .await
        .unwrap();
    let t = a
        .caller()
        .wait(&kept, Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(t.outcome, Outcome::Completed);

    let mut raw = redis::Client::open(redis.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let kept_prefix = format!("oab:d:{{{}}}:", kept.key);
    let mut last = Vec::new();
    let compacted = tokio::time::timeout(Duration::from_secs(60), async {
        loop {
            let keys: Vec<String> = redis::cmd("KEYS")
                .arg("oab:d:*")
                .query_async(&mut raw)
                .await
                .unwrap();
            let others: Vec<&String> = keys
                .iter()
                .filter(|k| !k.starts_with(&kept_prefix))
                .collect();
            if others.len() == N && others.iter().all(|k| k.ends_with(":meta")) {
                return keys;
            }
            last = keys.clone();
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("still not compacted after 60 s: {} keys", last.len()));
    let mut of_kept: Vec<&String> = compacted
        .iter()
        .filter(|k| k.starts_with(&kept_prefix))
        .collect();
    of_kept.sort();
    assert_eq!(
        of_kept,
        vec![
            &format!("{kept_prefix}down"),
            &format!("{kept_prefix}meta"),
            &format!("{kept_prefix}up"),
        ],
        "the uncommitted delegation keeps its logs"
    );
    for p in [CALLER, CALLEE] {
        let members: Vec<String> = redis::cmd("SMEMBERS")
            .arg(format!("oab:p:{{{p}}}:dlg"))
            .query_async(&mut raw)
            .await
            .unwrap();
        assert_eq!(members, vec![kept.key.to_string()], "delegations of {p}");
    }
    a.shutdown().await;
    b.shutdown().await;
    relay.stop().await;
}
