//! `delegations --mode cp`: OpenAB control-plane round trips per second,
//! through the relay and direct, in one run.
//!
//! Through the relay: an OAB primary (a CP client, [`crate::cp::Primary`])
//! -> connector A's CP endpoint -> a signed delegation through the relay
//! (TLS, the chosen store) -> connector B -> B's CP endpoint -> an OAB
//! worker ([`crate::cp::run_worker`]) that completes at once -> the signed
//! result back -> `cp/delegate_result` to the primary. The connectors run
//! in this process, as in the library mode. The baseline is the same
//! primary over one direct WebSocket to a worker ([`crate::cp::DirectCp`]).
//!
//! A round trip is `cp/delegate` sent to its `cp/delegate_result` read.
//! Each in-flight level keeps that many delegations going on the one
//! primary connection (a closed loop). Every delegation must end with
//! exactly one `completed` result carrying the worker's text, and the
//! endpoint must never close the primary (its `outbound_queue`
//! back-pressures; it never disconnects a runtime for having many in
//! flight): anything else is a violation.

use std::sync::Arc;

use anyhow::Context as _;
use oab_connector::openab::config::{OpenAbRuntime, OpenAbServe, OpenAbTarget};
use oab_connector::openab::proto::{AgentType, TargetSelector};
use oab_connector::openab::{OpenAbEndpoint, OpenAbSection, RuntimeKeys};
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use super::DelegationsOptions;
use super::{Common, relay_bin, run_header};
use crate::connectors::{
    AUDIT_CAPACITY, CALLEE_MAX_CONCURRENT, WatchedAudit, start_callee, start_caller,
};
use crate::cp::{DirectCp, Primary, PrimaryRun};
use crate::relay::RelayUnderTest;
use crate::report::{Percentiles, Report, Table, fmt_count, fmt_us};
use crate::setup::Setup;

/// The primary's key (`prod/koudu`); an external CP (`--cp-url`) binds it.
pub const PRIMARY_KEY: &str = "bench-primary-key-0123456789";
/// The worker's key (`prod/reviewer`); an external CP (`--cp-url`) binds it.
pub const WORKER_KEY: &str = "bench-worker-key-0123456789";

/// One level's figures on one path.
#[derive(Debug, Clone, Serialize)]
pub struct CpLevel {
    /// `direct` or `relay-<store>`.
    pub path: String,
    /// Delegations in flight on the primary's connection.
    pub in_flight: usize,
    /// Delegations with exactly one completed result with the worker's text.
    pub completed: u64,
    /// Refusals, wrong results, duplicates, and delegations without a result.
    pub failed: u64,
    /// Whether the endpoint closed the primary's connection.
    pub disconnected: bool,
    /// First `cp/delegate` to the last result, seconds.
    pub seconds: f64,
    /// Completed round trips per second.
    pub round_trips_per_sec: f64,
    /// `cp/delegate` to `cp/delegate_result`.
    pub round_trip: Percentiles,
    /// The first few failures.
    pub errors: Vec<String>,
}

fn level_of(path: &str, n: usize, r: PrimaryRun) -> CpLevel {
    let per_sec = if r.seconds > 0.0 {
        r.completed as f64 / r.seconds
    } else {
        0.0
    };
    CpLevel {
        path: path.into(),
        in_flight: n,
        completed: r.completed,
        failed: r.error_count,
        disconnected: r.disconnected,
        seconds: r.seconds,
        round_trips_per_sec: per_sec,
        round_trip: r
            .round_trip
            .as_ref()
            .map(Percentiles::of)
            .unwrap_or_default(),
        errors: r.errors,
    }
}

/// Host A's endpoint: the bench primary, and the target `reviewer` on the
/// callee peer.
fn section_a(setup: &Setup, max_in_flight: usize) -> anyhow::Result<OpenAbSection> {
    Ok(OpenAbSection {
        max_delegations: max_in_flight.max(1024),
        runtimes: vec![OpenAbRuntime {
            namespace: "prod".into(),
            name: "koudu".into(),
            agent_type: AgentType::Primary,
            key_file: None,
            key_env: None,
            max_delegated_sessions_cap: None,
        }],
        targets: vec![OpenAbTarget {
            name: Some("reviewer".into()),
            labels: None,
            peer: setup.callee.peer.clone(),
            remote: TargetSelector {
                name: Some("reviewer".into()),
                labels: None,
            },
            capabilities: vec!["read:repo".into()],
            read_only: true,
            max_delegated_sessions: None,
        }],
        ..OpenAbSection::default()
    })
}

/// Host B's endpoint: the bench worker, reachable from the caller peer.
fn section_b(setup: &Setup) -> OpenAbSection {
    OpenAbSection {
        runtimes: vec![OpenAbRuntime {
            namespace: "prod".into(),
            name: "reviewer".into(),
            agent_type: AgentType::Worker,
            key_file: None,
            key_env: None,
            max_delegated_sessions_cap: None,
        }],
        serve: vec![OpenAbServe {
            peer: setup.caller.peer.clone(),
            workers: vec!["prod/reviewer".into()],
        }],
        ..OpenAbSection::default()
    }
}

/// The same primary and worker against an external CP server at `url`:
/// both connect to it, as OAB runtimes do to openab-cp, and it routes the
/// delegations between them.
async fn run_external(
    url: &str,
    opts: &DelegationsOptions,
    common: &Common,
) -> anyhow::Result<Vec<CpLevel>> {
    let stop = CancellationToken::new();
    let max_n = opts.in_flight.iter().copied().max().unwrap_or(1);
    let mut ws = crate::cp::connect_url(url, WORKER_KEY, opts.cp_nagle)
        .await
        .context("the worker's connection to --cp-url")?;
    let beat = crate::cp::register(
        &mut ws,
        "prod",
        "reviewer",
        "worker",
        "bench-worker",
        u32::try_from(max_n).unwrap_or(u32::MAX),
    )
    .await?;
    tokio::spawn(crate::cp::run_worker(ws, beat, stop.clone(), opts.cp_nagle));
    let mut primary = Primary::connect_url(url, PRIMARY_KEY, "reviewer", opts.cp_nagle)
        .await
        .context("the primary's connection to --cp-url")?;
    let mut levels = Vec::new();
    for &n in &opts.in_flight {
        let r = primary
            .run(
                &format!("external-{n}"),
                n,
                opts.seconds,
                opts.max_delegations,
                common.drain,
            )
            .await?;
        levels.push(level_of("external", n, r));
    }
    drop(primary);
    stop.cancel();
    Ok(levels)
}

/// Runs the CP mode.
pub async fn run(opts: &DelegationsOptions, common: &Common) -> anyhow::Result<Report> {
    let common = &common.for_connectors();
    let setup = Setup::new(0, common.tuning.clone())?;
    let max_n = opts.in_flight.iter().copied().max().unwrap_or(1);
    let mut levels = Vec::new();

    if let Some(url) = &opts.cp_url {
        levels.extend(run_external(url, opts, common).await?);
    } else {
        // The baseline: the primary straight to a worker.
        let direct = DirectCp::start().await?;
        let mut primary =
            Primary::connect(direct.addr, PRIMARY_KEY, "reviewer", opts.cp_nagle).await?;
        for &n in &opts.in_flight {
            let r = primary
                .run(
                    &format!("direct-{n}"),
                    n,
                    opts.seconds,
                    opts.max_delegations,
                    common.drain,
                )
                .await?;
            levels.push(level_of("direct", n, r));
        }
        drop(primary);
        drop(direct);

        for &store in &opts.stores {
            let relay =
                RelayUnderTest::start(&setup, &common.relay, store, common.redis_persistence)
                    .await
                    .with_context(|| format!("starting the relay on the {} store", store.name()))?;
            let stop = CancellationToken::new();
            // Host B: the callee connector serving through its CP endpoint.
            let endpoint_b = OpenAbEndpoint::new(
                section_b(&setup),
                RuntimeKeys::from_secrets([(WORKER_KEY, 0)])?,
            );
            let audit = Arc::new(WatchedAudit::new(AUDIT_CAPACITY));
            let callee =
                start_callee(&setup, relay.addr(), Arc::new(endpoint_b.executor()), audit)?;
            let listener_b = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
            let addr_b = listener_b.local_addr()?;
            tokio::spawn(oab_connector::openab::serve(
                listener_b,
                endpoint_b,
                stop.clone(),
            ));
            // Host A: the caller connector behind its CP endpoint.
            let caller = start_caller(&setup, relay.addr())?;
            let endpoint_a = OpenAbEndpoint::new(
                section_a(&setup, max_n)?,
                RuntimeKeys::from_secrets([(PRIMARY_KEY, 0)])?,
            );
            endpoint_a.set_caller(caller.caller().clone());
            let listener_a = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
            let addr_a = listener_a.local_addr()?;
            tokio::spawn(oab_connector::openab::serve(
                listener_a,
                endpoint_a,
                stop.clone(),
            ));
            caller.connected().await.context("caller connect")?;
            callee.connected().await.context("callee connect")?;

            // The worker takes as many at once as the callee runtime runs.
            let mut ws = crate::cp::connect(addr_b, WORKER_KEY, opts.cp_nagle).await?;
            let max_sessions = u32::try_from(CALLEE_MAX_CONCURRENT).unwrap_or(u32::MAX);
            let beat = crate::cp::register(
                &mut ws,
                "prod",
                "reviewer",
                "worker",
                "bench-worker",
                max_sessions,
            )
            .await?;
            tokio::spawn(crate::cp::run_worker(ws, beat, stop.clone(), opts.cp_nagle));
            let mut primary =
                Primary::connect(addr_a, PRIMARY_KEY, "reviewer", opts.cp_nagle).await?;
            let path = format!("relay-{}", store.name());
            for &n in &opts.in_flight {
                let r = primary
                    .run(
                        &format!("{path}-{n}"),
                        n,
                        opts.seconds,
                        opts.max_delegations,
                        common.drain,
                    )
                    .await?;
                let l = level_of(&path, n, r);
                tracing::info!(path = %path, in_flight = n, per_sec = l.round_trips_per_sec.round(),
                failed = l.failed, "cp level done");
                levels.push(l);
            }
            drop(primary);
            stop.cancel();
            caller.shutdown().await;
            callee.shutdown().await;
            relay.stop().await;
        }
    }

    let mut violations = Vec::new();
    for l in &levels {
        if l.failed > 0 {
            violations.push(format!(
                "cp {} in flight {}: {} delegation(s) without exactly one completed result \
                 (first: {})",
                l.path,
                l.in_flight,
                l.failed,
                l.errors.first().map_or("-", String::as_str)
            ));
        }
        if l.disconnected {
            violations.push(format!(
                "cp {} in flight {}: the endpoint closed the primary's connection",
                l.path, l.in_flight
            ));
        }
    }
    let mut table = Table::new(
        format!(
            "delegations --mode cp: OAB primary -> CP endpoint (connector A) -> relay (TLS) -> \
             connector B -> OAB worker, beside the primary straight to a worker; {} s per level",
            opts.seconds
        ),
        &[
            "path",
            "in flight",
            "round trips/s",
            "rtt p50",
            "rtt p99",
            "completed",
            "failed",
        ],
    );
    for l in &levels {
        table.row(vec![
            l.path.clone(),
            l.in_flight.to_string(),
            fmt_count(l.round_trips_per_sec),
            fmt_us(l.round_trip.p50_us),
            fmt_us(l.round_trip.p99_us),
            fmt_count(l.completed as f64),
            l.failed.to_string(),
        ]);
    }
    let mut json = run_header("delegations", common, relay_bin(common).as_deref());
    if let Some(obj) = json.as_object_mut() {
        obj.insert("mode".into(), "cp".into());
        obj.insert("params".into(), serde_json::to_value(opts)?);
        obj.insert("levels".into(), serde_json::to_value(&levels)?);
    }
    Ok(Report {
        scenario: "delegations",
        tables: vec![table],
        notes: vec![
            "round trips/s: cp/delegate to a completed cp/delegate_result with the worker's \
             text, on one primary connection (closed loop: each result starts the next)."
                .into(),
            "relay path: a signed delegation per round trip (sign, verify, the relay's store), \
             over TLS; direct: one plain WebSocket, the worker answers the ack and the result \
             itself; external: the server at --cp-url routes between the primary and the worker."
                .into(),
            if opts.cp_nagle {
                "--cp-nagle: the CP clients (primary, worker) keep Nagle's algorithm on and \
                 write each frame on its own, as OpenAB's client does; the endpoints' and the \
                 relay's sockets set TCP_NODELAY."
                    .into()
            } else {
                "TCP_NODELAY on every socket; the CP clients batch what they have into one write."
                    .into()
            },
        ],
        json,
        violations,
    })
}
