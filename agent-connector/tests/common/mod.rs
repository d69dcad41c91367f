//! Harness: a real relay over TLS on loopback (memory or a real redis-server),
//! and connectors for a caller and a callee with keys made at test time.
#![allow(
    dead_code,
    unreachable_pub,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic
)]

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use oab_connector::authority::{CapabilitySet, Grant, Policy};
use oab_connector::callee::{CalleeOptions, Execution, StopReason, TaskExecutor, TaskRun};
use oab_connector::link::LinkSettings;
use oab_connector::profile::{Budgets, ParentContext, RiskLevel, Task};
use oab_connector::trust::RelayTrust;
use oab_connector::{Connector, ConnectorOptions, NewDelegation};
use oab_relay::config::Config;
use oab_relay::store::EventStore;
use oab_wire::identity::{Identity, PeerKey};
use oab_wire::{InstanceId, KeyId, PeerId};
use tokio_util::sync::CancellationToken;

pub const CALLER: &str = "acme/caller";
pub const CALLEE: &str = "acme/callee";
/// The peer id of [`Env::with_second_caller`]'s second caller.
pub const SECOND_CALLER: &str = "acme/caller-two";

pub fn peer(s: &str) -> PeerId {
    PeerId::new(s).unwrap()
}

pub fn key_of(id: &Identity) -> PeerKey {
    PeerKey {
        key_id: id.key_id.clone(),
        public_key: id.public_key(),
        not_before_ms: None,
        not_after_ms: None,
    }
}

pub struct Env {
    pub caller: Identity,
    pub callee: Identity,
    /// A second caller with its own route to the callee
    /// ([`Env::with_second_caller`]).
    pub caller2: Option<Identity>,
    pub cert_der: Vec<u8>,
    /// The relay certificate (PEM), for a relay process.
    pub cert_pem: String,
    /// The relay certificate's private key (PEM), for a relay process.
    pub key_pem: String,
    /// The relay config as TOML (what `config` was parsed from).
    pub config_text: String,
    pub config: Config,
    pub tls: Arc<rustls::ServerConfig>,
}

impl Env {
    pub fn new(extra: &str) -> Env {
        Self::build(extra, false)
    }

    /// An environment with [`SECOND_CALLER`] too, routed to the callee.
    pub fn with_second_caller(extra: &str) -> Env {
        Self::build(extra, true)
    }

    fn build(extra: &str, second_caller: bool) -> Env {
        oab_relay::tls::install_crypto_provider();
        let ss = oab_relay::tls::self_signed(&["localhost"]).unwrap();
        let k = KeyId::new("k1").unwrap();
        let caller = Identity::generate(peer(CALLER), k.clone());
        let callee = Identity::generate(peer(CALLEE), k.clone());
        let caller2 = second_caller.then(|| Identity::generate(peer(SECOND_CALLER), k));
        let mut text = String::from(
            "[relay]\nid = \"localhost\"\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:1\"\n\
             tls_cert = \"unused\"\ntls_key = \"unused\"\n",
        );
        text.push_str(extra);
        text.push('\n');
        for id in [Some(&caller), Some(&callee), caller2.as_ref()]
            .into_iter()
            .flatten()
        {
            text.push_str(&format!(
                "[[peers]]\nid = \"{}\"\nkeys = [{{ key_id = \"k1\", public_key = \"{}\" }}]\n",
                id.peer,
                id.public_key()
            ));
        }
        text.push_str(&format!(
            "[[routes]]\nfrom = \"{CALLER}\"\nto = \"{CALLEE}\"\nceiling = [\"read:*\", \"write:*\"]\n"
        ));
        if caller2.is_some() {
            text.push_str(&format!(
                "[[routes]]\nfrom = \"{SECOND_CALLER}\"\nto = \"{CALLEE}\"\nceiling = [\"read:*\"]\n"
            ));
        }
        let config = Config::from_toml_with_overrides(&text, "test", &[]).unwrap();
        let certs = vec![rustls::pki_types::CertificateDer::from(ss.cert_der.clone())];
        let key: rustls::pki_types::PrivateKeyDer<'static> =
            rustls::pki_types::pem::PemObject::from_pem_slice(ss.key_pem.as_bytes()).unwrap();
        let tls = oab_relay::tls::server_config(certs, key).unwrap();
        Env {
            caller,
            callee,
            caller2,
            cert_der: ss.cert_der,
            cert_pem: ss.cert_pem,
            key_pem: ss.key_pem,
            config_text: text,
            config,
            tls,
        }
    }

    pub fn trust(&self) -> HashMap<PeerId, Vec<PeerKey>> {
        [
            Some(&self.caller),
            Some(&self.callee),
            self.caller2.as_ref(),
        ]
        .into_iter()
        .flatten()
        .map(|i| (i.peer.clone(), vec![key_of(i)]))
        .collect()
    }
}

pub struct Relay {
    pub addr: std::net::SocketAddr,
    pub shutdown: CancellationToken,
    pub task: tokio::task::JoinHandle<()>,
}

impl Relay {
    pub async fn start<S: EventStore>(env: &Env, store: Arc<S>) -> Relay {
        Self::start_on(env, store, "127.0.0.1:0").await
    }

    pub async fn start_on<S: EventStore>(env: &Env, store: Arc<S>, addr: &str) -> Relay {
        let listener = tokio::net::TcpListener::bind(addr).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let shutdown = CancellationToken::new();
        let (config, tls, stop) = (
            Arc::new(env.config.clone()),
            Some(env.tls.clone()),
            shutdown.clone(),
        );
        let task = tokio::spawn(async move {
            oab_relay::run(listener, None, config, store, tls, stop)
                .await
                .unwrap();
        });
        Relay {
            addr,
            shutdown,
            task,
        }
    }

    pub async fn stop(self) {
        self.shutdown.cancel();
        let _ = self.task.await;
    }
}

/// A relay on a Redis store in a runtime of its own, which [`Crashable::crash`]
/// drops at once: no drain, no goodbye, every socket closed and every task
/// gone, as when the process is killed (its presence, liveness and leases in
/// Redis stay behind and lapse).
pub struct Crashable {
    pub addr: std::net::SocketAddr,
    rt: Option<tokio::runtime::Runtime>,
}

impl Crashable {
    pub fn start(env: &Env, redis_url: &str) -> Crashable {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let addr = listener.local_addr().unwrap();
        let (config, tls, url) = (
            Arc::new(env.config.clone()),
            Some(env.tls.clone()),
            redis_url.to_string(),
        );
        rt.spawn(async move {
            let listener = tokio::net::TcpListener::from_std(listener).unwrap();
            let store =
                oab_relay::store::RedisStore::connect(&url, oab_relay::store::Retention::default())
                    .await
                    .unwrap();
            let _ = oab_relay::run(
                listener,
                None,
                config,
                Arc::new(store),
                tls,
                CancellationToken::new(),
            )
            .await;
        });
        Crashable { addr, rt: Some(rt) }
    }

    pub fn crash(&mut self) {
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

impl Drop for Crashable {
    fn drop(&mut self) {
        self.crash();
    }
}

pub fn budgets(n: u64) -> Budgets {
    Budgets {
        tokens: n,
        cost_micros: n,
        risk: RiskLevel::Medium,
        output_bytes: n,
    }
}

pub fn policy() -> Policy {
    Policy {
        allowed_capabilities: CapabilitySet::parse(["read:*", "run:tests"]).unwrap(),
        allow_writes: false,
        max_depth: 1,
        budgets: budgets(1_000_000),
        max_deadline_ms: 3_600_000,
    }
}

pub fn settings(id: &Identity, relay: std::net::SocketAddr, cert_der: &[u8]) -> LinkSettings {
    let mut s = LinkSettings::new(
        format!("wss://localhost:{}/", relay.port()),
        RelayTrust::Ca(vec![rustls::pki_types::CertificateDer::from(
            cert_der.to_vec(),
        )]),
        id.clone(),
    );
    s.backoff_initial = Duration::from_millis(20);
    s.backoff_max = Duration::from_millis(500);
    s
}

/// A connector for `id`, optionally with a callee executor.
pub fn connector(
    env: &Env,
    id: &Identity,
    relay: std::net::SocketAddr,
    executor: Option<Arc<dyn TaskExecutor>>,
) -> Connector {
    connector_with(env, settings(id, relay, &env.cert_der), executor)
}

pub fn connector_with(
    env: &Env,
    link: LinkSettings,
    executor: Option<Arc<dyn TaskExecutor>>,
) -> Connector {
    connector_full(env, link, executor, policy(), None)
}

/// A connector with an explicit caller policy and audit sink.
pub fn connector_full(
    env: &Env,
    link: LinkSettings,
    executor: Option<Arc<dyn TaskExecutor>>,
    caller_policy: Policy,
    audit: Option<Arc<dyn oab_connector::audit::AuditSink>>,
) -> Connector {
    connector_state(env, link, executor, caller_policy, audit, None)
}

/// A connector with everything explicit, including a caller state folder.
pub fn connector_state(
    env: &Env,
    link: LinkSettings,
    executor: Option<Arc<dyn TaskExecutor>>,
    caller_policy: Policy,
    audit: Option<Arc<dyn oab_connector::audit::AuditSink>>,
    state: Option<oab_connector::state::FileState>,
) -> Connector {
    Connector::start(ConnectorOptions {
        link,
        trust: env.trust(),
        grant: Grant {
            capabilities: CapabilitySet::parse(["read:*", "run:tests", "write:*", "deploy:*"])
                .unwrap(),
            remaining: budgets(10_000_000),
        },
        caller_policy,
        callee: executor.map(|executor| CalleeOptions {
            executor,
            policy: Arc::new(policy()),
            max_concurrent: 512,
            max_concurrent_per_peer: 512,
            max_live_requests_per_peer: oab_connector::nonce::NonceCache::DEFAULT_PER_CALLER,
            replay_window_ms: oab_connector::nonce::NonceCache::DEFAULT_MAX_AGE_MS,
        }),
        audit,
        state,
    })
    .unwrap()
}

pub fn spec(text: &str) -> NewDelegation {
    NewDelegation {
        request_id: None,
        task: Task {
            text: text.to_string(),
            context: Default::default(),
            a2a_message: None,
        },
        capabilities: vec!["read:repo".into()],
        read_only: true,
        deadline: Duration::from_secs(60),
        budgets: budgets(1000),
        parent: ParentContext {
            agent: "agent-a".into(),
            trace_id: "trace-1".into(),
            execution_id: None,
        },
    }
}

pub fn instance() -> InstanceId {
    InstanceId::random()
}

/// An executor that streams `n` status events, pausing `pause` before each
/// like real work, then completes. With a gate, it waits after event
/// `gate_after` until the gate is opened (so a fault lands mid-stream).
pub struct Paced {
    pub n: u64,
    pub pause: Duration,
    pub gate_after: u64,
    pub gate: Arc<tokio::sync::Notify>,
    pub runs: AtomicUsize,
}

impl Paced {
    pub fn new(n: u64, pause: Duration) -> Arc<Paced> {
        Self::gated(n, pause, u64::MAX)
    }

    /// Waits for [`Paced::open_gate`] after event `after`.
    pub fn gated(n: u64, pause: Duration, after: u64) -> Arc<Paced> {
        Arc::new(Paced {
            n,
            pause,
            gate_after: after,
            gate: Arc::new(tokio::sync::Notify::new()),
            runs: AtomicUsize::new(0),
        })
    }

    pub fn open_gate(&self) {
        self.gate.notify_one();
    }

    pub fn runs(&self) -> usize {
        self.runs.load(Ordering::SeqCst)
    }
}

impl TaskExecutor for Paced {
    fn execute(
        &self,
        run: TaskRun,
    ) -> Pin<Box<dyn std::future::Future<Output = Execution> + Send>> {
        self.runs.fetch_add(1, Ordering::SeqCst);
        let (n, pause, after, gate) = (self.n, self.pause, self.gate_after, self.gate.clone());
        Box::pin(async move {
            for i in 1..=n {
                if i == after.saturating_add(1) {
                    gate.notified().await;
                }
                tokio::select! {
                    () = run.cancel.cancelled() => return Execution::stopped(StopReason::Cancelled),
                    () = tokio::time::sleep(pause) => {}
                }
                if run
                    .sink
                    .status(
                        "TASK_STATE_WORKING",
                        None,
                        Some(serde_json::json!({ "i": i })),
                    )
                    .await
                    .is_err()
                {
                    return Execution::stopped(StopReason::Error("link stopped".into()));
                }
            }
            Execution::stopped(StopReason::EndTurn)
        })
    }
}

/// The `oab-relay` binary in this profile's target folder (a test runs from
/// its `deps/` subfolder). It is not a binary of this crate: `cargo test
/// --workspace` builds it; running one of these tests alone needs `cargo
/// build [--release] -p oab-relay` first.
pub fn relay_bin() -> std::path::PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent()
        .and_then(|deps| deps.parent())
        .map(|profile| profile.join("oab-relay"))
        .filter(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!("no oab-relay binary next to {exe:?}: run `cargo build [--release] -p oab-relay` first")
        })
}

/// An `oab-relay` process (the real binary, [`relay_bin`]) on a Redis
/// store, with `env`'s config, certificate and key in a folder of its own.
/// [`RelayProcess::kill`] is `kill -9`; [`RelayProcess::restart`] starts it
/// again with the same config on the same address. Killed when dropped.
pub struct RelayProcess {
    pub addr: std::net::SocketAddr,
    child: Option<tokio::process::Child>,
    redis_url: String,
    dir: tempfile::TempDir,
}

impl RelayProcess {
    /// Starts the relay on a port the OS picks; returns once it listens.
    pub async fn start(env: &Env, redis_url: &str) -> RelayProcess {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("relay.toml"), &env.config_text).unwrap();
        std::fs::write(dir.path().join("cert.pem"), &env.cert_pem).unwrap();
        // Mode 0600: the relay refuses a key file other users can read.
        oab_relay::tls::write_file(&dir.path().join("key.pem"), &env.key_pem, true).unwrap();
        let mut relay = RelayProcess {
            addr: "127.0.0.1:0".parse().unwrap(),
            child: None,
            redis_url: redis_url.to_string(),
            dir,
        };
        let (child, addr) = relay.spawn().await.unwrap_or_else(|log| {
            panic!("the relay did not listen; its log:\n{log}");
        });
        relay.child = Some(child);
        relay.addr = addr;
        relay
    }

    /// What the relay wrote to stderr so far (every run of it).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("relay.log")).unwrap_or_default()
    }

    /// SIGKILL: no drain, no close frames; returns once it has exited.
    pub async fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            child.kill().await.unwrap();
        }
    }

    /// Starts the relay again with the same config and store on the same
    /// address, retrying while the address is not yet free.
    pub async fn restart(&mut self) {
        assert!(self.child.is_none(), "restart a relay that is running");
        let until = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            match self.spawn().await {
                Ok((child, addr)) => {
                    assert_eq!(addr, self.addr);
                    self.child = Some(child);
                    return;
                }
                Err(log) => assert!(
                    tokio::time::Instant::now() < until,
                    "the relay did not listen on {} again; its log:\n{log}",
                    self.addr
                ),
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// One relay process on `self.addr` and its address once it says it
    /// listens, or its log when it exits (or stays silent) first.
    async fn spawn(&self) -> Result<(tokio::process::Child, std::net::SocketAddr), String> {
        use tokio::io::AsyncBufReadExt as _;
        let dir = self.dir.path();
        let log = dir.join("relay.log");
        let mut child = tokio::process::Command::new(relay_bin())
            .arg("--config")
            .arg(dir.join("relay.toml"))
            .args(["--store", &self.redis_url])
            .arg("--listen")
            .arg(self.addr.to_string())
            .args(["--admin-listen", "127.0.0.2:0"])
            .arg("--set")
            .arg(format!("relay.tls_cert={}", dir.join("cert.pem").display()))
            .arg("--set")
            .arg(format!("relay.tls_key={}", dir.join("key.pem").display()))
            .env(
                "OAB_LOG",
                std::env::var("OAB_LOG").unwrap_or_else(|_| "warn".into()),
            )
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&log)
                    .unwrap(),
            )
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
        let addr = tokio::time::timeout(Duration::from_secs(30), async {
            while let Ok(Some(line)) = lines.next_line().await {
                if let Some((_, a)) = line.split_once("listening on wss://") {
                    return a.trim().parse::<std::net::SocketAddr>().ok();
                }
            }
            None
        })
        .await
        .ok()
        .flatten();
        match addr {
            Some(addr) => {
                // Keep reading its stdout so it never blocks on a full pipe.
                tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
                Ok((child, addr))
            }
            None => {
                let _ = child.kill().await;
                Err(std::fs::read_to_string(&log).unwrap_or_default())
            }
        }
    }
}
