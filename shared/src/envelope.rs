//! Signed envelopes for delegation requests and results (DSSE style).
//!
//! The signer signs the exact payload bytes under a pre-authentication
//! encoding that binds the payload type, so a signed request can never be
//! replayed as a result:
//!
//! ```text
//! PAE(type, body) = "DSSEv1" SP LEN(type) SP type SP LEN(body) SP body
//! ```
//!
//! (LEN is the ASCII decimal byte length.) On the wire an envelope is JSON:
//!
//! ```json
//! {"payloadType": "application/vnd.oab.delegation-result+json;version=1",
//!  "payload": "<standard base64 of the exact bytes>",
//!  "signatures": [{"peer": "acme/b", "keyid": "2026-11", "sig": "<base64>"}]}
//! ```
//!
//! **Verify, then parse**: an [`Envelope`] does not expose its payload; only
//! [`Envelope::verify`] hands out the bytes, and only after the signature
//! checked out, so no code path can parse unverified bytes.
//!
//! Never: hands out payload bytes before the signature verified (strict
//! ed25519) under a key of the expected signer that is valid at the given time.

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::digest::Digest;
use crate::identity::{Identity, KeyWindow, TrustStore};
use crate::ids::{KeyId, PeerId};

/// Payload type of a signed delegation request.
pub const REQUEST_TYPE: &str = "application/vnd.oab.delegation-request+json;version=1";
/// Payload type of a signed delegation result.
pub const RESULT_TYPE: &str = "application/vnd.oab.delegation-result+json;version=1";

/// Why an envelope was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EnvelopeError {
    /// The envelope's own JSON is not valid.
    #[error("malformed envelope: {0}")]
    Malformed(String),
    /// The payload type is not the one expected here.
    #[error("payload type {got:?} where {expected:?} was expected")]
    WrongType {
        /// What the verifier wanted.
        expected: String,
        /// What the envelope says.
        got: String,
    },
    /// Signed by a different peer than the one that must sign.
    #[error("signed by {got}, expected {expected}")]
    WrongSigner {
        /// Who must sign.
        expected: String,
        /// Who signed.
        got: String,
    },
    /// The signer is not configured.
    #[error("signer {0} is not a configured peer")]
    UnknownSigner(String),
    /// The signer has no such key.
    #[error("signer {peer} has no key {key_id}")]
    UnknownKey {
        /// Signer.
        peer: String,
        /// Key id.
        key_id: String,
    },
    /// The key was not valid at the time of verification.
    #[error("key {0} is outside its validity window")]
    KeyOutsideWindow(String),
    /// The signature does not verify.
    #[error("signature does not verify")]
    BadSignature,
    /// The verified payload is not the expected JSON.
    #[error("verified payload does not parse: {0}")]
    Payload(String),
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct WireSignature {
    peer: PeerId,
    keyid: KeyId,
    sig: String,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct WireEnvelope {
    payload_type: String,
    payload: String,
    signatures: Vec<WireSignature>,
}

/// A signed payload. The payload is reachable only through [`Envelope::verify`].
#[derive(Clone, PartialEq, Eq)]
pub struct Envelope {
    payload_type: String,
    payload: Vec<u8>,
    signer: PeerId,
    key_id: KeyId,
    signature: [u8; 64],
}

impl std::fmt::Debug for Envelope {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Envelope")
            .field("payload_type", &self.payload_type)
            .field("payload_len", &self.payload.len())
            .field("signer", &self.signer)
            .field("key_id", &self.key_id)
            .finish_non_exhaustive()
    }
}

/// The DSSE pre-authentication encoding.
pub fn pae(payload_type: &str, body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(payload_type.len() + body.len() + 32);
    out.extend_from_slice(b"DSSEv1 ");
    out.extend_from_slice(payload_type.len().to_string().as_bytes());
    out.push(b' ');
    out.extend_from_slice(payload_type.as_bytes());
    out.push(b' ');
    out.extend_from_slice(body.len().to_string().as_bytes());
    out.push(b' ');
    out.extend_from_slice(body);
    out
}

/// A verified payload: the exact signed bytes and who signed them. Only
/// [`Envelope::verify`] makes one, so holding a `Verified` proves the check.
#[derive(Debug, Clone, Copy)]
pub struct Verified<'a> {
    bytes: &'a [u8],
    signer: &'a PeerId,
    key_id: &'a KeyId,
}

impl<'a> Verified<'a> {
    /// The exact payload bytes that were signed.
    pub fn bytes(&self) -> &'a [u8] {
        self.bytes
    }

    /// The signer.
    pub fn signer(&self) -> &'a PeerId {
        self.signer
    }

    /// The signer's key id.
    pub fn key_id(&self) -> &'a KeyId {
        self.key_id
    }
}

impl Verified<'_> {
    /// Parses the verified bytes as JSON.
    pub fn parse<T: DeserializeOwned>(&self) -> Result<T, EnvelopeError> {
        serde_json::from_slice(self.bytes).map_err(|e| EnvelopeError::Payload(e.to_string()))
    }

    /// SHA-256 of the exact payload bytes.
    pub fn digest(&self) -> Digest {
        Digest::of(self.bytes)
    }
}

impl Envelope {
    /// Signs exactly `payload` as `payload_type`.
    pub fn sign(identity: &Identity, payload_type: &str, payload: Vec<u8>) -> Self {
        let signature = identity.sign(&pae(payload_type, &payload));
        Envelope {
            payload_type: payload_type.to_string(),
            payload,
            signer: identity.peer.clone(),
            key_id: identity.key_id.clone(),
            signature,
        }
    }

    /// Who claims to have signed (unverified).
    pub fn claimed_signer(&self) -> &PeerId {
        &self.signer
    }

    /// The claimed key id (unverified).
    pub fn claimed_key_id(&self) -> &KeyId {
        &self.key_id
    }

    /// The declared payload type (unverified).
    pub fn payload_type(&self) -> &str {
        &self.payload_type
    }

    /// SHA-256 of the payload bytes as carried (usable before verification,
    /// e.g. for an idempotency digest; it proves nothing by itself).
    pub fn payload_digest(&self) -> Digest {
        Digest::of(&self.payload)
    }

    /// Verifies type, signer, key window and signature, then hands out the bytes.
    pub fn verify<'a>(
        &'a self,
        expected_type: &str,
        expected_signer: &PeerId,
        trust: &dyn TrustStore,
        at_ms: u64,
    ) -> Result<Verified<'a>, EnvelopeError> {
        if self.payload_type != expected_type {
            return Err(EnvelopeError::WrongType {
                expected: expected_type.to_string(),
                got: self.payload_type.clone(),
            });
        }
        if &self.signer != expected_signer {
            return Err(EnvelopeError::WrongSigner {
                expected: expected_signer.to_string(),
                got: self.signer.to_string(),
            });
        }
        let keys = trust
            .peer_keys(&self.signer)
            .ok_or_else(|| EnvelopeError::UnknownSigner(self.signer.to_string()))?;
        let key = keys
            .iter()
            .find(|k| k.key_id == self.key_id)
            .ok_or_else(|| EnvelopeError::UnknownKey {
                peer: self.signer.to_string(),
                key_id: self.key_id.to_string(),
            })?;
        if key.window(at_ms) != KeyWindow::Valid {
            return Err(EnvelopeError::KeyOutsideWindow(self.key_id.to_string()));
        }
        if !key
            .public_key
            .verify_strict(&pae(&self.payload_type, &self.payload), &self.signature)
        {
            return Err(EnvelopeError::BadSignature);
        }
        Ok(Verified {
            bytes: &self.payload,
            signer: &self.signer,
            key_id: &self.key_id,
        })
    }

    /// The JSON wire form.
    pub fn to_json(&self) -> Vec<u8> {
        let wire = WireEnvelope {
            payload_type: self.payload_type.clone(),
            payload: STANDARD.encode(&self.payload),
            signatures: vec![WireSignature {
                peer: self.signer.clone(),
                keyid: self.key_id.clone(),
                sig: STANDARD.encode(self.signature),
            }],
        };
        serde_json::to_vec(&wire).unwrap_or_default()
    }

    /// Parses the JSON wire form. Only the envelope is parsed; the payload
    /// stays opaque bytes until [`Envelope::verify`].
    pub fn from_json(bytes: &[u8]) -> Result<Self, EnvelopeError> {
        let malformed = |m: &str| EnvelopeError::Malformed(m.to_string());
        let wire: WireEnvelope =
            serde_json::from_slice(bytes).map_err(|e| EnvelopeError::Malformed(e.to_string()))?;
        let [sig] = <[WireSignature; 1]>::try_from(wire.signatures)
            .map_err(|_| malformed("exactly one signature is required"))?;
        let payload = STANDARD
            .decode(wire.payload)
            .map_err(|_| malformed("payload is not base64"))?;
        let raw_sig = STANDARD
            .decode(sig.sig)
            .map_err(|_| malformed("sig is not base64"))?;
        let signature: [u8; 64] = raw_sig
            .try_into()
            .map_err(|_| malformed("sig is not 64 bytes"))?;
        Ok(Envelope {
            payload_type: wire.payload_type,
            payload,
            signer: sig.peer,
            key_id: sig.keyid,
            signature,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pae_matches_the_dsse_spec_example() {
        // From the DSSE protocol document.
        assert_eq!(
            pae("http://example.com/HelloWorld", b"hello world"),
            b"DSSEv1 29 http://example.com/HelloWorld 11 hello world".to_vec()
        );
    }
}
