//! Every way the relay refuses a frame from an authenticated peer. A refused
//! frame gets an `Error` frame and the session continues; this module owns
//! the [`Refusal`] naming each case and, in one place, the wire code and the
//! message text each one is sent with. Handlers in [`crate::session`] name a
//! refusal; [`crate::hub::Hub::refuse`] sends it. Connectors, operators and
//! tests match on both the code and the text, so the texts here are part of
//! the protocol (docs/protocol.md §8 and §10).
//!
//! Closes (a frame before authentication, a text message, an undecodable
//! frame, a handshake failure) are not refusals: they end the connection
//! with a close code instead, and are not listed here.
//!
//! Never: change a code or a text without docs/protocol.md; tell a missing
//! delegation apart from a delegation of other peers (both are
//! [`Refusal::NoSuchDelegation`], so ids cannot be probed); put secrets,
//! payload bytes or store error details in a text (a text reaches the peer,
//! and the wire cuts it at 255 bytes).

use std::borrow::Cow;

use oab_wire::{ErrorCode, FrameType, Outcome};

use crate::store::Budget;

/// Why a peer's frame was refused. Each variant is sent with one code and one
/// text ([`Refusal::code`], [`Refusal::message`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// A frame the relay does not take from a connector once the session is
    /// authenticated: one the relay sends (`Challenge`, `Welcome`, `Ack`,
    /// `Gap`, `Drain`, ...).
    NotForTheRelay {
        /// The type of the frame received.
        frame: FrameType,
    },
    /// A second `Hello` on an authenticated session: a connector sends its
    /// `Hello` once, in answer to the `Challenge`.
    HelloAgain,
    /// An `Open` whose key names a caller other than the session's peer.
    OpenForAnotherCaller,
    /// A `Data` or `Cancel` with the relay-origin flag set: only the relay
    /// sets it.
    RelayOriginFlag,
    /// A `Publish` whose descriptor does not parse as JSON.
    DescriptorNotJson,
    /// A `Publish` whose descriptor is over `limits.max_descriptor`.
    DescriptorTooLarge,
    /// A `Data` or `Cancel` for a delegation that does not exist (never
    /// created, expired past retention), or for a log the session's peer may
    /// not write (other peers' delegation, or the wrong side of this one).
    /// Both are answered alike so that delegations of other peers cannot be
    /// probed.
    NoSuchDelegation,
    /// An `Open` to a target with no configured route from the sender.
    NoRoute,
    /// An `Open` whose request id is already stored with another payload
    /// digest (a retry with the same digest is acknowledged instead).
    IdempotencyMismatch,
    /// An append to a delegation that already has its terminal.
    AlreadyTerminal {
        /// The outcome the delegation ended with.
        outcome: Outcome,
    },
    /// An append whose seq skips ahead of the log; the `Error` frame's seq is
    /// the log's tail, and the sender resends from the one after it.
    SequenceGap,
    /// An `Open` over the per-caller or per-route cap on open delegations.
    TooManyDelegations,
    /// An `Open`, `Data` or `Cancel` whose payload is over the route's
    /// `max_payload` (a frame over the global limit is a close instead).
    PayloadTooLarge,
    /// A `Data` or `Cancel` the store refused because storing it would pass
    /// a byte budget (`store.max_delegation_bytes` for the delegation's
    /// logs, `store.max_peer_bytes` for what the peer holds in its open
    /// delegations). Nothing was stored.
    OverBudget {
        /// Which budget.
        budget: Budget,
    },
    /// An `Open`, `Data` or `Cancel` in a batch over the peer's frame rate.
    RateLimited,
    /// A `Resume`, `PeersQuery` or `Publish` over the peer's request rate
    /// (`rate.peer_requests_per_second`, `rate.peer_requests_burst`).
    RequestRateLimited,
    /// An `Open` whose deadline is in the past or further away than the
    /// route's `max_deadline_ms`.
    InvalidDeadline {
        /// The route's longest deadline, ms from now.
        max_deadline_ms: u64,
    },
    /// An `Open` whose depth is 0 or over the route's `max_depth`.
    DepthExceeded {
        /// The route's deepest allowed delegation.
        max_depth: u8,
    },
    /// An `Open` whose digest is not the SHA-256 of its payload.
    DigestMismatch,
    /// An `Open`, `Data` or `Cancel` the store did not accept (or could not
    /// be looked up): nothing was acknowledged; the sender resends.
    StoreUnavailable,
    /// A `Resume` whose delegation the store could not look up.
    StoreUnavailableOnResume,
    /// A `Publish` the store did not accept.
    StoreUnavailableOnPublish,
    /// An `Open` whose frame could not be encoded again with the route's
    /// capability ceiling stamped in.
    CeilingNotStamped,
}

impl Refusal {
    /// The code of the `Error` frame.
    pub fn code(&self) -> ErrorCode {
        match self {
            Refusal::NotForTheRelay { .. }
            | Refusal::HelloAgain
            | Refusal::OpenForAnotherCaller
            | Refusal::RelayOriginFlag
            | Refusal::DescriptorNotJson => ErrorCode::ProtocolViolation,
            Refusal::DescriptorTooLarge => ErrorCode::DescriptorTooLarge,
            Refusal::NoSuchDelegation => ErrorCode::UnknownDelegation,
            Refusal::NoRoute => ErrorCode::RouteDenied,
            Refusal::IdempotencyMismatch => ErrorCode::IdempotencyMismatch,
            Refusal::AlreadyTerminal { .. } => ErrorCode::AlreadyTerminal,
            Refusal::SequenceGap => ErrorCode::SequenceGap,
            Refusal::TooManyDelegations => ErrorCode::TooManyDelegations,
            Refusal::PayloadTooLarge | Refusal::OverBudget { .. } => ErrorCode::PayloadTooLarge,
            Refusal::RateLimited | Refusal::RequestRateLimited => ErrorCode::RateLimited,
            Refusal::InvalidDeadline { .. } => ErrorCode::InvalidDeadline,
            Refusal::DepthExceeded { .. } => ErrorCode::DepthExceeded,
            Refusal::DigestMismatch => ErrorCode::DigestMismatch,
            Refusal::StoreUnavailable
            | Refusal::StoreUnavailableOnResume
            | Refusal::StoreUnavailableOnPublish => ErrorCode::StoreUnavailable,
            Refusal::CeilingNotStamped => ErrorCode::Internal,
        }
    }

    /// The text of the `Error` frame.
    pub fn message(&self) -> Cow<'static, str> {
        let text = match self {
            Refusal::NotForTheRelay { frame } => {
                return format!("{} frames are sent by the relay, not to it", frame.name()).into();
            }
            Refusal::AlreadyTerminal { outcome } => {
                return format!("the delegation already ended: {outcome}").into();
            }
            Refusal::InvalidDeadline { max_deadline_ms } => {
                return format!(
                    "deadline must be in the future and at most {max_deadline_ms} ms away"
                )
                .into();
            }
            Refusal::DepthExceeded { max_depth } => {
                return format!("depth must be 1..={max_depth}").into();
            }
            Refusal::HelloAgain => {
                "the session is already authenticated; a hello is sent once, at the start"
            }
            Refusal::OpenForAnotherCaller => "an open names its sender as caller",
            Refusal::RelayOriginFlag => "the relay-origin flag is set by the relay only",
            Refusal::DescriptorNotJson => "a descriptor is a JSON document",
            Refusal::DescriptorTooLarge => "descriptor over the relay's limit",
            Refusal::NoSuchDelegation => "no such delegation",
            Refusal::NoRoute => "no route from this peer to the target",
            Refusal::IdempotencyMismatch => "this request id was used with a different payload",
            Refusal::SequenceGap => {
                "sequence skips ahead of the log; resend from seq+1 of this error"
            }
            Refusal::TooManyDelegations => "too many open delegations; retry later",
            Refusal::PayloadTooLarge => "payload over the limit of its route (or max_payload)",
            Refusal::OverBudget {
                budget: Budget::Delegation,
            } => "the delegation's stored bytes would pass the relay's budget",
            Refusal::OverBudget {
                budget: Budget::Peer,
            } => "this peer's stored bytes would pass the relay's budget",
            Refusal::RateLimited => "frame rate over quota; resend later",
            Refusal::RequestRateLimited => "request rate over quota; ask again later",
            Refusal::DigestMismatch => "digest is not the SHA-256 of the payload",
            Refusal::StoreUnavailable => "store unavailable; resend later",
            Refusal::StoreUnavailableOnResume => "store unavailable; resume later",
            Refusal::StoreUnavailableOnPublish => "store unavailable; publish later",
            Refusal::CeilingNotStamped => "could not stamp the capability ceiling",
        };
        Cow::Borrowed(text)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    /// Every refusal with the code and text peers receive (the texts
    /// predate this module; connectors and tests match on them).
    fn table() -> Vec<(Refusal, ErrorCode, &'static str)> {
        use ErrorCode as C;
        use Refusal as R;
        vec![
            (
                R::NotForTheRelay {
                    frame: FrameType::Ack,
                },
                C::ProtocolViolation,
                "ack frames are sent by the relay, not to it",
            ),
            (
                R::HelloAgain,
                C::ProtocolViolation,
                "the session is already authenticated; a hello is sent once, at the start",
            ),
            (
                R::OpenForAnotherCaller,
                C::ProtocolViolation,
                "an open names its sender as caller",
            ),
            (
                R::RelayOriginFlag,
                C::ProtocolViolation,
                "the relay-origin flag is set by the relay only",
            ),
            (
                R::DescriptorNotJson,
                C::ProtocolViolation,
                "a descriptor is a JSON document",
            ),
            (
                R::DescriptorTooLarge,
                C::DescriptorTooLarge,
                "descriptor over the relay's limit",
            ),
            (
                R::NoSuchDelegation,
                C::UnknownDelegation,
                "no such delegation",
            ),
            (
                R::NoRoute,
                C::RouteDenied,
                "no route from this peer to the target",
            ),
            (
                R::IdempotencyMismatch,
                C::IdempotencyMismatch,
                "this request id was used with a different payload",
            ),
            (
                R::AlreadyTerminal {
                    outcome: Outcome::Expired,
                },
                C::AlreadyTerminal,
                "the delegation already ended: expired",
            ),
            (
                R::SequenceGap,
                C::SequenceGap,
                "sequence skips ahead of the log; resend from seq+1 of this error",
            ),
            (
                R::TooManyDelegations,
                C::TooManyDelegations,
                "too many open delegations; retry later",
            ),
            (
                R::PayloadTooLarge,
                C::PayloadTooLarge,
                "payload over the limit of its route (or max_payload)",
            ),
            (
                R::OverBudget {
                    budget: Budget::Delegation,
                },
                C::PayloadTooLarge,
                "the delegation's stored bytes would pass the relay's budget",
            ),
            (
                R::OverBudget {
                    budget: Budget::Peer,
                },
                C::PayloadTooLarge,
                "this peer's stored bytes would pass the relay's budget",
            ),
            (
                R::RateLimited,
                C::RateLimited,
                "frame rate over quota; resend later",
            ),
            (
                R::RequestRateLimited,
                C::RateLimited,
                "request rate over quota; ask again later",
            ),
            (
                R::InvalidDeadline {
                    max_deadline_ms: 90_000,
                },
                C::InvalidDeadline,
                "deadline must be in the future and at most 90000 ms away",
            ),
            (
                R::DepthExceeded { max_depth: 3 },
                C::DepthExceeded,
                "depth must be 1..=3",
            ),
            (
                R::DigestMismatch,
                C::DigestMismatch,
                "digest is not the SHA-256 of the payload",
            ),
            (
                R::StoreUnavailable,
                C::StoreUnavailable,
                "store unavailable; resend later",
            ),
            (
                R::StoreUnavailableOnResume,
                C::StoreUnavailable,
                "store unavailable; resume later",
            ),
            (
                R::StoreUnavailableOnPublish,
                C::StoreUnavailable,
                "store unavailable; publish later",
            ),
            (
                R::CeilingNotStamped,
                C::Internal,
                "could not stamp the capability ceiling",
            ),
        ]
    }

    #[test]
    fn every_refusal_keeps_its_code_and_text() {
        for (refusal, code, text) in table() {
            assert_eq!(refusal.code(), code, "{refusal:?}");
            assert_eq!(refusal.message(), text, "{refusal:?}");
        }
    }

    /// The position of each variant: adding a variant fails to compile here
    /// until it has one, and then fails
    /// [`the_table_names_every_refusal`] until the table has its row.
    fn ordinal(r: &Refusal) -> usize {
        match r {
            Refusal::NotForTheRelay { .. } => 0,
            Refusal::OpenForAnotherCaller => 1,
            Refusal::RelayOriginFlag => 2,
            Refusal::DescriptorNotJson => 3,
            Refusal::DescriptorTooLarge => 4,
            Refusal::NoSuchDelegation => 5,
            Refusal::NoRoute => 6,
            Refusal::IdempotencyMismatch => 7,
            Refusal::AlreadyTerminal { .. } => 8,
            Refusal::SequenceGap => 9,
            Refusal::TooManyDelegations => 10,
            Refusal::PayloadTooLarge => 11,
            Refusal::RateLimited => 12,
            Refusal::InvalidDeadline { .. } => 13,
            Refusal::DepthExceeded { .. } => 14,
            Refusal::DigestMismatch => 15,
            Refusal::StoreUnavailable => 16,
            Refusal::StoreUnavailableOnResume => 17,
            Refusal::StoreUnavailableOnPublish => 18,
            Refusal::CeilingNotStamped => 19,
            Refusal::OverBudget {
                budget: Budget::Delegation,
            } => 20,
            Refusal::OverBudget {
                budget: Budget::Peer,
            } => 21,
            Refusal::RequestRateLimited => 22,
            Refusal::HelloAgain => 23,
        }
    }
    const VARIANTS: usize = 24;

    #[test]
    fn the_table_names_every_refusal() {
        let listed: std::collections::BTreeSet<usize> =
            table().iter().map(|(r, _, _)| ordinal(r)).collect();
        let all: std::collections::BTreeSet<usize> = (0..VARIANTS).collect();
        assert_eq!(listed, all, "one row per refusal");
        assert_eq!(table().len(), VARIANTS, "no refusal listed twice");
    }

    /// Every text fits the wire's 255-byte limit on `Error.message`, even
    /// with the largest value a field can carry.
    #[test]
    fn every_text_fits_the_wire_limit() {
        let widest = [
            Refusal::InvalidDeadline {
                max_deadline_ms: u64::MAX,
            },
            Refusal::DepthExceeded { max_depth: u8::MAX },
        ];
        for r in table().into_iter().map(|(r, _, _)| r).chain(widest) {
            assert!(r.message().len() <= 255, "{r:?}");
        }
    }
}
