//! Feeds arbitrary bytes to every decoding entry point of the codec:
//! `decode_message`, `check`, and `FrameDecoder::decode`/`decode_eof` under
//! two chunkings and two sets of limits. Never panics; every decoded frame
//! re-encodes to exactly the bytes it came from; chunking does not change
//! what the stream decoder yields.

#![no_main]

use bytes::{Bytes, BytesMut};
use libfuzzer_sys::fuzz_target;
use oab_wire::codec::{Progress, check};
use oab_wire::limits::{MIN_HEADER_LIMIT, PREFIX_LEN};
use oab_wire::{Frame, FrameDecoder, FrameError, Limits, decode_message, encode};

/// Decoded frames must be canonical: encoding one gives back its input bytes.
fn assert_canonical(input: &[u8], frame: &Frame) {
    match encode(frame) {
        Ok(again) => assert_eq!(&again[..], input, "re-encoding differs for {frame:?}"),
        Err(e) => panic!("decoded frame {frame:?} does not encode: {e}"),
    }
}

fn assert_decoder_error(e: &FrameError) {
    assert!(
        !matches!(
            e,
            FrameError::Unencodable(_) | FrameError::EofMidFrame { .. }
        ),
        "decoder returned {e:?}"
    );
    let _ = e.close_code();
    let _ = e.to_string();
}

/// Decodes a stream fed in chunks of `chunk` bytes. Returns the frames and
/// the first error (after which a connection would close).
fn stream(data: &[u8], chunk: usize, limits: Limits) -> (Vec<Frame>, Option<FrameError>) {
    let mut dec = FrameDecoder::new(limits);
    let mut buf = BytesMut::new();
    let mut frames = Vec::new();
    let mut consumed = 0;
    for piece in data.chunks(chunk) {
        buf.extend_from_slice(piece);
        loop {
            let before = buf.len();
            match dec.decode(&mut buf) {
                Ok(Some(frame)) => {
                    let len = before - buf.len();
                    assert!(len >= PREFIX_LEN);
                    assert_canonical(&data[consumed..consumed + len], &frame);
                    consumed += len;
                    frames.push(frame);
                }
                Ok(None) => {
                    assert_eq!(buf.len(), before, "need-more consumed bytes");
                    break;
                }
                Err(e) => {
                    assert_decoder_error(&e);
                    return (frames, Some(e));
                }
            }
        }
    }
    match dec.decode_eof(&mut buf) {
        Ok(None) => assert!(buf.is_empty()),
        Ok(Some(_)) => panic!("decode_eof found a whole frame decode had left"),
        Err(FrameError::EofMidFrame { buffered }) => {
            assert_eq!(buffered, buf.len());
            assert_eq!(consumed + buffered, data.len());
            return (frames, Some(FrameError::EofMidFrame { buffered }));
        }
        Err(e) => panic!("decode_eof gave {e:?} after need-more"),
    }
    (frames, None)
}

fn run(data: &[u8], limits: Limits) {
    match decode_message(Bytes::copy_from_slice(data), &limits) {
        Ok(frame) => {
            assert_canonical(data, &frame);
            assert_eq!(check(data, &limits), Ok(Progress::Ready(data.len())));
        }
        Err(e) => assert_decoder_error(&e),
    }

    match check(data, &limits) {
        Ok(Progress::Need(n)) => assert!(n > 0),
        Ok(Progress::Ready(n)) => assert!((PREFIX_LEN..=data.len()).contains(&n)),
        Err(e) => assert!(
            matches!(
                e,
                FrameError::UnsupportedVersion { .. }
                    | FrameError::UnknownType(_)
                    | FrameError::HeaderTooLarge { .. }
                    | FrameError::PayloadTooLarge { .. }
            ),
            "check refused with {e:?}"
        ),
    }

    let whole = stream(data, data.len().max(1), limits);
    let chunk = usize::from(data.first().copied().unwrap_or(0) % 13) + 1;
    let chunked = stream(data, chunk, limits);
    assert_eq!(whole, chunked, "chunking changed the decoded stream");
}

fuzz_target!(|data: &[u8]| {
    run(data, Limits::default());
    // Small limits reach the size refusals with small inputs.
    run(
        data,
        Limits {
            max_header: MIN_HEADER_LIMIT,
            max_payload: 64,
        },
    );
});
