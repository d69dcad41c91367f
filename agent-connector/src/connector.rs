//! Starting a connector: the link task, the caller API and the callee runtime.
//!
//! Never: holds delegation state or touches the socket: it wires the link, the
//! caller and the callee runtime together and hands out their handles; stopping
//! is [`Connector::shutdown`].

use std::collections::HashMap;
use std::sync::Arc;

use bytes::Bytes;
use oab_wire::PeerId;
use oab_wire::identity::PeerKey;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::audit::{AuditSink, TracingAuditSink};
use crate::authority::{Grant, Policy};
use crate::callee::{CalleeOptions, CalleeRuntime};
use crate::caller::Caller;
use crate::link::{Command, LinkError, LinkHandle, LinkSettings, LinkState};

/// The peers' public keys, shared by the caller and the callee side and
/// replaced whole by [`Connector::reload`]; read once per verification.
pub use crate::profile::PeerKeys;

/// What a running connector takes from a reloaded configuration
/// ([`Connector::reload`]).
#[derive(Debug)]
pub struct Reconfiguration {
    /// The peers' keys: requests and results signed by a key no longer
    /// listed (or outside its window) are refused from now on.
    pub trust: HashMap<PeerId, Vec<PeerKey>>,
    /// What this host may delegate.
    pub grant: Grant,
    /// This host's policy for delegations it sends.
    pub caller_policy: Policy,
    /// How the relay's certificate is trusted at the next connect.
    pub relay_trust: crate::trust::RelayTrust,
}

/// Everything a connector needs.
#[derive(Debug)]
pub struct ConnectorOptions {
    /// Relay, trust, identity, reconnect settings.
    pub link: LinkSettings,
    /// The peers' public keys (requests and results are verified against these, never against the relay).
    pub trust: HashMap<PeerId, Vec<PeerKey>>,
    /// What this host may delegate (caller side).
    pub grant: Grant,
    /// This host's policy for delegations it sends.
    pub caller_policy: Policy,
    /// The callee side; `None` refuses every incoming delegation (signed `rejected`).
    pub callee: Option<CalleeOptions>,
    /// Where audit records go (default: the `oab::audit` tracing target).
    pub audit: Option<Arc<dyn AuditSink>>,
    /// Where state is kept across restarts: the caller side's delegations
    /// (see [`crate::state`]) and, in the same folder, the callee side's
    /// instance id and re-attach records (see [`crate::reattach`]; the
    /// link's instance id is then the folder's).
    pub state: Option<crate::state::FileState>,
}

/// A running connector. Dropping it does not stop it; call [`Connector::shutdown`].
#[derive(Debug)]
pub struct Connector {
    caller: Caller,
    callee: Arc<CalleeRuntime>,
    link: LinkHandle,
    trust: Arc<PeerKeys>,
    shutdown: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl std::fmt::Debug for dyn AuditSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AuditSink")
    }
}

/// Why a connector could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// TLS trust could not be set up.
    #[error(transparent)]
    Trust(#[from] crate::trust::TrustError),
    /// The state folder's callee records or instance id could not be read.
    #[error("the state folder's callee side: {0}")]
    State(#[from] crate::state::StateError),
}

impl Connector {
    /// Starts the link and, with `callee` options, the callee runtime.
    pub fn start(mut options: ConnectorOptions) -> Result<Connector, StartError> {
        let shutdown = CancellationToken::new();
        let reattach = match options.state.as_ref() {
            Some(state) => {
                options.link.instance = crate::reattach::instance_in(state.dir())?;
                Some(crate::reattach::CalleeJournal::open(state.dir())?)
            }
            None => None,
        };
        let identity = Arc::new(options.link.identity.clone());
        let retention = crate::caller::FinishedRetention {
            max_finished: options.link.max_finished,
            max_finished_bytes: options.link.max_finished_bytes,
        };
        let trust = Arc::new(PeerKeys::from_pointee(options.trust));
        let (incoming_tx, incoming_rx) = mpsc::channel(options.link.queue.max(1));
        let (link, task) = crate::link::spawn(options.link, incoming_tx, shutdown.clone())?;
        let audit: Arc<dyn AuditSink> = options.audit.unwrap_or_else(|| Arc::new(TracingAuditSink));
        let runtime = CalleeRuntime::new(
            link.clone(),
            identity.clone(),
            trust.clone(),
            options.callee,
            audit.clone(),
            reattach,
        );
        tokio::spawn(runtime.clone().run(incoming_rx));
        let caller = Caller::new(
            link.clone(),
            identity,
            trust.clone(),
            options.grant,
            options.caller_policy,
            options.state,
            audit,
        )
        .with_retention(retention);
        Ok(Connector {
            caller,
            callee: runtime,
            link,
            trust,
            shutdown,
            task,
        })
    }

    /// Applies a reloaded configuration: the relay trust first (when it
    /// cannot be set up, nothing changes), then the peers' keys and the
    /// caller side's grant and policy. The callee side's policy is its
    /// [`crate::callee::PolicyProvider`]'s (e.g. a
    /// [`crate::callee::LivePolicy`]). Delegations already running keep the
    /// authority they were given; the session up stays up.
    pub fn reload(&self, update: Reconfiguration) -> Result<(), crate::trust::TrustError> {
        self.link.set_relay_trust(&update.relay_trust)?;
        self.trust.store(Arc::new(update.trust));
        self.caller
            .set_authority(update.grant, update.caller_policy);
        Ok(())
    }

    /// The caller API.
    pub fn caller(&self) -> &Caller {
        &self.caller
    }

    /// What the callee side holds now: delegations being served and live
    /// replay-cache entries.
    pub fn callee_footprint(&self) -> crate::callee::CalleeFootprint {
        self.callee.footprint()
    }

    /// The link handle (its stats and status: [`crate::admin`]).
    pub fn link(&self) -> &LinkHandle {
        &self.link
    }

    /// The link state.
    pub fn state(&self) -> LinkState {
        self.link.state()
    }

    /// Waits until connected; returns the relay's store epoch.
    pub async fn connected(&self) -> Result<u64, LinkError> {
        self.link.connected().await
    }

    /// Publishes this host's agent card to the relay's peer directory.
    pub async fn publish(&self, card: &serde_json::Value) -> Result<(), LinkError> {
        let descriptor = Bytes::from(serde_json::to_vec(card).unwrap_or_default());
        self.link.command(Command::Publish { descriptor }).await
    }

    /// Stops the link (closing the connection) and waits for it.
    pub async fn shutdown(self) {
        self.shutdown.cancel();
        let _ = self.task.await;
    }
}
