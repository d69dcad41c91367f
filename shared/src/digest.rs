//! SHA-256 digests of exact bytes.
//!
//! Never: hashes anything but the exact bytes given: no re-serialisation, no
//! normalisation, so a digest names one byte string.

use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use sha2::{Digest as _, Sha256};

/// A SHA-256 digest. Shown and serialized as `sha256:<64 hex digits>`.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Digest(pub [u8; 32]);

impl Digest {
    /// The digest of exactly these bytes.
    pub fn of(bytes: &[u8]) -> Self {
        Digest(Sha256::digest(bytes).into())
    }

    /// Parses `sha256:<hex>` (64 hex digits, either case).
    pub fn parse(s: &str) -> Option<Self> {
        let mut out = [0u8; 32];
        ::hex::decode_to_slice(s.strip_prefix("sha256:")?, &mut out).ok()?;
        Some(Digest(out))
    }
}

/// Lower-case hex of bytes.
pub fn hex(bytes: &[u8]) -> String {
    ::hex::encode(bytes)
}

impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "sha256:{}", hex(&self.0))
    }
}

impl fmt::Debug for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Digest({self})")
    }
}

impl Serialize for Digest {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Digest {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Digest::parse(&s).ok_or_else(|| serde::de::Error::custom("expected sha256:<64 hex digits>"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_vector_and_round_trip() {
        let d = Digest::of(b"abc");
        assert_eq!(
            d.to_string(),
            "sha256:ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert_eq!(Digest::parse(&d.to_string()), Some(d));
        assert_eq!(Digest::parse("sha256:zz"), None);
        assert_eq!(Digest::parse("md5:00"), None);
    }
}
