//! A connector as its own OS process: the `oab-connector` binary, run with a
//! configuration this module writes (`oab-connector run --config ...`), as
//! it runs beside an OAB host. Its memory is its own (`/proc/<pid>/status`)
//! and its `connector.state_dir` is a folder of the run, so a scenario can
//! watch both over a long run.
//!
//! The configuration is the example in `deploy/connector/connector.toml`
//! with the run's relay, certificate, identities and loopback addresses.
//! Dropping a [`ConnectorProcess`] kills the child (SIGKILL).

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;

use anyhow::Context as _;
use oab_wire::identity::Identity;

use crate::relay::rss_of;
use crate::setup::{RELAY_ID, Setup};

/// Finds the `oab-connector` binary: `explicit` if given, else next to the
/// running executable (where `cargo build` puts both).
pub fn find_connector_bin(explicit: Option<&Path>) -> Option<PathBuf> {
    if let Some(p) = explicit {
        return Some(p.to_path_buf());
    }
    let exe = std::env::current_exe().ok()?;
    let candidate = exe.parent()?.join("oab-connector");
    candidate.is_file().then_some(candidate)
}

/// What one connector process does besides holding its session.
#[derive(Debug, Clone)]
pub struct ConnectorRole {
    /// The file name prefix of its folder and log (`connector-a`).
    pub name: String,
    /// Its identity (written to a 0600 identity file).
    pub identity: Identity,
    /// The peers whose signatures it accepts.
    pub peers: Vec<Identity>,
    /// `policy.max_concurrent` and `policy.max_concurrent_per_peer`.
    pub max_concurrent: usize,
    /// `a2a.facade_listen` (caller side), a loopback address.
    pub facade_listen: Option<SocketAddr>,
    /// `a2a.driver_url` (callee side): the local A2A server.
    pub driver_url: Option<String>,
    /// `a2a.default_timeout_ms`: the deadline of the delegations the
    /// facade starts.
    pub default_timeout_ms: u64,
}

/// A running `oab-connector run` child.
#[derive(Debug)]
pub struct ConnectorProcess {
    child: tokio::process::Child,
    pid: u32,
    state_dir: PathBuf,
    log: PathBuf,
}

impl ConnectorProcess {
    /// Writes `role`'s identity file and configuration under `setup`'s
    /// folder and starts `bin` on it, dialing the relay at `relay`. Its log
    /// (stderr, at `setup.child_log`) goes to `<name>.log` there.
    pub fn start(
        setup: &Setup,
        bin: &Path,
        relay: SocketAddr,
        role: &ConnectorRole,
    ) -> anyhow::Result<ConnectorProcess> {
        let dir = setup.dir.path().join(&role.name);
        let state_dir = dir.join("state");
        std::fs::create_dir_all(&state_dir)
            .with_context(|| format!("creating {}", state_dir.display()))?;
        let identity_path = dir.join("identity.toml");
        // A restart on the same folder keeps the file it wrote before.
        if !identity_path.exists() {
            oab_connector::keyfile::save(&role.identity, &identity_path)
                .with_context(|| format!("writing {}", identity_path.display()))?;
        }
        let config_path = dir.join("connector.toml");
        let text = config_text(setup, relay, role, &identity_path, &state_dir);
        oab_relay::tls::write_file(&config_path, &text, false)?;
        let log = setup.dir.path().join(format!("{}.log", role.name));
        // Appended to: a restarted connector's log follows its predecessor's.
        let stderr = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .with_context(|| format!("opening {}", log.display()))?;
        let child = tokio::process::Command::new(bin)
            .arg("run")
            .arg("--config")
            .arg(&config_path)
            .env("OAB_LOG", &setup.child_log)
            .env("OAB_LOG_FORMAT", &setup.child_log_format)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(stderr))
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        let pid = child.id().context("the connector process exited at once")?;
        tracing::info!(name = %role.name, pid, "connector process started");
        Ok(ConnectorProcess {
            child,
            pid,
            state_dir,
            log,
        })
    }

    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Its resident set size, bytes (`None` once it exited).
    pub fn rss_bytes(&self) -> Option<u64> {
        rss_of(&format!("/proc/{}/status", self.pid))
    }

    /// Its `connector.state_dir`.
    pub fn state_dir(&self) -> &Path {
        &self.state_dir
    }

    /// Whether it still runs (an exit is reaped here).
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Its log file (stderr).
    pub fn log_path(&self) -> &Path {
        &self.log
    }

    /// The tail of its log, for error messages.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read(&self.log).unwrap_or_default();
        let start = text.len().saturating_sub(2048);
        String::from_utf8_lossy(text.get(start..).unwrap_or_default()).into_owned()
    }

    /// Stops it with SIGTERM (it drains: open streams end, queued events
    /// and state are written) and waits for its exit, at most `timeout`
    /// (then SIGKILL). `true`: it exited with status 0 in time.
    pub async fn terminate(mut self, timeout: std::time::Duration) -> bool {
        crate::relay::terminate(&mut self.child, self.pid, timeout).await
    }

    /// Stops it: SIGKILL, then waits for it (bounded).
    pub async fn stop(mut self) {
        let _ = self.child.start_kill();
        let _ = tokio::time::timeout(std::time::Duration::from_secs(5), self.child.wait()).await;
    }
}

/// Files and bytes under a folder, recursively (what `du` would count as
/// apparent size). A folder that cannot be read counts as empty.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct DirSize {
    /// Regular files.
    pub files: u64,
    /// Their lengths, summed.
    pub bytes: u64,
}

/// The [`DirSize`] of `dir`.
pub fn dir_size(dir: &Path) -> DirSize {
    let mut total = DirSize::default();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(d) = pending.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            match e.metadata() {
                Ok(m) if m.is_dir() => pending.push(e.path()),
                Ok(m) if m.is_file() => {
                    total.files += 1;
                    total.bytes += m.len();
                }
                _ => {}
            }
        }
    }
    total
}

fn config_text(
    setup: &Setup,
    relay: SocketAddr,
    role: &ConnectorRole,
    identity: &Path,
    state_dir: &Path,
) -> String {
    let mut text = format!(
        "# Generated by oab-loadtest for one run.\n\
         [connector]\n\
         relay_url = \"wss://localhost:{port}/\"\n\
         relay_id = \"{RELAY_ID}\"\n\
         identity = \"{identity}\"\n\
         relay_ca = \"{ca}\"\n\
         state_dir = \"{state}\"\n\n",
        port = relay.port(),
        identity = identity.display(),
        ca = setup.dir.path().join("cert.pem").display(),
        state = state_dir.display(),
    );
    for p in &role.peers {
        let _ = write!(
            text,
            "[[peers]]\nid = \"{}\"\nkeys = [{{ key_id = \"{}\", public_key = \"{}\" }}]\n\n",
            p.peer,
            p.key_id,
            p.public_key()
        );
    }
    let _ = write!(
        text,
        "[policy]\n\
         allowed_capabilities = [\"read:*\"]\n\
         allow_writes = false\n\
         max_concurrent = {n}\n\
         max_concurrent_per_peer = {n}\n\
         max_deadline_ms = 3600000\n\n\
         [a2a]\n\
         default_capabilities = [\"read:repo\"]\n\
         default_timeout_ms = {timeout}\n",
        n = role.max_concurrent,
        timeout = role.default_timeout_ms,
    );
    if let Some(addr) = role.facade_listen {
        let _ = writeln!(text, "facade_listen = \"{addr}\"");
    }
    if let Some(url) = &role.driver_url {
        let _ = writeln!(text, "driver_url = \"{url}\"");
    }
    text
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::setup::Tuning;

    #[test]
    fn generated_config_validates() {
        let setup = Setup::new(0, Tuning::default()).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let role = ConnectorRole {
            name: "connector-a".into(),
            identity: setup.caller.clone(),
            peers: vec![setup.callee.clone()],
            max_concurrent: 64,
            facade_listen: Some("127.0.0.1:7070".parse().unwrap()),
            driver_url: Some("http://127.0.0.1:9999".into()),
            default_timeout_ms: 30_000,
        };
        let text = config_text(
            &setup,
            "127.0.0.1:7443".parse().unwrap(),
            &role,
            &dir.path().join("id.toml"),
            dir.path(),
        );
        let path = dir.path().join("c.toml");
        std::fs::write(&path, text).unwrap();
        let c = oab_connector::config::ConnectorConfig::load(&path).unwrap();
        assert_eq!(c.peers.len(), 1);
        assert_eq!(c.policy.max_concurrent, 64);
        assert!(c.a2a.facade_listen.is_some() && c.a2a.driver_url.is_some());
        assert_eq!(c.a2a.default_timeout_ms, Some(30_000));
    }

    #[test]
    fn dir_size_counts_nested_files() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("sub")).unwrap();
        std::fs::write(dir.path().join("a"), b"abc").unwrap();
        std::fs::write(dir.path().join("sub/b"), b"hello").unwrap();
        assert_eq!(dir_size(dir.path()), DirSize { files: 2, bytes: 8 });
        assert_eq!(dir_size(&dir.path().join("missing")), DirSize::default());
    }
}
