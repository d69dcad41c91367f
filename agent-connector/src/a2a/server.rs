//! Serving the facade: on a listener the caller binds (loopback, port 0 in
//! tests), until a shutdown token fires. Open SSE streams end when it fires,
//! so the graceful shutdown is not held up by subscribers; the delegations
//! behind them go on.
//!
//! Each connection is served by hyper's HTTP/1 server (the one `axum::serve`
//! uses), driven here so that it has a header read timeout
//! ([`FacadeOptions::header_read_timeout`](super::FacadeOptions)): a
//! connection that does not send a request's headers in time, whether new,
//! sending them a byte at a time, or idle between requests, is closed. So
//! slow or silent local connections hold the facade's tasks and sockets for
//! that long at most. Its writes have a deadline too
//! ([`super::write_deadline`]): a client that stops reading is cut once
//! one write has waited 10 s, so the drain at shutdown is bounded.
//!
//! Never: binds a port or chooses an address: the caller hands in the listener
//! (the `oab-connector` binary binds `a2a.facade_listen`, which its
//! configuration keeps on loopback). Never waits for a request's headers
//! without a deadline.

use std::pin::pin;
use std::time::Duration;

use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{Instrument as _, debug, warn};

use super::facade::Facade;
use super::write_deadline::{FACADE_WRITE_TIMEOUT, WriteDeadline};

/// Pause after a failed `accept` (out of file descriptors and the like),
/// so the loop does not spin while the condition lasts.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

/// Serves `facade` on `listener` until `shutdown` fires, then drains the
/// open connections (streams end at once; a connection waiting for its
/// next request closes) and returns.
pub async fn serve(
    listener: TcpListener,
    facade: Facade,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    let header_timeout = facade.header_read_timeout();
    let service = TowerToHyperService::new(facade.router_until(shutdown.child_token()));
    let connections = TaskTracker::new();
    loop {
        let (tcp, addr) = tokio::select! {
            () = shutdown.cancelled() => break,
            r = listener.accept() => match r {
                Ok(x) => x,
                Err(e) => {
                    warn!(error = %e, "facade: accept failed");
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                    continue;
                }
            },
        };
        let (service, stop) = (service.clone(), shutdown.clone());
        let span = tracing::debug_span!("facade_conn", %addr);
        connections.spawn(
            async move {
                let mut http = hyper::server::conn::http1::Builder::new();
                http.timer(TokioTimer::new())
                    .header_read_timeout(header_timeout);
                // A client that stops reading is cut once one write has
                // waited FACADE_WRITE_TIMEOUT: it cannot hold this task, or
                // the drain below, longer than that.
                let io = WriteDeadline::new(tcp, FACADE_WRITE_TIMEOUT);
                let mut conn = pin!(http.serve_connection(TokioIo::new(io), service));
                let done = tokio::select! {
                    r = conn.as_mut() => Some(r),
                    () = stop.cancelled() => None,
                };
                let result = match done {
                    Some(r) => r,
                    None => {
                        conn.as_mut().graceful_shutdown();
                        conn.await
                    }
                };
                if let Err(e) = result {
                    debug!(error = %e, "facade connection ended");
                }
            }
            .instrument(span),
        );
    }
    drop(listener);
    connections.close();
    connections.wait().await;
    Ok(())
}
