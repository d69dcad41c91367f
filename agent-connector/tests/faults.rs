//! The connector under faults: links cut, stalled and half-open while a
//! delegation streams; callee process restarts.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use common::*;
use futures_util::StreamExt as _;
use oab_connector::EventKind;
use oab_loadtest::proxy::{Fault, Proxy};
use oab_relay::store::{MemoryStore, Retention};
use oab_wire::Outcome;

const FAST_HEARTBEAT: &str = "heartbeat_ms = 100\nidle_timeout_ms = 600\n";

fn env_fast() -> Env {
    // The [relay] section is already open in the generated config; these
    // keys land in it.
    Env::new(FAST_HEARTBEAT)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cuts_stalls_and_half_open_links_lose_and_repeat_nothing() {
    let env = env_fast();
    let relay = Relay::start(&env, Arc::new(MemoryStore::new(Retention::default()))).await;
    let pa = Proxy::start(relay.addr).await.unwrap();
    let pb = Proxy::start(relay.addr).await.unwrap();
    let exec = Paced::new(400, Duration::from_millis(2));
    let b = connector(&env, &env.callee, pb.addr(), Some(exec.clone()));
    let a = connector(&env, &env.caller, pa.addr(), None);
    a.connected().await.unwrap();
    b.connected().await.unwrap();
    let h = a
        .caller()
        .delegate(&peer(CALLEE), spec("long job"))
        .await
        .unwrap();
    let mut events = a.caller().events(&h, 0).await.unwrap();
    let mut last = 0u64;
    let mut terminals = 0;
    let mut round = 0u32;
    loop {
        let ev = tokio::time::timeout(Duration::from_secs(60), events.next())
            .await
            .expect("progress despite faults")
            .expect("stream open")
            .expect("no gap");
        assert_eq!(ev.seq, last + 1, "every event exactly once, in order");
        last = ev.seq;
        if let EventKind::Terminal(t) = &ev.kind {
            terminals += 1;
            assert_eq!(t.outcome, Outcome::Completed);
            a.caller().verify(&h, t).unwrap();
            break;
        }
        // Every 25 events, break something.
        if last.is_multiple_of(25) {
            round += 1;
            match round % 4 {
                0 => pa.handle().cut_all(),
                1 => pb.handle().cut_all(),
                2 => {
                    // Half-open callee link: nothing flows, nobody sees a close
                    // until heartbeats time out on both ends.
                    let h = pb.handle();
                    h.set_fault(Fault::Stall);
                    let before = h.stats().accepted;
                    h.wait_until(|s| s.accepted > before).await;
                    h.set_fault(Fault::Pass);
                    h.cut_all();
                }
                _ => {
                    let h = pa.handle();
                    h.set_fault(Fault::Reset);
                    let before = h.stats().accepted;
                    h.wait_until(|s| s.accepted > before).await;
                    h.set_fault(Fault::Pass);
                }
            }
        }
    }
    assert_eq!(terminals, 1);
    assert_eq!(last, 402, "accepted + 400 events + terminal");
    assert_eq!(
        exec.runs.load(Ordering::SeqCst),
        1,
        "the executor ran exactly once"
    );
    assert!(round >= 10, "faults were injected ({round} rounds)");
    a.shutdown().await;
    b.shutdown().await;
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn callee_restart_mid_task_ends_unknown_not_retried() {
    let env = env_fast();
    let relay = Relay::start(&env, Arc::new(MemoryStore::new(Retention::default()))).await;
    let exec = Paced::new(1_000_000, Duration::from_millis(5));
    let b = connector(&env, &env.callee, relay.addr, Some(exec.clone()));
    let a = connector(&env, &env.caller, relay.addr, None);
    a.connected().await.unwrap();
    b.connected().await.unwrap();
    let h = a
        .caller()
        .delegate(&peer(CALLEE), spec("long job"))
        .await
        .unwrap();
    let mut events = a.caller().events(&h, 0).await.unwrap();
    // Wait until the callee accepted and made progress.
    loop {
        let ev = events.next().await.unwrap().unwrap();
        if ev.seq >= 5 {
            break;
        }
    }
    // The callee process dies; a new process (new instance id) starts.
    b.shutdown().await;
    let exec2 = Paced::new(1, Duration::from_millis(1));
    let b2 = connector(&env, &env.callee, relay.addr, Some(exec2.clone()));
    b2.connected().await.unwrap();
    let t = loop {
        let ev = tokio::time::timeout(Duration::from_secs(30), events.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        if let EventKind::Terminal(t) = ev.kind {
            break t;
        }
    };
    assert_eq!(t.outcome, Outcome::Unknown);
    assert!(t.relay_origin, "the relay, not the callee, says unknown");
    assert!(
        a.caller().verify(&h, &t).is_err(),
        "no signed result exists for unknown"
    );
    assert_eq!(
        exec2.runs.load(Ordering::SeqCst),
        0,
        "never retried by the new process"
    );
    a.shutdown().await;
    b2.shutdown().await;
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn caller_restart_resumes_from_its_committed_cursor() {
    let env = env_fast();
    let relay = Relay::start(&env, Arc::new(MemoryStore::new(Retention::default()))).await;
    let exec = Paced::new(200, Duration::from_millis(1));
    let b = connector(&env, &env.callee, relay.addr, Some(exec.clone()));
    let dir = tempfile::tempdir().unwrap();
    let state = || Some(oab_connector::state::FileState::open(dir.path()).unwrap());
    let a = connector_state(
        &env,
        settings(&env.caller, relay.addr, &env.cert_der),
        None,
        policy(),
        None,
        state(),
    );
    a.connected().await.unwrap();
    b.connected().await.unwrap();
    let h = a
        .caller()
        .delegate(&peer(CALLEE), spec("resumable"))
        .await
        .unwrap();
    let mut events = a.caller().events(&h, 0).await.unwrap();
    loop {
        let ev = events.next().await.unwrap().unwrap();
        a.caller().commit(&h, &ev).await.unwrap();
        if ev.seq == 60 {
            break;
        }
    }
    drop(events);
    a.shutdown().await;
    // A new process of the caller: same identity and state, new instance id.
    let a2 = connector_state(
        &env,
        settings(&env.caller, relay.addr, &env.cert_der),
        None,
        policy(),
        None,
        state(),
    );
    let restored = a2.caller().restore().await.unwrap();
    assert_eq!(restored, vec![h.clone()]);
    let mut events = a2.caller().events(&h, 60).await.unwrap();
    let mut last = 60;
    let t = loop {
        let ev = tokio::time::timeout(Duration::from_secs(30), events.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        assert_eq!(ev.seq, last + 1, "exactly once after the cursor");
        last = ev.seq;
        a2.caller().commit(&h, &ev).await.unwrap();
        if let EventKind::Terminal(t) = ev.kind {
            break t;
        }
    };
    assert_eq!(last, 202);
    assert_eq!(t.outcome, Outcome::Completed);
    a2.caller()
        .verify(&h, &t)
        .expect("verifies against the restored request");
    assert_eq!(exec.runs.load(Ordering::SeqCst), 1);
    // Finished: nothing left to restore.
    a2.shutdown().await;
    let a3 = connector_state(
        &env,
        settings(&env.caller, relay.addr, &env.cert_der),
        None,
        policy(),
        None,
        state(),
    );
    assert!(a3.caller().restore().await.unwrap().is_empty());
    a3.shutdown().await;
    b.shutdown().await;
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_certificate_pin_is_enforced() {
    let env = env_fast();
    let relay = Relay::start(&env, Arc::new(MemoryStore::new(Retention::default()))).await;
    let pinned = |digest| {
        let mut s = settings(&env.caller, relay.addr, &env.cert_der);
        s.trust = oab_connector::trust::RelayTrust::Pin(digest);
        s
    };
    // The right pin connects.
    let good = connector_with(&env, pinned(oab_wire::Digest::of(&env.cert_der)), None);
    good.connected().await.unwrap();
    good.shutdown().await;
    // A wrong pin never gets past TLS: the link keeps retrying, never connects.
    let bad = connector_with(
        &env,
        pinned(oab_wire::Digest::of(b"another certificate")),
        None,
    );
    let mut attempts_seen = 0;
    for _ in 0..200 {
        match bad.state() {
            oab_connector::link::LinkState::Connected { .. } => {
                panic!("connected with a wrong pin")
            }
            oab_connector::link::LinkState::Connecting { attempt } => {
                attempts_seen = attempts_seen.max(attempt)
            }
            oab_connector::link::LinkState::Stopped(r) => panic!("stopped: {r}"),
        }
        if attempts_seen >= 3 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        attempts_seen >= 3,
        "retried and failed {attempts_seen} times"
    );
    bad.shutdown().await;
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_drain_and_restart_on_redis_loses_nothing() {
    let env = env_fast();
    let redis =
        oab_testkit::redis::RedisServer::start(oab_testkit::redis::Persistence::Aof).unwrap();
    let store = || async {
        Arc::new(
            oab_relay::store::RedisStore::connect(&redis.url(), Retention::default())
                .await
                .unwrap(),
        )
    };
    let relay = Relay::start(&env, store().await).await;
    let addr = relay.addr;
    let exec = Paced::new(300, Duration::from_millis(2));
    let b = connector(&env, &env.callee, addr, Some(exec.clone()));
    let a = connector(&env, &env.caller, addr, None);
    a.connected().await.unwrap();
    b.connected().await.unwrap();
    let h = a
        .caller()
        .delegate(&peer(CALLEE), spec("survive a relay restart"))
        .await
        .unwrap();
    let mut events = a.caller().events(&h, 0).await.unwrap();
    let mut last = 0;
    while last < 50 {
        let ev = events.next().await.unwrap().unwrap();
        assert_eq!(ev.seq, last + 1);
        last = ev.seq;
    }
    // Graceful stop (Drain + going_away), then a new relay process on the same
    // address and store.
    relay.stop().await;
    let relay = Relay::start_on(&env, store().await, &addr.to_string()).await;
    let t = loop {
        let ev = tokio::time::timeout(Duration::from_secs(30), events.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        assert_eq!(
            ev.seq,
            last + 1,
            "nothing lost or repeated across the restart"
        );
        last = ev.seq;
        if let EventKind::Terminal(t) = ev.kind {
            break t;
        }
    };
    assert_eq!(t.outcome, Outcome::Completed);
    assert_eq!(last, 302);
    a.caller().verify(&h, &t).unwrap();
    assert_eq!(exec.runs.load(Ordering::SeqCst), 1);
    a.shutdown().await;
    b.shutdown().await;
    relay.stop().await;
}

/// A caller's event stream that must deliver every event once, in order.
struct InOrder {
    events: oab_connector::caller::EventStream,
    last: u64,
}

impl InOrder {
    async fn next(&mut self) -> oab_connector::DelegationEvent {
        let ev = tokio::time::timeout(Duration::from_secs(30), self.events.next())
            .await
            .expect("an event in time")
            .expect("stream open")
            .expect("no gap");
        assert_eq!(ev.seq, self.last + 1, "every event once, in order");
        self.last = ev.seq;
        ev
    }
}

/// A relay on a real redis-server with `persistence`, and both connectors
/// connected (the callee running `exec`).
async fn on_redis(
    env: &Env,
    persistence: oab_testkit::redis::Persistence,
    exec: Arc<Paced>,
) -> (
    oab_testkit::redis::RedisServer,
    Relay,
    oab_connector::Connector,
    oab_connector::Connector,
) {
    let redis = oab_testkit::redis::RedisServer::start(persistence).unwrap();
    let store = Arc::new(
        oab_relay::store::RedisStore::connect(&redis.url(), Retention::default())
            .await
            .unwrap(),
    );
    let relay = Relay::start(env, store).await;
    let b = connector(env, &env.callee, relay.addr, Some(exec));
    let a = connector(env, &env.caller, relay.addr, None);
    a.connected().await.unwrap();
    b.connected().await.unwrap();
    (redis, relay, a, b)
}

/// Waits (bounded) until `cond` holds, checking every few milliseconds.
async fn eventually<F, Fut>(what: &str, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while !cond().await {
        assert!(tokio::time::Instant::now() < deadline, "timed out: {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// The caller resumes a delegation it is caught up on (a reconnect), its
/// link then drops before the next frame, and the delegation finishes while
/// it is away: the relay's next welcome no longer lists it, and the caller
/// must still fetch the terminal (it resumes every delegation it has no
/// terminal for, whatever the previous session left behind).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delegation_that_finishes_while_the_caller_is_away_still_reaches_it() {
    let env = env_fast();
    let store = Arc::new(MemoryStore::new(Retention::default()));
    let relay = Relay::start(&env, store.clone()).await;
    let pa = Proxy::start(relay.addr).await.unwrap();
    let exec = Paced::gated(5, Duration::from_millis(1), 2);
    let b = connector(&env, &env.callee, relay.addr, Some(exec.clone()));
    let a = connector(&env, &env.caller, pa.addr(), None);
    a.connected().await.unwrap();
    b.connected().await.unwrap();
    let h = a
        .caller()
        .delegate(&peer(CALLEE), spec("finish while the caller is away"))
        .await
        .unwrap();
    let events = a.caller().events(&h, 0).await.unwrap();
    let mut events = InOrder { events, last: 0 };
    // Accepted, then two statuses: the executor now waits at its gate.
    while events.last < 3 {
        events.next().await;
    }
    let pa_h = pa.handle();
    for _ in 0..3 {
        // A reconnect while caught up: the caller resumes the listed
        // delegation, and nothing comes back yet.
        let before = pa_h.stats().accepted;
        pa_h.cut_all();
        pa_h.wait_until(|s| s.accepted > before).await;
        a.connected().await.unwrap();
        // A round trip through the link and the relay: the welcome's
        // resumes went out before this answer came back.
        a.caller().list_peers().await.unwrap();
    }
    // Away (the link stalls, then drops) while the delegation finishes.
    pa_h.set_fault(Fault::Stall);
    pa_h.cut_all();
    exec.open_gate();
    let key = h.key.clone();
    eventually("the relay holds the terminal", || {
        let (store, key) = (store.clone(), key.clone());
        async move {
            use oab_relay::store::EventStore as _;
            matches!(store.meta(&key).await, Ok(Some(m)) if m.terminal.is_some())
        }
    })
    .await;
    pa_h.set_fault(Fault::Pass);
    pa_h.cut_all();
    let t = loop {
        if let EventKind::Terminal(t) = events.next().await.kind {
            break t;
        }
    };
    assert_eq!(t.outcome, Outcome::Completed);
    assert_eq!(events.last, 7, "accepted, five statuses, the terminal");
    a.caller().verify(&h, &t).unwrap();
    assert_eq!(exec.runs(), 1);
    a.shutdown().await;
    b.shutdown().await;
    relay.stop().await;
}

/// Redis is killed while the callee streams and the caller cancels during
/// the outage: appends refused as `store_unavailable` are resent once the
/// store is back (the retry deadline is not pushed back by the link's other
/// traffic, here a ping every 100 ms), so the delegation goes on and the
/// cancel takes effect after the outage.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_outage_pauses_delegations_only_while_it_lasts() {
    let env = env_fast();
    // Fsynced before every answer: a SIGKILL loses nothing acknowledged
    // (with `everysec` it may, and then the caller gets a gap instead; see
    // the next test).
    let exec = Paced::new(1_000_000, Duration::from_millis(2));
    let (mut redis, relay, a, b) = on_redis(
        &env,
        oab_testkit::redis::Persistence::AofAlways,
        exec.clone(),
    )
    .await;
    let h = a
        .caller()
        .delegate(&peer(CALLEE), spec("stream through store outages"))
        .await
        .unwrap();
    let events = a.caller().events(&h, 0).await.unwrap();
    let mut events = InOrder { events, last: 0 };
    // The callee's frames pile up unacknowledged while the store is down.
    let refused = async |b: &oab_connector::Connector| {
        let key = h.key.clone();
        let caller = b.caller().clone();
        eventually("the callee's appends wait for the store", move || {
            let (caller, h) = (
                caller.clone(),
                oab_connector::DelegationHandle {
                    key: key.clone(),
                    callee: peer(CALLEE),
                },
            );
            async move { caller.get(&h).await.is_ok_and(|s| s.sent > s.acked + 20) }
        })
        .await;
    };
    for _ in 0..3 {
        let target = events.last + 20;
        while events.last < target {
            events.next().await;
        }
        redis.kill().unwrap();
        refused(&b).await;
        redis.restart().unwrap();
    }
    let target = events.last + 20;
    while events.last < target {
        events.next().await;
    }
    // A cancel during an outage takes effect after it.
    redis.kill().unwrap();
    refused(&b).await;
    a.caller().cancel(&h, "enough").await.unwrap();
    redis.restart().unwrap();
    let t = loop {
        if let EventKind::Terminal(t) = events.next().await.kind {
            break t;
        }
    };
    assert_eq!(t.outcome, Outcome::Cancelled);
    a.caller().verify(&h, &t).unwrap();
    assert_eq!(exec.runs(), 1);
    a.shutdown().await;
    b.shutdown().await;
    relay.stop().await;
}

/// The store loses events it had acknowledged (as Redis does when it
/// restarts without writes it had not yet put in its AOF, or fails over to
/// a replica that lagged), simulated by restoring the delegation's keys as
/// they were earlier: the caller, which already holds the lost events, is
/// told with a gap at once (not left waiting for events that will never
/// come again under those numbers).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_that_loses_acknowledged_events_ends_the_stream_with_a_gap() {
    let env = env_fast();
    let exec = Paced::gated(40, Duration::from_millis(20), 10);
    let (redis, relay, a, b) =
        on_redis(&env, oab_testkit::redis::Persistence::None, exec.clone()).await;
    let h = a
        .caller()
        .delegate(&peer(CALLEE), spec("lose some events"))
        .await
        .unwrap();
    let mut events = InOrder {
        events: a.caller().events(&h, 0).await.unwrap(),
        last: 0,
    };
    // Accepted and ten statuses; the executor waits at its gate.
    while events.last < 11 {
        events.next().await;
    }
    let client = redis::Client::open(redis.url()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let base = format!("oab:d:{{{}}}", h.key);
    let names = [
        format!("{base}:meta"),
        format!("{base}:up"),
        format!("{base}:down"),
    ];
    let mut snapshot = Vec::new();
    for k in &names {
        let dump: Vec<u8> = redis::cmd("DUMP")
            .arg(k)
            .query_async(&mut conn)
            .await
            .unwrap();
        snapshot.push(dump);
    }
    exec.open_gate();
    while events.last < 16 {
        events.next().await;
    }
    // The store goes back to how it was at event 11.
    for (k, dump) in names.iter().zip(&snapshot) {
        let _: () = redis::cmd("RESTORE")
            .arg(k)
            .arg(0)
            .arg(dump.as_slice())
            .arg("REPLACE")
            .query_async(&mut conn)
            .await
            .unwrap();
    }
    let gap = loop {
        match tokio::time::timeout(Duration::from_secs(30), events.events.next())
            .await
            .expect("the caller hears of the loss in time")
            .expect("stream open")
        {
            Ok(ev) => {
                assert_eq!(ev.seq, events.last + 1, "in order until the loss shows");
                events.last = ev.seq;
            }
            Err(e) => break e,
        }
    };
    assert!(
        matches!(
            gap,
            oab_connector::link::EventError::Gap {
                reason: oab_wire::GapReason::EpochChanged,
                ..
            }
        ),
        "{gap:?}"
    );
    a.shutdown().await;
    b.shutdown().await;
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_delegates_with_one_request_id_are_one_durable_delegation() {
    let env = env_fast();
    let relay = Relay::start(&env, Arc::new(MemoryStore::new(Retention::default()))).await;
    let exec = Paced::new(1, Duration::ZERO);
    let b = connector(&env, &env.callee, relay.addr, Some(exec.clone()));
    let dir = tempfile::tempdir().unwrap();
    let state = oab_connector::state::FileState::open(dir.path()).unwrap();
    let a = connector_state(
        &env,
        settings(&env.caller, relay.addr, &env.cert_der),
        None,
        policy(),
        None,
        Some(state.clone()),
    );
    a.connected().await.unwrap();
    b.connected().await.unwrap();
    let mut same = spec("once");
    same.request_id = Some(oab_wire::RequestId::new("req-concurrent").unwrap());
    // Every call races the first one's save; all get the one delegation.
    let callee = peer(CALLEE);
    let calls = (0..8).map(|_| a.caller().delegate(&callee, same.clone()));
    let handles: Vec<_> = futures_util::future::join_all(calls)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    assert!(handles.iter().all(|h| h == &handles[0]), "{handles:?}");
    assert_eq!(state.count().unwrap(), 1, "one durable record");
    let mut other = same.clone();
    other.task.text = "something else".into();
    let e = a.caller().delegate(&peer(CALLEE), other).await.unwrap_err();
    assert!(
        matches!(
            e,
            oab_connector::caller::CallerError::IdempotencyMismatch(_)
        ),
        "{e}"
    );
    let t = a
        .caller()
        .wait(&handles[0], Duration::from_secs(30))
        .await
        .unwrap();
    assert_eq!(t.outcome, Outcome::Completed);
    assert_eq!(exec.runs.load(Ordering::SeqCst), 1, "run once");
    a.shutdown().await;
    b.shutdown().await;
    relay.stop().await;
}

/// Streams `n` artifacts of `size` bytes; waits for the gate after the
/// first `gate_after`.
struct Artifacts {
    n: usize,
    size: usize,
    gate_after: usize,
    gate: Arc<tokio::sync::Notify>,
}

impl oab_connector::callee::TaskExecutor for Artifacts {
    fn execute(
        &self,
        run: oab_connector::callee::TaskRun,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = oab_connector::callee::Execution> + Send>>
    {
        let (n, size, after, gate) = (self.n, self.size, self.gate_after, self.gate.clone());
        Box::pin(async move {
            for i in 0..n {
                if i == after {
                    gate.notified().await;
                }
                let artifact = oab_connector::profile::Artifact {
                    artifact_id: format!("a{i}"),
                    name: format!("part {i}"),
                    media_type: "text/plain".into(),
                    text: Some("z".repeat(size)),
                    data: None,
                    url: None,
                };
                run.sink.artifact(artifact, false, true).await.unwrap();
            }
            oab_connector::callee::Execution::stopped(oab_connector::callee::StopReason::EndTurn)
        })
    }
}

/// The callee's link freezes (the proxy stops reading and writing both
/// ways, sockets kept open, so the kernel answers with a zero window) while
/// the callee is writing 50 MiB of artifacts: its write does not block the
/// link forever. It notices the dead link (the heartbeat deadline bounds
/// every write), reconnects and resends, and every artifact reaches the
/// caller in order. Then, frozen again mid-write, a shutdown ends the
/// connector at once instead of waiting for a write that never finishes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_link_frozen_mid_write_is_noticed_and_shutdown_is_not_held_by_it() {
    let env = env_fast();
    let relay = Relay::start(&env, Arc::new(MemoryStore::new(Retention::default()))).await;
    let pb = Proxy::start(relay.addr).await.unwrap();
    let gate = Arc::new(tokio::sync::Notify::new());
    let exec = Arc::new(Artifacts {
        n: 100,
        size: 512 * 1024,
        gate_after: 5,
        gate: gate.clone(),
    });
    let b = connector(&env, &env.callee, pb.addr(), Some(exec));
    let a = connector(&env, &env.caller, relay.addr, None);
    a.connected().await.unwrap();
    b.connected().await.unwrap();
    let freeze = || {
        let h = pb.handle();
        for c in h.connections() {
            h.set_connection_fault(c.id, Fault::Stall);
        }
    };
    let h = a
        .caller()
        .delegate(&peer(CALLEE), spec("fifty megabytes"))
        .await
        .unwrap();
    let mut events = a.caller().events(&h, 0).await.unwrap();
    let mut artifacts = 0;
    let mut last = 0;
    let t = loop {
        let ev = tokio::time::timeout(Duration::from_secs(60), events.next())
            .await
            .expect("the delegation goes on")
            .unwrap()
            .unwrap();
        assert_eq!(ev.seq, last + 1, "in order, no duplicate");
        last = ev.seq;
        match ev.kind {
            EventKind::Artifact { .. } => {
                artifacts += 1;
                if artifacts == 5 {
                    // Frozen, then the rest is written into it.
                    freeze();
                    gate.notify_one();
                }
            }
            EventKind::Terminal(t) => break t,
            _ => {}
        }
    };
    assert_eq!(t.outcome, Outcome::Completed);
    assert_eq!(artifacts, 100);
    assert!(
        b.link().stats().reconnects() >= 1,
        "the callee left the frozen link"
    );
    // Frozen again while a second delegation writes: shutdown ends it.
    let h2 = a
        .caller()
        .delegate(&peer(CALLEE), spec("again"))
        .await
        .unwrap();
    let mut events = a.caller().events(&h2, 0).await.unwrap();
    let mut artifacts = 0;
    while artifacts < 5 {
        let ev = tokio::time::timeout(Duration::from_secs(60), events.next())
            .await
            .expect("the second delegation goes on")
            .unwrap()
            .unwrap();
        if matches!(ev.kind, EventKind::Artifact { .. }) {
            artifacts += 1;
        }
    }
    freeze();
    gate.notify_one();
    tokio::time::timeout(Duration::from_secs(10), b.shutdown())
        .await
        .expect("a shutdown is not held by a frozen write");
    a.shutdown().await;
    relay.stop().await;
}
