//! The PROXY protocol (HAProxy's v1 text and v2 binary headers) on the
//! relay's listener: behind an L4 load balancer that sends it, the relay
//! learns each connection's real client address, and that address, not the
//! balancer's, is what the per-source limits ([`crate::admission`]), the
//! connection's log span and the refusal metrics see.
//!
//! Off by default (`relay.proxy_protocol.enabled`). When on, a connection is
//! read one of two ways, chosen by the address it comes from:
//!
//! - from an address in `relay.proxy_protocol.trusted` (the balancers): it
//!   must start with a v1 or v2 header, read before TLS, under the
//!   handshake deadline and within [`MAX_HEADER_BYTES`]. No header, a
//!   malformed or oversized one, or a connection that ends before its header
//!   does, is closed (`oab_handshakes_total{result="proxy_header"}`). A v2
//!   `LOCAL` header or a v1 `UNKNOWN` one (the balancer's own health checks)
//!   keeps the balancer's address.
//! - from any other address: served as it is, without a header; one that
//!   starts with a PROXY header signature is closed
//!   (`oab_handshakes_total{result="proxy_untrusted"}`), since anyone could
//!   write a header naming any address.
//!
//! Parsing is the `proxy-header` crate's; this module decides how many bytes
//! to read so that it never reads past the header (the TLS `ClientHello`
//! that follows stays in the socket for the TLS acceptor).

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::str::FromStr;

use governor::DefaultKeyedRateLimiter;
use proxy_header::{ParseConfig, Protocol, ProxyHeader};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt as _};
use tokio::net::TcpStream;
use tokio::time::Instant;
use tracing::debug;

use crate::admission::{HandshakePermit, SlotReservation, Source};
use crate::metrics::Metrics;

/// The largest header accepted, in bytes. A v1 header is at most 107 bytes
/// (the specification's bound); a v2 header is 16 bytes, then the addresses
/// (36 for IPv6, 216 for a Unix socket) and the TLVs a balancer adds (HAProxy
/// `proxy-v2-options`, a cloud balancer's endpoint id): 1 KiB leaves room for
/// these, while the 64 KiB a v2 length field could announce does not get
/// buffered. Overflow policy: the connection is closed before the header's
/// body is read.
pub const MAX_HEADER_BYTES: usize = 1024;

/// Shortest complete header: `PROXY UNKNOWN\r\n`. Every header is at least
/// this long, so this many bytes can always be read before looking.
const MIN_HEADER_BYTES: usize = 15;
/// Longest v1 header, CRLF included (the specification's bound).
const MAX_V1_BYTES: usize = 107;
/// The v2 signature.
const V2_SIGNATURE: &[u8; 12] = b"\r\n\r\n\0\r\nQUIT\n";
/// The fixed part of a v2 header: signature, version and command, family
/// and protocol, 2-byte length.
const V2_FIXED_BYTES: usize = 16;
/// How a v1 header starts.
const V1_SIGNATURE: &[u8; 6] = b"PROXY ";

/// `relay.proxy_protocol`: whether PROXY headers are read, and from which
/// load-balancer addresses.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProxyProtocol {
    /// Read PROXY headers from the `trusted` addresses (default false).
    #[serde(default)]
    pub enabled: bool,
    /// The load balancers' addresses, as CIDR blocks (`10.0.0.0/8`,
    /// `fd00::/8`) or single addresses (`192.0.2.7`). Connections from these
    /// must send a header; connections from elsewhere must not.
    #[serde(default)]
    pub trusted: Vec<Cidr>,
}

impl ProxyProtocol {
    /// Whether a connection from `peer` must start with a PROXY header.
    pub fn expects_header(&self, peer: IpAddr) -> bool {
        self.enabled && self.trusted.iter().any(|net| net.contains(peer))
    }

    /// Problems with these settings, as `(field, message)` pairs for the
    /// configuration's validation.
    pub fn problems(&self) -> Vec<(String, String)> {
        let mut out = Vec::new();
        if self.enabled && self.trusted.is_empty() {
            out.push((
                "relay.proxy_protocol.trusted".to_owned(),
                "must list the load balancers' addresses when enabled".to_owned(),
            ));
        }
        out
    }
}

/// An address block: an address and a prefix length (`10.0.0.0/8`). Written
/// without a prefix it is one address. The bits past the prefix must be zero.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Cidr {
    net: IpAddr,
    bits: u8,
}

impl Cidr {
    /// Whether `ip` is in this block (an IPv4-mapped IPv6 address counts as
    /// its IPv4 address).
    pub fn contains(&self, ip: IpAddr) -> bool {
        match (self.net, ip.to_canonical()) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => {
                let mask = u32::MAX.checked_shl(32 - u32::from(self.bits)).unwrap_or(0);
                u32::from(ip) & mask == u32::from(net)
            }
            (IpAddr::V6(net), IpAddr::V6(ip)) => {
                let mask = u128::MAX
                    .checked_shl(128 - u32::from(self.bits))
                    .unwrap_or(0);
                u128::from(ip) & mask == u128::from(net)
            }
            _ => false,
        }
    }
}

impl FromStr for Cidr {
    type Err = String;

    fn from_str(s: &str) -> Result<Cidr, String> {
        let (addr, bits) = match s.split_once('/') {
            Some((a, b)) => (a, Some(b)),
            None => (s, None),
        };
        let net: IpAddr = addr
            .parse()
            .map_err(|_| format!("{s:?} is not an IP address or CIDR block"))?;
        let max = if net.is_ipv4() { 32 } else { 128 };
        let bits = match bits {
            None => max,
            Some(b) => b
                .parse::<u8>()
                .ok()
                .filter(|&b| b <= max)
                .ok_or_else(|| format!("{s:?}: the prefix length must be 0..={max}"))?,
        };
        let cidr = Cidr { net, bits };
        let masked = match net {
            IpAddr::V4(a) => {
                let mask = u32::MAX.checked_shl(32 - u32::from(bits)).unwrap_or(0);
                IpAddr::V4(Ipv4Addr::from(u32::from(a) & mask))
            }
            IpAddr::V6(a) => {
                let mask = u128::MAX.checked_shl(128 - u32::from(bits)).unwrap_or(0);
                IpAddr::V6(Ipv6Addr::from(u128::from(a) & mask))
            }
        };
        if masked != net {
            return Err(format!(
                "{s:?} has bits set past its prefix (the block is {masked}/{bits})"
            ));
        }
        Ok(cidr)
    }
}

impl TryFrom<String> for Cidr {
    type Error = String;

    fn try_from(s: String) -> Result<Cidr, String> {
        s.parse()
    }
}

impl From<Cidr> for String {
    fn from(c: Cidr) -> String {
        c.to_string()
    }
}

impl std::fmt::Display for Cidr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.net, self.bits)
    }
}

/// Why a connection's PROXY header was refused.
#[derive(Debug, thiserror::Error)]
pub enum HeaderError {
    /// A trusted balancer's connection did not start with a header.
    #[error("no PROXY protocol header from a trusted load balancer")]
    Missing,
    /// The header did not parse (or is a v1 header past 107 bytes).
    #[error("malformed PROXY protocol header")]
    Malformed,
    /// A v2 header announced more than [`MAX_HEADER_BYTES`].
    #[error("PROXY protocol header of {0} bytes, over the {MAX_HEADER_BYTES}-byte bound")]
    TooLarge(usize),
    /// A header for a datagram (UDP) connection.
    #[error("PROXY protocol header for a datagram connection")]
    Datagram,
    /// The connection ended or failed before the header did.
    #[error("reading the PROXY protocol header: {0}")]
    Io(#[from] io::Error),
}

/// What a header said.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Proxied {
    /// The real client: the header's source address, or the balancer's own
    /// address for a `LOCAL`/`UNKNOWN` header.
    pub client: SocketAddr,
    /// 1 or 2.
    pub version: u8,
}

/// Reads one PROXY header (v1 or v2) from the start of `io`, and nothing
/// after it. `lb` is the connection's peer (the balancer), the address kept
/// for a `LOCAL` or `UNKNOWN` header. The caller bounds the time.
pub async fn read_header<R: AsyncRead + Unpin>(
    io: &mut R,
    lb: SocketAddr,
) -> Result<Proxied, HeaderError> {
    let mut buf = [0u8; MAX_HEADER_BYTES];
    let mut filled = MIN_HEADER_BYTES;
    io.read_exact(&mut buf[..filled]).await?;
    let version = if buf.starts_with(V2_SIGNATURE) {
        io.read_exact(&mut buf[filled..V2_FIXED_BYTES]).await?;
        let body = usize::from(u16::from_be_bytes([buf[14], buf[15]]));
        let total = V2_FIXED_BYTES + body;
        if total > MAX_HEADER_BYTES {
            return Err(HeaderError::TooLarge(total));
        }
        io.read_exact(&mut buf[V2_FIXED_BYTES..total]).await?;
        filled = total;
        2
    } else if buf.starts_with(V1_SIGNATURE) {
        // Up to the first CRLF, never past it: while the last byte is not
        // CR, at least CRLF (2 bytes) is still to come; after a CR, 1.
        while !buf[..filled].ends_with(b"\r\n") {
            if buf[..filled].contains(&b'\n') {
                return Err(HeaderError::Malformed);
            }
            let need = if buf[filled - 1] == b'\r' { 1 } else { 2 };
            if filled + need > MAX_V1_BYTES {
                return Err(HeaderError::Malformed);
            }
            io.read_exact(&mut buf[filled..filled + need]).await?;
            filled += need;
        }
        1
    } else {
        return Err(HeaderError::Missing);
    };
    let config = ParseConfig {
        include_tlvs: false,
        allow_v1: version == 1,
        allow_v2: version == 2,
    };
    let (header, used) =
        ProxyHeader::parse(&buf[..filled], config).map_err(|_| HeaderError::Malformed)?;
    if used != filled {
        return Err(HeaderError::Malformed);
    }
    let client = match header.proxied_address() {
        None => lb,
        Some(a) if a.protocol == Protocol::Stream => a.source,
        Some(_) => return Err(HeaderError::Datagram),
    };
    Ok(Proxied { client, version })
}

/// Whether `first` (the first bytes a connection sent, at least one) is the
/// start of a PROXY header: they match the v1 or v2 signature as far as they
/// go. Neither a TLS record (0x16) nor an HTTP `GET` starts this way.
pub fn looks_like_header(first: &[u8]) -> bool {
    let matches = |sig: &[u8]| {
        let n = first.len().min(sig.len());
        n > 0 && first[..n] == sig[..n]
    };
    matches(V1_SIGNATURE) || matches(V2_SIGNATURE)
}

/// Whether a connection starts with a PROXY header signature: peeks at its
/// first bytes without taking them (waiting for at least one; the caller
/// bounds the time). `false` for a connection closed before sending any.
pub async fn starts_with_header(tcp: &TcpStream) -> io::Result<bool> {
    let mut first = [0u8; V2_SIGNATURE.len()];
    let n = tcp.peek(&mut first).await?;
    Ok(n > 0 && looks_like_header(&first[..n]))
}

/// What [`admit`] applies, from `relay`'s settings.
#[derive(Debug, Clone, Copy)]
pub struct AdmitRules {
    /// `relay.proxy_protocol.enabled`.
    pub proxy_protocol: bool,
    /// `relay.source_prefix_v4`: the IPv4 prefix that makes one source.
    pub source_prefix_v4: u8,
    /// `relay.source_prefix_v6`: the IPv6 prefix that makes one source.
    pub source_prefix_v6: u8,
}

/// How a connection was admitted at accept.
#[derive(Debug)]
pub enum Admission {
    /// Its handshake slot is charged to its peer address's source already.
    Direct(HandshakePermit),
    /// From a trusted balancer: one of the total slots is reserved, and the
    /// source it is charged to comes in the header.
    Proxied(SlotReservation),
}

/// Finishes a connection's admission before TLS: for a proxied connection,
/// reads its header, then applies the per-source connection rate and the
/// per-source handshake share to the real client; for a direct one with
/// the PROXY protocol on, refuses it if it starts with a header. Everything
/// runs before `deadline`. `None` when the connection is refused (counted in
/// the metrics, logged at debug).
pub async fn admit(
    admission: Admission,
    tcp: &mut TcpStream,
    peer: SocketAddr,
    rules: AdmitRules,
    limiter: &DefaultKeyedRateLimiter<IpAddr>,
    metrics: &Metrics,
    deadline: Instant,
) -> Option<HandshakePermit> {
    let handshake_failed = |result: &str| metrics.handshakes.with_label_values(&[result]).inc();
    match admission {
        Admission::Direct(permit) => {
            if !rules.proxy_protocol {
                return Some(permit);
            }
            let first = tokio::select! {
                biased;
                () = permit.shed() => {
                    handshake_failed("shed");
                    return None;
                }
                r = tokio::time::timeout_at(deadline, starts_with_header(tcp)) => r,
            };
            match first {
                Ok(Ok(false)) => Some(permit),
                Ok(Ok(true)) => {
                    debug!(%peer, "PROXY protocol header from an untrusted address refused");
                    handshake_failed("proxy_untrusted");
                    None
                }
                Ok(Err(e)) => {
                    debug!(error = %e, "connection failed before its first byte");
                    None
                }
                Err(_) => {
                    handshake_failed("timeout");
                    None
                }
            }
        }
        Admission::Proxied(reservation) => {
            let proxied = match tokio::time::timeout_at(deadline, read_header(tcp, peer)).await {
                Ok(Ok(p)) => p,
                Ok(Err(e)) => {
                    debug!(lb = %peer, error = %e, "PROXY protocol header refused");
                    handshake_failed("proxy_header");
                    return None;
                }
                Err(_) => {
                    handshake_failed("timeout");
                    return None;
                }
            };
            let client = proxied.client;
            tracing::Span::current().record("client", tracing::field::display(client));
            let source = Source::of(client.ip(), rules.source_prefix_v4, rules.source_prefix_v6);
            let admitted = if limiter.check_key(&source.addr()).is_err() {
                Err("rate_limited")
            } else {
                reservation.assign(source).map_err(|why| why.metric_label())
            };
            match admitted {
                Ok(permit) => {
                    debug!(%client, lb = %peer, version = proxied.version, "proxied connection");
                    Some(permit)
                }
                Err(reason) => {
                    debug!(%client, lb = %peer, reason, "proxied connection refused");
                    metrics.refused.with_label_values(&[reason]).inc();
                    None
                }
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt as _;

    fn lb() -> SocketAddr {
        "10.0.0.9:40000".parse().unwrap()
    }

    /// A v2 header for a TCP connection from `src` to `dst`, with `tlv`
    /// bytes appended, written by hand.
    fn v2(src: SocketAddr, dst: SocketAddr, tlv: &[u8]) -> Vec<u8> {
        let mut h = V2_SIGNATURE.to_vec();
        h.push(0x21); // version 2, PROXY
        let mut addrs = Vec::new();
        match (src, dst) {
            (SocketAddr::V4(s), SocketAddr::V4(d)) => {
                h.push(0x11);
                addrs.extend(s.ip().octets());
                addrs.extend(d.ip().octets());
            }
            (SocketAddr::V6(s), SocketAddr::V6(d)) => {
                h.push(0x21);
                addrs.extend(s.ip().octets());
                addrs.extend(d.ip().octets());
            }
            _ => unreachable!(),
        }
        addrs.extend(src.port().to_be_bytes());
        addrs.extend(dst.port().to_be_bytes());
        addrs.extend(tlv);
        h.extend(u16::try_from(addrs.len()).unwrap().to_be_bytes());
        h.extend(addrs);
        h
    }

    /// Writes `bytes` then `after` into a 1-byte pipe (every read the
    /// reader makes gets one byte: the header arrives split everywhere) and
    /// returns the header read and what was left for the next reader.
    async fn read_through_tiny_pipe(
        bytes: &[u8],
        after: &[u8],
    ) -> (Result<Proxied, HeaderError>, Vec<u8>) {
        let (mut client, mut server) = tokio::io::duplex(1);
        let mut all = bytes.to_vec();
        all.extend(after);
        let writer = tokio::spawn(async move {
            let _ = client.write_all(&all).await;
        });
        let got = read_header(&mut server, lb()).await;
        let mut rest = Vec::new();
        if got.is_ok() {
            // The writer ends (closing its side) once the rest is read.
            server.read_to_end(&mut rest).await.unwrap();
            writer.await.unwrap();
        }
        (got, rest)
    }

    #[tokio::test]
    async fn v1_and_v2_headers_give_the_client_and_leave_what_follows() {
        let hello = b"\x16\x03\x01 client hello";
        let src4: SocketAddr = "192.0.2.7:51000".parse().unwrap();
        let dst4: SocketAddr = "198.51.100.1:443".parse().unwrap();
        let src6: SocketAddr = "[2001:db8::7]:51000".parse().unwrap();
        let dst6: SocketAddr = "[2001:db8::1]:443".parse().unwrap();
        let cases: Vec<(Vec<u8>, SocketAddr, u8)> = vec![
            (
                b"PROXY TCP4 192.0.2.7 198.51.100.1 51000 443\r\n".to_vec(),
                src4,
                1,
            ),
            (
                b"PROXY TCP6 2001:db8::7 2001:db8::1 51000 443\r\n".to_vec(),
                src6,
                1,
            ),
            (b"PROXY UNKNOWN\r\n".to_vec(), lb(), 1),
            (
                b"PROXY UNKNOWN ffff:f::1 ffff:f::2 65535 65535\r\n".to_vec(),
                lb(),
                1,
            ),
            (v2(src4, dst4, &[]), src4, 2),
            (v2(src6, dst6, &[]), src6, 2),
            // A TLV (type 0x04 NOOP, 3 bytes) is skipped.
            (v2(src4, dst4, &[0x04, 0x00, 0x03, 1, 2, 3]), src4, 2),
            // LOCAL (a health check): the balancer's own address.
            (
                [V2_SIGNATURE.as_slice(), &[0x20, 0x00, 0x00, 0x00]].concat(),
                lb(),
                2,
            ),
        ];
        for (header, client, version) in cases {
            let (got, rest) = read_through_tiny_pipe(&header, hello).await;
            let got = got.unwrap_or_else(|e| panic!("{header:?}: {e}"));
            assert_eq!(got, Proxied { client, version }, "{header:?}");
            assert_eq!(rest, hello, "{header:?}: bytes after the header kept");
        }
    }

    #[tokio::test]
    async fn bad_headers_are_refused_with_their_reason() {
        let src: SocketAddr = "192.0.2.7:1".parse().unwrap();
        let dst: SocketAddr = "192.0.2.8:2".parse().unwrap();
        let mut long_v1 = b"PROXY TCP4 192.0.2.7 192.0.2.8 1 2".to_vec();
        long_v1.resize(200, b' ');
        long_v1.extend(b"\r\n");
        let mut big_v2 = v2(src, dst, &[]);
        big_v2[14..16].copy_from_slice(&2000u16.to_be_bytes());
        let mut bad_command = v2(src, dst, &[]);
        bad_command[12] = 0x22;
        let mut udp = v2(src, dst, &[]);
        udp[13] = 0x12;
        type Expect = fn(&HeaderError) -> bool;
        let cases: Vec<(&str, Vec<u8>, Expect)> = vec![
            (
                "TLS first",
                b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03abcdefgh".to_vec(),
                |e| matches!(e, HeaderError::Missing),
            ),
            (
                "HTTP first",
                b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec(),
                |e| matches!(e, HeaderError::Missing),
            ),
            (
                "v1 bad address",
                b"PROXY TCP4 192.0.2.999 192.0.2.8 1 2\r\n".to_vec(),
                |e| matches!(e, HeaderError::Malformed),
            ),
            (
                "v1 family mismatch",
                b"PROXY TCP4 2001:db8::1 192.0.2.8 1 2\r\n".to_vec(),
                |e| matches!(e, HeaderError::Malformed),
            ),
            (
                "v1 bad protocol",
                b"PROXY UDP4 192.0.2.7 192.0.2.8 1 2\r\n".to_vec(),
                |e| matches!(e, HeaderError::Malformed),
            ),
            (
                "v1 LF only",
                b"PROXY TCP4 192.0.2.7 192.0.2.8 1 2\n\n\n\n".to_vec(),
                |e| matches!(e, HeaderError::Malformed),
            ),
            ("v1 over 107 bytes", long_v1, |e| {
                matches!(e, HeaderError::Malformed)
            }),
            ("v2 over the bound", big_v2, |e| {
                matches!(e, HeaderError::TooLarge(2016))
            }),
            ("v2 bad command", bad_command, |e| {
                matches!(e, HeaderError::Malformed)
            }),
            ("v2 datagram", udp, |e| matches!(e, HeaderError::Datagram)),
            ("v1 cut short", b"PROXY TCP4 192.0.2.7 19".to_vec(), |e| {
                matches!(e, HeaderError::Io(_))
            }),
            ("v2 cut short", v2(src, dst, &[])[..20].to_vec(), |e| {
                matches!(e, HeaderError::Io(_))
            }),
        ];
        for (name, bytes, expected) in cases {
            let (mut client, mut server) = tokio::io::duplex(4096);
            client.write_all(&bytes).await.unwrap();
            drop(client);
            let got = read_header(&mut server, lb()).await;
            match got {
                Err(e) => assert!(expected(&e), "{name}: got {e:?}"),
                Ok(p) => panic!("{name}: accepted as {p:?}"),
            }
        }
    }

    #[tokio::test]
    async fn an_oversized_v2_header_is_refused_before_its_body_arrives() {
        // Only the fixed 16 bytes are sent, announcing 60 000 more: the
        // reader refuses at once instead of waiting for (and buffering) them.
        let (mut client, mut server) = tokio::io::duplex(64);
        let mut fixed = V2_SIGNATURE.to_vec();
        fixed.extend([0x21, 0x11]);
        fixed.extend(60_000u16.to_be_bytes());
        client.write_all(&fixed).await.unwrap();
        let got = read_header(&mut server, lb()).await;
        assert!(matches!(got, Err(HeaderError::TooLarge(60_016))), "{got:?}");
        drop(client);
    }

    #[test]
    fn header_signatures_are_told_from_tls_and_http() {
        assert!(looks_like_header(b"P"));
        assert!(looks_like_header(b"PROXY TCP4 "));
        assert!(looks_like_header(b"\r\n\r\n\0\r\nQU"));
        assert!(looks_like_header(V2_SIGNATURE));
        assert!(!looks_like_header(b"\x16\x03\x01"));
        assert!(!looks_like_header(b"GET / HTTP/1.1"));
        assert!(!looks_like_header(b"PRI * HTTP/2.0"));
        assert!(!looks_like_header(b""));
    }

    #[test]
    fn cidr_blocks_parse_and_match() {
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        let c = |s: &str| s.parse::<Cidr>().unwrap();
        assert!(c("10.0.0.0/8").contains(ip("10.200.3.4")));
        assert!(!c("10.0.0.0/8").contains(ip("11.0.0.1")));
        assert!(c("10.0.0.0/8").contains(ip("::ffff:10.1.2.3")));
        assert!(c("192.0.2.7").contains(ip("192.0.2.7")));
        assert!(!c("192.0.2.7").contains(ip("192.0.2.8")));
        assert!(c("0.0.0.0/0").contains(ip("203.0.113.9")));
        assert!(!c("0.0.0.0/0").contains(ip("2001:db8::1")));
        assert!(c("fd00::/8").contains(ip("fd12:3456::1")));
        assert!(!c("fd00::/8").contains(ip("fe80::1")));
        assert!(c("::/0").contains(ip("2001:db8::1")));
        assert_eq!(c("10.0.0.0/8").to_string(), "10.0.0.0/8");
        assert_eq!(c("::1").to_string(), "::1/128");
        for bad in [
            "10.0.0.1/8",
            "10.0.0.0/33",
            "fd00::/129",
            "nonsense",
            "10.0.0.0/",
            "",
        ] {
            assert!(bad.parse::<Cidr>().is_err(), "{bad}");
        }
    }

    #[test]
    fn only_trusted_addresses_are_expected_to_send_a_header() {
        let mut p = ProxyProtocol {
            enabled: false,
            trusted: vec!["10.0.0.0/8".parse().unwrap()],
        };
        let lb: IpAddr = "10.1.1.1".parse().unwrap();
        let other: IpAddr = "192.0.2.1".parse().unwrap();
        assert!(!p.expects_header(lb), "off by default");
        p.enabled = true;
        assert!(p.expects_header(lb));
        assert!(!p.expects_header(other));
        assert!(p.problems().is_empty());
        p.trusted.clear();
        assert_eq!(p.problems()[0].0, "relay.proxy_protocol.trusted");
    }
}
