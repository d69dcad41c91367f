//! One W3C trace through every process: an A2A `SendMessage` with a
//! `traceparent` header to connector A's facade, through an `oab-relay`
//! process on Redis, to connector B's driver and the official-SDK sample
//! agent. The trace id of the header is in the relay's, connector A's and
//! connector B's JSON log lines for the delegation, each beside the same
//! delegation key, and in the `traceparent` of every request the agent
//! received for it.
//!
//! Needs the `oab-relay` and `oab-connector` binaries of the same build
//! profile (`cargo test --workspace` builds them) and the virtualenv of
//! `scripts/python-env` (`scripts/test` installs it).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use oab_loadtest::connector_process::{ConnectorProcess, ConnectorRole};
use oab_loadtest::relay::{RedisPersistence, RelayMode, RelayUnderTest, StoreKind};
use oab_loadtest::scenario::a2a_sdk::start_sample_agent;
use oab_loadtest::scenario::soak::{free_loopback_addr, wait_ready};
use oab_loadtest::setup::{CALLEE, Setup, Tuning};
use oab_wire::TraceId;
use serde_json::{Value, json};

/// The folder `cargo` puts this profile's binaries in (this test runs from
/// its `deps/` subfolder).
fn bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let path = exe
        .parent()
        .and_then(|deps| deps.parent())
        .map(|profile| profile.join(name))
        .unwrap();
    assert!(
        path.is_file(),
        "no {name} binary at {path:?}: build it first (cargo build -p oab-relay -p oab-connector)"
    );
    path
}

/// Every JSON log line of `path` that carries `field` (in its own fields or
/// in one of its spans): the line's (message, value of `field`, value of
/// `other`).
fn lines_with(path: &Path, field: &str, other: &str) -> Vec<(String, String, Option<String>)> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let mut out = Vec::new();
    for line in text.lines() {
        let Ok(v) = serde_json::from_str::<Value>(line) else {
            continue;
        };
        // The line's own fields, its span's and every enclosing span's.
        let mut scopes = vec![&v["fields"], &v["span"]];
        if let Some(spans) = v["spans"].as_array() {
            scopes.extend(spans.iter());
        }
        let find = |name: &str| {
            scopes
                .iter()
                .find_map(|s| s[name].as_str().map(str::to_string))
        };
        if let Some(value) = find(field) {
            let message = v["fields"]["message"].as_str().unwrap_or("").to_string();
            out.push((message, value, find(other)));
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_trace_id_goes_from_the_a2a_request_to_every_log_and_the_agent() {
    oab_relay::tls::install_crypto_provider();
    let tree = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let python = tree.join(".venv/bin/python");
    assert!(
        python.is_file(),
        "{} is missing: run scripts/python-env first (it creates .venv with the official a2a-sdk)",
        python.display()
    );
    let mut setup = Setup::new(0, Tuning::default()).unwrap();
    setup.child_log = "info".into();
    setup.child_log_format = "json".into();
    let relay = RelayUnderTest::start(
        &setup,
        &RelayMode::Process(bin("oab-relay")),
        StoreKind::Redis,
        RedisPersistence::None,
    )
    .await
    .unwrap();
    let (_agent, agent_port) =
        start_sample_agent(&python, &tree.join("agent-connector/tests/interop"))
            .await
            .unwrap();
    let agent_url = format!("http://127.0.0.1:{agent_port}");
    let facade = free_loopback_addr().unwrap();
    let connector = bin("oab-connector");
    let mut b = ConnectorProcess::start(
        &setup,
        &connector,
        relay.addr(),
        &ConnectorRole {
            name: "connector-b".into(),
            identity: setup.callee.clone(),
            peers: vec![setup.caller.clone()],
            max_concurrent: 16,
            facade_listen: None,
            driver_url: Some(agent_url.clone()),
            default_timeout_ms: 60_000,
        },
    )
    .unwrap();
    let mut a = ConnectorProcess::start(
        &setup,
        &connector,
        relay.addr(),
        &ConnectorRole {
            name: "connector-a".into(),
            identity: setup.caller.clone(),
            peers: vec![setup.callee.clone()],
            max_concurrent: 16,
            facade_listen: Some(facade),
            driver_url: None,
            default_timeout_ms: 60_000,
        },
    )
    .unwrap();
    let http = reqwest::Client::new();
    wait_ready(&http, facade, &mut a, &mut b).await.unwrap();

    // A blocking SendMessage in a trace of the client's; the agent streams
    // progress and completes (`stream-`).
    let trace = TraceId::random();
    let traceparent = format!("00-{trace}-00f067aa0ba902b7-01");
    let body = json!({
        "jsonrpc": "2.0",
        "id": 1,
        "method": "SendMessage",
        "params": { "message": {
            "messageId": "stream-traced",
            "role": "ROLE_USER",
            "parts": [{ "text": "follow me" }],
        }},
    });
    let answer: Value = tokio::time::timeout(
        Duration::from_secs(60),
        http.post(format!("http://{facade}/peers/{CALLEE}/"))
            .header("content-type", "application/json")
            .header("A2A-Version", "1.0")
            .header("traceparent", &traceparent)
            .body(body.to_string())
            .send(),
    )
    .await
    .expect("the facade answers in time")
    .unwrap()
    .json()
    .await
    .unwrap();
    assert_eq!(
        answer["result"]["task"]["status"]["state"], "TASK_STATE_COMPLETED",
        "{answer}"
    );

    // The relay: the open and the terminal, with the key and the trace id.
    let want = trace.to_hex();
    let relay_log = relay.log_path().unwrap();
    let relay_lines = lines_with(relay_log, "trace_id", "key");
    let keys: BTreeSet<String> = relay_lines
        .iter()
        .filter(|(_, t, _)| *t == want)
        .filter_map(|(_, _, k)| k.clone())
        .collect();
    assert_eq!(
        keys.len(),
        1,
        "the relay logs one delegation key with trace {want}: {relay_lines:?}\n{}",
        relay.log_tail()
    );
    let key = keys.into_iter().next().unwrap();
    let messages = |lines: &[(String, String, Option<String>)]| -> BTreeSet<String> {
        lines
            .iter()
            .filter(|(_, t, k)| *t == want && k.as_deref() == Some(key.as_str()))
            .map(|(m, _, _)| m.clone())
            .collect()
    };
    let relay_messages = messages(&relay_lines);
    for m in ["delegation opened", "delegation finished"] {
        assert!(
            relay_messages.contains(m),
            "relay: {m:?} with key and trace: {relay_messages:?}"
        );
    }
    // Connector A (the caller) and connector B (the callee): lines with
    // the same key and trace id, whichever message they carry.
    for (name, p) in [("connector A", &a), ("connector B", &b)] {
        let found = messages(&lines_with(p.log_path(), "trace_id", "key"));
        assert!(
            !found.is_empty(),
            "{name}: no log line with key {key} and trace {want}:\n{}",
            p.log_tail()
        );
    }
    let a_messages = messages(&lines_with(a.log_path(), "trace_id", "key"));
    assert!(
        a_messages.contains("delegation sent"),
        "connector A: {a_messages:?}"
    );
    let b_messages = messages(&lines_with(b.log_path(), "trace_id", "key"));
    assert!(
        b_messages.contains("delegation accepted"),
        "connector B: {b_messages:?}"
    );

    eprintln!(
        "trace {want}, key {key}: relay {relay_messages:?}; connector A {a_messages:?}; \
         connector B {b_messages:?}"
    );
    // The agent: every request for the task carried the trace, each with a
    // span id of its own (not the client's).
    let seen: Vec<Value> = http
        .get(format!("{agent_url}/test/traceparents"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(!seen.is_empty(), "the agent received no traceparent");
    for s in &seen {
        let header = s["traceparent"].as_str().unwrap();
        assert_eq!(
            TraceId::from_traceparent(header),
            Some(trace),
            "{header} ({s})"
        );
        assert_ne!(header, traceparent, "the driver sends its own span id");
    }
    assert!(
        seen.iter().any(|s| s["method"] == "POST"),
        "the message itself carried it: {seen:?}"
    );
    a.stop().await;
    b.stop().await;
    relay.stop().await;
}
