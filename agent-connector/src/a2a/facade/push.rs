//! Push notifications: the configs of each task, their delivery to the
//! webhooks, and their persistence in the caller's state folder.
//!
//! **Delivery.** One delivery task per config posts the task's A2A events,
//! the same StreamResponses a stream carries (`task`, then `statusUpdate` /
//! `artifactUpdate`), to the config's webhook, one at a time, in event
//! order, from the task table (which the tracker folds from the
//! connector's durable event log). A notification is confirmed by a `2xx`;
//! anything else is retried with exponential backoff (`initial_backoff`
//! doubling up to `max_backoff`) up to `max_attempts` attempts; then it is
//! dropped (logged, counted in [`PushStats::dropped`]) and the next is
//! tried. Headers: `X-A2A-Notification-Token: <token>` when the config has
//! a token, `Authorization: <scheme> <credentials>` when it has
//! `authentication` with credentials (SPEC §4.3.3, §13.2).
//!
//! **Cursor.** Each config keeps `next`, the task event sequence (the
//! profile's `seq`; 0 is the task as created) it delivers next. It moves
//! only past a confirmed (or dropped) notification and is saved after each
//! move, so after a restart delivery resumes at the first unconfirmed
//! notification: at least once, never a gap. The numbering is a pure
//! function of the delegation's up log, so the re-folded task after a
//! restart has the same numbers. A config registered with a new task's
//! `SendMessage` starts at 0 (the created task); one made by
//! `CreateTaskPushNotificationConfig` starts after the task's last event.
//!
//! **Persistence.** With a caller state folder, each task's configs and
//! cursors are one JSON file in `<state_dir>/a2a-push/` (mode 0600 in a 0700
//! folder: it holds the webhooks' tokens and credentials), written to a
//! temporary name and renamed. While a task has a config that has not
//! delivered its terminal, the tracker does not record the delegation as
//! finished, so a restart takes the delegation back and the configs with
//! it. Without a state folder, configs live in memory only.
//!
//! **Bounds** ([`PushOptions`]). Configs per task (`max_configs_per_task`)
//! and in all (`max_configs`): past either, a new config is refused with
//! `InvalidParams` (first, configs whose task the task table forgot are
//! dropped, then those that delivered their terminal). Notifications
//! waiting per config (`max_pending_per_config`): past it the oldest
//! waiting are skipped (a `warn` log, counted in [`PushStats::overflowed`]);
//! so are events the task table dropped (`max_events_per_task`) before
//! they were delivered.
//!
//! **Pruning.** A config's delivery ends at the terminal; the config stays
//! for `Get`/`List` until its task leaves the task table, and is then
//! removed (when the next config is created or after a restart). Its file
//! is deleted once every config of the task has delivered the terminal or
//! was deleted.

use parking_lot::Mutex;
use std::collections::HashMap;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use oab_wire::{DelegationKey, PeerId};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;
use tracing::{Instrument as _, debug, warn};

use super::Inner;
use super::webhook::{WebhookClient, WebhookUrl};
use crate::a2a::jsonrpc::A2aError;
use crate::a2a::tasks::{EventBody, TaskCell, minted_task_id};
use crate::caller::DelegationEvent;

/// Push notification settings (see the module's opening comment).
#[derive(Debug, Clone)]
pub struct PushOptions {
    /// Configs one task may have; past this `Create` is refused.
    pub max_configs_per_task: usize,
    /// Configs the facade holds in all; past this `Create` is refused
    /// (after forgetting configs of forgotten tasks, then delivered ones).
    pub max_configs: usize,
    /// Notifications that may wait per config; past this the oldest
    /// waiting are skipped (logged and counted).
    pub max_pending_per_config: u64,
    /// Attempts per notification before it is dropped (logged and
    /// counted); at least 1.
    pub max_attempts: u32,
    /// Pause after the first failed attempt; doubles after each.
    pub initial_backoff: Duration,
    /// Longest pause between attempts.
    pub max_backoff: Duration,
    /// Time for one attempt: connect, TLS, request and status line
    /// (SPEC §13.2 recommends 10–30 s).
    pub request_timeout: Duration,
    /// Accept `http://` webhooks on hosts other than loopback (their token
    /// and credentials then cross the network in clear).
    pub allow_plain_http: bool,
}

impl Default for PushOptions {
    fn default() -> Self {
        PushOptions {
            max_configs_per_task: 10,
            max_configs: 1_000,
            max_pending_per_config: 1_000,
            max_attempts: 8,
            initial_backoff: Duration::from_millis(500),
            max_backoff: Duration::from_secs(60),
            request_timeout: Duration::from_secs(10),
            allow_plain_http: false,
        }
    }
}

/// Counts of push deliveries since the facade started.
#[derive(Debug, Default)]
pub struct PushStats {
    /// Notifications confirmed with a 2xx.
    pub delivered: AtomicU64,
    /// Attempts that failed (and were retried or gave up).
    pub failed_attempts: AtomicU64,
    /// Notifications dropped after `max_attempts` failed attempts.
    pub dropped: AtomicU64,
    /// Notifications skipped because more than `max_pending_per_config`
    /// waited, or the task table no longer kept them.
    pub overflowed: AtomicU64,
}

/// The push configs the facade holds now, by whether their delivery is
/// still running.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PushConfigCounts {
    /// Configs whose task's terminal is not yet delivered.
    pub active: u64,
    /// Configs that delivered their task's terminal, kept for `Get`/`List`
    /// until their task leaves the task table.
    pub ended: u64,
}

impl PushStats {
    /// The push series in the Prometheus text format (0.0.4), with
    /// `configs` the configs held now. Every series is there from the
    /// start, at 0 (a connector without a facade renders
    /// `PushStats::default()`).
    pub fn render_prometheus(&self, configs: PushConfigCounts) -> String {
        use crate::link::stats::family;
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let mut out = String::new();
        family(
            &mut out,
            "oab_connector_push_notifications_total",
            "counter",
            "Push notifications by how they ended (delivered: a 2xx; dropped: after the last \
             attempt; skipped: more waited than push_max_pending_per_config, or the task no \
             longer kept them).",
            &[
                ("result=\"delivered\"".into(), load(&self.delivered)),
                ("result=\"dropped\"".into(), load(&self.dropped)),
                ("result=\"skipped\"".into(), load(&self.overflowed)),
            ],
        );
        family(
            &mut out,
            "oab_connector_push_failed_attempts_total",
            "counter",
            "Push attempts that failed (no 2xx in time), each retried or the last before a drop.",
            &[(String::new(), load(&self.failed_attempts))],
        );
        family(
            &mut out,
            "oab_connector_push_configs",
            "gauge",
            "Push notification configs held (active: delivering; ended: terminal delivered).",
            &[
                ("delivery=\"active\"".into(), configs.active),
                ("delivery=\"ended\"".into(), configs.ended),
            ],
        );
        out
    }
}

/// `AuthenticationInfo`. Its `Debug` never shows the credentials.
#[derive(Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct PushAuth {
    pub(crate) scheme: String,
    #[serde(default)]
    pub(crate) credentials: Option<String>,
}

/// One config as saved (and as the methods show it). Its `Debug` never
/// shows the token.
#[derive(Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct PushConfig {
    pub(crate) id: String,
    /// The task id the client named; `None`: the task's public id.
    #[serde(default)]
    pub(crate) task_id: Option<String>,
    pub(crate) url: String,
    #[serde(default)]
    pub(crate) token: Option<String>,
    #[serde(default)]
    pub(crate) authentication: Option<PushAuth>,
    /// Render notifications with the profile's metadata (the creating
    /// request activated the profile).
    #[serde(default)]
    pub(crate) profile: bool,
    /// The next task event sequence to deliver.
    pub(crate) next: u64,
}

impl std::fmt::Debug for PushAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PushAuth")
            .field("scheme", &self.scheme)
            .field("credentials", &self.credentials.as_ref().map(|_| ".."))
            .finish()
    }
}

impl std::fmt::Debug for PushConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PushConfig")
            .field("id", &self.id)
            .field("task_id", &self.task_id)
            .field("url", &self.url)
            .field("token", &self.token.as_ref().map(|_| ".."))
            .field("authentication", &self.authentication)
            .field("profile", &self.profile)
            .field("next", &self.next)
            .finish()
    }
}

impl PushConfig {
    /// The config as A2A shows it (`TaskPushNotificationConfig`).
    pub(crate) fn to_a2a(&self, public_id: &str) -> Value {
        let mut v = json!({
            "id": self.id,
            "taskId": self.task_id.as_deref().unwrap_or(public_id),
            "url": self.url,
        });
        if let Some(o) = v.as_object_mut() {
            if let Some(t) = &self.token {
                o.insert("token".into(), json!(t));
            }
            if let Some(a) = &self.authentication {
                let mut auth = json!({ "scheme": a.scheme });
                if let (Some(c), Some(m)) = (&a.credentials, auth.as_object_mut()) {
                    m.insert("credentials".into(), json!(c));
                }
                o.insert("authentication".into(), auth);
            }
        }
        v
    }
}

/// One task's configs as saved.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct SavedPush {
    key: DelegationKey,
    peer: PeerId,
    configs: Vec<PushConfig>,
}

#[derive(Debug)]
struct Slot {
    config: PushConfig,
    /// Stops this config's delivery task (on delete or replace).
    stop: CancellationToken,
    /// The terminal was delivered (or skipped): nothing left to send.
    done: bool,
}

#[derive(Debug)]
struct TaskPush {
    cell: Arc<TaskCell>,
    slots: Vec<Slot>,
    /// The terminal the tracker folded while configs were still
    /// delivering: committed when the last of them is done.
    deferred: Option<DelegationEvent>,
}

impl TaskPush {
    fn delivering(&self) -> bool {
        self.slots.iter().any(|s| !s.done)
    }
}

/// Every task's configs. An entry is added by the first config of a task
/// and removed when its task left the task table and every config is done,
/// or its last config is deleted.
#[derive(Debug, Default)]
struct Configs {
    tasks: HashMap<DelegationKey, TaskPush>,
    /// Slots held in all.
    total: usize,
}

/// The facade's push notification state.
#[derive(Debug)]
pub(super) struct PushRegistry {
    pub(super) options: PushOptions,
    /// `<state_dir>/a2a-push`, when the caller has a state folder.
    dir: Option<PathBuf>,
    client: WebhookClient,
    configs: Mutex<Configs>,
    /// Serializes file writes, so a later snapshot never loses to an
    /// earlier one.
    write_lock: Mutex<()>,
    pub(super) stats: PushStats,
}

/// A config to register, checked.
#[derive(Debug, Clone)]
pub(super) struct NewConfig {
    pub(super) config: PushConfig,
}

impl PushRegistry {
    pub(super) fn new(options: PushOptions, state_dir: Option<&Path>) -> PushRegistry {
        PushRegistry {
            client: WebhookClient::new(options.request_timeout),
            options,
            dir: state_dir.map(|d| d.join("a2a-push")),
            configs: Mutex::new(Configs::default()),
            write_lock: Mutex::new(()),
            stats: PushStats::default(),
        }
    }

    /// Checks a webhook URL against the facade's rule.
    pub(super) fn check_url(&self, url: &str) -> Result<(), A2aError> {
        WebhookUrl::parse(url, self.options.allow_plain_http)
            .map(|_| ())
            .map_err(A2aError::InvalidParams)
    }

    /// Forgets the entries whose task the table no longer holds and whose
    /// configs are all done.
    fn prune(&self, inner: &Inner, configs: &mut Configs) {
        let gone: Vec<DelegationKey> = configs
            .tasks
            .iter()
            .filter(|(_, t)| {
                !t.delivering() && inner.tasks.find(&t.cell.peer, &t.cell.minted_id).is_none()
            })
            .map(|(k, _)| k.clone())
            .collect();
        for k in gone {
            if let Some(t) = configs.tasks.remove(&k) {
                configs.total = configs.total.saturating_sub(t.slots.len());
            }
        }
    }

    /// Whether one more config fits in `max_configs` (after pruning), so a
    /// send checks before it starts a delegation.
    pub(super) fn check_room(&self, inner: &Inner) -> Result<(), A2aError> {
        let mut configs = self.configs.lock();
        if configs.total >= self.options.max_configs {
            self.prune(inner, &mut configs);
        }
        if configs.total >= self.options.max_configs
            && !configs
                .tasks
                .values()
                .any(|t| t.slots.iter().any(|s| s.done))
        {
            return Err(A2aError::InvalidParams(format!(
                "the facade holds {} push notification configs, the most allowed",
                configs.total
            )));
        }
        Ok(())
    }

    /// Adds (or, with the id of an existing one, replaces) a config of
    /// `cell`'s task and starts its delivery. Persist with [`persist`].
    pub(super) fn register(
        &self,
        inner: &Arc<Inner>,
        cell: &Arc<TaskCell>,
        new: NewConfig,
    ) -> Result<PushConfig, A2aError> {
        let mut configs = self.configs.lock();
        let key = cell.handle.key.clone();
        let replaces = configs
            .tasks
            .get(&key)
            .is_some_and(|t| t.slots.iter().any(|s| s.config.id == new.config.id));
        if !replaces {
            let here = configs.tasks.get(&key).map_or(0, |t| t.slots.len());
            if here >= self.options.max_configs_per_task {
                return Err(A2aError::InvalidParams(format!(
                    "the task has {here} push notification configs, the most allowed; delete one first"
                )));
            }
            if configs.total >= self.options.max_configs {
                self.prune(inner, &mut configs);
            }
            if configs.total >= self.options.max_configs {
                // Forget configs that delivered their terminal.
                let mut freed = 0;
                for t in configs.tasks.values_mut() {
                    let before = t.slots.len();
                    t.slots.retain(|s| !s.done);
                    freed += before - t.slots.len();
                }
                configs.tasks.retain(|_, t| !t.slots.is_empty());
                configs.total = configs.total.saturating_sub(freed);
            }
            if configs.total >= self.options.max_configs {
                return Err(A2aError::InvalidParams(format!(
                    "the facade holds {} push notification configs, the most allowed",
                    configs.total
                )));
            }
        }
        let entry = configs
            .tasks
            .entry(key.clone())
            .or_insert_with(|| TaskPush {
                cell: cell.clone(),
                slots: Vec::new(),
                deferred: None,
            });
        let stop = inner.stop.child_token();
        let slot = Slot {
            config: new.config.clone(),
            stop: stop.clone(),
            done: false,
        };
        if let Some(old) = entry
            .slots
            .iter_mut()
            .find(|s| s.config.id == new.config.id)
        {
            old.stop.cancel();
            *old = slot;
        } else {
            entry.slots.push(slot);
            configs.total += 1;
        }
        drop(configs);
        let span = tracing::info_span!("a2a_push", key = %key, config = %new.config.id);
        tokio::spawn(
            deliver(inner.clone(), cell.clone(), new.config.id.clone(), stop).instrument(span),
        );
        Ok(new.config)
    }

    /// The configs held now, active and ended.
    pub(super) fn counts(&self) -> PushConfigCounts {
        let configs = self.configs.lock();
        let mut counts = PushConfigCounts::default();
        for slot in configs.tasks.values().flat_map(|t| &t.slots) {
            if slot.done {
                counts.ended += 1;
            } else {
                counts.active += 1;
            }
        }
        counts
    }

    /// The configs of `cell`'s task, in creation order.
    pub(super) fn list(&self, cell: &TaskCell) -> Vec<PushConfig> {
        self.configs
            .lock()
            .tasks
            .get(&cell.handle.key)
            .map(|t| t.slots.iter().map(|s| s.config.clone()).collect())
            .unwrap_or_default()
    }

    /// Removes a config (nothing to do when it does not exist); returns the
    /// terminal to commit when that was the last config still delivering.
    pub(super) fn remove(&self, cell: &TaskCell, id: &str) -> Option<DelegationEvent> {
        let mut configs = self.configs.lock();
        let key = &cell.handle.key;
        let t = configs.tasks.get_mut(key)?;
        let pos = t.slots.iter().position(|s| s.config.id == id)?;
        let slot = t.slots.remove(pos);
        slot.stop.cancel();
        let commit = if t.delivering() {
            None
        } else {
            t.deferred.take()
        };
        if t.slots.is_empty() {
            configs.tasks.remove(key);
        }
        configs.total = configs.total.saturating_sub(1);
        commit
    }

    /// Called by the tracker when it folded the terminal: `Some` when the
    /// delegation may be recorded as finished now, `None` when configs are
    /// still delivering (it is then committed when the last is done).
    pub(super) fn on_terminal(
        &self,
        cell: &TaskCell,
        ev: DelegationEvent,
    ) -> Option<DelegationEvent> {
        let mut configs = self.configs.lock();
        match configs.tasks.get_mut(&cell.handle.key) {
            Some(t) if t.delivering() => {
                t.deferred = Some(ev);
                None
            }
            _ => Some(ev),
        }
    }

    /// The config's cursor after a confirmed notification; `false` when
    /// the config is gone (deleted or replaced).
    fn advance(&self, key: &DelegationKey, id: &str, stop: &CancellationToken, next: u64) -> bool {
        let mut configs = self.configs.lock();
        let Some(slot) = configs
            .tasks
            .get_mut(key)
            .and_then(|t| t.slots.iter_mut().find(|s| s.config.id == id))
        else {
            return false;
        };
        if stop.is_cancelled() {
            return false;
        }
        slot.config.next = slot.config.next.max(next);
        true
    }

    /// Marks a config done; returns the terminal to commit when it was the
    /// last one delivering.
    fn finish(&self, key: &DelegationKey, id: &str) -> Option<DelegationEvent> {
        let mut configs = self.configs.lock();
        let t = configs.tasks.get_mut(key)?;
        if let Some(s) = t.slots.iter_mut().find(|s| s.config.id == id) {
            s.done = true;
        }
        if t.delivering() {
            None
        } else {
            t.deferred.take()
        }
    }

    fn config(&self, key: &DelegationKey, id: &str) -> Option<PushConfig> {
        self.configs
            .lock()
            .tasks
            .get(key)
            .and_then(|t| t.slots.iter().find(|s| s.config.id == id))
            .map(|s| s.config.clone())
    }

    fn file(&self, key: &DelegationKey) -> Option<PathBuf> {
        let name = format!("{}.json", key.to_string().replace('/', "~"));
        self.dir.as_ref().map(|d| d.join(name))
    }

    /// Writes `key`'s configs as they stand now (or deletes the file when
    /// none is left delivering). Blocking: call from a blocking thread.
    fn write(&self, key: &DelegationKey) -> Result<(), String> {
        let Some(path) = self.file(key) else {
            return Ok(());
        };
        let _g = self.write_lock.lock();
        let saved = {
            let configs = self.configs.lock();
            configs
                .tasks
                .get(key)
                .filter(|t| t.delivering())
                .map(|t| SavedPush {
                    key: key.clone(),
                    peer: t.cell.peer.clone(),
                    configs: t
                        .slots
                        .iter()
                        .filter(|s| !s.done)
                        .map(|s| s.config.clone())
                        .collect(),
                })
        };
        let shown = path.display().to_string();
        let Some(saved) = saved else {
            return match std::fs::remove_file(&path) {
                Ok(()) => Ok(()),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
                Err(e) => Err(format!("{shown}: {e}")),
            };
        };
        let dir = path.parent().unwrap_or(Path::new("."));
        create_private_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let bytes = serde_json::to_vec_pretty(&saved).map_err(|e| format!("{shown}: {e}"))?;
        let tmp = path.with_extension("json.tmp");
        let io = |e: std::io::Error| format!("{shown}: {e}");
        let mut f = open_private(&tmp).map_err(io)?;
        f.write_all(&bytes).map_err(io)?;
        f.sync_data().map_err(io)?;
        std::fs::rename(&tmp, &path).map_err(io)
    }

    /// Takes back the configs an earlier process saved, for the tasks
    /// [`super::Facade::restore`] took back, and resumes their delivery from
    /// their cursors. Files of tasks that were not taken back are deleted.
    pub(super) fn restore(&self, inner: &Arc<Inner>) -> Result<usize, String> {
        let Some(dir) = &self.dir else {
            return Ok(0);
        };
        let entries = match std::fs::read_dir(dir) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
            Err(e) => return Err(format!("{}: {e}", dir.display())),
        };
        let mut restored = 0;
        for entry in entries {
            let path = entry.map_err(|e| format!("{}: {e}", dir.display()))?.path();
            let name = path.to_string_lossy().to_string();
            if name.ends_with(".json.tmp") {
                let _ = std::fs::remove_file(&path);
                continue;
            }
            if !name.ends_with(".json") {
                continue;
            }
            let saved: SavedPush = match std::fs::read(&path)
                .map_err(|e| e.to_string())
                .and_then(|b| serde_json::from_slice(&b).map_err(|e| e.to_string()))
            {
                Ok(s) => s,
                Err(e) => {
                    warn!(file = %name, error = %e, "an unreadable push config file is ignored");
                    continue;
                }
            };
            let Some(cell) = inner
                .tasks
                .find(&saved.peer, &minted_task_id(&saved.key))
                .filter(|c| c.handle.key == saved.key)
            else {
                warn!(key = %saved.key, "push configs of a delegation that was not taken back are dropped");
                let _ = std::fs::remove_file(&path);
                continue;
            };
            for config in saved.configs {
                match self.register(inner, &cell, NewConfig { config }) {
                    Ok(_) => restored += 1,
                    Err(e) => {
                        warn!(key = %saved.key, error = %e, "a saved push config was not taken back")
                    }
                }
            }
        }
        Ok(restored)
    }
}

fn create_private_dir(dir: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
    }
    Ok(())
}

fn open_private(path: &Path) -> std::io::Result<std::fs::File> {
    let mut o = std::fs::OpenOptions::new();
    o.write(true).create(true).truncate(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt as _;
        o.mode(0o600);
    }
    o.open(path)
}

/// Saves `key`'s configs (off the async threads). A failure is logged: the
/// config still delivers, but a restart may not take it back.
pub(super) async fn persist(inner: &Arc<Inner>, key: &DelegationKey) -> Result<(), String> {
    let (inner2, key2) = (inner.clone(), key.clone());
    match tokio::task::spawn_blocking(move || inner2.push.write(&key2)).await {
        Ok(r) => r,
        Err(e) => Err(e.to_string()),
    }
}

/// Records the delegation as finished (its terminal folded and every
/// config done).
pub(super) async fn commit_terminal(inner: &Arc<Inner>, cell: &TaskCell, ev: DelegationEvent) {
    let (caller, handle) = (inner.caller.clone(), cell.handle.clone());
    if let Err(e) = caller.commit(&handle, &ev).await {
        warn!(error = %e, "could not record the delegation as finished");
    }
}

/// What one step of a delivery has to do.
enum Step {
    /// Post this notification (sequence, body); `last` at the terminal.
    Send { seq: u64, body: Value, last: bool },
    /// Nothing to send yet.
    Wait,
    /// The terminal was delivered: the config is done.
    Done,
}

/// The next step of config `config` of `cell`'s task.
fn next_step(inner: &Inner, cell: &TaskCell, config: &PushConfig) -> (Step, u64) {
    let rec = cell.lock();
    let public = rec
        .callee_id
        .clone()
        .unwrap_or_else(|| cell.minted_id.clone());
    let task_id = config.task_id.clone().unwrap_or(public);
    let mut next = config.next;
    if next == 0 {
        // The task as created, once it has its public id (the callee's,
        // which comes before its first event), so every notification names
        // the task alike.
        if config.task_id.is_none()
            && rec.callee_id.is_none()
            && rec.last_seq == 0
            && rec.closed.is_none()
        {
            return (Step::Wait, 0);
        }
        let body = json!({ "task": rec.render_created(cell, &task_id, config.profile) });
        return (
            Step::Send {
                seq: 0,
                body,
                last: false,
            },
            0,
        );
    }
    let mut skipped = 0;
    if next <= rec.last_seq {
        let max = inner.push.options.max_pending_per_config.max(1);
        let pending = rec.last_seq + 1 - next;
        if pending > max {
            skipped += pending - max;
            next = rec.last_seq + 1 - max;
        }
        let first = rec.first_kept();
        if next < first {
            skipped += first - next;
            next = first;
        }
    }
    if let Some(ev) = rec.events.iter().find(|e| e.seq >= next) {
        let last = matches!(&ev.body, EventBody::Status { state, .. } if state.is_terminal());
        let body = rec.render_event(ev, &task_id, config.profile);
        return (
            Step::Send {
                seq: ev.seq,
                body,
                last,
            },
            skipped,
        );
    }
    if rec.is_terminal() {
        return (Step::Done, skipped);
    }
    (Step::Wait, skipped)
}

/// The pause after `failures` failed attempts.
fn backoff(options: &PushOptions, failures: u32) -> Duration {
    let factor = 2u32.saturating_pow(failures.saturating_sub(1).min(20));
    options
        .initial_backoff
        .saturating_mul(factor)
        .min(options.max_backoff)
}

/// Delivers config `id` of `cell`'s task until its terminal is delivered,
/// the config is deleted or replaced (`stop`), or the facade closes.
async fn deliver(inner: Arc<Inner>, cell: Arc<TaskCell>, id: String, stop: CancellationToken) {
    let key = cell.handle.key.clone();
    let mut watch = cell.subscribe();
    loop {
        let Some(config) = inner.push.config(&key, &id) else {
            return;
        };
        if stop.is_cancelled() {
            return;
        }
        let (step, skipped) = next_step(&inner, &cell, &config);
        if skipped > 0 {
            inner
                .push
                .stats
                .overflowed
                .fetch_add(skipped, Ordering::Relaxed);
            warn!(
                skipped,
                from = config.next,
                "push notifications skipped: more were waiting than max_pending_per_config, or the task no longer kept them"
            );
        }
        match step {
            Step::Wait => {
                tokio::select! {
                    r = watch.changed() => if r.is_err() { return },
                    () = stop.cancelled() => return,
                }
            }
            Step::Done => {
                finish(&inner, &cell, &id).await;
                return;
            }
            Step::Send { seq, body, last } => {
                let Ok(url) = WebhookUrl::parse(&config.url, inner.push.options.allow_plain_http)
                else {
                    warn!("a push config's url no longer passes the check; its delivery stops");
                    finish(&inner, &cell, &id).await;
                    return;
                };
                let headers = headers(&config);
                let bytes = serde_json::to_vec(&body).unwrap_or_default();
                let max = inner.push.options.max_attempts.max(1);
                let mut failures = 0u32;
                let delivered = loop {
                    let r = tokio::select! {
                        r = inner.push.client.post(&url, &headers, &bytes) => r,
                        () = stop.cancelled() => return,
                    };
                    match r {
                        Ok(code) if (200..300).contains(&code) => break true,
                        other => {
                            failures += 1;
                            inner
                                .push
                                .stats
                                .failed_attempts
                                .fetch_add(1, Ordering::Relaxed);
                            let why = match other {
                                Ok(code) => format!("HTTP {code}"),
                                Err(e) => e,
                            };
                            if failures >= max {
                                warn!(seq, attempts = failures, reason = %why, "a push notification is dropped after its last attempt");
                                break false;
                            }
                            let pause = backoff(&inner.push.options, failures);
                            debug!(seq, attempt = failures, reason = %why, ?pause, "push attempt failed; retrying");
                            tokio::select! {
                                () = tokio::time::sleep(pause) => {}
                                () = stop.cancelled() => return,
                            }
                        }
                    }
                };
                let counter = if delivered {
                    &inner.push.stats.delivered
                } else {
                    &inner.push.stats.dropped
                };
                counter.fetch_add(1, Ordering::Relaxed);
                if !inner.push.advance(&key, &id, &stop, seq + 1) {
                    return;
                }
                if last {
                    finish(&inner, &cell, &id).await;
                    return;
                }
                if let Err(e) = persist(&inner, &key).await {
                    warn!(error = %e, "could not save a push config's cursor");
                }
            }
        }
    }
}

/// The config is done: saved as such, and the delegation recorded as
/// finished when it was the last config delivering.
async fn finish(inner: &Arc<Inner>, cell: &Arc<TaskCell>, id: &str) {
    let commit = inner.push.finish(&cell.handle.key, id);
    if let Err(e) = persist(inner, &cell.handle.key).await {
        warn!(error = %e, "could not save a push config's end");
    }
    if let Some(ev) = commit {
        commit_terminal(inner, cell, ev).await;
    }
}

/// The headers of a notification (SPEC §4.3.3).
fn headers(config: &PushConfig) -> Vec<(&'static str, String)> {
    let mut h = Vec::new();
    if let Some(t) = config.token.as_ref().filter(|t| !t.is_empty()) {
        h.push(("X-A2A-Notification-Token", t.clone()));
    }
    if let Some(a) = &config.authentication
        && let Some(c) = a.credentials.as_ref().filter(|c| !c.is_empty())
    {
        h.push(("Authorization", format!("{} {c}", a.scheme)));
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_up_to_the_cap() {
        let o = PushOptions {
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(1),
            ..PushOptions::default()
        };
        let got: Vec<u128> = (1..=6).map(|f| backoff(&o, f).as_millis()).collect();
        assert_eq!(got, vec![100, 200, 400, 800, 1000, 1000]);
        assert_eq!(backoff(&o, u32::MAX), Duration::from_secs(1));
    }

    #[test]
    fn headers_follow_the_spec() {
        let mut c = PushConfig {
            id: "c".into(),
            task_id: None,
            url: "http://127.0.0.1/".into(),
            token: Some("tok".into()),
            authentication: Some(PushAuth {
                scheme: "Bearer".into(),
                credentials: Some("cred".into()),
            }),
            profile: false,
            next: 0,
        };
        assert_eq!(
            headers(&c),
            vec![
                ("X-A2A-Notification-Token", "tok".to_string()),
                ("Authorization", "Bearer cred".to_string()),
            ]
        );
        c.token = None;
        c.authentication = Some(PushAuth {
            scheme: "Bearer".into(),
            credentials: None,
        });
        assert!(
            headers(&c).is_empty(),
            "a scheme without credentials sends nothing"
        );
        c.token = Some("secret-token".into());
        c.authentication = Some(PushAuth {
            scheme: "Bearer".into(),
            credentials: Some("secret-cred".into()),
        });
        let shown = format!("{c:?}");
        assert!(!shown.contains("secret"), "{shown}");
    }
}
