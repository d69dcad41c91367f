//! What a connection may take from the relay before it is authenticated:
//! a handshake slot (a share of them per source), a few KiB of reads, and
//! the kernel's TCP settings that detect a dead peer.
//!
//! - [`Source`]: the unit the relay counts an unauthenticated client by: its
//!   address cut to a prefix (`relay.source_prefix_v4`, `source_prefix_v6`),
//!   so a host holding a whole IPv6 /64 counts once.
//! - [`HandshakeSlots`]: `relay.max_handshakes` slots, of which one source
//!   holds at most `relay.max_handshakes_per_source`. A connection over its
//!   source's share is dropped at accept, before TLS; nothing waits in a
//!   queue. When every slot is held, a new connection sheds the oldest
//!   unauthenticated connection of the source holding the most slots and
//!   takes its slot, so idle holders cannot lock logins out.
//! - [`PreAuthLimit`]: wraps the connection's plaintext stream and fails its
//!   reads once more than [`PRE_AUTH_READ_BYTES`] arrived before the `Hello`
//!   was verified; lifted when the session is authenticated.
//! - [`tune_accepted`]: `TCP_NODELAY`, keepalive and `TCP_USER_TIMEOUT` on
//!   every accepted socket.
//!
//! Never: keeps anything for a source that holds no slot: its counter is
//! removed when its last [`HandshakePermit`] is dropped or shed, so the map
//! holds at most `max_handshakes` entries. Never sheds a connection whose
//! `Hello` verified.

use std::collections::{BTreeMap, HashMap};
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use parking_lot::Mutex;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_util::sync::{CancellationToken, WaitForCancellationFuture};

/// Bytes a connection may send the relay after TLS and before its `Hello`
/// is verified: the HTTP upgrade request (a connector's is under 512 B) and
/// the `Hello` frame (under 600 B: its ids are bounded by `oab_wire::ids`
/// and it has no payload), with room for proxies' extra headers and a few
/// pings. Overflow policy: the read fails and the connection is closed with
/// `4501 frame_too_large` (or dropped, during the upgrade), so an
/// unauthenticated client can make the relay buffer at most this much plus
/// one read chunk, instead of a whole `max_payload` message.
pub const PRE_AUTH_READ_BYTES: usize = 8 * 1024;

/// Keepalive probes sent before the kernel declares the peer dead (with
/// `TCP_USER_TIMEOUT` set, the kernel gives up at that timeout instead).
pub const TCP_KEEPALIVE_PROBES: u32 = 3;

/// A client's source for admission: its address with the host bits beyond
/// the configured prefix cleared (IPv4-mapped IPv6 addresses count as IPv4).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Source(IpAddr);

impl Source {
    /// The source of `ip` with prefixes of `v4_bits` (IPv4) and `v6_bits`
    /// (IPv6) bits; larger values are taken as the full length.
    pub fn of(ip: IpAddr, v4_bits: u8, v6_bits: u8) -> Source {
        match ip.to_canonical() {
            IpAddr::V4(a) => {
                let bits = u32::from(v4_bits.min(32));
                let mask = u32::MAX.checked_shl(32 - bits).unwrap_or(0);
                Source(IpAddr::V4(Ipv4Addr::from(u32::from(a) & mask)))
            }
            IpAddr::V6(a) => {
                let bits = u32::from(v6_bits.min(128));
                let mask = u128::MAX.checked_shl(128 - bits).unwrap_or(0);
                Source(IpAddr::V6(Ipv6Addr::from(u128::from(a) & mask)))
            }
        }
    }

    /// The (masked) address.
    pub fn addr(&self) -> IpAddr {
        self.0
    }
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

/// Why a connection got no handshake slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotRefusal {
    /// All `max_handshakes` slots are held, and none by a connection that
    /// can be shed (every holder has verified its `Hello` already, or
    /// is a balancer's connection whose PROXY header is still being read).
    Full,
    /// Its source holds `max_handshakes_per_source` slots already.
    SourceShare,
}

impl SlotRefusal {
    /// The `reason` label of `oab_connections_refused_total`.
    pub fn metric_label(self) -> &'static str {
        match self {
            SlotRefusal::Full => "max_handshakes",
            SlotRefusal::SourceShare => "max_handshakes_per_source",
        }
    }
}

/// The relay's handshake slots: a total cap and a cap per source, shared
/// fairly when the total is reached.
///
/// When every slot is held, a new connection is not refused: it takes the
/// slot of the oldest connection of the source that holds the most slots
/// (that connection is *shed*: closed at once), counting its own source as
/// holding one more. A client that holds slots with idle connections
/// therefore keeps at most an equal share of them however many sources it
/// uses, and a connection from a source holding fewer than the largest
/// share always gets in; among sources of equal share the oldest
/// connection goes first, so a login that finishes its handshake in a few
/// round trips is not shed before it does. Only connections that have not
/// proved a key can be shed: once a `Hello` verifies ([`HandshakePermit::shield`])
/// its slot is kept until the `Welcome` is written. This is the idea of
/// DERP's and NATS's admission: unauthenticated connections are cheap to
/// drop and the one that waited longest without authenticating goes first.
#[derive(Debug)]
pub struct HandshakeSlots {
    total: usize,
    per_source: usize,
    pool: Mutex<Pool>,
}

/// What [`HandshakeSlots`] tracks, under one lock.
#[derive(Debug, Default)]
struct Pool {
    /// Slots held: reservations and permits (at most `total`).
    held: usize,
    /// Admission order: the key of the next sheddable connection.
    next: u64,
    /// Slots per source. An entry exists only while its count is above
    /// zero: the last [`HandshakePermit`] of a source removes it (at most
    /// `max_handshakes` entries).
    sources: HashMap<Source, Holder>,
}

/// One source's slots.
#[derive(Debug, Default)]
struct Holder {
    /// Slots charged to the source, sheddable or shielded.
    held: usize,
    /// Its connections that can still be shed, oldest first, each with the
    /// token that tells it so. An entry is removed when its permit is
    /// dropped or shielded, or when it is shed.
    sheddable: BTreeMap<u64, CancellationToken>,
}

impl Pool {
    /// Sheds one connection to free its slot for a newcomer from `incoming`
    /// (unknown for a balancer's connection): the oldest sheddable one of
    /// the source with the most slots, `incoming` counted with one more.
    /// Its slot is handed over (`held` is unchanged). False when no
    /// connection can be shed.
    fn shed_one(&mut self, incoming: Option<Source>) -> bool {
        let victim = self
            .sources
            .iter()
            .filter_map(|(source, h)| {
                let (&oldest, _) = h.sheddable.first_key_value()?;
                let share = h.held + usize::from(Some(*source) == incoming);
                Some(((share, std::cmp::Reverse(oldest)), *source))
            })
            .max_by_key(|(rank, _)| *rank)
            .map(|(_, source)| source);
        let Some(source) = victim else {
            return false;
        };
        let Some(holder) = self.sources.get_mut(&source) else {
            return false;
        };
        let Some((_, token)) = holder.sheddable.pop_first() else {
            return false;
        };
        token.cancel();
        holder.held = holder.held.saturating_sub(1);
        if holder.held == 0 {
            self.sources.remove(&source);
        }
        true
    }
}

impl HandshakeSlots {
    /// `total` slots, at most `per_source` of them for one source.
    pub fn new(total: usize, per_source: usize) -> Arc<HandshakeSlots> {
        Arc::new(HandshakeSlots {
            total,
            per_source,
            pool: Mutex::new(Pool::default()),
        })
    }

    /// Takes a slot for `source` now (shedding another connection's when
    /// all are held), or says why not. Never waits.
    pub fn try_admit(self: &Arc<Self>, source: Source) -> Result<HandshakePermit, SlotRefusal> {
        let mut pool = self.pool.lock();
        let share = pool.sources.get(&source).map_or(0, |h| h.held);
        if share >= self.per_source {
            return Err(SlotRefusal::SourceShare);
        }
        if pool.held >= self.total {
            if !pool.shed_one(Some(source)) {
                return Err(SlotRefusal::Full);
            }
        } else {
            pool.held += 1;
        }
        Ok(self.charge(&mut pool, source))
    }

    /// Takes one of the `max_handshakes` slots for a connection whose source
    /// is not known yet (it comes in a PROXY header), shedding another
    /// connection's when all are held; [`SlotReservation::assign`] then
    /// charges it to the source. A reservation cannot be shed. Never waits.
    pub fn try_reserve(self: &Arc<Self>) -> Result<SlotReservation, SlotRefusal> {
        let mut pool = self.pool.lock();
        if pool.held >= self.total {
            if !pool.shed_one(None) {
                return Err(SlotRefusal::Full);
            }
        } else {
            pool.held += 1;
        }
        Ok(SlotReservation {
            slots: Some(self.clone()),
        })
    }

    /// Charges a slot already counted in `pool.held` to `source`, sheddable.
    fn charge(self: &Arc<Self>, pool: &mut Pool, source: Source) -> HandshakePermit {
        let order = pool.next;
        pool.next += 1;
        let shed = CancellationToken::new();
        let holder = pool.sources.entry(source).or_default();
        holder.held += 1;
        holder.sheddable.insert(order, shed.clone());
        HandshakePermit {
            slots: self.clone(),
            source,
            order,
            shed,
        }
    }

    /// Slots `source` holds now.
    pub fn held_by(&self, source: Source) -> usize {
        self.pool.lock().sources.get(&source).map_or(0, |h| h.held)
    }

    /// Sources holding at least one slot.
    pub fn sources(&self) -> usize {
        self.pool.lock().sources.len()
    }

    /// Slots held now, by every source and reservation.
    pub fn held(&self) -> usize {
        self.pool.lock().held
    }
}

/// One of the total handshake slots, not yet charged to a source; dropping
/// it frees the slot.
#[derive(Debug)]
pub struct SlotReservation {
    /// `None` once assigned (the slot then belongs to the permit).
    slots: Option<Arc<HandshakeSlots>>,
}

impl SlotReservation {
    /// Charges the slot to `source`, or gives it back when `source` holds
    /// its `max_handshakes_per_source` share already.
    pub fn assign(mut self, source: Source) -> Result<HandshakePermit, SlotRefusal> {
        let Some(slots) = self.slots.take() else {
            return Err(SlotRefusal::Full);
        };
        let mut pool = slots.pool.lock();
        let share = pool.sources.get(&source).map_or(0, |h| h.held);
        if share >= slots.per_source {
            pool.held = pool.held.saturating_sub(1);
            return Err(SlotRefusal::SourceShare);
        }
        Ok(slots.charge(&mut pool, source))
    }
}

impl Drop for SlotReservation {
    fn drop(&mut self) {
        if let Some(slots) = self.slots.take() {
            let mut pool = slots.pool.lock();
            pool.held = pool.held.saturating_sub(1);
        }
    }
}

/// One handshake slot, held from accept until the session is authenticated
/// (its `Welcome` written) or the connection ends; dropping it frees the
/// slot. Until [`HandshakePermit::shield`], the slot may be taken for a
/// newer connection ([`HandshakeSlots`]): [`HandshakePermit::shed`] then
/// completes and the connection must close.
#[derive(Debug)]
pub struct HandshakePermit {
    slots: Arc<HandshakeSlots>,
    source: Source,
    /// Its key in its source's `sheddable` map.
    order: u64,
    /// Cancelled (under the pool's lock) when it is shed; its slot then
    /// belongs to another connection.
    shed: CancellationToken,
}

impl HandshakePermit {
    /// Completes when this connection was shed: it lost its slot to a newer
    /// connection and must close now. Never completes once shielded.
    pub fn shed(&self) -> WaitForCancellationFuture<'_> {
        self.shed.cancelled()
    }

    /// Whether this connection was shed.
    pub fn is_shed(&self) -> bool {
        self.shed.is_cancelled()
    }

    /// Makes the slot safe from shedding (the connection proved a key and
    /// is being welcomed). False when it was shed first: it must close.
    pub fn shield(&self) -> bool {
        let mut pool = self.slots.pool.lock();
        if self.shed.is_cancelled() {
            return false;
        }
        if let Some(holder) = pool.sources.get_mut(&self.source) {
            holder.sheddable.remove(&self.order);
        }
        true
    }
}

impl Drop for HandshakePermit {
    fn drop(&mut self) {
        let mut pool = self.slots.pool.lock();
        if self.shed.is_cancelled() {
            // Shed: its slot was handed to another connection already.
            return;
        }
        pool.held = pool.held.saturating_sub(1);
        if let Some(holder) = pool.sources.get_mut(&self.source) {
            holder.sheddable.remove(&self.order);
            holder.held = holder.held.saturating_sub(1);
            if holder.held == 0 {
                pool.sources.remove(&self.source);
            }
        }
    }
}

/// The connection's stream with a read budget while it is unauthenticated.
///
/// Reads count against [`PRE_AUTH_READ_BYTES`]; the read that goes over it
/// fails (`InvalidData`, its bytes discarded) and so does every later one,
/// until [`PreAuthLimit::lift`]. Writes pass through.
#[derive(Debug)]
pub struct PreAuthLimit<IO> {
    io: IO,
    /// Bytes still allowed; `None` once lifted.
    left: Option<usize>,
}

impl<IO> PreAuthLimit<IO> {
    /// `io` with a budget of `budget` bytes read.
    pub fn new(io: IO, budget: usize) -> PreAuthLimit<IO> {
        PreAuthLimit {
            io,
            left: Some(budget),
        }
    }

    /// Removes the budget (the peer is authenticated).
    pub fn lift(&mut self) {
        self.left = None;
    }

    /// Whether the budget was used up (reads fail).
    pub fn exhausted(&self) -> bool {
        self.left == Some(0)
    }

    /// The wrapped stream.
    pub fn get_ref(&self) -> &IO {
        &self.io
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for PreAuthLimit<IO> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        let Some(left) = this.left else {
            return Pin::new(&mut this.io).poll_read(cx, buf);
        };
        let over = || {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("more than {PRE_AUTH_READ_BYTES} bytes before authentication"),
            )
        };
        if left == 0 {
            return Poll::Ready(Err(over()));
        }
        let before = buf.filled().len();
        match Pin::new(&mut this.io).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                let n = buf.filled().len() - before;
                if n > left {
                    buf.set_filled(before);
                    this.left = Some(0);
                    return Poll::Ready(Err(over()));
                }
                this.left = Some(left - n);
                Poll::Ready(Ok(()))
            }
            other => other,
        }
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for PreAuthLimit<IO> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

/// Sets `TCP_NODELAY`, keepalive (`keepalive_ms`, from
/// `relay.tcp_keepalive_ms`, idle before the first probe, then a probe every
/// third of it, [`TCP_KEEPALIVE_PROBES`] probes) and `TCP_USER_TIMEOUT`
/// (`user_timeout_ms`, from `relay.tcp_user_timeout_ms`: how long written
/// data may stay unacknowledged) on an accepted socket. A value of 0 leaves
/// that option at the kernel's default.
pub fn tune_accepted(tcp: &TcpStream, keepalive_ms: u64, user_timeout_ms: u64) -> io::Result<()> {
    tcp.set_nodelay(true)?;
    let sock = socket2::SockRef::from(tcp);
    if keepalive_ms > 0 {
        let idle = Duration::from_millis(keepalive_ms);
        let keepalive = socket2::TcpKeepalive::new()
            .with_time(idle)
            .with_interval((idle / 3).max(Duration::from_secs(1)))
            .with_retries(TCP_KEEPALIVE_PROBES);
        sock.set_tcp_keepalive(&keepalive)?;
    }
    if user_timeout_ms > 0 {
        sock.set_tcp_user_timeout(Some(Duration::from_millis(user_timeout_ms)))?;
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt as _;

    #[test]
    fn sources_are_cut_to_their_prefix() {
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        let cases = [
            ("192.0.2.77", 32, 64, "192.0.2.77"),
            ("192.0.2.77", 24, 64, "192.0.2.0"),
            ("192.0.2.77", 0, 64, "0.0.0.0"),
            ("::ffff:192.0.2.77", 24, 64, "192.0.2.0"),
            ("2001:db8:1:2:3:4:5:6", 32, 64, "2001:db8:1:2::"),
            ("2001:db8:1:2:3:4:5:6", 32, 128, "2001:db8:1:2:3:4:5:6"),
            ("2001:db8:1:2:3:4:5:6", 32, 200, "2001:db8:1:2:3:4:5:6"),
        ];
        for (addr, v4, v6, want) in cases {
            assert_eq!(Source::of(ip(addr), v4, v6).addr(), ip(want), "{addr}");
        }
    }

    #[test]
    fn one_source_holds_at_most_its_share_and_frees_it() {
        let slots = HandshakeSlots::new(10, 3);
        let a = Source::of("10.0.0.1".parse().unwrap(), 32, 64);
        let b = Source::of("10.0.0.2".parse().unwrap(), 32, 64);
        let held: Vec<_> = (0..3).map(|_| slots.try_admit(a).unwrap()).collect();
        assert_eq!(slots.try_admit(a).err(), Some(SlotRefusal::SourceShare));
        assert_eq!(slots.held_by(a), 3);
        // Another source still gets in, and the refused one took nothing.
        let other = slots.try_admit(b).unwrap();
        assert_eq!(slots.held(), 4);
        drop(held);
        assert_eq!(slots.held_by(a), 0);
        assert_eq!(slots.sources(), 1, "a source with no slot is forgotten");
        drop(other);
        assert_eq!(slots.sources(), 0);
        assert_eq!(slots.held(), 0);
    }

    fn src(i: u8) -> Source {
        Source::of(IpAddr::from([10, 0, 0, i]), 32, 64)
    }

    #[test]
    fn when_full_the_oldest_connection_of_the_largest_holder_is_shed() {
        let slots = HandshakeSlots::new(4, 4);
        let a: Vec<_> = (0..3).map(|_| slots.try_admit(src(1)).unwrap()).collect();
        let b = slots.try_admit(src(2)).unwrap();
        assert_eq!(slots.held(), 4);
        // A third source takes the slot of source 1's oldest connection.
        let c = slots.try_admit(src(3)).unwrap();
        assert!(a[0].is_shed() && !a[1].is_shed() && !a[2].is_shed());
        assert!(!b.is_shed() && !c.is_shed());
        assert_eq!((slots.held(), slots.held_by(src(1))), (4, 2));
        // Sources 1 (2 slots) and 2 (1, +1 for the newcomer) tie: the older
        // connection goes, source 1's.
        let b2 = slots.try_admit(src(2)).unwrap();
        assert!(a[1].is_shed() && !b.is_shed());
        // Now every source holds 1 or 2: source 2 (2, +1) sheds its own.
        let _b3 = slots.try_admit(src(2)).unwrap();
        assert!(b.is_shed() && !b2.is_shed() && !a[2].is_shed() && !c.is_shed());
        assert_eq!(slots.held(), 4);
        // A shed permit gives nothing back when dropped (its slot moved
        // on); the live one does.
        drop(a);
        assert_eq!((slots.held(), slots.held_by(src(1))), (3, 0));
        assert_eq!(slots.held_by(src(2)), 2);
    }

    #[test]
    fn a_shielded_connection_is_never_shed() {
        let slots = HandshakeSlots::new(2, 2);
        let a = slots.try_admit(src(1)).unwrap();
        let b = slots.try_admit(src(1)).unwrap();
        assert!(a.shield() && b.shield());
        assert_eq!(slots.try_admit(src(2)).err(), Some(SlotRefusal::Full));
        assert!(!a.is_shed() && !b.is_shed());
        drop(a);
        let c = slots.try_admit(src(2)).unwrap();
        // A shed connection cannot shield itself afterwards.
        let _d = slots.try_admit(src(3)).unwrap();
        assert!(c.is_shed() && !c.shield());
        drop((b, c));
        assert_eq!(slots.held(), 1);
    }

    #[test]
    fn reservations_shed_and_are_never_shed() {
        let slots = HandshakeSlots::new(2, 1);
        let a = slots.try_admit(src(1)).unwrap();
        let r = slots.try_reserve().unwrap();
        let r2 = slots.try_reserve().unwrap();
        assert!(a.is_shed(), "a reservation takes a sheddable slot");
        assert_eq!(slots.try_reserve().err(), Some(SlotRefusal::Full));
        // Assigned to a source over its share, the slot is given back.
        let p = r.assign(src(2)).unwrap();
        assert_eq!(r2.assign(src(2)).err(), Some(SlotRefusal::SourceShare));
        assert_eq!(slots.held(), 1);
        drop((a, p));
        assert_eq!((slots.held(), slots.sources()), (0, 0));
    }

    #[test]
    fn many_idle_sources_cannot_keep_a_new_source_out() {
        // 100 sources fill 512 slots with idle connections and keep
        // reconnecting; a login from a new source always gets a slot and
        // keeps it while the idle sources churn.
        let slots = HandshakeSlots::new(512, 32);
        let mut idle: Vec<HandshakePermit> = Vec::new();
        for round in 0..8 {
            for i in 0..100u8 {
                if let Ok(p) = slots.try_admit(src(i)) {
                    idle.push(p);
                }
            }
            idle.retain(|p| !p.is_shed());
            assert!(round < 5 || slots.held() == 512);
        }
        let login = slots.try_admit(Source::of(IpAddr::from([192, 0, 2, 1]), 32, 64));
        let login = login.expect("a new source gets a slot");
        for i in 0..100u8 {
            idle.push(slots.try_admit(src(i)).unwrap());
        }
        assert!(!login.is_shed());
        assert!((0..100).all(|i| slots.held_by(src(i)) <= 6));
    }

    #[tokio::test]
    async fn reads_fail_past_the_budget_until_lifted() {
        let (mut client, server) = tokio::io::duplex(64);
        let mut limited = PreAuthLimit::new(server, 10);
        tokio::io::AsyncWriteExt::write_all(&mut client, b"0123456789abcdef")
            .await
            .unwrap();
        let mut buf = [0u8; 4];
        limited.read_exact(&mut buf).await.unwrap();
        let mut rest = [0u8; 16];
        let err = limited.read(&mut rest).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
        assert!(limited.exhausted());
        assert!(limited.read(&mut rest).await.is_err(), "stays failed");
        limited.lift();
        tokio::io::AsyncWriteExt::write_all(&mut client, &[7u8; 40])
            .await
            .unwrap();
        let mut big = [0u8; 40];
        limited.read_exact(&mut big).await.unwrap();
    }

    #[tokio::test]
    async fn accepted_sockets_get_keepalive_and_a_user_timeout() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let _client = TcpStream::connect(addr).await.unwrap();
        let (tcp, _) = listener.accept().await.unwrap();
        tune_accepted(&tcp, 30_000, 45_000).unwrap();
        let sock = socket2::SockRef::from(&tcp);
        assert!(sock.keepalive().unwrap());
        assert_eq!(sock.tcp_keepalive_time().unwrap(), Duration::from_secs(30));
        assert_eq!(
            sock.tcp_keepalive_interval().unwrap(),
            Duration::from_secs(10)
        );
        assert_eq!(sock.tcp_keepalive_retries().unwrap(), TCP_KEEPALIVE_PROBES);
        assert_eq!(
            sock.tcp_user_timeout().unwrap(),
            Some(Duration::from_secs(45))
        );
        assert!(tcp.nodelay().unwrap());
    }
}
