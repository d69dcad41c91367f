//! Property tests of the codec: every frame type round-trips, stream decoding
//! is independent of how the bytes are chunked, incomplete input is "need
//! more" and never an error, oversized frames are refused from the prefix
//! alone, and hostile input never panics and only yields typed errors.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::collections::HashSet;

use bytes::{Bytes, BytesMut};
use oab_wire::codec::{Progress, check, peek_prefix};
use oab_wire::limits::{MAX_PAYLOAD_CEILING, MIN_HEADER_LIMIT, PREFIX_LEN};
use oab_wire::*;
use proptest::prelude::*;
use proptest::strategy::ValueTree;
use proptest::test_runner::TestRunner;

// ---------------------------------------------------------------------------
// Strategies
// ---------------------------------------------------------------------------

/// Largest payload the strategies generate.
const MAX_TEST_PAYLOAD: usize = 2048;

fn peer_id() -> impl Strategy<Value = PeerId> {
    "[a-z0-9][a-z0-9._-]{0,62}/[a-z0-9][a-z0-9._-]{0,62}".prop_map(|s| PeerId::new(&s).unwrap())
}

fn request_id() -> impl Strategy<Value = RequestId> {
    "[A-Za-z0-9._:-]{1,128}".prop_map(|s| RequestId::new(&s).unwrap())
}

fn key_id() -> impl Strategy<Value = KeyId> {
    "[A-Za-z0-9._:-]{1,64}".prop_map(|s| KeyId::new(&s).unwrap())
}

fn relay_id() -> impl Strategy<Value = RelayId> {
    "[A-Za-z0-9._:-]{1,128}".prop_map(|s| RelayId::new(&s).unwrap())
}

fn delegation_key() -> impl Strategy<Value = DelegationKey> {
    (peer_id(), request_id()).prop_map(|(caller, request_id)| DelegationKey { caller, request_id })
}

fn payload() -> impl Strategy<Value = Bytes> {
    prop_oneof![
        1 => Just(Bytes::new()),
        4 => prop::collection::vec(any::<u8>(), 0..=MAX_TEST_PAYLOAD).prop_map(Bytes::from),
    ]
}

fn direction() -> impl Strategy<Value = Direction> {
    prop_oneof![Just(Direction::Down), Just(Direction::Up)]
}

fn outcome() -> impl Strategy<Value = Outcome> {
    prop::sample::select(Outcome::ALL)
}

fn binding() -> impl Strategy<Value = Binding> {
    prop_oneof![Just(Binding::TlsExporter), Just(Binding::ChallengeOnly)]
}

fn gap_reason() -> impl Strategy<Value = GapReason> {
    prop_oneof![
        Just(GapReason::Trimmed),
        Just(GapReason::EpochChanged),
        Just(GapReason::Unknown)
    ]
}

fn seq() -> impl Strategy<Value = u64> {
    prop_oneof![Just(1u64), Just(u64::MAX), 1..=u64::MAX]
}

fn challenge() -> impl Strategy<Value = Frame> {
    (
        any::<[u8; 32]>(),
        relay_id(),
        any::<u64>(),
        any::<u8>(),
        any::<u8>(),
    )
        .prop_map(
            |(nonce, relay_id, server_time_ms, min_version, max_version)| {
                Frame::Challenge(Challenge {
                    nonce,
                    relay_id,
                    server_time_ms,
                    min_version,
                    max_version,
                })
            },
        )
}

fn hello() -> impl Strategy<Value = Frame> {
    (
        any::<u8>(),
        peer_id(),
        key_id(),
        any::<[u8; 16]>(),
        any::<u64>(),
        relay_id(),
        any::<[u8; 32]>(),
        binding(),
        prop::collection::vec(any::<u8>(), 64),
    )
        .prop_map(
            |(version, peer, key_id, instance, time_ms, relay_id, nonce, binding, sig)| {
                Frame::Hello(Hello {
                    version,
                    peer,
                    key_id,
                    instance: InstanceId(instance),
                    time_ms,
                    relay_id,
                    nonce,
                    binding,
                    signature: sig.try_into().unwrap(),
                })
            },
        )
}

fn welcome() -> impl Strategy<Value = Frame> {
    (
        any::<[u8; 16]>(),
        any::<u64>(),
        any::<u32>(),
        any::<u16>(),
        any::<u32>(),
        any::<u32>(),
        payload(),
    )
        .prop_map(
            |(session, epoch, heartbeat_ms, max_header, max_payload, max_in_flight, payload)| {
                Frame::Welcome(Welcome {
                    session: SessionId(session),
                    epoch,
                    heartbeat_ms,
                    max_header,
                    max_payload,
                    max_in_flight,
                    payload,
                })
            },
        )
}

fn open() -> impl Strategy<Value = Frame> {
    (
        delegation_key(),
        peer_id(),
        any::<u64>(),
        any::<u8>(),
        any::<[u8; 32]>(),
        // At most 63 chars of up to 4 bytes: an `Open` with maximal ids and
        // this ceiling still fits the default 1 KiB header limit.
        prop_oneof![Just(String::new()), "[a-z_,]{0,63}", "\\PC{0,63}"],
        prop::option::of(any::<[u8; 16]>().prop_filter_map("not all zero", TraceId::from_bytes)),
        payload(),
    )
        .prop_map(
            |(key, target, deadline_ms, depth, digest, ceiling, trace, payload)| {
                Frame::Open(Open {
                    key,
                    target,
                    deadline_ms,
                    depth,
                    digest: Digest(digest),
                    ceiling,
                    trace,
                    payload,
                })
            },
        )
}

fn data() -> impl Strategy<Value = Frame> {
    (
        delegation_key(),
        direction(),
        seq(),
        prop::option::of(outcome()),
        any::<u8>(),
        payload(),
    )
        .prop_map(|(key, direction, seq, terminal, flags, payload)| {
            Frame::Data(Data {
                key,
                direction,
                seq,
                // Only the up log carries a terminal; the decoder refuses others.
                terminal: terminal.filter(|_| direction == Direction::Up),
                flags,
                payload,
            })
        })
}

fn cancel() -> impl Strategy<Value = Frame> {
    (delegation_key(), seq(), any::<u8>(), payload()).prop_map(|(key, seq, flags, payload)| {
        Frame::Cancel(Cancel {
            key,
            seq,
            flags,
            payload,
        })
    })
}

fn ack() -> impl Strategy<Value = Frame> {
    (delegation_key(), direction(), seq()).prop_map(|(key, direction, seq)| {
        Frame::Ack(Ack {
            key,
            direction,
            seq,
        })
    })
}

fn resume() -> impl Strategy<Value = Frame> {
    (delegation_key(), direction(), any::<u64>()).prop_map(|(key, direction, after)| {
        Frame::Resume(Resume {
            key,
            direction,
            after,
        })
    })
}

fn gap() -> impl Strategy<Value = Frame> {
    (
        delegation_key(),
        direction(),
        any::<u64>(),
        any::<u64>(),
        prop::option::of(outcome()),
        gap_reason(),
    )
        .prop_map(
            |(key, direction, after, first_available, terminal, reason)| {
                Frame::Gap(Gap {
                    key,
                    direction,
                    after,
                    first_available,
                    terminal,
                    reason,
                })
            },
        )
}

fn error_frame() -> impl Strategy<Value = Frame> {
    (
        any::<u16>(),
        prop::option::of(delegation_key()),
        direction(),
        any::<u64>(),
        // At most 63 chars of up to 4 bytes: never clipped (255-byte limit).
        "\\PC{0,63}",
    )
        .prop_map(|(code, key, direction, seq, message)| {
            Frame::Error(ErrorFrame {
                code,
                key,
                direction,
                seq,
                message,
            })
        })
}

/// Any valid frame, of every one of the 16 types.
fn frame() -> impl Strategy<Value = Frame> {
    prop_oneof![
        challenge(),
        hello(),
        welcome(),
        open(),
        data(),
        cancel(),
        ack(),
        resume(),
        gap(),
        error_frame(),
        any::<u64>().prop_map(|token| Frame::Ping(Ping { token })),
        any::<u64>().prop_map(|token| Frame::Pong(Ping { token })),
        any::<u32>().prop_map(|reconnect_after_ms| Frame::Drain(Drain { reconnect_after_ms })),
        Just(Frame::PeersQuery),
        payload().prop_map(Frame::Peers),
        payload().prop_map(Frame::Publish),
    ]
}

/// Bytes that start with a plausible prefix (right version, a known type,
/// lengths that match the body) followed by random header and payload bytes:
/// these reach the field decoders instead of dying at the prefix.
fn plausible_message() -> impl Strategy<Value = Vec<u8>> {
    (
        1u8..=16,
        prop::collection::vec(any::<u8>(), 0..=200),
        prop::collection::vec(any::<u8>(), 0..=64),
    )
        .prop_map(|(ty, header, payload)| {
            let mut msg = vec![PROTOCOL_VERSION, ty];
            msg.extend_from_slice(&u16::try_from(header.len()).unwrap().to_be_bytes());
            msg.extend_from_slice(&u32::try_from(payload.len()).unwrap().to_be_bytes());
            msg.extend_from_slice(&header);
            msg.extend_from_slice(&payload);
            msg
        })
}

/// Random bytes: fully random, or with a plausible prefix.
fn hostile_bytes() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        prop::collection::vec(any::<u8>(), 0..=4096),
        plausible_message(),
        // Several plausible messages back to back, for the stream decoder.
        prop::collection::vec(plausible_message(), 1..4).prop_map(|v| v.concat()),
    ]
}

// ---------------------------------------------------------------------------
// Oracles
// ---------------------------------------------------------------------------

fn limits() -> Limits {
    Limits::default()
}

/// Errors a decoder may return for bad input: all typed, all mapped to a close
/// code that closes the connection. Encoder-only and stream-only errors must
/// never come out of `decode_message`.
fn assert_decode_error_is_typed(err: &FrameError) {
    assert!(
        !matches!(
            err,
            FrameError::Unencodable(_) | FrameError::EofMidFrame { .. }
        ),
        "decode_message returned a non-decoder error: {err:?}"
    );
    assert!(
        matches!(
            err.close_code(),
            CloseCode::MalformedFrame | CloseCode::FrameTooLarge | CloseCode::UnsupportedVersion
        ),
        "{err:?} maps to {:?}",
        err.close_code()
    );
    // Display must not panic either.
    assert!(!err.to_string().is_empty());
}

/// A successful decode must be canonical: encoding it gives back the input.
fn assert_decoded_is_canonical(input: &[u8], frame: &Frame) {
    let again = encode(frame).expect("a decoded frame must be encodable");
    assert_eq!(&again[..], input, "decode/encode is not the identity");
}

/// Runs every decoding entry point over `bytes`; never panics, only typed errors.
fn exercise_decoders(bytes: &[u8]) {
    let limits = limits();

    match decode_message(Bytes::copy_from_slice(bytes), &limits) {
        Ok(frame) => assert_decoded_is_canonical(bytes, &frame),
        Err(e) => assert_decode_error_is_typed(&e),
    }

    match check(bytes, &limits) {
        Ok(Progress::Need(n)) => assert!(n > 0),
        Ok(Progress::Ready(n)) => {
            assert!(n >= PREFIX_LEN && n <= bytes.len());
            assert_eq!(peek_prefix(bytes, &limits).unwrap().frame_len(), n);
        }
        Err(e) => {
            assert!(
                matches!(
                    e,
                    FrameError::UnsupportedVersion { .. }
                        | FrameError::UnknownType(_)
                        | FrameError::HeaderTooLarge { .. }
                        | FrameError::PayloadTooLarge { .. }
                ),
                "check may only refuse the prefix, got {e:?}"
            );
        }
    }

    let mut dec = FrameDecoder::new(limits);
    let mut buf = BytesMut::from(bytes);
    loop {
        let before = buf.len();
        match dec.decode(&mut buf) {
            Ok(Some(_)) => assert!(buf.len() < before, "a frame must consume bytes"),
            Ok(None) => {
                assert_eq!(buf.len(), before, "need-more must not consume");
                match dec.decode_eof(&mut buf) {
                    Ok(None) => assert!(buf.is_empty()),
                    Err(FrameError::EofMidFrame { buffered }) => assert_eq!(buffered, buf.len()),
                    other => panic!("decode_eof after need-more gave {other:?}"),
                }
                break;
            }
            Err(e) => {
                assert_decode_error_is_typed(&e);
                break;
            }
        }
    }
}

fn concat(frames: &[Frame]) -> Vec<u8> {
    let mut all = Vec::new();
    for f in frames {
        all.extend_from_slice(&encode(f).unwrap());
    }
    all
}

// ---------------------------------------------------------------------------
// Properties
// ---------------------------------------------------------------------------

proptest! {
    #![proptest_config(ProptestConfig::with_cases(4096))]

    /// decode(encode(f)) == f for every frame type, and the encoding is
    /// canonical and accepted by `check` and `peek_prefix`.
    #[test]
    fn every_frame_round_trips(f in frame()) {
        let limits = limits();
        let bytes = encode(&f).unwrap();
        prop_assert_eq!(check(&bytes, &limits).unwrap(), Progress::Ready(bytes.len()));
        let prefix = peek_prefix(&bytes, &limits).unwrap();
        prop_assert_eq!(prefix.frame_type, f.frame_type());
        prop_assert_eq!(prefix.payload_len, f.payload().len());
        prop_assert_eq!(&codec::encode_checked(&f, &limits).unwrap(), &bytes);
        let back = decode_message(bytes.clone(), &limits).unwrap();
        prop_assert_eq!(&back, &f);
        prop_assert_eq!(encode(&back).unwrap(), bytes);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1024))]

    /// A stream of frames decodes to the same frames however it is chunked,
    /// and ends cleanly.
    #[test]
    fn stream_decoding_is_chunking_independent(
        frames in prop::collection::vec(frame(), 1..8),
        chunks in prop::collection::vec(1usize..=300, 1..40),
    ) {
        let all = concat(&frames);
        let mut dec = FrameDecoder::new(limits());
        let mut buf = BytesMut::new();
        let mut out = Vec::new();
        let mut at = 0;
        let mut sizes = chunks.iter().cycle();
        while at < all.len() {
            let n = (*sizes.next().unwrap()).min(all.len() - at);
            buf.extend_from_slice(&all[at..at + n]);
            at += n;
            while let Some(f) = dec.decode(&mut buf).unwrap() {
                out.push(f);
            }
        }
        prop_assert_eq!(dec.decode_eof(&mut buf).unwrap(), None);
        prop_assert!(buf.is_empty());
        prop_assert_eq!(out, frames);
    }

    /// One byte at a time, the worst chunking.
    #[test]
    fn stream_decoding_byte_by_byte(frames in prop::collection::vec(frame(), 1..4)) {
        let all = concat(&frames);
        let mut dec = FrameDecoder::new(limits());
        let mut buf = BytesMut::new();
        let mut out = Vec::new();
        for b in &all {
            buf.extend_from_slice(&[*b]);
            if let Some(f) = dec.decode(&mut buf).unwrap() {
                out.push(f);
            }
        }
        prop_assert_eq!(dec.decode_eof(&mut buf).unwrap(), None);
        prop_assert_eq!(out, frames);
    }

    /// Every strict prefix of a valid encoding is "need more", with the exact
    /// count, and the stream decoder keeps it buffered; at EOF it is an
    /// `EofMidFrame`, not a clean end.
    #[test]
    fn every_prefix_needs_more(f in frame()) {
        let limits = limits();
        let bytes = encode(&f).unwrap();
        for cut in 0..bytes.len() {
            let need = check(&bytes[..cut], &limits).unwrap();
            let expected = if cut < PREFIX_LEN { PREFIX_LEN - cut } else { bytes.len() - cut };
            prop_assert_eq!(need, Progress::Need(expected), "cut at {}", cut);
        }
        // The stream decoder, at a few cuts (all cuts would be quadratic).
        for cut in [0, 1, PREFIX_LEN - 1, PREFIX_LEN, bytes.len() / 2, bytes.len() - 1] {
            let cut = cut.min(bytes.len() - 1);
            let mut buf = BytesMut::from(&bytes[..cut]);
            let mut dec = FrameDecoder::new(limits);
            prop_assert_eq!(dec.decode(&mut buf).unwrap(), None);
            prop_assert_eq!(buf.len(), cut);
            let eof = dec.decode_eof(&mut buf);
            if cut == 0 {
                prop_assert_eq!(eof, Ok(None));
            } else {
                prop_assert_eq!(eof, Err(FrameError::EofMidFrame { buffered: cut }));
            }
            // A whole message that is cut short is a length mismatch.
            let err = decode_message(Bytes::copy_from_slice(&bytes[..cut]), &limits).unwrap_err();
            prop_assert!(matches!(err, FrameError::LengthMismatch { .. }), "{:?}", err);
        }
    }

    /// Arbitrary bytes never panic any decoder, and only produce typed errors.
    #[test]
    fn hostile_bytes_never_panic(bytes in hostile_bytes()) {
        exercise_decoders(&bytes);
    }

    /// Flipping one random bit of a valid encoding decodes to a (canonical)
    /// valid frame or gives a typed error.
    #[test]
    fn bit_flips_decode_or_fail_typed(f in frame(), at in any::<prop::sample::Index>(), bit in 0u8..8) {
        let mut bytes = encode(&f).unwrap().to_vec();
        let i = at.index(bytes.len());
        bytes[i] ^= 1 << bit;
        exercise_decoders(&bytes);
        // A flip in the fixed prefix is caught by the prefix checks or the length check.
        if i < PREFIX_LEN {
            let r = decode_message(Bytes::from(bytes), &limits());
            if i == 0 {
                prop_assert_eq!(r, Err(FrameError::UnsupportedVersion { got: PROTOCOL_VERSION ^ (1 << bit) }));
            } else if i >= 2 {
                prop_assert!(r.is_err(), "a changed length must not decode: {:?}", r);
            }
        }
    }

    /// Truncating a valid encoding anywhere, or cutting bytes from its
    /// middle, never panics; a cut whole message never decodes.
    #[test]
    fn truncations_fail_typed(f in frame(), at in any::<prop::sample::Index>(), len in 1usize..16) {
        let bytes = encode(&f).unwrap();
        let cut = at.index(bytes.len());
        exercise_decoders(&bytes[..cut]);
        let err = decode_message(bytes.slice(..cut), &limits()).unwrap_err();
        prop_assert!(matches!(err, FrameError::LengthMismatch { .. }), "{:?}", err);
        // Remove bytes from the middle and fix up nothing: the lengths lie.
        let end = (cut + len).min(bytes.len());
        let mut holed = bytes[..cut].to_vec();
        holed.extend_from_slice(&bytes[end..]);
        exercise_decoders(&holed);
    }

    /// A header or payload one byte over the limit is refused by `check` from
    /// the 8-byte prefix alone; exactly at the limit is "need more".
    #[test]
    fn one_over_the_limit_is_refused_from_the_prefix(
        ty in prop::sample::select(FrameType::ALL),
        max_header in MIN_HEADER_LIMIT..u16::MAX,
        max_payload in 1..=MAX_PAYLOAD_CEILING,
    ) {
        let limits = Limits { max_header, max_payload };
        let prefix = |h: u16, p: u32| {
            let mut v = vec![PROTOCOL_VERSION, ty as u8];
            v.extend_from_slice(&h.to_be_bytes());
            v.extend_from_slice(&p.to_be_bytes());
            v
        };

        let over_header = prefix(max_header + 1, 0);
        let expected = FrameError::HeaderTooLarge {
            len: usize::from(max_header) + 1,
            max: usize::from(max_header),
        };
        prop_assert_eq!(check(&over_header, &limits), Err(expected.clone()));
        prop_assert_eq!(expected.close_code(), CloseCode::FrameTooLarge);
        let mut buf = BytesMut::from(&over_header[..]);
        prop_assert_eq!(FrameDecoder::new(limits).decode(&mut buf), Err(expected));

        let over_payload = prefix(0, max_payload + 1);
        let expected = FrameError::PayloadTooLarge {
            len: max_payload as usize + 1,
            max: max_payload as usize,
        };
        prop_assert_eq!(check(&over_payload, &limits), Err(expected.clone()));
        prop_assert_eq!(expected.close_code(), CloseCode::FrameTooLarge);
        let mut buf = BytesMut::from(&over_payload[..]);
        prop_assert_eq!(FrameDecoder::new(limits).decode_eof(&mut buf), Err(expected));

        let at_limit = prefix(max_header, max_payload);
        prop_assert_eq!(
            check(&at_limit, &limits),
            Ok(Progress::Need(usize::from(max_header) + max_payload as usize))
        );
    }

    /// Error messages longer than 255 bytes are clipped on a char boundary to
    /// a prefix of the original; shorter ones round-trip exactly.
    #[test]
    fn error_messages_clip_to_a_prefix(message in "\\PC{0,300}") {
        let f = Frame::Error(ErrorFrame {
            code: 1,
            key: None,
            direction: Direction::Down,
            seq: 0,
            message: message.clone(),
        });
        let Frame::Error(back) = decode_message(encode(&f).unwrap(), &limits()).unwrap() else {
            panic!("not an error frame");
        };
        prop_assert!(back.message.len() <= 255);
        prop_assert!(message.starts_with(&back.message));
        if message.len() <= 255 {
            prop_assert_eq!(back.message, message);
        } else {
            prop_assert!(back.message.len() > 255 - 4, "clipped too much");
        }
    }
}

/// The frame strategy really generates all 16 frame types.
#[test]
fn strategy_covers_every_frame_type() {
    let mut runner = TestRunner::deterministic();
    let strategy = frame();
    let mut seen = HashSet::new();
    for _ in 0..2000 {
        let f = strategy.new_tree(&mut runner).unwrap().current();
        seen.insert(f.frame_type() as u8);
    }
    let all: HashSet<u8> = FrameType::ALL.iter().map(|t| *t as u8).collect();
    assert_eq!(seen, all);
}

/// The largest valid frames the strategies can make still fit the default
/// header limit, so the round trip above runs with production limits.
#[test]
fn maximal_open_fits_the_default_header_limit() {
    let peer = PeerId::new(&format!("{}/{}", "a".repeat(63), "b".repeat(63))).unwrap();
    let f = Frame::Open(Open {
        key: DelegationKey::new(peer.clone(), RequestId::new(&"r".repeat(128)).unwrap()),
        target: peer,
        deadline_ms: u64::MAX,
        depth: u8::MAX,
        digest: Digest([0xff; 32]),
        ceiling: "\u{10FFFF}".repeat(63),
        trace: Some(TraceId::random()),
        payload: Bytes::from(vec![0u8; MAX_TEST_PAYLOAD]),
    });
    let bytes = codec::encode_checked(&f, &Limits::default()).unwrap();
    assert_eq!(decode_message(bytes, &Limits::default()).unwrap(), f);
}

/// Fixed regressions of the decoder contract (no randomness).
#[test]
fn empty_and_tiny_inputs() {
    let limits = limits();
    for n in 0..PREFIX_LEN {
        let bytes = vec![PROTOCOL_VERSION; n];
        assert_eq!(check(&bytes, &limits), Ok(Progress::Need(PREFIX_LEN - n)));
        assert_eq!(
            decode_message(Bytes::from(bytes.clone()), &limits),
            Err(FrameError::LengthMismatch {
                declared: PREFIX_LEN,
                actual: n
            })
        );
        exercise_decoders(&bytes);
    }
    // A frame of all-maximum lengths within u32/u16 is refused, not allocated.
    let huge = [
        PROTOCOL_VERSION,
        FrameType::Data as u8,
        0xff,
        0xff,
        0xff,
        0xff,
        0xff,
        0xff,
    ];
    assert!(matches!(
        check(&huge, &limits),
        Err(FrameError::HeaderTooLarge { len: 65535, .. })
    ));
}
