//! Opens of one session in flight together: a run of `Open` frames sent at
//! once is answered open by open, in order, each with its own ack or
//! error, whatever the others' fate; created delegations are delivered and
//! indexed; the caps hold across the run. Real relay, TLS WebSockets over
//! loopback, both stores (a real `redis-server` for the Redis one).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use std::collections::BTreeSet;
use std::sync::Arc;

use common::*;
use oab_relay::store::EventStore;
use oab_testkit::raw_client::RawClient;
use oab_wire::{DelegationKey, Direction, ErrorCode, Frame};

both_stores! {
    opens_sent_at_once_each_get_their_own_reply_in_order => many_opens;
    opens_sent_at_once_stay_within_the_open_delegation_cap => capped_opens;
    an_opens_trace_id_is_kept_by_the_relay_and_not_forwarded => traced_open;
}

/// An `Open` with a trace id (protocol version 2): acknowledged, its trace
/// kept in the delegation's record (and so in `inspect`), and forwarded to
/// the callee without it (the callee reads the signed one; a callee of
/// version 1 could not decode it). A resend without the trace is the same
/// delegation.
async fn traced_open<S: EventStore>(store: Arc<S>) {
    let env = TestEnv::new("");
    let relay = TestRelay::start(&env, store.clone()).await;
    let mut b = relay.client(&env.callee).await;
    let mut a = relay.client(&env.caller).await;
    let trace = oab_wire::TraceId::random();
    let mut open = open_frame("traced", b"{\"t\":1}");
    if let Frame::Open(o) = &mut open {
        o.trace = Some(trace);
    }
    a.send(&open).await.unwrap();
    await_ack(&mut a, "traced", Direction::Down, 1).await;
    let forwarded = recv_until(&mut b, |f| match f {
        Frame::Open(o) => Some(o.clone()),
        _ => None,
    })
    .await;
    let Frame::Open(sent) = open else {
        unreachable!()
    };
    assert_eq!(forwarded.trace, None, "forwarded without the trace");
    assert_eq!(forwarded.payload, sent.payload);
    assert_eq!(forwarded.digest, sent.digest);
    let meta = store.meta(&key("traced")).await.unwrap().unwrap();
    assert_eq!(meta.trace, Some(trace), "the record keeps the trace");
    // Resent without it (a relay of version 1 in between, or a restart):
    // the same delegation, acknowledged again, its trace unchanged.
    a.send(&open_frame("traced", b"{\"t\":1}")).await.unwrap();
    await_ack(&mut a, "traced", Direction::Down, 1).await;
    let meta = store.meta(&key("traced")).await.unwrap().unwrap();
    assert_eq!(meta.trace, Some(trace));
    // An open without a trace keeps none.
    a.send(&open_frame("plain", b"{}")).await.unwrap();
    await_ack(&mut a, "plain", Direction::Down, 1).await;
    let meta = store.meta(&key("plain")).await.unwrap().unwrap();
    assert_eq!(meta.trace, None);
    relay.stop().await;
}

/// What the relay answered an open with.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Reply {
    Acked,
    Refused(u16),
}

/// The next `n` replies to opens (down acks and errors), in the order they
/// arrived; other frames are skipped.
async fn replies(c: &mut RawClient, n: usize) -> Vec<(DelegationKey, Reply)> {
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        match recv(c).await {
            Frame::Ack(a) if a.direction == Direction::Down => {
                assert_eq!(a.seq, 1, "an open is acked at seq 1: {a:?}");
                out.push((a.key, Reply::Acked));
            }
            Frame::Error(e) => {
                let key = e.key.clone().expect("an open's error names its delegation");
                out.push((key, Reply::Refused(e.code)));
            }
            _ => {}
        }
    }
    out
}

/// The keys of the `Open`s `c` receives until it has `n` of them.
async fn opens_delivered(c: &mut RawClient, n: usize) -> BTreeSet<DelegationKey> {
    let mut out = BTreeSet::new();
    while out.len() < n {
        if let Frame::Open(o) = recv(c).await {
            out.insert(o.key);
        }
    }
    out
}

async fn many_opens<S: EventStore>(store: Arc<S>) {
    let env = TestEnv::new("");
    let relay = TestRelay::start(&env, store.clone()).await;
    let mut b = relay.client(&env.callee).await;
    let mut a = relay.client(&env.caller).await;
    // One delegation the store already holds, for the retries below.
    a.send(&open_frame("held", b"{\"held\":1}")).await.unwrap();
    await_ack(&mut a, "held", Direction::Down, 1).await;
    // 64 opens in one write, with refused ones and retries among them.
    let mut expected = Vec::new();
    for i in 0..64u32 {
        let request = format!("p{i:02}");
        let mut open = open_frame(&request, b"{}");
        let reply = match i {
            // The header's digest is not the payload's.
            7 => {
                if let Frame::Open(o) = &mut open {
                    o.digest = oab_wire::Digest::of(b"other");
                }
                Reply::Refused(ErrorCode::DigestMismatch.as_u16())
            }
            // A target without a route.
            20 => {
                if let Frame::Open(o) = &mut open {
                    o.target = peer(OTHER);
                }
                Reply::Refused(ErrorCode::RouteDenied.as_u16())
            }
            // A retry of the held delegation: acked again.
            33 => {
                open = open_frame("held", b"{\"held\":1}");
                Reply::Acked
            }
            // The held request id with another payload.
            34 => {
                open = open_frame("held", b"{\"held\":2}");
                Reply::Refused(ErrorCode::IdempotencyMismatch.as_u16())
            }
            // A retry that no check passes any more (its deadline is gone):
            // answered from the store, before the checks.
            35 => {
                open = open_frame("held", b"{\"held\":1}");
                if let Frame::Open(o) = &mut open {
                    o.deadline_ms = 1;
                }
                Reply::Acked
            }
            _ => Reply::Acked,
        };
        let key = match &open {
            Frame::Open(o) => o.key.clone(),
            _ => unreachable!(),
        };
        a.feed(&open).await.unwrap();
        expected.push((key, reply));
    }
    a.flush().await.unwrap();
    let got = replies(&mut a, expected.len()).await;
    assert_eq!(got, expected, "one reply per open, in the order sent");
    // The callee gets every created delegation's open (the held one was
    // delivered before), and the store indexes each of them.
    let created: BTreeSet<DelegationKey> = expected
        .iter()
        .filter(|(k, r)| *r == Reply::Acked && k.request_id.as_str() != "held")
        .map(|(k, _)| k.clone())
        .collect();
    assert_eq!(created.len(), 59);
    let mut want = created.clone();
    want.insert(key("held"));
    assert_eq!(opens_delivered(&mut b, want.len()).await, want);
    let open_of_callee: BTreeSet<DelegationKey> = store
        .open_delegations_of(&peer(CALLEE))
        .await
        .unwrap()
        .into_iter()
        .map(|m| m.key)
        .collect();
    assert_eq!(open_of_callee, want);
    let of_caller: BTreeSet<DelegationKey> = store
        .delegations_of(&peer(CALLER))
        .await
        .unwrap()
        .into_iter()
        .map(|m| m.key)
        .collect();
    assert_eq!(of_caller, want);
    // Every one is on the deadline index: due once its deadline passed.
    let due: BTreeSet<DelegationKey> = store
        .due(u64::MAX, 1_000)
        .await
        .unwrap()
        .into_iter()
        .collect();
    assert_eq!(due, want);
    // The session goes on: a down frame on a delegation opened in the run.
    a.send(&data("p00", Direction::Down, 2, None, payload(2)))
        .await
        .unwrap();
    await_ack(&mut a, "p00", Direction::Down, 2).await;
    relay.stop().await;
}

async fn capped_opens<S: EventStore>(store: Arc<S>) {
    let env = TestEnv::new("[limits]\nmax_open_per_peer = 5");
    let relay = TestRelay::start(&env, store).await;
    let mut a = relay.client(&env.caller).await;
    let mut expected = Vec::new();
    for i in 0..12u32 {
        let request = format!("c{i:02}");
        a.feed(&open_frame(&request, b"{}")).await.unwrap();
        let reply = if i < 5 {
            Reply::Acked
        } else {
            Reply::Refused(ErrorCode::TooManyDelegations.as_u16())
        };
        expected.push((key(&request), reply));
    }
    // A retry of an open delegation is answered from the store although
    // the cap is reached.
    a.feed(&open_frame("c01", b"{}")).await.unwrap();
    expected.push((key("c01"), Reply::Acked));
    a.flush().await.unwrap();
    assert_eq!(replies(&mut a, expected.len()).await, expected);
    relay.stop().await;
}
