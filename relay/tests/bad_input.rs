//! Hostile and broken input against a real relay: each gets its documented
//! close code or error frame, nothing panics, and a well-behaved pair keeps
//! routing meanwhile.
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
use futures_util::SinkExt as _;
use oab_relay::store::{MemoryStore, Retention};
use oab_testkit::raw_client::{ClientError, RawClient, connect};
use oab_wire::{CloseCode, Direction, ErrorCode, Frame, InstanceId, Outcome, Ping};
use tokio::io::AsyncReadExt as _;
use tokio_tungstenite::tungstenite::Message;

fn memory() -> Arc<MemoryStore> {
    Arc::new(MemoryStore::new(Retention::default()))
}

async fn close_code(r: Result<Frame, ClientError>) -> u16 {
    match r {
        Err(ClientError::Closed { code, .. }) => code,
        other => panic!("expected a close, got {other:?}"),
    }
}

/// Reads frames until the relay closes; returns the close code.
async fn until_closed(c: &mut RawClient) -> u16 {
    loop {
        match tokio::time::timeout(Duration::from_secs(20), c.recv())
            .await
            .expect("closed in time")
        {
            Ok(_) => continue,
            other => return close_code(other).await,
        }
    }
}

#[tokio::test]
async fn frames_before_authentication_close_with_protocol_violation() {
    let env = TestEnv::new("");
    let relay = TestRelay::start(&env, memory()).await;
    let mut conn = connect(&relay.target()).await.unwrap();
    assert!(matches!(conn.recv().await.unwrap(), Frame::Challenge(_)));
    conn.send(&data("x", Direction::Up, 1, None, Bytes::new()))
        .await
        .unwrap();
    let code = close_code(conn.recv().await).await;
    assert_eq!(code, CloseCode::ProtocolViolation.as_u16());
    relay.stop().await;
}

#[tokio::test]
async fn text_messages_close_with_protocol_violation() {
    let env = TestEnv::new("");
    let relay = TestRelay::start(&env, memory()).await;
    let mut c = relay.client(&env.caller).await;
    c.ws.send(Message::text("hello")).await.unwrap();
    assert_eq!(
        until_closed(&mut c).await,
        CloseCode::ProtocolViolation.as_u16()
    );
    relay.stop().await;
}

/// A log frame over `max_payload` whose message still fits the WebSocket
/// cap is that delegation's error: an `Error payload_too_large` naming its
/// key, direction and sequence; nothing is stored, the same sequence is then taken with a payload that
/// fits, and the session (and its peer's) stays up. An oversized `Open` is
/// refused the same way. Only what cannot be attributed closes (above).
#[tokio::test]
async fn an_oversized_log_frame_is_refused_for_its_delegation_and_the_session_stays() {
    let env = TestEnv::new("[limits]\nmax_payload = 4096\n");
    let relay = TestRelay::start(&env, memory()).await;
    let limit = env.config.limits.max_payload as usize;
    let mut b = relay.client(&env.callee).await;
    let mut a = relay.client(&env.caller).await;
    a.send(&open_frame("big", b"{}")).await.unwrap();
    await_ack(&mut a, "big", Direction::Down, 1).await;
    recv_until(&mut b, |f| matches!(f, Frame::Open(_)).then_some(())).await;
    let too_large = Bytes::from(vec![b'x'; limit + 1]);
    b.send(&data("big", Direction::Up, 1, None, payload(1)))
        .await
        .unwrap();
    b.send(&data("big", Direction::Up, 2, None, too_large.clone()))
        .await
        .unwrap();
    // Frame 1 is acked and frame 2 refused (in either order).
    let (mut acked, mut refused) = (0, None);
    while acked < 1 || refused.is_none() {
        match recv(&mut b).await {
            Frame::Ack(x) if x.direction == Direction::Up => acked = acked.max(x.seq),
            Frame::Error(e) => refused = Some(e),
            _ => {}
        }
    }
    assert_eq!(acked, 1, "only the frame that fits is acked");
    let e = refused.unwrap();
    assert_eq!(e.code, ErrorCode::PayloadTooLarge.as_u16(), "{e:?}");
    assert_eq!(
        (e.key.clone(), e.direction, e.seq),
        (Some(key("big")), Direction::Up, 2)
    );
    // The log goes on from that sequence with a frame that fits.
    b.send(&data(
        "big",
        Direction::Up,
        2,
        Some(Outcome::Completed),
        payload(2),
    ))
    .await
    .unwrap();
    await_ack(&mut b, "big", Direction::Up, 2).await;
    let mut got = Vec::new();
    while got.len() < 2 {
        if let Frame::Data(d) = recv(&mut a).await {
            got.push((d.seq, d.payload.len()));
        }
    }
    assert_eq!(got, vec![(1, payload(1).len()), (2, payload(2).len())]);
    // An oversized open: refused, nothing created, the session stays.
    let mut open = open_frame("big-open", b"{}");
    if let Frame::Open(o) = &mut open {
        o.payload = too_large.clone();
        o.digest = oab_wire::Digest::of(&too_large);
    }
    a.send(&open).await.unwrap();
    let e = recv_until(&mut a, |f| match f {
        Frame::Error(e) => Some(e.clone()),
        _ => None,
    })
    .await;
    assert_eq!(e.code, ErrorCode::PayloadTooLarge.as_u16(), "{e:?}");
    assert_eq!(e.key, Some(key("big-open")));
    for c in [&mut a, &mut b] {
        c.send(&Frame::Ping(Ping { token: 9 })).await.unwrap();
        let pong = recv_until(c, |f| match f {
            Frame::Pong(p) => Some(p.token),
            _ => None,
        })
        .await;
        assert_eq!(pong, 9, "the session is still up");
    }
    relay.stop().await;
}

#[tokio::test]
async fn oversized_and_malformed_frames_close_with_their_codes() {
    let env = TestEnv::new("[limits]\nmax_payload = 4096\n");
    let relay = TestRelay::start(&env, memory()).await;
    let limit = env.config.limits.max_payload as usize;

    // A prefix declaring one byte over the payload limit.
    let mut c = relay.client(&env.caller).await;
    let mut raw = vec![1u8, 5, 0, 0];
    raw.extend_from_slice(&((limit + 1) as u32).to_be_bytes());
    c.send_raw(Bytes::from(raw)).await.unwrap();
    assert_eq!(
        until_closed(&mut c).await,
        CloseCode::FrameTooLarge.as_u16()
    );

    // A WebSocket message bigger than the largest frame.
    let mut c = relay.client(&env.caller).await;
    c.send_raw(Bytes::from(vec![0u8; limit + 8 + 1024 + 1]))
        .await
        .unwrap();
    assert_eq!(
        until_closed(&mut c).await,
        CloseCode::FrameTooLarge.as_u16()
    );

    // Garbage, an unknown frame type, a wrong version, a truncated header.
    for raw in [
        vec![0xde, 0xad, 0xbe, 0xef],
        vec![1, 99, 0, 0, 0, 0, 0, 0],
        vec![2, 5, 0, 0, 0, 0, 0, 0],
        vec![1, 5, 0, 3, 0, 0, 0, 0, 1, b'a', b'/'],
    ] {
        let mut c = relay.client(&env.caller).await;
        let expect = if raw[0] == 2 {
            CloseCode::UnsupportedVersion
        } else {
            CloseCode::MalformedFrame
        };
        c.send_raw(Bytes::from(raw)).await.unwrap();
        assert_eq!(until_closed(&mut c).await, expect.as_u16());
    }

    // Relay-only frames sent to the relay are refused with an error frame;
    // the session stays usable.
    let mut c = relay.client(&env.caller).await;
    c.send(&Frame::Drain(oab_wire::Drain {
        reconnect_after_ms: 1,
    }))
    .await
    .unwrap();
    let code = recv_until(&mut c, |f| match f {
        Frame::Error(e) => Some(e.code),
        _ => None,
    })
    .await;
    assert_eq!(code, ErrorCode::ProtocolViolation.as_u16());
    c.send(&Frame::Ping(Ping { token: 7 })).await.unwrap();
    let pong = recv_until(&mut c, |f| match f {
        Frame::Pong(p) => Some(p.token),
        _ => None,
    })
    .await;
    assert_eq!(pong, 7);
    relay.stop().await;
}

both_stores! {
    refused_frames_get_their_error_codes_and_texts => refused_frames;
}

/// The next `Error` frame's code and message (other frames are skipped).
async fn next_refusal(c: &mut RawClient) -> (u16, String) {
    recv_until(c, |f| match f {
        Frame::Error(e) => Some((e.code, e.message.clone())),
        _ => None,
    })
    .await
}

fn refusal(code: ErrorCode, text: &str) -> (u16, String) {
    (code.as_u16(), text.to_string())
}

/// Every refusal a peer can provoke without breaking the store arrives as an
/// `Error` frame with its documented code and exactly its text (connectors
/// and operators match on both), and the session stays usable throughout.
async fn refused_frames<S: oab_relay::store::EventStore>(store: Arc<S>) {
    let env = TestEnv::new("");
    let relay = TestRelay::start(&env, store).await;
    let mut a = relay.client(&env.caller).await;
    // A frame only the relay sends.
    a.send(&Frame::Drain(oab_wire::Drain {
        reconnect_after_ms: 1,
    }))
    .await
    .unwrap();
    assert_eq!(
        next_refusal(&mut a).await,
        refusal(
            ErrorCode::ProtocolViolation,
            "drain frames are sent by the relay, not to it"
        )
    );
    // A second hello: the connector sends one, once, and the session is
    // authenticated already (the relay sends challenges, it does not take
    // hellos from "the other side").
    a.send(&Frame::Hello(oab_wire::Hello {
        version: oab_wire::PROTOCOL_VERSION,
        peer: peer(CALLER),
        key_id: env.caller.key_id.clone(),
        instance: InstanceId::random(),
        time_ms: oab_wire::identity::now_ms(),
        relay_id: env.config.relay.id.clone(),
        nonce: [7; 32],
        binding: oab_wire::Binding::ChallengeOnly,
        signature: [0; 64],
    }))
    .await
    .unwrap();
    assert_eq!(
        next_refusal(&mut a).await,
        refusal(
            ErrorCode::ProtocolViolation,
            "the session is already authenticated; a hello is sent once, at the start"
        )
    );
    // An open naming another caller.
    let mut open = open_frame("e0", b"{}");
    if let Frame::Open(o) = &mut open {
        o.key.caller = peer(CALLEE);
    }
    a.send(&open).await.unwrap();
    assert_eq!(
        next_refusal(&mut a).await,
        refusal(
            ErrorCode::ProtocolViolation,
            "an open names its sender as caller"
        )
    );
    // No route to the target.
    let mut open = open_frame("e0", b"{}");
    if let Frame::Open(o) = &mut open {
        o.target = peer(OTHER);
    }
    a.send(&open).await.unwrap();
    assert_eq!(
        next_refusal(&mut a).await,
        refusal(
            ErrorCode::RouteDenied,
            "no route from this peer to the target"
        )
    );
    // Wrong digest.
    let mut open = open_frame("e1", b"{}");
    if let Frame::Open(o) = &mut open {
        o.digest = oab_wire::Digest::of(b"other");
    }
    a.send(&open).await.unwrap();
    assert_eq!(
        next_refusal(&mut a).await,
        refusal(
            ErrorCode::DigestMismatch,
            "digest is not the SHA-256 of the payload"
        )
    );
    // Deadline in the past, depth two (the texts carry the route's bounds).
    let mut open = open_frame("e2", b"{}");
    if let Frame::Open(o) = &mut open {
        o.deadline_ms = 1;
    }
    a.send(&open).await.unwrap();
    assert_eq!(
        next_refusal(&mut a).await,
        refusal(
            ErrorCode::InvalidDeadline,
            "deadline must be in the future and at most 86400000 ms away"
        )
    );
    let mut open = open_frame("e3", b"{}");
    if let Frame::Open(o) = &mut open {
        o.depth = 2;
    }
    a.send(&open).await.unwrap();
    assert_eq!(
        next_refusal(&mut a).await,
        refusal(ErrorCode::DepthExceeded, "depth must be 1..=1")
    );
    // Same request id, other payload.
    a.send(&open_frame("e4", b"{\"a\":1}")).await.unwrap();
    await_ack(&mut a, "e4", Direction::Down, 1).await;
    a.send(&open_frame("e4", b"{\"a\":1}")).await.unwrap();
    await_ack(&mut a, "e4", Direction::Down, 1).await;
    a.send(&open_frame("e4", b"{\"a\":2}")).await.unwrap();
    assert_eq!(
        next_refusal(&mut a).await,
        refusal(
            ErrorCode::IdempotencyMismatch,
            "this request id was used with a different payload"
        )
    );
    // A caller cannot write the callee's log: answered exactly like a
    // delegation that does not exist (below).
    a.send(&data("e4", Direction::Up, 1, None, Bytes::new()))
        .await
        .unwrap();
    assert_eq!(
        next_refusal(&mut a).await,
        refusal(ErrorCode::UnknownDelegation, "no such delegation")
    );
    // Nor set the relay-origin flag.
    let mut flagged = data("e4", Direction::Down, 2, None, Bytes::new());
    if let Frame::Data(d) = &mut flagged {
        d.flags = oab_wire::frame::FLAG_RELAY_ORIGIN;
    }
    a.send(&flagged).await.unwrap();
    assert_eq!(
        next_refusal(&mut a).await,
        refusal(
            ErrorCode::ProtocolViolation,
            "the relay-origin flag is set by the relay only"
        )
    );
    let mut b = relay.client(&env.callee).await;
    // Wrong sequences: a hole, then a frame for a delegation that does not exist.
    a.send(&data("e4", Direction::Down, 5, None, Bytes::new()))
        .await
        .unwrap();
    assert_eq!(
        next_refusal(&mut a).await,
        refusal(
            ErrorCode::SequenceGap,
            "sequence skips ahead of the log; resend from seq+1 of this error"
        )
    );
    a.send(&data("nope", Direction::Down, 2, None, Bytes::new()))
        .await
        .unwrap();
    assert_eq!(
        next_refusal(&mut a).await,
        refusal(ErrorCode::UnknownDelegation, "no such delegation")
    );
    // The callee's own `unknown` (it lost track of accepted work) is
    // taken; after the terminal, the message names the outcome.
    b.send(&data(
        "e4",
        Direction::Up,
        1,
        Some(Outcome::Unknown),
        Bytes::new(),
    ))
    .await
    .unwrap();
    await_ack(&mut b, "e4", Direction::Up, 1).await;
    b.send(&data("e4", Direction::Up, 2, None, Bytes::new()))
        .await
        .unwrap();
    assert_eq!(
        next_refusal(&mut b).await,
        refusal(
            ErrorCode::AlreadyTerminal,
            "the delegation already ended: unknown"
        )
    );
    // Descriptors: JSON, within the relay's limit.
    b.send(&Frame::Publish(Bytes::from_static(b"not json")))
        .await
        .unwrap();
    assert_eq!(
        next_refusal(&mut b).await,
        refusal(
            ErrorCode::ProtocolViolation,
            "a descriptor is a JSON document"
        )
    );
    let big = vec![b' '; env.config.limits.max_descriptor + 1];
    b.send(&Frame::Publish(Bytes::from(big))).await.unwrap();
    assert_eq!(
        next_refusal(&mut b).await,
        refusal(
            ErrorCode::DescriptorTooLarge,
            "descriptor over the relay's limit"
        )
    );
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_connections_are_closed_while_a_pair_keeps_routing() {
    let env = TestEnv::new(
        "[rate]\nconnects_per_second_per_ip = 100000\nconnects_burst_per_ip = 100000\n",
    );
    let mut env = env;
    env.config.relay.handshake_timeout_ms = 1_000;
    env.config.relay.max_handshakes = 2_000;
    // All 1,000 come from one address.
    env.config.relay.max_handshakes_per_source = 2_000;
    let relay = TestRelay::start(&env, memory()).await;
    let mut b = relay.client(&env.callee).await;
    let mut a = relay.client(&env.caller).await;
    // 1,000 TCP connections that never speak.
    let mut silent = Vec::new();
    for _ in 0..1000 {
        silent.push(tokio::net::TcpStream::connect(relay.addr).await.unwrap());
    }
    // The pair keeps routing while they hang.
    a.send(&open_frame("s1", b"{}")).await.unwrap();
    await_ack(&mut a, "s1", Direction::Down, 1).await;
    recv_until(&mut b, |f| matches!(f, Frame::Open(_)).then_some(())).await;
    for seq in 1..=100 {
        b.send(&data(
            "s1",
            Direction::Up,
            seq,
            None,
            Bytes::from_static(b"e"),
        ))
        .await
        .unwrap();
    }
    let mut last = 0;
    while last < 100 {
        if let Frame::Data(d) = recv(&mut a).await {
            assert_eq!(d.seq, last + 1);
            last = d.seq;
        }
    }
    // Every silent connection is closed by the handshake deadline.
    for mut s in silent {
        let mut buf = [0u8; 64];
        let n = tokio::time::timeout(Duration::from_secs(20), s.read(&mut buf))
            .await
            .expect("closed by the handshake deadline")
            .unwrap_or(0);
        assert_eq!(n, 0, "no bytes, just a close");
    }
    let m = relay.metrics().await;
    assert!(
        m.contains("oab_handshakes_total{result=\"timeout\"} 1000"),
        "{m}"
    );
    relay.stop().await;
}

/// A connection a connector gave up can finish its handshake after the one
/// that took its place (the relay's handshake waits for the store): the
/// one with the later `Hello` of the same instance stays the session, the
/// late one is closed with `superseded` (a reconnect code), and the live
/// one is not closed with `replaced`, which would stop the connector.
#[tokio::test]
async fn a_late_handshake_of_the_same_connector_does_not_replace_its_later_one() {
    let env = TestEnv::new("");
    let relay = TestRelay::start(&env, memory()).await;
    let instance = InstanceId::random();
    let now = oab_wire::identity::now_ms();
    // The connection in use: its Hello is the later one.
    let mut live = connect(&relay.target())
        .await
        .unwrap()
        .handshake_at(&env.caller, instance, now)
        .await
        .unwrap();
    // The given-up attempt finishes now, with its earlier Hello.
    let late = connect(&relay.target())
        .await
        .unwrap()
        .handshake_at(&env.caller, instance, now - 1_000)
        .await;
    match late {
        Err(ClientError::Closed { code, reason }) => {
            assert_eq!(code, CloseCode::Superseded.as_u16(), "{reason}");
            assert!(oab_wire::code::close_code_should_reconnect(code));
        }
        Err(e) => panic!("the late attempt failed otherwise: {e}"),
        Ok(_) => panic!("the late attempt got a Welcome"),
    }
    // The live session still works: a Ping is answered, no close came.
    live.send(&Frame::Ping(Ping { token: 7 })).await.unwrap();
    loop {
        match tokio::time::timeout(Duration::from_secs(20), live.recv())
            .await
            .expect("an answer in time")
        {
            Ok(Frame::Pong(p)) if p.token == 7 => break,
            Ok(_) => continue,
            Err(e) => panic!("the live session was closed: {e}"),
        }
    }
    let m = relay.metrics().await;
    assert!(m.contains("oab_sessions_replaced_total 0"), "{m}");
    assert!(
        m.contains("oab_handshakes_total{result=\"superseded\"} 1"),
        "{m}"
    );
    // Another instance of the same peer (another process) still replaces it,
    // whatever its clock says.
    let _other = connect(&relay.target())
        .await
        .unwrap()
        .handshake_at(&env.caller, InstanceId::random(), now - 2_000)
        .await
        .unwrap();
    assert_eq!(until_closed(&mut live).await, CloseCode::Replaced.as_u16());
    relay.stop().await;
}

#[tokio::test]
async fn a_newer_session_replaces_the_older_one() {
    let env = TestEnv::new("");
    let relay = TestRelay::start(&env, memory()).await;
    let mut first = relay.client(&env.caller).await;
    let _second = RawClient::connect(&relay.target(), &env.caller, InstanceId::random())
        .await
        .unwrap();
    assert_eq!(until_closed(&mut first).await, CloseCode::Replaced.as_u16());
    let m = relay.metrics().await;
    assert!(m.contains("oab_sessions_replaced_total 1"), "{m}");
    relay.stop().await;
}
