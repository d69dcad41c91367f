//! Error codes carried in `Error` frames and WebSocket close codes.
//!
//! Close codes live in the private range 4000-4999 (RFC 6455 section 7.4.2)
//! and are split in two: **4000-4499 mean "reconnect"** (with backoff; the
//! condition is transient and nothing acknowledged was lost), **4500-4999 mean
//! "do not retry"** until an operator fixed something (a key, a clock, a
//! version, the config). A connector decides what to do from the range alone,
//! so new codes stay safe for old connectors.
//!
//! Never: decides more about a code than the range rule
//! (`close_code_should_reconnect`) and `ErrorCode::is_retryable`: a code is a
//! number and a stable snake_case name, and the text a peer reads travels
//! beside it.

use std::fmt;

macro_rules! wire_enum {
    (
        $(#[$meta:meta])*
        $vis:vis enum $name:ident : $repr:ty {
            $( $(#[$vmeta:meta])* $variant:ident = $value:literal => $text:literal, )+
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[repr($repr)]
        $vis enum $name {
            $( $(#[$vmeta])* $variant = $value, )+
        }

        impl $name {
            /// Every value, in declaration order.
            pub const ALL: &'static [$name] = &[$($name::$variant),+];

            /// The numeric value on the wire.
            pub const fn as_u16(self) -> u16 {
                self as u16
            }

            /// The value for a number, if it is a known one.
            pub const fn from_u16(value: u16) -> Option<Self> {
                match value {
                    $( $value => Some($name::$variant), )+
                    _ => None,
                }
            }

            /// The stable snake_case name used in logs, metrics and docs.
            pub const fn name(self) -> &'static str {
                match self {
                    $( $name::$variant => $text, )+
                }
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.name())
            }
        }
    };
}

wire_enum! {
    /// A typed error carried by an `Error` frame. The connection stays open:
    /// these refuse one frame or one delegation, not the session.
    pub enum ErrorCode: u16 {
        /// The frame is valid but not allowed in this state (for example a
        /// `Welcome` sent by a connector).
        ProtocolViolation = 1 => "protocol_violation",
        /// No configured route lets the sender reach the target peer.
        RouteDenied = 2 => "route_denied",
        /// No such delegation, or it belongs to another peer (both are answered
        /// alike so ids of other peers cannot be probed).
        UnknownDelegation = 3 => "unknown_delegation",
        /// An `Open` reused a request id with a different payload digest.
        IdempotencyMismatch = 4 => "idempotency_mismatch",
        /// The delegation already has its one terminal.
        AlreadyTerminal = 5 => "already_terminal",
        /// A sequence number skipped ahead of the log: frames are missing before it.
        SequenceGap = 6 => "sequence_gap",
        /// The per-peer or per-route cap on open delegations is reached.
        TooManyDelegations = 7 => "too_many_delegations",
        /// The payload is larger than the route allows.
        PayloadTooLarge = 8 => "payload_too_large",
        /// The peer's frame rate is over its quota; retry later.
        RateLimited = 9 => "rate_limited",
        /// The session is not the sender of that direction of the delegation.
        NotSender = 10 => "not_sender",
        /// The deadline is in the past or beyond the route's maximum.
        InvalidDeadline = 11 => "invalid_deadline",
        /// The delegation depth is over the allowed maximum (one).
        DepthExceeded = 12 => "depth_exceeded",
        /// The durable store did not accept the append; nothing was acknowledged.
        StoreUnavailable = 13 => "store_unavailable",
        /// A published descriptor is larger than the relay accepts.
        DescriptorTooLarge = 14 => "descriptor_too_large",
        /// The payload digest of an `Open` does not match its payload.
        DigestMismatch = 15 => "digest_mismatch",
        /// An unexpected relay fault; details are in the relay log only.
        Internal = 16 => "internal",
    }
}

impl ErrorCode {
    /// Whether sending the same frame again later may succeed.
    pub const fn is_retryable(self) -> bool {
        matches!(
            self,
            ErrorCode::TooManyDelegations | ErrorCode::RateLimited | ErrorCode::StoreUnavailable
        )
    }
}

wire_enum! {
    /// A WebSocket close code used by the relay and the connector.
    pub enum CloseCode: u16 {
        /// The relay is shutting down or draining (a `Drain` frame came first).
        GoingAway = 4000 => "going_away",
        /// The receiver did not keep up: its send queue overflowed. Everything
        /// is in the durable log; reconnect and resume.
        SlowConsumer = 4001 => "slow_consumer",
        /// The TLS, WebSocket or session handshake did not finish in time.
        HandshakeTimeout = 4002 => "handshake_timeout",
        /// The relay is at its connection or handshake cap.
        Overloaded = 4003 => "overloaded",
        /// Too many connection attempts or frames; back off.
        RateLimited = 4004 => "rate_limited",
        /// The durable store is unreachable; the relay cannot acknowledge frames.
        StoreUnavailable = 4005 => "store_unavailable",
        /// No frame or pong arrived within the heartbeat timeout.
        IdleTimeout = 4006 => "idle_timeout",
        /// An unexpected internal fault; reconnect.
        InternalError = 4007 => "internal_error",
        /// A later connection of the same connector process already is the
        /// peer's session: this older attempt (one whose handshake the
        /// relay finished late, e.g. after a store outage) is closed instead
        /// of replacing it. Reconnect if this is the connection in use.
        Superseded = 4008 => "superseded",
        /// A frame broke the protocol (wrong state, wrong sender).
        ProtocolViolation = 4500 => "protocol_violation",
        /// A frame was over the header or payload limit.
        FrameTooLarge = 4501 => "frame_too_large",
        /// A frame could not be decoded.
        MalformedFrame = 4502 => "malformed_frame",
        /// The protocol versions of the two sides do not overlap.
        UnsupportedVersion = 4503 => "unsupported_version",
        /// The session handshake failed (unknown peer or key, bad signature,
        /// key outside its validity window, nonce reuse).
        AuthFailed = 4504 => "auth_failed",
        /// A newer session of the same peer replaced this one. Do not reconnect
        /// from this process: another instance holds the identity.
        Replaced = 4505 => "replaced",
        /// The peers' clocks differ by more than the allowed skew.
        ClockSkew = 4506 => "clock_skew",
        /// The relay requires TLS channel binding and the connector offered none.
        BindingRequired = 4507 => "binding_required",
        /// A configuration reload on the relay removed this peer, or retired
        /// the key this session authenticated with (removed it, or its
        /// validity window ended). Do not reconnect with the same identity
        /// and key: the relay would refuse it (`auth_failed`).
        Revoked = 4508 => "revoked",
    }
}

/// The first close code of the "do not retry" range.
pub const NO_RETRY_FROM: u16 = 4500;

impl CloseCode {
    /// Whether a connector should reconnect after this close (with backoff).
    pub const fn should_reconnect(self) -> bool {
        (self as u16) < NO_RETRY_FROM
    }
}

/// Whether a raw close code (possibly unknown to this version) asks for a
/// reconnect. Codes outside 4000-4999 (normal closes, transport errors) do.
pub const fn close_code_should_reconnect(code: u16) -> bool {
    !(code >= NO_RETRY_FROM && code <= 4999)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip_and_are_unique() {
        let mut seen = std::collections::HashSet::new();
        for c in ErrorCode::ALL {
            assert_eq!(ErrorCode::from_u16(c.as_u16()), Some(*c));
            assert!(seen.insert(c.name()));
        }
        for c in CloseCode::ALL {
            assert_eq!(CloseCode::from_u16(c.as_u16()), Some(*c));
            assert!((4000..5000).contains(&c.as_u16()));
            assert!(seen.insert(c.name()) || ErrorCode::ALL.iter().any(|e| e.name() == c.name()));
        }
        assert_eq!(ErrorCode::from_u16(0), None);
        assert_eq!(CloseCode::from_u16(1000), None);
    }

    #[test]
    fn close_ranges_split_reconnect_from_no_retry() {
        assert!(CloseCode::SlowConsumer.should_reconnect());
        assert!(CloseCode::GoingAway.should_reconnect());
        assert!(!CloseCode::Replaced.should_reconnect());
        assert!(!CloseCode::AuthFailed.should_reconnect());
        assert!(close_code_should_reconnect(1006));
        assert!(close_code_should_reconnect(4499));
        assert!(!close_code_should_reconnect(4999));
    }
}
