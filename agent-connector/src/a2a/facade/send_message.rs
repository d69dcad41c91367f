//! `SendMessage` and `SendStreamingMessage`: a message without a `taskId`
//! starts a delegation and its task (and its tracker); one with a `taskId`
//! goes down to the callee as a follow-up. A blocking call then waits for
//! the end of the turn; a streaming one hands the task to an SSE stream.
//!
//! Owns how a message becomes a delegation (profile contract, defaults,
//! request and context ids). Never holds a task's lock across an await.

use std::sync::Arc;
use std::time::Duration;

use oab_wire::{RequestId, TraceId};
use serde_json::{Map, Value, json};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;

use super::params::{history_length, param_bool};
use super::push::{NewConfig, PushConfig, persist};
use super::push_config::{config_of_send, register_for_send};
use super::rpc::{Reply, RpcCall};
use super::stream::{StreamPlan, StreamStart, sse_event};
use super::tracker::track_delegation;
use crate::a2a::jsonrpc::A2aError;
use crate::a2a::model::{fresh_id, message_text, normalise_message, now_ms, validate_user_message};
use crate::a2a::profile::{self, Contract};
use crate::a2a::tasks::{FacadeEvent, NewTask, TaskCell};
use crate::caller::NewDelegation;
use crate::profile::{ParentContext, Task};

impl RpcCall {
    /// `SendMessage` (`streaming` false) and `SendStreamingMessage`: a
    /// message without a `taskId` starts a delegation, one with a `taskId`
    /// is a follow-up. Blocking calls wait for the end of the turn.
    pub(super) async fn send_message(&self, streaming: bool) -> Result<Reply, A2aError> {
        let message = self
            .params
            .get("message")
            .ok_or_else(|| A2aError::InvalidParams("message is required".into()))?;
        validate_user_message(message)?;
        let config = match self.params.get("configuration") {
            None | Some(Value::Null) => Map::new(),
            Some(Value::Object(c)) => c.clone(),
            Some(_) => {
                return Err(A2aError::InvalidParams(
                    "configuration must be an object".into(),
                ));
            }
        };
        let return_immediately = param_bool(&config, "returnImmediately")?.unwrap_or(false);
        let history = history_length(&config)?;
        let push = config_of_send(self.inner(), &config, self.profile)?;
        if push.is_some() {
            self.inner().push.check_room(self.inner())?;
        }
        let request_metadata = self.params.get("metadata");
        if request_metadata.is_some_and(|m| !m.is_object() && !m.is_null()) {
            return Err(A2aError::InvalidParams("metadata must be an object".into()));
        }
        let (cell, task_id, after, created) = match message.get("taskId").and_then(Value::as_str) {
            Some(task_id) => {
                let (cell, after) = self.follow_up(task_id, message, push).await?;
                (cell, task_id.to_string(), after, false)
            }
            None => {
                let cell = self.new_task(message, request_metadata, push).await?;
                let id = cell.public_id();
                (cell, id, 0, true)
            }
        };
        if streaming {
            return Ok(self.start_stream(cell, task_id, after, created).await);
        }
        if !return_immediately {
            let left = cell.lock().deadline_ms.saturating_sub(now_ms());
            let wait = Duration::from_millis(left) + self.inner().options.deadline_grace;
            let turn = wait_turn_end(&cell, after, wait, &self.ctx.streams_stop);
            match self.inner().options.offline_wait {
                Some(patience) => {
                    let link = self.inner().caller.link();
                    tokio::select! {
                        () = turn => {}
                        () = link.down_for(patience) => {
                            tracing::warn!(
                                key = %cell.handle.key,
                                waited_ms = u64::try_from(patience.as_millis()).unwrap_or(u64::MAX),
                                "the relay link is down: a blocking SendMessage returns its task as it stands"
                            );
                        }
                    }
                }
                None => turn.await,
            }
        }
        let task_id = if created { cell.public_id() } else { task_id };
        let rec = cell.lock();
        if created && let Some(m) = rec.message_response() {
            return Ok(Reply::Result(json!({ "message": m })));
        }
        let task = rec.render_task(&cell, &task_id, history, true, self.profile);
        Ok(Reply::Result(json!({ "task": task })))
    }

    /// Starts a delegation for a message without a task id.
    async fn new_task(
        &self,
        message: &Value,
        request_metadata: Option<&Value>,
        push: Option<PushConfig>,
    ) -> Result<Arc<TaskCell>, A2aError> {
        let inner = self.inner();
        let defaults = &inner.options.defaults;
        let contract = if self.profile {
            profile::contract(message, request_metadata)?
        } else {
            Contract::default()
        };
        let message_id = message
            .get("messageId")
            .and_then(Value::as_str)
            .unwrap_or_default();
        let request_id = match &contract.request_id {
            Some(r) => Some(RequestId::new(r).map_err(|e| A2aError::InvalidParams(e.to_string()))?),
            // With the profile, a re-sent message is the same delegation.
            None if self.profile => {
                let d = oab_wire::Digest::of(format!("{}\n{message_id}", self.peer).as_bytes());
                RequestId::new(&format!("a2a-{}", &oab_wire::digest::hex(&d.0)[..32])).ok()
            }
            None => None,
        };
        let context_id = match message.get("contextId").and_then(Value::as_str) {
            Some(c) if !c.is_empty() && c.len() <= 256 => c.to_string(),
            Some(c) if !c.is_empty() => {
                return Err(A2aError::InvalidParams(
                    "contextId is longer than 256 bytes".into(),
                ));
            }
            _ => match &request_id {
                Some(r) => {
                    let d = oab_wire::Digest::of(r.as_str().as_bytes());
                    format!("ctx-{}", &oab_wire::digest::hex(&d.0)[..32])
                }
                None => fresh_id("ctx"),
            },
        };
        let mut forwarded = message.clone();
        if let Some(o) = forwarded.as_object_mut() {
            o.insert("contextId".into(), json!(context_id));
            o.remove("taskId");
        }
        let parent = contract.parent.clone().unwrap_or_default();
        let spec = NewDelegation {
            request_id,
            task: Task {
                text: message_text(message),
                context: Map::new(),
                a2a_message: Some(forwarded),
            },
            capabilities: contract
                .capabilities
                .clone()
                .unwrap_or_else(|| defaults.capabilities.clone()),
            read_only: contract.read_only.unwrap_or(defaults.read_only),
            deadline: contract.timeout().unwrap_or(defaults.timeout),
            budgets: contract
                .budgets
                .as_ref()
                .map_or(defaults.budgets, |b| b.over(&defaults.budgets)),
            parent: ParentContext {
                agent: parent.agent.unwrap_or_else(|| defaults.agent.clone()),
                // The profile's trace id, else the trace of a W3C
                // `traceparent` header, else one derived from the message.
                trace_id: parent
                    .trace_id
                    .or_else(|| {
                        self.headers
                            .get("traceparent")
                            .and_then(|v| v.to_str().ok())
                            .and_then(TraceId::from_traceparent)
                            .map(TraceId::to_hex)
                    })
                    .unwrap_or_else(|| message_id.chars().take(128).collect()),
                execution_id: parent.execution_id,
            },
        };
        let trace = TraceId::of_text(&spec.parent.trace_id);
        let deadline_ms =
            now_ms().saturating_add(u64::try_from(spec.deadline.as_millis()).unwrap_or(u64::MAX));
        let handle = inner
            .caller
            .delegate(&self.peer, spec)
            .await
            .map_err(A2aError::from_caller)?;
        let first = normalise_message(message, "ROLE_USER").unwrap_or(Value::Null);
        let (cell, fresh) = inner.tasks.insert(NewTask {
            peer: self.peer.clone(),
            handle,
            context_id,
            first_message: first,
            deadline_ms,
            created_ms: now_ms(),
        });
        // A new task's push config is registered before its tracker starts,
        // so the tracker finds it delivering when it folds the terminal.
        let push_again = push.clone().filter(|_| !fresh);
        let registered = match push {
            Some(mut config) if fresh => {
                config.next = 0;
                inner
                    .push
                    .register(&self.ctx.inner, &cell, NewConfig { config })
                    .map(|_| true)
            }
            _ => Ok(false),
        };
        if fresh {
            let span = tracing::info_span!("a2a_task", key = %cell.handle.key, trace_id = %trace);
            tokio::spawn(track_delegation(self.ctx.inner.clone(), cell.clone()).instrument(span));
        }
        match registered {
            Ok(true) => {
                if let Err(e) = persist(&self.ctx.inner, &cell.handle.key).await {
                    tracing::warn!(error = %e, "could not save a push notification config; a restart will not take it back");
                }
            }
            Ok(false) => {
                if let Some(config) = push_again {
                    register_for_send(&self.ctx.inner, &cell, config, None, false).await?;
                }
            }
            Err(e) => return Err(e),
        }
        Ok(cell)
    }

    /// Sends a follow-up message down; returns the task and the event
    /// sequence before it.
    async fn follow_up(
        &self,
        task_id: &str,
        message: &Value,
        push: Option<PushConfig>,
    ) -> Result<(Arc<TaskCell>, u64), A2aError> {
        let cell = self.find_task(task_id)?;
        let (after, context_id, callee_id) = {
            let rec = cell.lock();
            if let Some(c) = message.get("contextId").and_then(Value::as_str)
                && c != rec.context_id
            {
                return Err(A2aError::InvalidParams(format!(
                    "contextId {c:?} does not match the task's context"
                )));
            }
            if rec.is_terminal() {
                return Err(A2aError::UnsupportedOperation(format!(
                    "task {task_id} is in a terminal state; start a new task in its context"
                )));
            }
            (rec.last_seq, rec.context_id.clone(), rec.callee_id.clone())
        };
        if let Some(config) = push {
            // The webhook gets what follows this message.
            register_for_send(
                &self.ctx.inner,
                &cell,
                config,
                Some(task_id.to_string()),
                false,
            )
            .await?;
        }
        let mut down = message.clone();
        if let Some(o) = down.as_object_mut() {
            o.insert("contextId".into(), json!(context_id));
            o.insert(
                "taskId".into(),
                json!(callee_id.unwrap_or_else(|| cell.minted_id.clone())),
            );
        }
        self.inner()
            .caller
            .send_message(&cell.handle, down)
            .await
            .map_err(A2aError::from_caller)?;
        if let Some(m) = normalise_message(message, "ROLE_USER") {
            cell.lock().push_history(m);
        }
        cell.notify();
        Ok((cell, after))
    }

    /// Starts the SSE stream of a `SendStreamingMessage`: a follow-up's
    /// from the task as it stands, a new task's from its creation (or its
    /// message-only answer, when one comes within `first_event_wait`).
    async fn start_stream(
        &self,
        cell: Arc<TaskCell>,
        task_id: String,
        after: u64,
        created: bool,
    ) -> Reply {
        let (tx, rx) = mpsc::channel(32);
        if !created {
            let plan = StreamPlan {
                cell,
                task_id,
                first: StreamStart::Snapshot { gap: None },
                after,
            };
            self.spawn_stream(plan, tx);
            return Reply::Stream(rx);
        }
        // A new task: give the callee a moment, so a message-only answer
        // can be streamed as a message and the task shows the callee's id.
        let mut watch = cell.subscribe();
        let wait = async {
            loop {
                {
                    let rec = cell.lock();
                    if rec.last_seq > 0 || rec.closed.is_some() {
                        return;
                    }
                }
                if watch.changed().await.is_err() {
                    return;
                }
            }
        };
        let _ = tokio::time::timeout(self.inner().options.first_event_wait, wait).await;
        let answer = cell.lock().message_response();
        if let Some(m) = answer {
            let data = self.binding.result(json!({ "message": m }));
            let _ = tx.try_send(sse_event(&data, None));
            return Reply::Stream(rx);
        }
        let plan = StreamPlan {
            task_id: cell.public_id(),
            cell,
            first: StreamStart::Created,
            after: 0,
        };
        self.spawn_stream(plan, tx);
        Reply::Stream(rx)
    }
}

/// Waits until an event after `after` ends a turn (terminal or
/// input-required), the connector stops, `stop` fires or `limit` passes.
async fn wait_turn_end(cell: &TaskCell, after: u64, limit: Duration, stop: &CancellationToken) {
    let mut watch = cell.subscribe();
    let wait = async {
        loop {
            {
                let rec = cell.lock();
                if rec.closed.is_some()
                    || rec
                        .events_after(after)
                        .iter()
                        .any(FacadeEvent::closes_stream)
                    || (rec.is_terminal() && rec.last_seq <= after)
                {
                    return;
                }
            }
            if watch.changed().await.is_err() {
                return;
            }
        }
    };
    tokio::select! {
        _ = tokio::time::timeout(limit, wait) => {}
        () = stop.cancelled() => {}
    }
}
