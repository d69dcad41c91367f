//! `cancel-race`: `count` delegations, each cancelled at a random moment
//! around its completion; both sides must agree on exactly one terminal per
//! delegation.
//!
//! The callee's executor works for a random number of scheduler turns
//! (`0..turns`) and completes, stopping early if its cancel token fires; the
//! caller cancels after a random number of turns of its own (`0..turns`)
//! after `delegate` returned, then waits for the terminal. The caller's view
//! is the terminal it received (verified when the callee signed it); the
//! callee's view is the terminal it recorded in its audit trail once the
//! relay acknowledged it. A delegation fails the check when the two differ,
//! when either side has none, or when the callee recorded more than one.
//! The split between outcomes (`completed` vs `cancelled`) shows where the
//! race landed.
//!
//! Progress is checked too: the executor emits a progress event every
//! [`PROGRESS_EVERY`] turns and one more when it sees the cancel, and
//! records each event its sink accepted; the caller collects the progress
//! it received before the terminal. A delegation fails the check when the
//! two lists differ (a lost, extra or reordered event).

use std::collections::{BTreeMap, HashMap};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use futures_util::StreamExt as _;
use oab_connector::EventKind;
use oab_connector::callee::{Execution, StopReason, TaskExecutor, TaskRun};
use oab_wire::{DelegationKey, Outcome, PeerId};
use serde::Serialize;
use tokio::time::Instant;

use super::{Common, relay_bin, run_header};
use crate::connectors::{
    AUDIT_CAPACITY, Rng, WatchedAudit, new_delegation, start_callee, start_caller,
};
use crate::relay::{RelayUnderTest, StoreKind};
use crate::report::{Report, Table, fmt_count};
use crate::setup::{CALLEE, Setup};

/// Options of the cancel-race scenario.
#[derive(Debug, Clone, Serialize)]
pub struct CancelRaceOptions {
    /// The relay's store.
    pub store: StoreKind,
    /// Delegations.
    pub count: u32,
    /// Delegations in flight at once.
    pub in_flight: usize,
    /// Upper bound of the random scheduler turns on both sides.
    pub turns: u64,
    /// Seed of the random timing (reported; 0 picks one from the clock).
    pub seed: u64,
    /// How long the caller waits for each terminal, and the callee's audit
    /// for all of them, seconds.
    pub wait_seconds: f64,
}

/// The executor emits a progress event every this many turns.
pub const PROGRESS_EVERY: u64 = 16;

/// The progress number of the event the executor emits when it sees the
/// cancel.
const CANCEL_SEEN: u64 = u64::MAX;

/// What each delegation's executor emitted, by request id: one entry per
/// delegation of the run (`count` at most), dropped with the run.
type Emitted = Arc<parking_lot::Mutex<HashMap<String, Vec<u64>>>>;

/// Works for a random number of scheduler turns, then completes; emits
/// progress on the way and records what its sink accepted.
struct Racer {
    rng: Arc<Rng>,
    turns: u64,
    emitted: Emitted,
}

impl TaskExecutor for Racer {
    fn execute(
        &self,
        run: TaskRun,
    ) -> Pin<Box<dyn std::future::Future<Output = Execution> + Send>> {
        let turns = self.rng.below(self.turns);
        let emitted = self.emitted.clone();
        Box::pin(async move {
            let id = run.key.request_id.to_string();
            let emit = |i: u64| {
                let (sink, emitted, id) = (run.sink.clone(), emitted.clone(), id.clone());
                async move {
                    let data = Some(serde_json::json!({ "i": i }));
                    if sink.status("TASK_STATE_WORKING", None, data).await.is_ok() {
                        emitted.lock().entry(id).or_default().push(i);
                    }
                }
            };
            for t in 0..turns {
                if run.cancel.is_cancelled() {
                    emit(CANCEL_SEEN).await;
                    return Execution::stopped(StopReason::Cancelled);
                }
                if t % PROGRESS_EVERY == 0 {
                    emit(t).await;
                }
                tokio::task::yield_now().await;
            }
            Execution::stopped(StopReason::EndTurn)
        })
    }
}

/// What the caller saw for one delegation.
#[derive(Debug, Clone)]
struct CallerView {
    outcome: Option<Outcome>,
    /// The progress numbers received before the terminal.
    progress: Vec<u64>,
    error: Option<String>,
}

/// Runs the scenario.
pub async fn run(opts: &CancelRaceOptions, common: &Common) -> anyhow::Result<Report> {
    let common = &common.for_connectors();
    let seed = if opts.seed == 0 {
        oab_wire::identity::now_ms() | 1
    } else {
        opts.seed
    };
    let rng = Arc::new(Rng::new(seed));
    let setup = Setup::new(0, common.tuning.clone())?;
    let relay = RelayUnderTest::start(&setup, &common.relay, opts.store, common.redis_persistence)
        .await
        .with_context(|| format!("starting the relay on the {} store", opts.store.name()))?;
    tracing::info!(store = opts.store.name(), pid = ?relay.pid(), seed, "relay started");
    let audit = Arc::new(WatchedAudit::new(AUDIT_CAPACITY));
    let emitted: Emitted = Arc::default();
    let callee = start_callee(
        &setup,
        relay.addr(),
        Arc::new(Racer {
            rng: rng.clone(),
            turns: opts.turns.max(1),
            emitted: emitted.clone(),
        }),
        audit.clone(),
    )?;
    let caller = Arc::new(start_caller(&setup, relay.addr())?);
    caller.connected().await.context("caller connect")?;
    callee.connected().await.context("callee connect")?;
    let callee_peer = PeerId::new(CALLEE).context("callee peer id")?;
    let wait = Duration::from_secs_f64(opts.wait_seconds);

    let t0 = Instant::now();
    let slots = Arc::new(tokio::sync::Semaphore::new(opts.in_flight.max(1)));
    let mut tasks = tokio::task::JoinSet::new();
    let mut start_errors = Vec::new();
    for i in 0..opts.count {
        let slot = slots
            .clone()
            .acquire_owned()
            .await
            .context("in-flight slots")?;
        let (caller, peer, delay) = (
            caller.clone(),
            callee_peer.clone(),
            rng.below(opts.turns.max(1)),
        );
        tasks.spawn(async move {
            let _slot = slot;
            let h = match caller
                .caller()
                .delegate(&peer, new_delegation(format!("race {i}")))
                .await
            {
                Ok(h) => h,
                Err(e) => return Err(format!("delegate {i}: {e}")),
            };
            let mut view = CallerView {
                outcome: None,
                progress: Vec::new(),
                error: None,
            };
            let mut events = match caller.caller().events(&h, 0).await {
                Ok(e) => e,
                Err(e) => return Err(format!("events {i}: {e}")),
            };
            for _ in 0..delay {
                tokio::task::yield_now().await;
            }
            if let Err(e) = caller.caller().cancel(&h, "cancel-race").await {
                // The terminal may already be there: not an error by itself.
                tracing::debug!(key = %h.key, error = %e, "cancel refused");
            }
            let collect = async {
                while let Some(item) = events.next().await {
                    match item.map(|e| e.kind) {
                        Ok(EventKind::Status { data, .. }) => view.progress.push(
                            data.and_then(|d| d.get("i").and_then(serde_json::Value::as_u64))
                                .unwrap_or(CANCEL_SEEN - 1),
                        ),
                        Ok(EventKind::Terminal(t)) => return Ok(t),
                        Ok(_) => {}
                        Err(e) => return Err(format!("events: {e}")),
                    }
                }
                Err("the event stream ended before the terminal".to_string())
            };
            match tokio::time::timeout(wait, collect).await {
                Ok(Ok(t)) => {
                    view.outcome = Some(t.outcome);
                    if !t.relay_origin
                        && let Err(e) = caller.caller().verify(&h, &t)
                    {
                        view.error = Some(format!("verify: {e}"));
                    }
                }
                Ok(Err(e)) => view.error = Some(e),
                Err(_) => view.error = Some("wait: no terminal in time".into()),
            }
            Ok((h.key, view))
        });
    }
    let mut caller_view: HashMap<DelegationKey, CallerView> = HashMap::new();
    let mut violations = Vec::new();
    while let Some(joined) = tasks.join_next().await {
        match joined {
            Ok(Ok((k, v))) => {
                if caller_view.insert(k.clone(), v).is_some() {
                    violations.push(format!("{k}: two delegations with one key"));
                }
            }
            Ok(Err(e)) => start_errors.push(e),
            Err(e) => start_errors.push(format!("delegation task: {e}")),
        }
    }
    let caller_done = t0.elapsed();
    // The callee records a terminal when the relay's ack reaches it, which
    // can be just after the caller saw it: wait (bounded) for all of them.
    let expected: Vec<DelegationKey> = caller_view.keys().cloned().collect();
    let callee_view = audit
        .wait_terminals(wait, |v| expected.iter().all(|k| v.contains_key(k)))
        .await;

    let mut split: BTreeMap<String, u64> = BTreeMap::new();
    let (mut agreed, mut disagreed, mut missing, mut duplicated) = (0u64, 0u64, 0u64, 0u64);
    let (mut progress_equal, mut progress_differs, mut after_cancel) = (0u64, 0u64, 0u64);
    let emitted = std::mem::take(&mut *emitted.lock());
    for e in &start_errors {
        violations.push(format!("a delegation did not start: {e}"));
    }
    for (k, v) in &caller_view {
        let callee = callee_view.get(k).map(Vec::as_slice).unwrap_or_default();
        if let Some(e) = &v.error {
            violations.push(format!("{k}: caller: {e}"));
        }
        let sent = emitted
            .get(&k.request_id.to_string())
            .map(Vec::as_slice)
            .unwrap_or_default();
        if v.outcome.is_some() && v.progress == sent {
            progress_equal += 1;
            after_cancel += u64::from(sent.last() == Some(&CANCEL_SEEN));
        } else if v.outcome.is_some() {
            progress_differs += 1;
            violations.push(format!(
                "{k}: progress received {} != emitted {} before the terminal",
                v.progress.len(),
                sent.len()
            ));
        }
        match (v.outcome, callee) {
            (Some(o), [c]) if o == *c => {
                agreed += 1;
                *split.entry(format!("{o:?}").to_lowercase()).or_default() += 1;
            }
            (_, [_, _, ..]) => {
                duplicated += 1;
                violations.push(format!(
                    "{k}: callee recorded {} terminals: {callee:?}",
                    callee.len()
                ));
            }
            (None, _) | (_, []) => {
                missing += 1;
                violations.push(format!(
                    "{k}: missing terminal (caller {:?}, callee {callee:?})",
                    v.outcome
                ));
            }
            (Some(o), [c]) => {
                disagreed += 1;
                violations.push(format!("{k}: caller saw {o:?}, callee recorded {c:?}"));
            }
        }
    }
    for k in callee_view.keys().filter(|k| !caller_view.contains_key(*k)) {
        violations.push(format!(
            "{k}: callee recorded a terminal the caller never started"
        ));
    }
    if violations.len() > 50 {
        let more = violations.len() - 50;
        violations.truncate(50);
        violations.push(format!("... and {more} more"));
    }
    let rejected = split.get("rejected").copied().unwrap_or(0);

    let mut table = Table::new(
        format!(
            "cancel-race: {} delegations, each cancelled after 0..{} turns, executor done after \
             0..{} turns, {} in flight, {} store, seed {seed}",
            opts.count,
            opts.turns,
            opts.turns,
            opts.in_flight,
            opts.store.name()
        ),
        &["outcome", "delegations", "share"],
    );
    let total = caller_view.len().max(1) as f64;
    for (o, n) in &split {
        table.row(vec![
            o.clone(),
            fmt_count(*n as f64),
            format!("{:.1}%", *n as f64 * 100.0 / total),
        ]);
    }
    let mut check = Table::new(
        "cancel-race: agreement between caller and callee",
        &[
            "agreed",
            "disagreed",
            "missing",
            "duplicated",
            "not started",
            "progress = emitted",
            "progress differs",
            "seconds",
        ],
    );
    check.row(vec![
        agreed.to_string(),
        disagreed.to_string(),
        missing.to_string(),
        duplicated.to_string(),
        start_errors.len().to_string(),
        progress_equal.to_string(),
        progress_differs.to_string(),
        format!("{:.2}", caller_done.as_secs_f64()),
    ]);
    let mut json = run_header("cancel-race", common, relay_bin(common).as_deref());
    if let Some(obj) = json.as_object_mut() {
        obj.insert("params".into(), serde_json::to_value(opts)?);
        obj.insert("seed".into(), seed.into());
        obj.insert(
            "result".into(),
            serde_json::json!({
                "delegations": caller_view.len(),
                "agreed": agreed,
                "disagreed": disagreed,
                "missing": missing,
                "duplicated": duplicated,
                "not_started": start_errors.len(),
                "progress_equal": progress_equal,
                "progress_differs": progress_differs,
                "progress_after_cancel": after_cancel,
                "outcomes": split,
                "seconds": caller_done.as_secs_f64(),
            }),
        );
    }
    if let Ok(c) = Arc::try_unwrap(caller) {
        c.shutdown().await;
    }
    callee.shutdown().await;
    relay.stop().await;
    let mut notes = vec![
        "caller view: the terminal its event stream delivered (verified unless relay-originated); callee \
         view: the terminal its audit trail recorded once the relay acknowledged it."
            .into(),
        format!(
            "progress: the executor emits one event every {PROGRESS_EVERY} turns and one when it \
             sees the cancel ({after_cancel} delegation(s) ended with that one); each \
             delegation's received progress must equal what the executor's sink accepted"
        ),
    ];
    if rejected > 0 {
        notes.push(format!(
            "{rejected} delegation(s) were rejected (not run): the callee's concurrency cap or \
             policy refused them, so they did not race their cancel"
        ));
    }
    Ok(Report {
        scenario: "cancel-race",
        tables: vec![table, check],
        notes,
        json,
        violations,
    })
}
