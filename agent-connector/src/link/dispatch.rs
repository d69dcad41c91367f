//! Frames from the relay: acks, data, opens, cancels, gaps, refusals, the
//! peer list, pings and drain hints, each routed to the delegation, the
//! local subscribers or the callee side.
//!
//! Never writes to the socket (replies go into `out`), never awaits, and
//! never parses event payloads: only the peer list is decoded here.
//!
//! **Overflow policy of `incoming`** (the bounded channel to the callee
//! runtime, capacity `LinkSettings::queue`): a frame for the callee side is
//! handed over with `try_send`. When the channel is full the frame is not
//! taken: the delegation's receive cursor stays before it, and the link asks
//! the relay to resume that log from the cursor after the retry pause
//! (`RETRY_AFTER`, 250 ms). The relay's log is the buffer; the link goes on
//! reading, pinging and serving every other delegation meanwhile.

use std::time::Duration;

use bytes::Bytes;
use oab_wire::{Data, Direction, ErrorCode, Frame, Outcome, encode};
use tokio::sync::mpsc;
use tracing::{debug, info, warn};

use super::delegation::{Delegation, settle};
use super::frames::queue_resume;
use super::resume::in_order;
use super::stats::Side;
use super::{EventError, Incoming, Link, LinkError, UpEvent};

impl Link {
    /// Handles one frame from the relay.
    pub(super) fn dispatch(&mut self, frame: Frame, out: &mut Vec<Bytes>) {
        match frame {
            Frame::Ack(a) => {
                self.stats
                    .acks
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                self.ack(&a.key, a.direction, a.seq);
                // A caller's open is durable: start its up log (after the
                // cursor a restored delegation already processed).
                if let Some(d) = self.delegations.get_mut(&a.key)
                    && d.is_caller
                    && d.resume_after_open
                    && d.send_log.acked >= 1
                {
                    d.resume_after_open = false;
                    d.resuming = true;
                    queue_resume(&a.key, Direction::Up, d.cursor, out);
                }
            }
            Frame::Data(d) => self.deliver(d, out),
            Frame::Open(o) => {
                let key = o.key.clone();
                let is_new = !self.delegations.contains_key(&key);
                let entry = self
                    .delegations
                    .entry(key.clone())
                    .or_insert_with(|| Delegation::new(false, o.key.caller.clone()));
                if entry.is_caller || entry.cursor >= 1 {
                    return;
                }
                if is_new {
                    self.stats.opened(Side::Callee);
                }
                entry.cursor = 1;
                entry.resuming = false;
                let up = entry.send_log.acked;
                let item = if up > 0 {
                    Incoming::Reopened { open: o, up }
                } else {
                    Incoming::Open(o)
                };
                self.hand_to_callee(&key, 1, item);
            }
            Frame::Cancel(c) => {
                let Some(d) = self.delegations.get_mut(&c.key) else {
                    return;
                };
                if d.is_caller || !in_order(d, c.seq, &c.key, out) {
                    return;
                }
                let relay_origin = c.flags & oab_wire::frame::FLAG_RELAY_ORIGIN != 0;
                let (key, seq) = (c.key.clone(), c.seq);
                self.hand_to_callee(
                    &key,
                    seq,
                    Incoming::Cancel {
                        key: c.key,
                        relay_origin,
                        payload: c.payload,
                    },
                );
            }
            Frame::Gap(g) => {
                let Some(d) = self.delegations.get_mut(&g.key) else {
                    return;
                };
                d.resuming = false;
                warn!(key = %g.key, trace_id = d.trace.map(display), reason = g.reason.name(), after = g.after, "relay reports a gap");
                if d.is_caller {
                    d.notify_subscribers(&Err(EventError::Gap {
                        after: g.after,
                        reason: g.reason,
                    }));
                    if let Some(t) = g.terminal
                        && d.terminal.is_none()
                    {
                        // Its terminal will not be delivered: it is finished
                        // here now, and leaves within the finished bound.
                        settle(&self.stats, d, t);
                        let key = g.key.clone();
                        self.record_finished(&key);
                    }
                } else {
                    let key = g.key.clone();
                    let sent = self.incoming.try_send(Incoming::Ended {
                        key: g.key,
                        terminal: g.terminal,
                    });
                    if sent.is_err() {
                        // Full: the resume after the pause brings the gap again.
                        if let Some(d) = self.delegations.get_mut(&key) {
                            d.resuming = true;
                            d.resume_retry = true;
                        }
                        self.retry_later();
                    } else if let Some(t) = g.terminal {
                        // Over at the relay: nothing more is sent or received
                        // on it here.
                        self.callee_ended(&key, t);
                    }
                }
            }
            Frame::Error(e) => self.refused(e),
            Frame::Peers(payload) => {
                self.peers = serde_json::from_slice(&payload).unwrap_or_default();
                for w in self.peer_waiters.drain(..) {
                    let _ = w.send(self.peers.clone());
                }
            }
            Frame::Ping(p) => {
                if let Ok(b) = encode(&Frame::Pong(p)) {
                    out.push(b);
                }
            }
            Frame::Drain(d) => {
                info!(
                    reconnect_after_ms = d.reconnect_after_ms,
                    "relay is draining"
                );
                self.drain_hint = Some(Duration::from_millis(u64::from(d.reconnect_after_ms)));
            }
            Frame::Pong(_)
            | Frame::Challenge(_)
            | Frame::Hello(_)
            | Frame::Welcome(_)
            | Frame::Resume(_)
            | Frame::PeersQuery
            | Frame::Publish(_) => {}
        }
    }

    /// Hands a frame (sequence `seq` of the down log of `key`) to the callee
    /// runtime without waiting. Full: the frame is not taken (the cursor
    /// goes back before it) and the log is resumed from the cursor after the
    /// retry pause; closed (no runtime): dropped.
    fn hand_to_callee(&mut self, key: &oab_wire::DelegationKey, seq: u64, item: Incoming) {
        match self.incoming.try_send(item) {
            Ok(()) | Err(mpsc::error::TrySendError::Closed(_)) => {}
            Err(mpsc::error::TrySendError::Full(_)) => {
                let trace = self.delegations.get(key).and_then(|d| d.trace);
                debug!(%key, trace_id = trace.map(display), seq, "callee side busy; the relay resends this frame later");
                if let Some(d) = self.delegations.get_mut(key) {
                    d.cursor = seq.saturating_sub(1);
                    // No resume for the holes that follow until the pause ends.
                    d.resuming = true;
                    d.resume_retry = true;
                }
                self.retry_later();
            }
        }
    }

    /// A callee-side delegation that ended at the relay with `terminal`:
    /// nothing of ours is sent on it any more, and it is forgotten
    /// (`record_finished`).
    fn callee_ended(&mut self, key: &oab_wire::DelegationKey, terminal: Outcome) {
        let Some(d) = self.delegations.get_mut(key) else {
            return;
        };
        if d.is_caller {
            return;
        }
        settle(&self.stats, d, terminal);
        self.buffered = self.buffered.saturating_sub(d.send_log.unacked.len());
        d.send_log.unacked.clear();
        for (_, w) in d.send_log.ack_waiters.drain(..) {
            let _ = w.send(Err(LinkError::AlreadyTerminal(terminal)));
        }
        self.record_finished(key);
    }

    fn deliver(&mut self, f: Data, out: &mut Vec<Bytes>) {
        let Some(d) = self.delegations.get_mut(&f.key) else {
            return;
        };
        if f.direction != d.recv_dir() || !in_order(d, f.seq, &f.key, out) {
            return;
        }
        if d.is_caller {
            let ev = UpEvent {
                seq: f.seq,
                terminal: f.terminal,
                relay_origin: f.flags & oab_wire::frame::FLAG_RELAY_ORIGIN != 0,
                payload: f.payload,
            };
            if let Some(t) = ev.terminal {
                settle(&self.stats, d, t);
                // Nothing more will be accepted on our down log.
                self.buffered = self.buffered.saturating_sub(d.send_log.unacked.len());
                d.send_log.unacked.clear();
            }
            d.events.push_back(ev.clone());
            while d.events.len() > self.settings.max_events_per_delegation {
                d.events.pop_front();
            }
            let done = ev.terminal.is_some();
            d.notify_subscribers(&Ok(ev));
            if done {
                self.record_finished(&f.key);
            }
        } else {
            let (key, seq) = (f.key.clone(), f.seq);
            self.hand_to_callee(
                &key,
                seq,
                Incoming::Message {
                    key: f.key,
                    seq: f.seq,
                    payload: f.payload,
                },
            );
        }
    }

    fn refused(&mut self, e: oab_wire::ErrorFrame) {
        self.stats.refused(e.code);
        let code = ErrorCode::from_u16(e.code);
        let name = code.map_or_else(|| format!("error_{}", e.code), |c| c.name().to_string());
        let Some(key) = e.key.clone() else {
            warn!(code = %name, message = %e.message, "relay error");
            return;
        };
        let Some(d) = self.delegations.get_mut(&key) else {
            return;
        };
        debug!(%key, trace_id = d.trace.map(display), code = %name, seq = e.seq, message = %e.message, "relay refused a frame");
        match code {
            Some(ErrorCode::SequenceGap) if e.seq < d.send_log.acked => {
                // The relay acknowledged more than its store now holds:
                // resending cannot repair that, and would be refused
                // forever. The receiver is told with a gap by the relay.
                warn!(%key, trace_id = d.trace.map(display), held = e.seq, acked = d.send_log.acked, "the relay's store lost acknowledged events of this delegation; nothing more is sent on it");
                let lost = LinkError::StoreLost {
                    acked: d.send_log.acked,
                    held: e.seq,
                };
                d.send_log.lost = Some(e.seq);
                self.buffered = self.buffered.saturating_sub(d.send_log.unacked.len());
                d.send_log.unacked.clear();
                for (_, w) in d.send_log.ack_waiters.drain(..) {
                    let _ = w.send(Err(lost.clone()));
                }
                if let Some(r) = d.open_reply.take() {
                    let _ = r.send(Err(lost));
                }
            }
            Some(ErrorCode::SequenceGap) => {
                // The relay holds up to e.seq: everything after is resent.
                let tail = e.seq;
                while d.send_log.unacked.front().is_some_and(|(s, _)| *s <= tail) {
                    d.send_log.unacked.pop_front();
                    self.buffered = self.buffered.saturating_sub(1);
                }
                d.send_log.acked = d.send_log.acked.max(tail);
                d.send_log.sent = d.send_log.acked;
                self.ready_to_send.insert(key.clone());
            }
            Some(
                ErrorCode::StoreUnavailable
                | ErrorCode::RateLimited
                | ErrorCode::TooManyDelegations,
            ) => {
                if e.direction == d.recv_dir() {
                    // Our resume was refused: ask again after the pause.
                    d.resuming = false;
                    d.resume_retry = true;
                } else {
                    // Resend from the acked point after the pause.
                    d.send_log.sent = d.send_log.acked;
                    self.retry_logs.insert(key.clone());
                }
                self.retry_later();
            }
            Some(ErrorCode::AlreadyTerminal) => {
                let won = Outcome::ALL
                    .iter()
                    .copied()
                    .find(|o| e.message.ends_with(o.name()));
                settle(&self.stats, d, won.unwrap_or(Outcome::Unknown));
                self.buffered = self.buffered.saturating_sub(d.send_log.unacked.len());
                d.send_log.unacked.clear();
                for (_, w) in d.send_log.ack_waiters.drain(..) {
                    let _ = w.send(Err(LinkError::AlreadyTerminal(
                        won.unwrap_or(Outcome::Unknown),
                    )));
                }
                if !d.is_caller {
                    // Our terminal lost: the delegation is over here.
                    self.record_finished(&key);
                }
            }
            Some(ErrorCode::PayloadTooLarge) if e.direction == d.send_dir() => {
                // The relay cannot store that frame (over the route's limit
                // or a byte budget): that frame fails, the log goes on.
                let refused = LinkError::Refused {
                    code: name,
                    message: e.message,
                };
                self.unsendable(&key, e.seq, refused);
            }
            _ => {
                let refused = LinkError::Refused {
                    code: name.clone(),
                    message: e.message.clone(),
                };
                if let Some(r) = d.open_reply.take() {
                    let _ = r.send(Err(refused.clone()));
                }
                for (_, w) in d.send_log.ack_waiters.drain(..) {
                    let _ = w.send(Err(refused.clone()));
                }
                d.notify_subscribers(&Err(EventError::Refused {
                    code: name,
                    message: e.message,
                }));
                if e.direction == d.send_dir() && e.seq <= 1 && d.is_caller {
                    // The open itself was refused: nothing of this delegation exists.
                    self.buffered = self.buffered.saturating_sub(d.send_log.unacked.len());
                    if !d.end_counted {
                        self.stats.ended(Side::Caller, None);
                    }
                    self.delegations.remove(&key);
                    self.ready_to_send.remove(&key);
                    self.retry_logs.remove(&key);
                    self.remember_refusal(&key, &refused);
                }
            }
        }
    }
}
