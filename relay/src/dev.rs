//! The quick start: on first run, a development setup in one folder (a
//! self-signed certificate for `localhost`/`127.0.0.1`, two development
//! identities `dev/alice` and `dev/bob` allowed to delegate to each other, a
//! relay config using the in-memory store, and a connector config for each
//! peer: `dev-alice.connector.toml` with the A2A facade on
//! [`DEV_FACADE_LISTEN`], `dev-bob.connector.toml` with the A2A driver
//! towards [`DEV_AGENT_URL`]). Later runs reuse it; a connector config
//! missing from an older setup is added.
//!
//! Never use a development setup in production: its certificate is
//! self-signed and its identities sit next to the relay config.
//!
//! Never: overwrites a setup: a folder that has its `relay.toml` is reused as
//! it is (but a secret file in it that other users can read gets mode 0600,
//! and the caller says so), and the config is written last, once it
//! validated.

use std::path::{Path, PathBuf};

use oab_wire::identity::{Identity, PeerKey};
use oab_wire::{KeyId, PeerId};

use crate::config::ConfigError;
use crate::tls::{self, TlsError};

/// The A2A facade address of `dev/alice`'s connector config.
pub const DEV_FACADE_LISTEN: &str = "127.0.0.1:7070";

/// The local A2A server `dev/bob`'s connector config drives
/// (`oab-connector demo --a2a` serves its demo agent there).
pub const DEV_AGENT_URL: &str = "http://127.0.0.1:7080";

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
    /// Connector configs of the development peers, in the order of
    /// `identities`.
    pub connector_configs: Vec<PathBuf>,
    /// Whether this run created the files.
    pub created: bool,
    /// Secret files of a reused setup (the relay's key, the identities) that
    /// other users could read, and what was done about it: their mode was
    /// set to 0600, or could not be (the error). Say each one to the user.
    pub loose_secrets: Vec<LooseSecret>,
}

/// A secret file of a reused development setup that users other than its
/// owner could read (created by hand, copied, or unpacked with a loose
/// umask).
#[derive(Debug, Clone)]
pub struct LooseSecret {
    /// The file.
    pub path: PathBuf,
    /// Its permission bits as found.
    pub mode: u32,
    /// `Ok` when its mode is 0600 now; the error of `chmod` otherwise.
    pub fixed: Result<(), String>,
}

impl std::fmt::Display for LooseSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let path = self.path.display();
        match &self.fixed {
            Ok(()) => write!(
                f,
                "{path} was readable by other users (mode {:o}); its mode is now 600",
                self.mode
            ),
            Err(e) => write!(
                f,
                "{path} is readable by other users (mode {:o}) and its mode could not be \
                 changed ({e}); run `chmod 600 {path}`",
                self.mode
            ),
        }
    }
}

/// Finds the secret files among `files` that others may read
/// ([`tls::secret_file_problem`]) and sets their mode to 0600.
fn tighten_secrets<'a>(files: impl IntoIterator<Item = &'a Path>) -> Vec<LooseSecret> {
    let mut out = Vec::new();
    for path in files {
        let Ok(Some(mode)) = tls::secret_file_problem(path) else {
            continue;
        };
        #[cfg(unix)]
        let fixed = {
            use std::os::unix::fs::PermissionsExt as _;
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
                .map_err(|e| e.to_string())
        };
        #[cfg(not(unix))]
        let fixed = Ok(());
        out.push(LooseSecret {
            path: path.to_path_buf(),
            mode,
            fixed,
        });
    }
    out
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
        let key = dir.join("relay-key.pem");
        let secrets =
            std::iter::once(key.as_path()).chain(identities.iter().map(|(_, f)| f.as_path()));
        let loose_secrets = tighten_secrets(secrets);
        let connector_configs = write_connector_configs(dir, &identities)?;
        return Ok(DevSetup {
            dir: dir.to_path_buf(),
            config,
            cert,
            identities,
            connector_configs,
            created: false,
            loose_secrets,
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
    let connector_configs = write_connector_configs(dir, &identities)?;
    tls::write_file(&config, &text, false)?;
    Ok(DevSetup {
        dir: dir.to_path_buf(),
        config,
        cert,
        identities,
        connector_configs,
        created: true,
        loose_secrets: Vec::new(),
    })
}

/// The connector config file of a development peer.
pub fn connector_config_path(dir: &Path, peer: &str) -> PathBuf {
    dir.join(format!("{}.connector.toml", peer.replace('/', "-")))
}

/// Writes the connector config of each development peer that has none yet:
/// the relay on `localhost:7443` trusted through the setup's certificate, the
/// other peer's key from its identity file, a read-only `[policy]`, and for
/// `dev/alice` the A2A facade, for `dev/bob` the A2A driver. `oab-connector
/// check-config` accepts both (`agent-connector/tests/demo.rs`).
fn write_connector_configs(
    dir: &Path,
    identities: &[(PeerId, PathBuf)],
) -> Result<Vec<PathBuf>, DevError> {
    let io = |p: &Path| {
        let path = p.display().to_string();
        move |source| DevError::Io { path, source }
    };
    let abs = std::fs::canonicalize(dir).map_err(io(dir))?;
    let mut keys = Vec::new();
    for (peer, file) in identities {
        let text = std::fs::read_to_string(file).map_err(io(file))?;
        let id = Identity::from_file_str(&text, &file.display().to_string())?;
        keys.push((peer.clone(), id.key_id.clone(), id.public_key()));
    }
    let mut paths = Vec::new();
    for (peer, file) in identities {
        let path = connector_config_path(dir, peer.as_str());
        paths.push(path.clone());
        if path.exists() {
            continue;
        }
        let identity = std::fs::canonicalize(file).map_err(io(file))?;
        let mut others = String::new();
        for (other, key_id, public_key) in keys.iter().filter(|(p, ..)| p != peer) {
            others.push_str(&format!(
                "[[peers]]\nid = \"{other}\"\nkeys = [{{ key_id = \"{key_id}\", public_key = \"{public_key}\" }}]\n\n"
            ));
        }
        let a2a = if peer.as_str() == DEV_PEERS[0] {
            format!(
                "[a2a]\n\
                 # Local A2A clients delegate through http://{DEV_FACADE_LISTEN}/peers/<namespace>/<name>/\n\
                 facade_listen = \"{DEV_FACADE_LISTEN}\"\n\
                 default_capabilities = [\"read:repo\"]\n\
                 default_timeout_ms = 60000\n"
            )
        } else {
            format!(
                "[a2a]\n\
                 # The local A2A server that serves delegations to this peer\n\
                 # (`oab-connector demo --a2a` serves a demo agent there).\n\
                 driver_url = \"{DEV_AGENT_URL}\"\n"
            )
        };
        let text = format!(
            "# Development connector config for {peer}, written by `oab-relay` on first run.\n\
             # Run it with `oab-connector run --config {shown}`.\n\
             # Self-signed relay certificate and local identities: never use in production.\n\n\
             [connector]\n\
             relay_url = \"wss://localhost:7443/\"\n\
             relay_id = \"localhost\"\n\
             identity = \"{identity}\"\n\
             relay_ca = \"{cert}\"\n\n\
             {others}\
             # What callers may be granted here, and this host's own grant for the\n\
             # delegations it starts.\n\
             [policy]\n\
             allowed_capabilities = [\"read:*\"]\n\
             allow_writes = false\n\
             max_deadline_ms = 600000\n\n\
             {a2a}",
            shown = path.display(),
            identity = identity.display(),
            cert = abs.join("relay-cert.pem").display(),
        );
        tls::write_file(&path, &text, false)?;
    }
    Ok(paths)
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
        assert_eq!(first.connector_configs.len(), 2);
        for file in &first.connector_configs {
            let text = std::fs::read_to_string(file).unwrap();
            assert!(text.contains("relay_ca = "), "{text}");
        }
        // An older setup without connector configs gets them on the next run.
        std::fs::remove_file(&first.connector_configs[1]).unwrap();
        let second = prepare(&d).unwrap();
        assert!(!second.created);
        assert!(second.connector_configs[1].is_file());
        assert!(
            second.loose_secrets.is_empty(),
            "{:?}",
            second.loose_secrets
        );
    }

    #[cfg(unix)]
    #[test]
    fn a_reused_setups_secret_files_readable_by_others_are_made_private_and_said() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().join("dev");
        let first = prepare(&d).unwrap();
        let key = d.join("relay-key.pem");
        let id = &first.identities[0].1;
        let cert = &first.cert;
        let set = |p: &Path, mode| {
            std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap()
        };
        set(&key, 0o644);
        set(id, 0o604);
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        let cert_mode = mode(cert);
        let second = prepare(&d).unwrap();
        let found: Vec<(PathBuf, u32)> = second
            .loose_secrets
            .iter()
            .map(|l| (l.path.clone(), l.mode))
            .collect();
        assert_eq!(found, vec![(key.clone(), 0o644), (id.clone(), 0o604)]);
        assert!(second.loose_secrets.iter().all(|l| l.fixed.is_ok()));
        assert_eq!((mode(&key), mode(id)), (0o600, 0o600));
        assert_eq!(mode(cert), cert_mode, "the certificate is not a secret");
        let said = second.loose_secrets[0].to_string();
        assert!(
            said.contains("mode 644") && said.contains("now 600"),
            "{said}"
        );
        // The relay loads the key it refused before.
        assert!(crate::tls::load_key(&key).is_ok());
    }
}
