//! The relay under test: the `oab-relay` binary as a child process (the
//! default: the relay gets its own process, its memory can be read from
//! `/proc/<pid>/status`, and `perf record -p <pid>` profiles it alone), or
//! `oab_relay::run` on its own runtime in this process. Either way with the
//! memory store or a Redis store on a `redis-server` the harness starts.
//!
//! Dropping a [`RelayUnderTest`] kills the child process (SIGKILL) or stops
//! the in-process relay, and kills its `redis-server`: a run leaves nothing
//! behind, also when it is interrupted.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, bail};
use oab_relay::raw_client::Target;
use oab_relay::store::{MemoryStore, RedisStore};
use oab_relay::testing::{Persistence, RedisServer};
use serde::Serialize;
use tokio::io::AsyncBufReadExt as _;
use tokio_util::sync::CancellationToken;

use crate::setup::{RELAY_ID, Setup};

/// How long a relay child process may take to print its listen address.
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// How often [`RelayUnderTest::kill_and_restart`] retries a start that
/// failed (the port not yet released by the killed process).
const RESTART_ATTEMPTS: u32 = 40;

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
    /// Append-only file, fsync every second (what production should run).
    Aof,
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
    cert_der: Vec<u8>,
    store: StoreKind,
    store_url: String,
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
        let (addr, running) = match mode {
            RelayMode::Process(bin) => start_process(setup, bin, &store_url, None).await?,
            RelayMode::InProcess => start_in_process(setup, store, &store_url, None).await?,
        };
        Ok(RelayUnderTest {
            addr,
            cert_der: setup.cert_der.clone(),
            store,
            store_url,
            running,
            _redis: redis,
        })
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
        // The old listener is gone once the process is reaped; a rebind can
        // still race the kernel's cleanup, so retry briefly.
        let mut attempt = 0u32;
        let (addr, running) = loop {
            let started = match mode {
                RelayMode::Process(bin) => {
                    start_process(setup, bin, &self.store_url, Some(self.addr)).await
                }
                RelayMode::InProcess => {
                    start_in_process(setup, self.store, &self.store_url, Some(self.addr)).await
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
        if addr != self.addr {
            bail!("the restarted relay listens on {addr}, not {}", self.addr);
        }
        self.running = running;
        Ok(())
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

/// `VmRSS` from a `/proc/.../status` file, in bytes.
pub fn rss_of(status_path: &str) -> Option<u64> {
    let text = std::fs::read_to_string(status_path).ok()?;
    let line = text.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

async fn start_process(
    setup: &Setup,
    bin: &Path,
    store_url: &str,
    listen: Option<SocketAddr>,
) -> anyhow::Result<(SocketAddr, Running)> {
    let stderr_log = setup
        .dir
        .path()
        .join(format!("relay-{}.log", std::process::id()));
    let stderr = std::fs::File::create(&stderr_log)
        .with_context(|| format!("creating {}", stderr_log.display()))?;
    let mut child = tokio::process::Command::new(bin)
        .arg("--config")
        .arg(&setup.config_path)
        .args(["--store", store_url])
        .args(
            listen
                .map(|a| vec!["--set".to_string(), format!("relay.listen={a}")])
                .unwrap_or_default(),
        )
        .env("OAB_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::from(stderr))
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("starting {}", bin.display()))?;
    let pid = child.id().context("the relay exited at once")?;
    let stdout = child.stdout.take().context("relay stdout")?;
    let mut lines = tokio::io::BufReader::new(stdout).lines();
    // The relay prints `relay <id> listening on wss://<addr>` once bound.
    let found = tokio::time::timeout(START_TIMEOUT, async {
        while let Ok(Some(line)) = lines.next_line().await {
            if let Some(addr) = listen_addr_in(&line) {
                return Some(addr);
            }
        }
        None
    })
    .await;
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
    Ok((addr, running))
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

async fn start_in_process(
    setup: &Setup,
    store: StoreKind,
    store_url: &str,
    listen: Option<SocketAddr>,
) -> anyhow::Result<(SocketAddr, Running)> {
    let bind_to = listen.unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], 0)));
    let std_listener = bind_reusable(bind_to).context("binding the relay")?;
    std_listener.set_nonblocking(true)?;
    let addr = std_listener.local_addr()?;
    let mut config = setup.config.clone();
    config.store.url = store_url.to_string();
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
                let retention = config.retention();
                let result = match store {
                    StoreKind::Memory => {
                        let _ = started_tx.send(Ok(()));
                        let store = Arc::new(MemoryStore::new(retention));
                        oab_relay::run(listener, None, config, store, Some(tls), stop2).await
                    }
                    StoreKind::Redis => match RedisStore::connect(&url, retention).await {
                        Ok(s) => {
                            let _ = started_tx.send(Ok(()));
                            oab_relay::run(listener, None, config, Arc::new(s), Some(tls), stop2)
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
    Ok((
        addr,
        Running::InProcess {
            stop,
            done: Some(done_rx),
        },
    ))
}

#[cfg(test)]
mod tests {
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
    fn rss_is_read_from_proc_status() {
        assert!(rss_of("/proc/self/status").is_some_and(|b| b > 0));
        assert_eq!(rss_of("/nonexistent/status"), None);
    }
}
