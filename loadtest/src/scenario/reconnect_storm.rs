//! `reconnect-storm`: delegations streaming events while the links of both
//! connectors are cut, reset, stalled (half-open) and held away at random,
//! and optionally the relay process is killed (SIGKILL) and restarted, or the
//! `redis-server` under it is killed (SIGKILL) and restarted from its AOF.
//!
//! Each connector reaches the relay through its own fault proxy
//! ([`crate::proxy`]). `delegations` delegations run, `in_flight` at once
//! (closed loop: a new one starts when one ends); the callee's executor emits
//! `events` status events, one every `event_interval`, each carrying its
//! index, then completes (or stops when cancelled).
//!
//! One fault driver per proxy (caller's and callee's link, half the faults
//! each) waits for its connector's next link, lets it live two dead times
//! (six heartbeats, so a reconnect can finish its resumes) plus a random time
//! (uniform in `0..2 x` streaming time / `cuts`) and applies one of the
//! enabled [`LinkFault`]s:
//!
//! - `cut`: closes every live connection (the peers see an orderly close);
//! - `reset`: resets every live connection (TCP RST);
//! - `stall`: the live connection goes half-open (nothing forwarded, nobody
//!   sees a close) for a random time up to twice the link's dead time (three
//!   relay heartbeats): shorter, the link survives and forwarding resumes
//!   losslessly; longer, the connector gives up and reconnects, and the
//!   stalled connection is closed when the stall ends;
//! - `away`: closes the link, waits until the connector is connected again,
//!   then stalls that fresh link at once (its resumes are in flight) and
//!   refuses every new connection (RST) until, on the caller's side, at least
//!   one delegation finished at the callee meanwhile (at most `away_max`), or,
//!   on the callee's side, for a random time between the dead time and
//!   `away_max`. This is how delegations finish while the caller is away.
//!
//! Per delegation the caller reads every event from the start. Checked:
//! the status events the caller received against those the callee's executor
//! emitted (lost, duplicated, reordered, unexpected), sequence gaps, exactly
//! one terminal at the caller within `terminal_grace` of the executor
//! finishing (and before the run's time limit), a verified signed result for
//! a completion, the callee's audit trail holding exactly one acknowledged
//! terminal, the executor running exactly once, and, on the Redis store, the
//! caller's terminal and last sequence against the relay's log (the
//! delegation's record in Redis).
//!
//! Redis outages (`kill_redis_every`): `redis-server` (AOF) is killed with
//! SIGKILL while delegations append, stays down for `redis_outage`, and is
//! restarted on the same directory. During each outage `cancels_per_outage`
//! running delegations are cancelled by their caller; the cancel must take
//! effect after the outage (the delegation ends `cancelled`, or `completed`
//! when the executor finished before the cancel reached it). Per outage the
//! report gives its length (kill to PING answered) and the longest pause of
//! any delegation's event stream that overlaps it.
//!
//! Caller restarts (`restart_caller_every`): the caller's connector keeps
//! its delegations in a state folder and every reader commits each event;
//! the scenario stops the connector (its link closes, its streams end) and
//! starts a new one on the same folder, which takes the open delegations
//! back (`restore`). Each reader subscribes again after the last sequence it
//! read; the checks above apply unchanged.
//!
//! A2A path (`a2a`): each delegation is an A2A 1.0 `SendStreamingMessage`
//! from a plain HTTP JSON-RPC client to the caller connector's facade (with
//! the delegation profile, whose metadata carries each event's data, the
//! facade's event sequence and the relay's up sequence); cancels are
//! `CancelTask`. The same checks apply to what the A2A client read; the
//! terminal counts as verified when the facade says its result verified.
//!
//! Reconnect-to-replay time: from the caller proxy accepting a new
//! connection (TCP, after a fault or a relay restart) to the first event any
//! delegation's stream yields after it. It includes the reconnect's TLS
//! handshake, authentication, resume and replay (and, when the callee link is
//! down too, the callee's reconnect).

use parking_lot::Mutex;
use std::collections::{HashMap, HashSet};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use anyhow::{Context as _, bail};
use futures_util::StreamExt as _;
use hdrhistogram::Histogram;
use oab_connector::a2a::{Facade, FacadeOptions, PROFILE_URI};
use oab_connector::callee::{Execution, StopReason, TaskExecutor, TaskRun};
use oab_connector::{Connector, DelegationHandle, EventKind};
use oab_relay::store::{EventStore as _, RedisStore, Retention};
use oab_wire::{DelegationKey, Outcome, PeerId};
use serde::Serialize;
use tokio::sync::{Notify, Semaphore};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::{Common, relay_bin, run_header};
use crate::connectors::{
    AUDIT_CAPACITY, Rng, WatchedAudit, new_delegation, start_callee, start_caller,
    start_caller_with_state,
};
use crate::endpoint::latency_histogram;
use crate::proxy::{Fault, Proxy, ProxyHandle};
use crate::relay::{RedisPersistence, RelayUnderTest, StoreKind};
use crate::report::{Percentiles, Report, Table, fmt_us};
use crate::setup::{CALLEE, Setup};

/// The relay heartbeat of a run that stalls links or kills Redis, unless
/// set: a half-open link is found dead after three heartbeats (300 ms)
/// instead of 45 s, and during a Redis outage the pings are traffic on the
/// link more often than the connector's 250 ms resend of refused frames (a
/// resend timer that traffic pushed back would never fire).
pub const STALL_HEARTBEAT_MS: u32 = 100;

/// Heartbeats without a frame after which a connector treats its link as
/// dead (the connector's `dead_after_heartbeats` default).
const DEAD_AFTER_HEARTBEATS: u32 = 3;

/// Pauses recorded per delegation (each a gap between two events longer
/// than four event intervals); further pauses are not recorded, only the
/// longest is kept.
const MAX_PAUSES: usize = 64;

/// A fault the drivers apply to one connector's link.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum LinkFault {
    /// Close every live connection.
    Cut,
    /// Reset every live connection (TCP RST).
    Reset,
    /// Half-open: stop forwarding, keep the sockets open, for up to twice
    /// the link's dead time.
    Stall,
    /// Reconnect, then stall the fresh link and refuse new connections while
    /// delegations finish.
    Away,
}

impl LinkFault {
    /// Every fault.
    pub const ALL: [LinkFault; 4] = [
        LinkFault::Cut,
        LinkFault::Reset,
        LinkFault::Stall,
        LinkFault::Away,
    ];
}

/// Options of the reconnect-storm scenario.
#[derive(Debug, Clone, Serialize)]
pub struct ReconnectStormOptions {
    /// The relay's store (Redis unless measuring the memory store; killing
    /// the relay or Redis needs Redis).
    pub store: StoreKind,
    /// Delegations in the run.
    pub delegations: u32,
    /// Delegations streaming at once (0: all of them).
    pub in_flight: u32,
    /// Status events per delegation.
    pub events: u32,
    /// Pause of the executor before each event.
    pub event_interval: Duration,
    /// Link faults to make, half on each connector's link.
    pub cuts: u32,
    /// The faults to choose from (at random, per fault).
    pub faults: Vec<LinkFault>,
    /// The relay's heartbeat for the run (`None`: [`STALL_HEARTBEAT_MS`]
    /// when `faults` stall links or Redis is killed, else the relay
    /// default).
    pub heartbeat_ms: Option<u32>,
    /// Longest `away` fault.
    pub away_max: Duration,
    /// A delegation must have its terminal at the caller this long after
    /// the callee's executor finished.
    pub terminal_grace: Duration,
    /// Kill the relay (SIGKILL) and restart it this often; `None`: never.
    pub kill_relay_every: Option<Duration>,
    /// Kill `redis-server` (SIGKILL) and restart it this often; `None`:
    /// never. Needs the Redis store with AOF persistence.
    pub kill_redis_every: Option<Duration>,
    /// How long Redis stays down per outage (before its restart).
    pub redis_outage: Duration,
    /// Running delegations the caller cancels during each Redis outage.
    pub cancels_per_outage: u32,
    /// Stop the caller's connector and start a new one on the same state
    /// folder this often (it takes its delegations back); `None`: never.
    pub restart_caller_every: Option<Duration>,
    /// Delegate through the caller connector's A2A facade (an A2A 1.0
    /// client over HTTP JSON-RPC and SSE, with the delegation profile)
    /// instead of the library.
    pub a2a: bool,
    /// Seed of the random fault timing (0 picks one from the clock).
    pub seed: u64,
    /// The whole run's time limit; delegations unfinished by then count as
    /// missing their terminal.
    pub timeout: Duration,
}

impl ReconnectStormOptions {
    /// The heartbeat the run's relay uses, if the scenario sets one.
    pub fn effective_heartbeat_ms(&self) -> Option<u32> {
        self.heartbeat_ms.or_else(|| {
            let stalls = self
                .faults
                .iter()
                .any(|f| matches!(f, LinkFault::Stall | LinkFault::Away));
            (stalls || self.kill_redis_every.is_some()).then_some(STALL_HEARTBEAT_MS)
        })
    }
}

/// What one delegation saw.
#[derive(Debug, Clone, Default, Serialize)]
pub struct DelegationCheck {
    /// The delegation's index in the run.
    pub index: u32,
    /// The delegation key.
    pub key: String,
    /// Status events the callee's executor emitted.
    pub emitted: u64,
    /// Status events received (duplicates included).
    pub received: u64,
    /// Emitted status events never received.
    pub lost: u64,
    /// Status events received more than once.
    pub duplicated: u64,
    /// Status events received after a later one.
    pub reordered: u64,
    /// Status events received that the executor never emitted.
    pub unexpected: u64,
    /// Events whose sequence did not follow the previous one.
    pub seq_gaps: u64,
    /// The last sequence the caller received.
    pub last_seq: u64,
    /// Terminals the caller received.
    pub caller_terminals: u64,
    /// Acknowledged terminals the callee recorded.
    pub callee_terminals: u64,
    /// Times the executor ran.
    pub executor_runs: u64,
    /// The caller's terminal outcome.
    pub outcome: Option<String>,
    /// Whether its signed result verified.
    pub verified: bool,
    /// The executor finished while the caller's link was stalled or away.
    pub finished_while_caller_away: bool,
    /// The caller cancelled it (during a Redis outage).
    pub cancel_requested: bool,
    /// The executor saw the cancel and stopped.
    pub executor_saw_cancel: bool,
    /// The terminal in the relay's record (Redis store only).
    pub store_terminal: Option<String>,
    /// The up log's tail in the relay's record (Redis store only).
    pub store_up_tail: Option<u64>,
    /// Longest gap between two events at the caller, ms.
    pub longest_pause_ms: f64,
    /// Stream errors, timeouts, verification failures.
    pub errors: Vec<String>,
    /// The delegation key, for the relay's record.
    #[serde(skip)]
    dkey: Option<DelegationKey>,
    /// The caller's terminal, for the comparisons.
    #[serde(skip)]
    terminal: Option<Outcome>,
    /// Status event indexes in the order received (at most 4 x events + 16).
    #[serde(skip)]
    order: Vec<u32>,
    /// Gaps between events longer than four event intervals, (from, to).
    #[serde(skip)]
    pauses: Vec<(Instant, Instant)>,
}

impl DelegationCheck {
    /// Compares what the caller received with what the executor emitted.
    fn compare(&mut self, rec: &CalleeRecord) {
        self.emitted = rec.emitted.len() as u64;
        self.executor_runs = rec.runs;
        self.executor_saw_cancel = rec.saw_cancel;
        self.finished_while_caller_away = rec.finished_while_caller_away;
        let emitted: HashSet<u32> = rec.emitted.iter().copied().collect();
        let mut seen: HashSet<u32> = HashSet::new();
        let mut highest = 0u32;
        for &i in &self.order {
            if !emitted.contains(&i) {
                self.unexpected += 1;
            }
            if !seen.insert(i) {
                self.duplicated += 1;
            } else if i < highest {
                self.reordered += 1;
            }
            highest = highest.max(i);
        }
        self.lost = emitted.difference(&seen).count() as u64;
    }

    fn violations(&self) -> Vec<String> {
        let mut v = Vec::new();
        let k = &self.key;
        for (what, n) in [
            ("lost", self.lost),
            ("duplicated", self.duplicated),
            ("reordered", self.reordered),
            ("received but never emitted", self.unexpected),
            ("sequence gaps", self.seq_gaps),
        ] {
            if n > 0 {
                v.push(format!("{k}: {n} event(s) {what}"));
            }
        }
        if self.caller_terminals != 1 {
            v.push(format!(
                "{k}: caller got {} terminals",
                self.caller_terminals
            ));
        }
        if self.callee_terminals != 1 {
            v.push(format!(
                "{k}: callee recorded {} terminals",
                self.callee_terminals
            ));
        }
        if self.executor_runs != 1 {
            v.push(format!("{k}: executor ran {} times", self.executor_runs));
        }
        if self.caller_terminals == 1 {
            match self.terminal {
                Some(Outcome::Completed) if !self.verified => {
                    v.push(format!(
                        "{k}: completion whose signed result does not verify"
                    ));
                }
                Some(Outcome::Completed) if self.executor_saw_cancel => v.push(format!(
                    "{k}: the executor stopped on the cancel, the caller got completed"
                )),
                Some(Outcome::Completed) => {}
                Some(Outcome::Cancelled) if self.cancel_requested => {}
                other => v.push(format!(
                    "{k}: terminal {other:?} (expected {})",
                    if self.cancel_requested {
                        "cancelled or completed"
                    } else {
                        "completed"
                    }
                )),
            }
        }
        if let Some(st) = &self.store_terminal
            && self.outcome.as_ref() != Some(st)
        {
            v.push(format!(
                "{k}: caller's terminal {:?}, the relay's log {st}",
                self.outcome
            ));
        }
        if let Some(tail) = self.store_up_tail
            && self.caller_terminals == 1
            && tail != self.last_seq
        {
            v.push(format!(
                "{k}: caller read up to sequence {}, the relay's up log ends at {tail}",
                self.last_seq
            ));
        }
        v.extend(self.errors.iter().map(|e| format!("{k}: {e}")));
        v
    }
}

/// What the callee's executor did for one delegation.
#[derive(Debug, Default)]
struct CalleeRecord {
    runs: u64,
    /// Indexes of the status events the link took (at most `events`).
    emitted: Vec<u32>,
    finished_at: Option<Instant>,
    finished_while_caller_away: bool,
    saw_cancel: bool,
}

/// The executor's records, and whether the caller's link is away now.
#[derive(Debug, Default)]
struct Ledger {
    /// One record per delegation of the run (bounded by its delegation
    /// count); dropped with the run.
    records: Mutex<HashMap<DelegationKey, CalleeRecord>>,
    /// Executor runs finished so far.
    finishes: AtomicU64,
    /// Woken on every finish.
    changed: Notify,
    /// Set by the caller side's fault driver while it stalls or holds the
    /// caller's link away.
    caller_away: AtomicBool,
}

impl Ledger {
    fn with<R>(&self, key: &DelegationKey, f: impl FnOnce(&mut CalleeRecord) -> R) -> Option<R> {
        let mut records = self.records.lock();
        Some(f(records.entry(key.clone()).or_default()))
    }

    fn finish(&self, key: &DelegationKey, saw_cancel: bool) {
        let away = self.caller_away.load(Ordering::SeqCst);
        self.with(key, |r| {
            r.finished_at = Some(Instant::now());
            r.finished_while_caller_away = away;
            r.saw_cancel = saw_cancel;
        });
        self.finishes.fetch_add(1, Ordering::SeqCst);
        self.changed.notify_waiters();
    }

    /// Waits until the executor of `key` finished; returns when.
    async fn finished_at(&self, key: &DelegationKey) -> Instant {
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(Some(at)) = self.with(key, |r| r.finished_at) {
                return at;
            }
            notified.await;
        }
    }

    /// Waits until more than `n` executor runs finished.
    async fn finishes_above(&self, n: u64) {
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.finishes.load(Ordering::SeqCst) > n {
                return;
            }
            notified.await;
        }
    }
}

/// Paces `events` status events, then completes (or stops when
/// cancelled); records what it emitted in the [`Ledger`].
struct Paced {
    events: u32,
    interval: Duration,
    ledger: Arc<Ledger>,
}

impl TaskExecutor for Paced {
    fn execute(
        &self,
        run: TaskRun,
    ) -> Pin<Box<dyn std::future::Future<Output = Execution> + Send>> {
        let ledger = self.ledger.clone();
        let key = run.key.clone();
        ledger.with(&key, |r| r.runs += 1);
        let (n, pause) = (self.events, self.interval);
        Box::pin(async move {
            for i in 1..=n {
                tokio::select! {
                    () = run.cancel.cancelled() => {
                        ledger.finish(&key, true);
                        return Execution::stopped(StopReason::Cancelled);
                    }
                    () = tokio::time::sleep(pause) => {}
                }
                let data = serde_json::json!({ "i": i });
                if run
                    .sink
                    .status("TASK_STATE_WORKING", None, Some(data))
                    .await
                    .is_err()
                {
                    ledger.finish(&key, false);
                    return Execution::stopped(StopReason::Error("link stopped".into()));
                }
                ledger.with(&key, |r| r.emitted.push(i));
            }
            ledger.finish(&key, false);
            Execution::stopped(StopReason::EndTurn)
        })
    }
}

/// Reconnect-to-replay measurement shared by the readers: the time of the
/// caller proxy's latest accept not yet followed by an event.
#[derive(Debug, Default)]
struct Replay {
    pending: Mutex<Option<Instant>>,
    samples: Mutex<Option<Histogram<u64>>>,
}

impl Replay {
    fn accepted(&self, at: Instant) {
        {
            let mut p = self.pending.lock();
            *p = Some(at);
        }
    }

    fn event(&self) {
        let taken = self.pending.lock().take();
        if let Some(at) = taken {
            let mut h = self.samples.lock();
            let h = h.get_or_insert_with(latency_histogram);
            let _ = h.record(at.elapsed().as_nanos() as u64);
        }
    }

    fn percentiles(&self) -> Percentiles {
        self.samples
            .lock()
            .as_ref()
            .map(Percentiles::of)
            .unwrap_or_default()
    }
}

/// Faults one driver applied to its link.
#[derive(Debug, Clone, Default, Serialize)]
pub struct SideFaults {
    /// Connections closed.
    pub cut: u32,
    /// Connections reset.
    pub reset: u32,
    /// Stalls the link survived (forwarding resumed).
    pub stall_resumed: u32,
    /// Stalls the connector gave up on (it reconnected).
    pub stall_dropped: u32,
    /// `away` faults.
    pub away: u32,
    /// Executor runs that finished while this side was away.
    pub finished_while_away: u64,
}

impl SideFaults {
    fn total(&self) -> u32 {
        self.cut + self.reset + self.stall_resumed + self.stall_dropped + self.away
    }
}

/// One Redis outage.
#[derive(Debug, Clone, Serialize)]
pub struct Outage {
    /// Kill to the restarted server answering PING, ms.
    pub outage_ms: f64,
    /// Longest pause of any delegation's event stream overlapping it, ms.
    pub longest_pause_ms: f64,
    /// `longest_pause_ms - outage_ms`.
    pub excess_ms: f64,
    /// Delegations cancelled during it.
    pub cancels: u32,
    /// Of those, the ones whose executor saw the cancel.
    pub cancels_seen: u32,
    #[serde(skip)]
    from: Instant,
    #[serde(skip)]
    to: Instant,
    #[serde(skip)]
    cancelled: Vec<u32>,
}

/// Running delegations, by index, with the token that asks their reader to
/// cancel. An entry lives while its reader runs (at most `in_flight`).
#[derive(Debug, Default)]
struct Running(Mutex<HashMap<u32, CancellationToken>>);

/// The caller's connector, replaced when the scenario restarts it. Readers,
/// cancels and the caller's fault driver hold the read lock for one call
/// only, so a restart (the write lock) owns the connector alone and can shut
/// it down, as a process exit would.
#[derive(Debug)]
struct CallerSlot {
    conn: tokio::sync::RwLock<Option<Connector>>,
    /// Restarts begun so far: a reader whose stream ends after it changed
    /// subscribes again on the new connector.
    generation: AtomicU64,
}

impl CallerSlot {
    /// Waits until the current connector is connected; `false` if it
    /// stopped or is gone.
    async fn connected(&self) -> bool {
        let g = self.conn.read().await;
        match g.as_ref() {
            Some(c) => c.connected().await.is_ok(),
            None => false,
        }
    }
}

/// Stops the caller's connector and starts a new one on the same state
/// folder, which takes its delegations back (`restore`), as a restarted
/// process does. The caller counts as away meanwhile.
async fn restart_caller(
    slot: &CallerSlot,
    setup: &Setup,
    relay: std::net::SocketAddr,
    state: &std::path::Path,
    ledger: &Ledger,
) -> anyhow::Result<()> {
    slot.generation.fetch_add(1, Ordering::SeqCst);
    let mut g = slot.conn.write().await;
    ledger.caller_away.store(true, Ordering::SeqCst);
    if let Some(old) = g.take() {
        old.shutdown().await;
    }
    let started = async {
        let new = start_caller_with_state(setup, relay, state)?;
        let restored = new
            .caller()
            .restore()
            .await
            .context("restoring the caller's delegations")?;
        tracing::info!(restored = restored.len(), "caller connector restarted");
        anyhow::Ok(new)
    }
    .await;
    ledger.caller_away.store(false, Ordering::SeqCst);
    *g = Some(started?);
    Ok(())
}

/// What every reader shares.
struct Readers {
    caller: Arc<CallerSlot>,
    /// Commit every event (the caller keeps a state folder).
    commit: bool,
    /// Delegate through the caller's A2A facade instead of the library.
    a2a: Option<A2a>,
    callee: PeerId,
    events: u32,
    deadline: Instant,
    terminal_grace: Duration,
    pause_floor: Duration,
    replay: Arc<Replay>,
    ledger: Arc<Ledger>,
    running: Arc<Running>,
    slots: Arc<Semaphore>,
}

/// Runs the scenario.
pub async fn run(opts: &ReconnectStormOptions, common: &Common) -> anyhow::Result<Report> {
    let mut common = common.for_connectors();
    common.tuning.heartbeat_ms = opts.effective_heartbeat_ms();
    let common = &common;
    if opts.kill_relay_every.is_some() && opts.store != StoreKind::Redis {
        bail!("--kill-relay-every needs the Redis store: the memory store dies with the relay");
    }
    if opts.kill_redis_every.is_some()
        && (opts.store != StoreKind::Redis || common.redis_persistence == RedisPersistence::None)
    {
        bail!(
            "--kill-redis-every needs --store redis and --redis-persistence aof-always (or aof): \
             without an AOF a restarted Redis is empty"
        );
    }
    if opts.a2a && opts.restart_caller_every.is_some() {
        bail!(
            "--a2a with --restart-caller-every is not supported: the facade would need restoring"
        );
    }
    if opts.faults.is_empty() && opts.cuts > 0 {
        bail!("--faults is empty but --cuts asks for faults");
    }
    let seed = if opts.seed == 0 {
        oab_wire::identity::now_ms() | 1
    } else {
        opts.seed
    };
    let rng = Arc::new(Rng::new(seed));
    let setup = Setup::new(0, common.tuning.clone())?;
    let mut relay =
        RelayUnderTest::start(&setup, &common.relay, opts.store, common.redis_persistence)
            .await
            .with_context(|| format!("starting the relay on the {} store", opts.store.name()))?;
    tracing::info!(store = opts.store.name(), pid = ?relay.pid(), addr = %relay.addr(), seed, "relay started");
    let proxy_a = Proxy::start(relay.addr()).await.context("caller proxy")?;
    let proxy_b = Proxy::start(relay.addr()).await.context("callee proxy")?;
    let ledger = Arc::new(Ledger::default());
    let exec = Arc::new(Paced {
        events: opts.events,
        interval: opts.event_interval,
        ledger: ledger.clone(),
    });
    let audit = Arc::new(WatchedAudit::new(AUDIT_CAPACITY));
    let callee = Arc::new(start_callee(&setup, proxy_b.addr(), exec, audit.clone())?);
    // With restarts the caller keeps its delegations in a state folder.
    let state_dir = setup.dir.path().join("caller-state");
    let first = match opts.restart_caller_every {
        Some(_) => start_caller_with_state(&setup, proxy_a.addr(), &state_dir)?,
        None => start_caller(&setup, proxy_a.addr())?,
    };
    first.connected().await.context("caller connect")?;
    let caller = Arc::new(CallerSlot {
        conn: tokio::sync::RwLock::new(Some(first)),
        generation: AtomicU64::new(0),
    });
    callee.connected().await.context("callee connect")?;

    // The A2A path: the caller connector's facade on loopback.
    let facade = if opts.a2a {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .context("binding the A2A facade")?;
        let base = format!("http://{}", listener.local_addr()?);
        let api = caller
            .conn
            .read()
            .await
            .as_ref()
            .map(|c| c.caller().clone())
            .context("the caller's connector")?;
        let mut fo = FacadeOptions::default();
        fo.defaults.capabilities = vec!["read:repo".into()];
        let facade = Facade::new(api, fo);
        let stop = CancellationToken::new();
        let task = tokio::spawn(oab_connector::a2a::serve(
            listener,
            facade.clone(),
            stop.clone(),
        ));
        let url = Facade::interface_url(&base, &PeerId::new(CALLEE).context("callee peer id")?);
        Some((facade, stop, task, url))
    } else {
        None
    };

    let deadline = Instant::now() + opts.timeout;
    let done = CancellationToken::new();
    let replay = Arc::new(Replay::default());
    let running = Arc::new(Running::default());
    let t0 = Instant::now();

    // The readers: one per delegation, `in_flight` at once.
    let in_flight = if opts.in_flight == 0 {
        opts.delegations
    } else {
        opts.in_flight.min(opts.delegations)
    };
    let ctx = Arc::new(Readers {
        caller: caller.clone(),
        commit: opts.restart_caller_every.is_some(),
        a2a: facade.as_ref().map(|(_, _, _, url)| A2a {
            http: reqwest::Client::new(),
            url: url.clone(),
        }),
        callee: PeerId::new(CALLEE).context("callee peer id")?,
        events: opts.events,
        deadline,
        terminal_grace: opts.terminal_grace,
        pause_floor: (opts.event_interval * 4).max(Duration::from_millis(50)),
        replay: replay.clone(),
        ledger: ledger.clone(),
        running: running.clone(),
        slots: Arc::new(Semaphore::new(in_flight.max(1) as usize)),
    });
    let mut readers = tokio::task::JoinSet::new();
    for d in 0..opts.delegations {
        let ctx = ctx.clone();
        readers.spawn(async move { read_one(&ctx, d).await });
    }

    // The caller proxy's accepts, for the reconnect-to-replay time.
    let accepts = {
        let (h, replay, done) = (proxy_a.handle(), replay.clone(), done.clone());
        tokio::spawn(async move {
            let mut seen = h.stats().accepted;
            loop {
                tokio::select! {
                    () = done.cancelled() => return,
                    () = h.wait_until(|s| s.accepted > seen) => {}
                }
                seen = h.stats().accepted;
                replay.accepted(Instant::now());
            }
        })
    };

    let waves = f64::from(opts.delegations.div_ceil(in_flight.max(1)));
    let streaming = opts.event_interval.as_secs_f64() * f64::from(opts.events) * waves;
    // Aim to finish the faults in the first half of the streaming time: each
    // fault waits for the link to come back first, so the faults stretch out.
    let mean_gap = Duration::from_secs_f64(streaming / f64::from(opts.cuts.max(1)));
    let heartbeat = Duration::from_millis(u64::from(setup.config.relay.heartbeat_ms.max(1)));
    let dead = heartbeat * DEAD_AFTER_HEARTBEATS;
    // One driver per proxy, each with half the faults, so a link that is
    // slow to come back does not hold up the other's faults.
    let half = opts.cuts / 2;
    let drivers = [
        (
            proxy_a.handle(),
            Link::Caller(caller.clone()),
            true,
            opts.cuts - half,
        ),
        (proxy_b.handle(), Link::Callee(callee.clone()), false, half),
    ]
    .map(|(proxy, connector, is_caller, n)| {
        let side = Side {
            proxy,
            connector,
            is_caller,
            kinds: opts.faults.clone(),
            mean_gap,
            dead,
            away_max: opts.away_max.max(dead),
            rng: rng.clone(),
            ledger: ledger.clone(),
            done: done.clone(),
        };
        tokio::spawn(async move { side.drive(n).await })
    });

    // Relay kills and Redis outages run here (the relay is owned by this
    // task) until the readers are done.
    let mut kills = 0u32;
    let mut kill_errors = Vec::new();
    let mut outages: Vec<Outage> = Vec::new();
    let collect = async {
        let mut out = Vec::new();
        while let Some(j) = readers.join_next().await {
            match j {
                Ok(c) => out.push(c),
                Err(e) => out.push(DelegationCheck {
                    key: "?".into(),
                    errors: vec![format!("reader task: {e}")],
                    ..Default::default()
                }),
            }
        }
        out
    };
    tokio::pin!(collect);
    let mut next_relay_kill = opts.kill_relay_every.map(|e| Instant::now() + e);
    let mut next_redis_kill = opts.kill_redis_every.map(|e| Instant::now() + e);
    let mut next_restart = opts.restart_caller_every.map(|e| Instant::now() + e);
    let mut restarts = 0u32;
    let mut checks = loop {
        tokio::select! {
            c = &mut collect => break c,
            () = sleep_until_opt(next_relay_kill) => {
                match relay.kill_and_restart(&setup, &common.relay).await {
                    Ok(()) => {
                        kills += 1;
                        tracing::info!(kills, pid = ?relay.pid(), "relay killed and restarted");
                        next_relay_kill = opts.kill_relay_every.map(|e| Instant::now() + e);
                    }
                    Err(e) => {
                        kill_errors.push(format!("relay restart failed: {e:#}"));
                        break collect.await;
                    }
                }
            }
            () = sleep_until_opt(next_restart) => {
                match restart_caller(&caller, &setup, proxy_a.addr(), &state_dir, &ledger).await {
                    Ok(()) => {
                        restarts += 1;
                        next_restart = opts.restart_caller_every.map(|e| Instant::now() + e);
                    }
                    Err(e) => {
                        kill_errors.push(format!("caller restart: {e:#}"));
                        break collect.await;
                    }
                }
            }
            () = sleep_until_opt(next_redis_kill) => {
                match redis_outage(&mut relay, opts, &running, &rng).await {
                    Ok(o) => {
                        tracing::info!(outage_ms = o.outage_ms, cancels = o.cancels, "redis killed and restarted");
                        outages.push(o);
                        next_redis_kill = opts.kill_redis_every.map(|e| Instant::now() + e);
                    }
                    Err(e) => {
                        kill_errors.push(format!("redis outage: {e:#}"));
                        break collect.await;
                    }
                }
            }
        }
    };
    let elapsed = t0.elapsed();
    done.cancel();
    let mut sides = Vec::new();
    for d in drivers {
        sides.push(d.await.unwrap_or_default());
    }
    let _ = accepts.await;

    // The callee's acknowledged terminals can trail the caller's view.
    let keys: Vec<String> = checks.iter().map(|c| c.key.clone()).collect();
    let callee_view = audit
        .wait_terminals(
            deadline
                .saturating_duration_since(Instant::now())
                .max(Duration::from_secs(5)),
            |v| keys.iter().all(|k| v.keys().any(|vk| vk.to_string() == *k)),
        )
        .await;
    let by_name: HashMap<String, usize> = callee_view
        .iter()
        .map(|(k, v)| (k.to_string(), v.len()))
        .collect();
    {
        let records = ledger.records.lock();
        let by_key: HashMap<String, &CalleeRecord> =
            records.iter().map(|(k, r)| (k.to_string(), r)).collect();
        for c in &mut checks {
            c.callee_terminals = by_name.get(&c.key).map_or(0, |n| *n as u64);
            if let Some(r) = by_key.get(&c.key) {
                c.compare(r);
            }
        }
    }
    // The relay's own record of each delegation, where the scenario can read
    // it (Redis: a client of its own on the same server).
    let mut store_note = None;
    if opts.store == StoreKind::Redis {
        if let Err(e) = compare_with_store(relay.store_url(), &mut checks).await {
            store_note = Some(format!("the relay's log could not be read: {e:#}"));
        }
    } else {
        store_note = Some(
            "the memory store lives in the relay: terminals not compared with the relay's log"
                .to_string(),
        );
    }
    for o in &mut outages {
        for c in &checks {
            for (from, to) in &c.pauses {
                if *from < o.to && *to > o.from {
                    let ms = to.duration_since(*from).as_secs_f64() * 1e3;
                    o.longest_pause_ms = o.longest_pause_ms.max(ms);
                }
            }
        }
        o.excess_ms = o.longest_pause_ms - o.outage_ms;
        o.cancels_seen = checks
            .iter()
            .filter(|c| o.cancelled.contains(&c.index) && c.executor_saw_cancel)
            .count() as u32;
    }
    let stats_a = proxy_a.handle().stats();
    let stats_b = proxy_b.handle().stats();
    drop(ctx);
    if let Some((facade, stop, task, _)) = facade {
        stop.cancel();
        let _ = tokio::time::timeout(Duration::from_secs(15), task).await;
        facade.close();
    }
    let last = caller.conn.write().await.take();
    if let Some(c) = last {
        c.shutdown().await;
    }
    if let Ok(c) = Arc::try_unwrap(callee) {
        c.shutdown().await;
    }
    drop(proxy_a);
    drop(proxy_b);
    relay.stop().await;

    report(
        opts,
        common,
        seed,
        elapsed,
        [kills, restarts],
        &kill_errors,
        &checks,
        &sides,
        &outages,
        store_note,
        &replay,
        stats_a,
        stats_b,
    )
}

/// Builds the report.
#[allow(clippy::too_many_arguments)]
fn report(
    opts: &ReconnectStormOptions,
    common: &Common,
    seed: u64,
    elapsed: Duration,
    [kills, restarts]: [u32; 2],
    kill_errors: &[String],
    checks: &[DelegationCheck],
    sides: &[SideFaults],
    outages: &[Outage],
    store_note: Option<String>,
    replay: &Replay,
    stats_a: crate::proxy::ProxyStats,
    stats_b: crate::proxy::ProxyStats,
) -> anyhow::Result<Report> {
    let mut violations: Vec<String> = checks
        .iter()
        .flat_map(DelegationCheck::violations)
        .collect();
    violations.extend(kill_errors.iter().cloned());
    if violations.len() > 50 {
        let more = violations.len() - 50;
        violations.truncate(50);
        violations.push(format!("... and {more} more"));
    }
    let sum = |f: fn(&DelegationCheck) -> u64| checks.iter().map(f).sum::<u64>();
    let count = |f: fn(&DelegationCheck) -> bool| checks.iter().filter(|c| f(c)).count();
    let replay_p = replay.percentiles();
    let (a, b) = match sides {
        [a, b] => (a.clone(), b.clone()),
        _ => (SideFaults::default(), SideFaults::default()),
    };
    let faults = |s: &SideFaults| {
        format!(
            "{}/{}/{}+{}/{}",
            s.cut, s.reset, s.stall_resumed, s.stall_dropped, s.away
        )
    };
    let mut table = Table::new(
        format!(
            "reconnect-storm: {} delegations ({} at once) x {} events every {:?}, {} store, seed {seed}",
            opts.delegations,
            if opts.in_flight == 0 {
                opts.delegations
            } else {
                opts.in_flight.min(opts.delegations)
            },
            opts.events,
            opts.event_interval,
            opts.store.name()
        ),
        &[
            "caller faults",
            "callee faults",
            "relay kills",
            "caller restarts",
            "redis outages",
            "events",
            "lost",
            "dup",
            "reord",
            "no terminal",
            "terminals!=1",
            "runs!=1",
            "vs relay log",
            "done while caller away",
            "replay p50",
            "replay p99",
            "seconds",
        ],
    );
    table.row(vec![
        faults(&a),
        faults(&b),
        kills.to_string(),
        restarts.to_string(),
        outages.len().to_string(),
        sum(|c| c.received).to_string(),
        sum(|c| c.lost).to_string(),
        sum(|c| c.duplicated).to_string(),
        sum(|c| c.reordered).to_string(),
        count(|c| c.caller_terminals == 0).to_string(),
        count(|c| c.caller_terminals != 1 || c.callee_terminals != 1).to_string(),
        count(|c| c.executor_runs != 1).to_string(),
        if checks.iter().any(|c| c.store_terminal.is_some()) {
            count(|c| {
                c.store_terminal.is_some()
                    && (c.store_terminal != c.outcome || c.store_up_tail != Some(c.last_seq))
            })
            .to_string()
        } else {
            "-".into()
        },
        count(|c| c.finished_while_caller_away).to_string(),
        fmt_us(replay_p.p50_us),
        fmt_us(replay_p.p99_us),
        format!("{:.1}", elapsed.as_secs_f64()),
    ]);
    let mut tables = vec![table];
    let bound = pause_bound(opts);
    if !outages.is_empty() {
        let mut t = Table::new(
            format!(
                "Redis outages (kill -9, restart on its AOF); \
                 expected bound: pause <= outage + {:.0} ms",
                bound.as_secs_f64() * 1e3
            ),
            &[
                "#",
                "outage ms",
                "longest pause ms",
                "excess ms",
                "cancels",
                "seen by executor",
            ],
        );
        for (i, o) in outages.iter().enumerate() {
            t.row(vec![
                (i + 1).to_string(),
                format!("{:.0}", o.outage_ms),
                format!("{:.0}", o.longest_pause_ms),
                format!("{:.0}", o.excess_ms),
                o.cancels.to_string(),
                o.cancels_seen.to_string(),
            ]);
        }
        tables.push(t);
    }
    let mut notes = vec![
        "faults per side: cut/reset/stall (resumed+dropped)/away.".into(),
        "replay: caller proxy accepting a new connection -> the first event any stream yields \
         after it (TLS, authentication, resume, replay)."
            .into(),
    ];
    if let Some(n) = store_note {
        notes.push(n);
    }
    if !outages.is_empty() {
        notes.push(format!(
            "pause bound: the relay's Redis client retries with backoff up to 1 s, the \
             connector resends refused frames after 250 ms and reconnects within its 500 ms \
             backoff cap; plus two event intervals: {:.0} ms over the outage. Reported, never \
             checked (timings do not fail a run).",
            bound.as_secs_f64() * 1e3
        ));
    }
    let made = a.total() + b.total();
    if made < opts.cuts {
        notes.push(format!(
            "only {made} of {} faults were made before every delegation ended: raise \
             --events or the event interval for more",
            opts.cuts
        ));
    }
    let mut json = run_header("reconnect-storm", common, relay_bin(common).as_deref());
    if let Some(obj) = json.as_object_mut() {
        obj.insert("params".into(), serde_json::to_value(opts)?);
        obj.insert("seed".into(), seed.into());
        obj.insert(
            "result".into(),
            serde_json::json!({
                "cuts": made,
                "caller_faults": a,
                "callee_faults": b,
                "relay_kills": kills,
                "caller_restarts": restarts,
                "redis_outages": outages,
                "pause_bound_over_outage_ms": bound.as_secs_f64() * 1e3,
                "no_terminal": count(|c| c.caller_terminals == 0),
                "finished_while_caller_away": count(|c| c.finished_while_caller_away),
                "seconds": elapsed.as_secs_f64(),
                "reconnect_to_replay": replay_p,
                "caller_proxy": stats_a,
                "callee_proxy": stats_b,
            }),
        );
        obj.insert("delegations".into(), serde_json::to_value(checks)?);
    }
    Ok(Report {
        scenario: "reconnect-storm",
        tables,
        notes,
        json,
        violations,
    })
}

/// How much longer than a Redis outage a delegation's stream may pause: the
/// relay's Redis reconnect backoff cap (1 s), the connector's retry of a
/// refused frame (250 ms), its reconnect backoff cap and two event intervals.
pub fn pause_bound(opts: &ReconnectStormOptions) -> Duration {
    Duration::from_millis(1_250) + crate::connectors::BACKOFF_MAX + opts.event_interval * 2
}

/// Kills `redis-server`, cancels running delegations while it is down,
/// waits out the outage and restarts it.
async fn redis_outage(
    relay: &mut RelayUnderTest,
    opts: &ReconnectStormOptions,
    running: &Running,
    rng: &Rng,
) -> anyhow::Result<Outage> {
    let from = Instant::now();
    relay.kill_redis().await?;
    let mut cancelled = Vec::new();
    {
        let r = running.0.lock();
        let mut ids: Vec<u32> = r.keys().copied().collect();
        ids.sort_unstable();
        for _ in 0..opts.cancels_per_outage {
            if ids.is_empty() {
                break;
            }
            let i = rng.below(ids.len() as u64) as usize;
            let d = ids.swap_remove(i.min(ids.len() - 1));
            if let Some(t) = r.get(&d) {
                t.cancel();
                cancelled.push(d);
            }
        }
    }
    tokio::time::sleep_until(from + opts.redis_outage).await;
    relay.restart_redis().await?;
    let to = Instant::now();
    Ok(Outage {
        outage_ms: to.duration_since(from).as_secs_f64() * 1e3,
        longest_pause_ms: 0.0,
        excess_ms: 0.0,
        cancels: cancelled.len() as u32,
        cancels_seen: 0,
        from,
        to,
        cancelled,
    })
}

/// Fills in the relay's record of each delegation from Redis.
async fn compare_with_store(url: &str, checks: &mut [DelegationCheck]) -> anyhow::Result<()> {
    let store = tokio::time::timeout(
        Duration::from_secs(10),
        RedisStore::connect(url, Retention::default()),
    )
    .await
    .context("connecting to Redis timed out")??;
    for c in checks.iter_mut() {
        let Some(key) = c.dkey.clone() else { continue };
        let meta = tokio::time::timeout(Duration::from_secs(10), store.meta(&key))
            .await
            .context("reading a delegation's record timed out")?
            .with_context(|| format!("reading {key}"))?;
        match meta {
            Some(m) => {
                c.store_terminal = Some(
                    m.terminal
                        .map_or_else(|| "none".to_string(), |o| o.name().to_string()),
                );
                c.store_up_tail = Some(m.up_tail);
            }
            None => c
                .errors
                .push("the relay's store has no record of it".into()),
        }
    }
    Ok(())
}

/// Sleeps until `at`, or forever when there is nothing to wait for.
async fn sleep_until_opt(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// The connector behind one proxy.
enum Link {
    /// The caller's, which the scenario may restart.
    Caller(Arc<CallerSlot>),
    /// The callee's.
    Callee(Arc<Connector>),
}

impl Link {
    /// Waits until connected; `false` if the connector stopped.
    async fn connected(&self) -> bool {
        match self {
            Link::Caller(slot) => slot.connected().await,
            Link::Callee(c) => c.connected().await.is_ok(),
        }
    }
}

/// One connector's link and how to fault it.
struct Side {
    proxy: ProxyHandle,
    connector: Link,
    is_caller: bool,
    kinds: Vec<LinkFault>,
    mean_gap: Duration,
    dead: Duration,
    away_max: Duration,
    rng: Arc<Rng>,
    ledger: Arc<Ledger>,
    done: CancellationToken,
}

impl Side {
    /// Applies `n` faults, until `done`: waits for the connector's next link
    /// (a new upstream connection since the last fault, or the link a stall
    /// left alive), lets it live two dead times plus a random gap (uniform
    /// in `0..2 x mean_gap`), then applies a fault chosen at random. Only a fault that
    /// hit a live connection counts.
    async fn drive(self, n: u32) -> SideFaults {
        let mut f = SideFaults::default();
        let gap_us = micros(self.mean_gap).max(1) * 2;
        let mut connects = self.proxy.stats().upstream_connects.saturating_sub(1);
        let mut made = 0u32;
        while made < n && !self.kinds.is_empty() {
            let up = self
                .until_done(
                    self.proxy
                        .wait_until(|s| s.upstream_connects > connects && s.active > 0),
                )
                .await;
            // Every link lives at least two dead times, so a reconnect can
            // finish its resumes and replay before the next fault: a link
            // faulted again at once would starve every delegation without
            // any software being wrong.
            let gap = self.dead * 2 + Duration::from_micros(self.rng.below(gap_us));
            if up.is_none() || self.until_done(tokio::time::sleep(gap)).await.is_none() {
                break;
            }
            let i = self.rng.below(self.kinds.len() as u64) as usize;
            let kind = self.kinds.get(i).copied().unwrap_or(LinkFault::Cut);
            let applied = match kind {
                LinkFault::Cut => self.cut().await.inspect(|hit| f.cut += u32::from(*hit)),
                LinkFault::Reset => self.reset().await.inspect(|hit| f.reset += u32::from(*hit)),
                LinkFault::Stall => self.stall().await.map(|resumed| match resumed {
                    Some(true) => {
                        f.stall_resumed += 1;
                        true
                    }
                    Some(false) => {
                        f.stall_dropped += 1;
                        true
                    }
                    None => false,
                }),
                LinkFault::Away => self.away().await.map(|finished| match finished {
                    Some(n) => {
                        f.away += 1;
                        f.finished_while_away += n;
                        true
                    }
                    None => false,
                }),
            };
            match applied {
                None => break,
                Some(true) => made += 1,
                Some(false) => {}
            }
            connects = self.proxy.stats().upstream_connects;
            if self.proxy.stats().active > 0 && matches!(kind, LinkFault::Stall) {
                // The link survived the stall: it is the next one to fault.
                connects = connects.saturating_sub(1);
            }
        }
        f
    }

    /// `fut`'s output, or `None` once the run is done.
    async fn until_done<T>(&self, fut: impl std::future::Future<Output = T>) -> Option<T> {
        tokio::select! {
            () = self.done.cancelled() => None,
            v = fut => Some(v),
        }
    }

    fn live(&self) -> Vec<u64> {
        self.proxy.connections().iter().map(|c| c.id).collect()
    }

    fn set_away(&self, away: bool) {
        if self.is_caller {
            self.ledger.caller_away.store(away, Ordering::SeqCst);
        }
    }

    /// Closes every live connection; whether one was closed.
    async fn cut(&self) -> Option<bool> {
        let before = self.proxy.stats();
        self.proxy.cut_all();
        self.until_done(
            self.proxy
                .wait_until(|s| s.cuts > before.cuts || s.active == 0),
        )
        .await?;
        Some(self.proxy.stats().cuts > before.cuts)
    }

    /// Resets every live connection; whether one was reset.
    async fn reset(&self) -> Option<bool> {
        let before = self.proxy.stats();
        for id in self.live() {
            self.proxy.set_connection_fault(id, Fault::Reset);
        }
        self.until_done(
            self.proxy
                .wait_until(|s| s.resets > before.resets || s.active == 0),
        )
        .await?;
        Some(self.proxy.stats().resets > before.resets)
    }

    /// Stalls the live connections for a random time up to twice the dead
    /// time: `Some(true)` if the link survived (forwarding resumed),
    /// `Some(false)` if the connector reconnected meanwhile (the stalled
    /// connections are then closed), `None` (inner) if nothing was live.
    async fn stall(&self) -> Option<Option<bool>> {
        let ids = self.live();
        if ids.is_empty() {
            return Some(None);
        }
        let before = self.proxy.stats().upstream_connects;
        for id in &ids {
            self.proxy.set_connection_fault(*id, Fault::Stall);
        }
        self.set_away(true);
        let len = Duration::from_micros(self.rng.below(micros(self.dead) * 2));
        let ended = self.until_done(tokio::time::sleep(len)).await;
        let resumed = self.proxy.stats().upstream_connects == before;
        for id in &ids {
            if resumed {
                self.proxy.set_connection_fault(*id, Fault::Pass);
            } else {
                self.proxy.cut(*id);
            }
        }
        self.set_away(false);
        ended?;
        Some(Some(resumed))
    }

    /// Closes the link, waits for the connector's next session, stalls it at
    /// once and refuses new connections (RST) while the side is away: on
    /// the caller's side until a delegation finished at the callee (at most
    /// `away_max`, at least the dead time), on the callee's side a random
    /// time between the dead time and `away_max`. Returns the executor runs
    /// that finished meanwhile (`None` inner: no link to take away).
    async fn away(&self) -> Option<Option<u64>> {
        let before = self.proxy.stats();
        if before.active == 0 {
            return Some(None);
        }
        self.proxy.cut_all();
        // The connector is reconnecting once it opened a new connection.
        self.until_done(
            self.proxy
                .wait_until(|s| s.upstream_connects > before.upstream_connects),
        )
        .await?;
        if !self.until_done(self.connector.connected()).await? {
            return None;
        }
        // Its welcome arrived and its resumes are on their way: stall now.
        self.proxy.set_plan(|_| Some(Fault::Reset));
        let ids = self.live();
        for id in &ids {
            self.proxy.set_connection_fault(*id, Fault::Stall);
        }
        self.set_away(true);
        let f0 = self.ledger.finishes.load(Ordering::SeqCst);
        let from = Instant::now();
        let hold = async {
            if self.is_caller {
                tokio::time::sleep(self.dead).await;
                let _ =
                    tokio::time::timeout_at(from + self.away_max, self.ledger.finishes_above(f0))
                        .await;
            } else {
                let spread = micros(self.away_max.saturating_sub(self.dead)).max(1);
                let len = self.dead + Duration::from_micros(self.rng.below(spread));
                tokio::time::sleep(len).await;
            }
        };
        let ended = self.until_done(hold).await;
        self.proxy.clear_plan();
        for id in &ids {
            self.proxy.cut(*id);
        }
        self.set_away(false);
        ended?;
        Some(Some(
            self.ledger
                .finishes
                .load(Ordering::SeqCst)
                .saturating_sub(f0),
        ))
    }
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX / 4)
}

/// One delegation, read from its first event to its terminal.
async fn read_one(ctx: &Readers, d: u32) -> DelegationCheck {
    let mut c = DelegationCheck {
        index: d,
        ..Default::default()
    };
    let Ok(_slot) = ctx.slots.acquire().await else {
        c.key = format!("storm {d} (not started)");
        c.errors.push("the run ended before it started".into());
        return c;
    };
    if let Some(a2a) = &ctx.a2a {
        read_a2a(ctx, a2a, d, &mut c).await;
        return c;
    }
    let started = {
        let g = ctx.caller.conn.read().await;
        match g.as_ref() {
            Some(conn) => conn
                .caller()
                .delegate(&ctx.callee, new_delegation(format!("storm {d}")))
                .await
                .map_err(|e| e.to_string()),
            None => Err("the caller's connector is gone".to_string()),
        }
    };
    let h = match started {
        Ok(h) => h,
        Err(e) => {
            c.key = format!("storm {d} (not started)");
            c.errors.push(format!("delegate: {e}"));
            return c;
        }
    };
    c.key = h.key.to_string();
    c.dkey = Some(h.key.clone());
    let cancel_req = CancellationToken::new();
    {
        let mut r = ctx.running.0.lock();
        r.insert(d, cancel_req.clone());
    }
    read_events(ctx, &h, &cancel_req, &mut c).await;
    {
        let mut r = ctx.running.0.lock();
        r.remove(&d);
    }
    c
}

/// Reads `h`'s events into `c` until its terminal (and the stream's end),
/// the terminal deadline or the run's time limit. When the caller's
/// connector is restarted, the stream of the old one ends and the reader
/// subscribes on the new one after the last sequence it read.
async fn read_events(
    ctx: &Readers,
    h: &DelegationHandle,
    cancel_req: &CancellationToken,
    c: &mut DelegationCheck,
) {
    let max_order = ctx.events as usize * 4 + 16;
    let grace = ctx.terminal_grace;
    // Due `grace` after the callee's executor finished.
    let terminal_due = async {
        let at = ctx.ledger.finished_at(&h.key).await;
        tokio::time::sleep_until(at + grace).await;
    };
    tokio::pin!(terminal_due);
    let mut last_at = Instant::now();
    let mut cancel_task = None;
    'subscribe: loop {
        let generation = ctx.caller.generation.load(Ordering::SeqCst);
        let subscribed = {
            let g = ctx.caller.conn.read().await;
            match g.as_ref() {
                Some(conn) => conn
                    .caller()
                    .events(h, c.last_seq)
                    .await
                    .map_err(|e| e.to_string()),
                None => Err("the caller's connector is gone".to_string()),
            }
        };
        let mut stream = match subscribed {
            Ok(s) => s,
            Err(e) => {
                c.errors.push(format!("events: {e}"));
                break;
            }
        };
        let restarted = || ctx.caller.generation.load(Ordering::SeqCst) != generation;
        loop {
            let item = tokio::select! {
                biased;
                () = cancel_req.cancelled(), if !c.cancel_requested => {
                    c.cancel_requested = true;
                    // Sent from a task of its own: this loop keeps reading.
                    let (slot, h) = (ctx.caller.clone(), h.clone());
                    cancel_task = Some(tokio::spawn(async move {
                        let g = slot.conn.read().await;
                        if let Some(conn) = g.as_ref() {
                            let _ = conn.caller().cancel(&h, "cancelled during a Redis outage").await;
                        }
                    }));
                    continue;
                }
                () = &mut terminal_due, if c.caller_terminals == 0 => {
                    c.errors.push(format!(
                        "no terminal at the caller within {grace:?} of the callee's executor finishing"
                    ));
                    break 'subscribe;
                }
                () = tokio::time::sleep_until(ctx.deadline) => {
                    c.errors.push("no terminal before the run's time limit".into());
                    break 'subscribe;
                }
                item = stream.next() => item,
            };
            let ev = match item {
                Some(Ok(ev)) => ev,
                // The connector was restarted: its streams ended.
                None | Some(Err(_)) if restarted() && c.caller_terminals == 0 => {
                    continue 'subscribe;
                }
                None => break 'subscribe,
                Some(Err(e)) => {
                    c.errors.push(format!("event stream: {e}"));
                    break 'subscribe;
                }
            };
            ctx.replay.event();
            let now = Instant::now();
            let gap = now.duration_since(last_at);
            c.longest_pause_ms = c.longest_pause_ms.max(gap.as_secs_f64() * 1e3);
            if gap > ctx.pause_floor && c.pauses.len() < MAX_PAUSES {
                c.pauses.push((last_at, now));
            }
            last_at = now;
            if ev.seq != c.last_seq + 1 {
                c.seq_gaps += 1;
            }
            c.last_seq = ev.seq;
            if ctx.commit {
                // What a restarted connector resumes after.
                let g = ctx.caller.conn.read().await;
                if let Some(conn) = g.as_ref()
                    && let Err(e) = conn.caller().commit(h, &ev).await
                {
                    c.errors.push(format!("commit: {e}"));
                }
            }
            match ev.kind {
                EventKind::Status { data, .. } => {
                    c.received += 1;
                    let i = data
                        .as_ref()
                        .and_then(|d| d.get("i"))
                        .and_then(serde_json::Value::as_u64)
                        .and_then(|i| u32::try_from(i).ok())
                        .unwrap_or(0);
                    if i == 0 {
                        c.errors.push("status event without an index".into());
                    } else if c.order.len() < max_order {
                        c.order.push(i);
                    }
                }
                EventKind::Terminal(t) => {
                    c.caller_terminals += 1;
                    c.terminal = Some(t.outcome);
                    c.outcome = Some(t.outcome.name().to_string());
                    let verified = {
                        let g = ctx.caller.conn.read().await;
                        match g.as_ref() {
                            Some(conn) => conn.caller().verify(h, &t).map_err(|e| e.to_string()),
                            None => Err("the caller's connector is gone".to_string()),
                        }
                    };
                    match verified {
                        Ok(_) => c.verified = t.outcome == Outcome::Completed,
                        // Only a completion must carry a verifiable result.
                        Err(e) if t.outcome == Outcome::Completed => {
                            c.errors.push(format!("verify: {e}"));
                        }
                        Err(_) => {}
                    }
                }
                _ => {}
            }
        }
    }
    close_pause(ctx, c, last_at);
    if let Some(t) = cancel_task {
        // The link takes the command at once; a refusal because the
        // delegation already ended is not an error.
        let _ = tokio::time::timeout(Duration::from_secs(5), t).await;
    }
}

/// The A2A path: an A2A 1.0 client (plain HTTP JSON-RPC with the delegation
/// profile) talking to the caller connector's facade.
struct A2a {
    http: reqwest::Client,
    /// The callee's JSON-RPC URL on the facade.
    url: String,
}

/// Largest SSE event the A2A reader buffers.
const MAX_SSE_BYTES: usize = 4 * 1024 * 1024;

impl A2a {
    async fn post(
        &self,
        method: &str,
        params: serde_json::Value,
    ) -> Result<reqwest::Response, String> {
        let body =
            serde_json::json!({ "jsonrpc": "2.0", "id": 1, "method": method, "params": params });
        self.http
            .post(&self.url)
            .header("content-type", "application/json")
            .header("A2A-Version", "1.0")
            .header("A2A-Extensions", PROFILE_URI)
            .body(body.to_string())
            .send()
            .await
            .map_err(|e| format!("{method}: {e}"))
    }
}

/// Reads SSE events (their `data` JSON) from a response body.
struct SseReader {
    body: Pin<Box<dyn futures_util::Stream<Item = reqwest::Result<bytes::Bytes>> + Send>>,
    buf: String,
}

impl SseReader {
    /// The next event's data; `None` at the end of the stream.
    async fn next(&mut self) -> Option<Result<serde_json::Value, String>> {
        loop {
            if let Some(pos) = self.buf.find("\n\n") {
                let block: String = self.buf.drain(..pos + 2).collect();
                let data: Vec<&str> = block
                    .lines()
                    .filter_map(|l| l.strip_prefix("data:"))
                    .map(|v| v.strip_prefix(' ').unwrap_or(v))
                    .collect();
                if data.is_empty() {
                    continue;
                }
                return Some(serde_json::from_str(&data.join("\n")).map_err(|e| e.to_string()));
            }
            if self.buf.len() > MAX_SSE_BYTES {
                return Some(Err("an SSE event over 4 MiB".into()));
            }
            match self.body.next().await? {
                Ok(chunk) => self
                    .buf
                    .push_str(&String::from_utf8_lossy(&chunk).replace("\r\n", "\n")),
                Err(e) => return Some(Err(e.to_string())),
            }
        }
    }
}

fn outcome_named(name: &str) -> Outcome {
    Outcome::ALL
        .iter()
        .copied()
        .find(|o| o.name() == name)
        .unwrap_or(Outcome::Unknown)
}

/// One delegation through the facade: `SendStreamingMessage`, then every
/// event of its stream to the terminal; cancels with `CancelTask`.
async fn read_a2a(ctx: &Readers, a2a: &A2a, d: u32, c: &mut DelegationCheck) {
    let message = serde_json::json!({
        "message": {
            "messageId": format!("storm-{d}"),
            "role": "ROLE_USER",
            "parts": [{ "text": format!("storm {d}") }],
        }
    });
    let resp = match a2a.post("SendStreamingMessage", message).await {
        Ok(r) => r,
        Err(e) => {
            c.key = format!("storm {d} (not started)");
            c.errors.push(e);
            return;
        }
    };
    let mut sse = SseReader {
        body: Box::pin(resp.bytes_stream()),
        buf: String::new(),
    };
    let max_order = ctx.events as usize * 4 + 16;
    let grace = ctx.terminal_grace;
    let cancel_req = CancellationToken::new();
    let mut task_id: Option<String> = None;
    let mut terminal_due: Pin<Box<dyn std::future::Future<Output = ()> + Send + '_>> =
        Box::pin(std::future::pending());
    let mut last_at = Instant::now();
    let mut last_fseq = 0u64;
    let mut cancel_task = None;
    loop {
        let item = tokio::select! {
            biased;
            () = cancel_req.cancelled(), if !c.cancel_requested => {
                c.cancel_requested = true;
                if let Some(id) = task_id.clone() {
                    let a2a = A2a { http: a2a.http.clone(), url: a2a.url.clone() };
                    cancel_task = Some(tokio::spawn(async move {
                        let _ = a2a.post("CancelTask", serde_json::json!({ "id": id })).await;
                    }));
                }
                continue;
            }
            () = &mut terminal_due, if c.caller_terminals == 0 => {
                c.errors.push(format!(
                    "no terminal at the A2A client within {grace:?} of the callee's executor finishing"
                ));
                break;
            }
            () = tokio::time::sleep_until(ctx.deadline) => {
                c.errors.push("no terminal before the run's time limit".into());
                break;
            }
            item = sse.next() => item,
        };
        let v = match item {
            None => break,
            Some(Ok(v)) => v,
            Some(Err(e)) => {
                c.errors.push(format!("event stream: {e}"));
                break;
            }
        };
        if let Some(e) = v.get("error") {
            c.errors.push(format!("JSON-RPC error: {e}"));
            break;
        }
        let r = &v["result"];
        if let Some(task) = r.get("task") {
            let meta = &task["metadata"][PROFILE_URI];
            task_id = task["id"].as_str().map(str::to_string);
            let key = meta["requestId"]
                .as_str()
                .and_then(|rid| oab_wire::RequestId::new(rid).ok())
                .zip(PeerId::new(crate::setup::CALLER).ok())
                .map(|(rid, caller)| DelegationKey::new(caller, rid));
            if c.dkey.is_none()
                && let Some(key) = key
            {
                c.key = key.to_string();
                c.dkey = Some(key.clone());
                {
                    let mut running = ctx.running.0.lock();
                    running.insert(d, cancel_req.clone());
                }
                let ledger = ctx.ledger.clone();
                terminal_due = Box::pin(async move {
                    let at = ledger.finished_at(&key).await;
                    tokio::time::sleep_until(at + grace).await;
                });
            }
            continue;
        }
        let Some(update) = r.get("statusUpdate") else {
            continue;
        };
        ctx.replay.event();
        let meta = &update["metadata"][PROFILE_URI];
        let now = Instant::now();
        let gap = now.duration_since(last_at);
        c.longest_pause_ms = c.longest_pause_ms.max(gap.as_secs_f64() * 1e3);
        if gap > ctx.pause_floor && c.pauses.len() < MAX_PAUSES {
            c.pauses.push((last_at, now));
        }
        last_at = now;
        // The facade numbers a task's events 1, 2, ... (the task is 0).
        let fseq = meta["seq"].as_u64().unwrap_or(0);
        if fseq != last_fseq + 1 {
            c.seq_gaps += 1;
        }
        last_fseq = fseq;
        if let Some(up) = meta["upSeq"].as_u64() {
            c.last_seq = up;
        }
        if let Some(outcome) = meta["outcome"].as_str() {
            let o = outcome_named(outcome);
            c.caller_terminals += 1;
            c.terminal = Some(o);
            c.outcome = Some(o.name().to_string());
            c.verified = o == Outcome::Completed && meta["verified"] == true;
            continue;
        }
        match meta["data"]["i"]
            .as_u64()
            .and_then(|i| u32::try_from(i).ok())
        {
            Some(i) if i > 0 => {
                c.received += 1;
                if c.order.len() < max_order {
                    c.order.push(i);
                }
            }
            // The acceptance and other states carry no index.
            _ => {}
        }
    }
    close_pause(ctx, c, last_at);
    {
        let mut running = ctx.running.0.lock();
        running.remove(&d);
    }
    if let Some(t) = cancel_task {
        let _ = tokio::time::timeout(Duration::from_secs(15), t).await;
    }
}

/// A delegation that ended without its terminal was paused from its last
/// event to now: that pause counts too (a frozen stream has no later event).
fn close_pause(ctx: &Readers, c: &mut DelegationCheck, last_at: Instant) {
    if c.caller_terminals > 0 {
        return;
    }
    let now = Instant::now();
    let gap = now.duration_since(last_at);
    c.longest_pause_ms = c.longest_pause_ms.max(gap.as_secs_f64() * 1e3);
    if gap > ctx.pause_floor && c.pauses.len() < MAX_PAUSES {
        c.pauses.push((last_at, now));
    }
}
