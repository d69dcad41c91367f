//! The callee side under a flood and over time: a caller that floods one
//! delegation with follow-ups neither freezes the callee's link nor the
//! other delegations; an executor that streams while follow-ups pour in
//! does not deadlock; a task left waiting for input frees its slot; the
//! replay cache keeps callers apart; per-delegation state is pruned at the
//! terminal. Real relay on a real redis-server, real connectors over TLS.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod a2a_support;
mod common;

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use oab_connector::callee::{CalleeOptions, Execution, StopReason, TaskExecutor, TaskRun};
use oab_connector::{Connector, ConnectorOptions, DelegationHandle, Terminal};
use oab_relay::store::Retention;
use oab_wire::Outcome;
use tokio::sync::Notify;

/// Follow-ups sent in a flood: more than the callee's per-delegation queue
/// (64) and its link's channel to the runtime (1,024) together.
const FLOOD: usize = 1_500;

/// Runs by task text:
/// - `quick`: completes at once;
/// - `hold`: sends one event and waits for its cancel, never reading its
///   follow-ups;
/// - `stream`: sends one event, waits for the gate, then sends `events`
///   status events without reading its follow-ups, whatever happens, and
///   completes.
struct FlowExec {
    events: u64,
    gate: Arc<Notify>,
}

impl TaskExecutor for FlowExec {
    fn execute(
        &self,
        run: TaskRun,
    ) -> Pin<Box<dyn std::future::Future<Output = Execution> + Send>> {
        let (events, gate) = (self.events, self.gate.clone());
        Box::pin(async move {
            // Held unread for the whole run, like an agent busy with its work.
            let _unread = &run.messages;
            match run.request.task.text.as_str() {
                "quick" => Execution::stopped(StopReason::EndTurn),
                "hold" => {
                    let _ = run.sink.status("TASK_STATE_WORKING", None, None).await;
                    run.cancel.cancelled().await;
                    Execution::stopped(StopReason::Cancelled)
                }
                "stream" => {
                    let _ = run.sink.status("TASK_STATE_WORKING", None, None).await;
                    gate.notified().await;
                    for i in 1..=events {
                        let data = Some(serde_json::json!({ "i": i }));
                        if run
                            .sink
                            .status("TASK_STATE_WORKING", None, data)
                            .await
                            .is_err()
                        {
                            return Execution::stopped(StopReason::Error("link stopped".into()));
                        }
                    }
                    Execution::stopped(StopReason::EndTurn)
                }
                other => Execution::stopped(StopReason::Error(format!("unknown task {other}"))),
            }
        })
    }
}

fn callee_connector(
    env: &Env,
    relay: std::net::SocketAddr,
    executor: Arc<dyn TaskExecutor>,
    per_peer: usize,
) -> Connector {
    callee_connector_with_share(
        env,
        relay,
        executor,
        per_peer,
        oab_connector::nonce::NonceCache::DEFAULT_PER_CALLER,
    )
}

fn callee_connector_with_share(
    env: &Env,
    relay: std::net::SocketAddr,
    executor: Arc<dyn TaskExecutor>,
    per_peer: usize,
    live_requests: usize,
) -> Connector {
    Connector::start(ConnectorOptions {
        link: settings(&env.callee, relay, &env.cert_der),
        trust: env.trust(),
        grant: oab_connector::authority::Grant {
            capabilities: oab_connector::authority::CapabilitySet::parse(["read:*"]).unwrap(),
            remaining: budgets(10_000_000),
        },
        caller_policy: policy(),
        callee: Some(CalleeOptions {
            executor,
            policy: Arc::new(policy()),
            max_concurrent: 512,
            max_concurrent_per_peer: per_peer,
            max_live_requests_per_peer: live_requests,
            replay_window_ms: oab_connector::nonce::NonceCache::DEFAULT_MAX_AGE_MS,
        }),
        audit: None,
        state: None,
    })
    .unwrap()
}

async fn redis_relay(env: &Env) -> (oab_testkit::redis::RedisServer, Relay) {
    let redis =
        oab_testkit::redis::RedisServer::start(oab_testkit::redis::Persistence::None).unwrap();
    let store = Arc::new(
        oab_relay::store::RedisStore::connect(&redis.url(), Retention::default())
            .await
            .unwrap(),
    );
    let relay = Relay::start(env, store).await;
    (redis, relay)
}

/// Waits (bounded) until `cond` holds.
async fn eventually<F, Fut>(what: &str, limit: Duration, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + limit;
    while !cond().await {
        assert!(tokio::time::Instant::now() < deadline, "timed out: {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Sends the flood once the executor runs (its first event arrived).
async fn flood(a: &Connector, h: &DelegationHandle) {
    eventually("the executor runs", Duration::from_secs(30), || async {
        a.caller().get(h).await.unwrap().received >= 2
    })
    .await;
    for i in 0..FLOOD {
        a.caller()
            .send_message(
                h,
                serde_json::json!({ "role": "ROLE_USER", "parts": [{ "text": format!("more {i}") }] }),
            )
            .await
            .unwrap();
    }
}

/// Waits until the relay took every follow-up (the callee is receiving
/// them) or the delegation ended (the callee refused the flood).
async fn flooded(a: &Connector, h: &DelegationHandle) {
    eventually(
        "the relay took the flood",
        Duration::from_secs(60),
        || async {
            let snap = a.caller().get(h).await.unwrap();
            snap.acked > FLOOD as u64 || snap.terminal.is_some()
        },
    )
    .await;
}

/// The error the callee signed into a terminal's result.
fn result_error(a: &Connector, h: &DelegationHandle, t: &Terminal) -> String {
    let verified = a.caller().verify(h, t).expect("a signed result");
    verified.result.error.unwrap_or_default()
}

/// A follow-up flood on one delegation: the callee's link keeps answering
/// (a peer query round trip through the relay) and another delegation
/// completes while the flooded one is still open; the flooded one then
/// ends `failed` with `follow_up_overflow`, not the link.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follow_up_flood_leaves_the_link_and_other_delegations_flowing() {
    let env = Env::new("heartbeat_ms = 200\nidle_timeout_ms = 1000\n");
    let (_redis, relay) = redis_relay(&env).await;
    let exec = Arc::new(FlowExec {
        events: 0,
        gate: Arc::new(Notify::new()),
    });
    let b = callee_connector(&env, relay.addr, exec, 512);
    let a = connector(&env, &env.caller, relay.addr, None);
    a.connected().await.unwrap();
    b.connected().await.unwrap();

    let held = a
        .caller()
        .delegate(&peer(CALLEE), spec("hold"))
        .await
        .unwrap();
    flood(&a, &held).await;
    // Every follow-up is in the relay's log: the callee is receiving them.
    flooded(&a, &held).await;

    // The callee's link still reads and writes.
    tokio::time::timeout(Duration::from_secs(10), b.caller().list_peers())
        .await
        .expect("the callee's link answers during the flood")
        .unwrap();
    // Another delegation runs to its end.
    let quick = a
        .caller()
        .delegate(&peer(CALLEE), spec("quick"))
        .await
        .unwrap();
    let t = a
        .caller()
        .wait(&quick, Duration::from_secs(30))
        .await
        .expect("another delegation completes during the flood");
    assert_eq!(t.outcome, Outcome::Completed);

    // The flooded delegation failed alone, with a typed reason.
    let t = a
        .caller()
        .wait(&held, Duration::from_secs(30))
        .await
        .unwrap();
    assert_eq!(t.outcome, Outcome::Failed);
    let error = result_error(&a, &held, &t);
    assert!(error.contains("follow_up_overflow"), "{error}");
    assert!(matches!(
        b.state(),
        oab_connector::link::LinkState::Connected { .. }
    ));
    a.shutdown().await;
    b.shutdown().await;
    relay.stop().await;
}

/// An executor that streams more events than the link's command channel
/// holds, without reading its follow-ups, while a flood of them arrives:
/// every event and the terminal still reach the caller.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_executor_streaming_during_a_follow_up_flood_does_not_deadlock() {
    let env = Env::new("");
    let (_redis, relay) = redis_relay(&env).await;
    let events = 3_000;
    let gate = Arc::new(Notify::new());
    let exec = Arc::new(FlowExec {
        events,
        gate: gate.clone(),
    });
    let b = callee_connector(&env, relay.addr, exec, 512);
    let a = connector(&env, &env.caller, relay.addr, None);
    a.connected().await.unwrap();
    b.connected().await.unwrap();

    let h = a
        .caller()
        .delegate(&peer(CALLEE), spec("stream"))
        .await
        .unwrap();
    flood(&a, &h).await;
    flooded(&a, &h).await;
    gate.notify_one();
    let t = a
        .caller()
        .wait(&h, Duration::from_secs(60))
        .await
        .expect("the terminal arrives: no deadlock");
    // accepted + the first event + every streamed event + the terminal.
    let snap = a.caller().get(&h).await.unwrap();
    assert_eq!(snap.received, events + 3);
    assert_eq!(t.outcome, Outcome::Failed);
    let error = result_error(&a, &h, &t);
    assert!(error.contains("follow_up_overflow"), "{error}");
    a.shutdown().await;
    b.shutdown().await;
    relay.stop().await;
}

/// `wait` called once every event is in (3,000 of them, more than a
/// subscriber's channel holds, so its subscription lags at once) still
/// returns the terminal: it subscribes again after the last event it got.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_after_more_events_than_a_channel_holds_returns_the_terminal() {
    let env = Env::new("");
    let (_redis, relay) = redis_relay(&env).await;
    let events = 3_000;
    let gate = Arc::new(Notify::new());
    let exec = Arc::new(FlowExec {
        events,
        gate: gate.clone(),
    });
    let b = callee_connector(&env, relay.addr, exec, 512);
    let a = connector(&env, &env.caller, relay.addr, None);
    a.connected().await.unwrap();
    b.connected().await.unwrap();
    let h = a
        .caller()
        .delegate(&peer(CALLEE), spec("stream"))
        .await
        .unwrap();
    gate.notify_one();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while a.caller().get(&h).await.unwrap().terminal.is_none() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the terminal arrives"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(a.caller().get(&h).await.unwrap().received, events + 3);
    let t = a
        .caller()
        .wait(&h, Duration::from_secs(60))
        .await
        .expect("wait returns the terminal after its subscription lagged");
    assert_eq!(t.outcome, Outcome::Completed);
    a.shutdown().await;
    b.shutdown().await;
    relay.stop().await;
}

/// After many delegations finished, the callee keeps nothing per
/// delegation: no running entry, no link state (the delegation is unknown
/// to its link), and once their requests can no longer be accepted, no
/// replay-cache entry either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finished_delegations_leave_nothing_behind_on_the_callee() {
    let env = Env::new("");
    let (_redis, relay) = redis_relay(&env).await;
    let exec = Arc::new(FlowExec {
        events: 0,
        gate: Arc::new(Notify::new()),
    });
    let b = callee_connector(&env, relay.addr, exec, 512);
    let a = connector(&env, &env.caller, relay.addr, None);
    a.connected().await.unwrap();
    b.connected().await.unwrap();
    assert_eq!(b.callee_footprint().running, 0);
    assert_eq!(b.callee_footprint().nonces, 0);

    let n = 200;
    let deadline = Duration::from_secs(20);
    let mut handles = Vec::new();
    for _ in 0..n {
        let mut s = spec("quick");
        s.deadline = deadline;
        handles.push(a.caller().delegate(&peer(CALLEE), s).await.unwrap());
    }
    for h in &handles {
        let t = a.caller().wait(h, Duration::from_secs(30)).await.unwrap();
        assert_eq!(t.outcome, Outcome::Completed);
    }
    // Every terminal is settled at the callee: its link forgot them all.
    for h in &handles {
        eventually(
            "the callee's link forgets a finished delegation",
            Duration::from_secs(10),
            || async { b.caller().get(h).await.is_err() },
        )
        .await;
    }
    assert_eq!(b.callee_footprint().running, 0);
    // Replay protection holds until the requests are stale, then goes.
    assert_eq!(b.callee_footprint().nonces, n);
    eventually(
        "the replay cache empties after the deadlines",
        deadline + Duration::from_secs(10),
        || async { b.callee_footprint().nonces == 0 },
    )
    .await;
    a.shutdown().await;
    b.shutdown().await;
    relay.stop().await;
}

/// With one slot per caller, a task the local A2A agent left in
/// `input-required` whose caller never answers ends `failed` with
/// `input_timeout` once the driver's input wait runs out (long before its
/// deadline), and the caller's next delegation gets the slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_left_waiting_for_input_frees_its_slot() {
    let env = Env::new("");
    let (_redis, relay) = redis_relay(&env).await;
    let (_agent, port) = a2a_support::sample_agent().await;
    let mut options = oab_connector::a2a::DriverOptions::new(format!("http://127.0.0.1:{port}"));
    options.input_timeout = Duration::from_millis(500);
    let driver = oab_connector::a2a::A2aDriver::new(options).unwrap();
    let b = callee_connector(&env, relay.addr, Arc::new(driver), 1);
    let a = connector(&env, &env.caller, relay.addr, None);
    a.connected().await.unwrap();
    b.connected().await.unwrap();

    let ask = |id: &str| {
        let mut s = spec("which branch?");
        s.deadline = Duration::from_secs(600);
        s.task.a2a_message = Some(serde_json::json!({
            "messageId": id,
            "role": "ROLE_USER",
            "parts": [{ "text": "which branch?" }],
        }));
        s
    };
    let first = a
        .caller()
        .delegate(&peer(CALLEE), ask("ask-1"))
        .await
        .unwrap();
    let t = a
        .caller()
        .wait(&first, Duration::from_secs(30))
        .await
        .expect("the abandoned task ends long before its deadline");
    assert_eq!(t.outcome, Outcome::Failed);
    let error = result_error(&a, &first, &t);
    assert!(error.contains("input_timeout"), "{error}");

    let mut second = spec("hello");
    second.task.a2a_message = Some(serde_json::json!({
        "messageId": "echo-2",
        "role": "ROLE_USER",
        "parts": [{ "text": "hello" }],
    }));
    let h = a.caller().delegate(&peer(CALLEE), second).await.unwrap();
    let t = a.caller().wait(&h, Duration::from_secs(30)).await.unwrap();
    assert_eq!(t.outcome, Outcome::Completed, "the slot was freed");
    a.shutdown().await;
    b.shutdown().await;
    relay.stop().await;
}

/// `policy.max_live_requests_per_peer` bounds the requests a callee
/// remembers per caller: each stays (against a replay) until its deadline,
/// after it finished, so with a share of two the third delegation within
/// the deadline is refused `saturated` and takes no entry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_replay_cache_share_refuses_the_next_request_saturated() {
    let env = Env::new("");
    let (_redis, relay) = redis_relay(&env).await;
    let exec = Arc::new(FlowExec {
        events: 0,
        gate: Arc::new(Notify::new()),
    });
    let b = callee_connector_with_share(&env, relay.addr, exec, 4, 2);
    let a = connector(&env, &env.caller, relay.addr, None);
    a.connected().await.unwrap();
    b.connected().await.unwrap();
    for _ in 0..2 {
        let h = a
            .caller()
            .delegate(&peer(CALLEE), spec("quick"))
            .await
            .unwrap();
        let t = a.caller().wait(&h, Duration::from_secs(30)).await.unwrap();
        assert_eq!(t.outcome, Outcome::Completed);
    }
    let h = a
        .caller()
        .delegate(&peer(CALLEE), spec("quick"))
        .await
        .unwrap();
    let t = a.caller().wait(&h, Duration::from_secs(30)).await.unwrap();
    assert_eq!(t.outcome, Outcome::Rejected);
    let error = result_error(&a, &h, &t);
    assert!(error.starts_with("saturated"), "{error}");
    assert_eq!(b.callee_footprint().nonces, 2, "the two admitted requests");
    a.shutdown().await;
    b.shutdown().await;
}

/// A request the callee refuses (`saturated`: the caller's one slot is
/// taken) takes no replay-cache entry: the cache holds only the admitted
/// request, so refused attempts cannot fill a caller's share.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_requests_take_no_replay_cache_entry() {
    let env = Env::new("");
    let (_redis, relay) = redis_relay(&env).await;
    let exec = Arc::new(FlowExec {
        events: 0,
        gate: Arc::new(Notify::new()),
    });
    let b = callee_connector(&env, relay.addr, exec, 1);
    let a = connector(&env, &env.caller, relay.addr, None);
    a.connected().await.unwrap();
    b.connected().await.unwrap();

    let held = a
        .caller()
        .delegate(&peer(CALLEE), spec("hold"))
        .await
        .unwrap();
    eventually(
        "the held delegation runs",
        Duration::from_secs(30),
        || async { a.caller().get(&held).await.unwrap().received >= 2 },
    )
    .await;
    for _ in 0..20 {
        let h = a
            .caller()
            .delegate(&peer(CALLEE), spec("quick"))
            .await
            .unwrap();
        let t = a.caller().wait(&h, Duration::from_secs(30)).await.unwrap();
        assert_eq!(t.outcome, Outcome::Rejected);
        let error = result_error(&a, &h, &t);
        assert!(error.starts_with("saturated"), "{error}");
    }
    assert_eq!(b.callee_footprint().nonces, 1, "only the admitted request");
    a.caller().cancel(&held, "done").await.unwrap();
    let t = a
        .caller()
        .wait(&held, Duration::from_secs(30))
        .await
        .unwrap();
    assert_eq!(t.outcome, Outcome::Cancelled);
    a.shutdown().await;
    b.shutdown().await;
    relay.stop().await;
}
