//! The callee's connector process killed (SIGKILL) and started again while
//! its agent keeps running the delegated tasks: connector B is the
//! `oab-connector` binary with a state folder and its A2A driver in front
//! of the official-SDK sample agent (`gated-` tasks: two progress updates,
//! then they wait for the test to open their gate). After the restart the
//! connector re-attaches to every task (same instance id, so the relay
//! keeps the work open) and each delegation ends with the agent's real
//! terminal and every event the agent emitted, each once; with the agent
//! restarted too (its tasks gone), each ends `unknown`, signed by the
//! callee, saying the agent no longer has the task.
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

use a2a_support::{STEP, sample_agent, sample_agent_at};
use common::*;
use futures_util::StreamExt as _;
use oab_connector::{DelegationHandle, EventKind};
use oab_relay::store::{MemoryStore, Retention};
use oab_wire::{Digest, Outcome};
use parking_lot::Mutex;
use serde_json::json;
use tokio::io::AsyncBufReadExt as _;

/// Delegations running when connector B is killed.
const RUNNING: usize = 50;

/// Connector B's `connector.toml` (and its identity) in `dir`: the driver
/// towards the agent on `agent_port`, a state folder.
fn callee_config(env: &Env, dir: &Path, relay: std::net::SocketAddr, agent_port: u16) -> String {
    let identity = dir.join("callee.identity.toml");
    if !identity.exists() {
        oab_connector::keyfile::save(&env.callee, &identity).unwrap();
    }
    let pin = oab_wire::digest::hex(&Digest::of(&env.cert_der).0);
    let text = format!(
        r#"[connector]
relay_url = "wss://localhost:{port}/"
identity = "{identity}"
relay_pin_sha256 = "sha256:{pin}"
state_dir = "{state}"

[[peers]]
id = "{caller}"
keys = [{{ key_id = "k1", public_key = "{key}" }}]

[policy]
allowed_capabilities = ["read:*"]
allow_writes = false
max_concurrent = 64
max_concurrent_per_peer = 64
max_deadline_ms = 3600000

[a2a]
driver_url = "http://127.0.0.1:{agent_port}"
"#,
        port = relay.port(),
        identity = identity.display(),
        state = dir.join("state").display(),
        caller = env.caller.peer,
        key = env.caller.public_key(),
    );
    let path = dir.join("connector.toml");
    std::fs::write(&path, text).unwrap();
    path.display().to_string()
}

/// Connector B, its log lines collected.
struct Callee {
    child: tokio::process::Child,
    log: Arc<Mutex<Vec<String>>>,
}

impl Callee {
    fn start(config: &str) -> Callee {
        let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_oab-connector"))
            .args(["run", "--config", config])
            .env("OAB_LOG", "info")
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let log = Arc::new(Mutex::new(Vec::new()));
        let mut lines = tokio::io::BufReader::new(child.stderr.take().unwrap()).lines();
        let sink = log.clone();
        tokio::spawn(async move {
            while let Ok(Some(line)) = lines.next_line().await {
                sink.lock().push(line);
            }
        });
        Callee { child, log }
    }

    /// SIGTERM, and waits for the exit.
    async fn stop(mut self) {
        let pid = self.child.id().unwrap().to_string();
        let status = std::process::Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap();
        assert!(status.success());
        let exit = tokio::time::timeout(STEP, self.child.wait())
            .await
            .expect("connector B stops after SIGTERM")
            .unwrap();
        assert!(exit.success(), "{exit}");
    }

    /// Waits until `n` log lines contain `text`.
    async fn logged(&self, text: &str, n: usize) {
        let until = tokio::time::Instant::now() + STEP * 3;
        loop {
            let seen = self.log.lock().iter().filter(|l| l.contains(text)).count();
            if seen >= n {
                return;
            }
            assert!(
                tokio::time::Instant::now() < until,
                "{seen} of {n} lines with {text:?} in connector B's log:\n{}",
                self.log.lock().join("\n")
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// A delegation whose A2A message id (which picks what the sample agent
/// does) is `message_id`.
fn agent_task(message_id: &str) -> oab_connector::NewDelegation {
    let mut d = spec("a task for the sample agent");
    d.task.a2a_message = Some(json!({
        "messageId": message_id,
        "role": "ROLE_USER",
        "parts": [{ "text": "a gated task" }],
    }));
    d.deadline = Duration::from_secs(600);
    d
}

/// What the caller received of one delegation, in order.
#[derive(Debug, Default, Clone)]
struct Seen {
    /// Status message texts (statuses without one: the state name).
    statuses: Vec<String>,
    /// Artifact ids.
    artifacts: Vec<String>,
    terminal: Option<oab_connector::caller::Terminal>,
}

/// Reads `h`'s events into `seen` until the terminal.
async fn follow(a: Arc<oab_connector::Connector>, h: DelegationHandle, seen: Arc<Mutex<Seen>>) {
    let mut events = a.caller().events(&h, 0).await.unwrap();
    while let Some(item) = events.next().await {
        let ev = item.unwrap_or_else(|e| panic!("{}: {e}", h.key));
        match ev.kind {
            EventKind::Status { state, message, .. } => {
                let text = message
                    .as_ref()
                    .and_then(|m| m["parts"][0]["text"].as_str())
                    .map_or(state, str::to_string);
                seen.lock().statuses.push(text);
            }
            EventKind::Artifact { artifact, .. } => {
                seen.lock().artifacts.push(artifact.artifact_id.clone());
            }
            EventKind::Terminal(t) => {
                seen.lock().terminal = Some(t);
                return;
            }
            _ => {}
        }
    }
}

/// Waits until every delegation saw `n` statuses.
async fn statuses_at_least(all: &[Arc<Mutex<Seen>>], n: usize) {
    let until = tokio::time::Instant::now() + STEP * 3;
    loop {
        let behind = all.iter().filter(|s| s.lock().statuses.len() < n).count();
        if behind == 0 {
            return;
        }
        assert!(
            tokio::time::Instant::now() < until,
            "{behind} delegations have fewer than {n} statuses"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn open_gate(http: &reqwest::Client, agent_port: u16, message_id: &str) {
    let r = http
        .post(format!(
            "http://127.0.0.1:{agent_port}/test/gates/{message_id}"
        ))
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success(), "gate {message_id}: {}", r.status());
}

/// Starts `n` gated delegations from `a`, each followed in the background
/// until its terminal, and waits until each has sent up its first two
/// progress updates (the agent then waits at its gate).
async fn start_gated(
    a: &Arc<oab_connector::Connector>,
    env: &Env,
    n: usize,
) -> (Vec<DelegationHandle>, Vec<Arc<Mutex<Seen>>>) {
    let mut handles = Vec::new();
    let mut seen = Vec::new();
    for i in 0..n {
        let h = a
            .caller()
            .delegate(&env.callee.peer, agent_task(&format!("gated-{i}")))
            .await
            .unwrap();
        let s = Arc::new(Mutex::new(Seen::default()));
        tokio::spawn(follow(a.clone(), h.clone(), s.clone()));
        handles.push(h);
        seen.push(s);
    }
    // working, step 1, step 2
    statuses_at_least(&seen, 3).await;
    (handles, seen)
}

/// Waits until every delegation has its terminal.
async fn terminals(seen: &[Arc<Mutex<Seen>>]) {
    let until = tokio::time::Instant::now() + STEP * 3;
    loop {
        let open = seen.iter().filter(|s| s.lock().terminal.is_none()).count();
        if open == 0 {
            return;
        }
        assert!(
            tokio::time::Instant::now() < until,
            "{open} delegations have no terminal"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_callee_connector_reattaches_to_its_agents_running_tasks() {
    let env = Env::new("");
    let relay = Relay::start(&env, Arc::new(MemoryStore::new(Retention::default()))).await;
    let (_agent, agent_port) = sample_agent().await;
    let dir = tempfile::tempdir().unwrap();
    let config = callee_config(&env, dir.path(), relay.addr, agent_port);
    let mut b = Callee::start(&config);
    let a = Arc::new(connector(&env, &env.caller, relay.addr, None));
    a.connected().await.unwrap();

    let (handles, seen) = start_gated(&a, &env, RUNNING).await;

    // SIGKILL while every task waits at its gate, then the same folder again.
    b.child.kill().await.unwrap();
    let b2 = Callee::start(&config);
    b2.logged(
        "following the local A2A server's task again after a restart",
        RUNNING,
    )
    .await;
    let http = reqwest::Client::new();
    for i in 0..RUNNING {
        open_gate(&http, agent_port, &format!("gated-{i}")).await;
    }
    terminals(&seen).await;

    for (h, s) in handles.iter().zip(&seen) {
        let s = s.lock().clone();
        assert_eq!(
            s.statuses,
            ["TASK_STATE_WORKING", "step 1", "step 2", "step 3", "step 4"],
            "{}: every progress update once, in order",
            h.key
        );
        assert_eq!(s.artifacts, ["result"], "{}", h.key);
        let t = s.terminal.unwrap();
        assert_eq!(t.outcome, Outcome::Completed, "{}: {t:?}", h.key);
        assert!(!t.relay_origin);
        let verified = a.caller().verify(h, &t).unwrap();
        assert_eq!(
            verified
                .result
                .artifacts
                .iter()
                .map(|a| a.artifact_id.as_str())
                .collect::<Vec<_>>(),
            ["result"],
            "{}: the signed result holds the agent's artifact",
            h.key
        );
    }
    // Nothing ended `unknown`, and nothing ran twice.
    let log = b2.log.lock().join("\n");
    assert!(!log.contains("ending it unknown"), "{log}");
    // The records are gone once the terminals were acknowledged (read
    // after a clean stop, which writes what was queued).
    b2.stop().await;
    let (_journal, records) =
        oab_connector::reattach::CalleeJournal::open(&dir.path().join("state")).unwrap();
    assert!(records.is_empty(), "{records:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn work_the_agent_lost_too_ends_unknown_saying_so() {
    let env = Env::new("");
    let relay = Relay::start(&env, Arc::new(MemoryStore::new(Retention::default()))).await;
    let (mut agent, agent_port) = sample_agent().await;
    let dir = tempfile::tempdir().unwrap();
    let config = callee_config(&env, dir.path(), relay.addr, agent_port);
    let mut b = Callee::start(&config);
    let a = Arc::new(connector(&env, &env.caller, relay.addr, None));
    a.connected().await.unwrap();

    let (handles, seen) = start_gated(&a, &env, 5).await;

    // Both go: the connector and the agent with its tasks.
    b.child.kill().await.unwrap();
    agent.kill().await.unwrap();
    let (_agent2, _) = sample_agent_at(agent_port).await;
    let _b2 = Callee::start(&config);
    terminals(&seen).await;

    for (h, s) in handles.iter().zip(&seen) {
        let t = s.lock().terminal.clone().unwrap();
        assert_eq!(t.outcome, Outcome::Unknown, "{}: {t:?}", h.key);
        assert!(!t.relay_origin, "the callee says so, signed: {t:?}");
        let verified = a.caller().verify(h, &t).unwrap();
        let error = verified.result.error.unwrap_or_default();
        assert!(
            error.contains("the agent no longer has task"),
            "{}: {error}",
            h.key
        );
    }
}

/// What the agent recorded of a `paced-` task: its progress texts in
/// order, and its terminal once it has one.
async fn emitted(
    http: &reqwest::Client,
    agent_port: u16,
    message_id: &str,
) -> (Vec<String>, Option<String>) {
    let v: serde_json::Value = http
        .get(format!(
            "http://127.0.0.1:{agent_port}/test/emitted/{message_id}"
        ))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let texts = v["emitted"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|t| t.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    (texts, v["terminal"].as_str().map(str::to_string))
}

/// Connector B is killed while its agent's tasks tick on; the short ones
/// finish while it is down, the long ones go on after it is back. Every
/// progress update the agent emitted, during the outage too (the driver
/// takes them from the task's history), reaches the caller once, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_the_agent_did_while_the_connector_was_down_reaches_the_caller() {
    let env = Env::new("");
    let relay = Relay::start(&env, Arc::new(MemoryStore::new(Retention::default()))).await;
    let (_agent, agent_port) = sample_agent().await;
    let dir = tempfile::tempdir().unwrap();
    let config = callee_config(&env, dir.path(), relay.addr, agent_port);
    let mut b = Callee::start(&config);
    let a = Arc::new(connector(&env, &env.caller, relay.addr, None));
    a.connected().await.unwrap();

    // Ten finish while B is down (20 ticks, 25 ms apart), ten tick on
    // (400 ticks, 25 ms apart).
    let ids: Vec<String> = (0..20)
        .map(|i| {
            let ticks = if i < 10 { 20 } else { 400 };
            format!("paced-{ticks}-25-{i}")
        })
        .collect();
    let mut handles = Vec::new();
    let mut seen = Vec::new();
    for id in &ids {
        let h = a
            .caller()
            .delegate(&env.callee.peer, agent_task(id))
            .await
            .unwrap();
        let s = Arc::new(Mutex::new(Seen::default()));
        tokio::spawn(follow(a.clone(), h.clone(), s.clone()));
        handles.push(h);
        seen.push(s);
    }
    // working, tick 1, tick 2
    statuses_at_least(&seen, 3).await;
    b.child.kill().await.unwrap();
    let http = reqwest::Client::new();
    let until = tokio::time::Instant::now() + STEP;
    for id in ids.iter().take(10) {
        while emitted(&http, agent_port, id).await.1.is_none() {
            assert!(tokio::time::Instant::now() < until, "{id} never finished");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    let b2 = Callee::start(&config);
    terminals(&seen).await;

    for ((h, s), id) in handles.iter().zip(&seen).zip(&ids) {
        let s = s.lock().clone();
        let (agent_ticks, terminal) = emitted(&http, agent_port, id).await;
        assert_eq!(terminal.as_deref(), Some("completed"), "{id}");
        assert_eq!(
            s.statuses.first().map(String::as_str),
            Some("TASK_STATE_WORKING"),
            "{id}"
        );
        assert_eq!(
            s.statuses.get(1..).unwrap_or_default(),
            agent_ticks.as_slice(),
            "{id}: every progress update the agent emitted, once, in order"
        );
        assert_eq!(s.artifacts, ["result"], "{id}");
        let t = s.terminal.unwrap();
        assert_eq!(t.outcome, Outcome::Completed, "{id}: {t:?}");
        a.caller().verify(h, &t).unwrap();
    }
    let log = b2.log.lock().join("\n");
    assert!(!log.contains("ending it unknown"), "{log}");
}

/// A callee connector (in this process) with a state folder whose executor
/// saves no checkpoint stops while its delegation runs; started again on
/// the same folder, it keeps its instance id (the relay keeps the work
/// open), never runs the delegation again, and ends it `unknown`, signed,
/// saying it kept no record of the agent's task.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn accepted_work_without_a_record_ends_unknown_and_never_runs_again() {
    let env = Env::new("");
    let relay = Relay::start(&env, Arc::new(MemoryStore::new(Retention::default()))).await;
    let dir = tempfile::tempdir().unwrap();
    let callee = |exec: Arc<Paced>| {
        connector_state(
            &env,
            settings(&env.callee, relay.addr, &env.cert_der),
            Some(exec),
            policy(),
            None,
            Some(oab_connector::state::FileState::open(dir.path()).unwrap()),
        )
    };
    // One status, then it waits at its gate (never opened).
    let first = Paced::gated(2, Duration::from_millis(1), 1);
    let b = callee(first.clone());
    b.connected().await.unwrap();
    let instance = b.link().instance;
    let a = connector(&env, &env.caller, relay.addr, None);
    a.connected().await.unwrap();
    let h = a
        .caller()
        .delegate(&env.callee.peer, spec("runs once"))
        .await
        .unwrap();
    let until = tokio::time::Instant::now() + STEP;
    while a.caller().get(&h).await.unwrap().received < 2 {
        assert!(tokio::time::Instant::now() < until, "never ran");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    b.shutdown().await;

    let second = Paced::new(1, Duration::from_millis(1));
    let b2 = callee(second.clone());
    assert_eq!(b2.link().instance, instance, "the folder's instance id");
    let t = a.caller().wait(&h, STEP).await.unwrap();
    assert_eq!(t.outcome, Outcome::Unknown, "{t:?}");
    assert!(!t.relay_origin, "signed by the callee: {t:?}");
    let error = a.caller().verify(&h, &t).unwrap().result.error.unwrap();
    assert!(error.contains("kept no record"), "{error}");
    assert_eq!(second.runs(), 0, "never run again");
    assert_eq!(first.runs(), 1);
}
