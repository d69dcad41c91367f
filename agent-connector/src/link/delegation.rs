//! The state the link keeps per delegation: its role, the counterpart, its
//! outgoing log, the receive cursor, the terminal, the events kept for
//! local replay and the local subscribers; and the retention of finished
//! delegations.
//!
//! Never blocks on a subscriber: a subscriber whose channel is full is
//! dropped with [`EventError::Lagged`]. A delegation is removed only when
//! its open was refused or it ages out of the finished list.

use std::collections::VecDeque;

use oab_wire::{DelegationKey, Direction, Outcome, PeerId};
use tokio::sync::{mpsc, oneshot};

use super::window::SendLog;
use super::{EventError, Link, LinkError, UpEvent};

/// One delegation this connector takes part in, as caller or callee.
/// Removed when its open is refused, or when it ages out of the finished
/// list (`Link::record_finished`).
pub(super) struct Delegation {
    pub(super) is_caller: bool,
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
            counterpart,
            send_log: SendLog::default(),
            cursor: 0,
            resuming: false,
            resume_retry: false,
            terminal: None,
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

    pub(super) fn notify_subscribers(&mut self, item: &Result<UpEvent, EventError>) {
        self.subscribers.retain_mut(|(tx, last)| match item {
            Ok(ev) if ev.seq <= *last => true,
            _ => match tx.try_send(item.clone()) {
                Ok(()) => {
                    if let Ok(ev) = item {
                        *last = ev.seq;
                    }
                    true
                }
                Err(mpsc::error::TrySendError::Full(_)) => {
                    let lagged = EventError::Lagged { last: *last };
                    // Best effort: the receiver sees the channel close either way.
                    let _ = tx.try_send(Err(lagged));
                    false
                }
                Err(mpsc::error::TrySendError::Closed(_)) => false,
            },
        });
    }
}

impl Link {
    /// Remembers a finished delegation; the oldest beyond `max_finished`,
    /// or beyond `max_finished_bytes` of kept event payloads, are forgotten
    /// (their events can no longer be replayed locally).
    pub(super) fn record_finished(&mut self, key: &DelegationKey) {
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
