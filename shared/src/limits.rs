//! Size limits of the wire protocol, with the reason for each default.
//!
//! Every limit is checked from the fixed 8-byte frame prefix, before the rest
//! of a frame is buffered (see [`crate::codec`]). The relay publishes the
//! limits it enforces in its `Welcome`, so a connector can refuse locally what
//! the relay would refuse remotely.
//!
//! Never: holds a limit that needs more than the prefix to check, and
//! [`Limits::validate`] never admits a header limit under [`MIN_HEADER_LIMIT`]
//! or a payload limit over [`MAX_PAYLOAD_CEILING`].

/// Length of the fixed frame prefix: version (1), type (1), header length (2),
/// payload length (4).
pub const PREFIX_LEN: usize = 8;

/// Default maximum header length (bytes after the prefix, before the payload).
///
/// The largest header is an `Open`: two peer ids (127 bytes each plus a length
/// byte), a request id (128 + 1), a digest (32), deadline, depth and a
/// relay-stamped capability ceiling. 1 KiB leaves room for a ceiling of some
/// 40 capability names while keeping a hostile header cheap to refuse.
pub const DEFAULT_MAX_HEADER: u16 = 1024;

/// Default maximum payload length: 1 MiB.
///
/// Payloads are A2A events and results (status updates, artifacts). Large
/// artifacts belong behind a URL part; 1 MiB fits a generous text artifact and
/// bounds the memory a single in-flight frame can pin in the relay.
pub const DEFAULT_MAX_PAYLOAD: u32 = 1024 * 1024;

/// The largest payload limit a configuration may set: 16 MiB.
///
/// Beyond this a single frame would dominate a session's queue bound and the
/// Redis stream entry size; split such data into several events instead.
pub const MAX_PAYLOAD_CEILING: u32 = 16 * 1024 * 1024;

/// The smallest header limit a configuration may set: every frame with
/// maximal ids must still fit. The largest fixed-size header is an `Error`
/// with a delegation key and a 255-byte message (525 bytes); an `Open` with
/// maximal ids takes 428 bytes plus its capability ceiling.
pub const MIN_HEADER_LIMIT: u16 = 640;

/// Header bytes of an `Open` with maximal ids, not counting the ceiling text.
pub const OPEN_HEADER_WITHOUT_CEILING: usize = 428;

/// The frame size limits one side enforces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Maximum header length in bytes (after the prefix).
    pub max_header: u16,
    /// Maximum payload length in bytes.
    pub max_payload: u32,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_header: DEFAULT_MAX_HEADER,
            max_payload: DEFAULT_MAX_PAYLOAD,
        }
    }
}

impl Limits {
    /// The largest whole frame these limits admit; use it as the WebSocket
    /// message and frame size cap so the transport refuses what the codec would.
    pub fn max_frame(&self) -> usize {
        PREFIX_LEN + usize::from(self.max_header) + self.max_payload as usize
    }

    /// Checks that the limits are inside the ranges the protocol allows.
    pub fn validate(&self) -> Result<(), String> {
        if self.max_header < MIN_HEADER_LIMIT {
            return Err(format!(
                "max_header must be at least {MIN_HEADER_LIMIT} bytes (got {})",
                self.max_header
            ));
        }
        if self.max_payload == 0 || self.max_payload > MAX_PAYLOAD_CEILING {
            return Err(format!(
                "max_payload must be between 1 and {MAX_PAYLOAD_CEILING} bytes (got {})",
                self.max_payload
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_bounded() {
        let l = Limits::default();
        assert!(l.validate().is_ok());
        assert_eq!(l.max_frame(), 8 + 1024 + 1024 * 1024);
    }

    #[test]
    fn out_of_range_limits_are_refused() {
        let small = Limits {
            max_header: 639,
            ..Limits::default()
        };
        assert!(small.validate().unwrap_err().contains("max_header"));
        let big = Limits {
            max_payload: MAX_PAYLOAD_CEILING + 1,
            ..Limits::default()
        };
        assert!(big.validate().unwrap_err().contains("max_payload"));
        let zero = Limits {
            max_payload: 0,
            ..Limits::default()
        };
        assert!(zero.validate().is_err());
    }
}
