//! What a caller persists so a restarted process resumes its delegations.
//!
//! Per delegation, one JSON file in the state folder holds the callee, the
//! signed request (to resend the open, which the relay de-duplicates, and to
//! verify the result), and the **cursor**: the last up-log event the
//! application finished processing, committed with
//! [`crate::caller::Caller::commit`]. After a restart the connector resumes
//! each unfinished delegation after its cursor, so the application sees
//! every event after the cursor exactly once.
//!
//! Not persisted: follow-up messages and cancels that were not acknowledged
//! by the relay when the process died; re-issue them after a restart.
//!
//! Files are written to a temporary name and renamed, so a crash leaves the
//! old or the new version, never a torn one.
//!
//! **Retention.** A file lives while its delegation is open. Once the
//! delegation's end was handed to the application it is marked finished (at
//! [`crate::caller::Caller::commit`] of the terminal) and deleted when the
//! delegation ages out of the caller's finished list (at most
//! `max_finished` delegations weighing `max_finished_bytes` together, see
//! [`crate::caller::FinishedRetention`]). [`crate::caller::Caller::restore`]
//! deletes finished files beyond that bound, unfinished files whose
//! deadline passed more than [`crate::caller::STALE_AFTER_DEADLINE`] ago,
//! and temporary files left by a crash. So the folder holds the open
//! delegations plus a bounded number of bytes of finished ones.
//!
//! Never: rewrites a file in place, and never stores a follow-up message or a
//! cancel.

use std::io::Write as _;
use std::path::{Path, PathBuf};

use oab_wire::{DelegationKey, Digest, PeerId};
use serde::{Deserialize, Serialize};

use crate::profile::DelegationRequest;

/// One persisted delegation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SavedDelegation {
    /// The delegation.
    pub key: DelegationKey,
    /// The callee.
    pub callee: PeerId,
    /// The signed request envelope, the exact JSON text sent in the open
    /// (its digest is the relay's idempotency check).
    pub envelope: String,
    /// The request inside it.
    pub request: DelegationRequest,
    /// Digest of the signed request payload.
    pub request_digest: Digest,
    /// Last up-log event the application committed.
    pub cursor: u64,
    /// Whether the terminal was committed (nothing left to resume).
    #[serde(default)]
    pub finished: bool,
}

/// A folder of saved delegations.
#[derive(Debug, Clone)]
pub struct FileState {
    dir: PathBuf,
}

/// Errors reading or writing state.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    /// File system error.
    #[error("{path}: {source}")]
    Io {
        /// The path.
        path: String,
        /// The error.
        source: std::io::Error,
    },
    /// A state file is not valid.
    #[error("{path}: {message}")]
    Corrupt {
        /// The path.
        path: String,
        /// What is wrong.
        message: String,
    },
}

impl FileState {
    /// Uses (and creates) `dir`, mode 0700.
    pub fn open(dir: &Path) -> Result<Self, StateError> {
        let io = |source| StateError::Io {
            path: dir.display().to_string(),
            source,
        };
        std::fs::create_dir_all(dir).map_err(io)?;
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt as _;
            std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)).map_err(io)?;
        }
        Ok(FileState {
            dir: dir.to_path_buf(),
        })
    }

    /// The folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn path(&self, key: &DelegationKey) -> PathBuf {
        // Peer ids and request ids use a file-name-safe alphabet except '/'.
        let name = format!("{}.json", key.to_string().replace('/', "~"));
        self.dir.join(name)
    }

    /// Writes (replaces) one delegation.
    pub fn save(&self, saved: &SavedDelegation) -> Result<(), StateError> {
        let path = self.path(&saved.key);
        let tmp = path.with_extension("json.tmp");
        let io = |source| StateError::Io {
            path: path.display().to_string(),
            source,
        };
        let bytes = serde_json::to_vec(saved).map_err(|e| StateError::Corrupt {
            path: path.display().to_string(),
            message: e.to_string(),
        })?;
        let mut f = std::fs::File::create(&tmp).map_err(io)?;
        f.write_all(&bytes).map_err(io)?;
        f.sync_data().map_err(io)?;
        std::fs::rename(&tmp, &path).map_err(io)
    }

    /// Reads one delegation.
    pub fn load(&self, key: &DelegationKey) -> Result<Option<SavedDelegation>, StateError> {
        let path = self.path(key);
        match std::fs::read(&path) {
            Ok(b) => serde_json::from_slice(&b)
                .map(Some)
                .map_err(|e| StateError::Corrupt {
                    path: path.display().to_string(),
                    message: e.to_string(),
                }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(source) => Err(StateError::Io {
                path: path.display().to_string(),
                source,
            }),
        }
    }

    /// Deletes one delegation's file (nothing to do when there is none).
    pub fn remove(&self, key: &DelegationKey) -> Result<(), StateError> {
        let path = self.path(key);
        match std::fs::remove_file(&path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(source) => Err(StateError::Io {
                path: path.display().to_string(),
                source,
            }),
        }
    }

    /// Deletes the temporary files a crash during [`FileState::save`] left
    /// behind (the saved version is the `.json` file beside it).
    pub fn remove_temporaries(&self) -> Result<(), StateError> {
        let io = |source| StateError::Io {
            path: self.dir.display().to_string(),
            source,
        };
        for entry in std::fs::read_dir(&self.dir).map_err(io)? {
            let path = entry.map_err(io)?.path();
            if path.to_str().is_some_and(|p| p.ends_with(".json.tmp")) {
                std::fs::remove_file(&path).map_err(|source| StateError::Io {
                    path: path.display().to_string(),
                    source,
                })?;
            }
        }
        Ok(())
    }

    /// The number of delegation files in the folder.
    pub fn count(&self) -> Result<usize, StateError> {
        let io = |source| StateError::Io {
            path: self.dir.display().to_string(),
            source,
        };
        let mut n = 0;
        for entry in std::fs::read_dir(&self.dir).map_err(io)? {
            if entry
                .map_err(io)?
                .path()
                .extension()
                .and_then(|e| e.to_str())
                == Some("json")
            {
                n += 1;
            }
        }
        Ok(n)
    }

    /// Every saved delegation.
    pub fn load_all(&self) -> Result<Vec<SavedDelegation>, StateError> {
        let io = |source| StateError::Io {
            path: self.dir.display().to_string(),
            source,
        };
        let mut out = Vec::new();
        for entry in std::fs::read_dir(&self.dir).map_err(io)? {
            let path = entry.map_err(io)?.path();
            if path.extension().and_then(|e| e.to_str()) != Some("json") {
                continue;
            }
            let bytes = std::fs::read(&path).map_err(|source| StateError::Io {
                path: path.display().to_string(),
                source,
            })?;
            out.push(
                serde_json::from_slice(&bytes).map_err(|e| StateError::Corrupt {
                    path: path.display().to_string(),
                    message: e.to_string(),
                })?,
            );
        }
        Ok(out)
    }
}
