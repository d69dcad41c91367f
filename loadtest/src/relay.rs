//! The relay under test: the `oab-relay` binary as a child process (the
//! default: the relay gets its own process, its memory can be read from
//! `/proc/<pid>/status`, and `perf record -p <pid>` profiles it alone), or
//! `oab_relay::run` on its own runtime in this process. Either way with the
//! memory store or a Redis store on a `redis-server` the harness starts.
//!
//! Dropping a [`RelayUnderTest`] kills the child process (SIGKILL) or stops
//! the in-process relay, and kills its `redis-server`: a run leaves nothing
//! behind, also when it is interrupted.
//!
//! A [`RelayFleet`] is several relay instances over one shared store (a
//! `redis-server` or a three-master Redis Cluster started for the run), each
//! its own fleet member (`--set fleet.node=relay-N`).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, bail};
use oab_relay::config::Config;
use oab_relay::store::{MemoryStore, RedisStore, wake_channel};
use oab_testkit::raw_client::Target;
use oab_testkit::redis::{Persistence, RedisCluster, RedisServer};
use oab_wire::PeerId;
use serde::Serialize;
use tokio::io::{
    AsyncBufReadExt as _, AsyncRead, AsyncReadExt as _, AsyncWrite, AsyncWriteExt as _,
};
use tokio_util::sync::CancellationToken;

use crate::setup::{RELAY_ID, Setup};

/// How long a relay child process may take to print its listen address.
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// How often [`RelayUnderTest::kill_and_restart`] retries a start that
/// failed (the port not yet released by the killed process).
const RESTART_ATTEMPTS: u32 = 40;

/// How long one admin HTTP request or one Redis `INFO` may take.
const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

/// Which durable store the relay uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StoreKind {
    /// The in-memory store.
    Memory,
    /// A Redis store on a `redis-server` started for the run.
    Redis,
}

impl StoreKind {
    /// Stable name for tables and JSON.
    pub fn name(self) -> &'static str {
        match self {
            StoreKind::Memory => "memory",
            StoreKind::Redis => "redis",
        }
    }
}

/// How the relay runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RelayMode {
    /// The `oab-relay` binary at this path, as a child process.
    Process(PathBuf),
    /// `oab_relay::run` on a dedicated multi-threaded runtime in this process.
    InProcess,
}

impl RelayMode {
    /// Stable name for tables and JSON.
    pub fn name(&self) -> &'static str {
        match self {
            RelayMode::Process(_) => "process",
            RelayMode::InProcess => "in-process",
        }
    }
}

/// Finds the `oab-relay` binary: `explicit` if given, else next to the
/// running executable (where `cargo build` puts both).
pub fn find_relay_bin(explicit: Option<&Path>) -> Option<PathBuf> {
    if let Some(p) = explicit {
        return Some(p.to_path_buf());
    }
    let exe = std::env::current_exe().ok()?;
    let candidate = exe.parent()?.join("oab-relay");
    candidate.is_file().then_some(candidate)
}

/// How `redis-server` persists, for a Redis store.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RedisPersistence {
    /// No persistence (the store's cost without disk writes).
    None,
    /// Append-only file, fsync every second (what production usually runs;
    /// a SIGKILL while a background fsync is slow may lose acknowledged
    /// writes).
    Aof,
    /// Append-only file, fsync before every reply: a SIGKILL loses nothing
    /// acknowledged.
    AofAlways,
}

enum Running {
    Process {
        child: tokio::process::Child,
        pid: u32,
        stderr_log: PathBuf,
    },
    InProcess {
        stop: CancellationToken,
        done: Option<tokio::sync::oneshot::Receiver<()>>,
    },
}

/// A running relay. Dropping it stops the relay and its `redis-server`.
pub struct RelayUnderTest {
    addr: SocketAddr,
    admin: Option<SocketAddr>,
    cert_der: Vec<u8>,
    store: StoreKind,
    store_url: String,
    /// `--set` overrides of this instance (kept for a restart).
    sets: Vec<(String, String)>,
    /// The prefix of the child's log file name.
    log_name: String,
    running: Running,
    // Held only to keep redis-server alive; dropped after the relay (field
    // order), so the relay never sees its store vanish while it still runs.
    _redis: Option<RedisServer>,
}

impl std::fmt::Debug for RelayUnderTest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RelayUnderTest")
            .field("addr", &self.addr)
            .field("store", &self.store)
            .field("pid", &self.pid())
            .finish_non_exhaustive()
    }
}

impl RelayUnderTest {
    /// Starts a relay with `setup`'s config on `store`.
    pub async fn start(
        setup: &Setup,
        mode: &RelayMode,
        store: StoreKind,
        persistence: RedisPersistence,
    ) -> anyhow::Result<RelayUnderTest> {
        let redis = match store {
            StoreKind::Memory => None,
            StoreKind::Redis => {
                let p = match persistence {
                    RedisPersistence::None => Persistence::None,
                    RedisPersistence::Aof => Persistence::Aof,
                    RedisPersistence::AofAlways => Persistence::AofAlways,
                };
                // The harness polls with blocking sleeps while redis starts.
                let server = tokio::task::spawn_blocking(move || RedisServer::start(p))
                    .await
                    .context("redis harness task")?
                    .context("starting redis-server")?;
                Some(server)
            }
        };
        let store_url = redis
            .as_ref()
            .map_or_else(|| "memory".to_string(), RedisServer::url);
        let mut relay =
            RelayUnderTest::start_on(setup, mode, store, &store_url, Vec::new(), "relay").await?;
        relay._redis = redis;
        Ok(relay)
    }

    /// Starts a relay on a store someone else runs (`store_url`: `memory`,
    /// a Redis or a `redis-cluster://` URL), with `--set` overrides `sets`
    /// (applied to the config file in-process). `log_name` prefixes the
    /// child's log file, so instances of one run keep separate logs.
    pub async fn start_on(
        setup: &Setup,
        mode: &RelayMode,
        store: StoreKind,
        store_url: &str,
        sets: Vec<(String, String)>,
        log_name: &str,
    ) -> anyhow::Result<RelayUnderTest> {
        let started = match mode {
            RelayMode::Process(bin) => {
                start_process(setup, bin, store_url, None, &sets, log_name).await?
            }
            RelayMode::InProcess => start_in_process(setup, store, store_url, None, &sets).await?,
        };
        Ok(RelayUnderTest {
            addr: started.addr,
            admin: started.admin,
            cert_der: setup.cert_der.clone(),
            store,
            store_url: store_url.to_string(),
            sets,
            log_name: log_name.to_string(),
            running: started.running,
            _redis: None,
        })
    }

    /// The admin listener (`/metrics`, `/healthz`), when known.
    pub fn admin_addr(&self) -> Option<SocketAddr> {
        self.admin
    }

    /// The relay's Prometheus metrics page.
    pub async fn metrics(&self) -> anyhow::Result<String> {
        let admin = self
            .admin
            .context("the relay's admin address is not known")?;
        http_get(admin, "/metrics").await
    }

    /// The value of the unlabelled metric `name` (`None`: not on the page).
    pub async fn metric(&self, name: &str) -> anyhow::Result<Option<f64>> {
        Ok(metric_value(&self.metrics().await?, name))
    }

    /// Where connectors connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The store it runs on.
    pub fn store(&self) -> StoreKind {
        self.store
    }

    /// The connect target for raw clients.
    pub fn target(&self) -> Target {
        Target {
            addr: self.addr.to_string(),
            server_name: Some(RELAY_ID.into()),
            root_der: self.cert_der.clone(),
        }
    }

    /// The unix socket of the relay's own `redis-server` (`None`: the
    /// memory store, or a store someone else runs).
    pub fn redis_socket(&self) -> Option<std::path::PathBuf> {
        self._redis.as_ref().map(RedisServer::socket_path)
    }

    /// The relay's process id when it runs as a child process.
    pub fn pid(&self) -> Option<u32> {
        match &self.running {
            Running::Process { pid, .. } => Some(*pid),
            Running::InProcess { .. } => None,
        }
    }

    /// The resident set size of the relay's process, bytes: the child's, or
    /// this process's (relay and load generator together) when in-process.
    pub fn rss_bytes(&self) -> Option<u64> {
        match &self.running {
            Running::Process { pid, .. } => rss_of(&format!("/proc/{pid}/status")),
            Running::InProcess { .. } => rss_of("/proc/self/status"),
        }
    }

    /// Whether [`RelayUnderTest::rss_bytes`] measures the relay alone.
    pub fn rss_is_relay_only(&self) -> bool {
        matches!(self.running, Running::Process { .. })
    }

    /// Kills the relay and starts it again on the same address and store
    /// (the `redis-server` keeps running). A child process is killed with
    /// SIGKILL: no drain, no goodbye frames, exactly like a crash. An
    /// in-process relay cannot be killed that way; it is stopped through its
    /// shutdown token instead (a graceful stop, bounded by its drain).
    pub async fn kill_and_restart(
        &mut self,
        setup: &Setup,
        mode: &RelayMode,
    ) -> anyhow::Result<()> {
        self.restart(setup, mode, ProcessStop::Kill)
            .await
            .map(|_| ())
    }

    /// Stops the relay as `stop` says and starts it again on the same
    /// address, admin address and store. Returns how the old process
    /// ended: with SIGTERM, whether it exited cleanly within
    /// [`TERM_TIMEOUT`] (it drains its sessions first), and how long that
    /// took.
    pub async fn restart(
        &mut self,
        setup: &Setup,
        mode: &RelayMode,
        stop: ProcessStop,
    ) -> anyhow::Result<Stopped> {
        let began = tokio::time::Instant::now();
        let mut clean = false;
        match &mut self.running {
            Running::Process { child, pid, .. } => match stop {
                ProcessStop::Kill => {
                    let _ = child.start_kill();
                    let _ = tokio::time::timeout(Duration::from_secs(5), child.wait()).await;
                }
                ProcessStop::Term => {
                    clean = terminate(child, *pid, TERM_TIMEOUT).await;
                }
            },
            Running::InProcess { stop, done } => {
                stop.cancel();
                if let Some(done) = done.take() {
                    let _ = tokio::time::timeout(Duration::from_secs(15), done).await;
                }
            }
        }
        // The old listener is gone once the process is reaped; a rebind can
        // still race the kernel's cleanup, so retry briefly.
        let mut attempt = 0u32;
        let started = loop {
            let started = match mode {
                RelayMode::Process(bin) => {
                    start_process(
                        setup,
                        bin,
                        &self.store_url,
                        Some(self.addr),
                        &self.sets,
                        &self.log_name,
                    )
                    .await
                }
                RelayMode::InProcess => {
                    start_in_process(
                        setup,
                        self.store,
                        &self.store_url,
                        Some(self.addr),
                        &self.sets,
                    )
                    .await
                }
            };
            match started {
                Ok(r) => break r,
                Err(e) if attempt < RESTART_ATTEMPTS => {
                    attempt += 1;
                    tracing::warn!(error = %format!("{e:#}"), attempt, "relay restart failed; retrying");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => return Err(e),
            }
        };
        if started.addr != self.addr {
            bail!(
                "the restarted relay listens on {}, not {}",
                started.addr,
                self.addr
            );
        }
        self.admin = started.admin;
        self.running = started.running;
        Ok(Stopped {
            clean,
            took: began.elapsed(),
        })
    }

    /// Stops the relay and waits for it (bounded), then its redis-server.
    pub async fn stop(mut self) {
        match &mut self.running {
            Running::Process { child, .. } => {
                let _ = child.start_kill();
                let _ = tokio::time::timeout(Duration::from_secs(5), child.wait()).await;
            }
            Running::InProcess { stop, done } => {
                stop.cancel();
                if let Some(done) = done.take() {
                    let _ = tokio::time::timeout(Duration::from_secs(15), done).await;
                }
            }
        }
    }

    /// The store URL the relay runs on (`memory`, or the Redis URL).
    pub fn store_url(&self) -> &str {
        &self.store_url
    }

    /// Kills the `redis-server` behind a Redis store with SIGKILL (a crash:
    /// no shutdown save) and reaps it. The relay keeps running and sees its
    /// store vanish. Fails on the memory store.
    pub async fn kill_redis(&mut self) -> anyhow::Result<()> {
        let mut server = self
            ._redis
            .take()
            .context("the relay runs on no redis-server of its own")?;
        // Kill and reap block briefly: off the runtime's workers.
        let (server, r) = tokio::task::spawn_blocking(move || {
            let r = server.kill();
            (server, r)
        })
        .await
        .context("redis harness task")?;
        self._redis = Some(server);
        r.context("killing redis-server")
    }

    /// Starts the killed `redis-server` again on the same directory and
    /// socket (an AOF is reloaded) and waits until it answers PING.
    pub async fn restart_redis(&mut self) -> anyhow::Result<()> {
        let mut server = self
            ._redis
            .take()
            .context("the relay runs on no redis-server of its own")?;
        // The harness polls with blocking sleeps while redis starts.
        let (server, r) = tokio::task::spawn_blocking(move || {
            let r = server.restart();
            (server, r)
        })
        .await
        .context("redis harness task")?;
        self._redis = Some(server);
        r.context("restarting redis-server")
    }

    /// Keys and memory of the relay's own `redis-server` (`DBSIZE`,
    /// `INFO memory`). Fails on the memory store.
    pub async fn redis_footprint(&self) -> anyhow::Result<RedisFootprint> {
        let server = self
            ._redis
            .as_ref()
            .context("the relay runs on no redis-server of its own")?;
        let mut s = tokio::net::UnixStream::connect(server.socket_path())
            .await
            .context("connecting to redis-server")?;
        redis_footprint(&mut s).await
    }

    /// CPU seconds (user + system) the relay's own `redis-server` has used
    /// (`INFO cpu`). Fails on the memory store.
    pub async fn redis_cpu_seconds(&self) -> anyhow::Result<f64> {
        let server = self
            ._redis
            .as_ref()
            .context("the relay runs on no redis-server of its own")?;
        let s = tokio::net::UnixStream::connect(server.socket_path())
            .await
            .context("connecting to redis-server")?;
        redis_cpu_seconds(s).await
    }

    /// Calls per command so far on the relay's own `redis-server`
    /// (`INFO commandstats`: `cmdstat_<name>:calls=N,...`), by command
    /// name. Fails on the memory store.
    pub async fn redis_command_calls(
        &self,
    ) -> anyhow::Result<std::collections::BTreeMap<String, u64>> {
        let server = self
            ._redis
            .as_ref()
            .context("the relay runs on no redis-server of its own")?;
        let mut s = tokio::net::UnixStream::connect(server.socket_path())
            .await
            .context("connecting to redis-server")?;
        let Resp::Text(body) = redis_command(&mut s, &["INFO", "commandstats"]).await? else {
            bail!("INFO commandstats did not answer text");
        };
        Ok(body
            .lines()
            .filter_map(|l| {
                let (name, rest) = l.trim_end().strip_prefix("cmdstat_")?.split_once(':')?;
                let calls = rest
                    .split(',')
                    .find_map(|kv| kv.strip_prefix("calls="))?
                    .parse()
                    .ok()?;
                Some((name.to_string(), calls))
            })
            .collect())
    }

    /// The child's log file (stderr); `None` for a relay in this process.
    pub fn log_path(&self) -> Option<&Path> {
        match &self.running {
            Running::Process { stderr_log, .. } => Some(stderr_log),
            Running::InProcess { .. } => None,
        }
    }

    /// The tail of the child's log (stderr), for error messages.
    pub fn log_tail(&self) -> String {
        match &self.running {
            Running::Process { stderr_log, .. } => {
                let text = std::fs::read(stderr_log).unwrap_or_default();
                let start = text.len().saturating_sub(2048);
                String::from_utf8_lossy(text.get(start..).unwrap_or_default()).into_owned()
            }
            Running::InProcess { .. } => String::new(),
        }
    }
}

impl Drop for RelayUnderTest {
    fn drop(&mut self) {
        match &mut self.running {
            // kill_on_drop is set too; this also covers a Child moved out.
            Running::Process { child, .. } => {
                let _ = child.start_kill();
            }
            Running::InProcess { stop, .. } => stop.cancel(),
        }
    }
}

/// The shared store under a [`RelayFleet`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum SharedStoreKind {
    /// One `redis-server` (unix socket), persistence as the run asks.
    Redis,
    /// A three-master Redis Cluster on loopback TCP (AOF `everysec`, as the
    /// harness always starts it).
    RedisCluster,
}

impl SharedStoreKind {
    /// Stable name for tables and JSON.
    pub fn name(self) -> &'static str {
        match self {
            SharedStoreKind::Redis => "redis",
            SharedStoreKind::RedisCluster => "redis-cluster",
        }
    }
}

enum SharedStore {
    Redis(RedisServer),
    Cluster(RedisCluster),
}

/// Where to reach one `redis-server` of the shared store.
enum StoreNode {
    Unix(PathBuf),
    Tcp(SocketAddr),
}

/// How a process of the run is stopped before it is started again.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum ProcessStop {
    /// SIGKILL: a crash (no drain, nothing flushed).
    Kill,
    /// SIGTERM: the clean stop of a service manager or a rolling upgrade.
    Term,
}

impl ProcessStop {
    /// Stable name for tables and JSON.
    pub fn name(self) -> &'static str {
        match self {
            ProcessStop::Kill => "kill",
            ProcessStop::Term => "term",
        }
    }
}

/// How a restarted process's predecessor ended.
#[derive(Debug, Clone, Copy)]
pub struct Stopped {
    /// It exited with status 0 after SIGTERM (always `false` for SIGKILL).
    pub clean: bool,
    /// From the signal to the new process being ready.
    pub took: Duration,
}

/// How long a process may take to exit after SIGTERM (a relay drains its
/// sessions first, 10 s by default) before it is killed.
pub const TERM_TIMEOUT: Duration = Duration::from_secs(30);

/// Sends SIGTERM to a child and waits for its exit, at most `timeout`
/// (then SIGKILL). `true`: it exited with status 0 in time.
pub async fn terminate(child: &mut tokio::process::Child, pid: u32, timeout: Duration) -> bool {
    let signalled = tokio::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .await
        .is_ok_and(|s| s.success());
    if signalled && let Ok(Ok(exit)) = tokio::time::timeout(timeout, child.wait()).await {
        return exit.success();
    }
    let _ = child.start_kill();
    let _ = tokio::time::timeout(Duration::from_secs(5), child.wait()).await;
    false
}

/// Several relay instances over one store started for the run: each a fleet
/// member named `relay-1`, `relay-2`, ... (`--set fleet.node=relay-N`).
/// Dropping it stops every instance, then the store.
pub struct RelayFleet {
    // Field order is drop order: the instances go before their store.
    instances: Vec<RelayUnderTest>,
    kind: SharedStoreKind,
    url: String,
    store: SharedStore,
}

impl std::fmt::Debug for RelayFleet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RelayFleet")
            .field("store", &self.kind)
            .field("url", &self.url)
            .field("instances", &self.instances)
            .finish()
    }
}

impl RelayFleet {
    /// Starts the store; no relay instance runs yet (see
    /// [`RelayFleet::add_instance`]). `persistence` applies to a single
    /// `redis-server`; a cluster always runs with AOF `everysec`.
    pub async fn start_store(
        kind: SharedStoreKind,
        persistence: RedisPersistence,
    ) -> anyhow::Result<RelayFleet> {
        // The harness polls with blocking sleeps while redis starts.
        let store = tokio::task::spawn_blocking(move || match kind {
            SharedStoreKind::Redis => {
                let p = match persistence {
                    RedisPersistence::None => Persistence::None,
                    RedisPersistence::Aof => Persistence::Aof,
                    RedisPersistence::AofAlways => Persistence::AofAlways,
                };
                RedisServer::start(p)
                    .map(SharedStore::Redis)
                    .context("starting redis-server")
            }
            SharedStoreKind::RedisCluster => RedisCluster::start()
                .map(SharedStore::Cluster)
                .context("starting a three-master Redis Cluster"),
        })
        .await
        .context("redis harness task")??;
        let url = match &store {
            SharedStore::Redis(r) => r.url(),
            SharedStore::Cluster(c) => c.url(),
        };
        Ok(RelayFleet {
            instances: Vec::new(),
            kind,
            url,
            store,
        })
    }

    /// Starts the next instance, `relay-<n>`, with `fleet.node` set to that
    /// name plus `extra_sets`; returns its index.
    pub async fn add_instance(
        &mut self,
        setup: &Setup,
        mode: &RelayMode,
        extra_sets: &[(String, String)],
    ) -> anyhow::Result<usize> {
        let i = self.instances.len();
        let node = format!("relay-{}", i + 1);
        let mut sets = vec![("fleet.node".to_string(), node.clone())];
        sets.extend_from_slice(extra_sets);
        let relay = RelayUnderTest::start_on(setup, mode, StoreKind::Redis, &self.url, sets, &node)
            .await
            .with_context(|| format!("starting {node} on {}", self.kind.name()))?;
        tracing::info!(%node, pid = ?relay.pid(), addr = %relay.addr(), admin = ?relay.admin_addr(), "fleet instance started");
        self.instances.push(relay);
        Ok(i)
    }

    /// The running instances, in start order.
    pub fn instances(&self) -> &[RelayUnderTest] {
        &self.instances
    }

    /// The store's kind.
    pub fn store_kind(&self) -> SharedStoreKind {
        self.kind
    }

    /// The store URL every instance uses.
    pub fn store_url(&self) -> &str {
        &self.url
    }

    /// Polls every instance's `oab_fleet_nodes` until each reports `n` live
    /// instances (each then publishes every append: the fleet mode with
    /// other instances alive), at most `timeout`. Returns how long it took.
    pub async fn wait_for_nodes(&self, n: usize, timeout: Duration) -> anyhow::Result<Duration> {
        let started = tokio::time::Instant::now();
        let want = n as f64;
        loop {
            let mut seen = Vec::with_capacity(self.instances.len());
            for r in &self.instances {
                seen.push(match r.metric("oab_fleet_nodes").await {
                    Ok(v) => v,
                    Err(e) => {
                        tracing::debug!(error = %format!("{e:#}"), "metrics not readable yet");
                        None
                    }
                });
            }
            if seen.iter().all(|v| *v == Some(want)) {
                return Ok(started.elapsed());
            }
            if started.elapsed() >= timeout {
                bail!(
                    "the instances did not all see {n} live instances within {timeout:?} \
                     (oab_fleet_nodes per instance: {seen:?})"
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// CPU seconds (user + system) the store's `redis-server` processes have
    /// used, from `INFO cpu` (summed over a cluster's nodes).
    pub async fn store_cpu_seconds(&self) -> Option<f64> {
        let mut total = 0.0;
        for node in self.store_nodes() {
            total += match node {
                StoreNode::Unix(path) => {
                    let s = tokio::net::UnixStream::connect(path).await.ok()?;
                    redis_cpu_seconds(s).await.ok()?
                }
                StoreNode::Tcp(addr) => {
                    let s = tokio::net::TcpStream::connect(addr).await.ok()?;
                    redis_cpu_seconds(s).await.ok()?
                }
            };
        }
        Some(total)
    }

    /// How many subscriptions the store has on the wake channels of
    /// `peers` (summed over a cluster's nodes: each counts the subscribers
    /// connected to it).
    pub async fn wake_subscribers(&self, peers: &[&PeerId]) -> anyhow::Result<u64> {
        let channels: Vec<String> = peers.iter().map(|p| wake_channel(p)).collect();
        let mut total = 0;
        for node in self.store_nodes() {
            total += match node {
                StoreNode::Unix(path) => {
                    let s = tokio::net::UnixStream::connect(path).await?;
                    redis_numsub(s, &channels).await?
                }
                StoreNode::Tcp(addr) => {
                    let s = tokio::net::TcpStream::connect(addr).await?;
                    redis_numsub(s, &channels).await?
                }
            };
        }
        Ok(total)
    }

    /// Waits until the store has at most `at_most` subscriptions on the
    /// wake channels of `peers`, at most `timeout` (an instance drops the
    /// channel of a peer it no longer holds at its next liveness renewal).
    /// Returns how long it took.
    pub async fn wait_wake_subscribers(
        &self,
        peers: &[&PeerId],
        at_most: u64,
        timeout: Duration,
    ) -> anyhow::Result<Duration> {
        let started = tokio::time::Instant::now();
        loop {
            let n = self.wake_subscribers(peers).await?;
            if n <= at_most {
                return Ok(started.elapsed());
            }
            if started.elapsed() >= timeout {
                bail!(
                    "{n} wake-channel subscription(s) of {peers:?} still there after {timeout:?} \
                     (at most {at_most} expected)"
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn store_nodes(&self) -> Vec<StoreNode> {
        match &self.store {
            SharedStore::Redis(r) => vec![StoreNode::Unix(r.socket_path())],
            SharedStore::Cluster(c) => c
                .node_urls()
                .iter()
                .filter_map(|u| {
                    u.strip_prefix("redis://")?
                        .trim_end_matches('/')
                        .parse()
                        .ok()
                })
                .map(StoreNode::Tcp)
                .collect(),
        }
    }

    /// Stops instance `i` as `stop` says and starts it again on the same
    /// addresses (see [`RelayUnderTest::restart`]).
    pub async fn restart_instance(
        &mut self,
        i: usize,
        setup: &Setup,
        mode: &RelayMode,
        stop: ProcessStop,
    ) -> anyhow::Result<Stopped> {
        let relay = self
            .instances
            .get_mut(i)
            .with_context(|| format!("no fleet instance {i}"))?;
        relay.restart(setup, mode, stop).await
    }

    /// Stops the store's `redis-server` as `stop` says (SIGTERM: it syncs
    /// its AOF and exits; SIGKILL: a crash) and starts it again on the same
    /// directory, which reloads the AOF. A single `redis-server` only.
    pub async fn restart_store(&mut self, stop: ProcessStop) -> anyhow::Result<Stopped> {
        let SharedStore::Redis(server) = &mut self.store else {
            bail!("restarting the store is done for a single redis-server only");
        };
        let began = std::time::Instant::now();
        // The harness waits with blocking sleeps: off this worker's tasks.
        let mut bounce = || -> anyhow::Result<bool> {
            let clean = match stop {
                ProcessStop::Kill => {
                    server.kill().context("killing redis-server")?;
                    false
                }
                ProcessStop::Term => server.stop(TERM_TIMEOUT).context("stopping redis-server")?,
            };
            server.restart().context("starting redis-server again")?;
            Ok(clean)
        };
        let clean = match tokio::runtime::Handle::current().runtime_flavor() {
            tokio::runtime::RuntimeFlavor::CurrentThread => bounce()?,
            _ => tokio::task::block_in_place(bounce)?,
        };
        Ok(Stopped {
            clean,
            took: began.elapsed(),
        })
    }

    /// Stops every instance (last started first), then the store.
    pub async fn stop(mut self) {
        while let Some(r) = self.instances.pop() {
            r.stop().await;
        }
    }

    /// Stops the last started instance and forgets it.
    pub async fn stop_last(&mut self) {
        if let Some(r) = self.instances.pop() {
            r.stop().await;
        }
    }
}

/// A Redis reply, as far as this harness reads them.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Resp {
    /// `+...`, or a bulk string.
    Text(String),
    /// `:n`.
    Int(i64),
    /// `*n` followed by n replies.
    Array(Vec<Resp>),
    /// `$-1` or `*-1`.
    Nil,
}

/// Sends one command and reads its reply (bounded by [`PROBE_TIMEOUT`]).
async fn redis_command<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    args: &[&str],
) -> anyhow::Result<Resp> {
    let exchange = async {
        let mut req = format!("*{}\r\n", args.len());
        for a in args {
            req.push_str(&format!("${}\r\n{a}\r\n", a.len()));
        }
        s.write_all(req.as_bytes()).await?;
        let mut buf = Vec::new();
        let mut chunk = [0u8; 4096];
        loop {
            let n = s.read(&mut chunk).await?;
            if n == 0 {
                bail!("redis closed the connection");
            }
            buf.extend_from_slice(chunk.get(..n).unwrap_or_default());
            if let Some((reply, _)) = parse_resp(&buf)? {
                return anyhow::Ok(reply);
            }
        }
    };
    tokio::time::timeout(PROBE_TIMEOUT, exchange)
        .await
        .with_context(|| format!("redis {} timed out", args.first().unwrap_or(&"")))?
}

/// One complete reply at the start of `buf` and the bytes it took (`None`:
/// not all read yet). An error reply is an error.
fn parse_resp(buf: &[u8]) -> anyhow::Result<Option<(Resp, usize)>> {
    let Some(eol) = buf.windows(2).position(|w| w == b"\r\n") else {
        return Ok(None);
    };
    let line = String::from_utf8_lossy(buf.get(1..eol).unwrap_or_default()).into_owned();
    let after = eol + 2;
    let number = || -> anyhow::Result<i64> {
        line.parse()
            .with_context(|| format!("redis reply header {line:?}"))
    };
    match buf.first() {
        Some(b'+') => Ok(Some((Resp::Text(line), after))),
        Some(b'-') => bail!("redis answered an error: {line}"),
        Some(b':') => Ok(Some((Resp::Int(number()?), after))),
        Some(b'$') => {
            let Ok(len) = usize::try_from(number()?) else {
                return Ok(Some((Resp::Nil, after)));
            };
            Ok(buf.get(after..after + len).map(|b| {
                (
                    Resp::Text(String::from_utf8_lossy(b).into_owned()),
                    after + len + 2,
                )
            }))
        }
        Some(b'*') => {
            let Ok(count) = usize::try_from(number()?) else {
                return Ok(Some((Resp::Nil, after)));
            };
            let mut items = Vec::with_capacity(count.min(1024));
            let mut at = after;
            for _ in 0..count {
                let Some((item, used)) = parse_resp(buf.get(at..).unwrap_or_default())? else {
                    return Ok(None);
                };
                items.push(item);
                at += used;
            }
            Ok(Some((Resp::Array(items), at)))
        }
        _ => bail!("unexpected redis reply {line:?}"),
    }
}

/// What a `redis-server` holds: its key count and its allocator's view of
/// its memory.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct RedisFootprint {
    /// `DBSIZE`.
    pub keys: u64,
    /// `used_memory` from `INFO memory`, bytes.
    pub used_memory: u64,
}

/// `DBSIZE` and `INFO memory` on a Redis connection.
async fn redis_footprint<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
) -> anyhow::Result<RedisFootprint> {
    let Resp::Int(keys) = redis_command(s, &["DBSIZE"]).await? else {
        bail!("DBSIZE answered something other than a number");
    };
    let Resp::Text(body) = redis_command(s, &["INFO", "memory"]).await? else {
        bail!("INFO memory answered something other than text");
    };
    let used_memory = body
        .lines()
        .find_map(|l| l.strip_prefix("used_memory:"))
        .and_then(|v| v.trim().parse().ok())
        .context("INFO memory without used_memory")?;
    Ok(RedisFootprint {
        keys: u64::try_from(keys).unwrap_or(0),
        used_memory,
    })
}

/// `used_cpu_sys + used_cpu_user` from `INFO cpu` on a Redis connection.
async fn redis_cpu_seconds<S: AsyncRead + AsyncWrite + Unpin>(mut s: S) -> anyhow::Result<f64> {
    let Resp::Text(body) = redis_command(&mut s, &["INFO", "cpu"]).await? else {
        bail!("INFO cpu did not answer text");
    };
    let field = |name: &str| -> Option<f64> {
        body.lines()
            .find_map(|l| l.trim_end().strip_prefix(name)?.parse().ok())
    };
    match (field("used_cpu_sys:"), field("used_cpu_user:")) {
        (Some(sys), Some(user)) => Ok(sys + user),
        _ => bail!("INFO cpu without used_cpu_sys/used_cpu_user"),
    }
}

/// `PUBSUB NUMSUB` of `channels` on a Redis connection, summed.
async fn redis_numsub<S: AsyncRead + AsyncWrite + Unpin>(
    mut s: S,
    channels: &[String],
) -> anyhow::Result<u64> {
    let mut args = vec!["PUBSUB", "NUMSUB"];
    args.extend(channels.iter().map(String::as_str));
    let Resp::Array(items) = redis_command(&mut s, &args).await? else {
        bail!("PUBSUB NUMSUB did not answer an array");
    };
    // channel, count, channel, count, ...
    Ok(items
        .iter()
        .skip(1)
        .step_by(2)
        .map(|n| match n {
            Resp::Int(n) => u64::try_from(*n).unwrap_or(0),
            _ => 0,
        })
        .sum())
}

/// `VmRSS` from a `/proc/.../status` file, in bytes.
pub fn rss_of(status_path: &str) -> Option<u64> {
    let text = std::fs::read_to_string(status_path).ok()?;
    let line = text.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// A relay just started: where it listens, its admin listener, its handle.
struct Started {
    addr: SocketAddr,
    admin: Option<SocketAddr>,
    running: Running,
}

async fn start_process(
    setup: &Setup,
    bin: &Path,
    store_url: &str,
    listen: Option<SocketAddr>,
    sets: &[(String, String)],
    log_name: &str,
) -> anyhow::Result<Started> {
    let stderr_log = setup
        .dir
        .path()
        .join(format!("{log_name}-{}.log", std::process::id()));
    // Appended to: a restarted relay's log follows its predecessor's.
    let stderr = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&stderr_log)
        .with_context(|| format!("opening {}", stderr_log.display()))?;
    let mut child = tokio::process::Command::new(bin)
        .arg("--config")
        .arg(&setup.config_path)
        .args(["--store", store_url])
        .args(
            listen
                .map(|a| vec!["--set".to_string(), format!("relay.listen={a}")])
                .unwrap_or_default(),
        )
        .args(
            sets.iter()
                .flat_map(|(k, v)| ["--set".to_string(), format!("{k}={v}")]),
        )
        .env("OAB_LOG", &setup.child_log)
        .env("OAB_LOG_FORMAT", &setup.child_log_format)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::from(stderr))
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("starting {}", bin.display()))?;
    let pid = child.id().context("the relay exited at once")?;
    let stdout = child.stdout.take().context("relay stdout")?;
    let mut lines = tokio::io::BufReader::new(stdout).lines();
    // The relay prints `relay <id> listening on wss://<addr>` once bound,
    // and `admin (metrics, health) on http://<addr>/metrics` right after.
    let found = tokio::time::timeout(START_TIMEOUT, async {
        while let Ok(Some(line)) = lines.next_line().await {
            if let Some(addr) = listen_addr_in(&line) {
                return Some(addr);
            }
        }
        None
    })
    .await;
    let admin = if matches!(found, Ok(Some(_))) {
        tokio::time::timeout(Duration::from_secs(2), async {
            while let Ok(Some(line)) = lines.next_line().await {
                if let Some(addr) = admin_addr_in(&line) {
                    return Some(addr);
                }
            }
            None
        })
        .await
        .ok()
        .flatten()
    } else {
        None
    };
    let running = Running::Process {
        child,
        pid,
        stderr_log: stderr_log.clone(),
    };
    let addr = match found {
        Ok(Some(addr)) => addr,
        Ok(None) | Err(_) => {
            let log = std::fs::read_to_string(&stderr_log).unwrap_or_default();
            drop(running);
            bail!(
                "{} did not report its listen address within {START_TIMEOUT:?}; its log:\n{log}",
                bin.display()
            );
        }
    };
    // Keep draining stdout so the child never blocks on a full pipe.
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    Ok(Started {
        addr,
        admin,
        running,
    })
}

/// A listener with `SO_REUSEADDR`, as tokio's own `bind` sets it, so a
/// restarted relay can take its predecessor's port while old connections sit
/// in `TIME_WAIT`.
fn bind_reusable(addr: SocketAddr) -> std::io::Result<std::net::TcpListener> {
    let socket = tokio::net::TcpSocket::new_v4()?;
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(1024)?.into_std()
}

/// The address in a line like `relay localhost listening on wss://127.0.0.1:40123`.
fn listen_addr_in(line: &str) -> Option<SocketAddr> {
    let rest = line.split("listening on ").nth(1)?;
    let addr = rest.split("://").nth(1)?.split_whitespace().next()?;
    addr.trim_end_matches('/').parse().ok()
}

/// The address in a line like `admin (metrics, health) on http://127.0.0.2:9443/metrics`.
fn admin_addr_in(line: &str) -> Option<SocketAddr> {
    let rest = line.strip_prefix("admin ")?.split("http://").nth(1)?;
    rest.split(['/', ' ']).next()?.parse().ok()
}

/// `GET path` on a plain HTTP/1.1 listener; the body of a 200 response.
pub async fn http_get(addr: SocketAddr, path: &str) -> anyhow::Result<String> {
    let exchange = async {
        let mut s = tokio::net::TcpStream::connect(addr).await?;
        s.write_all(
            format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await?;
        let mut buf = Vec::new();
        s.read_to_end(&mut buf).await?;
        anyhow::Ok(buf)
    };
    let buf = tokio::time::timeout(PROBE_TIMEOUT, exchange)
        .await
        .with_context(|| format!("GET http://{addr}{path} timed out"))?
        .with_context(|| format!("GET http://{addr}{path}"))?;
    let text = String::from_utf8_lossy(&buf);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .with_context(|| format!("GET http://{addr}{path}: no HTTP response"))?;
    let status = head.lines().next().unwrap_or_default();
    if status.split_whitespace().nth(1) != Some("200") {
        bail!("GET http://{addr}{path}: {status}");
    }
    Ok(body.to_string())
}

/// The value of the unlabelled metric `name` in a Prometheus text page.
pub fn metric_value(page: &str, name: &str) -> Option<f64> {
    page.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        let (n, v) = l.split_once(' ')?;
        (n == name).then(|| v.trim().parse().ok()).flatten()
    })
}

async fn start_in_process(
    setup: &Setup,
    store: StoreKind,
    store_url: &str,
    listen: Option<SocketAddr>,
    sets: &[(String, String)],
) -> anyhow::Result<Started> {
    let bind_to = listen.unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], 0)));
    let std_listener = bind_reusable(bind_to).context("binding the relay")?;
    std_listener.set_nonblocking(true)?;
    let addr = std_listener.local_addr()?;
    let mut config = if sets.is_empty() {
        setup.config.clone()
    } else {
        // The same overrides a child process gets on its command line.
        let text = std::fs::read_to_string(&setup.config_path)
            .with_context(|| format!("reading {}", setup.config_path.display()))?;
        Config::from_toml_with_overrides(&text, "generated loadtest config", sets)
            .context("the relay config with the instance's overrides")?
    };
    config.store.url = store_url.to_string();
    // The admin listener (metrics) as the binary binds it; without it the
    // relay still runs, only its metrics cannot be read.
    let admin_listener = match std::net::TcpListener::bind(config.relay.admin_listen)
        .and_then(|l| l.set_nonblocking(true).map(|()| l))
    {
        Ok(l) => Some(l),
        Err(e) => {
            tracing::warn!(error = %e, listen = %config.relay.admin_listen, "in-process relay without its admin listener");
            None
        }
    };
    let admin = admin_listener.as_ref().and_then(|l| l.local_addr().ok());
    let config = Arc::new(config);
    let tls = setup.tls.clone();
    let stop = CancellationToken::new();
    let (started_tx, started_rx) = tokio::sync::oneshot::channel::<anyhow::Result<()>>();
    let (done_tx, done_rx) = tokio::sync::oneshot::channel::<()>();
    let stop2 = stop.clone();
    let url = store_url.to_string();
    std::thread::Builder::new()
        .name("relay-under-test".into())
        .spawn(move || {
            let runtime = match tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .thread_name("relay-worker")
                .build()
            {
                Ok(r) => r,
                Err(e) => {
                    let _ = started_tx.send(Err(e.into()));
                    return;
                }
            };
            runtime.block_on(async move {
                let listener = match tokio::net::TcpListener::from_std(std_listener) {
                    Ok(l) => l,
                    Err(e) => {
                        let _ = started_tx.send(Err(e.into()));
                        return;
                    }
                };
                let admin = admin_listener.and_then(|l| tokio::net::TcpListener::from_std(l).ok());
                let retention = config.retention();
                let result = match store {
                    StoreKind::Memory => {
                        let _ = started_tx.send(Ok(()));
                        let store = Arc::new(MemoryStore::new(retention));
                        oab_relay::run(listener, admin, config, store, Some(tls), stop2).await
                    }
                    StoreKind::Redis => match RedisStore::connect(&url, retention).await {
                        Ok(s) => {
                            let _ = started_tx.send(Ok(()));
                            oab_relay::run(listener, admin, config, Arc::new(s), Some(tls), stop2)
                                .await
                        }
                        Err(e) => {
                            let _ = started_tx.send(Err(e.into()));
                            return;
                        }
                    },
                };
                if let Err(e) = result {
                    tracing::error!(error = %e, "in-process relay failed");
                }
            });
            let _ = done_tx.send(());
        })
        .context("starting the relay thread")?;
    started_rx
        .await
        .context("the relay thread ended before starting")??;
    Ok(Started {
        addr,
        admin,
        running: Running::InProcess {
            stop,
            done: Some(done_rx),
        },
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn listen_address_is_read_from_the_relay_banner() {
        assert_eq!(
            listen_addr_in("relay localhost listening on wss://127.0.0.1:40123"),
            Some(SocketAddr::from(([127, 0, 0, 1], 40123)))
        );
        assert_eq!(listen_addr_in("admin (metrics, health) on http://x"), None);
    }

    #[test]
    fn admin_address_is_read_from_the_relay_banner() {
        assert_eq!(
            admin_addr_in("admin (metrics, health) on http://127.0.0.2:9443/metrics"),
            Some(SocketAddr::from(([127, 0, 0, 2], 9443)))
        );
        assert_eq!(
            admin_addr_in("relay localhost listening on wss://127.0.0.1:1"),
            None
        );
    }

    #[test]
    fn metrics_and_redis_replies_are_parsed() {
        let page = "# HELP oab_fleet_nodes x\n# TYPE oab_fleet_nodes gauge\noab_fleet_nodes 2\n\
                    oab_fleet_nodes_other 5\n";
        assert_eq!(metric_value(page, "oab_fleet_nodes"), Some(2.0));
        assert_eq!(metric_value(page, "oab_missing"), None);
        assert_eq!(parse_resp(b"$5\r\nab").unwrap(), None);
        assert_eq!(
            parse_resp(b"$2\r\nab\r\n").unwrap(),
            Some((Resp::Text("ab".into()), 8))
        );
        assert!(parse_resp(b"-ERR no\r\n").is_err());
        let numsub = b"*4\r\n$3\r\nch1\r\n:1\r\n$3\r\nch2\r\n:0\r\n";
        assert_eq!(
            parse_resp(numsub).unwrap(),
            Some((
                Resp::Array(vec![
                    Resp::Text("ch1".into()),
                    Resp::Int(1),
                    Resp::Text("ch2".into()),
                    Resp::Int(0)
                ]),
                numsub.len()
            ))
        );
        assert_eq!(parse_resp(&numsub[..numsub.len() - 3]).unwrap(), None);
        assert_eq!(parse_resp(b"$-1\r\n").unwrap(), Some((Resp::Nil, 5)));
    }

    #[test]
    fn rss_is_read_from_proc_status() {
        assert!(rss_of("/proc/self/status").is_some_and(|b| b > 0));
        assert_eq!(rss_of("/nonexistent/status"), None);
    }
}
