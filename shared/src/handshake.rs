//! The session handshake as a pure state machine (no sockets, no clocks: the
//! caller passes `now_ms`), so every refusal is testable in memory.
//!
//! ```text
//! relay                                   connector
//!   Challenge{nonce, relay_id, time, versions}  ->
//!                                         <-  Hello{version, peer, key_id, instance,
//!                                                   time, relay_id, nonce, binding, sig}
//!   verify: deadline, version, relay id, nonce (single use), clock skew,
//!           binding, peer, key, key window, signature (strict)
//!   Welcome{session, heartbeat, limits, open delegations}  ->
//! ```
//!
//! The signature covers a domain-separated transcript (see [`transcript`]),
//! bound to the TLS session with the RFC 9266 `tls-exporter` value unless the
//! relay runs behind a TLS-terminating load balancer (explicit
//! [`Binding::ChallengeOnly`]).
//!
//! Never: accepts a challenge nonce twice (the ledger consumes it, and holds at
//! most `capacity` outstanding), a hello without TLS binding when the policy
//! requires one, or a key outside its validity window.

use std::collections::HashMap;

use bytes::{BufMut, BytesMut};

use crate::code::CloseCode;
use crate::frame::{Binding, Challenge, Hello, PROTOCOL_VERSION};
use crate::identity::{Identity, KeyWindow, TrustStore};
use crate::ids::{InstanceId, KeyId, PeerId, RelayId};

/// Domain-separation context at the start of every handshake transcript.
pub const TRANSCRIPT_CONTEXT: &[u8] = b"oab-relay/v1 session-handshake\0";

/// RFC 9266 exporter label for `tls-exporter` channel binding (32 bytes, no context).
pub const TLS_EXPORTER_LABEL: &[u8] = b"EXPORTER-Channel-Binding";

/// Lowest protocol version this crate accepts.
pub const MIN_VERSION: u8 = PROTOCOL_VERSION;
/// Highest protocol version this crate accepts.
pub const MAX_VERSION: u8 = PROTOCOL_VERSION;

/// Why a handshake was refused. Each variant is distinct so operators can
/// tell what to fix; [`HandshakeError::close_code`] and
/// [`HandshakeError::public_reason`] say what the other side is told.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HandshakeError {
    /// The versions of the two sides do not overlap.
    #[error(
        "protocol version {offered} is not supported (supported: {min}..={max}); \
         upgrade the older side: relay and connectors must share a version"
    )]
    UnsupportedVersion {
        /// What the other side offered.
        offered: u8,
        /// Lowest supported here.
        min: u8,
        /// Highest supported here.
        max: u8,
    },
    /// The peer is not in the configuration.
    #[error("peer {0} is not configured")]
    UnknownPeer(String),
    /// The peer has no key with that id.
    #[error("peer {peer} has no key {key_id}")]
    UnknownKey {
        /// The peer.
        peer: String,
        /// The key id it used.
        key_id: String,
    },
    /// The key's `not_before` is in the future.
    #[error("key {0} is not valid yet")]
    KeyNotYetValid(String),
    /// The key's `not_after` has passed.
    #[error("key {0} has expired")]
    KeyExpired(String),
    /// The signature does not verify over the transcript.
    #[error("signature does not verify")]
    BadSignature,
    /// The nonce was already used (or never issued, or expired).
    #[error("challenge nonce already used or expired")]
    NonceReused,
    /// The hello answers another connection's challenge.
    #[error("hello answers a different challenge")]
    ChallengeMismatch,
    /// The hello was made for another relay.
    #[error("hello is for relay {got}, this is {expected}")]
    RelayMismatch {
        /// This relay's id.
        expected: String,
        /// The id the hello names.
        got: String,
    },
    /// The two clocks differ too much.
    #[error("clock skew of {skew_ms} ms is over the limit of {max_ms} ms; check NTP on both hosts")]
    ClockSkew {
        /// Observed difference.
        skew_ms: u64,
        /// Allowed difference.
        max_ms: u64,
    },
    /// The relay requires TLS channel binding and the hello is challenge-only.
    #[error("this relay requires TLS channel binding; the connector offered challenge-only")]
    BindingRequired,
    /// The hello is bound to TLS but the relay does not terminate TLS itself.
    #[error(
        "the connector bound its hello to TLS but this relay sits behind a TLS-terminating \
         load balancer; set the connector to challenge-only binding"
    )]
    BindingUnavailable,
    /// The handshake took longer than its deadline.
    #[error("handshake not finished within {0} ms")]
    Deadline(u64),
    /// Too many handshakes are in progress.
    #[error("too many handshakes in progress")]
    Overloaded,
}

impl HandshakeError {
    /// The WebSocket close code for this refusal.
    pub fn close_code(&self) -> CloseCode {
        match self {
            HandshakeError::UnsupportedVersion { .. } => CloseCode::UnsupportedVersion,
            HandshakeError::ClockSkew { .. } => CloseCode::ClockSkew,
            HandshakeError::BindingRequired | HandshakeError::BindingUnavailable => {
                CloseCode::BindingRequired
            }
            HandshakeError::Deadline(_) => CloseCode::HandshakeTimeout,
            HandshakeError::Overloaded => CloseCode::Overloaded,
            _ => CloseCode::AuthFailed,
        }
    }

    /// What the relay tells the connector. Identity failures are collapsed
    /// into one message so peer and key ids cannot be probed; the relay logs
    /// the precise error.
    pub fn public_reason(&self) -> String {
        match self {
            HandshakeError::UnknownPeer(_)
            | HandshakeError::UnknownKey { .. }
            | HandshakeError::BadSignature
            | HandshakeError::KeyNotYetValid(_)
            | HandshakeError::KeyExpired(_)
            | HandshakeError::NonceReused
            | HandshakeError::ChallengeMismatch => {
                "authentication failed: check the peer id, key id and key validity against \
                 the relay configuration"
                    .to_string()
            }
            other => other.to_string(),
        }
    }
}

/// The transport binding value the signer and verifier both compute.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChannelBinding {
    /// The 32-byte RFC 9266 exporter value of this TLS session.
    TlsExporter([u8; 32]),
    /// No transport binding (relay behind a TLS-terminating load balancer).
    ChallengeOnly,
}

impl ChannelBinding {
    /// The binding mode announced in the hello.
    pub fn mode(&self) -> Binding {
        match self {
            ChannelBinding::TlsExporter(_) => Binding::TlsExporter,
            ChannelBinding::ChallengeOnly => Binding::ChallengeOnly,
        }
    }
}

/// The fields a handshake signature covers.
#[derive(Debug, Clone, Copy)]
pub struct TranscriptFields<'a> {
    /// Chosen protocol version.
    pub version: u8,
    /// Challenge nonce.
    pub nonce: &'a [u8; 32],
    /// Relay id.
    pub relay_id: &'a RelayId,
    /// Peer id.
    pub peer: &'a PeerId,
    /// Key id.
    pub key_id: &'a KeyId,
    /// Instance id.
    pub instance: &'a InstanceId,
    /// Signer's clock.
    pub time_ms: u64,
    /// Transport binding.
    pub binding: &'a ChannelBinding,
}

/// The exact bytes a connector signs: the context string, then every field
/// with a fixed size or a u16 length prefix, so no two field lists encode alike.
pub fn transcript(f: &TranscriptFields<'_>) -> Vec<u8> {
    fn lp(buf: &mut BytesMut, b: &[u8]) {
        // Every field is bounded far below 65,535 bytes by its id type.
        buf.put_u16(u16::try_from(b.len()).unwrap_or(u16::MAX));
        buf.put_slice(b);
    }
    let mut buf = BytesMut::with_capacity(256);
    buf.put_slice(TRANSCRIPT_CONTEXT);
    buf.put_u8(f.version);
    buf.put_slice(f.nonce);
    lp(&mut buf, f.relay_id.as_bytes());
    lp(&mut buf, f.peer.as_bytes());
    lp(&mut buf, f.key_id.as_bytes());
    buf.put_slice(&f.instance.0);
    buf.put_u64(f.time_ms);
    buf.put_u8(f.binding.mode() as u8);
    match f.binding {
        ChannelBinding::TlsExporter(v) => lp(&mut buf, v),
        ChannelBinding::ChallengeOnly => lp(&mut buf, &[]),
    }
    buf.to_vec()
}

/// Issued challenge nonces, each usable once, bounded in count and age.
#[derive(Debug)]
pub struct NonceLedger {
    outstanding: HashMap<[u8; 32], u64>,
    capacity: usize,
    ttl_ms: u64,
}

impl NonceLedger {
    /// A ledger holding at most `capacity` outstanding nonces, each valid for `ttl_ms`.
    pub fn new(capacity: usize, ttl_ms: u64) -> Self {
        NonceLedger {
            outstanding: HashMap::new(),
            capacity,
            ttl_ms,
        }
    }

    /// Issues a fresh random nonce. Refuses when `capacity` nonces are
    /// outstanding and none has expired.
    pub fn issue(&mut self, now_ms: u64) -> Result<[u8; 32], HandshakeError> {
        if self.outstanding.len() >= self.capacity {
            self.outstanding.retain(|_, exp| *exp >= now_ms);
            if self.outstanding.len() >= self.capacity {
                return Err(HandshakeError::Overloaded);
            }
        }
        let mut nonce = [0u8; 32];
        rand_core::RngCore::fill_bytes(&mut rand_core::OsRng, &mut nonce);
        self.outstanding
            .insert(nonce, now_ms.saturating_add(self.ttl_ms));
        Ok(nonce)
    }

    /// Uses a nonce up. True only for an issued, unexpired, unused nonce.
    pub fn consume(&mut self, nonce: &[u8; 32], now_ms: u64) -> bool {
        matches!(self.outstanding.remove(nonce), Some(exp) if exp >= now_ms)
    }

    /// Forgets a nonce whose handshake was abandoned.
    pub fn forget(&mut self, nonce: &[u8; 32]) {
        self.outstanding.remove(nonce);
    }

    /// Nonces currently outstanding.
    pub fn len(&self) -> usize {
        self.outstanding.len()
    }

    /// Whether none is outstanding.
    pub fn is_empty(&self) -> bool {
        self.outstanding.is_empty()
    }
}

/// The relay's rules for accepting a hello.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HandshakePolicy {
    /// Largest accepted difference between the hello's time and the relay's, ms.
    pub max_skew_ms: u64,
    /// Time from challenge to verified hello, ms.
    pub deadline_ms: u64,
    /// Whether a hello must be bound to the TLS session.
    pub require_tls_binding: bool,
}

impl Default for HandshakePolicy {
    fn default() -> Self {
        HandshakePolicy {
            max_skew_ms: 60_000,
            deadline_ms: 10_000,
            require_tls_binding: true,
        }
    }
}

/// A verified peer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Authenticated {
    /// The peer.
    pub peer: PeerId,
    /// The key it proved.
    pub key_id: KeyId,
    /// Its process instance.
    pub instance: InstanceId,
    /// The agreed protocol version.
    pub version: u8,
}

/// The relay side of one connection's handshake.
#[derive(Debug)]
pub struct ServerHandshake {
    relay_id: RelayId,
    nonce: [u8; 32],
    started_ms: u64,
}

impl ServerHandshake {
    /// Issues a challenge for a new connection.
    pub fn start(
        relay_id: RelayId,
        now_ms: u64,
        ledger: &mut NonceLedger,
    ) -> Result<(Self, Challenge), HandshakeError> {
        let nonce = ledger.issue(now_ms)?;
        let challenge = Challenge {
            nonce,
            relay_id: relay_id.clone(),
            server_time_ms: now_ms,
            min_version: MIN_VERSION,
            max_version: MAX_VERSION,
        };
        Ok((
            ServerHandshake {
                relay_id,
                nonce,
                started_ms: now_ms,
            },
            challenge,
        ))
    }

    /// The nonce this handshake issued (to forget it if the connection drops).
    pub fn nonce(&self) -> &[u8; 32] {
        &self.nonce
    }

    /// Verifies a hello. `binding` is what the relay observes of the
    /// transport: the exporter value when it terminates TLS itself,
    /// `ChallengeOnly` behind a TLS-terminating load balancer.
    pub fn verify(
        &self,
        hello: &Hello,
        trust: &dyn TrustStore,
        ledger: &mut NonceLedger,
        policy: &HandshakePolicy,
        now_ms: u64,
        binding: &ChannelBinding,
    ) -> Result<Authenticated, HandshakeError> {
        if now_ms.saturating_sub(self.started_ms) > policy.deadline_ms {
            ledger.forget(&self.nonce);
            return Err(HandshakeError::Deadline(policy.deadline_ms));
        }
        if !(MIN_VERSION..=MAX_VERSION).contains(&hello.version) {
            return Err(HandshakeError::UnsupportedVersion {
                offered: hello.version,
                min: MIN_VERSION,
                max: MAX_VERSION,
            });
        }
        if hello.relay_id != self.relay_id {
            return Err(HandshakeError::RelayMismatch {
                expected: self.relay_id.to_string(),
                got: hello.relay_id.to_string(),
            });
        }
        if hello.nonce != self.nonce {
            return Err(HandshakeError::ChallengeMismatch);
        }
        if !ledger.consume(&hello.nonce, now_ms) {
            return Err(HandshakeError::NonceReused);
        }
        let skew_ms = hello.time_ms.abs_diff(now_ms);
        if skew_ms > policy.max_skew_ms {
            return Err(HandshakeError::ClockSkew {
                skew_ms,
                max_ms: policy.max_skew_ms,
            });
        }
        match (hello.binding, binding) {
            // Whatever the relay observes: a policy that requires binding
            // never accepts an unbound hello (fail closed on a misconfiguration).
            (Binding::ChallengeOnly, _) if policy.require_tls_binding => {
                return Err(HandshakeError::BindingRequired);
            }
            (Binding::TlsExporter, ChannelBinding::ChallengeOnly) => {
                return Err(HandshakeError::BindingUnavailable);
            }
            _ => {}
        }
        let signed_binding = match hello.binding {
            Binding::TlsExporter => *binding,
            Binding::ChallengeOnly => ChannelBinding::ChallengeOnly,
        };
        let keys = trust
            .peer_keys(&hello.peer)
            .ok_or_else(|| HandshakeError::UnknownPeer(hello.peer.to_string()))?;
        let key = keys
            .iter()
            .find(|k| k.key_id == hello.key_id)
            .ok_or_else(|| HandshakeError::UnknownKey {
                peer: hello.peer.to_string(),
                key_id: hello.key_id.to_string(),
            })?;
        match key.window(now_ms) {
            KeyWindow::Valid => {}
            KeyWindow::NotYetValid => {
                return Err(HandshakeError::KeyNotYetValid(hello.key_id.to_string()));
            }
            KeyWindow::Expired => return Err(HandshakeError::KeyExpired(hello.key_id.to_string())),
        }
        let message = transcript(&TranscriptFields {
            version: hello.version,
            nonce: &hello.nonce,
            relay_id: &hello.relay_id,
            peer: &hello.peer,
            key_id: &hello.key_id,
            instance: &hello.instance,
            time_ms: hello.time_ms,
            binding: &signed_binding,
        });
        if !key.public_key.verify_strict(&message, &hello.signature) {
            return Err(HandshakeError::BadSignature);
        }
        Ok(Authenticated {
            peer: hello.peer.clone(),
            key_id: hello.key_id.clone(),
            instance: hello.instance,
            version: hello.version,
        })
    }
}

/// The connector side: answers a challenge.
///
/// `expected_relay` pins the relay id when the connector is configured with
/// one, so a challenge from the wrong relay is refused before signing.
pub fn answer_challenge(
    identity: &Identity,
    challenge: &Challenge,
    expected_relay: Option<&RelayId>,
    instance: InstanceId,
    now_ms: u64,
    binding: &ChannelBinding,
) -> Result<Hello, HandshakeError> {
    if !(challenge.min_version..=challenge.max_version).contains(&PROTOCOL_VERSION) {
        return Err(HandshakeError::UnsupportedVersion {
            offered: PROTOCOL_VERSION,
            min: challenge.min_version,
            max: challenge.max_version,
        });
    }
    if let Some(expected) = expected_relay
        && *expected != challenge.relay_id
    {
        return Err(HandshakeError::RelayMismatch {
            expected: expected.to_string(),
            got: challenge.relay_id.to_string(),
        });
    }
    let message = transcript(&TranscriptFields {
        version: PROTOCOL_VERSION,
        nonce: &challenge.nonce,
        relay_id: &challenge.relay_id,
        peer: &identity.peer,
        key_id: &identity.key_id,
        instance: &instance,
        time_ms: now_ms,
        binding,
    });
    Ok(Hello {
        version: PROTOCOL_VERSION,
        peer: identity.peer.clone(),
        key_id: identity.key_id.clone(),
        instance,
        time_ms: now_ms,
        relay_id: challenge.relay_id.clone(),
        nonce: challenge.nonce,
        binding: binding.mode(),
        signature: identity.sign(&message),
    })
}
