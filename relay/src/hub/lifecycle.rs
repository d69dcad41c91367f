//! A delegation from creation to terminal: its view on creation (or on a
//! reopen) with the first subscriptions, its terminal recorded once, the
//! entries the relay itself appends (`expired`, `unknown`, the cancel after
//! expiry), and the sweep (deadlines, callees gone past the grace period,
//! retention, eviction of unread views).
//!
//! Never appends a peer's entry, and never appends a relay entry except by
//! compare-and-set at `tail + 1`, so it never takes a sequence a peer used.
//! The fleet-wide part of the sweep runs only on the sweeper lease holder.

use parking_lot::Mutex;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use oab_wire::frame::FLAG_RELAY_ORIGIN;
use oab_wire::{
    Cancel, Data, DelegationCursor, DelegationKey, Direction, Frame, InstanceId, Outcome, PeerId,
    encode,
};
use tracing::{info, warn};

use super::views::DelegationView;
use super::{Hub, SessionRef, ViewRef};
use crate::store::{AppendOutcome, AppendRequest, DelegationMeta, EventStore, Origin, StoreError};

impl<S: EventStore> Hub<S> {
    /// Inserts the view of a delegation that was just created, with the
    /// caller subscribed to its up log and the callee (if online) to its down log.
    pub fn created(
        self: &Arc<Self>,
        meta: &DelegationMeta,
        caller: &SessionRef,
        open_frame: Bytes,
    ) -> ViewRef {
        let live = loop {
            // With a shared store, a wake-up about this delegation (the callee's
            // first entry, or the open echoed back) can arrive before this runs
            // and load the view first: reuse that view, never replace it.
            let live = {
                let mut map = self.views.lock();
                match map.get(&meta.key) {
                    Some(l)
                        if {
                            let g = l.lock();
                            g.terminal.is_none() && !g.evicted
                        } =>
                    {
                        l.clone()
                    }
                    stale => {
                        if let Some(old) = stale {
                            old.lock().evicted = true;
                        }
                        let fresh = Arc::new(Mutex::new(self.view_from_meta(meta)));
                        map.insert(meta.key.clone(), fresh.clone());
                        self.gauges.count_views(map.len());
                        fresh
                    }
                }
            };
            let callee = self.sessions.lock().get(&meta.callee).cloned();
            let mut l = live.lock();
            // Subscriptions go only on the view the hub still caches: the
            // sweep may have evicted this one (it had none yet) since it was
            // cached above, and appends would then never reach it.
            if l.evicted {
                continue;
            }
            if l.subs[1].as_ref().is_none_or(|s| s.session != caller.id) {
                l.subs[1] = Some(self.new_subscription(&meta.key, Direction::Up, caller, 0, false));
            }
            if let Some(callee) = &callee
                && l.subs[0].is_none()
            {
                l.subs[0] =
                    Some(self.new_subscription(&meta.key, Direction::Down, callee, 0, false));
            }
            let _ = self.deliver(&mut l, &meta.key, Direction::Down, 1, open_frame);
            drop(l);
            break live;
        };
        // Up entries that arrived before the caller's subscription existed.
        let up_tail = live.lock().tails[1];
        if up_tail > 0 {
            self.catch_up(&live, &meta.key, Direction::Up, up_tail, None);
        }
        self.metrics.delegations_opened.inc();
        self.count_open(&meta.key.caller, &meta.callee, 1);
        live
    }

    /// An open the store already had (a resend after a lost ack, a retry
    /// after a store error that did commit, a restarted caller): both ends
    /// get the delegation as if it had just been created here. The caller's
    /// session reads the up log from its start unless it already does; the
    /// callee, when its session is here and reads nothing of it, gets the
    /// down log from its start (the open included). Receivers drop what they
    /// already processed by sequence.
    pub async fn reopened(
        self: &Arc<Self>,
        key: &DelegationKey,
        caller: &SessionRef,
    ) -> Result<(), StoreError> {
        let Some(live) = self.view(key).await? else {
            return Ok(());
        };
        let (read_up, callee) = {
            let l = live.lock();
            let read_up = l.subs[1].as_ref().is_none_or(|s| s.session != caller.id);
            let callee = (l.subs[0].is_none() && l.terminal.is_none()).then(|| l.callee.clone());
            (read_up, callee)
        };
        if read_up {
            self.subscribe(&live, key, Direction::Up, caller, 0);
        }
        let callee = callee.and_then(|c| self.sessions.lock().get(&c).cloned());
        if let Some(callee) = callee {
            self.subscribe(&live, key, Direction::Down, &callee, 0);
        }
        Ok(())
    }

    /// Delivers the delegations a `Welcome` had no room for on the new
    /// session: those the peer receives work on (the callee) get their down
    /// log from its start, the `Open` first, as if just created. A caller
    /// needs nothing: it resumes every delegation it holds on every new
    /// session. Runs in a task, after the welcome went out.
    pub fn deliver_left_out(
        self: &Arc<Self>,
        session: &SessionRef,
        left_out: Vec<DelegationCursor>,
    ) {
        let work: Vec<DelegationKey> = left_out
            .into_iter()
            .filter(|c| !c.is_caller)
            .map(|c| c.key)
            .collect();
        if work.is_empty() {
            return;
        }
        let hub = self.clone();
        let session = session.clone();
        self.tasks.spawn(async move {
            for key in work {
                if session.outbox.is_closed() {
                    return;
                }
                // Looked up again if the sweep evicted the view meanwhile.
                for _ in 0..4 {
                    let Ok(Some(live)) = hub.view(&key).await else {
                        break;
                    };
                    if hub.subscribe(&live, &key, Direction::Down, &session, 0)
                        != super::Subscribed::Evicted
                    {
                        break;
                    }
                }
            }
        });
    }

    pub(super) fn note_terminal(&self, l: &mut DelegationView, outcome: Option<Outcome>) {
        if let Some(outcome) = outcome
            && l.terminal.is_none()
        {
            l.terminal = Some(outcome);
            self.metrics
                .terminals
                .with_label_values(&[outcome.name()])
                .inc();
            let (caller, callee) = (l.caller.clone(), l.callee.clone());
            self.count_open(&caller, &callee, -1);
        }
    }

    /// Appends a relay-originated entry at `tail + 1` (compare-and-set,
    /// retried on conflict): the `expired`/`unknown` terminal on the up log,
    /// or the cancel sent down after expiry. Returns whether it was appended.
    pub async fn relay_append(
        self: &Arc<Self>,
        key: &DelegationKey,
        dir: Direction,
        outcome: Option<Outcome>,
        reason: &str,
    ) -> bool {
        for _ in 0..64 {
            let Ok(Some(live)) = self.view(key).await else {
                return false;
            };
            let (seq, wake, trace) = {
                let mut l = live.lock();
                if outcome.is_some() && l.terminal.is_some() {
                    return false;
                }
                (*l.tail_mut(dir) + 1, self.wake_for(&l, dir), l.trace)
            };
            let payload = Bytes::from(
                serde_json::json!({
                    "origin": "relay",
                    "outcome": outcome.map(Outcome::name),
                    "reason": reason,
                })
                .to_string(),
            );
            let frame = match dir {
                Direction::Up => Frame::Data(Data {
                    key: key.clone(),
                    direction: Direction::Up,
                    seq,
                    terminal: outcome,
                    flags: FLAG_RELAY_ORIGIN,
                    payload,
                }),
                Direction::Down => Frame::Cancel(Cancel {
                    key: key.clone(),
                    seq,
                    flags: FLAG_RELAY_ORIGIN,
                    payload,
                }),
            };
            let Ok(bytes) = encode(&frame) else {
                return false;
            };
            let req = AppendRequest {
                key: key.clone(),
                dir,
                seq,
                terminal: outcome,
                origin: Origin::Relay,
                frame: bytes.clone(),
                now_ms: oab_wire::identity::now_ms(),
                wake: wake.clone(),
            };
            let started = Instant::now();
            let res = self.store.append(vec![req]).await;
            self.observe_store("append", started, &res);
            match res.ok().and_then(|v| v.into_iter().next()) {
                Some(AppendOutcome::Appended { seq }) => {
                    info!(%key, trace_id = trace.map(tracing::field::display), dir = dir.name(), seq, outcome = outcome.map(Outcome::name), reason, "relay appended");
                    self.appended(&live, key, dir, seq, bytes, outcome, wake.is_some());
                    return true;
                }
                Some(AppendOutcome::Conflict { tail }) => {
                    let mut l = live.lock();
                    if *l.tail_mut(dir) > tail {
                        // Below what this view had seen: the store lost
                        // entries; the next round appends at its real tail.
                        self.store_lost(&mut l, key, dir, tail);
                    } else {
                        *l.tail_mut(dir) = tail;
                    }
                }
                Some(AppendOutcome::AlreadyTerminal { outcome: o }) => {
                    let mut l = live.lock();
                    l.terminal.get_or_insert(o);
                    return false;
                }
                _ => return false,
            }
        }
        warn!(%key, "relay append kept conflicting; giving up this round");
        false
    }

    /// Ends every accepted, unfinished delegation of `callee` accepted by an
    /// instance other than `current` (or any instance when `current` is
    /// `None`: the callee stayed away past the grace period) as `unknown`.
    pub async fn end_lost_work(
        self: &Arc<Self>,
        callee: &PeerId,
        current: Option<InstanceId>,
        metas: &[DelegationMeta],
    ) {
        for m in metas {
            let lost = &m.callee == callee
                && m.terminal.is_none()
                && m.accepted_by.is_some_and(|a| Some(a) != current);
            if lost {
                let reason = if current.is_some() {
                    "the callee restarted after accepting the work; side effects are unknown"
                } else {
                    "the callee did not come back within the grace period; side effects are unknown"
                };
                self.relay_append(&m.key, Direction::Up, Some(Outcome::Unknown), reason)
                    .await;
            }
        }
    }

    /// One sweep: deadlines, callees gone past the grace period, retention.
    /// With a shared store only the holder of the sweeper lease does this
    /// fleet-wide work; every instance evicts its cache and checks the epoch.
    pub async fn sweep(self: &Arc<Self>) {
        if self.fleet.enabled {
            let held = self
                .store
                .acquire_lease(
                    crate::fleet::SWEEPER_LEASE,
                    &self.fleet.node,
                    self.fleet.sweeper_lease_ms,
                )
                .await;
            // A store error drops the lease here: another instance may hold
            // it by now, and the work is safe to skip a round.
            self.fleet.set_leader(held.unwrap_or(false));
        }
        self.metrics
            .sweeper_leader
            .set(i64::from(self.fleet.is_leader()));
        if self.fleet.is_leader() {
            self.sweep_fleet().await;
        }
        self.evict_unread();
        self.check_epoch().await;
    }

    async fn sweep_fleet(self: &Arc<Self>) {
        let now = oab_wire::identity::now_ms();
        let started = Instant::now();
        let due = self.store.due(now, 256).await;
        self.observe_store("due", started, &due);
        for key in due.unwrap_or_default() {
            if self
                .relay_append(
                    &key,
                    Direction::Up,
                    Some(Outcome::Expired),
                    oab_wire::EXPIRED_REASON,
                )
                .await
            {
                self.relay_append(&key, Direction::Down, None, "the deadline passed")
                    .await;
            }
        }
        let grace = self.live().config.lifecycle.unknown_grace_ms;
        let gone: Vec<(PeerId, u64)> = self
            .offline_since
            .lock()
            .iter()
            .filter(|(_, since)| now.saturating_sub(**since) >= grace)
            .map(|(p, since)| (p.clone(), *since))
            .collect();
        if !gone.is_empty() && self.fleet.enabled {
            // Fresh liveness before acting on anyone.
            if let Ok(nodes) = self
                .store
                .renew_node(
                    &self.fleet.node,
                    &self.fleet.incarnation,
                    self.fleet.node_lease_ms,
                )
                .await
            {
                self.live_nodes(nodes).await;
            }
        }
        for (peer, since) in gone {
            if self.fleet.enabled && self.online_elsewhere(&peer).await != Some(false) {
                // Held by a live instance (or unknown): not gone.
                let mut off = self.offline_since.lock();
                if off.get(&peer) == Some(&since) {
                    off.remove(&peer);
                }
                continue;
            }
            if let Ok(metas) = self.store.open_delegations_of(&peer).await {
                self.end_lost_work(&peer, None, &metas).await;
                // Forget the peer only if it did not come back meanwhile.
                let mut off = self.offline_since.lock();
                if off.get(&peer) == Some(&since) {
                    off.remove(&peer);
                }
            }
        }
        let started = Instant::now();
        let expired = self.store.expire_finished(now).await;
        self.observe_store("expire", started, &expired);
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::super::test_support::{
        CALLEE, CALLER, STEP, callee_completes, next_data, open_in_store, peer, redis_hub, session,
    };
    use oab_testkit::redis::{Persistence, RedisServer};
    use oab_wire::DelegationCursor;

    /// A delegation a truncated `Welcome` had no room for reaches its
    /// callee on the new session anyway: its `Open` first, from the start of
    /// the down log, as if it had just been created.
    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn a_delegation_left_out_of_the_welcome_reaches_its_callee() {
        let redis = RedisServer::start(Persistence::None).unwrap();
        let hub = redis_hub(&redis).await;
        let (callee, mut inbox) = session(CALLEE);
        let (meta, open_frame) = open_in_store(&hub, "r-left-out").await;
        let left_out = DelegationCursor {
            key: meta.key.clone(),
            counterpart: peer(CALLER),
            is_caller: false,
            down: 1,
            up: 0,
            terminal: None,
        };
        hub.deliver_left_out(&callee, vec![left_out]);
        assert_eq!(next_data(&mut inbox).await, open_frame);
    }

    /// The sweep evicts a just-created view (it has no subscription yet)
    /// while `created` is between caching it and subscribing the caller:
    /// the caller must end up subscribed on the view the hub keeps, so the
    /// callee's terminal reaches it. (Before the fix the caller was
    /// subscribed on the evicted view and never saw its delegation's up log:
    /// a blocking send hung with the relay holding `completed`.)
    #[test]
    fn a_sweep_during_created_leaves_the_caller_subscribed() {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let redis = RedisServer::start(Persistence::None).unwrap();
        let hub = rt.block_on(redis_hub(&redis));
        let (caller, mut inbox) = session(CALLER);
        let (meta, open_frame) = rt.block_on(open_in_store(&hub, "r-created"));

        // `created` looks up the callee's session after it cached the view:
        // holding the session table pauses it exactly there.
        let held = hub.sessions.lock();
        let creating = {
            let (hub, meta, rt) = (hub.clone(), meta.clone(), rt.handle().clone());
            std::thread::spawn(move || {
                let _rt = rt.enter();
                hub.created(&meta, &caller, open_frame)
            })
        };
        let until = std::time::Instant::now() + STEP;
        while !hub.views.lock().contains_key(&meta.key) {
            assert!(
                std::time::Instant::now() < until,
                "created never cached the view"
            );
            std::thread::yield_now();
        }
        hub.evict_unread();
        drop(held);
        let live = creating.join().unwrap();

        assert!(
            !live.lock().evicted(),
            "the caller was subscribed on a view the sweep had evicted"
        );
        let sent = rt.block_on(callee_completes(&hub, &meta.key));
        assert_eq!(rt.block_on(next_data(&mut inbox)), sent);
    }
}
