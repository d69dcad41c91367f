//! The physical baseline: endpoint B listens for a WSS connection itself, in
//! this process, so endpoints A and B exchange the same frames over one
//! direct TLS 1.3 WebSocket instead of two hops through the relay. The
//! listener uses the relay's certificate, TLS config and WebSocket settings
//! (`oab_relay::server::ws_config`), and A dials it with the same raw client
//! code it uses for the relay, so the only difference is the relay.

use std::sync::Arc;

use anyhow::Context as _;
use oab_relay::config::Config;
use oab_testkit::raw_client::{self, Target};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsAcceptor;
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::handshake::server::{ErrorResponse, Request, Response};
use tokio_tungstenite::tungstenite::http::HeaderValue;
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;

use crate::setup::{RELAY_ID, Setup};

/// The server side of a direct connection.
pub type ServerWs = WebSocketStream<tokio_rustls::server::TlsStream<TcpStream>>;
/// The client side of any connection (direct or to the relay).
pub type ClientWs = WebSocketStream<raw_client::Io>;

/// A WSS listener for endpoint B.
pub struct DirectListener {
    listener: TcpListener,
    acceptor: TlsAcceptor,
    ws_config: WebSocketConfig,
    cert_der: Vec<u8>,
}

impl std::fmt::Debug for DirectListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DirectListener")
            .field("addr", &self.listener.local_addr().ok())
            .finish_non_exhaustive()
    }
}

impl DirectListener {
    /// Binds `127.0.0.1:0` with the setup's certificate and the relay's
    /// WebSocket settings for `config`.
    pub async fn bind(setup: &Setup, config: &Config) -> anyhow::Result<DirectListener> {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .context("binding the direct listener")?;
        Ok(DirectListener {
            listener,
            acceptor: TlsAcceptor::from(setup.tls.clone()),
            ws_config: oab_relay::server::ws_config(config),
            cert_der: setup.cert_der.clone(),
        })
    }

    /// Where endpoint A dials.
    pub fn target(&self) -> anyhow::Result<Target> {
        Ok(Target {
            addr: self.listener.local_addr()?.to_string(),
            server_name: Some(RELAY_ID.into()),
            root_der: self.cert_der.clone(),
        })
    }

    /// Accepts one connection: TCP (no Nagle, as the relay), TLS, and the
    /// WebSocket upgrade selecting the `oab-relay.v1` subprotocol.
    #[allow(clippy::result_large_err)] // tungstenite's callback signature.
    pub async fn accept(&self) -> anyhow::Result<ServerWs> {
        let (tcp, _) = self.listener.accept().await?;
        tcp.set_nodelay(true)?;
        let tls = self.acceptor.accept(tcp).await.context("direct TLS")?;
        let callback = |_req: &Request, mut resp: Response| -> Result<Response, ErrorResponse> {
            resp.headers_mut().insert(
                "sec-websocket-protocol",
                HeaderValue::from_static(oab_wire::SUBPROTOCOL),
            );
            Ok(resp)
        };
        tokio_tungstenite::accept_hdr_async_with_config(tls, callback, Some(self.ws_config))
            .await
            .context("direct WebSocket upgrade")
    }

    /// Dials this listener as endpoint A and accepts as endpoint B: the two
    /// ends of one direct connection.
    pub async fn pair(self: &Arc<Self>) -> anyhow::Result<(ClientWs, ServerWs)> {
        let target = self.target()?;
        let (client, server) = tokio::join!(raw_client::connect(&target), self.accept());
        let client = client.context("direct connect")?;
        Ok((client.ws, server?))
    }
}
