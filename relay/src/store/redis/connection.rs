//! The store's connection to Redis, and the two things that keep it
//! serving everyone: no caller can hold it up, and a connection that stops
//! answering is replaced.
//!
//! # Requests driven by a task of the store's own
//!
//! The redis crate hands every request to its connection's writer through
//! a bounded channel (50 requests on a single server's connection, 100 on a
//! cluster connection) whose room goes to waiting senders first come, first
//! served: a slot that frees up is given to the oldest waiting request
//! *whether or not its future is being polled*, and stays taken until that
//! future is polled again or dropped. A caller that starts many store calls
//! at once and then stops polling some of them while it awaits another
//! (a session answering a run of opens in order: the rest of the run waits
//! while the first one's answer reads the store) can so end up holding the
//! whole channel with requests nobody sends: no request of anyone reaches
//! Redis, every one times out after the response timeout (5 s), Redis and
//! the socket sit idle, for good. So no caller's future ever
//! waits in that channel: a request is handed at once (never waiting) to a
//! task of the store's own that drives every request, and the caller only
//! waits for the answer. That task is polled whenever one of its requests
//! can go on, so a slot given to a request is used at once, and a caller
//! that stops polling (or drops) its call only stops waiting for the
//! answer. The task starts the requests in the order they were made (the
//! order of the callers' first polls), which is the order they reach
//! Redis as long as none waits for room in the redis crate's queue (a
//! single server's is made large enough for that: `WRITER_QUEUE` in the
//! parent module; a cluster connection's cannot be set, and on a cluster
//! batches may reach different shards out of order anyway): a session's
//! append batches in flight stay in order. What a
//! request sends is owned by it: a copy of a single command (they are
//! small), a pipeline (an append batch's frames) shared behind an `Arc`.
//!
//! # The watchdog
//!
//! Whatever the cause (the above, a half-open TCP connection, a NAT that
//! forgot the flow, a bug in a client library), a connection on which a
//! request got no answer within the response timeout, and which answered
//! nothing else since that request was sent, is replaced: a new connection
//! (a new `ConnectionManager`, which connects on its first request; on a
//! cluster a new cluster connection, swapped in once it reached the seeds)
//! takes its place for every request from then on, the old one is closed
//! once the requests still on it end, `oab_store_connections_replaced_total`
//! counts it and a WARN line says so. "Answered" is per hash slot on a
//! cluster, so one silent shard is noticed although the others answer. A
//! request the redis crate's own timeouts did not end is given up after
//! [`REQUEST_DEADLINE`] and counts as unanswered too.
//!
//! A Redis that is only slow (a long script) may get its connection
//! replaced too: the cost is one reconnect, and at most one per response
//! timeout, since only the connection in use is ever replaced.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use futures_util::StreamExt as _;
use futures_util::stream::FuturesUnordered;
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, ErrorKind, Pipeline, RedisError, RedisFuture, RedisResult, Value};
use tokio::sync::{mpsc, oneshot};

use super::shards::slot_of;

/// Slots of a Redis Cluster (`CLUSTER KEYSLOT` is below this).
const CLUSTER_SLOTS: usize = 16384;

/// Requests made and not yet taken by the task that drives them. It takes
/// them as they come (each is one boxed future, and the requests it drives
/// are bounded in time by the response timeout, not in number), so this is
/// reached only if that task gets no CPU at all. Overflow: the request
/// fails at once, unsent (`StoreError::Unavailable`); a caller never waits
/// for room here (waiting is what let unpolled callers hold the redis
/// crate's queue).
const HANDOFF_QUEUE: usize = 65536;

/// A request with its bookkeeping and its answer's sender, as the driving
/// task polls it.
type Request = Pin<Box<dyn Future<Output = ()> + Send>>;

/// How long a request may take in all before it is given up and counted as
/// unanswered, whatever the redis crate's own timeouts do: its response
/// timeout, plus the reconnect a request may wait for first (about 1.5 s of
/// backoff, see `RECONNECT_RETRIES`, and a connection timeout per attempt),
/// with room to spare. A backstop: the response timeout ends a request on
/// a connection that does not answer long before this.
pub(super) const REQUEST_DEADLINE: Duration = Duration::from_secs(20);

/// A connection to a single Redis or to a Redis Cluster. Both multiplex
/// commands over their sockets and reconnect by themselves after a lost
/// connection (not after a silent one: that is the watchdog's); cloning is
/// cheap (the clones share the sockets).
#[derive(Clone)]
pub(super) enum Conn {
    /// One server.
    Single(ConnectionManager),
    /// A cluster: one connection per node, commands routed by key slot.
    Cluster(ClusterConnection),
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Conn::Single(c) => c.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Conn::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Conn::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Single(c) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
        }
    }
}

/// How to make a new connection: what [`super::RedisStore::connect`] made
/// the first one with.
pub(super) enum Dial {
    /// A single server: a new connection manager with the same settings.
    Single {
        client: redis::Client,
        config: ConnectionManagerConfig,
    },
    /// A cluster: a new cluster connection through the same seeds.
    Cluster { client: ClusterClient },
}

impl Dial {
    /// A new connection. A single server's connection manager connects on
    /// its first request, so this returns at once; a cluster's connects to
    /// the seeds first.
    async fn connect(&self) -> RedisResult<Conn> {
        match self {
            Dial::Single { client, config } => Ok(Conn::Single(
                ConnectionManager::new_lazy_with_config(client.clone(), config.clone())?,
            )),
            Dial::Cluster { client } => Ok(Conn::Cluster(client.get_async_connection().await?)),
        }
    }
}

/// The store's connection: the one in use, swapped for a new one when it
/// stops answering. Cheap to clone (the clones share everything).
#[derive(Clone)]
pub(super) struct Connection {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let current = self.shared.current.load();
        f.debug_struct("Connection")
            .field("store", &self.shared.shown)
            .field("cluster", &matches!(current.conn, Conn::Cluster(_)))
            .field("generation", &current.number)
            .finish()
    }
}

struct Shared {
    /// The connection requests go to now.
    current: ArcSwap<Generation>,
    /// To the task that drives the requests ([`drive`]); it ends when this
    /// is dropped (the store and every request are gone).
    requests: mpsc::Sender<Request>,
    dial: Dial,
    /// The response timeout the connections were made with (for the log).
    timeout: Duration,
    /// The store's URL without its credentials (for the log).
    shown: String,
    /// Set while a replacement is being made: one at a time.
    replacing: AtomicBool,
    /// `oab_store_connections_replaced_total`.
    replaced: prometheus::IntCounter,
    /// What the generations' answer times count from.
    origin: Instant,
}

/// One connection, from when it was made until it was replaced and the last
/// request on it ended (it is closed then, with its last clone).
struct Generation {
    conn: Conn,
    /// 0 for the first connection, one more per replacement.
    number: u64,
    /// Per lane (a single server has one; a cluster one per hash slot and
    /// one for keyless commands): when it last answered, in ms since
    /// [`Shared::origin`], plus one (0: never).
    answered: Box<[AtomicU64]>,
}

impl Generation {
    fn new(conn: Conn, number: u64) -> Generation {
        let lanes = match conn {
            Conn::Single(_) => 1,
            Conn::Cluster(_) => CLUSTER_SLOTS + 1,
        };
        Generation {
            conn,
            number,
            answered: (0..lanes).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    /// The lane of a request whose first key is `key`.
    fn lane(&self, key: Option<&[u8]>) -> usize {
        match (&self.conn, key) {
            (Conn::Single(_), _) => 0,
            (Conn::Cluster(_), Some(key)) => usize::from(slot_of(key)) % CLUSTER_SLOTS,
            (Conn::Cluster(_), None) => CLUSTER_SLOTS,
        }
    }

    fn answered(&self, lane: usize, at: u64) {
        if let Some(a) = self.answered.get(lane) {
            a.fetch_max(at, Ordering::Relaxed);
        }
    }

    fn answered_since(&self, lane: usize, since: u64) -> bool {
        self.answered
            .get(lane)
            .is_some_and(|a| a.load(Ordering::Relaxed) > since)
    }
}

/// What a finished request says about its connection.
enum Heard {
    /// A reply (a server error is one too).
    Reply,
    /// Nothing within the timeout.
    Silence,
    /// The connection failed, was refused or read something it could not
    /// parse: the redis crate reconnects by itself.
    Lost,
}

fn heard<T>(result: &RedisResult<T>) -> Heard {
    match result {
        Ok(_) => Heard::Reply,
        Err(e) if e.is_timeout() => Heard::Silence,
        Err(e) if e.is_io_error() || e.is_unrecoverable_error() => Heard::Lost,
        Err(_) => Heard::Reply,
    }
}

impl Connection {
    /// The store's connection, starting with `first` (made with `dial`'s
    /// settings, which make its replacements). `replaced` counts the
    /// replacements.
    pub(super) fn new(
        first: Conn,
        dial: Dial,
        timeout: Duration,
        shown: String,
        replaced: prometheus::IntCounter,
    ) -> Connection {
        let (requests, queue) = mpsc::channel(HANDOFF_QUEUE);
        tokio::spawn(drive(queue));
        Connection {
            shared: Arc::new(Shared {
                current: ArcSwap::from_pointee(Generation::new(first, 0)),
                requests,
                dial,
                timeout,
                shown,
                replacing: AtomicBool::new(false),
                replaced,
                origin: Instant::now(),
            }),
        }
    }

    /// Whether this is a cluster connection.
    pub(super) fn is_cluster(&self) -> bool {
        matches!(self.shared.current.load().conn, Conn::Cluster(_))
    }

    /// Runs `request` on the connection in use, driven by the store's own
    /// task (see the module documentation), and watches its answer. `key`:
    /// the first key it touches (on a cluster, the slot whose node it goes
    /// to). The request is handed over on the first poll, before anything
    /// is awaited; dropping the returned future leaves it to finish alone.
    pub(super) async fn run<T, F, Fut>(&self, key: Option<&[u8]>, request: F) -> RedisResult<T>
    where
        F: FnOnce(Conn) -> Fut + Send + 'static,
        Fut: Future<Output = RedisResult<T>> + Send + 'static,
        T: Send + 'static,
    {
        let generation = self.shared.current.load_full();
        let lane = generation.lane(key);
        let shared = self.shared.clone();
        let (answer, answered) = oneshot::channel();
        let call: Request = Box::pin(async move {
            let sent = shared.now_ms();
            let result = tokio::time::timeout(REQUEST_DEADLINE, request(generation.conn.clone()))
                .await
                .unwrap_or_else(|_| Err(std::io::Error::from(std::io::ErrorKind::TimedOut).into()));
            match heard(&result) {
                Heard::Reply => generation.answered(lane, shared.now_ms()),
                Heard::Silence => {
                    if !generation.answered_since(lane, sent) {
                        shared.replace(&generation, sent);
                    }
                }
                Heard::Lost => {}
            }
            // The caller may have stopped waiting.
            let _ = answer.send(result);
        });
        if self.shared.requests.try_send(call).is_err() {
            return Err(RedisError::from((
                ErrorKind::Client,
                "the store's request queue is full",
            )));
        }
        answered.await.unwrap_or_else(|_| {
            Err(RedisError::from((
                ErrorKind::Client,
                "the store's request task ended without an answer",
            )))
        })
    }

    /// Runs one command.
    pub(super) async fn command(&self, key: Option<&[u8]>, cmd: Arc<Cmd>) -> RedisResult<Value> {
        self.run(key, move |mut conn| async move {
            cmd.query_async::<Value>(&mut conn).await
        })
        .await
    }

    /// Runs a pipeline (on a cluster, its commands must share one slot).
    pub(super) async fn pipeline(
        &self,
        key: Option<&[u8]>,
        pipe: Arc<Pipeline>,
    ) -> RedisResult<Vec<Value>> {
        self.run(key, move |mut conn| async move {
            pipe.query_async::<Vec<Value>>(&mut conn).await
        })
        .await
    }

    /// `SCRIPT LOAD`s a script (on a cluster, on every node).
    pub(super) async fn load_script(&self, script: &redis::Script) -> RedisResult<String> {
        let script = script.clone();
        self.run(None, move |mut conn| async move {
            script.load_async(&mut conn).await
        })
        .await
    }
}

/// Drives every request of a connection: takes each from the queue as it
/// comes and polls them all until they end. Ends once the queue's sender is
/// gone and no request is left.
///
/// The requests start in the order they were made: a request is first
/// polled after every request taken before it (the futures set polls new
/// ones in the order they were pushed), and that first poll takes its place
/// in the redis crate's queue (sent, or waiting first come, first served).
/// Each runs outside tokio's cooperative budget: with the budget spent, that
/// first poll would give up before taking its place and be polled again
/// only after requests made later (the set puts a future that wakes itself
/// behind the others), which reorders them (seen with 500 batches at once,
/// before this task too).
async fn drive(mut queue: mpsc::Receiver<Request>) {
    let mut in_flight = FuturesUnordered::new();
    loop {
        tokio::select! {
            biased;
            next = queue.recv() => match next {
                Some(request) => in_flight.push(tokio::task::unconstrained(request)),
                None => break,
            },
            Some(()) = in_flight.next(), if !in_flight.is_empty() => {}
        }
    }
    while in_flight.next().await.is_some() {}
}

impl Shared {
    fn now_ms(&self) -> u64 {
        u64::try_from(self.origin.elapsed().as_millis())
            .unwrap_or(u64::MAX)
            .saturating_add(1)
    }

    /// Replaces `silent`, if it is still the connection in use and no
    /// replacement is under way: the new one is in use once made. `sent`:
    /// when the request that got no answer was sent.
    fn replace(self: &Arc<Self>, silent: &Arc<Generation>, sent: u64) {
        if !Arc::ptr_eq(&self.current.load(), silent) || self.replacing.swap(true, Ordering::AcqRel)
        {
            return;
        }
        let (shared, silent) = (self.clone(), silent.clone());
        let silent_ms = shared.now_ms().saturating_sub(sent);
        tokio::spawn(async move {
            match shared.dial.connect().await {
                Ok(conn) => {
                    let number = silent.number + 1;
                    shared
                        .current
                        .store(Arc::new(Generation::new(conn, number)));
                    shared.replaced.inc();
                    tracing::warn!(
                        store = %shared.shown,
                        generation = number,
                        silent_ms,
                        response_timeout_ms = u64::try_from(shared.timeout.as_millis()).unwrap_or(u64::MAX),
                        "Redis connection replaced: a request got no answer within the response \
                         timeout and the connection answered nothing else meanwhile"
                    );
                }
                Err(e) => {
                    tracing::warn!(
                        store = %shared.shown,
                        error = %e,
                        "Redis connection not answering, and a new one could not be made; \
                         trying again at the next request without an answer"
                    );
                }
            }
            shared.replacing.store(false, Ordering::Release);
        });
    }
}

#[cfg(test)]
mod tests {
    use super::{Heard, heard};
    use redis::{ErrorKind, RedisError, RedisResult};

    fn kind(r: &RedisResult<()>) -> &'static str {
        match heard(r) {
            Heard::Reply => "reply",
            Heard::Silence => "silence",
            Heard::Lost => "lost",
        }
    }

    #[test]
    fn a_timeout_is_silence_a_lost_connection_is_not_and_a_server_error_is_a_reply() {
        let io = |k: std::io::ErrorKind| Err(RedisError::from(std::io::Error::from(k)));
        assert_eq!(kind(&Ok(())), "reply");
        assert_eq!(kind(&io(std::io::ErrorKind::TimedOut)), "silence");
        assert_eq!(kind(&io(std::io::ErrorKind::ConnectionReset)), "lost");
        assert_eq!(kind(&io(std::io::ErrorKind::ConnectionRefused)), "lost");
        assert_eq!(
            kind(&Err(RedisError::from((ErrorKind::Client, "bad")))),
            "reply"
        );
    }
}
