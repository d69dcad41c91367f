//! The outgoing log of each delegation: sequence numbers, the frames not yet
//! acknowledged, the in-flight window, acks, and resending after a
//! retryable refusal once the retry deadline fires.
//!
//! Never writes to the socket: `pump` moves frames into the session's `out`
//! buffer. Never sends a frame beyond its log's in-flight window, nor a
//! refused log's frames before the retry deadline.

use std::collections::VecDeque;
use std::time::Duration;

use bytes::Bytes;
use oab_wire::handshake::TRACE_VERSION;
use oab_wire::{DelegationKey, Direction, Frame, Open};
use tokio::sync::oneshot;

use tracing::warn;

use super::frames::{queue_resume, within_limits};
use super::stats::Side;
use super::{EventError, Link, LinkError};

/// Pause before resending what the relay refused with a retryable code
/// (`store_unavailable`, `rate_limited`, `too_many_delegations`). A deadline
/// set by the first refusal and kept until it fires: other traffic does not
/// push it back, so a log refused during a store outage goes out again at
/// most this long after the outage ends.
const RETRY_AFTER: Duration = Duration::from_millis(250);

/// The sending half of one delegation (our log towards the relay).
#[derive(Debug, Default)]
pub(super) struct SendLog {
    pub(super) next: u64,
    pub(super) acked: u64,
    /// Sequence up to which frames were written on the current connection.
    pub(super) sent: u64,
    pub(super) unacked: VecDeque<(u64, Bytes)>,
    pub(super) ack_waiters: Vec<(u64, oneshot::Sender<Result<u64, LinkError>>)>,
    /// The relay's store lost entries of this log after acknowledging them
    /// (it holds up to this sequence): they cannot be sent again, so
    /// nothing more is sent on it.
    pub(super) lost: Option<u64>,
    /// The sequence of our own terminal in this log, once queued (a callee's
    /// result): if that frame cannot be sent, the terminal is taken back so
    /// a smaller one can replace it.
    pub(super) terminal_seq: Option<u64>,
}

impl Link {
    pub(super) fn ack(&mut self, key: &DelegationKey, dir: Direction, seq: u64) {
        let Some(d) = self.delegations.get_mut(key) else {
            return;
        };
        if dir != d.send_dir() || seq <= d.send_log.acked {
            return;
        }
        d.send_log.acked = seq;
        d.send_log.sent = d.send_log.sent.max(seq);
        while d.send_log.unacked.front().is_some_and(|(s, _)| *s <= seq) {
            d.send_log.unacked.pop_front();
            self.buffered = self.buffered.saturating_sub(1);
        }
        if let Some(r) = d.open_reply.take() {
            let _ = r.send(Ok(()));
        }
        let (done, waiting): (Vec<_>, Vec<_>) = d
            .send_log
            .ack_waiters
            .drain(..)
            .partition(|(s, _)| *s <= seq);
        d.send_log.ack_waiters = waiting;
        for (s, w) in done {
            let _ = w.send(Ok(s));
        }
        let sent_all = d.send_log.unacked.is_empty();
        let our_terminal_durable = sent_all && d.terminal.is_some() && !d.is_caller;
        if !sent_all {
            // The window moved: more may go out.
            self.ready_to_send.insert(key.clone());
        }
        if our_terminal_durable {
            self.record_finished(key);
        }
    }

    /// Moves unsent frames into `out`, within each log's in-flight window.
    /// Logs waiting for the retry deadline stay put; the others go on. A
    /// frame over the session's limits (queued before this relay's
    /// `Welcome` said them, or under a larger limit of an earlier session)
    /// is never sent: its log is cut there ([`Link::unsendable`]).
    pub(super) fn pump(&mut self, out: &mut Vec<Bytes>) {
        out.append(&mut self.control_frames);
        let window = u64::from(self.max_in_flight);
        let mut unsendable = Vec::new();
        // Only logs with something new to send (or a window that opened).
        for key in self.ready_to_send.drain() {
            if self.retry_logs.contains(&key) {
                continue;
            }
            let Some(d) = self.delegations.get_mut(&key) else {
                continue;
            };
            if d.send_log.lost.is_some() {
                continue;
            }
            for (seq, bytes) in d.send_log.unacked.iter() {
                if *seq <= d.send_log.sent {
                    continue;
                }
                if *seq > d.send_log.acked + window {
                    // Window full: the next ack makes this log ready again.
                    break;
                }
                if let Err(e) = within_limits(&self.limits, bytes) {
                    unsendable.push((key.clone(), *seq, e));
                    break;
                }
                if *seq == 1 && d.is_caller && self.session_version < TRACE_VERSION {
                    // A relay of protocol version 1 does not decode the
                    // trace id: the open goes without it.
                    out.push(without_trace(bytes));
                } else {
                    out.push(bytes.clone());
                }
                d.send_log.sent = *seq;
            }
        }
        for (key, seq, e) in unsendable {
            self.unsendable(&key, seq, e);
        }
    }

    /// The frame at `seq` of our log of `key` cannot be stored by the relay
    /// (over its limits, or refused `payload_too_large`): it is dropped with
    /// every later unacknowledged frame of the log, their waiters get `e`,
    /// and the log goes on from `seq` with whatever is sent next. Only
    /// frames the relay never acknowledged are dropped, so it holds none of
    /// them. A caller's open (seq 1) leaves no delegation: the refusal goes
    /// to its subscribers and is remembered for later ones. A callee's own
    /// terminal among the dropped frames is taken back, so a smaller one
    /// (a failed result saying why) can be sent instead. The link and every
    /// other delegation go on.
    pub(super) fn unsendable(&mut self, key: &DelegationKey, seq: u64, e: LinkError) {
        let Some(d) = self.delegations.get_mut(key) else {
            return;
        };
        if seq <= d.send_log.acked || seq >= d.send_log.next {
            return;
        }
        warn!(%key, trace_id = d.trace.map(display), seq, error = %e, "frame dropped: the relay cannot take it; the delegation goes on without it");
        let before = d.send_log.unacked.len();
        d.send_log.unacked.retain(|(s, _)| *s < seq);
        self.buffered = self
            .buffered
            .saturating_sub(before - d.send_log.unacked.len());
        d.send_log.next = seq;
        d.send_log.sent = d.send_log.sent.min(seq - 1);
        let (failed, waiting): (Vec<_>, Vec<_>) = d
            .send_log
            .ack_waiters
            .drain(..)
            .partition(|(s, _)| *s >= seq);
        d.send_log.ack_waiters = waiting;
        for (_, w) in failed {
            let _ = w.send(Err(e.clone()));
        }
        if d.send_log.terminal_seq.is_some_and(|t| t >= seq) {
            d.send_log.terminal_seq = None;
            d.terminal = None;
        }
        if d.is_caller && seq == 1 {
            if let Some(r) = d.open_reply.take() {
                let _ = r.send(Err(e.clone()));
            }
            let refusal = EventError::Refused {
                code: e
                    .code()
                    .unwrap_or(oab_wire::ErrorCode::PayloadTooLarge.name())
                    .to_string(),
                message: e.to_string(),
            };
            d.notify_subscribers(&Err(refusal));
            if !d.end_counted {
                self.stats.ended(Side::Caller, None);
            }
            self.delegations.remove(key);
            self.ready_to_send.remove(key);
            self.retry_logs.remove(key);
            self.remember_refusal(key, &e);
        }
    }

    /// Schedules a retry (keeps an earlier deadline).
    pub(super) fn retry_later(&mut self) {
        self.retry_at
            .get_or_insert_with(|| tokio::time::Instant::now() + RETRY_AFTER);
    }

    /// The retry deadline fired: refused logs go out again from their last
    /// ack, refused resumes are sent again.
    pub(super) fn retry_now(&mut self, out: &mut Vec<Bytes>) {
        self.retry_at = None;
        self.ready_to_send.extend(self.retry_logs.drain());
        for (key, d) in self.delegations.iter_mut() {
            if std::mem::take(&mut d.resume_retry) && d.terminal.is_none() {
                d.resuming = true;
                queue_resume(key, d.recv_dir(), d.cursor, out);
            }
        }
    }
}

/// An encoded `Open` without its trace id (any other frame as it is).
fn without_trace(bytes: &Bytes) -> Bytes {
    match oab_wire::decode_message(bytes.clone(), &super::connection::ceiling()) {
        Ok(Frame::Open(open)) if open.trace.is_some() => {
            let open = Frame::Open(Open {
                trace: None,
                ..open
            });
            oab_wire::encode(&open).unwrap_or_else(|_| bytes.clone())
        }
        _ => bytes.clone(),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::panic)]
mod tests {
    use super::*;
    use oab_wire::{Digest, Limits, PeerId, RequestId, TraceId};

    #[test]
    fn an_open_for_a_version_1_relay_loses_only_its_trace() {
        let payload = Bytes::from_static(b"{\"signed\":true}");
        let open = Open {
            key: DelegationKey::new(
                PeerId::new("acme/a").unwrap(),
                RequestId::new("r-1").unwrap(),
            ),
            target: PeerId::new("acme/b").unwrap(),
            deadline_ms: 42,
            depth: 1,
            digest: Digest::of(&payload),
            ceiling: String::new(),
            trace: Some(TraceId::random()),
            payload,
        };
        let with = oab_wire::encode(&Frame::Open(open.clone())).unwrap();
        let without = without_trace(&with);
        let Frame::Open(back) =
            oab_wire::decode_message(without.clone(), &Limits::default()).unwrap()
        else {
            panic!("not an open");
        };
        assert_eq!(
            back,
            Open {
                trace: None,
                ..open
            }
        );
        // Already without: the same bytes; any other frame: untouched.
        assert_eq!(without_trace(&without), without);
        let ping = oab_wire::encode(&Frame::Ping(oab_wire::Ping { token: 7 })).unwrap();
        assert_eq!(without_trace(&ping), ping);
    }
}
