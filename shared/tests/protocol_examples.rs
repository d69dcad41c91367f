//! The worked examples and test vectors of `docs/protocol.md` stay true:
//! every frame dump of §13 is read from the document itself, decoded with
//! the codec, re-encoded byte for byte, and checked against what the text
//! says it is; the handshake vector of §13.2 is recomputed from its inputs
//! (transcript, signatures, the `Hello`); the `Welcome` list examples (§6.6,
//! §13.4) parse as cursors; the identity file example of §5 parses and
//! holds the §13.2 key.
//!
//! What it assumes of the doc: §13 lies between `## 13.` and `## 14.`; a
//! dump is a fenced block, either `hexdump -C` style (`0000  01 05 ...
//! |ascii|`) or plain hex pairs, `[11 x32]` meaning 32 bytes of `0x11`; in
//! §13.3 each frame starts on a line that begins with a letter (its label,
//! up to the last `)`, or its first word), its bytes following.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use bytes::Bytes;
use oab_wire::handshake::{ChannelBinding, TranscriptFields, transcript};
use oab_wire::identity::Identity;
use oab_wire::{
    DelegationCursor, DelegationKey, Digest, Direction, Frame, InstanceId, KeyId, Limits, Outcome,
    PeerId, RelayId, RequestId, decode_message, encode,
};

fn doc() -> String {
    std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/protocol.md")).unwrap()
}

/// The text from the heading that starts with `start` to the next heading
/// of the same level.
fn section<'a>(doc: &'a str, start: &str) -> &'a str {
    let level = start.split(' ').next().unwrap();
    let from = doc
        .find(&format!("\n{start}"))
        .unwrap_or_else(|| panic!("no heading {start:?} in docs/protocol.md"));
    let rest = &doc[from + 1..];
    let end = rest[1..]
        .find(&format!("\n{level} "))
        .map_or(rest.len(), |i| i + 1);
    &rest[..end]
}

/// The fenced code blocks of `text`, in order.
fn code_blocks(text: &str) -> Vec<String> {
    let mut blocks = Vec::new();
    let mut current: Option<String> = None;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            match current.take() {
                Some(b) => blocks.push(b),
                None => current = Some(String::new()),
            }
        } else if let Some(b) = current.as_mut() {
            b.push_str(line);
            b.push('\n');
        }
    }
    blocks
}

/// The bytes of hex text: pairs separated by spaces, `[xx xN]` for N
/// copies, a `hexdump -C` offset column and `|ascii|` column ignored.
fn hex_bytes(text: &str) -> Vec<u8> {
    let mut out = Vec::new();
    for line in text.lines() {
        let line = line.split('|').next().unwrap();
        let mut words: Vec<&str> = line.split_whitespace().collect();
        if words
            .first()
            .is_some_and(|w| w.len() == 4 && w.chars().all(|c| c.is_ascii_hexdigit()))
        {
            words.remove(0); // the offset column
        }
        let mut i = 0;
        while i < words.len() {
            let w = words[i];
            if let Some(b) = w.strip_prefix('[') {
                let n: usize = words[i + 1]
                    .trim_start_matches('x')
                    .trim_end_matches(']')
                    .parse()
                    .unwrap();
                let byte = u8::from_str_radix(b, 16).unwrap();
                out.extend(std::iter::repeat_n(byte, n));
                i += 2;
                continue;
            }
            assert!(
                w.len() == 2,
                "not a hex byte: {w:?} in {line:?} of docs/protocol.md"
            );
            out.push(u8::from_str_radix(w, 16).unwrap());
            i += 1;
        }
    }
    out
}

/// Decodes a documented frame and checks that encoding it gives the same
/// bytes back.
fn frame(bytes: &[u8]) -> Frame {
    let f = decode_message(Bytes::copy_from_slice(bytes), &Limits::default())
        .unwrap_or_else(|e| panic!("a frame of docs/protocol.md does not decode: {e}"));
    assert_eq!(
        encode(&f).unwrap().as_ref(),
        bytes,
        "re-encoding {f:?} differs from docs/protocol.md"
    );
    f
}

fn key() -> DelegationKey {
    DelegationKey::new(
        PeerId::new("acme/caller").unwrap(),
        RequestId::new("req-1").unwrap(),
    )
}

#[test]
fn section_13_1_data_ack_and_terminal_frames_are_what_the_text_says() {
    let doc = doc();
    let blocks = code_blocks(section(&doc, "### 13.1"));
    assert_eq!(
        blocks.len(),
        3,
        "§13.1 has the Data, Ack and terminal dumps"
    );
    let data = hex_bytes(&blocks[0]);
    assert_eq!(data.len(), 56, "Total: 8 + 29 + 19 = 56 bytes");
    let Frame::Data(d) = frame(&data) else {
        panic!("§13.1's first dump is not a Data frame")
    };
    assert_eq!(d.key, key());
    assert_eq!(
        (d.direction, d.seq, d.terminal, d.flags),
        (Direction::Up, 7, None, 0)
    );
    assert_eq!(d.payload.as_ref(), br#"{"state":"working"}"#);
    let Frame::Ack(a) = frame(&hex_bytes(&blocks[1])) else {
        panic!("§13.1's second dump is not an Ack")
    };
    assert_eq!((a.key, a.direction, a.seq), (key(), Direction::Up, 7));
    let Frame::Data(t) = frame(&hex_bytes(&blocks[2])) else {
        panic!("§13.1's third dump is not a Data frame")
    };
    assert_eq!(
        (t.seq, t.terminal, t.payload.as_ref()),
        (9, Some(Outcome::Completed), &b"{}"[..])
    );
}

/// The §13.2 inputs, as its table gives them.
fn vector_identity() -> Identity {
    Identity::from_secret(
        PeerId::new("acme/caller").unwrap(),
        KeyId::new("2026-01").unwrap(),
        [0x01; 32],
    )
}

fn vector_transcript(binding: &ChannelBinding) -> Vec<u8> {
    let id = vector_identity();
    transcript(&TranscriptFields {
        version: 1,
        nonce: &[0x11; 32],
        relay_id: &RelayId::new("relay.example.com").unwrap(),
        peer: &id.peer,
        key_id: &id.key_id,
        instance: &InstanceId([0x22; 16]),
        time_ms: 1_767_225_600_123,
        binding,
    })
}

/// The hex digits at the start of `text` (after blanks and a backtick).
fn leading_hex(text: &str) -> Vec<u8> {
    let digits: String = text
        .trim_start()
        .trim_start_matches('`')
        .chars()
        .take_while(char::is_ascii_hexdigit)
        .collect();
    hex::decode(digits).unwrap()
}

#[test]
fn section_13_2_handshake_vector_is_recomputed_from_its_inputs() {
    let doc = doc();
    let text = section(&doc, "### 13.2");
    let id = vector_identity();
    let pk = id.public_key();
    assert!(
        text.contains(&pk.to_string()),
        "§13.2 shows the public key {pk}"
    );
    let blocks = code_blocks(text);
    assert_eq!(blocks.len(), 2, "§13.2 has the transcript and the Hello");
    let documented = hex_bytes(&blocks[0]);
    let computed = vector_transcript(&ChannelBinding::ChallengeOnly);
    assert_eq!(documented.len(), 132);
    assert_eq!(documented, computed, "the challenge-only transcript");
    let signature = id.sign(&computed);
    // The first "Signature:" is the challenge-only one, the second the
    // tls-exporter one.
    let mut parts = text.split("Signature:");
    parts.next();
    let challenge_only = leading_hex(parts.next().unwrap());
    assert_eq!(challenge_only, signature.to_vec());
    let exporter = leading_hex(parts.next().unwrap());
    let tls = vector_transcript(&ChannelBinding::TlsExporter([0xa5; 32]));
    assert_eq!(tls.len(), 164, "the tls-exporter transcript is 164 bytes");
    assert_eq!(tls[..0x80], computed[..0x80]);
    assert_eq!(exporter, id.sign(&tls).to_vec());
    let hello_bytes = hex_bytes(&blocks[1]);
    assert_eq!(hello_bytes.len(), 168);
    let Frame::Hello(h) = frame(&hello_bytes) else {
        panic!("§13.2's second dump is not a Hello")
    };
    assert_eq!(h.signature, signature);
    assert_eq!((&h.peer, &h.key_id), (&id.peer, &id.key_id));
    assert_eq!(
        (h.time_ms, h.nonce, h.instance),
        (1_767_225_600_123, [0x11; 32], InstanceId([0x22; 16]))
    );
    assert!(pk.verify_strict(&computed, &h.signature));
}

#[test]
fn section_13_3_frames_decode_to_what_their_labels_say() {
    let doc = doc();
    let text = section(&doc, "### 13.3");
    let blocks = code_blocks(text);
    assert_eq!(blocks.len(), 2, "§13.3 has the frame list and the Open");
    // Split the list into (label, bytes).
    let mut frames: Vec<(String, String)> = Vec::new();
    for line in blocks[0].lines() {
        if line.starts_with(|c: char| c.is_ascii_alphabetic()) {
            let (label, rest) = match line.rfind(')') {
                Some(i) => (&line[..=i], &line[i + 1..]),
                None => line.split_once(' ').unwrap_or((line, "")),
            };
            frames.push((label.to_string(), rest.to_string()));
        } else {
            let last = frames.last_mut().expect("bytes before any label");
            last.1.push('\n');
            last.1.push_str(line);
        }
    }
    let names: Vec<&str> = frames
        .iter()
        .map(|(l, _)| l.split(' ').next().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "Challenge",
            "Welcome",
            "Resume",
            "Gap",
            "Error",
            "Ping",
            "Drain",
            "PeersQuery"
        ]
    );
    for (label, hex) in &frames {
        let f = frame(&hex_bytes(hex));
        let name = label.split(' ').next().unwrap();
        assert_eq!(
            f.frame_type().name().replace('_', ""),
            name.to_ascii_lowercase(),
            "{label}"
        );
        match f {
            Frame::Challenge(c) => {
                assert_eq!(c.nonce, [0x11; 32]);
                assert_eq!(c.relay_id.as_str(), "relay.example.com");
                assert_eq!(c.server_time_ms, 1_767_225_600_000);
            }
            Frame::Welcome(w) => {
                assert_eq!(w.epoch, 0x0123_4567_89ab_cdef);
                assert_eq!(w.heartbeat_ms, 15_000);
            }
            Frame::Resume(r) => assert_eq!((r.key, r.after), (key(), 6)),
            Frame::Ping(p) => assert_eq!(p.token, 42),
            Frame::Drain(d) => assert_eq!(d.reconnect_after_ms, 1000),
            _ => {}
        }
    }
    let open = hex_bytes(&blocks[1]);
    let Frame::Open(o) = frame(&open) else {
        panic!("§13.3's second dump is not an Open")
    };
    assert_eq!(o.payload.as_ref(), br#"{"task":"x"}"#);
    assert_eq!(o.digest, Digest::of(&o.payload));
    assert!(
        text.contains(&o.digest.to_string()),
        "§13.3 states the Open's digest {}",
        o.digest
    );
    assert_eq!(
        (
            o.target.as_str(),
            o.deadline_ms,
            o.depth,
            o.ceiling.as_str()
        ),
        ("beta/worker", 1_767_225_900_000, 1, "")
    );
}

/// The JSON objects in `text` that start with `{"key":`.
fn cursor_examples(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(i) = rest.find("{\"key\":") {
        let mut depth = 0;
        let mut end = i;
        for (j, c) in rest[i..].char_indices() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        end = i + j + 1;
                        break;
                    }
                }
                _ => {}
            }
        }
        out.push(rest[i..end].replace('\n', ""));
        rest = &rest[end..];
    }
    out
}

#[test]
fn welcome_examples_parse_as_cursors_without_the_terminal_this_relay_never_sends() {
    let doc = doc();
    let mut examples = cursor_examples(section(&doc, "### 6.6"));
    examples.extend(cursor_examples(section(&doc, "### 13.4")));
    assert!(examples.len() >= 3, "{examples:?}");
    for e in &examples {
        let c: DelegationCursor =
            serde_json::from_str(e).unwrap_or_else(|err| panic!("{e}: {err}"));
        assert_eq!(c.terminal, None, "a listed delegation is unfinished: {e}");
    }
}

#[test]
fn section_5_identity_file_example_parses_and_holds_the_vector_key() {
    let doc = doc();
    let text = section(&doc, "## 5.");
    let block = code_blocks(text)
        .into_iter()
        .find(|b| b.contains("oab-identity-v1"))
        .expect("§5 shows an identity file");
    let id = Identity::from_file_str(&block, "docs/protocol.md §5").unwrap();
    assert_eq!(id.public_key(), vector_identity().public_key());
    // What keygen writes has the same shape.
    let written = vector_identity().to_file_string();
    let back = Identity::from_file_str(&written, "written").unwrap();
    assert_eq!(back.public_key(), id.public_key());
    assert!(written.contains(block.lines().find(|l| l.starts_with("secret_key")).unwrap()));
}
