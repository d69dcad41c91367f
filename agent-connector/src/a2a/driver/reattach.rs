//! The driver across a restart of its connector: what it saves so that a
//! restarted connector finds the server's task again ([`Saved`]), and the
//! re-attach itself ([`DriverInner::resume`]).
//!
//! Saved (through [`EventSink::checkpoint`], see [`crate::reattach`]): the
//! server's task and context ids, the task's state, the ids of the
//! artifacts sent up, the last status sent up and the id of the last status
//! message sent up, and how many follow-up
//! messages were forwarded; once the task is known and not finished, and
//! again before each event sent up (with that event as `pending`, so a
//! restart can tell from the relay's up log whether it was delivered) and
//! before each follow-up forwarded.
//!
//! The re-attach: `GetTask` (retried while the server is unreachable, for
//! [`REATTACH_ATTEMPTS`] tries); a server that answers `TaskNotFound` lost
//! the task (it restarted too), and the delegation ends `unknown` saying
//! so. Otherwise the task's artifacts make the result's list again (those
//! not sent up yet are sent), the status messages the task went through
//! while the connector was down go up from the task's history (as
//! `working`: the history keeps a message, not the state it came with),
//! its status goes up unless it is the last one sent, and the driver goes
//! on as after a dropped stream: a terminal task ends the delegation, an
//! interrupted one waits for the caller's follow-up (the ones already
//! forwarded, delivered again by the relay, are skipped), a running one is
//! followed with `SubscribeToTask`, whose leading snapshot is read the same
//! way (what the task went through between `GetTask` and the subscription
//! goes up from its history).

use std::collections::HashSet;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::Value;
use tracing::{info, warn};

use super::{
    DriverError, DriverInner, Session, TurnEnd, UpStatus, snapshot, take_artifact, upward_message,
};
use crate::a2a::model::{TaskState, artifact_from_a2a};
use crate::callee::{EventSink, Execution, StopReason, TaskRun};

/// The A2A error `TaskNotFoundError` (JSON-RPC code).
const TASK_NOT_FOUND: i64 = -32001;
/// Tries to reach the server's task after a restart before the delegation
/// ends `unknown` (the server may be restarting too): about 25 s in all.
pub(super) const REATTACH_ATTEMPTS: u32 = 8;
/// The first pause between those tries; doubled each time, at most 5 s.
const REATTACH_PAUSE: Duration = Duration::from_millis(200);

/// The event a checkpoint was saved before.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(super) enum Pending {
    /// An artifact (or a chunk of one); `new`: its id was not sent before.
    Artifact { id: String, new: bool },
    /// A status; the one sent up before it, and the id of the last status
    /// message sent up before it.
    Status {
        before: Option<SavedStatus>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        message_before: Option<String>,
    },
}

/// A status as sent up ([`UpStatus`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(super) struct SavedStatus {
    state: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    message_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    content: Option<Value>,
}

impl SavedStatus {
    fn of(up: &UpStatus) -> Self {
        SavedStatus {
            state: up.state.as_str().to_string(),
            message_id: up.message_id.clone(),
            content: up.content.clone(),
        }
    }

    fn status(&self) -> Option<UpStatus> {
        Some(UpStatus {
            state: TaskState::parse(&self.state)?,
            message_id: self.message_id.clone(),
            content: self.content.clone(),
        })
    }
}

/// What the driver saves for a restart.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(super) struct Saved {
    /// Format of this state (1).
    v: u32,
    task_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    context_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    state: Option<String>,
    /// Ids of the artifacts sent up.
    sent: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    last_up: Option<SavedStatus>,
    /// The id of the last status message sent up (statuses without a
    /// message do not move it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    last_message: Option<String>,
    /// Whether `last_message` is kept (a record written before it was
    /// has none, and then no message is recovered from the history).
    #[serde(default)]
    messages_tracked: bool,
    follow_ups: u64,
    /// The event this state was saved before (the state includes it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pending: Option<Pending>,
    /// Whether that event reached the relay (set on re-attach, not saved).
    #[serde(skip)]
    delivered: bool,
}

impl Saved {
    /// The driver's state in a checkpoint; `None` when it is not one.
    pub(super) fn from_checkpoint(c: crate::reattach::Checkpoint) -> Option<Saved> {
        let mut saved: Saved = serde_json::from_value(c.state).ok()?;
        if saved.v != 1 {
            return None;
        }
        saved.delivered = c.delivered;
        Some(saved)
    }

    /// The session as of the last event that reached the relay.
    fn session(self, output_budget: u64) -> Session {
        let mut sent: HashSet<String> = self.sent.into_iter().collect();
        let mut last_up = self.last_up.as_ref().and_then(SavedStatus::status);
        let mut last_message = self.last_message;
        if !self.delivered {
            match self.pending {
                Some(Pending::Artifact { id, new: true }) => {
                    sent.remove(&id);
                }
                Some(Pending::Status {
                    before,
                    message_before,
                }) => {
                    last_up = before.as_ref().and_then(SavedStatus::status);
                    last_message = message_before;
                }
                _ => {}
            }
        }
        Session {
            task_id: Some(self.task_id),
            context_id: self.context_id,
            state: self.state.as_deref().and_then(TaskState::parse),
            sent,
            last_up,
            last_message,
            history_unknown: !self.messages_tracked,
            skip_follow_ups: self.follow_ups,
            follow_ups: self.follow_ups,
            checkpointed: true,
            announce: true,
            output_budget,
            ..Session::default()
        }
    }
}

impl DriverInner {
    /// Saves `s` for a restart, as of just before the event `pending` (see
    /// the module docs). Nothing to do before the server's task is known or
    /// without a state folder.
    pub(super) async fn checkpoint(
        &self,
        s: &mut Session,
        sink: &EventSink,
        pending: Option<Pending>,
    ) {
        let Some(task_id) = s.task_id.clone() else {
            return;
        };
        if !sink.checkpoints() {
            return;
        }
        let mut sent: Vec<String> = s.sent.iter().cloned().collect();
        sent.sort();
        let saved = Saved {
            v: 1,
            task_id,
            context_id: s.context_id.clone(),
            state: s.state.map(|st| st.as_str().to_string()),
            sent,
            last_up: s.last_up.as_ref().map(SavedStatus::of),
            last_message: s.last_message.clone(),
            messages_tracked: true,
            follow_ups: s.follow_ups,
            pending,
            delivered: false,
        };
        if let Ok(state) = serde_json::to_value(&saved) {
            sink.checkpoint(state).await;
            s.checkpointed = true;
        }
    }

    /// Sends a status up (saving the state with it first); `last_up` is
    /// the new status once sent, the one before if it could not be.
    pub(super) async fn status_up(
        &self,
        s: &mut Session,
        sink: &EventSink,
        up: UpStatus,
        message: Option<Value>,
    ) {
        let state = up.state;
        let message_before = match &up.message_id {
            Some(id) => s.last_message.replace(id.clone()),
            None => s.last_message.clone(),
        };
        let before = s.last_up.replace(up);
        let pending = Pending::Status {
            before: before.as_ref().map(SavedStatus::of),
            message_before: message_before.clone(),
        };
        self.checkpoint(s, sink, Some(pending)).await;
        if let Err(e) = sink.status(state.as_str(), message, None).await {
            tracing::debug!(error = %e, "status not sent up");
            s.last_up = before;
            s.last_message = message_before;
        }
    }

    /// After a re-attach, takes the follow-up messages the relay delivered
    /// again that were forwarded before the restart. `false` when the
    /// delegation ended meanwhile.
    pub(super) async fn skip_repeated_follow_ups(
        &self,
        s: &mut Session,
        run: &mut TaskRun,
    ) -> bool {
        while s.skip_follow_ups > 0 {
            tokio::select! {
                m = run.messages.recv() => match m {
                    Some(_) => s.skip_follow_ups -= 1,
                    None => return false,
                },
                () = run.cancel.cancelled() => return true,
            }
        }
        true
    }

    /// Goes on with the server's task after a restart of this connector.
    pub(super) async fn resume(
        self: std::sync::Arc<Self>,
        run: TaskRun,
        saved: Saved,
    ) -> Execution {
        let task_id = saved.task_id.clone();
        let mut s = saved.session(run.authority.budgets.output_bytes);
        let mut pause = REATTACH_PAUSE;
        let mut last_error = String::new();
        for attempt in 1..=REATTACH_ATTEMPTS {
            if run.cancel.is_cancelled() {
                break;
            }
            let task = match self.resolve(attempt > 1).await {
                Ok(card) => match self.get_task(&card, &task_id).await {
                    Ok(task) => Ok((card, task)),
                    Err(e) => Err(e),
                },
                Err(e) => Err(e),
            };
            match task {
                Ok((card, task)) => {
                    info!(task_id = %task_id, "re-attached to the local A2A server's task");
                    let end = self.absorb_reattached(&mut s, &task, &run.sink).await;
                    return self.drive(&card, s, run, None, end).await;
                }
                Err(DriverError::Rpc {
                    code: TASK_NOT_FOUND,
                    ..
                }) => {
                    warn!(task_id = %task_id, "the local A2A server no longer has the task");
                    return Execution::stopped(StopReason::Lost(format!(
                        "the callee's connector restarted and the agent no longer has task \
                         {task_id} (it restarted too, or forgot it); side effects are unknown"
                    )));
                }
                Err(e) => {
                    last_error = e.to_string();
                    warn!(task_id = %task_id, attempt, error = %e, "the local A2A server's task cannot be read yet");
                }
            }
            tokio::select! {
                () = tokio::time::sleep(pause) => {}
                () = run.cancel.cancelled() => {}
            }
            pause = (pause * 2).min(Duration::from_secs(5));
        }
        Execution::stopped(StopReason::Lost(format!(
            "the callee's connector restarted and could not reach the agent's task {task_id} \
             again ({last_error}); side effects are unknown"
        )))
    }

    /// Takes the task as the server holds it after a re-attach: every
    /// artifact into the result (those not sent up yet are sent), and its
    /// status as a resumed stream's snapshot. `Some` when that ends the
    /// turn (finished or interrupted); `None`: follow the task.
    async fn absorb_reattached(
        &self,
        s: &mut Session,
        task: &Value,
        sink: &EventSink,
    ) -> Option<TurnEnd> {
        if let Some(c) = task.get("contextId").and_then(Value::as_str) {
            s.context_id = Some(c.to_string());
        }
        let arts = task
            .get("artifacts")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        for a in &arts {
            if let Some(art) = artifact_from_a2a(a)
                && s.sent.contains(&art.artifact_id)
                && !take_artifact(s, &art, false)
            {
                return Some(TurnEnd::OverBudget);
            }
        }
        self.absorb_artifacts(s, task, sink).await;
        if s.over_budget.is_some() {
            return Some(TurnEnd::OverBudget);
        }
        self.send_missed_messages(s, task, sink).await;
        self.on_status(s, task.get("status"), sink, true).await
    }

    /// Sends up, as `working` statuses, the status messages the server's
    /// task went through while the driver did not follow it (see
    /// [`snapshot::missed_messages`]).
    pub(super) async fn send_missed_messages(
        &self,
        s: &mut Session,
        task: &Value,
        sink: &EventSink,
    ) {
        for message in snapshot::missed_messages(s, task) {
            let up = UpStatus::new(TaskState::Working, Some(&message));
            self.status_up(s, sink, up, upward_message(Some(&message)))
                .await;
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use serde_json::json;

    #[test]
    fn an_undelivered_status_leaves_its_message_unsent() {
        let saved = Saved {
            v: 1,
            task_id: "t".into(),
            context_id: None,
            state: Some("TASK_STATE_WORKING".into()),
            sent: Vec::new(),
            last_up: None,
            last_message: Some("tick 2".into()),
            messages_tracked: true,
            follow_ups: 0,
            pending: Some(Pending::Status {
                before: None,
                message_before: Some("tick 1".into()),
            }),
            delivered: false,
        };
        let mut delivered = saved.clone();
        delivered.delivered = true;
        assert_eq!(saved.session(1).last_message.as_deref(), Some("tick 1"));
        assert_eq!(delivered.session(1).last_message.as_deref(), Some("tick 2"));
        // A record written before messages were tracked.
        let old: Saved = serde_json::from_value(json!({
            "v": 1, "task_id": "t", "sent": [], "follow_ups": 0
        }))
        .unwrap();
        assert!(old.session(1).history_unknown);
    }
}
