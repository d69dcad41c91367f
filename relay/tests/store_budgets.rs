//! Byte budgets on a real relay: a peer that stores 1 MiB frames as fast as
//! it can is refused at `store.max_peer_bytes` (across its delegations) and
//! at `store.max_delegation_bytes` (within one), with `payload_too_large`
//! error frames, long before the store fills: Redis's own memory use is
//! read before and after. Both run on the real relay over TLS, on a real
//! `redis-server` and on the memory store.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::*;
use futures_util::{SinkExt as _, StreamExt as _};
use oab_relay::store::{EventStore, MemoryStore, RedisStore, Retention};
use oab_testkit::raw_client::RawClient;
use oab_testkit::redis::{Persistence, RedisServer};
use oab_wire::{DelegationKey, Direction, ErrorCode, Frame, Outcome, encode};

use tokio_tungstenite::tungstenite::Message;

const MIB: u64 = 1 << 20;
/// The payload limit: every frame the test sends is as large as allowed.
const FRAME: usize = oab_wire::limits::DEFAULT_MAX_PAYLOAD as usize;
/// Frames the flooding peer sends: four times its budget.
const FLOOD: usize = 64;

/// Budgets small enough for a test, far below what the flood sends.
fn budgets() -> Retention {
    Retention {
        max_delegation_bytes: 4 * MIB,
        max_peer_bytes: 16 * MIB,
        ..Retention::default()
    }
}

/// What the relay answered for each frame: acked, or the error's code and
/// text, by delegation key and seq.
type Answers = HashMap<(DelegationKey, u64), Result<(), (u16, String)>>;

/// Sends `frames` as fast as the socket takes them while reading the
/// relay's answers, until every frame has one (an ack is cumulative per
/// log: it answers every seq up to its own).
async fn flood(client: RawClient, frames: Vec<(DelegationKey, Direction, u64, Frame)>) -> Answers {
    let (mut sink, mut stream) = client.ws.split();
    let wanted: Vec<(DelegationKey, Direction, u64)> = frames
        .iter()
        .map(|(k, d, s, _)| (k.clone(), *d, *s))
        .collect();
    let sender = tokio::spawn(async move {
        for (_, _, _, f) in frames {
            sink.feed(Message::Binary(encode(&f).unwrap()))
                .await
                .unwrap();
        }
        sink.flush().await.unwrap();
        sink
    });
    let mut answers = Answers::new();
    let limits = oab_wire::Limits::default();
    while wanted
        .iter()
        .any(|(k, _, s)| !answers.contains_key(&(k.clone(), *s)))
    {
        let msg = tokio::time::timeout(Duration::from_secs(60), stream.next())
            .await
            .unwrap_or_else(|_| panic!("no answer within 60 s: {answers:?}"))
            .expect("connection ended")
            .unwrap();
        let Message::Binary(b) = msg else {
            assert!(!msg.is_close(), "closed: {msg:?}");
            continue;
        };
        match oab_wire::decode_message(b, &limits).unwrap() {
            Frame::Ack(a) => {
                for (k, d, s) in &wanted {
                    if *k == a.key && *d == a.direction && *s <= a.seq {
                        answers.entry((k.clone(), *s)).or_insert(Ok(()));
                    }
                }
            }
            Frame::Error(e) => {
                let k = e.key.clone().expect("a refusal names its delegation");
                answers
                    .entry((k, e.seq))
                    .or_insert(Err((e.code, e.message.clone())));
            }
            _ => {}
        }
    }
    drop(sender.await.unwrap());
    answers
}

fn refused_with(text: &str) -> Result<(), (u16, String)> {
    Err((ErrorCode::PayloadTooLarge.as_u16(), text.to_string()))
}

const PEER_REFUSAL: &str = "this peer's stored bytes would pass the relay's budget";
const DELEGATION_REFUSAL: &str = "the delegation's stored bytes would pass the relay's budget";

/// The callee answers [`FLOOD`] delegations with one 1 MiB frame each, as
/// fast as it can: the first ones fit in its 16 MiB, every later one is
/// refused with the peer-budget error and not stored. Then the caller sends
/// 1 MiB frames on one delegation: refused past its 4 MiB. Returns the
/// bytes the refused frames would have added.
async fn flooding_peer_hits_its_budgets<S: EventStore>(store: Arc<S>) -> u64 {
    // The caller waits silently while the callee floods (a debug build
    // encrypts 64 MiB slowly): no idle close meanwhile.
    let env = TestEnv::new("idle_timeout_ms = 600000");
    let relay = TestRelay::start(&env, store.clone()).await;
    let mut a = relay.client(&env.caller).await;
    let b = relay.client(&env.callee).await;
    let names: Vec<String> = (0..FLOOD).map(|i| format!("flood-{i}")).collect();
    for n in &names {
        a.feed(&open_frame(n, b"{}")).await.unwrap();
    }
    a.flush().await.unwrap();
    for n in &names {
        await_ack(&mut a, n, Direction::Down, 1).await;
    }

    let big = Bytes::from(vec![0x5a; FRAME]);
    let frames = names
        .iter()
        .map(|n| {
            let f = data(n, Direction::Up, 1, None, big.clone());
            (key(n), Direction::Up, 1, f)
        })
        .collect();
    let answers = flood(b, frames).await;
    let stored: Vec<&String> = names
        .iter()
        .filter(|n| answers[&(key(n), 1)].is_ok())
        .collect();
    // 1 MiB of payload plus a frame header each: 15 fit in 16 MiB.
    assert_eq!(stored.len(), 15, "frames stored within 16 MiB");
    for n in &names {
        let answer = &answers[&(key(n), 1)];
        if answer.is_err() {
            assert_eq!(answer, &refused_with(PEER_REFUSAL), "{n}");
            let m = store.meta(&key(n)).await.unwrap().unwrap();
            assert_eq!(m.up_tail, 0, "{n}: a refused frame is not stored");
        }
    }

    // The caller's own budget is untouched by the callee's; a delegation
    // holds at most 4 MiB (the open included): 3 frames on one whose up
    // frame was refused.
    let last = &names[FLOOD - 1];
    assert!(answers[&(key(last), 1)].is_err());
    let k = key(last);
    let frames = (2..=5)
        .map(|seq| {
            let f = data(last, Direction::Down, seq, None, big.clone());
            (k.clone(), Direction::Down, seq, f)
        })
        .collect();
    let answers = flood(a, frames).await;
    for seq in 2..=4 {
        assert_eq!(answers[&(k.clone(), seq)], Ok(()), "seq {seq}");
    }
    assert_eq!(answers[&(k.clone(), 5)], refused_with(DELEGATION_REFUSAL));
    assert_eq!(store.meta(&k).await.unwrap().unwrap().down_tail, 4);
    relay.stop().await;
    (FLOOD as u64 - 15 + 1) * FRAME as u64
}

/// On Redis: what the flood added to Redis's memory is within the two
/// budgets (plus the stores' own keys), nowhere near the 64 MiB sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flooding_peer_is_held_to_its_budget_on_redis() {
    let server = RedisServer::start(Persistence::None).unwrap();
    let store = RedisStore::connect(&server.url(), budgets()).await.unwrap();
    let mut raw = redis::Client::open(server.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let used = |info: String| -> u64 {
        info.lines()
            .find_map(|l| l.strip_prefix("used_memory:"))
            .and_then(|v| v.trim().parse().ok())
            .unwrap()
    };
    let before = used(
        redis::cmd("INFO")
            .arg("memory")
            .query_async(&mut raw)
            .await
            .unwrap(),
    );
    let refused = flooding_peer_hits_its_budgets(Arc::new(store)).await;
    let after = used(
        redis::cmd("INFO")
            .arg("memory")
            .query_async(&mut raw)
            .await
            .unwrap(),
    );
    let grown = after.saturating_sub(before);
    eprintln!(
        "redis used_memory grew {:.1} MiB; refused {:.1} MiB",
        grown as f64 / MIB as f64,
        refused as f64 / MIB as f64
    );
    // Stored: 15 MiB of the callee's, 3 MiB of the caller's, 128 opens.
    assert!(
        grown < 32 * MIB,
        "Redis grew {grown} bytes for budgets of 16 + 4 MiB"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flooding_peer_is_held_to_its_budget_in_memory() {
    flooding_peer_hits_its_budgets(Arc::new(MemoryStore::new(budgets()))).await;
}

/// The callee finishes [`FLOOD`] delegations, eight at a time, each with
/// one 1 MiB terminal frame: four times its 16 MiB budget in all, and every
/// frame is stored, because a finished delegation's bytes leave the budget
/// at once (the budget bounds what a peer holds open; what retention keeps
/// for `finished_ttl_ms` never counts). The finished delegations stay
/// readable.
async fn finished_work_never_counts_against_the_budget<S: EventStore>(store: Arc<S>) {
    let env = TestEnv::new("idle_timeout_ms = 600000");
    let relay = TestRelay::start(&env, store.clone()).await;
    let mut a = relay.client(&env.caller).await;
    let callee = oab_wire::InstanceId::random();
    let big = Bytes::from(vec![0x5a; FRAME]);
    let mut all = Vec::new();
    for round in 0..FLOOD / 8 {
        let names: Vec<String> = (0..8).map(|i| format!("done-{round}-{i}")).collect();
        for n in &names {
            a.feed(&open_frame(n, b"{}")).await.unwrap();
        }
        a.flush().await.unwrap();
        for n in &names {
            await_ack(&mut a, n, Direction::Down, 1).await;
        }
        let b = relay.client_as(&env.callee, callee).await;
        let frames = names
            .iter()
            .map(|n| {
                let f = data(n, Direction::Up, 1, Some(Outcome::Completed), big.clone());
                (key(n), Direction::Up, 1, f)
            })
            .collect();
        let answers = flood(b, frames).await;
        for n in &names {
            assert_eq!(answers[&(key(n), 1)], Ok(()), "{n} (round {round})");
        }
        // The caller reads the results (a caller that does not read is
        // closed as a slow consumer, which is not what this tests).
        let mut left: std::collections::HashSet<DelegationKey> =
            names.iter().map(|n| key(n)).collect();
        while !left.is_empty() {
            recv_until(&mut a, |f| match f {
                Frame::Data(d) if d.terminal.is_some() => Some(left.remove(&d.key)),
                _ => None,
            })
            .await;
        }
        all.extend(names);
    }
    for n in &all {
        let m = store.meta(&key(n)).await.unwrap().unwrap();
        assert_eq!(m.terminal, Some(Outcome::Completed), "{n}");
        assert_eq!(m.up_tail, 1, "{n}");
    }
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finished_work_never_counts_against_the_budget_on_redis() {
    let server = RedisServer::start(Persistence::None).unwrap();
    let store = RedisStore::connect(&server.url(), budgets()).await.unwrap();
    finished_work_never_counts_against_the_budget(Arc::new(store)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finished_work_never_counts_against_the_budget_in_memory() {
    finished_work_never_counts_against_the_budget(Arc::new(MemoryStore::new(budgets()))).await;
}
