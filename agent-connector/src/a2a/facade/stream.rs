//! The SSE producer: one task per open stream, feeding the client from the
//! task table (never from the delegation), in sequence order, until an
//! event closes the stream (terminal or input-required), the client goes
//! away, the connector stops or the streams' stop token fires.
//!
//! Owns how a stream starts (the task as created, or as it stands with a
//! cursor gap noted) and the SSE framing of results and errors. It never
//! touches the delegation and never holds a task's lock across an await:
//! each batch is rendered under the lock, then sent without it. The channel
//! to the client is bounded (32 events, created by the method that opens
//! the stream); a slow client holds back only its own stream.

use std::sync::Arc;

use axum::response::sse::Event;
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument as _, warn};

use super::rpc::{Binding, RpcCall};
use crate::a2a::jsonrpc::A2aError;
use crate::a2a::profile::PROFILE_URI;
use crate::a2a::tasks::TaskCell;

/// A sequence of events to stream, and how it starts.
pub(super) struct StreamPlan {
    pub(super) cell: Arc<TaskCell>,
    /// The task id the client knows the task by.
    pub(super) task_id: String,
    pub(super) first: StreamStart,
    /// Events with a sequence above this are streamed.
    pub(super) after: u64,
}

/// The first event of a stream.
pub(super) enum StreamStart {
    /// The task as created (state submitted), numbered 0.
    Created,
    /// The task as it stands; `gap` = the cursor asked for and the first
    /// event still kept, when the cursor's events are gone.
    Snapshot { gap: Option<(u64, u64)> },
}

impl RpcCall {
    /// Spawns the producer of one SSE stream for this call, feeding `tx`.
    pub(super) fn spawn_stream(&self, plan: StreamPlan, tx: mpsc::Sender<Event>) {
        let binding = self.binding.clone();
        let profile = self.profile;
        let stop = self.ctx.streams_stop.clone();
        tokio::spawn(
            feed_stream(plan, binding, profile, tx, stop)
                .instrument(tracing::debug_span!("a2a_stream")),
        );
    }
}

/// One SSE event holding `data`, with the SSE id `id` when given (the
/// event sequence, shown with the profile).
pub(super) fn sse_event(data: &Value, id: Option<u64>) -> Event {
    let ev = Event::default().data(serde_json::to_string(data).unwrap_or_default());
    match id {
        Some(seq) => ev.id(seq.to_string()),
        None => ev,
    }
}

/// An SSE `error` event: the binding's error body for `e` (a JSON-RPC
/// error response, or a `google.rpc.Status`).
fn sse_error(binding: &Binding, e: &A2aError) -> Event {
    Event::default()
        .event("error")
        .data(serde_json::to_string(&binding.error(e)).unwrap_or_default())
}

/// Feeds one SSE stream from the task table until the stream closes (a
/// terminal or input-required event), the client goes away, the connector
/// stops or `stop` fires. It never touches the delegation itself.
async fn feed_stream(
    plan: StreamPlan,
    binding: Binding,
    profile: bool,
    tx: mpsc::Sender<Event>,
    stop: CancellationToken,
) {
    let StreamPlan {
        cell,
        task_id,
        first,
        after,
    } = plan;
    let mut watch = cell.subscribe();
    let id_of = |seq: u64| profile.then_some(seq);
    let first_event = {
        let rec = cell.lock();
        match first {
            StreamStart::Created => sse_event(
                &binding.result(json!({ "task": rec.render_created(&cell, &task_id, profile) })),
                id_of(0),
            ),
            StreamStart::Snapshot { gap } => {
                let mut task = rec.render_task(&cell, &task_id, None, true, profile);
                if let (Some((asked, first_kept)), Some(m)) = (
                    gap,
                    task.get_mut("metadata")
                        .and_then(|m| m.get_mut(PROFILE_URI))
                        .and_then(Value::as_object_mut),
                ) {
                    m.insert(
                        "gap".into(),
                        json!({ "after": asked, "firstSeq": first_kept }),
                    );
                }
                sse_event(
                    &binding.result(json!({ "task": task })),
                    id_of(rec.last_seq),
                )
            }
        }
    };
    if tx.send(first_event).await.is_err() {
        return;
    }
    let mut cursor = after;
    loop {
        let (batch, closed, done, trimmed) = {
            let rec = cell.lock();
            let trimmed = cursor + 1 < rec.first_kept() && cursor < rec.last_seq;
            let batch: Vec<(u64, Value, bool)> = rec
                .events_after(cursor)
                .iter()
                .map(|ev| {
                    (
                        ev.seq,
                        rec.render_event(ev, &task_id, profile),
                        ev.closes_stream(),
                    )
                })
                .collect();
            (batch, rec.closed.clone(), rec.is_terminal(), trimmed)
        };
        if trimmed && after < cursor {
            // Events this stream had not sent yet were dropped: say so.
            warn!(
                cursor,
                "a stream's next events are no longer kept; the client must resubscribe"
            );
            let e = A2aError::Internal(format!(
                "events after {cursor} are no longer kept; resubscribe (with the profile, from a cursor)"
            ));
            let _ = tx.send(sse_error(&binding, &e)).await;
            return;
        }
        for (seq, body, closes) in batch {
            if tx
                .send(sse_event(&binding.result(body), id_of(seq)))
                .await
                .is_err()
            {
                return;
            }
            cursor = seq;
            if closes {
                return;
            }
        }
        if done {
            return;
        }
        if let Some(reason) = closed {
            warn!(%reason, "a stream ends: the connector stopped");
            let e = A2aError::Internal(format!("the connector stopped: {reason}"));
            let _ = tx.send(sse_error(&binding, &e)).await;
            return;
        }
        tokio::select! {
            r = watch.changed() => if r.is_err() { return },
            () = tx.closed() => return,
            () = stop.cancelled() => return,
        }
    }
}
