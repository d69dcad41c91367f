//! The bearer keys of the runtimes allowed to register, each bound to one
//! `[[openab.runtimes]]` identity. Read once at start from a file (mode
//! 0600 or stricter) or an environment variable; kept only as SHA-256
//! digests and compared in time independent of where they differ.
//!
//! Never: logs, shows (`Debug` prints the count only) or keeps a key in
//! clear.

use oab_wire::Digest;

use super::config::OpenAbSection;

/// The runtimes' keys, as digests, each with its runtime's index in
/// `openab.runtimes`.
#[derive(Clone, Default)]
pub struct RuntimeKeys(Vec<(Digest, usize)>);

impl std::fmt::Debug for RuntimeKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RuntimeKeys({} keys)", self.0.len())
    }
}

/// Why a key could not be had.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    /// The file could not be read.
    #[error("openab.runtimes[{index}].key_file {path}: {source}")]
    Read {
        /// Runtime index.
        index: usize,
        /// File.
        path: String,
        /// Error.
        source: std::io::Error,
    },
    /// Group or others may read the file.
    #[error("openab.runtimes[{index}].key_file {path} has mode {mode:o}; it must be 0600")]
    Mode {
        /// Runtime index.
        index: usize,
        /// File.
        path: String,
        /// Permission bits.
        mode: u32,
    },
    /// The environment variable is not set.
    #[error("openab.runtimes[{index}].key_env: {var} is not set")]
    Env {
        /// Runtime index.
        index: usize,
        /// Variable.
        var: String,
    },
    /// Empty, or not visible ASCII (a header carries it).
    #[error(
        "openab.runtimes[{index}]: the key is empty or holds characters other than visible ASCII"
    )]
    Malformed {
        /// Runtime index.
        index: usize,
    },
    /// Two runtimes share a key (one key, one identity).
    #[error("openab.runtimes[{index}]: its key is also another runtime's key")]
    Shared {
        /// Runtime index.
        index: usize,
    },
}

impl RuntimeKeys {
    /// Reads every runtime's key.
    pub fn load(section: &OpenAbSection) -> Result<RuntimeKeys, KeyError> {
        let mut keys = Vec::new();
        for (index, r) in section.runtimes.iter().enumerate() {
            let secret = match (&r.key_file, &r.key_env) {
                (Some(path), _) => read_file(index, path)?,
                (None, Some(var)) => std::env::var(var).map_err(|_| KeyError::Env {
                    index,
                    var: var.clone(),
                })?,
                (None, None) => return Err(KeyError::Malformed { index }),
            };
            keys.push((digest_of(index, &secret)?, index));
        }
        Self::check_distinct(keys)
    }

    /// Keys given directly (embedding hosts, tests): `(secret, runtime index)`.
    pub fn from_secrets<'a>(
        secrets: impl IntoIterator<Item = (&'a str, usize)>,
    ) -> Result<RuntimeKeys, KeyError> {
        let keys = secrets
            .into_iter()
            .map(|(s, i)| Ok((digest_of(i, s)?, i)))
            .collect::<Result<Vec<_>, KeyError>>()?;
        Self::check_distinct(keys)
    }

    fn check_distinct(keys: Vec<(Digest, usize)>) -> Result<RuntimeKeys, KeyError> {
        for (i, (d, index)) in keys.iter().enumerate() {
            if keys.iter().skip(i + 1).any(|(o, _)| o == d) {
                return Err(KeyError::Shared { index: *index });
            }
        }
        Ok(RuntimeKeys(keys))
    }

    /// The runtime index bound to `presented`, comparing every key.
    pub fn identify(&self, presented: &str) -> Option<usize> {
        let p = Digest::of(presented.as_bytes());
        let mut found = None;
        for (d, index) in &self.0 {
            let diff =
                d.0.iter()
                    .zip(p.0.iter())
                    .fold(0u8, |acc, (a, b)| acc | (a ^ b));
            if diff == 0 {
                found = Some(*index);
            }
        }
        found
    }
}

fn digest_of(index: usize, secret: &str) -> Result<Digest, KeyError> {
    let s = secret.trim();
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(KeyError::Malformed { index });
    }
    Ok(Digest::of(s.as_bytes()))
}

fn read_file(index: usize, path: &std::path::Path) -> Result<String, KeyError> {
    let shown = path.display().to_string();
    let read = |source| KeyError::Read {
        index,
        path: shown.clone(),
        source,
    };
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt as _;
        let mode = std::fs::metadata(path).map_err(read)?.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            return Err(KeyError::Mode {
                index,
                path: shown,
                mode,
            });
        }
    }
    std::fs::read_to_string(path).map_err(read)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn keys_identify_their_runtime_and_never_show() {
        let keys = RuntimeKeys::from_secrets([("k-primary", 0), ("k-worker\n", 1)]).unwrap();
        assert_eq!(keys.identify("k-primary"), Some(0));
        assert_eq!(keys.identify("k-worker"), Some(1));
        assert_eq!(keys.identify("k-other"), None);
        let shown = format!("{keys:?}");
        assert!(!shown.contains("k-primary") && shown.contains("2 keys"));
        assert!(matches!(
            RuntimeKeys::from_secrets([("same", 0), ("same", 1)]),
            Err(KeyError::Shared { index: 0 })
        ));
        assert!(RuntimeKeys::from_secrets([("has space", 0)]).is_err());
    }

    #[cfg(unix)]
    #[test]
    fn a_key_file_others_can_read_is_refused() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("k");
        std::fs::write(&path, "secret-1\n").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let section: OpenAbSection = toml::from_str(&format!(
            "[[runtimes]]\nnamespace=\"p\"\nname=\"a\"\ntype=\"primary\"\nkey_file=\"{}\"",
            path.display()
        ))
        .unwrap();
        assert!(matches!(
            RuntimeKeys::load(&section),
            Err(KeyError::Mode { .. })
        ));
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        let keys = RuntimeKeys::load(&section).unwrap();
        assert_eq!(keys.identify("secret-1"), Some(0));
    }
}
