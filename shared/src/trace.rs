//! Trace ids: one W3C Trace Context trace id per delegation, carried from
//! the caller's request to the callee's agent and printed in every
//! process's log lines for that delegation.
//!
//! The signed delegation request carries the caller's trace id as text
//! (`parent.trace_id`); [`TraceId::of_text`] turns any such text into the
//! same 16 bytes on every side: a W3C trace id (32 lower-case hex digits,
//! not all zero) is taken as it is, a whole `traceparent` header gives its
//! trace id, and any other text is hashed. The caller's connector also puts
//! the id in its `Open` header (protocol version 2), so the relay can log it
//! without reading the signed payload.
//!
//! Never: reads a clock or keeps state; the only randomness is a fresh id
//! or span id for a request that arrived without one.

use std::fmt;

use sha2::{Digest as _, Sha256};

/// A W3C Trace Context trace id: 16 bytes, never all zero.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TraceId([u8; 16]);

impl TraceId {
    /// The id from its 16 bytes; `None` for all zeros (invalid in W3C).
    pub fn from_bytes(bytes: [u8; 16]) -> Option<TraceId> {
        (bytes != [0; 16]).then_some(TraceId(bytes))
    }

    /// Its 16 bytes.
    pub fn to_bytes(self) -> [u8; 16] {
        self.0
    }

    /// A fresh random id.
    pub fn random() -> TraceId {
        loop {
            let mut b = [0u8; 16];
            rand_core::RngCore::fill_bytes(&mut rand_core::OsRng, &mut b);
            if let Some(id) = TraceId::from_bytes(b) {
                return id;
            }
        }
    }

    /// The id of its W3C text form: exactly 32 lower-case hex digits, not
    /// all zero.
    pub fn parse(text: &str) -> Option<TraceId> {
        if text.len() != 32 || !text.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
            return None;
        }
        let mut b = [0u8; 16];
        hex::decode_to_slice(text, &mut b).ok()?;
        TraceId::from_bytes(b)
    }

    /// The trace id of a W3C `traceparent` header
    /// (`<version>-<trace-id>-<parent-id>-<flags>`), as the specification's
    /// parsing rules have it: version `00` is exactly four fields; a later
    /// version (not `ff`) may add fields after the flags; an all-zero trace
    /// id or parent id, upper-case hex or a bad length make it invalid.
    pub fn from_traceparent(header: &str) -> Option<TraceId> {
        let header = header.trim_matches(|c| c == ' ' || c == '\t');
        let mut fields = header.split('-');
        let version = fields.next()?;
        let trace = fields.next()?;
        let parent = fields.next()?;
        let flags = fields.next()?;
        let lower_hex = |s: &str, n: usize| {
            s.len() == n && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
        };
        if !lower_hex(version, 2) || version == "ff" || !lower_hex(flags, 2) {
            return None;
        }
        if version == "00" && fields.next().is_some() {
            return None;
        }
        if !lower_hex(parent, 16) || parent == "0000000000000000" {
            return None;
        }
        TraceId::parse(trace)
    }

    /// The id a caller's trace text stands for, the same on every side: a
    /// W3C trace id as it is, a `traceparent` header's trace id, else the
    /// first 16 bytes of the text's SHA-256 (a free-form trace id, such as
    /// an OpenAB delegation id, keeps one stable W3C id).
    pub fn of_text(text: &str) -> TraceId {
        if let Some(id) = TraceId::parse(text).or_else(|| TraceId::from_traceparent(text)) {
            return id;
        }
        let digest = Sha256::digest(text.as_bytes());
        let mut b = [0u8; 16];
        b.copy_from_slice(digest.get(..16).unwrap_or(&[1; 16]));
        // A hash of all zeros is as likely as a collision; map it anyway.
        TraceId::from_bytes(b).unwrap_or(TraceId([1; 16]))
    }

    /// Lower-case hex, the W3C text form.
    pub fn to_hex(self) -> String {
        crate::digest::hex(&self.0)
    }

    /// A `traceparent` header for a request sent on behalf of this trace:
    /// version `00`, a fresh span id, sampled.
    pub fn traceparent(self) -> String {
        let mut span = [0u8; 8];
        while span == [0; 8] {
            rand_core::RngCore::fill_bytes(&mut rand_core::OsRng, &mut span);
        }
        format!("00-{}-{}-01", self.to_hex(), crate::digest::hex(&span))
    }
}

impl fmt::Display for TraceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl fmt::Debug for TraceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "TraceId({})", self.to_hex())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    const W3C_EXAMPLE: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn the_w3c_example_header_gives_its_trace_id() {
        let id = TraceId::from_traceparent(W3C_EXAMPLE).unwrap();
        assert_eq!(id.to_hex(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(TraceId::of_text(W3C_EXAMPLE), id);
        assert_eq!(TraceId::of_text("4bf92f3577b34da6a3ce929d0e0e4736"), id);
    }

    #[test]
    fn invalid_headers_give_nothing() {
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "0-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ] {
            assert_eq!(TraceId::from_traceparent(bad), None, "{bad:?}");
        }
        // A later version may carry more fields.
        assert!(
            TraceId::from_traceparent(
                "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-more"
            )
            .is_some()
        );
    }

    #[test]
    fn free_text_hashes_to_a_stable_valid_id() {
        let a = TraceId::of_text("cp-delegation-42");
        assert_eq!(a, TraceId::of_text("cp-delegation-42"));
        assert_ne!(a, TraceId::of_text("cp-delegation-43"));
        assert_eq!(TraceId::parse(&a.to_hex()), Some(a));
    }

    #[test]
    fn a_header_made_here_parses_back_to_its_trace() {
        let id = TraceId::random();
        let header = id.traceparent();
        assert_eq!(header.len(), 55);
        assert_eq!(TraceId::from_traceparent(&header), Some(id));
        assert_eq!(TraceId::from_bytes([0; 16]), None);
    }
}
