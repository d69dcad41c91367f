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
    /// A file of the configuration (`relay.tls_cert`, `relay.tls_key`)
    /// cannot be used; names the field, the file and what to do.
    #[error("{field} ({path}): {message}")]
    Field {
        /// The configuration field.
        field: &'static str,
        /// The file.
        path: String,
        /// What is wrong, and what to do.
        message: String,
    },
    /// The key is not the key of the certificate.
    #[error(
        "relay.tls_key ({key}) is not the private key of the certificate in relay.tls_cert \
         ({cert}); give the key the certificate was issued for (a chain starts with the \
         relay's own certificate, then its issuers)"
    )]
    KeyMismatch {
        /// `relay.tls_cert`.
        cert: String,
        /// `relay.tls_key`.
        key: String,
    },
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

/// What an I/O error on a configured file means for the operator.
fn io_problem(e: &std::io::Error) -> String {
    match e.kind() {
        std::io::ErrorKind::NotFound => "no such file; check the path".into(),
        std::io::ErrorKind::PermissionDenied => {
            "permission denied; the relay's user cannot read it".into()
        }
        _ => e.to_string(),
    }
}

/// The labels of the PEM blocks in `text` (`CERTIFICATE`, `PRIVATE KEY`).
fn pem_labels(text: &str) -> Vec<&str> {
    text.lines()
        .filter_map(|l| l.trim().strip_prefix("-----BEGIN ")?.strip_suffix("-----"))
        .collect()
}

/// What a file holds, for a message: "a CERTIFICATE REQUEST", "no PEM block".
fn holds(labels: &[&str]) -> String {
    if labels.is_empty() {
        "no PEM block".into()
    } else {
        let mut l: Vec<&str> = labels.to_vec();
        l.dedup();
        format!("a {}", l.join(", a "))
    }
}

/// Loads `relay.tls_cert` and `relay.tls_key` and makes the server config;
/// every error names the field and the file, and says what to do: a file
/// that is missing, unreadable, or holds something else (a certificate
/// request given as the key), or a key that is not the certificate's.
pub fn load_server_config(cert: &Path, key: &Path) -> Result<Arc<ServerConfig>, TlsError> {
    let cert_shown = cert.display().to_string();
    let key_shown = key.display().to_string();
    let field = |field: &'static str, path: &str, message: String| TlsError::Field {
        field,
        path: path.to_string(),
        message,
    };
    let cert_text =
        std::fs::read(cert).map_err(|e| field("relay.tls_cert", &cert_shown, io_problem(&e)))?;
    let cert_text = String::from_utf8_lossy(&cert_text);
    let labels = pem_labels(&cert_text);
    if !labels.contains(&"CERTIFICATE") {
        return Err(field(
            "relay.tls_cert",
            &cert_shown,
            format!(
                "no certificate: it holds {}; give the PEM certificate chain \
                 (-----BEGIN CERTIFICATE-----, the relay's own first)",
                holds(&labels)
            ),
        ));
    }
    let certs = load_certs(cert)
        .map_err(|e| field("relay.tls_cert", &cert_shown, without_path(&e, &cert_shown)))?;
    // Permissions first (a key others can read is refused before it is read).
    match secret_file_problem(key) {
        Ok(Some(mode)) => {
            return Err(TlsError::Permissions {
                path: key_shown,
                mode,
            });
        }
        Ok(None) => {}
        Err(e) => return Err(field("relay.tls_key", &key_shown, io_problem(&e))),
    }
    let key_text =
        std::fs::read(key).map_err(|e| field("relay.tls_key", &key_shown, io_problem(&e)))?;
    let key_text = String::from_utf8_lossy(&key_text);
    let labels = pem_labels(&key_text);
    if !labels.iter().any(|l| l.ends_with("PRIVATE KEY")) {
        let hint = if labels.contains(&"CERTIFICATE REQUEST") {
            " (a certificate request is what was sent to the CA; the key is the file \
             made with it)"
        } else {
            ""
        };
        return Err(field(
            "relay.tls_key",
            &key_shown,
            format!(
                "not a private key: it holds {}{hint}; give the file that starts with \
                 -----BEGIN PRIVATE KEY----- (or EC / RSA PRIVATE KEY)",
                holds(&labels)
            ),
        ));
    }
    if labels.iter().any(|l| l.starts_with("ENCRYPTED")) {
        return Err(field(
            "relay.tls_key",
            &key_shown,
            "an encrypted private key; give it unencrypted (mode 0600), e.g. \
             `openssl pkey -in KEY -out KEY.pem`"
                .into(),
        ));
    }
    let key_der = PrivateKeyDer::from_pem_slice(key_text.as_bytes())
        .map_err(|e| field("relay.tls_key", &key_shown, e.to_string()))?;
    server_config(certs, key_der).map_err(|e| match e {
        TlsError::Config(rustls::Error::InconsistentKeys(_)) => TlsError::KeyMismatch {
            cert: cert_shown,
            key: key_shown,
        },
        other => other,
    })
}

/// A [`TlsError::Pem`]'s message without its path (named by the caller).
fn without_path(e: &TlsError, path: &str) -> String {
    let shown = e.to_string();
    shown
        .strip_prefix(path)
        .and_then(|rest| rest.strip_prefix(": "))
        .map_or(shown.clone(), str::to_string)
}

/// The warning for a certificate outside its validity at `now_secs`, naming
/// `relay.tls_cert`, the file and the date: connectors refuse it.
pub fn validity_warning(cert: &Path, now_secs: i64) -> Option<String> {
    let der = load_certs(cert).ok()?.into_iter().next()?;
    let (not_before, not_after) = validity(&der)?;
    let date = |secs| oab_ops::time::utc_rfc3339(secs);
    let shown = cert.display();
    if now_secs > not_after {
        Some(format!(
            "relay.tls_cert ({shown}): the certificate expired at {} (notAfter); connectors \
             refuse it until it is renewed: install a renewed certificate and reload (SIGHUP)",
            date(not_after)
        ))
    } else if now_secs < not_before {
        Some(format!(
            "relay.tls_cert ({shown}): the certificate is not valid before {} (notBefore); \
             connectors refuse it until then: check this host's clock, or the certificate's dates",
            date(not_before)
        ))
    } else {
        None
    }
}

/// `notBefore` and `notAfter` of a DER certificate, in seconds since the
/// Unix epoch (`None` when it does not read as X.509).
pub fn validity(der: &[u8]) -> Option<(i64, i64)> {
    let (_, cert, _) = tlv(der)?;
    let (_, tbs, _) = tlv(cert)?;
    let mut rest = tbs;
    if rest.first() == Some(&0xa0) {
        rest = tlv(rest)?.2; // version
    }
    for _ in 0..3 {
        rest = tlv(rest)?.2; // serial, signature, issuer
    }
    let (_, validity, _) = tlv(rest)?;
    let (nb_tag, nb, rest) = tlv(validity)?;
    let (na_tag, na, _) = tlv(rest)?;
    Some((der_time(nb_tag, nb)?, der_time(na_tag, na)?))
}

/// One DER element: tag, content, what follows.
fn tlv(b: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let tag = *b.first()?;
    let first = *b.get(1)?;
    let (len, header) = if first < 0x80 {
        (usize::from(first), 2)
    } else {
        let n = usize::from(first & 0x7f);
        if n == 0 || n > 4 {
            return None;
        }
        let mut len = 0usize;
        for byte in b.get(2..2 + n)? {
            len = (len << 8) | usize::from(*byte);
        }
        (len, 2 + n)
    };
    let content = b.get(header..header.checked_add(len)?)?;
    Some((tag, content, b.get(header + len..)?))
}

/// A DER UTCTime (`YYMMDDHHMMSSZ`) or GeneralizedTime
/// (`YYYYMMDDHHMMSSZ`), in seconds since the Unix epoch.
fn der_time(tag: u8, b: &[u8]) -> Option<i64> {
    let s = std::str::from_utf8(b).ok()?.strip_suffix('Z')?;
    let num = |r: std::ops::Range<usize>| s.get(r)?.parse::<i64>().ok();
    let (year, rest) = match tag {
        0x17 => {
            let yy = num(0..2)?;
            (if yy >= 50 { 1900 + yy } else { 2000 + yy }, 2)
        }
        0x18 => (num(0..4)?, 4),
        _ => return None,
    };
    let field = |i: usize| num(rest + 2 * i..rest + 2 * i + 2);
    let (month, day, hour, min, sec) = (field(0)?, field(1)?, field(2)?, field(3)?, field(4)?);
    // Days from the civil date (Howard Hinnant's algorithm).
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some(days * 86_400 + hour * 3_600 + min * 60 + sec)
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
