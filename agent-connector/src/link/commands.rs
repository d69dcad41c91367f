//! Commands from the handles: an open or a send becomes a sequenced frame in
//! the delegation's outgoing log; subscriptions replay the kept events;
//! snapshots, peer queries and the published descriptor.
//!
//! Never awaits: a command is applied at once and its frames leave with the
//! next pump. Never sends a frame after the delegation's terminal.

use bytes::Bytes;
use oab_wire::{Cancel, Data, Frame, GapReason, encode};
use tracing::warn;

use super::delegation::{Delegation, settle};
use super::frames::{queue_resume, within_limits};
use super::stats::Side;
use super::{Command, EventError, Link, LinkError, OpenDelegation, SendKind, Snapshot};

/// `list_peers` calls waiting for one answer, at most.
const MAX_PEER_WAITERS: usize = 1_024;

impl Link {
    fn within_limits(&self, frame: &Bytes) -> Result<(), LinkError> {
        within_limits(&self.limits, frame)
    }

    /// Remembers that `key`'s open was refused, for a subscriber that comes
    /// later (bounded by [`super::REFUSALS_KEPT`], oldest forgotten).
    pub(super) fn remember_refusal(&mut self, key: &oab_wire::DelegationKey, e: &LinkError) {
        let (code, message) = match e {
            LinkError::Refused { code, message } => (code.clone(), message.clone()),
            other => (
                other.code().unwrap_or("refused").to_string(),
                other.to_string(),
            ),
        };
        if self.refused.len() >= super::REFUSALS_KEPT {
            self.refused.pop_front();
        }
        self.refused
            .push_back((key.clone(), EventError::Refused { code, message }));
    }

    /// The refusal of `key`'s open, if it is still remembered.
    fn refusal_of(&self, key: &oab_wire::DelegationKey) -> Option<&EventError> {
        self.refused
            .iter()
            .rev()
            .find_map(|(k, e)| (k == key).then_some(e))
    }

    pub(super) fn apply_command(&mut self, cmd: Command) {
        match cmd {
            Command::Open {
                open,
                cursor,
                existing,
                reply,
            } => {
                if self.delegations.contains_key(&open.key) {
                    let _ = reply.send(Err(LinkError::Duplicate(open.key.request_id.to_string())));
                    return;
                }
                let key = open.key.clone();
                let target = open.target.clone();
                let trace = open.trace;
                let bytes = match encode(&Frame::Open(open)) {
                    Ok(b) => b,
                    Err(e) => {
                        let _ = reply.send(Err(LinkError::Frame(e.to_string())));
                        return;
                    }
                };
                if let Err(e) = self.within_limits(&bytes) {
                    warn!(%key, trace_id = trace.map(display), error = %e, "open not sent: over the relay's limits");
                    self.remember_refusal(&key, &e);
                    let _ = reply.send(Err(e));
                    return;
                }
                let mut d = Delegation::new(true, target);
                d.trace = trace;
                d.cursor = cursor;
                d.resume_after_open = existing;
                d.send_log.next = 2;
                d.send_log.unacked.push_back((1, bytes));
                d.open_reply = Some(reply);
                self.buffered += 1;
                self.ready_to_send.insert(key.clone());
                self.delegations.insert(key, d);
                self.stats.opened(Side::Caller);
            }
            Command::Send {
                key,
                kind,
                payload,
                acked,
            } => {
                let Some(d) = self.delegations.get_mut(&key) else {
                    if let Some(a) = acked {
                        let _ = a.send(Err(LinkError::UnknownDelegation(key.to_string())));
                    }
                    return;
                };
                if let Some(t) = d.terminal {
                    if let Some(a) = acked {
                        let _ = a.send(Err(LinkError::AlreadyTerminal(t)));
                    }
                    return;
                }
                if let Some(held) = d.send_log.lost {
                    if let Some(a) = acked {
                        let _ = a.send(Err(LinkError::StoreLost {
                            acked: d.send_log.acked,
                            held,
                        }));
                    }
                    return;
                }
                if d.send_log.next == 0 {
                    d.send_log.next = 1;
                }
                let seq = d.send_log.next;
                let frame = match kind {
                    SendKind::Cancel => Frame::Cancel(Cancel {
                        key: key.clone(),
                        seq,
                        flags: 0,
                        payload,
                    }),
                    SendKind::Data | SendKind::Terminal(_) => Frame::Data(Data {
                        key: key.clone(),
                        direction: d.send_dir(),
                        seq,
                        terminal: match kind {
                            SendKind::Terminal(o) => Some(o),
                            _ => None,
                        },
                        flags: 0,
                        payload,
                    }),
                };
                match encode(&frame)
                    .map_err(|e| LinkError::Frame(e.to_string()))
                    .and_then(|bytes| {
                        within_limits(&self.limits, &bytes)?;
                        Ok(bytes)
                    }) {
                    Ok(bytes) => {
                        if let SendKind::Terminal(_) = kind {
                            d.send_log.terminal_seq = Some(seq);
                        }
                        d.send_log.next += 1;
                        d.send_log.unacked.push_back((seq, bytes));
                        self.buffered += 1;
                        self.ready_to_send.insert(key.clone());
                        if let SendKind::Terminal(o) = kind {
                            settle(&self.stats, d, o);
                        }
                        if let Some(a) = acked {
                            d.send_log.ack_waiters.push((seq, a));
                        }
                    }
                    Err(e) => {
                        warn!(%key, trace_id = d.trace.map(display), seq, error = %e, "frame not sent");
                        if let Some(a) = acked {
                            let _ = a.send(Err(e));
                        }
                    }
                }
            }
            Command::Subscribe { key, after, tx } => {
                let Some(d) = self.delegations.get_mut(&key) else {
                    // A refused open leaves no delegation: its refusal is
                    // the answer, not an unknown one.
                    let refusal = self.refusal_of(&key).cloned();
                    let _ = tx.try_send(Err(refusal.unwrap_or(EventError::Gap {
                        after,
                        reason: GapReason::Unknown,
                    })));
                    return;
                };
                let first = d.events.front().map_or(d.cursor + 1, |e| e.seq);
                if after + 1 < first {
                    let _ = tx.try_send(Err(EventError::Gap {
                        after,
                        reason: GapReason::Trimmed,
                    }));
                    return;
                }
                let mut last = after;
                for ev in d.events.iter().filter(|e| e.seq > after) {
                    // The channel's last slot is kept for the `Lagged`
                    // notice (or the terminal), as for live events, so a
                    // subscriber whose replay does not fit learns it lagged
                    // instead of seeing its stream end.
                    let keep_last = tx.max_capacity() > 1 && ev.terminal.is_none();
                    if (keep_last && tx.capacity() <= 1) || tx.try_send(Ok(ev.clone())).is_err() {
                        let _ = tx.try_send(Err(EventError::Lagged { last }));
                        return;
                    }
                    last = ev.seq;
                }
                d.subscribers.push((tx, last));
            }
            Command::Snapshot { key, reply } => {
                let snap = self.delegations.get(&key).map(|d| Snapshot {
                    key: key.clone(),
                    counterpart: d.counterpart.clone(),
                    is_caller: d.is_caller,
                    sent: d.send_log.next.saturating_sub(1),
                    acked: d.send_log.acked,
                    received: d.cursor,
                    terminal: d.terminal,
                });
                let _ = reply.send(snap);
            }
            Command::Peers { reply } => {
                // Bounded: past MAX_PEER_WAITERS, answer from the last list.
                if self.peer_waiters.len() >= MAX_PEER_WAITERS {
                    let _ = reply.send(self.peers.clone());
                    return;
                }
                if self.peer_waiters.is_empty()
                    && self.online
                    && let Ok(b) = encode(&Frame::PeersQuery)
                {
                    self.control_frames.push(b);
                }
                self.peer_waiters.push(reply);
            }
            Command::Held { reply } => {
                let _ = reply.send(self.held());
            }
            Command::OpenList { max, reply } => {
                let open = self
                    .delegations
                    .iter()
                    .filter(|(_, d)| d.terminal.is_none());
                let total = open.clone().count();
                let list = open
                    .take(max)
                    .map(|(key, d)| OpenDelegation {
                        key: key.clone(),
                        counterpart: d.counterpart.clone(),
                        side: Side::of(d.is_caller),
                        sent: d.send_log.next.saturating_sub(1),
                        acked: d.send_log.acked,
                        received: d.cursor,
                    })
                    .collect();
                let _ = reply.send((list, total));
            }
            Command::Trace { key, trace } => {
                if let Some(d) = self.delegations.get_mut(&key) {
                    d.trace = Some(trace);
                }
            }
            Command::Release { key, after } => {
                // Only for a delegation this caller holds and saw end there.
                let ended = self
                    .delegations
                    .get(&key)
                    .is_none_or(|d| d.is_caller && d.terminal.is_some() && d.cursor >= after);
                if self.online && ended {
                    queue_resume(
                        &key,
                        oab_wire::Direction::Up,
                        after,
                        &mut self.control_frames,
                    );
                }
            }
            Command::Publish { descriptor } => {
                // Not sequenced: sent now if connected, and on every connect.
                let sent = self.online
                    && match encode(&Frame::Publish(descriptor.clone())) {
                        Ok(b) => {
                            self.control_frames.push(b);
                            true
                        }
                        Err(_) => false,
                    };
                self.stats.descriptor_set(descriptor.len(), sent);
                self.descriptor = Some(descriptor);
            }
        }
    }
}
