//! TLS for the relay listener (rustls, TLS 1.3 only, ring provider) and the
//! development certificate of the quick start.
//!
//! Never: offers a protocol version below TLS 1.3, or asks a client for a
//! certificate: peers authenticate in the session handshake, bound to the TLS
//! session by its exporter value (`exporter_value`). Never loads a private
//! key file that other users can read (`load_key`, at start and on reload).

use std::path::Path;
use std::sync::Arc;

use rustls::ServerConfig;
use rustls_pki_types::pem::PemObject as _;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

/// Errors setting up TLS.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A PEM file could not be read or parsed.
    #[error("{path}: {message}")]
    Pem {
        /// The file.
        path: String,
        /// What went wrong.
        message: String,
    },
    /// rustls refused the certificate or key.
    #[error("TLS configuration: {0}")]
    Config(#[from] rustls::Error),
    /// Certificate generation failed.
    #[error("certificate generation: {0}")]
    Generate(String),
    /// Writing generated files failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The error.
        source: std::io::Error,
    },
    /// The private key file is readable by users other than its owner (see
    /// [`secret_file_problem`]).
    #[error(
        "{path} is readable by other users (mode {mode:o}); run `chmod 600 {path}` \
         (a file owned by root may also be 0640 or 0440)"
    )]
    Permissions {
        /// The file.
        path: String,
        /// Its permission bits.
        mode: u32,
    },
}

/// Installs ring as the process-wide rustls provider. Safe to call more than
/// once; every binary and test helper that builds TLS configs calls it.
pub fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// Loads a PEM certificate chain.
pub fn load_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let shown = path.display().to_string();
    let certs: Result<Vec<_>, _> = CertificateDer::pem_file_iter(path)
        .map_err(|e| TlsError::Pem {
            path: shown.clone(),
            message: e.to_string(),
        })?
        .collect();
    let certs = certs.map_err(|e| TlsError::Pem {
        path: shown.clone(),
        message: e.to_string(),
    })?;
    if certs.is_empty() {
        return Err(TlsError::Pem {
            path: shown,
            message: "no CERTIFICATE block found".into(),
        });
    }
    Ok(certs)
}

/// Loads a PEM private key (PKCS#8, SEC1 or PKCS#1), refusing a file that
/// others can read (see [`secret_file_problem`]).
pub fn load_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    let shown = path.display().to_string();
    if let Some(mode) = secret_file_problem(path).map_err(|source| TlsError::Io {
        path: shown.clone(),
        source,
    })? {
        return Err(TlsError::Permissions { path: shown, mode });
    }
    PrivateKeyDer::from_pem_file(path).map_err(|e| TlsError::Pem {
        path: shown,
        message: e.to_string(),
    })
}

/// The permission bits of a secret file that users other than its owner
/// may read, or `None` when only its owner may: any access for others is
/// refused, and access for its group too unless root owns the file and the
/// group may only read it (a Kubernetes Secret mounted with `fsGroup` is
/// root-owned, mode 0440, so that a non-root relay in that group reads it;
/// the connector's identity files follow the same rule, as libpq does for
/// its key file). Always `None` off Unix.
pub fn secret_file_problem(path: &Path) -> std::io::Result<Option<u32>> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt as _;
        let meta = std::fs::metadata(path)?;
        let mode = meta.mode();
        let group_may_read = meta.uid() == 0 && mode & 0o030 == 0;
        let loose = if group_may_read { 0o037 } else { 0o077 };
        Ok((mode & loose != 0).then_some(mode & 0o777))
    }
    #[cfg(not(unix))]
    {
        let _ = path;
        Ok(None)
    }
}

/// A TLS 1.3-only server config with ALPN `http/1.1` (the WebSocket upgrade).
pub fn server_config(
    certs: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
) -> Result<Arc<ServerConfig>, TlsError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut cfg = ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_no_client_auth()
        .with_single_cert(certs, key)?;
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(cfg))
}

/// The RFC 9266 `tls-exporter` channel binding value of a TLS session.
pub fn exporter_value<D>(conn: &rustls::ConnectionCommon<D>) -> Option<[u8; 32]> {
    conn.export_keying_material([0u8; 32], oab_wire::handshake::TLS_EXPORTER_LABEL, None)
        .ok()
}

/// A self-signed certificate and key, as PEM text. `Debug` shows the
/// certificate, never the key.
#[derive(Clone)]
pub struct SelfSigned {
    /// Certificate PEM.
    pub cert_pem: String,
    /// Private key PEM (secret).
    pub key_pem: String,
    /// The certificate in DER form (to trust it in a client).
    pub cert_der: Vec<u8>,
}

impl std::fmt::Debug for SelfSigned {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let Self {
            cert_pem,
            key_pem: _,
            cert_der,
        } = self;
        f.debug_struct("SelfSigned")
            .field("cert_pem", cert_pem)
            .field("key_pem", &"***")
            .field("cert_der", cert_der)
            .finish()
    }
}

/// Generates a self-signed certificate for the given names (DNS names or IPs).
pub fn self_signed(names: &[&str]) -> Result<SelfSigned, TlsError> {
    let names: Vec<String> = names.iter().map(|s| s.to_string()).collect();
    let ck =
        rcgen::generate_simple_self_signed(names).map_err(|e| TlsError::Generate(e.to_string()))?;
    Ok(SelfSigned {
        cert_pem: ck.cert.pem(),
        key_pem: ck.signing_key.serialize_pem(),
        cert_der: ck.cert.der().to_vec(),
    })
}

/// Writes a file, with mode 0600 when `secret`: a file that already exists
/// gets that mode too, before the text is written into it.
pub fn write_file(path: &Path, text: &str, secret: bool) -> Result<(), TlsError> {
    use std::io::Write as _;
    let io = |source| TlsError::Io {
        path: path.display().to_string(),
        source,
    };
    let mut opts = std::fs::OpenOptions::new();
    opts.write(true).create(true).truncate(true);
    #[cfg(unix)]
    if secret {
        use std::os::unix::fs::OpenOptionsExt as _;
        opts.mode(0o600);
    }
    let mut f = opts.open(path).map_err(io)?;
    #[cfg(unix)]
    if secret {
        use std::os::unix::fs::PermissionsExt as _;
        f.set_permissions(std::fs::Permissions::from_mode(0o600))
            .map_err(io)?;
    }
    f.write_all(text.as_bytes()).map_err(io)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::panic)]
mod tests {
    use super::*;

    #[test]
    fn debug_of_self_signed_shows_no_key() {
        let s = self_signed(&["localhost"]).unwrap();
        let shown = format!("{s:?}");
        let body: String = s
            .key_pem
            .lines()
            .filter(|l| !l.starts_with("-----"))
            .collect();
        assert!(!body.is_empty());
        assert!(!shown.contains(&body), "{shown}");
        for line in s.key_pem.lines().filter(|l| !l.starts_with("-----")) {
            assert!(!shown.contains(line), "{shown}");
        }
        assert!(!shown.contains("PRIVATE KEY"), "{shown}");
        assert!(shown.contains("BEGIN CERTIFICATE"), "{shown}");
    }

    #[cfg(unix)]
    #[test]
    fn a_key_readable_by_others_is_refused_with_the_fix() {
        use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("key.pem");
        write_file(&path, &self_signed(&["localhost"]).unwrap().key_pem, true).unwrap();
        assert!(load_key(&path).is_ok(), "0600 loads");
        let set = |mode| std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode));
        let by_root = std::fs::metadata(&path).unwrap().uid() == 0;
        for mode in [0o644, 0o604, 0o660, 0o640, 0o440] {
            set(mode).unwrap();
            let root_group_read = by_root && mode & 0o037 == 0;
            match load_key(&path) {
                Ok(_) => assert!(root_group_read, "mode {mode:o} loaded"),
                Err(TlsError::Permissions { mode: m, .. }) => {
                    assert!(!root_group_read, "mode {mode:o} refused");
                    assert_eq!(m, mode);
                }
                Err(e) => panic!("mode {mode:o}: {e}"),
            }
        }
        set(0o644).unwrap();
        let shown = load_key(&path).err().unwrap().to_string();
        let want = format!("chmod 600 {}", path.display());
        assert!(
            shown.contains(&want) && shown.contains("mode 644"),
            "{shown}"
        );
    }

    #[cfg(unix)]
    #[test]
    fn a_secret_file_is_0600_even_when_it_existed() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("key.pem");
        std::fs::write(&path, "old").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        write_file(&path, "secret", true).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "mode {mode:o}");
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "secret");
        let fresh = dir.path().join("new.pem");
        write_file(&fresh, "secret", true).unwrap();
        let mode = std::fs::metadata(&fresh).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "mode {mode:o}");
    }
}
