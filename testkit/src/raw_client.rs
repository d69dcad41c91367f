//! A minimal protocol client: TLS, WebSocket upgrade, session handshake, then
//! raw frames. Used by the relay's tests, the load tester and for debugging;
//! OAB hosts use the `oab-connector` crate instead.
//!
//! Never: retries, resends or reorders anything: it sends exactly the frames
//! (or the raw bytes, `send_raw`) a test gives it, so a test can send what a
//! real connector never would.

use std::sync::Arc;

use bytes::Bytes;
use futures_util::{SinkExt as _, StreamExt as _};
use oab_wire::handshake::{ChannelBinding, answer_challenge};
use oab_wire::identity::{Identity, now_ms};
use oab_wire::{Frame, InstanceId, Limits, Welcome, decode_message, encode};
use rustls::pki_types::ServerName;
use tokio::net::TcpStream;
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::client::IntoClientRequest as _;
use tokio_tungstenite::tungstenite::http::HeaderValue;
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;

/// The stream type under the WebSocket: TLS or plain TCP.
pub type Io = tokio_util::either::Either<tokio_rustls::client::TlsStream<TcpStream>, TcpStream>;

/// Errors of the raw client.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// Connecting, TLS or the upgrade failed.
    #[error("connect: {0}")]
    Connect(String),
    /// The relay closed the connection.
    #[error("closed by relay: {code} {reason}")]
    Closed {
        /// Close code (0 when none was given).
        code: u16,
        /// Close reason.
        reason: String,
    },
    /// A frame could not be decoded.
    #[error("frame: {0}")]
    Frame(#[from] oab_wire::FrameError),
    /// The handshake could not be answered.
    #[error("handshake: {0}")]
    Handshake(#[from] oab_wire::handshake::HandshakeError),
    /// An unexpected frame arrived.
    #[error("unexpected frame: {0:?}")]
    Unexpected(Box<Frame>),
    /// The WebSocket failed.
    #[error("websocket: {0}")]
    Ws(#[from] tokio_tungstenite::tungstenite::Error),
}

/// Where and how to connect.
#[derive(Debug, Clone)]
pub struct Target {
    /// `host:port` of the relay.
    pub addr: String,
    /// TLS server name (certificate name); `None` for plain TCP (behind a load balancer).
    pub server_name: Option<String>,
    /// Trusted root certificate (DER), for TLS.
    pub root_der: Vec<u8>,
}

/// A connection that has done TCP, TLS (unless plain) and the upgrade, but
/// not the session handshake.
pub struct Connection {
    /// The WebSocket.
    pub ws: WebSocketStream<Io>,
    /// The binding value to sign.
    pub binding: ChannelBinding,
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connection").finish_non_exhaustive()
    }
}

/// Largest `Welcome` payload a relay sends (`docs/protocol.md` §6.6): the
/// list of open delegations may be longer than a log frame's payload.
pub const MAX_WELCOME_PAYLOAD: usize = 4 * 1024 * 1024;

/// The client WebSocket settings: a message may be as large as a frame
/// under `limits` or a `Welcome` of the largest size, whichever is larger.
pub fn client_ws_config(limits: &Limits) -> WebSocketConfig {
    let welcome =
        oab_wire::limits::PREFIX_LEN + usize::from(limits.max_header) + MAX_WELCOME_PAYLOAD;
    let max = limits.max_frame().max(welcome);
    WebSocketConfig::default()
        .read_buffer_size(8 * 1024)
        .write_buffer_size(32 * 1024)
        .max_write_buffer_size(4 * limits.max_frame())
        .max_message_size(Some(max))
        .max_frame_size(Some(max))
}

/// TCP + TLS + WebSocket upgrade with the `oab-relay.v1` subprotocol.
pub async fn connect(target: &Target) -> Result<Connection, ClientError> {
    let tcp = TcpStream::connect(&target.addr)
        .await
        .map_err(|e| ClientError::Connect(e.to_string()))?;
    connect_over(tcp, target).await
}

/// TLS + WebSocket upgrade over a TCP connection the caller opened (to
/// choose its source address or socket options).
pub async fn connect_over(tcp: TcpStream, target: &Target) -> Result<Connection, ClientError> {
    let err = |e: &dyn std::fmt::Display| ClientError::Connect(e.to_string());
    tcp.set_nodelay(true).map_err(|e| err(&e))?;
    let (io, binding, scheme, host) = match &target.server_name {
        Some(name) => {
            let mut roots = rustls::RootCertStore::empty();
            roots
                .add(rustls::pki_types::CertificateDer::from(
                    target.root_der.clone(),
                ))
                .map_err(|e| err(&e))?;
            let provider = Arc::new(rustls::crypto::ring::default_provider());
            let mut cfg = rustls::ClientConfig::builder_with_provider(provider)
                .with_protocol_versions(&[&rustls::version::TLS13])
                .map_err(|e| err(&e))?
                .with_root_certificates(roots)
                .with_no_client_auth();
            cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
            let sn = ServerName::try_from(name.clone()).map_err(|e| err(&e))?;
            let tls = tokio_rustls::TlsConnector::from(Arc::new(cfg))
                .connect(sn, tcp)
                .await
                .map_err(|e| err(&e))?;
            let exporter = exporter_value(tls.get_ref().1)
                .ok_or_else(|| ClientError::Connect("no TLS exporter".into()))?;
            (
                tokio_util::either::Either::Left(tls),
                ChannelBinding::TlsExporter(exporter),
                "wss",
                name.clone(),
            )
        }
        None => (
            tokio_util::either::Either::Right(tcp),
            ChannelBinding::ChallengeOnly,
            "ws",
            target.addr.clone(),
        ),
    };
    let url = format!("{scheme}://{host}/");
    let mut req = url.into_client_request().map_err(|e| err(&e))?;
    req.headers_mut().insert(
        "sec-websocket-protocol",
        HeaderValue::from_static(oab_wire::SUBPROTOCOL),
    );
    let (ws, _resp) = tokio_tungstenite::client_async_with_config(
        req,
        io,
        Some(client_ws_config(&Limits::default())),
    )
    .await
    .map_err(|e| err(&e))?;
    Ok(Connection { ws, binding })
}

/// An authenticated raw session.
pub struct RawClient {
    /// The WebSocket.
    pub ws: WebSocketStream<Io>,
    /// The relay's welcome.
    pub welcome: Welcome,
    limits: Limits,
}

impl std::fmt::Debug for RawClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RawClient")
            .field("session", &self.welcome.session)
            .finish_non_exhaustive()
    }
}

impl Connection {
    /// Reads the next frame (skipping WebSocket pings). Before the
    /// `Welcome` the session's limits are not known: a payload may be as
    /// large as the largest `Welcome`'s.
    pub async fn recv(&mut self) -> Result<Frame, ClientError> {
        let handshake = Limits {
            max_payload: MAX_WELCOME_PAYLOAD as u32,
            ..Limits::default()
        };
        recv_frame(&mut self.ws, &handshake).await
    }

    /// Sends a frame.
    pub async fn send(&mut self, frame: &Frame) -> Result<(), ClientError> {
        self.ws.send(Message::Binary(encode(frame)?)).await?;
        Ok(())
    }

    /// Runs the session handshake as `identity`.
    pub async fn handshake(
        self,
        identity: &Identity,
        instance: InstanceId,
    ) -> Result<RawClient, ClientError> {
        self.handshake_at(identity, instance, now_ms()).await
    }

    /// Runs the session handshake as `identity`, with `time_ms` as the
    /// `Hello`'s clock (within the relay's skew): which of two connections
    /// of one connector process is the later one.
    pub async fn handshake_at(
        mut self,
        identity: &Identity,
        instance: InstanceId,
        time_ms: u64,
    ) -> Result<RawClient, ClientError> {
        let challenge = match self.recv().await? {
            Frame::Challenge(c) => c,
            other => return Err(ClientError::Unexpected(Box::new(other))),
        };
        let hello = answer_challenge(identity, &challenge, None, instance, time_ms, &self.binding)?;
        self.send(&Frame::Hello(hello)).await?;
        match self.recv().await? {
            Frame::Welcome(welcome) => Ok(RawClient {
                limits: Limits {
                    max_header: welcome.max_header,
                    max_payload: welcome.max_payload,
                },
                ws: self.ws,
                welcome,
            }),
            other => Err(ClientError::Unexpected(Box::new(other))),
        }
    }
}

async fn recv_frame(ws: &mut WebSocketStream<Io>, limits: &Limits) -> Result<Frame, ClientError> {
    loop {
        match ws.next().await {
            None => {
                return Err(ClientError::Closed {
                    code: 0,
                    reason: "eof".into(),
                });
            }
            Some(Err(e)) => return Err(e.into()),
            Some(Ok(Message::Binary(b))) => return Ok(decode_message(b, limits)?),
            Some(Ok(Message::Close(c))) => {
                return Err(ClientError::Closed {
                    code: c.as_ref().map_or(0, |c| u16::from(c.code)),
                    reason: c.map(|c| c.reason.to_string()).unwrap_or_default(),
                });
            }
            Some(Ok(_)) => continue,
        }
    }
}

impl RawClient {
    /// Connects and authenticates.
    pub async fn connect(
        target: &Target,
        identity: &Identity,
        instance: InstanceId,
    ) -> Result<RawClient, ClientError> {
        connect(target).await?.handshake(identity, instance).await
    }

    /// Sends a frame.
    pub async fn send(&mut self, frame: &Frame) -> Result<(), ClientError> {
        self.ws.send(Message::Binary(encode(frame)?)).await?;
        Ok(())
    }

    /// Queues a frame without flushing (call [`RawClient::flush`]).
    pub async fn feed(&mut self, frame: &Frame) -> Result<(), ClientError> {
        self.ws.feed(Message::Binary(encode(frame)?)).await?;
        Ok(())
    }

    /// Flushes queued frames.
    pub async fn flush(&mut self) -> Result<(), ClientError> {
        self.ws.flush().await?;
        Ok(())
    }

    /// Sends raw bytes as one binary message.
    pub async fn send_raw(&mut self, bytes: Bytes) -> Result<(), ClientError> {
        self.ws.send(Message::Binary(bytes)).await?;
        Ok(())
    }

    /// Reads the next frame; a close becomes [`ClientError::Closed`].
    pub async fn recv(&mut self) -> Result<Frame, ClientError> {
        recv_frame(&mut self.ws, &self.limits).await
    }

    /// Closes the connection normally.
    pub async fn close(mut self) {
        let _ = self.ws.close(None).await;
    }
}

/// The RFC 9266 `tls-exporter` value of a TLS connection.
fn exporter_value<D>(conn: &rustls::ConnectionCommon<D>) -> Option<[u8; 32]> {
    conn.export_keying_material([0u8; 32], oab_wire::handshake::TLS_EXPORTER_LABEL, None)
        .ok()
}
