//! `oab-connector demo`: one delegation across a development relay, in one
//! command.
//!
//! With `cargo run -p oab-relay` running (it writes `.oab-dev/`: the relay
//! config, its self-signed certificate and the identities of `dev/alice` and
//! `dev/bob`), [`run`] starts two connectors in this process, `dev/alice`
//! (caller only) and `dev/bob` (callee, with [`DemoExecutor`]), delegates one
//! task from alice to bob, writes each event as it arrives, then verifies
//! bob's signed result against bob's key from the identity file (never
//! against the relay) and writes it with its provenance.
//!
//! `--a2a` ([`a2a`]) does the same through the A2A facade and driver, from
//! the connector configs the development relay wrote.
//!
//! Never: uses anything but a development setup: the relay certificate is
//! trusted as a CA from the setup folder, and both peers' keys come from the
//! identity files next to it.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt as _;
use oab_wire::identity::{Identity, PeerKey};
use oab_wire::{Outcome, PeerId};

use crate::authority::{CapabilitySet, Grant, Policy};
use crate::callee::{CalleeOptions, Execution, StopReason, TaskExecutor, TaskRun};
use crate::caller::{CallerError, DelegationEvent, EventKind, NewDelegation};
use crate::connector::{Connector, ConnectorOptions, StartError};
use crate::link::LinkSettings;
use crate::profile::{Artifact, Budgets, ParentContext, RiskLevel, Task, Usage};
use crate::trust::RelayTrust;

#[cfg(feature = "a2a")]
pub mod a2a;

/// The caller of the demo (one of the dev relay's peers, `relay::dev::DEV_PEERS`).
pub const CALLER: &str = "dev/alice";

/// The callee of the demo.
pub const CALLEE: &str = "dev/bob";

/// Progress events [`DemoExecutor`] emits before it completes.
pub const PROGRESS_STEPS: u64 = 3;

/// Pause before each progress event: long enough to see them arrive one by
/// one, short enough that the demo takes about a second.
pub const STEP_PAUSE: Duration = Duration::from_millis(150);

/// How long the demo waits for each connector to reach the relay before it
/// says the relay does not answer (a local relay answers in milliseconds).
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// How long the demo waits for the delegation's terminal (the executor takes
/// about `PROGRESS_STEPS * STEP_PAUSE`).
pub const WAIT_TIMEOUT: Duration = Duration::from_secs(30);

/// The hint every "no relay" error ends with.
const START_RELAY: &str = "start the development relay first: `cargo run -p oab-relay`";

/// Where the development setup is and which relay to dial.
#[derive(Debug, Clone)]
pub struct DemoOptions {
    /// The folder the development relay wrote (`.oab-dev`).
    pub dev_dir: PathBuf,
    /// The relay URL; `None`: `wss://localhost:<port of relay.listen>/` from
    /// the setup's `relay.toml`.
    pub relay_url: Option<String>,
    /// `--a2a` only: where the facade listens instead of `dev/alice`'s
    /// `a2a.facade_listen` (port 0: one the OS picks).
    pub facade_listen: Option<std::net::SocketAddr>,
    /// `--a2a` only: where the demo A2A agent listens instead of the
    /// address of `dev/bob`'s `a2a.driver_url`.
    pub agent_listen: Option<std::net::SocketAddr>,
}

/// Why the demo did not show a verified delegation.
#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    /// A file of the development setup is missing.
    #[error(
        "{path} is missing: {START_RELAY} (it writes the development setup), or pass --dev-dir"
    )]
    Missing {
        /// The missing file.
        path: String,
    },
    /// A file of the development setup could not be read or parsed.
    #[error("{path}: {reason}")]
    BadFile {
        /// The file.
        path: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A connector could not start.
    #[error("starting the connector for {peer}: {source}")]
    Start {
        /// The peer.
        peer: String,
        /// The error.
        source: StartError,
    },
    /// A connector did not reach the relay.
    #[error("{peer} could not reach the relay at {url}: {reason}; {START_RELAY}")]
    Unreachable {
        /// The peer.
        peer: String,
        /// The relay URL.
        url: String,
        /// What happened.
        reason: String,
    },
    /// The caller API refused or failed.
    #[error("delegation: {0}")]
    Caller(#[from] CallerError),
    /// The delegation ended without a completed, verified result.
    #[error("the delegation ended {outcome}: {reason}")]
    NotCompleted {
        /// The outcome.
        outcome: Outcome,
        /// The relay's or callee's reason.
        reason: String,
    },
    /// Stopped by a signal (Ctrl-C) before it finished.
    #[error("stopped ({signal}) before the delegation finished; the connectors are disconnected")]
    Interrupted {
        /// The signal (`Ctrl-C`, `SIGTERM`).
        signal: String,
    },
    /// A listener of the A2A demo could not be bound.
    #[error("binding {what} on {addr}: {reason}")]
    Bind {
        /// What was to listen there.
        what: String,
        /// The address.
        addr: std::net::SocketAddr,
        /// Why it failed, and what to do.
        reason: String,
    },
    /// Writing the report failed.
    #[error("writing the output: {0}")]
    Output(#[from] std::io::Error),
}

/// The identity file `relay::dev::prepare` writes for `peer`.
fn identity_path(dir: &Path, peer: &str) -> PathBuf {
    dir.join(format!("{}.identity.toml", peer.replace('/', "-")))
}

fn dev_file(dir: &Path, name: &str) -> Result<PathBuf, DemoError> {
    let path = dir.join(name);
    if path.is_file() {
        Ok(path)
    } else {
        Err(DemoError::Missing {
            path: path.display().to_string(),
        })
    }
}

fn bad(path: &Path, reason: impl ToString) -> DemoError {
    DemoError::BadFile {
        path: path.display().to_string(),
        reason: reason.to_string(),
    }
}

/// The relay URL of the setup's `relay.toml` (`relay.listen`'s port, on
/// `localhost`, the name the self-signed certificate carries).
fn relay_url_from(config: &Path) -> Result<String, DemoError> {
    #[derive(serde::Deserialize)]
    struct File {
        relay: Relay,
    }
    #[derive(serde::Deserialize)]
    struct Relay {
        listen: std::net::SocketAddr,
    }
    let text = std::fs::read_to_string(config).map_err(|e| bad(config, e))?;
    let file: File = toml::from_str(&text).map_err(|e| bad(config, e))?;
    Ok(format!("wss://localhost:{}/", file.relay.listen.port()))
}

fn load_cert(path: &Path) -> Result<Vec<rustls::pki_types::CertificateDer<'static>>, DemoError> {
    use rustls::pki_types::pem::PemObject as _;
    let certs: Result<Vec<_>, _> = rustls::pki_types::CertificateDer::pem_file_iter(path)
        .map_err(|e| bad(path, e))?
        .collect();
    let certs = certs.map_err(|e| bad(path, e))?;
    if certs.is_empty() {
        return Err(bad(path, "no CERTIFICATE block"));
    }
    Ok(certs)
}

fn load_identity(dir: &Path, peer: &str) -> Result<Identity, DemoError> {
    let path = identity_path(dir, peer);
    if !path.is_file() {
        return Err(DemoError::Missing {
            path: path.display().to_string(),
        });
    }
    let id = crate::keyfile::load(&path).map_err(|e| bad(&path, e))?;
    if id.peer.as_str() != peer {
        return Err(bad(&path, format!("holds {}, expected {peer}", id.peer)));
    }
    Ok(id)
}

fn key_of(id: &Identity) -> PeerKey {
    PeerKey {
        key_id: id.key_id.clone(),
        public_key: id.public_key(),
        not_before_ms: None,
        not_after_ms: None,
    }
}

fn budgets(n: u64) -> Budgets {
    Budgets {
        tokens: n,
        cost_micros: n,
        risk: RiskLevel::Low,
        output_bytes: n,
    }
}

/// Both sides' policy: read-only `read:*`, generous budgets.
fn policy() -> Policy {
    Policy {
        // A constant pattern that parses; were it ever refused, the empty
        // set would refuse the delegation (fail closed), never widen it.
        allowed_capabilities: CapabilitySet::parse(["read:*"]).unwrap_or_default(),
        allow_writes: false,
        max_depth: 1,
        budgets: budgets(1_000_000),
        max_deadline_ms: 600_000,
    }
}

/// The demo's callee: emits [`PROGRESS_STEPS`] `TASK_STATE_WORKING` events,
/// [`STEP_PAUSE`] apart, then completes with a small structured output and a
/// text artifact. Keeps nothing per delegation.
#[derive(Debug, Clone, Copy, Default)]
pub struct DemoExecutor;

impl TaskExecutor for DemoExecutor {
    fn execute(
        &self,
        run: TaskRun,
    ) -> Pin<Box<dyn std::future::Future<Output = Execution> + Send + 'static>> {
        Box::pin(async move {
            let words = run.request.task.text.split_whitespace().count();
            for step in 1..=PROGRESS_STEPS {
                tokio::select! {
                    () = run.cancel.cancelled() => return Execution::stopped(StopReason::Cancelled),
                    () = tokio::time::sleep(STEP_PAUSE) => {}
                }
                let message = serde_json::json!(format!("step {step} of {PROGRESS_STEPS}"));
                let data = serde_json::json!({ "step": step, "of": PROGRESS_STEPS });
                if let Err(e) = run
                    .sink
                    .status("TASK_STATE_WORKING", Some(message), Some(data))
                    .await
                {
                    return Execution::stopped(StopReason::Error(format!("link: {e}")));
                }
            }
            let summary = format!("dev/bob read the task: {words} words");
            let output = serde_json::json!({ "summary": summary, "words": words });
            let artifact = Artifact {
                artifact_id: "summary".into(),
                name: "summary".into(),
                media_type: "text/plain".into(),
                text: Some(summary.clone()),
                data: None,
                url: None,
            };
            Execution {
                stop: StopReason::EndTurn,
                output: Some(output),
                artifacts: vec![artifact],
                side_effects: Vec::new(),
                usage: Usage {
                    tokens: 0,
                    cost_micros: 0,
                    output_bytes: u64::try_from(summary.len()).unwrap_or(u64::MAX),
                },
            }
        })
    }
}

fn start(
    peer: &Identity,
    url: &str,
    certs: &[rustls::pki_types::CertificateDer<'static>],
    trust: &HashMap<PeerId, Vec<PeerKey>>,
    executor: Option<Arc<dyn TaskExecutor>>,
) -> Result<Connector, DemoError> {
    let link = LinkSettings::new(url, RelayTrust::Ca(certs.to_vec()), peer.clone());
    Connector::start(ConnectorOptions {
        link,
        trust: trust.clone(),
        grant: Grant {
            capabilities: policy().allowed_capabilities,
            remaining: budgets(1_000_000),
        },
        caller_policy: policy(),
        callee: executor.map(|executor| CalleeOptions {
            executor,
            policy: Arc::new(policy()),
            max_concurrent: 4,
            max_concurrent_per_peer: 4,
            max_live_requests_per_peer: crate::nonce::NonceCache::DEFAULT_PER_CALLER,
            replay_window_ms: crate::nonce::NonceCache::DEFAULT_MAX_AGE_MS,
        }),
        audit: None,
        state: None,
    })
    .map_err(|source| DemoError::Start {
        peer: peer.peer.to_string(),
        source,
    })
}

async fn connected(c: &Connector, peer: &Identity, url: &str) -> Result<(), DemoError> {
    let unreachable = |reason: String| DemoError::Unreachable {
        peer: peer.peer.to_string(),
        url: url.to_string(),
        reason,
    };
    match tokio::time::timeout(CONNECT_TIMEOUT, c.connected()).await {
        Ok(Ok(_epoch)) => Ok(()),
        Ok(Err(e)) => Err(unreachable(e.to_string())),
        Err(_) => Err(unreachable(format!(
            "no session within {} s",
            CONNECT_TIMEOUT.as_secs()
        ))),
    }
}

/// Runs the demo, writing what happens to `out`. Returns once the verified
/// result is written (both connectors are shut down first).
pub async fn run(options: &DemoOptions, out: &mut dyn Write) -> Result<(), DemoError> {
    let dir = &options.dev_dir;
    let config = dev_file(dir, "relay.toml")?;
    let cert = dev_file(dir, "relay-cert.pem")?;
    let certs = load_cert(&cert)?;
    let alice = load_identity(dir, CALLER)?;
    let bob = load_identity(dir, CALLEE)?;
    let url = match &options.relay_url {
        Some(u) => u.clone(),
        None => relay_url_from(&config)?,
    };
    let trust: HashMap<PeerId, Vec<PeerKey>> = [&alice, &bob]
        .into_iter()
        .map(|i| (i.peer.clone(), vec![key_of(i)]))
        .collect();
    writeln!(out, "development setup: {}", dir.display())?;
    writeln!(out, "relay:             {url}")?;
    let bob_c = start(&bob, &url, &certs, &trust, Some(Arc::new(DemoExecutor)))?;
    let alice_c = start(&alice, &url, &certs, &trust, None)?;
    let result = async {
        connected(&bob_c, &bob, &url).await?;
        writeln!(out, "{CALLEE} connected (callee, demo executor)")?;
        connected(&alice_c, &alice, &url).await?;
        writeln!(out, "{CALLER} connected (caller)")?;
        delegate(&alice_c, &bob, out).await
    }
    .await;
    alice_c.shutdown().await;
    bob_c.shutdown().await;
    result
}

async fn delegate(
    alice: &Connector,
    bob_id: &Identity,
    out: &mut dyn Write,
) -> Result<(), DemoError> {
    let caller = alice.caller();
    let bob = &bob_id.peer;
    let spec = NewDelegation {
        request_id: None,
        task: Task {
            text: "Summarise the README of this repository".into(),
            context: Default::default(),
            a2a_message: None,
        },
        capabilities: vec!["read:repo".into()],
        read_only: true,
        deadline: Duration::from_secs(60),
        budgets: budgets(10_000),
        parent: ParentContext {
            agent: "oab-connector-demo".into(),
            trace_id: "demo".into(),
            execution_id: None,
        },
    };
    let asked = format!(
        "capabilities: {}, read-only: {}",
        spec.capabilities.join(", "),
        spec.read_only
    );
    let handle = caller.delegate(bob, spec).await?;
    writeln!(
        out,
        "delegated {} from {CALLER} to {bob} ({asked})",
        handle.key
    )?;
    let mut events = caller.events(&handle, 0).await?;
    let terminal = tokio::time::timeout(WAIT_TIMEOUT, async {
        while let Some(item) = events.next().await {
            let DelegationEvent { seq, kind } = item.map_err(CallerError::from)?;
            match kind {
                EventKind::Accepted { task_id } => {
                    writeln!(out, "  [{seq}] accepted as task {task_id}")?;
                }
                EventKind::Status {
                    state,
                    message,
                    data,
                } => {
                    let message = message
                        .as_ref()
                        .and_then(|m| m.as_str().map(str::to_string))
                        .unwrap_or_default();
                    let data = data.map(|d| d.to_string()).unwrap_or_default();
                    writeln!(out, "  [{seq}] progress {state} {message} {data}")?;
                }
                EventKind::Artifact { artifact, .. } => {
                    writeln!(out, "  [{seq}] artifact {}", artifact.name)?;
                }
                EventKind::Unrecognised(b) => {
                    writeln!(out, "  [{seq}] (unrecognised event, {} bytes)", b.len())?;
                }
                EventKind::Terminal(t) => {
                    writeln!(out, "  [{seq}] terminal {}", t.outcome)?;
                    return Ok(t);
                }
            }
        }
        Err(DemoError::Caller(CallerError::Events(
            crate::link::EventError::Stopped("event stream ended".into()),
        )))
    })
    .await
    .map_err(|_| CallerError::Timeout)??;
    drop(events);
    if terminal.outcome != Outcome::Completed || terminal.relay_origin {
        return Err(DemoError::NotCompleted {
            outcome: terminal.outcome,
            reason: terminal.reason.unwrap_or_default(),
        });
    }
    let verified = caller.verify(&handle, &terminal)?;
    let r = &verified.result;
    // The key the signature was checked against: bob's, from his identity
    // file (the connector's `trust` holds the same one).
    let public_key = if r.executor.peer == bob_id.peer && verified.key_id == bob_id.key_id {
        bob_id.public_key().to_string()
    } else {
        "not the demo's key".to_string()
    };
    writeln!(
        out,
        "verified result (signature checked against {CALLEE}'s configured key, not the relay):"
    )?;
    writeln!(out, "  outcome:         {}", r.outcome)?;
    writeln!(out, "  task id:         {}", r.task_id)?;
    writeln!(
        out,
        "  executor:        {} key {} ({public_key})",
        r.executor.peer, verified.key_id
    )?;
    writeln!(
        out,
        "  capabilities:    {} (read-only: {})",
        r.effective_capabilities.join(", "),
        r.read_only
    )?;
    writeln!(out, "  request digest:  {}", r.request_digest)?;
    writeln!(out, "  result digest:   {}", r.result_digest)?;
    writeln!(
        out,
        "  output:          {}",
        r.output.as_ref().map(|o| o.to_string()).unwrap_or_default()
    )?;
    for a in &r.artifacts {
        writeln!(
            out,
            "  artifact:        {} ({}): {}",
            a.name,
            a.media_type,
            a.text.as_deref().unwrap_or("")
        )?;
    }
    writeln!(
        out,
        "  took:            {} ms on {}",
        r.finished_ms.saturating_sub(r.started_ms),
        r.executor.peer
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn the_relay_url_comes_from_relay_listen_on_localhost() {
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("relay.toml");
        std::fs::write(
            &config,
            "[relay]\nid = \"localhost\"\nlisten = \"127.0.0.1:7443\"\n\n[store]\nurl = \"memory\"\n",
        )
        .unwrap();
        assert_eq!(relay_url_from(&config).unwrap(), "wss://localhost:7443/");
        std::fs::write(&config, "[relay]\nlisten = \"nowhere\"\n").unwrap();
        assert!(matches!(
            relay_url_from(&config),
            Err(DemoError::BadFile { .. })
        ));
    }
}
