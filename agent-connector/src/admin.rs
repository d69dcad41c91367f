//! The connector's admin endpoint: `/metrics` (Prometheus text, every series
//! `oab_connector_*`), `/healthz` (the process answers), `/readyz` (the link
//! is up and the relay answers on it) and `/status` (JSON,
//! [`crate::status::ConnectorStatus`]), on a listener the caller binds
//! (`[admin] listen` in `connector.toml`; port 0 in tests).
//!
//! The one module of the crate that serves HTTP for operators, so the HTTP
//! server can be left out of builds that do not want it.
//!
//! Never: binds a port itself, changes anything (every route is a read), or
//! waits on the link task without a deadline (`/status` lists delegations
//! under [`crate::status::LIST_DEADLINE`]; the other routes read atomics).

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::link::{LinkHandle, LinkState};
use crate::status::ConnectorStatus;

/// The admin routes over `link`.
pub fn router(link: LinkHandle) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(ready))
        .route("/status", get(status))
        .with_state(link)
}

/// Serves the admin routes on `listener` until `shutdown` fires.
pub async fn serve(
    listener: TcpListener,
    link: LinkHandle,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    axum::serve(listener, router(link))
        .with_graceful_shutdown(shutdown.cancelled_owned())
        .await
}

fn state_name(state: &LinkState) -> &'static str {
    match state {
        LinkState::Connecting { .. } => "connecting",
        LinkState::Connected { .. } => "connected",
        LinkState::Stopped(_) => "stopped",
    }
}

async fn metrics(State(link): State<LinkHandle>) -> impl axum::response::IntoResponse {
    let text = link
        .stats()
        .render_prometheus(state_name(&link.state()), link.relay_reachable());
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4",
        )],
        text,
    )
}

async fn ready(State(link): State<LinkHandle>) -> (StatusCode, String) {
    match link.state() {
        LinkState::Connected { .. } if link.relay_reachable() => (StatusCode::OK, "ready\n".into()),
        LinkState::Connected { .. } => (
            StatusCode::SERVICE_UNAVAILABLE,
            "relay silent: no frame within the dead-link deadline\n".into(),
        ),
        LinkState::Connecting { attempt } => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("connecting to the relay (attempt {attempt})\n"),
        ),
        LinkState::Stopped(reason) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("stopped: {reason}\n"),
        ),
    }
}

async fn status(State(link): State<LinkHandle>) -> axum::Json<ConnectorStatus> {
    axum::Json(ConnectorStatus::of(&link).await)
}
