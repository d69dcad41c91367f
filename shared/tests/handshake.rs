//! The session handshake state machine, in memory: one accepted path per
//! binding mode, and every refusal with its own error variant, close code and
//! public reason.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::collections::HashMap;
use std::mem::discriminant;

use oab_wire::handshake::{
    Authenticated, ChannelBinding, HandshakeError, HandshakePolicy, MAX_VERSION, MIN_VERSION,
    NonceLedger, ServerHandshake, answer_challenge,
};
use oab_wire::identity::{Identity, PeerKey};
use oab_wire::*;

const NOW: u64 = 1_767_225_600_000; // 2026-01-01T00:00:00Z
const EXPORTER_A: ChannelBinding = ChannelBinding::TlsExporter([0xa5; 32]);
const EXPORTER_B: ChannelBinding = ChannelBinding::TlsExporter([0x5b; 32]);

fn peer() -> PeerId {
    PeerId::new("acme/build-bot").unwrap()
}

fn key_id() -> KeyId {
    KeyId::new("2026-01").unwrap()
}

fn relay() -> RelayId {
    RelayId::new("relay.example.com").unwrap()
}

fn instance() -> InstanceId {
    InstanceId([7; 16])
}

fn identity() -> Identity {
    Identity::from_secret(peer(), key_id(), [1; 32])
}

/// Same peer and key id as [`identity`], another private key.
fn impostor() -> Identity {
    Identity::from_secret(peer(), key_id(), [2; 32])
}

fn peer_key(id: &Identity, not_before_ms: Option<u64>, not_after_ms: Option<u64>) -> PeerKey {
    PeerKey {
        key_id: id.key_id.clone(),
        public_key: id.public_key(),
        not_before_ms,
        not_after_ms,
    }
}

/// A relay's side of the world: its trust store, nonce ledger and policy.
struct Relay {
    trust: HashMap<PeerId, Vec<PeerKey>>,
    ledger: NonceLedger,
    policy: HandshakePolicy,
}

impl Relay {
    fn new() -> Self {
        let mut trust = HashMap::new();
        trust.insert(peer(), vec![peer_key(&identity(), Some(NOW - 1), None)]);
        Relay {
            trust,
            ledger: NonceLedger::new(64, 30_000),
            policy: HandshakePolicy::default(),
        }
    }

    fn with_key(key: PeerKey) -> Self {
        let mut r = Relay::new();
        r.trust.insert(peer(), vec![key]);
        r
    }

    fn start(&mut self) -> (ServerHandshake, Challenge) {
        ServerHandshake::start(relay(), NOW, &mut self.ledger).unwrap()
    }

    fn verify(
        &mut self,
        hs: &ServerHandshake,
        hello: &Hello,
        observed: &ChannelBinding,
    ) -> Result<Authenticated, HandshakeError> {
        self.verify_at(hs, hello, observed, NOW)
    }

    fn verify_at(
        &mut self,
        hs: &ServerHandshake,
        hello: &Hello,
        observed: &ChannelBinding,
        now_ms: u64,
    ) -> Result<Authenticated, HandshakeError> {
        hs.verify(
            hello,
            &self.trust,
            &mut self.ledger,
            &self.policy,
            now_ms,
            observed,
        )
    }
}

fn answer(id: &Identity, challenge: &Challenge, binding: &ChannelBinding) -> Hello {
    answer_at(id, challenge, binding, NOW)
}

fn answer_at(id: &Identity, challenge: &Challenge, binding: &ChannelBinding, now: u64) -> Hello {
    answer_challenge(id, challenge, Some(&relay()), instance(), now, binding).unwrap()
}

/// Runs a fresh handshake where the connector signs with `signer` and
/// `signed`, the hello is changed by `tamper`, and the relay observes
/// `observed`.
fn run(
    relay_side: &mut Relay,
    signer: &Identity,
    signed: &ChannelBinding,
    observed: &ChannelBinding,
    tamper: impl FnOnce(&mut Hello),
) -> Result<Authenticated, HandshakeError> {
    let (hs, challenge) = relay_side.start();
    let mut hello = answer(signer, &challenge, signed);
    tamper(&mut hello);
    relay_side.verify(&hs, &hello, observed)
}

fn expected_auth() -> Authenticated {
    Authenticated {
        peer: peer(),
        key_id: key_id(),
        instance: instance(),
        version: MAX_VERSION,
    }
}

// ---------------------------------------------------------------------------
// Accepted
// ---------------------------------------------------------------------------

#[test]
fn tls_bound_hello_is_accepted_and_uses_up_its_nonce() {
    let mut r = Relay::new();
    assert!(
        r.policy.require_tls_binding,
        "default policy requires binding"
    );
    let (hs, challenge) = r.start();
    assert_eq!(challenge.relay_id, relay());
    assert_eq!(
        (challenge.min_version, challenge.max_version),
        (MIN_VERSION, MAX_VERSION)
    );
    assert_eq!(hs.nonce(), &challenge.nonce);
    assert_eq!(r.ledger.len(), 1);
    let hello = answer(&identity(), &challenge, &EXPORTER_A);
    assert_eq!(hello.binding, Binding::TlsExporter);
    assert_eq!(r.verify(&hs, &hello, &EXPORTER_A), Ok(expected_auth()));
    assert!(r.ledger.is_empty(), "the nonce is used up");
}

#[test]
fn hello_survives_the_wire_codec() {
    let mut r = Relay::new();
    let (hs, challenge) = r.start();
    let challenge_bytes = encode(&Frame::Challenge(challenge)).unwrap();
    let Frame::Challenge(challenge) = decode_message(challenge_bytes, &Limits::default()).unwrap()
    else {
        panic!("not a challenge");
    };
    let hello = answer(&identity(), &challenge, &EXPORTER_A);
    let bytes = encode(&Frame::Hello(hello.clone())).unwrap();
    let Frame::Hello(decoded) = decode_message(bytes, &Limits::default()).unwrap() else {
        panic!("not a hello");
    };
    assert_eq!(decoded, hello);
    assert_eq!(r.verify(&hs, &decoded, &EXPORTER_A), Ok(expected_auth()));
}

#[test]
fn challenge_only_hello_is_accepted_when_policy_allows() {
    let mut r = Relay::new();
    r.policy.require_tls_binding = false;
    // Behind a TLS-terminating load balancer: the relay sees no TLS session.
    let got = run(
        &mut r,
        &identity(),
        &ChannelBinding::ChallengeOnly,
        &ChannelBinding::ChallengeOnly,
        |h| assert_eq!(h.binding, Binding::ChallengeOnly),
    );
    assert_eq!(got, Ok(expected_auth()));
    // Terminating TLS itself but not requiring binding: challenge-only still passes.
    let got = run(
        &mut r,
        &identity(),
        &ChannelBinding::ChallengeOnly,
        &EXPORTER_A,
        |_| {},
    );
    assert_eq!(got, Ok(expected_auth()));
    // And a TLS-bound hello is of course accepted too.
    let got = run(&mut r, &identity(), &EXPORTER_A, &EXPORTER_A, |_| {});
    assert_eq!(got, Ok(expected_auth()));
}

#[test]
fn clock_skew_exactly_at_the_limit_and_deadline_exactly_at_the_limit_pass() {
    let mut r = Relay::new();
    let max = r.policy.max_skew_ms;
    for time in [NOW - max, NOW + max] {
        let (hs, challenge) = r.start();
        let hello = answer_at(&identity(), &challenge, &EXPORTER_A, time);
        assert_eq!(r.verify(&hs, &hello, &EXPORTER_A), Ok(expected_auth()));
    }
    let (hs, challenge) = r.start();
    let at = NOW + r.policy.deadline_ms;
    let hello = answer_at(&identity(), &challenge, &EXPORTER_A, at);
    assert_eq!(
        r.verify_at(&hs, &hello, &EXPORTER_A, at),
        Ok(expected_auth())
    );
}

#[test]
fn key_window_bounds_are_inclusive() {
    for key in [
        peer_key(&identity(), Some(NOW), None),
        peer_key(&identity(), None, Some(NOW)),
        peer_key(&identity(), Some(NOW), Some(NOW)),
    ] {
        let mut r = Relay::with_key(key);
        assert_eq!(
            run(&mut r, &identity(), &EXPORTER_A, &EXPORTER_A, |_| {}),
            Ok(expected_auth())
        );
    }
}

#[test]
fn a_rotated_second_key_is_accepted() {
    let new = Identity::from_secret(peer(), KeyId::new("2026-02").unwrap(), [3; 32]);
    let mut r = Relay::new();
    r.trust
        .get_mut(&peer())
        .unwrap()
        .push(peer_key(&new, Some(NOW - 1), None));
    let got = run(&mut r, &new, &EXPORTER_A, &EXPORTER_A, |_| {}).unwrap();
    assert_eq!(got.key_id, new.key_id);
}

// ---------------------------------------------------------------------------
// Refused, one variant each
// ---------------------------------------------------------------------------

#[test]
fn unknown_peer_is_refused() {
    let stranger = Identity::from_secret(PeerId::new("acme/stranger").unwrap(), key_id(), [1; 32]);
    let err = run(
        &mut Relay::new(),
        &stranger,
        &EXPORTER_A,
        &EXPORTER_A,
        |_| {},
    )
    .unwrap_err();
    assert_eq!(err, HandshakeError::UnknownPeer("acme/stranger".into()));
    assert_eq!(err.close_code(), CloseCode::AuthFailed);
}

#[test]
fn unknown_key_id_is_refused() {
    let wrong_key = Identity::from_secret(peer(), KeyId::new("2025-12").unwrap(), [1; 32]);
    let err = run(
        &mut Relay::new(),
        &wrong_key,
        &EXPORTER_A,
        &EXPORTER_A,
        |_| {},
    )
    .unwrap_err();
    assert_eq!(
        err,
        HandshakeError::UnknownKey {
            peer: "acme/build-bot".into(),
            key_id: "2025-12".into()
        }
    );
    assert_eq!(err.close_code(), CloseCode::AuthFailed);
}

#[test]
fn signature_by_another_private_key_is_refused() {
    let err = run(
        &mut Relay::new(),
        &impostor(),
        &EXPORTER_A,
        &EXPORTER_A,
        |_| {},
    )
    .unwrap_err();
    assert_eq!(err, HandshakeError::BadSignature);
    assert_eq!(err.close_code(), CloseCode::AuthFailed);
}

#[test]
fn expired_key_is_refused() {
    let mut r = Relay::with_key(peer_key(&identity(), Some(NOW - 1000), Some(NOW - 1)));
    let err = run(&mut r, &identity(), &EXPORTER_A, &EXPORTER_A, |_| {}).unwrap_err();
    assert_eq!(err, HandshakeError::KeyExpired("2026-01".into()));
    assert_eq!(err.close_code(), CloseCode::AuthFailed);
}

#[test]
fn not_yet_valid_key_is_refused() {
    let mut r = Relay::with_key(peer_key(&identity(), Some(NOW + 1), None));
    let err = run(&mut r, &identity(), &EXPORTER_A, &EXPORTER_A, |_| {}).unwrap_err();
    assert_eq!(err, HandshakeError::KeyNotYetValid("2026-01".into()));
    assert_eq!(err.close_code(), CloseCode::AuthFailed);
}

#[test]
fn reusing_a_hello_is_refused() {
    let mut r = Relay::new();
    let (hs, challenge) = r.start();
    let hello = answer(&identity(), &challenge, &EXPORTER_A);
    assert_eq!(r.verify(&hs, &hello, &EXPORTER_A), Ok(expected_auth()));
    let err = r.verify(&hs, &hello, &EXPORTER_A).unwrap_err();
    assert_eq!(err, HandshakeError::NonceReused);
    assert_eq!(err.close_code(), CloseCode::AuthFailed);
}

#[test]
fn a_nonce_past_its_ttl_is_refused_as_used() {
    let mut r = Relay::new();
    r.ledger = NonceLedger::new(8, 1_000);
    let (hs, challenge) = r.start();
    let later = NOW + 1_001; // inside the deadline, past the nonce's TTL
    let hello = answer_at(&identity(), &challenge, &EXPORTER_A, later);
    assert_eq!(
        r.verify_at(&hs, &hello, &EXPORTER_A, later),
        Err(HandshakeError::NonceReused)
    );
}

#[test]
fn hello_for_another_connections_challenge_is_refused() {
    let mut r = Relay::new();
    let (hs_a, _challenge_a) = r.start();
    let (hs_b, challenge_b) = r.start();
    let hello_b = answer(&identity(), &challenge_b, &EXPORTER_A);
    let err = r.verify(&hs_a, &hello_b, &EXPORTER_A).unwrap_err();
    assert_eq!(err, HandshakeError::ChallengeMismatch);
    assert_eq!(err.close_code(), CloseCode::AuthFailed);
    // The mismatch did not burn connection B's nonce: B still verifies.
    assert_eq!(r.verify(&hs_b, &hello_b, &EXPORTER_A), Ok(expected_auth()));
}

#[test]
fn stale_or_future_timestamp_is_refused() {
    let mut r = Relay::new();
    let max = r.policy.max_skew_ms;
    for (time, skew) in [(NOW - max - 1, max + 1), (NOW + max + 5, max + 5)] {
        let (hs, challenge) = r.start();
        let hello = answer_at(&identity(), &challenge, &EXPORTER_A, time);
        let err = r.verify(&hs, &hello, &EXPORTER_A).unwrap_err();
        assert_eq!(
            err,
            HandshakeError::ClockSkew {
                skew_ms: skew,
                max_ms: max
            }
        );
        assert_eq!(err.close_code(), CloseCode::ClockSkew);
    }
}

#[test]
fn hello_signed_for_another_relay_is_refused() {
    let mut r = Relay::new();
    let (hs, mut challenge) = r.start();
    // A man in the middle forwards our nonce under its own relay id; the
    // unpinned connector signs over that id.
    challenge.relay_id = RelayId::new("evil.example.net").unwrap();
    let hello =
        answer_challenge(&identity(), &challenge, None, instance(), NOW, &EXPORTER_A).unwrap();
    let err = r.verify(&hs, &hello, &EXPORTER_A).unwrap_err();
    assert_eq!(
        err,
        HandshakeError::RelayMismatch {
            expected: "relay.example.com".into(),
            got: "evil.example.net".into()
        }
    );
    assert_eq!(err.close_code(), CloseCode::AuthFailed);
    // Rewriting the relay id in the hello does not help: the signature covers it.
    let mut rewritten = hello;
    rewritten.relay_id = relay();
    assert_eq!(
        r.verify(&hs, &rewritten, &EXPORTER_A),
        Err(HandshakeError::BadSignature)
    );
}

#[test]
fn a_pinned_connector_refuses_to_sign_for_another_relay() {
    let mut r = Relay::new();
    let (_hs, mut challenge) = r.start();
    challenge.relay_id = RelayId::new("evil.example.net").unwrap();
    let err = answer_challenge(
        &identity(),
        &challenge,
        Some(&relay()),
        instance(),
        NOW,
        &EXPORTER_A,
    )
    .unwrap_err();
    assert_eq!(
        err,
        HandshakeError::RelayMismatch {
            expected: "relay.example.com".into(),
            got: "evil.example.net".into()
        }
    );
}

#[test]
fn changing_any_signed_field_after_signing_breaks_the_signature() {
    // A second peer and a second key id that share the signer's public key,
    // so changing peer or key id reaches the signature check.
    let mut r = Relay::new();
    r.policy.require_tls_binding = false;
    let twin_peer = PeerId::new("acme/twin").unwrap();
    r.trust.insert(
        twin_peer.clone(),
        vec![peer_key(&identity(), Some(NOW - 1), None)],
    );
    let twin_key = KeyId::new("2026-01-copy").unwrap();
    r.trust.get_mut(&peer()).unwrap().push(PeerKey {
        key_id: twin_key.clone(),
        ..peer_key(&identity(), Some(NOW - 1), None)
    });

    type Tamper = Box<dyn FnOnce(&mut Hello)>;
    let tampers: Vec<(&str, Tamper)> = vec![
        ("instance", Box::new(|h| h.instance.0[0] ^= 1)),
        ("time +1", Box::new(|h| h.time_ms += 1)),
        ("time -1", Box::new(|h| h.time_ms -= 1)),
        (
            "binding downgraded",
            Box::new(|h| h.binding = Binding::ChallengeOnly),
        ),
        ("peer", Box::new(move |h| h.peer = twin_peer)),
        ("key id", Box::new(move |h| h.key_id = twin_key)),
    ];
    for (what, tamper) in tampers {
        let got = run(&mut r, &identity(), &EXPORTER_A, &EXPORTER_A, tamper);
        assert_eq!(got, Err(HandshakeError::BadSignature), "{what}");
    }
    // The untampered control passes under the same setup.
    assert_eq!(
        run(&mut r, &identity(), &EXPORTER_A, &EXPORTER_A, |_| {}),
        Ok(expected_auth())
    );
}

#[test]
fn every_bit_of_the_signature_matters() {
    let mut r = Relay::new();
    r.ledger = NonceLedger::new(1024, 30_000);
    for bit in 0..512 {
        let got = run(&mut r, &identity(), &EXPORTER_A, &EXPORTER_A, |h| {
            h.signature[bit / 8] ^= 1 << (bit % 8);
        });
        assert_eq!(got, Err(HandshakeError::BadSignature), "bit {bit}");
    }
}

#[test]
fn hello_bound_to_another_tls_session_is_refused() {
    // Signed over exporter A (the connector's TLS session with a relaying
    // attacker), verified where the relay sees exporter B.
    let err = run(
        &mut Relay::new(),
        &identity(),
        &EXPORTER_A,
        &EXPORTER_B,
        |_| {},
    )
    .unwrap_err();
    assert_eq!(err, HandshakeError::BadSignature);
}

#[test]
fn challenge_only_hello_is_refused_when_binding_is_required() {
    let mut r = Relay::new();
    assert!(r.policy.require_tls_binding);
    let err = run(
        &mut r,
        &identity(),
        &ChannelBinding::ChallengeOnly,
        &EXPORTER_A,
        |_| {},
    )
    .unwrap_err();
    assert_eq!(err, HandshakeError::BindingRequired);
    assert_eq!(err.close_code(), CloseCode::BindingRequired);
    assert!(err.public_reason().contains("requires TLS channel binding"));
}

#[test]
fn required_binding_is_enforced_even_where_no_tls_session_is_visible() {
    // Regression: a relay whose policy requires binding but that observes no
    // TLS session (a misconfiguration) used to accept challenge-only hellos.
    let mut r = Relay::new();
    assert!(r.policy.require_tls_binding);
    let err = run(
        &mut r,
        &identity(),
        &ChannelBinding::ChallengeOnly,
        &ChannelBinding::ChallengeOnly,
        |_| {},
    )
    .unwrap_err();
    assert_eq!(err, HandshakeError::BindingRequired);
}

#[test]
fn tls_bound_hello_is_refused_where_no_tls_session_is_visible() {
    let mut r = Relay::new();
    r.policy.require_tls_binding = false;
    let err = run(
        &mut r,
        &identity(),
        &EXPORTER_A,
        &ChannelBinding::ChallengeOnly,
        |_| {},
    )
    .unwrap_err();
    assert_eq!(err, HandshakeError::BindingUnavailable);
    assert_eq!(err.close_code(), CloseCode::BindingRequired);
    assert!(err.public_reason().contains("challenge-only"));
}

#[test]
fn hello_after_the_deadline_is_refused_and_frees_its_nonce() {
    let mut r = Relay::new();
    let (hs, challenge) = r.start();
    let late = NOW + r.policy.deadline_ms + 1;
    let hello = answer_at(&identity(), &challenge, &EXPORTER_A, late);
    let err = r.verify_at(&hs, &hello, &EXPORTER_A, late).unwrap_err();
    assert_eq!(err, HandshakeError::Deadline(r.policy.deadline_ms));
    assert_eq!(err.close_code(), CloseCode::HandshakeTimeout);
    assert!(r.ledger.is_empty(), "the abandoned nonce is forgotten");
}

#[test]
fn server_refuses_an_unsupported_hello_version() {
    let mut r = Relay::new();
    for version in [0u8, 3, u8::MAX] {
        let err = run(&mut r, &identity(), &EXPORTER_A, &EXPORTER_A, |h| {
            h.version = version;
        })
        .unwrap_err();
        assert_eq!(
            err,
            HandshakeError::UnsupportedVersion {
                offered: version,
                min: 1,
                max: 2
            }
        );
        assert_eq!(err.close_code(), CloseCode::UnsupportedVersion);
        assert!(err.public_reason().contains("upgrade"));
    }
}

#[test]
fn connector_refuses_a_challenge_without_a_version_it_speaks() {
    let mut r = Relay::new();
    let (_hs, challenge) = r.start();
    for (min, max) in [(3u8, 4u8), (0, 0), (2, 1)] {
        let c = Challenge {
            min_version: min,
            max_version: max,
            ..challenge.clone()
        };
        let err =
            answer_challenge(&identity(), &c, None, instance(), NOW, &EXPORTER_A).unwrap_err();
        assert_eq!(
            err,
            HandshakeError::UnsupportedVersion {
                offered: 2,
                min,
                max
            }
        );
        assert_eq!(err.close_code(), CloseCode::UnsupportedVersion);
    }
    // A range that includes 2 is answered with version 2, one that stops
    // at 1 with version 1.
    for (max, want) in [(9u8, 2u8), (1, 1)] {
        let c = Challenge {
            min_version: 0,
            max_version: max,
            ..challenge.clone()
        };
        let hello = answer_challenge(&identity(), &c, None, instance(), NOW, &EXPORTER_A).unwrap();
        assert_eq!(hello.version, want);
    }
}

#[test]
fn a_full_nonce_ledger_refuses_new_handshakes() {
    let mut ledger = NonceLedger::new(2, 1_000);
    let (first, _) = ServerHandshake::start(relay(), NOW, &mut ledger).unwrap();
    let _second = ServerHandshake::start(relay(), NOW, &mut ledger).unwrap();
    let err = ServerHandshake::start(relay(), NOW, &mut ledger).unwrap_err();
    assert_eq!(err, HandshakeError::Overloaded);
    assert_eq!(err.close_code(), CloseCode::Overloaded);
    assert_eq!(ledger.len(), 2);
    // Forgetting an abandoned handshake frees its slot.
    ledger.forget(first.nonce());
    assert!(ServerHandshake::start(relay(), NOW, &mut ledger).is_ok());
    assert_eq!(
        ServerHandshake::start(relay(), NOW, &mut ledger).unwrap_err(),
        HandshakeError::Overloaded
    );
    // Expired nonces are evicted when the ledger is full.
    assert!(ServerHandshake::start(relay(), NOW + 1_001, &mut ledger).is_ok());
    assert_eq!(ledger.len(), 1);
}

#[test]
fn issued_nonces_differ() {
    let mut ledger = NonceLedger::new(16, 1_000);
    let a = ledger.issue(NOW).unwrap();
    let b = ledger.issue(NOW).unwrap();
    assert_ne!(a, b);
    assert!(ledger.consume(&a, NOW));
    assert!(!ledger.consume(&a, NOW), "single use");
    assert!(!ledger.consume(&[0; 32], NOW), "never issued");
}

// ---------------------------------------------------------------------------
// What the other side is told
// ---------------------------------------------------------------------------

/// Every refusal scenario above, as (name, error).
fn all_refusals() -> Vec<(&'static str, HandshakeError)> {
    let id = identity();
    let mut out = Vec::new();
    let stranger = Identity::from_secret(PeerId::new("acme/stranger").unwrap(), key_id(), [1; 32]);
    out.push((
        "unknown peer",
        run(
            &mut Relay::new(),
            &stranger,
            &EXPORTER_A,
            &EXPORTER_A,
            |_| {},
        )
        .unwrap_err(),
    ));
    let wrong_key = Identity::from_secret(peer(), KeyId::new("nope").unwrap(), [1; 32]);
    out.push((
        "unknown key",
        run(
            &mut Relay::new(),
            &wrong_key,
            &EXPORTER_A,
            &EXPORTER_A,
            |_| {},
        )
        .unwrap_err(),
    ));
    out.push((
        "bad signature",
        run(
            &mut Relay::new(),
            &impostor(),
            &EXPORTER_A,
            &EXPORTER_A,
            |_| {},
        )
        .unwrap_err(),
    ));
    let mut r = Relay::with_key(peer_key(&id, None, Some(NOW - 1)));
    out.push((
        "expired",
        run(&mut r, &id, &EXPORTER_A, &EXPORTER_A, |_| {}).unwrap_err(),
    ));
    let mut r = Relay::with_key(peer_key(&id, Some(NOW + 1), None));
    out.push((
        "not yet valid",
        run(&mut r, &id, &EXPORTER_A, &EXPORTER_A, |_| {}).unwrap_err(),
    ));
    let mut r = Relay::new();
    let (hs, c) = r.start();
    let hello = answer(&id, &c, &EXPORTER_A);
    r.verify(&hs, &hello, &EXPORTER_A).unwrap();
    out.push((
        "nonce reused",
        r.verify(&hs, &hello, &EXPORTER_A).unwrap_err(),
    ));
    let (hs_a, _) = r.start();
    let (_hs_b, c_b) = r.start();
    out.push((
        "challenge mismatch",
        r.verify(&hs_a, &answer(&id, &c_b, &EXPORTER_A), &EXPORTER_A)
            .unwrap_err(),
    ));
    out.push((
        "clock skew",
        run(&mut Relay::new(), &id, &EXPORTER_A, &EXPORTER_A, |h| {
            h.time_ms = 0;
        })
        .unwrap_err(),
    ));
    out.push((
        "relay mismatch",
        run(&mut Relay::new(), &id, &EXPORTER_A, &EXPORTER_A, |h| {
            h.relay_id = RelayId::new("other").unwrap();
        })
        .unwrap_err(),
    ));
    out.push((
        "binding required",
        run(
            &mut Relay::new(),
            &id,
            &ChannelBinding::ChallengeOnly,
            &EXPORTER_A,
            |_| {},
        )
        .unwrap_err(),
    ));
    out.push((
        "binding unavailable",
        run(
            &mut Relay::new(),
            &id,
            &EXPORTER_A,
            &ChannelBinding::ChallengeOnly,
            |_| {},
        )
        .unwrap_err(),
    ));
    let mut r = Relay::new();
    let (hs, c) = r.start();
    let late = NOW + r.policy.deadline_ms + 1;
    out.push((
        "deadline",
        r.verify_at(
            &hs,
            &answer_at(&id, &c, &EXPORTER_A, late),
            &EXPORTER_A,
            late,
        )
        .unwrap_err(),
    ));
    out.push((
        "version",
        run(&mut Relay::new(), &id, &EXPORTER_A, &EXPORTER_A, |h| {
            h.version = 3;
        })
        .unwrap_err(),
    ));
    let mut full = NonceLedger::new(0, 1_000);
    out.push((
        "overloaded",
        ServerHandshake::start(relay(), NOW, &mut full).unwrap_err(),
    ));
    out
}

#[test]
fn every_refusal_has_its_own_variant() {
    let refusals = all_refusals();
    let mut seen = HashMap::new();
    for (name, err) in &refusals {
        if let Some(other) = seen.insert(discriminant(err), *name) {
            panic!("{name} and {other} share the variant {err:?}");
        }
    }
    assert_eq!(seen.len(), 14);
}

#[test]
fn close_codes_map_each_refusal() {
    use CloseCode::*;
    let expected = [
        ("unknown peer", AuthFailed),
        ("unknown key", AuthFailed),
        ("bad signature", AuthFailed),
        ("expired", AuthFailed),
        ("not yet valid", AuthFailed),
        ("nonce reused", AuthFailed),
        ("challenge mismatch", AuthFailed),
        ("clock skew", ClockSkew),
        ("relay mismatch", AuthFailed),
        ("binding required", BindingRequired),
        ("binding unavailable", BindingRequired),
        ("deadline", HandshakeTimeout),
        ("version", UnsupportedVersion),
        ("overloaded", Overloaded),
    ];
    let refusals = all_refusals();
    assert_eq!(refusals.len(), expected.len());
    for ((name, err), (want_name, want_code)) in refusals.iter().zip(expected) {
        assert_eq!(*name, want_name);
        assert_eq!(err.close_code(), want_code, "{name}: {err:?}");
        // Only transient conditions ask the connector to reconnect.
        assert_eq!(
            err.close_code().should_reconnect(),
            matches!(name, &"deadline" | &"overloaded"),
            "{name}"
        );
    }
}

#[test]
fn identity_failures_do_not_reveal_whether_the_peer_exists() {
    let refusals: HashMap<_, _> = all_refusals().into_iter().collect();
    let identity_failures = [
        "unknown peer",
        "unknown key",
        "bad signature",
        "expired",
        "not yet valid",
        "nonce reused",
        "challenge mismatch",
    ];
    let reasons: Vec<String> = identity_failures
        .iter()
        .map(|n| refusals[n].public_reason())
        .collect();
    for (name, reason) in identity_failures.iter().zip(&reasons) {
        assert_eq!(reason, &reasons[0], "{name} is told apart from the others");
        // The precise error names the peer or key; the public one never does.
        assert!(!reason.contains("acme"), "{name}: {reason}");
        assert!(!reason.contains("stranger"), "{name}: {reason}");
        assert!(!reason.contains("2026-01"), "{name}: {reason}");
        assert!(!reason.contains("nope"), "{name}: {reason}");
        assert!(
            !reason.contains("expired") && !reason.contains("not valid yet"),
            "{name}: {reason}"
        );
    }
    // The operator-side message is precise.
    assert!(
        refusals["unknown peer"]
            .to_string()
            .contains("acme/stranger")
    );
    assert!(refusals["unknown key"].to_string().contains("nope"));
    // Non-identity failures say what to fix.
    assert!(refusals["clock skew"].public_reason().contains("NTP"));
    assert!(refusals["deadline"].public_reason().contains("ms"));
}
