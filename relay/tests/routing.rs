//! Routing, delivery, acks, resume and refusals through a real relay over TLS.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use std::sync::Arc;

use bytes::Bytes;
use common::*;
use oab_relay::store::{EventStore, MemoryStore, Retention};
use oab_wire::{CloseCode, Direction, ErrorCode, Frame, Outcome, Resume};

both_stores! {
    open_1000_events_and_terminal_arrive_byte_identical_in_order => exchange_1000;
    receiver_that_reconnects_resumes_without_loss_or_duplicates => receiver_resume;
    sender_cut_before_acks_resends_and_relay_deduplicates => sender_resend;
    unconfigured_peer_and_unrouted_delegation_are_refused => refusals;
}

fn payload(i: u64) -> Bytes {
    Bytes::from(format!("event-{i:05}-{}", "x".repeat((i % 200) as usize)))
}

async fn exchange_1000<S: EventStore>(store: Arc<S>) {
    let env = TestEnv::new("");
    let relay = TestRelay::start(&env, store).await;
    let mut b = relay.client(&env.callee).await;
    let mut a = relay.client(&env.caller).await;
    let open = open_frame("r1", b"{\"task\":\"summarise\"}");
    a.send(&open).await.unwrap();
    await_ack(&mut a, "r1", Direction::Down, 1).await;
    // The callee receives the open with the payload bytes untouched.
    let got = recv_until(&mut b, |f| match f {
        Frame::Open(o) => Some(o.clone()),
        _ => None,
    })
    .await;
    assert_eq!(&got.payload[..], b"{\"task\":\"summarise\"}");
    assert_eq!(got.key, key("r1"));
    for seq in 1..=1000u64 {
        b.feed(&data("r1", Direction::Up, seq, None, payload(seq)))
            .await
            .unwrap();
    }
    b.feed(&data(
        "r1",
        Direction::Up,
        1001,
        Some(Outcome::Completed),
        Bytes::from_static(b"done"),
    ))
    .await
    .unwrap();
    b.flush().await.unwrap();
    await_ack(&mut b, "r1", Direction::Up, 1001).await;
    let mut next = 1u64;
    while next <= 1001 {
        if let Frame::Data(d) = recv(&mut a).await {
            assert_eq!(d.seq, next, "in order, no gap, no duplicate");
            if next <= 1000 {
                assert_eq!(d.payload, payload(next));
                assert_eq!(d.terminal, None);
            } else {
                assert_eq!(d.terminal, Some(Outcome::Completed));
                assert_eq!(&d.payload[..], b"done");
            }
            next += 1;
        }
    }
    // A second terminal is refused.
    b.send(&data(
        "r1",
        Direction::Up,
        1002,
        Some(Outcome::Failed),
        Bytes::new(),
    ))
    .await
    .unwrap();
    let code = recv_until(&mut b, |f| match f {
        Frame::Error(e) => Some(e.code),
        _ => None,
    })
    .await;
    assert_eq!(code, ErrorCode::AlreadyTerminal.as_u16());
    let metrics = relay.metrics().await;
    assert!(
        metrics.contains("oab_terminals_total{outcome=\"completed\"} 1"),
        "{metrics}"
    );
    assert!(metrics.contains("oab_delegations_opened_total 1"));
    relay.stop().await;
}

async fn receiver_resume<S: EventStore>(store: Arc<S>) {
    let env = TestEnv::new("");
    let relay = TestRelay::start(&env, store).await;
    let mut b = relay.client(&env.callee).await;
    let mut a = relay.client(&env.caller).await;
    a.send(&open_frame("r2", b"{}")).await.unwrap();
    await_ack(&mut a, "r2", Direction::Down, 1).await;
    // The caller reads the first 100 events, then disappears.
    for seq in 1..=300u64 {
        b.feed(&data("r2", Direction::Up, seq, None, payload(seq)))
            .await
            .unwrap();
    }
    b.flush().await.unwrap();
    let mut last = 0;
    while last < 100 {
        if let Frame::Data(d) = recv(&mut a).await {
            assert_eq!(d.seq, last + 1);
            last = d.seq;
        }
    }
    drop(a);
    await_ack(&mut b, "r2", Direction::Up, 300).await;
    for seq in 301..=500u64 {
        b.feed(&data("r2", Direction::Up, seq, None, payload(seq)))
            .await
            .unwrap();
    }
    b.feed(&data(
        "r2",
        Direction::Up,
        501,
        Some(Outcome::Completed),
        Bytes::new(),
    ))
    .await
    .unwrap();
    b.flush().await.unwrap();
    // Reconnect and resume from the cursor while the callee keeps sending.
    let mut a = relay.client(&env.caller).await;
    a.send(&Frame::Resume(Resume {
        key: key("r2"),
        direction: Direction::Up,
        after: last,
    }))
    .await
    .unwrap();
    while last < 501 {
        if let Frame::Data(d) = recv(&mut a).await {
            assert_eq!(d.seq, last + 1, "exactly once, in order, across the seam");
            assert_eq!(
                d.payload,
                if d.seq <= 500 {
                    payload(d.seq)
                } else {
                    Bytes::new()
                }
            );
            last = d.seq;
        }
    }
    relay.stop().await;
}

async fn sender_resend<S: EventStore>(store: Arc<S>) {
    let env = TestEnv::new("");
    let relay = TestRelay::start(&env, store).await;
    let mut a = relay.client(&env.caller).await;
    a.send(&open_frame("r3", b"{}")).await.unwrap();
    await_ack(&mut a, "r3", Direction::Down, 1).await;
    let instance = oab_wire::InstanceId::random();
    let mut b = relay.client_as(&env.callee, instance).await;
    b.send(&Frame::Resume(Resume {
        key: key("r3"),
        direction: Direction::Down,
        after: 0,
    }))
    .await
    .unwrap();
    recv_until(&mut b, |f| matches!(f, Frame::Open(_)).then_some(())).await;
    // Send 50 events and vanish without reading any ack.
    for seq in 1..=50u64 {
        b.feed(&data("r3", Direction::Up, seq, None, payload(seq)))
            .await
            .unwrap();
    }
    b.flush().await.unwrap();
    drop(b);
    // The new session resends everything it never saw acknowledged: 1..=80.
    let mut b = relay.client_as(&env.callee, instance).await;
    for seq in 1..=80u64 {
        b.feed(&data("r3", Direction::Up, seq, None, payload(seq)))
            .await
            .unwrap();
    }
    b.flush().await.unwrap();
    await_ack(&mut b, "r3", Direction::Up, 80).await;
    // A frame that skips ahead is refused with the relay's tail.
    b.send(&data("r3", Direction::Up, 90, None, Bytes::new()))
        .await
        .unwrap();
    let (code, seq) = recv_until(&mut b, |f| match f {
        Frame::Error(e) => Some((e.code, e.seq)),
        _ => None,
    })
    .await;
    assert_eq!(code, ErrorCode::SequenceGap.as_u16());
    assert_eq!(seq, 80);
    let mut last = 0;
    while last < 80 {
        if let Frame::Data(d) = recv(&mut a).await {
            assert_eq!(d.seq, last + 1);
            assert_eq!(d.payload, payload(d.seq));
            last = d.seq;
        }
    }
    relay.stop().await;
}

async fn refusals<S: EventStore>(store: Arc<S>) {
    let env = TestEnv::new("");
    let relay = TestRelay::start(&env, store).await;
    // A peer that is not configured cannot connect.
    let stranger = oab_wire::identity::Identity::generate(
        peer("evil/peer"),
        oab_wire::KeyId::new("k1").unwrap(),
    );
    let err = oab_testkit::raw_client::RawClient::connect(
        &relay.target(),
        &stranger,
        oab_wire::InstanceId::random(),
    )
    .await
    .unwrap_err();
    match err {
        oab_testkit::raw_client::ClientError::Closed { code, reason } => {
            assert_eq!(code, CloseCode::AuthFailed.as_u16());
            assert!(reason.contains("authentication failed"), "{reason}");
        }
        other => panic!("expected auth_failed close, got {other:?}"),
    }
    // A configured peer without a route cannot open.
    let mut o = relay.client(&env.other).await;
    let mut open = open_frame("r4", b"{}");
    if let Frame::Open(x) = &mut open {
        x.key.caller = peer(OTHER);
    }
    o.send(&open).await.unwrap();
    let code = recv_until(&mut o, |f| match f {
        Frame::Error(e) => Some(e.code),
        _ => None,
    })
    .await;
    assert_eq!(code, ErrorCode::RouteDenied.as_u16());
    // And cannot touch someone else's delegation: answered like a missing one.
    let mut a = relay.client(&env.caller).await;
    a.send(&open_frame("r5", b"{}")).await.unwrap();
    await_ack(&mut a, "r5", Direction::Down, 1).await;
    o.send(&Frame::Resume(Resume {
        key: key("r5"),
        direction: Direction::Up,
        after: 0,
    }))
    .await
    .unwrap();
    let gap = recv_until(&mut o, |f| match f {
        Frame::Gap(g) => Some(g.clone()),
        _ => None,
    })
    .await;
    o.send(&Frame::Resume(Resume {
        key: key("nope"),
        direction: Direction::Up,
        after: 0,
    }))
    .await
    .unwrap();
    let missing = recv_until(&mut o, |f| match f {
        Frame::Gap(g) => Some(g.clone()),
        _ => None,
    })
    .await;
    assert_eq!(gap.reason, missing.reason);
    assert_eq!(
        (gap.first_available, gap.terminal),
        (missing.first_available, missing.terminal)
    );
    relay.stop().await;
}

#[tokio::test]
async fn a_second_resume_restarts_the_replay_without_interleaving() {
    let env = TestEnv::new("");
    let relay = TestRelay::start(&env, Arc::new(MemoryStore::new(Retention::default()))).await;
    let mut b = relay.client(&env.callee).await;
    let mut a = relay.client(&env.caller).await;
    a.send(&open_frame("r6", b"{}")).await.unwrap();
    await_ack(&mut a, "r6", Direction::Down, 1).await;
    for seq in 1..=2000u64 {
        b.feed(&data("r6", Direction::Up, seq, None, payload(seq)))
            .await
            .unwrap();
    }
    b.flush().await.unwrap();
    await_ack(&mut b, "r6", Direction::Up, 2000).await;
    drop(a);
    let mut a = relay.client(&env.caller).await;
    let resume = Frame::Resume(Resume {
        key: key("r6"),
        direction: Direction::Up,
        after: 10,
    });
    a.feed(&resume).await.unwrap();
    a.feed(&resume).await.unwrap();
    a.flush().await.unwrap();
    // Frames run 11, 12, ... and may restart at 11 once; never anything else.
    let (mut last, mut restarts) = (10u64, 0);
    while last < 2000 {
        if let Frame::Data(d) = recv(&mut a).await {
            if d.seq == 11 && last != 10 {
                restarts += 1;
            } else {
                assert_eq!(d.seq, last + 1, "contiguous within one replay");
            }
            last = d.seq;
        }
    }
    assert!(restarts <= 1, "{restarts} restarts");
    relay.stop().await;
}

#[tokio::test]
async fn peer_directory_lists_reachable_peers_and_pushes_presence() {
    let env = TestEnv::new("");
    let relay = TestRelay::start(&env, Arc::new(MemoryStore::new(Retention::default()))).await;
    let mut a = relay.client(&env.caller).await;
    let peers = |f: &Frame| match f {
        Frame::Peers(p) => Some(serde_json::from_slice::<Vec<oab_wire::PeerEntry>>(p).unwrap()),
        _ => None,
    };
    a.send(&Frame::PeersQuery).await.unwrap();
    let list = recv_until(&mut a, peers).await;
    assert_eq!(list.len(), 1, "only peers on a route from the caller");
    assert_eq!(list[0].peer, peer(CALLEE));
    assert!(!list[0].online);
    // The callee comes online and publishes its agent card: pushed to the caller.
    let mut b = relay.client(&env.callee).await;
    let card = serde_json::json!({"name": "callee", "version": "1.0"});
    b.send(&Frame::Publish(Bytes::from(card.to_string())))
        .await
        .unwrap();
    let list = recv_until(&mut a, |f| {
        peers(f).filter(|l| l[0].online && l[0].descriptor.is_some())
    })
    .await;
    assert_eq!(list[0].descriptor.as_ref().unwrap()["name"], "callee");
    // Oversized and non-JSON descriptors are refused.
    b.send(&Frame::Publish(Bytes::from_static(b"not json")))
        .await
        .unwrap();
    let code = recv_until(&mut b, |f| match f {
        Frame::Error(e) => Some(e.code),
        _ => None,
    })
    .await;
    assert_eq!(code, oab_wire::ErrorCode::ProtocolViolation.as_u16());
    drop(b);
    let list = recv_until(&mut a, |f| peers(f).filter(|l| !l[0].online)).await;
    assert!(!list[0].online, "presence change pushed");
    relay.stop().await;
}

#[tokio::test]
async fn shutdown_sends_drain_with_a_reconnect_hint_then_closes() {
    let env = TestEnv::new("");
    let relay = TestRelay::start(&env, Arc::new(MemoryStore::new(Retention::default()))).await;
    let mut a = relay.client(&env.caller).await;
    relay.shutdown.cancel();
    let drain = recv_until(&mut a, |f| match f {
        Frame::Drain(d) => Some(*d),
        _ => None,
    })
    .await;
    assert_eq!(drain.reconnect_after_ms, env.config.relay.reconnect_hint_ms);
    let closed = loop {
        match a.recv().await {
            Ok(_) => continue,
            Err(e) => break e,
        }
    };
    match closed {
        oab_testkit::raw_client::ClientError::Closed { code, .. } => {
            assert_eq!(code, CloseCode::GoingAway.as_u16())
        }
        other => panic!("{other:?}"),
    }
    relay.task.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_receiver_is_cut_with_the_reconnect_code_and_loses_nothing() {
    let mut env = TestEnv::new("");
    env.config.limits.session_queue = 16;
    env.config.limits.slow_consumer_ms = 200;
    let relay = TestRelay::start(&env, Arc::new(MemoryStore::new(Retention::default()))).await;
    let mut b = relay.client(&env.callee).await;
    let mut a = relay.client(&env.caller).await;
    a.send(&open_frame("slow", b"{}")).await.unwrap();
    await_ack(&mut a, "slow", Direction::Down, 1).await;
    // The caller stops reading; the callee keeps sending until the relay
    // gives up on the caller (bounded).
    let big = |i: u64| Bytes::from(format!("{i:08}{}", "x".repeat(16 * 1024)));
    let mut sent = 0u64;
    for _round in 0..400 {
        for _ in 0..20 {
            sent += 1;
            b.feed(&data("slow", Direction::Up, sent, None, big(sent)))
                .await
                .unwrap();
        }
        b.flush().await.unwrap();
        await_ack(&mut b, "slow", Direction::Up, sent).await;
        if relay
            .metrics()
            .await
            .contains("oab_disconnects_total{reason=\"slow_consumer\"} 1")
        {
            break;
        }
    }
    // Now read: what was buffered, then the close.
    let mut last = 0;
    let code = loop {
        match tokio::time::timeout(std::time::Duration::from_secs(20), a.recv())
            .await
            .unwrap()
        {
            Ok(Frame::Data(d)) => {
                assert_eq!(d.seq, last + 1);
                last = d.seq;
            }
            Ok(_) => {}
            Err(oab_testkit::raw_client::ClientError::Closed { code, .. }) => break code,
            Err(e) => panic!("{e}"),
        }
    };
    assert_eq!(code, CloseCode::SlowConsumer.as_u16());
    assert!(CloseCode::SlowConsumer.should_reconnect());
    assert!(last < sent, "cut before it got everything");
    let mut a = relay.client(&env.caller).await;
    a.send(&Frame::Resume(Resume {
        key: key("slow"),
        direction: Direction::Up,
        after: last,
    }))
    .await
    .unwrap();
    while last < sent {
        if let Frame::Data(d) = recv(&mut a).await {
            assert_eq!(d.seq, last + 1, "resumed with nothing lost");
            assert_eq!(d.payload, big(d.seq));
            last = d.seq;
        }
    }
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receiver_slower_than_its_sender_is_fed_from_the_log_not_cut() {
    let mut env = TestEnv::new("");
    env.config.limits.session_queue = 16;
    let relay = TestRelay::start(&env, Arc::new(MemoryStore::new(Retention::default()))).await;
    let mut b = relay.client(&env.callee).await;
    let mut a = relay.client(&env.caller).await;
    a.send(&open_frame("fast", b"{}")).await.unwrap();
    await_ack(&mut a, "fast", Direction::Down, 1).await;
    let sender = tokio::spawn(async move {
        for seq in 1..=3000u64 {
            b.feed(&data("fast", Direction::Up, seq, None, payload(seq)))
                .await
                .unwrap();
        }
        b.flush().await.unwrap();
        await_ack(&mut b, "fast", Direction::Up, 3000).await;
    });
    // The caller reads all the while, slower than the sender sends: the
    // 16-frame queue overflows again and again, and the relay switches the
    // subscription to replay from the log instead of cutting the session.
    let mut last = 0;
    while last < 3000 {
        if let Frame::Data(d) = recv(&mut a).await {
            assert_eq!(d.seq, last + 1, "in order, exactly once");
            assert_eq!(d.payload, payload(d.seq));
            last = d.seq;
        }
    }
    sender.await.unwrap();
    let m = relay.metrics().await;
    assert!(
        metric_value(&m, "oab_disconnects_total{reason=\"slow_consumer\"}") == 0.0,
        "{m}"
    );
    assert!(metric_value(&m, "oab_replayed_frames_total") > 0.0, "{m}");
    relay.stop().await;
}

#[tokio::test]
async fn behind_a_load_balancer_the_relay_speaks_plain_websocket_with_challenge_binding() {
    let mut env = TestEnv::new("");
    env.config.relay.tls_mode = oab_relay::config::TlsMode::BehindLoadBalancer;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let shutdown = tokio_util::sync::CancellationToken::new();
    let (config, stop) = (Arc::new(env.config.clone()), shutdown.clone());
    let store = Arc::new(MemoryStore::new(Retention::default()));
    let task = tokio::spawn(async move {
        oab_relay::run(listener, None, config, store, None, stop)
            .await
            .unwrap();
    });
    // The load balancer terminated TLS; the connector binds to the challenge.
    let target = oab_testkit::raw_client::Target {
        addr: addr.to_string(),
        server_name: None,
        root_der: Vec::new(),
    };
    let mut a = oab_testkit::raw_client::RawClient::connect(
        &target,
        &env.caller,
        oab_wire::InstanceId::random(),
    )
    .await
    .unwrap();
    a.send(&open_frame("lb", b"{}")).await.unwrap();
    await_ack(&mut a, "lb", Direction::Down, 1).await;
    shutdown.cancel();
    task.await.unwrap();
}

#[tokio::test]
async fn a_relay_terminating_tls_refuses_an_unbound_hello() {
    let env = TestEnv::new("");
    let relay = TestRelay::start(&env, Arc::new(MemoryStore::new(Retention::default()))).await;
    // TLS to the relay, but a hello bound to the challenge only.
    let mut conn = oab_testkit::raw_client::connect(&relay.target())
        .await
        .unwrap();
    conn.binding = oab_wire::handshake::ChannelBinding::ChallengeOnly;
    match conn
        .handshake(&env.caller, oab_wire::InstanceId::random())
        .await
    {
        Err(oab_testkit::raw_client::ClientError::Closed { code, .. }) => {
            assert_eq!(code, CloseCode::BindingRequired.as_u16())
        }
        other => panic!("expected binding_required, got {other:?}"),
    }
    relay.stop().await;
}
