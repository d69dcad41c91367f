//! An executor shaped like OpenAB's `PromptRunner`, for hosts that embed
//! `oab-connector` as a library instead of running the sidecar: run a prompt
//! under a deadline and a cancel signal, return text or an error.
//!
//! `PromptExecutor` adapts any such runner to the connector's
//! [`TaskExecutor`]: the callee runtime has already verified, authorized and
//! accepted the delegation; the runner sees only the prompt, a session key
//! (the delegation key) and the cancel signal (the caller's cancel or the
//! deadline). Its text becomes the signed result's output; its error a
//! `failed` result.
//!
//! `main` runs it end to end on loopback: a relay (in memory, TLS with a
//! certificate made at start), a callee connector serving with an echo
//! runner, and a caller connector that delegates one prompt and prints the
//! verified answer. `cargo run -p oab-connector --example prompt_runner`.
#![allow(clippy::print_stdout)]

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use oab_connector::authority::{CapabilitySet, Grant, Policy};
use oab_connector::callee::{CalleeOptions, Execution, StopReason, TaskExecutor, TaskRun};
use oab_connector::link::LinkSettings;
use oab_connector::profile::{Budgets, ParentContext, RiskLevel, Task};
use oab_connector::trust::RelayTrust;
use oab_connector::{Connector, ConnectorOptions, Identity, KeyId, NewDelegation, PeerId, PeerKey};
use tokio_util::sync::CancellationToken;

/// What one prompt produced, as OAB's runner reports it.
#[derive(Debug, Clone, Default)]
pub struct PromptOutcome {
    /// The reply text.
    pub text: String,
    /// An error that ended the turn.
    pub error: Option<String>,
}

/// The prompt-execution seam, in OAB's shape.
pub trait PromptRunner: Send + Sync + 'static {
    /// Runs `prompt` to completion in session `session_key`.
    fn run(
        &self,
        session_key: String,
        prompt: String,
    ) -> Pin<Box<dyn Future<Output = Result<PromptOutcome, String>> + Send>>;

    /// Best-effort interrupt of the turn running in `session_key`.
    fn cancel(&self, session_key: &str);

    /// Drops `session_key` and anything kept for it.
    fn discard(&self, session_key: &str);
}

/// A [`PromptRunner`] as the connector's executor.
pub struct PromptExecutor<R>(pub Arc<R>);

impl<R: PromptRunner> TaskExecutor for PromptExecutor<R> {
    fn execute(&self, run: TaskRun) -> Pin<Box<dyn Future<Output = Execution> + Send + 'static>> {
        let runner = self.0.clone();
        Box::pin(async move {
            let key = run.key.to_string();
            let turn = runner.run(key.clone(), run.request.task.text.clone());
            // The cancel token fires on the caller's cancel and at the
            // deadline (the runtime reports the latter as `expired`).
            let stop = tokio::select! {
                r = turn => match r {
                    Ok(PromptOutcome { error: Some(e), .. }) | Err(e) => {
                        Execution::stopped(StopReason::Error(e))
                    }
                    Ok(PromptOutcome { text, .. }) => Execution {
                        output: Some(serde_json::Value::String(text)),
                        ..Execution::stopped(StopReason::EndTurn)
                    },
                },
                () = run.cancel.cancelled() => {
                    runner.cancel(&key);
                    Execution::stopped(StopReason::Cancelled)
                }
            };
            runner.discard(&key);
            stop
        })
    }
}

/// A runner that answers with the prompt reversed.
struct Echo;

impl PromptRunner for Echo {
    fn run(
        &self,
        _session_key: String,
        prompt: String,
    ) -> Pin<Box<dyn Future<Output = Result<PromptOutcome, String>> + Send>> {
        Box::pin(async move {
            Ok(PromptOutcome {
                text: prompt.chars().rev().collect(),
                error: None,
            })
        })
    }

    fn cancel(&self, _session_key: &str) {}

    fn discard(&self, _session_key: &str) {}
}

fn peer_entry(id: &Identity) -> String {
    format!(
        "[[peers]]\nid = \"{}\"\nkeys = [{{ key_id = \"k1\", public_key = \"{}\" }}]\n",
        id.peer,
        id.public_key()
    )
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    oab_relay::tls::install_crypto_provider();
    let k = KeyId::new("k1")?;
    let caller = Identity::generate(PeerId::new("demo/caller")?, k.clone());
    let callee = Identity::generate(PeerId::new("demo/callee")?, k);

    // A relay on loopback with a certificate made now.
    let cert = oab_relay::tls::self_signed(&["localhost"])?;
    let text = format!(
        "[relay]\nid = \"localhost\"\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:1\"\n\
         tls_cert = \"unused\"\ntls_key = \"unused\"\n{}{}\
         [[routes]]\nfrom = \"demo/caller\"\nto = \"demo/callee\"\nceiling = [\"read:*\"]\n",
        peer_entry(&caller),
        peer_entry(&callee),
    );
    let config = Arc::new(oab_relay::config::Config::from_toml_with_overrides(
        &text,
        "example",
        &[],
    )?);
    let key: rustls::pki_types::PrivateKeyDer<'static> =
        rustls::pki_types::pem::PemObject::from_pem_slice(cert.key_pem.as_bytes())?;
    let tls = oab_relay::tls::server_config(
        vec![rustls::pki_types::CertificateDer::from(
            cert.cert_der.clone(),
        )],
        key,
    )?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let stop = CancellationToken::new();
    let store = Arc::new(oab_relay::store::MemoryStore::new(
        oab_relay::store::Retention::default(),
    ));
    let relay = tokio::spawn(oab_relay::run(
        listener,
        None,
        config,
        store,
        Some(tls),
        stop.clone(),
    ));

    let budgets = Budgets {
        tokens: 10_000,
        cost_micros: 10_000,
        risk: RiskLevel::Low,
        output_bytes: 100_000,
    };
    let policy = Policy {
        allowed_capabilities: CapabilitySet::parse(["read:*"])?,
        allow_writes: false,
        max_depth: 1,
        budgets,
        max_deadline_ms: 600_000,
    };
    let trust: std::collections::HashMap<_, _> = [&caller, &callee]
        .into_iter()
        .map(|i| {
            let key = PeerKey {
                key_id: i.key_id.clone(),
                public_key: i.public_key(),
                not_before_ms: None,
                not_after_ms: None,
            };
            (i.peer.clone(), vec![key])
        })
        .collect();
    let start = |id: &Identity, executor: Option<Arc<dyn TaskExecutor>>| {
        let link = LinkSettings::new(
            format!("wss://localhost:{}/", addr.port()),
            RelayTrust::Ca(vec![rustls::pki_types::CertificateDer::from(
                cert.cert_der.clone(),
            )]),
            id.clone(),
        );
        Connector::start(ConnectorOptions {
            link,
            trust: trust.clone(),
            grant: Grant {
                capabilities: policy.allowed_capabilities.clone(),
                remaining: budgets,
            },
            caller_policy: policy.clone(),
            callee: executor.map(|executor| CalleeOptions {
                executor,
                policy: Arc::new(policy.clone()),
                max_concurrent: 4,
                max_concurrent_per_peer: 4,
                max_live_requests_per_peer: oab_connector::nonce::NonceCache::DEFAULT_PER_CALLER,
                replay_window_ms: oab_connector::nonce::NonceCache::DEFAULT_MAX_AGE_MS,
            }),
            audit: None,
            state: None,
        })
    };
    let b = start(&callee, Some(Arc::new(PromptExecutor(Arc::new(Echo)))))?;
    let a = start(&caller, None)?;
    a.connected().await?;
    b.connected().await?;

    let handle = a
        .caller()
        .delegate(
            &callee.peer,
            NewDelegation {
                request_id: None,
                task: Task {
                    text: "hello from the caller".into(),
                    context: Default::default(),
                    a2a_message: None,
                },
                capabilities: vec!["read:repo".into()],
                read_only: true,
                deadline: Duration::from_secs(30),
                budgets,
                parent: ParentContext {
                    agent: "example".into(),
                    trace_id: "example-1".into(),
                    execution_id: None,
                },
            },
        )
        .await?;
    let terminal = a.caller().wait(&handle, Duration::from_secs(30)).await?;
    let verified = a.caller().verify(&handle, &terminal)?;
    println!(
        "{:?}: {}",
        verified.result.outcome,
        verified.result.output.unwrap_or_default()
    );

    a.shutdown().await;
    b.shutdown().await;
    stop.cancel();
    relay.await??;
    Ok(())
}
