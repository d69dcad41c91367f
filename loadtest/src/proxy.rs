//! A fault-injecting TCP proxy for tests and load scenarios.
//!
//! [`Proxy::start`] listens on `127.0.0.1:0` and forwards every accepted
//! connection to an upstream address. Each connection applies a [`Fault`]:
//! pass-through, added latency and a bandwidth cap, a drop after N bytes, a
//! stall (half-open: nothing forwarded, sockets kept open), a reset (RST) or a
//! blackhole (accepted, never forwarded). Faults change at runtime through a
//! cloneable [`ProxyHandle`]: for every connection ([`ProxyHandle::set_fault`]),
//! for one connection ([`ProxyHandle::set_connection_fault`]), per new
//! connection by its accept index ([`ProxyHandle::set_plan`]), or on a timed
//! script ([`ProxyHandle::play`]). [`ProxyHandle::cut_all`] closes every current
//! connection. [`ProxyHandle::stats`] counts connections and bytes, and
//! [`ProxyHandle::wait_until`] waits for a condition on them without sleeping.
//!
//! Shutdown is by ownership: dropping the [`Proxy`] stops accepting and closes
//! every connection it forwards (handles stay usable but see no new traffic).
//!
//! Timing uses `tokio::time`, so tests can run the proxy under
//! `tokio::time::pause` and assert latencies and rates exactly.
//!
//! ```no_run
//! # async fn demo(relay: std::net::SocketAddr) -> std::io::Result<()> {
//! use std::time::Duration;
//! use oab_loadtest::proxy::{Fault, Proxy};
//!
//! let proxy = Proxy::start(relay).await?;
//! // ... point a connector at proxy.addr() ...
//! proxy.set_fault(Fault::Stall); // the link goes half-open
//! proxy.set_fault(Fault::Pass); // and comes back
//! let steps = proxy.play(vec![(Duration::from_secs(1), Fault::Reset)]);
//! steps.await.ok();
//! proxy.cut_all();
//! # Ok(()) }
//! ```

use parking_lot::Mutex;
use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::ops::Deref;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::tcp::{ReadHalf, WriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, watch};
use tokio::time::Instant;
use tokio_util::sync::{CancellationToken, DropGuard};

/// Largest chunk read from one side before it is forwarded. Small enough
/// that a bandwidth cap is applied smoothly, large enough that pass-through
/// costs few syscalls.
const CHUNK: usize = 16 * 1024;

/// Bytes a direction may hold while it waits out an added latency or a
/// bandwidth cap before it stops reading (back-pressure on the sender).
const MAX_QUEUED: usize = 1024 * 1024;

/// Pacing granularity of a bandwidth cap: at most 1/50 s worth of bytes is
/// written at once, so the cap holds over any window longer than ~20 ms.
const PACING_SLICES_PER_SECOND: u64 = 50;

/// What the proxy does to a connection.
///
/// A fault set at runtime applies to live connections at once, except that a
/// connection accepted under [`Fault::Blackhole`] stays blackholed (it was
/// never connected upstream, and the bytes it swallowed are gone).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fault {
    /// Forward both directions unchanged.
    Pass,
    /// Forward with a one-way delay added to every chunk in each direction
    /// (a round trip gains `2 * latency`) and, if set, at most
    /// `bytes_per_second` in each direction. Delayed chunks stay in order and
    /// are pipelined: latency does not limit throughput.
    Shape {
        /// Added one-way delay.
        latency: Duration,
        /// Cap per direction, bytes per second (`None`: no cap).
        bytes_per_second: Option<u64>,
    },
    /// Forward the first `bytes` bytes of the connection (both directions
    /// counted together, from the connection's start), then close both
    /// sockets. Set at runtime on a connection already past the budget, it
    /// closes the connection at once.
    DropAfter {
        /// Bytes forwarded before the close.
        bytes: u64,
    },
    /// Half-open link: stop reading and writing in both directions but keep
    /// both sockets open. Senders fill their kernel buffers and block; nobody
    /// sees a close. Forwarding resumes, losslessly, when the fault changes.
    Stall,
    /// Reset: close both sockets with `SO_LINGER` 0, so both peers get a TCP
    /// RST. New connections are accepted and reset at once.
    Reset,
    /// Accept and never forward: new connections are not connected upstream;
    /// whatever either side sends is read and discarded (unlike
    /// [`Fault::Stall`], senders never block).
    Blackhole,
}

impl Fault {
    /// A pure added one-way latency.
    pub fn latency(latency: Duration) -> Fault {
        Fault::Shape {
            latency,
            bytes_per_second: None,
        }
    }

    /// A pure bandwidth cap, bytes per second per direction.
    pub fn bandwidth(bytes_per_second: u64) -> Fault {
        Fault::Shape {
            latency: Duration::ZERO,
            bytes_per_second: Some(bytes_per_second),
        }
    }
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Fault::Pass => f.write_str("pass"),
            Fault::Shape {
                latency,
                bytes_per_second,
            } => {
                write!(f, "shape(latency {latency:?}")?;
                if let Some(bps) = bytes_per_second {
                    write!(f, ", {bps} B/s")?;
                }
                f.write_str(")")
            }
            Fault::DropAfter { bytes } => write!(f, "drop-after({bytes} B)"),
            Fault::Stall => f.write_str("stall"),
            Fault::Reset => f.write_str("reset"),
            Fault::Blackhole => f.write_str("blackhole"),
        }
    }
}

/// Counters of a proxy since it started. Bytes are counted when written to
/// the other side.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct ProxyStats {
    /// Connections accepted.
    pub accepted: u64,
    /// Connections currently open (accepted and not yet ended).
    pub active: u64,
    /// Upstream connections established.
    pub upstream_connects: u64,
    /// Upstream connections that failed (the client is then closed).
    pub upstream_failures: u64,
    /// Bytes forwarded client -> upstream.
    pub bytes_to_upstream: u64,
    /// Bytes forwarded upstream -> client.
    pub bytes_to_client: u64,
    /// Connections ended by a [`Fault::Reset`].
    pub resets: u64,
    /// Connections ended by [`ProxyHandle::cut_all`] or [`ProxyHandle::cut`].
    pub cuts: u64,
    /// Connections ended by a [`Fault::DropAfter`] budget.
    pub drops: u64,
    /// Connections accepted under [`Fault::Blackhole`].
    pub blackholed: u64,
}

/// One live connection, as listed by [`ProxyHandle::connections`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnectionInfo {
    /// The connection's id: its accept index, from 0.
    pub id: u64,
    /// The client's address.
    pub client: SocketAddr,
    /// The fault it applies now.
    pub fault: Fault,
    /// Bytes forwarded client -> upstream.
    pub bytes_to_upstream: u64,
    /// Bytes forwarded upstream -> client.
    pub bytes_to_client: u64,
}

/// Chooses the fault of a new connection from its accept index; `None`
/// falls back to the proxy-wide fault.
pub type Plan = Box<dyn FnMut(u64) -> Option<Fault> + Send>;

#[derive(Debug, Default)]
struct Counters {
    accepted: AtomicU64,
    active: AtomicU64,
    upstream_connects: AtomicU64,
    upstream_failures: AtomicU64,
    bytes_to_upstream: AtomicU64,
    bytes_to_client: AtomicU64,
    resets: AtomicU64,
    cuts: AtomicU64,
    drops: AtomicU64,
    blackholed: AtomicU64,
}

#[derive(Debug, Default)]
struct ConnCounters {
    to_upstream: AtomicU64,
    to_client: AtomicU64,
    /// Bytes admitted for forwarding (both directions): the
    /// [`Fault::DropAfter`] budget is charged here.
    admitted: AtomicU64,
}

struct ConnEntry {
    client: SocketAddr,
    fault: watch::Sender<Fault>,
    cut: CancellationToken,
    counters: Arc<ConnCounters>,
}

struct Shared {
    upstream: Mutex<SocketAddr>,
    fault: Mutex<Fault>,
    plan: Mutex<Option<Plan>>,
    conns: Mutex<HashMap<u64, ConnEntry>>,
    counters: Counters,
    changed: Notify,
    stop: CancellationToken,
}

/// A running proxy. Dropping it stops the proxy and closes its connections.
/// Derefs to its [`ProxyHandle`].
pub struct Proxy {
    addr: SocketAddr,
    handle: ProxyHandle,
    _stop: DropGuard,
}

/// Controls a proxy; cheap to clone.
#[derive(Clone)]
pub struct ProxyHandle {
    shared: Arc<Shared>,
}

impl fmt::Debug for Proxy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Proxy")
            .field("addr", &self.addr)
            .field("handle", &self.handle)
            .finish()
    }
}

impl fmt::Debug for ProxyHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProxyHandle")
            .field("upstream", &self.upstream())
            .field("fault", &self.fault())
            .field("stats", &self.stats())
            .finish()
    }
}

impl Proxy {
    /// Listens on `127.0.0.1:0` and forwards to `upstream` with
    /// [`Fault::Pass`]. Must be called inside a tokio runtime.
    pub async fn start(upstream: SocketAddr) -> io::Result<Proxy> {
        let listener = TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0))).await?;
        Proxy::with_listener(listener, upstream)
    }

    /// Forwards connections accepted on `listener` to `upstream`.
    pub fn with_listener(listener: TcpListener, upstream: SocketAddr) -> io::Result<Proxy> {
        let addr = listener.local_addr()?;
        let stop = CancellationToken::new();
        let shared = Arc::new(Shared {
            upstream: Mutex::new(upstream),
            fault: Mutex::new(Fault::Pass),
            plan: Mutex::new(None),
            conns: Mutex::new(HashMap::new()),
            counters: Counters::default(),
            changed: Notify::new(),
            stop: stop.clone(),
        });
        tokio::spawn(accept_loop(listener, shared.clone()));
        Ok(Proxy {
            addr,
            handle: ProxyHandle { shared },
            _stop: stop.drop_guard(),
        })
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// A handle that controls this proxy.
    pub fn handle(&self) -> ProxyHandle {
        self.handle.clone()
    }
}

impl Deref for Proxy {
    type Target = ProxyHandle;
    fn deref(&self) -> &ProxyHandle {
        &self.handle
    }
}

impl ProxyHandle {
    /// Sets the fault of every current connection and of new ones (unless a
    /// [plan](ProxyHandle::set_plan) chooses otherwise for a new connection).
    pub fn set_fault(&self, fault: Fault) {
        *self.shared.fault.lock() = fault.clone();
        for entry in self.shared.conns.lock().values() {
            entry.fault.send_replace(fault.clone());
        }
    }

    /// The proxy-wide fault for new connections.
    pub fn fault(&self) -> Fault {
        self.shared.fault.lock().clone()
    }

    /// Sets the fault of one live connection. Returns `false` if it is gone.
    pub fn set_connection_fault(&self, id: u64, fault: Fault) -> bool {
        match self.shared.conns.lock().get(&id) {
            Some(entry) => {
                entry.fault.send_replace(fault);
                true
            }
            None => false,
        }
    }

    /// Chooses the fault of each new connection from its accept index (from
    /// 0); where the plan returns `None` the proxy-wide fault applies. For
    /// example `|n| (n == 0).then_some(Fault::Reset)` resets only the first
    /// connection.
    pub fn set_plan(&self, plan: impl FnMut(u64) -> Option<Fault> + Send + 'static) {
        *self.shared.plan.lock() = Some(Box::new(plan));
    }

    /// Removes the plan.
    pub fn clear_plan(&self) {
        *self.shared.plan.lock() = None;
    }

    /// Closes every current connection (both sockets; the peers see an
    /// orderly close unless unread data was pending, where the kernel sends
    /// a RST as for any close). New connections are still accepted.
    pub fn cut_all(&self) {
        for entry in self.shared.conns.lock().values() {
            entry.cut.cancel();
        }
    }

    /// Closes one connection like [`ProxyHandle::cut_all`]. Returns `false`
    /// if it is gone.
    pub fn cut(&self, id: u64) -> bool {
        match self.shared.conns.lock().get(&id) {
            Some(entry) => {
                entry.cut.cancel();
                true
            }
            None => false,
        }
    }

    /// Changes where new connections are forwarded (a restarted upstream on
    /// another port, say). Live connections keep their upstream.
    pub fn set_upstream(&self, upstream: SocketAddr) {
        *self.shared.upstream.lock() = upstream;
    }

    /// Where new connections are forwarded.
    pub fn upstream(&self) -> SocketAddr {
        *self.shared.upstream.lock()
    }

    /// Applies faults on a timed script: each step waits its duration (from
    /// the previous step), then [sets](ProxyHandle::set_fault) its fault.
    /// Await the handle to wait for the last step, or abort it to stop early;
    /// it also ends when the proxy is dropped.
    pub fn play(
        &self,
        steps: impl IntoIterator<Item = (Duration, Fault)>,
    ) -> tokio::task::JoinHandle<()> {
        let steps: Vec<(Duration, Fault)> = steps.into_iter().collect();
        let handle = self.clone();
        tokio::spawn(async move {
            for (wait, fault) in steps {
                tokio::select! {
                    () = handle.shared.stop.cancelled() => return,
                    () = tokio::time::sleep(wait) => handle.set_fault(fault),
                }
            }
        })
    }

    /// The counters now.
    pub fn stats(&self) -> ProxyStats {
        let c = &self.shared.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        ProxyStats {
            accepted: get(&c.accepted),
            active: get(&c.active),
            upstream_connects: get(&c.upstream_connects),
            upstream_failures: get(&c.upstream_failures),
            bytes_to_upstream: get(&c.bytes_to_upstream),
            bytes_to_client: get(&c.bytes_to_client),
            resets: get(&c.resets),
            cuts: get(&c.cuts),
            drops: get(&c.drops),
            blackholed: get(&c.blackholed),
        }
    }

    /// The live connections, by id.
    pub fn connections(&self) -> Vec<ConnectionInfo> {
        let mut out: Vec<ConnectionInfo> = self
            .shared
            .conns
            .lock()
            .iter()
            .map(|(id, e)| ConnectionInfo {
                id: *id,
                client: e.client,
                fault: e.fault.borrow().clone(),
                bytes_to_upstream: e.counters.to_upstream.load(Ordering::Relaxed),
                bytes_to_client: e.counters.to_client.load(Ordering::Relaxed),
            })
            .collect();
        out.sort_by_key(|c| c.id);
        out
    }

    /// Waits until `condition` holds for the counters. Re-checked whenever a
    /// connection is accepted, connected upstream or ended, and whenever
    /// bytes are forwarded; never by polling.
    pub async fn wait_until(&self, mut condition: impl FnMut(&ProxyStats) -> bool) {
        loop {
            let notified = self.shared.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if condition(&self.stats()) {
                return;
            }
            notified.await;
        }
    }
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    let mut next_id = 0u64;
    loop {
        let accepted = tokio::select! {
            () = shared.stop.cancelled() => return,
            r = listener.accept() => r,
        };
        let (client, addr) = match accepted {
            Ok(x) => x,
            Err(e) => {
                // Out of descriptors and the like: back off briefly, keep serving.
                tracing::warn!(error = %e, "proxy accept failed");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let id = next_id;
        next_id += 1;
        let _ = client.set_nodelay(true);
        let planned = shared.plan.lock().as_mut().and_then(|plan| plan(id));
        let fault = planned.unwrap_or_else(|| shared.fault.lock().clone());
        let (tx, rx) = watch::channel(fault);
        let cut = shared.stop.child_token();
        let counters = Arc::new(ConnCounters::default());
        shared.conns.lock().insert(
            id,
            ConnEntry {
                client: addr,
                fault: tx,
                cut: cut.clone(),
                counters: counters.clone(),
            },
        );
        shared.counters.accepted.fetch_add(1, Ordering::Relaxed);
        shared.counters.active.fetch_add(1, Ordering::Relaxed);
        shared.changed.notify_waiters();
        let shared2 = shared.clone();
        tokio::spawn(async move {
            connection(&shared2, client, rx, cut, &counters).await;
            shared2.conns.lock().remove(&id);
            shared2.counters.active.fetch_sub(1, Ordering::Relaxed);
            shared2.changed.notify_waiters();
        });
    }
}

/// How a forwarded connection ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    /// Both directions finished (EOF propagated), or a socket failed.
    Closed,
    /// Cut by the handle or the proxy stopped.
    Cut,
    /// A reset fault: close with RST.
    Reset,
    /// The drop-after budget was used up.
    Dropped,
}

fn reset(stream: &TcpStream) {
    // SO_LINGER 0: close() sends RST and discards unsent data.
    let _ = stream.set_zero_linger();
}

async fn connection(
    shared: &Shared,
    client: TcpStream,
    mut fault: watch::Receiver<Fault>,
    cut: CancellationToken,
    counters: &ConnCounters,
) {
    let initial = fault.borrow_and_update().clone();
    match initial {
        Fault::Reset => {
            shared.counters.resets.fetch_add(1, Ordering::Relaxed);
            reset(&client);
            return;
        }
        Fault::Blackhole => {
            shared.counters.blackholed.fetch_add(1, Ordering::Relaxed);
            blackhole(shared, client, fault, cut).await;
            return;
        }
        _ => {}
    }
    let upstream_addr = *shared.upstream.lock();
    let upstream = tokio::select! {
        () = cut.cancelled() => return,
        r = TcpStream::connect(upstream_addr) => r,
    };
    let mut upstream = match upstream {
        Ok(s) => s,
        Err(e) => {
            tracing::debug!(error = %e, %upstream_addr, "proxy upstream connect failed");
            shared
                .counters
                .upstream_failures
                .fetch_add(1, Ordering::Relaxed);
            shared.changed.notify_waiters();
            return;
        }
    };
    let _ = upstream.set_nodelay(true);
    shared
        .counters
        .upstream_connects
        .fetch_add(1, Ordering::Relaxed);
    shared.changed.notify_waiters();
    let mut client = client;
    let end = forward(shared, &mut client, &mut upstream, fault, &cut, counters).await;
    match end {
        End::Reset => {
            shared.counters.resets.fetch_add(1, Ordering::Relaxed);
            reset(&client);
            reset(&upstream);
        }
        End::Cut => {
            if !shared.stop.is_cancelled() {
                shared.counters.cuts.fetch_add(1, Ordering::Relaxed);
            }
        }
        End::Dropped => {
            shared.counters.drops.fetch_add(1, Ordering::Relaxed);
        }
        End::Closed => {}
    }
    // Dropping both streams closes them.
}

/// A connection accepted under [`Fault::Blackhole`]: read and discard until
/// the client closes, the connection is cut, or a reset fault arrives.
async fn blackhole(
    shared: &Shared,
    client: TcpStream,
    mut fault: watch::Receiver<Fault>,
    cut: CancellationToken,
) {
    let mut client = client;
    let mut buf = vec![0u8; CHUNK];
    loop {
        tokio::select! {
            () = cut.cancelled() => {
                if !shared.stop.is_cancelled() {
                    shared.counters.cuts.fetch_add(1, Ordering::Relaxed);
                }
                return;
            }
            changed = fault.changed() => {
                if changed.is_err() {
                    return;
                }
                if *fault.borrow_and_update() == Fault::Reset {
                    shared.counters.resets.fetch_add(1, Ordering::Relaxed);
                    reset(&client);
                    return;
                }
            }
            r = client.read(&mut buf) => match r {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            },
        }
    }
}

async fn forward(
    shared: &Shared,
    client: &mut TcpStream,
    upstream: &mut TcpStream,
    mut fault: watch::Receiver<Fault>,
    cut: &CancellationToken,
    counters: &ConnCounters,
) -> End {
    let (client_r, client_w) = client.split();
    let (upstream_r, upstream_w) = upstream.split();
    let up = Pump {
        shared,
        counters,
        moved: &counters.to_upstream,
        total: &shared.counters.bytes_to_upstream,
        fault: fault.clone(),
    }
    .run(client_r, upstream_w);
    let down = Pump {
        shared,
        counters,
        moved: &counters.to_client,
        total: &shared.counters.bytes_to_client,
        fault: fault.clone(),
    }
    .run(upstream_r, client_w);
    let control = async {
        loop {
            tokio::select! {
                () = cut.cancelled() => return End::Cut,
                changed = fault.changed() => {
                    if changed.is_err() {
                        return End::Cut;
                    }
                    let now = fault.borrow_and_update().clone();
                    match now {
                        Fault::Reset => return End::Reset,
                        Fault::DropAfter { bytes }
                            if counters.admitted.load(Ordering::Relaxed) >= bytes =>
                        {
                            return End::Dropped;
                        }
                        _ => {}
                    }
                }
            }
        }
    };
    tokio::select! {
        r = async { tokio::try_join!(up, down) } => match r {
            Ok(_) => End::Closed,
            Err(end) => end,
        },
        end = control => end,
    }
}

/// One direction of a forwarded connection.
struct Pump<'a> {
    shared: &'a Shared,
    counters: &'a ConnCounters,
    /// This connection's counter for this direction.
    moved: &'a AtomicU64,
    /// The proxy's counter for this direction.
    total: &'a AtomicU64,
    fault: watch::Receiver<Fault>,
}

impl Pump<'_> {
    /// Charges `n` read bytes to the drop-after budget; returns how many may
    /// be forwarded and whether the budget is now used up.
    fn admit(&self, n: usize, budget: Option<u64>) -> (usize, bool) {
        let n64 = n as u64;
        let Some(budget) = budget else {
            self.counters.admitted.fetch_add(n64, Ordering::Relaxed);
            return (n, false);
        };
        let before = self
            .counters
            .admitted
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |a| {
                Some(a.saturating_add(n64).min(budget.max(a)))
            })
            .unwrap_or(0);
        let take = budget.saturating_sub(before).min(n64);
        (
            usize::try_from(take).unwrap_or(n),
            before.saturating_add(take) >= budget,
        )
    }

    async fn write(&self, w: &mut WriteHalf<'_>, chunk: &[u8]) -> Result<(), End> {
        w.write_all(chunk).await.map_err(|_| End::Closed)?;
        let n = chunk.len() as u64;
        self.moved.fetch_add(n, Ordering::Relaxed);
        self.total.fetch_add(n, Ordering::Relaxed);
        self.shared.changed.notify_waiters();
        Ok(())
    }

    /// Forwards `r` to `w` under the current fault until EOF (then shuts
    /// `w` down) or until the connection must end (`Err`).
    async fn run(mut self, mut r: ReadHalf<'_>, mut w: WriteHalf<'_>) -> Result<(), End> {
        let mut buf = vec![0u8; CHUNK];
        // Chunks waiting for their release time: (release at, bytes).
        let mut queue: VecDeque<(Instant, Bytes)> = VecDeque::new();
        let mut queued = 0usize;
        let mut eof = false;
        // Set when the drop-after budget ran out: close once the queue is out.
        let mut dropping = false;
        // Bandwidth pacing: the earliest time the next write may start.
        let mut pace_at = Instant::now();
        loop {
            let fault = self.fault.borrow_and_update().clone();
            let (latency, bps, budget) = match &fault {
                Fault::Pass => (Duration::ZERO, None, None),
                Fault::Shape {
                    latency,
                    bytes_per_second,
                } => (*latency, bytes_per_second.filter(|b| *b > 0), None),
                Fault::DropAfter { bytes } => (Duration::ZERO, None, Some(*bytes)),
                Fault::Stall | Fault::Reset => {
                    // Stall: neither read nor write until the fault changes.
                    // Reset: the connection's control ends everything.
                    if self.fault.changed().await.is_err() {
                        return Err(End::Cut);
                    }
                    continue;
                }
                Fault::Blackhole => {
                    queue.clear();
                    queued = 0;
                    tokio::select! {
                        changed = self.fault.changed() => {
                            if changed.is_err() {
                                return Err(End::Cut);
                            }
                        }
                        n = r.read(&mut buf), if !eof => match n {
                            Ok(0) => eof = true,
                            Ok(_) => {}
                            Err(_) => return Err(End::Closed),
                        },
                    }
                    if eof && self.fault.changed().await.is_err() {
                        return Err(End::Cut);
                    }
                    continue;
                }
            };
            if queue.is_empty() {
                if dropping {
                    return Err(End::Dropped);
                }
                if eof {
                    let _ = w.shutdown().await;
                    return Ok(());
                }
            }
            let can_read = !eof && !dropping && queued < MAX_QUEUED;
            let read_limit = match bps {
                Some(b) => usize::try_from((b / PACING_SLICES_PER_SECOND).max(1))
                    .unwrap_or(CHUNK)
                    .min(CHUNK),
                None => CHUNK,
            };
            let release = queue.front().map(|(at, _)| (*at).max(pace_at));
            tokio::select! {
                biased;
                changed = self.fault.changed() => {
                    if changed.is_err() {
                        return Err(End::Cut);
                    }
                }
                () = sleep_until_opt(release) => {
                    let Some((_, chunk)) = queue.pop_front() else { continue };
                    queued -= chunk.len();
                    let started = Instant::now();
                    self.write(&mut w, &chunk).await?;
                    if let Some(b) = bps {
                        pace_at = pace_at.max(started) + transmit_time(chunk.len(), b);
                    }
                }
                n = r.read(buf.get_mut(..read_limit).unwrap_or_default()), if can_read => {
                    let n = match n {
                        Ok(0) => {
                            eof = true;
                            continue;
                        }
                        Ok(n) => n,
                        Err(_) => return Err(End::Closed),
                    };
                    let (take, exhausted) = self.admit(n, budget);
                    dropping = exhausted;
                    let data = buf.get(..take).unwrap_or_default();
                    if data.is_empty() {
                        continue;
                    }
                    if latency.is_zero() && bps.is_none() && queue.is_empty() {
                        self.write(&mut w, data).await?;
                    } else {
                        queued += data.len();
                        queue.push_back((Instant::now() + latency, Bytes::copy_from_slice(data)));
                    }
                }
            }
        }
    }
}

/// Sleeps until `at`, or forever when there is nothing to wait for.
async fn sleep_until_opt(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// How long `len` bytes take at `bytes_per_second`.
fn transmit_time(len: usize, bytes_per_second: u64) -> Duration {
    let nanos = (len as u128 * 1_000_000_000) / u128::from(bytes_per_second.max(1));
    Duration::from_nanos(u64::try_from(nanos).unwrap_or(u64::MAX))
}

#[cfg(test)]
mod tests;
