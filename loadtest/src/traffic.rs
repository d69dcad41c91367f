//! The frames a scenario sends and the checks its receivers apply.
//!
//! Every benchmark payload starts with a 24-byte stamp: the frame's down-log
//! sequence, the sender's send time and its scheduled send time (nanoseconds
//! on this process's monotonic clock, [`now_ns`]); the rest is a fixed
//! filler. A receiver checks each frame against that: its sequence is the
//! next one expected (else it is a duplicate or out of order), and its
//! payload is exactly what the sender built for that sequence (else it is
//! corrupt). What never arrives is lost. These are the correctness
//! invariants `--check` enforces; they never depend on timing.

use std::collections::BTreeSet;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use anyhow::{Context as _, ensure};
use bytes::{BufMut as _, Bytes, BytesMut};
use oab_wire::{Data, DelegationKey, Direction, Frame, encode};
use serde::Serialize;
use tokio::sync::Notify;

/// Bytes of the stamp at the start of every payload: sequence, send time,
/// scheduled send time (three big-endian u64).
pub const STAMP_LEN: usize = 24;

/// Nanoseconds since this process first asked (a monotonic clock shared by
/// every endpoint in the process, so one-way and round-trip times need no
/// clock synchronisation).
pub fn now_ns() -> u64 {
    static BASE: OnceLock<Instant> = OnceLock::new();
    let base = *BASE.get_or_init(Instant::now);
    u64::try_from(base.elapsed().as_nanos()).unwrap_or(u64::MAX)
}

/// The filler byte at payload offset `i`: a pattern with period 251 (prime,
/// so it never lines up with power-of-two buffer sizes).
fn filler(i: usize) -> u8 {
    (i % 251) as u8
}

/// Encoded `Data` frames of one delegation log with a fixed payload size,
/// built by copying one template and patching the sequence and the stamp.
#[derive(Debug, Clone)]
pub struct DataTemplate {
    bytes: Vec<u8>,
    seq_at: usize,
    payload_at: usize,
    payload_len: usize,
}

impl DataTemplate {
    /// A template for `Data` frames on `key`'s `direction` log with
    /// `payload_len` bytes of payload (at least [`STAMP_LEN`]).
    pub fn new(
        key: &DelegationKey,
        direction: Direction,
        payload_len: usize,
    ) -> anyhow::Result<DataTemplate> {
        ensure!(
            payload_len >= STAMP_LEN,
            "payloads carry a {STAMP_LEN}-byte stamp: {payload_len} B is too small"
        );
        let payload = filler_payload(payload_len);
        let probe = 0x0102_0304_0506_0708u64;
        let frame = Frame::Data(Data {
            key: key.clone(),
            direction,
            seq: probe,
            terminal: None,
            flags: 0,
            payload,
        });
        let bytes = encode(&frame)
            .context("encoding the frame template")?
            .to_vec();
        let payload_at = bytes.len() - payload_len;
        // Locate the sequence field by its value instead of hard-coding the
        // header layout; the decode check below proves the patch is right.
        let seq_at = bytes
            .windows(8)
            .position(|w| w == probe.to_be_bytes())
            .filter(|at| *at < payload_at)
            .context("sequence field not found in the encoded header")?;
        let template = DataTemplate {
            bytes,
            seq_at,
            payload_at,
            payload_len,
        };
        let check = template.frame(42, 1, 2);
        match oab_wire::decode_message(check, &oab_wire::Limits::default())
            .context("decoding a patched frame")?
        {
            Frame::Data(d) if d.seq == 42 && stamp_of(&d.payload) == Some((42, 1, 2)) => {}
            other => anyhow::bail!("patched frame decodes wrong: {other:?}"),
        }
        Ok(template)
    }

    /// The payload size.
    pub fn payload_len(&self) -> usize {
        self.payload_len
    }

    /// Bytes of one encoded frame (prefix, header and payload).
    pub fn frame_len(&self) -> usize {
        self.bytes.len()
    }

    /// The encoded frame for `seq`, stamped with `sent_ns` and `scheduled_ns`.
    pub fn frame(&self, seq: u64, sent_ns: u64, scheduled_ns: u64) -> Bytes {
        let mut b = BytesMut::with_capacity(self.bytes.len());
        b.put_slice(&self.bytes);
        let p = self.payload_at;
        for (at, value) in [
            (self.seq_at, seq),
            (p, seq),
            (p + 8, sent_ns),
            (p + 16, scheduled_ns),
        ] {
            if let Some(field) = b.get_mut(at..at + 8) {
                field.copy_from_slice(&value.to_be_bytes());
            }
        }
        b.freeze()
    }
}

/// The stamp of a payload: (sequence, sent_ns, scheduled_ns).
pub fn stamp_of(payload: &[u8]) -> Option<(u64, u64, u64)> {
    let word = |i: usize| -> Option<u64> {
        let b: [u8; 8] = payload.get(i..i + 8)?.try_into().ok()?;
        Some(u64::from_be_bytes(b))
    };
    Some((word(0)?, word(8)?, word(16)?))
}

/// The payload a sender builds for `len` bytes, before the stamp is written.
fn filler_payload(len: usize) -> Bytes {
    (0..len).map(filler).collect::<Vec<u8>>().into()
}

/// How far ahead of the expected sequence a frame may be and still count as
/// reordered (tracked), rather than corrupt: far beyond any send window.
const MAX_SKIP: u64 = 1 << 20;

/// What a receiver saw on one log, checked frame by frame.
#[derive(Debug, Clone)]
pub struct StreamCheck {
    /// The payload every frame must carry after its stamp (compared with
    /// one `memcmp`, so checking costs little next to TLS).
    expected: Bytes,
    /// The payload stamp's sequence minus the header's (an echo on the up
    /// log carries the down frame's stamp: +1).
    stamp_offset: u64,
    next: u64,
    received: u64,
    duplicates: u64,
    reordered: u64,
    corrupt: u64,
    /// Sequences skipped by a frame that arrived early; removed when they
    /// arrive late.
    skipped: BTreeSet<u64>,
}

/// The verdict on a finished log.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct CheckReport {
    /// Distinct frames received.
    pub received: u64,
    /// Frames sent (or acknowledged) that never arrived.
    pub lost: u64,
    /// Frames that arrived again after their sequence was processed.
    pub duplicated: u64,
    /// Frames that arrived out of sequence order.
    pub reordered: u64,
    /// Frames whose payload differed from what was sent for that sequence.
    pub corrupt: u64,
}

impl CheckReport {
    /// Whether every invariant holds.
    pub fn is_clean(&self) -> bool {
        self.lost == 0 && self.duplicated == 0 && self.reordered == 0 && self.corrupt == 0
    }

    /// The violated invariants, in words.
    pub fn violations(&self, what: &str) -> Vec<String> {
        [
            ("lost", self.lost),
            ("duplicated", self.duplicated),
            ("reordered", self.reordered),
            ("corrupt", self.corrupt),
        ]
        .into_iter()
        .filter(|(_, n)| *n > 0)
        .map(|(name, n)| format!("{what}: {n} frame(s) {name}"))
        .collect()
    }
}

impl StreamCheck {
    /// Expects sequences from `first` on, with `payload_len`-byte payloads
    /// whose stamp sequence is the header's plus `stamp_offset`.
    pub fn new(first: u64, payload_len: usize, stamp_offset: u64) -> StreamCheck {
        StreamCheck {
            expected: filler_payload(payload_len),
            stamp_offset,
            next: first,
            received: 0,
            duplicates: 0,
            reordered: 0,
            corrupt: 0,
            skipped: BTreeSet::new(),
        }
    }

    /// Checks one frame. Returns whether it was new (not a duplicate).
    pub fn observe(&mut self, seq: u64, payload: &[u8]) -> bool {
        let intact = payload.len() == self.expected.len()
            && stamp_of(payload).is_some_and(|(s, _, _)| s == seq.wrapping_add(self.stamp_offset))
            && payload.get(STAMP_LEN..) == self.expected.get(STAMP_LEN..);
        if !intact {
            self.corrupt += 1;
        }
        if seq == self.next {
            self.next += 1;
        } else if seq > self.next && seq - self.next > MAX_SKIP {
            // No sender in this crate runs that far ahead: a forged or
            // mangled sequence, not a reordering.
            self.corrupt += 1;
            return false;
        } else if seq > self.next {
            self.reordered += 1;
            self.skipped.extend(self.next..seq);
            self.next = seq + 1;
        } else if self.skipped.remove(&seq) {
            // Arrived late: counted as reordered when the early one came.
        } else {
            self.duplicates += 1;
            return false;
        }
        self.received += 1;
        true
    }

    /// The next sequence expected in order.
    pub fn next(&self) -> u64 {
        self.next
    }

    /// The highest sequence up to which everything arrived.
    pub fn contiguous(&self) -> u64 {
        match self.skipped.first() {
            Some(first) => first - 1,
            None => self.next - 1,
        }
    }

    /// Distinct frames received so far.
    pub fn received(&self) -> u64 {
        self.received
    }

    /// The verdict, given the last sequence that should have arrived.
    pub fn report(&self, first: u64, last_expected: u64) -> CheckReport {
        let expected = (last_expected + 1).saturating_sub(first);
        CheckReport {
            received: self.received,
            lost: expected.saturating_sub(self.received),
            duplicated: self.duplicates,
            reordered: self.reordered,
            corrupt: self.corrupt,
        }
    }
}

/// A monotonically advancing position shared between tasks (the highest
/// acknowledged or received sequence), with a wake-up for waiters.
#[derive(Debug, Default)]
pub struct Progress {
    value: AtomicU64,
    /// Notified (one permit) on every advance.
    pub changed: Notify,
}

impl Progress {
    /// A position starting at `start`.
    pub fn new(start: u64) -> Progress {
        Progress {
            value: AtomicU64::new(start),
            changed: Notify::new(),
        }
    }

    /// The position now.
    pub fn get(&self) -> u64 {
        self.value.load(Ordering::Acquire)
    }

    /// Advances to `to` if it is further, and wakes a waiter.
    pub fn advance(&self, to: u64) {
        if self.value.fetch_max(to, Ordering::AcqRel) < to {
            self.changed.notify_one();
        }
    }

    /// Waits until the position reaches `at_least`.
    pub async fn wait_for(&self, at_least: u64) {
        while self.get() < at_least {
            self.changed.notified().await;
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::indexing_slicing)]
    use super::*;
    use oab_wire::{PeerId, RequestId};

    fn key() -> DelegationKey {
        DelegationKey::new(
            PeerId::new("bench/caller").unwrap(),
            RequestId::new("r-1").unwrap(),
        )
    }

    #[test]
    fn template_frames_decode_with_their_sequence_and_stamp() {
        for size in [STAMP_LEN, 64, 1024, 65_536] {
            let t = DataTemplate::new(&key(), Direction::Down, size).unwrap();
            let b = t.frame(7, 100, 90);
            assert_eq!(b.len(), t.frame_len());
            let Frame::Data(d) = oab_wire::decode_message(b, &oab_wire::Limits::default()).unwrap()
            else {
                panic!("not data")
            };
            assert_eq!(d.seq, 7);
            assert_eq!(d.payload.len(), size);
            assert_eq!(stamp_of(&d.payload), Some((7, 100, 90)));
            let mut c = StreamCheck::new(7, size, 0);
            assert!(c.observe(7, &d.payload));
            assert!(c.report(7, 7).is_clean());
        }
        assert!(DataTemplate::new(&key(), Direction::Down, 8).is_err());
    }

    fn payload(t: &DataTemplate, seq: u64) -> Bytes {
        let f = t.frame(seq, 0, 0);
        f.slice(f.len() - t.payload_len()..)
    }

    #[test]
    fn check_counts_loss_duplicates_reordering_and_corruption() {
        let t = DataTemplate::new(&key(), Direction::Down, 64).unwrap();
        let mut c = StreamCheck::new(2, 64, 0);
        for seq in [2, 3, 5, 4, 5, 6] {
            c.observe(seq, &payload(&t, seq));
        }
        let mut bad = payload(&t, 7).to_vec();
        bad[40] ^= 1;
        c.observe(7, &bad);
        // Frame 8 belongs to sequence 9: corrupt (wrong stamp).
        c.observe(8, &payload(&t, 9));
        let r = c.report(2, 10);
        assert_eq!(
            r,
            CheckReport {
                received: 7,
                lost: 2,
                duplicated: 1,
                reordered: 1,
                corrupt: 2
            }
        );
        assert_eq!(c.contiguous(), 8);
        assert_eq!(r.violations("x").len(), 4);
    }

    #[test]
    fn check_of_an_echo_uses_the_stamp_offset() {
        let t = DataTemplate::new(&key(), Direction::Down, 64).unwrap();
        let mut c = StreamCheck::new(1, 64, 1);
        // Up entry 1 echoes down entry 2.
        assert!(c.observe(1, &payload(&t, 2)));
        assert!(c.report(1, 1).is_clean());
    }

    #[tokio::test]
    async fn progress_wakes_a_waiter() {
        let p = std::sync::Arc::new(Progress::new(0));
        let waiter = {
            let p = p.clone();
            tokio::spawn(async move { p.wait_for(3).await })
        };
        p.advance(1);
        p.advance(3);
        waiter.await.unwrap();
        p.advance(2);
        assert_eq!(p.get(), 3);
    }
}
