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
            max_live_requests_per_peer: oab_connector::nonce::NonceCache::DEFAULT_PER_CALLER,
            replay_window_ms: oab_connector::nonce::NonceCache::DEFAULT_MAX_AGE_MS,
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

/// Waits for a `Peers` snapshot in which the callee's online state is
/// `online` (bounded: a connector that never gets there fails the test).
async fn callee_online(c: &mut oab_testkit::raw_client::RawClient, online: bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let frame = tokio::time::timeout_at(deadline, c.recv())
            .await
            .unwrap_or_else(|_| panic!("the callee never became online={online}"))
            .unwrap();
        if let oab_wire::Frame::Peers(p) = frame {
            let entries: serde_json::Value = serde_json::from_slice(&p).unwrap();
            let state = entries
                .as_array()
                .unwrap()
                .iter()
                .find(|e| e["peer"] == CALLEE)
                .map(|e| e["online"] == true);
            if state == Some(online) {
                return;
            }
        }
    }
}

/// Reads the connector's log until a line contains `what`.
async fn logged(
    log: &mut tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStderr>>,
    what: &str,
) -> String {
    // One deadline for the whole wait: the connector may keep logging
    // other lines (its reconnect attempts).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let line = tokio::time::timeout_at(deadline, log.next_line())
            .await
            .unwrap_or_else(|_| panic!("never logged {what:?}"))
            .unwrap()
            .unwrap_or_else(|| panic!("the connector exited before logging {what:?}"));
        if line.contains(what) {
            return line;
        }
    }
}

/// `oab-connector run` reloads its file on SIGHUP: a connector started with
/// the wrong relay CA connects once the file names the right one; a broken
/// file is refused and the process keeps running.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reloads_the_connector_binarys_file() {
    let env = Env::new("");
    let relay = Relay::start(&env, Arc::new(MemoryStore::new(Retention::default()))).await;
    let dir = tempfile::tempdir().unwrap();
    let identity = dir.path().join("callee.identity.toml");
    oab_connector::keyfile::save(&env.callee, &identity).unwrap();
    let (right, wrong) = (
        dir.path().join("relay-ca.pem"),
        dir.path().join("other-ca.pem"),
    );
    std::fs::write(&right, &env.cert_pem).unwrap();
    let stranger = oab_relay::tls::self_signed(&["localhost"]).unwrap();
    std::fs::write(&wrong, &stranger.cert_pem).unwrap();
    let config = dir.path().join("connector.toml");
    let text = |ca: &std::path::Path| {
        format!(
            "[connector]\nrelay_url = \"wss://localhost:{}/\"\nidentity = \"{}\"\nrelay_ca = \"{}\"\n\
             [[peers]]\nid = \"{CALLER}\"\nkeys = [{{ key_id = \"k1\", public_key = \"{}\" }}]\n",
            relay.addr.port(),
            identity.display(),
            ca.display(),
            env.caller.public_key()
        )
    };
    std::fs::write(&config, text(&wrong)).unwrap();
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_oab-connector"))
        .args(["run", "--config"])
        .arg(&config)
        .env("OAB_LOG", "info")
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut log =
        tokio::io::AsyncBufReadExt::lines(tokio::io::BufReader::new(child.stderr.take().unwrap()));
    let target = oab_testkit::raw_client::Target {
        addr: relay.addr.to_string(),
        server_name: Some("localhost".into()),
        root_der: env.cert_der.clone(),
    };
    let mut watcher = oab_testkit::raw_client::RawClient::connect(&target, &env.caller, instance())
        .await
        .unwrap();
    watcher.send(&oab_wire::Frame::PeersQuery).await.unwrap();
    callee_online(&mut watcher, false).await;
    let hup = |pid: u32| {
        let ok = std::process::Command::new("kill")
            .args(["-HUP", &pid.to_string()])
            .status()
            .unwrap()
            .success();
        assert!(ok);
    };
    let pid = child.id().unwrap();
    // It cannot connect while it trusts another CA (and its signal
    // handlers are in place by the time it tried).
    logged(&mut log, "TLS").await;
    std::fs::write(&config, text(&right)).unwrap();
    hup(pid);
    logged(&mut log, "configuration reloaded").await;
    callee_online(&mut watcher, true).await;
    // A file that does not validate is refused; the connector stays up.
    std::fs::write(
        &config,
        format!("{}\n[policy]\nmax_concurrent = 0\n", text(&right)),
    )
    .unwrap();
    hup(pid);
    logged(&mut log, "configuration reload refused").await;
    // The errors follow, one per line, as `check-config` prints them (with
    // the field's line).
    let line = logged(&mut log, "must be greater than 0").await;
    assert!(line.contains("policy.max_concurrent (line "), "{line}");
    assert!(
        child.try_wait().unwrap().is_none(),
        "SIGHUP ended the connector"
    );
    watcher.send(&oab_wire::Frame::PeersQuery).await.unwrap();
    callee_online(&mut watcher, true).await;
    child.kill().await.unwrap();
}
