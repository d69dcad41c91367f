//! The caller API: delegate a task to a peer, follow its events (replay,
//! then live), get, wait, cancel, list peers, verify the signed result.
//!
//! It owns this connector's record of each delegation it started (the signed
//! request, its digest, the callee), the state record made durable before an `Open`
//! leaves (with a state folder), and the reading of up-log events into
//! [`EventKind`]s (`parse_event`).
//!
//! Never: sends a new delegation before authorizing it: `Caller::delegate`
//! refuses a nested delegation, runs `authorize_outgoing` (grant and policy,
//! fail closed), signs the request and saves its state record, all before the
//! `Open` is handed to the link; a delegation restored from the state folder
//! is sent again exactly as it was signed then. Never takes a result on the
//! relay's word: [`Caller::verify`] checks the callee's signature with its
//! configured key and the request signed here, and a relay-originated terminal,
//! which has no result, fails it.

use arc_swap::ArcSwap;
use parking_lot::Mutex;
use std::collections::{HashMap, VecDeque};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::Stream;
use oab_wire::envelope::Envelope;
use oab_wire::identity::{Identity, now_ms};
use oab_wire::{DelegationKey, Digest, Open, Outcome, PeerEntry, PeerId, RequestId, TraceId};
use serde_json::Value;
use tokio::sync::{mpsc, oneshot, watch};

use crate::audit::{AuditEvent, AuditRecord, AuditSink, Side};
use crate::authority::{AuthorityError, Grant, Policy, authorize_outgoing};
use crate::events::{CancelPayload, DownPayload, UpPayload};
use crate::link::{Command, EventError, LinkError, LinkHandle, SendKind, Snapshot, UpEvent};
use crate::nonce::Nonce;
use crate::profile::{
    Budgets, DelegationRequest, DelegationResult, PROFILE_VERSION, ParentContext, ProfileError,
    Task, check_result_within_request, sign_request, verify_result,
};
use crate::state::{FileState, SavedDelegation};

/// What the caller asks for. The connector adds the nonce, times, depth and
/// signature.
#[derive(Debug, Clone, PartialEq)]
pub struct NewDelegation {
    /// Idempotency key; a fresh one is made when `None`.
    pub request_id: Option<RequestId>,
    /// The task.
    pub task: Task,
    /// Capabilities requested (exact names).
    pub capabilities: Vec<String>,
    /// Whether the callee must not change anything (the default).
    pub read_only: bool,
    /// Time from now until the deadline.
    pub deadline: Duration,
    /// Budgets, all explicit (zero is zero).
    pub budgets: Budgets,
    /// Caller-side provenance.
    pub parent: ParentContext,
}

/// A delegation this connector started.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct DelegationHandle {
    /// The delegation key (this peer + request id).
    pub key: DelegationKey,
    /// The callee.
    pub callee: PeerId,
}

/// One event of a delegation, as the caller sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct DelegationEvent {
    /// Position in the up log.
    pub seq: u64,
    /// What happened.
    pub kind: EventKind,
}

/// The kinds of caller-visible events.
#[derive(Debug, Clone, PartialEq)]
pub enum EventKind {
    /// The callee took the work under this A2A task id.
    Accepted {
        /// The task id.
        task_id: String,
    },
    /// Progress.
    Status {
        /// A2A state name.
        state: String,
        /// Optional message.
        message: Option<Value>,
        /// Optional data.
        data: Option<Value>,
    },
    /// An artifact (or chunk).
    Artifact {
        /// The artifact.
        artifact: crate::profile::Artifact,
        /// Extends an earlier artifact.
        append: bool,
        /// Last chunk.
        last_chunk: bool,
    },
    /// The one terminal.
    Terminal(Terminal),
    /// A payload this version does not understand (kept, not dropped).
    Unrecognised(Bytes),
}

/// The terminal of a delegation.
#[derive(Debug, Clone, PartialEq)]
pub struct Terminal {
    /// The outcome.
    pub outcome: Outcome,
    /// Appended by the relay (`expired`, `unknown`): no signed result exists.
    pub relay_origin: bool,
    /// The callee's signed result (unverified until [`Caller::verify`]).
    pub envelope: Option<Envelope>,
    /// The relay's reason, for relay-originated terminals.
    pub reason: Option<String>,
}

/// Errors of the caller API.
#[derive(Debug, thiserror::Error)]
pub enum CallerError {
    /// A refusal by the authority rules (fail closed), before anything was sent.
    #[error("{0}")]
    Authority(#[from] crate::authority::AuthorityError),
    /// The request is not valid (e.g. it carries credentials).
    #[error("{0}")]
    Profile(#[from] ProfileError),
    /// The link refused or stopped.
    #[error("{0}")]
    Link(#[from] LinkError),
    /// The request id is in use with a different request.
    #[error("idempotency_mismatch: request id {0} was used with a different request")]
    IdempotencyMismatch(String),
    /// Not a delegation of this connector.
    #[error("unknown delegation {0}")]
    UnknownDelegation(String),
    /// `wait` timed out (the delegation goes on).
    #[error("no terminal within the wait timeout")]
    Timeout,
    /// The event stream failed.
    #[error("{0}")]
    Events(#[from] EventError),
    /// The state folder could not be read or written.
    #[error("state: {0}")]
    State(String),
}

impl CallerError {
    /// A stable snake_case code.
    pub fn code(&self) -> &'static str {
        match self {
            CallerError::Authority(e) => e.code(),
            CallerError::Profile(e) => e.code(),
            CallerError::Link(_) => "link",
            CallerError::IdempotencyMismatch(_) => "idempotency_mismatch",
            CallerError::UnknownDelegation(_) => "unknown_delegation",
            CallerError::Timeout => "timeout",
            CallerError::Events(_) => "events",
            CallerError::State(_) => "state",
        }
    }
}

/// A verified result.
#[derive(Debug, Clone, PartialEq)]
pub struct VerifiedResult {
    /// The signed result, checked against the request.
    pub result: DelegationResult,
    /// The key that signed it.
    pub key_id: oab_wire::KeyId,
}

#[derive(Debug, Clone)]
struct CallerRecord {
    /// Its end was handed to the application (it sits in
    /// [`Records::finished`]).
    finished: bool,
    callee: PeerId,
    /// `None` for a delegation restored from state after a restart.
    spec: Option<NewDelegation>,
    request: DelegationRequest,
    request_digest: Digest,
    envelope: String,
    /// While the first call with this request id waits for its state
    /// record to be durable: `Some(true)` once it is, `Some(false)` (or a
    /// dropped sender) when that failed and the record is gone. Concurrent
    /// calls with the same id wait on it. `None` once saved, and without a
    /// state folder.
    saving: Option<watch::Receiver<Option<bool>>>,
}

/// A delegation found already recorded for a new call: its handle and,
/// while its first call is still saving it, what to wait on.
type Existing = Result<(DelegationHandle, Option<watch::Receiver<Option<bool>>>), CallerError>;

/// Answers a call that found its request id recorded: the same delegation
/// once its record is durable, or the first call's failure.
async fn settle(found: Existing) -> Result<DelegationHandle, CallerError> {
    let (handle, saving) = found?;
    if let Some(mut saving) = saving {
        let saved = saving
            .wait_for(Option::is_some)
            .await
            .is_ok_and(|v| *v == Some(true));
        if !saved {
            return Err(CallerError::State(format!(
                "{}: the first call with this request id could not save its state",
                handle.key
            )));
        }
    }
    Ok(handle)
}

/// Removes a delegation's record when its first call fails (or is
/// dropped) before its state record is durable, so the request id is free
/// again.
struct Unclaim<'a> {
    records: &'a Mutex<Records>,
    key: &'a DelegationKey,
    armed: bool,
}

impl Drop for Unclaim<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.records.lock().map.remove(self.key);
        }
    }
}

impl CallerRecord {
    /// What a new call with `spec` to `callee` gets when this record holds
    /// its request id.
    fn existing(&self, key: &DelegationKey, spec: &NewDelegation, callee: &PeerId) -> Existing {
        if self.same(spec, callee) {
            Ok((
                DelegationHandle {
                    key: key.clone(),
                    callee: self.callee.clone(),
                },
                self.saving.clone(),
            ))
        } else {
            Err(CallerError::IdempotencyMismatch(key.request_id.to_string()))
        }
    }

    /// Whether `spec` asks for the same delegation as this record.
    fn same(&self, spec: &NewDelegation, callee: &PeerId) -> bool {
        if &self.callee != callee {
            return false;
        }
        // The trace id is not part of the request's identity: a retry in
        // another trace is the same delegation, which keeps its first trace.
        let same_parent = |p: &ParentContext| {
            p.agent == spec.parent.agent && p.execution_id == spec.parent.execution_id
        };
        match &self.spec {
            Some(s) => {
                s.task == spec.task
                    && s.capabilities == spec.capabilities
                    && s.read_only == spec.read_only
                    && s.deadline == spec.deadline
                    && s.budgets == spec.budgets
                    && same_parent(&s.parent)
            }
            None => {
                let r = &self.request;
                r.task == spec.task
                    && r.capabilities == spec.capabilities
                    && r.read_only == spec.read_only
                    && r.budgets == spec.budgets
                    && same_parent(&r.parent)
            }
        }
    }

    /// The record of a delegation saved by an earlier process.
    fn from_saved(s: SavedDelegation) -> Self {
        CallerRecord {
            finished: false,
            callee: s.callee,
            spec: None,
            request: s.request,
            request_digest: s.request_digest,
            envelope: s.envelope,
            saving: None,
        }
    }

    /// What a finished record weighs against the retention's byte budget:
    /// the length of its state record's JSON (the record in memory holds the
    /// same request and envelope).
    fn weight(&self, key: &DelegationKey) -> u64 {
        saved_weight(&self.saved(key, 0, true))
    }

    fn saved(&self, key: &DelegationKey, cursor: u64, finished: bool) -> SavedDelegation {
        SavedDelegation {
            key: key.clone(),
            callee: self.callee.clone(),
            envelope: self.envelope.clone(),
            request: self.request.clone(),
            request_digest: self.request_digest,
            cursor,
            finished,
        }
    }
}

/// How many finished delegations the caller keeps, and how many bytes they
/// may weigh together (the caller's record of finished delegations).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FinishedRetention {
    /// Finished delegations kept; past this the oldest is forgotten.
    pub max_finished: usize,
    /// Bytes the kept finished delegations may weigh together (each weighs
    /// the length of its state record's JSON); past this the oldest is
    /// forgotten.
    pub max_finished_bytes: u64,
}

impl Default for FinishedRetention {
    /// The link's defaults: 1,000 delegations, 8 MiB.
    fn default() -> Self {
        FinishedRetention {
            max_finished: crate::link::DEFAULT_MAX_FINISHED,
            max_finished_bytes: crate::link::DEFAULT_MAX_FINISHED_BYTES,
        }
    }
}

/// The caller's per-delegation records and the retention of finished ones.
///
/// A record is added by `delegate` (or `reattach` after a restart) and
/// stays while the delegation is open. When its end (the terminal, or a
/// refusal or gap that ends its event stream) is handed to the application
/// through [`Caller::events`], or the terminal is committed with
/// [`Caller::commit`], the delegation joins `finished`, newest last. The
/// oldest finished delegations are forgotten while more than
/// `max_finished` are kept or they weigh more than `max_finished_bytes`
/// together: the record is removed and the state record removed. Finished
/// delegations restored from the state folder (files only, no record) take
/// part in the same list.
#[derive(Debug, Default)]
struct Records {
    /// Open delegations, and finished ones still in `finished`. Pruned when
    /// their key leaves `finished`.
    map: HashMap<DelegationKey, CallerRecord>,
    /// Finished delegations, oldest first, with the bytes each weighs.
    /// Bounded by `retention`; overflow forgets the oldest.
    finished: VecDeque<(DelegationKey, u64)>,
    /// Sum of the bytes in `finished`.
    finished_bytes: u64,
    retention: FinishedRetention,
}

impl Records {
    /// Adds `key` to the finished list; returns the delegations that aged
    /// out (their records are already removed; their state records are the
    /// caller's to delete).
    fn finish(&mut self, key: &DelegationKey, bytes: u64) -> Vec<DelegationKey> {
        self.finished.push_back((key.clone(), bytes));
        self.finished_bytes = self.finished_bytes.saturating_add(bytes);
        let mut gone = Vec::new();
        while self.finished.len() > self.retention.max_finished
            || (self.finished_bytes > self.retention.max_finished_bytes && self.finished.len() > 1)
        {
            let Some((old, b)) = self.finished.pop_front() else {
                break;
            };
            self.finished_bytes = self.finished_bytes.saturating_sub(b);
            match self.map.get(&old) {
                // Taken back by a re-sent request since: it stays, and so
                // does its state record, until it finishes again.
                Some(r) if !r.finished => {}
                Some(_) => {
                    self.map.remove(&old);
                    gone.push(old);
                }
                None => gone.push(old),
            }
        }
        gone
    }
}

/// What a saved delegation weighs: the length of its state record's JSON.
fn saved_weight(saved: &SavedDelegation) -> u64 {
    serde_json::to_vec(saved).map_or(0, |b| u64::try_from(b.len()).unwrap_or(u64::MAX))
}

/// An unfinished delegation whose deadline passed longer ago than this is
/// not taken back by [`Caller::restore`]; its state record is removed. The
/// relay keeps a finished delegation readable for a day by default
/// (`finished_ttl_ms`), so after this long it no longer holds the terminal.
pub const STALE_AFTER_DEADLINE: Duration = Duration::from_secs(24 * 3600);

/// A stream of events.
pub type EventStream = Pin<Box<dyn Stream<Item = Result<DelegationEvent, EventError>> + Send>>;

/// The caller side of a connector.
#[derive(Debug, Clone)]
pub struct Caller {
    link: LinkHandle,
    identity: Arc<Identity>,
    /// The peers' keys; a configuration reload replaces them.
    trust: Arc<crate::profile::PeerKeys>,
    /// What this host may delegate; a configuration reload replaces it.
    grant: Arc<ArcSwap<Grant>>,
    /// This host's policy for what it sends; a reload replaces it.
    policy: Arc<ArcSwap<Policy>>,
    /// Per-delegation records; see [`Records`] for who prunes them.
    records: Arc<Mutex<Records>>,
    state: Option<FileState>,
    audit: Arc<dyn AuditSink>,
}

/// Moves a delegation's record to the finished list when the event stream
/// that handed its end to the application is done with (polled past the end
/// or dropped).
struct FinishGuard {
    records: Arc<Mutex<Records>>,
    state: Option<FileState>,
    key: DelegationKey,
    /// The end was yielded.
    armed: bool,
    /// The end was a refusal: the relay holds nothing of the delegation (or
    /// it could not be sent at all), so its state record is removed too and
    /// a restart does not send it again.
    refused: bool,
}

impl Drop for FinishGuard {
    fn drop(&mut self) {
        if self.armed {
            finish_record(&self.records, self.state.as_ref(), &self.key);
            if let (true, Some(state)) = (self.refused, &self.state) {
                state.remove_later(&self.key);
            }
        }
    }
}

/// Moves `key`'s record to the finished list (once) and forgets the
/// finished delegations that aged out: their records are dropped and their
/// state records removed. A key without a record (forgotten already, or never
/// this caller's) is left alone.
fn finish_record(records: &Mutex<Records>, state: Option<&FileState>, key: &DelegationKey) {
    let gone = move_to_finished(records, key);
    // Not waited for (a drop calls this): a removal lost in a crash is
    // made again by the next `restore`, which applies the retention.
    if let Some(state) = state {
        for old in gone {
            state.remove_later(&old);
        }
    }
}

/// Moves `key`'s record to the finished list (once); returns the
/// delegations that aged out (their records are dropped, their state
/// records are the caller's to remove).
fn move_to_finished(records: &Mutex<Records>, key: &DelegationKey) -> Vec<DelegationKey> {
    let mut records = records.lock();
    let Some(rec) = records.map.get_mut(key) else {
        return Vec::new();
    };
    if rec.finished {
        return Vec::new();
    }
    rec.finished = true;
    let bytes = rec.weight(key);
    records.finish(key, bytes)
}

/// Parses an up-log event into what the caller sees.
pub fn parse_event(ev: &UpEvent) -> DelegationEvent {
    let kind = if let Some(outcome) = ev.terminal {
        if ev.relay_origin {
            let reason = serde_json::from_slice::<Value>(&ev.payload)
                .ok()
                .and_then(|v| v.get("reason").and_then(Value::as_str).map(str::to_string));
            EventKind::Terminal(Terminal {
                outcome,
                relay_origin: true,
                envelope: None,
                reason,
            })
        } else {
            let envelope = match serde_json::from_slice::<UpPayload>(&ev.payload) {
                Ok(UpPayload::Result { envelope }) => serde_json::to_vec(&envelope)
                    .ok()
                    .and_then(|b| Envelope::from_json(&b).ok()),
                _ => None,
            };
            EventKind::Terminal(Terminal {
                outcome,
                relay_origin: false,
                envelope,
                reason: None,
            })
        }
    } else {
        match serde_json::from_slice::<UpPayload>(&ev.payload) {
            Ok(UpPayload::Accepted { task_id }) => EventKind::Accepted { task_id },
            Ok(UpPayload::Status {
                state,
                message,
                data,
            }) => EventKind::Status {
                state,
                message,
                data,
            },
            Ok(UpPayload::Artifact {
                artifact,
                append,
                last_chunk,
            }) => EventKind::Artifact {
                artifact,
                append,
                last_chunk,
            },
            _ => EventKind::Unrecognised(ev.payload.clone()),
        }
    };
    DelegationEvent { seq: ev.seq, kind }
}

impl Caller {
    /// Replaces what this host may delegate and its policy for what it
    /// sends (a configuration reload); delegations already sent keep theirs.
    pub(crate) fn set_authority(&self, grant: Grant, policy: Policy) {
        self.grant.store(Arc::new(grant));
        self.policy.store(Arc::new(policy));
    }

    pub(crate) fn new(
        link: LinkHandle,
        identity: Arc<Identity>,
        trust: Arc<crate::profile::PeerKeys>,
        grant: Grant,
        policy: Policy,
        state: Option<FileState>,
        audit: Arc<dyn AuditSink>,
    ) -> Self {
        Caller {
            link,
            identity,
            trust,
            grant: Arc::new(ArcSwap::from_pointee(grant)),
            policy: Arc::new(ArcSwap::from_pointee(policy)),
            records: Arc::new(Mutex::new(Records::default())),
            state,
            audit,
        }
    }

    /// Keeps finished delegations within `retention` (the default is
    /// [`FinishedRetention::default`]).
    pub(crate) fn with_retention(self, retention: FinishedRetention) -> Self {
        self.records.lock().retention = retention;
        self
    }

    /// The signed request of a delegation this connector started (or
    /// restored).
    pub fn request(&self, handle: &DelegationHandle) -> Option<DelegationRequest> {
        self.records
            .lock()
            .map
            .get(&handle.key)
            .map(|r| r.request.clone())
    }

    /// The link this caller's delegations go out on.
    pub fn link(&self) -> &LinkHandle {
        &self.link
    }

    /// The state folder, when delegations are persisted.
    pub fn state_dir(&self) -> Option<&std::path::Path> {
        self.state.as_ref().map(FileState::dir)
    }

    /// Resumes every unfinished delegation saved in the state folder (after a
    /// restart): the open is resent (the relay de-duplicates it) and the up
    /// log resumes after the committed cursor. Returns their handles.
    ///
    /// Cleans the folder first: finished delegations join the finished list
    /// (newest kept, within the retention; the records of older ones are
    /// removed), an unfinished one whose deadline passed more than
    /// [`STALE_AFTER_DEADLINE`] ago is removed (the relay no longer holds
    /// it), with one sync for all of them; temporary files an earlier
    /// version's crash left behind are deleted.
    pub async fn restore(&self) -> Result<Vec<DelegationHandle>, CallerError> {
        let Some(state) = &self.state else {
            return Ok(Vec::new());
        };
        let state_err = |e: crate::state::StateError| CallerError::State(e.to_string());
        state.remove_temporaries().map_err(state_err)?;
        let saved = state.load_all().map_err(state_err)?;
        let stale_before = now_ms()
            .saturating_sub(u64::try_from(STALE_AFTER_DEADLINE.as_millis()).unwrap_or(u64::MAX));
        let (mut finished, open): (Vec<_>, Vec<_>) = saved.into_iter().partition(|s| s.finished);
        finished.sort_by_key(|s| s.request.issued_ms);
        let mut gone = Vec::new();
        for s in &finished {
            gone.extend(self.records.lock().finish(&s.key, saved_weight(s)));
        }
        let (stale, open): (Vec<_>, Vec<_>) = open
            .into_iter()
            .partition(|s| s.request.deadline_ms < stale_before);
        gone.extend(stale.into_iter().map(|s| s.key));
        // One sync for all of them.
        state.remove_many(&gone).await.map_err(state_err)?;
        let mut handles = Vec::new();
        for s in open {
            handles.push(self.reattach(s).await?);
        }
        Ok(handles)
    }

    /// Takes a saved delegation back into this connector: its record, and
    /// its open resent to the relay (which holds it already, or creates it
    /// if the first open never arrived), with the up log resumed after the
    /// saved cursor once the open is acknowledged.
    async fn reattach(&self, s: SavedDelegation) -> Result<DelegationHandle, CallerError> {
        let payload = Bytes::from(s.envelope.clone());
        let open = Open {
            key: s.key.clone(),
            target: s.callee.clone(),
            deadline_ms: s.request.deadline_ms,
            depth: s.request.depth,
            digest: Digest::of(&payload),
            ceiling: String::new(),
            trace: Some(TraceId::of_text(&s.request.parent.trace_id)),
            payload,
        };
        let cursor = if s.finished { 0 } else { s.cursor };
        let handle = DelegationHandle {
            key: s.key.clone(),
            callee: s.callee.clone(),
        };
        self.records
            .lock()
            .map
            .insert(s.key.clone(), CallerRecord::from_saved(s));
        let (reply, _ignored) = oneshot::channel();
        self.link
            .command(Command::Open {
                open,
                cursor,
                existing: true,
                reply,
            })
            .await?;
        Ok(handle)
    }

    /// Records that the application finished processing `event`: after a
    /// restart, events resume after it. Returns once that is durable (the
    /// state writer syncs it, together with whatever other delegations
    /// committed meanwhile; no runtime thread waits on the disk). Without a
    /// state folder nothing is recorded.
    ///
    /// Committing the terminal also releases the delegation at the relay
    /// ([`LinkHandle::release`]): it keeps only the outcome from then on,
    /// so commit the terminal once nothing more is needed from the
    /// delegation's events.
    pub async fn commit(
        &self,
        handle: &DelegationHandle,
        event: &DelegationEvent,
    ) -> Result<(), CallerError> {
        let finished = matches!(event.kind, EventKind::Terminal(_));
        let Some(state) = &self.state else {
            if finished {
                self.release(handle, event).await;
            }
            return Ok(());
        };
        let saved = self
            .records
            .lock()
            .map
            .get(&handle.key)
            .map(|rec| rec.saved(&handle.key, event.seq, finished))
            .ok_or_else(|| CallerError::UnknownDelegation(handle.key.to_string()))?;
        // At the terminal the delegation joins the finished list (as the
        // event stream that yielded it does), and the oldest finished ones
        // beyond the retention are forgotten: their state records are
        // removed in the same sync as this save, so the folder is within the
        // retention when this returns.
        let gone = if finished {
            move_to_finished(&self.records, &handle.key)
        } else {
            Vec::new()
        };
        state
            .save_and_remove(&saved, &gone)
            .await
            .map_err(|e| CallerError::State(e.to_string()))?;
        if finished {
            self.release(handle, event).await;
        }
        Ok(())
    }

    /// The terminal `event` is processed (and recorded, with a state
    /// folder): the relay may compact the delegation
    /// ([`LinkHandle::release`]). Best effort: a stopped link changes
    /// nothing (retention drops the delegation whole).
    async fn release(&self, handle: &DelegationHandle, event: &DelegationEvent) {
        if let Err(e) = self.link.release(&handle.key, event.seq).await {
            tracing::debug!(key = %handle.key, error = %e, "release not sent");
        }
    }

    /// How many delegations the caller holds a record of (open ones, and
    /// finished ones within the retention).
    pub fn records_held(&self) -> usize {
        self.records.lock().map.len()
    }

    /// How many delegations the link holds (open ones, and finished ones
    /// within the retention).
    pub async fn link_delegations_held(&self) -> Result<usize, CallerError> {
        Ok(self.link.delegations_held().await?)
    }

    /// Delegates a task to `peer`. Returns as soon as the open is queued: the
    /// relay may be unreachable right now; the link delivers it when it can.
    /// A refusal by the relay arrives as an error on [`Caller::events`].
    pub async fn delegate(
        &self,
        peer: &PeerId,
        spec: NewDelegation,
    ) -> Result<DelegationHandle, CallerError> {
        self.delegate_at_depth(peer, spec, 1).await
    }

    /// [`Caller::delegate`] for a delegation `depth` deep (1: a direct
    /// one). Deeper ones are what the OpenAB endpoint starts for a worker
    /// runtime that names the delegation it serves as parent; this host's
    /// `[policy] max_depth`, the relay route's and the callee's must all
    /// allow the depth, else it is refused (`depth_exceeded`).
    pub async fn delegate_at_depth(
        &self,
        peer: &PeerId,
        spec: NewDelegation,
        depth: u8,
    ) -> Result<DelegationHandle, CallerError> {
        // An executor serving a delegation in this process cannot delegate
        // further, at any depth.
        if crate::callee::serving().is_some() {
            return Err(AuthorityError::NestedDelegation.into());
        }
        let request_id = match &spec.request_id {
            Some(r) => r.clone(),
            None => RequestId::new(&format!("req-{}", oab_wire::InstanceId::random().to_hex()))
                .map_err(|e| ProfileError::Malformed(e.to_string()))?,
        };
        let key = DelegationKey::new(self.identity.peer.clone(), request_id.clone());
        let found = self
            .records
            .lock()
            .map
            .get(&key)
            .map(|rec| rec.existing(&key, &spec, peer));
        if let Some(found) = found {
            return settle(found).await;
        }
        // Started by an earlier process of this connector (and finished
        // before this one restored what was open): the same request is the
        // same delegation, re-attached; its events come again from the relay.
        if let Some(state) = &self.state
            && let Some(saved) = state
                .load(&key)
                .map_err(|e| CallerError::State(e.to_string()))?
        {
            return if CallerRecord::from_saved(saved.clone()).same(&spec, peer) {
                self.reattach(saved).await
            } else {
                Err(CallerError::IdempotencyMismatch(request_id.to_string()))
            };
        }
        let now = now_ms();
        let deadline_ms =
            now.saturating_add(u64::try_from(spec.deadline.as_millis()).unwrap_or(u64::MAX));
        let request = DelegationRequest {
            v: PROFILE_VERSION,
            request_id: request_id.clone(),
            caller: self.identity.peer.clone(),
            callee: peer.clone(),
            nonce: Nonce::random(),
            issued_ms: now,
            task: spec.task.clone(),
            capabilities: spec.capabilities.clone(),
            depth,
            read_only: spec.read_only,
            deadline_ms,
            budgets: spec.budgets,
            parent: spec.parent.clone(),
        };
        // Fail closed before anything leaves this host.
        let (grant, policy) = (self.grant.load(), self.policy.load());
        if let Err(e) = authorize_outgoing(&grant, &policy, &request, None, now) {
            self.audit.record(
                &AuditRecord::refused(now, Side::Caller, &key, e.code()).with_callee(peer.clone()),
            );
            return Err(e.into());
        }
        let spec_caps = request.capabilities.clone();
        let envelope = sign_request(&self.identity, &request);
        let envelope_text = String::from_utf8(envelope.to_json()).unwrap_or_default();
        let payload = Bytes::from(envelope_text.clone());
        let request_digest = envelope.payload_digest();
        // Refused before anything is saved or sent: the relay would not
        // take it (the link refuses it too, and never sends it).
        let limit = self.link.max_payload();
        if payload.len() > limit {
            return Err(LinkError::TooLarge {
                part: "payload",
                size: u64::try_from(payload.len()).unwrap_or(u64::MAX),
                limit: u64::try_from(limit).unwrap_or(u64::MAX),
            }
            .into());
        }
        let trace = TraceId::of_text(&request.parent.trace_id);
        let open = Open {
            key: key.clone(),
            target: peer.clone(),
            deadline_ms,
            depth,
            digest: Digest::of(&payload),
            ceiling: String::new(),
            trace: Some(trace),
            payload,
        };
        // The record claims the request id (a concurrent call with the same
        // id finds it and waits for its save); the save itself runs without
        // the records lock.
        let claim = {
            let mut records = self.records.lock();
            if let Some(rec) = records.map.get(&key) {
                // A concurrent call with the same request id won the race.
                Err(rec.existing(&key, &spec, peer))
            } else {
                let mut rec = CallerRecord {
                    finished: false,
                    callee: peer.clone(),
                    spec: Some(spec),
                    request,
                    request_digest,
                    envelope: envelope_text,
                    saving: None,
                };
                let to_save = self.state.as_ref().map(|_| {
                    let (tx, rx) = watch::channel(None);
                    rec.saving = Some(rx);
                    (rec.saved(&key, 0, false), tx)
                });
                records.map.insert(key.clone(), rec);
                Ok(to_save)
            }
        };
        let to_save = match claim {
            Ok(to_save) => to_save,
            Err(found) => return settle(found).await,
        };
        // Durable before the open leaves, so a crash right after still
        // resumes it.
        if let (Some(state), Some((saved, saved_tx))) = (&self.state, to_save) {
            let mut unclaim = Unclaim {
                records: &self.records,
                key: &key,
                armed: true,
            };
            if let Err(e) = state.save(&saved).await {
                drop(unclaim);
                let _ignored = saved_tx.send(Some(false));
                return Err(CallerError::State(e.to_string()));
            }
            unclaim.armed = false;
            if let Some(rec) = self.records.lock().map.get_mut(&key) {
                rec.saving = None;
            }
            let _ignored = saved_tx.send(Some(true));
        }
        self.audit.record(
            &AuditRecord::new(now, Side::Caller, &key, AuditEvent::Opened)
                .with_callee(peer.clone())
                .with_request_digest(request_digest)
                .with_capabilities(spec_caps),
        );
        let (reply, _ignored) = oneshot::channel();
        self.link
            .command(Command::Open {
                open,
                cursor: 0,
                existing: false,
                reply,
            })
            .await?;
        tracing::info!(%key, trace_id = %trace, callee = %peer, "delegation sent");
        Ok(DelegationHandle {
            key,
            callee: peer.clone(),
        })
    }

    /// Events after `after` (0 for all): first what this connector already
    /// holds, then live. A gap is an error item, never a silent skip.
    pub async fn events(
        &self,
        handle: &DelegationHandle,
        after: u64,
    ) -> Result<EventStream, CallerError> {
        let (tx, rx) = mpsc::channel(1024);
        self.link
            .command(Command::Subscribe {
                key: handle.key.clone(),
                after,
                tx,
            })
            .await?;
        let guard = FinishGuard {
            records: self.records.clone(),
            state: self.state.clone(),
            key: handle.key.clone(),
            armed: false,
            refused: false,
        };
        let stream = futures_util::stream::unfold(
            (rx, false, guard),
            |(mut rx, done, mut guard)| async move {
                if done {
                    return None;
                }
                let item = rx.recv().await?;
                let item = item.map(|ev| parse_event(&ev));
                // The end of the delegation (a lagged or stopped stream is
                // not one): the record moves to the finished list once the
                // application is done with this item (the stream is polled
                // again or dropped).
                guard.armed = matches!(
                    &item,
                    Ok(DelegationEvent {
                        kind: EventKind::Terminal(_),
                        ..
                    }) | Err(EventError::Refused { .. } | EventError::Gap { .. })
                );
                guard.refused = matches!(&item, Err(EventError::Refused { .. }));
                let end = guard.armed || item.is_err();
                Some((item, (rx, end, guard)))
            },
        );
        Ok(Box::pin(stream))
    }

    /// Where a delegation stands.
    pub async fn get(&self, handle: &DelegationHandle) -> Result<Snapshot, CallerError> {
        self.link
            .snapshot(&handle.key)
            .await?
            .ok_or_else(|| CallerError::UnknownDelegation(handle.key.to_string()))
    }

    /// Waits for the terminal, up to `timeout`.
    pub async fn wait(
        &self,
        handle: &DelegationHandle,
        timeout: Duration,
    ) -> Result<Terminal, CallerError> {
        use futures_util::StreamExt as _;
        let wait = async {
            // A subscriber that falls behind the events is dropped with
            // `Lagged`; only the terminal matters here, so it subscribes
            // again after the last event it got (each time at least one
            // channel's worth further), and after a lag whose events the
            // link no longer keeps, from the last one received.
            let (mut after, mut lagged) = (0, false);
            loop {
                let mut events = self.events(handle, after).await?;
                let mut again = None;
                while let Some(item) = events.next().await {
                    match item {
                        Ok(DelegationEvent {
                            kind: EventKind::Terminal(t),
                            ..
                        }) => return Ok(t),
                        Ok(ev) => after = ev.seq,
                        Err(EventError::Lagged { last }) => {
                            again = Some(last.max(after));
                            break;
                        }
                        Err(
                            e @ EventError::Gap {
                                reason: oab_wire::GapReason::Trimmed,
                                ..
                            },
                        ) if lagged => {
                            let next = self.get(handle).await?.received.saturating_sub(1);
                            if next <= after {
                                return Err(e.into());
                            }
                            again = Some(next);
                            break;
                        }
                        Err(e) => return Err(e.into()),
                    }
                }
                match again {
                    Some(next) => (after, lagged) = (next, true),
                    None => {
                        return Err(CallerError::Events(EventError::Stopped(
                            "event stream ended".into(),
                        )));
                    }
                }
            }
        };
        tokio::time::timeout(timeout, wait)
            .await
            .map_err(|_| CallerError::Timeout)?
    }

    /// Asks the callee to stop. The terminal (`cancelled`, or whatever won
    /// the race) arrives as an event; a cancel never guarantees `cancelled`.
    pub async fn cancel(&self, handle: &DelegationHandle, reason: &str) -> Result<(), CallerError> {
        let payload = Bytes::from(
            serde_json::to_vec(&CancelPayload {
                reason: reason.to_string(),
            })
            .unwrap_or_default(),
        );
        self.link
            .command(Command::Send {
                key: handle.key.clone(),
                kind: SendKind::Cancel,
                payload,
                acked: None,
            })
            .await?;
        Ok(())
    }

    /// Sends a follow-up message (e.g. the answer to `input-required`).
    pub async fn send_message(
        &self,
        handle: &DelegationHandle,
        message: Value,
    ) -> Result<(), CallerError> {
        let payload =
            Bytes::from(serde_json::to_vec(&DownPayload::Message { message }).unwrap_or_default());
        self.link
            .command(Command::Send {
                key: handle.key.clone(),
                kind: SendKind::Data,
                payload,
                acked: None,
            })
            .await?;
        Ok(())
    }

    /// The peers this host may reach, their online state and agent cards.
    pub async fn list_peers(&self) -> Result<Vec<PeerEntry>, CallerError> {
        let (reply, rx) = oneshot::channel();
        self.link.command(Command::Peers { reply }).await?;
        rx.await
            .map_err(|_| CallerError::Link(LinkError::Stopped("link task ended".into())))
    }

    /// Verifies a terminal's signed result against the callee's configured
    /// key and the request this connector signed. The relay is not trusted:
    /// a relay-originated terminal has no result and fails here.
    pub fn verify(
        &self,
        handle: &DelegationHandle,
        terminal: &Terminal,
    ) -> Result<VerifiedResult, CallerError> {
        let rec = self
            .records
            .lock()
            .map
            .get(&handle.key)
            .cloned()
            .ok_or_else(|| CallerError::UnknownDelegation(handle.key.to_string()))?;
        let envelope = terminal.envelope.as_ref().ok_or_else(|| {
            ProfileError::Malformed("no signed result (relay-originated terminal)".into())
        })?;
        let keys = self.trust.load_full();
        let result = verify_result(
            envelope,
            &rec.callee,
            &rec.request_digest,
            &rec.request.request_id,
            keys.as_ref(),
            now_ms(),
        )?;
        check_result_within_request(&result, &rec.request)?;
        if result.outcome != terminal.outcome {
            return Err(ProfileError::InvalidField {
                field: "outcome",
                reason: "signed outcome differs from the terminal frame",
            }
            .into());
        }
        Ok(VerifiedResult {
            key_id: envelope.claimed_key_id().clone(),
            result,
        })
    }
}
