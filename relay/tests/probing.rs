//! Delegations of other peers cannot be probed: a `Resume` or a `Data` on
//! another pair's existing delegation gets the same answer as on a missing
//! one (checked in `bad_input`), and costs the relay the same store work,
//! so its answer does not come back faster either. Checked by counting the
//! store's commands (Redis `INFO commandstats`) on a real relay over TLS;
//! the latencies themselves are measured by an ignored test.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use common::*;
use oab_relay::store::{RedisStore, Retention};
use oab_testkit::raw_client::RawClient;
use oab_testkit::redis::{Persistence, RedisServer};
use oab_wire::{Direction, ErrorCode, Frame, GapReason, Resume};

/// A relay on Redis with a live delegation `probed` between caller and
/// callee (both online, so the relay holds its view), and a session of
/// `other`, which has nothing to do with it.
struct Probe {
    _server: RedisServer,
    raw: redis::aio::MultiplexedConnection,
    relay: TestRelay,
    other: RawClient,
    _pair: (RawClient, RawClient),
}

async fn probe() -> Probe {
    let server = RedisServer::start(Persistence::None).unwrap();
    let store = RedisStore::connect(&server.url(), Retention::default())
        .await
        .unwrap();
    let raw = redis::Client::open(server.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let env = TestEnv::new("");
    let relay = TestRelay::start(&env, Arc::new(store)).await;
    let mut a = relay.client(&env.caller).await;
    let mut b = relay.client(&env.callee).await;
    a.send(&open_frame("probed", b"{}")).await.unwrap();
    await_ack(&mut a, "probed", Direction::Down, 1).await;
    recv_until(&mut b, |f| matches!(f, Frame::Open(_)).then_some(())).await;
    let other = relay.client(&env.other).await;
    Probe {
        _server: server,
        raw,
        relay,
        other,
        _pair: (a, b),
    }
}

/// One probe by `other`: a `Resume` (`resume`) or a `Data` of the up log of
/// `request`; returns when its answer (`Gap unknown` or `Error
/// unknown_delegation`) arrived.
async fn ask(c: &mut RawClient, request: &str, resume: bool) {
    let k = key(request);
    if resume {
        c.send(&Frame::Resume(Resume {
            key: k.clone(),
            direction: Direction::Up,
            after: 0,
        }))
        .await
        .unwrap();
        let reason = recv_until(c, |f| match f {
            Frame::Gap(g) if g.key == k => Some(g.reason),
            _ => None,
        })
        .await;
        assert_eq!(reason, GapReason::Unknown);
    } else {
        c.send(&data(
            request,
            Direction::Up,
            1,
            None,
            Bytes::from_static(b"x"),
        ))
        .await
        .unwrap();
        let code = recv_until(c, |f| match f {
            Frame::Error(e) if e.key.as_ref() == Some(&k) => Some(e.code),
            _ => None,
        })
        .await;
        assert_eq!(code, ErrorCode::UnknownDelegation.as_u16());
    }
}

/// Calls of each delegation command Redis ran since the last reset.
async fn commands(raw: &mut redis::aio::MultiplexedConnection) -> Vec<(String, u64)> {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(raw)
        .await
        .unwrap();
    let mut out: Vec<(String, u64)> = info
        .lines()
        .filter_map(|l| {
            let (name, rest) = l.strip_prefix("cmdstat_")?.split_once(':')?;
            let calls = rest
                .strip_prefix("calls=")?
                .split(',')
                .next()?
                .parse()
                .ok()?;
            // Only what a lookup can run: the meta read and the scripts.
            ["hgetall", "hget", "evalsha", "hmget"]
                .contains(&name)
                .then(|| (name.to_owned(), calls))
        })
        .collect();
    out.sort();
    out
}

async fn reset(raw: &mut redis::aio::MultiplexedConnection) {
    let _: () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async(raw)
        .await
        .unwrap();
}

/// The store commands of three probes of `request`.
async fn work_of(p: &mut Probe, request: &str, resume: bool) -> Vec<(String, u64)> {
    reset(&mut p.raw).await;
    for _ in 0..3 {
        ask(&mut p.other, request, resume).await;
    }
    commands(&mut p.raw).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probing_another_pairs_delegation_costs_what_a_missing_one_costs() {
    let mut p = probe().await;
    for resume in [true, false] {
        let existing = work_of(&mut p, "probed", resume).await;
        let missing = work_of(&mut p, "never-opened", resume).await;
        assert_eq!(
            existing,
            missing,
            "{}: store work on another pair's delegation vs a missing one",
            if resume { "Resume" } else { "Data" }
        );
        assert_eq!(missing, vec![("hget".to_owned(), 3)]);
    }
    p.relay.stop().await;
}

/// Median answer time of `other`'s probes, existing vs missing, printed.
/// `cargo test --release -p oab-relay --test probing -- --ignored --nocapture`
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "latency measurement; run with --ignored --nocapture, ideally --release"]
async fn measure_probe_latency() {
    const ROUNDS: usize = 2_000;
    let mut p = probe().await;
    for resume in [true, false] {
        let mut times = [Vec::with_capacity(ROUNDS), Vec::with_capacity(ROUNDS)];
        for i in 0..ROUNDS * 2 {
            let which = i % 2;
            let request = if which == 0 { "probed" } else { "never-opened" };
            let started = Instant::now();
            ask(&mut p.other, request, resume).await;
            times[which].push(started.elapsed().as_secs_f64() * 1e6);
        }
        for t in &mut times {
            t.sort_by(f64::total_cmp);
        }
        eprintln!(
            "{}: median existing {:.1} us, missing {:.1} us (p90 {:.1} / {:.1})",
            if resume { "Resume" } else { "Data" },
            times[0][ROUNDS / 2],
            times[1][ROUNDS / 2],
            times[0][ROUNDS * 9 / 10],
            times[1][ROUNDS * 9 / 10],
        );
    }
    p.relay.stop().await;
}
