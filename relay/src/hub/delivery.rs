//! Getting a log's entries to its receiver: a durable append delivered
//! live when it is the receiver's next entry, a subscription from a cursor
//! with its replay from the store, and the `Gap` or `Error` frames that
//! tell a receiver what it cannot have (trimmed, unknown, entries the store
//! lost after acknowledging them).
//!
//! Never appends to the store and never reads payloads. Never waits on a
//! receiver's queue under a view's lock: a full queue turns the
//! subscription into a replay that sends at the receiver's pace.

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use oab_wire::{CloseCode, DelegationKey, Direction, Frame, Gap, GapReason, Outcome, encode};
use tracing::{Instrument as _, debug, warn};

use super::views::DelegationView;
use super::wakeups::nudge;
use super::{Hub, SessionRef, ViewRef};
use crate::outbox::{Outbox, Pushed};
use crate::refusal::Refusal;
use crate::store::{EventStore, ReadOutcome};

/// Most entries read from the store per replay step.
const REPLAY_BATCH: usize = 256;

/// Bytes a replay step aims to read: each step reads as many entries as the
/// previous step's average entry size fits in this (one at least, at most
/// [`REPLAY_BATCH`]), and the first step reads one. A replay whose receiver
/// does not read therefore holds at most about this much (plus one entry)
/// beyond what its session's queue holds (`session_queue_bytes`), whatever
/// the size of the log's entries; small entries still go 256 per read.
const REPLAY_STEP_BYTES: usize = 1024 * 1024;

/// Entries to read next, from the bytes and count of the last step.
fn next_replay_count(read_bytes: usize, read_entries: usize) -> usize {
    if read_entries == 0 {
        return 1;
    }
    let average = (read_bytes / read_entries).max(1);
    (REPLAY_STEP_BYTES / average).clamp(1, REPLAY_BATCH)
}

/// What [`Hub::subscribe`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Subscribed {
    /// Subscribed; the replay from the cursor runs.
    Yes,
    /// The session's peer does not receive that log.
    Refused,
    /// The view was dropped from the hub's cache since it was looked up:
    /// look the delegation up again and retry.
    Evicted,
}

impl<S: EventStore> Hub<S> {
    /// Applies a durable append to the view and delivers the frame.
    /// `woke`: the append was published to the receiver's wake channel; if
    /// not and the receiver is not subscribed here, it gets a nudge instead.
    #[allow(clippy::too_many_arguments)] // the entry's fields
    pub fn appended(
        self: &Arc<Self>,
        live: &ViewRef,
        key: &DelegationKey,
        dir: Direction,
        seq: u64,
        frame: Bytes,
        terminal: Option<Outcome>,
        woke: bool,
    ) {
        let mut l = live.lock();
        let tail = l.tail_mut(dir);
        *tail = (*tail).max(seq);
        self.note_terminal(&mut l, terminal);
        let subscribed = self.deliver(&mut l, key, dir, seq, frame);
        if self.fleet.enabled && !woke && !subscribed {
            // The receiver went away between the decision and the append.
            let receiver = l.receiver(dir).clone();
            drop(l);
            let hub = self.clone();
            let msg = nudge(key, dir, seq);
            self.tasks.spawn(async move {
                let _ = hub.store.publish(vec![(receiver, msg)]).await;
            });
        }
    }

    /// The store's log `dir` ends at `tail`, below what this view had seen:
    /// the store lost entries it had acknowledged (a Redis restart that lost
    /// writes not yet in its AOF, a failover to a replica that lagged). The
    /// cached tail follows the store, and a receiver that already holds
    /// entries past `tail` is told with a `Gap` (`epoch_changed`, as for a
    /// store that lost everything) and unsubscribed, instead of waiting for
    /// entries that will never come again under those numbers.
    pub fn store_lost(
        &self,
        l: &mut DelegationView,
        key: &DelegationKey,
        dir: Direction,
        tail: u64,
    ) {
        *l.tail_mut(dir) = tail;
        let (terminal, trace) = (l.terminal, l.trace);
        let slot = l.sub_mut(dir);
        let Some(sub) = slot.as_ref().filter(|s| s.delivered > tail) else {
            return;
        };
        warn!(%key, trace_id = trace.map(tracing::field::display), dir = dir.name(), tail, delivered = sub.delivered, "the store lost acknowledged entries; the receiver is told with a gap");
        let (outbox, after, session) = (sub.outbox.clone(), sub.delivered, sub.session);
        *slot = None;
        self.forget_subscription(session, key, dir);
        self.gap(
            &outbox,
            key,
            dir,
            after,
            u64::from(tail > 0),
            terminal,
            GapReason::EpochChanged,
        );
    }

    /// A sender's entry skipped ahead of the store's log, which ends at
    /// `tail`: if the view had seen more, the store lost entries
    /// ([`Self::store_lost`]).
    pub fn hole(&self, live: &ViewRef, key: &DelegationKey, dir: Direction, tail: u64) {
        let mut l = live.lock();
        if *l.tail_mut(dir) > tail {
            self.store_lost(&mut l, key, dir, tail);
        }
    }

    /// Delivers entry `seq` to the receiver of `dir` if it is the next one for
    /// a live subscription; starts a catch-up replay if the receiver is behind.
    /// Returns whether the receiver is subscribed here.
    pub(super) fn deliver(
        self: &Arc<Self>,
        l: &mut DelegationView,
        key: &DelegationKey,
        dir: Direction,
        seq: u64,
        frame: Bytes,
    ) -> bool {
        let slot = l.sub_mut(dir);
        let Some(sub) = slot.as_mut() else {
            return false;
        };
        if sub.replaying || seq <= sub.delivered {
            return true;
        }
        if seq == sub.delivered + 1 {
            match sub.outbox.push_data(frame) {
                Pushed::Queued => {
                    sub.delivered = seq;
                    self.metrics.hot.data_out.inc();
                    return true;
                }
                Pushed::Closed => {
                    let session = sub.session;
                    *slot = None;
                    self.forget_subscription(session, key, dir);
                    return false;
                }
                // The receiver's queue is full: it is fed from the log
                // instead, at its own pace (below).
                Pushed::Full => {}
            }
        }
        sub.replaying = true;
        let (generation, outbox, from) = (sub.generation, sub.outbox.clone(), sub.delivered);
        self.spawn_replay(key.clone(), dir, generation, outbox, from);
        true
    }

    /// Subscribes a session to a log from `after` and starts its replay.
    /// A view the sweep evicted since `live` was looked up gets no
    /// subscription ([`Subscribed::Evicted`]): look the delegation up again.
    pub fn subscribe(
        self: &Arc<Self>,
        live: &ViewRef,
        key: &DelegationKey,
        dir: Direction,
        session: &SessionRef,
        after: u64,
    ) -> Subscribed {
        let generation = {
            let mut l = live.lock();
            // The sweep marks a view evicted under this lock and keeps every
            // view with a subscription: checked here, the subscription lands
            // on a view that stays cached and so sees every later append.
            if l.evicted {
                return Subscribed::Evicted;
            }
            if l.receiver(dir) != &session.peer {
                return Subscribed::Refused;
            }
            if let Some(sub) = l.sub_mut(dir).as_mut()
                && sub.session == session.id
                && sub.replaying
            {
                sub.rewind = Some(after);
                sub.delivered = after;
                return Subscribed::Yes;
            }
            let sub = self.new_subscription(key, dir, session, after, true);
            let generation = sub.generation;
            *l.sub_mut(dir) = Some(sub);
            generation
        };
        self.metrics.replays.inc();
        self.spawn_replay(key.clone(), dir, generation, session.outbox.clone(), after);
        Subscribed::Yes
    }

    pub(super) fn spawn_replay(
        self: &Arc<Self>,
        key: DelegationKey,
        dir: Direction,
        generation: u64,
        outbox: Outbox,
        from: u64,
    ) {
        let hub = self.clone();
        let span = tracing::debug_span!("replay", %key, dir = dir.name(), generation, from);
        self.tasks.spawn(
            async move { hub.replay(key, dir, generation, outbox, from).await }.instrument(span),
        );
    }

    async fn replay(
        self: Arc<Self>,
        key: DelegationKey,
        dir: Direction,
        generation: u64,
        outbox: Outbox,
        mut cursor: u64,
    ) {
        let start = cursor;
        let mut count = 1;
        loop {
            let started = Instant::now();
            let read = self.store.read(&key, dir, cursor, count).await;
            self.observe_store("read", started, &read);
            let (entries, tail) = match read {
                Err(e) => {
                    warn!(error = %e, "replay read failed");
                    outbox.close(
                        CloseCode::StoreUnavailable,
                        "store unavailable during replay",
                    );
                    return;
                }
                Ok(ReadOutcome::Unknown) => {
                    self.gap(&outbox, &key, dir, start, 0, None, self.missing_reason());
                    self.drop_subscription(&key, dir, generation);
                    return;
                }
                Ok(ReadOutcome::Trimmed {
                    first_available,
                    terminal,
                }) => {
                    self.gap(
                        &outbox,
                        &key,
                        dir,
                        cursor,
                        first_available,
                        terminal,
                        GapReason::Trimmed,
                    );
                    self.drop_subscription(&key, dir, generation);
                    return;
                }
                Ok(ReadOutcome::Lost { tail, terminal }) => {
                    warn!(
                        cursor,
                        tail, "receiver is ahead of the store: data was lost"
                    );
                    self.gap(
                        &outbox,
                        &key,
                        dir,
                        cursor,
                        u64::from(tail > 0),
                        terminal,
                        GapReason::EpochChanged,
                    );
                    self.drop_subscription(&key, dir, generation);
                    return;
                }
                Ok(ReadOutcome::Entries { entries, tail, .. }) => {
                    let bytes = entries.iter().map(|(_, f)| f.len()).sum();
                    count = next_replay_count(bytes, entries.len());
                    (entries, tail)
                }
            };
            let Ok(Some(live)) = self.view(&key).await else {
                return;
            };
            let mut rewound = false;
            for (seq, frame) in entries {
                // Stop as soon as another subscription took over; restart
                // from a newer cursor of the same session.
                {
                    let mut l = live.lock();
                    match l.sub_mut(dir).as_mut() {
                        Some(sub) if sub.generation == generation => {
                            if let Some(r) = sub.rewind.take() {
                                cursor = r;
                                rewound = true;
                            }
                        }
                        _ => return,
                    }
                }
                if rewound {
                    break;
                }
                if seq != cursor + 1 {
                    warn!(seq, cursor, "store returned a non-contiguous entry");
                    outbox.close(
                        CloseCode::InternalError,
                        "store returned a non-contiguous log",
                    );
                    return;
                }
                if !outbox.send_data(frame).await {
                    return;
                }
                cursor = seq;
                self.metrics.replayed_frames.inc();
            }
            if rewound {
                continue;
            }
            let mut l = live.lock();
            let t = l.tail_mut(dir);
            *t = (*t).max(tail);
            let caught_up = *t <= cursor;
            let slot = l.sub_mut(dir);
            match slot.as_mut() {
                Some(sub) if sub.generation == generation => {
                    if let Some(r) = sub.rewind.take() {
                        cursor = r;
                        sub.delivered = r;
                        continue;
                    }
                    sub.delivered = cursor;
                    if caught_up {
                        sub.replaying = false;
                        debug!(cursor, "replay caught up; live");
                        return;
                    }
                }
                // Superseded by a newer subscription (reconnect) or dropped.
                _ => return,
            }
        }
    }

    /// Sends a `Gap` and logs it.
    #[allow(clippy::too_many_arguments)] // one per field of the frame
    pub fn gap(
        &self,
        outbox: &Outbox,
        key: &DelegationKey,
        dir: Direction,
        after: u64,
        first: u64,
        terminal: Option<Outcome>,
        reason: GapReason,
    ) {
        self.metrics.gaps.with_label_values(&[reason.name()]).inc();
        let frame = Frame::Gap(Gap {
            key: key.clone(),
            direction: dir,
            after,
            first_available: first,
            terminal,
            reason,
        });
        if let Ok(bytes) = encode(&frame) {
            outbox.push(bytes);
        }
    }

    /// Sends the `Error` frame of `refusal` about a frame at a log position
    /// (its code and text come from [`Refusal`] only).
    pub fn refuse(
        &self,
        to: &SessionRef,
        refusal: Refusal,
        key: Option<&DelegationKey>,
        dir: Direction,
        seq: u64,
    ) {
        let code = refusal.code();
        self.metrics.errors.with_label_values(&[code.name()]).inc();
        let message = refusal.message().into_owned();
        self.refusals.record(super::RefusalRecord {
            at_ms: oab_wire::identity::now_ms(),
            peer: to.peer.to_string(),
            code: code.name().to_string(),
            message: message.clone(),
            key: key.map(ToString::to_string),
            dir: dir.name().to_string(),
            seq,
        });
        let outbox = &to.outbox;
        let frame = Frame::Error(oab_wire::ErrorFrame {
            code: code.as_u16(),
            key: key.cloned(),
            direction: dir,
            seq,
            message,
        });
        if let Ok(bytes) = encode(&frame) {
            outbox.push(bytes);
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::super::test_support::{
        CALLER, callee_completes, next_data, open_in_store, redis_hub, session,
    };
    use super::*;
    use oab_testkit::redis::{Persistence, RedisServer};

    /// A replay reads one entry first, then as many as the last step's
    /// average entry fits in `REPLAY_STEP_BYTES`: large entries one by one,
    /// small ones by the full batch.
    #[test]
    fn a_replay_step_is_sized_by_the_bytes_of_the_last_one() {
        assert_eq!(next_replay_count(0, 0), 1);
        assert_eq!(next_replay_count(1024 * 1024, 1), 1);
        assert_eq!(next_replay_count(16 * 1024 * 1024, 1), 1);
        assert_eq!(next_replay_count(4 * 64 * 1024, 4), 16);
        assert_eq!(next_replay_count(100, 1), REPLAY_BATCH);
        assert_eq!(next_replay_count(256 * 1000, 256), REPLAY_BATCH);
    }

    /// A `Resume` whose lookup raced the sweep: the evicted view refuses the
    /// subscription, and the one looked up again delivers the log.
    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn a_resume_on_an_evicted_view_is_refused_and_retried() {
        let redis = RedisServer::start(Persistence::None).unwrap();
        let hub = redis_hub(&redis).await;
        let (caller, mut inbox) = session(CALLER);
        let (meta, _) = open_in_store(&hub, "r-resume").await;
        let key = meta.key.clone();

        let looked_up = hub.view(&key).await.unwrap().unwrap();
        hub.evict_unread();
        assert_eq!(
            hub.subscribe(&looked_up, &key, Direction::Up, &caller, 0),
            Subscribed::Evicted
        );
        let again = hub.view(&key).await.unwrap().unwrap();
        assert_eq!(
            hub.subscribe(&again, &key, Direction::Up, &caller, 0),
            Subscribed::Yes
        );
        let sent = callee_completes(&hub, &key).await;
        assert_eq!(next_data(&mut inbox).await, sent);
    }
}
