//! A real `redis-server` (and Redis Cluster) for tests and benchmarks.
//!
//! [`RedisServer`] runs a real `redis-server` as a child process: in its own
//! temporary directory, on a unix socket only (`--port 0`, so parallel tests
//! never race for a TCP port), with no RDB snapshots and the persistence the
//! test asks for. It can be killed with SIGKILL and restarted on the same
//! directory and socket, which is how the tests simulate a crash (with AOF the
//! data comes back; without it the store's epoch changes).
//!
//! [`RedisCluster`] runs a three-master Redis Cluster the same way: three
//! `redis-server` processes with `--cluster-enabled yes`, on free TCP ports
//! of 127.0.0.1 (a cluster cannot run on unix sockets: its nodes and clients
//! find each other by address), each in its own temporary directory with
//! AOF. The harness assigns the slots and introduces the nodes itself, with
//! `CLUSTER ADDSLOTSRANGE` and `CLUSTER MEET` (no `redis-cli` needed), then
//! waits until every node reports the cluster ok.
//!
//! Never: leaves a `redis-server` running after its handle is dropped, and
//! never takes a fixed sleep for readiness: it polls (`PING`, `CLUSTER INFO`) a
//! bounded number of times and reports the server's log when it gives up.

use std::fmt;
use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How often readiness is probed while `redis-server` starts.
const READY_POLL_INTERVAL: Duration = Duration::from_millis(5);
/// Probes before giving up: 2,000 x 5 ms = 10 s, far above the ~10 ms a
/// start takes (and enough to reload a test-sized AOF on a loaded machine).
const READY_POLL_ATTEMPTS: u32 = 2_000;
/// Per-probe socket timeout, so a wedged server cannot hang a test.
const PROBE_TIMEOUT: Duration = Duration::from_millis(500);
/// The server binary, looked up on PATH.
const REDIS_SERVER: &str = "redis-server";
/// Masters of a [`RedisCluster`].
const CLUSTER_MASTERS: u16 = 3;
/// Hash slots of a Redis Cluster.
const CLUSTER_SLOTS: u16 = 16_384;
/// Starts of a cluster node on fresh ports when the ones picked were taken
/// by another process between the probe and `redis-server`'s bind.
const PORT_ATTEMPTS: u32 = 5;
/// How often the cluster state is polled while it forms.
const CLUSTER_POLL_INTERVAL: Duration = Duration::from_millis(20);
/// Polls before giving up: 1,000 x 20 ms = 20 s. A master reports the
/// cluster ok no sooner than 2 s after it started (Redis waits that long
/// before accepting writes as a new master), so ~2.1 s is usual.
const CLUSTER_POLL_ATTEMPTS: u32 = 1_000;

/// What `redis-server` persists.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Persistence {
    /// Nothing (`--appendonly no`): a restart loses every key.
    None,
    /// Append-only file fsynced every second (`--appendonly yes
    /// --appendfsync everysec`): a restart reloads the data. A SIGKILL may
    /// still lose what Redis acknowledged in its last two seconds: while a
    /// background fsync is slow, Redis postpones its AOF writes and answers
    /// all the same.
    Aof,
    /// Append-only file fsynced before every answer (`--appendfsync
    /// always`): nothing acknowledged is lost to a SIGKILL.
    AofAlways,
}

/// Why the harness could not run `redis-server`.
#[derive(Debug, thiserror::Error)]
pub enum HarnessError {
    /// The binary is missing.
    #[error(
        "redis-server is not on PATH: install it (the project's scripts/test installs it; \
         on Debian/Ubuntu: apt-get install redis-server)"
    )]
    NotInstalled,
    /// Spawning, killing or the temporary directory failed.
    #[error("redis-server harness I/O error: {0}")]
    Io(#[from] io::Error),
    /// It exited before it answered PING.
    #[error("redis-server exited during startup ({status}); its log:\n{log}")]
    Exited {
        /// The exit status.
        status: String,
        /// The end of its log file.
        log: String,
    },
    /// It did not answer PING in time.
    #[error("redis-server did not answer PING after {attempts} attempts; its log:\n{log}")]
    NotReady {
        /// How many probes were made.
        attempts: u32,
        /// The end of its log file.
        log: String,
    },
    /// A command the harness sent to a cluster node failed.
    #[error("redis-server on port {port}: {command} failed: {error}; its log:\n{log}")]
    Command {
        /// The node's port.
        port: u16,
        /// The command, without its arguments' values where they are long.
        command: String,
        /// What the node or the connection said.
        error: String,
        /// The end of the node's log file.
        log: String,
    },
    /// The cluster did not reach `cluster_state:ok` on every node in time.
    #[error(
        "the Redis cluster did not form after {attempts} attempts; last CLUSTER INFO \
         per node:\n{info}\nthe node logs:\n{logs}"
    )]
    ClusterNotReady {
        /// How many polls were made.
        attempts: u32,
        /// The last `CLUSTER INFO` state lines of each node.
        info: String,
        /// The end of each node's log file.
        logs: String,
    },
}

/// A `redis-server` child process for tests. Dropping it kills the process
/// and removes its directory.
pub struct RedisServer {
    binary: &'static str,
    dir: tempfile::TempDir,
    persistence: Persistence,
    child: Option<Child>,
}

impl fmt::Debug for RedisServer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisServer")
            .field("dir", &self.dir.path())
            .field("persistence", &self.persistence)
            .field("pid", &self.child.as_ref().map(Child::id))
            .finish()
    }
}

impl RedisServer {
    /// Starts a server and waits until it answers PING.
    pub fn start(persistence: Persistence) -> Result<RedisServer, HarnessError> {
        Self::start_binary(REDIS_SERVER, persistence)
    }

    fn start_binary(
        binary: &'static str,
        persistence: Persistence,
    ) -> Result<RedisServer, HarnessError> {
        // A short prefix keeps the socket path far below the 108-byte limit.
        let dir = tempfile::Builder::new().prefix("oab-redis-").tempdir()?;
        let mut server = RedisServer {
            binary,
            dir,
            persistence,
            child: None,
        };
        server.spawn()?;
        Ok(server)
    }

    /// The server's directory (its log is `redis.log` there).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The unix socket path.
    pub fn socket_path(&self) -> PathBuf {
        self.dir.path().join("redis.sock")
    }

    /// The URL to connect to: `redis+unix:///<dir>/redis.sock`.
    pub fn url(&self) -> String {
        format!("redis+unix://{}", self.socket_path().display())
    }

    /// The persistence it was started with.
    pub fn persistence(&self) -> Persistence {
        self.persistence
    }

    /// Whether the process is running (not killed).
    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    /// Kills the process with SIGKILL (no shutdown save, like a crash) and
    /// reaps it. Does nothing if it is not running.
    pub fn kill(&mut self) -> io::Result<()> {
        if let Some(mut child) = self.child.take() {
            // `Child::kill` sends SIGKILL on unix. It fails only if the
            // process was already reaped, which `wait` then reports.
            let _ = child.kill();
            child.wait()?;
        }
        Ok(())
    }

    /// Stops the process with SIGTERM, as an operator's service manager
    /// does: Redis finishes the command it runs, writes and syncs its AOF,
    /// and exits. Waits for the exit (bounded by `timeout`; SIGKILL after
    /// it) and returns whether it exited cleanly in time. Does nothing if it
    /// is not running.
    pub fn stop(&mut self, timeout: Duration) -> io::Result<bool> {
        let Some(mut child) = self.child.take() else {
            return Ok(true);
        };
        let status = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status()?;
        if !status.success() {
            let _ = child.kill();
            child.wait()?;
            return Ok(false);
        }
        let until = Instant::now() + timeout;
        loop {
            if let Some(exit) = child.try_wait()? {
                return Ok(exit.success());
            }
            if Instant::now() >= until {
                let _ = child.kill();
                child.wait()?;
                return Ok(false);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Starts the server again on the same directory and socket (killing it
    /// first if it still runs), so an AOF is reloaded, and waits until it
    /// answers PING.
    pub fn restart(&mut self) -> Result<(), HarnessError> {
        self.kill()?;
        self.spawn()
    }

    fn spawn(&mut self) -> Result<(), HarnessError> {
        let dir = self.dir.path();
        let socket = self.socket_path();
        // A stale socket from a killed server would only refuse connections,
        // but removing it makes "connects" mean "the new server is up".
        match std::fs::remove_file(&socket) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e.into()),
        }
        let (appendonly, fsync) = match self.persistence {
            Persistence::None => ("no", "everysec"),
            Persistence::Aof => ("yes", "everysec"),
            Persistence::AofAlways => ("yes", "always"),
        };
        let mut cmd = Command::new(self.binary);
        cmd.arg("--port")
            .arg("0")
            .arg("--unixsocket")
            .arg(&socket)
            .arg("--unixsocketperm")
            .arg("700");
        self.child = Some(spawn_server(cmd, dir, appendonly, fsync)?);
        match self.wait_ready() {
            Ok(()) => Ok(()),
            Err(e) => {
                let _ = self.kill();
                Err(e)
            }
        }
    }

    /// Polls until the server answers PING with PONG (not `-LOADING` while an
    /// AOF is reloaded), or it exits, or the attempts run out.
    fn wait_ready(&mut self) -> Result<(), HarnessError> {
        let socket = self.socket_path();
        for _ in 0..READY_POLL_ATTEMPTS {
            if let Some(child) = self.child.as_mut()
                && let Some(status) = child.try_wait()?
            {
                self.child = None;
                return Err(HarnessError::Exited {
                    status: status.to_string(),
                    log: self.log_tail(),
                });
            }
            if ping(&socket) {
                return Ok(());
            }
            std::thread::sleep(READY_POLL_INTERVAL);
        }
        Err(HarnessError::NotReady {
            attempts: READY_POLL_ATTEMPTS,
            log: self.log_tail(),
        })
    }

    /// The last few KiB of the server log, for error messages.
    fn log_tail(&self) -> String {
        log_tail(self.dir.path())
    }
}

/// The last few KiB of `<dir>/redis.log`, for error messages.
fn log_tail(dir: &Path) -> String {
    let log = std::fs::read(dir.join("redis.log")).unwrap_or_default();
    let start = log.len().saturating_sub(4096);
    String::from_utf8_lossy(log.get(start..).unwrap_or_default()).into_owned()
}

/// One readiness probe: `PING` over the socket answered by `+PONG`.
fn ping(socket: &Path) -> bool {
    let probe = || -> io::Result<bool> {
        let mut s = UnixStream::connect(socket)?;
        s.set_read_timeout(Some(PROBE_TIMEOUT))?;
        s.set_write_timeout(Some(PROBE_TIMEOUT))?;
        answers_pong(&mut s)
    };
    probe().unwrap_or(false)
}

/// One readiness probe over TCP on 127.0.0.1.
fn ping_tcp(port: u16) -> bool {
    let probe = || -> io::Result<bool> {
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
        let mut s = TcpStream::connect_timeout(&addr, PROBE_TIMEOUT)?;
        s.set_read_timeout(Some(PROBE_TIMEOUT))?;
        s.set_write_timeout(Some(PROBE_TIMEOUT))?;
        answers_pong(&mut s)
    };
    probe().unwrap_or(false)
}

/// Sends an inline `PING` and checks the reply is `+PONG`.
fn answers_pong(s: &mut (impl Read + Write)) -> io::Result<bool> {
    s.write_all(b"PING\r\n")?;
    let mut buf = [0u8; 64];
    let mut got = 0;
    while got < buf.len() {
        let Some(rest) = buf.get_mut(got..) else {
            break;
        };
        let n = s.read(rest)?;
        if n == 0 {
            break;
        }
        got += n;
        if buf.get(..got).is_some_and(|b| b.ends_with(b"\r\n")) {
            break;
        }
    }
    Ok(buf.get(..got).is_some_and(|b| b.starts_with(b"+PONG")))
}

/// Adds the settings every test server shares (its directory and log, no
/// RDB snapshots, AOF on or off with the given fsync policy, `noeviction`) and
/// starts it.
fn spawn_server(
    mut cmd: Command,
    dir: &Path,
    appendonly: &str,
    fsync: &str,
) -> Result<Child, HarnessError> {
    cmd.arg("--dir")
        .arg(dir)
        .arg("--logfile")
        .arg(dir.join("redis.log"))
        .arg("--daemonize")
        .arg("no")
        .arg("--save")
        .arg("")
        .arg("--appendonly")
        .arg(appendonly)
        .arg("--appendfsync")
        .arg(fsync)
        .arg("--maxmemory-policy")
        .arg("noeviction")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    match cmd.spawn() {
        Ok(c) => Ok(c),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Err(HarnessError::NotInstalled),
        Err(e) => Err(e.into()),
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        // The TempDir field then removes the directory.
        let _ = self.kill();
    }
}

/// Two distinct free TCP ports on 127.0.0.1 (both bound at once, then
/// released): a node's client port and its cluster bus port.
fn free_port_pair() -> io::Result<(u16, u16)> {
    let a = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
    let b = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
    Ok((a.local_addr()?.port(), b.local_addr()?.port()))
}

/// One `redis-server --cluster-enabled yes` of a [`RedisCluster`].
struct ClusterNode {
    dir: tempfile::TempDir,
    port: u16,
    bus_port: u16,
    child: Option<Child>,
}

impl ClusterNode {
    /// Creates its directory and starts it on free ports, on fresh ones when
    /// it exits during startup (a port taken meanwhile by another process).
    fn start() -> Result<ClusterNode, HarnessError> {
        let dir = tempfile::Builder::new().prefix("oab-rc-").tempdir()?;
        let mut node = ClusterNode {
            dir,
            port: 0,
            bus_port: 0,
            child: None,
        };
        let mut attempt = 1;
        loop {
            (node.port, node.bus_port) = free_port_pair()?;
            match node.spawn() {
                Err(HarnessError::Exited { .. }) if attempt < PORT_ATTEMPTS => attempt += 1,
                other => return other.map(|()| node),
            }
        }
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Starts the process on its ports and directory (its `nodes-<port>.conf`
    /// and AOF are reloaded on a restart) and waits until it answers PING.
    fn spawn(&mut self) -> Result<(), HarnessError> {
        let dir = self.dir.path();
        let mut cmd = Command::new(REDIS_SERVER);
        cmd.arg("--port")
            .arg(self.port.to_string())
            .arg("--bind")
            .arg("127.0.0.1")
            .arg("--cluster-enabled")
            .arg("yes")
            .arg("--cluster-port")
            .arg(self.bus_port.to_string())
            .arg("--cluster-config-file")
            .arg(dir.join(format!("nodes-{}.conf", self.port)))
            .arg("--cluster-announce-ip")
            .arg("127.0.0.1");
        self.child = Some(spawn_server(cmd, dir, "yes", "everysec")?);
        match self.wait_ready() {
            Ok(()) => Ok(()),
            Err(e) => {
                let _ = self.kill();
                Err(e)
            }
        }
    }

    /// Polls until it answers PING, or exits, or the attempts run out.
    fn wait_ready(&mut self) -> Result<(), HarnessError> {
        for _ in 0..READY_POLL_ATTEMPTS {
            self.check_running()?;
            if ping_tcp(self.port) {
                return Ok(());
            }
            std::thread::sleep(READY_POLL_INTERVAL);
        }
        Err(HarnessError::NotReady {
            attempts: READY_POLL_ATTEMPTS,
            log: log_tail(self.dir.path()),
        })
    }

    /// `Exited` if the process it started has exited.
    fn check_running(&mut self) -> Result<(), HarnessError> {
        if let Some(child) = self.child.as_mut()
            && let Some(status) = child.try_wait()?
        {
            self.child = None;
            return Err(HarnessError::Exited {
                status: status.to_string(),
                log: log_tail(self.dir.path()),
            });
        }
        Ok(())
    }

    /// Sends `signal` (`-STOP`, `-CONT`) with `kill(1)`; an error if it is
    /// not running.
    fn signal(&mut self, signal: &str) -> io::Result<()> {
        let pid = self
            .child
            .as_ref()
            .map(Child::id)
            .ok_or_else(|| io::Error::other(format!("node {} is not running", self.port)))?;
        let status = Command::new("kill")
            .arg(signal)
            .arg(pid.to_string())
            .status()?;
        if status.success() {
            Ok(())
        } else {
            Err(io::Error::other(format!("kill {signal} {pid}: {status}")))
        }
    }

    /// SIGKILL and reap; nothing if it is not running.
    fn kill(&mut self) -> io::Result<()> {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            child.wait()?;
        }
        Ok(())
    }

    /// Sends one command on a fresh connection (bounded by the probe
    /// timeout); `what` names it in errors.
    fn command<T: redis::FromRedisValue>(
        &self,
        what: &str,
        cmd: &redis::Cmd,
    ) -> Result<T, HarnessError> {
        let run = || -> redis::RedisResult<T> {
            let client = redis::Client::open(self.url())?;
            let mut conn = client.get_connection_with_timeout(PROBE_TIMEOUT)?;
            conn.set_read_timeout(Some(PROBE_TIMEOUT))?;
            conn.set_write_timeout(Some(PROBE_TIMEOUT))?;
            cmd.query(&mut conn)
        };
        run().map_err(|e| HarnessError::Command {
            port: self.port,
            command: what.to_owned(),
            error: e.to_string(),
            log: log_tail(self.dir.path()),
        })
    }
}

impl Drop for ClusterNode {
    fn drop(&mut self) {
        // The TempDir field then removes the directory.
        let _ = self.kill();
    }
}

/// Whether a `CLUSTER INFO` reply says the node sees the whole cluster:
/// state ok, every slot served, and all masters known.
fn cluster_formed(info: &str) -> bool {
    let field = |name: &str| {
        info.lines().find_map(|line| {
            line.trim_end()
                .strip_prefix(name)
                .and_then(|rest| rest.strip_prefix(':'))
        })
    };
    let masters = CLUSTER_MASTERS.to_string();
    field("cluster_state") == Some("ok")
        && field("cluster_slots_ok") == Some(CLUSTER_SLOTS.to_string().as_str())
        && field("cluster_known_nodes") == Some(masters.as_str())
        && field("cluster_size") == Some(masters.as_str())
}

/// A three-master Redis Cluster for tests, every node a `redis-server`
/// child process on 127.0.0.1 with AOF (`appendfsync everysec`) and no RDB
/// snapshots. The slots are split in three equal ranges, one per node, in
/// node order. Dropping it kills the processes and removes their
/// directories.
pub struct RedisCluster {
    nodes: Vec<ClusterNode>,
}

impl fmt::Debug for RedisCluster {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list()
            .entries(self.nodes.iter().map(|n| {
                (
                    n.port,
                    n.dir.path().to_path_buf(),
                    n.child.as_ref().map(Child::id),
                )
            }))
            .finish()
    }
}

impl RedisCluster {
    /// Starts the three nodes, assigns the slots, joins the nodes and waits
    /// until every node reports `cluster_state:ok` with all slots served and
    /// three masters known (about 2 s: see `CLUSTER_POLL_ATTEMPTS`).
    pub fn start() -> Result<RedisCluster, HarnessError> {
        let mut cluster = RedisCluster {
            nodes: Vec::with_capacity(CLUSTER_MASTERS.into()),
        };
        for _ in 0..CLUSTER_MASTERS {
            cluster.nodes.push(ClusterNode::start()?);
        }
        let per_node = CLUSTER_SLOTS / CLUSTER_MASTERS;
        for (i, node) in (0..CLUSTER_MASTERS).zip(&cluster.nodes) {
            let first = i * per_node;
            let last = if i + 1 == CLUSTER_MASTERS {
                CLUSTER_SLOTS - 1
            } else {
                first + per_node - 1
            };
            // Distinct config epochs, as `redis-cli --cluster create` sets
            // them, so the nodes need not resolve a collision first.
            node.command::<()>(
                "CLUSTER SET-CONFIG-EPOCH",
                redis::cmd("CLUSTER").arg("SET-CONFIG-EPOCH").arg(i + 1),
            )?;
            node.command::<()>(
                "CLUSTER ADDSLOTSRANGE",
                redis::cmd("CLUSTER")
                    .arg("ADDSLOTSRANGE")
                    .arg(first)
                    .arg(last),
            )?;
        }
        if let Some((first, others)) = cluster.nodes.split_first() {
            for node in others {
                node.command::<()>(
                    "CLUSTER MEET",
                    redis::cmd("CLUSTER")
                        .arg("MEET")
                        .arg("127.0.0.1")
                        .arg(first.port)
                        .arg(first.bus_port),
                )?;
            }
        }
        cluster.wait_formed()?;
        Ok(cluster)
    }

    /// The URL for `oab_relay::store::RedisStore::connect`:
    /// `redis-cluster://127.0.0.1:<p1>,127.0.0.1:<p2>,127.0.0.1:<p3>`.
    pub fn url(&self) -> String {
        let seeds: Vec<String> = self
            .nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        format!("redis-cluster://{}", seeds.join(","))
    }

    /// Each node's own URL, `redis://127.0.0.1:<port>`, in node order (node
    /// `i` serves the `i`th third of the slots).
    pub fn node_urls(&self) -> Vec<String> {
        self.nodes.iter().map(ClusterNode::url).collect()
    }

    /// Node `i`'s directory (its log is `redis.log` there).
    pub fn node_dir(&self, i: usize) -> Option<&Path> {
        self.nodes.get(i).map(|n| n.dir.path())
    }

    /// Whether node `i` is running (not killed).
    pub fn is_node_running(&self, i: usize) -> bool {
        self.nodes.get(i).is_some_and(|n| n.child.is_some())
    }

    /// `FLUSHALL` on every node: an empty cluster for the next test. The
    /// scripts stay loaded.
    pub fn flush_all(&self) -> Result<(), HarnessError> {
        for node in &self.nodes {
            node.command::<()>("FLUSHALL", &redis::cmd("FLUSHALL"))?;
        }
        Ok(())
    }

    /// Kills node `i` with SIGKILL (a crash) and reaps it. Its slots are
    /// unreachable until [`restart_node`](Self::restart_node); the other
    /// nodes mark it failed only after the cluster node timeout (15 s).
    ///
    /// What the node acknowledged survives only if it reached its AOF:
    /// with `appendfsync everysec` Redis may hold the AOF write back for up
    /// to 2 s while a background fsync is slow, acknowledging all the same.
    /// Call [`wait_aof_written`](Self::wait_aof_written) first when the
    /// test expects acknowledged writes back.
    pub fn kill_node(&mut self, i: usize) -> io::Result<()> {
        self.node_mut(i)?.kill()
    }

    /// Stops node `i` with SIGSTOP: it keeps its sockets (the kernel still
    /// accepts connections) but answers nothing until
    /// [`resume_node`](Self::resume_node). A hung node, as opposed to a dead one.
    pub fn pause_node(&mut self, i: usize) -> io::Result<()> {
        self.node_mut(i)?.signal("-STOP")
    }

    /// Continues node `i` after [`pause_node`](Self::pause_node) (SIGCONT).
    pub fn resume_node(&mut self, i: usize) -> io::Result<()> {
        self.node_mut(i)?.signal("-CONT")
    }

    /// Waits until node `i` has written everything it acknowledged to its
    /// AOF (`aof_buffer_length:0`), so a SIGKILL loses none of it (the
    /// kernel keeps what was written).
    pub fn wait_aof_written(&self, i: usize) -> Result<(), HarnessError> {
        let node = self.nodes.get(i).ok_or_else(|| {
            io::Error::new(io::ErrorKind::InvalidInput, format!("no cluster node {i}"))
        })?;
        for _ in 0..READY_POLL_ATTEMPTS {
            let info: String =
                node.command("INFO persistence", redis::cmd("INFO").arg("persistence"))?;
            if info.lines().any(|l| l.trim_end() == "aof_buffer_length:0") {
                return Ok(());
            }
            std::thread::sleep(READY_POLL_INTERVAL);
        }
        Err(HarnessError::Command {
            port: node.port,
            command: "INFO persistence".to_owned(),
            error: format!("aof_buffer_length not 0 after {READY_POLL_ATTEMPTS} polls"),
            log: log_tail(node.dir.path()),
        })
    }

    /// Starts node `i` again on its ports and directory (killing it first if
    /// it still runs): it reloads its AOF and its cluster configuration,
    /// rejoins, and this waits until every node reports the cluster ok again
    /// (about 2 s, as at start).
    pub fn restart_node(&mut self, i: usize) -> Result<(), HarnessError> {
        let node = self.node_mut(i)?;
        node.kill()?;
        node.spawn()?;
        self.wait_formed()
    }

    fn node_mut(&mut self, i: usize) -> io::Result<&mut ClusterNode> {
        let count = self.nodes.len();
        self.nodes.get_mut(i).ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("no cluster node {i} (there are {count})"),
            )
        })
    }

    /// Polls `CLUSTER INFO` on every node until all see the whole cluster,
    /// a node exits, or the attempts run out.
    fn wait_formed(&mut self) -> Result<(), HarnessError> {
        let mut last = Vec::new();
        for _ in 0..CLUSTER_POLL_ATTEMPTS {
            last.clear();
            let mut formed = true;
            for node in &mut self.nodes {
                node.check_running()?;
                let info = node
                    .command::<String>("CLUSTER INFO", redis::cmd("CLUSTER").arg("INFO"))
                    .unwrap_or_else(|e| e.to_string());
                formed &= cluster_formed(&info);
                let state: Vec<&str> = info
                    .lines()
                    .filter(|l| {
                        l.starts_with("cluster_state")
                            || l.starts_with("cluster_slots_ok")
                            || l.starts_with("cluster_known_nodes")
                            || l.starts_with("cluster_size")
                    })
                    .map(str::trim_end)
                    .collect();
                last.push(format!("port {}: {}", node.port, state.join(" ")));
            }
            if formed {
                return Ok(());
            }
            std::thread::sleep(CLUSTER_POLL_INTERVAL);
        }
        Err(HarnessError::ClusterNotReady {
            attempts: CLUSTER_POLL_ATTEMPTS,
            info: last.join("\n"),
            logs: self
                .nodes
                .iter()
                .map(|n| format!("--- port {} ---\n{}", n.port, log_tail(n.dir.path())))
                .collect::<Vec<_>>()
                .join("\n"),
        })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::panic)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_binary_says_how_to_install_it() {
        match RedisServer::start_binary("oab-test-no-such-redis-server", Persistence::None) {
            Err(e @ HarnessError::NotInstalled) => {
                let msg = e.to_string();
                assert!(msg.contains("install"), "{msg}");
                assert!(msg.contains("scripts/test"), "{msg}");
            }
            other => panic!("expected NotInstalled, got {other:?}"),
        }
    }

    #[test]
    fn starts_answers_and_cleans_up() {
        let mut server = RedisServer::start(Persistence::None).unwrap();
        let dir = server.dir().to_path_buf();
        assert!(server.url().starts_with("redis+unix:///"));
        assert!(ping(&server.socket_path()));
        server.kill().unwrap();
        assert!(!server.is_running());
        assert!(!ping(&server.socket_path()));
        server.restart().unwrap();
        assert!(ping(&server.socket_path()));
        drop(server);
        assert!(!dir.exists(), "the directory is removed on drop");
    }

    #[test]
    fn cluster_info_parsing() {
        let ok = "cluster_state:ok\r\ncluster_slots_assigned:16384\r\ncluster_slots_ok:16384\r\n\
                  cluster_known_nodes:3\r\ncluster_size:3\r\n";
        assert!(cluster_formed(ok));
        assert!(!cluster_formed(
            &ok.replace("cluster_state:ok", "cluster_state:fail")
        ));
        assert!(!cluster_formed(
            &ok.replace("cluster_size:3", "cluster_size:2")
        ));
        assert!(!cluster_formed(
            &ok.replace("known_nodes:3", "known_nodes:2")
        ));
        assert!(!cluster_formed(""));
    }

    #[test]
    fn cluster_forms_survives_a_node_restart_and_cleans_up() {
        let mut cluster = RedisCluster::start().unwrap();
        let urls = cluster.node_urls();
        assert_eq!(urls.len(), 3);
        let url = cluster.url();
        assert_eq!(
            url,
            format!(
                "redis-cluster://{}",
                urls.iter()
                    .map(|u| u.trim_start_matches("redis://"))
                    .collect::<Vec<_>>()
                    .join(",")
            )
        );
        let dirs: Vec<PathBuf> = (0..3)
            .map(|i| cluster.node_dir(i).unwrap().to_path_buf())
            .collect();
        // Every node serves its third of the slots and sees the others.
        for (i, node) in cluster.nodes.iter().enumerate() {
            let slots: redis::Value = node
                .command("CLUSTER SLOTS", redis::cmd("CLUSTER").arg("SLOTS"))
                .unwrap();
            let redis::Value::Array(ranges) = slots else {
                panic!("node {i}: CLUSTER SLOTS: {slots:?}");
            };
            assert_eq!(ranges.len(), 3, "node {i}");
        }
        // "foo" is in slot 12182, the last third: node 2. What it acknowledged
        // survives a SIGKILL (the AOF is written before the reply; the kernel
        // keeps it) and the node rejoins the cluster.
        let set = cluster.nodes[2].command::<()>("SET", redis::cmd("SET").arg("foo").arg("bar"));
        set.unwrap();
        cluster.wait_aof_written(2).unwrap();
        cluster.kill_node(2).unwrap();
        assert!(!cluster.is_node_running(2));
        assert!(!ping_tcp(cluster.nodes[2].port));
        cluster.restart_node(2).unwrap();
        assert!(cluster.is_node_running(2));
        let got: String = cluster.nodes[2]
            .command("GET", redis::cmd("GET").arg("foo"))
            .unwrap();
        assert_eq!(got, "bar");
        assert!(cluster.kill_node(7).is_err());
        drop(cluster);
        for dir in dirs {
            assert!(!dir.exists(), "{} is removed on drop", dir.display());
        }
    }
}
