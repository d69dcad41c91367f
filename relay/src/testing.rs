//! Test harness pieces shared by this crate's tests and other crates' tests.
//!
//! [`RedisServer`] runs a real `redis-server` as a child process: in its own
//! temporary directory, on a unix socket only (`--port 0`, so parallel tests
//! never race for a TCP port), with no RDB snapshots and the persistence the
//! test asks for. It can be killed with SIGKILL and restarted on the same
//! directory and socket, which is how the tests simulate a crash (with AOF the
//! data comes back; without it the store's epoch changes).

use std::fmt;
use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// How often readiness is probed while `redis-server` starts.
const READY_POLL_INTERVAL: Duration = Duration::from_millis(5);
/// Probes before giving up: 2,000 x 5 ms = 10 s, far above the ~10 ms a
/// start takes (and enough to reload a test-sized AOF on a loaded machine).
const READY_POLL_ATTEMPTS: u32 = 2_000;
/// Per-probe socket timeout, so a wedged server cannot hang a test.
const PROBE_TIMEOUT: Duration = Duration::from_millis(500);
/// The server binary, looked up on PATH.
const REDIS_SERVER: &str = "redis-server";

/// What `redis-server` persists.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Persistence {
    /// Nothing (`--appendonly no`): a restart loses every key.
    None,
    /// Append-only file fsynced every second (`--appendonly yes
    /// --appendfsync everysec`): a restart reloads the data.
    Aof,
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
        let appendonly = match self.persistence {
            Persistence::None => "no",
            Persistence::Aof => "yes",
        };
        let mut cmd = Command::new(self.binary);
        cmd.arg("--port")
            .arg("0")
            .arg("--unixsocket")
            .arg(&socket)
            .arg("--unixsocketperm")
            .arg("700")
            .arg("--dir")
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
            .arg("everysec")
            .arg("--maxmemory-policy")
            .arg("noeviction")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Err(HarnessError::NotInstalled);
            }
            Err(e) => return Err(e.into()),
        };
        self.child = Some(child);
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
        let log = std::fs::read(self.dir.path().join("redis.log")).unwrap_or_default();
        let start = log.len().saturating_sub(4096);
        String::from_utf8_lossy(log.get(start..).unwrap_or_default()).into_owned()
    }
}

/// One readiness probe: `PING` over the socket answered by `+PONG`.
fn ping(socket: &Path) -> bool {
    let probe = || -> io::Result<bool> {
        let mut s = UnixStream::connect(socket)?;
        s.set_read_timeout(Some(PROBE_TIMEOUT))?;
        s.set_write_timeout(Some(PROBE_TIMEOUT))?;
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
    };
    probe().unwrap_or(false)
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        // The TempDir field then removes the directory.
        let _ = self.kill();
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
}
