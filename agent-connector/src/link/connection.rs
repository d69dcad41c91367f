//! Reaching the relay and keeping the session up: dial, TLS, the WebSocket
//! upgrade and the handshake; the session loop that reads frames, takes
//! commands, pings on the relay's heartbeat and declares a silent link
//! dead; reconnecting with exponential backoff and full jitter.
//!
//! The only code that touches the socket. The session loop's `select!` arms
//! only collect frames in `out`; they are written after the arm ran (the
//! best-effort close on shutdown, bounded by `CLOSE_WAIT`, is the one write
//! inside an arm). Every write is raced against shutdown and must make
//! progress within the heartbeat deadline: a peer or middlebox that stops
//! reading ends the session like a silent one. After the handshake, never
//! interprets a frame itself: frames go to `dispatch`.

use std::time::Duration;

use bytes::Bytes;
use futures_util::{SinkExt as _, StreamExt as _};
use oab_wire::handshake::{ChannelBinding, answer_challenge};
use oab_wire::identity::now_ms;
use oab_wire::{DelegationCursor, Frame, Limits, decode_message, encode};
use tokio::net::TcpStream;
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::http::HeaderValue;
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::relay_url::relay_request;
use super::{EventError, Link, LinkError, LinkState};

/// What to check when the relay's certificate is refused.
const CERTIFICATE_HINT: &str = "check connector.relay_ca (the PEM of the CA that signed the relay's certificate) or relay_pin_sha256; the relay's certificate must be an end-entity certificate (CA:FALSE) naming the relay's host in subjectAltName";

/// What to do about a refused relay certificate, from rustls' reason: an
/// expired (or not yet valid) certificate is the relay's to renew (its
/// date is named), anything else is this side's trust settings.
fn certificate_hint(reason: &str) -> String {
    // rustls: "... is not valid after <unix secs> ..." / "... before ...".
    let date_after = |marker: &str| {
        let rest = reason.split(marker).nth(1)?;
        let secs: i64 = rest.split_whitespace().next()?.parse().ok()?;
        Some(oab_ops::time::utc_rfc3339(secs))
    };
    if reason.contains("certificate expired") || reason.contains("Expired") {
        let when = date_after("not valid after ")
            .map(|d| format!(" at {d} (its notAfter)"))
            .unwrap_or_default();
        format!(
            "the relay's certificate expired{when}: it must be renewed on the relay \
             (relay.tls_cert, then a reload); nothing in this connector's configuration is wrong"
        )
    } else if reason.contains("not valid yet") || reason.contains("NotValidYet") {
        let when = date_after("not valid before ")
            .map(|d| format!(" before {d} (its notBefore)"))
            .unwrap_or_default();
        format!(
            "the relay's certificate is not valid{when}: check the clocks of this host and \
             of the relay"
        )
    } else {
        CERTIFICATE_HINT.to_string()
    }
}

/// How long the close frame sent at shutdown may take to leave.
const CLOSE_WAIT: Duration = Duration::from_secs(1);

type Ws = WebSocketStream<
    tokio_util::either::Either<tokio_rustls::client::TlsStream<TcpStream>, TcpStream>,
>;

enum Exit {
    Reconnect(String),
    Fatal(String),
    Shutdown,
}

fn jitter(max: Duration) -> Duration {
    let mut b = [0u8; 8];
    rand_core::RngCore::fill_bytes(&mut rand_core::OsRng, &mut b);
    let max_ms = u64::try_from(max.as_millis()).unwrap_or(u64::MAX).max(1);
    Duration::from_millis(u64::from_be_bytes(b) % max_ms)
}

impl Link {
    pub(super) async fn run(mut self, shutdown: CancellationToken) {
        let mut attempt: u32 = 0;
        // Until the first session, a failure is an operator's problem (a
        // wrong URL, port or trust): said at WARN with the URL.
        let mut ever_connected = false;
        loop {
            let _ = self.state.send(LinkState::Connecting { attempt });
            let connected = tokio::select! {
                () = shutdown.cancelled() => break,
                r = tokio::time::timeout(self.settings.connect_timeout, self.connect()) => r,
            };
            let exit = match connected {
                Ok(Ok((ws, welcome_list))) => {
                    attempt = 0;
                    ever_connected = true;
                    self.online = true;
                    let exit = self.session(ws, welcome_list, &shutdown).await;
                    self.online = false;
                    exit
                }
                Ok(Err(Exit::Fatal(r))) => Exit::Fatal(r),
                Ok(Err(e)) => e,
                Err(_) => Exit::Reconnect("connect timed out".into()),
            };
            if let Exit::Reconnect(reason) | Exit::Fatal(reason) = &exit {
                let mut facts = self.stats.facts.lock();
                facts.session = None;
                facts.connected_since_ms = None;
                facts.last_disconnect = Some((now_ms(), reason.clone()));
                if let Some(d) = facts.descriptor.as_mut() {
                    d.sent = false;
                }
            }
            match exit {
                Exit::Shutdown => break,
                Exit::Fatal(reason) => {
                    warn!(%reason, "link stopped for good");
                    self.stop(&reason);
                    return;
                }
                Exit::Reconnect(reason) => {
                    self.stats
                        .reconnects
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    attempt = attempt.saturating_add(1);
                    let cap = self
                        .settings
                        .backoff_initial
                        .saturating_mul(2u32.saturating_pow(attempt.min(16)))
                        .min(self.settings.backoff_max);
                    // Full jitter; a drain hint sets the floor.
                    let wait = self.drain_hint.take().unwrap_or_default() + jitter(cap);
                    if reason.contains("certificate") {
                        // Retrying will not help until the configuration
                        // or the relay's certificate changes: say so loudly.
                        let hint = certificate_hint(&reason);
                        warn!(url = %self.settings.url, %reason, attempt, wait_ms = wait.as_millis() as u64, %hint, "the relay's certificate was refused; reconnecting");
                    } else if !ever_connected {
                        let url = &self.settings.url;
                        warn!(%url, %reason, attempt, wait_ms = wait.as_millis() as u64, "cannot reach the relay at {url}: {reason}; retrying");
                    } else {
                        info!(url = %self.settings.url, %reason, attempt, wait_ms = wait.as_millis() as u64, "link down; reconnecting");
                    }
                    let _ = self.state.send(LinkState::Connecting { attempt });
                    if !self.wait_offline(wait, &shutdown).await {
                        break;
                    }
                }
            }
        }
        self.stop("connector shut down");
    }

    fn stop(&mut self, reason: &str) {
        let _ = self.state.send(LinkState::Stopped(reason.to_string()));
        for d in self.delegations.values_mut() {
            d.notify_subscribers(&Err(EventError::Stopped(reason.to_string())));
            for (_, w) in d.send_log.ack_waiters.drain(..) {
                let _ = w.send(Err(LinkError::Stopped(reason.to_string())));
            }
        }
        self.commands.close();
    }

    /// While disconnected: keep taking commands (frames queue as unacked)
    /// until the backoff elapses. `false` on shutdown.
    async fn wait_offline(&mut self, wait: Duration, shutdown: &CancellationToken) -> bool {
        let until = tokio::time::Instant::now() + wait;
        loop {
            let room = self.buffered < self.settings.max_buffered_frames;
            tokio::select! {
                () = shutdown.cancelled() => return false,
                () = tokio::time::sleep_until(until) => return true,
                () = self.trust_changed.notified() => return true,
                cmd = self.commands.recv(), if room => match cmd {
                    Some(cmd) => self.apply_command(cmd),
                    None => return false,
                },
            }
            self.note_buffered();
        }
    }

    async fn connect(&mut self) -> Result<(Ws, Vec<DelegationCursor>), Exit> {
        let reconnect = |e: &dyn std::fmt::Display| Exit::Reconnect(e.to_string());
        let (mut req, url) = relay_request(&self.settings.url).map_err(Exit::Fatal)?;
        let tcp = TcpStream::connect((url.host.as_str(), url.port))
            .await
            .map_err(|e| match e.kind() {
                std::io::ErrorKind::ConnectionRefused => Exit::Reconnect(
                    "connection refused (is the relay running, and is connector.relay_url \
                     its relay.listen?)"
                        .into(),
                ),
                _ => reconnect(&e),
            })?;
        let _ = tcp.set_nodelay(true);
        let (io, binding) = if url.tls {
            let name = rustls::pki_types::ServerName::try_from(url.host.clone())
                .map_err(|e| Exit::Fatal(format!("relay host name: {e}")))?;
            let tls = tokio_rustls::TlsConnector::from(self.tls.load_full())
                .connect(name, tcp)
                .await
                .map_err(|e| {
                    let corrupt = e
                        .get_ref()
                        .and_then(|inner| inner.downcast_ref::<rustls::Error>())
                        .is_some_and(|r| {
                            matches!(
                                r,
                                rustls::Error::InvalidMessage(
                                    rustls::InvalidMessage::InvalidContentType
                                )
                            )
                        });
                    if corrupt {
                        // An HTTP answer (or any plain bytes) to the TLS hello.
                        Exit::Reconnect(format!(
                            "{}:{} does not speak TLS (is it the relay's admin port? \
                             connector.relay_url must name the relay's relay.listen)",
                            url.host, url.port
                        ))
                    } else {
                        reconnect(&format!("TLS: {e}"))
                    }
                })?;
            let binding = if self.settings.challenge_only {
                ChannelBinding::ChallengeOnly
            } else {
                let value = tls
                    .get_ref()
                    .1
                    .export_keying_material(
                        [0u8; 32],
                        oab_wire::handshake::TLS_EXPORTER_LABEL,
                        None,
                    )
                    .map_err(|e| reconnect(&e))?;
                ChannelBinding::TlsExporter(value)
            };
            (tokio_util::either::Either::Left(tls), binding)
        } else {
            (
                tokio_util::either::Either::Right(tcp),
                ChannelBinding::ChallengeOnly,
            )
        };
        req.headers_mut().insert(
            "sec-websocket-protocol",
            HeaderValue::from_static(oab_wire::SUBPROTOCOL),
        );
        // The write buffer's cap must hold the largest frame any relay may
        // take (the limits arrive with the Welcome, after the upgrade): a
        // frame over the session's limits never reaches the socket (`pump`).
        let cfg = WebSocketConfig::default()
            .read_buffer_size(16 * 1024)
            .write_buffer_size(32 * 1024)
            .max_write_buffer_size(32 * 1024 + 2 * ceiling().max_frame())
            .max_message_size(Some(oab_wire::limits::MAX_PAYLOAD_CEILING as usize * 2))
            .max_frame_size(Some(oab_wire::limits::MAX_PAYLOAD_CEILING as usize * 2));
        let (mut ws, _) = tokio_tungstenite::client_async_with_config(req, io, Some(cfg))
            .await
            .map_err(|e| reconnect(&format!("upgrade: {e}")))?;
        let challenge = match recv_handshake(&mut ws).await? {
            Frame::Challenge(c) => c,
            other => {
                return Err(Exit::Reconnect(format!(
                    "expected challenge, got {:?}",
                    other.frame_type()
                )));
            }
        };
        let hello = answer_challenge(
            &self.settings.identity,
            &challenge,
            self.settings.relay_id.as_ref(),
            self.settings.instance,
            now_ms(),
            &binding,
        )
        .map_err(|e| match e {
            oab_wire::handshake::HandshakeError::RelayMismatch { expected, got } => {
                Exit::Fatal(format!(
                    "connector.relay_id is {expected:?}, but the relay at {} names itself \
                     {got:?}; set connector.relay_id = {got:?} if that is the relay meant, \
                     or point connector.relay_url at the relay {expected:?}",
                    self.settings.url
                ))
            }
            other => Exit::Fatal(other.to_string()),
        })?;
        let version = hello.version;
        let bytes = encode(&Frame::Hello(hello)).map_err(|e| Exit::Fatal(e.to_string()))?;
        ws.send(Message::Binary(bytes))
            .await
            .map_err(|e| reconnect(&e))?;
        let welcome = match recv_handshake(&mut ws).await? {
            Frame::Welcome(w) => w,
            other => {
                return Err(Exit::Reconnect(format!(
                    "expected welcome, got {:?}",
                    other.frame_type()
                )));
            }
        };
        let list: Vec<DelegationCursor> =
            serde_json::from_slice(&welcome.payload).unwrap_or_default();
        self.max_in_flight = welcome.max_in_flight.max(1);
        self.session_version = version;
        self.heartbeat = Duration::from_millis(u64::from(welcome.heartbeat_ms.max(100)));
        self.limits = Limits {
            max_header: welcome.max_header,
            max_payload: welcome.max_payload,
        };
        self.stats.set_max_payload(welcome.max_payload);
        if let Some(old) = self.epoch.replace(welcome.epoch)
            && old != welcome.epoch
        {
            warn!(
                old,
                new = welcome.epoch,
                "relay store epoch changed: its logs may be lost"
            );
            self.epoch_changed(&list);
        }
        {
            let now = now_ms();
            let mut facts = self.stats.facts.lock();
            facts.session = Some(welcome.session.to_string());
            facts.connected_since_ms = Some(now);
            facts.epoch = Some(welcome.epoch);
            facts.heartbeat_ms = Some(self.heartbeat.as_millis().try_into().unwrap_or(u64::MAX));
            self.stats
                .last_rx_ms
                .store(now, std::sync::atomic::Ordering::Relaxed);
        }
        self.stats
            .sessions
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let _ = self.state.send(LinkState::Connected {
            epoch: welcome.epoch,
        });
        info!(session = %welcome.session, delegations = list.len(), "connected to relay");
        Ok((ws, list))
    }

    async fn session(
        &mut self,
        mut ws: Ws,
        list: Vec<DelegationCursor>,
        shutdown: &CancellationToken,
    ) -> Exit {
        let mut out: Vec<Bytes> = Vec::new();
        self.after_welcome(&list, &mut out);
        for (key, d) in self.delegations.iter_mut() {
            d.send_log.sent = d.send_log.acked;
            if !d.send_log.unacked.is_empty() {
                self.ready_to_send.insert(key.clone());
            }
        }
        let heartbeat = self.heartbeat;
        let dead = heartbeat * self.settings.dead_after_heartbeats.max(2);
        self.pump(&mut out);
        if let Err(e) = self.write_all(&mut ws, &mut out, dead, shutdown).await {
            return e;
        }
        let mut ping = tokio::time::interval(heartbeat);
        ping.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last_rx = tokio::time::Instant::now();
        let mut token = 0u64;
        loop {
            let room = self.buffered < self.settings.max_buffered_frames;
            tokio::select! {
                () = shutdown.cancelled() => {
                    // Best effort, bounded: a relay that stopped reading
                    // does not hold the shutdown.
                    let _ = tokio::time::timeout(CLOSE_WAIT, ws.close(None)).await;
                    return Exit::Shutdown;
                }
                cmd = self.commands.recv(), if room => {
                    let Some(cmd) = cmd else { return Exit::Shutdown };
                    self.apply_command(cmd);
                    // Take whatever else is queued without waiting.
                    while self.buffered < self.settings.max_buffered_frames {
                        let Ok(cmd) = self.commands.try_recv() else { break };
                        self.apply_command(cmd);
                    }
                    self.pump(&mut out);
                }
                msg = ws.next() => {
                    last_rx = tokio::time::Instant::now();
                    oab_ops::busy_poll::touch(last_rx.into_std());
                    self.stats.frames_in.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    self.stats.last_rx_ms.store(now_ms(), std::sync::atomic::Ordering::Relaxed);
                    match msg {
                        None => return Exit::Reconnect("relay closed the connection".into()),
                        Some(Err(e)) => return Exit::Reconnect(e.to_string()),
                        Some(Ok(Message::Close(c))) => {
                            let (code, reason) = c.map(|c| (u16::from(c.code), c.reason.to_string())).unwrap_or((1005, String::new()));
                            return if oab_wire::code::close_code_should_reconnect(code) {
                                Exit::Reconnect(format!("closed by relay: {code} {reason}"))
                            } else {
                                Exit::Fatal(format!("closed by relay: {code} {reason}"))
                            };
                        }
                        Some(Ok(Message::Binary(b))) => match decode_message(b, &ceiling()) {
                            Ok(frame) => self.dispatch(frame, &mut out),
                            Err(e) => return Exit::Reconnect(format!("undecodable frame from relay: {e}")),
                        },
                        Some(Ok(_)) => {}
                    }
                    self.pump(&mut out);
                }
                () = tokio::time::sleep_until(self.retry_at.unwrap_or_else(tokio::time::Instant::now)), if self.retry_at.is_some() => {
                    self.retry_now(&mut out);
                    self.pump(&mut out);
                }
                _ = ping.tick() => {
                    if last_rx.elapsed() > dead {
                        return Exit::Reconnect("no frame from the relay within the heartbeat deadline".into());
                    }
                    token += 1;
                    if let Ok(b) = encode(&Frame::Ping(oab_wire::Ping { token })) {
                        out.push(b);
                    }
                }
            }
            if let Err(e) = self.write_all(&mut ws, &mut out, dead, shutdown).await {
                return e;
            }
        }
    }

    /// Writes `out` and counts the frames. Each frame (and the flush) must
    /// be taken by the socket within `dead`, the heartbeat deadline: a
    /// relay or middlebox that stops reading (its TCP window stays shut)
    /// is a dead link like a silent one, and the link reconnects instead of
    /// blocking in the write. Shutdown ends a write that is stuck.
    async fn write_all(
        &self,
        ws: &mut Ws,
        out: &mut Vec<Bytes>,
        dead: Duration,
        shutdown: &CancellationToken,
    ) -> Result<(), Exit> {
        let n = u64::try_from(out.len()).unwrap_or(u64::MAX);
        tokio::select! {
            r = write_all(ws, out, dead) => r.map_err(Exit::Reconnect)?,
            () = shutdown.cancelled() => return Err(Exit::Shutdown),
        }
        self.stats
            .frames_out
            .fetch_add(n, std::sync::atomic::Ordering::Relaxed);
        self.note_buffered();
        Ok(())
    }

    /// Publishes the resend buffer's size to the stats.
    fn note_buffered(&self) {
        self.stats.unacked.store(
            u64::try_from(self.buffered).unwrap_or(u64::MAX),
            std::sync::atomic::Ordering::Relaxed,
        );
    }
}

/// The protocol's ceilings: frames from the relay are read within them (the
/// relay may send a larger payload than it takes), and before the first
/// `Welcome` nothing smaller is known of what it takes.
pub(super) fn ceiling() -> Limits {
    Limits {
        max_header: u16::MAX,
        max_payload: oab_wire::limits::MAX_PAYLOAD_CEILING,
    }
}

async fn recv_handshake(ws: &mut Ws) -> Result<Frame, Exit> {
    loop {
        match ws.next().await {
            None => return Err(Exit::Reconnect("relay closed during the handshake".into())),
            Some(Err(e)) => return Err(Exit::Reconnect(e.to_string())),
            Some(Ok(Message::Binary(b))) => {
                return decode_message(b, &ceiling()).map_err(|e| Exit::Reconnect(e.to_string()));
            }
            Some(Ok(Message::Close(c))) => {
                let (code, reason) = c
                    .map(|c| (u16::from(c.code), c.reason.to_string()))
                    .unwrap_or((1005, String::new()));
                let msg = format!("relay refused the session: {code} {reason}");
                return Err(if oab_wire::code::close_code_should_reconnect(code) {
                    Exit::Reconnect(msg)
                } else {
                    Exit::Fatal(msg)
                });
            }
            Some(Ok(_)) => {}
        }
    }
}

/// Feeds every frame of `out` and flushes, each step within `deadline`.
async fn write_all(ws: &mut Ws, out: &mut Vec<Bytes>, deadline: Duration) -> Result<(), String> {
    if out.is_empty() {
        return Ok(());
    }
    let stalled = || {
        format!(
            "the relay took nothing written to it for {} ms (the heartbeat deadline); the link is dead",
            deadline.as_millis()
        )
    };
    for b in out.drain(..) {
        tokio::time::timeout(deadline, ws.feed(Message::Binary(b)))
            .await
            .map_err(|_| stalled())?
            .map_err(|e| e.to_string())?;
    }
    tokio::time::timeout(deadline, ws.flush())
        .await
        .map_err(|_| stalled())?
        .map_err(|e| e.to_string())
}
