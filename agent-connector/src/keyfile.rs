//! The identity file on disk: written once with mode 0600, never
//! overwritten, and read only while nobody but its owner can read it, or,
//! for a file owned by root, its owner and its group (a Kubernetes Secret
//! mounted with `fsGroup` is root-owned, mode 0440, so that a non-root
//! connector in that group reads it; libpq accepts a root-owned key file
//! with group read for the same reason).
//!
//! The file's format ([`Identity::to_file_string`],
//! [`Identity::from_file_str`]) belongs to `oab-wire`; this module owns only
//! the file system side, and never logs or prints the secret.
//!
//! Never: overwrites an identity file (`save` creates a new file only), and
//! never reads one that others can read, or that its group can read unless
//! root owns it (and the group cannot write it).

use std::io::Write as _;
use std::path::Path;

use oab_wire::identity::{Identity, IdentityError};

/// Why an identity file could not be written or read.
#[derive(Debug, thiserror::Error)]
pub enum KeyFileError {
    /// The file could not be read or written.
    #[error("{path}: {error}")]
    Io {
        /// The file.
        path: String,
        /// The I/O error.
        error: std::io::Error,
    },
    /// `save` found a file there already.
    #[error(
        "{path} already exists; an identity file is never overwritten: give another --out, \
         or move the old file away first"
    )]
    Exists {
        /// The file.
        path: String,
    },
    /// The secret file is readable by group or others.
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
    /// The file's content is not a valid identity.
    #[error(transparent)]
    Format(#[from] IdentityError),
}

/// Writes `identity` to a new file with mode 0600. Refuses to overwrite.
pub fn save(identity: &Identity, path: &Path) -> Result<(), KeyFileError> {
    let io = |error| KeyFileError::Io {
        path: path.display().to_string(),
        error,
    };
    let mut opts = std::fs::OpenOptions::new();
    opts.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt as _;
        opts.mode(0o600);
    }
    let mut f = opts.open(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::AlreadyExists => KeyFileError::Exists {
            path: path.display().to_string(),
        },
        _ => io(e),
    })?;
    f.write_all(identity.to_file_string().as_bytes())
        .map_err(io)?;
    f.sync_all().map_err(io)
}

/// Reads an identity file, refusing one that others can read, or that its
/// group can read while it is not owned by root.
pub fn load(path: &Path) -> Result<Identity, KeyFileError> {
    let shown = path.display().to_string();
    let io = |error| KeyFileError::Io {
        path: shown.clone(),
        error,
    };
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt as _;
        let meta = std::fs::metadata(path).map_err(io)?;
        let mode = meta.mode();
        let group_may_read = meta.uid() == 0 && mode & 0o030 == 0;
        let loose = if group_may_read { 0o037 } else { 0o077 };
        if mode & loose != 0 {
            return Err(KeyFileError::Permissions {
                path: shown.clone(),
                mode: mode & 0o777,
            });
        }
    }
    let text = std::fs::read_to_string(path).map_err(io)?;
    Ok(Identity::from_file_str(&text, &shown)?)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use oab_wire::{KeyId, PeerId};

    #[cfg(unix)]
    #[test]
    fn saved_with_0600_and_loose_files_refused() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("id.toml");
        let id = Identity::generate(
            PeerId::new("acme/build").unwrap(),
            KeyId::new("k1").unwrap(),
        );
        save(&id, &path).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        assert_eq!(load(&path).unwrap().public_key(), id.public_key());
        assert!(save(&id, &path).is_err(), "never overwrites");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let err = load(&path).unwrap_err();
        assert!(
            matches!(err, KeyFileError::Permissions { mode: 0o644, .. }),
            "{err}"
        );
    }

    #[cfg(unix)]
    #[test]
    fn group_may_read_only_a_root_owned_file() {
        use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("id.toml");
        let id = Identity::generate(
            PeerId::new("acme/build").unwrap(),
            KeyId::new("k1").unwrap(),
        );
        save(&id, &path).unwrap();
        let set = |mode| std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode));
        let by_root = std::fs::metadata(&path).unwrap().uid() == 0;
        for mode in [0o640, 0o440] {
            set(mode).unwrap();
            assert_eq!(
                load(&path).is_ok(),
                by_root,
                "mode {mode:o}, root-owned {by_root}"
            );
        }
        // Never with group write, and never for others, whoever owns it.
        for mode in [0o660, 0o604, 0o644] {
            set(mode).unwrap();
            assert!(
                matches!(load(&path), Err(KeyFileError::Permissions { .. })),
                "mode {mode:o}"
            );
        }
        if by_root {
            // Owned by someone else, group read is refused.
            std::os::unix::fs::chown(&path, Some(10001), None).unwrap();
            set(0o640).unwrap();
            assert!(matches!(load(&path), Err(KeyFileError::Permissions { .. })));
            set(0o600).unwrap();
            assert!(load(&path).is_ok());
        }
    }
}
