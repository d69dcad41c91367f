//! Peer identities: ed25519 key pairs, their file format, public keys in
//! text form, and key validity windows for rotation.
//!
//! **Identity file** (secret, written with mode 0600, refused when group or
//! others can read it):
//!
//! ```toml
//! # OAB Relay peer identity. Secret: keep this file private.
//! format = "oab-identity-v1"
//! peer = "acme/build-bot"
//! key_id = "2026-11"
//! secret_key = "<base64url, 32 bytes, no padding>"
//! public_key = "ed25519:<base64url, 32 bytes, no padding>"
//! ```
//!
//! **Public key text**: `ed25519:` followed by the 32-byte key in unpadded
//! base64url. This is what goes into the relay's and the other connectors'
//! peer configuration.
//!
//! Never: shows a secret key (`Debug` redacts it), and never touches the file
//! system: this is the file's text form only; writing and reading the file with
//! its permissions is the connector's `keyfile` module (and the relay's quick
//! start, for its development identities).

use std::fmt;

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use ed25519_dalek::{Signature, Signer as _, SigningKey, VerifyingKey};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::ids::{KeyId, PeerId};

/// The `format` value of identity files this version reads and writes.
pub const IDENTITY_FORMAT: &str = "oab-identity-v1";

/// Errors loading, saving or parsing identities and keys.
#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    /// The file's content is not a valid identity.
    #[error("{path}: {reason}")]
    Format {
        /// The file.
        path: String,
        /// What is wrong.
        reason: String,
    },
    /// A key in text form is not valid.
    #[error(
        "invalid public key {0:?}: expected ed25519:<43 base64url characters>, as \
         `oab-connector keygen` prints it"
    )]
    PublicKey(String),
}

/// An ed25519 public key in its text form `ed25519:<base64url>`.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct PublicKey(pub VerifyingKey);

impl PublicKey {
    /// Parses the text form.
    pub fn parse(s: &str) -> Result<Self, IdentityError> {
        let bad = || IdentityError::PublicKey(s.chars().take(80).collect());
        let b64 = s.strip_prefix("ed25519:").ok_or_else(bad)?;
        let raw = URL_SAFE_NO_PAD.decode(b64).map_err(|_| bad())?;
        let arr: [u8; 32] = raw.try_into().map_err(|_| bad())?;
        let key = VerifyingKey::from_bytes(&arr).map_err(|_| bad())?;
        if key.is_weak() {
            return Err(bad());
        }
        Ok(PublicKey(key))
    }

    /// Verifies with strict rules (no malleable or small-order signatures).
    pub fn verify_strict(&self, message: &[u8], signature: &[u8; 64]) -> bool {
        let sig = Signature::from_bytes(signature);
        self.0.verify_strict(message, &sig).is_ok()
    }
}

impl fmt::Display for PublicKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ed25519:{}", URL_SAFE_NO_PAD.encode(self.0.as_bytes()))
    }
}

impl fmt::Debug for PublicKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PublicKey({self})")
    }
}

impl std::str::FromStr for PublicKey {
    type Err = IdentityError;
    fn from_str(s: &str) -> Result<Self, IdentityError> {
        PublicKey::parse(s)
    }
}

impl Serialize for PublicKey {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for PublicKey {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        PublicKey::parse(&s).map_err(serde::de::Error::custom)
    }
}

/// A peer's own signing identity. `Debug` never shows the secret.
#[derive(Clone)]
pub struct Identity {
    /// The peer this identity belongs to.
    pub peer: PeerId,
    /// The id of this key among the peer's keys.
    pub key_id: KeyId,
    signing: SigningKey,
}

impl fmt::Debug for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Identity")
            .field("peer", &self.peer)
            .field("key_id", &self.key_id)
            .field("public_key", &self.public_key())
            .field("secret_key", &"<redacted>")
            .finish()
    }
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct IdentityFile {
    format: String,
    peer: PeerId,
    key_id: KeyId,
    secret_key: String,
    #[serde(default)]
    public_key: Option<PublicKey>,
}

impl Identity {
    /// A fresh identity from the operating system's random generator.
    pub fn generate(peer: PeerId, key_id: KeyId) -> Self {
        Identity {
            peer,
            key_id,
            signing: SigningKey::generate(&mut rand_core::OsRng),
        }
    }

    /// An identity from a 32-byte secret seed (tests and key import).
    pub fn from_secret(peer: PeerId, key_id: KeyId, secret: [u8; 32]) -> Self {
        Identity {
            peer,
            key_id,
            signing: SigningKey::from_bytes(&secret),
        }
    }

    /// The public half, in its text form.
    pub fn public_key(&self) -> PublicKey {
        PublicKey(self.signing.verifying_key())
    }

    /// Signs a message.
    pub fn sign(&self, message: &[u8]) -> [u8; 64] {
        self.signing.sign(message).to_bytes()
    }

    /// The identity file's text.
    pub fn to_file_string(&self) -> String {
        let file = IdentityFile {
            format: IDENTITY_FORMAT.to_string(),
            peer: self.peer.clone(),
            key_id: self.key_id.clone(),
            secret_key: URL_SAFE_NO_PAD.encode(self.signing.to_bytes()),
            public_key: Some(self.public_key()),
        };
        let body = toml::to_string(&file).unwrap_or_default();
        format!("# OAB Relay peer identity. Secret: keep this file private.\n{body}")
    }

    /// Parses an identity file's text (`origin` names it in errors).
    pub fn from_file_str(text: &str, origin: &str) -> Result<Self, IdentityError> {
        let fmt_err = |reason: String| IdentityError::Format {
            path: origin.to_string(),
            reason,
        };
        let file: IdentityFile =
            toml::from_str(text).map_err(|e| fmt_err(e.message().to_string()))?;
        if file.format != IDENTITY_FORMAT {
            return Err(fmt_err(format!(
                "format is {:?}; this version reads {IDENTITY_FORMAT:?}",
                file.format
            )));
        }
        let raw = URL_SAFE_NO_PAD
            .decode(file.secret_key.trim())
            .map_err(|_| fmt_err("secret_key is not base64url".into()))?;
        let secret: [u8; 32] = raw
            .try_into()
            .map_err(|_| fmt_err("secret_key is not 32 bytes".into()))?;
        let id = Identity::from_secret(file.peer, file.key_id, secret);
        if let Some(public) = file.public_key
            && public != id.public_key()
        {
            return Err(fmt_err("public_key does not belong to secret_key".into()));
        }
        Ok(id)
    }
}

/// One trusted public key of a peer, with an optional validity window.
///
/// Rotation: add the new key with `not_before`, let both overlap, then set
/// `not_after` on the old one (or remove it).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PeerKey {
    /// The key id.
    pub key_id: KeyId,
    /// The public key.
    pub public_key: PublicKey,
    /// Not valid before this time, ms since the Unix epoch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub not_before_ms: Option<u64>,
    /// Not valid after this time, ms since the Unix epoch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub not_after_ms: Option<u64>,
}

/// Where a key's validity window puts a moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyWindow {
    /// Inside the window.
    Valid,
    /// Before `not_before`.
    NotYetValid,
    /// After `not_after`.
    Expired,
}

impl PeerKey {
    /// Where `now_ms` falls in this key's window.
    pub fn window(&self, now_ms: u64) -> KeyWindow {
        if self.not_before_ms.is_some_and(|nb| now_ms < nb) {
            KeyWindow::NotYetValid
        } else if self.not_after_ms.is_some_and(|na| now_ms > na) {
            KeyWindow::Expired
        } else {
            KeyWindow::Valid
        }
    }
}

/// Looks up the trusted keys of a peer. Implemented by the relay's and the
/// connector's configurations.
pub trait TrustStore {
    /// The keys of `peer`, or `None` when the peer is not configured.
    fn peer_keys(&self, peer: &PeerId) -> Option<&[PeerKey]>;
}

impl TrustStore for std::collections::HashMap<PeerId, Vec<PeerKey>> {
    fn peer_keys(&self, peer: &PeerId) -> Option<&[PeerKey]> {
        self.get(peer).map(Vec::as_slice)
    }
}

/// Milliseconds since the Unix epoch, from the system clock.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ident() -> Identity {
        Identity::generate(PeerId::new("acme/a").unwrap(), KeyId::new("k1").unwrap())
    }

    #[test]
    fn public_key_text_round_trips() {
        let id = ident();
        let text = id.public_key().to_string();
        assert!(text.starts_with("ed25519:"));
        assert_eq!(PublicKey::parse(&text).unwrap(), id.public_key());
        for bad in [
            "",
            "ed25519:",
            "rsa:AAAA",
            "ed25519:!!!!",
            &text[..text.len() - 2],
        ] {
            assert!(PublicKey::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn file_round_trip_and_debug_redacts() {
        let id = ident();
        let text = id.to_file_string();
        let back = Identity::from_file_str(&text, "mem").unwrap();
        assert_eq!(back.public_key(), id.public_key());
        assert_eq!(back.peer, id.peer);
        let dbg = format!("{id:?}");
        assert!(dbg.contains("redacted"));
        let secret = id.signing.to_bytes();
        let secret_b64 = URL_SAFE_NO_PAD.encode(secret);
        let secret_hex: String = secret.iter().map(|b| format!("{b:02x}")).collect();
        let alternate = format!("{id:#?}");
        for shown in [&dbg, &alternate] {
            assert!(!shown.contains(&secret_b64), "{shown}");
            assert!(!shown.to_lowercase().contains(&secret_hex), "{shown}");
            assert!(!shown.contains(&format!("{secret:?}")), "{shown}");
            assert!(!shown.contains(&format!("{secret:#?}")), "{shown}");
        }
    }

    #[test]
    fn file_errors_name_the_problem() {
        let id = ident();
        let other = ident();
        let text = id.to_file_string().replace(
            &id.public_key().to_string(),
            &other.public_key().to_string(),
        );
        let err = Identity::from_file_str(&text, "f").unwrap_err();
        assert!(err.to_string().contains("does not belong"), "{err}");
        let err = Identity::from_file_str("format = \"x\"", "f").unwrap_err();
        assert!(err.to_string().contains("missing field"), "{err}");
        let unknown = format!("{}\nextra = 1\n", id.to_file_string());
        assert!(Identity::from_file_str(&unknown, "f").is_err());
    }

    #[test]
    fn key_windows() {
        let k = PeerKey {
            key_id: KeyId::new("k").unwrap(),
            public_key: ident().public_key(),
            not_before_ms: Some(100),
            not_after_ms: Some(200),
        };
        assert_eq!(k.window(99), KeyWindow::NotYetValid);
        assert_eq!(k.window(100), KeyWindow::Valid);
        assert_eq!(k.window(200), KeyWindow::Valid);
        assert_eq!(k.window(201), KeyWindow::Expired);
    }
}
