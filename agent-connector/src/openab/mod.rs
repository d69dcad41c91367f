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
//! delegation it cannot serve now (SATURATED fails fast); or lets a
//! delegation received from a remote peer start another one (depth one).

pub mod callee_side;
pub mod caller_side;
pub mod config;
pub mod keys;
pub mod proto;
pub mod server;

use parking_lot::Mutex;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

pub use callee_side::OpenAbExecutor;
pub use config::OpenAbSection;
pub use keys::{KeyError, RuntimeKeys};
pub use server::serve;

use crate::caller::{Caller, DelegationHandle};
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
                undelivered: Mutex::new(VecDeque::new()),
                serving: Mutex::new(HashMap::new()),
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
/// its `cp/delegate_result` is handed on (or kept in `undelivered`); at
/// most `max_delegations` of them.
pub(crate) struct CallerFlight {
    pub(crate) admission: u64,
    pub(crate) handle: Option<DelegationHandle>,
    /// A `cp/cancel` that came before the delegation was handed to the link.
    pub(crate) cancel_reason: Option<String>,
}

/// A result whose primary instance was not connected when it ended; kept
/// for `result_retention_secs`, at most `max_delegations` (oldest dropped).
pub(crate) struct Undelivered {
    pub(crate) logical: String,
    pub(crate) instance_id: String,
    pub(crate) params: DelegateResultParams,
    pub(crate) kept_at: Instant,
}

/// The callee side's entry for one delegation forwarded to a worker, keyed
/// by the forwarded `delegation_id`; removed by the worker's result, the
/// cancel, or the worker's disconnection (which drops `result` and so ends
/// the delegation target_disconnected). At most one per running executor,
/// which `[policy].max_concurrent` bounds.
pub(crate) struct ServingFlight {
    pub(crate) worker: u64,
    pub(crate) admission: u64,
    pub(crate) result: oneshot::Sender<DelegateResultParams>,
}

pub(crate) struct Shared {
    pub(crate) cfg: OpenAbSection,
    pub(crate) keys: RuntimeKeys,
    pub(crate) caller: OnceLock<Caller>,
    /// Registered connections by handle.
    pub(crate) conns: Mutex<HashMap<u64, Conn>>,
    pub(crate) flights: Mutex<HashMap<FlightKey, CallerFlight>>,
    pub(crate) undelivered: Mutex<VecDeque<Undelivered>>,
    pub(crate) serving: Mutex<HashMap<String, ServingFlight>>,
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

    /// Removes a connection and ends what it was serving: dropping each
    /// serving entry's result sender ends that delegation
    /// target_disconnected. Delegations it started go on (their results
    /// wait for its instance to come back).
    pub(crate) fn deregister(&self, handle: u64) {
        self.conns.lock().remove(&handle);
        self.serving.lock().retain(|_, f| f.worker != handle);
    }

    /// Hands a result to the primary instance that started the delegation,
    /// or keeps it for that instance's reconnection.
    pub(crate) async fn deliver(
        &self,
        logical: &str,
        instance_id: &str,
        params: DelegateResultParams,
    ) {
        let target = self
            .conns
            .lock()
            .iter()
            .find(|(_, c)| c.logical == logical && c.instance_id == instance_id)
            .map(|(h, _)| *h);
        let frame = proto::request(
            self.next_id(),
            proto::methods::DELEGATE_RESULT,
            serde_json::to_value(&params).unwrap_or_default(),
        );
        if let Some(h) = target
            && self.send(h, frame).await
        {
            return;
        }
        let mut kept = self.undelivered.lock();
        self.prune_undelivered(&mut kept);
        if kept.len() >= self.cfg.max_delegations {
            kept.pop_front();
        }
        kept.push_back(Undelivered {
            logical: logical.to_string(),
            instance_id: instance_id.to_string(),
            params,
            kept_at: Instant::now(),
        });
    }

    fn prune_undelivered(&self, kept: &mut VecDeque<Undelivered>) {
        let retention = Duration::from_secs(self.cfg.result_retention_secs);
        while kept
            .front()
            .is_some_and(|u| u.kept_at.elapsed() > retention)
        {
            kept.pop_front();
        }
    }

    /// Sends the results kept for `logical`'s `instance_id` to `handle`;
    /// what could not be sent (the connection ended) is kept again.
    pub(crate) async fn redeliver(&self, handle: u64, logical: &str, instance_id: &str) {
        let mine: Vec<Undelivered> = {
            let mut kept = self.undelivered.lock();
            self.prune_undelivered(&mut kept);
            let (mine, rest): (VecDeque<_>, VecDeque<_>) = kept
                .drain(..)
                .partition(|u| u.logical == logical && u.instance_id == instance_id);
            *kept = rest;
            mine.into_iter().collect()
        };
        let mut mine = mine.into_iter();
        while let Some(u) = mine.next() {
            let frame = proto::request(
                self.next_id(),
                proto::methods::DELEGATE_RESULT,
                serde_json::to_value(&u.params).unwrap_or_default(),
            );
            if !self.send(handle, frame).await {
                let mut kept = self.undelivered.lock();
                for u in std::iter::once(u).chain(mine) {
                    if kept.len() >= self.cfg.max_delegations {
                        kept.pop_front();
                    }
                    kept.push_back(u);
                }
                return;
            }
        }
    }
}
