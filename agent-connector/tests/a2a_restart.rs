//! The caller's connector process killed (SIGKILL) and started again while
//! its A2A clients' tasks run: the `oab-connector` binary with a state
//! folder, its facade on a fixed loopback port, a relay and a callee on the
//! other side. After the restart every task the killed process had open is
//! found again under the ids the client holds (`GetTask`, `ListTasks`,
//! `SubscribeToTask` with a cursor), each reaches its terminal, including
//! the one that finished while the caller was down, and re-sending the same
//! message with the profile returns the same task. A second process started
//! on the same state folder while the first runs is refused.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod a2a_support;
mod common;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use a2a_support::*;
use common::*;
use oab_relay::store::{EventStore as _, MemoryStore, Retention};
use oab_wire::{DelegationKey, Digest, RequestId};
use serde_json::{Value, json};

/// Writes the caller's `connector.toml` (and its identity) into `dir`.
fn caller_config(env: &Env, dir: &Path, relay: std::net::SocketAddr, facade_port: u16) -> String {
    let identity = dir.join("caller.identity.toml");
    oab_connector::keyfile::save(&env.caller, &identity).unwrap();
    let pin = oab_wire::digest::hex(&Digest::of(&env.cert_der).0);
    let text = format!(
        r#"[connector]
relay_url = "wss://localhost:{port}/"
identity = "{identity}"
relay_pin_sha256 = "sha256:{pin}"
state_dir = "{state}"

[[peers]]
id = "{callee}"
keys = [{{ key_id = "k1", public_key = "{key}" }}]

[policy]
allowed_capabilities = ["read:*"]
allow_writes = false
max_concurrent = 16
max_concurrent_per_peer = 16
max_deadline_ms = 3600000

[a2a]
facade_listen = "127.0.0.1:{facade_port}"
default_capabilities = ["read:repo"]
default_timeout_ms = 120000
"#,
        port = relay.port(),
        identity = identity.display(),
        state = dir.join("state").display(),
        callee = env.callee.peer,
        key = env.callee.public_key(),
    );
    let path = dir.join("connector.toml");
    std::fs::write(&path, text).unwrap();
    path.display().to_string()
}

fn start_caller(config: &str) -> tokio::process::Child {
    tokio::process::Command::new(env!("CARGO_BIN_EXE_oab-connector"))
        .args(["run", "--config", config])
        .env("OAB_LOG", "warn")
        .kill_on_drop(true)
        .spawn()
        .unwrap()
}

/// Waits until the facade answers (bounded).
async fn facade_up(rpc: &Rpc) {
    let until = tokio::time::Instant::now() + STEP;
    loop {
        let ok = rpc
            .http
            .post(&rpc.url)
            .header("content-type", "application/json")
            .body(r#"{"jsonrpc":"2.0","id":1,"method":"ListTasks","params":{}}"#)
            .send()
            .await
            .is_ok();
        if ok {
            return;
        }
        assert!(
            tokio::time::Instant::now() < until,
            "the facade never came up"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Sends task `i` (message id `m-<i>`) with the profile, returning at once.
async fn send_task(rpc: &Rpc, i: usize) -> Value {
    rpc.call(
        "SendMessage",
        json!({
            "message": message(&format!("m-{i}"), &format!("task {i}")),
            "configuration": { "returnImmediately": true },
        }),
        &with_profile(&[]),
    )
    .await
}

/// The delegation key the facade derives for a profile message.
fn key_of_message(env: &Env, message_id: &str) -> DelegationKey {
    let d = Digest::of(format!("{}\n{message_id}", env.callee.peer).as_bytes());
    let rid = RequestId::new(&format!("a2a-{}", &oab_wire::digest::hex(&d.0)[..32])).unwrap();
    DelegationKey::new(env.caller.peer.clone(), rid)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_caller_connector_finds_and_finishes_every_task_after_a_restart() {
    let env = Env::new("");
    let store = Arc::new(MemoryStore::new(Retention::default()));
    let relay = Relay::start(&env, store.clone()).await;
    // Two status events, then each run waits for one opening of the gate.
    let exec = Paced::gated(4, Duration::from_millis(1), 2);
    let b = connector(&env, &env.callee, relay.addr, Some(exec.clone()));
    b.connected().await.unwrap();

    let dir = tempfile::tempdir().unwrap();
    let facade_port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let config = caller_config(&env, dir.path(), relay.addr, facade_port);
    let mut a = start_caller(&config);
    let rpc = Rpc::new(format!(
        "http://127.0.0.1:{facade_port}/peers/{}/",
        env.callee.peer
    ));
    facade_up(&rpc).await;

    let profile = with_profile(&[]);
    let mut ids = Vec::new();
    for i in 0..3 {
        let r = send_task(&rpc, i).await;
        let id = r["result"]["task"]["id"]
            .as_str()
            .unwrap_or_else(|| panic!("a task: {r}"))
            .to_string();
        ids.push(id);
    }
    // Every task is running on the callee (two statuses each).
    for id in &ids {
        let until = tokio::time::Instant::now() + STEP;
        loop {
            let r = rpc.call("GetTask", json!({ "id": id }), &profile).await;
            let seq = r["result"]["metadata"][oab_connector::a2a::PROFILE_URI]["seq"]
                .as_u64()
                .unwrap_or(0);
            if seq >= 2 {
                break;
            }
            assert!(
                tokio::time::Instant::now() < until,
                "task {id} stalled: {r}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    // A second process on the same state folder is refused and says why
    // (it would resume the same delegations); the first one goes on.
    let second = tokio::process::Command::new(env!("CARGO_BIN_EXE_oab-connector"))
        .args(["run", "--config", &config])
        .env("OAB_LOG", "warn")
        .kill_on_drop(true)
        .output();
    let second = tokio::time::timeout(STEP, second)
        .await
        .expect("a second connector on the same state folder exits")
        .unwrap();
    let stderr = String::from_utf8_lossy(&second.stderr);
    assert!(!second.status.success(), "{stderr}");
    assert!(
        stderr.contains("another process has this state folder open"),
        "{stderr}"
    );
    assert!(
        a.try_wait().unwrap().is_none(),
        "the first connector exited"
    );

    // SIGKILL: no goodbye, nothing flushed (and the folder's lock goes with
    // the process: the restart below takes it).
    a.kill().await.unwrap();
    // One task finishes while the caller's connector is down.
    exec.open_gate();
    let keys: Vec<DelegationKey> = (0..3)
        .map(|i| key_of_message(&env, &format!("m-{i}")))
        .collect();
    let until = tokio::time::Instant::now() + STEP;
    loop {
        let mut done = 0;
        for k in &keys {
            if matches!(store.meta(k).await, Ok(Some(m)) if m.terminal.is_some()) {
                done += 1;
            }
        }
        if done == 1 {
            break;
        }
        assert!(tokio::time::Instant::now() < until, "no task finished");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    let _a = start_caller(&config);
    facade_up(&rpc).await;
    // Every task is found again under the id the client holds.
    for id in &ids {
        let r = rpc.call("GetTask", json!({ "id": id }), &profile).await;
        assert_eq!(
            r["result"]["id"],
            json!(id),
            "GetTask after the restart: {r}"
        );
    }
    let listed = rpc.call("ListTasks", json!({}), &profile).await;
    let listed: Vec<&str> = listed["result"]["tasks"]
        .as_array()
        .unwrap_or_else(|| panic!("ListTasks: {listed}"))
        .iter()
        .flat_map(|t| {
            // The public id is the callee's once known; the profile's
            // metadata also names the id the facade minted first.
            let m = &t["metadata"][oab_connector::a2a::PROFILE_URI];
            [t["id"].as_str(), m["facadeTaskId"].as_str()]
        })
        .flatten()
        .collect();
    for id in &ids {
        assert!(listed.contains(&id.as_str()), "{id} listed in {listed:?}");
    }
    // A subscription from a cursor replays what follows it, then goes live.
    let mut sub = rpc
        .stream(
            "SubscribeToTask",
            json!({ "id": ids[1] }),
            &with_profile(&[("OAB-Cursor", "1".to_string())]),
        )
        .await;
    let first = sub.next().await.expect("the snapshot");
    assert_eq!(kind(&first), "task");
    exec.open_gate();
    exec.open_gate();
    let mut expect = 2;
    loop {
        let item = sub.next().await.expect("events until the terminal");
        assert_eq!(seq(&item), Some(expect), "replay then live, in order");
        expect += 1;
        if state(&item).as_deref() == Some("TASK_STATE_COMPLETED") {
            break;
        }
    }
    for id in &ids {
        wait_state(&rpc, id, "TASK_STATE_COMPLETED").await;
    }
    // The same message again is the same task (the profile's idempotency).
    for (i, id) in ids.iter().enumerate() {
        let r = send_task(&rpc, i).await;
        let again: &Value = &r["result"]["task"];
        assert_eq!(
            again["metadata"][oab_connector::a2a::PROFILE_URI]["facadeTaskId"],
            json!(id),
            "re-sent m-{i} is the same task: {r}"
        );
        assert_eq!(again["status"]["state"], "TASK_STATE_COMPLETED");
    }
    assert_eq!(exec.runs(), 3, "each task ran once");
    b.shutdown().await;
    relay.stop().await;
}

/// The push notifications of a task survive a SIGKILL of the caller's
/// connector: the webhook refuses everything after the first three, the
/// task reaches its terminal in the connector, the connector is killed
/// while it retries, and the restarted connector delivers from its saved
/// cursor: every event, in order, none lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn push_notifications_resume_from_their_cursor_after_a_killed_connector_restarts() {
    let env = Env::new("");
    let store = Arc::new(MemoryStore::new(Retention::default()));
    let relay = Relay::start(&env, store.clone()).await;
    // Two status events, then the run waits for one opening of the gate,
    // then two more and the end.
    let exec = Paced::gated(4, Duration::from_millis(1), 2);
    let b = connector(&env, &env.callee, relay.addr, Some(exec.clone()));
    b.connected().await.unwrap();
    let hook = Webhook::start(0).await;

    let dir = tempfile::tempdir().unwrap();
    let facade_port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let config = caller_config(&env, dir.path(), relay.addr, facade_port);
    let mut a = start_caller(&config);
    let rpc = Rpc::new(format!(
        "http://127.0.0.1:{facade_port}/peers/{}/",
        env.callee.peer
    ));
    facade_up(&rpc).await;
    let profile = with_profile(&[]);
    let r = rpc
        .call(
            "SendMessage",
            json!({
                "message": message("m-push", "task with a webhook"),
                "configuration": {
                    "returnImmediately": true,
                    "taskPushNotificationConfig": { "url": hook.url, "token": "tok" },
                },
            }),
            &profile,
        )
        .await;
    let id = r["result"]["task"]["id"]
        .as_str()
        .unwrap_or_else(|| panic!("a task: {r}"))
        .to_string();
    hook.wait_for("the first three notifications", |got| got.len() >= 3)
        .await;
    // The webhook goes down; the task runs to its end in the connector,
    // whose delivery of the next notification is refused.
    hook.set_failing(true);
    exec.open_gate();
    wait_state(&rpc, &id, "TASK_STATE_COMPLETED").await;
    hook.wait_all("a refused attempt", |all| {
        all.iter().any(|n| n.status == 503)
    })
    .await;
    a.kill().await.unwrap();
    assert_eq!(hook.accepted().len(), 3, "nothing confirmed past the third");
    hook.set_failing(false);

    let _a = start_caller(&config);
    let got = hook.wait_terminal().await;
    let seqs: Vec<u64> = got
        .iter()
        .map(|b| body_seq(b).unwrap_or_else(|| panic!("a sequence: {b}")))
        .collect();
    // At least once: a repeat may only go back, never skip ahead.
    for pair in seqs.windows(2) {
        assert!(pair[1] <= pair[0] + 1, "no gap, in order: {seqs:?}");
    }
    let mut distinct = seqs.clone();
    distinct.dedup();
    distinct.sort_unstable();
    distinct.dedup();
    assert_eq!(
        distinct,
        (0..=5).collect::<Vec<_>>(),
        "every event: {seqs:?}"
    );
    assert_eq!(seqs.last(), Some(&5));
    assert_eq!(
        got.last().unwrap()["statusUpdate"]["status"]["state"],
        "TASK_STATE_COMPLETED"
    );
    assert_eq!(body_kind(&got[0]), "task");
    for n in hook.all() {
        assert_eq!(
            n.headers
                .get("x-a2a-notification-token")
                .and_then(|v| v.to_str().ok()),
            Some("tok")
        );
    }
    hook.stop();
    b.shutdown().await;
    relay.stop().await;
}

/// The metric `name`'s value on the admin page `page` (0 when absent).
fn metric(page: &str, name: &str) -> f64 {
    page.lines()
        .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
        .unwrap_or(0.0)
}

/// The caller's connector process is killed (SIGKILL) while a delegation
/// whose agent produces 200 MB (far over the output budget) is in flight,
/// and started again: it is in session at its first attempt and stays
/// there (no reconnect loop), and the task ends `failed` with the reason
/// the callee gave. The relay is a process on Redis, the agent the
/// official SDK behind connector B's driver.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_killed_with_an_oversized_output_in_flight_comes_back_in_session_at_once() {
    use oab_testkit::redis::{Persistence, RedisServer};
    let env = Env::new("");
    let redis = RedisServer::start(Persistence::Aof).unwrap();
    let relay = RelayProcess::start(&env, &redis.url()).await;
    let (_agent, agent_port) = sample_agent().await;
    let driver = oab_connector::a2a::A2aDriver::new(oab_connector::a2a::DriverOptions::new(
        format!("http://127.0.0.1:{agent_port}"),
    ))
    .unwrap();
    let b = connector(&env, &env.callee, relay.addr, Some(Arc::new(driver)));
    b.connected().await.unwrap();

    let dir = tempfile::tempdir().unwrap();
    let free = || {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let (facade_port, admin_port) = (free(), free());
    let config = caller_config(&env, dir.path(), relay.addr, facade_port);
    let mut text = std::fs::read_to_string(&config).unwrap();
    text.push_str(&format!("\n[admin]\nlisten = \"127.0.0.1:{admin_port}\"\n"));
    std::fs::write(&config, text).unwrap();
    let mut a = start_caller(&config);
    let rpc = Rpc::new(format!(
        "http://127.0.0.1:{facade_port}/peers/{}/",
        env.callee.peer
    ));
    facade_up(&rpc).await;
    let profile = with_profile(&[]);
    let sent = rpc
        .call(
            "SendMessage",
            json!({
                "message": message("big-200000000-1048576-killed", "a lot"),
                "configuration": { "returnImmediately": true },
            }),
            &profile,
        )
        .await;
    let id = sent["result"]["task"]["id"]
        .as_str()
        .unwrap_or_else(|| panic!("a task: {sent}"))
        .to_string();
    a.kill().await.unwrap();

    let _a = start_caller(&config);
    facade_up(&rpc).await;
    let until = tokio::time::Instant::now() + STEP;
    let task = loop {
        let r = rpc.call("GetTask", json!({ "id": id }), &profile).await;
        let state = r["result"]["status"]["state"].as_str().unwrap_or("");
        if state == "TASK_STATE_FAILED" {
            break r["result"].clone();
        }
        assert!(
            !matches!(
                state,
                "TASK_STATE_COMPLETED" | "TASK_STATE_CANCELED" | "TASK_STATE_REJECTED"
            ),
            "ended otherwise: {r}"
        );
        assert!(tokio::time::Instant::now() < until, "never ended: {r}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let said = task["status"]["message"].to_string();
    assert!(said.contains("over the budget"), "{said}");
    // In session from the first attempt, and still there.
    let page = reqwest::get(format!("http://127.0.0.1:{admin_port}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert_eq!(metric(&page, "oab_connector_sessions_total"), 1.0, "{page}");
    assert_eq!(
        metric(&page, "oab_connector_reconnects_total"),
        0.0,
        "{page}"
    );
    b.shutdown().await;
}
