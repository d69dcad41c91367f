//! What a caller persists so a restarted process resumes its delegations.
//!
//! Per delegation, one record holds the callee, the signed request (to
//! resend the open, which the relay de-duplicates, and to verify the
//! result), and the **cursor**: the last up-log event the application
//! finished processing, committed with [`crate::caller::Caller::commit`].
//! After a restart the connector resumes each unfinished delegation after
//! its cursor, so the application sees every event after the cursor exactly
//! once.
//!
//! Not persisted: follow-up messages and cancels that were not acknowledged
//! by the relay when the process died; re-issue them after a restart.
//!
//! **Layout.** The state folder holds two files:
//!
//! - `delegations.journal`: an append-only log. Each write is one *frame*
//!   (`u32` payload length, `u64` XXH3 hash of the payload, both little
//!   endian, then the payload); a payload is one or more entries, each a
//!   tag (save or remove), a `u32` length and the JSON of a
//!   [`SavedDelegation`] (save) or of its key (remove). The last entry for
//!   a key wins.
//! - `delegations.snapshot`: the live set as of the last compaction, in
//!   the same frames, written whole to a temporary name and renamed.
//!
//! The live set is the snapshot with the journal applied over it. Only the
//! location of each live record is kept in memory; its bytes are read back
//! from the files when needed.
//!
//! **Group commit.** One writer thread per state folder owns the files. A
//! [`FileState::save`] queues its record and waits for the writer to
//! report it durable; the writer takes every record queued while its last
//! `fdatasync` ran and writes them as one frame with one `fdatasync`. So
//! concurrent delegations share their syncs ([`FileState::syncs`] counts
//! them), no async runtime thread ever waits on the disk, and a save is
//! durable when it returns. Per delegation the caller queues two records:
//! the open's, before the `Open` is handed to the link
//! ([`crate::caller::Caller::delegate`]), and the terminal's commit, with
//! the removals of the finished delegations it ages out in the same sync
//! ([`FileState::save_and_remove`]). The queue is bounded in bytes
//! ([`MAX_QUEUED_BYTES`]): past it a save waits for room (back-pressure),
//! it is never dropped. A frame holds at most [`MAX_BATCH_BYTES`] of records
//! (one larger record gets a frame of its own); a record larger than
//! [`MAX_SAVED_BYTES`] is refused.
//!
//! **Room ahead.** When a frame grows the journal file, the writer also
//! writes [`JOURNAL_PREALLOC_BYTES`] of zeros after it, in the same sync; the
//! next frames overwrite those zeros, so their `fdatasync` writes data
//! blocks only, not the inode and block map an append needs. On open, zeros
//! after the last frame are that room, kept; an earlier version reads them
//! as a torn tail and cuts them, which loses nothing.
//!
//! **Crash safety.** A frame reaches the journal by one positional write
//! followed by `fdatasync`; a save is acknowledged only after both. A crash
//! (kill -9, or power loss within what `fdatasync` promises) can tear only
//! the frame being written, which nobody was told is durable. On open, the
//! journal is read frame by frame; the first frame that is incomplete or
//! whose hash does not match is the torn tail (unless all that follows is
//! zeros, the room ahead): it is dropped and the file truncated there (a
//! warning says how many bytes). One exception: when the
//! bad frame is followed by a valid frame, the damage is not a torn tail but
//! corruption of acknowledged records, and [`FileState::open`] fails with
//! [`StateError::Corrupt`] naming the offset instead of silently dropping
//! records (an operator restores the folder or removes the journal). A bad
//! frame in the snapshot, which is only ever renamed into place whole, is
//! corruption too. If a write fails (e.g. the disk is full) the journal is
//! cut back to its last good end and the records of that frame report the
//! error; if an `fdatasync` fails, what reached the disk is unknown, so
//! every later save fails until the process restarts and reads the journal
//! again.
//!
//! **Compaction (the journal's bound).** After a write, when the journal
//! is over [`COMPACT_MIN_BYTES`] and over [`COMPACT_RATIO`] times the live
//! set, the writer writes the live set to `delegations.snapshot.tmp`,
//! syncs it, renames it over the snapshot, syncs the folder, then cuts the
//! journal back to its header and syncs it. Replaying a journal over a
//! snapshot that already contains it gives the same live set, so a crash at
//! any step leaves the old or the new state. The journal therefore stays
//! under `max(COMPACT_MIN_BYTES, COMPACT_RATIO × live set)` plus one frame;
//! saves queued while a compaction runs wait for it (at most one write of
//! the live set). If a compaction fails it is logged and retried once the
//! journal has grown by another [`COMPACT_MIN_BYTES`]. A writer that had
//! nothing to do for [`IDLE_COMPACT_AFTER`] after writing compacts once if
//! the journal's records are at least an eighth of the live set, so an
//! idle connector's folder holds about its live set (the soak run checks
//! it does not grow with the delegations it served).
//!
//! **Upgrade.** Earlier versions kept one `<key>.json` file per delegation.
//! [`FileState::open`] takes such files into the journal (synced) and only
//! then deletes them, so a crash during the upgrade repeats it on the next
//! open. There is no way back: an earlier version does not read the
//! journal.
//!
//! **Retention.** A record lives while its delegation is open. Once the
//! delegation's end was handed to the application it is marked finished (at
//! [`crate::caller::Caller::commit`] of the terminal) and removed when the
//! delegation ages out of the caller's finished list (at most
//! `max_finished` delegations weighing `max_finished_bytes` together, see
//! [`crate::caller::FinishedRetention`]). [`crate::caller::Caller::restore`]
//! removes finished records beyond that bound and unfinished ones whose
//! deadline passed more than [`crate::caller::STALE_AFTER_DEADLINE`] ago.
//! So the live set holds the open delegations plus a bounded number of
//! bytes of finished ones, and the journal is bounded by it (above).
//!
//! **One process per folder.** A process opens a folder once: every
//! [`FileState::open`] of the same folder in one process shares the same
//! writer. Two processes must not share a state folder (both would resume
//! the same delegations and write one journal): the writer holds an
//! exclusive advisory lock ([`LOCK_FILE`], `flock`) on the folder, and an
//! open while another process holds it fails with [`StateError::Locked`].
//! The lock goes with the process, so a crashed connector leaves none
//! behind.
//!
//! Never: rewrites a journal frame in place, acknowledges a save before its
//! `fdatasync`, or stores a follow-up message or a cancel.

use std::collections::{HashMap, VecDeque};
use std::fs::{File, OpenOptions};
use std::io::Read as _;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;

use oab_wire::{DelegationKey, Digest, PeerId};
use parking_lot::{Condvar, Mutex};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, oneshot};

use crate::profile::DelegationRequest;

/// The journal's file name in the state folder.
pub const JOURNAL_FILE: &str = "delegations.journal";
/// The snapshot's file name in the state folder.
pub const SNAPSHOT_FILE: &str = "delegations.snapshot";
/// The file whose exclusive lock the folder's writer holds (empty; it is
/// left in place, only the lock matters).
pub const LOCK_FILE: &str = "lock";
/// Where a compaction writes the next snapshot before renaming it.
const SNAPSHOT_TMP: &str = "delegations.snapshot.tmp";
/// First bytes of the journal (format version 1).
const JOURNAL_MAGIC: [u8; 8] = *b"OABJRNL1";
/// First bytes of the snapshot (format version 1).
const SNAPSHOT_MAGIC: [u8; 8] = *b"OABSNAP1";
/// Length of either magic.
const MAGIC_LEN: u64 = 8;
/// A frame's header: payload length (`u32`) and XXH3 hash (`u64`).
const FRAME_HEADER: usize = 12;
/// An entry's header: tag (`u8`) and length (`u32`).
const ENTRY_HEADER: usize = 5;
/// Entry tag: the JSON of a record (a [`SavedDelegation`] in a caller's
/// folder), an object whose `key` field names its delegation.
const TAG_SAVE: u8 = 1;
/// Entry tag: the JSON of a [`DelegationKey`] whose record is gone.
const TAG_REMOVE: u8 = 2;

/// Records written in one frame, at most (a single larger record gets a
/// frame of its own). 1 MiB: hundreds of delegations' records (about 2 KiB
/// each) per `fdatasync`, and a bound on what a torn write can cost.
pub const MAX_BATCH_BYTES: usize = 1 << 20;
/// The largest record [`FileState::save`] accepts (its JSON). A record
/// holds one signed request; 16 MiB is far above what the relay carries
/// in an open.
pub const MAX_SAVED_BYTES: usize = 16 << 20;
/// Bytes of records queued for the writer, at most; a save past it waits
/// for room. At least [`MAX_SAVED_BYTES`], so every accepted record fits.
pub const MAX_QUEUED_BYTES: usize = 16 << 20;
/// The journal is compacted only past this size (4 MiB: a few thousand
/// delegations' records between compactions at the smallest live sets).
pub const COMPACT_MIN_BYTES: u64 = 4 << 20;
/// ... and only when it is this many times the live set.
pub const COMPACT_RATIO: u64 = 4;
/// The journal is kept up to this many bytes of written zeros ahead of
/// its last frame: a frame then overwrites blocks the file already has, so
/// its `fdatasync` writes the data alone. An append that grows the file
/// also has the inode and the block map written (measured on ext4 here:
/// 760-1,080 µs per 2 KB record synced against 136-169 µs, and 82-96
/// against 28-39 µs of CPU). 64 KiB: a few dozen delegations' records per
/// extension, and the most a folder holds beyond its records.
pub const JOURNAL_PREALLOC_BYTES: u64 = 64 << 10;
/// A writer with nothing queued for this long compacts the journal once
/// if it holds more than an eighth of the live set in records since the
/// last compaction, so an idle connector's folder is its live set, not the
/// live set plus up to [`COMPACT_RATIO`] times it of superseded records.
pub const IDLE_COMPACT_AFTER: std::time::Duration = std::time::Duration::from_secs(1);

/// What the writer reads of a record when it opens a folder: its key (the
/// rest is parsed by whoever loads it).
#[derive(Deserialize)]
struct Keyed {
    key: DelegationKey,
}

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
    /// A record larger than [`MAX_SAVED_BYTES`].
    #[error("a saved delegation of {bytes} bytes is over the limit of {max}")]
    TooLarge {
        /// Its size.
        bytes: usize,
        /// The limit.
        max: usize,
    },
    /// Another process holds the folder's lock ([`LOCK_FILE`]): two
    /// processes must not share a state folder.
    #[error(
        "{path}: another process has this state folder open (two connectors must not share a state folder; stop the other one or give this one a folder of its own)"
    )]
    Locked {
        /// The lock file.
        path: String,
    },
    /// The writer stopped (its folder was closed).
    #[error("{path}: the state writer stopped")]
    Stopped {
        /// The journal.
        path: String,
    },
}

/// A failure the writer reports to every waiter of a frame.
#[derive(Debug, Clone)]
struct Failure {
    kind: std::io::ErrorKind,
    message: String,
}

impl Failure {
    fn of(e: &std::io::Error, what: &str) -> Self {
        Failure {
            kind: e.kind(),
            message: format!("{what}: {e}"),
        }
    }

    fn into_error(self, path: &Path) -> StateError {
        StateError::Io {
            path: path.display().to_string(),
            source: std::io::Error::new(self.kind, self.message),
        }
    }
}

/// The state folder of a caller: a journal of saved delegations with one
/// writer (see the module docs). Cheap to clone; every clone and every
/// [`FileState::open`] of the same folder in this process share the writer,
/// which stops when the last one is dropped.
#[derive(Clone)]
pub struct FileState {
    dir: PathBuf,
    handle: Arc<Handle>,
}

impl std::fmt::Debug for FileState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileState")
            .field("dir", &self.dir)
            .finish_non_exhaustive()
    }
}

/// Owns the writer thread: dropping the last handle closes the queue and
/// waits for the writer to finish what was queued.
struct Handle {
    shared: Arc<Shared>,
    writer: Mutex<Option<JoinHandle<()>>>,
}

impl Drop for Handle {
    fn drop(&mut self) {
        self.shared.close_and_wait();
        if let Some(w) = self.writer.lock().take()
            && w.join().is_err()
        {
            tracing::error!(dir = %self.shared.dir.display(), "the state writer panicked");
        }
        let mut open = OPEN.lock();
        open.retain(|e| !Arc::ptr_eq(&e.shared, &self.shared));
    }
}

/// A folder open in this process.
struct Registered {
    dir: PathBuf,
    handle: Weak<Handle>,
    shared: Arc<Shared>,
}

/// The folders open in this process, so a folder has one writer. An entry
/// is removed when its last [`FileState`] is dropped.
static OPEN: Mutex<Vec<Registered>> = Mutex::new(Vec::new());

/// What the writer and the readers share.
struct Shared {
    dir: PathBuf,
    journal_path: PathBuf,
    queue: Mutex<Queue>,
    /// The writer waits here for work.
    work: Condvar,
    /// [`Shared::close_and_wait`] waits here for the writer to exit.
    exit: Condvar,
    /// Room in the queue, in bytes of records ([`MAX_QUEUED_BYTES`]).
    room: Arc<Semaphore>,
    files: Mutex<Files>,
    syncs: AtomicU64,
}

/// Requests waiting for the writer. Bounded in bytes of saves by
/// [`Shared::room`]; removes take no room (a few dozen bytes, at most one
/// per delegation the caller forgets).
#[derive(Default)]
struct Queue {
    items: VecDeque<Request>,
    closed: bool,
    exited: bool,
    /// Tests hold the writer to queue a known batch.
    #[cfg(test)]
    paused: bool,
    /// Unit tests that read the files turn the idle compaction off (off
    /// unless a test turns it on).
    #[cfg(test)]
    idle_compaction: bool,
}

struct Request {
    op: Op,
    /// Told when the request is durable (or failed); `None` when nobody
    /// waits (failures are logged).
    done: Option<oneshot::Sender<Result<(), Failure>>>,
    /// Its room in the queue, given back when it is done.
    _room: Option<OwnedSemaphorePermit>,
}

enum Op {
    Save { key: DelegationKey, json: Vec<u8> },
    Remove { key: DelegationKey, json: Vec<u8> },
    Compact,
}

/// Where a live record's JSON is.
#[derive(Debug, Clone, Copy)]
struct Loc {
    in_snapshot: bool,
    offset: u64,
    len: u32,
}

/// The files and the index of live records. The writer changes them; readers
/// take the lock only to find and read a record (page cache), never across
/// a sync.
struct Files {
    journal: Arc<File>,
    /// Where the journal's frames end (the next frame's offset).
    journal_len: u64,
    /// The journal file's size: from `journal_len` to here it holds
    /// zeros written ahead of the frames ([`JOURNAL_PREALLOC_BYTES`]).
    journal_cap: u64,
    snapshot: Option<Arc<File>>,
    index: HashMap<DelegationKey, Loc>,
    /// Bytes of the live records, entry headers included.
    live_bytes: u64,
    /// Set when an `fdatasync` failed: nothing more is written.
    failed: Option<Failure>,
}

impl Files {
    fn read(&self, loc: Loc) -> std::io::Result<Vec<u8>> {
        let file = if loc.in_snapshot {
            self.snapshot
                .as_ref()
                .ok_or_else(|| std::io::Error::other("no snapshot"))?
        } else {
            &self.journal
        };
        let mut buf = vec![0; loc.len as usize];
        read_exact_at(file, &mut buf, loc.offset)?;
        Ok(buf)
    }

    fn apply(&mut self, key: DelegationKey, loc: Option<Loc>) {
        let added = loc.map_or(0, |l| u64::from(l.len) + ENTRY_HEADER as u64);
        let old = match loc {
            Some(loc) => self.index.insert(key, loc),
            None => self.index.remove(&key),
        };
        let removed = old.map_or(0, |l| u64::from(l.len) + ENTRY_HEADER as u64);
        self.live_bytes = self
            .live_bytes
            .saturating_sub(removed)
            .saturating_add(added);
    }
}

impl FileState {
    /// Uses (and creates) `dir`, mode 0700: reads the snapshot and the
    /// journal (dropping a torn tail, see the module docs), takes in the
    /// per-delegation `.json` files of earlier versions, and starts the
    /// writer. Blocks on the disk: call it at start-up, not per request.
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
        let canonical = dir.canonicalize().map_err(io)?;
        let mut open = OPEN.lock();
        if let Some(pos) = open.iter().position(|e| e.dir == canonical) {
            if let Some(handle) = open.get(pos).and_then(|e| e.handle.upgrade()) {
                return Ok(FileState {
                    dir: dir.to_path_buf(),
                    handle,
                });
            }
            // Its last handle is being dropped on another thread: let its
            // writer finish (and give the folder's lock back) before this
            // one reads the files.
            let old = open.swap_remove(pos);
            old.shared.close_and_wait();
        }
        let handle = start(&canonical)?;
        open.push(Registered {
            dir: canonical,
            handle: Arc::downgrade(&handle),
            shared: handle.shared.clone(),
        });
        Ok(FileState {
            dir: dir.to_path_buf(),
            handle,
        })
    }

    /// The folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn shared(&self) -> &Shared {
        &self.handle.shared
    }

    /// Writes (replaces) one delegation's record; returns once it is
    /// durable. Waits for room when [`MAX_QUEUED_BYTES`] are queued.
    pub async fn save(&self, saved: &SavedDelegation) -> Result<(), StateError> {
        self.save_and_remove(saved, &[]).await
    }

    /// Writes one delegation's record and deletes the records of `removed`,
    /// queued together so that one sync usually covers all of them; returns
    /// once all are durable (an error when any is not).
    pub async fn save_and_remove(
        &self,
        saved: &SavedDelegation,
        removed: &[DelegationKey],
    ) -> Result<(), StateError> {
        self.save_record(&saved.key, saved, removed).await
    }

    /// Writes (replaces) the record of `key`, any JSON object with a `key`
    /// field holding `key` (a folder holds one kind of record: the
    /// caller's [`SavedDelegation`]s, or the callee's re-attach records),
    /// and deletes the records of `removed`, in one sync usually; returns
    /// once all are durable.
    pub async fn save_record<T: Serialize>(
        &self,
        key: &DelegationKey,
        record: &T,
        removed: &[DelegationKey],
    ) -> Result<(), StateError> {
        let shared = self.shared();
        let json = serde_json::to_vec(record).map_err(|e| StateError::Corrupt {
            path: shared.journal_path.display().to_string(),
            message: e.to_string(),
        })?;
        if json.len() > MAX_SAVED_BYTES {
            return Err(StateError::TooLarge {
                bytes: json.len(),
                max: MAX_SAVED_BYTES,
            });
        }
        // At most MAX_SAVED_BYTES, which fits in a u32.
        let weight = u32::try_from(json.len()).unwrap_or(u32::MAX).max(1);
        let room = shared
            .room
            .clone()
            .acquire_many_owned(weight)
            .await
            .map_err(|_| shared.stopped())?;
        let (tx, rx) = oneshot::channel();
        let mut requests = vec![Request {
            op: Op::Save {
                key: key.clone(),
                json,
            },
            done: Some(tx),
            _room: Some(room),
        }];
        let mut waiting = vec![rx];
        for key in removed {
            let (tx, rx) = oneshot::channel();
            requests.push(Request {
                op: remove_op(key),
                done: Some(tx),
                _room: None,
            });
            waiting.push(rx);
        }
        shared.enqueue_all(requests)?;
        for rx in waiting {
            shared.outcome(rx.await)?;
        }
        Ok(())
    }

    /// Deletes one delegation's record (nothing to do when there is none);
    /// returns once that is durable.
    pub async fn remove(&self, key: &DelegationKey) -> Result<(), StateError> {
        self.submit(remove_op(key), None).await
    }

    /// Deletes several delegations' records; returns once all are durable
    /// (usually one sync for all).
    pub async fn remove_many(&self, keys: &[DelegationKey]) -> Result<(), StateError> {
        let mut waiting = Vec::with_capacity(keys.len());
        for key in keys {
            let (tx, rx) = oneshot::channel();
            self.shared().enqueue(Request {
                op: remove_op(key),
                done: Some(tx),
                _room: None,
            })?;
            waiting.push(rx);
        }
        for rx in waiting {
            self.shared().outcome(rx.await)?;
        }
        Ok(())
    }

    /// Deletes one delegation's record without waiting: it is durable with
    /// the writer's next sync. For callers that cannot wait (a drop); a
    /// failure is logged. Losing it in a crash is harmless for records that
    /// aged out of the finished retention: the next
    /// [`crate::caller::Caller::restore`] applies the retention again.
    pub fn remove_later(&self, key: &DelegationKey) {
        let request = Request {
            op: remove_op(key),
            done: None,
            _room: None,
        };
        if let Err(e) = self.shared().enqueue(request) {
            tracing::warn!(key = %key, error = %e, "could not delete a delegation's state record");
        }
    }

    /// Compacts the journal now (it also compacts by itself, see the module
    /// docs); returns once the new snapshot is in place.
    pub async fn compact(&self) -> Result<(), StateError> {
        self.submit(Op::Compact, None).await
    }

    async fn submit(&self, op: Op, room: Option<OwnedSemaphorePermit>) -> Result<(), StateError> {
        let (tx, rx) = oneshot::channel();
        self.shared().enqueue(Request {
            op,
            done: Some(tx),
            _room: room,
        })?;
        self.shared().outcome(rx.await)
    }

    /// How many `fdatasync`s of the journal the writer made since the
    /// folder was opened in this process (each covers every record queued
    /// before it started).
    pub fn syncs(&self) -> u64 {
        self.shared().syncs.load(Ordering::Relaxed)
    }

    /// Where the journal's frames end, in bytes (the file may hold up to
    /// [`JOURNAL_PREALLOC_BYTES`] of zeros after it).
    pub fn journal_bytes(&self) -> u64 {
        self.shared().files.lock().journal_len
    }

    /// Reads one delegation.
    pub fn load(&self, key: &DelegationKey) -> Result<Option<SavedDelegation>, StateError> {
        self.load_record(key)
    }

    /// Reads the record of `key` as a `T`.
    pub fn load_record<T: DeserializeOwned>(
        &self,
        key: &DelegationKey,
    ) -> Result<Option<T>, StateError> {
        let shared = self.shared();
        let json = {
            let files = shared.files.lock();
            let Some(loc) = files.index.get(key).copied() else {
                return Ok(None);
            };
            files.read(loc).map_err(|e| shared.io(e))?
        };
        shared.parse(&json).map(Some)
    }

    /// Deletes the temporary files earlier versions' saves left behind in a
    /// crash (`<key>.json.tmp`), and a compaction's unfinished snapshot.
    pub fn remove_temporaries(&self) -> Result<(), StateError> {
        remove_temporaries(&self.shared().dir)
    }

    /// The number of saved delegations.
    pub fn count(&self) -> Result<usize, StateError> {
        Ok(self.shared().files.lock().index.len())
    }

    /// Every saved delegation.
    pub fn load_all(&self) -> Result<Vec<SavedDelegation>, StateError> {
        self.load_all_records()
    }

    /// Every record, each read as a `T`.
    pub fn load_all_records<T: DeserializeOwned>(&self) -> Result<Vec<T>, StateError> {
        let shared = self.shared();
        let all = {
            let files = shared.files.lock();
            files
                .index
                .values()
                .map(|loc| files.read(*loc))
                .collect::<std::io::Result<Vec<_>>>()
                .map_err(|e| shared.io(e))?
        };
        all.iter().map(|json| shared.parse(json)).collect()
    }

    /// Holds the writer (tests queue a known batch).
    #[cfg(test)]
    fn pause(&self, paused: bool) {
        self.shared().queue.lock().paused = paused;
        self.shared().work.notify_all();
    }

    /// Turns the idle compaction on or off (tests; off by default there).
    #[cfg(test)]
    fn idle_compaction(&self, on: bool) {
        self.shared().queue.lock().idle_compaction = on;
        self.shared().work.notify_all();
    }

    /// Requests waiting for the writer (tests).
    #[cfg(test)]
    fn queued(&self) -> usize {
        self.shared().queue.lock().items.len()
    }
}

fn remove_op(key: &DelegationKey) -> Op {
    Op::Remove {
        key: key.clone(),
        // A key always serializes (two strings).
        json: serde_json::to_vec(key).unwrap_or_default(),
    }
}

impl Shared {
    fn io(&self, source: std::io::Error) -> StateError {
        StateError::Io {
            path: self.journal_path.display().to_string(),
            source,
        }
    }

    fn stopped(&self) -> StateError {
        StateError::Stopped {
            path: self.journal_path.display().to_string(),
        }
    }

    fn parse<T: DeserializeOwned>(&self, json: &[u8]) -> Result<T, StateError> {
        serde_json::from_slice(json).map_err(|e| StateError::Corrupt {
            path: self.journal_path.display().to_string(),
            message: e.to_string(),
        })
    }

    fn outcome(
        &self,
        done: Result<Result<(), Failure>, oneshot::error::RecvError>,
    ) -> Result<(), StateError> {
        match done {
            Ok(Ok(())) => Ok(()),
            Ok(Err(f)) => Err(f.into_error(&self.journal_path)),
            Err(_) => Err(self.stopped()),
        }
    }

    fn enqueue(&self, request: Request) -> Result<(), StateError> {
        self.enqueue_all(vec![request])
    }

    /// Queues `requests` in order, all at once (the writer takes them in
    /// one batch unless [`MAX_BATCH_BYTES`] cuts it).
    fn enqueue_all(&self, requests: Vec<Request>) -> Result<(), StateError> {
        let mut q = self.queue.lock();
        if q.closed {
            return Err(self.stopped());
        }
        q.items.extend(requests);
        drop(q);
        self.work.notify_one();
        Ok(())
    }

    /// Closes the queue and waits until the writer wrote what was queued
    /// and exited.
    fn close_and_wait(&self) {
        let mut q = self.queue.lock();
        q.closed = true;
        self.work.notify_all();
        while !q.exited {
            self.exit.wait(&mut q);
        }
    }

    /// The next batch: every queued request up to [`MAX_BATCH_BYTES`] (at
    /// least one); `None` once the queue is closed and empty. With `idle`,
    /// an empty batch after [`IDLE_COMPACT_AFTER`] with nothing queued.
    fn next_batch(&self, idle: bool) -> Option<Vec<Request>> {
        let mut q = self.queue.lock();
        loop {
            #[cfg(test)]
            let held = q.paused && !q.closed;
            #[cfg(not(test))]
            let held = false;
            if !q.items.is_empty() && !held {
                break;
            }
            if q.items.is_empty() && q.closed {
                return None;
            }
            #[cfg(test)]
            let idle = idle && q.idle_compaction;
            if idle {
                if self.work.wait_for(&mut q, IDLE_COMPACT_AFTER).timed_out() && q.items.is_empty()
                {
                    return Some(Vec::new());
                }
            } else {
                self.work.wait(&mut q);
            }
        }
        let mut batch = Vec::new();
        let mut bytes = 0usize;
        while let Some(first) = q.items.front() {
            let len = match &first.op {
                Op::Save { json, .. } | Op::Remove { json, .. } => json.len() + ENTRY_HEADER,
                Op::Compact => 0,
            };
            if !batch.is_empty() && bytes + len > MAX_BATCH_BYTES {
                break;
            }
            bytes += len;
            if let Some(r) = q.items.pop_front() {
                batch.push(r);
            }
        }
        Some(batch)
    }

    /// The writer: one frame and one `fdatasync` per batch, then a
    /// compaction when the journal is due one.
    /// The writer's loop; holds the folder's `lock` until it exits.
    fn run(&self, lock: File) {
        let _exit = WriterExit(self, Some(lock));
        let mut frame = Vec::with_capacity(64 * 1024);
        let mut compact_after = 0u64;
        // Records were written since the last compaction.
        let mut written_since = false;
        while let Some(batch) = self.next_batch(written_since) {
            let idle = batch.is_empty();
            let compact = batch.iter().any(|r| matches!(r.op, Op::Compact));
            let (written, compacts): (Vec<_>, Vec<_>) = batch
                .into_iter()
                .partition(|r| !matches!(r.op, Op::Compact));
            if !written.is_empty() {
                self.write(written, &mut frame);
                written_since = true;
            }
            let due = {
                let f = self.files.lock();
                let records = f.journal_len.saturating_sub(MAGIC_LEN);
                f.failed.is_none()
                    && if idle {
                        records > 0 && records >= f.live_bytes / 8
                    } else {
                        f.journal_len >= COMPACT_MIN_BYTES.max(compact_after)
                            && f.journal_len >= COMPACT_RATIO.saturating_mul(f.live_bytes)
                    }
            };
            if idle {
                // One idle compaction (or none) per quiet spell.
                written_since = false;
            }
            if compact || due {
                let result = self.compact();
                match &result {
                    Ok(()) => compact_after = 0,
                    Err(f) => {
                        tracing::warn!(dir = %self.dir.display(), error = %f.message, "could not compact the state journal");
                        compact_after = self
                            .files
                            .lock()
                            .journal_len
                            .saturating_add(COMPACT_MIN_BYTES);
                    }
                }
                respond(compacts, &result);
            }
        }
    }

    /// Appends one frame holding `batch`, syncs it, updates the index and
    /// answers every waiter.
    fn write(&self, batch: Vec<Request>, frame: &mut Vec<u8>) {
        let (journal, at, cap, failed) = {
            let f = self.files.lock();
            (
                f.journal.clone(),
                f.journal_len,
                f.journal_cap,
                f.failed.clone(),
            )
        };
        if let Some(failed) = failed {
            respond(batch, &Err(failed));
            return;
        }
        frame.clear();
        frame.resize(FRAME_HEADER, 0);
        let mut locs = Vec::with_capacity(batch.len());
        for r in &batch {
            let (tag, json) = match &r.op {
                Op::Save { json, .. } => (TAG_SAVE, json),
                Op::Remove { json, .. } => (TAG_REMOVE, json),
                Op::Compact => continue,
            };
            frame.push(tag);
            // Records are at most MAX_SAVED_BYTES, keys far less.
            let len = u32::try_from(json.len()).unwrap_or(u32::MAX);
            frame.extend_from_slice(&len.to_le_bytes());
            locs.push(Loc {
                in_snapshot: false,
                offset: at + frame.len() as u64,
                len,
            });
            frame.extend_from_slice(json);
        }
        seal(frame);
        let end = at + frame.len() as u64;
        if let Err(e) = write_all_at(&journal, frame, at) {
            let failure = Failure::of(&e, "writing the journal");
            // Cut what may have reached the file so the next frame follows
            // the last good one; if even that fails, stop writing.
            let mut f = self.files.lock();
            match journal.set_len(at) {
                Ok(()) => f.journal_cap = at,
                Err(e) => f.failed = Some(Failure::of(&e, "cutting the journal back")),
            }
            drop(f);
            respond(batch, &Err(failure));
            return;
        }
        // A frame that grew the file: zeros ahead of it, in the same sync,
        // so the next frames only overwrite. Without them (no room) the
        // frames append as they would anyway.
        let cap = if end > cap {
            let ahead = end + JOURNAL_PREALLOC_BYTES;
            match write_zeros_at(&journal, end, ahead) {
                Ok(()) => ahead,
                Err(e) => {
                    tracing::debug!(path = %self.journal_path.display(), error = %e, "no zeros written ahead of the state journal");
                    // Zeros left after the frames are harmless (read as
                    // room ahead), and no frame is written past `end`.
                    let _cut = journal.set_len(end);
                    end
                }
            }
        } else {
            cap
        };
        if let Err(e) = journal.sync_data() {
            let failure = Failure::of(&e, "syncing the journal");
            tracing::error!(path = %self.journal_path.display(), error = %e, "the state journal could not be synced; saves fail until a restart");
            self.files.lock().failed = Some(failure.clone());
            respond(batch, &Err(failure));
            return;
        }
        {
            let mut f = self.files.lock();
            for (r, loc) in batch.iter().zip(locs) {
                match &r.op {
                    Op::Save { key, .. } => f.apply(key.clone(), Some(loc)),
                    Op::Remove { key, .. } => f.apply(key.clone(), None),
                    Op::Compact => {}
                }
            }
            f.journal_len = end;
            f.journal_cap = cap;
        }
        self.syncs.fetch_add(1, Ordering::Relaxed);
        respond(batch, &Ok(()));
    }

    /// Writes the live set to a new snapshot and starts the journal afresh
    /// (see the module docs for the order and why a crash is safe).
    fn compact(&self) -> Result<(), Failure> {
        let (live, journal, snapshot) = {
            let f = self.files.lock();
            if let Some(failed) = &f.failed {
                return Err(failed.clone());
            }
            let live: Vec<(DelegationKey, Loc)> =
                f.index.iter().map(|(k, l)| (k.clone(), *l)).collect();
            (live, f.journal.clone(), f.snapshot.clone())
        };
        let tmp_path = self.dir.join(SNAPSHOT_TMP);
        let fail = |what: &'static str| move |e: std::io::Error| Failure::of(&e, what);
        let tmp = open_private(&tmp_path, true).map_err(fail("creating the snapshot"))?;
        let mut index = HashMap::with_capacity(live.len());
        let mut frame = Vec::with_capacity(MAX_BATCH_BYTES.min(64 * 1024));
        let mut at = MAGIC_LEN;
        write_all_at(&tmp, &SNAPSHOT_MAGIC, 0).map_err(fail("writing the snapshot"))?;
        let mut live_bytes = 0u64;
        let mut pending = live.into_iter().peekable();
        while pending.peek().is_some() {
            frame.clear();
            frame.resize(FRAME_HEADER, 0);
            while let Some((_, loc)) = pending.peek() {
                let len = loc.len as usize + ENTRY_HEADER;
                if frame.len() > FRAME_HEADER && frame.len() + len > MAX_BATCH_BYTES {
                    break;
                }
                let Some((key, loc)) = pending.next() else {
                    break;
                };
                let file = if loc.in_snapshot {
                    snapshot
                        .as_ref()
                        .ok_or_else(|| Failure::of(&std::io::Error::other("gone"), "no snapshot"))?
                } else {
                    &journal
                };
                frame.push(TAG_SAVE);
                frame.extend_from_slice(&loc.len.to_le_bytes());
                let start = frame.len();
                frame.resize(start + loc.len as usize, 0);
                read_exact_at(file, &mut frame[start..], loc.offset)
                    .map_err(fail("reading a live record"))?;
                index.insert(
                    key,
                    Loc {
                        in_snapshot: true,
                        offset: at + start as u64,
                        len: loc.len,
                    },
                );
                live_bytes += len as u64;
            }
            seal(&mut frame);
            write_all_at(&tmp, &frame, at).map_err(fail("writing the snapshot"))?;
            at += frame.len() as u64;
        }
        tmp.sync_all().map_err(fail("syncing the snapshot"))?;
        std::fs::rename(&tmp_path, self.dir.join(SNAPSHOT_FILE))
            .map_err(fail("renaming the snapshot"))?;
        sync_dir(&self.dir).map_err(fail("syncing the state folder"))?;
        // The snapshot holds the whole live set now; replaying the old
        // journal over it changes nothing, so cutting the journal can fail.
        let cut = {
            let mut f = self.files.lock();
            f.snapshot = Some(Arc::new(tmp));
            f.index = index;
            f.live_bytes = live_bytes;
            let cut = journal.set_len(MAGIC_LEN);
            if cut.is_ok() {
                f.journal_len = MAGIC_LEN;
                f.journal_cap = MAGIC_LEN;
            }
            cut
        };
        cut.map_err(fail("cutting the journal"))?;
        if let Err(e) = journal.sync_data() {
            let failure = Failure::of(&e, "syncing the journal");
            self.files.lock().failed = Some(failure.clone());
            return Err(failure);
        }
        Ok(())
    }
}

/// Marks the writer gone when it returns or panics: the folder's lock is
/// given back, the queue closes, what is still queued fails with
/// [`StateError::Stopped`] (its senders are dropped), and
/// [`Shared::close_and_wait`] returns.
struct WriterExit<'a>(&'a Shared, Option<File>);

impl Drop for WriterExit<'_> {
    fn drop(&mut self) {
        drop(self.1.take());
        let left = {
            let mut q = self.0.queue.lock();
            q.closed = true;
            q.exited = true;
            std::mem::take(&mut q.items)
        };
        drop(left);
        self.0.exit.notify_all();
    }
}

/// Answers every waiter of `batch` (and logs a failure nobody waits for).
fn respond(batch: Vec<Request>, result: &Result<(), Failure>) {
    for r in batch {
        match r.done {
            Some(done) => {
                let _ignored = done.send(result.clone());
            }
            None => {
                if let Err(f) = result {
                    let what = match r.op {
                        Op::Save { .. } => "written",
                        _ => "deleted",
                    };
                    tracing::warn!(error = %f.message, "a state record could not be {what}");
                }
            }
        }
    }
}

/// Fills in a frame's header (length and hash of what follows it).
fn seal(frame: &mut [u8]) {
    let (header, payload) = frame.split_at_mut(FRAME_HEADER);
    // Batches are at most MAX_BATCH_BYTES plus one record of at most
    // MAX_SAVED_BYTES.
    let len = u32::try_from(payload.len()).unwrap_or(u32::MAX);
    header[..4].copy_from_slice(&len.to_le_bytes());
    header[4..].copy_from_slice(&xxhash_rust::xxh3::xxh3_64(payload).to_le_bytes());
}

/// The payload range of a valid frame at `at`, and where the next begins;
/// `None` when the frame is incomplete or its hash does not match.
fn frame_at(buf: &[u8], at: usize) -> Option<(Range<usize>, usize)> {
    let header = buf.get(at..at.checked_add(FRAME_HEADER)?)?;
    let len = u32::from_le_bytes(header.get(..4)?.try_into().ok()?) as usize;
    let hash = u64::from_le_bytes(header.get(4..)?.try_into().ok()?);
    if len == 0 {
        return None;
    }
    let start = at + FRAME_HEADER;
    let end = start.checked_add(len)?;
    let payload = buf.get(start..end)?;
    (xxhash_rust::xxh3::xxh3_64(payload) == hash).then_some((start..end, end))
}

/// The entries of a valid frame's payload: tag and the range of its JSON.
fn entries(buf: &[u8], payload: Range<usize>) -> Result<Vec<(u8, Range<usize>)>, String> {
    let mut out = Vec::new();
    let mut at = payload.start;
    while at < payload.end {
        let header = buf
            .get(at..at + ENTRY_HEADER)
            .filter(|_| at + ENTRY_HEADER <= payload.end)
            .ok_or_else(|| format!("entry header cut at offset {at}"))?;
        let tag = header[0];
        let len = u32::from_le_bytes([header[1], header[2], header[3], header[4]]) as usize;
        let start = at + ENTRY_HEADER;
        let end = start + len;
        if end > payload.end {
            return Err(format!("entry at offset {at} runs past its frame"));
        }
        if tag != TAG_SAVE && tag != TAG_REMOVE {
            return Err(format!(
                "unknown entry tag {tag} at offset {at} (written by a newer version?)"
            ));
        }
        out.push((tag, start..end));
        at = end;
    }
    Ok(out)
}

/// Applies the frames of `buf` (a whole file) from `at` to `files`' index;
/// returns where the valid frames end.
fn replay(
    buf: &[u8],
    mut at: usize,
    in_snapshot: bool,
    path: &Path,
    files: &mut Files,
) -> Result<usize, StateError> {
    let corrupt = |message: String| StateError::Corrupt {
        path: path.display().to_string(),
        message,
    };
    while at < buf.len() {
        let Some((payload, next)) = frame_at(buf, at) else {
            return Ok(at);
        };
        for (tag, json) in entries(buf, payload).map_err(corrupt)? {
            let bytes = buf.get(json.clone()).unwrap_or_default();
            let loc = Loc {
                in_snapshot,
                offset: json.start as u64,
                len: u32::try_from(json.len()).unwrap_or(u32::MAX),
            };
            if tag == TAG_SAVE {
                let saved: Keyed = serde_json::from_slice(bytes)
                    .map_err(|e| corrupt(format!("record at offset {}: {e}", json.start)))?;
                files.apply(saved.key, Some(loc));
            } else {
                let key: DelegationKey = serde_json::from_slice(bytes)
                    .map_err(|e| corrupt(format!("removal at offset {}: {e}", json.start)))?;
                files.apply(key, None);
            }
        }
        at = next;
    }
    Ok(at)
}

/// Whether the bad frame at `at` is followed by a valid one (then it is
/// corruption, not a torn tail).
fn valid_frame_follows(buf: &[u8], at: usize) -> bool {
    let Some(header) = buf.get(at..at + FRAME_HEADER) else {
        return false;
    };
    let len = u32::from_le_bytes([header[0], header[1], header[2], header[3]]) as usize;
    len > 0 && frame_at(buf, at + FRAME_HEADER + len).is_some()
}

/// Opens the folder's files and starts its writer.
/// Takes the folder's exclusive lock ([`LOCK_FILE`]), or fails with
/// [`StateError::Locked`] when another process holds it. The writer thread
/// holds it and gives it back before it marks itself gone, so an earlier
/// writer of the folder in this process never holds it past
/// [`Shared::close_and_wait`].
fn lock_folder(dir: &Path) -> Result<File, StateError> {
    let path = dir.join(LOCK_FILE);
    let io = |source| StateError::Io {
        path: path.display().to_string(),
        source,
    };
    let file = open_private(&path, false).map_err(io)?;
    match file.try_lock() {
        Ok(()) => Ok(file),
        Err(std::fs::TryLockError::WouldBlock) => Err(StateError::Locked {
            path: path.display().to_string(),
        }),
        Err(std::fs::TryLockError::Error(e)) => Err(io(e)),
    }
}

fn start(dir: &Path) -> Result<Arc<Handle>, StateError> {
    let lock = lock_folder(dir)?;
    let journal_path = dir.join(JOURNAL_FILE);
    let snapshot_path = dir.join(SNAPSHOT_FILE);
    let io = |path: &Path| {
        let path = path.display().to_string();
        move |source| StateError::Io {
            path: path.clone(),
            source,
        }
    };
    remove_if_exists(&dir.join(SNAPSHOT_TMP))?;

    let journal = open_private(&journal_path, false).map_err(io(&journal_path))?;
    let mut bytes = Vec::new();
    (&journal)
        .read_to_end(&mut bytes)
        .map_err(io(&journal_path))?;
    let mut files = Files {
        journal: Arc::new(journal),
        journal_len: MAGIC_LEN,
        journal_cap: MAGIC_LEN,
        snapshot: None,
        index: HashMap::new(),
        live_bytes: 0,
        failed: None,
    };

    match File::open(&snapshot_path) {
        Ok(mut snapshot) => {
            let mut snap = Vec::new();
            snapshot
                .read_to_end(&mut snap)
                .map_err(io(&snapshot_path))?;
            if snap.get(..8) != Some(&SNAPSHOT_MAGIC[..]) {
                return Err(StateError::Corrupt {
                    path: snapshot_path.display().to_string(),
                    message: "not a snapshot of delegations (unknown header)".into(),
                });
            }
            let end = replay(&snap, 8, true, &snapshot_path, &mut files)?;
            if end != snap.len() {
                return Err(StateError::Corrupt {
                    path: snapshot_path.display().to_string(),
                    message: format!("damaged frame at offset {end}"),
                });
            }
            files.snapshot = Some(Arc::new(snapshot));
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io(&snapshot_path)(e)),
    }

    if bytes.len() < JOURNAL_MAGIC.len() {
        if !JOURNAL_MAGIC.starts_with(&bytes) {
            return Err(StateError::Corrupt {
                path: journal_path.display().to_string(),
                message: "not a journal of delegations (unknown header)".into(),
            });
        }
        // New, or a crash while it was created.
        files.journal.set_len(0).map_err(io(&journal_path))?;
        write_all_at(&files.journal, &JOURNAL_MAGIC, 0).map_err(io(&journal_path))?;
        files.journal.sync_all().map_err(io(&journal_path))?;
        sync_dir(dir).map_err(io(dir))?;
    } else {
        if bytes.get(..8) != Some(&JOURNAL_MAGIC[..]) {
            return Err(StateError::Corrupt {
                path: journal_path.display().to_string(),
                message: "not a journal of delegations (unknown header)".into(),
            });
        }
        let end = replay(&bytes, 8, false, &journal_path, &mut files)?;
        // Zeros after the frames are room written ahead of them
        // ([`JOURNAL_PREALLOC_BYTES`]), kept; anything else is a torn tail.
        let written = bytes
            .iter()
            .rposition(|b| *b != 0)
            .map_or(0, |last| last + 1);
        files.journal_cap = bytes.len() as u64;
        if end < written {
            if valid_frame_follows(&bytes, end) {
                return Err(StateError::Corrupt {
                    path: journal_path.display().to_string(),
                    message: format!(
                        "damaged frame at offset {end} followed by valid ones: acknowledged records are damaged (restore the folder from a backup, or remove the journal to start without them)"
                    ),
                });
            }
            tracing::warn!(
                path = %journal_path.display(),
                offset = end,
                bytes = written - end,
                "dropping the torn tail of the state journal (a write a crash interrupted)"
            );
            files
                .journal
                .set_len(end as u64)
                .map_err(io(&journal_path))?;
            files.journal.sync_data().map_err(io(&journal_path))?;
            files.journal_cap = end as u64;
        }
        files.journal_len = end as u64;
    }
    migrate(dir, &journal_path, &mut files)?;

    let shared = Arc::new(Shared {
        dir: dir.to_path_buf(),
        journal_path,
        queue: Mutex::new(Queue::default()),
        work: Condvar::new(),
        exit: Condvar::new(),
        room: Arc::new(Semaphore::new(MAX_QUEUED_BYTES)),
        files: Mutex::new(files),
        syncs: AtomicU64::new(0),
    });
    let writer = {
        let shared = shared.clone();
        std::thread::Builder::new()
            .name("oab-state".into())
            .spawn(move || shared.run(lock))
            .map_err(io(dir))?
    };
    Ok(Arc::new(Handle {
        shared,
        writer: Mutex::new(Some(writer)),
    }))
}

/// Takes the `<key>.json` files of earlier versions into the journal
/// (synced), then deletes them and their temporaries.
fn migrate(dir: &Path, journal_path: &Path, files: &mut Files) -> Result<(), StateError> {
    let io = |path: &Path| {
        let path = path.display().to_string();
        move |source| StateError::Io {
            path: path.clone(),
            source,
        }
    };
    let mut legacy = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io(dir))? {
        let entry = entry.map_err(io(dir))?;
        let path = entry.path();
        if path.extension().and_then(|e| e.to_str()) == Some("json")
            && entry.file_type().map_err(io(&path))?.is_file()
        {
            legacy.push(path);
        }
    }
    if legacy.is_empty() {
        return Ok(());
    }
    legacy.sort();
    let mut at = files.journal_len;
    let mut frame = Vec::new();
    let mut pending = legacy.iter().peekable();
    while pending.peek().is_some() {
        frame.clear();
        frame.resize(FRAME_HEADER, 0);
        let mut applied = Vec::new();
        while let Some(path) = pending.next_if(|_| frame.len() < MAX_BATCH_BYTES) {
            let json = std::fs::read(path).map_err(io(path))?;
            let saved: SavedDelegation =
                serde_json::from_slice(&json).map_err(|e| StateError::Corrupt {
                    path: path.display().to_string(),
                    message: e.to_string(),
                })?;
            let len = u32::try_from(json.len()).map_err(|_| StateError::TooLarge {
                bytes: json.len(),
                max: MAX_SAVED_BYTES,
            })?;
            frame.push(TAG_SAVE);
            frame.extend_from_slice(&len.to_le_bytes());
            applied.push((
                saved.key,
                Loc {
                    in_snapshot: false,
                    offset: at + frame.len() as u64,
                    len,
                },
            ));
            frame.extend_from_slice(&json);
        }
        seal(&mut frame);
        write_all_at(&files.journal, &frame, at).map_err(io(journal_path))?;
        at += frame.len() as u64;
        for (key, loc) in applied {
            files.apply(key, Some(loc));
        }
    }
    files.journal.sync_data().map_err(io(journal_path))?;
    files.journal_len = at;
    files.journal_cap = files.journal_cap.max(at);
    tracing::info!(dir = %dir.display(), files = legacy.len(), "took the state files of an earlier version into the journal");
    for path in &legacy {
        remove_if_exists(path)?;
    }
    remove_temporaries(dir)?;
    sync_dir(dir).map_err(io(dir))
}

fn remove_temporaries(dir: &Path) -> Result<(), StateError> {
    let io = |source| StateError::Io {
        path: dir.display().to_string(),
        source,
    };
    for entry in std::fs::read_dir(dir).map_err(io)? {
        let path = entry.map_err(io)?.path();
        if path.to_str().is_some_and(|p| p.ends_with(".json.tmp")) {
            remove_if_exists(&path)?;
        }
    }
    Ok(())
}

fn remove_if_exists(path: &Path) -> Result<(), StateError> {
    match std::fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(StateError::Io {
            path: path.display().to_string(),
            source,
        }),
    }
}

/// Opens `path` for reading and writing (created mode 0600); `truncate`
/// empties it.
fn open_private(path: &Path, truncate: bool) -> std::io::Result<File> {
    let mut o = OpenOptions::new();
    o.read(true).write(true).create(true).truncate(truncate);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt as _;
        o.mode(0o600);
    }
    o.open(path)
}

/// Makes a rename or a new file in `dir` durable.
fn sync_dir(dir: &Path) -> std::io::Result<()> {
    #[cfg(unix)]
    {
        File::open(dir)?.sync_all()
    }
    #[cfg(not(unix))]
    {
        let _ = dir;
        Ok(())
    }
}

#[cfg(unix)]
fn write_all_at(file: &File, buf: &[u8], at: u64) -> std::io::Result<()> {
    std::os::unix::fs::FileExt::write_all_at(file, buf, at)
}

/// Writes zeros over `from..to` of `file`.
fn write_zeros_at(file: &File, from: u64, to: u64) -> std::io::Result<()> {
    const ZEROS: [u8; 8192] = [0; 8192];
    let mut at = from;
    while at < to {
        let n = usize::try_from(to - at).map_or(ZEROS.len(), |left| left.min(ZEROS.len()));
        write_all_at(file, &ZEROS[..n], at)?;
        at += n as u64;
    }
    Ok(())
}

#[cfg(unix)]
fn read_exact_at(file: &File, buf: &mut [u8], at: u64) -> std::io::Result<()> {
    std::os::unix::fs::FileExt::read_exact_at(file, buf, at)
}

#[cfg(windows)]
fn write_all_at(file: &File, mut buf: &[u8], mut at: u64) -> std::io::Result<()> {
    while !buf.is_empty() {
        let n = std::os::windows::fs::FileExt::seek_write(file, buf, at)?;
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        buf = &buf[n..];
        at += n as u64;
    }
    Ok(())
}

#[cfg(windows)]
fn read_exact_at(file: &File, mut buf: &mut [u8], mut at: u64) -> std::io::Result<()> {
    while !buf.is_empty() {
        let n = std::os::windows::fs::FileExt::seek_read(file, buf, at)?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        buf = &mut buf[n..];
        at += n as u64;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::tests::{NOW, peer, sample_request};
    use oab_wire::RequestId;

    fn saved(id: &str, cursor: u64) -> SavedDelegation {
        let mut request = sample_request(NOW);
        request.request_id = RequestId::new(id).unwrap();
        SavedDelegation {
            key: DelegationKey::new(peer("acme/a"), request.request_id.clone()),
            callee: peer("acme/b"),
            envelope: format!("{{\"signed\":\"{id}\"}}"),
            request_digest: Digest::of(id.as_bytes()),
            request,
            cursor,
            finished: false,
        }
    }

    fn sorted(state: &FileState) -> Vec<SavedDelegation> {
        let mut all = state.load_all().unwrap();
        all.sort_by(|a, b| a.key.cmp(&b.key));
        all
    }

    fn journal_len(dir: &Path) -> u64 {
        std::fs::metadata(dir.join(JOURNAL_FILE)).unwrap().len()
    }

    #[tokio::test]
    async fn saves_and_removes_survive_a_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let state = FileState::open(dir.path()).unwrap();
        let (a, b, c) = (saved("req-a", 0), saved("req-b", 0), saved("req-c", 0));
        for s in [&a, &b, &c] {
            state.save(s).await.unwrap();
        }
        let mut a2 = a.clone();
        a2.cursor = 7;
        a2.finished = true;
        state.save(&a2).await.unwrap();
        state.remove(&b.key).await.unwrap();
        // A removal nobody waits for is durable with the next sync.
        state.remove_later(&c.key);
        let d = saved("req-d", 1);
        state.save(&d).await.unwrap();
        drop(state);

        let state = FileState::open(dir.path()).unwrap();
        assert_eq!(state.count().unwrap(), 2);
        assert_eq!(state.load(&a.key).unwrap(), Some(a2));
        assert_eq!(state.load(&b.key).unwrap(), None);
        assert_eq!(state.load(&c.key).unwrap(), None);
        assert_eq!(state.load(&d.key).unwrap(), Some(d));
    }

    #[tokio::test]
    async fn a_folder_locked_elsewhere_is_refused_and_taken_once_free() {
        let dir = tempfile::tempdir().unwrap();
        // What another process's writer holds: the lock on its own open file.
        let other = File::create(dir.path().join(LOCK_FILE)).unwrap();
        other.lock().unwrap();
        match FileState::open(dir.path()) {
            Err(StateError::Locked { path }) => {
                assert!(path.ends_with(LOCK_FILE), "{path}");
            }
            Err(e) => panic!("refused for another reason: {e}"),
            Ok(_) => panic!("a folder another process holds was opened"),
        }
        // Nothing was written while it was refused.
        assert!(!dir.path().join(JOURNAL_FILE).exists());
        drop(other);

        let state = FileState::open(dir.path()).unwrap();
        let a = saved("req-a", 0);
        state.save(&a).await.unwrap();
        // Held while open (also through a second open in this process) ...
        let again = FileState::open(dir.path()).unwrap();
        let probe = File::open(dir.path().join(LOCK_FILE)).unwrap();
        assert!(matches!(
            probe.try_lock(),
            Err(std::fs::TryLockError::WouldBlock)
        ));
        drop(state);
        assert!(matches!(
            probe.try_lock(),
            Err(std::fs::TryLockError::WouldBlock)
        ));
        // ... and released with the last handle.
        drop(again);
        probe.try_lock().unwrap();
        probe.unlock().unwrap();
        let state = FileState::open(dir.path()).unwrap();
        assert_eq!(state.load(&a.key).unwrap(), Some(a));
    }

    #[tokio::test]
    async fn a_torn_tail_is_dropped_and_cut() {
        let dir = tempfile::tempdir().unwrap();
        let state = FileState::open(dir.path()).unwrap();
        let kept = [saved("req-1", 1), saved("req-2", 2)];
        for s in &kept {
            state.save(s).await.unwrap();
        }
        let before = sorted(&state);
        let good = state.journal_bytes();
        drop(state);

        // Crashes mid-write: half a frame, a whole frame whose payload is
        // damaged, each after the zeros written ahead (as an append past
        // them leaves it) and over them at the end of the frames (as a
        // write into that room leaves it).
        let json = serde_json::to_vec(&saved("req-3", 3)).unwrap();
        let mut frame = vec![0; FRAME_HEADER];
        frame.push(TAG_SAVE);
        frame.extend_from_slice(&u32::try_from(json.len()).unwrap().to_le_bytes());
        frame.extend_from_slice(&json);
        seal(&mut frame);
        let mut damaged = frame.clone();
        let last = damaged.len() - 2;
        damaged[last] ^= 0x55;
        for tail in [&frame[..frame.len() / 2], &damaged[..]] {
            for inside in [false, true] {
                let f = OpenOptions::new()
                    .write(true)
                    .open(dir.path().join(JOURNAL_FILE))
                    .unwrap();
                let room = good + JOURNAL_PREALLOC_BYTES;
                f.set_len(room).unwrap();
                let at = if inside { good } else { room };
                write_all_at(&f, tail, at).unwrap();
                drop(f);
                let state = FileState::open(dir.path()).unwrap();
                assert_eq!(sorted(&state), before);
                assert_eq!(state.journal_bytes(), good);
                assert_eq!(journal_len(dir.path()), good, "the tail is cut");
                drop(state);
            }
        }
        // Zeros after the frames (no frame was begun) are not a torn tail:
        // kept, and written over by the next frame.
        let f = OpenOptions::new()
            .write(true)
            .open(dir.path().join(JOURNAL_FILE))
            .unwrap();
        write_all_at(&f, &[0u8; 300], good).unwrap();
        drop(f);
        let state = FileState::open(dir.path()).unwrap();
        assert_eq!(sorted(&state), before);
        assert_eq!(state.journal_bytes(), good);
        assert_eq!(journal_len(dir.path()), good + 300, "zeros are kept");
        drop(state);

        // And the journal goes on after the cut.
        let state = FileState::open(dir.path()).unwrap();
        state.save(&saved("req-4", 4)).await.unwrap();
        drop(state);
        let state = FileState::open(dir.path()).unwrap();
        assert_eq!(state.count().unwrap(), 3);
    }

    /// Frames are written over zeros written ahead of them: the file grows
    /// by a frame and [`JOURNAL_PREALLOC_BYTES`] when a frame passes its
    /// end, and not for the frames that fit before it; a reopen keeps the
    /// zeros and writes the next frame over them.
    #[tokio::test]
    async fn the_journal_keeps_zeros_ahead_of_its_frames() {
        let dir = tempfile::tempdir().unwrap();
        let ahead = |dir: &Path, end: u64| {
            let bytes = std::fs::read(dir.join(JOURNAL_FILE)).unwrap();
            let from = usize::try_from(end).unwrap();
            bytes.len() - from - bytes[from..].iter().take_while(|b| **b == 0).count()
        };
        let state = FileState::open(dir.path()).unwrap();
        state.save(&saved("req-0", 0)).await.unwrap();
        let first = state.journal_bytes();
        let cap = first + JOURNAL_PREALLOC_BYTES;
        assert_eq!(journal_len(dir.path()), cap);
        assert_eq!(ahead(dir.path(), first), 0, "zeros after the frames");
        // Frames that fit before the end leave the file's size alone.
        let mut n = 1;
        while state.journal_bytes() + 2_000 < cap {
            state.save(&saved(&format!("req-{n}"), 0)).await.unwrap();
            n += 1;
            assert_eq!(journal_len(dir.path()), cap);
        }
        let end = state.journal_bytes();
        assert!(end > first);
        drop(state);
        // A reopen reads every record and keeps the zeros.
        let state = FileState::open(dir.path()).unwrap();
        assert_eq!(state.count().unwrap(), n);
        assert_eq!(state.journal_bytes(), end);
        assert_eq!(journal_len(dir.path()), cap);
        // The frames go on at their end; the one that passes the file's end
        // grows it with new zeros ahead.
        while state.journal_bytes() <= cap {
            state.save(&saved(&format!("req-{n}"), 0)).await.unwrap();
            n += 1;
        }
        let end = state.journal_bytes();
        assert_eq!(journal_len(dir.path()), end + JOURNAL_PREALLOC_BYTES);
        assert_eq!(ahead(dir.path(), end), 0);
        drop(state);
        let state = FileState::open(dir.path()).unwrap();
        assert_eq!(state.count().unwrap(), n);
        assert_eq!(state.journal_bytes(), end);
    }

    #[tokio::test]
    async fn damage_before_acknowledged_records_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let state = FileState::open(dir.path()).unwrap();
        state.save(&saved("req-1", 1)).await.unwrap();
        state.save(&saved("req-2", 2)).await.unwrap();
        drop(state);
        // A bit flipped in the first frame, a valid frame after it.
        let path = dir.path().join(JOURNAL_FILE);
        let mut bytes = std::fs::read(&path).unwrap();
        let at = MAGIC_LEN as usize + FRAME_HEADER + ENTRY_HEADER + 10;
        bytes[at] ^= 0x01;
        std::fs::write(&path, &bytes).unwrap();
        let err = FileState::open(dir.path()).unwrap_err();
        assert!(
            matches!(&err, StateError::Corrupt { message, .. } if message.contains("followed by valid ones")),
            "{err}"
        );
        // Nothing was cut: an operator can still look at it.
        assert_eq!(std::fs::read(&path).unwrap(), bytes);
    }

    /// A writer left idle after writing compacts once: the journal goes
    /// back to its header, the snapshot holds the live set, and a reopen
    /// reads the same records.
    #[tokio::test]
    async fn an_idle_writer_compacts_the_journal_once() {
        let dir = tempfile::tempdir().unwrap();
        let state = FileState::open(dir.path()).unwrap();
        state.idle_compaction(true);
        for i in 0..50 {
            state.save(&saved(&format!("req-{i}"), 0)).await.unwrap();
            state.save(&saved(&format!("req-{i}"), 7)).await.unwrap();
        }
        let live = sorted(&state);
        assert_eq!(live.len(), 50);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while state.journal_bytes() > MAGIC_LEN {
            assert!(
                std::time::Instant::now() < deadline,
                "no idle compaction: the journal holds {} bytes",
                state.journal_bytes()
            );
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        assert_eq!(journal_len(dir.path()), MAGIC_LEN);
        assert_eq!(sorted(&state), live);
        drop(state);
        let state = FileState::open(dir.path()).unwrap();
        assert_eq!(sorted(&state), live);
    }
    #[tokio::test]
    async fn compaction_keeps_exactly_the_live_set() {
        let dir = tempfile::tempdir().unwrap();
        let state = FileState::open(dir.path()).unwrap();
        for i in 0..200 {
            state.save(&saved(&format!("req-{i}"), 0)).await.unwrap();
            state.save(&saved(&format!("req-{i}"), 5)).await.unwrap();
        }
        let gone: Vec<_> = (0..200)
            .filter(|i| i % 3 != 0)
            .map(|i| saved(&format!("req-{i}"), 0).key)
            .collect();
        state.remove_many(&gone).await.unwrap();
        let live = sorted(&state);
        assert_eq!(live.len(), 67);
        assert!(live.iter().all(|s| s.cursor == 5));

        state.compact().await.unwrap();
        assert_eq!(
            journal_len(dir.path()),
            MAGIC_LEN,
            "the journal starts afresh"
        );
        assert!(!dir.path().join(SNAPSHOT_TMP).exists());
        assert_eq!(sorted(&state), live);
        // Records after the compaction go to the journal, over the snapshot.
        let mut first = live[0].clone();
        first.finished = true;
        state.save(&first).await.unwrap();
        state.remove(&live[1].key).await.unwrap();
        let mut expected = live.clone();
        expected[0] = first;
        expected.remove(1);
        assert_eq!(sorted(&state), expected);
        drop(state);

        let state = FileState::open(dir.path()).unwrap();
        assert_eq!(sorted(&state), expected);
        // A second compaction reads from the snapshot and the journal.
        state.compact().await.unwrap();
        drop(state);
        let state = FileState::open(dir.path()).unwrap();
        assert_eq!(sorted(&state), expected);
    }

    #[tokio::test]
    async fn a_crash_between_snapshot_and_journal_cut_changes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let state = FileState::open(dir.path()).unwrap();
        for i in 0..20 {
            state.save(&saved(&format!("req-{i}"), i)).await.unwrap();
        }
        let keys: Vec<_> = (0..10).map(|i| saved(&format!("req-{i}"), 0).key).collect();
        state.remove_many(&keys).await.unwrap();
        let journal = std::fs::read(dir.path().join(JOURNAL_FILE)).unwrap();
        let live = sorted(&state);
        state.compact().await.unwrap();
        drop(state);
        // As if the process died after the rename, before the cut.
        std::fs::write(dir.path().join(JOURNAL_FILE), &journal).unwrap();
        let state = FileState::open(dir.path()).unwrap();
        assert_eq!(sorted(&state), live);
    }

    #[tokio::test]
    async fn the_journal_compacts_itself_within_its_bound() {
        let dir = tempfile::tempdir().unwrap();
        let state = FileState::open(dir.path()).unwrap();
        let one = serde_json::to_vec(&saved("req-0000", 0)).unwrap().len() as u64;
        // Rewrite ten records far past COMPACT_MIN_BYTES.
        let rounds = (3 * COMPACT_MIN_BYTES / one / 10) as usize;
        let mut most = 0;
        for round in 0..rounds {
            for i in 0..10 {
                state
                    .save(&saved(&format!("req-{i:04}"), round as u64))
                    .await
                    .unwrap();
            }
            most = most.max(state.journal_bytes());
        }
        assert!(
            most <= COMPACT_MIN_BYTES + MAX_BATCH_BYTES as u64,
            "the journal reached {most} bytes"
        );
        assert_eq!(state.count().unwrap(), 10);
        assert!(dir.path().join(SNAPSHOT_FILE).exists(), "it compacted");
    }

    #[tokio::test]
    async fn per_delegation_files_of_earlier_versions_are_taken_in() {
        let dir = tempfile::tempdir().unwrap();
        let old = [saved("req-1", 3), saved("req-2", 0)];
        for s in &old {
            // The earlier layout: `<caller~name#request>.json`.
            let name = format!("{}.json", s.key.to_string().replace('/', "~"));
            std::fs::write(dir.path().join(name), serde_json::to_vec(s).unwrap()).unwrap();
        }
        std::fs::write(dir.path().join("x.json.tmp"), b"{").unwrap();
        std::fs::create_dir(dir.path().join("a2a-push")).unwrap();

        let state = FileState::open(dir.path()).unwrap();
        let mut expected = old.to_vec();
        expected.sort_by(|a, b| a.key.cmp(&b.key));
        assert_eq!(sorted(&state), expected);
        let left: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".json") || n.ends_with(".json.tmp"))
            .collect();
        assert!(left.is_empty(), "left behind: {left:?}");
        assert!(dir.path().join("a2a-push").is_dir());
        drop(state);
        let state = FileState::open(dir.path()).unwrap();
        assert_eq!(sorted(&state), expected);
    }

    #[tokio::test]
    async fn a_damaged_file_of_an_earlier_version_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("acme~a#req-1.json"), b"{\"key\":").unwrap();
        let err = FileState::open(dir.path()).unwrap_err();
        assert!(matches!(err, StateError::Corrupt { .. }), "{err}");
        assert!(dir.path().join("acme~a#req-1.json").exists());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_saves_share_one_sync() {
        const SAVES: usize = 100;
        let dir = tempfile::tempdir().unwrap();
        let state = FileState::open(dir.path()).unwrap();
        state.save(&saved("req-first", 0)).await.unwrap();
        let before = state.syncs();
        // Hold the writer as if a sync were running while the saves come.
        state.pause(true);
        let tasks: Vec<_> = (0..SAVES)
            .map(|i| {
                let state = state.clone();
                tokio::spawn(async move { state.save(&saved(&format!("req-{i}"), 1)).await })
            })
            .collect();
        while state.queued() < SAVES {
            tokio::task::yield_now().await;
        }
        state.pause(false);
        for t in tasks {
            t.await.unwrap().unwrap();
        }
        assert_eq!(state.syncs() - before, 1, "{SAVES} saves, one sync");
        assert_eq!(state.count().unwrap(), SAVES + 1);
    }

    #[tokio::test]
    async fn opening_a_folder_twice_shares_its_writer() {
        let dir = tempfile::tempdir().unwrap();
        let a = FileState::open(dir.path()).unwrap();
        let b = FileState::open(dir.path()).unwrap();
        a.save(&saved("req-1", 1)).await.unwrap();
        assert_eq!(b.count().unwrap(), 1);
        b.save(&saved("req-2", 1)).await.unwrap();
        assert_eq!(a.syncs(), 2);
        drop(a);
        drop(b);
        let c = FileState::open(dir.path()).unwrap();
        assert_eq!(c.count().unwrap(), 2);
    }

    #[tokio::test]
    async fn a_record_over_the_limit_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let state = FileState::open(dir.path()).unwrap();
        let mut big = saved("req-big", 0);
        big.envelope = "x".repeat(MAX_SAVED_BYTES + 1);
        let err = state.save(&big).await.unwrap_err();
        assert!(matches!(err, StateError::TooLarge { .. }), "{err}");
        assert_eq!(state.count().unwrap(), 0);
    }
}
