//! The connector's admin endpoint: `/metrics` (Prometheus text, every series
//! `oab_connector_*`: the link's, and with the `a2a` feature the facade's
//! push deliveries), `/healthz` (the process answers), `/readyz` (the link
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

/// What the admin routes read: the link, and the facade when there is one
/// (a `LinkHandle` converts into one without a facade).
#[derive(Clone)]
pub struct AdminSources {
    link: LinkHandle,
    /// The facade whose push deliveries `/metrics` shows; `None`: the push
    /// series are exported at 0.
    #[cfg(feature = "a2a")]
    facade: Option<crate::a2a::Facade>,
}

impl AdminSources {
    /// The link only.
    pub fn new(link: LinkHandle) -> AdminSources {
        AdminSources {
            link,
            #[cfg(feature = "a2a")]
            facade: None,
        }
    }

    /// Adds the facade whose push deliveries `/metrics` shows.
    #[cfg(feature = "a2a")]
    pub fn with_facade(mut self, facade: Option<crate::a2a::Facade>) -> AdminSources {
        self.facade = facade;
        self
    }
}

impl From<LinkHandle> for AdminSources {
    fn from(link: LinkHandle) -> AdminSources {
        AdminSources::new(link)
    }
}

/// The admin routes over `sources` (a [`LinkHandle`] or [`AdminSources`]).
pub fn router(sources: impl Into<AdminSources>) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(ready))
        .route("/status", get(status))
        .with_state(sources.into())
}

/// Serves the admin routes on `listener` until `shutdown` fires.
pub async fn serve(
    listener: TcpListener,
    sources: impl Into<AdminSources>,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    axum::serve(listener, router(sources))
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

async fn metrics(State(sources): State<AdminSources>) -> impl axum::response::IntoResponse {
    let link = &sources.link;
    let text = link
        .stats()
        .render_prometheus(state_name(&link.state()), link.relay_reachable());
    #[cfg(feature = "a2a")]
    let text = text
        + &match &sources.facade {
            Some(facade) => facade.render_push_metrics(),
            None => crate::a2a::PushStats::default()
                .render_prometheus(crate::a2a::PushConfigCounts::default()),
        };
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4",
        )],
        text,
    )
}

async fn ready(State(sources): State<AdminSources>) -> (StatusCode, String) {
    let link = &sources.link;
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

async fn status(State(sources): State<AdminSources>) -> axum::Json<ConnectorStatus> {
    axum::Json(ConnectorStatus::of(&sources.link).await)
}
