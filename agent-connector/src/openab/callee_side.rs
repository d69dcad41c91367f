//! Callee side: a delegation from a remote peer, already verified,
//! authorized and accepted by the callee runtime, is forwarded as
//! `cp/delegate` to a registered local worker that the calling peer may
//! reach (`[[openab.serve]]`) and that matches the target named in the
//! request (`task.context.openab.target`). The worker sees what the CP
//! would hand it: the initiator's `delegation_id` and `admission`
//! unchanged, `from` and `chain` as the initiating runtime's
//! `namespace/name` (`chain` the whole ancestry of a deeper delegation),
//! and the calling host in `from_peer`. The serving entry keeps the chain,
//! the signed depth and the deadline, which a delegation the worker starts
//! naming this one as parent inherits ([`super::caller_side`]). The worker's
//! `cp/delegate_result` becomes the signed result. Once forwarded, a
//! `TASK_STATE_WORKING` status with `{"openab": {"assigned_to", "admission"}}`
//! tells the caller side that a worker took it.
//!
//! Ids stay apart across calling hosts without renaming them: the serving
//! table is keyed by (worker connection, `delegation_id`), and a worker is
//! never handed a second delegation with an id it is serving, whichever
//! host sent it: that worker is passed over, and when every matching
//! worker with room is serving that id the request is `rejected`
//! "duplicate_delegation: ..." (the primary gets DUPLICATE_DELEGATION).
//!
//! Ends that are not the worker's: no matching worker, `rejected`
//! "no_target: ..."; every matching worker at its `max_delegated_sessions`,
//! `rejected` "saturated: ..." (never queued); the worker's connection
//! ending or its lease lapsing mid-task, `failed` with an error starting
//! [`DISCONNECTED`]; the caller's cancel or the deadline, a best-effort
//! `cp/cancel` to the worker and `cancelled` (the deadline is reported
//! `expired` by the runtime).
//!
//! Never: forwards to a worker the calling peer may not reach, or waits
//! for a worker's capacity.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use serde_json::{Value, json};
use tokio::sync::oneshot;
use tracing::{info, warn};

use super::proto::{
    self, AgentType, DelegateResultParams, DelegationStatus, TargetSelector, texts,
};
use super::{ServingFlight, ServingKey, Shared};
use crate::callee::{Execution, StopReason, TaskExecutor, TaskRun};

/// The error prefix of a delegation whose worker went away mid-task; the
/// caller side maps it to `target_disconnected`.
pub const DISCONNECTED: &str = "target_disconnected";

/// Serves remote delegations with the endpoint's registered workers.
#[derive(Clone)]
pub struct OpenAbExecutor {
    pub(crate) shared: Arc<Shared>,
}

impl std::fmt::Debug for OpenAbExecutor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("OpenAbExecutor")
    }
}

/// What the calling side put in `task.context.openab`.
struct Request {
    target: TargetSelector,
    /// The initiator's id and admission; absent from a caller that sends
    /// none (then the relay's delegation key and a fresh admission serve).
    delegation_id: Option<String>,
    admission: Option<u64>,
    from: String,
    chain: Vec<String>,
}

fn read_context(run: &TaskRun) -> Option<Request> {
    let o = run.request.task.context.get("openab")?;
    let target: TargetSelector = serde_json::from_value(o.get("target")?.clone()).ok()?;
    if !target.is_valid() {
        return None;
    }
    let from = o
        .get("from")
        .and_then(Value::as_str)
        .unwrap_or("unknown")
        .chars()
        .take(256)
        .collect();
    let chain = o
        .get("chain")
        .and_then(Value::as_array)
        .map(|c| {
            c.iter()
                .filter_map(Value::as_str)
                .take(usize::from(crate::authority::MAX_DEPTH))
                .map(|e| e.chars().take(256).collect())
                .collect()
        })
        .unwrap_or_default();
    let delegation_id = o
        .get("delegation_id")
        .and_then(Value::as_str)
        .filter(|d| !d.is_empty() && d.len() <= 256)
        .map(str::to_string);
    Some(Request {
        target,
        delegation_id,
        admission: o.get("admission").and_then(Value::as_u64),
        from,
        chain,
    })
}

impl TaskExecutor for OpenAbExecutor {
    fn execute(&self, run: TaskRun) -> Pin<Box<dyn Future<Output = Execution> + Send + 'static>> {
        let shared = self.shared.clone();
        Box::pin(async move { serve(shared, run).await })
    }

    /// An OpenAB runtime cancels its delegations when its control-plane
    /// connection drops and never sends their results (its client's
    /// `serve` ends with `cancel_all`; the results are dropped on purpose),
    /// so after a restart of this connector there is nothing to re-attach
    /// to: the delegation ends `unknown`, saying which worker had it.
    fn reattach(
        &self,
        _run: TaskRun,
        checkpoint: crate::reattach::Checkpoint,
    ) -> Option<Pin<Box<dyn Future<Output = Execution> + Send + 'static>>> {
        let worker = checkpoint
            .state
            .get("worker")
            .and_then(Value::as_str)
            .unwrap_or("?")
            .to_string();
        let delegation = checkpoint
            .state
            .get("delegation_id")
            .and_then(Value::as_str)
            .unwrap_or("?")
            .to_string();
        Some(Box::pin(async move {
            Execution::stopped(StopReason::Lost(format!(
                "the callee's connector restarted while OpenAB worker {worker} was serving \
                 delegation {delegation}; an OpenAB runtime stops its delegations when its \
                 control-plane connection drops and does not send their results, so the \
                 work stopped at an unknown point; side effects are unknown"
            )))
        }))
    }
}

/// Picks a worker, forwards, and waits for its result or the cancel.
async fn serve(shared: Arc<Shared>, run: TaskRun) -> Execution {
    let Some(req) = read_context(&run) else {
        return Execution::stopped(StopReason::Rejected(
            "no_target: the request names no OpenAB target".into(),
        ));
    };
    let caller = &run.request.caller;
    let allowed: Vec<&String> = shared
        .cfg
        .serve
        .iter()
        .filter(|s| &s.peer == caller)
        .flat_map(|s| s.workers.iter())
        .collect();
    let delegation_id = req
        .delegation_id
        .clone()
        .unwrap_or_else(|| run.key.to_string());
    let admission = req.admission.unwrap_or_else(|| shared.next_admission());
    let (tx, rx) = oneshot::channel();
    // Select a worker, reserve its slot and enter the serving entry under
    // the connections' lock, so no second delegation with this id reaches
    // the same worker.
    let picked = {
        let mut conns = shared.conns.lock();
        let mut serving = shared.serving.lock();
        let mut matching = conns
            .iter_mut()
            .filter(|(_, c)| {
                c.agent_type == AgentType::Worker
                    && allowed.contains(&&c.logical)
                    && req
                        .target
                        .matches(c.logical.rsplit('/').next().unwrap_or(""), &c.labels)
            })
            .peekable();
        if matching.peek().is_none() {
            Pick::NoTarget
        } else {
            let with_room: Vec<(&u64, &mut super::Conn)> = matching
                .filter(|(_, c)| c.active < c.max_sessions)
                .collect();
            if with_room.is_empty() {
                Pick::Saturated
            } else {
                match with_room
                    .into_iter()
                    .filter(|(h, _)| !serving.contains_key(&(**h, delegation_id.clone())))
                    .min_by_key(|(_, c)| c.active)
                {
                    None => Pick::Duplicate,
                    Some((h, c)) => {
                        c.active += 1;
                        serving.insert(
                            (*h, delegation_id.clone()),
                            ServingFlight {
                                caller: caller.clone(),
                                admission,
                                chain: req.chain.clone(),
                                depth: run.request.depth,
                                deadline_ms: run.request.deadline_ms,
                                capabilities: run.authority.capabilities.clone(),
                                read_only: run.authority.read_only,
                                result: tx,
                            },
                        );
                        Pick::Worker(*h, c.logical.clone())
                    }
                }
            }
        }
    };
    let (worker, logical) = match picked {
        Pick::NoTarget => {
            return Execution::stopped(StopReason::Rejected(format!(
                "no_target: {} (none that {caller} may reach)",
                texts::NO_TARGET
            )));
        }
        Pick::Saturated => {
            return Execution::stopped(StopReason::Rejected(format!(
                "saturated: {}",
                texts::SATURATED
            )));
        }
        Pick::Duplicate => {
            return Execution::stopped(StopReason::Rejected(format!(
                "duplicate_delegation: {}",
                texts::duplicate(&delegation_id)
            )));
        }
        Pick::Worker(h, l) => (h, l),
    };
    // Releases the worker's slot and the entry however this ends.
    let _slot = Slot {
        shared: shared.clone(),
        key: (worker, delegation_id.clone()),
        admission,
    };
    let forward = json!({
        "delegation_id": delegation_id,
        "admission": admission,
        "prompt": run.request.task.text,
        "deadline": crate::a2a::model::iso_from_ms(run.request.deadline_ms),
        "from": req.from,
        "chain": req.chain,
        "from_peer": caller.to_string(),
    });
    let frame = proto::request(shared.next_id(), proto::methods::DELEGATE, forward);
    // A worker whose queue is full is waited for (it reads, or its writer
    // closes it), unless the caller cancels first.
    let sent = tokio::select! {
        s = shared.send(worker, frame) => s,
        () = run.cancel.cancelled() => return Execution::stopped(StopReason::Cancelled),
    };
    if !sent {
        return Execution::stopped(StopReason::Error(format!(
            "{DISCONNECTED}: worker {logical} disconnected during routing"
        )));
    }
    info!(worker = %logical, delegation = %delegation_id, admission, "forwarded to a local worker");
    // The caller side answers its primary's `cp/delegate` on this event.
    let taken = json!({ "openab": { "assigned_to": logical, "admission": admission } });
    let _ = run
        .sink
        .status("TASK_STATE_WORKING", None, Some(taken))
        .await;
    // Which worker has it: after a restart of this process the delegation
    // ends `unknown` naming it (see `reattach`). After the status, so the
    // primary's answer does not wait for the disk.
    run.sink
        .checkpoint(json!({ "worker": logical, "delegation_id": delegation_id }))
        .await;
    tokio::select! {
        r = rx => match r {
            Ok(p) => execution_of(&shared, p),
            Err(_) => Execution::stopped(StopReason::Error(format!(
                "{DISCONNECTED}: worker {logical} disconnected"
            ))),
        },
        () = run.cancel.cancelled() => {
            // The executor learns that, not why: the deadline is told apart
            // by the clock, in the CP's words for it.
            let reason = if oab_wire::identity::now_ms() >= run.request.deadline_ms {
                "deadline exceeded"
            } else {
                "cancelled by the initiator or its host"
            };
            let cancel = json!({
                "delegation_id": delegation_id,
                "admission": admission,
                "reason": reason,
            });
            // Best effort, in its own task: the end is not held up by a
            // worker that reads slowly.
            let frame = proto::request(shared.next_id(), proto::methods::CANCEL, cancel);
            let shared = shared.clone();
            tokio::spawn(async move { shared.send(worker, frame).await });
            Execution::stopped(StopReason::Cancelled)
        }
    }
}

/// How a worker was picked.
enum Pick {
    NoTarget,
    Saturated,
    /// Every matching worker with room serves a delegation with this id.
    Duplicate,
    Worker(u64, String),
}

/// A worker's slot and serving entry, released on drop.
struct Slot {
    shared: Arc<Shared>,
    key: ServingKey,
    admission: u64,
}

impl Drop for Slot {
    fn drop(&mut self) {
        {
            let mut serving = self.shared.serving.lock();
            if serving
                .get(&self.key)
                .is_some_and(|f| f.admission == self.admission)
            {
                serving.remove(&self.key);
            }
        }
        if let Some(c) = self.shared.conns.lock().get_mut(&self.key.0) {
            c.active = c.active.saturating_sub(1);
        }
    }
}

fn execution_of(shared: &Shared, p: DelegateResultParams) -> Execution {
    let error = p.error.unwrap_or_else(|| "no reason given".into());
    match p.status {
        DelegationStatus::Completed => {
            let text = proto::cap_result(p.result.unwrap_or_default(), shared.cfg.max_result_bytes);
            Execution {
                output: Some(Value::String(text)),
                ..Execution::stopped(StopReason::EndTurn)
            }
        }
        DelegationStatus::Failed => Execution::stopped(StopReason::Error(error)),
        DelegationStatus::Cancelled => Execution::stopped(StopReason::Cancelled),
        DelegationStatus::Timeout => Execution::stopped(StopReason::Deadline),
        DelegationStatus::TargetDisconnected => {
            Execution::stopped(StopReason::Error(format!("{DISCONNECTED}: {error}")))
        }
    }
}

/// A worker's `cp/delegate_result`: taken when it names a delegation this
/// worker serves (and its admission, when given); otherwise dropped, as
/// the CP drops a late or foreign result.
pub(crate) fn worker_result(shared: &Shared, handle: u64, p: DelegateResultParams) {
    let key: ServingKey = (handle, p.delegation_id.clone());
    let flight = {
        let mut serving = shared.serving.lock();
        match serving.get(&key) {
            Some(f) if p.admission.is_none_or(|a| a == f.admission) => serving.remove(&key),
            _ => None,
        }
    };
    match flight {
        Some(f) => {
            info!(delegation = %p.delegation_id, caller = %f.caller, status = ?p.status, "worker result");
            let _ = f.result.send(p);
        }
        None => {
            warn!(delegation = %p.delegation_id, "result for no delegation this worker serves; dropped")
        }
    }
}
