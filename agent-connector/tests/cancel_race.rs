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
