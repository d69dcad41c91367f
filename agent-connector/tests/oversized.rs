//! No peer takes another out of service with a large message: an output or
//! a request over the relay's limits fails that one delegation with a typed
//! reason, and the links of both connectors stay up for everything else.
//!
//! ```text
//! facade -> connector A ==> relay process (Redis) <== connector B -> driver -> a2a-sdk agent
//!           connector C (a second caller) ==^
//! ```
//!
//! The relay is the `oab-relay` binary on a real `redis-server`, the agent
//! the official Python SDK (`sample_agent.py`, its `big-` mode streams an
//! artifact of any size in chunks). Needs `.venv` (`scripts/python-env`)
//! and `cargo build -p oab-relay` when run alone.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod a2a_support;
mod common;

use std::time::Duration;

use a2a_support::*;
use common::*;
use futures_util::StreamExt as _;
use oab_connector::Connector;
use oab_connector::link::EventError;
use oab_testkit::redis::{Persistence, RedisServer};
use oab_wire::Outcome;
use serde_json::json;

/// Ordinary delegations the second caller runs meanwhile.
const ORDINARY: usize = 100;

/// A relay process on Redis, the SDK agent behind connector B's driver,
/// connector A (with a facade) and a second caller C.
struct Topology {
    _redis: RedisServer,
    _relay: RelayProcess,
    _agent: tokio::process::Child,
    a: Connector,
    b: Connector,
    c: Connector,
    facade: FacadeServer,
}

async fn topology(env: &Env) -> Topology {
    let redis = RedisServer::start(Persistence::None).unwrap();
    let relay = RelayProcess::start(env, &redis.url()).await;
    let (agent, port) = sample_agent().await;
    let (a, b, _card) =
        driver_topology_at(env, relay.addr, &format!("http://127.0.0.1:{port}")).await;
    let c = connector(env, env.caller2.as_ref().unwrap(), relay.addr, None);
    c.connected().await.unwrap();
    let facade = FacadeServer::start(a.caller().clone(), facade_options()).await;
    Topology {
        _redis: redis,
        _relay: relay,
        _agent: agent,
        a,
        b,
        c,
        facade,
    }
}

/// Runs [`ORDINARY`] delegations from `c` to the callee, eight at a time;
/// returns their outcomes.
fn ordinary_traffic(c: &Connector) -> tokio::task::JoinHandle<Vec<Outcome>> {
    let caller = c.caller().clone();
    tokio::spawn(async move {
        futures_util::stream::iter(0..ORDINARY)
            .map(|i| {
                let caller = caller.clone();
                async move {
                    let h = caller
                        .delegate(&peer(CALLEE), spec(&format!("ordinary {i}")))
                        .await
                        .unwrap();
                    caller
                        .wait(&h, Duration::from_secs(60))
                        .await
                        .unwrap()
                        .outcome
                }
            })
            .buffer_unordered(8)
            .collect()
            .await
    })
}

/// Polls `GetTask` until the task is in a terminal state (bounded).
async fn ended(rpc: &Rpc, id: &str) -> serde_json::Value {
    let until = tokio::time::Instant::now() + Duration::from_secs(120);
    loop {
        let r = rpc.call("GetTask", json!({ "id": id }), V1).await;
        let state = r["result"]["status"]["state"].as_str().unwrap_or("");
        if matches!(
            state,
            "TASK_STATE_COMPLETED"
                | "TASK_STATE_FAILED"
                | "TASK_STATE_CANCELED"
                | "TASK_STATE_REJECTED"
        ) {
            return r["result"].clone();
        }
        assert!(tokio::time::Instant::now() < until, "never ended: {r}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The link of `c` came up once and never went down.
fn never_dropped(name: &str, c: &Connector) {
    let stats = c.link().stats();
    assert_eq!(
        (stats.sessions(), stats.reconnects()),
        (1, 0),
        "connector {name}'s link went down (sessions, reconnects)"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_output_over_the_budget_fails_its_delegation_and_no_link_drops() {
    let env = Env::with_second_caller("");
    let t = topology(&env).await;
    let ordinary = ordinary_traffic(&t.c);
    let rpc = Rpc::new(t.facade.url(CALLEE));
    // 2 MB in one event (one message over the relay's frame limit), then
    // 20 MB and 200 MB in chunks of 1 MiB: the callee's budget (the
    // policy's 1,000,000 bytes) runs out on the way.
    for (i, (total, chunk)) in [
        (2_000_000u64, 2_000_000u64),
        (20_000_000, 1 << 20),
        (200_000_000, 1 << 20),
    ]
    .into_iter()
    .enumerate()
    {
        let id = format!("big-{total}-{chunk}-{i}");
        let sent = rpc
            .call(
                "SendMessage",
                json!({
                    "message": message(&id, "big"),
                    "configuration": { "returnImmediately": true },
                }),
                V1,
            )
            .await;
        let task_id = sent["result"]["task"]["id"]
            .as_str()
            .unwrap_or_else(|| panic!("{total} bytes: a task: {sent}"))
            .to_string();
        let task = ended(&rpc, &task_id).await;
        assert_eq!(
            task["status"]["state"], "TASK_STATE_FAILED",
            "{total} bytes: {task}"
        );
        let said = task["status"]["message"].to_string();
        assert!(
            said.contains("over the budget"),
            "{total} bytes: the reason names the budget: {said}"
        );
    }
    let outcomes = tokio::time::timeout(Duration::from_secs(120), ordinary)
        .await
        .expect("the ordinary delegations finish")
        .unwrap();
    assert_eq!(outcomes, vec![Outcome::Completed; ORDINARY]);
    never_dropped("A", &t.a);
    never_dropped("B", &t.b);
    never_dropped("C", &t.c);
    t.facade.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_over_the_relays_limit_is_refused_and_no_link_drops() {
    let env = Env::with_second_caller("");
    let t = topology(&env).await;
    let ordinary = ordinary_traffic(&t.c);
    let rpc = Rpc::new(t.facade.url(CALLEE));
    // 400 KB makes a request over 1 MiB once signed and enveloped (the bug
    // report's case).
    for size in [400_000usize, 2_000_000, 20_000_000] {
        let text = "x".repeat(size);
        let reply = rpc
            .call(
                "SendMessage",
                json!({ "message": message(&format!("m-{size}"), &text) }),
                V1,
            )
            .await;
        assert_eq!(reply["error"]["code"], -32602, "{size} bytes: {reply:.300}");
        assert_eq!(
            reply["error"]["data"][0]["reason"], "PAYLOAD_TOO_LARGE",
            "{size} bytes"
        );
    }
    // 40 MB is over what the facade reads at all: it answers once it has
    // read its limit, and closes. HTTP lets a server answer and close before
    // the body ends, so a client still writing may see its write fail
    // instead of the answer; it never sees anything else.
    let body = json!({ "jsonrpc": "2.0", "id": 1, "method": "SendMessage",
        "params": { "message": message("m-40000000", &"x".repeat(40_000_000)) } });
    let mut post = reqwest::Client::new()
        .post(t.facade.url(CALLEE))
        .header("content-type", "application/json")
        .body(body.to_string());
    for (k, v) in V1 {
        post = post.header(*k, *v);
    }
    match tokio::time::timeout(Duration::from_secs(60), post.send())
        .await
        .expect("an answer or a closed connection in time")
    {
        Ok(resp) => {
            let reply: serde_json::Value = resp.json().await.unwrap();
            assert_eq!(reply["error"]["code"], -32602, "40 MB: {reply:.300}");
            assert_eq!(reply["error"]["data"][0]["reason"], "PAYLOAD_TOO_LARGE");
        }
        Err(e) => {
            let chain = format!("{e:?}");
            assert!(
                e.is_request()
                    && (chain.contains("BrokenPipe") || chain.contains("ConnectionReset")),
                "40 MB: {chain}"
            );
        }
    }
    // The same connector still delegates.
    let reply = rpc
        .call(
            "SendMessage",
            json!({ "message": message("m-small", "small") }),
            V1,
        )
        .await;
    assert_eq!(
        reply["result"]["task"]["status"]["state"], "TASK_STATE_COMPLETED",
        "{reply}"
    );
    let outcomes = tokio::time::timeout(Duration::from_secs(120), ordinary)
        .await
        .expect("the ordinary delegations finish")
        .unwrap();
    assert_eq!(outcomes, vec![Outcome::Completed; ORDINARY]);
    never_dropped("A", &t.a);
    never_dropped("B", &t.b);
    never_dropped("C", &t.c);
    t.facade.stop().await;
}

/// A caller's state folder holds a delegation whose request is over the
/// relay's limit (saved before this relay's limit was known, as a
/// connector does when it starts offline, or by an earlier version that
/// did not check): after a restart the connector comes up in session on
/// the first attempt, the delegation ends with the refusal that says why,
/// and it is never sent, so nothing loops.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restored_request_over_the_limit_ends_with_its_reason() {
    let env = Env::new("");
    let redis = RedisServer::start(Persistence::None).unwrap();
    let relay = RelayProcess::start(&env, &redis.url()).await;
    let dir = tempfile::tempdir().unwrap();
    let state = || Some(oab_connector::state::FileState::open(dir.path()).unwrap());
    // First run: no relay reachable, so no limit known but the protocol's.
    let nowhere = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let first = connector_state(
        &env,
        settings(&env.caller, nowhere, &env.cert_der),
        None,
        policy(),
        None,
        state(),
    );
    let h = first
        .caller()
        .delegate(&peer(CALLEE), spec(&"y".repeat(2_000_000)))
        .await
        .expect("taken while the relay's limit is unknown");
    first.shutdown().await;
    // Second run, against the relay.
    let second = connector_state(
        &env,
        settings(&env.caller, relay.addr, &env.cert_der),
        None,
        policy(),
        None,
        state(),
    );
    let restored = second.caller().restore().await.unwrap();
    assert_eq!(restored, vec![h.clone()]);
    let mut events = second.caller().events(&h, 0).await.unwrap();
    let first_item = tokio::time::timeout(STEP, events.next())
        .await
        .expect("the delegation ends in time")
        .expect("an item");
    match first_item {
        Err(EventError::Refused { code, message }) => {
            assert_eq!(code, "payload_too_large");
            assert!(message.contains("over the relay's limit"), "{message}");
        }
        other => panic!("expected the refusal, got {other:?}"),
    }
    drop(events);
    // In session, on the first attempt, and it stays there.
    second.connected().await.unwrap();
    let b = connector(
        &env,
        &env.callee,
        relay.addr,
        Some(Paced::new(1, Duration::ZERO)),
    );
    let ok = second
        .caller()
        .delegate(&peer(CALLEE), spec("after"))
        .await
        .unwrap();
    let done = second.caller().wait(&ok, STEP).await.unwrap();
    assert_eq!(done.outcome, Outcome::Completed);
    never_dropped("A (restarted)", &second);
    // Ended: it is not restored again.
    second.shutdown().await;
    let third = connector_state(
        &env,
        settings(&env.caller, relay.addr, &env.cert_der),
        None,
        policy(),
        None,
        state(),
    );
    let again = third.caller().restore().await.unwrap();
    assert!(
        !again.contains(&h),
        "the refused delegation is not restored"
    );
    third.shutdown().await;
    b.shutdown().await;
}
