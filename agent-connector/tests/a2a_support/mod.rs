//! Test support for the A2A facade: serve it on loopback, call it with
//! JSON-RPC, read its SSE streams. Every wait is bounded.
#![allow(
    dead_code,
    unreachable_pub,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic
)]

use std::pin::Pin;
use std::time::Duration;

use bytes::Bytes;
use futures_util::{Stream, StreamExt as _};
use oab_connector::Caller;
use oab_connector::a2a::{Facade, FacadeOptions, PROFILE_URI};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

/// How long any single read of the tests may take.
pub const STEP: Duration = Duration::from_secs(20);

pub struct FacadeServer {
    pub base: String,
    pub facade: Facade,
    pub shutdown: CancellationToken,
    pub task: tokio::task::JoinHandle<std::io::Result<()>>,
}

impl FacadeServer {
    pub async fn start(caller: Caller, options: FacadeOptions) -> FacadeServer {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let facade = Facade::new(caller, options);
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(oab_connector::a2a::serve(
            listener,
            facade.clone(),
            shutdown.clone(),
        ));
        FacadeServer {
            base,
            facade,
            shutdown,
            task,
        }
    }

    /// The JSON-RPC URL of a peer.
    pub fn url(&self, peer: &str) -> String {
        format!("{}/peers/{peer}/", self.base)
    }

    pub async fn stop(self) {
        self.shutdown.cancel();
        tokio::time::timeout(STEP, self.task)
            .await
            .expect("the facade drains in time")
            .unwrap()
            .unwrap();
        self.facade.close();
    }
}

pub fn facade_options() -> FacadeOptions {
    let mut o = FacadeOptions::default();
    o.defaults.capabilities = vec!["read:repo".into()];
    o
}

/// Headers of a plain A2A 1.0 client.
pub const V1: &[(&str, &str)] = &[("A2A-Version", "1.0")];

/// Headers of a client that activates the profile.
pub fn with_profile(extra: &[(&'static str, String)]) -> Vec<(&'static str, String)> {
    let mut h = vec![
        ("A2A-Version", "1.0".to_string()),
        ("A2A-Extensions", PROFILE_URI.to_string()),
    ];
    h.extend(extra.iter().cloned());
    h
}

pub struct Rpc {
    pub http: reqwest::Client,
    pub url: String,
}

pub fn message(id: &str, text: &str) -> Value {
    json!({ "messageId": id, "role": "ROLE_USER", "parts": [{ "text": text }] })
}

impl Rpc {
    pub fn new(url: String) -> Rpc {
        Rpc {
            http: reqwest::Client::new(),
            url,
        }
    }

    fn request<K: AsRef<str>, V: AsRef<str>>(
        &self,
        body: String,
        headers: &[(K, V)],
    ) -> reqwest::RequestBuilder {
        let mut r = self.http.post(&self.url).body(body);
        if !headers
            .iter()
            .any(|(k, _)| k.as_ref().eq_ignore_ascii_case("content-type"))
        {
            r = r.header("content-type", "application/json");
        }
        for (k, v) in headers {
            r = r.header(k.as_ref(), v.as_ref());
        }
        r
    }

    /// Posts a raw body; returns the response's JSON and headers.
    pub async fn raw<K: AsRef<str>, V: AsRef<str>>(
        &self,
        body: &str,
        headers: &[(K, V)],
    ) -> (Value, reqwest::header::HeaderMap) {
        let resp = tokio::time::timeout(STEP, self.request(body.to_string(), headers).send())
            .await
            .expect("answer in time")
            .unwrap();
        assert_eq!(resp.status(), 200, "JSON-RPC answers with HTTP 200");
        let h = resp.headers().clone();
        (resp.json().await.unwrap(), h)
    }

    /// Calls a method; returns the whole response object.
    pub async fn call<K: AsRef<str>, V: AsRef<str>>(
        &self,
        method: &str,
        params: Value,
        headers: &[(K, V)],
    ) -> Value {
        let body = json!({ "jsonrpc": "2.0", "id": 1, "method": method, "params": params });
        self.raw(&body.to_string(), headers).await.0
    }

    /// Calls a streaming method.
    pub async fn stream<K: AsRef<str>, V: AsRef<str>>(
        &self,
        method: &str,
        params: Value,
        headers: &[(K, V)],
    ) -> Sse {
        let body = json!({ "jsonrpc": "2.0", "id": 7, "method": method, "params": params });
        let resp = tokio::time::timeout(STEP, self.request(body.to_string(), headers).send())
            .await
            .expect("answer in time")
            .unwrap();
        Sse::of(resp)
    }
}

/// A client of the facade's HTTP+JSON binding for one peer.
pub struct Rest {
    pub http: reqwest::Client,
    /// The peer base, ending in `/`.
    pub base: String,
}

/// An HTTP+JSON answer that is not a stream.
#[derive(Debug)]
pub struct RestReply {
    pub status: u16,
    pub headers: reqwest::header::HeaderMap,
    pub body: Value,
}

impl RestReply {
    /// The ErrorInfo `reason` of a `google.rpc.Status` error body, checking
    /// its shape (`code` = the HTTP status, `status`, `message`, details).
    pub fn reason(&self) -> String {
        let e = &self.body["error"];
        assert_eq!(e["code"], self.status, "code is the HTTP status: {self:?}");
        assert!(
            e["status"].is_string() && e["message"].is_string(),
            "{self:?}"
        );
        let info = &e["details"][0];
        assert_eq!(info["@type"], "type.googleapis.com/google.rpc.ErrorInfo");
        info["reason"]
            .as_str()
            .unwrap_or_else(|| panic!("no reason: {self:?}"))
            .to_string()
    }

    /// The `google.rpc.Code` name of an error body.
    pub fn status_name(&self) -> &str {
        self.body["error"]["status"].as_str().unwrap_or_default()
    }
}

impl Rest {
    pub fn new(base: String) -> Rest {
        Rest {
            http: reqwest::Client::new(),
            base,
        }
    }

    /// A request to `path` (relative to the peer base), with a JSON body
    /// when `body` is given.
    pub fn request<K: AsRef<str>, V: AsRef<str>>(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<&Value>,
        headers: &[(K, V)],
    ) -> reqwest::RequestBuilder {
        let mut r = self.http.request(method, format!("{}{path}", self.base));
        if let Some(b) = body {
            r = r
                .header("content-type", "application/a2a+json")
                .body(b.to_string());
        }
        for (k, v) in headers {
            r = r.header(k.as_ref(), v.as_ref());
        }
        r
    }

    /// Sends `r`; returns the status, headers and JSON body.
    pub async fn send(r: reqwest::RequestBuilder) -> RestReply {
        let resp = tokio::time::timeout(STEP, r.send())
            .await
            .expect("answer in time")
            .unwrap();
        let status = resp.status().as_u16();
        let headers = resp.headers().clone();
        let text = resp.text().await.unwrap();
        let body = serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("not JSON ({e}), HTTP {status}: {text}"));
        RestReply {
            status,
            headers,
            body,
        }
    }

    pub async fn get<K: AsRef<str>, V: AsRef<str>>(
        &self,
        path: &str,
        headers: &[(K, V)],
    ) -> RestReply {
        Rest::send(self.request(reqwest::Method::GET, path, None, headers)).await
    }

    pub async fn post<K: AsRef<str>, V: AsRef<str>>(
        &self,
        path: &str,
        body: &Value,
        headers: &[(K, V)],
    ) -> RestReply {
        Rest::send(self.request(reqwest::Method::POST, path, Some(body), headers)).await
    }

    /// A streaming route (`message:stream`, `tasks/{id}:subscribe`).
    pub async fn stream<K: AsRef<str>, V: AsRef<str>>(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<&Value>,
        headers: &[(K, V)],
    ) -> Sse {
        let resp = tokio::time::timeout(STEP, self.request(method, path, body, headers).send())
            .await
            .expect("answer in time")
            .unwrap();
        Sse::of(resp)
    }
}

/// One SSE event.
#[derive(Debug, Clone)]
pub struct SseItem {
    pub id: Option<String>,
    pub event: String,
    pub data: Value,
}

pub struct Sse {
    pub status: u16,
    pub headers: reqwest::header::HeaderMap,
    /// Whether the answer is an event stream (else a JSON error).
    pub sse: bool,
    body: Pin<Box<dyn Stream<Item = reqwest::Result<Bytes>> + Send>>,
    buf: String,
}

impl Sse {
    fn of(resp: reqwest::Response) -> Sse {
        let status = resp.status().as_u16();
        let headers = resp.headers().clone();
        let sse = headers
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("text/event-stream"));
        Sse {
            status,
            headers,
            sse,
            body: Box::pin(resp.bytes_stream()),
            buf: String::new(),
        }
    }

    /// The JSON body of an answer that is not a stream.
    pub async fn json(mut self) -> Value {
        assert!(!self.sse, "expected a JSON answer, got a stream");
        let mut all = Vec::new();
        while let Some(c) = tokio::time::timeout(STEP, self.body.next()).await.unwrap() {
            all.extend_from_slice(&c.unwrap());
        }
        serde_json::from_slice(&all).unwrap()
    }

    /// The next event, or `None` when the server closed the stream.
    pub async fn next(&mut self) -> Option<SseItem> {
        loop {
            if let Some(pos) = self.buf.find("\n\n") {
                let block: String = self.buf.drain(..pos + 2).collect();
                let mut id = None;
                let mut event = "message".to_string();
                let mut data = Vec::new();
                for line in block.lines() {
                    if line.starts_with(':') || line.is_empty() {
                        continue;
                    }
                    let (k, v) = line.split_once(':').unwrap_or((line, ""));
                    let v = v.strip_prefix(' ').unwrap_or(v);
                    match k {
                        "id" => id = Some(v.to_string()),
                        "event" => event = v.to_string(),
                        "data" => data.push(v.to_string()),
                        _ => {}
                    }
                }
                if data.is_empty() {
                    continue;
                }
                return Some(SseItem {
                    id,
                    event,
                    data: serde_json::from_str(&data.join("\n")).unwrap(),
                });
            }
            let chunk = tokio::time::timeout(STEP, self.body.next())
                .await
                .expect("the stream moves in time")?;
            self.buf
                .push_str(&String::from_utf8_lossy(&chunk.unwrap()).replace("\r\n", "\n"));
        }
    }

    /// Every event until the server closes the stream.
    pub async fn collect(mut self) -> Vec<SseItem> {
        let mut out = Vec::new();
        while let Some(e) = self.next().await {
            out.push(e);
        }
        out
    }
}

/// The StreamResponse of an event: the JSON-RPC `result`, or the bare
/// data of the HTTP+JSON binding.
pub fn response(item: &SseItem) -> &Value {
    item.data.get("result").unwrap_or(&item.data)
}

/// The StreamResponse member an event carries: `task`, `message`,
/// `statusUpdate` or `artifactUpdate`.
pub fn kind(item: &SseItem) -> &'static str {
    let r = response(item);
    for k in ["task", "message", "statusUpdate", "artifactUpdate"] {
        if r.get(k).is_some() {
            return k;
        }
    }
    "error"
}

/// The profile sequence number of an event.
pub fn seq(item: &SseItem) -> Option<u64> {
    let r = response(item);
    ["task", "statusUpdate", "artifactUpdate"]
        .iter()
        .find_map(|k| r.get(*k))
        .and_then(|v| v["metadata"][PROFILE_URI]["seq"].as_u64())
}

/// The state an event shows (task or status update).
pub fn state(item: &SseItem) -> Option<String> {
    let r = response(item);
    r.get("task")
        .or_else(|| r.get("statusUpdate"))
        .and_then(|v| v["status"]["state"].as_str())
        .map(str::to_string)
}

/// Polls `GetTask` until the task is in `want` (bounded).
pub async fn wait_state(rpc: &Rpc, id: &str, want: &str) -> Value {
    let until = tokio::time::Instant::now() + STEP;
    loop {
        let r = rpc.call("GetTask", json!({ "id": id }), V1).await;
        if r["result"]["status"]["state"] == want {
            return r["result"].clone();
        }
        assert!(
            tokio::time::Instant::now() < until,
            "task {id} never reached {want}: {r}"
        );
        tokio::task::yield_now().await;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The repository root.
pub fn repo() -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The virtualenv's Python (made by `scripts/python-env`).
pub fn python() -> std::path::PathBuf {
    let p = repo().join(".venv/bin/python");
    assert!(
        p.exists(),
        "{} is missing: run scripts/python-env first (it creates .venv with the official a2a-sdk)",
        p.display()
    );
    p
}

/// Starts the official-SDK sample server; returns it and its port.
pub async fn sample_agent() -> (tokio::process::Child, u16) {
    sample_agent_at(0).await
}

/// Starts the official-SDK sample server on `port` (0: a free one);
/// returns it and its port.
pub async fn sample_agent_at(port: u16) -> (tokio::process::Child, u16) {
    sample_agent_with(port, "jsonrpc", None).await
}

/// Starts the official-SDK sample server on `port` (0: a free one) serving
/// `binding` (`jsonrpc`, `rest` or `both`; with `-blocking` appended its
/// card says it does not stream), its card's interfaces at `public`
/// (default: its own address); returns it and its port.
pub async fn sample_agent_with(
    port: u16,
    binding: &str,
    public: Option<&str>,
) -> (tokio::process::Child, u16) {
    use tokio::io::AsyncBufReadExt as _;
    let script = repo().join("agent-connector/tests/interop/sample_agent.py");
    let mut cmd = tokio::process::Command::new(python());
    cmd.arg(script).arg(format!("--port={port}")).arg(format!(
        "--binding={}",
        binding.trim_end_matches("-blocking")
    ));
    if let Some(p) = public {
        cmd.arg(format!("--public-url={p}"));
    }
    if binding.ends_with("-blocking") {
        cmd.arg("--no-streaming");
    }
    let mut child = cmd
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .expect("the sample agent starts");
    let stdout = child.stdout.take().unwrap();
    let mut lines = tokio::io::BufReader::new(stdout).lines();
    let line = tokio::time::timeout(std::time::Duration::from_secs(60), lines.next_line())
        .await
        .expect("the sample agent is ready in time")
        .unwrap()
        .expect("the sample agent printed READY");
    let port = line
        .strip_prefix("READY ")
        .and_then(|p| p.trim().parse().ok())
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"));
    (child, port)
}

/// Connector B (driver in front of the A2A server at `agent_url`) and
/// connector A (caller) through a real relay, with B's agent card published
/// and visible to A (bounded poll).
pub async fn driver_topology(
    env: &crate::common::Env,
    relay: &crate::common::Relay,
    agent_url: &str,
) -> (
    oab_connector::Connector,
    oab_connector::Connector,
    serde_json::Value,
) {
    driver_topology_at(env, relay.addr, agent_url).await
}

/// [`driver_topology`] for a relay listening at `relay` (e.g. a relay
/// process).
pub async fn driver_topology_at(
    env: &crate::common::Env,
    relay: std::net::SocketAddr,
    agent_url: &str,
) -> (
    oab_connector::Connector,
    oab_connector::Connector,
    serde_json::Value,
) {
    use crate::common::{CALLEE, connector};
    let driver =
        oab_connector::a2a::A2aDriver::new(oab_connector::a2a::DriverOptions::new(agent_url))
            .unwrap();
    let card = driver
        .agent_card()
        .await
        .expect("the driver resolves the server's card");
    let b = connector(env, &env.callee, relay, Some(std::sync::Arc::new(driver)));
    let a = connector(env, &env.caller, relay, None);
    a.connected().await.unwrap();
    b.connected().await.unwrap();
    b.publish(&card).await.unwrap();
    let until = tokio::time::Instant::now() + STEP;
    loop {
        let peers = a.caller().list_peers().await.unwrap();
        if peers
            .iter()
            .any(|p| p.peer.as_str() == CALLEE && p.descriptor.is_some())
        {
            break;
        }
        assert!(
            tokio::time::Instant::now() < until,
            "the card never reached the caller: {peers:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    (a, b, card)
}

/// The folder of the JavaScript SDK interop scripts (`scripts/node-env`
/// installs `@a2a-js/sdk` there with `npm ci`).
pub fn js_dir() -> std::path::PathBuf {
    repo().join("agent-connector/tests/interop/js")
}

/// Node.js for the JavaScript SDK interop tests, or `None` (with a message
/// on stderr) when no `node` is installed: those tests then skip. With node
/// present, the SDK must be installed (`scripts/node-env`).
pub fn node() -> Option<std::path::PathBuf> {
    let node = std::env::var_os("NODE").map_or_else(|| "node".into(), std::path::PathBuf::from);
    let ok = std::process::Command::new(&node)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        eprintln!(
            "SKIPPED: no Node.js ({}) on this machine; the JavaScript SDK interop tests need node >= 20 and npm (scripts/node-env)",
            node.display()
        );
        return None;
    }
    let sdk = js_dir().join("node_modules/@a2a-js/sdk/package.json");
    assert!(
        sdk.exists(),
        "{} is missing: run scripts/node-env first (it installs @a2a-js/sdk with npm ci)",
        sdk.display()
    );
    Some(node)
}

/// Starts the JavaScript-SDK sample server (`interop/js/sample_agent.mjs`);
/// returns it and its port.
pub async fn js_sample_agent(node: &std::path::Path) -> (tokio::process::Child, u16) {
    js_sample_agent_with(node, "jsonrpc").await
}

/// [`js_sample_agent`] serving `binding` (`jsonrpc` or `rest`).
pub async fn js_sample_agent_with(
    node: &std::path::Path,
    binding: &str,
) -> (tokio::process::Child, u16) {
    use tokio::io::AsyncBufReadExt as _;
    let mut child = tokio::process::Command::new(node)
        .arg(js_dir().join("sample_agent.mjs"))
        .arg(format!("--binding={binding}"))
        .current_dir(js_dir())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .expect("the JS sample agent starts");
    let stdout = child.stdout.take().unwrap();
    let mut lines = tokio::io::BufReader::new(stdout).lines();
    let line = tokio::time::timeout(std::time::Duration::from_secs(60), lines.next_line())
        .await
        .expect("the JS sample agent is ready in time")
        .unwrap()
        .expect("the JS sample agent printed READY");
    let port = line
        .strip_prefix("READY ")
        .and_then(|p| p.trim().parse().ok())
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"));
    (child, port)
}

/// A loopback TCP proxy in front of a local A2A server whose open
/// connections can be cut: the server's streams then break as a crashed
/// connection breaks them, while new connections go through. It records
/// what goes through, both ways, and wakes [`CutProxy::until`] at each
/// chunk.
pub struct CutProxy {
    /// The proxy's port.
    pub port: u16,
    conns: std::sync::Arc<std::sync::Mutex<Vec<tokio::task::AbortHandle>>>,
    traffic: std::sync::Arc<Traffic>,
    accept: tokio::task::JoinHandle<()>,
}

/// What went through a [`CutProxy`], per chunk (lossy UTF-8), in order.
#[derive(Default)]
struct Traffic {
    /// From clients to the server.
    sent: std::sync::Mutex<Vec<String>>,
    /// From the server to clients.
    received: std::sync::Mutex<Vec<String>>,
    changed: tokio::sync::Notify,
}

impl Traffic {
    fn record(&self, up: bool, chunk: &[u8]) {
        let log = if up { &self.sent } else { &self.received };
        log.lock()
            .unwrap()
            .push(String::from_utf8_lossy(chunk).into_owned());
        self.changed.notify_waiters();
    }
}

impl CutProxy {
    /// Proxies connections to `listener` on to `127.0.0.1:target`.
    pub fn start(listener: tokio::net::TcpListener, target: u16) -> CutProxy {
        let port = listener.local_addr().unwrap().port();
        let conns = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let traffic = std::sync::Arc::new(Traffic::default());
        let (c, t) = (conns.clone(), traffic.clone());
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let (up_log, down_log) = (t.clone(), t.clone());
                let task = tokio::spawn(async move {
                    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
                    let Ok(server) = tokio::net::TcpStream::connect(("127.0.0.1", target)).await
                    else {
                        return;
                    };
                    let (mut cr, mut cw) = client.into_split();
                    let (mut sr, mut sw) = server.into_split();
                    let up = async move {
                        let mut buf = vec![0u8; 16 << 10];
                        while let Ok(n) = cr.read(&mut buf).await {
                            if n == 0 {
                                break;
                            }
                            up_log.record(true, &buf[..n]);
                            if sw.write_all(&buf[..n]).await.is_err() {
                                break;
                            }
                        }
                        let _ = sw.shutdown().await;
                    };
                    let down = async move {
                        let mut buf = vec![0u8; 16 << 10];
                        while let Ok(n) = sr.read(&mut buf).await {
                            if n == 0 {
                                break;
                            }
                            if cw.write_all(&buf[..n]).await.is_err() {
                                break;
                            }
                            down_log.record(false, &buf[..n]);
                        }
                        let _ = cw.shutdown().await;
                    };
                    tokio::join!(up, down);
                });
                c.lock().unwrap().push(task.abort_handle());
            }
        });
        CutProxy {
            port,
            conns,
            traffic,
            accept,
        }
    }

    /// Closes every connection open now (both sides).
    pub fn cut(&self) {
        for c in self.conns.lock().unwrap().drain(..) {
            c.abort();
        }
    }

    /// What clients sent so far.
    pub fn sent(&self) -> Vec<String> {
        self.traffic.sent.lock().unwrap().clone()
    }

    /// What the server sent back so far (recorded once passed on).
    pub fn received(&self) -> Vec<String> {
        self.traffic.received.lock().unwrap().clone()
    }

    /// Waits until `done(sent, received)` holds (checked now and at every
    /// chunk through the proxy), at most `limit`; panics naming `what`
    /// when it does not.
    pub async fn until(
        &self,
        what: &str,
        limit: std::time::Duration,
        done: impl Fn(&[String], &[String]) -> bool,
    ) {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let changed = self.traffic.changed.notified();
            tokio::pin!(changed);
            // Registered before the check: a chunk recorded in between
            // still wakes the wait.
            changed.as_mut().enable();
            if done(&self.sent(), &self.received()) {
                return;
            }
            if tokio::time::timeout_at(deadline, changed).await.is_err() {
                panic!(
                    "{what}: not within {limit:?}; sent {:?}, received {:?}",
                    self.sent(),
                    self.received()
                );
            }
        }
    }
}

impl Drop for CutProxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.cut();
    }
}

/// One request a [`Webhook`] received.
#[derive(Debug, Clone)]
pub struct Notification {
    pub headers: axum::http::HeaderMap,
    pub body: Value,
    /// The status the receiver answered with.
    pub status: u16,
}

/// A push notification receiver on loopback (axum): records every request
/// in arrival order and answers `503` to the first `fail_first` of them,
/// `204` after that.
pub struct Webhook {
    pub url: String,
    seen: std::sync::Arc<parking_lot::Mutex<Vec<Notification>>>,
    changed: std::sync::Arc<tokio::sync::Notify>,
    failing: std::sync::Arc<std::sync::atomic::AtomicBool>,
    shutdown: CancellationToken,
}

impl Webhook {
    pub async fn start(fail_first: usize) -> Webhook {
        Self::start_on(
            tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap(),
            fail_first,
        )
    }

    pub fn start_on(listener: tokio::net::TcpListener, fail_first: usize) -> Webhook {
        use axum::extract::State;
        type Shared = (
            std::sync::Arc<parking_lot::Mutex<Vec<Notification>>>,
            std::sync::Arc<tokio::sync::Notify>,
            std::sync::Arc<std::sync::atomic::AtomicUsize>,
            usize,
            std::sync::Arc<std::sync::atomic::AtomicBool>,
        );
        async fn hook(
            State((seen, changed, count, fail_first, failing)): State<Shared>,
            headers: axum::http::HeaderMap,
            body: Bytes,
        ) -> axum::http::StatusCode {
            let n = count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let status = if n < fail_first || failing.load(std::sync::atomic::Ordering::SeqCst) {
                axum::http::StatusCode::SERVICE_UNAVAILABLE
            } else {
                axum::http::StatusCode::NO_CONTENT
            };
            seen.lock().push(Notification {
                headers,
                body: serde_json::from_slice(&body).unwrap_or(Value::Null),
                status: status.as_u16(),
            });
            changed.notify_waiters();
            status
        }
        let url = format!("http://{}/hook", listener.local_addr().unwrap());
        let seen = std::sync::Arc::new(parking_lot::Mutex::new(Vec::new()));
        let changed = std::sync::Arc::new(tokio::sync::Notify::new());
        let failing = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let state: Shared = (
            seen.clone(),
            changed.clone(),
            std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0)),
            fail_first,
            failing.clone(),
        );
        let router = axum::Router::new()
            .route("/hook", axum::routing::post(hook))
            .with_state(state);
        let shutdown = CancellationToken::new();
        let stop = shutdown.clone();
        tokio::spawn(async move {
            let _ = axum::serve(listener, router)
                .with_graceful_shutdown(stop.cancelled_owned())
                .await;
        });
        Webhook {
            url,
            seen,
            changed,
            failing,
            shutdown,
        }
    }

    /// While on, every request is answered `503`.
    pub fn set_failing(&self, on: bool) {
        self.failing.store(on, std::sync::atomic::Ordering::SeqCst);
    }

    /// Waits (bounded) until `done` holds for everything received.
    pub async fn wait_all(&self, what: &str, done: impl Fn(&[Notification]) -> bool) {
        let until = tokio::time::Instant::now() + STEP;
        loop {
            let wait = self.changed.notified();
            let got = self.all();
            if done(&got) {
                return;
            }
            assert!(
                tokio::time::timeout_at(until, wait).await.is_ok(),
                "the webhook never got {what}: {got:?}"
            );
        }
    }

    /// Everything received so far, failed answers included.
    pub fn all(&self) -> Vec<Notification> {
        self.seen.lock().clone()
    }

    /// The bodies answered with a 2xx, in arrival order.
    pub fn accepted(&self) -> Vec<Value> {
        self.seen
            .lock()
            .iter()
            .filter(|n| (200..300).contains(&n.status))
            .map(|n| n.body.clone())
            .collect()
    }

    /// Waits (bounded) until `done` holds for the accepted bodies.
    pub async fn wait_for(&self, what: &str, done: impl Fn(&[Value]) -> bool) -> Vec<Value> {
        let until = tokio::time::Instant::now() + STEP;
        loop {
            let wait = self.changed.notified();
            let got = self.accepted();
            if done(&got) {
                return got;
            }
            assert!(
                tokio::time::timeout_at(until, wait).await.is_ok(),
                "the webhook never got {what}: {got:?}"
            );
        }
    }

    /// Waits until the accepted bodies include a terminal status update.
    pub async fn wait_terminal(&self) -> Vec<Value> {
        self.wait_for("a terminal status", |got| {
            got.iter().any(is_terminal_update)
        })
        .await
    }

    pub fn stop(&self) {
        self.shutdown.cancel();
    }
}

/// Whether a StreamResponse is a status update in a terminal state.
pub fn is_terminal_update(body: &Value) -> bool {
    body["statusUpdate"]["status"]["state"]
        .as_str()
        .is_some_and(|s| {
            [
                "TASK_STATE_COMPLETED",
                "TASK_STATE_FAILED",
                "TASK_STATE_CANCELED",
                "TASK_STATE_REJECTED",
            ]
            .contains(&s)
        })
}

/// The StreamResponse member of a webhook body.
pub fn body_kind(body: &Value) -> &'static str {
    for k in ["task", "message", "statusUpdate", "artifactUpdate"] {
        if body.get(k).is_some() {
            return k;
        }
    }
    "none"
}

/// The profile sequence number of a webhook body.
pub fn body_seq(body: &Value) -> Option<u64> {
    ["task", "statusUpdate", "artifactUpdate"]
        .iter()
        .find_map(|k| body.get(*k))
        .and_then(|v| v["metadata"][PROFILE_URI]["seq"].as_u64())
}
