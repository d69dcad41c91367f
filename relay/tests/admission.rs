//! Admission before authentication, against a real relay over TLS on
//! loopback: one source cannot hold every handshake slot, many sources
//! holding every slot with idle connections do not lock logins out, an
//! unauthenticated client cannot make the relay buffer more than a few KiB,
//! and a client that authenticates and then stops reading loses its slot at
//! the deadline.
//!
//! Different source addresses are loopback addresses (127.0.0.2, 127.0.0.3,
//! ...): the relay listens on 127.0.0.1 and Linux routes all of 127.0.0.0/8
//! to the loopback interface.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use futures_util::SinkExt as _;
use oab_relay::store::{MemoryStore, Retention};
use oab_testkit::raw_client::{ClientError, RawClient, connect_over};
use oab_wire::handshake::answer_challenge;
use oab_wire::identity::now_ms;
use oab_wire::{Direction, Frame, InstanceId, encode};
use tokio::io::AsyncWriteExt as _;
use tokio::net::{TcpSocket, TcpStream};
use tokio_tungstenite::tungstenite::Message;

fn memory() -> Arc<MemoryStore> {
    Arc::new(MemoryStore::new(Retention::default()))
}

/// A TCP connection to `relay` from the loopback address `source`.
async fn connect_from(source: [u8; 4], relay: SocketAddr) -> TcpStream {
    let socket = TcpSocket::new_v4().unwrap();
    socket.bind(SocketAddr::from((source, 0))).unwrap();
    socket.connect(relay).await.unwrap()
}

/// Polls the relay's metrics until `series` reaches `want` (bounded).
async fn await_metric(relay: &TestRelay, series: &str, want: u64) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let text = relay.metrics().await;
        let value = text
            .lines()
            .find_map(|l| l.strip_prefix(series).and_then(|v| v.trim().parse().ok()))
            .unwrap_or(0u64);
        if value >= want {
            assert_eq!(value, want, "{series}");
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{series} stayed at {value}, want {want}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_source_cannot_hold_every_handshake_slot() {
    let mut env = TestEnv::new(
        "[rate]\nconnects_per_second_per_ip = 100000\nconnects_burst_per_ip = 100000\n",
    );
    env.config.relay.max_handshakes = 64;
    env.config.relay.max_handshakes_per_source = 8;
    // Silent connections hold their slots for the whole test.
    env.config.relay.handshake_timeout_ms = 60_000;
    let relay = TestRelay::start(&env, memory()).await;

    // Two sources each open as many silent connections as there are slots.
    let mut silent = Vec::new();
    for source in [[127, 0, 0, 2], [127, 0, 0, 3]] {
        for _ in 0..64 {
            silent.push(connect_from(source, relay.addr).await);
        }
    }
    // Logins from a third source still get a slot (the relay accepts in
    // order, so the silent connections are all admitted or refused first),
    // and route.
    let target = relay.target();
    let login = |id| {
        let target = target.clone();
        async move {
            RawClient::connect(&target, id, InstanceId::random())
                .await
                .expect("a login from another source gets a handshake slot")
        }
    };
    for _ in 0..3 {
        login(&env.other).await.close().await;
    }
    let mut b = login(&env.callee).await;
    let mut a = login(&env.caller).await;
    a.send(&open_frame("s1", b"{}")).await.unwrap();
    await_ack(&mut a, "s1", Direction::Down, 1).await;
    recv_until(&mut b, |f| matches!(f, Frame::Open(_)).then_some(())).await;
    // Each silent source got its share; the rest were closed at accept.
    await_metric(
        &relay,
        "oab_connections_refused_total{reason=\"max_handshakes_per_source\"}",
        2 * (64 - 8),
    )
    .await;
    drop(silent);
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_message_before_the_hello_is_refused_at_a_few_kib() {
    let mut env = TestEnv::new("");
    // Without the pre-authentication cap the relay would wait this long
    // for the rest of the frame and then close with `handshake_timeout`.
    env.config.relay.handshake_timeout_ms = 5_000;
    let relay = TestRelay::start(&env, memory()).await;
    let mut conn = oab_testkit::raw_client::connect(&relay.target())
        .await
        .unwrap();
    assert!(matches!(conn.recv().await.unwrap(), Frame::Challenge(_)));
    // A binary WebSocket frame announcing 512 KiB (under the relay's
    // authenticated frame cap), of which 16 KiB follow.
    let len: u64 = 512 * 1024;
    let mut bytes = vec![0x82, 0x80 | 127];
    bytes.extend_from_slice(&len.to_be_bytes());
    bytes.extend_from_slice(&[0, 0, 0, 0]); // mask key (zeros: payload as is)
    bytes.extend_from_slice(&[0u8; 16 * 1024]);
    let io = conn.ws.get_mut();
    io.write_all(&bytes).await.unwrap();
    io.flush().await.unwrap();
    let closed = tokio::time::timeout(Duration::from_secs(30), conn.recv())
        .await
        .expect("the relay answers");
    match closed {
        Err(ClientError::Closed { code, reason }) => {
            assert_eq!(code, 4501, "{reason}");
            assert!(reason.contains("before the hello"), "{reason}");
        }
        other => panic!("expected a close, got {other:?}"),
    }
    // A well-behaved client is unaffected.
    let _ok = relay.client(&env.caller).await;
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stops_reading_the_welcome_loses_its_handshake_slot() {
    let mut env = TestEnv::new(
        "[rate]\nconnects_per_second_per_ip = 100000\nconnects_burst_per_ip = 100000\n\
         [limits]\nmax_open_per_peer = 100000\n",
    );
    for route in &mut env.config.routes {
        route.max_open = 100_000;
    }
    env.config.relay.max_handshakes = 1;
    env.config.relay.max_handshakes_per_source = 1;
    env.config.relay.handshake_timeout_ms = 3_000;
    let relay = TestRelay::start(&env, memory()).await;

    // The caller opens enough delegations (the callee is offline) that its
    // next `Welcome` lists a few hundred KiB of cursors.
    const OPEN: usize = 900;
    let id = |i: usize| format!("{i:0>120}");
    let mut a = relay.client(&env.caller).await;
    for i in 0..OPEN {
        a.feed(&open_frame(&id(i), b"{}")).await.unwrap();
    }
    a.flush().await.unwrap();
    let mut acked = 0;
    while acked < OPEN {
        match recv(&mut a).await {
            Frame::Ack(k) if k.direction == Direction::Down => acked += 1,
            Frame::Error(e) => panic!("error frame: {e:?}"),
            _ => {}
        }
    }
    a.close().await;

    // It logs in again with a tiny receive window and never reads the
    // `Welcome`.
    let socket = TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    socket2::SockRef::from(&socket).set_tcp_mss(536).unwrap();
    let tcp = socket.connect(relay.addr).await.unwrap();
    let mut stalled = connect_over(tcp, &relay.target()).await.unwrap();
    let Frame::Challenge(challenge) = stalled.recv().await.unwrap() else {
        panic!("expected a challenge");
    };
    let hello = answer_challenge(
        &env.caller,
        &challenge,
        None,
        InstanceId::random(),
        now_ms(),
        &stalled.binding,
    )
    .unwrap();
    stalled
        .ws
        .send(Message::Binary(encode(&Frame::Hello(hello)).unwrap()))
        .await
        .unwrap();

    // The only handshake slot comes free at the deadline: another peer gets
    // in while the stalled connection is still open.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let _b = loop {
        match RawClient::connect(&relay.target(), &env.callee, InstanceId::random()).await {
            Ok(c) => break c,
            Err(e) => {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "no login within 30 s: {e}"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    let m = relay.metrics().await;
    assert!(
        m.contains("oab_handshakes_total{result=\"timeout\"} 1"),
        "{m}"
    );
    drop(stalled);
    relay.stop().await;
}

/// `sources` loopback addresses (127.0.0.2 onwards), each holding `each`
/// silent TCP connections to the relay: a connection the relay closes is
/// dialed again at the next tick of `pace` (the attacker's pace, not a wait
/// for anything), so the holders keep every slot they can until `stop`.
fn hold_idle_connections(
    relay: SocketAddr,
    sources: u8,
    each: usize,
    pace: Duration,
    stop: &tokio_util::sync::CancellationToken,
) -> tokio::task::JoinSet<()> {
    use tokio::io::AsyncReadExt as _;
    let mut holders = tokio::task::JoinSet::new();
    for s in 0..sources {
        for _ in 0..each {
            let stop = stop.clone();
            holders.spawn(async move {
                let mut tick = tokio::time::interval(pace);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                loop {
                    tokio::select! {
                        () = stop.cancelled() => return,
                        _ = tick.tick() => {}
                    }
                    // Whatever fails is tried again at the next tick: a
                    // holder never gives up its place in the siege.
                    let Ok(socket) = TcpSocket::new_v4() else {
                        continue;
                    };
                    if socket
                        .bind(SocketAddr::from(([127, 0, 0, 2 + s], 0)))
                        .is_err()
                    {
                        continue;
                    }
                    let connect = tokio::time::timeout(pace * 4, socket.connect(relay));
                    let Ok(Ok(mut tcp)) = connect.await else {
                        continue;
                    };
                    // Silent until the relay closes it.
                    let mut buf = [0u8; 64];
                    tokio::select! {
                        () = stop.cancelled() => return,
                        _ = tcp.read(&mut buf) => {}
                    }
                }
            });
        }
    }
    holders
}

/// The value of a metric series on the relay now (0 when absent).
async fn metric(relay: &TestRelay, series: &str) -> u64 {
    relay
        .metrics()
        .await
        .lines()
        .find_map(|l| l.strip_prefix(series).and_then(|v| v.trim().parse().ok()))
        .unwrap_or(0)
}

/// Many sources hold every handshake slot with idle connections (and dial
/// again each one the relay closes); good logins from another source still
/// get in: the relay sheds the idle connections of the largest holders
/// instead of refusing newcomers. Returns the logins that succeeded, of 25.
async fn logins_while_idle_sources_hold_every_slot(sources: u8, each: usize) -> usize {
    let mut env = TestEnv::new(
        "[rate]\nconnects_per_second_per_ip = 100000\nconnects_burst_per_ip = 100000\n",
    );
    // The defaults (512 slots, 32 per source); idle connections are not
    // timed out during the test.
    assert_eq!(env.config.relay.max_handshakes, 512);
    assert_eq!(env.config.relay.max_handshakes_per_source, 32);
    env.config.relay.handshake_timeout_ms = 120_000;
    let relay = TestRelay::start(&env, memory()).await;
    assert!(
        sources as usize * each > 512,
        "the holders ask for more than every slot"
    );
    let stop = tokio_util::sync::CancellationToken::new();
    let holders =
        hold_idle_connections(relay.addr, sources, each, Duration::from_millis(250), &stop);

    // Every slot is held by an idle connection: seen as 512 connections,
    // or as a shed (which happens only when every slot is held; with the
    // holders dialing again what is shed, the count churns around 512).
    // Polled slowly: rendering the metrics is work the relay under test
    // shares its threads with.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(180);
    loop {
        let m = relay.metrics().await;
        let value = |series: &str| -> u64 {
            m.lines()
                .find_map(|l| l.strip_prefix(series).and_then(|v| v.trim().parse().ok()))
                .unwrap_or(0)
        };
        if value("oab_connections ") >= 512 || value("oab_handshakes_total{result=\"shed\"}") > 0 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the idle holders never filled the handshake slots:\n{}",
            m.lines()
                .filter(|l| l.starts_with("oab_connections") || l.starts_with("oab_handshakes"))
                .collect::<Vec<_>>()
                .join("\n")
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }

    const LOGINS: usize = 25;
    let target = relay.target();
    let ids = [&env.caller, &env.callee, &env.other];
    let mut ok = 0;
    for i in 0..LOGINS {
        let login = RawClient::connect(&target, ids[i % 3], InstanceId::random());
        // A generous bound: a refused login fails at once, a hung one here.
        match tokio::time::timeout(Duration::from_secs(20), login).await {
            Ok(Ok(c)) => {
                ok += 1;
                c.close().await;
            }
            Ok(Err(e)) => eprintln!("login {i} failed: {e}"),
            Err(_) => eprintln!("login {i} hung"),
        }
    }
    // The holders were still at it: the slots stayed full throughout.
    assert!(
        metric(&relay, "oab_connections ").await >= 500,
        "the idle holders kept their connections up"
    );
    let shed = metric(&relay, "oab_handshakes_total{result=\"shed\"}").await;
    eprintln!(
        "{sources} sources x {each} idle connections: {ok}/{LOGINS} good logins succeeded, \
         {shed} idle connections shed"
    );
    stop.cancel();
    holders.join_all().await;
    relay.stop().await;
    ok
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_sources_of_idle_connections_do_not_lock_out_logins() {
    let ok = logins_while_idle_sources_hold_every_slot(20, 32).await;
    assert!(ok * 10 >= 25 * 9, "only {ok} of 25 good logins succeeded");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_sources_of_idle_connections_do_not_lock_out_logins() {
    let ok = logins_while_idle_sources_hold_every_slot(100, 6).await;
    assert!(ok * 10 >= 25 * 9, "only {ok} of 25 good logins succeeded");
}

/// `relay.max_connections` refuses a connection over it at once: the relay
/// closes it on accept, without waiting for a handshake timeout (here a
/// minute), and counts it (`oab_connections_refused_total{reason=
/// "max_connections"}`); the connection holding the slot is not disturbed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_over_max_connections_is_closed_at_once() {
    use tokio::io::AsyncReadExt as _;
    let mut env = TestEnv::new("");
    env.config.relay.max_connections = 1;
    env.config.relay.handshake_timeout_ms = 60_000;
    let relay = TestRelay::start(&env, memory()).await;
    let mut held = relay.client(&env.caller).await;

    let mut extra = TcpStream::connect(relay.addr).await.unwrap();
    let mut buf = [0u8; 16];
    // Closed by the relay (end of stream or reset), long before the
    // handshake timeout could have done it.
    let read = tokio::time::timeout(Duration::from_secs(10), extra.read(&mut buf))
        .await
        .expect("the relay closes a connection over max_connections at once");
    assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");
    await_metric(
        &relay,
        "oab_connections_refused_total{reason=\"max_connections\"}",
        1,
    )
    .await;
    held.send(&Frame::PeersQuery).await.unwrap();
    recv_until(&mut held, |f| matches!(f, Frame::Peers(_)).then_some(())).await;
    relay.stop().await;
}
