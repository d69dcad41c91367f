//! End-to-end delegations through a real relay: events in order, signed
//! results that verify, refusals that run nothing.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use common::*;
use futures_util::StreamExt as _;
use oab_connector::callee::{Execution, StopReason, TaskExecutor, TaskRun};
use oab_connector::profile::{Artifact, Usage};
use oab_connector::{EventKind, Terminal};
use oab_relay::store::{MemoryStore, Retention};
use oab_wire::Outcome;

/// Streams `n` progress events, then completes with one artifact.
struct Streamer {
    n: u64,
    runs: AtomicUsize,
}

impl TaskExecutor for Streamer {
    fn execute(
        &self,
        run: TaskRun,
    ) -> Pin<Box<dyn std::future::Future<Output = Execution> + Send>> {
        self.runs.fetch_add(1, Ordering::SeqCst);
        let n = self.n;
        Box::pin(async move {
            for i in 1..=n {
                if run.cancel.is_cancelled() {
                    return Execution::stopped(StopReason::Cancelled);
                }
                run.sink
                    .status(
                        "TASK_STATE_WORKING",
                        None,
                        Some(serde_json::json!({ "step": i })),
                    )
                    .await
                    .unwrap();
            }
            Execution {
                stop: StopReason::EndTurn,
                output: Some(serde_json::json!({ "summary": run.request.task.text })),
                artifacts: vec![Artifact {
                    artifact_id: "a1".into(),
                    name: "report".into(),
                    media_type: "text/plain".into(),
                    text: Some("all good".into()),
                    data: None,
                    url: None,
                }],
                side_effects: vec![],
                usage: Usage {
                    tokens: 10,
                    cost_micros: 5,
                    output_bytes: 8,
                },
            }
        })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hundred_events_and_a_verified_result_in_order() {
    let env = Env::new("");
    let relay = Relay::start(&env, Arc::new(MemoryStore::new(Retention::default()))).await;
    let exec = Arc::new(Streamer {
        n: 100,
        runs: AtomicUsize::new(0),
    });
    let b = connector(&env, &env.callee, relay.addr, Some(exec.clone()));
    let a = connector(&env, &env.caller, relay.addr, None);
    a.connected().await.unwrap();
    b.connected().await.unwrap();
    let h = a
        .caller()
        .delegate(&peer(CALLEE), spec("summarise the repo"))
        .await
        .unwrap();
    let mut events = a.caller().events(&h, 0).await.unwrap();
    let mut seen = Vec::new();
    let terminal: Terminal = loop {
        let ev = tokio::time::timeout(Duration::from_secs(30), events.next())
            .await
            .expect("events arrive")
            .expect("stream open")
            .expect("no gap");
        assert_eq!(ev.seq, seen.len() as u64 + 1, "in order, none missing");
        match ev.kind {
            EventKind::Terminal(t) => break t,
            other => seen.push(other),
        }
    };
    assert!(matches!(seen[0], EventKind::Accepted { .. }));
    let steps: Vec<u64> = seen[1..]
        .iter()
        .map(|e| match e {
            EventKind::Status { data: Some(d), .. } => d["step"].as_u64().unwrap(),
            other => panic!("unexpected {other:?}"),
        })
        .collect();
    assert_eq!(steps, (1..=100).collect::<Vec<_>>());
    assert_eq!(terminal.outcome, Outcome::Completed);
    assert!(!terminal.relay_origin);
    let verified = a.caller().verify(&h, &terminal).unwrap();
    assert_eq!(verified.result.outcome, Outcome::Completed);
    assert_eq!(verified.result.artifacts.len(), 1);
    assert_eq!(
        verified.result.effective_capabilities,
        vec!["read:repo".to_string()]
    );
    assert_eq!(exec.runs.load(Ordering::SeqCst), 1);
    // Tampering is caught: a result re-signed by another key of the same peer
    // name, a different outcome on the frame, a doctored result.
    let forged_key =
        oab_wire::identity::Identity::generate(env.callee.peer.clone(), env.callee.key_id.clone());
    let forged = oab_connector::profile::sign_result(&forged_key, &verified.result);
    let mut t2 = terminal.clone();
    t2.envelope = Some(forged);
    assert_eq!(
        a.caller().verify(&h, &t2).unwrap_err().code(),
        "bad_signature"
    );
    let mut t3 = terminal.clone();
    t3.outcome = Outcome::Failed;
    assert!(a.caller().verify(&h, &t3).is_err());
    let mut doctored = verified.result.clone();
    doctored.usage.tokens = 1;
    let mut t4 = terminal.clone();
    t4.envelope = Some(oab_connector::profile::sign_result(&env.caller, &doctored));
    assert!(
        a.caller().verify(&h, &t4).is_err(),
        "signed by the caller, not the callee"
    );
    // `wait` gives the same terminal.
    let again = a.caller().wait(&h, Duration::from_secs(10)).await.unwrap();
    assert_eq!(again, terminal);
    a.shutdown().await;
    b.shutdown().await;
    relay.stop().await;
}
