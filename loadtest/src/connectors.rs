//! Real connectors (`oab_connector::Connector`) against the relay under
//! test, for the scenarios that measure and check whole delegations
//! (`delegations`, `cancel-race`, `reconnect-storm`): their options, the
//! request every benchmark delegation sends, an audit sink whose changes can
//! be awaited, and a small seeded random generator for fault timing.
//!
//! Both connectors use the [`Setup`]'s identities and trust each other's
//! configured key; the callee's policy admits `read:*` (the route's ceiling),
//! and its concurrency cap is above every in-flight level the scenarios use,
//! so a delegation is never refused for `saturated`.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::Context as _;
use oab_connector::audit::{AuditEvent, AuditRecord, AuditSink, MemoryAuditSink};
use oab_connector::authority::{CapabilitySet, Grant, Policy};
use oab_connector::callee::{CalleeOptions, TaskExecutor};
use oab_connector::link::LinkSettings;
use oab_connector::profile::{Budgets, ParentContext, RiskLevel, Task};
use oab_connector::trust::RelayTrust;
use oab_connector::{Connector, ConnectorOptions, NewDelegation};
use oab_wire::identity::{Identity, PeerKey};
use oab_wire::{DelegationKey, Outcome, PeerId};
use tokio::sync::Notify;

use crate::setup::Setup;

/// Delegations one callee runs at once at most: above the largest in-flight
/// level a scenario offers, so none is refused as `saturated`.
pub const CALLEE_MAX_CONCURRENT: usize = 4_096;

/// Audit records the callee's sink keeps: five or so per delegation for the
/// largest default run (cancel-race, 1,000), with a wide margin.
pub const AUDIT_CAPACITY: usize = 1_000_000;
/// Requests a benchmark callee keeps for one caller (its replay cache
/// share): one `delegations` level of the default --max-delegations, whose
/// 600 s deadlines all outlive the run. The connector's default is 16,384.
pub const BENCH_LIVE_REQUESTS_PER_PEER: usize = 1 << 20;

/// First reconnect backoff of the scenarios' connectors (the library default
/// is 100 ms; a fault scenario reconnects hundreds of times).
pub const BACKOFF_INITIAL: Duration = Duration::from_millis(20);

/// Largest reconnect backoff of the scenarios' connectors.
pub const BACKOFF_MAX: Duration = Duration::from_millis(500);

/// `store.finished_ttl_ms` of the connector scenarios: ten minutes instead of
/// the benchmarks' one second. A connector reads a finished delegation's
/// events after the relay appended its terminal; with the 1 s TTL a caller
/// that falls more than a second behind under load (256 in flight on the
/// Redis store does) finds the delegation gone and gets a gap, which would
/// measure the retention setting instead of the delegation path.
pub const FINISHED_TTL_MS: u64 = 600_000;

fn budgets(n: u64) -> Budgets {
    Budgets {
        tokens: n,
        cost_micros: n,
        risk: RiskLevel::Medium,
        output_bytes: n,
    }
}

fn policy() -> anyhow::Result<Policy> {
    Ok(Policy {
        allowed_capabilities: CapabilitySet::parse(["read:*"]).context("capability set")?,
        allow_writes: false,
        max_depth: 1,
        budgets: budgets(u64::MAX / 4),
        max_deadline_ms: 3_600_000,
    })
}

fn key_of(id: &Identity) -> PeerKey {
    PeerKey {
        key_id: id.key_id.clone(),
        public_key: id.public_key(),
        not_before_ms: None,
        not_after_ms: None,
    }
}

/// Link settings for `id` dialing `relay` (the relay, or a proxy in front of
/// it), trusting the run's certificate.
pub fn link_settings(setup: &Setup, id: &Identity, relay: SocketAddr) -> LinkSettings {
    let mut s = LinkSettings::new(
        format!("wss://localhost:{}/", relay.port()),
        RelayTrust::Ca(vec![rustls_pki_types::CertificateDer::from(
            setup.cert_der.clone(),
        )]),
        id.clone(),
    );
    s.backoff_initial = BACKOFF_INITIAL;
    s.backoff_max = BACKOFF_MAX;
    s
}

/// Starts a connector for the run's caller (no callee side) dialing `relay`.
pub fn start_caller(setup: &Setup, relay: SocketAddr) -> anyhow::Result<Connector> {
    start(
        setup,
        link_settings(setup, &setup.caller, relay),
        None,
        None,
        None,
    )
}

/// Starts a caller-only connector for `id` (one of the [`Setup`]'s extra
/// callers) dialing `relay`.
pub fn start_caller_as(
    setup: &Setup,
    id: &Identity,
    relay: SocketAddr,
) -> anyhow::Result<Connector> {
    start(setup, link_settings(setup, id, relay), None, None, None)
}

/// Starts a connector for the run's caller dialing `relay` that keeps its
/// delegations in the state folder `state` (a later connector on the same
/// folder takes them back with `restore()`, as a restarted process does).
pub fn start_caller_with_state(
    setup: &Setup,
    relay: SocketAddr,
    state: &std::path::Path,
) -> anyhow::Result<Connector> {
    let state = oab_connector::state::FileState::open(state)
        .with_context(|| format!("opening the caller's state folder {}", state.display()))?;
    start(
        setup,
        link_settings(setup, &setup.caller, relay),
        None,
        None,
        Some(state),
    )
}

/// Starts a caller-only connector for `id` dialing `relay` that keeps its
/// delegations in the state folder `state` (see
/// [`start_caller_with_state`]).
pub fn start_caller_as_with_state(
    setup: &Setup,
    id: &Identity,
    relay: SocketAddr,
    state: &std::path::Path,
) -> anyhow::Result<Connector> {
    let state = oab_connector::state::FileState::open(state)
        .with_context(|| format!("opening the caller's state folder {}", state.display()))?;
    start(
        setup,
        link_settings(setup, id, relay),
        None,
        None,
        Some(state),
    )
}

/// Starts a connector for the run's callee dialing `relay`, serving
/// delegations with `executor` and auditing into `audit`.
pub fn start_callee(
    setup: &Setup,
    relay: SocketAddr,
    executor: Arc<dyn TaskExecutor>,
    audit: Arc<dyn AuditSink>,
) -> anyhow::Result<Connector> {
    start(
        setup,
        link_settings(setup, &setup.callee, relay),
        Some(executor),
        Some(audit),
        None,
    )
}

fn start(
    setup: &Setup,
    link: LinkSettings,
    executor: Option<Arc<dyn TaskExecutor>>,
    audit: Option<Arc<dyn AuditSink>>,
    state: Option<oab_connector::state::FileState>,
) -> anyhow::Result<Connector> {
    let trust: HashMap<PeerId, Vec<PeerKey>> = [&setup.caller, &setup.callee]
        .into_iter()
        .map(|i| (i.peer.clone(), vec![key_of(i)]))
        .collect();
    let callee = match executor {
        Some(executor) => Some(CalleeOptions {
            executor,
            policy: Arc::new(policy()?),
            max_concurrent: CALLEE_MAX_CONCURRENT,
            max_concurrent_per_peer: CALLEE_MAX_CONCURRENT,
            // A callee keeps every request until its deadline (600 s here),
            // so the default share (16,384) would refuse a run at thousands
            // of delegations a second as `saturated` after a few seconds;
            // this one holds a level of the default --max-delegations.
            max_live_requests_per_peer: BENCH_LIVE_REQUESTS_PER_PEER,
            replay_window_ms: oab_connector::nonce::NonceCache::DEFAULT_MAX_AGE_MS,
        }),
        None => None,
    };
    Connector::start(ConnectorOptions {
        link,
        trust,
        grant: Grant {
            capabilities: CapabilitySet::parse(["read:*"]).context("capability set")?,
            remaining: budgets(u64::MAX / 4),
        },
        caller_policy: policy()?,
        callee,
        audit,
        state,
    })
    .context("starting a connector")
}

/// The request every benchmark delegation sends: read-only, `read:repo`,
/// small budgets, a deadline far beyond the run.
pub fn new_delegation(text: String) -> NewDelegation {
    NewDelegation {
        request_id: None,
        task: Task {
            text,
            context: Default::default(),
            a2a_message: None,
        },
        capabilities: vec!["read:repo".into()],
        read_only: true,
        deadline: Duration::from_secs(600),
        budgets: budgets(1_000),
        parent: ParentContext {
            agent: "oab-loadtest".into(),
            trace_id: "loadtest".into(),
            execution_id: None,
        },
    }
}

/// A [`MemoryAuditSink`] that also wakes waiters on every record, so a
/// scenario can wait for the callee's acknowledged terminals without polling.
#[derive(Debug)]
pub struct WatchedAudit {
    records: MemoryAuditSink,
    changed: Notify,
}

impl WatchedAudit {
    /// A sink keeping at most `capacity` records.
    pub fn new(capacity: usize) -> WatchedAudit {
        WatchedAudit {
            records: MemoryAuditSink::new(capacity),
            changed: Notify::new(),
        }
    }

    /// The terminals the callee recorded as acknowledged by the relay
    /// (`completed`, `cancelled`, `failed`, `rejected` without an error
    /// code), per delegation, in order.
    pub fn terminals(&self) -> HashMap<DelegationKey, Vec<Outcome>> {
        let mut out: HashMap<DelegationKey, Vec<Outcome>> = HashMap::new();
        for rec in self.records.records() {
            let terminal = matches!(
                rec.event,
                AuditEvent::Completed
                    | AuditEvent::Cancelled
                    | AuditEvent::Failed
                    | AuditEvent::Rejected
            );
            if terminal
                && rec.code.is_none()
                && let Some(o) = rec.outcome
            {
                out.entry(rec.key()).or_default().push(o);
            }
        }
        out
    }

    /// Waits until `condition` holds for [`WatchedAudit::terminals`], or
    /// `timeout` passes; returns the last view either way.
    pub async fn wait_terminals(
        &self,
        timeout: Duration,
        mut condition: impl FnMut(&HashMap<DelegationKey, Vec<Outcome>>) -> bool,
    ) -> HashMap<DelegationKey, Vec<Outcome>> {
        let wait = async {
            loop {
                let notified = self.changed.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                let view = self.terminals();
                if condition(&view) {
                    return view;
                }
                notified.await;
            }
        };
        match tokio::time::timeout(timeout, wait).await {
            Ok(view) => view,
            Err(_) => self.terminals(),
        }
    }
}

impl AuditSink for WatchedAudit {
    fn record(&self, record: &AuditRecord) {
        self.records.record(record);
        self.changed.notify_waiters();
    }
}

/// A xorshift64 generator, seeded per run (the seed is reported, so a run's
/// fault timing can be reproduced). Not for anything but test timing.
#[derive(Debug)]
pub struct Rng(AtomicU64);

impl Rng {
    /// A generator from `seed` (0 is replaced: xorshift would stay at 0).
    pub fn new(seed: u64) -> Rng {
        Rng(AtomicU64::new(if seed == 0 {
            0x9E37_79B9_7F4A_7C15
        } else {
            seed
        }))
    }

    /// A value in `0..n` (0 when `n` is 0).
    pub fn below(&self, n: u64) -> u64 {
        let mut x = self.0.load(Ordering::Relaxed);
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0.store(x, Ordering::Relaxed);
        x.checked_rem(n).unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rng_stays_in_range_and_is_reproducible() {
        let (a, b) = (Rng::new(7), Rng::new(7));
        for _ in 0..1000 {
            let x = a.below(10);
            assert!(x < 10);
            assert_eq!(x, b.below(10));
        }
        assert_eq!(Rng::new(0).below(0), 0);
    }
}
