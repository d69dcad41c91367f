//! The receive cursor of each delegation and resumes: a frame is taken only
//! in order, a hole asks the relay to resume from the cursor (once per
//! session), every new session resumes each delegation without a terminal,
//! and a new store epoch ends with a gap what the relay no longer lists.
//!
//! Never advances a cursor past a hole, and never sends a second resume for
//! a log while one is in flight on the session.

use bytes::Bytes;
use oab_wire::{DelegationCursor, DelegationKey, Frame, GapReason, encode};

use super::delegation::Delegation;
use super::frames::queue_resume;
use super::stats::Side;
use super::{EventError, Link};

impl Link {
    pub(super) fn after_welcome(&mut self, list: &[DelegationCursor], out: &mut Vec<Bytes>) {
        self.control_frames.clear();
        // Everything goes out again from its last ack on this session.
        self.retry_at = None;
        self.retry_logs.clear();
        if let Some(d) = &self.descriptor
            && let Ok(b) = encode(&Frame::Publish(d.clone()))
        {
            out.push(b);
            self.stats.published();
        }
        if !self.peer_waiters.is_empty()
            && let Ok(b) = encode(&Frame::PeersQuery)
        {
            out.push(b);
        }
        // New work for us that arrived while we were away, or that an
        // earlier run of this connector accepted (its up log holds entries:
        // ours continue after them, and its `Open` is handed on as
        // `Reopened`, never to be run again).
        for c in list {
            if !c.is_caller && c.terminal.is_none() && !self.delegations.contains_key(&c.key) {
                let mut d = Delegation::new(false, c.counterpart.clone());
                if c.up > 0 {
                    d.send_log.next = c.up + 1;
                    d.send_log.acked = c.up;
                    d.send_log.sent = c.up;
                }
                self.delegations.insert(c.key.clone(), d);
                self.stats.opened(Side::Callee);
            }
        }
        // The receiver decides what to resume, not the welcome: every
        // delegation without a terminal here is resumed from its cursor on
        // every new session, listed or not (a delegation that finished while
        // we were away is not listed, and its terminal must still arrive).
        // A resume of an earlier session is void on this one.
        for (key, d) in self.delegations.iter_mut() {
            d.resuming = false;
            d.resume_retry = false;
            if d.terminal.is_some() {
                continue;
            }
            if d.is_caller && d.send_log.acked == 0 {
                // The open goes out again; resume once it is acknowledged (a
                // resume before the open lands would be answered with a gap,
                // and a relay that already had the open does not subscribe
                // us by itself).
                d.resume_after_open = true;
                continue;
            }
            d.resuming = true;
            queue_resume(key, d.recv_dir(), d.cursor, out);
        }
    }

    /// The relay's store lost data: every delegation it no longer lists and
    /// that is not finished locally ends with a gap for its subscribers.
    pub(super) fn epoch_changed(&mut self, list: &[DelegationCursor]) {
        for (key, d) in self.delegations.iter_mut() {
            if d.terminal.is_none() && !list.iter().any(|c| &c.key == key) {
                d.notify_subscribers(&Err(EventError::Gap {
                    after: d.cursor,
                    reason: GapReason::EpochChanged,
                }));
            }
        }
    }
}

/// Checks a received sequence against the cursor: `true` to process it.
/// A hole asks the relay to resume from the cursor (once).
pub(super) fn in_order(
    d: &mut Delegation,
    seq: u64,
    key: &DelegationKey,
    out: &mut Vec<Bytes>,
) -> bool {
    if seq <= d.cursor {
        return false;
    }
    if seq > d.cursor + 1 {
        if !d.resuming {
            d.resuming = true;
            queue_resume(key, d.recv_dir(), d.cursor, out);
        }
        return false;
    }
    d.cursor = seq;
    d.resuming = false;
    true
}
