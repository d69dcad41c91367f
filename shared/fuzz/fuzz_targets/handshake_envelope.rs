//! Feeds arbitrary bytes to the two authentication paths.
//!
//! Input: one control byte (see `oab_wire_fuzz::control`), then a body.
//! - The body as an envelope's JSON: `Envelope::from_json`, then `verify`
//!   against a fixed trust store under several expectations. Oracle: an
//!   accepted envelope is exactly one a known identity signed.
//! - The body as a frame: a `Hello` is verified by a fresh relay handshake
//!   (the control byte splices in the live nonce, relay id, clock, chooses the
//!   observed binding and policy, and may re-sign). Oracles: only a hello the
//!   harness re-signed can verify, and never twice. A `Challenge` is answered.

#![no_main]

use std::collections::HashMap;
use std::sync::LazyLock;

use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use oab_wire::PeerId;
use oab_wire::envelope::{Envelope, EnvelopeError, REQUEST_TYPE, RESULT_TYPE};
use oab_wire::handshake::{
    ChannelBinding, HandshakeError, HandshakePolicy, NonceLedger, ServerHandshake, answer_challenge,
};
use oab_wire::identity::{Identity, PeerKey};
use oab_wire::{Frame, InstanceId, Limits, decode_message, encode};
use oab_wire_fuzz::{
    EXPORTER, KnownIdentity, NOW, control, identity, known_identities, relay, resign, trust,
};

// Built once: key derivation per input would dominate the run time.
static TRUST: LazyLock<HashMap<PeerId, Vec<PeerKey>>> = LazyLock::new(trust);
static KNOWN: LazyLock<Vec<KnownIdentity>> = LazyLock::new(known_identities);
static FIXTURE: LazyLock<Identity> = LazyLock::new(identity);

fn envelope(body: &[u8]) {
    let env = match Envelope::from_json(body) {
        Ok(env) => env,
        Err(EnvelopeError::Malformed(_)) => return,
        Err(e) => panic!("from_json gave {e:?}"),
    };
    match Envelope::from_json(&env.to_json()) {
        Ok(again) => assert_eq!(again, env, "wire form does not round-trip"),
        Err(e) => panic!("re-parsing our own wire form failed: {e}"),
    }
    let trust = &*TRUST;
    let fixture = &*FIXTURE;
    let claimed_type = env.payload_type().to_string();
    let claimed_signer = env.claimed_signer().clone();
    for ty in [REQUEST_TYPE, RESULT_TYPE, claimed_type.as_str()] {
        for signer in [&fixture.peer, &claimed_signer] {
            for at in [NOW, NOW - 1, NOW + 1] {
                match env.verify(ty, signer, trust, at) {
                    Ok(v) => {
                        // Ed25519 signing is deterministic and every known
                        // key is distinct: an accepted envelope is exactly
                        // what one of the known identities signs.
                        assert!(
                            KNOWN.iter().any(|(id, _, _)| {
                                Envelope::sign(id, ty, v.bytes().to_vec()) == env
                            }),
                            "accepted an envelope no known key signed"
                        );
                        assert_eq!(v.signer(), env.claimed_signer());
                        let _ = v.parse::<serde_json::Value>();
                    }
                    Err(e) => {
                        let _ = e.to_string();
                    }
                }
            }
        }
    }
}

fn hello(ctl: u8, body: &[u8]) {
    let limits = Limits::default();
    match decode_message(Bytes::copy_from_slice(body), &limits) {
        Ok(Frame::Hello(mut hello)) => {
            let mut ledger = NonceLedger::new(4, 30_000);
            let Ok((hs, challenge)) = ServerHandshake::start(relay(), NOW, &mut ledger) else {
                panic!("an empty ledger refused a handshake");
            };
            if ctl & control::SPLICE_NONCE != 0 {
                hello.nonce = challenge.nonce;
            }
            if ctl & control::SPLICE_RELAY != 0 {
                hello.relay_id = challenge.relay_id.clone();
            }
            if ctl & control::SPLICE_TIME != 0 {
                hello.time_ms = NOW;
            }
            let observed = if ctl & control::OBSERVE_TLS != 0 {
                ChannelBinding::TlsExporter(EXPORTER)
            } else {
                ChannelBinding::ChallengeOnly
            };
            let policy = HandshakePolicy {
                require_tls_binding: ctl & control::REQUIRE_TLS != 0,
                ..HandshakePolicy::default()
            };
            let fixture = &*FIXTURE;
            let resigned = ctl & control::RESIGN != 0
                && hello.peer == fixture.peer
                && hello.key_id == fixture.key_id;
            if resigned {
                resign(&mut hello, &observed);
            }
            let now = if ctl & control::LATE != 0 {
                NOW + policy.deadline_ms + 1
            } else {
                NOW
            };
            let trust = &*TRUST;
            match hs.verify(&hello, trust, &mut ledger, &policy, now, &observed) {
                Ok(auth) => {
                    assert!(resigned, "a hello the harness did not sign verified");
                    assert_eq!(auth.peer, fixture.peer);
                    assert_eq!(auth.key_id, fixture.key_id);
                    assert_eq!(auth.instance, hello.instance);
                    assert_eq!(hello.nonce, challenge.nonce);
                    assert!(ledger.is_empty(), "the nonce was not used up");
                    let again = hs.verify(&hello, trust, &mut ledger, &policy, now, &observed);
                    assert_eq!(again, Err(HandshakeError::NonceReused));
                }
                Err(e) => {
                    let _ = e.close_code();
                    let _ = e.public_reason();
                }
            }
        }
        Ok(Frame::Challenge(challenge)) => {
            let binding = ChannelBinding::TlsExporter(EXPORTER);
            let answered = answer_challenge(
                &FIXTURE,
                &challenge,
                None,
                InstanceId([3; 16]),
                NOW,
                &binding,
            );
            if let Ok(h) = answered {
                assert_eq!(h.nonce, challenge.nonce);
                let frame = Frame::Hello(h);
                match encode(&frame).map(|b| decode_message(b, &limits)) {
                    Ok(Ok(back)) => assert_eq!(back, frame),
                    other => panic!("an answered hello does not round-trip: {other:?}"),
                }
            }
        }
        _ => {}
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&ctl, body)) = data.split_first() else {
        return;
    };
    envelope(body);
    hello(ctl, body);
});
