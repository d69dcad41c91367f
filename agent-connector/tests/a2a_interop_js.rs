//! Interop with the official JavaScript A2A SDK (`@a2a-js/sdk`) at both
//! ends:
//!
//! ```text
//! @a2a-js/sdk client -> connector A facade -> relay (TLS) -> connector B driver -> @a2a-js/sdk server
//! (js/client.mjs)       (in-process)          (in-process)    (in-process)         (js/sample_agent.mjs)
//! ```
//!
//! The same scenarios as `a2a_interop.rs` (the Python SDK). Needs Node.js
//! and the SDK installed by `scripts/node-env`; skips with a message when
//! there is no `node`.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod a2a_support;
mod common;

use std::sync::Arc;
use std::time::Duration;

use a2a_support::*;
use common::*;
use oab_connector::a2a::{A2aDriver, AgentBinding, DriverOptions, PROFILE_URI};
use oab_relay::store::{MemoryStore, Retention};
use serde_json::Value;

fn states(events: &Value) -> Vec<String> {
    events
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|e| e["state"].as_str().map(str::to_string))
        .collect()
}

fn texts(events: &Value) -> Vec<String> {
    events
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|e| e["text"].as_str().map(str::to_string))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn official_js_sdk_client_and_server_through_the_relay() {
    js_scenarios("jsonrpc", AgentBinding::JsonRpc).await;
}

/// The same scenarios with the SDK client preferring the facade's HTTP+JSON
/// interface (its REST transport).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn official_js_sdk_rest_client_through_the_relay() {
    js_scenarios("http_json", AgentBinding::JsonRpc).await;
}

/// HTTP+JSON end to end: the SDK client on the facade's REST interface and
/// the SDK server serving only HTTP+JSON (its `restHandler`), which the
/// driver speaks REST to.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn official_js_sdk_client_and_rest_only_server_through_the_relay() {
    js_scenarios("http_json", AgentBinding::HttpJson).await;
}

async fn js_scenarios(transport: &str, binding: AgentBinding) {
    let Some(node) = node() else { return };
    let flag = match binding {
        AgentBinding::JsonRpc => "jsonrpc",
        AgentBinding::HttpJson => "rest",
    };
    let (mut agent, port) = js_sample_agent_with(&node, flag).await;
    let agent_url = format!("http://127.0.0.1:{port}");
    let driver = A2aDriver::new(DriverOptions::new(agent_url.as_str())).unwrap();
    assert_eq!(driver.binding().await.unwrap(), binding);

    let env = Env::new("");
    let relay = Relay::start(&env, Arc::new(MemoryStore::new(Retention::default()))).await;
    let (a, b, card) = driver_topology(&env, &relay, &agent_url).await;
    assert_eq!(card["name"], "OAB interop sample agent (JS)");
    let facade = FacadeServer::start(a.caller().clone(), facade_options()).await;
    let facade_url = facade.url(CALLEE);
    assert!(
        facade_url.ends_with('/'),
        "the SDK needs the trailing slash"
    );

    let out = tokio::time::timeout(
        Duration::from_secs(120),
        tokio::process::Command::new(&node)
            .arg(js_dir().join("client.mjs"))
            .arg("--facade-url")
            .arg(&facade_url)
            .arg("--agent-url")
            .arg(&agent_url)
            .arg("--transport")
            .arg(transport)
            .current_dir(js_dir())
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("the SDK client finishes in time")
    .unwrap();
    assert!(
        out.status.success(),
        "client.mjs failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let r: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "client.mjs printed no JSON ({e}):\n{}",
            String::from_utf8_lossy(&out.stdout)
        )
    });
    println!("{}", serde_json::to_string_pretty(&r).unwrap());

    // The card the SDK resolved through the facade.
    assert_eq!(r["card"]["name"], "OAB interop sample agent (JS)");
    assert_eq!(r["card"]["interface"]["url"], facade_url.as_str());
    assert_eq!(r["card"]["interface"]["protocolBinding"], "JSONRPC");
    assert_eq!(r["card"]["extensions"][0], PROFILE_URI);
    assert_eq!(r["card"]["interfaces"][1]["protocolBinding"], "HTTP+JSON");
    // The binding the SDK spoke.
    let routes: Vec<&str> = r["routes"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .filter(|r| !r.ends_with("/.well-known/agent-card.json"))
        .collect();
    if transport == "http_json" {
        for want in [
            "POST /message:send",
            "POST /message:stream",
            "GET /tasks/{id}",
            "GET /tasks",
            "POST /tasks/{id}:cancel",
        ] {
            assert!(routes.contains(&want), "{want} not in {routes:?}");
        }
        assert!(
            routes.iter().any(|r| r.ends_with("/tasks/{id}:subscribe")),
            "{routes:?}"
        );
        assert!(!routes.contains(&"POST /"), "{routes:?}");
    } else {
        assert_eq!(routes, ["POST /"], "{routes:?}");
    }

    // Streamed: task first, progress in order, the chunked artifact, completed.
    let streamed = &r["streamed"];
    assert_eq!(streamed[0]["kind"], "task", "{streamed}");
    let t = texts(streamed);
    let progress: Vec<&String> = t.iter().filter(|x| x.starts_with("progress")).collect();
    assert_eq!(
        progress,
        ["progress 1", "progress 2", "progress 3"],
        "{streamed}"
    );
    let chunks: Vec<&Value> = streamed
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["kind"] == "artifactUpdate")
        .collect();
    assert_eq!(chunks.len(), 2, "{streamed}");
    assert_eq!(chunks[0]["parts"][0], "chunk-1 ");
    assert_eq!(chunks[1]["parts"][0], "chunk-2");
    assert_eq!(chunks[1]["append"], true);
    assert_eq!(chunks[1]["lastChunk"], true);
    assert_eq!(states(streamed).last().unwrap(), "TASK_STATE_COMPLETED");
    assert_eq!(t.last().unwrap(), "streamed");
    // Event for event what a stream straight from the agent carries (no
    // extra submitted status after the first task).
    let shape = |evs: &Value| -> Vec<(String, String, String)> {
        evs.as_array()
            .unwrap()
            .iter()
            .map(|e| {
                let f = |k: &str| e[k].as_str().unwrap_or_default().to_string();
                (f("kind"), f("state"), f("text"))
            })
            .collect()
    };
    assert_eq!(
        shape(streamed),
        shape(&r["direct_streamed"]),
        "through the relay vs direct"
    );

    // Blocking send and GetTask.
    let blocking = &r["blocking"];
    assert_eq!(
        blocking["sent"]["state"], "TASK_STATE_COMPLETED",
        "{blocking}"
    );
    assert_eq!(blocking["get"]["artifacts"][0][0], "echo: hello");
    assert_eq!(blocking["get"]["history"], 1);

    // A direct message answer stays a message.
    assert_eq!(r["message"][0]["kind"], "message", "{}", r["message"]);
    assert_eq!(r["message"][0]["text"], "direct answer to hi");
    assert_eq!(r["message"].as_array().unwrap().len(), 1);

    // Cancel reaches the SDK server's executor.
    let cancel = &r["cancel"];
    assert_eq!(cancel["task"]["state"], "TASK_STATE_CANCELED", "{cancel}");
    assert_ne!(cancel["again"], "no error", "{cancel}");

    // Input required, then the follow-up completes the same task: the
    // agent's leading snapshot of the follow-up (still input-required) is
    // not a new state, so neither the stream nor the blocking call ends
    // on it.
    let ir = &r["input_required"];
    assert_eq!(ir["first"]["state"], "TASK_STATE_INPUT_REQUIRED", "{ir}");
    assert_eq!(
        states(&ir["follow"]).last().unwrap(),
        "TASK_STATE_COMPLETED",
        "{ir}"
    );
    // The facade's own snapshot first (the task as the caller left it),
    // then only the agent's new states.
    assert_eq!(ir["follow"][0]["kind"], "task", "{ir}");
    assert_eq!(
        states(&ir["follow"])[1..],
        ["TASK_STATE_WORKING", "TASK_STATE_COMPLETED"],
        "no input-required status in the follow-up: {ir}"
    );
    assert_eq!(ir["final"]["state"], "TASK_STATE_COMPLETED", "{ir}");
    assert!(
        ir["final"]["artifacts"]
            .as_array()
            .unwrap()
            .iter()
            .any(|a| a[0] == "branch main"),
        "{ir}"
    );
    assert_eq!(
        ir["blocking_first"]["state"], "TASK_STATE_INPUT_REQUIRED",
        "{ir}"
    );
    assert_eq!(
        ir["blocking_follow"]["state"], "TASK_STATE_COMPLETED",
        "the blocking follow-up waits for the end of the turn: {ir}"
    );

    // A failing task.
    assert_eq!(states(&r["failed"]).last().unwrap(), "TASK_STATE_FAILED");
    assert_eq!(texts(&r["failed"]).last().unwrap(), "it broke");

    // With the profile: the cursor resumes exactly after the last event seen.
    let rp = &r["resubscribe_profile"];
    let cursor = rp["cursor"].as_u64().unwrap();
    let before: Vec<u64> = rp["before"].as_array().unwrap()[1..]
        .iter()
        .map(|e| e["seq"].as_u64().unwrap())
        .collect();
    let after = rp["after"].as_array().unwrap();
    assert_eq!(after[0]["kind"], "task", "{rp}");
    let resumed: Vec<u64> = after[1..]
        .iter()
        .map(|e| e["seq"].as_u64().unwrap())
        .collect();
    let all: Vec<u64> = before.iter().chain(&resumed).copied().collect();
    assert_eq!(
        all,
        (1..=all.len() as u64).collect::<Vec<_>>(),
        "nothing missed, nothing twice: {rp}"
    );
    assert_eq!(*before.last().unwrap(), cursor);
    assert_eq!(states(&rp["after"]).last().unwrap(), "TASK_STATE_COMPLETED");
    let after_texts = texts(&rp["after"]);
    assert!(
        after_texts.contains(&"step 3".to_string()) && after_texts.contains(&"step 4".to_string()),
        "{rp}"
    );

    // Without it: the snapshot, then live; a finished task cannot be subscribed to.
    let plain = &r["resubscribe_plain"];
    assert_eq!(plain["snapshot"]["kind"], "task", "{plain}");
    assert_eq!(plain["snapshot"]["state"], "TASK_STATE_WORKING");
    assert!(plain["snapshot"].get("seq").is_none());
    assert_eq!(texts(&plain["live"])[..2], ["step 3", "step 4"], "{plain}");
    assert_eq!(
        states(&plain["live"]).last().unwrap(),
        "TASK_STATE_COMPLETED"
    );
    assert_ne!(plain["terminal"], "no error", "{plain}");

    // ListTasks pages.
    let list = &r["list"];
    let total = list["total"].as_u64().unwrap();
    assert!(total >= 9, "{list}");
    assert_eq!(list["page1"].as_array().unwrap().len(), 2);
    assert_ne!(list["next"], "");
    assert_eq!(list["page2"].as_array().unwrap().len() as u64, total - 2);
    assert_eq!(list["next2"], "");
    assert_eq!(list["artifacts_in_list"], false);

    facade.stop().await;
    a.shutdown().await;
    b.shutdown().await;
    relay.stop().await;
    agent.kill().await.unwrap();
}
