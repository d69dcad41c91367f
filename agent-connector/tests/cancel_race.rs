//! Cancel racing completion, 1,000 times with random timing: both sides end
//! with the same single terminal.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use common::*;
use oab_connector::audit::{AuditEvent, MemoryAuditSink};
use oab_connector::callee::{Execution, StopReason, TaskExecutor, TaskRun};
use oab_relay::store::{MemoryStore, Retention};
use oab_wire::Outcome;

/// A small xorshift generator seeded per run (printed, for reproduction).
struct Rng(AtomicU64);
impl Rng {
    fn below(&self, n: u64) -> u64 {
        let mut x = self.0.load(Ordering::Relaxed);
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0.store(x, Ordering::Relaxed);
        x % n
    }
}

/// Works for a random number of scheduler turns, then completes.
struct Racer(Arc<Rng>);

impl TaskExecutor for Racer {
    fn execute(
        &self,
        run: TaskRun,
    ) -> Pin<Box<dyn std::future::Future<Output = Execution> + Send>> {
        let turns = self.0.below(400);
        Box::pin(async move {
            for _ in 0..turns {
                if run.cancel.is_cancelled() {
                    return Execution::stopped(StopReason::Cancelled);
                }
                tokio::task::yield_now().await;
            }
            Execution::stopped(StopReason::EndTurn)
        })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_racing_completion_1000_times_agrees_on_one_terminal() {
    let seed = oab_wire::identity::now_ms() | 1;
    println!("seed {seed}");
    let rng = Arc::new(Rng(AtomicU64::new(seed)));
    let env = Env::new("");
    let relay = Relay::start(&env, Arc::new(MemoryStore::new(Retention::default()))).await;
    let audit = Arc::new(MemoryAuditSink::new(100_000));
    let b = connector_full(
        &env,
        settings(&env.callee, relay.addr, &env.cert_der),
        Some(Arc::new(Racer(rng.clone()))),
        policy(),
        Some(audit.clone()),
    );
    let a = Arc::new(connector(&env, &env.caller, relay.addr, None));
    a.connected().await.unwrap();
    b.connected().await.unwrap();
    let mut tasks = tokio::task::JoinSet::new();
    // 256 in flight at once, under the callee's concurrency cap (512), so
    // every delegation runs and races its cancel.
    let slots = Arc::new(tokio::sync::Semaphore::new(256));
    for i in 0..1000u32 {
        let (a, delay) = (a.clone(), rng.below(400));
        let slot = slots.clone().acquire_owned().await.unwrap();
        tasks.spawn(async move {
            let _slot = slot;
            let h = a
                .caller()
                .delegate(&peer(CALLEE), spec(&format!("race {i}")))
                .await
                .unwrap();
            for _ in 0..delay {
                tokio::task::yield_now().await;
            }
            a.caller().cancel(&h, "changed my mind").await.unwrap();
            let t = a.caller().wait(&h, Duration::from_secs(120)).await.unwrap();
            if !t.relay_origin {
                a.caller().verify(&h, &t).unwrap();
            }
            (h.key, t.outcome)
        });
    }
    let mut caller_view = HashMap::new();
    while let Some(r) = tasks.join_next().await {
        let (k, o) = r.unwrap();
        assert!(caller_view.insert(k, o).is_none());
    }
    // The callee's view: the terminal it appended and the relay acknowledged.
    // The callee records it when the ack reaches it, which can be just after
    // the caller saw the terminal: wait (bounded) for all 1,000.
    let callee_view = {
        let mut attempts = 0;
        loop {
            let mut view = HashMap::new();
            for rec in audit.records() {
                let terminal = matches!(
                    rec.event,
                    AuditEvent::Completed
                        | AuditEvent::Cancelled
                        | AuditEvent::Failed
                        | AuditEvent::Rejected
                );
                if terminal && rec.code.is_none() {
                    assert!(
                        view.insert(rec.key(), rec.outcome.unwrap()).is_none(),
                        "one terminal each"
                    );
                }
            }
            attempts += 1;
            if view.len() == 1000 || attempts > 1000 {
                break view;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    let mut split: HashMap<Outcome, usize> = HashMap::new();
    for (k, o) in &caller_view {
        assert_eq!(callee_view.get(k), Some(o), "both sides agree on {k}");
        *split.entry(*o).or_default() += 1;
    }
    assert_eq!(callee_view.len(), 1000);
    println!("outcomes: {split:?}");
    assert!(
        !split.contains_key(&Outcome::Rejected),
        "every delegation ran: {split:?}"
    );
    if let Ok(a) = Arc::try_unwrap(a) {
        a.shutdown().await;
    }
    b.shutdown().await;
    relay.stop().await;
}

/// What each delegation's executor emitted before it returned, by request id.
type Emitted = Arc<std::sync::Mutex<HashMap<String, Vec<u64>>>>;

/// Streams numbered progress until it is cancelled or has sent a random
/// number of events; after the cancel it keeps emitting a random number of
/// events (cleanup progress) before it returns `Cancelled`. Every event the
/// sink accepted is recorded.
struct Chatter {
    rng: Arc<Rng>,
    emitted: Emitted,
}

impl TaskExecutor for Chatter {
    fn execute(
        &self,
        run: TaskRun,
    ) -> Pin<Box<dyn std::future::Future<Output = Execution> + Send>> {
        let (turns, after_cancel) = (1 + self.rng.below(200), self.rng.below(4));
        let emitted = self.emitted.clone();
        Box::pin(async move {
            let id = run.key.request_id.to_string();
            let emit = |i: u64| {
                let (sink, emitted, id) = (run.sink.clone(), emitted.clone(), id.clone());
                async move {
                    let data = Some(serde_json::json!({ "i": i }));
                    if sink.status("TASK_STATE_WORKING", None, data).await.is_ok() {
                        emitted.lock().unwrap().entry(id).or_default().push(i);
                    }
                }
            };
            for i in 1..=turns {
                emit(i).await;
                if run.cancel.is_cancelled() {
                    for j in 1..=after_cancel {
                        emit(1_000_000 + j).await;
                    }
                    return Execution::stopped(StopReason::Cancelled);
                }
                tokio::task::yield_now().await;
            }
            Execution::stopped(StopReason::EndTurn)
        })
    }
}

/// For every delegation of 500 cancel races, the progress the caller
/// received before the terminal is exactly what the executor emitted
/// (including what it emitted after it saw the cancel), in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn progress_emitted_around_a_cancel_reaches_the_caller_500_times() {
    use futures_util::StreamExt as _;
    use oab_connector::EventKind;

    let seed = oab_wire::identity::now_ms() | 1;
    println!("seed {seed}");
    let rng = Arc::new(Rng(AtomicU64::new(seed)));
    let emitted: Emitted = Arc::default();
    let env = Env::new("");
    let relay = Relay::start(&env, Arc::new(MemoryStore::new(Retention::default()))).await;
    let b = connector(
        &env,
        &env.callee,
        relay.addr,
        Some(Arc::new(Chatter {
            rng: rng.clone(),
            emitted: emitted.clone(),
        })),
    );
    let a = Arc::new(connector(&env, &env.caller, relay.addr, None));
    a.connected().await.unwrap();
    b.connected().await.unwrap();
    let mut tasks = tokio::task::JoinSet::new();
    let slots = Arc::new(tokio::sync::Semaphore::new(128));
    for i in 0..500u32 {
        let (a, delay) = (a.clone(), rng.below(200));
        let slot = slots.clone().acquire_owned().await.unwrap();
        tasks.spawn(async move {
            let _slot = slot;
            let h = a
                .caller()
                .delegate(&peer(CALLEE), spec(&format!("chatter {i}")))
                .await
                .unwrap();
            let mut events = a.caller().events(&h, 0).await.unwrap();
            let cancel = async {
                for _ in 0..delay {
                    tokio::task::yield_now().await;
                }
                a.caller().cancel(&h, "changed my mind").await.unwrap();
            };
            let collect = async {
                let mut got = Vec::new();
                loop {
                    let ev = tokio::time::timeout(Duration::from_secs(60), events.next())
                        .await
                        .expect("the terminal arrives in time")
                        .expect("the stream lasts until the terminal")
                        .unwrap();
                    match ev.kind {
                        EventKind::Status { data, .. } => {
                            got.push(data.unwrap()["i"].as_u64().unwrap());
                        }
                        EventKind::Terminal(t) => return (got, t.outcome),
                        _ => {}
                    }
                }
            };
            let ((), (got, outcome)) = tokio::join!(cancel, collect);
            (h.key.request_id.to_string(), got, outcome)
        });
    }
    let mut split: HashMap<Outcome, usize> = HashMap::new();
    let mut after_cancel = 0;
    while let Some(r) = tasks.join_next().await {
        let (id, got, outcome) = r.unwrap();
        let sent = emitted
            .lock()
            .unwrap()
            .get(&id)
            .cloned()
            .unwrap_or_default();
        assert_eq!(
            got, sent,
            "delegation {id} ({outcome:?}): received vs emitted"
        );
        after_cancel += got.iter().filter(|i| **i > 1_000_000).count();
        *split.entry(outcome).or_default() += 1;
    }
    println!("outcomes: {split:?}; events emitted after the cancel: {after_cancel}");
    assert!(
        split.get(&Outcome::Cancelled).is_some_and(|n| *n > 0) && after_cancel > 0,
        "the cancel raced the progress: {split:?}"
    );
    if let Ok(a) = Arc::try_unwrap(a) {
        a.shutdown().await;
    }
    b.shutdown().await;
    relay.stop().await;
}

/// Works until it is cancelled; counts the runs it started.
struct Holder(AtomicU64);

impl TaskExecutor for Holder {
    fn execute(
        &self,
        run: TaskRun,
    ) -> Pin<Box<dyn std::future::Future<Output = Execution> + Send>> {
        self.0.fetch_add(1, Ordering::SeqCst);
        Box::pin(async move {
            run.cancel.cancelled().await;
            Execution::stopped(StopReason::Cancelled)
        })
    }
}

/// A cancel sent right after the open reaches the callee while it still
/// checks and accepts the request: it is kept, never dropped, so each of
/// 200 delegations ends `cancelled` (a lost cancel would leave the worker
/// running until the deadline: `expired`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_right_after_the_open_is_never_lost() {
    let env = Env::new("");
    let relay = Relay::start(&env, Arc::new(MemoryStore::new(Retention::default()))).await;
    let holder = Arc::new(Holder(AtomicU64::new(0)));
    let b = connector(&env, &env.callee, relay.addr, Some(holder.clone()));
    let a = Arc::new(connector(&env, &env.caller, relay.addr, None));
    a.connected().await.unwrap();
    b.connected().await.unwrap();
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..200u32 {
        let a = a.clone();
        tasks.spawn(async move {
            let mut s = spec(&format!("hold {i}"));
            s.deadline = Duration::from_secs(5);
            let h = a.caller().delegate(&peer(CALLEE), s).await.unwrap();
            a.caller().cancel(&h, "at once").await.unwrap();
            a.caller()
                .wait(&h, Duration::from_secs(60))
                .await
                .unwrap()
                .outcome
        });
    }
    let mut split: HashMap<Outcome, usize> = HashMap::new();
    while let Some(r) = tasks.join_next().await {
        *split.entry(r.unwrap()).or_default() += 1;
    }
    println!(
        "outcomes: {split:?}; workers started: {}",
        holder.0.load(Ordering::SeqCst)
    );
    assert_eq!(split.get(&Outcome::Cancelled), Some(&200), "{split:?}");
    if let Ok(a) = Arc::try_unwrap(a) {
        a.shutdown().await;
    }
    b.shutdown().await;
    relay.stop().await;
}
