//! The tracker: one task per delegation that folds the connector's event
//! log (replay, then live) into the delegation's task in the task table,
//! and wakes the task's readers after each event. On the terminal it
//! verifies the callee's signed result and records the delegation as
//! finished (once its push configs delivered the terminal, see `push`), so
//! a restart no longer takes it back, and counts the task
//! against the task table's bound on finished tasks.
//!
//! It is the only writer of a task's state and events once the task is
//! created (a follow-up only adds its message to the history). It ends at
//! the terminal, at an end the relay or the link reports (refused, gap,
//! stopped), or on [`Facade::close`]; it never cancels the delegation and
//! never holds a task's lock across an await.

use std::sync::Arc;

use futures_util::StreamExt as _;
use tracing::debug;

#[cfg(doc)]
use super::Facade;
use super::Inner;
use super::push::commit_terminal;
use crate::a2a::model::TaskState;
use crate::a2a::tasks::{TaskCell, TerminalView};
use crate::caller::{DelegationEvent, EventKind};
use crate::link::EventError;

/// Folds one delegation's events into its task until the terminal, the end
/// of the connector, or [`Facade::close`].
pub(super) async fn track_delegation(inner: Arc<Inner>, cell: Arc<TaskCell>) {
    let mut after = 0u64;
    loop {
        let events = tokio::select! {
            () = inner.stop.cancelled() => return,
            r = inner.caller.events(&cell.handle, after) => r,
        };
        let mut events = match events {
            Ok(s) => s,
            Err(e) => {
                cell.lock().closed = Some(e.to_string());
                cell.notify();
                return;
            }
        };
        loop {
            let item = tokio::select! {
                () = inner.stop.cancelled() => return,
                i = events.next() => i,
            };
            match item {
                Some(Ok(ev)) => {
                    let terminal = matches!(ev.kind, EventKind::Terminal(_)).then(|| ev.clone());
                    let end = fold_event(&inner, &cell, ev);
                    cell.notify();
                    if let Some(ev) = terminal {
                        // Finished: a restart no longer takes it back (the
                        // state record stays while the delegation is within the
                        // caller's finished retention, so a re-sent request
                        // is still the same delegation). While push configs
                        // still deliver, the last of them commits instead,
                        // so a restart takes the delegation (and them) back.
                        if let Some(ev) = inner.push.on_terminal(&cell, ev) {
                            commit_terminal(&inner, &cell, ev).await;
                        }
                        inner.tasks.finished(&cell);
                    }
                    if end {
                        return;
                    }
                }
                Some(Err(EventError::Lagged { last })) => {
                    debug!(last, "tracker lagged; resubscribing");
                    after = last;
                    break;
                }
                Some(Err(EventError::Refused { code, message })) => {
                    cell.lock().observed_end(
                        TaskState::Rejected,
                        "refused",
                        format!("the relay refused the delegation: {code} ({message})"),
                    );
                    cell.notify();
                    inner.tasks.finished(&cell);
                    return;
                }
                Some(Err(EventError::Gap { after, reason })) => {
                    cell.lock().observed_end(
                        TaskState::Failed,
                        "gap",
                        format!(
                            "the delegation's events after {after} are gone ({reason:?}); reconcile"
                        ),
                    );
                    cell.notify();
                    inner.tasks.finished(&cell);
                    return;
                }
                Some(Err(EventError::Stopped(reason))) => {
                    cell.lock().closed = Some(reason);
                    cell.notify();
                    return;
                }
                None => {
                    cell.lock().closed = Some("the event stream ended".into());
                    cell.notify();
                    return;
                }
            }
        }
    }
}

/// Folds one event; `true` at the terminal.
fn fold_event(inner: &Inner, cell: &Arc<TaskCell>, ev: DelegationEvent) -> bool {
    match ev.kind {
        EventKind::Accepted { task_id } => {
            cell.lock().callee_id.get_or_insert_with(|| task_id.clone());
            inner.tasks.alias(cell, &task_id);
            false
        }
        EventKind::Status {
            state,
            message,
            data,
        } => {
            cell.lock().status(ev.seq, &state, message.as_ref(), data);
            false
        }
        EventKind::Artifact {
            artifact,
            append,
            last_chunk,
        } => {
            cell.lock().artifact(ev.seq, &artifact, append, last_chunk);
            false
        }
        EventKind::Terminal(t) => {
            let verified = inner.caller.verify(&cell.handle, &t).map(|v| v.result);
            let view = TerminalView::new(&t, verified);
            cell.lock().terminal(ev.seq, view);
            true
        }
        EventKind::Unrecognised(_) => false,
    }
}
