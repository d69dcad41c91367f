//! Signed envelopes: a valid one verifies and parses; every single-bit change
//! of what it carries is refused; types, signers, keys and key windows are
//! enforced; malformed JSON is a typed error; and the payload is only ever
//! handed out (and so parsed) after its signature checked out.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::collections::HashMap;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use oab_wire::envelope::{Envelope, EnvelopeError, REQUEST_TYPE, RESULT_TYPE};
use oab_wire::identity::{Identity, PeerKey};
use oab_wire::{Digest, KeyId, PeerId};
use proptest::prelude::*;
use serde_json::{Value, json};

const NOW: u64 = 1_767_225_600_000;
/// A small payload, so flipping each of its bits is cheap.
const PAYLOAD: &[u8] = br#"{"task":"build"}"#;

fn signer() -> Identity {
    Identity::from_secret(
        PeerId::new("acme/caller").unwrap(),
        KeyId::new("k1").unwrap(),
        [9; 32],
    )
}

/// Another configured peer with a key id of the same name.
fn other_peer() -> Identity {
    Identity::from_secret(
        PeerId::new("acme/other").unwrap(),
        KeyId::new("k1").unwrap(),
        [10; 32],
    )
}

/// A second key of the signer, registered under another key id.
fn second_key() -> Identity {
    Identity::from_secret(
        PeerId::new("acme/caller").unwrap(),
        KeyId::new("k2").unwrap(),
        [11; 32],
    )
}

fn key_of(id: &Identity, not_before_ms: Option<u64>, not_after_ms: Option<u64>) -> PeerKey {
    PeerKey {
        key_id: id.key_id.clone(),
        public_key: id.public_key(),
        not_before_ms,
        not_after_ms,
    }
}

fn trust() -> HashMap<PeerId, Vec<PeerKey>> {
    let mut t = HashMap::new();
    t.insert(
        signer().peer,
        vec![
            key_of(&signer(), None, None),
            key_of(&second_key(), None, None),
        ],
    );
    t.insert(other_peer().peer, vec![key_of(&other_peer(), None, None)]);
    t
}

fn signed(payload: &[u8]) -> Envelope {
    Envelope::sign(&signer(), REQUEST_TYPE, payload.to_vec())
}

/// Verifies as the relay's counterpart would: a request from `acme/caller`.
fn verify_request(env: &Envelope) -> Result<Vec<u8>, EnvelopeError> {
    env.verify(REQUEST_TYPE, &signer().peer, &trust(), NOW)
        .map(|v| v.bytes().to_vec())
}

/// Parses wire JSON and verifies it as a request from `acme/caller`.
fn receive(json: &[u8]) -> Result<Vec<u8>, EnvelopeError> {
    verify_request(&Envelope::from_json(json)?)
}

fn wire_value(env: &Envelope) -> Value {
    serde_json::from_slice(&env.to_json()).unwrap()
}

fn to_bytes(v: &Value) -> Vec<u8> {
    serde_json::to_vec(v).unwrap()
}

/// The byte range of the string value that follows `"key":` in `json`.
fn value_range(json: &[u8], key: &str) -> std::ops::Range<usize> {
    let needle = format!("\"{key}\":\"");
    let start = json
        .windows(needle.len())
        .position(|w| w == needle.as_bytes())
        .unwrap()
        + needle.len();
    let len = json[start..].iter().position(|b| *b == b'"').unwrap();
    start..start + len
}

// ---------------------------------------------------------------------------
// Valid
// ---------------------------------------------------------------------------

#[test]
fn valid_envelope_round_trips_verifies_and_parses() {
    let env = signed(PAYLOAD);
    let json = env.to_json();
    let wire: Value = serde_json::from_slice(&json).unwrap();
    assert_eq!(wire["payloadType"], REQUEST_TYPE);
    assert_eq!(wire["payload"], STANDARD.encode(PAYLOAD));
    assert_eq!(wire["signatures"][0]["peer"], "acme/caller");
    assert_eq!(wire["signatures"][0]["keyid"], "k1");

    let back = Envelope::from_json(&json).unwrap();
    assert_eq!(back, env);
    assert_eq!(back.claimed_signer(), &signer().peer);
    assert_eq!(back.claimed_key_id(), &signer().key_id);
    assert_eq!(back.payload_type(), REQUEST_TYPE);
    assert_eq!(back.payload_digest(), Digest::of(PAYLOAD));

    let trust = trust();
    let v = back
        .verify(REQUEST_TYPE, &signer().peer, &trust, NOW)
        .unwrap();
    assert_eq!(v.bytes(), PAYLOAD);
    assert_eq!(v.signer(), &signer().peer);
    assert_eq!(v.key_id(), &signer().key_id);
    assert_eq!(v.digest(), Digest::of(PAYLOAD));
    assert_eq!(v.parse::<Value>().unwrap(), json!({"task": "build"}));
}

#[test]
fn a_result_signed_with_the_second_key_verifies() {
    let env = Envelope::sign(&second_key(), RESULT_TYPE, PAYLOAD.to_vec());
    let env = Envelope::from_json(&env.to_json()).unwrap();
    let trust = trust();
    let v = env
        .verify(RESULT_TYPE, &signer().peer, &trust, NOW)
        .unwrap();
    assert_eq!(v.key_id().as_str(), "k2");
}

#[test]
fn debug_does_not_show_the_payload() {
    let env = signed(b"secret-ish payload");
    let dbg = format!("{env:?}");
    assert!(!dbg.contains("secret-ish"), "{dbg}");
    assert!(dbg.contains("payload_len: 18"), "{dbg}");
}

// ---------------------------------------------------------------------------
// Every single-bit change is refused
// ---------------------------------------------------------------------------

#[test]
fn every_bit_of_the_payload_matters() {
    let wire = wire_value(&signed(PAYLOAD));
    for bit in 0..PAYLOAD.len() * 8 {
        let mut tampered = PAYLOAD.to_vec();
        tampered[bit / 8] ^= 1 << (bit % 8);
        let mut w = wire.clone();
        w["payload"] = Value::String(STANDARD.encode(&tampered));
        assert_eq!(
            receive(&to_bytes(&w)),
            Err(EnvelopeError::BadSignature),
            "payload bit {bit}"
        );
    }
}

#[test]
fn every_bit_of_the_signature_matters() {
    let wire = wire_value(&signed(PAYLOAD));
    let sig = STANDARD
        .decode(wire["signatures"][0]["sig"].as_str().unwrap())
        .unwrap();
    assert_eq!(sig.len(), 64);
    for bit in 0..512 {
        let mut tampered = sig.clone();
        tampered[bit / 8] ^= 1 << (bit % 8);
        let mut w = wire.clone();
        w["signatures"][0]["sig"] = Value::String(STANDARD.encode(&tampered));
        assert_eq!(
            receive(&to_bytes(&w)),
            Err(EnvelopeError::BadSignature),
            "signature bit {bit}"
        );
    }
}

#[test]
fn every_bit_of_the_payload_type_matters() {
    let json = signed(PAYLOAD).to_json();
    let range = value_range(&json, "payloadType");
    assert_eq!(&json[range.clone()], REQUEST_TYPE.as_bytes());
    for i in range {
        for bit in 0..8 {
            let mut bytes = json.clone();
            bytes[i] ^= 1 << bit;
            let env = match Envelope::from_json(&bytes) {
                Err(EnvelopeError::Malformed(_)) => continue,
                Err(other) => panic!("from_json gave {other:?}"),
                Ok(env) => env,
            };
            // The verifier expects a request: the type check refuses it.
            assert!(
                matches!(verify_request(&env), Err(EnvelopeError::WrongType { .. })),
                "byte {i} bit {bit}"
            );
            // Even a verifier that expects the tampered type refuses it:
            // the type is signed.
            let tampered_type = env.payload_type().to_string();
            let trust = trust();
            assert_eq!(
                env.verify(&tampered_type, &signer().peer, &trust, NOW)
                    .map(|v| v.bytes().to_vec()),
                Err(EnvelopeError::BadSignature),
                "byte {i} bit {bit}"
            );
        }
    }
}

#[test]
fn every_bit_of_the_key_id_matters() {
    let json = signed(PAYLOAD).to_json();
    let range = value_range(&json, "keyid");
    assert_eq!(&json[range.clone()], b"k1");
    for i in range {
        for bit in 0..8 {
            let mut bytes = json.clone();
            bytes[i] ^= 1 << bit;
            let got = receive(&bytes);
            assert!(
                matches!(
                    got,
                    Err(EnvelopeError::Malformed(_) | EnvelopeError::UnknownKey { .. })
                ),
                "byte {i} bit {bit}: {got:?}"
            );
        }
    }
    // Naming another registered key of the signer: that key does not verify.
    let mut w = wire_value(&signed(PAYLOAD));
    w["signatures"][0]["keyid"] = json!("k2");
    assert_eq!(receive(&to_bytes(&w)), Err(EnvelopeError::BadSignature));
}

#[test]
fn every_bit_of_the_signer_matters() {
    let json = signed(PAYLOAD).to_json();
    let range = value_range(&json, "peer");
    assert_eq!(&json[range.clone()], b"acme/caller");
    let trust = trust();
    for i in range {
        for bit in 0..8 {
            let mut bytes = json.clone();
            bytes[i] ^= 1 << bit;
            let env = match Envelope::from_json(&bytes) {
                Err(EnvelopeError::Malformed(_)) => continue,
                Err(other) => panic!("from_json gave {other:?}"),
                Ok(env) => env,
            };
            assert!(
                matches!(verify_request(&env), Err(EnvelopeError::WrongSigner { .. })),
                "byte {i} bit {bit}"
            );
            // A verifier that expects the tampered signer finds no such peer
            // (or no key, or a key that does not verify).
            let claimed = env.claimed_signer().clone();
            let got = env.verify(REQUEST_TYPE, &claimed, &trust, NOW);
            assert!(
                matches!(
                    got,
                    Err(EnvelopeError::UnknownSigner(_)
                        | EnvelopeError::UnknownKey { .. }
                        | EnvelopeError::BadSignature)
                ),
                "byte {i} bit {bit}: {got:?}"
            );
        }
    }
    // Re-attributing the envelope to another configured peer with the same
    // key id: that peer's key does not verify it.
    let mut w = wire_value(&signed(PAYLOAD));
    w["signatures"][0]["peer"] = json!("acme/other");
    let env = Envelope::from_json(&to_bytes(&w)).unwrap();
    assert_eq!(
        env.verify(REQUEST_TYPE, &other_peer().peer, &trust, NOW)
            .map(|v| v.bytes().len()),
        Err(EnvelopeError::BadSignature)
    );
}

#[test]
fn no_single_bit_flip_of_the_wire_form_verifies() {
    let json = signed(PAYLOAD).to_json();
    let mut parsed = 0;
    for i in 0..json.len() {
        for bit in 0..8 {
            let mut bytes = json.clone();
            bytes[i] ^= 1 << bit;
            match Envelope::from_json(&bytes) {
                Err(EnvelopeError::Malformed(_)) => {}
                Err(other) => panic!("from_json gave {other:?}"),
                Ok(env) => {
                    parsed += 1;
                    let got = verify_request(&env);
                    assert!(
                        matches!(
                            got,
                            Err(EnvelopeError::WrongType { .. }
                                | EnvelopeError::WrongSigner { .. }
                                | EnvelopeError::UnknownKey { .. }
                                | EnvelopeError::BadSignature)
                        ),
                        "byte {i} bit {bit}: {got:?}"
                    );
                }
            }
        }
    }
    // Many flips still parse (inside base64 and the strings): the signature,
    // not the JSON parser, is what refuses them.
    assert!(parsed > 100, "only {parsed} flips parsed");
}

// ---------------------------------------------------------------------------
// Type, signer, key and window checks
// ---------------------------------------------------------------------------

#[test]
fn a_request_presented_as_a_result_is_refused() {
    let env = signed(PAYLOAD);
    let trust = trust();
    assert_eq!(
        env.verify(RESULT_TYPE, &signer().peer, &trust, NOW)
            .map(|v| v.bytes().len()),
        Err(EnvelopeError::WrongType {
            expected: RESULT_TYPE.into(),
            got: REQUEST_TYPE.into()
        })
    );
    // Relabelling the request as a result does not help: the type is signed.
    let mut w = wire_value(&env);
    w["payloadType"] = json!(RESULT_TYPE);
    let relabelled = Envelope::from_json(&to_bytes(&w)).unwrap();
    assert_eq!(
        relabelled
            .verify(RESULT_TYPE, &signer().peer, &trust, NOW)
            .map(|v| v.bytes().len()),
        Err(EnvelopeError::BadSignature)
    );
}

#[test]
fn a_key_outside_its_window_is_refused() {
    for (not_before, not_after, inside) in [
        (Some(NOW + 1), None, NOW + 1),
        (None, Some(NOW - 1), NOW - 1),
    ] {
        let mut t = trust();
        t.insert(
            signer().peer,
            vec![key_of(&signer(), not_before, not_after)],
        );
        let env = signed(PAYLOAD);
        assert_eq!(
            env.verify(REQUEST_TYPE, &signer().peer, &t, NOW)
                .map(|v| v.bytes().len()),
            Err(EnvelopeError::KeyOutsideWindow("k1".into()))
        );
        // The same key at a moment inside its window is fine.
        assert!(env.verify(REQUEST_TYPE, &signer().peer, &t, inside).is_ok());
    }
}

#[test]
fn an_envelope_signed_by_another_key_is_refused() {
    // Same peer and key id, another private key.
    let impostor = Identity::from_secret(signer().peer, signer().key_id, [66; 32]);
    let env = Envelope::sign(&impostor, REQUEST_TYPE, PAYLOAD.to_vec());
    assert_eq!(verify_request(&env), Err(EnvelopeError::BadSignature));
}

#[test]
fn unknown_and_unexpected_signers_are_refused() {
    let trust = trust();
    let stranger = Identity::from_secret(
        PeerId::new("acme/stranger").unwrap(),
        KeyId::new("k1").unwrap(),
        [12; 32],
    );
    let env = Envelope::sign(&stranger, REQUEST_TYPE, PAYLOAD.to_vec());
    assert_eq!(
        env.verify(REQUEST_TYPE, &stranger.peer, &trust, NOW)
            .map(|v| v.bytes().len()),
        Err(EnvelopeError::UnknownSigner("acme/stranger".into()))
    );
    // Validly signed by acme/other, but acme/caller must sign here.
    let env = Envelope::sign(&other_peer(), REQUEST_TYPE, PAYLOAD.to_vec());
    assert_eq!(
        verify_request(&env),
        Err(EnvelopeError::WrongSigner {
            expected: "acme/caller".into(),
            got: "acme/other".into()
        })
    );
    let unknown_key = Identity::from_secret(signer().peer, KeyId::new("k9").unwrap(), [9; 32]);
    let env = Envelope::sign(&unknown_key, REQUEST_TYPE, PAYLOAD.to_vec());
    assert_eq!(
        verify_request(&env),
        Err(EnvelopeError::UnknownKey {
            peer: "acme/caller".into(),
            key_id: "k9".into()
        })
    );
}

// ---------------------------------------------------------------------------
// Malformed wire forms
// ---------------------------------------------------------------------------

fn assert_malformed(bytes: &[u8], what: &str) {
    match Envelope::from_json(bytes) {
        Err(EnvelopeError::Malformed(m)) => assert!(!m.is_empty(), "{what}"),
        other => panic!("{what}: {other:?}"),
    }
}

#[test]
fn garbage_is_malformed() {
    let valid = wire_value(&signed(PAYLOAD));
    let sig = valid["signatures"][0].clone();
    let with = |f: &dyn Fn(&mut Value)| {
        let mut v = valid.clone();
        f(&mut v);
        to_bytes(&v)
    };
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("empty", b"".to_vec()),
        ("whitespace", b"   ".to_vec()),
        ("null", b"null".to_vec()),
        ("number", b"42".to_vec()),
        ("array", b"[]".to_vec()),
        ("empty object", b"{}".to_vec()),
        ("not utf-8", vec![0xff, 0xfe, b'{', b'}']),
        ("binary", vec![0; 64]),
        (
            "unknown field",
            with(&|v| v["extra"] = json!(1)),
        ),
        (
            "unknown signature field",
            with(&|v| v["signatures"][0]["extra"] = json!(1)),
        ),
        ("no signatures", with(&|v| v["signatures"] = json!([]))),
        (
            "two signatures",
            with(&|v| v["signatures"] = json!([sig.clone(), sig.clone()])),
        ),
        ("payload not base64", with(&|v| v["payload"] = json!("***"))),
        ("payload a number", with(&|v| v["payload"] = json!(5))),
        (
            "payload url-safe base64",
            with(&|v| v["payload"] = json!("-_-_")),
        ),
        ("missing payload", with(&|v| {
            v.as_object_mut().unwrap().remove("payload");
        })),
        (
            "sig not base64",
            with(&|v| v["signatures"][0]["sig"] = json!("not base64!")),
        ),
        (
            "sig 63 bytes",
            with(&|v| v["signatures"][0]["sig"] = json!(STANDARD.encode([0u8; 63]))),
        ),
        (
            "sig 65 bytes",
            with(&|v| v["signatures"][0]["sig"] = json!(STANDARD.encode([0u8; 65]))),
        ),
        (
            "invalid peer id",
            with(&|v| v["signatures"][0]["peer"] = json!("ACME/Caller")),
        ),
        (
            "invalid key id",
            with(&|v| v["signatures"][0]["keyid"] = json!("k 1")),
        ),
        (
            "duplicate field",
            format!(
                "{{\"payloadType\":\"a\",\"payloadType\":\"b\",\"payload\":\"\",\"signatures\":{}}}",
                valid["signatures"]
            )
            .into_bytes(),
        ),
        (
            "trailing garbage",
            [to_bytes(&valid), b"x".to_vec()].concat(),
        ),
    ];
    for (what, bytes) in cases {
        assert_malformed(&bytes, what);
    }
}

#[test]
fn every_truncation_is_malformed() {
    let json = signed(PAYLOAD).to_json();
    for cut in 0..json.len() {
        assert_malformed(&json[..cut], &format!("cut at {cut}"));
    }
    assert!(Envelope::from_json(&json).is_ok());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2048))]

    /// Arbitrary bytes never panic `from_json`; the only error is `Malformed`.
    #[test]
    fn from_json_never_panics_on_bytes(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        match Envelope::from_json(&bytes) {
            Ok(_) | Err(EnvelopeError::Malformed(_)) => {}
            Err(other) => prop_assert!(false, "unexpected {:?}", other),
        }
    }

    /// JSON-shaped input (the right keys, random values) never panics either,
    /// and never verifies.
    #[test]
    fn from_json_never_panics_on_json_shapes(
        ty in prop_oneof![Just(REQUEST_TYPE.to_string()), ".{0,40}"],
        payload in prop_oneof!["[A-Za-z0-9+/=]{0,64}", ".{0,64}"],
        peer in prop_oneof![Just("acme/caller".to_string()), ".{0,20}"],
        keyid in prop_oneof![Just("k1".to_string()), ".{0,20}"],
        sig in prop_oneof!["[A-Za-z0-9+/]{86}==", ".{0,100}"],
    ) {
        let v = json!({
            "payloadType": ty,
            "payload": payload,
            "signatures": [{"peer": peer, "keyid": keyid, "sig": sig}],
        });
        match Envelope::from_json(&to_bytes(&v)) {
            Err(EnvelopeError::Malformed(_)) => {}
            Err(other) => prop_assert!(false, "unexpected {:?}", other),
            Ok(env) => prop_assert!(verify_request(&env).is_err()),
        }
    }
}

// ---------------------------------------------------------------------------
// Verify, then parse
// ---------------------------------------------------------------------------
//
// By construction: `Envelope` has no accessor for its payload bytes; the only
// way to them is `Envelope::verify`, which returns a `Verified` only after
// the type, signer, key window and signature checked out, and `parse` is a
// method of `Verified`. The tests below show the observable half: the
// verifier never looks inside the payload, and a tampered payload is refused
// by the signature check whatever it contains, before anyone could parse it.

#[test]
fn a_correctly_signed_non_json_payload_verifies_because_verify_does_not_parse() {
    let not_json: &[u8] = b"\xff\xfe{ this is not JSON \x00";
    let env = Envelope::from_json(&signed(not_json).to_json()).unwrap();
    let trust = trust();
    let v = env
        .verify(REQUEST_TYPE, &signer().peer, &trust, NOW)
        .unwrap();
    assert_eq!(v.bytes(), not_json);
    // Parsing is a separate, later step; here it fails with its own error.
    assert!(matches!(v.parse::<Value>(), Err(EnvelopeError::Payload(_))));
}

#[test]
fn a_tampered_payload_is_refused_by_the_signature_before_any_parse() {
    let wire = wire_value(&signed(PAYLOAD));
    let replacements: [&[u8]; 4] = [
        // Not JSON: a verifier that parsed first would fail with `Payload`.
        b"\xff\xfe not json",
        // Well-formed JSON of the expected shape: a verifier that parsed and
        // trusted it would act on it.
        br#"{"task":"deploy"}"#,
        b"",
        // The signed bytes plus one trailing byte.
        &[PAYLOAD, b" ".as_slice()].concat(),
    ];
    for tampered in replacements {
        let mut w = wire.clone();
        w["payload"] = Value::String(STANDARD.encode(tampered));
        assert_eq!(
            receive(&to_bytes(&w)),
            Err(EnvelopeError::BadSignature),
            "{tampered:?}"
        );
    }
}

#[test]
fn the_payload_digest_is_of_the_carried_bytes_and_proves_nothing() {
    // Usable before verification (idempotency), but it follows a tampered
    // payload: it is not a substitute for `verify`.
    let mut w = wire_value(&signed(PAYLOAD));
    w["payload"] = Value::String(STANDARD.encode(b"other"));
    let env = Envelope::from_json(&to_bytes(&w)).unwrap();
    assert_eq!(env.payload_digest(), Digest::of(b"other"));
    assert_eq!(verify_request(&env), Err(EnvelopeError::BadSignature));
}
