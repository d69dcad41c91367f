//! The facade's task table: each delegation the facade started, folded from
//! the connector's event log into an A2A task and a numbered list of A2A
//! stream events.
//!
//! **Numbering.** Every A2A event the facade derives gets the next number of
//! its task, 1, 2, 3... (the profile's `seq`). The derivation is a pure
//! function of the delegation's up log, so the same log always gives the
//! same numbers; `upSeq` names the up-log event it came from.
//!
//! **Bounds** ([`TaskBounds`], from the facade's options).
//! - Tasks: at most `max_tasks`, and the finished ones weigh at most
//!   `max_finished_bytes` together; past either, the oldest finished task is
//!   forgotten (an unfinished one never is) and `GetTask` answers
//!   `TaskNotFound` for it. A task's weight is the JSON length of its kept
//!   events, history and artifacts, plus [`TASK_OVERHEAD_BYTES`].
//! - Events per task: at most `max_events`, and at most `max_task_bytes` of
//!   them; past either the oldest is dropped, and a cursor before the first
//!   kept event is reported as a gap, never skipped silently.
//! - History per task: at most `max_history` messages and `max_task_bytes`
//!   of them; past either the oldest message after the first (the request)
//!   is dropped.
//! - Artifacts per task: at most `max_task_bytes`; an artifact update past
//!   that is still streamed as an event but not merged into the task's
//!   artifacts, and the task's profile metadata says
//!   `"artifactsTruncated": true`.
//!
//! Never: forgets an unfinished task, skips an event silently, or awaits:
//! everything here is synchronous.

use parking_lot::{Mutex, MutexGuard};
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use oab_wire::{DelegationKey, Outcome, PeerId};
use serde_json::{Map, Value, json};
use tokio::sync::watch;

use super::model::{
    TaskState, agent_data_message, agent_text_message, artifact_to_a2a, iso_from_ms,
    merge_artifact, normalise_message, now_ms, render_message,
};
use super::profile;
use crate::caller::{CallerError, DelegationHandle, Terminal};
use crate::profile::{Artifact, DelegationResult};

/// How a delegation ended, as the final status event shows it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct FinalInfo {
    /// The delegation outcome (`completed`, ..., `expired`, `unknown`), or
    /// `refused`/`gap`/`unverified` for ends the facade observed.
    pub(crate) outcome: String,
    /// The callee-signed result envelope, when there is one.
    pub(crate) envelope: Option<Value>,
    /// Whether the envelope verified against the callee's key.
    pub(crate) verified: Option<bool>,
    /// The relay's or the facade's reason, for ends without a result.
    pub(crate) reason: Option<String>,
}

/// What an A2A stream event says.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum EventBody {
    /// A `statusUpdate`.
    Status {
        state: TaskState,
        message: Option<Value>,
        data: Option<Value>,
        end: Option<FinalInfo>,
    },
    /// An `artifactUpdate`.
    Artifact {
        artifact: Value,
        append: bool,
        last_chunk: bool,
    },
}

/// One numbered A2A event of a task.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct FacadeEvent {
    pub(crate) seq: u64,
    pub(crate) up_seq: u64,
    pub(crate) at_ms: u64,
    pub(crate) body: EventBody,
}

impl FacadeEvent {
    /// Whether a stream closes after this event: a terminal, or
    /// input-required (the agent waits for the client; auth-required keeps
    /// the stream open, SPEC §7.6.1).
    pub(crate) fn closes_stream(&self) -> bool {
        matches!(
            &self.body,
            EventBody::Status { state, .. }
                if state.is_terminal() || *state == TaskState::InputRequired
        )
    }
}

/// The end of a delegation, prepared for folding (verification is done by
/// the caller before the record is locked).
#[derive(Debug, Clone)]
pub(crate) struct TerminalView {
    pub(crate) state: TaskState,
    pub(crate) message: Option<Value>,
    pub(crate) artifacts: Vec<Value>,
    pub(crate) message_response: bool,
    pub(crate) end: FinalInfo,
}

impl TerminalView {
    /// Maps a terminal and the outcome of verifying its signed result.
    pub(crate) fn new(
        terminal: &Terminal,
        verified: Result<DelegationResult, CallerError>,
    ) -> Self {
        let outcome = terminal.outcome;
        let envelope = terminal
            .envelope
            .as_ref()
            .and_then(|e| serde_json::from_slice::<Value>(&e.to_json()).ok());
        let mut state = match outcome {
            Outcome::Completed => TaskState::Completed,
            Outcome::Cancelled => TaskState::Canceled,
            Outcome::Rejected => TaskState::Rejected,
            Outcome::Failed | Outcome::Expired | Outcome::Unknown => TaskState::Failed,
        };
        let mut end = FinalInfo {
            outcome: outcome.name().to_string(),
            envelope,
            verified: None,
            reason: terminal.reason.clone(),
        };
        let ended = |reason: &str| {
            agent_text_message(&format!(
                "the delegation ended {}: {reason}",
                outcome.name()
            ))
        };
        if terminal.relay_origin {
            return TerminalView {
                state,
                message: Some(ended(
                    terminal
                        .reason
                        .as_deref()
                        .unwrap_or("reported by the relay"),
                )),
                artifacts: Vec::new(),
                message_response: false,
                end,
            };
        }
        let result = match verified {
            Ok(r) => r,
            Err(e) => {
                end.verified = Some(false);
                end.reason = Some(format!("{}: {e}", e.code()));
                return TerminalView {
                    state: TaskState::Failed,
                    message: Some(agent_text_message(&format!(
                        "the callee's signed result did not verify ({}); outcome claimed: {}",
                        e.code(),
                        outcome.name()
                    ))),
                    artifacts: Vec::new(),
                    message_response: false,
                    end,
                };
            }
        };
        end.verified = Some(true);
        if outcome == Outcome::Expired {
            // Expiry reads the same whether the callee or the relay's sweeper
            // wrote it (which one wins is a race): the relay's reason and
            // text, not whatever the local agent said when it was stopped.
            // What the callee produced before the deadline is kept.
            end.reason = Some(oab_wire::EXPIRED_REASON.to_string());
            return TerminalView {
                state,
                message: Some(ended(oab_wire::EXPIRED_REASON)),
                artifacts: result.artifacts.iter().map(artifact_to_a2a).collect(),
                message_response: false,
                end,
            };
        }
        let a2a = result.output.as_ref().and_then(|o| o.get("a2a"));
        if outcome == Outcome::Failed
            && a2a
                .and_then(|a| a.get("state"))
                .and_then(Value::as_str)
                .and_then(TaskState::parse)
                == Some(TaskState::Rejected)
        {
            state = TaskState::Rejected;
        }
        let message = if let Some(m) = a2a.and_then(|a| a.get("message")).filter(|m| m.is_object())
        {
            normalise_message(m, "ROLE_AGENT")
        } else if let Some(err) = &result.error {
            Some(agent_text_message(err))
        } else {
            result
                .output
                .clone()
                .filter(|_| a2a.is_none())
                .map(agent_data_message)
        };
        let message_response = outcome == Outcome::Completed
            && a2a.and_then(|a| a.get("kind")).and_then(Value::as_str) == Some("message")
            && message.is_some();
        TerminalView {
            state,
            message,
            artifacts: result.artifacts.iter().map(artifact_to_a2a).collect(),
            message_response,
            end,
        }
    }
}

/// What a task weighs beyond its events, history and artifacts (ids, state,
/// the cell and index entries), for the finished tasks' byte budget.
pub(crate) const TASK_OVERHEAD_BYTES: u64 = 1_024;

/// What an event weighs beyond its JSON values.
const EVENT_OVERHEAD_BYTES: u64 = 64;

/// The bounds of the task table (see the module's opening comment).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TaskBounds {
    pub(crate) max_tasks: usize,
    pub(crate) max_finished_bytes: u64,
    pub(crate) max_events: usize,
    pub(crate) max_history: usize,
    pub(crate) max_task_bytes: u64,
}

/// The length of `v` as compact JSON, without building the text.
pub(crate) fn json_len(v: &Value) -> u64 {
    struct Count(u64);
    impl std::io::Write for Count {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0 = self
                .0
                .saturating_add(u64::try_from(b.len()).unwrap_or(u64::MAX));
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut c = Count(0);
    // Writing a `Value` to a writer that never fails cannot fail.
    let _ = serde_json::to_writer(&mut c, v);
    c.0
}

impl EventBody {
    /// What the event weighs (its JSON values plus a fixed overhead).
    fn weight(&self) -> u64 {
        let values = match self {
            EventBody::Status {
                message, data, end, ..
            } => [
                message.as_ref(),
                data.as_ref(),
                end.as_ref().and_then(|e| e.envelope.as_ref()),
            ]
            .into_iter()
            .flatten()
            .map(json_len)
            .fold(0u64, u64::saturating_add),
            EventBody::Artifact { artifact, .. } => json_len(artifact),
        };
        values.saturating_add(EVENT_OVERHEAD_BYTES)
    }
}

/// What the facade knows about one task.
#[derive(Debug)]
pub(crate) struct TaskRecord {
    pub(crate) context_id: String,
    pub(crate) callee_id: Option<String>,
    pub(crate) request_id: String,
    pub(crate) state: TaskState,
    pub(crate) status_message: Option<Value>,
    pub(crate) status_ms: u64,
    pub(crate) created_ms: u64,
    pub(crate) history: Vec<Value>,
    pub(crate) artifacts: Vec<Value>,
    pub(crate) events: VecDeque<FacadeEvent>,
    pub(crate) last_seq: u64,
    pub(crate) end: Option<FinalInfo>,
    /// The agent answered with a message, not a task.
    pub(crate) message_response: bool,
    /// The connector stopped: no more events will come.
    pub(crate) closed: Option<String>,
    /// The delegation's deadline (Unix ms).
    pub(crate) deadline_ms: u64,
    /// Artifact updates were left out of `artifacts` (over `max_task_bytes`).
    pub(crate) artifacts_truncated: bool,
    /// Bytes of the kept events, history and artifacts.
    events_bytes: u64,
    history_bytes: u64,
    artifacts_bytes: u64,
    /// The weight counted in the table's finished bytes, once finished.
    counted: Option<u64>,
    bounds: TaskBounds,
}

impl TaskRecord {
    fn push(&mut self, up_seq: u64, body: EventBody) {
        self.last_seq += 1;
        self.events_bytes = self.events_bytes.saturating_add(body.weight());
        self.events.push_back(FacadeEvent {
            seq: self.last_seq,
            up_seq,
            at_ms: self.status_ms,
            body,
        });
        while self.events.len() > self.bounds.max_events
            || (self.events_bytes > self.bounds.max_task_bytes && self.events.len() > 1)
        {
            let Some(old) = self.events.pop_front() else {
                break;
            };
            self.events_bytes = self.events_bytes.saturating_sub(old.body.weight());
        }
    }

    /// Adds a message to the history; past `max_history` messages or
    /// `max_task_bytes`, the oldest after the first (the request) is
    /// dropped.
    pub(crate) fn push_history(&mut self, message: Value) {
        self.history_bytes = self.history_bytes.saturating_add(json_len(&message));
        self.history.push(message);
        while self.history.len() > self.bounds.max_history.max(2)
            || (self.history_bytes > self.bounds.max_task_bytes && self.history.len() > 2)
        {
            let old = self.history.remove(1);
            self.history_bytes = self.history_bytes.saturating_sub(json_len(&old));
        }
    }

    /// Merges an artifact update into the task's artifacts, unless that
    /// takes them past `max_task_bytes` (then the task is marked
    /// `artifacts_truncated`; the update still goes out as an event).
    fn keep_artifact(&mut self, a2a: &Value, append: bool) {
        let len = json_len(a2a);
        if self.artifacts_bytes.saturating_add(len) > self.bounds.max_task_bytes {
            self.artifacts_truncated = true;
            return;
        }
        self.artifacts_bytes = self.artifacts_bytes.saturating_add(len);
        merge_artifact(&mut self.artifacts, a2a, append);
    }

    /// What the task weighs against the finished tasks' byte budget.
    pub(crate) fn weight(&self) -> u64 {
        self.events_bytes
            .saturating_add(self.history_bytes)
            .saturating_add(self.artifacts_bytes)
            .saturating_add(TASK_OVERHEAD_BYTES)
    }

    /// Whether the task reached a terminal state.
    pub(crate) fn is_terminal(&self) -> bool {
        self.state.is_terminal()
    }

    /// The first kept event sequence (`last_seq + 1` when none is kept).
    pub(crate) fn first_kept(&self) -> u64 {
        self.events.front().map_or(self.last_seq + 1, |e| e.seq)
    }

    /// Events after `after`, in order.
    pub(crate) fn events_after(&self, after: u64) -> Vec<FacadeEvent> {
        self.events
            .iter()
            .filter(|e| e.seq > after)
            .cloned()
            .collect()
    }

    /// Folds a progress event.
    pub(crate) fn status(
        &mut self,
        up_seq: u64,
        state: &str,
        message: Option<&Value>,
        data: Option<Value>,
    ) {
        if self.is_terminal() {
            return;
        }
        // Only the delegation's terminal ends the task: a terminal (or
        // unknown) state in a progress event is shown as working.
        let state = TaskState::parse(state)
            .filter(|s| !s.is_terminal())
            .unwrap_or(TaskState::Working);
        let message = message.and_then(|m| normalise_message(m, "ROLE_AGENT"));
        self.state = state;
        self.status_ms = now_ms();
        if let Some(m) = &message {
            self.push_history(m.clone());
        }
        self.status_message = message.clone();
        self.push(
            up_seq,
            EventBody::Status {
                state,
                message,
                data,
                end: None,
            },
        );
    }

    /// Folds an artifact event.
    pub(crate) fn artifact(
        &mut self,
        up_seq: u64,
        artifact: &Artifact,
        append: bool,
        last_chunk: bool,
    ) {
        if self.is_terminal() {
            return;
        }
        let a2a = artifact_to_a2a(artifact);
        self.keep_artifact(&a2a, append);
        self.status_ms = self.status_ms.max(now_ms());
        self.push(
            up_seq,
            EventBody::Artifact {
                artifact: a2a,
                append,
                last_chunk,
            },
        );
    }

    /// Folds the terminal: the result's artifacts not streamed before, then
    /// the final status.
    pub(crate) fn terminal(&mut self, up_seq: u64, view: TerminalView) {
        if self.is_terminal() {
            return;
        }
        self.status_ms = now_ms();
        for a in &view.artifacts {
            let id = a.get("artifactId");
            if !self.artifacts.iter().any(|x| x.get("artifactId") == id) {
                self.keep_artifact(a, false);
                self.push(
                    up_seq,
                    EventBody::Artifact {
                        artifact: a.clone(),
                        append: false,
                        last_chunk: true,
                    },
                );
            }
        }
        self.message_response = view.message_response && self.last_seq == 0;
        self.state = view.state;
        if let Some(m) = &view.message {
            self.push_history(m.clone());
        }
        self.status_message = view.message.clone();
        self.end = Some(view.end.clone());
        self.push(
            up_seq,
            EventBody::Status {
                state: view.state,
                message: view.message,
                data: None,
                end: Some(view.end),
            },
        );
    }

    /// Folds an end the facade observed without a terminal event: the relay
    /// refused the delegation (`rejected`), or its events are gone (`failed`).
    pub(crate) fn observed_end(&mut self, state: TaskState, outcome: &str, reason: String) {
        if self.is_terminal() {
            return;
        }
        let up_seq = self.events.back().map_or(0, |e| e.up_seq);
        self.terminal(
            up_seq,
            TerminalView {
                state,
                message: Some(agent_text_message(&reason)),
                artifacts: Vec::new(),
                message_response: false,
                end: FinalInfo {
                    outcome: outcome.into(),
                    envelope: None,
                    verified: None,
                    reason: Some(reason),
                },
            },
        );
    }

    /// The profile metadata of the task itself.
    fn task_metadata(&self, facade_id: &str, seq: u64) -> Value {
        let mut f = Map::new();
        f.insert("seq".into(), json!(seq));
        f.insert("requestId".into(), json!(self.request_id));
        f.insert("facadeTaskId".into(), json!(facade_id));
        if let Some(c) = &self.callee_id {
            f.insert("calleeTaskId".into(), json!(c));
        }
        if let Some(end) = &self.end {
            end_fields(end, &mut f);
        }
        if self.artifacts_truncated {
            f.insert("artifactsTruncated".into(), json!(true));
        }
        profile::metadata(f)
    }

    /// The task as A2A shows it.
    pub(crate) fn render_task(
        &self,
        cell: &TaskCell,
        task_id: &str,
        history_length: Option<usize>,
        include_artifacts: bool,
        profile: bool,
    ) -> Value {
        let mut t = Map::new();
        t.insert("id".into(), json!(task_id));
        t.insert("contextId".into(), json!(self.context_id));
        let mut status = Map::new();
        status.insert("state".into(), json!(self.state.as_str()));
        if let Some(m) = &self.status_message {
            status.insert(
                "message".into(),
                render_message(m, Some(task_id), &self.context_id),
            );
        }
        status.insert("timestamp".into(), json!(iso_from_ms(self.status_ms)));
        t.insert("status".into(), Value::Object(status));
        if include_artifacts && !self.artifacts.is_empty() {
            t.insert("artifacts".into(), Value::Array(self.artifacts.clone()));
        }
        let keep = history_length.unwrap_or(usize::MAX).min(self.history.len());
        if keep > 0 {
            let start = self.history.len() - keep;
            let history = self
                .history
                .iter()
                .skip(start)
                .map(|m| render_message(m, Some(task_id), &self.context_id))
                .collect();
            t.insert("history".into(), Value::Array(history));
        }
        if profile {
            t.insert(
                "metadata".into(),
                self.task_metadata(&cell.minted_id, self.last_seq),
            );
        }
        Value::Object(t)
    }

    /// The task as it was created (before any event): the first element of
    /// a new task's stream.
    pub(crate) fn render_created(&self, cell: &TaskCell, task_id: &str, profile: bool) -> Value {
        let mut t = json!({
            "id": task_id,
            "contextId": self.context_id,
            "status": {
                "state": TaskState::Submitted.as_str(),
                "timestamp": iso_from_ms(self.created_ms),
            },
        });
        if let (Some(first), Some(obj)) = (self.history.first(), t.as_object_mut()) {
            obj.insert(
                "history".into(),
                json!([render_message(first, Some(task_id), &self.context_id)]),
            );
            if profile {
                let mut f = Map::new();
                f.insert("seq".into(), json!(0));
                f.insert("requestId".into(), json!(self.request_id));
                f.insert("facadeTaskId".into(), json!(cell.minted_id));
                obj.insert("metadata".into(), profile::metadata(f));
            }
        }
        t
    }

    /// One event as a StreamResponse.
    pub(crate) fn render_event(&self, ev: &FacadeEvent, task_id: &str, profile: bool) -> Value {
        let mut f = Map::new();
        f.insert("seq".into(), json!(ev.seq));
        f.insert("upSeq".into(), json!(ev.up_seq));
        match &ev.body {
            EventBody::Status {
                state,
                message,
                data,
                end,
            } => {
                let mut status = Map::new();
                status.insert("state".into(), json!(state.as_str()));
                if let Some(m) = message {
                    status.insert(
                        "message".into(),
                        render_message(m, Some(task_id), &self.context_id),
                    );
                } else if let (Some(d), false) = (data, profile) {
                    // A plain client would lose the data: show it as a message.
                    status.insert(
                        "message".into(),
                        render_message(
                            &agent_data_message(d.clone()),
                            Some(task_id),
                            &self.context_id,
                        ),
                    );
                }
                status.insert("timestamp".into(), json!(iso_from_ms(ev.at_ms)));
                let mut u = Map::new();
                u.insert("taskId".into(), json!(task_id));
                u.insert("contextId".into(), json!(self.context_id));
                u.insert("status".into(), Value::Object(status));
                if profile {
                    if let Some(d) = data {
                        f.insert("data".into(), d.clone());
                    }
                    if let Some(end) = end {
                        end_fields(end, &mut f);
                    }
                    u.insert("metadata".into(), profile::metadata(f));
                }
                json!({ "statusUpdate": u })
            }
            EventBody::Artifact {
                artifact,
                append,
                last_chunk,
            } => {
                let mut u = Map::new();
                u.insert("taskId".into(), json!(task_id));
                u.insert("contextId".into(), json!(self.context_id));
                u.insert("artifact".into(), artifact.clone());
                if *append {
                    u.insert("append".into(), json!(true));
                }
                if *last_chunk {
                    u.insert("lastChunk".into(), json!(true));
                }
                if profile {
                    u.insert("metadata".into(), profile::metadata(f));
                }
                json!({ "artifactUpdate": u })
            }
        }
    }

    /// The agent's direct message answer, when the agent answered with a
    /// message instead of a task.
    pub(crate) fn message_response(&self) -> Option<Value> {
        if !self.message_response {
            return None;
        }
        self.status_message
            .as_ref()
            .map(|m| render_message(m, None, &self.context_id))
    }
}

fn end_fields(end: &FinalInfo, f: &mut Map<String, Value>) {
    f.insert("outcome".into(), json!(end.outcome));
    if let Some(e) = &end.envelope {
        f.insert("result".into(), e.clone());
    }
    if let Some(v) = end.verified {
        f.insert("verified".into(), json!(v));
    }
    if let Some(r) = &end.reason {
        f.insert("reason".into(), json!(r));
    }
}

/// One task: its identity, its record, and a counter that ticks on every
/// change (streams wait on it).
#[derive(Debug)]
pub(crate) struct TaskCell {
    pub(crate) peer: PeerId,
    pub(crate) handle: DelegationHandle,
    pub(crate) minted_id: String,
    record: Mutex<TaskRecord>,
    version: watch::Sender<u64>,
}

impl TaskCell {
    /// The record, locked (never across an await).
    pub(crate) fn lock(&self) -> MutexGuard<'_, TaskRecord> {
        self.record.lock()
    }

    /// A receiver that sees every later change.
    pub(crate) fn subscribe(&self) -> watch::Receiver<u64> {
        self.version.subscribe()
    }

    /// Wakes every waiter.
    pub(crate) fn notify(&self) {
        self.version.send_modify(|v| *v = v.wrapping_add(1));
    }

    /// The id A2A shows by default: the callee's task id once known.
    pub(crate) fn public_id(&self) -> String {
        self.lock()
            .callee_id
            .clone()
            .unwrap_or_else(|| self.minted_id.clone())
    }
}

/// A new task's first facts.
#[derive(Debug)]
pub(crate) struct NewTask {
    pub(crate) peer: PeerId,
    pub(crate) handle: DelegationHandle,
    pub(crate) context_id: String,
    pub(crate) first_message: Value,
    pub(crate) deadline_ms: u64,
    /// When the delegation was requested (kept across a restart).
    pub(crate) created_ms: u64,
}

/// The facade's own id of a delegation's task, used until the callee's id
/// is known. Derived from the delegation key, so a restarted connector
/// answers to the ids its clients already hold.
pub(crate) fn minted_task_id(key: &DelegationKey) -> String {
    key.a2a_task_id()
}

/// The tasks by id and by delegation, in creation order. An entry is added
/// by [`TaskTable::insert`] (and [`TaskTable::alias`]) and removed when its
/// task, finished, is the oldest finished one past `max_tasks` or
/// `max_finished_bytes`.
#[derive(Debug, Default)]
struct Index {
    by_id: HashMap<String, Arc<TaskCell>>,
    by_key: HashMap<DelegationKey, Arc<TaskCell>>,
    order: VecDeque<Arc<TaskCell>>,
    /// Sum of the weights counted by [`TaskTable::finished`].
    finished_bytes: u64,
}

/// Every task of the facade, by id (facade-minted and callee) and by
/// delegation.
#[derive(Debug)]
pub(crate) struct TaskTable {
    index: Mutex<Index>,
    bounds: TaskBounds,
}

impl TaskTable {
    pub(crate) fn new(bounds: TaskBounds) -> Self {
        TaskTable {
            index: Mutex::new(Index::default()),
            bounds: TaskBounds {
                max_tasks: bounds.max_tasks.max(1),
                max_events: bounds.max_events.max(1),
                max_history: bounds.max_history.max(2),
                ..bounds
            },
        }
    }

    /// How many tasks the table holds.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.index.lock().by_key.len()
    }

    /// Counts a task that reached its end against the finished tasks'
    /// bytes (once), then forgets the oldest finished tasks past the
    /// bounds. Called by the tracker after it folded the end.
    pub(crate) fn finished(&self, cell: &Arc<TaskCell>) {
        let mut index = self.index.lock();
        if !index
            .by_key
            .get(&cell.handle.key)
            .is_some_and(|c| Arc::ptr_eq(c, cell))
        {
            return;
        }
        {
            let mut rec = cell.lock();
            if rec.counted.is_some() || !rec.is_terminal() {
                return;
            }
            let w = rec.weight();
            rec.counted = Some(w);
            index.finished_bytes = index.finished_bytes.saturating_add(w);
        }
        self.evict(&mut index);
    }

    /// Forgets the oldest finished tasks while more than `max_tasks` are
    /// held or the finished ones weigh more than `max_finished_bytes`.
    fn evict(&self, index: &mut Index) {
        while index.by_key.len() > self.bounds.max_tasks
            || index.finished_bytes > self.bounds.max_finished_bytes
        {
            let Some(pos) = index.order.iter().position(|c| c.lock().is_terminal()) else {
                break;
            };
            let Some(old) = index.order.remove(pos) else {
                break;
            };
            let counted = old.lock().counted.unwrap_or(0);
            index.finished_bytes = index.finished_bytes.saturating_sub(counted);
            index.by_key.remove(&old.handle.key);
            index.by_id.retain(|_, c| !Arc::ptr_eq(c, &old));
        }
    }

    /// The task with id `id` (minted or callee) delegated to `peer`.
    pub(crate) fn find(&self, peer: &PeerId, id: &str) -> Option<Arc<TaskCell>> {
        self.index
            .lock()
            .by_id
            .get(id)
            .filter(|c| &c.peer == peer)
            .cloned()
    }

    /// Adds a task; returns the existing one when the delegation is known
    /// (an idempotent re-send) and `false` then.
    pub(crate) fn insert(&self, new: NewTask) -> (Arc<TaskCell>, bool) {
        let mut index = self.index.lock();
        if let Some(c) = index.by_key.get(&new.handle.key) {
            return (c.clone(), false);
        }
        let now = now_ms();
        let minted_id = minted_task_id(&new.handle.key);
        let record = TaskRecord {
            context_id: new.context_id,
            callee_id: None,
            request_id: new.handle.key.request_id.to_string(),
            state: TaskState::Submitted,
            status_message: None,
            status_ms: now,
            created_ms: new.created_ms,
            history: Vec::new(),
            artifacts: Vec::new(),
            events: VecDeque::new(),
            last_seq: 0,
            end: None,
            message_response: false,
            closed: None,
            deadline_ms: new.deadline_ms,
            artifacts_truncated: false,
            events_bytes: 0,
            history_bytes: 0,
            artifacts_bytes: 0,
            counted: None,
            bounds: self.bounds,
        };
        let mut record = record;
        record.push_history(new.first_message);
        let (version, _) = watch::channel(0);
        let cell = Arc::new(TaskCell {
            peer: new.peer,
            handle: new.handle,
            minted_id: minted_id.clone(),
            record: Mutex::new(record),
            version,
        });
        index.by_id.insert(minted_id, cell.clone());
        index.by_key.insert(cell.handle.key.clone(), cell.clone());
        index.order.push_back(cell.clone());
        self.evict(&mut index);
        (cell, true)
    }

    /// Records the callee's task id as another name of `cell`.
    pub(crate) fn alias(&self, cell: &Arc<TaskCell>, callee_id: &str) {
        let mut index = self.index.lock();
        if index.by_key.contains_key(&cell.handle.key) {
            index
                .by_id
                .entry(callee_id.to_string())
                .or_insert_with(|| cell.clone());
        }
    }

    /// The tasks delegated to `peer`, oldest first.
    pub(crate) fn of_peer(&self, peer: &PeerId) -> Vec<Arc<TaskCell>> {
        self.index
            .lock()
            .order
            .iter()
            .filter(|c| &c.peer == peer)
            .cloned()
            .collect()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::indexing_slicing)]

    use super::*;
    use oab_wire::RequestId;

    fn bounds() -> TaskBounds {
        TaskBounds {
            max_tasks: 1_000,
            max_finished_bytes: u64::MAX,
            max_events: 1_000,
            max_history: 1_000,
            max_task_bytes: u64::MAX,
        }
    }

    fn peer() -> PeerId {
        PeerId::new("acme/callee").unwrap()
    }

    fn add(table: &TaskTable, i: usize) -> Arc<TaskCell> {
        let key = DelegationKey::new(
            PeerId::new("acme/caller").unwrap(),
            RequestId::new(&format!("req-{i}")).unwrap(),
        );
        table
            .insert(NewTask {
                peer: peer(),
                handle: DelegationHandle {
                    key,
                    callee: peer(),
                },
                context_id: "ctx".into(),
                first_message: agent_text_message("the request"),
                deadline_ms: 0,
                created_ms: 0,
            })
            .0
    }

    fn finish(table: &TaskTable, cell: &Arc<TaskCell>, text: &str) {
        cell.lock()
            .observed_end(TaskState::Failed, "gap", text.to_string());
        table.finished(cell);
    }

    #[test]
    fn finished_tasks_are_forgotten_oldest_first_past_the_byte_budget() {
        let big = "x".repeat(10_000);
        let table = TaskTable::new(TaskBounds {
            max_finished_bytes: 100_000,
            ..bounds()
        });
        let cells: Vec<_> = (0..50).map(|i| add(&table, i)).collect();
        for c in &cells {
            finish(&table, c, &big);
        }
        let held = table.len();
        assert!(
            (1..10).contains(&held),
            "50 finished tasks of over 20 kB each within 100 kB: {held} kept"
        );
        let newest = cells.last().unwrap();
        assert!(table.find(&peer(), &newest.minted_id).is_some());
        assert!(table.find(&peer(), &cells[0].minted_id).is_none());
    }

    #[test]
    fn unfinished_tasks_are_never_forgotten_for_bytes() {
        let table = TaskTable::new(TaskBounds {
            max_finished_bytes: 1,
            max_tasks: 2,
            ..bounds()
        });
        let cells: Vec<_> = (0..5).map(|i| add(&table, i)).collect();
        assert_eq!(table.len(), 5, "open tasks stay past max_tasks");
        finish(&table, &cells[2], "done");
        assert_eq!(table.len(), 4);
        assert!(table.find(&peer(), &cells[2].minted_id).is_none());
    }

    #[test]
    fn history_keeps_the_request_and_the_newest_messages() {
        let table = TaskTable::new(TaskBounds {
            max_history: 4,
            ..bounds()
        });
        let cell = add(&table, 0);
        let mut rec = cell.lock();
        for i in 0..10 {
            rec.status(
                i,
                "TASK_STATE_WORKING",
                Some(&agent_text_message(&format!("m{i}"))),
                None,
            );
        }
        assert_eq!(rec.history.len(), 4);
        let text = |m: &Value| m["parts"][0]["text"].as_str().unwrap().to_string();
        assert_eq!(text(&rec.history[0]), "the request");
        assert_eq!(text(&rec.history[3]), "m9");
        assert_eq!(text(&rec.history[1]), "m7");
    }

    #[test]
    fn history_and_events_stay_within_the_task_byte_budget() {
        let table = TaskTable::new(TaskBounds {
            max_task_bytes: 50_000,
            ..bounds()
        });
        let cell = add(&table, 0);
        let mut rec = cell.lock();
        let big = agent_text_message(&"y".repeat(10_000));
        for i in 0..100 {
            rec.status(i, "TASK_STATE_WORKING", Some(&big), None);
        }
        assert!(
            rec.history.len() < 10,
            "{} messages kept",
            rec.history.len()
        );
        assert!(rec.events.len() < 10, "{} events kept", rec.events.len());
        assert_eq!(rec.last_seq, 100, "numbering goes on");
        assert!(rec.first_kept() > 90, "the oldest events were dropped");
    }

    #[test]
    fn artifacts_past_the_task_byte_budget_are_streamed_but_not_kept() {
        let table = TaskTable::new(TaskBounds {
            max_task_bytes: 50_000,
            ..bounds()
        });
        let cell = add(&table, 0);
        let mut rec = cell.lock();
        let chunk = Artifact {
            artifact_id: "a1".into(),
            name: "out".into(),
            media_type: "text/plain".into(),
            text: Some("z".repeat(10_000)),
            data: None,
            url: None,
        };
        for i in 0..20 {
            rec.artifact(i, &chunk, i > 0, false);
        }
        let kept = json_len(&Value::Array(rec.artifacts.clone()));
        assert!(kept <= 50_000, "{kept} bytes of artifacts kept");
        assert!(rec.artifacts_truncated);
        assert_eq!(rec.last_seq, 20, "every update was still an event");
        let task = rec.render_task(&cell, "t", None, true, true);
        assert_eq!(
            task["metadata"][profile::PROFILE_URI]["artifactsTruncated"],
            json!(true),
            "{task}"
        );
    }
}

#[cfg(test)]
mod expiry_tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::profile::tests::{identity, sample_request, sample_result};

    /// An `expired` terminal reads the same to the A2A client whether the
    /// relay's sweeper wrote it or the callee did when the deadline stopped
    /// its worker (which one wins is a race that differs with the store).
    #[test]
    fn an_expiry_reads_the_same_whoever_wrote_it() {
        let by_relay = TerminalView::new(
            &Terminal {
                outcome: Outcome::Expired,
                relay_origin: true,
                envelope: None,
                reason: Some(oab_wire::EXPIRED_REASON.to_string()),
            },
            Err(CallerError::Timeout),
        );
        let callee = identity("acme/callee", "k1", 7);
        let req = sample_request(oab_wire::identity::now_ms());
        let mut result = sample_result(&req, oab_wire::Digest::of(b"r"), &callee);
        result.outcome = Outcome::Expired;
        result.error = Some(oab_wire::EXPIRED_REASON.to_string());
        // What an A2A agent says when the driver cancels it at the deadline.
        result.output = Some(serde_json::json!({"a2a": {"state": "TASK_STATE_CANCELED",
            "message": {"role": "ROLE_AGENT", "messageId": "m1",
                "parts": [{"text": "canceled on request"}]}}}));
        let by_callee = TerminalView::new(
            &Terminal {
                outcome: Outcome::Expired,
                relay_origin: false,
                envelope: None,
                reason: None,
            },
            Ok(result),
        );
        assert_eq!(by_relay.state, by_callee.state);
        assert_eq!(by_callee.state, TaskState::Failed);
        // The message's words (its id is minted per message).
        let text = |v: &TerminalView| {
            let m = v.message.as_ref().unwrap();
            serde_json::to_string(&(&m["role"], &m["parts"])).unwrap()
        };
        assert_eq!(text(&by_relay), text(&by_callee));
        assert!(text(&by_callee).contains(oab_wire::EXPIRED_REASON));
        assert_eq!(by_relay.end.reason, by_callee.end.reason);
        assert_eq!(by_relay.end.outcome, by_callee.end.outcome);
    }
}
