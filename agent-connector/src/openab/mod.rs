//! OpenAB drop-in: a control-plane (CP) compatible WebSocket endpoint on
//! loopback, so an unmodified OAB runtime delegates across the relay by
//! pointing its `[control_plane]` URL at the connector (`docs/openab.md`).
//!
//! | module | concern |
//! |---|---|
//! | [`proto`] | the CP's JSON-RPC frames, fields, status names and error codes |
//! | [`config`] | the `[openab]` section and its validation |
//! | [`keys`] | the runtimes' bearer keys, read from files or the environment |
//! | [`server`] | the accept loop, the upgrade with the bearer check, one task per connection (register deadline, lease, bounded writer) |
//! | `registry` (this file) | the registered connections and both sides' in-flight tables |
//! | [`caller_side`] | a primary's `cp/delegate` as a signed delegation through the relay, its end as `cp/delegate_result` |
//! | [`callee_side`] | a remote delegation forwarded to a registered local worker ([`OpenAbExecutor`]) |
//!
//! Never: logs or shows a bearer key; trusts a frame's identity claims
//! (everything derives from the key the connection presented); queues a
//! delegation it cannot serve now (SATURATED fails fast); or starts a
//! delegation deeper than one unless the initiator's namespace allows it
//! (`[openab.namespaces]`) and the initiator serves the parent it names:
//! then the new delegation carries the parent's chain and depth + 1.

pub mod callee_side;
pub mod caller_side;
pub mod config;
pub mod keys;
pub mod proto;
pub mod server;

use parking_lot::Mutex;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

pub use callee_side::OpenAbExecutor;
pub use config::OpenAbSection;
pub use keys::{KeyError, RuntimeKeys};
pub use server::serve;

use crate::caller::Caller;
use proto::{AgentType, DelegateResultParams};

/// The endpoint: configuration, keys and the shared tables. Cloning shares
/// them; [`serve`] runs it on a listener.
#[derive(Clone)]
pub struct OpenAbEndpoint {
    pub(crate) shared: Arc<Shared>,
}

impl std::fmt::Debug for OpenAbEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpenAbEndpoint")
            .field("listen", &self.shared.cfg.listen)
            .finish_non_exhaustive()
    }
}

impl OpenAbEndpoint {
    /// An endpoint for `cfg` with the runtimes' `keys`. Delegations from
    /// local primaries need [`OpenAbEndpoint::set_caller`].
    pub fn new(cfg: OpenAbSection, keys: RuntimeKeys) -> Self {
        // Admission tokens start at the clock so that a restarted
        // connector does not hand out tokens an earlier process used.
        let seed = u64::try_from(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default()
                .as_micros(),
        )
        .unwrap_or(1);
        OpenAbEndpoint {
            shared: Arc::new(Shared {
                cfg,
                keys,
                caller: OnceLock::new(),
                conns: Mutex::new(HashMap::new()),
                flights: Mutex::new(HashMap::new()),
                serving: Mutex::new(HashMap::new()),
                identities: Mutex::new(HashMap::new()),
                next_id: AtomicU64::new(1),
                next_admission: AtomicU64::new(seed),
            }),
        }
    }

    /// The caller API delegations from local primaries go through.
    pub fn set_caller(&self, caller: Caller) {
        let _ = self.shared.caller.set(caller);
    }

    /// The executor that serves remote delegations with local workers.
    pub fn executor(&self) -> OpenAbExecutor {
        OpenAbExecutor {
            shared: self.shared.clone(),
        }
    }

    /// The registered runtimes, one per connection, in no particular order:
    /// what openab-cp's registry lists (`Registry::list`), for every
    /// namespace.
    pub fn registrations(&self) -> Vec<Registration> {
        self.shared
            .conns
            .lock()
            .iter()
            .map(|(handle, c)| {
                let (namespace, name) = c.logical.split_once('/').unwrap_or(("", &c.logical));
                Registration {
                    handle: *handle,
                    namespace: namespace.to_string(),
                    name: name.to_string(),
                    agent_type: c.agent_type,
                    instance_id: c.instance_id.clone(),
                    labels: c.labels.clone(),
                    max_delegated_sessions: c.max_sessions,
                    active_sessions: c.active,
                }
            })
            .collect()
    }

    /// The connections open for the identity `namespace/name`, registered
    /// or not (what counts against `max_connections_per_identity`).
    pub fn connection_count(&self, identity: &str) -> usize {
        self.shared
            .identities
            .lock()
            .get(identity)
            .copied()
            .unwrap_or(0)
    }

    /// Ends every registration at once as a lapsed lease does: each one is
    /// dropped from the registry before this returns (the delegations its
    /// worker served end target_disconnected, the ones its primary started
    /// are cancelled) and its connection is closed 1008 "lease expired".
    /// Returns how many there were. The operator's lever, and the
    /// counterpart of openab-cp's lease sweep with a zero window.
    pub fn expire_leases(&self) -> usize {
        let conns: Vec<(u64, mpsc::Sender<Outbound>, CancellationToken)> = self
            .shared
            .conns
            .lock()
            .iter()
            .map(|(h, c)| (*h, c.tx.clone(), c.close.clone()))
            .collect();
        for (handle, tx, close) in &conns {
            self.shared.deregister(*handle);
            if tx
                .try_send(Outbound::Close(server::POLICY, "lease expired"))
                .is_err()
            {
                close.cancel();
            }
        }
        conns.len()
    }
}

/// One registered runtime connection, as [`OpenAbEndpoint::registrations`]
/// lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Registration {
    /// This endpoint's handle for the connection (new on every connection).
    pub handle: u64,
    /// The namespace of the identity it registered as.
    pub namespace: String,
    /// The name of the identity it registered as.
    pub name: String,
    /// Primary or worker.
    pub agent_type: AgentType,
    /// The runtime process's id, as it registered.
    pub instance_id: String,
    /// The labels it registered with.
    pub labels: BTreeMap<String, String>,
    /// The effective `max_delegated_sessions` (after the cap).
    pub max_delegated_sessions: u32,
    /// Delegations the runtime serves right now (workers).
    pub active_sessions: u32,
}

/// A frame towards one runtime.
#[derive(Debug)]
pub(crate) enum Outbound {
    /// A JSON-RPC message.
    Text(String),
    /// Close with a code and a reason, then stop writing.
    Close(u16, &'static str),
}

/// One registered connection. Owned by the registry from `cp/register`
/// until its connection task ends (`Shared::deregister`).
pub(crate) struct Conn {
    pub(crate) logical: String,
    pub(crate) agent_type: AgentType,
    pub(crate) instance_id: String,
    pub(crate) labels: BTreeMap<String, String>,
    pub(crate) max_sessions: u32,
    /// Delegations served right now (workers), counted at forwarding and
    /// released when the serving entry ends.
    pub(crate) active: u32,
    pub(crate) tx: mpsc::Sender<Outbound>,
    pub(crate) close: CancellationToken,
}

/// A delegation started by a local primary: `(namespace/name, delegation_id)`.
pub(crate) type FlightKey = (String, String);

/// The caller side's entry for one delegation, from `cp/delegate` until
/// its end: the terminal handed to the primary, its `cp/cancel`, or the
/// primary's connection ending (whichever comes first removes it, so the
/// `delegation_id` is free again at once, as in the CP); at most
/// `max_delegations` of them.
pub(crate) struct CallerFlight {
    pub(crate) admission: u64,
    /// The connection that started it: only it may cancel it, its result
    /// goes there, and its ending cancels the delegation.
    pub(crate) conn: u64,
    /// The `[[openab.targets]]` entry it went to (for `cp/list_agents`).
    pub(crate) target: usize,
    /// Removing the entry with a reason sent here cancels the delegation
    /// across the relay; its end is then delivered to nobody.
    pub(crate) cancel: oneshot::Sender<String>,
}

/// The callee side's key for one delegation forwarded to a worker: the
/// worker's connection and the `delegation_id` the initiating runtime
/// chose (forwarded unchanged). One worker never serves two delegations
/// with the same id at once: a second one, from any calling host, is
/// refused `duplicate_delegation`, so a worker's `cp/delegate_result`
/// names exactly one.
pub(crate) type ServingKey = (u64, String);

/// The callee side's entry for one delegation forwarded to a worker;
/// removed by the worker's result, the cancel, or the worker's
/// disconnection (which drops `result` and so ends the delegation
/// target_disconnected). At most one per running executor, which
/// `[policy].max_concurrent` bounds.
pub(crate) struct ServingFlight {
    /// The calling peer (the relay authenticated it).
    pub(crate) caller: oab_wire::PeerId,
    pub(crate) admission: u64,
    /// What a delegation the worker starts naming this one as parent
    /// inherits: the ancestry as the calling peer sent it (root first, at
    /// most `authority::MAX_DEPTH` entries), the signed depth, and the
    /// signed deadline (a child may not outlive it).
    pub(crate) chain: Vec<String>,
    pub(crate) depth: u8,
    pub(crate) deadline_ms: u64,
    /// The authority it runs with: a child may ask for no capability
    /// outside it, and must be read-only when it is.
    pub(crate) capabilities: Vec<String>,
    pub(crate) read_only: bool,
    pub(crate) result: oneshot::Sender<DelegateResultParams>,
}

pub(crate) struct Shared {
    pub(crate) cfg: OpenAbSection,
    pub(crate) keys: RuntimeKeys,
    pub(crate) caller: OnceLock<Caller>,
    /// Registered connections by handle.
    pub(crate) conns: Mutex<HashMap<u64, Conn>>,
    pub(crate) flights: Mutex<HashMap<FlightKey, CallerFlight>>,
    pub(crate) serving: Mutex<HashMap<ServingKey, ServingFlight>>,
    /// Connections per identity (`namespace/name`), counted from the
    /// upgrade to the connection's end (`server::IdentityPermit`), at most
    /// `max_connections_per_identity` each; an entry is removed when its
    /// count falls to zero.
    pub(crate) identities: Mutex<HashMap<String, usize>>,
    next_id: AtomicU64,
    next_admission: AtomicU64,
}

impl Shared {
    /// A fresh connection handle or request id.
    pub(crate) fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// A fresh admission token.
    pub(crate) fn next_admission(&self) -> u64 {
        self.next_admission.fetch_add(1, Ordering::Relaxed)
    }

    /// Queues `frame` towards connection `handle`, waiting while its queue
    /// is full (back-pressure: a runtime with many delegations in flight is
    /// never disconnected for it). The wait ends when there is room or the
    /// connection ends; a runtime that stops reading altogether is closed
    /// by its writer ([`server::WRITE_TIMEOUT`]). False when the frame was
    /// not queued (no such connection, or it ended).
    pub(crate) async fn send(&self, handle: u64, frame: String) -> bool {
        let Some((tx, close)) = self
            .conns
            .lock()
            .get(&handle)
            .map(|c| (c.tx.clone(), c.close.clone()))
        else {
            return false;
        };
        tokio::select! {
            () = close.cancelled() => false,
            r = tx.send(Outbound::Text(frame)) => r.is_ok(),
        }
    }

    /// Removes a connection and ends what it touched, as the CP does: each
    /// delegation it served ends target_disconnected (dropping its serving
    /// entry's result sender), and each delegation it started is cancelled
    /// across the relay (the remote worker gets `cp/cancel`), its end
    /// delivered to nobody.
    pub(crate) fn deregister(&self, handle: u64) {
        let gone = self.conns.lock().remove(&handle);
        self.serving
            .lock()
            .retain(|(worker, _), _| *worker != handle);
        let started: Vec<CallerFlight> = {
            let mut flights = self.flights.lock();
            let keys: Vec<FlightKey> = flights
                .iter()
                .filter(|(_, f)| f.conn == handle)
                .map(|(k, _)| k.clone())
                .collect();
            keys.iter().filter_map(|k| flights.remove(k)).collect()
        };
        let who = gone.map(|c| c.logical).unwrap_or_default();
        for f in started {
            let _ = f.cancel.send(format!("initiator {who} disconnected"));
        }
    }

    /// Hands a result to the connection that started the delegation; when
    /// it is gone the result is dropped (its delegations were cancelled
    /// when it ended, as the CP does).
    pub(crate) async fn deliver(&self, conn: u64, params: DelegateResultParams) -> bool {
        let frame = proto::request(
            self.next_id(),
            proto::methods::DELEGATE_RESULT,
            serde_json::to_value(&params).unwrap_or_default(),
        );
        self.send(conn, frame).await
    }
}
