//! OpenAB control-plane (CP) runtimes for the delegations scenario's CP
//! mode, written from the CP protocol (`docs/openab.md`): WebSocket with
//! `Authorization: Bearer`, JSON-RPC 2.0, `cp/register` first.
//!
//! - [`Primary`]: an OAB primary that keeps N `cp/delegate` in flight on
//!   one connection and checks that each gets exactly one `completed`
//!   `cp/delegate_result` carrying the worker's text.
//! - [`run_worker`]: an OAB worker that answers each `cp/delegate` at once
//!   with `completed` and `done: <prompt>`.
//! - [`DirectCp`]: the baseline, a worker the primary dials directly: it
//!   answers `cp/register`, and each `cp/delegate` with the ack and then
//!   the result, over that one WebSocket (no relay, no connectors, no TLS,
//!   no signatures).
//!
//! Every socket here sets TCP_NODELAY (the CP as shipped does not, which
//! is its 23 round trips/s at one in flight).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context as _;
use futures_util::{SinkExt as _, StreamExt as _};
use serde_json::{Value, json};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::client::IntoClientRequest as _;
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;
use tokio_util::sync::CancellationToken;

use crate::endpoint::latency_histogram;

/// A CP connection.
pub type Ws = WebSocketStream<TcpStream>;

/// Largest message read (the CP's 1 MiB frame cap).
const MAX_MESSAGE: usize = 1024 * 1024;

fn ws_config() -> WebSocketConfig {
    WebSocketConfig::default()
        .max_message_size(Some(MAX_MESSAGE))
        .max_frame_size(Some(MAX_MESSAGE))
}

/// Dials `addr` with `key` as the bearer; `nagle`: leave Nagle's algorithm
/// on (no `TCP_NODELAY`), as OpenAB's own CP client does.
pub async fn connect(addr: SocketAddr, key: &str, nagle: bool) -> anyhow::Result<Ws> {
    connect_url(&format!("ws://{addr}/cp"), key, nagle).await
}

/// Dials the CP at `url` (`ws://host:port/path`; the path is the server's
/// own, e.g. openab-cp's `/cp`) with `key` as the bearer; `nagle` as
/// [`connect`]. `wss://` is refused: the clients here speak plain TCP.
pub async fn connect_url(url: &str, key: &str, nagle: bool) -> anyhow::Result<Ws> {
    let uri: tokio_tungstenite::tungstenite::http::Uri = url
        .parse()
        .with_context(|| format!("--cp-url {url:?} is not a URL"))?;
    anyhow::ensure!(
        uri.scheme_str() == Some("ws"),
        "--cp-url {url:?}: only ws:// is supported"
    );
    let host = uri
        .host()
        .with_context(|| format!("--cp-url {url:?} names no host"))?;
    let port = uri.port_u16().unwrap_or(80);
    let tcp = TcpStream::connect((host.trim_start_matches('[').trim_end_matches(']'), port))
        .await
        .with_context(|| format!("connecting to the CP at {url}"))?;
    tcp.set_nodelay(!nagle).context("TCP_NODELAY")?;
    let mut req = url.into_client_request()?;
    req.headers_mut()
        .insert("authorization", format!("Bearer {key}").parse()?);
    let (ws, _) = tokio_tungstenite::client_async_with_config(req, tcp, Some(ws_config()))
        .await
        .context("CP upgrade")?;
    Ok(ws)
}

fn rpc(id: u64, method: &str, params: Value) -> Message {
    Message::text(
        json!({ "jsonrpc": "2.0", "id": id, "method": method, "params": params }).to_string(),
    )
}

fn ok(id: &Value) -> Message {
    Message::text(json!({ "jsonrpc": "2.0", "id": id, "result": { "ok": true } }).to_string())
}

/// The next JSON message; `None` at the end of the connection.
async fn read(ws: &mut Ws) -> anyhow::Result<Option<Value>> {
    loop {
        match ws.next().await {
            None | Some(Ok(Message::Close(_))) => return Ok(None),
            Some(Ok(Message::Text(t))) => return Ok(Some(serde_json::from_str(t.as_str())?)),
            Some(Ok(_)) => {}
            Some(Err(e)) => return Err(e.into()),
        }
    }
}

/// Registers as `namespace/name` of `kind`; returns the heartbeat interval.
pub async fn register(
    ws: &mut Ws,
    namespace: &str,
    name: &str,
    kind: &str,
    instance: &str,
    max_sessions: u32,
) -> anyhow::Result<Duration> {
    ws.send(rpc(
        0,
        "cp/register",
        json!({
            "protocol_version": 1, "namespace": namespace, "name": name, "type": kind,
            "instance_id": instance, "labels": {}, "max_delegated_sessions": max_sessions,
        }),
    ))
    .await?;
    let r = read(ws)
        .await?
        .context("closed before the register answer")?;
    let secs = r
        .pointer("/result/heartbeat_interval_secs")
        .and_then(Value::as_u64)
        .with_context(|| format!("cp/register refused: {r}"))?;
    Ok(Duration::from_secs(secs.max(1)))
}

/// A worker: answers every `cp/delegate` with `completed` and
/// `done: <prompt>`, heartbeats, until `stop` or the connection ends.
///
/// `one_write_per_frame`: write the ack and the result each on its own, as
/// OpenAB's client does (its serve loop sends the ack when the request
/// arrives and the result when the turn ends); else both go in one write.
/// With Nagle's algorithm on, the second of two back-to-back small writes
/// waits for the peer's (delayed) ACK of the first.
pub async fn run_worker(
    mut ws: Ws,
    heartbeat: Duration,
    stop: CancellationToken,
    one_write_per_frame: bool,
) {
    let mut beat = tokio::time::interval(heartbeat);
    beat.tick().await;
    let mut next = 1u64;
    loop {
        let msg = tokio::select! {
            () = stop.cancelled() => break,
            _ = beat.tick() => {
                next += 1;
                if ws.send(rpc(next, "cp/heartbeat", json!({ "instance_id": "w" }))).await.is_err() {
                    break;
                }
                continue;
            }
            m = read(&mut ws) => match m {
                Ok(Some(m)) => m,
                _ => break,
            },
        };
        if msg.get("method").and_then(Value::as_str) != Some("cp/delegate") {
            continue;
        }
        let p = &msg["params"];
        let prompt = p["prompt"].as_str().unwrap_or_default();
        next += 1;
        let result = rpc(
            next,
            "cp/delegate_result",
            json!({ "delegation_id": p["delegation_id"], "admission": p["admission"],
                    "status": "completed", "result": format!("done: {prompt}") }),
        );
        let sent = async {
            if one_write_per_frame {
                ws.send(ok(&msg["id"])).await?;
                ws.send(result).await
            } else {
                ws.feed(ok(&msg["id"])).await?;
                ws.feed(result).await?;
                ws.flush().await
            }
        };
        if sent.await.is_err() {
            break;
        }
    }
    let _ = ws.close(None).await;
}

/// Queues `m`, or writes it at once when each frame goes on its own.
async fn put(ws: &mut Ws, one_write_per_frame: bool, m: Message) -> anyhow::Result<()> {
    if one_write_per_frame {
        ws.send(m).await?;
    } else {
        ws.feed(m).await?;
    }
    Ok(())
}

/// The baseline: a CP worker the primary dials directly. Serves one
/// connection at a time until `stop`.
pub struct DirectCp {
    /// Where it listens.
    pub addr: SocketAddr,
    stop: CancellationToken,
}

impl DirectCp {
    /// Listens on loopback.
    pub async fn start() -> anyhow::Result<DirectCp> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let stop = CancellationToken::new();
        let token = stop.clone();
        tokio::spawn(async move {
            loop {
                let tcp = tokio::select! {
                    () = token.cancelled() => break,
                    r = listener.accept() => match r {
                        Ok((tcp, _)) => tcp,
                        Err(_) => continue,
                    },
                };
                let _ = tcp.set_nodelay(true);
                tokio::spawn(direct_conn(tcp, token.clone()));
            }
        });
        Ok(DirectCp { addr, stop })
    }
}

impl Drop for DirectCp {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

async fn direct_conn(tcp: TcpStream, stop: CancellationToken) {
    let Ok(mut ws) = tokio_tungstenite::accept_async_with_config(tcp, Some(ws_config())).await
    else {
        return;
    };
    let mut next = 1u64;
    loop {
        let msg = tokio::select! {
            () = stop.cancelled() => break,
            m = read(&mut ws) => match m {
                Ok(Some(m)) => m,
                _ => break,
            },
        };
        let (id, p) = (&msg["id"], &msg["params"]);
        let reply = |result: Value| {
            Message::text(json!({ "jsonrpc": "2.0", "id": id, "result": result }).to_string())
        };
        let sent = match msg.get("method").and_then(Value::as_str) {
            Some("cp/register") => {
                ws.send(reply(json!({
                    "protocol_version": 1, "heartbeat_interval_secs": 15,
                    "lease_expiry_secs": 45, "effective_max_delegated_sessions": 1,
                })))
                .await
            }
            Some("cp/delegate") => {
                next += 1;
                let admission = next;
                let prompt = p["prompt"].as_str().unwrap_or_default();
                let result = rpc(
                    next,
                    "cp/delegate_result",
                    json!({ "delegation_id": p["delegation_id"], "admission": admission,
                            "status": "completed", "result": format!("done: {prompt}") }),
                );
                let ack = reply(json!({ "delegation_id": p["delegation_id"],
                                        "admission": admission, "assigned_to": "direct" }));
                async {
                    ws.feed(ack).await?;
                    ws.feed(result).await?;
                    ws.flush().await
                }
                .await
            }
            Some(_) => ws.send(ok(id)).await,
            None => Ok(()),
        };
        if sent.is_err() {
            break;
        }
    }
}

/// What one primary run measured.
#[derive(Debug, Default)]
pub struct PrimaryRun {
    /// Delegations with exactly one `completed` result carrying the
    /// worker's text.
    pub completed: u64,
    /// First `cp/delegate` to the last result, seconds.
    pub seconds: f64,
    /// `cp/delegate` to its `cp/delegate_result`.
    pub round_trip: Option<hdrhistogram::Histogram<u64>>,
    /// Refusals, wrong statuses or texts, duplicates, unknown ids, and
    /// delegations without a result by the end of the drain.
    pub errors: Vec<String>,
    /// How many errors there were (`errors` keeps the first few).
    pub error_count: u64,
    /// Whether the endpoint closed the connection during the run.
    pub disconnected: bool,
}

impl PrimaryRun {
    fn error(&mut self, e: String) {
        self.error_count += 1;
        if self.errors.len() < 10 {
            self.errors.push(e);
        }
    }
}

/// An OAB primary keeping delegations in flight on one connection.
pub struct Primary {
    ws: Ws,
    /// The `target.name` its delegations name.
    target: String,
    /// Write each frame on its own (as OpenAB's client), set with Nagle's
    /// algorithm on: see [`run_worker`].
    one_write_per_frame: bool,
}

impl Primary {
    /// Dials `addr` (`nagle` as [`connect`]), registers as `prod/koudu`.
    pub async fn connect(
        addr: SocketAddr,
        key: &str,
        target: &str,
        nagle: bool,
    ) -> anyhow::Result<Primary> {
        Self::connect_url(&format!("ws://{addr}/cp"), key, target, nagle).await
    }

    /// [`Primary::connect`] to the CP at `url` (see [`connect_url`]).
    pub async fn connect_url(
        url: &str,
        key: &str,
        target: &str,
        nagle: bool,
    ) -> anyhow::Result<Primary> {
        let mut ws = connect_url(url, key, nagle).await?;
        register(&mut ws, "prod", "koudu", "primary", "bench-primary", 1).await?;
        Ok(Primary {
            ws,
            target: target.into(),
            one_write_per_frame: nagle,
        })
    }

    /// Keeps `n` delegations in flight for `seconds` (or `max` started),
    /// then waits up to `drain` for the last results. `tag` makes the
    /// delegation ids of this run unique on the connection.
    pub async fn run(
        &mut self,
        tag: &str,
        n: usize,
        seconds: f64,
        max: u64,
        drain: Duration,
    ) -> anyhow::Result<PrimaryRun> {
        let one_write = self.one_write_per_frame;
        let mut out = PrimaryRun::default();
        let mut rtt = latency_histogram();
        let t0 = Instant::now();
        let until = t0 + Duration::from_secs_f64(seconds);
        let deadline = oab_connector::a2a::model::iso_from_ms(
            oab_wire::identity::now_ms()
                + (seconds * 1000.0) as u64
                + drain.as_millis() as u64
                + 60_000,
        );
        // delegation id -> when it was sent; removed by its result.
        let mut open: HashMap<String, Instant> = HashMap::with_capacity(n);
        let mut ended: HashMap<String, ()> = HashMap::new();
        // JSON-RPC id of a cp/delegate not yet answered -> its delegation id.
        let mut unanswered: HashMap<u64, String> = HashMap::with_capacity(n);
        let (mut started, mut next_rpc) = (0u64, 1u64);
        let mut last = t0;
        let start_one = |started: &mut u64, next_rpc: &mut u64| {
            *started += 1;
            *next_rpc += 1;
            let id = format!("{tag}-{started}");
            let frame = (
                *next_rpc,
                rpc(
                    *next_rpc,
                    "cp/delegate",
                    json!({ "delegation_id": id, "target": { "name": self.target },
                        "prompt": format!("p {id}"), "deadline": deadline }),
                ),
            );
            (id, frame)
        };
        let mut first = Vec::new();
        for _ in 0..n.max(1) {
            first.push(start_one(&mut started, &mut next_rpc));
        }
        for (id, (rpc_id, frame)) in first {
            open.insert(id.clone(), Instant::now());
            unanswered.insert(rpc_id, id);
            put(&mut self.ws, one_write, frame).await?;
        }
        self.ws.flush().await?;
        let stop_at = until + drain;
        while !open.is_empty() {
            let msg = match tokio::time::timeout_at(stop_at, read(&mut self.ws)).await {
                Err(_) => break,
                Ok(Ok(Some(m))) => m,
                Ok(Ok(None)) | Ok(Err(_)) => {
                    out.disconnected = true;
                    break;
                }
            };
            match msg.get("method").and_then(Value::as_str) {
                Some("cp/delegate_result") => {
                    let p = &msg["params"];
                    let id = p["delegation_id"].as_str().unwrap_or_default().to_string();
                    put(&mut self.ws, one_write, ok(&msg["id"])).await?;
                    let Some(sent) = open.remove(&id) else {
                        let what = if ended.contains_key(&id) {
                            "a second"
                        } else {
                            "a"
                        };
                        out.error(format!("{what} result for {id}, not in flight: {p}"));
                        self.ws.flush().await?;
                        continue;
                    };
                    ended.insert(id.clone(), ());
                    let now = Instant::now();
                    let want = format!("done: p {id}");
                    if p["status"] == "completed" && p["result"] == want.as_str() {
                        out.completed += 1;
                        let _ = rtt.record(now.duration_since(sent).as_nanos() as u64);
                        last = now;
                    } else {
                        out.error(format!("{id}: {p}"));
                    }
                    if now < until && started < max {
                        let (id, (rpc_id, frame)) = start_one(&mut started, &mut next_rpc);
                        open.insert(id.clone(), Instant::now());
                        unanswered.insert(rpc_id, id);
                        put(&mut self.ws, one_write, frame).await?;
                    }
                    self.ws.flush().await?;
                }
                Some(_) => {
                    self.ws.send(ok(&msg["id"])).await?;
                }
                // A response: the ack of a cp/delegate, or an error (a refusal).
                None => {
                    let id = msg["id"].as_u64().and_then(|i| unanswered.remove(&i));
                    if let Some(e) = msg.get("error") {
                        // A refused delegation has no result coming.
                        if let Some(id) = &id {
                            open.remove(id);
                        }
                        out.error(format!("{} refused: {e}", id.unwrap_or_default()));
                    }
                }
            }
        }
        for id in open.keys().take(3) {
            out.error(format!("{id}: no result by the end of the drain"));
        }
        if open.len() > 3 {
            out.error_count += open.len() as u64 - 3;
        }
        out.seconds = last.duration_since(t0).as_secs_f64();
        out.round_trip = Some(rtt);
        Ok(out)
    }
}
