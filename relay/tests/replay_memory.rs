//! A receiver that asks for its logs and never reads them costs the relay
//! its session's queue budget, not its logs: a replay reads the store in
//! steps of about 1 MiB, and waits for room in the session's queue
//! (`limits.session_queue_bytes`) before it reads the next step. The relay
//! is a real process on a real redis-server; its memory is read from
//! `/proc`.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::*;
use oab_testkit::redis::{Persistence, RedisServer};
use oab_wire::{Direction, Frame, InstanceId, Resume};

/// Delegations whose up logs are replayed at once.
const LOGS: usize = 3;
/// Entries per log, each of [`ENTRY_BYTES`]: 40 MB a log.
const ENTRIES: u64 = 40;
const ENTRY_BYTES: usize = 1_000_000;
const MIB: u64 = 1024 * 1024;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replays_that_are_not_read_hold_the_session_budget_not_the_logs() {
    let env = TestEnv::new("");
    let redis = RedisServer::start(Persistence::None).unwrap();
    let mut relay = RelayProcess::start(&env, &redis.url()).await;
    let mut a = relay.client_as(&env.caller, InstanceId::random()).await;
    let mut b = relay.client_as(&env.callee, InstanceId::random()).await;
    for i in 0..LOGS {
        let request = format!("big-log-{i}");
        a.send(&open_frame(&request, b"{}")).await.unwrap();
        await_ack(&mut a, &request, Direction::Down, 1).await;
    }
    drop(a);
    let entry = Bytes::from(vec![b'e'; ENTRY_BYTES]);
    for i in 0..LOGS {
        let request = format!("big-log-{i}");
        let k = key(&request);
        // Sends from `next` on; a refusal (a batch that found a hole while
        // an earlier one was in flight, or a retryable one) resends from
        // the relay's tail, as a connector does.
        let mut acked = 0;
        while acked < ENTRIES {
            for seq in acked + 1..=ENTRIES {
                b.send(&data(&request, Direction::Up, seq, None, entry.clone()))
                    .await
                    .unwrap();
            }
            loop {
                match recv(&mut b).await {
                    Frame::Ack(x) if x.key == k && x.direction == Direction::Up => {
                        acked = acked.max(x.seq);
                        if acked >= ENTRIES {
                            break;
                        }
                    }
                    Frame::Error(e) => {
                        if e.code == oab_wire::ErrorCode::SequenceGap.as_u16() {
                            acked = acked.max(e.seq.min(ENTRIES));
                        }
                        // Let the rest of this round's refusals arrive.
                        while let Ok(Ok(f)) =
                            tokio::time::timeout(Duration::from_millis(200), b.recv()).await
                        {
                            if let Frame::Ack(x) = f {
                                acked = acked.max(x.seq);
                            }
                        }
                        break;
                    }
                    _ => {}
                }
            }
        }
    }
    drop(b);
    // A fresh process: what it holds from here on is the replays' doing.
    relay.restart().await;
    let mut a = relay.client_as(&env.caller, InstanceId::random()).await;
    let before = relay.rss_bytes().unwrap();
    for i in 0..LOGS {
        a.send(&Frame::Resume(Resume {
            key: key(&format!("big-log-{i}")),
            direction: Direction::Up,
            after: 0,
        }))
        .await
        .unwrap();
    }
    // `a` reads nothing. The replays run until the session's queue and the
    // socket buffers are full; sample the relay's memory meanwhile (well
    // before `slow_consumer_ms` closes the session).
    let mut peak = before;
    for _ in 0..60 {
        peak = peak.max(relay.rss_bytes().unwrap());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let replayed = relay.metric("oab_replayed_frames_total").await;
    assert!(replayed >= 1.0, "the replays ran ({replayed} frames)");
    let queue = 16 * MIB; // limits.session_queue_bytes, default
    // One step (about 1 MiB plus one entry) per replay, and room for the
    // socket buffers, TLS records and the allocator.
    let bound = queue + LOGS as u64 * 2 * MIB + 32 * MIB;
    let grew = peak.saturating_sub(before);
    eprintln!(
        "relay memory: {} MiB before the resumes, {} MiB at the peak",
        before / MIB,
        peak / MIB
    );
    assert!(
        grew <= bound,
        "the relay grew by {} MiB while {LOGS} replays of {} MB logs were not read (bound {} MiB)",
        grew / MIB,
        ENTRIES * ENTRY_BYTES as u64 / 1_000_000,
        bound / MIB
    );
    drop(a);
}
