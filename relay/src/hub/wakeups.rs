//! How instances sharing a store tell each other about entries: whom an
//! append wakes, the messages taken from a peer's wake channel (entry,
//! nudge, claim, presence), a subscription catching up after a nudge, a
//! local callee subscribed to a delegation opened on another instance, and
//! the resynchronisation after wake-ups may have been missed (subscriber
//! reconnected, queue overflow, an instance that left the fleet).
//!
//! Never treats a wake-up as the truth about a log: delivery stays by
//! cursor, so a late, duplicated or missing wake-up costs a replay, never a
//! wrong delivery. Malformed messages are logged and dropped, never
//! panicked on.

use std::sync::Arc;

use bytes::Bytes;
use oab_wire::{CloseCode, DelegationKey, Direction, Frame, Outcome, PeerId};
use tracing::{debug, info, warn};

use super::views::DelegationView;
use super::{Hub, ViewRef};
use crate::fleet::DepartureKind;
use crate::metrics::ResyncCause;
use crate::store::{EventStore, Liveness};

impl<S: EventStore> Hub<S> {
    /// The peer to wake for an entry about to be appended on `dir`: with a
    /// shared store, the receiver, unless it is subscribed here (then local
    /// delivery is enough; if its session has in fact moved, the unsubscribe
    /// here nudges it, and if this instance dies first, the new one
    /// resynchronises when it sees this one's liveness lapse).
    pub fn wake_for(&self, l: &DelegationView, dir: Direction) -> Option<PeerId> {
        if !self.fleet.enabled {
            return None;
        }
        let subscribed = match dir {
            Direction::Down => l.subs[0].is_some(),
            Direction::Up => l.subs[1].is_some(),
        };
        (!subscribed).then(|| l.receiver(dir).clone())
    }

    /// The peer to wake for a new delegation's `Open`: the callee, unless it
    /// is held here by a session that is not closing (one replaced by a
    /// newer session elsewhere closes, and may take a second to go).
    pub fn open_wake(&self, callee: &PeerId) -> Option<PeerId> {
        (self.fleet.enabled && !self.holds_open_session(callee)).then(|| callee.clone())
    }

    /// Publishes a created delegation's `Open` on the callee's wake channel
    /// when the store did not (the callee was held here when the open was
    /// checked) and the callee's session here is gone or closing now: it
    /// went during the store's round trip, possibly to a newer session on
    /// another instance, which would otherwise not hear of the delegation
    /// until its next connection. The entry is durable already; a wake-up
    /// that reaches this instance too is dropped by sequence.
    pub fn wake_if_gone(self: &Arc<Self>, callee: &PeerId, open_frame: Bytes) {
        if !self.fleet.enabled || self.holds_open_session(callee) {
            return;
        }
        debug!(peer = %callee, "the callee's session here went during the open: waking it elsewhere");
        let hub = self.clone();
        let mut message = Vec::with_capacity(open_frame.len() + 1);
        message.push(b'W');
        message.extend_from_slice(&open_frame);
        let callee = callee.clone();
        self.tasks.spawn(async move {
            if let Err(e) = hub.store.publish(vec![(callee.clone(), Bytes::from(message))]).await {
                warn!(error = %e, peer = %callee, "could not wake the callee of a new delegation; it gets it on its next connection");
            }
        });
    }

    /// Whether `peer` holds a session here that is not closing.
    fn holds_open_session(&self, peer: &PeerId) -> bool {
        self.sessions
            .lock()
            .get(peer)
            .is_some_and(|s| !s.outbox.is_closed())
    }

    /// Handles a message from `peer`'s wake channel (see
    /// [`crate::store::fleet`] for the kinds). Malformed messages are logged
    /// and dropped: the channel is written only by relay instances.
    pub fn on_wake(self: &Arc<Self>, peer: PeerId, payload: Bytes) {
        let Some((&kind, _)) = payload.split_first() else {
            return;
        };
        debug!(%peer, kind = %char::from(kind), "wake-up");
        let body = payload.slice(1..);
        match kind {
            b'W' => {
                let limits = self.config.wire_limits();
                let (key, dir, seq, terminal) =
                    match oab_wire::decode_message(body.clone(), &limits) {
                        Ok(Frame::Open(o)) => (o.key, Direction::Down, 1, None),
                        Ok(Frame::Data(d)) => (d.key, d.direction, d.seq, d.terminal),
                        Ok(Frame::Cancel(c)) => (c.key, Direction::Down, c.seq, None),
                        _ => {
                            warn!(%peer, "undecodable wake-up entry dropped");
                            return;
                        }
                    };
                self.metrics.wakes.with_label_values(&["entry"]).inc();
                self.remote_appended(&peer, key, dir, seq, body, terminal);
            }
            b'N' => {
                let Some((key, dir, tail)) = parse_nudge(&body) else {
                    warn!(%peer, "malformed nudge dropped");
                    return;
                };
                self.metrics.wakes.with_label_values(&["nudge"]).inc();
                let live = self.views.lock().get(&key).cloned();
                match live {
                    Some(live) => self.catch_up(&live, &key, dir, tail, None),
                    // A delegation not loaded here whose down log went to
                    // the callee's session on another instance, which ended
                    // (replaced by the session here, say, after the `Open`
                    // reached it): the session here gets it from the start.
                    None if dir == Direction::Down && self.holds_open_session(&peer) => {
                        let hub = self.clone();
                        self.tasks
                            .spawn(async move { hub.subscribe_callee(&key, None, tail).await });
                    }
                    None => {}
                }
            }
            b'T' => {
                let generation = std::str::from_utf8(&body)
                    .ok()
                    .and_then(|t| t.split('|').next())
                    .and_then(|g| g.parse::<u64>().ok());
                let Some(generation) = generation else {
                    warn!(%peer, "malformed claim dropped");
                    return;
                };
                self.metrics.wakes.with_label_values(&["claim"]).inc();
                if let Some(old) = self.fleet.announced(&peer, generation) {
                    let session = self.sessions.lock().get(&peer).cloned();
                    if let Some(s) = session.filter(|s| s.id == old) {
                        self.metrics.replaced.inc();
                        info!(%peer, session = %s.id, "session replaced by a newer one on another instance");
                        s.outbox.close(
                            CloseCode::Replaced,
                            "a newer session of this peer replaced this one",
                        );
                    }
                }
            }
            b'P' => {
                self.metrics.wakes.with_label_values(&["presence"]).inc();
                self.send_peers(&peer);
            }
            _ => warn!(%peer, kind, "unknown wake-up message dropped"),
        }
    }

    /// A durable entry appended by another instance (or echoed back).
    fn remote_appended(
        self: &Arc<Self>,
        peer: &PeerId,
        key: DelegationKey,
        dir: Direction,
        seq: u64,
        frame: Bytes,
        terminal: Option<Outcome>,
    ) {
        let cached = self.views.lock().get(&key).cloned();
        let open_for_callee_here = dir == Direction::Down && seq == 1 && self.is_online(peer);
        match cached {
            Some(live) if !open_for_callee_here || live.lock().subs[0].is_some() => {
                self.appended(&live, &key, dir, seq, frame, terminal, true);
            }
            // Nobody reads it here.
            None if !self.is_online(peer) => {}
            // The receiver is here but the view is not (yet): load it. A new
            // delegation for a callee held here gets it subscribed, as
            // `created` does on the caller's instance; an entry that beat
            // `created` to the caller's instance is kept in the loaded view,
            // which `created` then reuses.
            _ => {
                let hub = self.clone();
                self.tasks.spawn(async move {
                    if open_for_callee_here {
                        hub.subscribe_callee(&key, Some(frame), 1).await;
                    } else if let Ok(Some(live)) = hub.view(&key).await {
                        hub.appended(&live, &key, dir, seq, frame, terminal, true);
                    }
                });
            }
        }
    }

    /// Subscribes the callee's local session to a delegation's down log from
    /// the start, unless it is subscribed already or the delegation has its
    /// terminal; delivers `open` if given, else catches up to `tail` from
    /// the store.
    async fn subscribe_callee(
        self: &Arc<Self>,
        key: &DelegationKey,
        open: Option<Bytes>,
        tail: u64,
    ) {
        // Looked up again while the sweep evicts the view in between.
        loop {
            let Ok(Some(live)) = self.view(key).await else {
                return;
            };
            if self.subscribe_callee_on(&live, key, open.clone(), tail) {
                return;
            }
        }
    }

    /// [`Hub::subscribe_callee`] on one view; `false` if the sweep evicted
    /// it (nothing done).
    fn subscribe_callee_on(
        self: &Arc<Self>,
        live: &ViewRef,
        key: &DelegationKey,
        open: Option<Bytes>,
        tail: u64,
    ) -> bool {
        let mut l = live.lock();
        if l.evicted {
            return false;
        }
        if l.terminal.is_some() {
            return true;
        }
        if l.subs[0].is_none() {
            let session = self.sessions.lock().get(&l.callee).cloned();
            let Some(session) = session else {
                return true;
            };
            l.subs[0] = Some(self.new_subscription(key, Direction::Down, &session, 0, false));
        }
        match open {
            Some(frame) => {
                let _ = self.deliver(&mut l, key, Direction::Down, 1, frame);
            }
            None => {
                drop(l);
                self.catch_up(live, key, Direction::Down, tail, None);
            }
        }
        true
    }

    /// The log `dir` has entries up to `tail`: a live subscription behind it
    /// catches up from the store.
    pub(crate) fn catch_up(
        self: &Arc<Self>,
        live: &ViewRef,
        key: &DelegationKey,
        dir: Direction,
        tail: u64,
        terminal: Option<Outcome>,
    ) {
        let mut l = live.lock();
        let t = l.tail_mut(dir);
        *t = (*t).max(tail);
        self.note_terminal(&mut l, terminal);
        if let Some(sub) = l.sub_mut(dir).as_mut()
            && !sub.replaying
            && sub.delivered < tail
        {
            sub.replaying = true;
            let (generation, outbox, from) = (sub.generation, sub.outbox.clone(), sub.delivered);
            self.spawn_replay(key.clone(), dir, generation, outbox, from);
        }
    }

    /// After wake-ups may have been missed (the subscriber reconnected or its
    /// queue overflowed): re-checks every log read here against the store,
    /// and subscribes local callees to delegations opened meanwhile.
    pub async fn resync(self: &Arc<Self>, cause: ResyncCause) {
        let started = std::time::Instant::now();
        self.metrics.wakes.with_label_values(&["resync"]).inc();
        self.metrics
            .resyncs
            .with_label_values(&[cause.label()])
            .inc();
        let lives: Vec<(DelegationKey, ViewRef)> = self
            .views
            .lock()
            .iter()
            .map(|(k, l)| (k.clone(), l.clone()))
            .collect();
        for (key, live) in lives {
            if !live.lock().subs.iter().any(Option::is_some) {
                continue;
            }
            if let Ok(Some(meta)) = self.store.meta(&key).await {
                for dir in [Direction::Down, Direction::Up] {
                    self.catch_up(&live, &key, dir, meta.tail(dir), meta.terminal);
                }
            }
        }
        // The index of open delegations only: what retention keeps of
        // finished ones never adds to a resync's cost.
        let sessions: Vec<PeerId> = self.sessions.lock().keys().cloned().collect();
        for peer in sessions {
            let Ok(metas) = self.store.open_delegations_of(&peer).await else {
                continue;
            };
            for m in metas
                .iter()
                .filter(|m| m.callee == peer && m.terminal.is_none())
            {
                self.subscribe_callee(&m.key, None, m.down_tail).await;
            }
        }
        self.metrics
            .resync_seconds
            .observe(started.elapsed().as_secs_f64());
    }

    /// Records the live instances from a liveness renewal, and
    /// resynchronises if any instance process left the fleet.
    pub(super) async fn live_nodes(self: &Arc<Self>, view: Liveness) {
        let departures = self.fleet.set_live_nodes(view);
        self.metrics.fleet_nodes.set(self.fleet.live_count() as i64);
        if departures.is_empty() {
            return;
        }
        let of = |kind: DepartureKind| -> Vec<String> {
            departures
                .iter()
                .filter(|d| d.kind == kind)
                .map(|d| format!("{}/{}", d.node, d.incarnation))
                .collect()
        };
        let (lapsed, restarted, left) = (
            of(DepartureKind::Lapsed),
            of(DepartureKind::Restarted),
            of(DepartureKind::Left),
        );
        // A crash is an incident; a clean leave (a drain) is routine.
        if !lapsed.is_empty() {
            warn!(lost = ?lapsed, "relay instances stopped renewing; resynchronising");
        }
        if !restarted.is_empty() {
            warn!(
                lost = ?restarted,
                "relay instances restarted under the same name (a new incarnation): \
                 the previous process died; resynchronising"
            );
        }
        if !left.is_empty() {
            info!(
                ?left,
                "relay instances left the fleet cleanly; resynchronising"
            );
        }
        // A departed instance may have delivered entries only to sessions
        // that had already moved here (and not published their nudges, if
        // it died): re-read every log served here. After a clean leave the
        // nudges were published; the round is cheap insurance.
        let cause = if !restarted.is_empty() {
            ResyncCause::InstanceRestarted
        } else if !lapsed.is_empty() {
            ResyncCause::InstanceLost
        } else {
            ResyncCause::InstanceLeft
        };
        self.resync(cause).await;
    }

    /// The fleet's periodic upkeep (every third of the node lease): renews
    /// this instance's liveness, drops wake subscriptions no longer needed,
    /// and on the sweeper lease holder refreshes which peers are offline
    /// fleet-wide (the start of their grace period).
    pub async fn fleet_tick(self: &Arc<Self>) {
        match self
            .store
            .renew_node(
                &self.fleet.node,
                &self.fleet.incarnation,
                self.fleet.node_lease_ms,
            )
            .await
        {
            Ok(view) => self.live_nodes(view).await,
            Err(e) => warn!(error = %e, "could not renew this instance's liveness"),
        }
        self.fleet.prune_subscriptions().await;
        if !self.fleet.is_leader() {
            return;
        }
        let peers: Vec<PeerId> = self.live().directory.peers.to_vec();
        let Ok(presence) = self.store.presence(&peers).await else {
            return;
        };
        let now = oab_wire::identity::now_ms();
        let mut off = self.offline_since.lock();
        for (peer, p) in peers.into_iter().zip(presence) {
            let online = self.is_online(&peer)
                || p.as_ref()
                    .is_some_and(|p| self.fleet.node_alive(&p.node, &p.incarnation));
            if online {
                off.remove(&peer);
            } else {
                off.entry(peer).or_insert(now);
            }
        }
    }
}

/// A nudge message: the log `dir` of `key` has entries up to `tail`.
pub(super) fn nudge(key: &DelegationKey, dir: Direction, tail: u64) -> Bytes {
    let d = match dir {
        Direction::Down => 'd',
        Direction::Up => 'u',
    };
    Bytes::from(format!("N{d}|{tail}|{key}"))
}

/// Parses a nudge body (after the kind byte).
fn parse_nudge(body: &[u8]) -> Option<(DelegationKey, Direction, u64)> {
    let text = std::str::from_utf8(body).ok()?;
    let mut parts = text.splitn(3, '|');
    let dir = match parts.next()? {
        "d" => Direction::Down,
        "u" => Direction::Up,
        _ => return None,
    };
    let tail = parts.next()?.parse().ok()?;
    let (caller, rid) = parts.next()?.split_once('#')?;
    let key = DelegationKey::new(
        PeerId::new(caller).ok()?,
        oab_wire::RequestId::new(rid).ok()?,
    );
    Some((key, dir, tail))
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    #[test]
    fn nudges_round_trip_and_malformed_ones_are_refused() {
        let key = DelegationKey::new(
            PeerId::new("acme/caller").unwrap_or_else(|_| unreachable!()),
            oab_wire::RequestId::new("r-1").unwrap_or_else(|_| unreachable!()),
        );
        for (dir, tail) in [(Direction::Down, 0), (Direction::Up, u64::MAX)] {
            let msg = nudge(&key, dir, tail);
            assert_eq!(msg.first(), Some(&b'N'));
            assert_eq!(parse_nudge(&msg[1..]), Some((key.clone(), dir, tail)));
        }
        for bad in [
            &b""[..],
            b"x|1|acme/caller#r-1",
            b"d|-1|acme/caller#r-1",
            b"d|1|acme/caller",
            b"u|1|#r",
            b"d|1",
            b"\xff|1|a#b",
        ] {
            assert_eq!(parse_nudge(bad), None, "{bad:?}");
        }
    }
}
