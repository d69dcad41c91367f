//! Caller side: a local primary's `cp/delegate` to a mapped target becomes
//! a signed delegation through the relay ([`crate::Caller::delegate`]), and
//! its terminal comes back as `cp/delegate_result`.
//!
//! The request: task text from the prompt, deadline from the CP deadline,
//! capabilities and read-only from the target's `[[openab.targets]]` entry,
//! and in `task.context.openab` the CP's delegation id, the initiator
//! (`from`), the chain and the remote target. The answer to `cp/delegate`
//! waits up to `admission_wait_ms` for the remote side: its first progress
//! event (a remote endpoint sends one when a worker took the task) is the
//! ack (`delegation_id`, `admission`, `assigned_to`), a refusal is the
//! CP's error code, and past the wait the delegation is acknowledged and
//! goes on. Outcomes: completed, failed and cancelled as they are,
//! `expired` as timeout, `unknown` as target_disconnected.
//!
//! Never: passes on a result that did not verify against the callee's key
//! (it becomes `failed` naming why); cancels a delegation because its
//! primary's connection dropped (its result waits for that instance).

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt as _;
use oab_wire::Outcome;
use serde_json::{Value, json};
use tracing::{Instrument as _, info, warn};

use super::proto::{
    self, AgentType, CancelParams, DelegateParams, DelegateResultParams, DelegationStatus,
    RpcError, codes,
};
use super::{CallerFlight, FlightKey, Shared};
use crate::a2a::DelegationDefaults;
use crate::caller::{CallerError, DelegationHandle, EventKind, NewDelegation, Terminal};
use crate::link::EventError;
use crate::profile::{ParentContext, Task};

/// Admits a `cp/delegate` from connection `handle` and starts it; an error
/// is answered at once, success later (ack or refusal) by the flight task.
pub(crate) fn delegate(
    shared: &Arc<Shared>,
    handle: u64,
    rpc_id: u64,
    p: DelegateParams,
) -> Result<(), RpcError> {
    let (logical, agent_type, instance_id) = {
        let conns = shared.conns.lock();
        let c = conns
            .get(&handle)
            .ok_or_else(|| RpcError::new(codes::NOT_REGISTERED, "connection is not registered"))?;
        (c.logical.clone(), c.agent_type, c.instance_id.clone())
    };
    // The duplicate check comes first, as in the CP.
    let key: FlightKey = (logical.clone(), p.delegation_id.clone());
    if shared.flights.lock().contains_key(&key) {
        return Err(RpcError::new(
            codes::DUPLICATE_DELEGATION,
            format!("delegation {} is already in flight", p.delegation_id),
        ));
    }
    if agent_type == AgentType::Worker {
        return Err(RpcError::new(
            codes::POLICY_DENIED,
            "workers may not initiate delegations",
        ));
    }
    if p.parent_delegation_id.is_some() || p.parent_admission.is_some() {
        return Err(RpcError::new(
            codes::POLICY_DENIED,
            "delegation depth 2 exceeds max_depth 1",
        ));
    }
    if p.delegation_id.is_empty() || p.delegation_id.len() > 256 {
        return Err(RpcError::new(
            codes::INVALID_PARAMS,
            "delegation_id must be 1 to 256 bytes",
        ));
    }
    if p.prompt.len() > shared.cfg.max_prompt_bytes {
        return Err(RpcError::new(
            codes::INVALID_PARAMS,
            format!(
                "prompt exceeds max_prompt_bytes ({})",
                shared.cfg.max_prompt_bytes
            ),
        ));
    }
    if !p.target.is_valid() {
        return Err(RpcError::new(
            codes::INVALID_PARAMS,
            "target must set exactly one of `name` or `labels`",
        ));
    }
    let deadline_ms = crate::a2a::model::ms_from_iso(&p.deadline)
        .ok_or_else(|| RpcError::new(codes::INVALID_PARAMS, "deadline must be an RFC 3339 time"))?;
    let now = oab_wire::identity::now_ms();
    if deadline_ms <= now {
        return Err(RpcError::new(
            codes::POLICY_DENIED,
            "deadline is in the past",
        ));
    }
    let max = shared.cfg.max_deadline_secs;
    if deadline_ms - now > max.saturating_mul(1000) {
        return Err(RpcError::new(
            codes::POLICY_DENIED,
            format!("deadline exceeds the cap of {max}s"),
        ));
    }
    let Some(target) = shared.cfg.targets.iter().find(|t| t.matches(&p.target)) else {
        return Err(RpcError::new(
            codes::NO_TARGET,
            "no target matches the selector",
        ));
    };
    let Some(caller) = shared.caller.get().cloned() else {
        return Err(RpcError::new(
            codes::NO_TARGET,
            "this connector does not delegate to remote peers",
        ));
    };
    let admission = shared.next_admission();
    {
        let mut flights = shared.flights.lock();
        if flights.contains_key(&key) {
            return Err(RpcError::new(
                codes::DUPLICATE_DELEGATION,
                format!("delegation {} is already in flight", p.delegation_id),
            ));
        }
        if flights.len() >= shared.cfg.max_delegations {
            return Err(RpcError::new(
                codes::SATURATED,
                format!(
                    "{} delegations in flight (max_delegations); retry later",
                    flights.len()
                ),
            ));
        }
        flights.insert(
            key.clone(),
            CallerFlight {
                admission,
                handle: None,
                cancel_reason: None,
            },
        );
    }
    let defaults = DelegationDefaults::default();
    let spec = NewDelegation {
        request_id: None,
        task: Task {
            text: p.prompt,
            context: openab_context(&p.delegation_id, &logical, &target.remote),
            a2a_message: None,
        },
        capabilities: target.capabilities.clone(),
        read_only: target.read_only,
        deadline: Duration::from_millis(deadline_ms - now),
        budgets: defaults.budgets,
        parent: ParentContext {
            agent: logical.clone(),
            trace_id: p.delegation_id.chars().take(128).collect(),
            execution_id: None,
        },
    };
    let flight = Flight {
        shared: shared.clone(),
        key,
        instance_id,
        admission,
        rpc_id,
        conn: handle,
        peer: target.peer.clone(),
    };
    let span = tracing::info_span!("openab_delegation", runtime = %logical, delegation = %p.delegation_id, admission);
    tokio::spawn(flight.run(caller, spec).instrument(span));
    Ok(())
}

/// What the callee side reads from `task.context.openab`.
fn openab_context(
    delegation_id: &str,
    from: &str,
    remote: &proto::TargetSelector,
) -> serde_json::Map<String, Value> {
    let mut m = serde_json::Map::new();
    m.insert(
        "openab".into(),
        json!({
            "delegation_id": delegation_id,
            "from": from,
            "chain": [from],
            "target": remote,
        }),
    );
    m
}

/// `cp/cancel` from an initiator: cancels its own delegation through the
/// relay. The end still comes as `cp/delegate_result` (cancelled, or what
/// won the race).
pub(crate) fn cancel(
    shared: &Arc<Shared>,
    handle: u64,
    p: &CancelParams,
) -> Result<Value, RpcError> {
    let refused = || {
        RpcError::new(
            codes::POLICY_DENIED,
            "delegation is not in flight for this instance",
        )
    };
    let logical = shared
        .conns
        .lock()
        .get(&handle)
        .map(|c| c.logical.clone())
        .ok_or_else(refused)?;
    let reason = p.reason.clone().unwrap_or_else(|| "cancelled".into());
    let to_cancel = {
        let mut flights = shared.flights.lock();
        let f = flights
            .get_mut(&(logical, p.delegation_id.clone()))
            .ok_or_else(refused)?;
        if p.admission.is_some_and(|a| a != f.admission) {
            return Err(refused());
        }
        match &f.handle {
            Some(h) => Some(h.clone()),
            None => {
                f.cancel_reason = Some(reason.clone());
                None
            }
        }
    };
    if let (Some(h), Some(caller)) = (to_cancel, shared.caller.get().cloned()) {
        tokio::spawn(async move {
            if let Err(e) = caller.cancel(&h, &reason).await {
                warn!(error = %e, "cancel not sent");
            }
        });
    }
    Ok(json!({ "ok": true }))
}

/// One delegation from a local primary, from admission to its result.
struct Flight {
    shared: Arc<Shared>,
    key: FlightKey,
    instance_id: String,
    admission: u64,
    rpc_id: u64,
    /// The connection that sent `cp/delegate` (the ack goes there).
    conn: u64,
    peer: oab_wire::PeerId,
}

/// How the wait for a terminal ended.
enum End {
    Terminal(Terminal),
    Refused(String, String),
    Lost(String),
}

impl Flight {
    async fn run(self, caller: crate::Caller, spec: NewDelegation) {
        let handle = match caller.delegate(&self.peer, spec).await {
            Ok(h) => h,
            Err(e) => {
                let code = match &e {
                    CallerError::Authority(_) | CallerError::Profile(_) => codes::POLICY_DENIED,
                    // The signed request is over the relay's payload limit
                    // (a prompt under max_prompt_bytes can still be, when
                    // that cap is set above the relay's): the request's
                    // fault, as an oversized prompt is.
                    CallerError::Link(crate::link::LinkError::TooLarge { .. }) => {
                        codes::INVALID_PARAMS
                    }
                    _ => codes::TARGET_DISCONNECTED,
                };
                self.refuse(RpcError::new(code, e.to_string())).await;
                return;
            }
        };
        let pending_cancel = {
            let mut flights = self.shared.flights.lock();
            flights.get_mut(&self.key).and_then(|f| {
                f.handle = Some(handle.clone());
                f.cancel_reason.take()
            })
        };
        if let Some(reason) = pending_cancel {
            let _ = caller.cancel(&handle, &reason).await;
        }
        let (end, acked) = self.follow(&caller, &handle).await;
        let result = match end {
            End::Terminal(t) if !acked && t.outcome == Outcome::Rejected => {
                let error = verified_error(&caller, &handle, &t);
                self.refuse(refusal_code(&error)).await;
                return;
            }
            End::Refused(code, message) if !acked => {
                self.refuse(relay_refusal(&code, &message)).await;
                return;
            }
            End::Terminal(t) => self.result_of(&caller, &handle, &t),
            End::Refused(code, message) => self.params(
                DelegationStatus::Failed,
                None,
                Some(format!("the relay refused: {code} ({message})")),
            ),
            End::Lost(why) => self.params(DelegationStatus::TargetDisconnected, None, Some(why)),
        };
        if !acked {
            self.ack(None).await;
        }
        info!(status = ?result.status, "delegation ended");
        self.shared.flights.lock().remove(&self.key);
        self.shared
            .deliver(&self.key.0, &self.instance_id, result)
            .await;
    }

    /// Reads events until the terminal; acks at acceptance or when
    /// `admission_wait_ms` passes. Returns the end and whether it acked.
    async fn follow(&self, caller: &crate::Caller, handle: &DelegationHandle) -> (End, bool) {
        let mut acked = false;
        let admit_by =
            tokio::time::Instant::now() + Duration::from_millis(self.shared.cfg.admission_wait_ms);
        let mut events = match caller.events(handle, 0).await {
            Ok(s) => s,
            Err(e) => return (End::Lost(e.to_string()), acked),
        };
        loop {
            let item = if acked {
                events.next().await
            } else {
                match tokio::time::timeout_at(admit_by, events.next()).await {
                    Ok(item) => item,
                    Err(_) => {
                        self.ack(None).await;
                        acked = true;
                        continue;
                    }
                }
            };
            match item {
                None => return (End::Lost("the event stream ended".into()), acked),
                Some(Ok(ev)) => match ev.kind {
                    EventKind::Terminal(t) => return (End::Terminal(t), acked),
                    // Acceptance alone is not admission: the remote side
                    // accepts before it looks for a worker. Its first
                    // progress event is the worker taking the task.
                    EventKind::Status { data, .. } if !acked => {
                        let worker = data
                            .as_ref()
                            .and_then(|d| d.pointer("/openab/assigned_to"))
                            .and_then(Value::as_str)
                            .map(str::to_string);
                        self.ack(worker.as_deref()).await;
                        acked = true;
                    }
                    EventKind::Artifact { .. } if !acked => {
                        self.ack(None).await;
                        acked = true;
                    }
                    _ => {}
                },
                Some(Err(EventError::Lagged { last })) => match caller.events(handle, last).await {
                    Ok(s) => events = s,
                    Err(e) => return (End::Lost(e.to_string()), acked),
                },
                Some(Err(EventError::Refused { code, message })) => {
                    return (End::Refused(code, message), acked);
                }
                Some(Err(e)) => return (End::Lost(e.to_string()), acked),
            }
        }
    }

    /// Answers `cp/delegate`; `assigned_to` is `<peer>` or, when the
    /// remote endpoint named its worker, `<peer>:<namespace>/<name>`.
    async fn ack(&self, worker: Option<&str>) {
        let assigned_to = match worker {
            Some(w) => format!("{}:{w}", self.peer),
            None => self.peer.to_string(),
        };
        let ack = json!({
            "delegation_id": self.key.1,
            "admission": self.admission,
            "assigned_to": assigned_to,
        });
        self.shared
            .send(self.conn, proto::response(self.rpc_id, ack))
            .await;
    }

    async fn refuse(&self, e: RpcError) {
        info!(code = e.code, reason = %e.message, "delegation refused");
        self.shared.flights.lock().remove(&self.key);
        self.shared
            .send(self.conn, proto::error_response(self.rpc_id, &e))
            .await;
    }

    fn params(
        &self,
        status: DelegationStatus,
        result: Option<String>,
        error: Option<String>,
    ) -> DelegateResultParams {
        DelegateResultParams {
            delegation_id: self.key.1.clone(),
            admission: Some(self.admission),
            status,
            result: result.map(|r| proto::cap_result(r, self.shared.cfg.max_result_bytes)),
            error,
        }
    }

    /// The `cp/delegate_result` for a terminal.
    fn result_of(
        &self,
        caller: &crate::Caller,
        handle: &DelegationHandle,
        t: &Terminal,
    ) -> DelegateResultParams {
        if t.relay_origin {
            let why = t.reason.clone();
            return match t.outcome {
                Outcome::Expired => self.params(DelegationStatus::Timeout, None, why),
                _ => self.params(DelegationStatus::TargetDisconnected, None, why),
            };
        }
        let verified = match caller.verify(handle, t) {
            Ok(v) => v.result,
            Err(e) => {
                return self.params(
                    DelegationStatus::Failed,
                    None,
                    Some(format!("the signed result did not verify: {e}")),
                );
            }
        };
        let error = verified.error.clone();
        match t.outcome {
            Outcome::Completed => {
                self.params(DelegationStatus::Completed, Some(text_of(&verified)), None)
            }
            Outcome::Failed | Outcome::Rejected => {
                let e = error.unwrap_or_default();
                let status = if e.starts_with(super::callee_side::DISCONNECTED) {
                    DelegationStatus::TargetDisconnected
                } else {
                    DelegationStatus::Failed
                };
                self.params(status, None, Some(e))
            }
            Outcome::Cancelled => self.params(DelegationStatus::Cancelled, None, error),
            Outcome::Expired => self.params(DelegationStatus::Timeout, None, error),
            Outcome::Unknown => self.params(DelegationStatus::TargetDisconnected, None, error),
        }
    }
}

/// The text of a completed result: a string output, an output's `text`,
/// else the text parts of its artifacts, else the output as JSON.
fn text_of(r: &crate::profile::DelegationResult) -> String {
    match &r.output {
        Some(Value::String(s)) => return s.clone(),
        Some(Value::Object(o)) if o.get("text").is_some_and(Value::is_string) => {
            return o
                .get("text")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_string();
        }
        _ => {}
    }
    let parts: Vec<String> = r
        .artifacts
        .iter()
        .filter_map(|a| serde_json::to_value(a).ok())
        .flat_map(|a| {
            a.get("parts")
                .and_then(Value::as_array)
                .cloned()
                .unwrap_or_default()
        })
        .filter_map(|p| p.get("text").and_then(Value::as_str).map(str::to_string))
        .collect();
    if !parts.is_empty() {
        return parts.join("\n");
    }
    r.output.as_ref().map(Value::to_string).unwrap_or_default()
}

/// The signed error of a refusal (or why it could not be read).
fn verified_error(caller: &crate::Caller, handle: &DelegationHandle, t: &Terminal) -> String {
    match caller.verify(handle, t) {
        Ok(v) => v.result.error.unwrap_or_default(),
        Err(e) => format!("policy: the signed refusal did not verify: {e}"),
    }
}

/// The CP error code for a callee's signed refusal (`[rejected: ]code: message`).
fn refusal_code(error: &str) -> RpcError {
    let rest = error.strip_prefix("rejected: ").unwrap_or(error);
    let code = rest.split(':').next().unwrap_or_default().trim();
    let cp = match code {
        "saturated" => codes::SATURATED,
        "no_target" => codes::NO_TARGET,
        _ => codes::POLICY_DENIED,
    };
    RpcError::new(cp, format!("the remote side refused: {error}"))
}

/// The CP error code for the relay's refusal of the delegation: the
/// retryable ones (caps, rate, store) are SATURATED, the rest (route,
/// deadline, depth, size) POLICY_DENIED.
fn relay_refusal(code: &str, message: &str) -> RpcError {
    let cp = match code {
        "too_many_delegations" | "rate_limited" | "store_unavailable" => codes::SATURATED,
        _ => codes::POLICY_DENIED,
    };
    RpcError::new(cp, format!("the relay refused: {code} ({message})"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_map_to_the_cps_codes() {
        let table = [
            ("saturated: 4 running", codes::SATURATED),
            ("rejected: saturated: worker at capacity", codes::SATURATED),
            ("rejected: no_target: no worker", codes::NO_TARGET),
            ("capability_denied: write:*", codes::POLICY_DENIED),
            ("", codes::POLICY_DENIED),
        ];
        for (error, want) in table {
            assert_eq!(refusal_code(error).code, want, "{error}");
        }
        assert_eq!(
            relay_refusal("route_denied", "x").code,
            codes::POLICY_DENIED
        );
        assert_eq!(
            relay_refusal("too_many_delegations", "x").code,
            codes::SATURATED
        );
        assert_eq!(relay_refusal("rate_limited", "x").code, codes::SATURATED);
        assert_eq!(
            relay_refusal("depth_exceeded", "x").code,
            codes::POLICY_DENIED
        );
    }
}
