//! A running connector takes a reloaded configuration (what `SIGHUP` does in
//! `oab-connector run`): peer keys, policy and relay trust change while the
//! session stays up. A real relay over TLS on loopback.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use oab_connector::authority::{CapabilitySet, Grant, Policy};
use oab_connector::callee::{CalleeOptions, LivePolicy};
use oab_connector::trust::RelayTrust;
use oab_connector::{Connector, ConnectorOptions, Reconfiguration};
use oab_relay::store::{MemoryStore, Retention};
use oab_wire::identity::{Identity, PeerKey};
use oab_wire::{KeyId, Outcome, PeerId};

fn relay_trust(env: &Env) -> RelayTrust {
    RelayTrust::Ca(vec![rustls::pki_types::CertificateDer::from(
        env.cert_der.clone(),
    )])
}

fn grant() -> Grant {
    Grant {
        capabilities: CapabilitySet::parse(["read:*", "run:tests", "write:*", "deploy:*"]).unwrap(),
        remaining: budgets(10_000_000),
    }
}

/// `env`'s peer keys with `retired`'s key replaced by a new one (a
/// rotation the other host has not rolled out yet).
fn trust_retiring(env: &Env, retired: &PeerId) -> HashMap<PeerId, Vec<PeerKey>> {
    let mut t = env.trust();
    let rotated = Identity::generate(retired.clone(), KeyId::new("k2").unwrap());
    t.insert(retired.clone(), vec![key_of(&rotated)]);
    t
}

fn reconfiguration(env: &Env, trust: HashMap<PeerId, Vec<PeerKey>>) -> Reconfiguration {
    Reconfiguration {
        trust,
        grant: grant(),
        caller_policy: policy(),
        relay_trust: relay_trust(env),
    }
}

/// A callee connector whose `[policy]` is a [`LivePolicy`], as
/// `oab-connector run` wires it.
fn callee(
    env: &Env,
    relay: std::net::SocketAddr,
    live: Arc<LivePolicy>,
    executor: Arc<Paced>,
) -> Connector {
    Connector::start(ConnectorOptions {
        link: settings(&env.callee, relay, &env.cert_der),
        trust: env.trust(),
        grant: grant(),
        caller_policy: policy(),
        callee: Some(CalleeOptions {
            executor,
            policy: live,
            max_concurrent: 16,
            max_concurrent_per_peer: 16,
        }),
        audit: None,
        state: None,
    })
    .unwrap()
}

async fn outcome_of(a: &Connector, text: &str) -> (Outcome, Option<String>) {
    let h = a
        .caller()
        .delegate(&peer(CALLEE), spec(text))
        .await
        .unwrap();
    let t = a.caller().wait(&h, Duration::from_secs(30)).await.unwrap();
    let v = a.caller().verify(&h, &t).expect("signed by the callee");
    (t.outcome, v.result.error)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_signed_by_a_retired_key_are_refused_after_a_reload() {
    let env = Env::new("");
    let relay = Relay::start(&env, Arc::new(MemoryStore::new(Retention::default()))).await;
    let exec = Paced::new(1, Duration::ZERO);
    let b = callee(
        &env,
        relay.addr,
        Arc::new(LivePolicy::new(policy())),
        exec.clone(),
    );
    let a = connector(&env, &env.caller, relay.addr, None);
    a.connected().await.unwrap();
    b.connected().await.unwrap();
    assert_eq!(outcome_of(&a, "before").await.0, Outcome::Completed);
    assert_eq!(exec.runs(), 1);
    // The callee retires the caller's key k1.
    b.reload(reconfiguration(&env, trust_retiring(&env, &peer(CALLER))))
        .unwrap();
    let h = a
        .caller()
        .delegate(&peer(CALLEE), spec("after"))
        .await
        .unwrap();
    let t = a.caller().wait(&h, Duration::from_secs(30)).await.unwrap();
    assert_eq!(t.outcome, Outcome::Rejected);
    assert_eq!(exec.runs(), 1, "a request signed by a retired key ran");
    // The callee's session stayed up through the reload.
    assert!(matches!(
        b.state(),
        oab_connector::link::LinkState::Connected { .. }
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn results_signed_by_a_retired_key_are_refused_after_a_reload() {
    let env = Env::new("");
    let relay = Relay::start(&env, Arc::new(MemoryStore::new(Retention::default()))).await;
    let b = callee(
        &env,
        relay.addr,
        Arc::new(LivePolicy::new(policy())),
        Paced::new(1, Duration::ZERO),
    );
    let a = connector(&env, &env.caller, relay.addr, None);
    a.connected().await.unwrap();
    b.connected().await.unwrap();
    let h = a.caller().delegate(&peer(CALLEE), spec("x")).await.unwrap();
    let t = a.caller().wait(&h, Duration::from_secs(30)).await.unwrap();
    assert_eq!(t.outcome, Outcome::Completed);
    a.caller()
        .verify(&h, &t)
        .expect("verifies before the reload");
    // The caller retires the callee's key.
    a.reload(reconfiguration(&env, trust_retiring(&env, &peer(CALLEE))))
        .unwrap();
    let refused = a.caller().verify(&h, &t);
    assert!(
        refused.is_err(),
        "a result signed by a retired key verified"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reloaded_policy_applies_to_the_next_delegation_on_both_sides() {
    let env = Env::new("");
    let relay = Relay::start(&env, Arc::new(MemoryStore::new(Retention::default()))).await;
    let live = Arc::new(LivePolicy::new(policy()));
    let b = callee(
        &env,
        relay.addr,
        live.clone(),
        Paced::new(1, Duration::ZERO),
    );
    let a = connector(&env, &env.caller, relay.addr, None);
    a.connected().await.unwrap();
    b.connected().await.unwrap();
    assert_eq!(outcome_of(&a, "before").await.0, Outcome::Completed);
    // The callee no longer lets callers read.
    let narrowed = Policy {
        allowed_capabilities: CapabilitySet::parse(["run:tests"]).unwrap(),
        ..policy()
    };
    live.set(narrowed.clone());
    let (outcome, error) = outcome_of(&a, "read after the reload").await;
    assert_eq!(outcome, Outcome::Rejected);
    let error = error.unwrap();
    assert!(error.starts_with("capability_denied"), "{error}");
    // The caller's own grant and policy, reloaded, refuse before sending.
    a.reload(Reconfiguration {
        grant: Grant {
            capabilities: narrowed.allowed_capabilities.clone(),
            remaining: budgets(10_000_000),
        },
        caller_policy: narrowed,
        ..reconfiguration(&env, env.trust())
    })
    .unwrap();
    let refused = a.caller().delegate(&peer(CALLEE), spec("x")).await;
    assert!(
        refused.is_err(),
        "the caller sent what its reloaded grant forbids"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reloaded_relay_trust_applies_at_the_next_connect() {
    let env = Env::new("");
    let relay = Relay::start(&env, Arc::new(MemoryStore::new(Retention::default()))).await;
    // Started trusting another CA: it cannot connect.
    let stranger = oab_relay::tls::self_signed(&["localhost"]).unwrap();
    let a = connector_with(
        &env,
        settings(&env.caller, relay.addr, &stranger.cert_der),
        None,
    );
    // A reload whose CA cannot be used changes nothing.
    let bad = a.reload(Reconfiguration {
        relay_trust: RelayTrust::Ca(vec![rustls::pki_types::CertificateDer::from(vec![1, 2, 3])]),
        ..reconfiguration(&env, env.trust())
    });
    assert!(bad.is_err());
    a.reload(reconfiguration(&env, env.trust())).unwrap();
    tokio::time::timeout(Duration::from_secs(20), a.connected())
        .await
        .expect("connects once it trusts the relay's CA")
        .unwrap();
}
