//! Every fault over loopback against small upstream servers. Timing
//! assertions run under `tokio::time::pause` (the clock only moves when every
//! task is idle), so they are exact and never sleep on the wall clock.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::io::ErrorKind;
use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::{Fault, Proxy};

/// An upstream that echoes every byte back.
async fn echo_upstream() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = listener.accept().await else {
                return;
            };
            let _ = s.set_nodelay(true);
            tokio::spawn(async move {
                let (mut r, mut w) = s.split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
            });
        }
    });
    addr
}

/// What a sink upstream saw on one connection.
#[derive(Debug)]
enum SinkEvent {
    Accepted,
    Bytes(usize),
    Eof,
    Error(ErrorKind),
}

/// An upstream that reads and reports everything, never writing.
async fn sink_upstream() -> (SocketAddr, mpsc::UnboundedReceiver<SinkEvent>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = listener.accept().await else {
                return;
            };
            let tx = tx.clone();
            let _ = tx.send(SinkEvent::Accepted);
            tokio::spawn(async move {
                let mut buf = vec![0u8; 64 * 1024];
                loop {
                    match s.read(&mut buf).await {
                        Ok(0) => {
                            let _ = tx.send(SinkEvent::Eof);
                            return;
                        }
                        Ok(n) => {
                            let _ = tx.send(SinkEvent::Bytes(n));
                        }
                        Err(e) => {
                            let _ = tx.send(SinkEvent::Error(e.kind()));
                            return;
                        }
                    }
                }
            });
        }
    });
    (addr, rx)
}

/// Reads sink events until `total` bytes arrived; returns the next event too
/// if `then_end` (EOF or error expected).
async fn sink_bytes(rx: &mut mpsc::UnboundedReceiver<SinkEvent>, total: usize) {
    let mut got = 0;
    while got < total {
        match rx.recv().await.unwrap() {
            SinkEvent::Bytes(n) => got += n,
            SinkEvent::Accepted => {}
            other => panic!("sink ended early after {got} bytes: {other:?}"),
        }
    }
    assert_eq!(got, total, "sink received more than expected");
}

async fn roundtrip(client: &mut TcpStream, msg: &[u8]) {
    client.write_all(msg).await.unwrap();
    let mut back = vec![0u8; msg.len()];
    client.read_exact(&mut back).await.unwrap();
    assert_eq!(back, msg);
}

#[tokio::test]
async fn pass_forwards_both_ways_and_counts_bytes() {
    let proxy = Proxy::start(echo_upstream().await).await.unwrap();
    let mut client = TcpStream::connect(proxy.addr()).await.unwrap();
    roundtrip(&mut client, b"hello through the proxy").await;
    roundtrip(&mut client, &[7u8; 100_000]).await;
    let n = 23 + 100_000;
    proxy
        .wait_until(|s| s.bytes_to_upstream == n && s.bytes_to_client == n)
        .await;
    let s = proxy.stats();
    assert_eq!((s.accepted, s.active, s.upstream_connects), (1, 1, 1));
    let conns = proxy.connections();
    assert_eq!(conns.len(), 1);
    assert_eq!(conns[0].bytes_to_upstream, n);
    assert_eq!(conns[0].fault, Fault::Pass);
    drop(client);
    proxy.wait_until(|s| s.active == 0).await;
}

#[tokio::test(start_paused = true)]
async fn latency_delays_each_direction() {
    let proxy = Proxy::start(echo_upstream().await).await.unwrap();
    proxy.set_fault(Fault::latency(Duration::from_millis(100)));
    let mut client = TcpStream::connect(proxy.addr()).await.unwrap();
    // No Nagle: the kernel must not hold bytes back while the virtual clock
    // runs ahead.
    client.set_nodelay(true).unwrap();
    let started = Instant::now();
    roundtrip(&mut client, b"ping").await;
    let rtt = started.elapsed();
    assert!(
        rtt >= Duration::from_millis(200) && rtt < Duration::from_millis(210),
        "round trip {rtt:?} should be 2 x 100 ms"
    );
    // Latency is pipelined: ten messages written together still take one
    // round trip, not ten.
    let started = Instant::now();
    for _ in 0..10 {
        client.write_all(b"0123456789").await.unwrap();
    }
    let mut back = vec![0u8; 100];
    client.read_exact(&mut back).await.unwrap();
    let rtt = started.elapsed();
    assert!(rtt < Duration::from_millis(210), "pipelined {rtt:?}");
}

#[tokio::test(start_paused = true)]
async fn bandwidth_caps_the_rate() {
    let (upstream, mut sink) = sink_upstream().await;
    let proxy = Proxy::start(upstream).await.unwrap();
    proxy.set_fault(Fault::bandwidth(10_000));
    let mut client = TcpStream::connect(proxy.addr()).await.unwrap();
    let started = Instant::now();
    client.write_all(&vec![1u8; 100_000]).await.unwrap();
    sink_bytes(&mut sink, 100_000).await;
    let took = started.elapsed();
    // 100,000 B at 10,000 B/s: 10 s, less the first slice (200 B = 20 ms).
    assert!(
        took >= Duration::from_millis(9_900) && took <= Duration::from_millis(10_100),
        "took {took:?}"
    );
    assert_eq!(proxy.stats().bytes_to_upstream, 100_000);
}

#[tokio::test]
async fn drop_after_forwards_exactly_n_bytes_then_closes() {
    let (upstream, mut sink) = sink_upstream().await;
    let proxy = Proxy::start(upstream).await.unwrap();
    proxy.set_fault(Fault::DropAfter { bytes: 1_000 });
    let mut client = TcpStream::connect(proxy.addr()).await.unwrap();
    client.write_all(&[3u8; 5_000]).await.unwrap();
    sink_bytes(&mut sink, 1_000).await;
    match sink.recv().await.unwrap() {
        SinkEvent::Eof | SinkEvent::Error(_) => {}
        other => panic!("upstream should see the close, got {other:?}"),
    }
    // The client sees the close too (EOF, or a reset if its bytes were unread).
    let mut buf = [0u8; 16];
    match client.read(&mut buf).await {
        Ok(0) | Err(_) => {}
        Ok(n) => panic!("client read {n} bytes from a sink"),
    }
    proxy.wait_until(|s| s.drops == 1 && s.active == 0).await;
    assert_eq!(proxy.stats().bytes_to_upstream, 1_000);
}

#[tokio::test]
async fn drop_after_counts_both_directions_and_applies_to_live_connections() {
    let proxy = Proxy::start(echo_upstream().await).await.unwrap();
    let mut client = TcpStream::connect(proxy.addr()).await.unwrap();
    roundtrip(&mut client, &[5u8; 600]).await;
    // 1,200 bytes already crossed: a budget of 1,000 closes it at once.
    proxy.set_fault(Fault::DropAfter { bytes: 1_000 });
    let mut buf = [0u8; 16];
    match client.read(&mut buf).await {
        Ok(0) | Err(_) => {}
        Ok(n) => panic!("unexpected {n} bytes"),
    }
    proxy.wait_until(|s| s.drops == 1).await;
}

#[tokio::test(start_paused = true)]
async fn stall_keeps_the_connection_open_and_forwards_nothing_until_cleared() {
    let proxy = Proxy::start(echo_upstream().await).await.unwrap();
    let mut client = TcpStream::connect(proxy.addr()).await.unwrap();
    roundtrip(&mut client, b"before").await;
    proxy.set_fault(Fault::Stall);
    client.write_all(b"during").await.unwrap();
    let mut back = [0u8; 6];
    // Virtual time: the minute passes as soon as everything is idle.
    let waited = tokio::time::timeout(Duration::from_secs(60), client.read_exact(&mut back)).await;
    assert!(waited.is_err(), "nothing may cross a stalled link");
    let s = proxy.stats();
    assert_eq!(s.bytes_to_upstream, 6, "only the bytes before the stall");
    assert_eq!(s.active, 1, "a stall is not a close");
    proxy.set_fault(Fault::Pass);
    client.read_exact(&mut back).await.unwrap();
    assert_eq!(&back, b"during");
}

#[tokio::test]
async fn reset_sends_rst_to_both_sides() {
    let (upstream, mut sink) = sink_upstream().await;
    let proxy = Proxy::start(upstream).await.unwrap();
    let mut client = TcpStream::connect(proxy.addr()).await.unwrap();
    client.write_all(b"x").await.unwrap();
    sink_bytes(&mut sink, 1).await;
    proxy.set_fault(Fault::Reset);
    let mut buf = [0u8; 8];
    let err = client.read(&mut buf).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::ConnectionReset);
    match sink.recv().await.unwrap() {
        SinkEvent::Error(kind) => assert_eq!(kind, ErrorKind::ConnectionReset),
        other => panic!("upstream should see a reset, got {other:?}"),
    }
    proxy.wait_until(|s| s.resets == 1 && s.active == 0).await;
}

#[tokio::test]
async fn reset_applies_to_new_connections_without_dialing_upstream() {
    let (upstream, _sink) = sink_upstream().await;
    let proxy = Proxy::start(upstream).await.unwrap();
    proxy.set_fault(Fault::Reset);
    let mut client = TcpStream::connect(proxy.addr()).await.unwrap();
    let mut buf = [0u8; 8];
    let err = client.read(&mut buf).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::ConnectionReset);
    proxy.wait_until(|s| s.resets == 1 && s.active == 0).await;
    assert_eq!(proxy.stats().upstream_connects, 0);
}

#[tokio::test(start_paused = true)]
async fn blackhole_accepts_and_never_forwards() {
    let (upstream, mut sink) = sink_upstream().await;
    let proxy = Proxy::start(upstream).await.unwrap();
    proxy.set_fault(Fault::Blackhole);
    let mut client = TcpStream::connect(proxy.addr()).await.unwrap();
    // The blackhole reads: a large write completes instead of blocking.
    client.write_all(&vec![9u8; 4 * 1024 * 1024]).await.unwrap();
    let mut buf = [0u8; 8];
    let waited = tokio::time::timeout(Duration::from_secs(60), client.read(&mut buf)).await;
    assert!(waited.is_err(), "a blackhole never answers");
    let s = proxy.stats();
    assert_eq!(
        (s.blackholed, s.upstream_connects, s.bytes_to_upstream),
        (1, 0, 0)
    );
    assert!(sink.try_recv().is_err(), "upstream saw nothing");
    // It stays blackholed when the fault clears, and a cut ends it.
    proxy.set_fault(Fault::Pass);
    proxy.cut_all();
    proxy.wait_until(|s| s.active == 0 && s.cuts == 1).await;
}

#[tokio::test]
async fn cut_all_closes_every_current_connection_but_keeps_accepting() {
    let proxy = Proxy::start(echo_upstream().await).await.unwrap();
    let mut a = TcpStream::connect(proxy.addr()).await.unwrap();
    let mut b = TcpStream::connect(proxy.addr()).await.unwrap();
    roundtrip(&mut a, b"a").await;
    roundtrip(&mut b, b"b").await;
    proxy.cut_all();
    let mut buf = [0u8; 4];
    assert_eq!(a.read(&mut buf).await.unwrap(), 0);
    assert_eq!(b.read(&mut buf).await.unwrap(), 0);
    proxy.wait_until(|s| s.cuts == 2 && s.active == 0).await;
    let mut c = TcpStream::connect(proxy.addr()).await.unwrap();
    roundtrip(&mut c, b"still serving").await;
}

#[tokio::test]
async fn one_connection_can_be_faulted_or_cut_alone() {
    let proxy = Proxy::start(echo_upstream().await).await.unwrap();
    let mut a = TcpStream::connect(proxy.addr()).await.unwrap();
    let mut b = TcpStream::connect(proxy.addr()).await.unwrap();
    roundtrip(&mut a, b"a").await;
    roundtrip(&mut b, b"b").await;
    let ids: Vec<u64> = proxy.connections().iter().map(|c| c.id).collect();
    assert_eq!(ids, vec![0, 1]);
    assert!(proxy.set_connection_fault(0, Fault::Stall));
    assert_eq!(proxy.connections()[0].fault, Fault::Stall);
    roundtrip(&mut b, b"b still flows").await;
    assert!(proxy.cut(1));
    let mut buf = [0u8; 4];
    assert_eq!(b.read(&mut buf).await.unwrap(), 0);
    proxy.wait_until(|s| s.active == 1).await;
    assert!(!proxy.cut(1), "already gone");
    assert!(proxy.set_connection_fault(0, Fault::Pass));
    roundtrip(&mut a, b"a again").await;
}

#[tokio::test]
async fn plan_chooses_the_fault_per_new_connection() {
    let proxy = Proxy::start(echo_upstream().await).await.unwrap();
    proxy.set_plan(|n| (n == 0).then_some(Fault::Reset));
    let mut first = TcpStream::connect(proxy.addr()).await.unwrap();
    let mut buf = [0u8; 4];
    assert_eq!(
        first.read(&mut buf).await.unwrap_err().kind(),
        ErrorKind::ConnectionReset
    );
    let mut second = TcpStream::connect(proxy.addr()).await.unwrap();
    roundtrip(&mut second, b"second passes").await;
    proxy.clear_plan();
}

#[tokio::test(start_paused = true)]
async fn play_applies_steps_at_their_times() {
    let proxy = Proxy::start(echo_upstream().await).await.unwrap();
    let started = Instant::now();
    let steps = proxy.play(vec![
        (Duration::from_secs(1), Fault::Stall),
        (
            Duration::from_secs(2),
            Fault::latency(Duration::from_millis(5)),
        ),
    ]);
    tokio::time::sleep_until(started + Duration::from_millis(1_500)).await;
    assert_eq!(proxy.fault(), Fault::Stall);
    steps.await.unwrap();
    assert_eq!(started.elapsed(), Duration::from_secs(3));
    assert_eq!(proxy.fault(), Fault::latency(Duration::from_millis(5)));
}

#[tokio::test]
async fn upstream_failure_closes_the_client_and_set_upstream_redirects() {
    // A port with nothing listening: bind, note, release.
    let dead = {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        l.local_addr().unwrap()
    };
    let proxy = Proxy::start(dead).await.unwrap();
    let mut client = TcpStream::connect(proxy.addr()).await.unwrap();
    let mut buf = [0u8; 4];
    match client.read(&mut buf).await {
        Ok(0) | Err(_) => {}
        Ok(n) => panic!("unexpected {n} bytes"),
    }
    proxy.wait_until(|s| s.upstream_failures == 1).await;
    proxy.set_upstream(echo_upstream().await);
    let mut client = TcpStream::connect(proxy.addr()).await.unwrap();
    roundtrip(&mut client, b"redirected").await;
}

#[tokio::test]
async fn dropping_the_proxy_closes_its_connections() {
    let proxy = Proxy::start(echo_upstream().await).await.unwrap();
    let handle = proxy.handle();
    let mut client = TcpStream::connect(proxy.addr()).await.unwrap();
    roundtrip(&mut client, b"x").await;
    drop(proxy);
    let mut buf = [0u8; 4];
    match client.read(&mut buf).await {
        Ok(0) | Err(_) => {}
        Ok(n) => panic!("unexpected {n} bytes"),
    }
    handle.wait_until(|s| s.active == 0).await;
}
