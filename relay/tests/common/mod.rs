//! Harness for relay integration tests: a real relay on 127.0.0.1:0 with a
//! certificate and identities generated at test time, and raw clients.
#![allow(
    dead_code,
    unreachable_pub,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic
)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use oab_relay::config::Config;
use oab_relay::store::EventStore;
use oab_testkit::raw_client::{RawClient, Target};
use oab_wire::identity::{Identity, PeerKey};
use oab_wire::{
    Data, DelegationKey, Digest, Direction, ErrorCode, Frame, InstanceId, KeyId, Open, Outcome,
    PeerId, RequestId,
};
use tokio_util::sync::CancellationToken;

pub const CALLER: &str = "acme/caller";
pub const CALLEE: &str = "acme/callee";
pub const OTHER: &str = "acme/other";

/// Identities, certificate and config for one test.
pub struct TestEnv {
    pub caller: Identity,
    pub callee: Identity,
    pub other: Identity,
    pub cert_der: Vec<u8>,
    pub config: Config,
    pub tls: Arc<rustls::ServerConfig>,
    /// The config file (with real certificate paths) for running the binary.
    pub config_path: std::path::PathBuf,
    pub dir: tempfile::TempDir,
}

pub fn peer(s: &str) -> PeerId {
    PeerId::new(s).unwrap()
}

impl TestEnv {
    /// Peers caller, callee, other; one route caller -> callee. `extra` is
    /// appended to the generated TOML (e.g. `[lifecycle]` settings).
    pub fn new(extra: &str) -> TestEnv {
        oab_relay::tls::install_crypto_provider();
        let dir = tempfile::tempdir().unwrap();
        let ss = oab_relay::tls::self_signed(&["localhost"]).unwrap();
        let key = KeyId::new("k1").unwrap();
        let caller = Identity::generate(peer(CALLER), key.clone());
        let callee = Identity::generate(peer(CALLEE), key.clone());
        let other = Identity::generate(peer(OTHER), key);
        let cert_path = dir.path().join("cert.pem");
        let key_path = dir.path().join("key.pem");
        std::fs::write(&cert_path, &ss.cert_pem).unwrap();
        // Mode 0600: the relay refuses a key file other users can read.
        oab_relay::tls::write_file(&key_path, &ss.key_pem, true).unwrap();
        let mut text = format!(
            "[relay]\nid = \"localhost\"\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:1\"\n\
             tls_cert = \"{}\"\ntls_key = \"{}\"\n",
            cert_path.display(),
            key_path.display()
        );
        text.push_str(extra);
        text.push('\n');
        for id in [&caller, &callee] {
            let pk = PeerKey {
                key_id: id.key_id.clone(),
                public_key: id.public_key(),
                not_before_ms: None,
                not_after_ms: None,
            };
            text.push_str(&format!(
                "[[peers]]\nid = \"{}\"\nkeys = [{{ key_id = \"{}\", public_key = \"{}\" }}]\n",
                id.peer, pk.key_id, pk.public_key
            ));
        }
        // `other` is configured too, but has no route.
        text.push_str(&format!(
            "[[peers]]\nid = \"{}\"\nkeys = [{{ key_id = \"k1\", public_key = \"{}\" }}]\n",
            other.peer,
            other.public_key()
        ));
        text.push_str(&format!(
            "[[routes]]\nfrom = \"{CALLER}\"\nto = \"{CALLEE}\"\n"
        ));
        let config = Config::from_toml_with_overrides(&text, "test", &[]).unwrap();
        let config_path = dir.path().join("relay.toml");
        std::fs::write(&config_path, &text).unwrap();
        let certs = vec![rustls::pki_types::CertificateDer::from(ss.cert_der.clone())];
        let key_der = rustls::pki_types::PrivateKeyDer::try_from(
            rustls::pki_types::pem::PemObject::from_pem_slice(ss.key_pem.as_bytes())
                .map(|k: rustls::pki_types::PrivateKeyDer<'static>| k.clone_key())
                .unwrap()
                .secret_der()
                .to_vec(),
        )
        .unwrap();
        let tls = oab_relay::tls::server_config(certs, key_der).unwrap();
        TestEnv {
            caller,
            callee,
            other,
            cert_der: ss.cert_der,
            config,
            tls,
            config_path,
            dir,
        }
    }
}

/// A relay running in this process.
pub struct TestRelay {
    pub addr: SocketAddr,
    pub admin: SocketAddr,
    pub shutdown: CancellationToken,
    pub task: tokio::task::JoinHandle<()>,
    pub cert_der: Vec<u8>,
}

impl TestRelay {
    pub async fn start<S: EventStore>(env: &TestEnv, store: Arc<S>) -> TestRelay {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let admin = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let (addr, admin_addr) = (listener.local_addr().unwrap(), admin.local_addr().unwrap());
        let shutdown = CancellationToken::new();
        let config = Arc::new(env.config.clone());
        let tls = Some(env.tls.clone());
        let stop = shutdown.clone();
        let task = tokio::spawn(async move {
            oab_relay::run(listener, Some(admin), config, store, tls, stop)
                .await
                .unwrap();
        });
        TestRelay {
            addr,
            admin: admin_addr,
            shutdown,
            task,
            cert_der: env.cert_der.clone(),
        }
    }

    pub fn target(&self) -> Target {
        Target {
            addr: self.addr.to_string(),
            server_name: Some("localhost".into()),
            root_der: self.cert_der.clone(),
        }
    }

    pub async fn client(&self, id: &Identity) -> RawClient {
        RawClient::connect(&self.target(), id, InstanceId::random())
            .await
            .unwrap()
    }

    pub async fn client_as(&self, id: &Identity, instance: InstanceId) -> RawClient {
        RawClient::connect(&self.target(), id, instance)
            .await
            .unwrap()
    }

    pub async fn stop(self) {
        self.shutdown.cancel();
        let _ = self.task.await;
    }

    pub async fn metrics(&self) -> String {
        http_get(self.admin, "/metrics").await
    }
}

/// A minimal HTTP/1.0 GET over TCP (no client crate needed).
pub async fn http_get(addr: SocketAddr, path: &str) -> String {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    out
}

pub fn key(request: &str) -> DelegationKey {
    DelegationKey::new(peer(CALLER), RequestId::new(request).unwrap())
}

pub fn open_frame(request: &str, payload: &'static [u8]) -> Frame {
    Frame::Open(Open {
        key: key(request),
        target: peer(CALLEE),
        deadline_ms: oab_wire::identity::now_ms() + 60_000,
        depth: 1,
        digest: Digest::of(payload),
        ceiling: String::new(),
        trace: None,
        payload: Bytes::from_static(payload),
    })
}

pub fn data(
    request: &str,
    dir: Direction,
    seq: u64,
    terminal: Option<Outcome>,
    payload: Bytes,
) -> Frame {
    Frame::Data(Data {
        key: key(request),
        direction: dir,
        seq,
        terminal,
        flags: 0,
        payload,
    })
}

/// Receives with a generous bound so a broken relay fails the test instead
/// of hanging it (not a timing assertion).
pub async fn recv(c: &mut RawClient) -> Frame {
    tokio::time::timeout(Duration::from_secs(20), c.recv())
        .await
        .expect("no frame within 20 s")
        .expect("connection failed")
}

/// Receives frames until one matches, returning it (other frames are skipped).
pub async fn recv_until<T>(c: &mut RawClient, mut f: impl FnMut(&Frame) -> Option<T>) -> T {
    loop {
        let frame = recv(c).await;
        if let Some(t) = f(&frame) {
            return t;
        }
    }
}

/// Waits for a cumulative ack of at least `seq`.
pub async fn await_ack(c: &mut RawClient, request: &str, dir: Direction, seq: u64) {
    let k = key(request);
    recv_until(c, |f| match f {
        Frame::Ack(a) if a.key == k && a.direction == dir && a.seq >= seq => Some(()),
        Frame::Error(e) => panic!("error frame: {e:?}"),
        _ => None,
    })
    .await
}

pub fn payload(i: u64) -> Bytes {
    Bytes::from(format!("event {i}"))
}

/// Reads frames until the connection fails; returns the last contiguous data
/// seq seen (checking order) and the highest up ack.
pub async fn drain_until_broken(
    c: &mut RawClient,
    request: &str,
    mut last_data: u64,
    mut last_ack: u64,
) -> (u64, u64) {
    let k = key(request);
    loop {
        match tokio::time::timeout(Duration::from_secs(20), c.recv())
            .await
            .expect("relay gone")
        {
            Ok(Frame::Data(d)) if d.key == k => {
                assert_eq!(d.seq, last_data + 1, "in order, exactly once");
                last_data = d.seq;
            }
            Ok(Frame::Ack(a)) if a.key == k && a.direction == Direction::Up => {
                last_ack = last_ack.max(a.seq)
            }
            Ok(_) => {}
            Err(_) => return (last_data, last_ack),
        }
    }
}

/// Sends `acked+1..=to` (the last one a terminal when `finish`) until all are acked,
/// resending after `store_unavailable` errors.
pub async fn send_until_acked(
    b: &mut RawClient,
    request: &str,
    mut acked: u64,
    to: u64,
    finish: bool,
) -> u64 {
    let k = key(request);
    while acked < to {
        for seq in acked + 1..=to {
            let terminal = (finish && seq == to).then_some(Outcome::Completed);
            b.feed(&data(request, Direction::Up, seq, terminal, payload(seq)))
                .await
                .unwrap();
        }
        b.flush().await.unwrap();
        // Read until everything is acked or a refusal says to resend.
        loop {
            match recv(b).await {
                Frame::Ack(a) if a.key == k && a.direction == Direction::Up => {
                    acked = acked.max(a.seq);
                    if acked >= to {
                        break;
                    }
                }
                Frame::Error(e) if e.code == ErrorCode::StoreUnavailable.as_u16() => {
                    // Drain the rest of this round's refusals, then resend.
                    tokio::task::yield_now().await;
                    break;
                }
                Frame::Error(e) if e.code == ErrorCode::SequenceGap.as_u16() => {
                    acked = acked.max(e.seq);
                    break;
                }
                Frame::Error(e) => panic!("unexpected {e:?}"),
                _ => {}
            }
        }
    }
    acked
}

pub async fn read_to_terminal(a: &mut RawClient, request: &str, mut last: u64, terminal_seq: u64) {
    let k = key(request);
    while last < terminal_seq {
        if let Frame::Data(d) = recv(a).await
            && d.key == k
        {
            assert_eq!(d.seq, last + 1, "no loss, duplicate or reordering");
            assert_eq!(d.payload, payload(d.seq));
            assert_eq!(d.terminal.is_some(), d.seq == terminal_seq);
            last = d.seq;
        }
    }
}

/// `a` opens `request` for `b`; once `b` has the open, `b` pipelines up
/// events `1..=sent` (payload [`payload`]) and waits for an ack of at least
/// `acked`.
pub async fn open_and_stream_up(
    a: &mut RawClient,
    b: &mut RawClient,
    request: &str,
    sent: u64,
    acked: u64,
) {
    a.send(&open_frame(request, b"{}")).await.unwrap();
    await_ack(a, request, Direction::Down, 1).await;
    recv_until(b, |f| matches!(f, Frame::Open(_)).then_some(())).await;
    for seq in 1..=sent {
        b.feed(&data(request, Direction::Up, seq, None, payload(seq)))
            .await
            .unwrap();
    }
    b.flush().await.unwrap();
    await_ack(b, request, Direction::Up, acked).await;
}

/// A free loopback port (bound, then released).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The `oab-relay` binary as a child process, killable with SIGKILL.
pub struct RelayProcess {
    pub addr: SocketAddr,
    pub admin: SocketAddr,
    config: std::path::PathBuf,
    store: String,
    sets: Vec<String>,
    child: Option<std::process::Child>,
    pub cert_der: Vec<u8>,
}

impl RelayProcess {
    pub async fn start(env: &TestEnv, store_url: &str) -> RelayProcess {
        Self::start_with(env, store_url, &[]).await
    }

    /// With extra `--set field=value` overrides.
    pub async fn start_with(env: &TestEnv, store_url: &str, sets: &[&str]) -> RelayProcess {
        let mut p = RelayProcess {
            addr: SocketAddr::from(([127, 0, 0, 1], free_port())),
            admin: SocketAddr::from(([127, 0, 0, 1], free_port())),
            config: env.config_path.clone(),
            store: store_url.to_string(),
            sets: sets.iter().map(|s| s.to_string()).collect(),
            child: None,
            cert_der: env.cert_der.clone(),
        };
        p.spawn().await;
        p
    }

    async fn spawn(&mut self) {
        let child = std::process::Command::new(env!("CARGO_BIN_EXE_oab-relay"))
            .arg("--config")
            .arg(&self.config)
            .args(["--listen", &self.addr.to_string()])
            .args(["--admin-listen", &self.admin.to_string()])
            .args(["--store", &self.store])
            .args(["--set", "lifecycle.sweep_interval_ms=20"])
            .args(self.sets.iter().flat_map(|s| ["--set", s.as_str()]))
            // `OAB_TEST_RELAY_LOG=oab_relay=debug` shows what the relay
            // processes of a failing test did (their log goes to stderr).
            .env(
                "OAB_LOG",
                std::env::var("OAB_TEST_RELAY_LOG").unwrap_or_else(|_| "warn".into()),
            )
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap();
        self.child = Some(child);
        // Ready when the admin endpoint answers (bounded number of attempts).
        for _ in 0..500 {
            if tokio::net::TcpStream::connect(self.admin).await.is_ok()
                && tokio::net::TcpStream::connect(self.addr).await.is_ok()
            {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!("relay process did not start listening");
    }

    /// SIGKILL, no drain.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    pub async fn restart(&mut self) {
        self.kill();
        self.spawn().await;
    }

    pub fn target(&self) -> Target {
        Target {
            addr: self.addr.to_string(),
            server_name: Some("localhost".into()),
            root_der: self.cert_der.clone(),
        }
    }

    pub async fn client_as(&self, id: &Identity, instance: InstanceId) -> RawClient {
        RawClient::connect(&self.target(), id, instance)
            .await
            .unwrap()
    }

    pub async fn metrics(&self) -> String {
        http_get(self.admin, "/metrics").await
    }

    /// The value of an unlabelled metric (0 if absent).
    pub async fn metric(&self, name: &str) -> f64 {
        metric_value(&self.metrics().await, name)
    }

    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    /// The process's resident memory in bytes (Linux: `VmRSS` of
    /// `/proc/<pid>/status`), if it runs.
    pub fn rss_bytes(&self) -> Option<u64> {
        let pid = self.child.as_ref()?.id();
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
        let kib: u64 = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))?
            .trim()
            .trim_end_matches("kB")
            .trim()
            .parse()
            .ok()?;
        Some(kib * 1024)
    }

    /// Sends SIGHUP (reload the configuration file).
    pub fn sighup(&self) {
        let c = self.child.as_ref().expect("running");
        let status = std::process::Command::new("kill")
            .args(["-HUP", &c.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
    }

    /// Polls `/metrics` until the unlabelled metric `name` equals `value`
    /// (bounded: a relay that never gets there fails the test).
    pub async fn await_metric(&self, name: &str, value: f64) {
        for _ in 0..500 {
            if self.metric(name).await == value {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!("{name} never became {value}: {}", self.metric(name).await);
    }

    /// SIGTERM (a clean shutdown: drain, then leave the fleet), and waits
    /// for the process to exit.
    pub fn terminate(&mut self) {
        if let Some(mut c) = self.child.take() {
            let status = std::process::Command::new("kill")
                .args(["-TERM", &c.id().to_string()])
                .status()
                .unwrap();
            assert!(status.success());
            let _ = c.wait();
        }
    }
}

/// A minimal HTTP/1.0 POST with an empty body; returns the status code and
/// the body.
pub async fn http_post(addr: SocketAddr, path: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(format!("POST {path} HTTP/1.0\r\nHost: x\r\nContent-Length: 0\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    let status = out
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = out
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (status, body)
}

/// The value of an unlabelled metric in a Prometheus text page (0 if absent).
pub fn metric_value(page: &str, name: &str) -> f64 {
    page.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| {
            let (n, v) = l.split_once(' ')?;
            (n == name).then(|| v.trim().parse().ok()).flatten()
        })
        .unwrap_or(0.0)
}

impl Drop for RelayProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Runs each scenario `async fn(Arc<S>)` against the memory store and against
/// a real redis-server (one per test).
#[allow(unused_macros)]
macro_rules! both_stores {
    ($($name:ident => $body:ident;)*) => {
        mod memory {
            use super::*;
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                $body(::std::sync::Arc::new(::oab_relay::store::MemoryStore::new(
                    ::oab_relay::store::Retention::default(),
                )))
                .await;
            })*
        }
        mod redis {
            use super::*;
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                let server = ::oab_testkit::redis::RedisServer::start(
                    ::oab_testkit::redis::Persistence::None,
                )
                .unwrap();
                let store = ::oab_relay::store::RedisStore::connect(
                    &server.url(),
                    ::oab_relay::store::Retention::default(),
                )
                .await
                .unwrap();
                $body(::std::sync::Arc::new(store)).await;
                drop(server);
            })*
        }
    };
}
#[allow(unused_imports)]
pub(crate) use both_stores;

/// The `oab-relay` binary as a child process with its log (stderr) in a
/// file, for tests that check what it logs.
pub struct LoggedRelay {
    child: Option<std::process::Child>,
    pub addr: SocketAddr,
    pub admin: SocketAddr,
    pub log: std::path::PathBuf,
}

impl LoggedRelay {
    /// Starts it on free ports with `store_url`, the `--set` overrides
    /// `sets` and the log filter `log_filter` (`OAB_LOG`), and waits until
    /// its admin listener accepts connections.
    pub async fn start(
        env: &TestEnv,
        store_url: &str,
        sets: &[&str],
        log_filter: &str,
    ) -> LoggedRelay {
        let addr = SocketAddr::from(([127, 0, 0, 1], free_port()));
        let admin = SocketAddr::from(([127, 0, 0, 1], free_port()));
        let log = env.dir.path().join(format!("relay-{}.log", addr.port()));
        let child = std::process::Command::new(env!("CARGO_BIN_EXE_oab-relay"))
            .arg("--config")
            .arg(&env.config_path)
            .args(["--listen", &addr.to_string()])
            .args(["--admin-listen", &admin.to_string()])
            .args(["--store", store_url])
            .args(sets.iter().flat_map(|s| ["--set", *s]))
            .env("OAB_LOG", log_filter)
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn();
        let relay = LoggedRelay {
            child: Some(child.unwrap()),
            addr,
            admin,
            log,
        };
        for _ in 0..500 {
            if tokio::net::TcpStream::connect(admin).await.is_ok() {
                return relay;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!("relay did not start:\n{}", relay.log());
    }

    /// What it has logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Where its sessions connect (its test certificate trusted).
    pub fn target(&self, env: &TestEnv) -> Target {
        Target {
            addr: self.addr.to_string(),
            server_name: Some("localhost".into()),
            root_der: env.cert_der.clone(),
        }
    }

    /// Polls its log until a line has every one of `parts` (at most 20 s);
    /// returns that line.
    pub async fn await_line(&self, parts: &[&str]) -> String {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            let log = self.log();
            if let Some(line) = log.lines().find(|l| parts.iter().all(|p| l.contains(p))) {
                return line.to_string();
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "no line with {parts:?} in the relay's log:\n{log}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// SIGTERM, and waits (at most 20 s) for the process to exit.
    pub async fn terminate(&mut self) {
        let Some(mut c) = self.child.take() else {
            return;
        };
        let status = std::process::Command::new("kill")
            .args(["-TERM", &c.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        while c.try_wait().unwrap().is_none() {
            assert!(
                tokio::time::Instant::now() < deadline,
                "relay did not exit on SIGTERM"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for LoggedRelay {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}
