//! Where one delegation is: `GET /delegation?id=` on the admin port and
//! `oab-relay inspect` ([`inspect`], [`Inspection::render`]); and the
//! delegations open longest (`GET /delegations`, [`oldest_open`]) that the
//! status page lists, each linking to its inspect view.
//!
//! A delegation is found by its key (`<caller>#<request id>`), by the task id
//! the A2A facade gave it (`task-<32 hex>`, derived from the key), or by the
//! delegation id an OpenAB runtime gave it at its connector's CP endpoint
//! (the request id starts with `RequestId::cp_prefix` of it). The last two scan the key
//! index of every configured peer, so they cost one index walk per peer.
//!
//! Never: shows a payload, a signature or an authority; reads only the
//! meta record, the down log's frame types and this instance's delivery
//! cursors. Every store read has a deadline ([`STORE_DEADLINE`]).

use std::fmt::Write as _;

use oab_wire::{DelegationKey, Direction, FrameType, PeerId};
use serde::{Deserialize, Serialize};

use crate::hub::Hub;
use crate::status::{PeerStatus, STORE_DEADLINE, peer_statuses};
use crate::store::{DelegationMeta, EventStore, ReadOutcome, StoreError};

/// Most down-log entries [`inspect`] reads to find follow-ups and cancels
/// (the default `retention.max_log_entries`); past it the lists are cut and
/// say so.
pub const MAX_SCANNED_ENTRIES: u64 = 10_000;

/// Most delegations [`oldest_open`] returns.
pub const MAX_OLDEST: usize = 100;

/// Everything `inspect` shows of one delegation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Inspection {
    /// Its key, `<caller>#<request id>`.
    pub key: String,
    /// The task id the A2A facade gives it.
    pub a2a_task_id: String,
    /// The caller's W3C trace id, when its connector sent one (protocol
    /// version 2): the `trace_id` of every process's log lines for it.
    #[serde(default)]
    pub trace_id: Option<String>,
    /// `open` or `finished`.
    pub state: String,
    /// The terminal outcome (`completed`, `failed`, `cancelled`, `expired`,
    /// `unknown`, `rejected`) once there is one.
    pub outcome: Option<String>,
    /// The caller, and where its session is.
    pub caller: PeerStatus,
    /// The callee, and where its session is.
    pub callee: PeerStatus,
    /// When it was opened (ms since the Unix epoch).
    pub created_ms: u64,
    /// Its deadline (ms since the Unix epoch).
    pub deadline_ms: u64,
    /// Whether the callee accepted it (stored its first up entry).
    pub accepted: bool,
    /// The callee's connector instance that accepted it.
    pub accepted_by: Option<String>,
    /// When its terminal was stored (ms since the Unix epoch).
    pub terminal_ms: Option<u64>,
    /// The down log (caller to callee: the open, follow-ups, cancels).
    pub down: LogStatus,
    /// The up log (callee to caller: events, the terminal).
    pub up: LogStatus,
    /// Down sequences of the caller's follow-up messages (`Data` after the
    /// open), in order.
    pub follow_ups: Vec<u64>,
    /// Down sequences of cancels (the caller's, or the relay's at expiry).
    pub cancels: Vec<u64>,
    /// Whether `follow_ups` and `cancels` cover the whole down log: `false`
    /// when the log was compacted (released by the caller after its
    /// terminal), trimmed by retention, or longer than
    /// [`MAX_SCANNED_ENTRIES`].
    pub down_log_read: bool,
    /// The store keys it lives in (Redis; none with the memory store).
    pub store_keys: Vec<String>,
    /// What it waits for, most pressing first; empty once nothing is owed.
    pub waiting_for: Vec<String>,
    /// The instance that answered (`fleet.node`).
    pub answered_by: String,
    /// When the answer was made (ms since the Unix epoch).
    pub now_ms: u64,
}

/// One log of a delegation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LogStatus {
    /// The last sequence stored durably (the relay's entries included).
    pub stored: u64,
    /// The last sequence the sending peer stored: what the relay
    /// acknowledged to it.
    pub acknowledged: u64,
    /// The last sequence this instance delivered to the receiver's session
    /// here; `None` when the receiver's session is not here (see its
    /// `served_by`) or has not subscribed to this log.
    pub delivered_here: Option<u64>,
}

/// One delegation open long, as `/delegations` lists them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OpenSummary {
    /// Its key.
    pub key: String,
    /// The callee.
    pub callee: String,
    /// When it was opened (ms since the Unix epoch).
    pub created_ms: u64,
    /// Its deadline (ms since the Unix epoch).
    pub deadline_ms: u64,
    /// Whether the callee accepted it.
    pub accepted: bool,
    /// Up entries stored (events and the terminal).
    pub up_stored: u64,
}

/// The answer of `/delegations`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OldestOpen {
    /// The open delegations, oldest first.
    pub delegations: Vec<OpenSummary>,
    /// How many open delegations the configured callers have in all.
    pub open: usize,
    /// When the answer was made (ms since the Unix epoch).
    pub now_ms: u64,
}

/// Why [`inspect`] found nothing to show.
#[derive(Debug, thiserror::Error)]
pub enum InspectError {
    /// No delegation with this id exists (never opened, or dropped after its
    /// retention).
    #[error(
        "no delegation {0} in the store (never opened, or its retention after the terminal passed)"
    )]
    NotFound(String),
    /// The id names several delegations (one CP delegation id used by
    /// several runtimes): inspect one of these keys.
    #[error("{id} names {} delegations; inspect one key: {}", keys.len(), keys.join(", "))]
    Ambiguous {
        /// The id given.
        id: String,
        /// The keys it names.
        keys: Vec<String>,
    },
    /// The id is none of the forms a delegation is known by.
    #[error(
        "{0} is not a delegation id: give <caller peer>#<request id>, an A2A task id (task-<32 hex>) or an OpenAB CP delegation id"
    )]
    BadId(String),
    /// The store failed or did not answer in time.
    #[error("the store did not answer: {0}")]
    Store(String),
}

impl From<StoreError> for InspectError {
    fn from(e: StoreError) -> Self {
        InspectError::Store(e.to_string())
    }
}

/// Runs a store read under [`STORE_DEADLINE`].
async fn timed<T>(
    f: impl Future<Output = Result<T, StoreError>>,
    what: &str,
) -> Result<T, InspectError> {
    match tokio::time::timeout(STORE_DEADLINE, f).await {
        Ok(r) => Ok(r?),
        Err(_) => Err(InspectError::Store(format!(
            "{what}: no answer within {} s",
            STORE_DEADLINE.as_secs()
        ))),
    }
}

/// Finds the delegation `id` names and shows where it is.
pub async fn inspect<S: EventStore>(hub: &Hub<S>, id: &str) -> Result<Inspection, InspectError> {
    let id = id.trim();
    let key = find(hub, id).await?;
    let meta = timed(hub.store.meta(&key), "meta")
        .await?
        .ok_or_else(|| InspectError::NotFound(id.to_string()))?;
    let parties = peer_statuses(hub, &[key.caller.clone(), meta.callee.clone()], true).await;
    let [caller, callee]: [PeerStatus; 2] = parties
        .try_into()
        .map_err(|_| InspectError::Store("presence: wrong number of records".into()))?;
    let delivered = hub.delivered_here(&key);
    let scan = scan_down_log(hub, &key, meta.down_tail).await?;
    let now_ms = oab_wire::identity::now_ms();
    let mut out = Inspection {
        key: key.to_string(),
        a2a_task_id: key.a2a_task_id(),
        state: if meta.terminal.is_some() {
            "finished"
        } else {
            "open"
        }
        .into(),
        outcome: meta.terminal.map(|o| o.to_string()),
        trace_id: meta.trace.map(|t| t.to_hex()),
        caller,
        callee,
        created_ms: meta.created_ms,
        deadline_ms: meta.deadline_ms,
        accepted: meta.up_tail > 0,
        accepted_by: meta.accepted_by.as_ref().map(ToString::to_string),
        terminal_ms: meta.terminal_ms,
        down: LogStatus {
            stored: meta.down_tail,
            acknowledged: meta.down_sender_tail,
            delivered_here: delivered[0],
        },
        up: LogStatus {
            stored: meta.up_tail,
            acknowledged: meta.up_sender_tail,
            delivered_here: delivered[1],
        },
        follow_ups: scan.follow_ups,
        cancels: scan.cancels,
        down_log_read: scan.complete,
        store_keys: hub.store.keys_of(&key),
        waiting_for: Vec::new(),
        answered_by: hub.fleet.node.clone(),
        now_ms,
    };
    out.waiting_for = waiting_for(&out, &meta, scan.compacted);
    Ok(out)
}

/// The key `id` names: the key itself, or found by a derived id.
async fn find<S: EventStore>(hub: &Hub<S>, id: &str) -> Result<DelegationKey, InspectError> {
    if id.contains('#') {
        return id
            .parse::<DelegationKey>()
            .map_err(|_| InspectError::BadId(id.to_string()));
    }
    if id.is_empty() || id.len() > 256 || id.chars().any(char::is_control) {
        return Err(InspectError::BadId(id.to_string()));
    }
    let task = id.starts_with("task-");
    let prefix = oab_wire::RequestId::cp_prefix(id);
    let peers = hub.live().directory.peers.clone();
    let mut found: Vec<DelegationKey> = Vec::new();
    for peer in &peers {
        let keys = timed(hub.store.delegation_keys_of(peer), "the peer's index").await?;
        for key in keys.into_iter().filter(|k| &k.caller == peer) {
            let hit = if task {
                key.a2a_task_id() == id
            } else {
                key.request_id.as_str().starts_with(&prefix)
            };
            if hit && !found.contains(&key) {
                found.push(key);
            }
        }
    }
    match found.len() {
        0 => Err(InspectError::NotFound(id.to_string())),
        1 => Ok(found.remove(0)),
        _ => {
            let mut keys: Vec<String> = found.iter().map(ToString::to_string).collect();
            keys.sort();
            Err(InspectError::Ambiguous {
                id: id.to_string(),
                keys,
            })
        }
    }
}

/// What the down log holds after the open.
struct DownScan {
    follow_ups: Vec<u64>,
    cancels: Vec<u64>,
    /// Every entry after the open was read.
    complete: bool,
    /// The logs were compacted after the caller released the terminal.
    compacted: bool,
}

/// Reads the down log's frame types after the open (entry 1), at most
/// [`MAX_SCANNED_ENTRIES`].
async fn scan_down_log<S: EventStore>(
    hub: &Hub<S>,
    key: &DelegationKey,
    tail: u64,
) -> Result<DownScan, InspectError> {
    let mut scan = DownScan {
        follow_ups: Vec::new(),
        cancels: Vec::new(),
        complete: true,
        compacted: false,
    };
    let mut cursor = 1;
    let limits = hub.live().config.wire_limits();
    while cursor < tail {
        if cursor > MAX_SCANNED_ENTRIES {
            scan.complete = false;
            break;
        }
        let read = timed(hub.store.read(key, Direction::Down, cursor, 256), "read").await?;
        match read {
            ReadOutcome::Entries { entries, .. } => {
                let Some(&(last, _)) = entries.last() else {
                    break;
                };
                for (seq, frame) in entries {
                    match oab_wire::codec::peek_prefix(&frame, &limits).map(|p| p.frame_type) {
                        Ok(FrameType::Data) => scan.follow_ups.push(seq),
                        Ok(FrameType::Cancel) => scan.cancels.push(seq),
                        _ => {}
                    }
                }
                cursor = last;
            }
            ReadOutcome::Trimmed {
                first_available, ..
            } => {
                scan.complete = false;
                if first_available == 0 || first_available <= cursor {
                    scan.compacted = first_available == 0;
                    break;
                }
                cursor = first_available - 1;
            }
            ReadOutcome::Lost { .. } | ReadOutcome::Unknown => {
                scan.complete = false;
                break;
            }
        }
    }
    Ok(scan)
}

/// What the delegation waits for, most pressing first.
fn waiting_for(i: &Inspection, meta: &DelegationMeta, compacted: bool) -> Vec<String> {
    let mut w = Vec::new();
    let caller = &i.caller;
    let callee = &i.callee;
    let where_ = |p: &PeerStatus| match &p.served_by {
        Some(node) => format!("online on {node}"),
        None => "offline".to_string(),
    };
    if let Some(outcome) = &i.outcome {
        if compacted {
            return w;
        }
        match i.up.delivered_here {
            Some(d) if d >= i.up.stored => {}
            Some(d) => w.push(format!(
                "the caller {} ({}) to receive up entries {}..={} (the terminal, {outcome}, is {})",
                caller.peer,
                where_(caller),
                d + 1,
                i.up.stored,
                i.up.stored
            )),
            None if !caller.online => w.push(format!(
                "the caller {} (offline) to come back and read the terminal ({outcome}, up entry {}) from the store",
                caller.peer, i.up.stored
            )),
            None => {}
        }
        return w;
    }
    if i.now_ms >= meta.deadline_ms {
        w.push(format!(
            "the sweeper: the deadline passed {} ago; the relay ends it expired at its next sweep",
            oab_ops::time::short_duration(i.now_ms - meta.deadline_ms)
        ));
    }
    if !callee.online {
        let what = if i.accepted {
            format!(
                "down entries after its cursor wait in the store (the log holds {})",
                i.down.stored
            )
        } else {
            "the open waits in the store".to_string()
        };
        w.push(format!(
            "the callee {} (offline) to come online: {what}",
            callee.peer
        ));
    } else if !i.accepted {
        let held = match i.down.delivered_here {
            Some(d) if d >= 1 => "its connector has the open",
            Some(_) => "the relay is delivering the open",
            None => "the open is delivered by its instance",
        };
        w.push(format!(
            "the callee {} ({}) to accept it: {held}",
            callee.peer,
            where_(callee)
        ));
    } else if let Some(&c) = i.cancels.last() {
        w.push(format!(
            "the callee {} ({}) to end it after the cancel (down entry {c})",
            callee.peer,
            where_(callee)
        ));
    } else {
        w.push(format!(
            "the callee {} ({}): its agent is running it ({} up entries so far)",
            callee.peer,
            where_(callee),
            i.up.stored
        ));
    }
    if let Some(d) = i.down.delivered_here.filter(|d| *d < i.down.stored) {
        w.push(format!(
            "delivery of down entries {}..={} to the callee's session here",
            d + 1,
            i.down.stored
        ));
    }
    if !caller.online && i.up.stored > 0 {
        w.push(format!(
            "the caller {} (offline): up entries wait in the store (the log holds {})",
            caller.peer, i.up.stored
        ));
    }
    w
}

/// The open delegations of the configured callers, oldest first, at most
/// `limit` (capped at [`MAX_OLDEST`]). Reads every open delegation's record
/// (the store's open index), so it costs one read per open delegation.
pub async fn oldest_open<S: EventStore>(
    hub: &Hub<S>,
    limit: usize,
) -> Result<OldestOpen, InspectError> {
    let peers: Vec<PeerId> = hub.live().directory.peers.clone();
    let mut all: Vec<DelegationMeta> = Vec::new();
    for peer in &peers {
        let open = timed(hub.store.open_delegations_of(peer), "open delegations").await?;
        all.extend(open.into_iter().filter(|m| &m.key.caller == peer));
    }
    let open = all.len();
    all.sort_by_key(|a| (a.created_ms, a.key.to_string()));
    all.truncate(limit.min(MAX_OLDEST));
    Ok(OldestOpen {
        delegations: all
            .into_iter()
            .map(|m| OpenSummary {
                key: m.key.to_string(),
                callee: m.callee.to_string(),
                created_ms: m.created_ms,
                deadline_ms: m.deadline_ms,
                accepted: m.up_tail > 0,
                up_stored: m.up_tail,
            })
            .collect(),
        open,
        now_ms: oab_wire::identity::now_ms(),
    })
}

impl Inspection {
    /// The inspection as text (what `oab-relay inspect` prints).
    pub fn render(&self) -> String {
        use oab_ops::time::{short_duration, utc_rfc3339};
        let now = self.now_ms;
        let at = |ms: u64| {
            let when = utc_rfc3339(i64::try_from(ms / 1_000).unwrap_or(i64::MAX));
            if ms <= now {
                format!("{when} ({} ago)", short_duration(now - ms))
            } else {
                format!("{when} (in {})", short_duration(ms - now))
            }
        };
        let party = |p: &PeerStatus| match (&p.served_by, &p.session) {
            (Some(node), Some(s)) => format!("{} online on {node} (session {s})", p.peer),
            (Some(node), None) => format!("{} online on {node}", p.peer),
            _ => format!("{} offline", p.peer),
        };
        let mut o = String::new();
        let _ = writeln!(o, "delegation {}", self.key);
        let _ = writeln!(o, "  a2a task id  {}", self.a2a_task_id);
        if let Some(trace) = &self.trace_id {
            let _ = writeln!(o, "  trace id     {trace}");
        }
        let state = match &self.outcome {
            Some(outcome) => format!("finished: {outcome}"),
            None => "open".to_string(),
        };
        let _ = writeln!(o, "  state        {state}");
        let _ = writeln!(o, "  caller       {}", party(&self.caller));
        let _ = writeln!(o, "  callee       {}", party(&self.callee));
        let _ = writeln!(o, "  created      {}", at(self.created_ms));
        let _ = writeln!(o, "  deadline     {}", at(self.deadline_ms));
        let accepted = match (&self.accepted, &self.accepted_by) {
            (true, Some(by)) => format!("yes, by connector instance {by}"),
            (true, None) => "yes".to_string(),
            (false, _) => "not yet".to_string(),
        };
        let _ = writeln!(o, "  accepted     {accepted}");
        if let Some(t) = self.terminal_ms {
            let _ = writeln!(o, "  terminal     {}", at(t));
        }
        let here = |d: Option<u64>| d.map_or_else(|| "-".to_string(), |d| d.to_string());
        let _ = writeln!(
            o,
            "\n  LOG   STORED  ACKNOWLEDGED TO SENDER  DELIVERED HERE\n  down  {:<6}  {:<22}  {}\n  up    {:<6}  {:<22}  {}",
            self.down.stored,
            self.down.acknowledged,
            here(self.down.delivered_here),
            self.up.stored,
            self.up.acknowledged,
            here(self.up.delivered_here),
        );
        let list = |v: &[u64]| {
            if v.is_empty() {
                "none".to_string()
            } else {
                v.iter().map(u64::to_string).collect::<Vec<_>>().join(", ")
            }
        };
        let partial = if self.down_log_read {
            ""
        } else {
            " (down log not fully readable: compacted, trimmed or long)"
        };
        let _ = writeln!(
            o,
            "\n  follow-ups   {} (down entries){partial}",
            list(&self.follow_ups)
        );
        let _ = writeln!(o, "  cancels      {} (down entries)", list(&self.cancels));
        if !self.store_keys.is_empty() {
            let _ = writeln!(o, "  store keys   {}", self.store_keys.join(" "));
        }
        if self.waiting_for.is_empty() {
            let _ = writeln!(o, "\n  waiting for  nothing");
        } else {
            let _ = writeln!(o, "\n  waiting for");
            for w in &self.waiting_for {
                let _ = writeln!(o, "    - {w}");
            }
        }
        let _ = writeln!(
            o,
            "\n  (answered by {}; DELIVERED HERE counts this instance's sessions only)",
            self.answered_by
        );
        o
    }
}
