//! Serving the facade: on a listener the caller binds (loopback, port 0 in
//! tests), until a shutdown token fires. Open SSE streams end when it fires,
//! so the graceful shutdown is not held up by subscribers; the delegations
//! behind them go on.
//!
//! Never: binds a port or chooses an address: the caller hands in the listener
//! (the `oab-connector` binary binds `a2a.facade_listen`, which its
//! configuration keeps on loopback).

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use super::facade::Facade;

/// Serves `facade` on `listener` until `shutdown` fires, then drains the
/// open connections (streams end at once) and returns.
pub async fn serve(
    listener: TcpListener,
    facade: Facade,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    let router = facade.router_until(shutdown.child_token());
    axum::serve(listener, router)
        .with_graceful_shutdown(shutdown.cancelled_owned())
        .await
}
