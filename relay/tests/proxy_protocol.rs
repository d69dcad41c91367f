//! The PROXY protocol on the relay's listener: headers written by hand (v1,
//! v2, split across writes, malformed, oversized, from an untrusted address,
//! missing from a trusted one), and a real HAProxy with `send-proxy` and
//! `send-proxy-v2` in front of the relay. The trusted load balancer is
//! 127.0.0.2 (clients bind their socket to it, or HAProxy uses it as its
//! `source`); every other loopback address is untrusted.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::net::{IpAddr, SocketAddr};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use common::{LoggedRelay, TestEnv, TestRelay, free_port, http_get};
use oab_relay::store::{MemoryStore, Retention};
use oab_testkit::raw_client::{RawClient, Target, connect_over};
use oab_wire::InstanceId;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpSocket, TcpStream};

const LB: &str = "127.0.0.2";
/// The relay's log filter: the PROXY protocol module's debug lines.
const PROXY_LOG: &str = "warn,oab_relay::proxy_protocol=debug";

/// Waits (bounded) until the relay logged `client`'s proxied connection as
/// admitted: it holds a handshake slot from then on.
async fn await_admitted(relay: &LoggedRelay, client: impl std::fmt::Display) {
    let want = format!("client={client}");
    for _ in 0..400 {
        if relay.log().lines().any(|l| {
            l.contains("proxied connection") && !l.contains("refused") && l.contains(&want)
        }) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!(
        "no admitted proxied connection of {client}:\n{}",
        relay.log()
    );
}

fn env(extra: &str) -> TestEnv {
    TestEnv::new(&format!(
        "proxy_protocol = {{ enabled = true, trusted = [\"{LB}/32\"] }}\n{extra}"
    ))
}

async fn relay(env: &TestEnv) -> TestRelay {
    TestRelay::start(env, Arc::new(MemoryStore::new(Retention::default()))).await
}

/// A TCP connection to `to` from the loopback address `from`.
async fn tcp_from(from: &str, to: SocketAddr) -> TcpStream {
    let socket = TcpSocket::new_v4().unwrap();
    socket
        .bind(SocketAddr::new(from.parse().unwrap(), 0))
        .unwrap();
    let tcp = socket.connect(to).await.unwrap();
    tcp.set_nodelay(true).unwrap();
    tcp
}

/// A v2 header for a TCP/IPv4 connection from `client`, by hand.
fn v2_header(client: SocketAddr, relay: SocketAddr) -> Vec<u8> {
    let (IpAddr::V4(src), IpAddr::V4(dst)) = (client.ip(), relay.ip()) else {
        panic!("IPv4 only")
    };
    let mut h = b"\r\n\r\n\0\r\nQUIT\n".to_vec();
    h.extend([0x21, 0x11, 0x00, 12]);
    h.extend(src.octets());
    h.extend(dst.octets());
    h.extend(client.port().to_be_bytes());
    h.extend(relay.port().to_be_bytes());
    h
}

fn v1_header(client: SocketAddr, relay: SocketAddr) -> Vec<u8> {
    format!(
        "PROXY TCP4 {} {} {} {}\r\n",
        client.ip(),
        relay.ip(),
        client.port(),
        relay.port()
    )
    .into_bytes()
}

/// The value of `name{label="value"}` in a metrics page (0 if absent).
fn labelled(page: &str, series: &str) -> f64 {
    page.lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
        .unwrap_or(0.0)
}

/// Waits (bounded) until the relay closes `tcp`: a read gives EOF or an
/// error without the relay having sent anything.
async fn closed_by_relay(tcp: &mut TcpStream) {
    let mut buf = [0u8; 64];
    match tokio::time::timeout(Duration::from_secs(10), tcp.read(&mut buf)).await {
        Ok(Ok(0) | Err(_)) => {}
        Ok(Ok(n)) => panic!("the relay answered {n} bytes instead of closing"),
        Err(_) => panic!("the relay kept the connection open"),
    }
}

/// Polls the relay's metrics until `series` reaches `want` (bounded).
async fn await_metric(admin: SocketAddr, series: &str, want: f64) {
    let mut last = 0.0;
    for _ in 0..200 {
        last = labelled(&http_get(admin, "/metrics").await, series);
        if last == want {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("{series} stayed {last}, expected {want}");
}

async fn session_over(tcp: TcpStream, target: &Target, env: &TestEnv) -> RawClient {
    connect_over(tcp, target)
        .await
        .unwrap()
        .handshake(&env.caller, InstanceId::random())
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_behind_hand_written_v1_and_v2_headers() {
    let env = env("");
    let relay = relay(&env).await;
    let client: SocketAddr = "203.0.113.5:40000".parse().unwrap();
    for (name, header) in [
        ("v1", v1_header(client, relay.addr)),
        ("v2", v2_header(client, relay.addr)),
    ] {
        let mut tcp = tcp_from(LB, relay.addr).await;
        tcp.write_all(&header).await.unwrap();
        let c = session_over(tcp, &relay.target(), &env).await;
        assert_ne!(c.welcome.heartbeat_ms, 0, "{name}: welcomed");
    }
    // The header split across TCP writes, one part sent a while after the
    // other (the relay reads what has come and waits for the rest).
    for header in [v1_header(client, relay.addr), v2_header(client, relay.addr)] {
        let mut tcp = tcp_from(LB, relay.addr).await;
        let (a, b) = header.split_at(header.len() / 2);
        tcp.write_all(a).await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        tcp.write_all(b).await.unwrap();
        session_over(tcp, &relay.target(), &env).await;
    }
    // A direct client (untrusted address, no header) is served as before.
    RawClient::connect(&relay.target(), &env.caller, InstanceId::random())
        .await
        .unwrap();
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_or_misplaced_headers_close_the_connection() {
    let env = env("");
    let relay = relay(&env).await;
    let client: SocketAddr = "203.0.113.5:40000".parse().unwrap();
    let header = "oab_handshakes_total{result=\"proxy_header\"}";
    let untrusted = "oab_handshakes_total{result=\"proxy_untrusted\"}";

    // From an untrusted address, a header (v1 or v2) is refused.
    for h in [v1_header(client, relay.addr), v2_header(client, relay.addr)] {
        let mut tcp = tcp_from("127.0.0.1", relay.addr).await;
        tcp.write_all(&h).await.unwrap();
        closed_by_relay(&mut tcp).await;
    }
    await_metric(relay.admin, untrusted, 2.0).await;

    // From the trusted balancer: no header (TLS at once), a malformed one,
    // an oversized v2 one, and one cut short by the balancer's close.
    let tls_first = connect_over(tcp_from(LB, relay.addr).await, &relay.target()).await;
    assert!(tls_first.is_err(), "TLS without a header from the balancer");
    let mut oversized = v2_header(client, relay.addr);
    oversized[14..16].copy_from_slice(&4000u16.to_be_bytes());
    for bytes in [
        b"PROXY TCP4 203.0.113.5 nonsense 1 2\r\n".to_vec(),
        oversized,
        b"PROXY TCP4 203.0.113.5 127.0.".to_vec(),
    ] {
        let mut tcp = tcp_from(LB, relay.addr).await;
        tcp.write_all(&bytes).await.unwrap();
        if bytes.ends_with(b".") {
            tcp.shutdown().await.unwrap();
        }
        closed_by_relay(&mut tcp).await;
    }
    await_metric(relay.admin, header, 4.0).await;
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_per_source_handshake_share_applies_to_the_real_client() {
    // One handshake slot per source: without the header, a second
    // connection from the balancer would be refused.
    let env = env("");
    let relay = LoggedRelay::start(
        &env,
        "memory",
        &["relay.max_handshakes_per_source=1"],
        PROXY_LOG,
    )
    .await;
    let a: SocketAddr = "203.0.113.1:1000".parse().unwrap();
    let b: SocketAddr = "203.0.113.2:1000".parse().unwrap();
    let share = "oab_connections_refused_total{reason=\"max_handshakes_per_source\"}";
    let mut first = tcp_from(LB, relay.addr).await;
    first.write_all(&v2_header(a, relay.addr)).await.unwrap();
    await_admitted(&relay, a).await;
    let mut second = tcp_from(LB, relay.addr).await;
    second.write_all(&v1_header(b, relay.addr)).await.unwrap();
    await_admitted(&relay, b).await;
    // A second handshake of client a is over its share.
    let mut again = tcp_from(LB, relay.addr).await;
    again.write_all(&v2_header(a, relay.addr)).await.unwrap();
    closed_by_relay(&mut again).await;
    await_metric(relay.admin, share, 1.0).await;
    let target = Target {
        addr: relay.addr.to_string(),
        server_name: Some("localhost".into()),
        root_der: env.cert_der.clone(),
    };
    // Both first connections still hold their slots and complete.
    session_over(second, &target, &env).await;
    session_over(first, &target, &env).await;
    assert_eq!(
        labelled(&http_get(relay.admin, "/metrics").await, share),
        1.0
    );
}

// ---------------------------------------------------------------------------
// Through a real HAProxy

fn haproxy_binary() -> Option<&'static str> {
    [
        "/usr/sbin/haproxy",
        "/usr/bin/haproxy",
        "/usr/local/sbin/haproxy",
    ]
    .into_iter()
    .find(|p| std::path::Path::new(p).exists())
}

/// HAProxy in the foreground with two frontends to one relay: `v1` sends
/// `send-proxy`, `v2` `send-proxy-v2`, both from the balancer's address.
/// `retries 0`: HAProxy would otherwise connect again after the relay
/// closes a refused connection, and the test counts refusals.
struct HaProxy {
    child: Child,
    v1: SocketAddr,
    v2: SocketAddr,
    /// A frontend that answers itself (`monitor-uri`), to see HAProxy up.
    probe: SocketAddr,
    _dir: tempfile::TempDir,
}

impl HaProxy {
    fn start(binary: &str, relay: SocketAddr) -> HaProxy {
        let dir = tempfile::tempdir().unwrap();
        let v1 = SocketAddr::from(([127, 0, 0, 1], free_port()));
        let v2 = SocketAddr::from(([127, 0, 0, 1], free_port()));
        let probe = SocketAddr::from(([127, 0, 0, 1], free_port()));
        let cfg = format!(
            "global\n    log stderr format short local0 info\n\
             defaults\n    mode tcp\n    log global\n    timeout connect 3s\n    \
             timeout client 30s\n    timeout server 30s\n    retries 0\n\
             frontend probe\n    mode http\n    bind {probe}\n    monitor-uri /ok\n\
             frontend v1\n    bind {v1}\n    default_backend relay_v1\n\
             frontend v2\n    bind {v2}\n    default_backend relay_v2\n\
             backend relay_v1\n    server relay {relay} send-proxy source {LB}\n\
             backend relay_v2\n    server relay {relay} send-proxy-v2 source {LB}\n"
        );
        let path = dir.path().join("haproxy.cfg");
        std::fs::write(&path, cfg).unwrap();
        let check = Command::new(binary)
            .args(["-c", "-f"])
            .arg(&path)
            .output()
            .unwrap();
        assert!(
            check.status.success(),
            "haproxy -c: {}",
            String::from_utf8_lossy(&check.stderr)
        );
        let child = Command::new(binary)
            .arg("-db")
            .arg("-f")
            .arg(&path)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        HaProxy {
            child,
            v1,
            v2,
            probe,
            _dir: dir,
        }
    }

    /// Waits (bounded) until HAProxy accepts connections (it binds every
    /// frontend before it serves any).
    async fn ready(&self) {
        for _ in 0..250 {
            // Not the relay frontends: a connection there reaches the relay.
            if TcpStream::connect(self.probe).await.is_ok() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!("haproxy did not start listening");
    }
}

impl Drop for HaProxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn behind_haproxy_send_proxy_and_send_proxy_v2() {
    let Some(binary) = haproxy_binary() else {
        eprintln!("SKIPPED: haproxy is not installed (scripts/test installs Debian's haproxy)");
        return;
    };
    let env = env("");
    let relay = LoggedRelay::start(
        &env,
        "memory",
        &["relay.max_handshakes_per_source=1"],
        PROXY_LOG,
    )
    .await;
    let haproxy = HaProxy::start(binary, relay.addr);
    haproxy.ready().await;
    let target = |front: SocketAddr| Target {
        addr: front.to_string(),
        server_name: Some("localhost".into()),
        root_der: env.cert_der.clone(),
    };
    // A session through each frontend, from distinct client addresses.
    let c1 = session_over(
        tcp_from("127.0.0.3", haproxy.v1).await,
        &target(haproxy.v1),
        &env,
    )
    .await;
    let c2 = session_over(
        tcp_from("127.0.0.4", haproxy.v2).await,
        &target(haproxy.v2),
        &env,
    )
    .await;
    drop((c1, c2));
    // The relay saw the clients, with the balancer as the connection's peer.
    let log = relay.log();
    for (client, version) in [("127.0.0.3", 1), ("127.0.0.4", 2)] {
        assert!(
            log.lines().any(|l| l.contains("proxied connection")
                && l.contains(&format!("client={client}:"))
                && l.contains(&format!("lb={LB}:"))
                && l.contains(&format!("version={version}"))),
            "no log line for {client}:\n{log}"
        );
    }

    // One handshake slot per source, charged to the real client: two
    // clients each hold one (idle, before TLS) and a third still gets a
    // session; a second connection of a holding client is refused.
    let share = "oab_connections_refused_total{reason=\"max_handshakes_per_source\"}";
    let _held_a = tcp_from("127.0.0.5", haproxy.v2).await;
    await_admitted(&relay, "127.0.0.5:").await;
    let _held_b = tcp_from("127.0.0.6", haproxy.v1).await;
    await_admitted(&relay, "127.0.0.6:").await;
    let mut over = tcp_from("127.0.0.5", haproxy.v2).await;
    closed_by_relay(&mut over).await;
    await_metric(relay.admin, share, 1.0).await;
    session_over(
        tcp_from("127.0.0.7", haproxy.v2).await,
        &target(haproxy.v2),
        &env,
    )
    .await;
    let page = http_get(relay.admin, "/metrics").await;
    assert_eq!(
        labelled(&page, share),
        1.0,
        "only the over-share connection"
    );
    assert_eq!(
        labelled(&page, "oab_handshakes_total{result=\"proxy_header\"}"),
        0.0
    );
}
