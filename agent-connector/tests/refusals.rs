//! Requests that ask for too much, or replay someone else's signature, are
//! refused with their typed error, and nothing runs.
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

use bytes::Bytes;
use common::*;
use oab_connector::authority::CapabilitySet;
use oab_connector::callee::{Execution, StopReason, TaskExecutor, TaskRun};
use oab_connector::caller::CallerError;
use oab_connector::nonce::Nonce;
use oab_connector::profile::{DelegationRequest, PROFILE_VERSION, sign_request};
use oab_connector::{EventKind, NewDelegation};
use oab_relay::store::{MemoryStore, Retention};
use oab_testkit::raw_client::{RawClient, Target};
use oab_wire::identity::now_ms;
use oab_wire::{DelegationKey, Digest, Direction, Frame, Open, Outcome, RequestId, Resume};

/// Counts runs; tries to delegate further when asked to.
struct Counting {
    runs: AtomicUsize,
    /// The host's own caller API, set once the connector started.
    nested: Option<Arc<std::sync::OnceLock<oab_connector::Caller>>>,
}

impl TaskExecutor for Counting {
    fn execute(
        &self,
        run: TaskRun,
    ) -> Pin<Box<dyn std::future::Future<Output = Execution> + Send>> {
        self.runs.fetch_add(1, Ordering::SeqCst);
        let err = self
            .nested
            .as_ref()
            .and_then(|c| c.get().cloned())
            .map(|c| (c, run.request.task.text.clone()));
        let outcome = async move {
            if let Some((caller, text)) = err {
                let r = caller.delegate(&peer(CALLEE), spec(&text)).await;
                return match r {
                    Err(e) => Execution::stopped(StopReason::Refusal(e.code().to_string())),
                    Ok(_) => Execution::stopped(StopReason::EndTurn),
                };
            }
            Execution::stopped(StopReason::EndTurn)
        };
        Box::pin(outcome)
    }
}

fn permissive() -> oab_connector::authority::Policy {
    let mut p = policy();
    p.allowed_capabilities = CapabilitySet::parse(["read:*", "write:*", "deploy:*"]).unwrap();
    p.allow_writes = true;
    p
}

async fn rejected_with(
    a: &oab_connector::Connector,
    h: &oab_connector::DelegationHandle,
) -> String {
    let t = a.caller().wait(h, Duration::from_secs(30)).await.unwrap();
    assert_eq!(t.outcome, Outcome::Rejected);
    let v = a
        .caller()
        .verify(h, &t)
        .expect("the rejection is signed by the callee");
    v.result.error.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_reaching_requests_are_refused_and_nothing_runs() {
    let env = Env::new("");
    let relay = Relay::start(&env, Arc::new(MemoryStore::new(Retention::default()))).await;
    let exec = Arc::new(Counting {
        runs: AtomicUsize::new(0),
        nested: None,
    });
    let b = connector(&env, &env.callee, relay.addr, Some(exec.clone()));
    // A caller whose own policy lets it ask for anything, so the callee decides.
    let a = connector_full(
        &env,
        settings(&env.caller, relay.addr, &env.cert_der),
        None,
        permissive(),
        None,
    );
    a.connected().await.unwrap();
    b.connected().await.unwrap();

    // Capability widening: the callee's policy has no deploy:*.
    let mut s = spec("deploy it");
    s.capabilities = vec!["read:repo".into(), "deploy:prod".into()];
    let h = a.caller().delegate(&peer(CALLEE), s).await.unwrap();
    let err = rejected_with(&a, &h).await;
    assert!(err.starts_with("capability_denied"), "{err}");
    assert!(
        err.contains("deploy:prod") && !err.contains("read:repo"),
        "names what was refused: {err}"
    );

    // Writes under the callee's read-only policy.
    let mut s = spec("change it");
    s.read_only = false;
    let h = a.caller().delegate(&peer(CALLEE), s).await.unwrap();
    assert!(
        rejected_with(&a, &h)
            .await
            .starts_with("writes_not_allowed")
    );

    // Caller-side refusals never leave the host.
    let strict = connector(&env, &env.caller, relay.addr, None);
    strict.connected().await.unwrap();
    let mut s = spec("x");
    s.task
        .context
        .insert("api_key".into(), serde_json::json!("sk-123"));
    let e = strict
        .caller()
        .delegate(&peer(CALLEE), s)
        .await
        .unwrap_err();
    assert_eq!(e.code(), "credential_field");
    let mut s = spec("x");
    s.budgets = budgets(2_000_000);
    let e = strict
        .caller()
        .delegate(&peer(CALLEE), s)
        .await
        .unwrap_err();
    assert_eq!(e.code(), "over_budget");
    let mut s = spec("x");
    s.capabilities = vec!["admin:everything".into()];
    let e = strict
        .caller()
        .delegate(&peer(CALLEE), s)
        .await
        .unwrap_err();
    assert_eq!(e.code(), "capability_denied");
    assert_eq!(exec.runs.load(Ordering::SeqCst), 0, "nothing ran");
    for c in [a, b, strict] {
        c.shutdown().await;
    }
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_callee_cannot_delegate_further() {
    let env = Env::new("");
    let relay = Relay::start(&env, Arc::new(MemoryStore::new(Retention::default()))).await;
    // The callee host is also a caller: its executor tries to delegate on
    // through the same connector.
    let slot = Arc::new(std::sync::OnceLock::new());
    let exec = Arc::new(Counting {
        runs: AtomicUsize::new(0),
        nested: Some(slot.clone()),
    });
    let b = connector(&env, &env.callee, relay.addr, Some(exec.clone()));
    let _ = slot.set(b.caller().clone());
    let a = connector(&env, &env.caller, relay.addr, None);
    a.connected().await.unwrap();
    b.connected().await.unwrap();
    let h = a
        .caller()
        .delegate(&peer(CALLEE), spec("delegate onwards"))
        .await
        .unwrap();
    let t = a.caller().wait(&h, Duration::from_secs(30)).await.unwrap();
    assert_eq!(t.outcome, Outcome::Failed);
    let v = a.caller().verify(&h, &t).unwrap();
    assert_eq!(
        v.result.error.as_deref(),
        Some("refused: nested_delegation")
    );
    a.shutdown().await;
    b.shutdown().await;
    relay.stop().await;
}

fn request(env: &Env, request_id: &str, nonce: Nonce) -> DelegationRequest {
    DelegationRequest {
        v: PROFILE_VERSION,
        request_id: RequestId::new(request_id).unwrap(),
        caller: env.caller.peer.clone(),
        callee: env.callee.peer.clone(),
        nonce,
        issued_ms: now_ms(),
        task: spec("t").task,
        capabilities: vec!["read:repo".into()],
        depth: 1,
        read_only: true,
        deadline_ms: now_ms() + 60_000,
        budgets: budgets(10),
        parent: spec("t").parent,
    }
}

fn open_with(env: &Env, request_id: &str, payload: Bytes, deadline_ms: u64) -> Frame {
    Frame::Open(Open {
        key: DelegationKey::new(env.caller.peer.clone(), RequestId::new(request_id).unwrap()),
        target: env.callee.peer.clone(),
        deadline_ms,
        depth: 1,
        digest: Digest::of(&payload),
        ceiling: String::new(),
        trace: None,
        payload,
    })
}

/// Reads the caller's up log until the terminal; returns the result's error.
async fn terminal_error(c: &mut RawClient, request_id: &str) -> (Outcome, Option<String>) {
    loop {
        let f = tokio::time::timeout(Duration::from_secs(30), c.recv())
            .await
            .unwrap()
            .unwrap();
        if let Frame::Data(d) = f
            && d.key.request_id.as_str() == request_id
            && let Some(outcome) = d.terminal
        {
            let v: serde_json::Value = serde_json::from_slice(&d.payload).unwrap();
            let env_json = serde_json::to_vec(&v["envelope"]).unwrap();
            let envelope = oab_wire::envelope::Envelope::from_json(&env_json).unwrap();
            // Read the result without a trust store: only its error matters here.
            let payload: serde_json::Value = serde_json::from_slice(&base64_decode(
                &serde_json::from_slice::<serde_json::Value>(&env_json).unwrap()["payload"],
            ))
            .unwrap();
            let _ = envelope;
            return (outcome, payload["error"].as_str().map(str::to_string));
        }
    }
}

fn base64_decode(v: &serde_json::Value) -> Vec<u8> {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD
        .decode(v.as_str().unwrap())
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replayed_signatures_and_reused_nonces_are_refused() {
    let env = Env::new("");
    let relay = Relay::start(&env, Arc::new(MemoryStore::new(Retention::default()))).await;
    let exec = Arc::new(Counting {
        runs: AtomicUsize::new(0),
        nested: None,
    });
    let b = connector(&env, &env.callee, relay.addr, Some(exec.clone()));
    b.connected().await.unwrap();
    let target = Target {
        addr: relay.addr.to_string(),
        server_name: Some("localhost".into()),
        root_der: env.cert_der.clone(),
    };
    let mut a = RawClient::connect(&target, &env.caller, instance())
        .await
        .unwrap();
    let nonce = Nonce::random();
    let req = request(&env, "r1", nonce);
    let signed = Bytes::from(sign_request(&env.caller, &req).to_json());
    a.send(&open_with(&env, "r1", signed.clone(), req.deadline_ms))
        .await
        .unwrap();
    assert_eq!(
        terminal_error(&mut a, "r1").await,
        (Outcome::Completed, None)
    );

    // The same signed bytes under a new request id.
    a.send(&open_with(&env, "r2", signed, req.deadline_ms))
        .await
        .unwrap();
    let (o, e) = terminal_error(&mut a, "r2").await;
    assert_eq!(o, Outcome::Rejected);
    assert!(e.unwrap().starts_with("request_id_mismatch"));

    // A new request that reuses the nonce.
    let req3 = request(&env, "r3", nonce);
    let signed3 = Bytes::from(sign_request(&env.caller, &req3).to_json());
    a.send(&open_with(&env, "r3", signed3, req3.deadline_ms))
        .await
        .unwrap();
    let (o, e) = terminal_error(&mut a, "r3").await;
    assert_eq!(o, Outcome::Rejected);
    assert!(e.unwrap().starts_with("nonce_reused"));
    assert_eq!(
        exec.runs.load(Ordering::SeqCst),
        1,
        "only the genuine request ran"
    );
    let _ = a
        .send(&Frame::Resume(Resume {
            key: DelegationKey::new(env.caller.peer.clone(), RequestId::new("r1").unwrap()),
            direction: Direction::Up,
            after: 0,
        }))
        .await;
    b.shutdown().await;
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_request_id_runs_once_and_a_different_body_is_a_mismatch() {
    let env = Env::new("");
    let relay = Relay::start(&env, Arc::new(MemoryStore::new(Retention::default()))).await;
    let exec = Arc::new(Counting {
        runs: AtomicUsize::new(0),
        nested: None,
    });
    let b = connector(&env, &env.callee, relay.addr, Some(exec.clone()));
    let a = connector(&env, &env.caller, relay.addr, None);
    a.connected().await.unwrap();
    b.connected().await.unwrap();
    let mut s: NewDelegation = spec("once");
    s.request_id = Some(RequestId::new("same-id").unwrap());
    let callee = peer(CALLEE);
    let (h1, h2, h3) = tokio::join!(
        a.caller().delegate(&callee, s.clone()),
        a.caller().delegate(&callee, s.clone()),
        a.caller().delegate(&callee, s.clone()),
    );
    let (h1, h2, h3) = (h1.unwrap(), h2.unwrap(), h3.unwrap());
    assert!(h1 == h2 && h2 == h3);
    let t = a.caller().wait(&h1, Duration::from_secs(30)).await.unwrap();
    assert_eq!(t.outcome, Outcome::Completed);
    let mut other = s.clone();
    other.task.text = "something else".into();
    let e = a.caller().delegate(&peer(CALLEE), other).await.unwrap_err();
    assert!(matches!(e, CallerError::IdempotencyMismatch(_)));
    // A retry in another trace is the same delegation (the trace id is not
    // part of the request's identity), which keeps its first trace.
    let mut retried = s.clone();
    retried.parent.trace_id = "another-trace".into();
    let h4 = a.caller().delegate(&peer(CALLEE), retried).await.unwrap();
    assert!(h4 == h1);
    assert_eq!(exec.runs.load(Ordering::SeqCst), 1);
    let mut events = a.caller().events(&h1, 0).await.unwrap();
    use futures_util::StreamExt as _;
    let first = events.next().await.unwrap().unwrap();
    assert!(matches!(first.kind, EventKind::Accepted { .. }));
    a.shutdown().await;
    b.shutdown().await;
    relay.stop().await;
}

/// A refusal that comes before anyone subscribes is still the answer: the
/// relay refuses an open (no route from the callee to the caller), the link
/// drops the delegation, and a subscriber that comes only then reads the
/// refusal with the relay's code, never "events are gone (unknown)". This
/// is the race a facade task lost when its tracker subscribed after the
/// refusal had arrived.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_read_after_it_arrived_is_the_refusal() {
    let env = Env::new("");
    let relay = Relay::start(&env, Arc::new(MemoryStore::new(Retention::default()))).await;
    let a = connector(&env, &env.caller, relay.addr, None);
    let b = connector(&env, &env.callee, relay.addr, None);
    b.connected().await.unwrap();
    a.connected().await.unwrap();
    for i in 0..20 {
        let h = b
            .caller()
            .delegate(&peer(CALLER), spec(&format!("no route {i}")))
            .await
            .unwrap();
        // The refusal has arrived once the link no longer holds it.
        let until = tokio::time::Instant::now() + Duration::from_secs(20);
        while b.caller().get(&h).await.is_ok() {
            assert!(tokio::time::Instant::now() < until, "never refused");
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        match b.caller().wait(&h, Duration::from_secs(20)).await {
            Err(CallerError::Events(oab_connector::link::EventError::Refused { code, .. })) => {
                assert_eq!(code, "route_denied");
            }
            other => panic!("delegation {i}: expected the refusal, got {other:?}"),
        }
    }
    a.shutdown().await;
    b.shutdown().await;
    relay.stop().await;
}
