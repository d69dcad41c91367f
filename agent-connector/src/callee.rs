//! The callee side: verifies, authorizes, reserves and runs delegations.
//!
//! For each `Open` the runtime owns this order, and nothing runs unless every
//! step passed:
//!
//! 1. **authenticate**: the request envelope verifies against the caller's
//!    configured key, and its signed fields match the `Open` header;
//! 2. **validate**: version, depth, no credential fields, deadline ahead;
//! 3. **intersect authority**: callee policy ∩ route ceiling ∩ requested,
//!    refusing (never narrowing) anything wider;
//! 4. **reserve**: a concurrency slot is free (else `saturated`, never an
//!    unbounded queue), then the request nonce is fresh (a replay, even
//!    under a new request id, is refused); only an admitted request takes a
//!    replay-cache entry, from its caller's share;
//! 5. **audit** the acceptance, then append `accepted` to the up log and wait
//!    until the relay acknowledged it (from then on a restart of this
//!    process ends the delegation `unknown` instead of running it twice);
//! 6. **execute** with an event sink, the caller's follow-up messages (at
//!    most [`MAX_PENDING_MESSAGES`] unread; one more fails the delegation), a
//!    cancel token and the deadline;
//! 7. sign the result and append it as the terminal.
//!
//! A refusal at steps 1-4 is answered with a signed `rejected` result.
//! Stop reasons map to outcomes: end of turn -> `completed`; refusal, limits
//! or error -> `failed`; deadline -> `expired`; cancel -> `cancelled`, sent
//! only after the executor returned (the worker stopped).
//!
//! Never: runs an executor for a request it has not verified
//! (`verify_open_request`), authorized (`authorize_incoming`), reserved (a
//! fresh nonce and two concurrency permits) and whose `accepted` event the
//! relay acknowledged. Never sends the terminal while the executor still runs:
//! at the deadline it cancels the run and waits for the executor to return.

use parking_lot::Mutex;
use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use bytes::Bytes;
use oab_wire::identity::{Identity, now_ms};
use oab_wire::{DelegationKey, Digest, ErrorCode, Open, Outcome, PeerId, TraceId};
use serde_json::Value;
use tokio::sync::{Semaphore, mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tracing::{Instrument as _, info, warn};

use crate::audit::{AuditEvent, AuditRecord, AuditSink, Side};
use crate::authority::{
    DelegationContext, EffectiveAuthority, Policy, RouteCeiling, authorize_incoming,
};
use crate::events::{DownPayload, UpPayload};
use crate::link::{Command, Incoming, LinkError, LinkHandle, SendKind};
use crate::nonce::{NonceCache, NonceCheck};
use crate::profile::{
    Artifact, DelegationRequest, DelegationResult, Executor, PROFILE_VERSION, SideEffect, Usage,
    sign_result, verify_open_request,
};
use crate::reattach::{CalleeJournal, CalleeRecord, Checkpoint};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

tokio::task_local! {
    static SERVING: DelegationKey;
}

/// The delegation the current task is serving, if any (depth one: such a
/// task cannot delegate further). Set for the executor's future; tasks it
/// spawns must not delegate either (the connector cannot see them).
pub fn serving() -> Option<DelegationKey> {
    SERVING.try_with(Clone::clone).ok()
}

/// Why an executor stopped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopReason {
    /// The agent finished its turn: `completed`.
    EndTurn,
    /// The agent refused the task: `failed`.
    Refusal(String),
    /// A budget or limit ran out: `failed`.
    LimitExceeded(String),
    /// The work failed: `failed`.
    Error(String),
    /// The deadline stopped the work: `expired`.
    Deadline,
    /// The cancel token stopped the work: `cancelled`.
    Cancelled,
    /// The agent declined the task before doing anything: `rejected`.
    Rejected(String),
    /// Whether the work happened cannot be told (after a restart, the
    /// agent no longer has the task): `unknown`.
    Lost(String),
}

impl StopReason {
    /// The outcome this stop reason maps to.
    pub fn outcome(&self) -> Outcome {
        match self {
            StopReason::EndTurn => Outcome::Completed,
            StopReason::Refusal(_) | StopReason::LimitExceeded(_) | StopReason::Error(_) => {
                Outcome::Failed
            }
            StopReason::Deadline => Outcome::Expired,
            StopReason::Cancelled => Outcome::Cancelled,
            StopReason::Rejected(_) => Outcome::Rejected,
            StopReason::Lost(_) => Outcome::Unknown,
        }
    }

    fn error(&self) -> Option<String> {
        match self {
            StopReason::Refusal(m) => Some(format!("refused: {m}")),
            StopReason::LimitExceeded(m) => Some(format!("limit exceeded: {m}")),
            StopReason::Error(m) => Some(m.clone()),
            StopReason::Deadline => Some(oab_wire::EXPIRED_REASON.into()),
            StopReason::Cancelled => Some("cancelled".into()),
            StopReason::Rejected(m) => Some(format!("rejected: {m}")),
            StopReason::Lost(m) => Some(m.clone()),
            StopReason::EndTurn => None,
        }
    }
}

/// What an executor returns.
#[derive(Debug, Clone, PartialEq)]
pub struct Execution {
    /// Why it stopped.
    pub stop: StopReason,
    /// Structured output.
    pub output: Option<Value>,
    /// Artifacts of the result.
    pub artifacts: Vec<Artifact>,
    /// Side effects caused (provenance).
    pub side_effects: Vec<SideEffect>,
    /// What it consumed.
    pub usage: Usage,
}

impl Execution {
    /// A bare execution that stopped for `stop`.
    pub fn stopped(stop: StopReason) -> Self {
        Execution {
            stop,
            output: None,
            artifacts: Vec::new(),
            side_effects: Vec::new(),
            usage: Usage::default(),
        }
    }
}

/// Sends events of one running delegation to the caller.
#[derive(Debug, Clone)]
pub struct EventSink {
    link: LinkHandle,
    key: DelegationKey,
    /// The up-log sequence of the last entry queued for this delegation.
    sent: Arc<AtomicU64>,
    /// Where checkpoints go, with what the runtime knows of the delegation
    /// (no state folder: `None`, and checkpoints do nothing).
    records: Option<Arc<Records>>,
}

/// A delegation's re-attach record as the runtime knows it; the executor
/// adds its state and the sequence at each checkpoint.
#[derive(Debug)]
struct Records {
    journal: CalleeJournal,
    base: CalleeRecord,
    /// A checkpoint was queued: the record is removed at the end.
    saved: AtomicBool,
}

impl EventSink {
    fn new(link: LinkHandle, key: DelegationKey, sent: u64, records: Option<Records>) -> Self {
        EventSink {
            link,
            key,
            sent: Arc::new(AtomicU64::new(sent)),
            records: records.map(Arc::new),
        }
    }

    /// Whether [`EventSink::checkpoint`] records anything (the connector has
    /// a state folder): an executor may skip building its state otherwise.
    pub fn checkpoints(&self) -> bool {
        self.records.is_some()
    }

    /// Saves what the executor needs to go on with this delegation after a
    /// restart of this process ([`TaskExecutor::reattach`] gets it back),
    /// as of just before the next event it sends; returns once it is
    /// durable (see [`crate::reattach`]). A failure is logged, and the
    /// delegation then ends `unknown` if this process restarts before a
    /// later checkpoint.
    pub async fn checkpoint(&self, state: Value) {
        let Some(r) = &self.records else {
            return;
        };
        let mut record = r.base.clone();
        record.up_seq = self.sent.load(Ordering::SeqCst).saturating_add(1);
        record.state = state;
        match r.journal.save(&record).await {
            Ok(()) => r.saved.store(true, Ordering::SeqCst),
            Err(e) => warn!(key = %self.key, error = %e, "could not save a re-attach checkpoint"),
        }
    }

    /// Forgets this delegation's re-attach record, if a checkpoint made one.
    fn forget(&self) {
        if let Some(r) = &self.records
            && r.saved.load(Ordering::SeqCst)
        {
            r.journal.remove_later(&self.key);
        }
    }

    async fn send(
        &self,
        payload: UpPayload,
        acked: Option<oneshot::Sender<Result<u64, LinkError>>>,
    ) -> Result<(), LinkError> {
        let payload = payload.to_bytes();
        // Refused here, so the executor learns it: the link refuses it too,
        // and a frame over the relay's limits never leaves.
        let limit = self.link.max_payload();
        if payload.len() > limit {
            return Err(LinkError::TooLarge {
                part: "payload",
                size: u64::try_from(payload.len()).unwrap_or(u64::MAX),
                limit: u64::try_from(limit).unwrap_or(u64::MAX),
            });
        }
        self.link
            .command(Command::Send {
                key: self.key.clone(),
                kind: SendKind::Data,
                payload,
                acked,
            })
            .await?;
        self.sent.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }

    /// Reports progress (an A2A state name such as `TASK_STATE_WORKING`).
    pub async fn status(
        &self,
        state: &str,
        message: Option<Value>,
        data: Option<Value>,
    ) -> Result<(), LinkError> {
        self.send(
            UpPayload::Status {
                state: state.to_string(),
                message,
                data,
            },
            None,
        )
        .await
    }

    /// Sends an artifact or a chunk of one.
    pub async fn artifact(
        &self,
        artifact: Artifact,
        append: bool,
        last_chunk: bool,
    ) -> Result<(), LinkError> {
        self.send(
            UpPayload::Artifact {
                artifact,
                append,
                last_chunk,
            },
            None,
        )
        .await
    }
}

/// One delegation handed to an executor.
#[derive(Debug)]
pub struct TaskRun {
    /// The delegation.
    pub key: DelegationKey,
    /// The A2A task id minted for it.
    pub task_id: String,
    /// The verified request.
    pub request: DelegationRequest,
    /// What it may do (checked, fail closed).
    pub authority: EffectiveAuthority,
    /// Where progress goes.
    pub sink: EventSink,
    /// Cancelled on a cancel from the caller, the relay, or the deadline.
    pub cancel: CancellationToken,
    /// Follow-up messages from the caller.
    pub messages: mpsc::Receiver<Value>,
    /// The serving context (depth one).
    pub context: DelegationContext,
}

/// Runs delegated tasks: OAB's prompt runner, or the A2A driver.
///
/// An executor keeps nothing per delegation after `execute` returns (or
/// after `discard`).
pub trait TaskExecutor: Send + Sync + 'static {
    /// Runs one task to its end. Must return soon after `run.cancel` fires.
    fn execute(&self, run: TaskRun) -> Pin<Box<dyn Future<Output = Execution> + Send + 'static>>;

    /// Goes on with a delegation this connector accepted before it
    /// restarted, from the executor's last [`EventSink::checkpoint`]: the
    /// work already started and must not start again. `None` (the default):
    /// this executor cannot, and the delegation ends `unknown`. The run's
    /// sink sends the next event after what the relay holds.
    fn reattach(
        &self,
        run: TaskRun,
        checkpoint: Checkpoint,
    ) -> Option<Pin<Box<dyn Future<Output = Execution> + Send + 'static>>> {
        let _ = (run, checkpoint);
        None
    }

    /// The delegation ended elsewhere (the relay reports it finished or
    /// gone); drop anything kept for it.
    fn discard(&self, _key: &DelegationKey) {}
}

/// Which policy applies to delegations from a caller.
pub trait PolicyProvider: Send + Sync + 'static {
    /// The policy for `caller`, or `None` to refuse it outright.
    fn policy_for(&self, caller: &PeerId) -> Option<Policy>;
}

impl PolicyProvider for Policy {
    fn policy_for(&self, _caller: &PeerId) -> Option<Policy> {
        Some(self.clone())
    }
}

/// One policy for every caller that a configuration reload can replace
/// ([`LivePolicy::set`]): delegations verified after the swap are
/// authorized against the new policy, running ones keep the authority they
/// were given.
#[derive(Debug)]
pub struct LivePolicy(arc_swap::ArcSwap<Policy>);

impl LivePolicy {
    /// Starts with `policy`.
    pub fn new(policy: Policy) -> Self {
        LivePolicy(arc_swap::ArcSwap::from_pointee(policy))
    }

    /// Replaces the policy.
    pub fn set(&self, policy: Policy) {
        self.0.store(Arc::new(policy));
    }
}

impl PolicyProvider for LivePolicy {
    fn policy_for(&self, _caller: &PeerId) -> Option<Policy> {
        Some(Policy::clone(&self.0.load()))
    }
}

/// Callee-side settings.
#[derive(Clone)]
pub struct CalleeOptions {
    /// The executor.
    pub executor: Arc<dyn TaskExecutor>,
    /// Policies per caller.
    pub policy: Arc<dyn PolicyProvider>,
    /// Delegations running at once.
    pub max_concurrent: usize,
    /// Delegations running at once per caller.
    pub max_concurrent_per_peer: usize,
    /// Requests remembered per caller against replays, live until they can
    /// no longer be accepted; a caller whose share is full is refused
    /// `saturated` (see [`crate::nonce`]). Default
    /// [`NonceCache::DEFAULT_PER_CALLER`].
    pub max_live_requests_per_peer: usize,
    /// The replay window, ms: a request issued longer ago is refused
    /// `stale_request` whatever its deadline, and no request is remembered
    /// longer. Default [`NonceCache::DEFAULT_MAX_AGE_MS`] (10 minutes).
    pub replay_window_ms: u64,
}

impl std::fmt::Debug for CalleeOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CalleeOptions")
            .field("max_concurrent", &self.max_concurrent)
            .field("max_concurrent_per_peer", &self.max_concurrent_per_peer)
            .field(
                "max_live_requests_per_peer",
                &self.max_live_requests_per_peer,
            )
            .field("replay_window_ms", &self.replay_window_ms)
            .finish_non_exhaustive()
    }
}

/// Follow-up messages kept per delegation until its executor reads them
/// (the `TaskRun::messages` channel). Overflow policy: a follow-up that
/// finds the queue full fails that delegation (its run is cancelled and it
/// ends `failed`, "limit exceeded: follow-up messages ..."); the runtime
/// never waits for an executor, so the link and every other delegation go
/// on. Memory: at most this many times the relay's `limits.max_payload` per
/// delegation.
pub const MAX_PENDING_MESSAGES: usize = 64;

struct Running {
    /// The delegation's span (its key, and its trace id once the request
    /// verified): the lines about it logged outside its task use it too.
    span: tracing::Span,
    cancel: CancellationToken,
    messages: mpsc::Sender<Value>,
    /// Set when a follow-up found `messages` full (the run is cancelled).
    overflowed: Arc<std::sync::atomic::AtomicBool>,
}

/// What the callee runtime holds right now (for operators and tests): every
/// count returns to its idle size once delegations finished and their
/// requests aged out of the replay window.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CalleeFootprint {
    /// Delegations registered (from their `Open` until their serving task
    /// ends).
    pub running: usize,
    /// Live replay-cache entries (until the request can no longer be
    /// accepted).
    pub nonces: usize,
}

/// What a delegation's serving task receives when its `Open` is
/// registered: the cancel token and the caller's messages, live from the
/// moment the `Open` arrived, so a cancel or a message that follows it at
/// once is never lost while the request is checked and accepted.
struct Registered {
    cancel: CancellationToken,
    messages: mpsc::Receiver<Value>,
    overflowed: Arc<std::sync::atomic::AtomicBool>,
    _entry: RunningEntry,
}

/// Removes a delegation's entry from `running` when its serving task ends,
/// however it ends.
struct RunningEntry {
    rt: Arc<CalleeRuntime>,
    key: DelegationKey,
}

impl Drop for RunningEntry {
    fn drop(&mut self) {
        self.rt.running.lock().remove(&self.key);
    }
}

/// A delegation being run, as [`CalleeRuntime::run_to_end`] needs it.
struct Serving {
    key: DelegationKey,
    task_id: String,
    digest: Digest,
    started_ms: u64,
    deadline_ms: u64,
    authority: EffectiveAuthority,
    sink: EventSink,
    cancel: CancellationToken,
    overflowed: Arc<AtomicBool>,
}

/// The callee runtime: consumes what the link receives for this peer.
pub(crate) struct CalleeRuntime {
    pub(crate) link: LinkHandle,
    pub(crate) identity: Arc<Identity>,
    pub(crate) trust: Arc<crate::profile::PeerKeys>,
    pub(crate) options: Option<CalleeOptions>,
    pub(crate) audit: Arc<dyn AuditSink>,
    /// Delegations being served, from their `Open` until their serving
    /// task ends (pruned by [`RunningEntry`]); at most one entry per
    /// concurrent `Open`, refused or not.
    running: Mutex<HashMap<DelegationKey, Running>>,
    /// Replay cache: filled only for admitted requests (after the
    /// concurrency permits), pruned when a request can no longer be
    /// accepted; each configured caller has its own share.
    nonces: Mutex<NonceCache>,
    global: Arc<Semaphore>,
    /// One semaphore per caller that passed verification: bounded by the
    /// configured peers, never pruned (a few dozen bytes each).
    per_peer: Mutex<HashMap<PeerId, Arc<Semaphore>>>,
    /// The state folder's re-attach records (see [`crate::reattach`]).
    journal: Option<CalleeJournal>,
    /// Records read at start, taken when their delegation's `Open` comes
    /// back ([`Incoming::Reopened`]).
    restored: Mutex<HashMap<DelegationKey, CalleeRecord>>,
}

impl std::fmt::Debug for CalleeRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CalleeRuntime")
            .field("peer", &self.identity.peer)
            .field("footprint", &self.footprint())
            .finish_non_exhaustive()
    }
}

/// A refusal before acceptance: the code goes into the signed result.
struct Refusal {
    code: &'static str,
    message: String,
}

impl CalleeRuntime {
    pub(crate) fn new(
        link: LinkHandle,
        identity: Arc<Identity>,
        trust: Arc<crate::profile::PeerKeys>,
        options: Option<CalleeOptions>,
        audit: Arc<dyn AuditSink>,
        reattach: Option<(CalleeJournal, Vec<CalleeRecord>)>,
    ) -> Arc<Self> {
        let global = options.as_ref().map_or(1, |o| o.max_concurrent.max(1));
        // A share per configured caller, and room for all of them: one
        // caller filling its share never refuses another.
        let per_caller = options
            .as_ref()
            .map_or(NonceCache::DEFAULT_PER_CALLER, |o| {
                o.max_live_requests_per_peer.max(1)
            });
        let window = options
            .as_ref()
            .map_or(NonceCache::DEFAULT_MAX_AGE_MS, |o| {
                o.replay_window_ms.max(1)
            });
        let nonces = NonceCache::new(
            per_caller.saturating_mul(trust.load().len().max(1)),
            window,
            NonceCache::DEFAULT_MAX_SKEW_MS,
        )
        .with_per_caller(per_caller);
        Arc::new(CalleeRuntime {
            link,
            identity,
            trust,
            options,
            audit,
            running: Mutex::new(HashMap::new()),
            nonces: Mutex::new(nonces),
            global: Arc::new(Semaphore::new(global)),
            per_peer: Mutex::new(HashMap::new()),
            restored: Mutex::new(restored_records(reattach.as_ref())),
            journal: reattach.map(|(journal, _)| journal),
        })
    }

    /// Consumes the link's incoming channel until it closes.
    pub(crate) async fn run(self: Arc<Self>, mut incoming: mpsc::Receiver<Incoming>) {
        while let Some(item) = incoming.recv().await {
            match item {
                Incoming::Open(open) => {
                    let Some((registered, span)) = self.register(&open.key) else {
                        // Redelivered while it is being served: nothing to do.
                        continue;
                    };
                    let rt = self.clone();
                    tokio::spawn(async move { rt.serve(open, registered).await }.instrument(span));
                }
                Incoming::Reopened { open, up } => {
                    let Some((registered, span)) = self.register(&open.key) else {
                        continue;
                    };
                    let rt = self.clone();
                    tokio::spawn(
                        async move { rt.reattach(open, up, registered).await }.instrument(span),
                    );
                }
                Incoming::Cancel {
                    key, relay_origin, ..
                } => {
                    if let Some(r) = self.running.lock().get(&key) {
                        info!(parent: &r.span, relay_origin, "cancel requested");
                        self.audit.record(&AuditRecord::new(
                            now_ms(),
                            Side::Callee,
                            &key,
                            AuditEvent::CancelRequested,
                        ));
                        r.cancel.cancel();
                    }
                }
                Incoming::Message { key, payload, .. } => {
                    let Ok(DownPayload::Message { message }) = serde_json::from_slice(&payload)
                    else {
                        continue;
                    };
                    // Never waits: a full queue fails this one delegation.
                    let running = self.running.lock();
                    let Some(r) = running.get(&key) else {
                        continue;
                    };
                    if let Err(mpsc::error::TrySendError::Full(_)) = r.messages.try_send(message)
                        && !r.overflowed.swap(true, std::sync::atomic::Ordering::SeqCst)
                    {
                        warn!(parent: &r.span, limit = MAX_PENDING_MESSAGES, "follow-up messages overflow; stopping the delegation");
                        r.cancel.cancel();
                    }
                }
                Incoming::Ended { key, terminal } => {
                    if let Some(r) = self.running.lock().get(&key) {
                        warn!(parent: &r.span, ?terminal, "delegation ended at the relay; stopping");
                        r.cancel.cancel();
                    }
                    if let Some(o) = &self.options {
                        o.executor.discard(&key);
                    }
                }
            }
        }
    }

    /// Registers a delegation whose `Open` arrived, before anything awaits;
    /// `None` when it is already being served. With it, the delegation's
    /// span, which its serving task runs in.
    fn register(self: &Arc<Self>, key: &DelegationKey) -> Option<(Registered, tracing::Span)> {
        let mut running = self.running.lock();
        if running.contains_key(key) {
            return None;
        }
        let span = tracing::info_span!("delegation", %key, trace_id = tracing::field::Empty);
        let cancel = CancellationToken::new();
        // Bounded (MAX_PENDING_MESSAGES, overflow fails the delegation);
        // emptied by the executor.
        let (tx, rx) = mpsc::channel(MAX_PENDING_MESSAGES);
        let overflowed = Arc::new(std::sync::atomic::AtomicBool::new(false));
        running.insert(
            key.clone(),
            Running {
                span: span.clone(),
                cancel: cancel.clone(),
                messages: tx,
                overflowed: overflowed.clone(),
            },
        );
        let registered = Registered {
            cancel,
            messages: rx,
            overflowed,
            _entry: RunningEntry {
                rt: self.clone(),
                key: key.clone(),
            },
        };
        Some((registered, span))
    }

    /// What the runtime holds now (expired replay-cache entries are
    /// purged first).
    pub(crate) fn footprint(&self) -> CalleeFootprint {
        let nonces = {
            let mut n = self.nonces.lock();
            n.purge(now_ms());
            n.len()
        };
        CalleeFootprint {
            running: self.running.lock().len(),
            nonces,
        }
    }

    /// Puts the trace id of a verified request on the current span (the
    /// delegation's) and on the link's record of it, so every line logged
    /// for it carries the same id as the caller's and the relay's lines.
    fn record_trace(&self, key: &DelegationKey, request: &DelegationRequest) {
        let trace = TraceId::of_text(&request.parent.trace_id);
        tracing::Span::current().record("trace_id", tracing::field::display(trace));
        self.link.note_trace(key, trace);
    }

    fn audit(&self, key: &DelegationKey, event: AuditEvent) -> AuditRecord {
        AuditRecord::new(now_ms(), Side::Callee, key, event)
    }

    async fn serve(self: Arc<Self>, open: Open, registered: Registered) {
        let key = open.key.clone();
        let started_ms = now_ms();
        let task_id = format!("task-{}", oab_wire::InstanceId::random().to_hex());
        self.audit.record(&self.audit(&key, AuditEvent::Received));
        let prepared = self.prepare(&open);
        let (verified, authority, permits) = match prepared {
            Ok(x) => x,
            Err((refusal, request_digest, request)) => {
                if refusal.code == "redelivery" {
                    return;
                }
                if let Some(r) = &request {
                    self.record_trace(&key, r);
                }
                warn!(code = refusal.code, message = %refusal.message, "delegation refused");
                self.audit.record(
                    &AuditRecord::refused(now_ms(), Side::Callee, &key, refusal.code)
                        .with_request_digest(request_digest),
                );
                let mut result = self.result(
                    &key,
                    &task_id,
                    request_digest,
                    Outcome::Rejected,
                    started_ms,
                );
                result.error = Some(format!("{}: {}", refusal.code, refusal.message));
                result.read_only = request.as_ref().is_none_or(|r| r.read_only);
                self.finish(&key, result).await;
                return;
            }
        };
        let digest = verified.request_digest;
        self.record_trace(&key, &verified.request);
        self.audit.record(
            &self
                .audit(&key, AuditEvent::Reserved)
                .with_request_digest(digest)
                .with_capabilities(authority.capabilities.clone()),
        );
        // Accepted, and durable at the relay, before anything runs.
        let records = self.journal.as_ref().map(|journal| Records {
            journal: journal.clone(),
            base: CalleeRecord {
                key: key.clone(),
                task_id: task_id.clone(),
                authority: authority.clone(),
                started_ms,
                up_seq: 0,
                state: Value::Null,
            },
            saved: AtomicBool::new(false),
        });
        let sink = EventSink::new(self.link.clone(), key.clone(), 0, records);
        let (ack_tx, ack_rx) = oneshot::channel();
        if sink
            .send(
                UpPayload::Accepted {
                    task_id: task_id.clone(),
                },
                Some(ack_tx),
            )
            .await
            .is_err()
        {
            return;
        }
        match ack_rx.await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => {
                warn!(error = %e, "acceptance not acknowledged; not executing");
                return;
            }
            Err(_) => return,
        }
        info!(caller = %key.caller, %task_id, "delegation accepted");
        self.audit.record(
            &self
                .audit(&key, AuditEvent::Accepted)
                .with_task_id(task_id.clone()),
        );
        let Some(options) = self.options.clone() else {
            return;
        };
        let Registered {
            cancel,
            messages: msg_rx,
            overflowed,
            _entry,
        } = registered;
        let run = TaskRun {
            key: key.clone(),
            task_id: task_id.clone(),
            request: verified.request.clone(),
            authority: authority.clone(),
            sink: sink.clone(),
            cancel: cancel.clone(),
            messages: msg_rx,
            context: DelegationContext::new(key.clone(), authority.clone()),
        };
        let work = if cancel.is_cancelled() {
            // Cancelled while it was being accepted: no worker was started.
            drop(run);
            None
        } else {
            self.audit.record(
                &self
                    .audit(&key, AuditEvent::Executing)
                    .with_task_id(task_id.clone()),
            );
            Some(options.executor.execute(run))
        };
        let serving = Serving {
            key,
            task_id,
            digest,
            started_ms,
            deadline_ms: verified.request.deadline_ms.min(authority.deadline_ms),
            authority,
            sink,
            cancel,
            overflowed,
        };
        self.run_to_end(serving, work, Some(permits)).await;
        drop(_entry);
    }

    /// Goes on with a delegation this process's instance accepted before a
    /// restart (its `Open` came back with `up` entries already in the up
    /// log): re-attached from its record by the executor, or ended
    /// `unknown`. Never runs it again.
    async fn reattach(self: Arc<Self>, open: Open, up: u64, registered: Registered) {
        let key = open.key.clone();
        let record = self.restored.lock().remove(&key);
        let executor = self.options.as_ref().map(|o| o.executor.clone());
        let Registered {
            cancel,
            messages,
            overflowed,
            _entry,
        } = registered;
        let (Some(record), Some(executor)) = (record, executor) else {
            warn!(
                up,
                "accepted before this process started, with no re-attach record: ending it unknown"
            );
            self.end_lost(
                &open,
                "the callee's connector restarted after accepting this delegation and kept no \
                 record of the agent's task (it may have run); side effects are unknown",
            )
            .await;
            return;
        };
        // The request as it was verified when it was accepted.
        let keys = self.trust.load_full();
        let verified = match verify_open_request(
            &open,
            &self.identity.peer,
            keys.as_ref(),
            record.started_ms,
        ) {
            Ok(v) => v,
            Err(e) => {
                warn!(error = %e, "the request of a delegation accepted before the restart no longer verifies: ending it unknown");
                self.end_lost(
                    &open,
                    &format!(
                        "the callee's connector restarted and could not verify the request \
                             again ({e}); side effects are unknown"
                    ),
                )
                .await;
                return;
            }
        };
        self.record_trace(&key, &verified.request);
        info!(up, task_id = %record.task_id, "re-attaching after a restart");
        self.audit.record(
            &self
                .audit(&key, AuditEvent::Executing)
                .with_task_id(record.task_id.clone()),
        );
        // Remembered against replays again (the cache did not survive the
        // restart); a refusal here changes nothing: the work is running.
        let _ = self.nonces.lock().check(
            &key,
            &verified.request,
            &verified.request_digest,
            now_ms(),
            record.authority.deadline_ms,
        );
        let checkpoint = Checkpoint {
            state: record.state.clone(),
            delivered: up >= record.up_seq,
        };
        let records = self.journal.as_ref().map(|journal| Records {
            journal: journal.clone(),
            base: CalleeRecord {
                up_seq: 0,
                state: Value::Null,
                ..record.clone()
            },
            // The record exists: it goes at the end.
            saved: AtomicBool::new(true),
        });
        let sink = EventSink::new(self.link.clone(), key.clone(), up, records);
        let run = TaskRun {
            key: key.clone(),
            task_id: record.task_id.clone(),
            request: verified.request.clone(),
            authority: record.authority.clone(),
            sink: sink.clone(),
            cancel: cancel.clone(),
            messages,
            context: DelegationContext::new(key.clone(), record.authority.clone()),
        };
        let serving = Serving {
            key,
            task_id: record.task_id,
            digest: verified.request_digest,
            started_ms: record.started_ms,
            deadline_ms: verified
                .request
                .deadline_ms
                .min(record.authority.deadline_ms),
            authority: record.authority,
            sink,
            cancel,
            overflowed,
        };
        let work = match executor.reattach(run, checkpoint) {
            Some(work) => work,
            None => Box::pin(async {
                Execution::stopped(StopReason::Lost(
                    "the callee's connector restarted and its executor cannot re-attach to \
                     running work; side effects are unknown"
                        .into(),
                ))
            }),
        };
        // Admitted before the restart: runs whether or not a slot is free
        // now, and holds one if it is.
        let permits = self.try_permits(&serving.key.caller);
        self.run_to_end(serving, Some(work), permits).await;
        drop(_entry);
    }

    /// Ends a delegation accepted before this process started that cannot
    /// be re-attached: `unknown`, signed, with `reason`.
    async fn end_lost(&self, open: &Open, reason: &str) {
        let keys = self.trust.load_full();
        let (digest, read_only) =
            match verify_open_request(open, &self.identity.peer, keys.as_ref(), now_ms()) {
                Ok(v) => (v.request_digest, v.request.read_only),
                Err(_) => (Digest::of(&open.payload), true),
            };
        let task_id = format!("task-{}", oab_wire::InstanceId::random().to_hex());
        let mut result = self.result(&open.key, &task_id, digest, Outcome::Unknown, now_ms());
        result.read_only = read_only;
        result.error = Some(reason.to_string());
        self.finish(&open.key, result).await;
    }

    /// Both concurrency permits, if both are free now.
    fn try_permits(
        &self,
        caller: &PeerId,
    ) -> Option<(
        tokio::sync::OwnedSemaphorePermit,
        tokio::sync::OwnedSemaphorePermit,
    )> {
        let per_caller = self.options.as_ref()?.max_concurrent_per_peer.max(1);
        let per_peer = self
            .per_peer
            .lock()
            .entry(caller.clone())
            .or_insert_with(|| Arc::new(Semaphore::new(per_caller)))
            .clone();
        let a = self.global.clone().try_acquire_owned().ok()?;
        let b = per_peer.try_acquire_owned().ok()?;
        Some((a, b))
    }

    /// Runs `work` (none: cancelled before it started) until it returns or
    /// the deadline stops it, then signs and sends the terminal.
    async fn run_to_end(
        &self,
        s: Serving,
        work: Option<Pin<Box<dyn Future<Output = Execution> + Send + 'static>>>,
        permits: Option<(
            tokio::sync::OwnedSemaphorePermit,
            tokio::sync::OwnedSemaphorePermit,
        )>,
    ) {
        let until = tokio::time::Instant::now()
            + std::time::Duration::from_millis(s.deadline_ms.saturating_sub(now_ms()));
        let mut deadline_hit = false;
        let execution = match work {
            None => Execution::stopped(StopReason::Cancelled),
            Some(work) => {
                let fut = SERVING.scope(s.key.clone(), work);
                tokio::pin!(fut);
                tokio::select! {
                    e = &mut fut => e,
                    () = tokio::time::sleep_until(until) => {
                        deadline_hit = true;
                        s.cancel.cancel();
                        // The worker must stop before the terminal is sent.
                        fut.await
                    }
                }
            }
        };
        drop(permits);
        self.running.lock().remove(&s.key);
        let stop = if s.overflowed.load(Ordering::SeqCst) {
            StopReason::LimitExceeded(format!(
                "follow_up_overflow: more than {MAX_PENDING_MESSAGES} follow-up messages were waiting to be read"
            ))
        } else if deadline_hit {
            StopReason::Deadline
        } else {
            execution.stop.clone()
        };
        let mut result = self.result(&s.key, &s.task_id, s.digest, stop.outcome(), s.started_ms);
        result.effective_capabilities = s.authority.capabilities.clone();
        result.read_only = s.authority.read_only;
        result.artifacts = execution.artifacts;
        result.side_effects = execution.side_effects;
        result.usage = execution.usage;
        result.output = execution.output;
        result.error = stop.error();
        let acked = self.finish(&s.key, result).await;
        if acked {
            s.sink.forget();
        }
    }

    // Internal: the refusal carries the request for the signed rejection.
    #[allow(clippy::type_complexity, clippy::result_large_err)]
    fn prepare(
        &self,
        open: &Open,
    ) -> Result<
        (
            crate::profile::VerifiedRequest,
            EffectiveAuthority,
            (
                tokio::sync::OwnedSemaphorePermit,
                tokio::sync::OwnedSemaphorePermit,
            ),
        ),
        (Refusal, Digest, Option<DelegationRequest>),
    > {
        let now = now_ms();
        let payload_digest = Digest::of(&open.payload);
        let keys = self.trust.load_full();
        let verified =
            verify_open_request(open, &self.identity.peer, keys.as_ref(), now).map_err(|e| {
                (
                    Refusal {
                        code: e.code(),
                        message: e.to_string(),
                    },
                    payload_digest,
                    None,
                )
            })?;
        let digest = verified.request_digest;
        let req = Some(verified.request.clone());
        let refuse =
            |code: &'static str, message: String| (Refusal { code, message }, digest, req.clone());
        let Some(options) = &self.options else {
            return Err(refuse("no_executor", "this host runs no executor".into()));
        };
        let Some(policy) = options.policy.policy_for(&open.key.caller) else {
            return Err(refuse(
                "capability_denied",
                "this caller may not delegate here".into(),
            ));
        };
        let ceiling =
            RouteCeiling::parse(&open.ceiling).map_err(|e| refuse(e.code(), e.to_string()))?;
        let authority = authorize_incoming(&policy, &ceiling, &verified.request, now)
            .map_err(|e| refuse(e.code(), e.to_string()))?;
        let per_peer = self
            .per_peer
            .lock()
            .entry(open.key.caller.clone())
            .or_insert_with(|| Arc::new(Semaphore::new(options.max_concurrent_per_peer.max(1))))
            .clone();
        let saturated = || {
            refuse(
                "saturated",
                "too many delegations running; retry later".into(),
            )
        };
        let a = self
            .global
            .clone()
            .try_acquire_owned()
            .map_err(|_| saturated())?;
        let b = per_peer.try_acquire_owned().map_err(|_| saturated())?;
        // Admitted: only now does the request take a replay-cache entry (a
        // refused request holds none), kept no longer than the deadline
        // granted here.
        match self.nonces.lock().check(
            &open.key,
            &verified.request,
            &digest,
            now,
            authority.deadline_ms,
        ) {
            Ok(NonceCheck::Fresh) => {}
            Ok(NonceCheck::Redelivery) => {
                return Err(refuse("redelivery", "already running".into()));
            }
            Err(e) => return Err(refuse(e.code(), e.to_string())),
        }
        Ok((verified, authority, (a, b)))
    }

    fn result(
        &self,
        key: &DelegationKey,
        task_id: &str,
        request_digest: Digest,
        outcome: Outcome,
        started_ms: u64,
    ) -> DelegationResult {
        DelegationResult {
            v: PROFILE_VERSION,
            request_id: key.request_id.clone(),
            task_id: task_id.to_string(),
            outcome,
            request_digest,
            result_digest: Digest::default(),
            executor: Executor {
                peer: self.identity.peer.clone(),
                key_id: self.identity.key_id.clone(),
            },
            effective_capabilities: Vec::new(),
            read_only: true,
            artifacts: Vec::new(),
            side_effects: Vec::new(),
            usage: Usage::default(),
            started_ms,
            finished_ms: now_ms(),
            output: None,
            error: None,
        }
    }

    /// Signs the result and appends it as the terminal. A result the relay
    /// cannot take (over its payload limit, or refused `payload_too_large`
    /// by a route limit or a byte budget) is replaced once by a `failed`
    /// result without output or artifacts that says why, so the caller
    /// still gets one signed terminal and the link goes on.
    async fn finish(&self, key: &DelegationKey, mut result: DelegationResult) -> bool {
        let mut answer = self.send_result(key, &mut result).await;
        if let Some(Err(e)) = &answer
            && e.code() == Some(ErrorCode::PayloadTooLarge.name())
        {
            warn!(%key, error = %e, "the result is too large for the relay; a failed result says so instead");
            result = too_large_result(result, e);
            answer = self.send_result(key, &mut result).await;
        }
        if let Some(Err(e)) = &answer
            && result.outcome == Outcome::Unknown
            && e.code() == Some(ErrorCode::ProtocolViolation.name())
        {
            // A relay that predates callee-sent `unknown` refuses it.
            warn!(%key, error = %e, "the relay does not take an unknown terminal from a callee; a failed result says so instead");
            result.outcome = Outcome::Failed;
            result.error = result.error.map(|m| format!("unknown: {m}"));
            answer = self.send_result(key, &mut result).await;
        }
        let settled = matches!(answer, Some(Ok(_) | Err(LinkError::AlreadyTerminal(_))));
        let outcome = result.outcome;
        let event = AuditEvent::terminal(outcome);
        let record = self
            .audit(key, event)
            .with_task_id(result.task_id.clone())
            .with_outcome(outcome)
            .with_request_digest(result.request_digest)
            .with_result_digest(result.result_digest)
            .with_capabilities(result.effective_capabilities.clone());
        match answer {
            Some(Ok(_)) => self.audit.record(&record),
            Some(Err(LinkError::AlreadyTerminal(winner))) => {
                info!(%key, ?winner, ours = ?outcome, "another terminal won");
                self.audit
                    .record(&record.with_code(format!("lost_to_{}", winner.name())));
            }
            Some(Err(e)) => warn!(%key, error = %e, "terminal not acknowledged"),
            None => {}
        }
        settled
    }

    /// Signs `result` (setting its end time and digest) and appends it as
    /// the terminal; the relay's answer, or `None` when the link stopped
    /// first.
    async fn send_result(
        &self,
        key: &DelegationKey,
        result: &mut DelegationResult,
    ) -> Option<Result<u64, LinkError>> {
        result.finished_ms = now_ms();
        result.bind(&self.identity);
        let envelope = sign_result(&self.identity, result);
        let env_json: Value = serde_json::from_slice(&envelope.to_json()).unwrap_or(Value::Null);
        let payload: Bytes = UpPayload::Result { envelope: env_json }.to_bytes();
        let (tx, rx) = oneshot::channel();
        self.link
            .command(Command::Send {
                key: key.clone(),
                kind: SendKind::Terminal(result.outcome),
                payload,
                acked: Some(tx),
            })
            .await
            .ok()?;
        rx.await.ok()
    }
}

/// A record whose deadline passed longer ago than this is dropped at start:
/// the relay ended its delegation (`expired`) long ago, so its `Open` will
/// not come back.
const STALE_RECORD_AFTER_MS: u64 = 10 * 60 * 1000;

/// The re-attach records read at start, by delegation; records of
/// delegations long past their deadline are dropped (and deleted).
fn restored_records(
    reattach: Option<&(CalleeJournal, Vec<CalleeRecord>)>,
) -> HashMap<DelegationKey, CalleeRecord> {
    let Some((journal, records)) = reattach else {
        return HashMap::new();
    };
    let now = now_ms();
    let mut kept = HashMap::new();
    for r in records {
        if r.authority
            .deadline_ms
            .saturating_add(STALE_RECORD_AFTER_MS)
            < now
        {
            journal.remove_later(&r.key);
        } else {
            kept.insert(r.key.clone(), r.clone());
        }
    }
    if !kept.is_empty() {
        info!(
            delegations = kept.len(),
            "re-attach records from before the restart"
        );
    }
    kept
}

/// The result sent instead of one the relay cannot take: without output
/// or artifacts, its error naming the size and the limit; a `completed`
/// result becomes `failed` (the caller does not get what was produced),
/// any other outcome stays.
fn too_large_result(mut result: DelegationResult, e: &LinkError) -> DelegationResult {
    let was = result.outcome;
    if was == Outcome::Completed {
        result.outcome = Outcome::Failed;
    }
    result.output = None;
    result.artifacts = Vec::new();
    let before = result
        .error
        .take()
        .map(|m| format!("{m}; "))
        .unwrap_or_default();
    result.error = Some(format!(
        "{before}limit exceeded: the {} result is too large for the relay ({e})",
        was.name()
    ));
    result
}
