//! Interop with the official Python A2A SDK at both ends:
//!
//! ```text
//! a2a-sdk client -> connector A facade -> relay (TLS) -> connector B driver -> a2a-sdk server
//! (client.py)       (in-process)          (in-process)    (in-process)         (sample_agent.py)
//! ```
//!
//! The SDK server serves JSON-RPC, or only HTTP+JSON (REST): the `_rest`
//! tests run the same scenarios with the driver speaking REST to it.
//!
//! Needs the virtualenv made by `scripts/python-env` (`.venv` at the
//! repository root).
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
use serde_json::{Value, json};

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
async fn official_sdk_client_and_server_through_the_relay() {
    sdk_scenarios("jsonrpc", AgentBinding::JsonRpc).await;
}

/// The same scenarios with the SDK client restricted to the facade's
/// HTTP+JSON interface (its REST transport); the driver still speaks
/// JSON-RPC to the SDK server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn official_sdk_rest_client_through_the_relay() {
    sdk_scenarios("http_json", AgentBinding::JsonRpc).await;
}

/// The same scenarios over HTTP+JSON end to end: the SDK client on the
/// facade's REST interface, and the SDK server serving only HTTP+JSON, which
/// the driver picks from the card and speaks REST to.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn official_sdk_client_and_rest_only_server_through_the_relay() {
    sdk_scenarios("http_json", AgentBinding::HttpJson).await;
}

/// The sample agent's `--binding` for a binding served alone.
fn agent_flag(binding: AgentBinding) -> &'static str {
    match binding {
        AgentBinding::JsonRpc => "jsonrpc",
        AgentBinding::HttpJson => "rest",
    }
}

/// A driver for the server at `url`; asserts the binding it chose.
async fn expect_binding(url: &str, want: AgentBinding) {
    let driver = A2aDriver::new(DriverOptions::new(url)).unwrap();
    assert_eq!(driver.binding().await.unwrap(), want);
}

/// Runs `client.py --transport <transport>` through facade, relay and
/// driver against the SDK sample server serving only `binding`, and checks
/// what it saw.
async fn sdk_scenarios(transport: &str, binding: AgentBinding) {
    let python = python();
    let (mut agent, port) = sample_agent_with(0, agent_flag(binding), None).await;
    let agent_url = format!("http://127.0.0.1:{port}");
    expect_binding(&agent_url, binding).await;

    let env = Env::new("");
    let relay = Relay::start(&env, Arc::new(MemoryStore::new(Retention::default()))).await;
    let (a, b, card) = driver_topology(&env, &relay, &agent_url).await;
    assert_eq!(
        card["supportedInterfaces"][0]["protocolBinding"],
        binding.as_str()
    );
    assert_eq!(card["name"], "OAB interop sample agent");
    let facade = FacadeServer::start(a.caller().clone(), facade_options()).await;
    let facade_url = facade.url(CALLEE);

    let client = repo().join("agent-connector/tests/interop/client.py");
    let out = tokio::time::timeout(
        Duration::from_secs(120),
        tokio::process::Command::new(&python)
            .arg(client)
            .arg("--facade-url")
            .arg(&facade_url)
            .arg("--agent-url")
            .arg(&agent_url)
            .arg("--transport")
            .arg(transport)
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("the SDK client finishes in time")
    .unwrap();
    assert!(
        out.status.success(),
        "client.py failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let r: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "client.py printed no JSON ({e}):\n{}",
            String::from_utf8_lossy(&out.stdout)
        )
    });
    println!("{}", serde_json::to_string_pretty(&r).unwrap());

    // The card the SDK resolved through the facade.
    assert_eq!(r["card"]["name"], "OAB interop sample agent");
    assert_eq!(r["card"]["interface"]["url"], facade_url.as_str());
    assert_eq!(r["card"]["interface"]["protocolBinding"], "JSONRPC");
    assert_eq!(r["card"]["interface"]["protocolVersion"], "1.0");
    assert_eq!(r["card"]["extensions"][0], PROFILE_URI);
    let rest = &r["card"]["interfaces"][1];
    assert_eq!(rest["protocolBinding"], "HTTP+JSON", "{}", r["card"]);
    assert_eq!(rest["url"], facade_url.as_str());
    assert_eq!(rest["protocolVersion"], "1.0");

    // The binding the SDK spoke: every call at its REST route, or every
    // call a POST to the JSON-RPC endpoint.
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
            "POST /tasks/{id}:subscribe",
        ] {
            assert!(routes.contains(&want), "{want} not in {routes:?}");
        }
        assert!(!routes.contains(&"POST /"), "{routes:?}");
    } else {
        assert_eq!(routes, ["POST /"], "{routes:?}");
    }

    // Streamed: task first, progress in order, the chunked artifact, completed.
    let streamed = &r["streamed"];
    assert_eq!(streamed[0]["kind"], "task", "{streamed}");
    // Then the agent's first status, as a direct stream has it: no extra
    // submitted status for the agent's own first task.
    assert_eq!(streamed[1]["state"], "TASK_STATE_WORKING", "{streamed}");
    assert_eq!(streamed[1]["text"], "starting", "{streamed}");
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

    // Blocking send and GetTask.
    let blocking = &r["blocking"];
    assert_eq!(
        blocking["events"][0]["state"], "TASK_STATE_COMPLETED",
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
    assert_eq!(cancel["again"], "TaskNotCancelableError");

    // Input required, then the follow-up completes the same task.
    let ir = &r["input_required"];
    assert_eq!(ir["first"][0]["state"], "TASK_STATE_INPUT_REQUIRED", "{ir}");
    assert_eq!(
        states(&ir["follow"]).last().unwrap(),
        "TASK_STATE_COMPLETED",
        "{ir}"
    );
    assert_eq!(ir["final"]["state"], "TASK_STATE_COMPLETED");
    assert!(
        ir["final"]["artifacts"]
            .as_array()
            .unwrap()
            .iter()
            .any(|a| a[0] == "branch main"),
        "{ir}"
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
    assert_eq!(plain["terminal"], "UnsupportedOperationError");

    // ListTasks pages.
    let list = &r["list"];
    let total = list["total"].as_u64().unwrap();
    assert!(total >= 8, "{list}");
    assert_eq!(list["page1"].as_array().unwrap().len(), 2);
    assert_ne!(list["next"], "");
    assert_eq!(list["page2"].as_array().unwrap().len() as u64, total - 2);
    assert_eq!(list["next2"], "");
    assert_eq!(list["artifacts_in_list"], false);

    // Errors reach the SDK as its own error classes.
    let errors = &r["errors"];
    assert_eq!(errors["get_unknown"], "TaskNotFoundError", "{errors}");
    assert_eq!(errors["cancel_unknown"], "TaskNotFoundError", "{errors}");
    assert_eq!(
        errors["follow_up_finished"], "UnsupportedOperationError",
        "{errors}"
    );

    facade.stop().await;
    a.shutdown().await;
    b.shutdown().await;
    relay.stop().await;
    agent.kill().await.unwrap();
}

/// The texts of a status event's message.
fn status_text(message: Option<&Value>) -> Option<String> {
    let parts = message?.get("parts")?.as_array()?;
    let t: String = parts
        .iter()
        .filter_map(|p| p.get("text").and_then(Value::as_str))
        .collect();
    (!t.is_empty()).then_some(t)
}

/// The official-SDK agent streams progress (one a millisecond) while the
/// caller cancels: some progress is still in flight when the driver learns
/// of the cancel, and the agent's cancel handler emits more after the
/// driver's `CancelTask`. For every delegation, the progress the caller
/// received equals what the agent emitted before its terminal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn progress_around_a_cancel_reaches_the_caller_through_the_driver() {
    cancel_races(AgentBinding::JsonRpc, 210).await;
}

/// The same races with the driver speaking HTTP+JSON (`CancelTask` is
/// `POST tasks/{id}:cancel`), fewer of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn progress_around_a_cancel_reaches_the_caller_through_the_driver_rest() {
    cancel_races(AgentBinding::HttpJson, 70).await;
}

async fn cancel_races(binding: AgentBinding, races: usize) {
    use futures_util::StreamExt as _;
    use oab_connector::EventKind;
    use oab_wire::Outcome;

    let (_agent, port) = sample_agent_with(0, agent_flag(binding), None).await;
    let agent_url = format!("http://127.0.0.1:{port}");
    expect_binding(&agent_url, binding).await;
    let env = Env::new("");
    let relay = Relay::start(&env, Arc::new(MemoryStore::new(Retention::default()))).await;
    let (a, b, _card) = driver_topology(&env, &relay, &agent_url).await;
    let a = Arc::new(a);
    let http = reqwest::Client::new();
    let run = oab_wire::InstanceId::random().to_hex();
    let slots = Arc::new(tokio::sync::Semaphore::new(8));
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..races {
        let (a, http, agent_url) = (a.clone(), http.clone(), agent_url.clone());
        let slot = slots.clone().acquire_owned().await.unwrap();
        // The caller cancels once it saw `after` ticks (0: right after the
        // delegation was opened, before the agent has a task); the agent
        // goes on ticking meanwhile, so the cancel lands mid-stream.
        let after = i % 7;
        let mid = format!("race-{run}-{i}");
        tasks.spawn(async move {
            let _slot = slot;
            let mut spec = spec("race");
            spec.task.a2a_message = Some(serde_json::json!({
                "messageId": mid, "role": "ROLE_USER", "parts": [{ "text": "race" }],
            }));
            let h = a.caller().delegate(&peer(CALLEE), spec).await.unwrap();
            let mut events = a.caller().events(&h, 0).await.unwrap();
            if after == 0 {
                a.caller().cancel(&h, "race").await.unwrap();
            }
            let mut got = Vec::new();
            let outcome = loop {
                let ev = tokio::time::timeout(STEP, events.next())
                    .await
                    .expect("the terminal arrives in time")
                    .expect("the stream lasts until the terminal")
                    .unwrap();
                match ev.kind {
                    EventKind::Status { message, .. } => {
                        if let Some(t) = status_text(message.as_ref()) {
                            got.push(t);
                            if got.len() == after {
                                a.caller().cancel(&h, "race").await.unwrap();
                            }
                        }
                    }
                    EventKind::Terminal(t) => break t.outcome,
                    _ => {}
                }
            };
            let emitted: Value = http
                .get(format!("{agent_url}/test/emitted/{mid}"))
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            (mid, got, outcome, emitted)
        });
    }
    let (mut ran, mut cancel_seen) = (0, 0);
    while let Some(r) = tasks.join_next().await {
        let (mid, got, outcome, emitted) = r.unwrap();
        // A delegation cancelled before the callee started it never
        // reached the agent (the agent answers 404 for it).
        let sent: Vec<String> =
            serde_json::from_value(emitted["emitted"].clone()).unwrap_or_default();
        assert_eq!(
            got, sent,
            "{mid} ({outcome:?}, agent ended {}): received vs emitted",
            emitted["terminal"]
        );
        assert_eq!(outcome, Outcome::Cancelled, "{mid}");
        if emitted.get("terminal").is_some() {
            ran += 1;
            assert_eq!(emitted["terminal"], "canceled", "{mid}");
            cancel_seen += usize::from(got.last().is_some_and(|t| t == "cancel seen"));
        }
    }
    println!("{ran} of {races} delegations reached the agent before the cancel");
    assert!(
        ran >= races * 6 / 7,
        "the cancel raced a running agent: {ran}"
    );
    assert_eq!(
        cancel_seen, ran,
        "the cancel handler's progress arrived every time"
    );
    if let Ok(a) = Arc::try_unwrap(a) {
        a.shutdown().await;
    }
    b.shutdown().await;
    relay.stop().await;
}

/// Connector B started before its local A2A server: the card is published
/// once the server answers (retried with backoff), and the caller sees it;
/// before, one failed read left the caller's facade with a stand-in card
/// until connector B restarted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_card_is_published_once_an_agent_that_starts_later_answers() {
    use common::{CALLEE, connector};
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let env = Env::new("");
    let relay = Relay::start(&env, Arc::new(MemoryStore::new(Retention::default()))).await;
    let driver = oab_connector::a2a::A2aDriver::new(oab_connector::a2a::DriverOptions::new(
        format!("http://127.0.0.1:{port}"),
    ))
    .unwrap();
    assert!(
        driver.agent_card().await.is_err(),
        "no agent answers on the port yet"
    );
    let b = connector(
        &env,
        &env.callee,
        relay.addr,
        Some(Arc::new(driver.clone())),
    );
    let a = connector(&env, &env.caller, relay.addr, None);
    a.connected().await.unwrap();
    b.connected().await.unwrap();
    let seen = async {
        // The first attempt has failed by now; the agent comes up later.
        let (agent, _) = sample_agent_at(port).await;
        let until = tokio::time::Instant::now() + STEP;
        loop {
            let peers = a.caller().list_peers().await.unwrap();
            if let Some(d) = peers
                .iter()
                .find(|p| p.peer.as_str() == CALLEE)
                .and_then(|p| p.descriptor.clone())
            {
                return (agent, d);
            }
            assert!(
                tokio::time::Instant::now() < until,
                "the card never reached the caller: {peers:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    let ((mut agent, descriptor), ()) =
        tokio::join!(seen, oab_connector::a2a::publish_card(&b, &driver));
    assert_eq!(descriptor["name"], "OAB interop sample agent");
    agent.kill().await.unwrap();
    a.shutdown().await;
    b.shutdown().await;
}

/// A delegation of the sample agent's `gated-` mode (step 1, step 2, wait
/// for the gate, step 3, step 4, artifact, completed) through a proxy
/// that cuts the driver's connections to the agent after step 2: the
/// driver resumes with `SubscribeToTask` (JSON-RPC, or
/// `POST tasks/{id}:subscribe` over HTTP+JSON) and the delegation
/// completes with everything after the break, each step once. A2A has no
/// replay: the subscription starts with the task's snapshot, whose status
/// (step 2) the caller has already seen, so it does not go up again. The
/// gate opens only once the agent answered the subscription through the
/// proxy, so the rest of the task runs on the resumed stream.
async fn dropped_agent_stream_resumes(binding: AgentBinding) {
    use futures_util::StreamExt as _;
    use oab_connector::EventKind;
    use oab_wire::Outcome;

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let proxy_url = format!("http://127.0.0.1:{}", listener.local_addr().unwrap().port());
    let (mut agent, port) = sample_agent_with(0, agent_flag(binding), Some(&proxy_url)).await;
    let proxy = CutProxy::start(listener, port);
    let env = Env::new("");
    let relay = Relay::start(&env, Arc::new(MemoryStore::new(Retention::default()))).await;
    let (a, b, card) = driver_topology(&env, &relay, &proxy_url).await;
    assert!(
        card["supportedInterfaces"][0]["url"]
            .as_str()
            .unwrap()
            .starts_with(&proxy_url),
        "{card}"
    );
    let mid = format!("gated-{}", oab_wire::InstanceId::random().to_hex());
    let mut spec = spec("gated");
    spec.task.a2a_message = Some(serde_json::json!({
        "messageId": mid, "role": "ROLE_USER", "parts": [{ "text": "gated" }],
    }));
    let h = a.caller().delegate(&peer(CALLEE), spec).await.unwrap();
    let mut events = a.caller().events(&h, 0).await.unwrap();
    let http = reqwest::Client::new();
    let subscribe = |c: &String| match binding {
        AgentBinding::JsonRpc => c.contains("\"SubscribeToTask\""),
        AgentBinding::HttpJson => c.starts_with("POST ") && c.contains(":subscribe HTTP/1.1"),
    };
    let (mut got, mut artifacts) = (Vec::new(), Vec::new());
    let outcome = loop {
        let ev = tokio::time::timeout(STEP, events.next())
            .await
            .expect("the terminal arrives in time")
            .expect("the stream lasts until the terminal")
            .unwrap();
        match ev.kind {
            EventKind::Status { message, .. } => {
                let Some(t) = status_text(message.as_ref()) else {
                    continue;
                };
                got.push(t);
                if got == ["step 1", "step 2"] {
                    let before = proxy.received().len();
                    proxy.cut();
                    // The driver resubscribed and the agent's answer, the
                    // task's snapshot, came back through the proxy: the
                    // driver listens again.
                    proxy
                        .until(
                            "the resubscribe and its snapshot",
                            STEP,
                            |sent, received| {
                                sent.iter().any(subscribe)
                                    && received
                                        .get(before..)
                                        .unwrap_or_default()
                                        .iter()
                                        .any(|c| c.contains("\"task\""))
                            },
                        )
                        .await;
                    // Straight to the agent, not through the proxy.
                    let r = http
                        .post(format!("http://127.0.0.1:{port}/test/gates/{mid}"))
                        .send()
                        .await
                        .unwrap();
                    assert!(r.status().is_success());
                }
            }
            EventKind::Artifact { artifact, .. } => artifacts.push(artifact),
            EventKind::Terminal(t) => break t.outcome,
            _ => {}
        }
    };
    assert_eq!(outcome, Outcome::Completed, "{got:?}");
    assert_eq!(
        got,
        ["step 1", "step 2", "step 3", "step 4"],
        "each step once: the snapshot's status (step 2) is not sent up again"
    );
    assert_eq!(artifacts.len(), 1, "{artifacts:?}");
    assert_eq!(artifacts[0].text.as_deref(), Some("gated result"));
    a.shutdown().await;
    b.shutdown().await;
    relay.stop().await;
    agent.kill().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_agent_stream_is_resumed_with_subscribe() {
    dropped_agent_stream_resumes(AgentBinding::JsonRpc).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_agent_stream_is_resumed_with_subscribe_rest() {
    dropped_agent_stream_resumes(AgentBinding::HttpJson).await;
}

/// A card listing both bindings, HTTP+JSON first: the driver follows the
/// card's order unless its options force a binding; forcing one the card
/// lacks is a typed error at the first read of the card, and every
/// delegation fails with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cards_order_picks_the_binding_unless_the_options_force_one() {
    use oab_connector::a2a::DriverError;
    use oab_wire::Outcome;

    let (mut both, port) = sample_agent_with(0, "both", None).await;
    let both_url = format!("http://127.0.0.1:{port}");
    expect_binding(&both_url, AgentBinding::HttpJson).await;
    let mut forced = DriverOptions::new(both_url.as_str());
    forced.binding = Some(AgentBinding::JsonRpc);
    let forced = A2aDriver::new(forced).unwrap();
    assert_eq!(forced.binding().await.unwrap(), AgentBinding::JsonRpc);

    let (mut rest, port) = sample_agent_with(0, "rest", None).await;
    let mut options = DriverOptions::new(format!("http://127.0.0.1:{port}"));
    options.binding = Some(AgentBinding::JsonRpc);
    let driver = A2aDriver::new(options).unwrap();
    let e = driver.binding().await.unwrap_err();
    assert!(matches!(e, DriverError::NoInterface { .. }), "{e:?}");
    let text = e.to_string();
    assert!(
        text.contains("JSONRPC (forced by the driver's options)")
            && text.contains(&format!(
                "HTTP+JSON 1.0 at http://127.0.0.1:{port}/a2a/rest"
            )),
        "{text}"
    );

    let env = Env::new("");
    let relay = Relay::start(&env, Arc::new(MemoryStore::new(Retention::default()))).await;
    let b = connector(&env, &env.callee, relay.addr, Some(Arc::new(driver)));
    let a = connector(&env, &env.caller, relay.addr, None);
    a.connected().await.unwrap();
    b.connected().await.unwrap();
    let h = a
        .caller()
        .delegate(&peer(CALLEE), spec("hello"))
        .await
        .unwrap();
    let t = a.caller().wait(&h, STEP).await.unwrap();
    assert_eq!(t.outcome, Outcome::Failed);
    let error = a
        .caller()
        .verify(&h, &t)
        .unwrap()
        .result
        .error
        .unwrap_or_default();
    assert!(
        error.contains("offers no interface the driver can use"),
        "{error}"
    );
    a.shutdown().await;
    b.shutdown().await;
    relay.stop().await;
    both.kill().await.unwrap();
    rest.kill().await.unwrap();
}

/// A card without `streaming`: the driver sends each turn as a blocking
/// `SendMessage` (HTTP+JSON: `POST message:send`). A task completes with
/// its artifact; an input-required task waits for the caller's follow-up,
/// sent blocking with the task's id, which completes it.
async fn blocking_sends(binding: AgentBinding) {
    use futures_util::StreamExt as _;
    use oab_connector::EventKind;
    use oab_wire::Outcome;

    let flag = format!("{}-blocking", agent_flag(binding));
    let (mut agent, port) = sample_agent_with(0, &flag, None).await;
    let agent_url = format!("http://127.0.0.1:{port}");
    expect_binding(&agent_url, binding).await;
    let env = Env::new("");
    let relay = Relay::start(&env, Arc::new(MemoryStore::new(Retention::default()))).await;
    let (a, b, card) = driver_topology(&env, &relay, &agent_url).await;
    assert_eq!(card["capabilities"]["streaming"], false, "{card}");
    let run = oab_wire::InstanceId::random().to_hex();
    for (mid, answer, want) in [
        (format!("echo-{run}"), None, "echo: hello"),
        (format!("ask-{run}"), Some("main"), "branch main"),
    ] {
        let mut spec = spec("hello");
        spec.task.a2a_message = Some(serde_json::json!({
            "messageId": mid, "role": "ROLE_USER", "parts": [{ "text": "hello" }],
        }));
        let h = a.caller().delegate(&peer(CALLEE), spec).await.unwrap();
        let mut events = a.caller().events(&h, 0).await.unwrap();
        let (mut states, mut artifacts) = (Vec::new(), Vec::new());
        let outcome = loop {
            let ev = tokio::time::timeout(STEP, events.next())
                .await
                .expect("the terminal arrives in time")
                .expect("the stream lasts until the terminal")
                .unwrap();
            match ev.kind {
                EventKind::Status { state, .. } => {
                    if state == "TASK_STATE_INPUT_REQUIRED" {
                        let answer = answer.expect("only ask- asks");
                        a.caller()
                            .send_message(
                                &h,
                                serde_json::json!({
                                    "messageId": format!("answer-{run}"),
                                    "role": "ROLE_USER",
                                    "parts": [{ "text": answer }],
                                }),
                            )
                            .await
                            .unwrap();
                    }
                    states.push(state);
                }
                EventKind::Artifact { artifact, .. } => artifacts.push(artifact),
                EventKind::Terminal(t) => break t.outcome,
                _ => {}
            }
        };
        assert_eq!(outcome, Outcome::Completed, "{mid}: {states:?}");
        assert_eq!(
            answer.is_some(),
            states.iter().any(|s| s == "TASK_STATE_INPUT_REQUIRED"),
            "{mid}: {states:?}"
        );
        assert!(
            artifacts.iter().any(|x| x.text.as_deref() == Some(want)),
            "{mid}: {artifacts:?}"
        );
    }
    a.shutdown().await;
    b.shutdown().await;
    relay.stop().await;
    agent.kill().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_does_not_stream_gets_blocking_sends() {
    blocking_sends(AgentBinding::JsonRpc).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_does_not_stream_gets_blocking_sends_rest() {
    blocking_sends(AgentBinding::HttpJson).await;
}

/// The official SDK client's push notification calls through the facade:
/// a send with a config delivers the task's events to a webhook (with the
/// token and credentials), and the four config methods round-trip.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn official_sdk_client_push_notification_configs_through_the_facade() {
    let python = python();
    let (mut agent, port) = sample_agent().await;
    let agent_url = format!("http://127.0.0.1:{port}");
    let env = Env::new("");
    let relay = Relay::start(&env, Arc::new(MemoryStore::new(Retention::default()))).await;
    let (a, b, _card) = driver_topology(&env, &relay, &agent_url).await;
    let facade = FacadeServer::start(a.caller().clone(), facade_options()).await;
    let hook = Webhook::start(0).await;

    let out = tokio::time::timeout(
        Duration::from_secs(120),
        tokio::process::Command::new(&python)
            .arg(repo().join("agent-connector/tests/interop/push_client.py"))
            .arg("--facade-url")
            .arg(facade.url(CALLEE))
            .arg("--webhook-url")
            .arg(&hook.url)
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("the SDK client finishes in time")
    .unwrap();
    assert!(
        out.status.success(),
        "push_client.py failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let r: Value = serde_json::from_slice(&out.stdout).unwrap();
    let task_id = r["task_id"].as_str().expect("a task id").to_string();
    assert_eq!(
        r["created"],
        json!({ "id": "py-1", "taskId": task_id, "url": hook.url, "token": "second" }),
        "{r}"
    );
    assert_eq!(r["got"], r["created"]);
    assert_eq!(r["listed"].as_array().map(Vec::len), Some(2), "{r}");
    assert_eq!(r["delete_again"], "no error");
    assert_ne!(r["get_deleted"], "no error");
    assert_ne!(r["unknown_task"], "no error");
    assert_ne!(r["bad_url"], "no error");
    assert_eq!(r["listed_after"], 1);

    // The webhook got the task and every event, in order, with the auth.
    let got = hook.wait_terminal().await;
    let kinds: Vec<&str> = got.iter().map(body_kind).collect();
    assert_eq!(kinds.first(), Some(&"task"), "{got:?}");
    assert_eq!(
        got.last().unwrap()["statusUpdate"]["status"]["state"],
        "TASK_STATE_COMPLETED"
    );
    let texts: Vec<String> = got
        .iter()
        .filter_map(|b| b["statusUpdate"]["status"]["message"]["parts"][0]["text"].as_str())
        .map(str::to_string)
        .collect();
    assert_eq!(
        texts,
        [
            "starting",
            "progress 1",
            "progress 2",
            "progress 3",
            "streamed"
        ],
        "{got:?}"
    );
    assert_eq!(
        kinds.iter().filter(|k| **k == "artifactUpdate").count(),
        2,
        "{got:?}"
    );
    for b in &got {
        let id = ["task", "statusUpdate", "artifactUpdate"]
            .iter()
            .find_map(|k| b.get(*k))
            .and_then(|v| v.get("id").or_else(|| v.get("taskId")))
            .and_then(Value::as_str);
        assert_eq!(
            id,
            Some(task_id.as_str()),
            "every notification names the task: {b}"
        );
    }
    for n in hook.all() {
        let h = |k: &str| {
            n.headers
                .get(k)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)
        };
        assert_eq!(h("x-a2a-notification-token").as_deref(), Some("py-token"));
        assert_eq!(h("authorization").as_deref(), Some("Bearer py-cred"));
    }
    hook.stop();
    facade.stop().await;
    a.shutdown().await;
    b.shutdown().await;
    relay.stop().await;
    let _ = agent.kill().await;
}

/// An agent that asks twice: its answer to the first follow-up is input
/// required once more, with no message (the A2A conformance kit's agent does
/// this). The caller sees input required twice and its second follow-up
/// completes the task: a state re-entered after a follow-up is news, even
/// without a message. `flag` is the sample agent's binding (a `-blocking`
/// suffix: the card says no streaming, so each turn is a blocking send).
async fn asks_twice(flag: &str) {
    use futures_util::StreamExt as _;
    use oab_connector::EventKind;
    use oab_wire::Outcome;

    let (mut agent, port) = sample_agent_with(0, flag, None).await;
    let agent_url = format!("http://127.0.0.1:{port}");
    let env = Env::new("");
    let relay = Relay::start(&env, Arc::new(MemoryStore::new(Retention::default()))).await;
    let (a, b, _card) = driver_topology(&env, &relay, &agent_url).await;
    let run = oab_wire::InstanceId::random().to_hex();
    let mut spec = spec("hello");
    spec.task.a2a_message = Some(serde_json::json!({
        "messageId": format!("ask-{run}"), "role": "ROLE_USER", "parts": [{ "text": "hello" }],
    }));
    let h = a.caller().delegate(&peer(CALLEE), spec).await.unwrap();
    let mut events = a.caller().events(&h, 0).await.unwrap();
    let mut answers = ["again", "main"].into_iter();
    let (mut asked, mut artifacts) = (0, Vec::new());
    let outcome = loop {
        let ev = tokio::time::timeout(STEP, events.next())
            .await
            .expect("each turn's news arrives in time")
            .expect("the stream lasts until the terminal")
            .unwrap();
        match ev.kind {
            EventKind::Status { state, .. } if state == "TASK_STATE_INPUT_REQUIRED" => {
                asked += 1;
                let answer = answers.next().expect("asked at most twice");
                a.caller()
                    .send_message(
                        &h,
                        serde_json::json!({
                            "messageId": format!("answer-{asked}-{run}"),
                            "role": "ROLE_USER",
                            "parts": [{ "text": answer }],
                        }),
                    )
                    .await
                    .unwrap();
            }
            EventKind::Artifact { artifact, .. } => artifacts.push(artifact),
            EventKind::Terminal(t) => break t.outcome,
            _ => {}
        }
    };
    assert_eq!(outcome, Outcome::Completed);
    assert_eq!(asked, 2, "input required reached the caller twice");
    assert!(
        artifacts
            .iter()
            .any(|x| x.text.as_deref() == Some("branch main")),
        "{artifacts:?}"
    );
    a.shutdown().await;
    b.shutdown().await;
    relay.stop().await;
    agent.kill().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn input_required_twice_reaches_the_caller_twice() {
    asks_twice("jsonrpc").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn input_required_twice_reaches_the_caller_twice_blocking_rest() {
    asks_twice("rest-blocking").await;
}
