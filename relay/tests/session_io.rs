//! A session's socket and queues under peers that read slowly, stop reading,
//! or read while receiving heavy traffic: real relay, TLS WebSockets over
//! loopback, both stores (a real `redis-server` for the Redis one).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::*;
use oab_relay::store::EventStore;
use oab_testkit::raw_client::RawClient;
use oab_wire::identity::Identity;
use oab_wire::{Direction, Frame, InstanceId, KeyId, PeerEntry, Resume};

both_stores! {
    a_peer_that_stops_reading_is_closed_and_its_connection_slot_is_free_again => stops_reading;
    a_replaced_session_that_never_reads_is_torn_down_within_the_close_deadline => replaced_never_reads;
    a_peer_receiving_a_heavy_replay_still_gets_its_own_frames_acked => reads_under_heavy_delivery;
    a_session_idle_longer_than_the_stall_time_is_not_cut_by_a_burst => idle_then_burst;
    delegation_frames_over_the_byte_budget_are_delivered_from_the_log => byte_budget;
    a_peer_list_larger_than_the_write_buffer_is_delivered_bounded => large_peer_list;
}

/// A payload of `len` bytes that names its sequence.
fn sized(seq: u64, len: usize) -> Bytes {
    let mut s = format!("{seq:08}");
    s.push_str(&"x".repeat(len.saturating_sub(8)));
    Bytes::from(s)
}

/// `b` sends `from..=to` up on `request` (payloads of `len` bytes) in rounds
/// of `round`, waiting for each round's ack; stops early once `done` says so.
async fn stream_up(
    relay: &TestRelay,
    b: &mut RawClient,
    request: &str,
    (from, to): (u64, u64),
    len: usize,
    round: u64,
    done: &str,
) -> u64 {
    let mut seq = from - 1;
    while seq < to {
        let end = (seq + round).min(to);
        for s in seq + 1..=end {
            b.feed(&data(request, Direction::Up, s, None, sized(s, len)))
                .await
                .unwrap();
        }
        b.flush().await.unwrap();
        await_ack(b, request, Direction::Up, end).await;
        seq = end;
        if !done.is_empty() && relay.metrics().await.contains(done) {
            break;
        }
    }
    seq
}

/// Polls the relay's metrics until `cond` holds; panics after `bound`.
async fn wait_for_metrics(relay: &TestRelay, bound: Duration, cond: impl Fn(&str) -> bool) {
    let deadline = tokio::time::Instant::now() + bound;
    loop {
        let m = relay.metrics().await;
        if cond(&m) {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "not within {bound:?}:\n{m}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

const SLOW_CONSUMER: &str = "oab_disconnects_total{reason=\"slow_consumer\"} 1";

/// Item: a peer that authenticates and then never reads must not hold its
/// connection (and a `max_connections` slot) forever.
async fn stops_reading<S: EventStore>(store: Arc<S>) {
    let mut env = TestEnv::new("");
    env.config.relay.max_connections = 2;
    env.config.limits.slow_consumer_ms = 300;
    let relay = TestRelay::start(&env, store).await;
    let mut b = relay.client(&env.callee).await;
    let mut a = relay.client(&env.caller).await;
    a.send(&open_frame("stuck", b"{}")).await.unwrap();
    await_ack(&mut a, "stuck", Direction::Down, 1).await;
    recv_until(&mut b, |f| matches!(f, Frame::Open(_)).then_some(())).await;
    // From here on `a` reads nothing. Enough 64 KiB frames to fill the
    // relay's write buffer and both kernel socket buffers (bounded: 64 MiB).
    let sent = stream_up(
        &relay,
        &mut b,
        "stuck",
        (1, 1024),
        64 * 1024,
        16,
        SLOW_CONSUMER,
    )
    .await;
    // The relay closes `a` within slow_consumer_ms plus the close deadline;
    // then its slot is free: a third connection authenticates. Bounded poll.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let mut third = loop {
        match RawClient::connect(&relay.target(), &env.other, InstanceId::random()).await {
            Ok(c) => break c,
            Err(e) => {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "no free connection slot 10 s after {sent} frames to a peer that stopped reading: {e}"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    assert!(relay.metrics().await.contains(SLOW_CONSUMER));
    third.send(&Frame::PeersQuery).await.unwrap();
    recv_until(&mut third, |f| matches!(f, Frame::Peers(_)).then_some(())).await;
    drop(a);
    relay.stop().await;
}

/// Item: a session closed with `replaced` (4505) whose client keeps the
/// socket open and reads nothing (its replay filled every buffer) is torn
/// down within the close deadline, and its queues go with it.
async fn replaced_never_reads<S: EventStore>(store: Arc<S>) {
    let env = TestEnv::new("");
    let relay = TestRelay::start(&env, store).await;
    let mut b = relay.client(&env.callee).await;
    let mut a = relay.client(&env.caller).await;
    a.send(&open_frame("big", b"{}")).await.unwrap();
    await_ack(&mut a, "big", Direction::Down, 1).await;
    recv_until(&mut b, |f| matches!(f, Frame::Open(_)).then_some(())).await;
    a.close().await;
    // A 24 MiB log.
    let total = stream_up(&relay, &mut b, "big", (1, 384), 64 * 1024, 32, "").await;
    let instance = InstanceId::random();
    let mut first = relay.client_as(&env.caller, instance).await;
    first
        .send(&Frame::Resume(Resume {
            key: key("big"),
            direction: Direction::Up,
            after: 0,
        }))
        .await
        .unwrap();
    // `first` never reads again; wait until its replay has filled every
    // buffer between the relay and it (the relay stops taking frames).
    let stalled_at = wait_replay_stalled(&relay).await;
    assert!(
        stalled_at < total,
        "the replay must still be waiting ({stalled_at} of {total})"
    );
    // A new session of the same instance replaces it.
    let mut second = relay.client_as(&env.caller, instance).await;
    wait_for_metrics(&relay, Duration::from_secs(5), |m| {
        m.contains("oab_disconnects_total{reason=\"replaced\"} 1")
            && metric_value(m, "oab_connections") == 2.0
    })
    .await;
    // The new session works: its own resume delivers the whole log.
    second
        .send(&Frame::Resume(Resume {
            key: key("big"),
            direction: Direction::Up,
            after: 0,
        }))
        .await
        .unwrap();
    let mut last = 0;
    while last < total {
        if let Frame::Data(d) = recv(&mut second).await {
            assert_eq!(d.seq, last + 1);
            last = d.seq;
        }
    }
    drop(first);
    relay.stop().await;
}

/// Waits until the replayed frame count stops moving for 300 ms (the
/// writer is blocked on a full socket); returns it. Bounded.
async fn wait_replay_stalled(relay: &TestRelay) -> u64 {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let mut last = (0.0, tokio::time::Instant::now());
    loop {
        let n = metric_value(&relay.metrics().await, "oab_replayed_frames_total");
        if n != last.0 {
            last = (n, tokio::time::Instant::now());
        } else if n > 0.0 && last.1.elapsed() > Duration::from_millis(300) {
            return n as u64;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "replay never stalled"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Item: heavy delivery towards a peer must not starve reading that
/// peer's own frames: its `Data` is acknowledged while a long replay is
/// still flowing to it. The peer reads more slowly than the relay writes
/// (the scenario: its socket, not the relay, is the bottleneck), so the
/// relay always has replayed frames waiting to be written.
async fn reads_under_heavy_delivery<S: EventStore>(store: Arc<S>) {
    let env = TestEnv::new("");
    let relay = TestRelay::start(&env, store).await;
    let mut b = relay.client(&env.callee).await;
    let mut a = relay.client(&env.caller).await;
    for request in ["heavy", "mine"] {
        a.send(&open_frame(request, b"{}")).await.unwrap();
        await_ack(&mut a, request, Direction::Down, 1).await;
        recv_until(&mut b, |f| matches!(f, Frame::Open(_)).then_some(())).await;
    }
    a.close().await;
    // 47 MiB: far more than the socket buffers between the relay and `a`.
    const TOTAL: u64 = 3_000;
    const LEN: usize = 16 * 1024;
    stream_up(&relay, &mut b, "heavy", (1, TOTAL), LEN, 500, "").await;
    let mut a = relay.client(&env.caller).await;
    a.send(&Frame::Resume(Resume {
        key: key("heavy"),
        direction: Direction::Up,
        after: 0,
    }))
    .await
    .unwrap();
    // Once the replay fills the path to us (200 frames in, read slowly),
    // send a frame of our own and count how much of the replay arrives
    // before its ack.
    let mut last = 0;
    while last < 200 {
        if let Frame::Data(d) = recv(&mut a).await {
            assert_eq!(d.seq, last + 1, "in order");
            last = d.seq;
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
    a.send(&data("mine", Direction::Down, 2, None, payload(2)))
        .await
        .unwrap();
    let mine = key("mine");
    let acked_at = loop {
        match recv(&mut a).await {
            Frame::Data(d) => {
                assert_eq!(d.seq, last + 1, "in order");
                last = d.seq;
                // A reader slower than the relay's writer.
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            Frame::Ack(ack) if ack.key == mine && ack.direction == Direction::Down => {
                assert_eq!(ack.seq, 2);
                break last;
            }
            _ => {}
        }
    };
    println!("own frame acknowledged after {acked_at} of {TOTAL} replayed frames");
    assert!(
        acked_at < TOTAL / 2,
        "own frame acknowledged only after {acked_at} of {TOTAL} replayed frames"
    );
    relay.stop().await;
}

/// Item: the stall clock runs only while frames wait; a session idle for
/// longer than `slow_consumer_ms` that then receives a burst larger than
/// its queue, and reads it, is not cut.
async fn idle_then_burst<S: EventStore>(store: Arc<S>) {
    let mut env = TestEnv::new("");
    env.config.limits.session_queue = 4;
    env.config.limits.slow_consumer_ms = 200;
    let relay = TestRelay::start(&env, store).await;
    let mut b = relay.client(&env.callee).await;
    let mut a = relay.client(&env.caller).await;
    a.send(&open_frame("burst", b"{}")).await.unwrap();
    await_ack(&mut a, "burst", Direction::Down, 1).await;
    recv_until(&mut b, |f| matches!(f, Frame::Open(_)).then_some(())).await;
    // The scenario itself: both sessions idle for longer than the stall time.
    tokio::time::sleep(Duration::from_millis(600)).await;
    const BURST: u64 = 256;
    for seq in 1..=BURST {
        b.feed(&data("burst", Direction::Up, seq, None, payload(seq)))
            .await
            .unwrap();
    }
    b.flush().await.unwrap();
    let mut last = 0;
    while last < BURST {
        match tokio::time::timeout(Duration::from_secs(20), a.recv())
            .await
            .expect("no frame within 20 s")
        {
            Ok(Frame::Data(d)) => {
                assert_eq!(d.seq, last + 1, "in order, exactly once");
                last = d.seq;
            }
            Ok(_) => {}
            Err(e) => panic!("cut after {last} of {BURST} frames: {e}"),
        }
    }
    await_ack(&mut b, "burst", Direction::Up, BURST).await;
    let m = relay.metrics().await;
    assert!(
        metric_value(&m, "oab_disconnects_total{reason=\"slow_consumer\"}") == 0.0,
        "{m}"
    );
    relay.stop().await;
}

/// Item: the queues are bounded in bytes, not only in frames: 64 KiB frames
/// towards a peer that reads late overflow the byte budget long before the
/// 1,024-frame queue, and the rest is delivered from the log, in order,
/// with nothing lost and the session not cut.
async fn byte_budget<S: EventStore>(store: Arc<S>) {
    let mut env = TestEnv::new("");
    let least =
        2 * env.config.wire_limits().max_frame() + oab_relay::outbox::CONTROL_HEADROOM_BYTES;
    env.config.limits.session_queue_bytes = least;
    env.config.validate().unwrap();
    assert_eq!(env.config.limits.session_queue, 1_024);
    let relay = TestRelay::start(&env, store).await;
    let mut b = relay.client(&env.callee).await;
    let mut a = relay.client(&env.caller).await;
    a.send(&open_frame("bytes", b"{}")).await.unwrap();
    await_ack(&mut a, "bytes", Direction::Down, 1).await;
    recv_until(&mut b, |f| matches!(f, Frame::Open(_)).then_some(())).await;
    // `a` does not read while 300 x 64 KiB (19 MiB, 300 frames) are sent.
    const TOTAL: u64 = 300;
    stream_up(&relay, &mut b, "bytes", (1, TOTAL), 64 * 1024, 50, "").await;
    let mut last = 0;
    while last < TOTAL {
        if let Frame::Data(d) = recv(&mut a).await {
            assert_eq!(d.seq, last + 1, "in order, exactly once");
            assert_eq!(d.payload, sized(d.seq, 64 * 1024));
            last = d.seq;
        }
    }
    let m = relay.metrics().await;
    assert!(
        metric_value(&m, "oab_disconnects_total{reason=\"slow_consumer\"}") == 0.0,
        "{m}"
    );
    assert!(
        metric_value(&m, "oab_replayed_frames_total") > 0.0,
        "the byte budget sent the overflow to the log: {m}"
    );
    relay.stop().await;
}

/// Item: a `Peers` frame larger than the session's write buffer used to
/// end the session on every push; it is now bounded to the payload limit
/// (largest descriptors left out first) and delivered.
async fn large_peer_list<S: EventStore>(store: Arc<S>) {
    // Nine more peers the caller may reach, each with a ~900 KiB descriptor:
    // about 8 MiB of peer list, over the relay's write buffer cap.
    let mut extra = String::new();
    let mut others = Vec::new();
    for i in 0..9 {
        let id = Identity::generate(peer(&format!("acme/big{i}")), KeyId::new("k1").unwrap());
        extra.push_str(&format!(
            "[[peers]]\nid = \"{}\"\nkeys = [{{ key_id = \"k1\", public_key = \"{}\" }}]\n\
             [[routes]]\nfrom = \"{CALLER}\"\nto = \"{}\"\n",
            id.peer,
            id.public_key(),
            id.peer
        ));
        others.push(id.peer.clone());
    }
    let env = TestEnv::new(&extra);
    for p in &others {
        let card = serde_json::json!({ "name": p.to_string(), "blob": "y".repeat(900 * 1024) });
        store
            .put_descriptor(p, Bytes::from(serde_json::to_vec(&card).unwrap()))
            .await
            .unwrap();
    }
    let relay = TestRelay::start(&env, store).await;
    let mut a = relay.client(&env.caller).await;
    a.send(&Frame::PeersQuery).await.unwrap();
    let payload = loop {
        match tokio::time::timeout(Duration::from_secs(20), a.recv())
            .await
            .expect("no frame within 20 s")
        {
            Ok(Frame::Peers(p)) => break p,
            Ok(_) => {}
            Err(e) => panic!("the session ended instead of delivering the peer list: {e}"),
        }
    };
    assert!(payload.len() <= env.config.limits.max_payload as usize);
    let entries: Vec<PeerEntry> = serde_json::from_slice(&payload).unwrap();
    assert_eq!(entries.len(), 10, "every reachable peer is listed");
    let with_card = entries.iter().filter(|e| e.descriptor.is_some()).count();
    assert!(with_card >= 1, "as many descriptors as fit are kept");
    // The session is still usable.
    a.send(&open_frame("after", b"{}")).await.unwrap();
    await_ack(&mut a, "after", Direction::Down, 1).await;
    relay.stop().await;
}
