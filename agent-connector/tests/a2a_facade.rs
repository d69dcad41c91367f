//! The A2A facade over a real relay and a Rust callee (no Python): the
//! JSON-RPC error codes, blocking and streaming sends, and the profile's
//! cursor replay after a client dropped its stream (which never cancels).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod a2a_support;
mod common;

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use a2a_support::*;
use common::*;
use oab_connector::a2a::PROFILE_URI;
use oab_connector::callee::{Execution, StopReason, TaskExecutor, TaskRun};
use oab_connector::profile::{Artifact, Usage};
use oab_relay::store::{MemoryStore, Retention};
use serde_json::{Value, json};
use tokio::sync::Semaphore;

/// A callee that acts on the task text:
/// - `complete`: one artifact, then completed;
/// - `gated`: two progress events, then waits for a permit of `gate`, two
///   more, an artifact, completed;
/// - `hold`: one progress event, then waits for a cancel;
/// - `ask`: input-required, then completes with the answer's text.
struct Script {
    gate: Arc<Semaphore>,
    runs: AtomicUsize,
    cancels: AtomicUsize,
}

fn artifact(text: &str) -> Artifact {
    Artifact {
        artifact_id: "report".into(),
        name: "report".into(),
        media_type: "text/plain".into(),
        text: Some(text.into()),
        data: None,
        url: None,
    }
}

fn done(text: &str) -> Execution {
    Execution {
        stop: StopReason::EndTurn,
        output: Some(json!({ "summary": text })),
        artifacts: vec![artifact(text)],
        side_effects: vec![],
        usage: Usage::default(),
    }
}

fn agent_msg(text: &str) -> Option<Value> {
    Some(
        json!({ "messageId": format!("m-{text}"), "role": "ROLE_AGENT", "parts": [{ "text": text }] }),
    )
}

/// The executor handle the callee runtime owns.
struct ScriptExec(Arc<Script>);

impl TaskExecutor for ScriptExec {
    fn execute(
        &self,
        mut run: TaskRun,
    ) -> Pin<Box<dyn std::future::Future<Output = Execution> + Send>> {
        self.0.runs.fetch_add(1, Ordering::SeqCst);
        let me = self.0.clone();
        Box::pin(async move {
            let text = run.request.task.text.clone();
            let working = "TASK_STATE_WORKING";
            match text.as_str() {
                "complete" => done("all good"),
                "gated" => {
                    for i in 1..=2 {
                        run.sink
                            .status(working, agent_msg(&format!("step {i}")), None)
                            .await
                            .unwrap();
                    }
                    tokio::select! {
                        p = me.gate.acquire() => p.unwrap().forget(),
                        () = run.cancel.cancelled() => {
                            me.cancels.fetch_add(1, Ordering::SeqCst);
                            return Execution::stopped(StopReason::Cancelled);
                        }
                    }
                    for i in 3..=4 {
                        run.sink
                            .status(working, agent_msg(&format!("step {i}")), None)
                            .await
                            .unwrap();
                    }
                    run.sink
                        .artifact(artifact("gated result"), false, true)
                        .await
                        .unwrap();
                    done("gated result")
                }
                "hold" => {
                    run.sink
                        .status(working, agent_msg("holding"), None)
                        .await
                        .unwrap();
                    run.cancel.cancelled().await;
                    me.cancels.fetch_add(1, Ordering::SeqCst);
                    Execution::stopped(StopReason::Cancelled)
                }
                "ask" => {
                    run.sink
                        .status(
                            "TASK_STATE_INPUT_REQUIRED",
                            agent_msg("which branch?"),
                            None,
                        )
                        .await
                        .unwrap();
                    let answer = run.messages.recv().await.unwrap();
                    let branch = answer["parts"][0]["text"]
                        .as_str()
                        .unwrap_or_default()
                        .to_string();
                    done(&format!("branch {branch}"))
                }
                _ => Execution::stopped(StopReason::Error(format!("unknown script {text}"))),
            }
        })
    }
}

struct World {
    relay: Relay,
    a: oab_connector::Connector,
    b: oab_connector::Connector,
    facade: FacadeServer,
    rpc: Rpc,
    script: Arc<Script>,
}

async fn world() -> World {
    world_with(facade_options()).await
}

async fn world_with(options: oab_connector::a2a::FacadeOptions) -> World {
    let env = Env::new("");
    let relay = Relay::start(&env, Arc::new(MemoryStore::new(Retention::default()))).await;
    let script = Arc::new(Script {
        gate: Arc::new(Semaphore::new(0)),
        runs: AtomicUsize::new(0),
        cancels: AtomicUsize::new(0),
    });
    let b = connector(
        &env,
        &env.callee,
        relay.addr,
        Some(Arc::new(ScriptExec(script.clone()))),
    );
    let a = connector(&env, &env.caller, relay.addr, None);
    a.connected().await.unwrap();
    b.connected().await.unwrap();
    let facade = FacadeServer::start(a.caller().clone(), options).await;
    let rpc = Rpc::new(facade.url(CALLEE));
    World {
        relay,
        a,
        b,
        facade,
        rpc,
        script,
    }
}

impl World {
    async fn stop(self) {
        self.facade.stop().await;
        self.a.shutdown().await;
        self.b.shutdown().await;
        self.relay.stop().await;
    }
}

fn code(v: &Value) -> i64 {
    v["error"]["code"]
        .as_i64()
        .unwrap_or_else(|| panic!("not an error: {v}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn error_codes_follow_the_spec() {
    let w = world().await;
    let rpc = &w.rpc;
    let none: &[(&str, &str)] = &[];

    // No A2A-Version means 0.3, which is not served.
    let r = rpc.call("GetTask", json!({ "id": "x" }), none).await;
    assert_eq!(code(&r), -32009, "{r}");
    let info = &r["error"]["data"][0];
    assert_eq!(info["@type"], "type.googleapis.com/google.rpc.ErrorInfo");
    assert_eq!(info["reason"], "VERSION_NOT_SUPPORTED");
    assert_eq!(info["domain"], "a2a-protocol.org");
    assert!(r["error"]["data"].is_array());
    let r = rpc
        .call("GetTask", json!({ "id": "x" }), &[("A2A-Version", "0.3")])
        .await;
    assert_eq!(code(&r), -32009);
    // The query parameter works too.
    let q = Rpc::new(format!("{}?A2A-Version=1.0", rpc.url));
    assert_eq!(
        code(&q.call("GetTask", json!({ "id": "x" }), none).await),
        -32001
    );

    // Envelope errors.
    assert_eq!(code(&rpc.raw("{not json", V1).await.0), -32700);
    assert_eq!(code(&rpc.raw("[]", V1).await.0), -32600);
    assert_eq!(
        code(
            &rpc.raw(r#"{"jsonrpc":"2.0","method":"GetTask"}"#, V1)
                .await
                .0
        ),
        -32600
    );
    assert_eq!(
        code(&rpc.raw(r#"{"jsonrpc":"2.0","id":1}"#, V1).await.0),
        -32600
    );
    // A media type other than JSON: HTTP 415 with a JSON-RPC error.
    let resp = rpc
        .http
        .post(&rpc.url)
        .header("A2A-Version", "1.0")
        .header("content-type", "text/plain")
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 415);
    assert_eq!(code(&resp.json().await.unwrap()), -32005);
    assert_eq!(code(&rpc.call("tasks/get", json!({}), V1).await), -32601);
    assert_eq!(code(&rpc.call("NoSuchMethod", json!({}), V1).await), -32601);
    assert_eq!(code(&rpc.call("GetTask", json!({}), V1).await), -32602);
    assert_eq!(
        code(
            &rpc.call(
                "SendMessage",
                json!({ "message": { "role": "ROLE_USER" } }),
                V1
            )
            .await
        ),
        -32602
    );

    // Unknown tasks, unsupported features.
    assert_eq!(
        code(&rpc.call("GetTask", json!({ "id": "nope" }), V1).await),
        -32001
    );
    assert_eq!(
        code(&rpc.call("CancelTask", json!({ "id": "nope" }), V1).await),
        -32001
    );
    let s = rpc
        .stream("SubscribeToTask", json!({ "id": "nope" }), V1)
        .await;
    assert_eq!(code(&s.json().await), -32001);
    let follow = json!({ "message": { "messageId": "f1", "role": "ROLE_USER", "taskId": "nope", "parts": [{ "text": "x" }] } });
    assert_eq!(code(&rpc.call("SendMessage", follow, V1).await), -32001);
    assert_eq!(
        code(&rpc.call("GetExtendedAgentCard", json!({}), V1).await),
        -32007
    );
    for m in [
        "CreateTaskPushNotificationConfig",
        "GetTaskPushNotificationConfig",
        "ListTaskPushNotificationConfigs",
        "DeleteTaskPushNotificationConfig",
    ] {
        assert_eq!(
            code(
                &rpc.call(
                    m,
                    json!({ "taskId": "t", "id": "c", "url": "http://127.0.0.1:9/" }),
                    V1
                )
                .await
            ),
            -32001,
            "{m}"
        );
    }

    // A finished task: not cancelable; not subscribable without the profile.
    let r = rpc
        .call(
            "SendMessage",
            json!({ "message": message("m-complete", "complete") }),
            V1,
        )
        .await;
    let task = &r["result"]["task"];
    assert_eq!(task["status"]["state"], "TASK_STATE_COMPLETED", "{r}");
    assert_eq!(task["artifacts"][0]["parts"][0]["text"], "all good");
    assert!(
        task.get("metadata").is_none(),
        "no profile metadata for a plain client"
    );
    let id = task["id"].as_str().unwrap().to_string();
    assert!(id.starts_with("task-"), "the callee's task id: {id}");
    assert_eq!(
        code(&rpc.call("CancelTask", json!({ "id": id }), V1).await),
        -32002
    );
    let s = rpc.stream("SubscribeToTask", json!({ "id": id }), V1).await;
    assert_eq!(code(&s.json().await), -32004);
    // A message to a finished task is an unsupported operation.
    let again = json!({ "message": { "messageId": "m2", "role": "ROLE_USER", "taskId": id, "parts": [{ "text": "more" }] } });
    assert_eq!(code(&rpc.call("SendMessage", again, V1).await), -32004);
    // A mismatching contextId is refused.
    let mismatch = json!({ "message": { "messageId": "m3", "role": "ROLE_USER", "taskId": id, "contextId": "other", "parts": [{ "text": "x" }] } });
    assert_eq!(code(&rpc.call("SendMessage", mismatch, V1).await), -32602);

    // With the profile, a finished task replays after the cursor.
    let h = with_profile(&[("Last-Event-ID", "0".to_string())]);
    let s = rpc.stream("SubscribeToTask", json!({ "id": id }), &h).await;
    assert!(s.sse);
    assert_eq!(
        s.headers
            .get("A2A-Extensions")
            .and_then(|v| v.to_str().ok()),
        Some(PROFILE_URI),
        "the activated profile is echoed"
    );
    let items = s.collect().await;
    let kinds: Vec<&str> = items.iter().map(kind).collect();
    assert_eq!(
        kinds,
        ["task", "artifactUpdate", "statusUpdate"],
        "{items:?}"
    );
    let last = &items[2].data["result"]["statusUpdate"];
    assert_eq!(last["status"]["state"], "TASK_STATE_COMPLETED");
    let meta = &last["metadata"][PROFILE_URI];
    assert_eq!(meta["outcome"], "completed");
    assert_eq!(meta["verified"], true);
    assert_eq!(
        meta["result"]["payloadType"]
            .as_str()
            .map(|t| t.contains("result")),
        Some(true),
        "{meta}"
    );
    let seqs: Vec<Option<u64>> = items.iter().map(seq).collect();
    assert_eq!(seqs, [Some(2), Some(1), Some(2)]);
    assert_eq!(
        items[1].id.as_deref(),
        Some("1"),
        "the SSE id is the sequence"
    );
    // A cursor at the end replays nothing but the snapshot.
    let h = with_profile(&[("OAB-Cursor", "2".to_string())]);
    let items = rpc
        .stream("SubscribeToTask", json!({ "id": id }), &h)
        .await
        .collect()
        .await;
    assert_eq!(items.iter().map(kind).collect::<Vec<_>>(), ["task"]);

    // ListTasks: newest first, artifacts only on request, pagination.
    let r = rpc
        .call(
            "SendMessage",
            json!({ "message": message("m-complete-2", "complete") }),
            V1,
        )
        .await;
    let second = r["result"]["task"]["id"].as_str().unwrap().to_string();
    let page = rpc.call("ListTasks", json!({ "pageSize": 1 }), V1).await;
    let res = &page["result"];
    assert_eq!(res["totalSize"], 2, "{page}");
    assert_eq!(res["pageSize"], 1);
    assert_eq!(res["tasks"][0]["id"], second.as_str());
    assert!(res["tasks"][0].get("artifacts").is_none());
    let token = res["nextPageToken"].as_str().unwrap().to_string();
    assert!(!token.is_empty());
    let page = rpc
        .call("ListTasks", json!({ "pageSize": 1, "pageToken": token, "includeArtifacts": true, "historyLength": 0 }), V1)
        .await;
    let res = &page["result"];
    assert_eq!(res["tasks"][0]["id"], id.as_str());
    assert_eq!(res["nextPageToken"], "");
    assert!(res["tasks"][0]["artifacts"].is_array());
    assert!(res["tasks"][0].get("history").is_none());
    assert_eq!(
        code(&rpc.call("ListTasks", json!({ "pageSize": 500 }), V1).await),
        -32602
    );
    let got = rpc
        .call("GetTask", json!({ "id": id, "historyLength": 1 }), V1)
        .await;
    assert_eq!(
        got["result"]["history"].as_array().map(Vec::len),
        Some(1),
        "{got}"
    );
    // The proto field name is accepted too (ProtoJSON).
    let got = rpc
        .call("GetTask", json!({ "id": id, "history_length": 0 }), V1)
        .await;
    assert!(got["result"].get("history").is_none(), "{got}");

    // The agent card of the peer.
    let card: Value = reqwest::get(format!(
        "{}.well-known/agent-card.json",
        w.facade.url(CALLEE)
    ))
    .await
    .unwrap()
    .json()
    .await
    .unwrap();
    let iface = &card["supportedInterfaces"][0];
    assert_eq!(iface["url"], w.facade.url(CALLEE).as_str());
    assert_eq!(iface["protocolBinding"], "JSONRPC");
    assert_eq!(iface["protocolVersion"], "1.0");
    assert_eq!(card["capabilities"]["streaming"], true);
    assert_eq!(card["capabilities"]["pushNotifications"], true);
    assert_eq!(card["capabilities"]["extensions"][0]["uri"], PROFILE_URI);
    assert_eq!(card["capabilities"]["extensions"][0]["required"], false);
    let missing = reqwest::get(format!(
        "{}/peers/acme/nobody/.well-known/agent-card.json",
        w.facade.base
    ))
    .await
    .unwrap();
    assert_eq!(missing.status(), 404);
    w.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_stream_never_cancels_and_the_cursor_replays_exactly_what_was_missed() {
    let w = world().await;
    let rpc = &w.rpc;
    let h = with_profile(&[]);
    let mut s = rpc
        .stream(
            "SendStreamingMessage",
            json!({ "message": message("m-gated", "gated") }),
            &h,
        )
        .await;
    assert!(s.sse);
    let first = s.next().await.unwrap();
    assert_eq!(kind(&first), "task");
    assert_eq!(state(&first).as_deref(), Some("TASK_STATE_SUBMITTED"));
    assert_eq!(seq(&first), Some(0));
    let id = first.data["result"]["task"]["id"]
        .as_str()
        .unwrap()
        .to_string();
    let mut seen = Vec::new();
    while seen.len() < 2 {
        let ev = s.next().await.unwrap();
        assert_eq!(kind(&ev), "statusUpdate");
        seen.push(seq(&ev).unwrap());
    }
    assert_eq!(seen, [1, 2]);
    // The client goes away mid-task.
    drop(s);
    // The work goes on while nobody listens, and finishes.
    w.script.gate.add_permits(1);
    let done = wait_state(rpc, &id, "TASK_STATE_COMPLETED").await;
    assert_eq!(done["artifacts"][0]["parts"][0]["text"], "gated result");
    assert_eq!(
        w.script.cancels.load(Ordering::SeqCst),
        0,
        "a disconnect is not a cancel"
    );
    assert_eq!(w.script.runs.load(Ordering::SeqCst), 1);

    // Reconnect with the cursor: the snapshot, then exactly what was missed.
    let h = with_profile(&[("Last-Event-ID", "2".to_string())]);
    let items = rpc
        .stream("SubscribeToTask", json!({ "id": id }), &h)
        .await
        .collect()
        .await;
    assert_eq!(kind(&items[0]), "task");
    assert_eq!(state(&items[0]).as_deref(), Some("TASK_STATE_COMPLETED"));
    let missed: Vec<(u64, &str)> = items[1..]
        .iter()
        .map(|e| (seq(e).unwrap(), kind(e)))
        .collect();
    assert_eq!(
        missed,
        [
            (3, "statusUpdate"),
            (4, "statusUpdate"),
            (5, "artifactUpdate"),
            (6, "statusUpdate")
        ],
        "{items:?}"
    );
    let texts: Vec<String> = items[1..3]
        .iter()
        .map(|e| {
            e.data["result"]["statusUpdate"]["status"]["message"]["parts"][0]["text"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    assert_eq!(texts, ["step 3", "step 4"]);
    let ids: Vec<Option<&str>> = items[1..].iter().map(|e| e.id.as_deref()).collect();
    assert_eq!(ids, [Some("3"), Some("4"), Some("5"), Some("6")]);
    w.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_subscribe_is_snapshot_then_live_and_cancel_and_input_required_work() {
    let w = world().await;
    let rpc = &w.rpc;
    // returnImmediately: the task comes back before the work ends.
    let r = rpc
        .call(
            "SendMessage",
            json!({ "message": message("m-gated-2", "gated"), "configuration": { "returnImmediately": true } }),
            V1,
        )
        .await;
    let id = r["result"]["task"]["id"].as_str().unwrap().to_string();
    assert!(
        !r["result"]["task"]["status"]["state"]
            .as_str()
            .unwrap()
            .contains("COMPLETED")
    );
    // Wait until both first steps are in, then subscribe without the profile.
    let until = tokio::time::Instant::now() + STEP;
    loop {
        let t = rpc.call("GetTask", json!({ "id": id }), V1).await;
        if t["result"]["history"].as_array().map_or(0, Vec::len) >= 3 {
            break;
        }
        assert!(tokio::time::Instant::now() < until, "no progress: {t}");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let mut s = rpc.stream("SubscribeToTask", json!({ "id": id }), V1).await;
    let snap = s.next().await.unwrap();
    assert_eq!(kind(&snap), "task");
    assert_eq!(state(&snap).as_deref(), Some("TASK_STATE_WORKING"));
    assert!(
        snap.id.is_none() && seq(&snap).is_none(),
        "no profile fields"
    );
    w.script.gate.add_permits(1);
    let rest = s.collect().await;
    let kinds: Vec<&str> = rest.iter().map(kind).collect();
    assert_eq!(
        kinds,
        [
            "statusUpdate",
            "statusUpdate",
            "artifactUpdate",
            "statusUpdate"
        ]
    );
    assert_eq!(
        state(rest.last().unwrap()).as_deref(),
        Some("TASK_STATE_COMPLETED")
    );

    // CancelTask: the callee stops, the task is canceled.
    let r = rpc
        .call(
            "SendMessage",
            json!({ "message": message("m-hold", "hold"), "configuration": { "returnImmediately": true } }),
            V1,
        )
        .await;
    let hold = r["result"]["task"]["id"].as_str().unwrap().to_string();
    wait_state(rpc, &hold, "TASK_STATE_WORKING").await;
    let r = rpc.call("CancelTask", json!({ "id": hold }), V1).await;
    assert_eq!(r["result"]["status"]["state"], "TASK_STATE_CANCELED", "{r}");
    assert_eq!(w.script.cancels.load(Ordering::SeqCst), 1);

    // Input required: the blocking send returns at the interruption; the
    // answer goes down as a follow-up and the stream runs to the end.
    let r = rpc
        .call(
            "SendMessage",
            json!({ "message": message("m-ask", "ask") }),
            V1,
        )
        .await;
    let task = &r["result"]["task"];
    assert_eq!(task["status"]["state"], "TASK_STATE_INPUT_REQUIRED", "{r}");
    assert_eq!(
        task["status"]["message"]["parts"][0]["text"],
        "which branch?"
    );
    let ask = task["id"].as_str().unwrap().to_string();
    let ctx = task["contextId"].as_str().unwrap().to_string();
    let answer = json!({ "message": { "messageId": "m-answer", "role": "ROLE_USER", "taskId": ask, "contextId": ctx, "parts": [{ "text": "main" }] } });
    let items = rpc
        .stream("SendStreamingMessage", answer, V1)
        .await
        .collect()
        .await;
    let last = items.last().unwrap();
    assert_eq!(
        state(last).as_deref(),
        Some("TASK_STATE_COMPLETED"),
        "{items:?}"
    );
    let t = rpc.call("GetTask", json!({ "id": ask }), V1).await;
    assert_eq!(
        t["result"]["artifacts"][0]["parts"][0]["text"],
        "branch main"
    );
    let history = t["result"]["history"].as_array().unwrap();
    assert!(history.iter().any(|m| m["messageId"] == "m-answer"), "{t}");
    w.stop().await;
}

/// The card carries `Last-Modified` (CARD-CACHE-003) beside its `ETag`:
/// `If-Modified-Since` at or after it answers 304, before it 200;
/// `If-None-Match` wins when both are sent; a newly published card moves
/// the date, even within the same second.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_card_has_last_modified_and_if_modified_since_revalidates() {
    use reqwest::header::{ETAG, IF_MODIFIED_SINCE, IF_NONE_MATCH, LAST_MODIFIED};
    let w = world().await;
    let url = format!("{}.well-known/agent-card.json", w.facade.url(CALLEE));
    let http = reqwest::Client::new();
    let get = |headers: Vec<(reqwest::header::HeaderName, String)>| {
        let mut r = http.get(&url);
        for (k, v) in headers {
            r = r.header(k, v);
        }
        async move { r.send().await.unwrap() }
    };
    let first = get(vec![]).await;
    assert_eq!(first.status(), 200);
    let lm = first.headers()[LAST_MODIFIED].to_str().unwrap().to_string();
    let etag = first.headers()[ETAG].to_str().unwrap().to_string();
    let date = httpdate::parse_http_date(&lm).expect("Last-Modified is an HTTP date");
    assert!(date <= std::time::SystemTime::now());

    let same = get(vec![(IF_MODIFIED_SINCE, lm.clone())]).await;
    assert_eq!(same.status(), 304);
    assert_eq!(same.headers()[LAST_MODIFIED], lm.as_str());
    let earlier = httpdate::fmt_http_date(date - Duration::from_secs(3600));
    assert_eq!(get(vec![(IF_MODIFIED_SINCE, earlier)]).await.status(), 200);
    assert_eq!(get(vec![(IF_NONE_MATCH, etag.clone())]).await.status(), 304);
    let both = get(vec![
        (IF_NONE_MATCH, "\"another\"".into()),
        (IF_MODIFIED_SINCE, lm.clone()),
    ])
    .await;
    assert_eq!(both.status(), 200, "If-None-Match wins");
    assert_eq!(
        get(vec![(IF_MODIFIED_SINCE, "not a date".into())])
            .await
            .status(),
        200
    );

    // A new card from the peer: a new ETag and a later date.
    w.b.publish(&json!({ "name": "renamed", "description": "a new card" }))
        .await
        .unwrap();
    let until = tokio::time::Instant::now() + STEP;
    let changed = loop {
        let r = get(vec![]).await;
        if r.headers()[ETAG] != etag.as_str() {
            break r;
        }
        assert!(
            tokio::time::Instant::now() < until,
            "the new card never showed"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let lm2 = changed.headers()[LAST_MODIFIED]
        .to_str()
        .unwrap()
        .to_string();
    assert!(
        httpdate::parse_http_date(&lm2).unwrap() > date,
        "{lm} -> {lm2}"
    );
    assert_eq!(get(vec![(IF_MODIFIED_SINCE, lm)]).await.status(), 200);
    assert_eq!(get(vec![(IF_MODIFIED_SINCE, lm2)]).await.status(), 304);
    w.stop().await;
}

/// The HTTP+JSON binding: every method at its route, answered as the
/// JSON-RPC binding answers it (same tasks, same errors as
/// `google.rpc.Status` with the HTTP status of the A2A table), `A2A-Version`
/// checked, bare SSE events, both `:subscribe` methods, the profile's
/// activation, cursor and metadata, and the `{tenant}/` prefix.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rest_binding_answers_every_method_like_json_rpc() {
    use reqwest::Method;
    let w = world().await;
    let rest = Rest::new(w.facade.url(CALLEE));
    let none: &[(&str, &str)] = &[];

    // The card lists HTTP+JSON after JSON-RPC, at the same peer base.
    let card = rest.get(".well-known/agent-card.json", none).await.body;
    let ifaces = card["supportedInterfaces"].as_array().unwrap();
    assert_eq!(ifaces.len(), 2, "{card}");
    assert_eq!(ifaces[0]["protocolBinding"], "JSONRPC");
    assert_eq!(ifaces[1]["protocolBinding"], "HTTP+JSON");
    assert_eq!(ifaces[1]["protocolVersion"], "1.0");
    assert_eq!(ifaces[1]["url"], rest.base.as_str());

    // A2A-Version: missing means 0.3, refused; the query parameter works.
    let r = rest.get("tasks/nope", none).await;
    assert_eq!(r.status, 400, "{r:?}");
    assert_eq!(r.reason(), "VERSION_NOT_SUPPORTED");
    assert_eq!(r.status_name(), "FAILED_PRECONDITION");
    assert_eq!(
        r.body["error"]["details"][0]["metadata"]["requestedVersion"],
        "0.3"
    );
    assert_eq!(
        rest.get("tasks/nope", &[("A2A-Version", "2.0")])
            .await
            .reason(),
        "VERSION_NOT_SUPPORTED"
    );
    let r = rest.get("tasks/nope?A2A-Version=1.0", none).await;
    assert_eq!((r.status, r.reason().as_str()), (404, "TASK_NOT_FOUND"));
    assert_eq!(r.status_name(), "NOT_FOUND");
    // Plain JSON unless the client asks for application/a2a+json.
    assert_eq!(r.headers["content-type"], "application/json", "{r:?}");
    let r = rest
        .get(
            "tasks/nope",
            &[("A2A-Version", "1.0"), ("Accept", "application/a2a+json")],
        )
        .await;
    assert_eq!((r.status, r.reason().as_str()), (404, "TASK_NOT_FOUND"));
    assert_eq!(r.headers["content-type"], "application/a2a+json", "{r:?}");
    // The interface URL ends in `/`: a client that joins it with a route
    // starting in `/` reaches the same route.
    let r = rest.get("/tasks/nope", V1).await;
    assert_eq!((r.status, r.reason().as_str()), (404, "TASK_NOT_FOUND"));

    // Unknown routes, wrong methods, bad bodies, wrong media types.
    let r = rest.get("nothing/here", V1).await;
    assert_eq!((r.status, r.reason().as_str()), (404, "METHOD_NOT_FOUND"));
    let r = Rest::send(rest.request(Method::GET, "message:send", None, V1)).await;
    assert_eq!(r.status, 405, "{r:?}");
    assert_eq!(r.headers["allow"], "POST");
    let r = Rest::send(rest.request(Method::DELETE, "tasks/x:subscribe", None, V1)).await;
    assert_eq!(
        (r.status, &r.headers["allow"]),
        (405, &"GET, POST".parse().unwrap())
    );
    let raw = |body: &'static str, ct: &'static str| {
        Rest::send(
            rest.request(Method::POST, "message:send", None, V1)
                .header("content-type", ct)
                .body(body),
        )
    };
    let r = raw("{not json", "application/json").await;
    assert_eq!((r.status, r.reason().as_str()), (400, "PARSE_ERROR"));
    assert_eq!(r.status_name(), "INVALID_ARGUMENT");
    let r = raw("[1]", "application/json").await;
    assert_eq!((r.status, r.reason().as_str()), (400, "INVALID_REQUEST"));
    let r = raw("{}", "text/plain").await;
    assert_eq!(
        (r.status, r.reason().as_str()),
        (415, "CONTENT_TYPE_NOT_SUPPORTED")
    );
    let r = rest.post("message:send", &json!({}), V1).await;
    assert_eq!((r.status, r.reason().as_str()), (400, "INVALID_PARAMS"));
    let r = rest
        .post(
            "message:send",
            &json!({ "message": { "role": "ROLE_USER" } }),
            V1,
        )
        .await;
    assert_eq!((r.status, r.reason().as_str()), (400, "INVALID_PARAMS"));

    // Errors of unknown tasks and unsupported features.
    let r = rest.post("tasks/nope:cancel", &json!({}), V1).await;
    assert_eq!((r.status, r.reason().as_str()), (404, "TASK_NOT_FOUND"));
    let s = rest
        .stream(Method::GET, "tasks/nope:subscribe", None, V1)
        .await;
    assert!(!s.sse && s.status == 404);
    let r = rest.get("extendedAgentCard", V1).await;
    assert_eq!(
        (r.status, r.reason().as_str()),
        (400, "EXTENDED_AGENT_CARD_NOT_CONFIGURED")
    );
    // The push-config routes answer what the JSON-RPC methods answer.
    let push: [(&str, Method, &str, Option<Value>, Value); 4] = [
        (
            "CreateTaskPushNotificationConfig",
            Method::POST,
            "tasks/nope/pushNotificationConfigs",
            Some(json!({ "url": "http://127.0.0.1:9/hook" })),
            json!({ "taskId": "nope", "url": "http://127.0.0.1:9/hook" }),
        ),
        (
            "ListTaskPushNotificationConfigs",
            Method::GET,
            "tasks/nope/pushNotificationConfigs",
            None,
            json!({ "taskId": "nope" }),
        ),
        (
            "GetTaskPushNotificationConfig",
            Method::GET,
            "tasks/nope/pushNotificationConfigs/c1",
            None,
            json!({ "taskId": "nope", "id": "c1" }),
        ),
        (
            "DeleteTaskPushNotificationConfig",
            Method::DELETE,
            "tasks/nope/pushNotificationConfigs/c1",
            None,
            json!({ "taskId": "nope", "id": "c1" }),
        ),
    ];
    for (method, http, path, body, params) in push {
        let j = w.rpc.call(method, params, V1).await;
        let r = Rest::send(rest.request(http, path, body.as_ref(), V1)).await;
        assert_eq!(
            r.reason(),
            j["error"]["data"][0]["reason"].as_str().unwrap(),
            "{method}: {j} vs {r:?}"
        );
        assert_eq!(
            r.status,
            if code(&j) == -32001 { 404 } else { 400 },
            "{method}"
        );
    }

    // A blocking send: the task, completed; then GetTask with historyLength.
    let r = rest
        .post(
            "message:send",
            &json!({ "message": message("r-complete", "complete") }),
            V1,
        )
        .await;
    assert_eq!(r.status, 200, "{r:?}");
    let task = &r.body["task"];
    assert_eq!(task["status"]["state"], "TASK_STATE_COMPLETED", "{r:?}");
    assert_eq!(task["artifacts"][0]["parts"][0]["text"], "all good");
    let id = task["id"].as_str().unwrap().to_string();
    let got = rest.get(&format!("tasks/{id}?historyLength=1"), V1).await;
    assert_eq!(
        got.body["history"].as_array().map(Vec::len),
        Some(1),
        "{got:?}"
    );
    let got = rest.get(&format!("tasks/{id}?history_length=0"), V1).await;
    assert!(got.body.get("history").is_none(), "{got:?}");
    assert_eq!(got.body["id"], id.as_str());
    // ... and under a tenant prefix.
    let got = rest.get(&format!("some-tenant/tasks/{id}"), V1).await;
    assert_eq!((got.status, &got.body["id"]), (200, &json!(id)));

    // Finished: not cancelable, not subscribable without the profile (GET or POST).
    let r = rest
        .post(&format!("tasks/{id}:cancel"), &json!({}), V1)
        .await;
    assert_eq!(
        (r.status, r.reason().as_str()),
        (400, "TASK_NOT_CANCELABLE")
    );
    for m in [Method::GET, Method::POST] {
        let s = rest
            .stream(m.clone(), &format!("tasks/{id}:subscribe"), None, V1)
            .await;
        assert!(!s.sse, "{m}");
        assert_eq!(s.status, 400, "{m}");
        let body = s.json().await;
        assert_eq!(
            body["error"]["details"][0]["reason"],
            "UNSUPPORTED_OPERATION"
        );
    }
    let again = json!({ "message": { "messageId": "r2", "role": "ROLE_USER", "taskId": id, "parts": [{ "text": "more" }] } });
    assert_eq!(
        rest.post("message:send", &again, V1).await.reason(),
        "UNSUPPORTED_OPERATION"
    );

    // With the profile, both :subscribe methods replay after the cursor:
    // bare StreamResponses, the SSE id and the metadata as in JSON-RPC.
    for m in [Method::GET, Method::POST] {
        let h = with_profile(&[("Last-Event-ID", "0".to_string())]);
        let s = rest
            .stream(m.clone(), &format!("tasks/{id}:subscribe"), None, &h)
            .await;
        assert!(s.sse, "{m}");
        assert_eq!(
            s.headers
                .get("A2A-Extensions")
                .and_then(|v| v.to_str().ok()),
            Some(PROFILE_URI)
        );
        let items = s.collect().await;
        assert!(
            items.iter().all(|e| e.data.get("result").is_none()),
            "bare: {items:?}"
        );
        let kinds: Vec<&str> = items.iter().map(kind).collect();
        assert_eq!(
            kinds,
            ["task", "artifactUpdate", "statusUpdate"],
            "{m}: {items:?}"
        );
        assert_eq!(
            items.iter().map(seq).collect::<Vec<_>>(),
            [Some(2), Some(1), Some(2)]
        );
        assert_eq!(items[1].id.as_deref(), Some("1"));
        let meta = &items[2].data["statusUpdate"]["metadata"][PROFILE_URI];
        assert_eq!(meta["outcome"], "completed", "{meta}");
        assert_eq!(meta["verified"], true);
    }

    // ListTasks from the query: pages, artifacts on request, status filter.
    rest.post(
        "message:send",
        &json!({ "message": message("r-complete-2", "complete") }),
        V1,
    )
    .await;
    let page = rest.get("tasks?pageSize=1", V1).await;
    assert_eq!(page.status, 200, "{page:?}");
    assert_eq!(
        (
            page.body["totalSize"].as_u64(),
            page.body["pageSize"].as_u64()
        ),
        (Some(2), Some(1))
    );
    assert!(page.body["tasks"][0].get("artifacts").is_none());
    let token = page.body["nextPageToken"].as_str().unwrap().to_string();
    assert!(!token.is_empty());
    let page = rest
        .get(
            &format!("tasks?pageSize=1&pageToken={token}&includeArtifacts=true"),
            V1,
        )
        .await;
    assert_eq!(page.body["tasks"][0]["id"], id.as_str(), "{page:?}");
    assert_eq!(page.body["nextPageToken"], "");
    assert!(page.body["tasks"][0]["artifacts"].is_array());
    let page = rest.get("tasks?status=TASK_STATE_WORKING", V1).await;
    assert_eq!(page.body["totalSize"], 0, "{page:?}");
    let r = rest.get("tasks?pageSize=500", V1).await;
    assert_eq!((r.status, r.reason().as_str()), (400, "INVALID_PARAMS"));

    // A streamed send with the profile: bare events in order, seq from 0;
    // a dropped stream goes on, and the cursor resumes it over REST.
    let h = with_profile(&[]);
    let body = json!({ "message": message("r-gated", "gated") });
    let mut s = rest
        .stream(Method::POST, "message:stream", Some(&body), &h)
        .await;
    assert!(s.sse && s.status == 200);
    let first = s.next().await.unwrap();
    assert_eq!((kind(&first), seq(&first)), ("task", Some(0)));
    assert_eq!(state(&first).as_deref(), Some("TASK_STATE_SUBMITTED"));
    let gated = first.data["task"]["id"].as_str().unwrap().to_string();
    let step = s.next().await.unwrap();
    assert_eq!((kind(&step), seq(&step)), ("statusUpdate", Some(1)));
    drop(s);
    w.script.gate.add_permits(1);
    let h = with_profile(&[("OAB-Cursor", "1".to_string())]);
    let items = rest
        .stream(Method::POST, &format!("tasks/{gated}:subscribe"), None, &h)
        .await
        .collect()
        .await;
    let seqs: Vec<u64> = items[1..].iter().map(|e| seq(e).unwrap()).collect();
    assert_eq!(seqs, [2, 3, 4, 5, 6], "{items:?}");
    assert_eq!(
        state(items.last().unwrap()).as_deref(),
        Some("TASK_STATE_COMPLETED")
    );
    assert_eq!(w.script.cancels.load(Ordering::SeqCst), 0);

    // Cancel over REST reaches the callee.
    let r = rest
        .post(
            "message:send",
            &json!({ "message": message("r-hold", "hold"), "configuration": { "returnImmediately": true } }),
            V1,
        )
        .await;
    let hold = r.body["task"]["id"].as_str().unwrap().to_string();
    wait_state(&w.rpc, &hold, "TASK_STATE_WORKING").await;
    let r = rest
        .post(&format!("tasks/{hold}:cancel"), &json!({ "id": hold }), V1)
        .await;
    assert_eq!(r.body["status"]["state"], "TASK_STATE_CANCELED", "{r:?}");
    assert_eq!(w.script.cancels.load(Ordering::SeqCst), 1);

    // Input required: the stream closes at the interruption; the answer
    // goes down with message:send and the task completes.
    let body = json!({ "message": message("r-ask", "ask") });
    let items = rest
        .stream(Method::POST, "message:stream", Some(&body), V1)
        .await
        .collect()
        .await;
    assert_eq!(
        state(items.last().unwrap()).as_deref(),
        Some("TASK_STATE_INPUT_REQUIRED"),
        "{items:?}"
    );
    let ask = response(&items[0])["task"]["id"]
        .as_str()
        .unwrap()
        .to_string();
    let answer = json!({ "message": { "messageId": "r-answer", "role": "ROLE_USER", "taskId": ask, "parts": [{ "text": "dev" }] } });
    let r = rest.post("message:send", &answer, V1).await;
    assert_eq!(
        r.body["task"]["status"]["state"], "TASK_STATE_COMPLETED",
        "{r:?}"
    );
    assert_eq!(
        r.body["task"]["artifacts"][0]["parts"][0]["text"],
        "branch dev"
    );
    w.stop().await;
}

/// The browser-safety checks guard the HTTP+JSON routes too, GET routes
/// included: a foreign `Host`, a cross-site `Origin` or `Sec-Fetch-Site`,
/// a form post and a missing bearer token are refused before any method.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rest_routes_pass_the_browser_guard() {
    use reqwest::Method;
    let w = world().await;
    let mut options = facade_options();
    options.token = Some(oab_connector::a2a::FacadeToken::new("rest-secret").unwrap());
    let locked = FacadeServer::start(w.a.caller().clone(), options).await;
    let rest = Rest::new(w.facade.url(CALLEE));
    let routes = [
        (Method::GET, "tasks"),
        (Method::GET, "tasks/x"),
        (Method::GET, "tasks/x:subscribe"),
        (Method::POST, "tasks/x:subscribe"),
        (Method::POST, "tasks/x:cancel"),
        (Method::POST, "message:send"),
        (Method::GET, "extendedAgentCard"),
        (Method::DELETE, "tasks/x/pushNotificationConfigs/c"),
    ];
    let status = |r: reqwest::RequestBuilder| async move {
        tokio::time::timeout(STEP, r.send())
            .await
            .unwrap()
            .unwrap()
            .status()
            .as_u16()
    };
    for (m, path) in &routes {
        let req = || rest.request(m.clone(), path, None, V1);
        assert_eq!(
            status(req().header("host", "evil.example")).await,
            421,
            "{m} {path}"
        );
        assert_eq!(
            status(req().header("origin", "https://evil.example")).await,
            403,
            "{m} {path}"
        );
        assert_eq!(
            status(req().header("sec-fetch-site", "cross-site")).await,
            403,
            "{m} {path}"
        );
        // A same-site request passes the guard (and gets a method's answer).
        assert_ne!(
            status(req().header("origin", "http://127.0.0.1:3000")).await,
            403,
            "{m} {path}"
        );
        let locked_rest = Rest::new(locked.url(CALLEE));
        let lreq = || locked_rest.request(m.clone(), path, None, V1);
        assert_eq!(status(lreq()).await, 401, "{m} {path}");
        assert_eq!(
            status(lreq().header("authorization", "Bearer wrong")).await,
            401,
            "{m} {path}"
        );
        assert_ne!(
            status(lreq().header("authorization", "Bearer rest-secret")).await,
            401,
            "{m} {path}"
        );
    }
    // A form post (no body needed) is refused by its media type, even on
    // a route that takes no body.
    for path in ["tasks/x:cancel", "tasks/x:subscribe", "message:send"] {
        let r = rest
            .request(Method::POST, path, None, V1)
            .header("content-type", "application/x-www-form-urlencoded");
        assert_eq!(status(r).await, 415, "{path}");
    }
    assert_eq!(
        w.script.runs.load(Ordering::SeqCst),
        0,
        "no refused request reached the callee"
    );
    locked.stop().await;
}

/// The push config a send registers.
fn push_config(url: &str, token: &str) -> Value {
    json!({
        "url": url,
        "token": token,
        "authentication": { "scheme": "Bearer", "credentials": format!("cred-{token}") },
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_webhook_gets_every_event_of_a_task_in_order_with_its_token() {
    let w = world().await;
    let hook = Webhook::start(0).await;
    let profile = with_profile(&[]);
    let r = w
        .rpc
        .call(
            "SendMessage",
            json!({
                "message": message("m-push-gated", "gated"),
                "configuration": {
                    "returnImmediately": true,
                    "taskPushNotificationConfig": push_config(&hook.url, "tok-1"),
                },
            }),
            &profile,
        )
        .await;
    let id = r["result"]["task"]["id"]
        .as_str()
        .unwrap_or_else(|| panic!("a task: {r}"))
        .to_string();
    // The task as created and the two steps before the gate.
    hook.wait_for("three notifications", |got| got.len() >= 3)
        .await;
    w.script.gate.add_permits(1);
    let got = hook.wait_terminal().await;
    let kinds: Vec<&str> = got.iter().map(body_kind).collect();
    assert_eq!(
        kinds,
        [
            "task",
            "statusUpdate",
            "statusUpdate",
            "statusUpdate",
            "statusUpdate",
            "artifactUpdate",
            "statusUpdate"
        ],
        "{got:?}"
    );
    let seqs: Vec<Option<u64>> = got.iter().map(body_seq).collect();
    assert_eq!(
        seqs,
        (0..=6).map(Some).collect::<Vec<_>>(),
        "in order, no gap"
    );
    assert_eq!(
        got[6]["statusUpdate"]["status"]["state"],
        "TASK_STATE_COMPLETED"
    );
    for n in hook.all() {
        let h = |k: &str| {
            n.headers
                .get(k)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)
        };
        assert_eq!(h("x-a2a-notification-token").as_deref(), Some("tok-1"));
        assert_eq!(h("authorization").as_deref(), Some("Bearer cred-tok-1"));
        assert_eq!(h("content-type").as_deref(), Some("application/json"));
    }
    // The webhook got exactly what a stream from the start carries.
    let h = with_profile(&[("OAB-Cursor", "0".to_string())]);
    let items = w
        .rpc
        .stream("SubscribeToTask", json!({ "id": id }), &h)
        .await
        .collect()
        .await;
    let streamed: Vec<Value> = items
        .iter()
        .skip(1)
        .map(|i| i.data["result"].clone())
        .collect();
    let pushed: Vec<Value> = got
        .iter()
        .skip(1)
        .map(|b| {
            let mut b = b.clone();
            // The stream names the task by the id it was asked with.
            for k in ["statusUpdate", "artifactUpdate"] {
                if let Some(u) = b.get_mut(k) {
                    u["taskId"] = json!(id);
                    if let Some(m) = u.get_mut("status").and_then(|s| s.get_mut("message")) {
                        m["taskId"] = json!(id);
                    }
                }
            }
            b
        })
        .collect();
    assert_eq!(pushed, streamed);
    let until = tokio::time::Instant::now() + STEP;
    let delivered = || {
        w.facade
            .facade
            .push_stats()
            .delivered
            .load(Ordering::Relaxed)
    };
    while delivered() < 7 {
        assert!(tokio::time::Instant::now() < until, "7 confirmed");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(delivered(), 7);
    hook.stop();
    w.stop().await;
}

/// The admin endpoint's `/metrics` page.
async fn metrics_page(admin: std::net::SocketAddr) -> String {
    let r = oab_ops::admin_client::get(&format!("http://{admin}/metrics"), STEP)
        .await
        .unwrap();
    assert_eq!(r.status, 200);
    String::from_utf8(r.body).unwrap()
}

/// The value of the sample `series` (name with its labels as exported);
/// panics if absent.
fn metric(page: &str, series: &str) -> u64 {
    page.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("no {series} in\n{page}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_metrics_count_push_deliveries_failed_attempts_and_drops() {
    let mut options = facade_options();
    options.push.initial_backoff = Duration::from_millis(5);
    options.push.max_backoff = Duration::from_millis(40);
    options.push.max_attempts = 2;
    let w = world_with(options).await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let admin = listener.local_addr().unwrap();
    let stop = tokio_util::sync::CancellationToken::new();
    let sources = oab_connector::admin::AdminSources::new(w.a.link().clone())
        .with_facade(Some(w.facade.facade.clone()));
    tokio::spawn(oab_connector::admin::serve(
        listener,
        sources,
        stop.child_token(),
    ));
    let delivered = "oab_connector_push_notifications_total{result=\"delivered\"}";
    let dropped = "oab_connector_push_notifications_total{result=\"dropped\"}";
    let skipped = "oab_connector_push_notifications_total{result=\"skipped\"}";
    let failed = "oab_connector_push_failed_attempts_total";
    let active = "oab_connector_push_configs{delivery=\"active\"}";
    let ended = "oab_connector_push_configs{delivery=\"ended\"}";
    // Before any push: every series is there, at 0.
    let page = metrics_page(admin).await;
    for series in [delivered, dropped, skipped, failed, active, ended] {
        assert_eq!(metric(&page, series), 0, "{series} at start-up");
    }
    for family in [
        "oab_connector_push_notifications_total counter",
        "oab_connector_push_failed_attempts_total counter",
        "oab_connector_push_configs gauge",
    ] {
        assert!(page.contains(&format!("# TYPE {family}\n")), "{family}");
    }
    // The webhook refuses its first three requests, and each notification
    // has two attempts: the task as created fails both and is dropped, the
    // status update fails once and is delivered on its second attempt, the
    // terminal is delivered at once.
    let hook = Webhook::start(3).await;
    let r = w
        .rpc
        .call(
            "SendMessage",
            json!({
                "message": message("m-push-metrics", "complete"),
                "configuration": { "taskPushNotificationConfig": push_config(&hook.url, "t") },
            }),
            &with_profile(&[]),
        )
        .await;
    assert_eq!(
        r["result"]["task"]["status"]["state"], "TASK_STATE_COMPLETED",
        "{r}"
    );
    let got = hook.wait_terminal().await;
    let seqs: Vec<Option<u64>> = got.iter().map(body_seq).collect();
    assert_eq!(seqs, [Some(1), Some(2)], "the task as created was dropped");
    assert_eq!(hook.all().len(), 5, "three refused attempts, two accepted");
    // The last confirmation and the config's end are counted right after
    // the webhook answered.
    let until = tokio::time::Instant::now() + STEP;
    let mut page = metrics_page(admin).await;
    while metric(&page, delivered) < 2 || metric(&page, ended) < 1 {
        assert!(
            tokio::time::Instant::now() < until,
            "two delivered, the config ended:\n{page}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
        page = metrics_page(admin).await;
    }
    assert_eq!(metric(&page, delivered), 2);
    assert_eq!(metric(&page, dropped), 1);
    assert_eq!(metric(&page, skipped), 0);
    assert_eq!(metric(&page, failed), 3);
    assert_eq!(metric(&page, active), 0);
    assert_eq!(metric(&page, ended), 1);
    // The page and the facade's own counts agree.
    let stats = w.facade.facade.push_stats();
    assert_eq!(stats.delivered.load(Ordering::Relaxed), 2);
    assert_eq!(stats.failed_attempts.load(Ordering::Relaxed), 3);
    stop.cancel();
    hook.stop();
    w.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn push_configs_round_trip_and_refuse_what_they_must() {
    let w = world().await;
    let rpc = &w.rpc;
    let hook = Webhook::start(0).await;
    let r = rpc
        .call(
            "SendMessage",
            json!({ "message": message("m-push-crud", "complete") }),
            V1,
        )
        .await;
    let id = r["result"]["task"]["id"].as_str().unwrap().to_string();

    // Create, with and without an id.
    let c1 = rpc
        .call(
            "CreateTaskPushNotificationConfig",
            json!({ "taskId": id, "id": "c1", "url": hook.url, "token": "t1",
                    "authentication": { "scheme": "Bearer", "credentials": "x" } }),
            V1,
        )
        .await;
    assert_eq!(
        c1["result"],
        json!({ "id": "c1", "taskId": id, "url": hook.url, "token": "t1",
                "authentication": { "scheme": "Bearer", "credentials": "x" } }),
        "{c1}"
    );
    // The proto field names work too (the TCK sends `task_id`).
    let c2 = rpc
        .call(
            "CreateTaskPushNotificationConfig",
            json!({ "task_id": id, "url": "https://example.com/hook" }),
            V1,
        )
        .await;
    let c2_id = c2["result"]["id"].as_str().unwrap().to_string();
    assert!(c2_id.starts_with("push-"), "a minted id: {c2}");
    // Get.
    let got = rpc
        .call(
            "GetTaskPushNotificationConfig",
            json!({ "taskId": id, "id": "c1" }),
            V1,
        )
        .await;
    assert_eq!(got["result"], c1["result"]);
    assert_eq!(
        code(
            &rpc.call(
                "GetTaskPushNotificationConfig",
                json!({ "taskId": id, "id": "nope" }),
                V1
            )
            .await
        ),
        -32001
    );
    // List, whole and in pages.
    let all = rpc
        .call(
            "ListTaskPushNotificationConfigs",
            json!({ "taskId": id }),
            V1,
        )
        .await;
    let ids: Vec<&str> = all["result"]["configs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["c1", c2_id.as_str()]);
    assert_eq!(all["result"]["nextPageToken"], "");
    let p1 = rpc
        .call(
            "ListTaskPushNotificationConfigs",
            json!({ "taskId": id, "pageSize": 1 }),
            V1,
        )
        .await;
    assert_eq!(p1["result"]["configs"][0]["id"], "c1");
    let token = p1["result"]["nextPageToken"].as_str().unwrap().to_string();
    assert!(!token.is_empty());
    let p2 = rpc
        .call(
            "ListTaskPushNotificationConfigs",
            json!({ "taskId": id, "pageSize": 1, "pageToken": token }),
            V1,
        )
        .await;
    assert_eq!(p2["result"]["configs"][0]["id"], c2_id.as_str());
    assert_eq!(p2["result"]["nextPageToken"], "");
    for bad in [json!({ "pageSize": 500 }), json!({ "pageToken": "zzz" })] {
        let mut p = bad.clone();
        p["taskId"] = json!(id);
        assert_eq!(
            code(&rpc.call("ListTaskPushNotificationConfigs", p, V1).await),
            -32602,
            "{bad}"
        );
    }
    // Delete, twice (idempotent).
    for _ in 0..2 {
        let d = rpc
            .call(
                "DeleteTaskPushNotificationConfig",
                json!({ "taskId": id, "id": "c1" }),
                V1,
            )
            .await;
        assert_eq!(d["result"], json!({}), "{d}");
    }
    assert_eq!(
        code(
            &rpc.call(
                "GetTaskPushNotificationConfig",
                json!({ "taskId": id, "id": "c1" }),
                V1
            )
            .await
        ),
        -32001
    );
    let all = rpc
        .call(
            "ListTaskPushNotificationConfigs",
            json!({ "taskId": id }),
            V1,
        )
        .await;
    assert_eq!(all["result"]["configs"].as_array().map(Vec::len), Some(1));

    // Refusals: unknown task, missing or bad url, bad authentication.
    assert_eq!(
        code(
            &rpc.call(
                "CreateTaskPushNotificationConfig",
                json!({ "taskId": "nope", "url": hook.url }),
                V1
            )
            .await
        ),
        -32001
    );
    for bad in [
        json!({}),
        json!({ "url": "ftp://127.0.0.1/hook" }),
        json!({ "url": "http://example.com/hook" }),
        json!({ "url": "not a url" }),
        json!({ "url": hook.url, "authentication": { "credentials": "x" } }),
        json!({ "url": hook.url, "token": "a\r\nInjected: yes" }),
    ] {
        let mut p = bad.clone();
        p["taskId"] = json!(id);
        assert_eq!(
            code(&rpc.call("CreateTaskPushNotificationConfig", p, V1).await),
            -32602,
            "{bad}"
        );
    }
    // A send with a bad config starts nothing.
    let runs = w.script.runs.load(Ordering::SeqCst);
    let r = rpc
        .call(
            "SendMessage",
            json!({
                "message": message("m-push-bad", "complete"),
                "configuration": { "taskPushNotificationConfig": { "url": "http://example.com/" } },
            }),
            V1,
        )
        .await;
    assert_eq!(code(&r), -32602, "{r}");
    assert_eq!(w.script.runs.load(Ordering::SeqCst), runs);

    // A config made mid-task gets what follows it.
    let profile = with_profile(&[]);
    let r = rpc
        .call(
            "SendMessage",
            json!({ "message": message("m-push-hold", "hold"), "configuration": { "returnImmediately": true } }),
            &profile,
        )
        .await;
    let hold = r["result"]["task"]["id"].as_str().unwrap().to_string();
    let seq_now = loop {
        let t = rpc.call("GetTask", json!({ "id": hold }), &profile).await;
        let s = t["result"]["metadata"][PROFILE_URI]["seq"]
            .as_u64()
            .unwrap_or(0);
        if s >= 1 {
            break s;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let made = rpc
        .call(
            "CreateTaskPushNotificationConfig",
            json!({ "taskId": hold, "url": hook.url }),
            &profile,
        )
        .await;
    assert!(made["result"]["id"].is_string(), "{made}");
    rpc.call("CancelTask", json!({ "id": hold }), V1).await;
    let got = hook.wait_terminal().await;
    assert_eq!(body_seq(&got[0]), Some(seq_now + 1), "{got:?}");
    assert_eq!(
        got.last().unwrap()["statusUpdate"]["status"]["state"],
        "TASK_STATE_CANCELED"
    );
    hook.stop();
    w.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_webhook_is_retried_and_one_that_stays_down_loses_only_what_is_dropped() {
    let mut options = facade_options();
    options.push.initial_backoff = Duration::from_millis(5);
    options.push.max_backoff = Duration::from_millis(40);
    options.push.max_attempts = 3;
    let w = world_with(options).await;
    let profile = with_profile(&[]);
    // Fails twice, then takes everything: every notification arrives.
    let flaky = Webhook::start(2).await;
    // Fails three times: the first notification runs out of attempts.
    let down = Webhook::start(3).await;
    for (hook, mid) in [(&flaky, "m-push-flaky"), (&down, "m-push-down")] {
        let r = w
            .rpc
            .call(
                "SendMessage",
                json!({
                    "message": message(mid, "complete"),
                    "configuration": { "taskPushNotificationConfig": push_config(&hook.url, "t") },
                }),
                &profile,
            )
            .await;
        assert_eq!(
            r["result"]["task"]["status"]["state"], "TASK_STATE_COMPLETED",
            "{r}"
        );
    }
    let got = flaky.wait_terminal().await;
    let seqs: Vec<Option<u64>> = got.iter().map(body_seq).collect();
    assert_eq!(seqs, [Some(0), Some(1), Some(2)], "{got:?}");
    let all = flaky.all();
    assert_eq!(
        all.len(),
        5,
        "two refused attempts, then three notifications"
    );
    assert_eq!(all[0].body, all[2].body, "the same notification retried");
    let got = down.wait_terminal().await;
    let seqs: Vec<Option<u64>> = got.iter().map(body_seq).collect();
    assert_eq!(seqs, [Some(1), Some(2)], "the task as created was dropped");
    let stats = w.facade.facade.push_stats();
    assert_eq!(stats.dropped.load(Ordering::Relaxed), 1);
    assert_eq!(stats.failed_attempts.load(Ordering::Relaxed), 5);
    // The last confirmation is counted right after the webhook answered.
    let until = tokio::time::Instant::now() + STEP;
    while stats.delivered.load(Ordering::Relaxed) < 5 {
        assert!(tokio::time::Instant::now() < until, "5 confirmed");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(stats.delivered.load(Ordering::Relaxed), 5);
    flaky.stop();
    down.stop();
    w.stop().await;
}
