//! The state the link keeps per delegation: its role, the counterpart, its
//! outgoing log, the receive cursor, the terminal, the events kept for
//! local replay and the local subscribers; and the retention of finished
//! delegations.
//!
//! Never blocks on a subscriber: a subscriber whose channel has one slot
//! left gets [`EventError::Lagged`] in it and is dropped. A caller's
//! delegation is removed when its open was refused or it ages out of the
//! finished list; a callee's as soon as its terminal is settled (ours
//! acknowledged, or the relay's reported), since nothing local reads it
//! afterwards.

use std::collections::VecDeque;

use oab_wire::{DelegationKey, Direction, Outcome, PeerId};
use tokio::sync::{mpsc, oneshot};

use super::stats::{LinkStats, Side};
use super::window::SendLog;
use super::{EventError, Link, LinkError, UpEvent};

/// One delegation this connector takes part in, as caller or callee.
/// Pruned when its open is refused; as a caller, when it ages out of the
/// finished list; as a callee, when its terminal is settled
/// (`Link::record_finished`).
pub(super) struct Delegation {
    pub(super) is_caller: bool,
    /// Its trace id, for log lines: the caller's from its `Open`, the
    /// callee's once its request verified ([`super::LinkHandle::note_trace`]).
    pub(super) trace: Option<oab_wire::TraceId>,
    pub(super) counterpart: PeerId,
    pub(super) send_log: SendLog,
    /// Last sequence received on our receiving log.
    pub(super) cursor: u64,
    /// A resume is in flight on this session (do not send another for a
    /// hole). Void on the next session.
    pub(super) resuming: bool,
    /// The relay refused our resume with a retryable code: resend it when
    /// the retry deadline fires.
    pub(super) resume_retry: bool,
    pub(super) terminal: Option<Outcome>,
    /// Its end was counted (`oab_connector_delegations_finished_total`):
    /// a terminal taken back and set again is not counted twice.
    pub(super) end_counted: bool,
    pub(super) events: VecDeque<UpEvent>,
    pub(super) subscribers: Vec<(mpsc::Sender<Result<UpEvent, EventError>>, u64)>,
    pub(super) open_reply: Option<oneshot::Sender<Result<(), LinkError>>>,
    /// Send a resume of the up log once the open is acknowledged (the relay
    /// subscribes the caller by itself only when it creates the delegation).
    pub(super) resume_after_open: bool,
}

impl Delegation {
    pub(super) fn new(is_caller: bool, counterpart: PeerId) -> Self {
        Delegation {
            is_caller,
            trace: None,
            counterpart,
            send_log: SendLog::default(),
            cursor: 0,
            resuming: false,
            resume_retry: false,
            terminal: None,
            end_counted: false,
            events: VecDeque::new(),
            subscribers: Vec::new(),
            open_reply: None,
            resume_after_open: false,
        }
    }

    pub(super) fn send_dir(&self) -> Direction {
        if self.is_caller {
            Direction::Down
        } else {
            Direction::Up
        }
    }

    pub(super) fn recv_dir(&self) -> Direction {
        self.send_dir().reverse()
    }

    /// Hands `item` to every subscriber without waiting. The last free slot
    /// of a subscriber's channel is kept for the [`EventError::Lagged`]
    /// notice: a subscriber that has one slot left when an event arrives
    /// gets the notice there (so it is always delivered) and is dropped; it
    /// resubscribes from its cursor.
    pub(super) fn notify_subscribers(&mut self, item: &Result<UpEvent, EventError>) {
        self.subscribers.retain_mut(|(tx, last)| match item {
            Ok(ev) if ev.seq <= *last => true,
            _ => {
                let is_end = item.is_err() || item.as_ref().is_ok_and(|e| e.terminal.is_some());
                if tx.capacity() <= 1 && tx.max_capacity() > 1 && !is_end {
                    let _ = tx.try_send(Err(EventError::Lagged { last: *last }));
                    return false;
                }
                match tx.try_send(item.clone()) {
                    Ok(()) => {
                        if let Ok(ev) = item {
                            *last = ev.seq;
                        }
                        true
                    }
                    Err(mpsc::error::TrySendError::Full(_)) => {
                        // A channel of one slot has no room for a notice:
                        // the receiver sees its stream end.
                        false
                    }
                    Err(mpsc::error::TrySendError::Closed(_)) => false,
                }
            }
        });
    }
}

/// Sets the delegation's terminal if it has none yet, and counts its end
/// (`oab_connector_delegations_finished_total`). The one place a terminal
/// is first set, so each delegation is counted once.
pub(super) fn settle(stats: &LinkStats, d: &mut Delegation, outcome: Outcome) {
    if d.terminal.is_none() {
        d.terminal = Some(outcome);
        if !std::mem::replace(&mut d.end_counted, true) {
            stats.ended(Side::of(d.is_caller), Some(outcome));
        }
    }
}

impl Link {
    /// Remembers a finished delegation; the oldest beyond `max_finished`,
    /// or beyond `max_finished_bytes` of kept event payloads, are forgotten
    /// (their events can no longer be replayed locally). A callee's
    /// delegation is forgotten at once once nothing of ours is
    /// unacknowledged: nobody local reads its events, and a frame the relay
    /// still sends for it is dropped as unknown.
    pub(super) fn record_finished(&mut self, key: &DelegationKey) {
        if let Some(d) = self.delegations.get(key)
            && !d.is_caller
        {
            if d.terminal.is_some() && d.send_log.unacked.is_empty() {
                self.delegations.remove(key);
                self.ready_to_send.remove(key);
                self.retry_logs.remove(key);
            }
            return;
        }
        let bytes = self.delegations.get(key).map_or(0, |d| {
            d.events
                .iter()
                .map(|e| u64::try_from(e.payload.len()).unwrap_or(u64::MAX))
                .fold(0u64, u64::saturating_add)
        });
        self.finished.push_back((key.clone(), bytes));
        self.finished_bytes = self.finished_bytes.saturating_add(bytes);
        while self.finished.len() > self.settings.max_finished
            || (self.finished_bytes > self.settings.max_finished_bytes && self.finished.len() > 1)
        {
            let Some((old, b)) = self.finished.pop_front() else {
                break;
            };
            self.finished_bytes = self.finished_bytes.saturating_sub(b);
            if self
                .delegations
                .get(&old)
                .is_some_and(|d| d.terminal.is_some() && d.send_log.unacked.is_empty())
            {
                self.delegations.remove(&old);
            }
        }
    }

    /// How many delegations the link holds (open ones, and finished ones
    /// within the retention).
    pub(super) fn held(&self) -> usize {
        self.delegations.len()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use bytes::Bytes;

    fn event(seq: u64) -> Result<UpEvent, EventError> {
        Ok(UpEvent {
            seq,
            terminal: None,
            relay_origin: false,
            payload: Bytes::from_static(b"{}"),
        })
    }

    #[test]
    fn a_subscriber_that_falls_behind_receives_the_lagged_notice() {
        let mut d = Delegation::new(true, PeerId::new("acme/b").unwrap());
        let (tx, mut rx) = mpsc::channel(3);
        d.subscribers.push((tx, 0));
        for seq in 1..=5 {
            d.notify_subscribers(&event(seq));
        }
        assert!(d.subscribers.is_empty(), "the subscriber was dropped");
        assert_eq!(rx.try_recv().unwrap(), event(1));
        assert_eq!(rx.try_recv().unwrap(), event(2));
        assert_eq!(
            rx.try_recv().unwrap(),
            Err(EventError::Lagged { last: 2 }),
            "the notice is delivered"
        );
        assert!(rx.try_recv().is_err());
    }
}
