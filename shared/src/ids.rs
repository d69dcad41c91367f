//! Identifiers that cross the wire: peers, keys, requests, relays, sessions,
//! process instances and delegation keys.
//!
//! String ids are ASCII with a restricted alphabet, validated once when they
//! are made or decoded, and backed by [`Bytes`] of their own: decoding a
//! frame copies an id out of the received message (at most
//! [`RequestId::MAX_LEN`] bytes), so an id kept in a map (a delegation's
//! view, a store key, a session's state) never keeps the whole received
//! frame (up to the payload limit) alive.
//!
//! Never: holds a value that failed its check: every way to make an id (`new`,
//! `from_bytes`, `FromStr`, `Deserialize`) validates it.

use std::fmt;

use bytes::Bytes;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Why a string is not a valid identifier.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid {kind} {value:?}: {reason}")]
pub struct IdError {
    /// Which kind of id was being made.
    pub kind: &'static str,
    /// The offending value (truncated to 64 bytes, lossy UTF-8).
    pub value: String,
    /// What rule it broke.
    pub reason: &'static str,
}

impl IdError {
    fn new(kind: &'static str, raw: &[u8], reason: &'static str) -> Self {
        let shown = raw.get(..raw.len().min(64)).unwrap_or_default();
        IdError {
            kind,
            value: String::from_utf8_lossy(shown).into_owned(),
            reason,
        }
    }
}

fn is_token_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-' | b':')
}

fn is_name_byte(b: u8) -> bool {
    b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'.' | b'_' | b'-')
}

/// Validates a token: 1..=max bytes of `[A-Za-z0-9._:-]`.
fn check_token(kind: &'static str, raw: &[u8], max: usize) -> Result<(), IdError> {
    if raw.is_empty() {
        return Err(IdError::new(kind, raw, "must not be empty"));
    }
    if raw.len() > max {
        return Err(IdError::new(kind, raw, "too long"));
    }
    if !raw.iter().all(|b| is_token_byte(*b)) {
        return Err(IdError::new(
            kind,
            raw,
            "only A-Z a-z 0-9 . _ : - are allowed",
        ));
    }
    Ok(())
}

/// Validates a peer id: `namespace/name`, each part 1..=63 bytes of
/// `[a-z0-9._-]` starting with a letter or digit.
fn check_peer(raw: &[u8]) -> Result<(), IdError> {
    const KIND: &str = "peer id";
    if raw.len() > PeerId::MAX_LEN {
        return Err(IdError::new(KIND, raw, "too long"));
    }
    let mut parts = raw.split(|b| *b == b'/');
    let (Some(ns), Some(name), None) = (parts.next(), parts.next(), parts.next()) else {
        return Err(IdError::new(KIND, raw, "must be namespace/name"));
    };
    for part in [ns, name] {
        let Some(first) = part.first() else {
            return Err(IdError::new(
                KIND,
                raw,
                "namespace and name must not be empty",
            ));
        };
        if part.len() > 63 {
            return Err(IdError::new(
                KIND,
                raw,
                "namespace and name are at most 63 bytes",
            ));
        }
        if !(first.is_ascii_lowercase() || first.is_ascii_digit()) {
            return Err(IdError::new(KIND, raw, "each part starts with a-z or 0-9"));
        }
        if !part.iter().all(|b| is_name_byte(*b)) {
            return Err(IdError::new(KIND, raw, "only a-z 0-9 . _ - are allowed"));
        }
    }
    Ok(())
}

macro_rules! string_id {
    ($(#[$meta:meta])* $name:ident, $kind:literal, $check:expr) => {
        $(#[$meta])*
        #[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(Bytes);

        impl $name {
            /// Validates bytes and copies them into a buffer of the id's
            /// own: `raw` is typically a slice of a received frame, which the
            /// id must not keep alive.
            pub fn from_bytes(raw: Bytes) -> Result<Self, IdError> {
                Self::from_slice(&raw)
            }

            /// Validates and copies a string.
            pub fn new(s: &str) -> Result<Self, IdError> {
                Self::from_slice(s.as_bytes())
            }

            fn from_slice(raw: &[u8]) -> Result<Self, IdError> {
                let check: fn(&[u8]) -> Result<(), IdError> = $check;
                check(raw)?;
                Ok($name(Bytes::copy_from_slice(raw)))
            }

            /// The id as a string slice.
            pub fn as_str(&self) -> &str {
                // Validated ASCII at construction, so this never falls back.
                std::str::from_utf8(&self.0).unwrap_or_default()
            }

            /// The id's bytes.
            pub fn as_bytes(&self) -> &[u8] {
                &self.0
            }

            /// The id's backing buffer.
            pub fn to_bytes(&self) -> Bytes {
                self.0.clone()
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}({:?})", stringify!($name), self.as_str())
            }
        }

        impl std::str::FromStr for $name {
            type Err = IdError;
            fn from_str(s: &str) -> Result<Self, IdError> {
                Self::new(s)
            }
        }

        impl Serialize for $name {
            fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(self.as_str())
            }
        }

        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let s = String::deserialize(d)?;
                Self::new(&s).map_err(serde::de::Error::custom)
            }
        }
    };
}

string_id!(
    /// A peer: one OAB host, `namespace/name` (for example `acme/build-bot`).
    PeerId, "peer id", check_peer
);
string_id!(
    /// The id of one of a peer's signing keys (for example `2026-11`), unique per peer.
    KeyId, "key id", |raw| check_token("key id", raw, KeyId::MAX_LEN)
);
string_id!(
    /// The caller's idempotency key for a delegation, unique per caller.
    RequestId, "request id", |raw| check_token("request id", raw, RequestId::MAX_LEN)
);
string_id!(
    /// The id a relay signs into handshakes, so a transcript for one relay is
    /// useless at another (for example `relay.example.com`).
    RelayId, "relay id", |raw| check_token("relay id", raw, RelayId::MAX_LEN)
);

impl PeerId {
    /// Longest peer id in bytes (two 63-byte parts and the slash).
    pub const MAX_LEN: usize = 127;
}
impl KeyId {
    /// Longest key id in bytes.
    pub const MAX_LEN: usize = 64;
}
impl RequestId {
    /// Longest request id in bytes.
    pub const MAX_LEN: usize = 128;
}
impl RequestId {
    /// The request id prefix of the delegations a connector's OpenAB CP
    /// endpoint sends for the CP delegation id `delegation_id`: `cp-<id>-`
    /// for an id of at most 96 bytes of `A-Z a-z 0-9 . _ : -`, else
    /// `cp-h<16 hex of its SHA-256>-`. The endpoint appends 16 random hex
    /// digits ([`RequestId::for_cp_delegation`]), so the relay can find a
    /// delegation by the id its OpenAB runtime knows (`oab-relay inspect`).
    pub fn cp_prefix(delegation_id: &str) -> String {
        let plain = !delegation_id.is_empty()
            && delegation_id.len() <= 96
            && delegation_id.bytes().all(is_token_byte);
        if plain {
            format!("cp-{delegation_id}-")
        } else {
            let d = crate::Digest::of(delegation_id.as_bytes());
            let hex = crate::digest::hex(&d.0);
            format!("cp-h{}-", hex.get(..16).unwrap_or(&hex))
        }
    }

    /// A fresh request id for the CP delegation id `delegation_id`:
    /// [`RequestId::cp_prefix`] and 16 random hex digits (at most 116
    /// bytes, so always valid).
    pub fn for_cp_delegation(delegation_id: &str) -> RequestId {
        let mut b = [0u8; 8];
        rand_core::RngCore::fill_bytes(&mut rand_core::OsRng, &mut b);
        let text = format!(
            "{}{}",
            Self::cp_prefix(delegation_id),
            crate::digest::hex(&b)
        );
        RequestId(Bytes::from(text))
    }
}

impl RelayId {
    /// Longest relay id in bytes.
    pub const MAX_LEN: usize = 128;
}

macro_rules! random_id {
    ($(#[$meta:meta])* $name:ident) => {
        $(#[$meta])*
        #[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(pub [u8; 16]);

        impl $name {
            /// A fresh random id from the operating system's generator.
            pub fn random() -> Self {
                let mut b = [0u8; 16];
                rand_core::RngCore::fill_bytes(&mut rand_core::OsRng, &mut b);
                $name(b)
            }

            /// Lower-case hex form.
            pub fn to_hex(&self) -> String {
                crate::digest::hex(&self.0)
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.to_hex())
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}({})", stringify!($name), self.to_hex())
            }
        }
    };
}

random_id!(
    /// One incarnation of a connector's callee work: a process start, or the
    /// life of a state folder that keeps the id and the records to re-attach
    /// to accepted work. A callee that comes back with another instance id
    /// lost whatever it was running.
    InstanceId
);
random_id!(
    /// One authenticated session, minted by the relay in its `Welcome`.
    SessionId
);

/// The identity of a delegation: the caller's peer id and its request id.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct DelegationKey {
    /// The peer that opened the delegation.
    pub caller: PeerId,
    /// The caller's idempotency key.
    pub request_id: RequestId,
}

impl DelegationKey {
    /// Builds a key.
    pub fn new(caller: PeerId, request_id: RequestId) -> Self {
        DelegationKey { caller, request_id }
    }

    /// The id a connector's A2A facade gives the delegation's task until
    /// the callee's own task id is known: `task-` and 32 hex digits of the
    /// SHA-256 of the key's text form. Derived, so a restarted connector
    /// answers to the ids its clients hold, and the relay can find a
    /// delegation by it.
    pub fn a2a_task_id(&self) -> String {
        let d = crate::Digest::of(self.to_string().as_bytes());
        let hex = crate::digest::hex(&d.0);
        format!("task-{}", hex.get(..32).unwrap_or(&hex))
    }
}

impl std::str::FromStr for DelegationKey {
    type Err = IdError;

    /// The text form `Display` writes: `<caller peer id>#<request id>`
    /// (neither may contain `#`).
    fn from_str(s: &str) -> Result<Self, IdError> {
        let Some((caller, request_id)) = s.split_once('#') else {
            return Err(IdError::new(
                "delegation key",
                s.as_bytes(),
                "must be <caller peer id>#<request id>",
            ));
        };
        Ok(DelegationKey {
            caller: PeerId::new(caller)?,
            request_id: RequestId::new(request_id)?,
        })
    }
}

impl fmt::Display for DelegationKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}#{}", self.caller, self.request_id)
    }
}

impl fmt::Debug for DelegationKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DelegationKey({self})")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_delegation_key_reads_back_its_text_form() {
        let key = DelegationKey::new(
            PeerId::new("acme/build-bot").unwrap(),
            RequestId::new("req-1").unwrap(),
        );
        let text = key.to_string();
        assert_eq!(text, "acme/build-bot#req-1");
        assert_eq!(text.parse::<DelegationKey>().unwrap(), key);
        for (bad, why) in [
            ("acme/build-bot", "#"),
            ("acme#req-1", "namespace/name"),
            ("acme/build-bot#", "request id"),
            ("acme/build-bot#a#b", "allowed"),
        ] {
            let err = bad.parse::<DelegationKey>().unwrap_err();
            assert!(err.to_string().contains(why), "{bad}: {err}");
        }
        let task = key.a2a_task_id();
        assert!(task.starts_with("task-") && task.len() == 37, "{task}");
        let other = DelegationKey::new(key.caller, RequestId::new("req-2").unwrap());
        assert_ne!(task, other.a2a_task_id(), "one id per delegation");
    }

    #[test]
    fn peer_ids() {
        for ok in ["acme/build-bot", "a/b", "0ns/x.y_z-1"] {
            assert!(PeerId::new(ok).is_ok(), "{ok}");
        }
        let long = format!("{}/{}", "a".repeat(63), "b".repeat(63));
        assert!(PeerId::new(&long).is_ok());
        for (bad, why) in [
            ("", "namespace/name"),
            ("acme", "namespace/name"),
            ("a/b/c", "namespace/name"),
            ("/b", "empty"),
            ("a/", "empty"),
            ("Acme/x", "starts"),
            ("a/-x", "starts"),
            ("a/x y", "allowed"),
            ("a/xé", "allowed"),
        ] {
            let err = PeerId::new(bad).unwrap_err();
            assert!(err.to_string().contains(why), "{bad}: {err}");
        }
        let too_long = format!("{}/{}", "a".repeat(64), "b");
        assert!(PeerId::new(&too_long).is_err());
    }

    #[test]
    fn tokens() {
        assert!(RequestId::new("req-1:2026.11_30").is_ok());
        // CP delegation ids: plain ones readable, others hashed; always valid.
        for (cp, prefix) in [
            ("deleg-7", "cp-deleg-7-".to_string()),
            ("a b/c", RequestId::cp_prefix("a b/c")),
            (&*"x".repeat(97), RequestId::cp_prefix(&"x".repeat(97))),
            ("", RequestId::cp_prefix("")),
        ] {
            let r = RequestId::for_cp_delegation(cp);
            assert!(RequestId::new(r.as_str()).is_ok(), "{r}");
            assert!(r.as_str().starts_with(&prefix), "{r}");
            assert_eq!(r.as_str().len(), prefix.len() + 16);
            assert_ne!(r, RequestId::for_cp_delegation(cp));
        }
        assert!(RequestId::cp_prefix("a b/c").starts_with("cp-h"));
        assert_eq!(RequestId::cp_prefix("a b/c").len(), "cp-h".len() + 17);
        assert!(RequestId::new(&"r".repeat(128)).is_ok());
        assert!(RequestId::new(&"r".repeat(129)).is_err());
        assert!(RequestId::new("").is_err());
        assert!(KeyId::new("k 1").is_err());
        assert!(RelayId::new("relay.example.com:443").is_ok());
    }

    #[test]
    fn serde_validates() {
        let p: PeerId = serde_json::from_str("\"acme/x\"").unwrap();
        assert_eq!(p.as_str(), "acme/x");
        assert!(serde_json::from_str::<PeerId>("\"ACME/x\"").is_err());
        assert_eq!(serde_json::to_string(&p).unwrap(), "\"acme/x\"");
    }

    /// An id decoded from a frame owns its bytes: keeping it (a map key,
    /// a store key) does not keep the received message alive.
    #[test]
    fn ids_decoded_from_a_frame_do_not_share_its_buffer() {
        let frame = crate::Frame::Data(crate::Data {
            key: DelegationKey::new(
                PeerId::new("acme/caller").unwrap(),
                RequestId::new("r-1").unwrap(),
            ),
            direction: crate::Direction::Up,
            seq: 1,
            terminal: None,
            flags: 0,
            payload: Bytes::from(vec![7u8; 64 * 1024]),
        });
        let msg = crate::encode(&frame).unwrap();
        let limits = crate::Limits::default();
        let crate::Frame::Data(d) = crate::decode_message(msg.clone(), &limits).unwrap() else {
            panic!("not data");
        };
        let received = msg.as_ptr_range();
        for id in [d.key.caller.as_bytes(), d.key.request_id.as_bytes()] {
            assert!(
                !received.contains(&id.as_ptr()),
                "the id points into the received message"
            );
        }
        assert_eq!(d.key.caller.as_str(), "acme/caller");
        assert_eq!(d.key.request_id.as_str(), "r-1");
    }

    #[test]
    fn random_ids_differ() {
        assert_ne!(InstanceId::random(), InstanceId::random());
        assert_eq!(SessionId([0xab; 16]).to_hex().len(), 32);
    }
}
