//! `oab-wire`: the wire protocol shared by the OAB relay and its connectors.
//!
//! No I/O lives here: only types, byte layouts and pure state machines
//! (the identity file's text form included; the connector reads and writes
//! the file), so both sides use the same code and every rule is testable in
//! memory.
//!
//! | module | concern |
//! |---|---|
//! | [`limits`] | frame size limits and why each default is what it is |
//! | [`code`] | error codes (`Error` frames) and WebSocket close codes |
//! | [`ids`] | peer, key, request, relay, session, instance ids; delegation keys |
//! | [`frame`] | the frame types and their fields |
//! | [`codec`] | byte layout, encoder, and the decoder contract |
//! | [`digest`] | SHA-256 digests of exact bytes |
//! | [`identity`] | ed25519 identities, the identity file format, public keys, key windows |
//! | [`handshake`] | the session handshake transcript and state machine |
//! | [`envelope`] | signed envelopes (DSSE-style) for requests and results |
//! | [`trace`] | W3C trace ids, carried from a caller's request to the callee's agent |
//!
//! The protocol itself is specified in `docs/protocol.md`.
//!
//! Never: opens a socket or a file, spawns a task or keeps global state: every
//! function works on the values it is given (the clock is read only by
//! `identity::now_ms`, for the callers that ask, and the operating system's
//! randomness only where keys, nonces and ids are made).

#![deny(clippy::indexing_slicing, clippy::panic, clippy::unwrap_used)]

pub mod code;
pub mod codec;
pub mod digest;
pub mod envelope;
pub mod frame;
pub mod handshake;
pub mod identity;
pub mod ids;
pub mod limits;
pub mod trace;

pub use code::{CloseCode, ErrorCode};
pub use codec::{FrameDecoder, FrameError, decode_message, encode};
pub use digest::Digest;
pub use frame::*;
pub use ids::{DelegationKey, InstanceId, KeyId, PeerId, RelayId, RequestId, SessionId};
pub use limits::Limits;
pub use trace::TraceId;
