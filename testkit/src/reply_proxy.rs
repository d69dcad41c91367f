//! A TCP proxy in front of a server (a `redis-server` on its unix socket or
//! on TCP) that can be told to hold the replies of the connections it
//! forwards: what a store connection that stops answering looks like from
//! the client (a wedged connection, a half-open link, a NAT that forgot the
//! flow), while the server itself stays healthy.
//!
//! [`ReplyProxy::hold_replies`] holds every connection accepted so far: the
//! requests still reach the server, its replies are read and kept, and the
//! client hears nothing, the socket staying open. Connections accepted
//! after the call pass both ways, so a client that replaces its connection
//! is served again. [`ReplyProxy::release_replies`] forwards what was held,
//! in order, and lets the replies flow again.
//!
//! Shutdown is by ownership: dropping the [`ReplyProxy`] stops accepting and
//! closes every connection it forwards.

use std::io;
use std::net::SocketAddr;
#[cfg(unix)]
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWrite, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio_util::sync::{CancellationToken, DropGuard};

/// Largest chunk read from one side before it is forwarded.
const CHUNK: usize = 16 * 1024;

/// Where the proxy forwards its connections.
#[derive(Debug, Clone)]
pub enum Upstream {
    /// A TCP address.
    Tcp(SocketAddr),
    /// A unix socket path (what [`crate::redis::RedisServer::socket_path`] gives).
    #[cfg(unix)]
    Unix(PathBuf),
}

/// The proxy; see the module documentation.
#[derive(Debug)]
pub struct ReplyProxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
    _stop: DropGuard,
}

#[derive(Debug)]
struct Shared {
    /// Connections accepted so far (the next one's index).
    accepted: AtomicUsize,
    /// Connections with an index below this hold their replies.
    held_below: watch::Sender<usize>,
}

impl ReplyProxy {
    /// Listens on `127.0.0.1:0` and forwards each connection to `upstream`.
    pub async fn start(upstream: Upstream) -> io::Result<ReplyProxy> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (held_below, _) = watch::channel(0);
        let shared = Arc::new(Shared {
            accepted: AtomicUsize::new(0),
            held_below,
        });
        let stop = CancellationToken::new();
        tokio::spawn(accept_loop(
            listener,
            upstream,
            shared.clone(),
            stop.clone(),
        ));
        Ok(ReplyProxy {
            addr,
            shared,
            _stop: stop.drop_guard(),
        })
    }

    /// The address clients connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `redis://127.0.0.1:<port>/`: a Redis URL through the proxy.
    pub fn redis_url(&self) -> String {
        format!("redis://{}/", self.addr)
    }

    /// Connections accepted so far.
    pub fn connections(&self) -> usize {
        self.shared.accepted.load(Ordering::SeqCst)
    }

    /// Holds the replies of every connection accepted so far (see the
    /// module documentation); later connections are not held.
    pub fn hold_replies(&self) {
        let accepted = self.connections();
        self.shared.held_below.send_replace(accepted);
    }

    /// Forwards the held replies and lets every connection's replies flow.
    pub fn release_replies(&self) {
        self.shared.held_below.send_replace(0);
    }
}

async fn accept_loop(
    listener: TcpListener,
    upstream: Upstream,
    shared: Arc<Shared>,
    stop: CancellationToken,
) {
    loop {
        let accepted = tokio::select! {
            () = stop.cancelled() => return,
            accepted = listener.accept() => accepted,
        };
        let Ok((client, _)) = accepted else {
            continue;
        };
        let index = shared.accepted.fetch_add(1, Ordering::SeqCst);
        let held = shared.held_below.subscribe();
        let (upstream, stop) = (upstream.clone(), stop.clone());
        tokio::spawn(async move {
            tokio::select! {
                () = stop.cancelled() => {}
                () = forward(client, upstream, index, held) => {}
            }
        });
    }
}

/// One connection, both ways, until either side closes.
async fn forward(
    client: TcpStream,
    upstream: Upstream,
    index: usize,
    held: watch::Receiver<usize>,
) {
    let server: Box<dyn Duplex> = match upstream {
        Upstream::Tcp(addr) => match TcpStream::connect(addr).await {
            Ok(s) => Box::new(s),
            Err(_) => return,
        },
        #[cfg(unix)]
        Upstream::Unix(path) => match tokio::net::UnixStream::connect(path).await {
            Ok(s) => Box::new(s),
            Err(_) => return,
        },
    };
    let (mut client_read, mut client_write) = tokio::io::split(client);
    let (mut server_read, mut server_write) = tokio::io::split(server);
    let requests = async {
        let _ = tokio::io::copy(&mut client_read, &mut server_write).await;
    };
    let replies = async {
        let mut held = held;
        let mut buf = vec![0u8; CHUNK];
        loop {
            let n = match server_read.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            // Read, then kept until this connection is no longer held.
            if held.wait_for(|&below| index >= below).await.is_err() {
                return;
            }
            if client_write
                .write_all(buf.get(..n).unwrap_or_default())
                .await
                .is_err()
            {
                return;
            }
        }
    };
    tokio::select! {
        () = requests => {}
        () = replies => {}
    }
}

/// Either upstream stream.
trait Duplex: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Duplex for T {}
