//! How the connector trusts the relay's TLS certificate: the WebPKI roots
//! (default), a configured CA certificate, or a pin of the relay's own
//! certificate (SHA-256 of its DER bytes). TLS 1.3 only, ring provider.
//!
//! Never: offers TLS below 1.3, and never skips the handshake's signature
//! checks: a pin replaces only the certificate chain check.

use std::sync::Arc;

use oab_wire::Digest;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{ClientConfig, DigitallySignedStruct, SignatureScheme};

/// The relay certificate trust anchor.
#[derive(Debug, Clone)]
pub enum RelayTrust {
    /// The Mozilla root program (webpki-roots): a relay with a public certificate.
    WebPki,
    /// These CA certificates (DER), e.g. a private CA or a self-signed relay.
    Ca(Vec<CertificateDer<'static>>),
    /// Exactly the certificate with this SHA-256 (of its DER bytes).
    Pin(Digest),
}

/// Errors building the TLS client config.
#[derive(Debug, thiserror::Error)]
pub enum TrustError {
    /// A CA certificate was refused.
    #[error("CA certificate: {0}")]
    Ca(String),
    /// rustls refused the configuration.
    #[error("TLS: {0}")]
    Tls(#[from] rustls::Error),
}

/// Accepts exactly one certificate (by digest); still checks the handshake
/// signatures with the provider's algorithms.
#[derive(Debug)]
struct PinVerifier {
    pin: Digest,
    provider: Arc<rustls::crypto::CryptoProvider>,
}

impl ServerCertVerifier for PinVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        if Digest::of(end_entity.as_ref()) == self.pin {
            Ok(ServerCertVerified::assertion())
        } else {
            Err(rustls::Error::General(
                "relay certificate does not match the configured pin".into(),
            ))
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// A TLS 1.3 client config for reaching the relay.
pub fn client_config(trust: &RelayTrust) -> Result<Arc<ClientConfig>, TrustError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ClientConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13])?;
    let mut cfg = match trust {
        RelayTrust::WebPki => {
            let roots = rustls::RootCertStore {
                roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
            };
            builder.with_root_certificates(roots).with_no_client_auth()
        }
        RelayTrust::Ca(certs) => {
            let mut roots = rustls::RootCertStore::empty();
            for c in certs {
                roots
                    .add(c.clone())
                    .map_err(|e| TrustError::Ca(e.to_string()))?;
            }
            builder.with_root_certificates(roots).with_no_client_auth()
        }
        RelayTrust::Pin(pin) => builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(PinVerifier {
                pin: *pin,
                provider,
            }))
            .with_no_client_auth(),
    };
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(cfg))
}
