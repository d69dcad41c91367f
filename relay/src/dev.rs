//! The quick start: on first run, a development setup in one folder (a
//! self-signed certificate for `localhost`/`127.0.0.1`, two development
//! identities `dev/alice` and `dev/bob` allowed to delegate to each other, and
//! a relay config using the in-memory store). Later runs reuse it.
//!
//! Never use a development setup in production: its certificate is
//! self-signed and its identities sit next to the relay config.
//!
//! Never: overwrites a setup: a folder that has its `relay.toml` is reused as
//! it is, and the config is written last, once it validated.

use std::path::{Path, PathBuf};

use oab_wire::identity::{Identity, PeerKey};
use oab_wire::{KeyId, PeerId};

use crate::config::ConfigError;
use crate::tls::{self, TlsError};

/// Files of a development setup.
#[derive(Debug, Clone)]
pub struct DevSetup {
    /// The folder.
    pub dir: PathBuf,
    /// The relay config.
    pub config: PathBuf,
    /// The relay's certificate (trust it in connectors).
    pub cert: PathBuf,
    /// Identity files of the development peers, with their peer ids.
    pub identities: Vec<(PeerId, PathBuf)>,
    /// Whether this run created the files.
    pub created: bool,
}

/// Errors preparing a development setup.
#[derive(Debug, thiserror::Error)]
pub enum DevError {
    /// Creating the folder or a file failed.
    #[error("{path}: {source}")]
    Io {
        /// The path.
        path: String,
        /// The error.
        source: std::io::Error,
    },
    /// TLS material could not be made.
    #[error(transparent)]
    Tls(#[from] TlsError),
    /// An identity could not be saved.
    #[error(transparent)]
    Identity(#[from] oab_wire::identity::IdentityError),
    /// The generated config did not validate.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// An internal id was invalid.
    #[error("{0}")]
    Id(#[from] oab_wire::ids::IdError),
}

/// The development peers.
pub const DEV_PEERS: [&str; 2] = ["dev/alice", "dev/bob"];

/// Creates the development setup in `dir` if it does not exist yet.
pub fn prepare(dir: &Path) -> Result<DevSetup, DevError> {
    let io = |p: &Path| {
        let path = p.display().to_string();
        move |source| DevError::Io { path, source }
    };
    let config = dir.join("relay.toml");
    let cert = dir.join("relay-cert.pem");
    let identities: Vec<(PeerId, PathBuf)> = DEV_PEERS
        .iter()
        .map(|p| {
            let peer = PeerId::new(p)?;
            let file = dir.join(format!("{}.identity.toml", p.replace('/', "-")));
            Ok((peer, file))
        })
        .collect::<Result<_, oab_wire::ids::IdError>>()?;
    if config.exists() {
        return Ok(DevSetup {
            dir: dir.to_path_buf(),
            config,
            cert,
            identities,
            created: false,
        });
    }
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    // Absolute paths in the generated config, so it works from any folder.
    let abs = std::fs::canonicalize(dir).map_err(io(dir))?;
    let (cert, key) = (abs.join("relay-cert.pem"), abs.join("relay-key.pem"));
    let ss = tls::self_signed(&["localhost", "127.0.0.1"])?;
    tls::write_file(&cert, &ss.cert_pem, false)?;
    tls::write_file(&key, &ss.key_pem, true)?;
    let key_id = KeyId::new("dev-1")?;
    let mut peers_toml = String::new();
    for (peer, file) in &identities {
        if file.exists() {
            std::fs::remove_file(file).map_err(io(file))?;
        }
        let id = Identity::generate(peer.clone(), key_id.clone());
        tls::write_file(file, &id.to_file_string(), true)?;
        let pk = PeerKey {
            key_id: key_id.clone(),
            public_key: id.public_key(),
            not_before_ms: None,
            not_after_ms: None,
        };
        peers_toml.push_str(&format!(
            "[[peers]]\nid = \"{peer}\"\nkeys = [{{ key_id = \"{}\", public_key = \"{}\" }}]\n\n",
            pk.key_id, pk.public_key
        ));
    }
    let text = format!(
        "# Development relay config written by `oab-relay` on first run.\n\
         # Self-signed certificate and local identities: never use in production.\n\n\
         [relay]\n\
         id = \"localhost\"\n\
         listen = \"127.0.0.1:7443\"\n\
         admin_listen = \"127.0.0.1:9443\"\n\
         tls_cert = \"{cert}\"\n\
         tls_key = \"{key}\"\n\n\
         [store]\n\
         url = \"memory\"\n\n\
         {peers_toml}\
         [[routes]]\nfrom = \"dev/alice\"\nto = \"dev/bob\"\n\n\
         [[routes]]\nfrom = \"dev/bob\"\nto = \"dev/alice\"\n",
        cert = cert.display(),
        key = key.display(),
    );
    crate::config::Config::from_toml_with_overrides(&text, "generated dev config", &[])?;
    tls::write_file(&config, &text, false)?;
    Ok(DevSetup {
        dir: dir.to_path_buf(),
        config,
        cert,
        identities,
        created: true,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dev_setup_is_created_once_and_valid() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().join("dev");
        let first = prepare(&d).unwrap();
        assert!(first.created);
        let text = std::fs::read_to_string(&first.config).unwrap();
        let c = crate::config::Config::from_toml_with_overrides(&text, "t", &[]).unwrap();
        assert_eq!(c.peers.len(), 2);
        assert_eq!(c.routes.len(), 2);
        for (peer, file) in &first.identities {
            let text = std::fs::read_to_string(file).unwrap();
            assert_eq!(&Identity::from_file_str(&text, "t").unwrap().peer, peer);
            #[cfg(unix)]
            {
                use std::os::unix::fs::PermissionsExt as _;
                let mode = std::fs::metadata(file).unwrap().permissions().mode();
                assert_eq!(mode & 0o777, 0o600, "identity files are private");
            }
        }
        let second = prepare(&d).unwrap();
        assert!(!second.created);
    }
}
