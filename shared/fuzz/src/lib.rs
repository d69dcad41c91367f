//! Fixtures shared by the fuzz targets and the seed writer: a fixed identity,
//! trust store, relay id and clock, and valid inputs to seed the corpora.

use std::collections::HashMap;

use bytes::Bytes;
use oab_wire::envelope::{Envelope, REQUEST_TYPE, RESULT_TYPE};
use oab_wire::handshake::{ChannelBinding, TranscriptFields, transcript};
use oab_wire::identity::{Identity, PeerKey};
use oab_wire::*;

/// The fixed "now" of every verification, ms since the Unix epoch.
pub const NOW: u64 = 1_767_225_600_000;

/// The TLS exporter value the relay observes when the control byte says TLS.
pub const EXPORTER: [u8; 32] = [0xe5; 32];

/// Control bits of the `handshake_envelope` input's first byte.
pub mod control {
    /// Replace the hello's nonce with the live challenge's.
    pub const SPLICE_NONCE: u8 = 1;
    /// Replace the hello's relay id with the relay's.
    pub const SPLICE_RELAY: u8 = 2;
    /// Set the hello's time to the relay's clock.
    pub const SPLICE_TIME: u8 = 4;
    /// The relay observes a TLS session (else it sits behind a load balancer).
    pub const OBSERVE_TLS: u8 = 8;
    /// The policy requires TLS binding.
    pub const REQUIRE_TLS: u8 = 16;
    /// Re-sign the (spliced) hello with the fixture identity, when it names it.
    pub const RESIGN: u8 = 32;
    /// Verify after the handshake deadline.
    pub const LATE: u8 = 64;
}

fn peer(s: &str) -> PeerId {
    PeerId::new(s).unwrap_or_else(|e| panic!("fixture peer id: {e}"))
}

fn key(s: &str) -> KeyId {
    KeyId::new(s).unwrap_or_else(|e| panic!("fixture key id: {e}"))
}

/// The relay's id.
pub fn relay() -> RelayId {
    RelayId::new("relay.fuzz").unwrap_or_else(|e| panic!("fixture relay id: {e}"))
}

/// The one identity whose signatures the trust store accepts.
pub fn identity() -> Identity {
    Identity::from_secret(peer("acme/fuzz"), key("k1"), [0x42; 32])
}

fn peer_key(id: &Identity, not_before_ms: Option<u64>, not_after_ms: Option<u64>) -> PeerKey {
    PeerKey {
        key_id: id.key_id.clone(),
        public_key: id.public_key(),
        not_before_ms,
        not_after_ms,
    }
}

/// An identity the trust store knows, with its `not_before` and `not_after`.
pub type KnownIdentity = (Identity, Option<u64>, Option<u64>);

/// Every identity the trust store knows, with its validity window: the
/// fixture identity's key, an expired and a future key of the same peer, and
/// another peer with a key id of the same name. Every public key is distinct,
/// so an accepted signature pins down its signer.
pub fn known_identities() -> Vec<KnownIdentity> {
    let id = identity();
    let expired = Identity::from_secret(id.peer.clone(), key("old"), [0x43; 32]);
    let future = Identity::from_secret(id.peer.clone(), key("new"), [0x44; 32]);
    let other = Identity::from_secret(peer("acme/other"), key("k1"), [0x45; 32]);
    vec![
        (id, None, None),
        (expired, None, Some(NOW - 1)),
        (future, Some(NOW + 1), None),
        (other, None, None),
    ]
}

/// The trust store made of [`known_identities`].
pub fn trust() -> HashMap<PeerId, Vec<PeerKey>> {
    let mut t: HashMap<PeerId, Vec<PeerKey>> = HashMap::new();
    for (id, not_before, not_after) in known_identities() {
        t.entry(id.peer.clone())
            .or_default()
            .push(peer_key(&id, not_before, not_after));
    }
    t
}

/// The channel binding a hello with `mode` signs, given what the relay observes.
pub fn signed_binding(mode: Binding, observed: &ChannelBinding) -> ChannelBinding {
    match (mode, observed) {
        (Binding::TlsExporter, ChannelBinding::TlsExporter(v)) => ChannelBinding::TlsExporter(*v),
        (Binding::TlsExporter, ChannelBinding::ChallengeOnly) => {
            ChannelBinding::TlsExporter(EXPORTER)
        }
        (Binding::ChallengeOnly, _) => ChannelBinding::ChallengeOnly,
    }
}

/// Re-signs a hello's own fields with the fixture identity.
pub fn resign(hello: &mut Hello, observed: &ChannelBinding) {
    let binding = signed_binding(hello.binding, observed);
    let message = transcript(&TranscriptFields {
        version: hello.version,
        nonce: &hello.nonce,
        relay_id: &hello.relay_id,
        peer: &hello.peer,
        key_id: &hello.key_id,
        instance: &hello.instance,
        time_ms: hello.time_ms,
        binding: &binding,
    });
    hello.signature = identity().sign(&message);
}

fn dkey() -> DelegationKey {
    DelegationKey::new(
        peer("acme/caller"),
        RequestId::new("req-1").unwrap_or_else(|e| panic!("fixture request id: {e}")),
    )
}

/// One valid frame of every type.
pub fn seed_frames() -> Vec<Frame> {
    let id = identity();
    let mut hello = Hello {
        version: PROTOCOL_VERSION,
        peer: id.peer.clone(),
        key_id: id.key_id.clone(),
        instance: InstanceId([1; 16]),
        time_ms: NOW,
        relay_id: relay(),
        nonce: [7; 32],
        binding: Binding::TlsExporter,
        signature: [0; 64],
    };
    resign(&mut hello, &ChannelBinding::TlsExporter(EXPORTER));
    let payload = Bytes::from_static(br#"{"kind":"status-update","state":"working"}"#);
    vec![
        Frame::Challenge(Challenge {
            nonce: [7; 32],
            relay_id: relay(),
            server_time_ms: NOW,
            min_version: 1,
            max_version: 1,
        }),
        Frame::Hello(hello),
        Frame::Welcome(Welcome {
            session: SessionId([2; 16]),
            epoch: 42,
            heartbeat_ms: 15_000,
            max_header: 1024,
            max_payload: 1 << 20,
            max_in_flight: 64,
            payload: Bytes::from_static(b"[]"),
        }),
        Frame::Open(Open {
            key: dkey(),
            target: peer("acme/callee"),
            deadline_ms: NOW + 60_000,
            depth: 1,
            digest: Digest::of(&payload),
            ceiling: "read,write".into(),
            trace: oab_wire::TraceId::from_bytes([7; 16]),
            payload: payload.clone(),
        }),
        Frame::Data(Data {
            key: dkey(),
            direction: Direction::Up,
            seq: 2,
            terminal: Some(Outcome::Completed),
            flags: FLAG_RELAY_ORIGIN,
            payload: payload.clone(),
        }),
        Frame::Cancel(Cancel {
            key: dkey(),
            seq: 3,
            flags: 0,
            payload: Bytes::from_static(b"user asked"),
        }),
        Frame::Ack(Ack {
            key: dkey(),
            direction: Direction::Down,
            seq: 3,
        }),
        Frame::Resume(Resume {
            key: dkey(),
            direction: Direction::Up,
            after: 0,
        }),
        Frame::Gap(Gap {
            key: dkey(),
            direction: Direction::Up,
            after: 1,
            first_available: 5,
            terminal: Some(Outcome::Expired),
            reason: GapReason::Trimmed,
        }),
        Frame::Error(ErrorFrame {
            code: ErrorCode::SequenceGap.as_u16(),
            key: Some(dkey()),
            direction: Direction::Down,
            seq: 9,
            message: "sequence 9 skips 4..=8".into(),
        }),
        Frame::Ping(Ping { token: 77 }),
        Frame::Pong(Ping { token: 77 }),
        Frame::Drain(Drain {
            reconnect_after_ms: 5_000,
        }),
        Frame::PeersQuery,
        Frame::Peers(Bytes::from_static(
            br#"[{"peer":"acme/callee","online":true}]"#,
        )),
        Frame::Publish(Bytes::from_static(br#"{"name":"fuzz agent"}"#)),
    ]
}

/// Valid envelopes signed by the known identities.
pub fn seed_envelopes() -> Vec<Vec<u8>> {
    let id = identity();
    let other = Identity::from_secret(peer("acme/other"), key("k1"), [0x45; 32]);
    let expired = Identity::from_secret(id.peer.clone(), key("old"), [0x43; 32]);
    vec![
        Envelope::sign(&id, REQUEST_TYPE, br#"{"task":"build"}"#.to_vec()).to_json(),
        Envelope::sign(&id, RESULT_TYPE, br#"{"status":"completed"}"#.to_vec()).to_json(),
        Envelope::sign(&id, REQUEST_TYPE, b"\xff not json".to_vec()).to_json(),
        Envelope::sign(&id, REQUEST_TYPE, Vec::new()).to_json(),
        Envelope::sign(&other, RESULT_TYPE, br#"{"status":"failed"}"#.to_vec()).to_json(),
        Envelope::sign(&expired, REQUEST_TYPE, br#"{"task":"old"}"#.to_vec()).to_json(),
    ]
}
