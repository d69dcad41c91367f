//! The callee side across its own restarts: the records that let a
//! restarted connector find its agents' tasks again instead of ending their
//! delegations `unknown`.
//!
//! A connector with a state folder keeps two things there for its callee
//! side:
//!
//! - **its instance id** (`instance`, written once): the relay ends as
//!   `unknown` every delegation accepted by an *earlier* instance of a
//!   callee (protocol §8.9), so a connector that keeps its folder keeps its
//!   instance and its accepted work stays open across a restart. Without a
//!   folder every start is a new instance, as before.
//! - **re-attach records** (`callee/`, a journal of [`crate::state`]'s
//!   format): one per delegation whose executor saved a checkpoint
//!   ([`crate::callee::EventSink::checkpoint`]). The A2A driver saves one
//!   when the agent's task is known and not finished, and before each event
//!   it sends up or each follow-up it forwards; the record holds the
//!   authority the delegation runs with, the up-log sequence of the event
//!   that follows, and the executor's own state (the agent's task id, what
//!   was sent up), under 1 KiB for the driver (the request comes back in
//!   the relay's `Open`). It is removed once the terminal is acknowledged.
//!
//! After a restart the relay delivers the `Open` of each delegation still
//! open, and the link hands the ones whose up log already holds entries
//! (`accepted` was durable: the work may have started) as
//! [`crate::link::Incoming::Reopened`], with the up log's tail. The runtime
//! never runs those again: with a record, the executor re-attaches to the
//! agent's task ([`crate::callee::TaskExecutor::reattach`]) and the
//! delegation goes on, its next event at the tail plus one; without one
//! (the executor saved none, or cannot re-attach) it ends `unknown`, signed,
//! saying that the connector restarted and lost track of the work.
//!
//! A checkpoint is durable before the event it precedes is sent (the
//! journal's group commit: one `fdatasync` for every record written
//! meanwhile, about 0.15-1 ms here), and names that event's up-log
//! sequence: after a restart the relay's up tail says whether it was
//! delivered, so every event reaches the caller once. That sync is what a
//! checkpoint costs an event; delegations whose agent answers at once
//! write no record at all.
//!
//! Never: runs an executor again for a delegation whose `accepted` was
//! durable before this process started.

use std::path::Path;

use oab_wire::{DelegationKey, InstanceId};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::authority::EffectiveAuthority;
use crate::state::{FileState, StateError};

/// The folder of re-attach records inside the state folder.
pub const CALLEE_DIR: &str = "callee";
/// The file holding the instance id inside the state folder.
pub const INSTANCE_FILE: &str = "instance";

/// What a restarted callee needs to go on with one delegation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CalleeRecord {
    /// The delegation.
    pub key: DelegationKey,
    /// The A2A task id this connector minted for it.
    pub task_id: String,
    /// The authority it runs with (the request itself comes back in the
    /// relay's `Open`, verified again as of `started_ms`).
    pub authority: EffectiveAuthority,
    /// When the serving started, ms since the Unix epoch.
    pub started_ms: u64,
    /// The up-log sequence of the event the executor sends after this
    /// checkpoint: when the relay's up log reaches it, that event was
    /// delivered.
    pub up_seq: u64,
    /// The executor's own state.
    pub state: Value,
}

/// What an executor gets back after a restart.
#[derive(Debug, Clone, PartialEq)]
pub struct Checkpoint {
    /// The state it saved last.
    pub state: Value,
    /// Whether the event it was about to send when it saved `state` reached
    /// the relay (the up log's tail is at or past its sequence).
    pub delivered: bool,
}

/// The re-attach records of one state folder.
#[derive(Debug, Clone)]
pub struct CalleeJournal {
    files: FileState,
}

impl CalleeJournal {
    /// Opens `<state_dir>/callee` and reads every record in it.
    pub fn open(state_dir: &Path) -> Result<(CalleeJournal, Vec<CalleeRecord>), StateError> {
        let files = FileState::open(&state_dir.join(CALLEE_DIR))?;
        let records = files.load_all_records()?;
        Ok((CalleeJournal { files }, records))
    }

    /// Writes `record`; returns once it is durable (one group-committed
    /// sync, shared with every record written meanwhile).
    pub async fn save(&self, record: &CalleeRecord) -> Result<(), StateError> {
        self.files.save_record(&record.key, record, &[]).await
    }

    /// Forgets the record of `key` (durable with the writer's next sync).
    pub fn remove_later(&self, key: &DelegationKey) {
        self.files.remove_later(key);
    }

    /// How many records the folder holds.
    pub fn count(&self) -> Result<usize, StateError> {
        self.files.count()
    }
}

/// The instance id kept in `state_dir` (written there, mode 0600, on the
/// first start).
pub fn instance_in(state_dir: &Path) -> Result<InstanceId, StateError> {
    let path = state_dir.join(INSTANCE_FILE);
    let io = |source| StateError::Io {
        path: path.display().to_string(),
        source,
    };
    match std::fs::read_to_string(&path) {
        Ok(text) => parse_instance(text.trim()).ok_or_else(|| StateError::Corrupt {
            path: path.display().to_string(),
            message: "not 32 hex digits (delete the file to start as a new instance: \
                      the relay then ends this callee's accepted work unknown)"
                .into(),
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            std::fs::create_dir_all(state_dir).map_err(io)?;
            let id = InstanceId::random();
            let tmp = state_dir.join(format!("{INSTANCE_FILE}.tmp"));
            write_private(&tmp, id.to_hex().as_bytes()).map_err(io)?;
            std::fs::rename(&tmp, &path).map_err(io)?;
            if let Ok(dir) = std::fs::File::open(state_dir) {
                dir.sync_all().map_err(io)?;
            }
            Ok(id)
        }
        Err(e) => Err(io(e)),
    }
}

fn write_private(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write as _;
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt as _;
        options.mode(0o600);
    }
    let mut f = options.open(path)?;
    f.write_all(bytes)?;
    f.sync_all()
}

fn parse_instance(hex: &str) -> Option<InstanceId> {
    if hex.len() != 32 {
        return None;
    }
    let mut b = [0u8; 16];
    for (i, out) in b.iter_mut().enumerate() {
        let pair = hex.get(2 * i..2 * i + 2)?;
        *out = u8::from_str_radix(pair, 16).ok()?;
    }
    Some(InstanceId(b))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn the_instance_id_is_kept_in_the_folder() {
        let dir = tempfile::tempdir().unwrap();
        let first = instance_in(dir.path()).unwrap();
        assert_eq!(instance_in(dir.path()).unwrap(), first, "read back");
        let other = tempfile::tempdir().unwrap();
        assert_ne!(
            instance_in(other.path()).unwrap(),
            first,
            "a new folder, a new instance"
        );
        std::fs::write(dir.path().join(INSTANCE_FILE), "not hex").unwrap();
        assert!(
            matches!(instance_in(dir.path()), Err(StateError::Corrupt { .. })),
            "a damaged file is an error, not a new instance"
        );
    }

    #[test]
    fn instance_ids_parse_only_as_32_hex_digits() {
        let id = InstanceId::random();
        assert_eq!(parse_instance(&id.to_hex()), Some(id));
        assert_eq!(parse_instance("abc"), None);
        assert_eq!(parse_instance(&"zz".repeat(16)), None);
        assert_eq!(parse_instance(&"é".repeat(16)), None);
    }
}
