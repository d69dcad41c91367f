//! Caller side: a local primary's `cp/delegate` to a mapped target becomes
//! a signed delegation through the relay ([`crate::Caller::delegate`]), and
//! its terminal comes back as `cp/delegate_result`.
//!
//! The request: task text from the prompt, deadline from the CP deadline,
//! capabilities and read-only from the target's `[[openab.targets]]` entry,
//! and in `task.context.openab` the CP's delegation id and admission (the
//! remote endpoint hands both to its worker unchanged), the initiator
//! (`from`), the chain and the remote target. The answer to `cp/delegate`
//! waits up to `admission_wait_ms` for the remote side: its first progress
//! event (a remote endpoint sends one when a worker took the task) is the
//! ack (`delegation_id`, `admission`, `assigned_to` = the worker's
//! `namespace/name`), a refusal is the CP's error code, and past the wait
//! the delegation is acknowledged and goes on. Outcomes: completed, failed
//! and cancelled as they are, `expired` as timeout, `unknown` as
//! target_disconnected.
//!
//! Depth and initiation follow the initiator's namespace policy
//! (`[openab.namespaces.<ns>]`, openab-cp's `max_depth` and
//! `allow_worker_initiation`, checked in openab-cp's order): a runtime that
//! names as parent (`parent_delegation_id` with `parent_admission`) a
//! delegation it serves starts one a level deeper, carrying the parent's
//! chain with the initiator appended, at the relay at that depth, and with
//! a deadline no later than the parent's.
//!
//! As in the CP, whoever removes a delegation's entry owns its end: the
//! terminal (delivered to the connection that started it), `cp/cancel`
//! (cancelled across the relay, nothing delivered afterwards), or that
//! connection ending (the same cancel).
//!
//! Never: passes on a result that did not verify against the callee's key
//! (it becomes `failed` naming why); delivers a result for a delegation
//! its primary cancelled or left.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt as _;
use oab_wire::Outcome;
use serde_json::{Value, json};
use tokio::sync::oneshot;
use tracing::{Instrument as _, debug, info, warn};

use super::proto::{
    self, AgentType, CancelParams, DelegateParams, DelegateResultParams, DelegationStatus,
    RpcError, codes, texts,
};
use super::{CallerFlight, FlightKey, Shared};
use crate::a2a::DelegationDefaults;
use crate::caller::{
    CallerError, DelegationEvent, DelegationHandle, EventKind, NewDelegation, Terminal,
};
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
    let (logical, agent_type) = {
        let conns = shared.conns.lock();
        let c = conns
            .get(&handle)
            .ok_or_else(|| RpcError::new(codes::NOT_REGISTERED, "connection is not registered"))?;
        (c.logical.clone(), c.agent_type)
    };
    // The duplicate check comes first, as in the CP.
    let key: FlightKey = (logical.clone(), p.delegation_id.clone());
    if shared.flights.lock().contains_key(&key) {
        return Err(RpcError::new(
            codes::DUPLICATE_DELEGATION,
            texts::duplicate(&p.delegation_id),
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
    let parent = parent_of(shared, handle, &p)?;
    if !p.target.is_valid() {
        return Err(RpcError::new(
            codes::INVALID_PARAMS,
            "target must set exactly one of `name` or `labels`",
        ));
    }
    let deadline_ms = crate::a2a::model::ms_from_iso(&p.deadline)
        .ok_or_else(|| RpcError::new(codes::INVALID_PARAMS, "deadline must be an RFC 3339 time"))?;
    let Some((target_index, target)) = shared
        .cfg
        .targets
        .iter()
        .enumerate()
        .find(|(_, t)| t.matches(&p.target))
    else {
        return Err(RpcError::new(codes::NO_TARGET, texts::NO_TARGET));
    };
    let Some(caller) = shared.caller.get().cloned() else {
        return Err(RpcError::new(codes::NO_TARGET, texts::NO_TARGET));
    };
    // The initiator's namespace's policy, in the CP's order: role, depth,
    // deadline.
    let namespace = logical.split('/').next().unwrap_or_default();
    let policy = shared.cfg.policy_for(namespace);
    if agent_type == AgentType::Worker && !policy.allow_worker_initiation {
        return Err(RpcError::new(
            codes::POLICY_DENIED,
            texts::WORKER_INITIATION,
        ));
    }
    let depth = parent.as_ref().map_or(1, |a| u32::from(a.depth) + 1);
    let depth = match u8::try_from(depth) {
        Ok(d) if d <= policy.max_depth => d,
        _ => {
            return Err(RpcError::new(
                codes::POLICY_DENIED,
                texts::depth_exceeded(depth, policy.max_depth),
            ));
        }
    };
    // Authority only shrinks down a chain: a child asks for nothing its
    // parent does not hold, and writes only under a parent that may.
    if let Some(a) = &parent {
        let extra: Vec<&str> = target
            .capabilities
            .iter()
            .filter(|c| !a.capabilities.contains(c))
            .map(String::as_str)
            .collect();
        if !extra.is_empty() {
            return Err(RpcError::new(
                codes::POLICY_DENIED,
                texts::beyond_parent(&extra),
            ));
        }
        if a.read_only && !target.read_only {
            return Err(RpcError::new(
                codes::POLICY_DENIED,
                texts::beyond_parent(&["writes"]),
            ));
        }
    }
    let now = oab_wire::identity::now_ms();
    if deadline_ms <= now {
        return Err(RpcError::new(codes::POLICY_DENIED, texts::DEADLINE_PAST));
    }
    let max = shared.cfg.max_deadline_secs;
    if deadline_ms - now > max.saturating_mul(1000) {
        return Err(RpcError::new(
            codes::POLICY_DENIED,
            texts::deadline_too_long(max),
        ));
    }
    if parent.as_ref().is_some_and(|a| deadline_ms > a.deadline_ms) {
        return Err(RpcError::new(
            codes::POLICY_DENIED,
            texts::DEADLINE_EXCEEDS_PARENT,
        ));
    }
    let mut chain = parent.map(|a| a.chain).unwrap_or_default();
    chain.push(logical.clone());
    let admission = shared.next_admission();
    let (cancel_tx, cancel_rx) = oneshot::channel();
    {
        let mut flights = shared.flights.lock();
        if flights.contains_key(&key) {
            return Err(RpcError::new(
                codes::DUPLICATE_DELEGATION,
                texts::duplicate(&p.delegation_id),
            ));
        }
        if flights.len() >= shared.cfg.max_delegations {
            return Err(RpcError::new(
                codes::SATURATED,
                texts::inflight_limit(shared.cfg.max_delegations),
            ));
        }
        if let Some(cap) = target.max_delegated_sessions {
            let to_target = flights
                .values()
                .filter(|f| f.target == target_index)
                .count();
            if to_target >= usize::try_from(cap).unwrap_or(usize::MAX) {
                return Err(RpcError::new(codes::SATURATED, texts::SATURATED));
            }
        }
        flights.insert(
            key.clone(),
            CallerFlight {
                admission,
                conn: handle,
                target: target_index,
                cancel: cancel_tx,
            },
        );
    }
    let defaults = DelegationDefaults::default();
    // A request id the relay can find the delegation by (`oab-relay inspect
    // <delegation id>`).
    let request_id = oab_wire::RequestId::for_cp_delegation(&p.delegation_id);
    let spec = NewDelegation {
        request_id: Some(request_id),
        task: Task {
            text: p.prompt,
            context: openab_context(
                &p.delegation_id,
                admission,
                &logical,
                &chain,
                &target.remote,
            ),
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
        admission,
        rpc_id,
        conn: handle,
        peer: target.peer.clone(),
        depth,
        cancel: cancel_rx,
    };
    let span = tracing::info_span!("openab_delegation", runtime = %logical, delegation = %p.delegation_id, admission, depth);
    tokio::spawn(flight.run(caller, spec).instrument(span));
    Ok(())
}

/// What a delegation inherits from the parent its initiator names.
struct Ancestry {
    chain: Vec<String>,
    depth: u8,
    deadline_ms: u64,
    capabilities: Vec<String>,
    read_only: bool,
}

/// The parent `p` names, as the CP resolves it: both `parent_delegation_id`
/// and `parent_admission`, naming a delegation this connection serves under
/// that admission. An unknown parent, another connection's and a stale
/// admission get the same answer, so nothing about other delegations can
/// be learned from it.
fn parent_of(
    shared: &Shared,
    handle: u64,
    p: &DelegateParams,
) -> Result<Option<Ancestry>, RpcError> {
    match (&p.parent_delegation_id, p.parent_admission) {
        (None, None) => Ok(None),
        (Some(_), None) => Err(RpcError::new(
            codes::INVALID_PARAMS,
            texts::PARENT_ID_WITHOUT_ADMISSION,
        )),
        (None, Some(_)) => Err(RpcError::new(
            codes::INVALID_PARAMS,
            texts::PARENT_ADMISSION_WITHOUT_ID,
        )),
        (Some(pid), Some(admission)) => shared
            .serving
            .lock()
            .get(&(handle, pid.clone()))
            .filter(|f| f.admission == admission)
            .map(|f| {
                Some(Ancestry {
                    chain: f.chain.clone(),
                    depth: f.depth,
                    deadline_ms: f.deadline_ms,
                    capabilities: f.capabilities.clone(),
                    read_only: f.read_only,
                })
            })
            .ok_or_else(|| RpcError::new(codes::INVALID_PARAMS, texts::parent_not_in_flight(pid))),
    }
}

/// What the callee side reads from `task.context.openab`.
fn openab_context(
    delegation_id: &str,
    admission: u64,
    from: &str,
    chain: &[String],
    remote: &proto::TargetSelector,
) -> serde_json::Map<String, Value> {
    let mut m = serde_json::Map::new();
    m.insert(
        "openab".into(),
        json!({
            "delegation_id": delegation_id,
            "admission": admission,
            "from": from,
            "chain": chain,
            "target": remote,
        }),
    );
    m
}

/// `cp/cancel` from an initiator: ends its own delegation here at once, as
/// the CP does (the id is free again, and no `cp/delegate_result` follows),
/// and cancels it through the relay, which reaches the remote worker as
/// `cp/cancel`.
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
    let flight = {
        let mut flights = shared.flights.lock();
        let key = (logical, p.delegation_id.clone());
        match flights.get(&key) {
            Some(f) if f.conn == handle && p.admission.is_none_or(|a| a == f.admission) => {
                flights.remove(&key).ok_or_else(refused)?
            }
            _ => return Err(refused()),
        }
    };
    let _ = flight.cancel.send(reason);
    Ok(json!({ "ok": true }))
}

/// One delegation from a local primary, from admission to its result.
struct Flight {
    shared: Arc<Shared>,
    key: FlightKey,
    admission: u64,
    rpc_id: u64,
    /// The connection that sent `cp/delegate` (the ack and the result go
    /// there).
    conn: u64,
    peer: oab_wire::PeerId,
    /// The delegation's depth (1, or its parent's + 1).
    depth: u8,
    /// The cancel (the primary's `cp/cancel`, or its connection ending).
    cancel: oneshot::Receiver<String>,
}

/// Commits a delegation's terminal, which releases it at the relay (only
/// its outcome is kept from then on). A failure only costs retention.
async fn release(caller: &crate::Caller, handle: &DelegationHandle, terminal: &DelegationEvent) {
    if let Err(e) = caller.commit(handle, terminal).await {
        debug!(key = %handle.key, error = %e, "terminal not committed");
    }
}

/// How the wait for a terminal ended.
enum End {
    Terminal(Terminal),
    Refused(String, String),
    Lost(String),
    /// The primary cancelled or left: the entry is already gone.
    Cancelled(String),
}

impl Flight {
    async fn run(mut self, caller: crate::Caller, spec: NewDelegation) {
        let handle = match caller.delegate_at_depth(&self.peer, spec, self.depth).await {
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
        // The caller logs "delegation sent" with the key and the trace id,
        // inside this span, which carries the CP delegation id beside them:
        // `oab-relay inspect` takes either.
        let (end, acked) = self.follow(&caller, &handle).await;
        let result = match end {
            End::Cancelled(reason) => {
                if !acked {
                    self.ack(None).await;
                }
                info!(%reason, "delegation cancelled by its primary");
                if let Err(e) = caller.cancel(&handle, &reason).await {
                    warn!(error = %e, "cancel not sent");
                }
                // Followed to its end so the caller's record of it ends too;
                // the end goes to nobody.
                if let Ok(mut events) = caller.events(&handle, 0).await {
                    while let Some(Ok(ev)) = events.next().await {
                        if matches!(ev.kind, EventKind::Terminal(_)) {
                            release(&caller, &handle, &ev).await;
                            break;
                        }
                    }
                }
                return;
            }
            End::Terminal(t) if !acked && t.outcome == Outcome::Rejected => {
                let error = verified_error(&caller, &handle, &t);
                self.refuse(refusal_code(&error, &self.key.1)).await;
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
        // Whoever removes the entry owns the end: a cancel that came first
        // already did, and then nothing is delivered.
        if !self.take_entry() {
            info!(status = ?result.status, "delegation ended after its primary cancelled or left; not delivered");
            return;
        }
        info!(status = ?result.status, "delegation ended");
        if !self.shared.deliver(self.conn, result).await {
            info!("the primary's connection ended before its result; dropped");
        }
    }

    /// Removes this delegation's entry (not a later admission of the same
    /// id); false when a cancel or the primary's leaving removed it first.
    fn take_entry(&self) -> bool {
        let mut flights = self.shared.flights.lock();
        match flights.get(&self.key) {
            Some(f) if f.admission == self.admission => flights.remove(&self.key).is_some(),
            _ => false,
        }
    }

    /// Reads events until the terminal or the cancel; acks at acceptance
    /// or when `admission_wait_ms` passes. Returns the end and whether it
    /// acked.
    async fn follow(&mut self, caller: &crate::Caller, handle: &DelegationHandle) -> (End, bool) {
        let mut acked = false;
        let admit_by =
            tokio::time::Instant::now() + Duration::from_millis(self.shared.cfg.admission_wait_ms);
        let mut events = match caller.events(handle, 0).await {
            Ok(s) => s,
            Err(e) => return (End::Lost(e.to_string()), acked),
        };
        // Closed when the entry went without a cancel (never while this
        // task follows); then only the events end the wait.
        let mut cancel_open = true;
        loop {
            let admit = async {
                if acked {
                    std::future::pending::<()>().await;
                } else {
                    tokio::time::sleep_until(admit_by).await;
                }
            };
            let item = tokio::select! {
                r = &mut self.cancel, if cancel_open => match r {
                    Ok(reason) => return (End::Cancelled(reason), acked),
                    Err(_) => {
                        cancel_open = false;
                        continue;
                    }
                },
                () = admit => {
                    self.ack(None).await;
                    acked = true;
                    continue;
                }
                item = events.next() => item,
            };
            match item {
                None => return (End::Lost("the event stream ended".into()), acked),
                Some(Ok(ev)) => match ev.kind {
                    EventKind::Terminal(ref t) => {
                        // Read for good (the result goes to the primary
                        // from here): the relay may keep only the outcome.
                        release(caller, handle, &ev).await;
                        return (End::Terminal(t.clone()), acked);
                    }
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

    /// Answers `cp/delegate`. `assigned_to` is the worker's `namespace/name`
    /// as the remote endpoint named it (what the CP answers), or the peer
    /// when the remote side has not answered within `admission_wait_ms`;
    /// `assigned_peer` names the remote host either way.
    async fn ack(&self, worker: Option<&str>) {
        let assigned_to = match worker {
            Some(w) => w.to_string(),
            None => self.peer.to_string(),
        };
        let ack = json!({
            "delegation_id": self.key.1,
            "admission": self.admission,
            "assigned_to": assigned_to,
            "assigned_peer": self.peer.to_string(),
        });
        self.shared
            .send(self.conn, proto::response(self.rpc_id, ack))
            .await;
    }

    async fn refuse(&self, e: RpcError) {
        info!(code = e.code, reason = %e.message, "delegation refused");
        self.take_entry();
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

/// The CP error for a callee's signed refusal (`[rejected: ]code: message`):
/// the remote endpoint's no-target, saturation and duplicate refusals are
/// the CP's own, with its words; any other is POLICY_DENIED naming it.
fn refusal_code(error: &str, delegation_id: &str) -> RpcError {
    let rest = error.strip_prefix("rejected: ").unwrap_or(error);
    let code = rest.split(':').next().unwrap_or_default().trim();
    match code {
        "saturated" => RpcError::new(codes::SATURATED, texts::SATURATED),
        "no_target" => RpcError::new(codes::NO_TARGET, texts::NO_TARGET),
        "duplicate_delegation" => {
            RpcError::new(codes::DUPLICATE_DELEGATION, texts::duplicate(delegation_id))
        }
        _ => RpcError::new(
            codes::POLICY_DENIED,
            format!("the remote side refused: {error}"),
        ),
    }
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
            (
                "rejected: duplicate_delegation: d-1 in flight",
                codes::DUPLICATE_DELEGATION,
            ),
            ("capability_denied: write:*", codes::POLICY_DENIED),
            ("", codes::POLICY_DENIED),
        ];
        for (error, want) in table {
            assert_eq!(refusal_code(error, "d-1").code, want, "{error}");
        }
        assert_eq!(
            refusal_code("rejected: no_target: x", "d-1").message,
            texts::NO_TARGET
        );
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
