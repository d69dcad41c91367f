//! OpenAB drop-in, end to end on loopback: a relay over TLS on a real
//! redis-server, two `oab-connector run` processes (host A with an OAB
//! primary, host B with an OAB worker), and CP clients written here from
//! the CP protocol (`docs/openab.md`) playing the OAB runtimes: WebSocket,
//! `Authorization: Bearer`, JSON-RPC 2.0, `cp/register` first.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use std::collections::VecDeque;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use futures_util::{SinkExt as _, StreamExt as _};
use oab_relay::store::{RedisStore, Retention};
use oab_wire::Digest;
use serde_json::{Value, json};
use tokio::net::TcpStream;
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::client::IntoClientRequest as _;

/// How long any single wait of these tests may take.
const STEP: Duration = Duration::from_secs(20);
const PRIMARY_KEY: &str = "k-primary-0123456789";
const WORKER_KEY: &str = "k-worker-0123456789";
/// A second primary identity on host A.
const PRIMARY2_KEY: &str = "k-primary2-0123456789";
const HELPER_KEY: &str = "k-helper-0123456789";

fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

fn write_private(path: &Path, text: &str) {
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::write(path, text).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).unwrap();
}

/// Host A's (`side` "a") or host B's connector configuration, with
/// `extra` in its `[openab]` section and `policy` in its `[policy]`.
fn config(
    env: &Env,
    dir: &Path,
    relay: std::net::SocketAddr,
    side: &str,
    port: u16,
    (extra, policy): (&str, &str),
) -> std::path::PathBuf {
    let (me, other) = match side {
        "a" => (&env.caller, &env.callee),
        _ => (&env.callee, &env.caller),
    };
    let identity = dir.join(format!("{side}.identity.toml"));
    oab_connector::keyfile::save(me, &identity).unwrap();
    let pin = oab_wire::digest::hex(&Digest::of(&env.cert_der).0);
    let openab = if side == "a" {
        let key = dir.join("primary.key");
        write_private(&key, &format!("{PRIMARY_KEY}\n"));
        format!(
            r#"
[openab]
listen = "127.0.0.1:{port}"
register_timeout_secs = 2
{extra}

[[openab.runtimes]]
namespace = "prod"
name = "koudu"
type = "primary"
key_file = "{key}"

[[openab.runtimes]]
namespace = "prod"
name = "koudu2"
type = "primary"
key_env = "TEST_CP_PRIMARY2_KEY"

[[openab.runtimes]]
namespace = "prod"
name = "helper"
type = "worker"
key_env = "TEST_CP_HELPER_KEY"

[[openab.targets]]
name = "reviewer"
peer = "{callee}"
remote = {{ name = "reviewer" }}
capabilities = ["read:repo"]

[[openab.targets]]
name = "nobody-home"
peer = "{callee}"
remote = {{ name = "absent" }}

[[openab.targets]]
name = "bounded"
peer = "{callee}"
remote = {{ name = "reviewer" }}
max_delegated_sessions = 1
"#,
            key = key.display(),
            callee = env.callee.peer,
        )
    } else {
        format!(
            r#"
[openab]
listen = "127.0.0.1:{port}"
{extra}

[[openab.runtimes]]
namespace = "prod"
name = "reviewer"
type = "worker"
key_env = "TEST_CP_WORKER_KEY"

[[openab.serve]]
peer = "{caller}"
workers = ["prod/reviewer"]
"#,
            caller = env.caller.peer,
        )
    };
    let text = format!(
        r#"[connector]
relay_url = "wss://localhost:{relay_port}/"
identity = "{identity}"
relay_pin_sha256 = "sha256:{pin}"

[[peers]]
id = "{other}"
keys = [{{ key_id = "k1", public_key = "{key}" }}]

[policy]
allowed_capabilities = ["read:*"]
max_concurrent = 16
max_concurrent_per_peer = 16
{policy}
{openab}"#,
        relay_port = relay.port(),
        identity = identity.display(),
        other = other.peer,
        key = other.public_key(),
    );
    let path = dir.join(format!("{side}.toml"));
    std::fs::write(&path, text).unwrap();
    path
}

fn start_connector(config: &Path) -> tokio::process::Child {
    tokio::process::Command::new(env!("CARGO_BIN_EXE_oab-connector"))
        .args(["run", "--config"])
        .arg(config)
        .env(
            "OAB_LOG",
            std::env::var("OAB_LOG").unwrap_or_else(|_| "warn".into()),
        )
        .env("TEST_CP_WORKER_KEY", WORKER_KEY)
        .env("TEST_CP_HELPER_KEY", HELPER_KEY)
        .env("TEST_CP_PRIMARY2_KEY", PRIMARY2_KEY)
        .kill_on_drop(true)
        .spawn()
        .unwrap()
}

/// A relay on Redis and the two connector processes with their endpoints.
struct World {
    _redis: oab_testkit::redis::RedisServer,
    _relay: Option<Relay>,
    /// The relay as an `oab-relay` process, when the test kills it.
    process: Option<RelayProcess>,
    _dir: tempfile::TempDir,
    a: tokio::process::Child,
    b: tokio::process::Child,
    /// Host A's endpoint port (the primary's CP).
    pa: u16,
    /// Host B's endpoint port (the worker's CP).
    pb: u16,
}

impl World {
    async fn start() -> World {
        Self::start_with("").await
    }

    /// With `b_extra` added to host B's `[openab]` section.
    async fn start_with(b_extra: &str) -> World {
        Self::start_with_both("", b_extra).await
    }

    /// With `a_extra` and `b_extra` added to host A's and host B's
    /// `[openab]` sections.
    async fn start_with_both(a_extra: &str, b_extra: &str) -> World {
        Self::start_full("", (a_extra, b_extra), "").await
    }

    /// With `relay_extra` added to the relay's configuration, the
    /// `[openab]` extras, and `policy` added to both hosts' `[policy]`.
    async fn start_full(
        relay_extra: &str,
        (a_extra, b_extra): (&str, &str),
        policy: &str,
    ) -> World {
        let env = Env::new(relay_extra);
        let redis =
            oab_testkit::redis::RedisServer::start(oab_testkit::redis::Persistence::None).unwrap();
        let store = Arc::new(
            RedisStore::connect(&redis.url(), Retention::default())
                .await
                .unwrap(),
        );
        let relay = Relay::start(&env, store).await;
        let addr = relay.addr;
        Self::around(
            env,
            redis,
            addr,
            (Some(relay), None),
            (a_extra, b_extra),
            policy,
        )
        .await
    }

    /// With the relay as an `oab-relay` process (in [`World::process`]),
    /// which a test may kill and start again.
    async fn start_relay_process() -> World {
        let env = Env::new("");
        let redis =
            oab_testkit::redis::RedisServer::start(oab_testkit::redis::Persistence::None).unwrap();
        let relay = RelayProcess::start(&env, &redis.url()).await;
        let addr = relay.addr;
        Self::around(env, redis, addr, (None, Some(relay)), ("", ""), "").await
    }

    async fn around(
        env: Env,
        redis: oab_testkit::redis::RedisServer,
        relay: std::net::SocketAddr,
        (in_process, process): (Option<Relay>, Option<RelayProcess>),
        (a_extra, b_extra): (&str, &str),
        policy: &str,
    ) -> World {
        let dir = tempfile::tempdir().unwrap();
        let (pa, pb) = (free_port(), free_port());
        let a = start_connector(&config(&env, dir.path(), relay, "a", pa, (a_extra, policy)));
        let b = start_connector(&config(&env, dir.path(), relay, "b", pb, (b_extra, policy)));
        for port in [pa, pb] {
            let until = tokio::time::Instant::now() + STEP;
            while TcpStream::connect(("127.0.0.1", port)).await.is_err() {
                assert!(
                    tokio::time::Instant::now() < until,
                    "endpoint {port} never came up"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        World {
            _redis: redis,
            _relay: in_process,
            process,
            _dir: dir,
            a,
            b,
            pa,
            pb,
        }
    }

    async fn primary(&self) -> Cp {
        let mut cp = Cp::connect(self.pa, PRIMARY_KEY).await.unwrap();
        let r = cp
            .register("prod", "koudu", "primary", "i-primary-1", 1)
            .await;
        assert!(r.get("result").is_some(), "{r}");
        cp
    }

    async fn worker(&self, instance: &str, max: u32) -> Cp {
        let mut cp = Cp::connect(self.pb, WORKER_KEY).await.unwrap();
        let r = cp
            .register("prod", "reviewer", "worker", instance, max)
            .await;
        assert!(r.get("result").is_some(), "{r}");
        cp
    }

    async fn stop(mut self) {
        let _ = self.a.kill().await;
        let _ = self.b.kill().await;
    }
}

/// A CP client: one WebSocket, JSON-RPC 2.0.
struct Cp {
    ws: WebSocketStream<TcpStream>,
    next: u64,
    /// Requests from the endpoint read while waiting for a response.
    requests: VecDeque<Value>,
    /// `cp/delegate_result`s read while waiting for another delegation's
    /// (results come in the order delegations end, not the order asked).
    results: Vec<Value>,
}

impl Cp {
    /// Connects with `key`; an upgrade refusal returns its HTTP status.
    async fn connect(port: u16, key: &str) -> Result<Cp, u16> {
        let tcp = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
        let mut req = format!("ws://127.0.0.1:{port}/cp")
            .into_client_request()
            .unwrap();
        req.headers_mut()
            .insert("authorization", format!("Bearer {key}").parse().unwrap());
        match tokio_tungstenite::client_async(req, tcp).await {
            Ok((ws, _)) => Ok(Cp {
                ws,
                next: 1,
                requests: VecDeque::new(),
                results: Vec::new(),
            }),
            Err(tokio_tungstenite::tungstenite::Error::Http(resp)) => Err(resp.status().as_u16()),
            Err(e) => panic!("unexpected handshake error: {e}"),
        }
    }

    /// Connects with `key` expecting a refusal of the upgrade: its HTTP
    /// status and body.
    async fn refused(port: u16, key: &str) -> (u16, String) {
        let tcp = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
        let mut req = format!("ws://127.0.0.1:{port}/cp")
            .into_client_request()
            .unwrap();
        req.headers_mut()
            .insert("authorization", format!("Bearer {key}").parse().unwrap());
        match tokio_tungstenite::client_async(req, tcp).await {
            Ok(_) => panic!("the upgrade was accepted"),
            Err(tokio_tungstenite::tungstenite::Error::Http(resp)) => (
                resp.status().as_u16(),
                String::from_utf8_lossy(resp.body().as_deref().unwrap_or_default()).into_owned(),
            ),
            Err(e) => panic!("unexpected handshake error: {e}"),
        }
    }

    async fn send(&mut self, v: Value) {
        self.ws.send(Message::text(v.to_string())).await.unwrap();
    }

    /// The next JSON message; `None` when the connection closed.
    async fn read(&mut self) -> Option<Value> {
        loop {
            let msg = tokio::time::timeout(STEP, self.ws.next())
                .await
                .expect("a frame within the step")?;
            match msg {
                Ok(Message::Text(t)) => return Some(serde_json::from_str(t.as_str()).unwrap()),
                Ok(Message::Close(_)) | Err(_) => return None,
                Ok(_) => {}
            }
        }
    }

    /// Sends a request and returns its response (requests seen meanwhile
    /// are kept for [`Cp::request`]).
    async fn call(&mut self, method: &str, params: Value) -> Value {
        let id = self.next;
        self.next += 1;
        self.send(json!({ "jsonrpc": "2.0", "id": id, "method": method, "params": params }))
            .await;
        loop {
            let m = self
                .read()
                .await
                .expect("the connection closed before the response");
            if m.get("method").is_some() {
                self.requests.push_back(m);
            } else if m["id"] == json!(id) {
                return m;
            }
        }
    }

    /// The next request from the endpoint with `method`, answered with
    /// `{"ok": true}` as an OAB runtime does.
    async fn request(&mut self, method: &str) -> Value {
        loop {
            let m = match self.requests.pop_front() {
                Some(m) => m,
                None => self.read().await.expect("the connection closed"),
            };
            if m.get("method").is_none() {
                continue;
            }
            let id = m["id"].clone();
            self.send(json!({ "jsonrpc": "2.0", "id": id, "result": { "ok": true } }))
                .await;
            if m["method"] == method {
                return m["params"].clone();
            }
        }
    }

    async fn register(
        &mut self,
        ns: &str,
        name: &str,
        kind: &str,
        instance: &str,
        max: u32,
    ) -> Value {
        self.call(
            "cp/register",
            json!({
                "protocol_version": 1,
                "namespace": ns,
                "name": name,
                "type": kind,
                "instance_id": instance,
                "labels": {},
                "max_delegated_sessions": max,
            }),
        )
        .await
    }

    async fn delegate(&mut self, id: &str, target: &str, prompt: &str) -> Value {
        self.delegate_within(id, target, prompt, 60_000).await
    }

    async fn delegate_within(&mut self, id: &str, target: &str, prompt: &str, ms: u64) -> Value {
        let deadline = oab_connector::a2a::model::iso_from_ms(oab_wire::identity::now_ms() + ms);
        self.call(
            "cp/delegate",
            json!({
                "delegation_id": id,
                "target": { "name": target },
                "prompt": prompt,
                "deadline": deadline,
            }),
        )
        .await
    }

    /// `cp/delegate` naming `parent` (its delegation id and admission) as
    /// the parent, with a deadline 30 s away.
    async fn delegate_under(&mut self, id: &str, target: &str, parent: (&str, &Value)) -> Value {
        let deadline =
            oab_connector::a2a::model::iso_from_ms(oab_wire::identity::now_ms() + 30_000);
        self.call(
            "cp/delegate",
            json!({
                "delegation_id": id,
                "target": { "name": target },
                "prompt": format!("child {id}"),
                "deadline": deadline,
                "parent_delegation_id": parent.0,
                "parent_admission": parent.1,
            }),
        )
        .await
    }

    async fn result_for(&mut self, delegation_id: &str) -> Value {
        if let Some(i) = self
            .results
            .iter()
            .position(|p| p["delegation_id"] == delegation_id)
        {
            return self.results.remove(i);
        }
        loop {
            let p = self.request("cp/delegate_result").await;
            if p["delegation_id"] == delegation_id {
                return p;
            }
            self.results.push(p);
        }
    }
}

fn error_code(v: &Value) -> i64 {
    v["error"]["code"]
        .as_i64()
        .unwrap_or_else(|| panic!("not an error: {v}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registration_checks_the_key_the_claims_the_version_and_the_deadline() {
    let w = World::start().await;
    // A missing or unknown key is refused at the upgrade.
    assert_eq!(Cp::connect(w.pa, "k-wrong").await.err(), Some(401));
    assert_eq!(Cp::connect(w.pa, "").await.err(), Some(401));
    // The key's identity, the CP's lease figures.
    let mut p = Cp::connect(w.pa, PRIMARY_KEY).await.unwrap();
    let r = p.register("prod", "koudu", "primary", "i-1", 1).await;
    assert_eq!(r["result"]["protocol_version"], 1);
    assert_eq!(r["result"]["heartbeat_interval_secs"], 15);
    assert_eq!(r["result"]["lease_expiry_secs"], 45);
    let hb = p
        .call("cp/heartbeat", json!({ "instance_id": "i-1" }))
        .await;
    assert_eq!(hb["result"]["ok"], true, "{hb}");
    // A second register on the same connection is refused.
    let again = p.register("prod", "koudu", "primary", "i-1", 1).await;
    assert_eq!(error_code(&again), -32600);
    // Claims other than the key's identity.
    let mut q = Cp::connect(w.pa, PRIMARY_KEY).await.unwrap();
    let r = q
        .register("prod", "someone-else", "primary", "i-2", 1)
        .await;
    assert_eq!(error_code(&r), -32002, "{r}");
    assert!(q.read().await.is_none(), "closed after the refusal");
    let mut q = Cp::connect(w.pa, PRIMARY_KEY).await.unwrap();
    let r = q.register("prod", "koudu", "worker", "i-2", 1).await;
    assert_eq!(error_code(&r), -32002, "{r}");
    // Another protocol version.
    let mut q = Cp::connect(w.pa, PRIMARY_KEY).await.unwrap();
    let r = q
        .call(
            "cp/register",
            json!({ "protocol_version": 2, "namespace": "prod", "name": "koudu",
                    "type": "primary", "instance_id": "i-3" }),
        )
        .await;
    assert_eq!(error_code(&r), -32009, "{r}");
    // Anything before cp/register.
    let mut q = Cp::connect(w.pa, PRIMARY_KEY).await.unwrap();
    let r = q
        .call("cp/heartbeat", json!({ "instance_id": "i-4" }))
        .await;
    assert_eq!(error_code(&r), -32001, "{r}");
    // No register within register_timeout_secs (2 s here): closed 1008.
    let mut idle = Cp::connect(w.pa, PRIMARY_KEY).await.unwrap();
    let closed = tokio::time::timeout(STEP, idle.ws.next()).await.unwrap();
    match closed {
        Some(Ok(Message::Close(Some(f)))) => {
            assert_eq!(u16::from(f.code), 1008);
            assert_eq!(f.reason.as_str(), "registration timeout");
        }
        other => panic!("expected a 1008 close, got {other:?}"),
    }
    w.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delegation_completes_with_the_workers_text_and_fails_with_its_error() {
    let w = World::start().await;
    let mut worker = w.worker("i-w1", 4).await;
    let mut primary = w.primary().await;

    let ack = primary.delegate("d-1", "reviewer", "review PR 7").await;
    assert_eq!(ack["result"]["delegation_id"], "d-1", "{ack}");
    assert!(ack["result"]["admission"].is_u64(), "{ack}");
    // What openab-cp answers: the worker's logical id; the remote host
    // in a field of its own.
    assert_eq!(ack["result"]["assigned_to"], "prod/reviewer", "{ack}");
    assert_eq!(ack["result"]["assigned_peer"], "acme/callee", "{ack}");

    // The worker gets what openab-cp would hand it: the initiator's id and
    // admission unchanged, `from` and `chain` as the initiating runtime.
    let fwd = worker.request("cp/delegate").await;
    assert_eq!(fwd["delegation_id"], "d-1", "{fwd}");
    assert_eq!(fwd["admission"], ack["result"]["admission"], "{fwd}");
    assert_eq!(fwd["prompt"], "review PR 7");
    assert_eq!(fwd["from"], "prod/koudu");
    assert_eq!(fwd["chain"], json!(["prod/koudu"]));
    assert_eq!(fwd["from_peer"], "acme/caller");
    assert!(fwd["deadline"].as_str().unwrap().ends_with('Z'));
    let admission = fwd["admission"].clone();
    let done = worker
        .call(
            "cp/delegate_result",
            json!({ "delegation_id": fwd["delegation_id"], "admission": admission,
                    "status": "completed", "result": "LGTM, two nits" }),
        )
        .await;
    assert_eq!(done["result"]["ok"], true);
    let r = primary.result_for("d-1").await;
    assert_eq!(r["status"], "completed", "{r}");
    assert_eq!(r["result"], "LGTM, two nits");
    assert_eq!(r["admission"], ack["result"]["admission"]);

    // The same id again, now that d-1 ended, is a new delegation; it fails.
    let ack = primary.delegate("d-1", "reviewer", "review PR 8").await;
    assert!(ack.get("result").is_some(), "{ack}");
    let fwd = worker.request("cp/delegate").await;
    worker
        .call(
            "cp/delegate_result",
            json!({ "delegation_id": fwd["delegation_id"], "admission": fwd["admission"],
                    "status": "failed", "error": "the build is red" }),
        )
        .await;
    let r = primary.result_for("d-1").await;
    assert_eq!(r["status"], "failed", "{r}");
    assert_eq!(r["error"], "the build is red");
    w.stop().await;
}

/// Reads the primary's `cp/delegate_result`s until `id`'s, which must be
/// completed with `text`; none of them may be for an id in `never`.
async fn only_result_is(primary: &mut Cp, id: &str, text: &str, never: &[&str]) {
    loop {
        let p = primary.request("cp/delegate_result").await;
        let got = p["delegation_id"].as_str().unwrap_or_default();
        assert!(!never.contains(&got), "a result for {got}: {p}");
        if got == id {
            assert_eq!(p["status"], "completed", "{p}");
            assert_eq!(p["result"], text, "{p}");
            return;
        }
    }
}

/// Answers `fwd` as a worker does: completed with "done: <prompt>".
async fn complete(worker: &mut Cp, fwd: &Value) -> Value {
    worker
        .call(
            "cp/delegate_result",
            json!({ "delegation_id": fwd["delegation_id"], "admission": fwd["admission"],
                    "status": "completed",
                    "result": format!("done: {}", fwd["prompt"].as_str().unwrap_or_default()) }),
        )
        .await
}

/// As on openab-cp: `cp/cancel` is answered `{"ok": true}`, reaches the
/// worker as `cp/cancel` with the delegation's id and admission, frees the
/// id at once, and no `cp/delegate_result` ever follows for it, even when
/// the worker answers anyway.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_mid_task_reaches_the_worker_and_no_result_follows() {
    let w = World::start().await;
    let mut worker = w.worker("i-w1", 4).await;
    let mut primary = w.primary().await;
    let ack = primary.delegate("d-c", "reviewer", "long review").await;
    let admission = ack["result"]["admission"].clone();
    let fwd = worker.request("cp/delegate").await;
    let c = primary
        .call(
            "cp/cancel",
            json!({ "delegation_id": "d-c", "admission": admission, "reason": "user gave up" }),
        )
        .await;
    assert_eq!(c["result"]["ok"], true, "{c}");
    let cancel = worker.request("cp/cancel").await;
    assert_eq!(cancel["delegation_id"], "d-c");
    assert_eq!(cancel["admission"], fwd["admission"]);
    // A second cancel of it is refused: it is no longer in flight.
    let again = primary
        .call(
            "cp/cancel",
            json!({ "delegation_id": "d-c", "admission": admission, "reason": "x" }),
        )
        .await;
    assert_eq!(error_code(&again), -32003, "{again}");
    // The worker answers anyway; the endpoint acknowledges and drops it.
    let late = complete(&mut worker, &fwd).await;
    assert_eq!(late["result"]["ok"], true, "{late}");
    // The id is free again at once, and the next round trip on the same
    // connection brings its own result and none for the cancelled one.
    let ack2 = primary.delegate("d-c", "reviewer", "short review").await;
    assert!(ack2.get("result").is_some(), "{ack2}");
    assert_ne!(ack2["result"]["admission"], admission);
    let fwd2 = worker.request("cp/delegate").await;
    assert_eq!(fwd2["admission"], ack2["result"]["admission"]);
    complete(&mut worker, &fwd2).await;
    let r = primary.result_for("d-c").await;
    assert_eq!(r["result"], "done: short review", "{r}");
    assert_eq!(r["admission"], ack2["result"]["admission"], "{r}");
    let ack3 = primary.delegate("d-after", "reviewer", "after").await;
    assert!(ack3.get("result").is_some(), "{ack3}");
    let fwd3 = worker.request("cp/delegate").await;
    complete(&mut worker, &fwd3).await;
    only_result_is(&mut primary, "d-after", "done: after", &["d-c"]).await;
    // A cancel for a delegation not in flight is refused as the CP does.
    let c = primary
        .call(
            "cp/cancel",
            json!({ "delegation_id": "d-none", "admission": 1, "reason": "x" }),
        )
        .await;
    assert_eq!(error_code(&c), -32003);
    assert_eq!(
        c["error"]["message"],
        "delegation is not in flight for this instance"
    );
    w.stop().await;
}

/// As on openab-cp, a primary whose connection ends has its delegations
/// cancelled: the remote worker gets `cp/cancel` within one second, and
/// the result the worker gives anyway reaches nobody, not even the same
/// instance registering again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_that_leaves_has_its_delegations_cancelled_at_the_remote_worker() {
    let w = World::start().await;
    let mut worker = w.worker("i-w1", 4).await;
    let mut primary = w.primary().await;
    let mut fwds = Vec::new();
    for id in ["d-left-1", "d-left-2"] {
        let ack = primary.delegate(id, "reviewer", id).await;
        assert!(ack.get("result").is_some(), "{ack}");
        fwds.push(worker.request("cp/delegate").await);
    }
    let left = tokio::time::Instant::now();
    drop(primary);
    let mut cancelled = std::collections::BTreeSet::new();
    while cancelled.len() < 2 {
        let c = worker.request("cp/cancel").await;
        assert!(
            left.elapsed() < Duration::from_secs(1),
            "cp/cancel reached the worker {:?} after the primary left",
            left.elapsed()
        );
        let fwd = fwds
            .iter()
            .find(|f| f["delegation_id"] == c["delegation_id"])
            .unwrap_or_else(|| panic!("a cancel for no delegation: {c}"));
        assert_eq!(c["admission"], fwd["admission"], "{c}");
        cancelled.insert(c["delegation_id"].as_str().unwrap().to_string());
    }
    // The worker answers both anyway.
    for fwd in &fwds {
        let ok = complete(&mut worker, fwd).await;
        assert_eq!(ok["result"]["ok"], true, "{ok}");
    }
    // The same instance comes back: its next round trip brings only its
    // own result.
    let mut back = w.primary().await;
    let ack = back.delegate("d-back", "reviewer", "back").await;
    assert!(ack.get("result").is_some(), "{ack}");
    let fwd = worker.request("cp/delegate").await;
    complete(&mut worker, &fwd).await;
    only_result_is(&mut back, "d-back", "done: back", &["d-left-1", "d-left-2"]).await;
    w.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_carry_the_cps_error_codes() {
    let w = World::start().await;
    let mut primary = w.primary().await;
    // A target no [[openab.targets]] entry maps.
    const NO_TARGET: &str = "no registered healthy runtime matches the target selector";
    const SATURATED: &str =
        "all matching runtimes are at capacity (CP does not queue; retry later)";
    let r = primary.delegate("d-u", "unmapped", "x").await;
    assert_eq!(error_code(&r), -32004, "{r}");
    assert_eq!(r["error"]["message"], NO_TARGET, "{r}");
    // Mapped, but no worker on host B matches it: the remote side refuses,
    // in the CP's words.
    let r = primary.delegate("d-n", "nobody-home", "x").await;
    assert_eq!(error_code(&r), -32004, "{r}");
    assert_eq!(r["error"]["message"], NO_TARGET, "{r}");
    // Deadlines past, and beyond the 1800 s cap.
    let r = primary
        .delegate_within("d-far", "reviewer", "x", 1_900_000)
        .await;
    assert_eq!(error_code(&r), -32003, "{r}");
    assert_eq!(
        r["error"]["message"],
        "deadline exceeds the CP cap of 1800s"
    );
    let past = oab_connector::a2a::model::iso_from_ms(oab_wire::identity::now_ms() - 1_000);
    let r = primary
        .call(
            "cp/delegate",
            json!({ "delegation_id": "d-past", "target": { "name": "reviewer" },
                    "prompt": "x", "deadline": past }),
        )
        .await;
    assert_eq!(error_code(&r), -32003, "{r}");
    assert_eq!(r["error"]["message"], "deadline is in the past");
    // A parent the primary does not serve (a primary serves none).
    let r = primary
        .delegate_under("d-2", "reviewer", ("d-1", &json!(1)))
        .await;
    assert_eq!(error_code(&r), -32602, "{r}");
    assert_eq!(
        r["error"]["message"],
        "parent delegation d-1 is not in flight for this instance"
    );
    // A worker may not initiate.
    let mut helper = Cp::connect(w.pa, "k-helper-0123456789").await.unwrap();
    let reg = helper.register("prod", "helper", "worker", "i-h", 1).await;
    assert!(reg.get("result").is_some(), "{reg}");
    let r = helper.delegate("d-h", "reviewer", "x").await;
    assert_eq!(error_code(&r), -32003, "{r}");
    assert_eq!(
        r["error"]["message"],
        "workers may not initiate delegations in this namespace"
    );

    // Prompts past the CP's cap (256 KiB) within the frame limit (1 MiB):
    // invalid params, nothing sent; the primary's connection stays up. (A
    // message over the frame limit closes the sender's own connection, as
    // on openab-cp.)
    for size in [256 * 1024 + 1, 900_000] {
        let r = primary
            .delegate(&format!("d-long-{size}"), "reviewer", &"p".repeat(size))
            .await;
        assert_eq!(error_code(&r), -32602, "{size} bytes: {r:.200}");
        assert!(
            r["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("max_prompt_bytes")),
            "{r:.200}"
        );
    }
    // Saturated: the only worker holds its one session; duplicate ids.
    let mut worker = w.worker("i-w1", 1).await;
    let first = primary.delegate("d-s1", "reviewer", "first").await;
    assert!(first.get("result").is_some(), "{first}");
    let _held = worker.request("cp/delegate").await;
    let dup = primary.delegate("d-s1", "reviewer", "again").await;
    assert_eq!(error_code(&dup), -32008, "{dup}");
    assert_eq!(
        dup["error"]["message"],
        "delegation d-s1 is already in flight"
    );
    let second = primary.delegate("d-s2", "reviewer", "second").await;
    assert_eq!(error_code(&second), -32005, "{second}");
    assert_eq!(second["error"]["message"], SATURATED, "{second}");
    w.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_disconnects_mid_task_ends_it_target_disconnected() {
    let w = World::start().await;
    let mut worker = w.worker("i-w1", 4).await;
    let mut primary = w.primary().await;
    let ack = primary.delegate("d-x", "reviewer", "work").await;
    assert!(ack.get("result").is_some(), "{ack}");
    let _fwd = worker.request("cp/delegate").await;
    drop(worker);
    let r = primary.result_for("d-x").await;
    assert_eq!(r["status"], "target_disconnected", "{r}");
    w.stop().await;
}

/// The environment variable that makes [`cp_worker_process`] act (the
/// parent test sets it): `<port> <instance_id>`.
const CP_WORKER_ENV: &str = "OPENAB_TEST_CP_WORKER";

/// A CP worker as its own OS process: this test binary run again with
/// only [`cp_worker_process`] selected.
struct WorkerProcess {
    child: tokio::process::Child,
    lines: tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStdout>>,
}

impl WorkerProcess {
    /// Starts a worker registering on host B's endpoint as `instance`;
    /// returns once it is registered.
    async fn start(port: u16, instance: &str) -> WorkerProcess {
        use tokio::io::AsyncBufReadExt as _;
        let mut child = tokio::process::Command::new(std::env::current_exe().unwrap())
            .args(["cp_worker_process", "--exact", "--ignored", "--nocapture"])
            .args(["--test-threads", "1"])
            .env(CP_WORKER_ENV, format!("{port} {instance}"))
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
        let mut w = WorkerProcess { child, lines };
        assert_eq!(w.said().await, "registered");
        w
    }

    /// The next thing the worker printed after its `cp-worker: ` prefix.
    async fn said(&mut self) -> String {
        loop {
            let line = tokio::time::timeout(STEP, self.lines.next_line())
                .await
                .expect("a line within the step")
                .unwrap()
                .expect("the worker process ended");
            // libtest's own "test cp_worker_process ... " may precede it.
            if let Some((_, rest)) = line.split_once("cp-worker: ") {
                return rest.to_string();
            }
        }
    }

    /// `kill -9`: no close frame, no goodbye.
    async fn kill(mut self) {
        self.child.kill().await.unwrap();
    }
}

/// Not a test: the body of [`WorkerProcess`]. Registers as
/// `prod/reviewer`, prints `cp-worker: registered`, then for each
/// `cp/delegate` prints `cp-worker: delegate <prompt>` and, unless the
/// prompt starts with "hold", answers `completed` with "done: <prompt>".
#[tokio::test]
#[ignore = "a CP worker process the restart test starts; does nothing on its own"]
async fn cp_worker_process() {
    let Ok(args) = std::env::var(CP_WORKER_ENV) else {
        return;
    };
    let (port, instance) = args.split_once(' ').unwrap();
    let mut cp = Cp::connect(port.parse().unwrap(), WORKER_KEY)
        .await
        .unwrap();
    let r = cp.register("prod", "reviewer", "worker", instance, 4).await;
    assert!(r.get("result").is_some(), "{r}");
    println!("cp-worker: registered");
    loop {
        let fwd = cp.request("cp/delegate").await;
        let prompt = fwd["prompt"].as_str().unwrap_or_default().to_string();
        println!("cp-worker: delegate {prompt}");
        if !prompt.starts_with("hold") {
            cp.call(
                "cp/delegate_result",
                json!({ "delegation_id": fwd["delegation_id"], "admission": fwd["admission"],
                        "status": "completed", "result": format!("done: {prompt}") }),
            )
            .await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_process_killed_mid_task_ends_it_target_disconnected_once_and_its_restart_serves()
{
    let w = World::start().await;
    let mut worker = WorkerProcess::start(w.pb, "i-proc-1").await;
    let mut primary = w.primary().await;
    let ack = primary.delegate("d-9", "reviewer", "hold on").await;
    assert!(ack.get("result").is_some(), "{ack}");
    assert_eq!(worker.said().await, "delegate hold on");
    worker.kill().await;
    let r = primary.result_for("d-9").await;
    assert_eq!(r["status"], "target_disconnected", "{r}");

    // The worker comes back as a new process (a new instance id) and
    // serves the next delegation; d-9 gets no second result meanwhile.
    let mut worker = WorkerProcess::start(w.pb, "i-proc-2").await;
    let ack = primary.delegate("d-10", "reviewer", "after restart").await;
    assert!(ack.get("result").is_some(), "{ack}");
    assert_eq!(worker.said().await, "delegate after restart");
    loop {
        let p = primary.request("cp/delegate_result").await;
        assert_ne!(p["delegation_id"], "d-9", "a second result for d-9: {p}");
        if p["delegation_id"] == "d-10" {
            assert_eq!(p["status"], "completed", "{p}");
            assert_eq!(p["result"], "done: after restart");
            break;
        }
    }
    worker.kill().await;
    w.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadline_that_passes_ends_timeout_and_cancels_the_worker() {
    let w = World::start().await;
    let mut worker = w.worker("i-w1", 4).await;
    let mut primary = w.primary().await;
    let ack = primary
        .delegate_within("d-t", "reviewer", "slow", 3_000)
        .await;
    assert!(ack.get("result").is_some(), "{ack}");
    let fwd = worker.request("cp/delegate").await;
    // The worker never answers.
    let r = primary.result_for("d-t").await;
    assert_eq!(r["status"], "timeout", "{r}");
    let cancel = worker.request("cp/cancel").await;
    assert_eq!(cancel["delegation_id"], fwd["delegation_id"]);
    w.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_whose_lease_lapses_is_closed_and_its_task_ends_target_disconnected() {
    let w = World::start_with("heartbeat_interval_secs = 1\nlease_expiry_secs = 2").await;
    let mut worker = w.worker("i-w1", 4).await;
    let mut primary = w.primary().await;
    let ack = primary.delegate("d-l", "reviewer", "work").await;
    assert!(ack.get("result").is_some(), "{ack}");
    let _fwd = worker.request("cp/delegate").await;
    // No heartbeat: the endpoint closes the connection 1008 "lease expired".
    let closed = tokio::time::timeout(STEP, worker.ws.next()).await.unwrap();
    match closed {
        Some(Ok(Message::Close(Some(f)))) => {
            assert_eq!(u16::from(f.code), 1008);
            assert_eq!(f.reason.as_str(), "lease expired");
        }
        other => panic!("expected a 1008 close, got {other:?}"),
    }
    let r = primary.result_for("d-l").await;
    assert_eq!(r["status"], "target_disconnected", "{r}");
    w.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_result_over_256_kib_is_cut_to_the_cap_with_the_cps_marker() {
    let w = World::start().await;
    let mut worker = w.worker("i-w1", 4).await;
    let mut primary = w.primary().await;
    let ack = primary.delegate("d-big", "reviewer", "say a lot").await;
    assert!(ack.get("result").is_some(), "{ack}");
    let fwd = worker.request("cp/delegate").await;
    let big = "x".repeat(256 * 1024 + 1);
    worker
        .call(
            "cp/delegate_result",
            json!({ "delegation_id": fwd["delegation_id"], "admission": fwd["admission"],
                    "status": "completed", "result": big }),
        )
        .await;
    let r = primary.result_for("d-big").await;
    assert_eq!(r["status"], "completed");
    let text = r["result"].as_str().unwrap();
    assert!(text.len() <= 256 * 1024, "{} bytes", text.len());
    assert!(text.starts_with("xxxx"));
    assert!(
        text.ends_with("[truncated by control plane: 262145 bytes total]"),
        "{}",
        &text[text.len() - 80..]
    );
    w.stop().await;
}

/// A worker whose result message is over `max_frame_bytes` (2 MB and
/// 20 MB of text) loses its own connection, as on openab-cp: its delegation
/// ends `target_disconnected` at the primary, and host B's link to the
/// relay, and another worker's delegation, go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_result_over_the_frame_limit_closes_only_that_worker() {
    let w = World::start().await;
    let mut primary = w.primary().await;
    for (i, size) in [2_000_000usize, 20_000_000].into_iter().enumerate() {
        let mut worker = w.worker(&format!("i-big-{i}"), 4).await;
        let id = format!("d-huge-{i}");
        let ack = primary.delegate(&id, "reviewer", "say far too much").await;
        assert!(ack.get("result").is_some(), "{ack}");
        let fwd = worker.request("cp/delegate").await;
        // The endpoint may cut the connection before the message is sent.
        let big = json!({ "jsonrpc": "2.0", "id": 99, "method": "cp/delegate_result",
            "params": { "delegation_id": fwd["delegation_id"], "admission": fwd["admission"],
                        "status": "completed", "result": "x".repeat(size) } });
        let _ = worker.ws.send(Message::text(big.to_string())).await;
        assert!(
            worker.read().await.is_none(),
            "{size} bytes: the worker's connection is closed"
        );
        let r = primary.result_for(&id).await;
        assert_eq!(r["status"], "target_disconnected", "{size} bytes: {r}");
    }
    // Host B still serves: a new worker completes a delegation.
    let mut worker = w.worker("i-after", 4).await;
    let ack = primary.delegate("d-after", "reviewer", "small").await;
    assert!(ack.get("result").is_some(), "{ack}");
    let fwd = worker.request("cp/delegate").await;
    worker
        .call(
            "cp/delegate_result",
            json!({ "delegation_id": fwd["delegation_id"], "admission": fwd["admission"],
                    "status": "completed", "result": "fine" }),
        )
        .await;
    let r = primary.result_for("d-after").await;
    assert_eq!(r["status"], "completed", "{r}");
    w.stop().await;
}

/// The relay is a real `oab-relay` process on the real redis-server,
/// `kill -9`ed while the worker holds two tasks and started again on the
/// same address: one task ends while the relay is down, the other after it
/// is back. Each reaches the primary as exactly one `cp/delegate_result`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_killed_mid_task_and_restarted_still_gives_exactly_one_result() {
    let mut w = World::start_relay_process().await;
    let mut worker = w.worker("i-w1", 4).await;
    let mut primary = w.primary().await;
    let mut held = Vec::new();
    for id in ["d-down", "d-back"] {
        let ack = primary.delegate(id, "reviewer", id).await;
        assert!(ack.get("result").is_some(), "{ack}");
        held.push(worker.request("cp/delegate").await);
    }
    let answer = |fwd: &Value| {
        json!({ "delegation_id": fwd["delegation_id"], "admission": fwd["admission"],
                "status": "completed", "result": format!("done: {}", fwd["prompt"].as_str().unwrap()) })
    };

    // The worker holds both; the relay dies. One ends while it is down.
    let relay = w.process.as_mut().unwrap();
    relay.kill().await;
    let ok = worker.call("cp/delegate_result", answer(&held[0])).await;
    assert_eq!(ok["result"]["ok"], true, "{ok}");
    // Back on the same address, config and Redis; the other ends now.
    relay.restart().await;
    let ok = worker.call("cp/delegate_result", answer(&held[1])).await;
    assert_eq!(ok["result"]["ok"], true, "{ok}");

    // The first result the primary gets for each is the worker's.
    let mut seen = std::collections::HashMap::new();
    while seen.len() < 2 {
        let p = primary.request("cp/delegate_result").await;
        let id = p["delegation_id"].as_str().unwrap().to_string();
        assert_eq!(p["status"], "completed", "{p}");
        assert_eq!(p["result"], format!("done: {id}"), "{p}");
        assert!(seen.insert(id, p.clone()).is_none(), "a second result: {p}");
    }

    // A later delegation makes a full round trip through the restarted
    // relay on the same connections; no second result for either arrives
    // before (or with) its result.
    let ack = primary.delegate("d-after", "reviewer", "d-after").await;
    assert!(ack.get("result").is_some(), "{ack}");
    let fwd = worker.request("cp/delegate").await;
    let ok = worker.call("cp/delegate_result", answer(&fwd)).await;
    assert_eq!(ok["result"]["ok"], true, "{ok}");
    loop {
        let p = primary.request("cp/delegate_result").await;
        assert!(
            !seen.contains_key(p["delegation_id"].as_str().unwrap()),
            "a second result: {p}"
        );
        if p["delegation_id"] == "d-after" {
            assert_eq!(p["result"], "done: d-after", "{p}");
            break;
        }
    }
    w.stop().await;
}

/// Silent local TCP connections (no request, so no key shown) neither hold
/// the runtimes' connection slots nor stay open: a worker registers while
/// three times `max_connections` of them are open, and each of them is
/// closed, shed by newer ones or at `upgrade_timeout_ms`. (Before, 64 such
/// connections held every slot until `register_timeout_secs`, renewably.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_connections_do_not_keep_runtimes_out_and_are_closed() {
    use tokio::io::AsyncReadExt as _;
    // A long registration deadline: it no longer bounds a silent connection.
    let w = World::start_with("register_timeout_secs = 60\nupgrade_timeout_ms = 1000\n").await;
    let mut silent = tokio::task::JoinSet::new();
    for _ in 0..3 * 64 {
        let tcp = TcpStream::connect(("127.0.0.1", w.pb)).await.unwrap();
        silent.spawn(async move {
            let mut tcp = tcp;
            let mut buf = [0u8; 64];
            // Until the endpoint closes it.
            loop {
                match tcp.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {}
                }
            }
        });
    }
    let mut worker = tokio::time::timeout(STEP, w.worker("i-w-silent", 1))
        .await
        .expect("the worker registers while silent connections are open");
    let hb = worker
        .call("cp/heartbeat", json!({ "instance_id": "i-w-silent" }))
        .await;
    assert_eq!(hb["result"]["ok"], true, "{hb}");
    let closed =
        tokio::time::timeout(STEP, async { while silent.join_next().await.is_some() {} }).await;
    assert!(closed.is_ok(), "silent connections stayed open");
    // The registered worker is not one of them.
    let hb = worker
        .call("cp/heartbeat", json!({ "instance_id": "i-w-silent" }))
        .await;
    assert_eq!(hb["result"]["ok"], true, "{hb}");
    w.stop().await;
}

/// The agent with `name` in a `cp/list_agents` answer.
fn agent<'a>(list: &'a Value, name: &str) -> &'a Value {
    list["result"]["agents"]
        .as_array()
        .and_then(|a| a.iter().find(|x| x["name"] == name))
        .unwrap_or_else(|| panic!("no {name} in {list}"))
}

/// `cp/list_agents` as on openab-cp (`{namespace, agents: [{name, type,
/// instance_id, labels, active_sessions, max_delegated_sessions}]}`): on
/// host A the registered runtimes of the namespace and the remote targets
/// (named by their peer, their sessions counted here), on host B the
/// worker with the sessions it serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_agents_shows_the_local_runtimes_and_the_remote_targets() {
    let w = World::start().await;
    let mut worker = w.worker("i-w1", 3).await;
    let mut primary = w.primary().await;

    let list = primary.call("cp/list_agents", json!({})).await;
    assert_eq!(list["result"]["namespace"], "prod", "{list}");
    let me = agent(&list, "koudu");
    assert_eq!(me["type"], "primary");
    assert_eq!(me["instance_id"], "i-primary-1");
    assert_eq!(me["active_sessions"], 0);
    let reviewer = agent(&list, "reviewer");
    assert_eq!(reviewer["type"], "worker", "{reviewer}");
    assert_eq!(reviewer["instance_id"], "acme/callee", "{reviewer}");
    assert_eq!(reviewer["peer"], "acme/callee", "{reviewer}");
    assert_eq!(reviewer["labels"], json!({}), "{reviewer}");
    assert_eq!(reviewer["active_sessions"], 0, "{reviewer}");
    assert_eq!(reviewer["max_delegated_sessions"], 1024, "{reviewer}");
    assert_eq!(agent(&list, "bounded")["max_delegated_sessions"], 1);
    agent(&list, "nobody-home");

    // One delegation in flight to each of `reviewer` and `bounded` (both
    // served by the one worker on host B).
    for (id, target) in [("d-la", "reviewer"), ("d-lb", "bounded")] {
        let ack = primary.delegate(id, target, id).await;
        assert!(ack.get("result").is_some(), "{ack}");
    }
    let mut held = vec![
        worker.request("cp/delegate").await,
        worker.request("cp/delegate").await,
    ];
    let list = primary.call("cp/list_agents", json!({})).await;
    assert_eq!(agent(&list, "reviewer")["active_sessions"], 1, "{list}");
    assert_eq!(agent(&list, "bounded")["active_sessions"], 1, "{list}");
    // `bounded` is at its max_delegated_sessions: SATURATED, not queued.
    let r = primary.delegate("d-lc", "bounded", "more").await;
    assert_eq!(error_code(&r), -32005, "{r}");

    let mine = worker.call("cp/list_agents", json!({})).await;
    assert_eq!(mine["result"]["namespace"], "prod", "{mine}");
    let me = agent(&mine, "reviewer");
    assert_eq!(me["type"], "worker");
    assert_eq!(me["instance_id"], "i-w1");
    assert_eq!(me["active_sessions"], 2, "{mine}");
    assert_eq!(me["max_delegated_sessions"], 3, "{mine}");

    for fwd in held.drain(..) {
        complete(&mut worker, &fwd).await;
    }
    for id in ["d-la", "d-lb"] {
        let r = primary.result_for(id).await;
        assert_eq!(r["status"], "completed", "{r}");
    }
    let list = primary.call("cp/list_agents", json!({})).await;
    assert_eq!(agent(&list, "reviewer")["active_sessions"], 0, "{list}");
    assert_eq!(agent(&list, "bounded")["active_sessions"], 0, "{list}");
    w.stop().await;
}

/// The connection limits refuse the upgrade at once with HTTP 503 and a
/// body naming the limit, as openab-cp refuses an over-quota upgrade:
/// `max_connections_per_identity` per `namespace/name` (registered or not),
/// `max_connections` for all; a place given back is taken again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_limits_refuse_the_upgrade_at_once_with_503() {
    let w =
        World::start_with_both("max_connections = 3\nmax_connections_per_identity = 2", "").await;
    // Two of the primary's identity: one registered, one not.
    let first = w.primary().await;
    let _second = Cp::connect(w.pa, PRIMARY_KEY).await.unwrap();
    let asked = tokio::time::Instant::now();
    let (status, body) = Cp::refused(w.pa, PRIMARY_KEY).await;
    assert!(
        asked.elapsed() < Duration::from_millis(100),
        "refused after {:?}",
        asked.elapsed()
    );
    assert_eq!(status, 503);
    assert_eq!(
        body,
        "identity is at its connection quota (max_connections_per_identity = 2)\n"
    );
    // Another identity has its own quota, until all three places are held.
    let mut helper = Cp::connect(w.pa, HELPER_KEY).await.unwrap();
    let reg = helper.register("prod", "helper", "worker", "i-h", 1).await;
    assert!(reg.get("result").is_some(), "{reg}");
    let asked = tokio::time::Instant::now();
    let (status, body) = Cp::refused(w.pa, PRIMARY2_KEY).await;
    assert!(
        asked.elapsed() < Duration::from_millis(100),
        "refused after {:?}",
        asked.elapsed()
    );
    assert_eq!(status, 503);
    assert_eq!(
        body,
        "control plane is at its connection limit (max_connections = 3)\n"
    );
    // The registered primary leaves: its places are given back once the
    // endpoint has seen the connection end.
    drop(first);
    let until = tokio::time::Instant::now() + STEP;
    let mut again = loop {
        match Cp::connect(w.pa, PRIMARY_KEY).await {
            Ok(cp) => break cp,
            Err(status) => assert_eq!(status, 503),
        }
        assert!(
            tokio::time::Instant::now() < until,
            "the place never came back"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let reg = again
        .register("prod", "koudu", "primary", "i-primary-1", 1)
        .await;
    assert!(reg.get("result").is_some(), "{reg}");
    w.stop().await;
}

/// Two initiators choosing the same `delegation_id` for the same worker:
/// the worker is never handed a second delegation with an id it serves.
/// The second goes to another matching worker when there is one, else it
/// is refused DUPLICATE_DELEGATION, as openab-cp refuses an id in flight in
/// the namespace. Each worker sees the id as its initiator chose it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_id_from_two_initiators_never_reaches_one_worker_twice() {
    let w = World::start().await;
    let mut w1 = w.worker("i-w1", 4).await;
    let mut koudu = w.primary().await;
    let mut koudu2 = Cp::connect(w.pa, PRIMARY2_KEY).await.unwrap();
    let reg = koudu2
        .register("prod", "koudu2", "primary", "i-p2", 1)
        .await;
    assert!(reg.get("result").is_some(), "{reg}");

    let ack = koudu.delegate("d-same", "reviewer", "first").await;
    assert!(ack.get("result").is_some(), "{ack}");
    let fwd1 = w1.request("cp/delegate").await;
    assert_eq!(fwd1["delegation_id"], "d-same");
    assert_eq!(fwd1["from"], "prod/koudu");
    let r = koudu2.delegate("d-same", "reviewer", "second").await;
    assert_eq!(error_code(&r), -32008, "{r}");
    assert_eq!(
        r["error"]["message"],
        "delegation d-same is already in flight"
    );

    // With a second worker the same request is served there.
    let mut w2 = w.worker("i-w2", 4).await;
    let ack2 = koudu2.delegate("d-same", "reviewer", "second").await;
    assert!(ack2.get("result").is_some(), "{ack2}");
    let fwd2 = w2.request("cp/delegate").await;
    assert_eq!(fwd2["delegation_id"], "d-same");
    assert_eq!(fwd2["from"], "prod/koudu2");
    assert_eq!(fwd2["admission"], ack2["result"]["admission"]);

    // Each result reaches its own initiator.
    complete(&mut w2, &fwd2).await;
    complete(&mut w1, &fwd1).await;
    only_result_is(&mut koudu2, "d-same", "done: second", &[]).await;
    only_result_is(&mut koudu, "d-same", "done: first", &[]).await;
    w.stop().await;
}

/// Host B's `[[openab.targets]]` entry towards host A's worker `helper`.
const TARGET_HELPER_ON_A: &str = r#"
[[openab.targets]]
name = "helper-on-a"
peer = "acme/caller"
remote = { name = "helper" }
capabilities = ["read:repo"]

[[openab.targets]]
name = "helper-docs"
peer = "acme/caller"
remote = { name = "helper" }
capabilities = ["read:repo", "read:docs"]
"#;

/// A namespace policy that lets workers start delegations two deep.
const PROD_DEPTH_TWO: &str = r#"
[openab.namespaces.prod]
max_depth = 2
allow_worker_initiation = true
"#;

/// Host A serving host B with its worker `helper`.
const A_SERVES_B: &str = r#"
[[openab.serve]]
peer = "acme/callee"
workers = ["prod/helper"]
"#;

/// A relay route from host B back to host A, `max_depth` deep.
fn route_back(max_depth: u8) -> String {
    format!(
        "[[routes]]\nfrom = \"{CALLEE}\"\nto = \"{CALLER}\"\nmax_depth = {max_depth}\nceiling = [\"read:*\"]\n"
    )
}

impl World {
    /// Host A's worker `helper`, registered.
    async fn helper(&self) -> Cp {
        let mut cp = Cp::connect(self.pa, HELPER_KEY).await.unwrap();
        let r = cp.register("prod", "helper", "worker", "i-helper", 1).await;
        assert!(r.get("result").is_some(), "{r}");
        cp
    }
}

/// openab-cp's defaults (`max_depth` 1, no worker initiation): a worker
/// naming the delegation it serves as parent is refused with the CP's code
/// and text, and nothing reaches the relay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn by_default_a_worker_may_not_start_a_delegation_under_the_one_it_serves() {
    let w = World::start_with(TARGET_HELPER_ON_A).await;
    let mut reviewer = w.worker("i-w1", 2).await;
    let mut primary = w.primary().await;
    let ack = primary.delegate("d-root", "reviewer", "root task").await;
    assert!(ack.get("result").is_some(), "{ack}");
    let fwd = reviewer.request("cp/delegate").await;
    assert_eq!(fwd["chain"], json!(["prod/koudu"]));

    let r = reviewer
        .delegate_under("d-child", "helper-on-a", ("d-root", &fwd["admission"]))
        .await;
    assert_eq!(error_code(&r), -32003, "{r}");
    assert_eq!(
        r["error"]["message"],
        "workers may not initiate delegations in this namespace"
    );
    // The root delegation is untouched by the refusal.
    complete(&mut reviewer, &fwd).await;
    only_result_is(&mut primary, "d-root", "done: root task", &[]).await;
    w.stop().await;
}

/// With `[openab.namespaces.prod] max_depth = 2, allow_worker_initiation =
/// true` on both hosts, `[policy] max_depth = 2` on both and a relay route
/// back allowing depth 2: a worker naming the delegation it serves as
/// parent starts a delegation across the relay whose worker gets the grown
/// chain; a parent it does not serve (unknown id, stale admission) is
/// refused; one level more is over the namespace's `max_depth`; results go
/// back up the chain.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_opted_in_delegates_under_its_parent_and_the_chain_grows_to_the_cap() {
    let a = format!("{PROD_DEPTH_TWO}{A_SERVES_B}");
    let b = format!("{PROD_DEPTH_TWO}{TARGET_HELPER_ON_A}");
    let w = World::start_full(&route_back(2), (&a, &b), "max_depth = 2").await;
    let mut reviewer = w.worker("i-w1", 2).await;
    let mut helper = w.helper().await;
    let mut primary = w.primary().await;
    let ack = primary.delegate("d-root", "reviewer", "root task").await;
    assert!(ack.get("result").is_some(), "{ack}");
    let fwd = reviewer.request("cp/delegate").await;
    assert_eq!(fwd["chain"], json!(["prod/koudu"]));

    // Parents this worker does not serve: one answer for all.
    let stale = json!(fwd["admission"].as_u64().unwrap() + 1);
    for (parent, admission) in [("d-nope", &fwd["admission"]), ("d-root", &stale)] {
        let r = reviewer
            .delegate_under("d-child", "helper-on-a", (parent, admission))
            .await;
        assert_eq!(error_code(&r), -32602, "{r}");
        assert_eq!(
            r["error"]["message"],
            format!("parent delegation {parent} is not in flight for this instance")
        );
    }
    let half = reviewer
        .call(
            "cp/delegate",
            json!({ "delegation_id": "d-child", "target": { "name": "helper-on-a" },
                    "prompt": "x", "deadline": fwd["deadline"], "parent_delegation_id": "d-root" }),
        )
        .await;
    assert_eq!(error_code(&half), -32602, "{half}");

    // A child asking for a capability its parent does not hold.
    let r = reviewer
        .delegate_under("d-child", "helper-docs", ("d-root", &fwd["admission"]))
        .await;
    assert_eq!(error_code(&r), -32003, "{r}");
    assert_eq!(
        r["error"]["message"],
        "the target asks for more than the parent delegation holds: read:docs"
    );

    // The child: accepted, its worker on host A sees the grown chain.
    let ack = reviewer
        .delegate_under("d-child", "helper-on-a", ("d-root", &fwd["admission"]))
        .await;
    assert_eq!(ack["result"]["assigned_to"], "prod/helper", "{ack}");
    let child = helper.request("cp/delegate").await;
    assert_eq!(child["delegation_id"], "d-child");
    assert_eq!(child["admission"], ack["result"]["admission"]);
    assert_eq!(child["from"], "prod/reviewer");
    assert_eq!(child["from_peer"], CALLEE);
    assert_eq!(child["chain"], json!(["prod/koudu", "prod/reviewer"]));

    // One level more is over max_depth 2.
    let r = helper
        .delegate_under("d-grandchild", "reviewer", ("d-child", &child["admission"]))
        .await;
    assert_eq!(error_code(&r), -32003, "{r}");
    assert_eq!(
        r["error"]["message"],
        "delegation depth 3 exceeds namespace max_depth 2"
    );

    // Results go back up: the child's to the reviewer, the root's to the
    // primary.
    complete(&mut helper, &child).await;
    only_result_is(&mut reviewer, "d-child", "done: child d-child", &[]).await;
    complete(&mut reviewer, &fwd).await;
    only_result_is(&mut primary, "d-root", "done: root task", &[]).await;
    w.stop().await;
}

/// The child crosses the relay at its depth: with the namespace and both
/// hosts' `[policy]` opted in but the relay route back at its default
/// depth (1), the relay refuses it and the worker gets POLICY_DENIED
/// naming the relay's limit; nothing reaches host A's worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_child_deeper_than_the_relay_route_allows_is_refused_by_the_relay() {
    let a = format!("{PROD_DEPTH_TWO}{A_SERVES_B}");
    let b = format!("{PROD_DEPTH_TWO}{TARGET_HELPER_ON_A}");
    let w = World::start_full(&route_back(1), (&a, &b), "max_depth = 2").await;
    let mut reviewer = w.worker("i-w1", 2).await;
    let mut helper = w.helper().await;
    let mut primary = w.primary().await;
    let ack = primary.delegate("d-root", "reviewer", "root task").await;
    assert!(ack.get("result").is_some(), "{ack}");
    let fwd = reviewer.request("cp/delegate").await;

    let r = reviewer
        .delegate_under("d-child", "helper-on-a", ("d-root", &fwd["admission"]))
        .await;
    assert_eq!(error_code(&r), -32003, "{r}");
    let message = r["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.starts_with("the relay refused: depth_exceeded"),
        "{r}"
    );
    // Host A's worker got nothing.
    let list = helper.call("cp/list_agents", json!({})).await;
    assert_eq!(agent(&list, "helper")["active_sessions"], 0, "{list}");
    complete(&mut reviewer, &fwd).await;
    only_result_is(&mut primary, "d-root", "done: root task", &[]).await;
    w.stop().await;
}

/// An endpoint run in this process with one worker identity, `prod/reviewer`
/// under `WORKER_KEY`: what a host embedding the connector sees of it.
async fn in_process_worker_endpoint() -> (
    oab_connector::openab::OpenAbEndpoint,
    u16,
    tokio_util::sync::CancellationToken,
) {
    use oab_connector::openab::config::OpenAbRuntime;
    use oab_connector::openab::proto::AgentType;
    use oab_connector::openab::{OpenAbEndpoint, OpenAbSection, RuntimeKeys};
    let section = OpenAbSection {
        runtimes: vec![OpenAbRuntime {
            namespace: "prod".into(),
            name: "reviewer".into(),
            agent_type: AgentType::Worker,
            key_file: None,
            key_env: None,
            max_delegated_sessions_cap: Some(3),
        }],
        ..OpenAbSection::default()
    };
    let endpoint = OpenAbEndpoint::new(
        section,
        RuntimeKeys::from_secrets([(WORKER_KEY, 0)]).expect("the key is usable"),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let stop = tokio_util::sync::CancellationToken::new();
    tokio::spawn(oab_connector::openab::serve(
        listener,
        endpoint.clone(),
        stop.clone(),
    ));
    (endpoint, port, stop)
}

#[tokio::test]
async fn the_registry_lists_each_registration_and_expiring_the_leases_drops_and_closes_them() {
    let (endpoint, port, stop) = in_process_worker_endpoint().await;
    assert!(endpoint.registrations().is_empty());

    // A connection counts against its identity from the upgrade on.
    let mut w = Cp::connect(port, WORKER_KEY).await.unwrap();
    assert_eq!(endpoint.connection_count("prod/reviewer"), 1);
    assert!(endpoint.registrations().is_empty(), "not registered yet");
    let r = w.register("prod", "reviewer", "worker", "i-reg", 5).await;
    assert!(r.get("result").is_some(), "{r}");
    let regs = endpoint.registrations();
    assert_eq!(regs.len(), 1, "{regs:?}");
    assert_eq!(
        (regs[0].namespace.as_str(), regs[0].name.as_str()),
        ("prod", "reviewer")
    );
    assert_eq!(regs[0].instance_id, "i-reg");
    assert_eq!(regs[0].max_delegated_sessions, 3, "clamped by the cap");
    assert_eq!(regs[0].active_sessions, 0);
    let first = regs[0].handle;

    // Expiring the leases drops the registration before it returns, then
    // closes the connection as a lapsed lease does.
    assert_eq!(endpoint.expire_leases(), 1);
    assert!(endpoint.registrations().is_empty());
    match tokio::time::timeout(STEP, w.ws.next()).await.unwrap() {
        Some(Ok(Message::Close(Some(f)))) => {
            assert_eq!(u16::from(f.code), 1008);
            assert_eq!(f.reason.as_str(), "lease expired");
        }
        other => panic!("expected a 1008 close, got {other:?}"),
    }
    drop(w);

    // The identity's place is given back when the connection ends, and the
    // runtime registers again on a new connection.
    let mut again = tokio::time::timeout(STEP, async {
        loop {
            match Cp::connect(port, WORKER_KEY).await {
                Ok(cp) => break cp,
                Err(status) => {
                    assert_eq!(status, 503, "only the quota may refuse");
                    tokio::task::yield_now().await;
                }
            }
        }
    })
    .await
    .expect("the identity's place is given back");
    let r = again
        .register("prod", "reviewer", "worker", "i-reg", 5)
        .await;
    assert!(r.get("result").is_some(), "{r}");
    let regs = endpoint.registrations();
    assert_eq!(regs.len(), 1);
    assert_ne!(regs[0].handle, first, "a new connection, a new handle");
    stop.cancel();
}

/// The endpoint releases each delegation at the relay once the primary's
/// result is read from it: the relay's Redis keeps only the delegation's
/// record (its outcome), not its logs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_finished_delegation_leaves_only_its_outcome_at_the_relay() {
    let w = World::start().await;
    let mut worker = w.worker("i-w1", 4).await;
    let mut primary = w.primary().await;
    let ack = primary.delegate("d-1", "reviewer", "review PR 7").await;
    assert!(ack.get("result").is_some(), "{ack}");
    let fwd = worker.request("cp/delegate").await;
    let done = worker
        .call(
            "cp/delegate_result",
            json!({ "delegation_id": fwd["delegation_id"], "admission": fwd["admission"],
                    "status": "completed", "result": "LGTM" }),
        )
        .await;
    assert_eq!(done["result"]["ok"], true);
    assert_eq!(primary.result_for("d-1").await["status"], "completed");

    let mut raw = redis::Client::open(w._redis.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let mut keys: Vec<String> = Vec::new();
    let compacted = tokio::time::timeout(STEP, async {
        loop {
            keys = redis::cmd("KEYS")
                .arg("oab:d:*")
                .query_async(&mut raw)
                .await
                .unwrap();
            if keys.len() == 1 && keys[0].ends_with(":meta") {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    assert!(compacted.is_ok(), "the delegation's keys: {keys:?}");
    w.stop().await;
}
