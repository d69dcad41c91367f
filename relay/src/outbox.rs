//! The bounded queues towards one session, and the handle that closes it.
//!
//! Two lanes, both bounded in frames, and together bounded in bytes
//! (`limits.session_queue_bytes`), drained control first:
//!
//! - **control** (acks, errors, gaps, pongs, peer lists; capacity
//!   [`CONTROL_CAPACITY`]): small frames the session must not lose. Overflow
//!   (in frames, or in bytes: the lanes together over the byte budget) means
//!   the peer reads nothing at all: the session is closed with
//!   `slow_consumer` (4001).
//! - **data** (delegation frames; capacity `limits.session_queue`, and at most
//!   the byte budget less one largest frame and
//!   [`CONTROL_HEADROOM_BYTES`], so control frames always have room): a live frame that does not fit is **not** dropped and does
//!   not close the session: the subscription falls back to replaying from the
//!   durable log, paced by the receiver ([`Outbox::send_data`] waits for
//!   room). Only a receiver that took nothing off its queues for `stall`
//!   while something waited in them is closed with `slow_consumer`; it
//!   resumes from its cursor after reconnecting, and nothing is lost because
//!   every frame is in the log.
//!
//! The stall clock runs only while something waits to be written: it starts
//! when the lanes go from empty to non-empty and restarts at every frame the
//! writer takes, so a session idle for longer than `stall` that then
//! receives a burst is not cut.
//!
//! Never: blocks a live pusher: `Outbox::push` and `Outbox::push_data` only
//! `try_send`, so the hub can call them under a view's lock; a full control
//! lane closes the session, a full data lane answers `Pushed::Full` and the hub
//! replays instead. Only a replay waits for room (`Outbox::send_data`), and it
//! gives up once the writer took nothing off the lanes for `stall`. Never
//! keeps frames after the session ends: the session task drops its
//! [`Inbox`] (and with it every queued frame) when the connection closes.

use parking_lot::Mutex;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use oab_wire::CloseCode;
use tokio::sync::{Notify, mpsc};
use tokio_util::sync::CancellationToken;

/// Capacity of the control lane: acks are cumulative and at most one per
/// log per batch, so a peer that keeps reading never comes close.
pub const CONTROL_CAPACITY: usize = 512;

/// Room kept in the byte budget for acks and errors, on top of one largest
/// frame (a `Peers` frame is bounded to `limits.max_payload`): data frames
/// may not use the last `max_frame + CONTROL_HEADROOM_BYTES` bytes, so
/// control frames of a session that keeps reading always fit.
pub const CONTROL_HEADROOM_BYTES: usize = 64 * 1024;

#[derive(Debug)]
struct Shared {
    reason: Mutex<Option<(CloseCode, String)>>,
    /// Bytes queued on both lanes (pushed and not yet taken by the writer).
    queued_bytes: AtomicUsize,
    /// The byte budget of both lanes together.
    budget: usize,
    /// The part of `budget` only control frames may use.
    control_reserve: usize,
    /// The last progress (ms since `epoch`): the writer's last take, or the
    /// moment the lanes went from empty to non-empty.
    progress_ms: AtomicU64,
    /// Replays waiting for byte room, and a reader waiting for control
    /// room; woken when the writer takes a frame.
    room: Notify,
    /// How many wait on `room` (the writer notifies only then).
    room_waiters: AtomicUsize,
    epoch: Instant,
    stall: Duration,
}

impl Shared {
    fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// Counts `len` more queued bytes if that stays within `limit`.
    fn admit(&self, len: usize, limit: usize) -> bool {
        let before = self.queued_bytes.fetch_add(len, Ordering::AcqRel);
        if before.saturating_add(len) > limit {
            self.queued_bytes.fetch_sub(len, Ordering::AcqRel);
            return false;
        }
        if before == 0 {
            // The lanes were empty: the stall clock starts now.
            self.progress_ms.store(self.now_ms(), Ordering::Relaxed);
        }
        true
    }

    /// Un-counts `len` bytes that were admitted but not queued.
    fn release(&self, len: usize) {
        self.queued_bytes.fetch_sub(len, Ordering::AcqRel);
    }

    /// Whether something waits in the lanes and the writer took nothing for
    /// `stall`.
    fn stalled(&self) -> bool {
        if self.queued_bytes.load(Ordering::Acquire) == 0 {
            return false;
        }
        let idle = self
            .now_ms()
            .saturating_sub(self.progress_ms.load(Ordering::Relaxed));
        u128::from(idle) >= self.stall.as_millis()
    }
}

/// The sending side of a session's queues, plus its close control. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Outbox {
    control: mpsc::Sender<Bytes>,
    data: mpsc::Sender<Bytes>,
    cancel: CancellationToken,
    shared: Arc<Shared>,
}

/// The receiving side, owned by the session task. Dropping it frees every
/// queued frame.
#[derive(Debug)]
pub struct Inbox {
    /// Control frames to write (drained first).
    pub control: mpsc::Receiver<Bytes>,
    /// Delegation frames to write.
    pub data: mpsc::Receiver<Bytes>,
    /// Cancelled when someone closes the session.
    pub cancel: CancellationToken,
    shared: Arc<Shared>,
}

/// What a live data push did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pushed {
    /// Queued.
    Queued,
    /// The lane is full: deliver from the log instead (replay).
    Full,
    /// The session is gone (or was just closed as a stalled consumer).
    Closed,
}

impl Inbox {
    /// Why the session was closed, if someone closed it.
    pub fn close_reason(&self) -> Option<(CloseCode, String)> {
        self.shared.reason.lock().clone()
    }

    /// Takes the next queued frame without waiting, control lane first.
    pub fn try_next(&mut self) -> Option<Bytes> {
        let f = self.try_take()?;
        self.taken(f.len());
        Some(f)
    }

    /// Takes the next queued frame without waiting, control lane first,
    /// without recording it: the caller reports the bytes it took with
    /// [`Inbox::taken`] (once per batch: one update of the shared counters
    /// instead of one per frame).
    pub fn try_take(&mut self) -> Option<Bytes> {
        match self.control.try_recv() {
            Ok(f) => Some(f),
            Err(_) => self.data.try_recv().ok(),
        }
    }

    /// Records that the writer took a frame of `len` bytes off a lane
    /// (progress; frees its share of the byte budget).
    pub fn taken(&self, len: usize) {
        let shared = &self.shared;
        shared.queued_bytes.fetch_sub(len, Ordering::AcqRel);
        shared.progress_ms.store(shared.now_ms(), Ordering::Relaxed);
        if shared.room_waiters.load(Ordering::Acquire) > 0 {
            shared.room.notify_waiters();
        }
    }

    /// Drops every queued data frame (the session is closing: its receiver
    /// resumes them from the log) and stops the data lane taking more.
    pub fn discard_data(&mut self) {
        self.data.close();
        while let Ok(f) = self.data.try_recv() {
            self.taken(f.len());
        }
    }

    /// Bytes queued on both lanes.
    pub fn queued_bytes(&self) -> usize {
        self.shared.queued_bytes.load(Ordering::Acquire)
    }
}

/// Queues of `data_capacity` data frames and [`CONTROL_CAPACITY`] control
/// frames, `budget` bytes on both lanes together of which data frames leave
/// `control_reserve` to control frames; `parent` cancels them (relay
/// shutdown); queued frames with no progress for `stall` close the session.
pub fn outbox(
    data_capacity: usize,
    budget: usize,
    control_reserve: usize,
    stall: Duration,
    parent: &CancellationToken,
) -> (Outbox, Inbox) {
    outbox_with_control(
        CONTROL_CAPACITY,
        data_capacity,
        budget,
        control_reserve,
        stall,
        parent,
    )
}

/// [`outbox`] with a control lane of `control_capacity` frames instead of
/// [`CONTROL_CAPACITY`] (a session with several append batches in flight
/// reserves room for each batch's replies). Slots are allocated as frames
/// are queued, so an idle session costs the same whatever the capacity.
pub fn outbox_with_control(
    control_capacity: usize,
    data_capacity: usize,
    budget: usize,
    control_reserve: usize,
    stall: Duration,
    parent: &CancellationToken,
) -> (Outbox, Inbox) {
    let (ctx, crx) = mpsc::channel(control_capacity.max(1));
    let (dtx, drx) = mpsc::channel(data_capacity.max(1));
    let cancel = parent.child_token();
    let shared = Arc::new(Shared {
        reason: Mutex::new(None),
        queued_bytes: AtomicUsize::new(0),
        budget,
        control_reserve,
        progress_ms: AtomicU64::new(0),
        room: Notify::new(),
        room_waiters: AtomicUsize::new(0),
        epoch: Instant::now(),
        stall,
    });
    (
        Outbox {
            control: ctx,
            data: dtx,
            cancel: cancel.clone(),
            shared: shared.clone(),
        },
        Inbox {
            control: crx,
            data: drx,
            cancel,
            shared,
        },
    )
}

/// Un-registers a replay waiting for byte room, however its wait ends.
struct RoomWaiter<'a>(&'a Shared);

impl<'a> RoomWaiter<'a> {
    fn new(shared: &'a Shared) -> Self {
        shared.room_waiters.fetch_add(1, Ordering::AcqRel);
        RoomWaiter(shared)
    }
}

impl Drop for RoomWaiter<'_> {
    fn drop(&mut self) {
        self.0.room_waiters.fetch_sub(1, Ordering::AcqRel);
    }
}

const NOT_DRAINING: &str = "send queue full and not draining; reconnect and resume";

impl Outbox {
    /// Queues a control frame without waiting. On overflow (in frames or in
    /// bytes) the session is closed with `slow_consumer` and `false` is
    /// returned.
    pub fn push(&self, frame: Bytes) -> bool {
        let len = frame.len();
        if !self.shared.admit(len, self.shared.budget) {
            self.close(
                CloseCode::SlowConsumer,
                "send queue over its byte budget; reconnect and resume",
            );
            return false;
        }
        match self.control.try_send(frame) {
            Ok(()) => true,
            Err(mpsc::error::TrySendError::Full(_)) => {
                self.shared.release(len);
                self.close(
                    CloseCode::SlowConsumer,
                    "control queue full; reconnect and resume",
                );
                false
            }
            Err(mpsc::error::TrySendError::Closed(_)) => {
                self.shared.release(len);
                false
            }
        }
    }

    /// The bytes data frames may occupy.
    fn data_budget(&self) -> usize {
        self.shared
            .budget
            .saturating_sub(self.shared.control_reserve)
    }

    /// Queues a live data frame without waiting (see the module doc for the
    /// overflow policy).
    pub fn push_data(&self, frame: Bytes) -> Pushed {
        let len = frame.len();
        if !self.shared.admit(len, self.data_budget()) {
            return self.full();
        }
        match self.data.try_send(frame) {
            Ok(()) => Pushed::Queued,
            Err(mpsc::error::TrySendError::Full(_)) => {
                self.shared.release(len);
                self.full()
            }
            Err(mpsc::error::TrySendError::Closed(_)) => {
                self.shared.release(len);
                Pushed::Closed
            }
        }
    }

    /// A live frame found no room: replay, or close a stalled receiver.
    fn full(&self) -> Pushed {
        if self.cancel.is_cancelled() {
            Pushed::Closed
        } else if self.shared.stalled() {
            self.close(CloseCode::SlowConsumer, NOT_DRAINING);
            Pushed::Closed
        } else {
            Pushed::Full
        }
    }

    /// Queues a data frame, waiting for room in frames and in bytes
    /// (replays). `false` once the session is gone, or when it drained
    /// nothing for `stall` (then it is closed with `slow_consumer`).
    pub async fn send_data(&self, frame: Bytes) -> bool {
        let permit = loop {
            tokio::select! {
                r = self.data.reserve() => match r {
                    Ok(permit) => break permit,
                    Err(_) => return false,
                },
                () = self.cancel.cancelled() => return false,
                () = tokio::time::sleep(self.shared.stall) => {
                    if self.stall_close() {
                        return false;
                    }
                }
            }
        };
        let len = frame.len();
        let limit = self.data_budget();
        let _waiter = RoomWaiter::new(&self.shared);
        loop {
            let room = self.shared.room.notified();
            tokio::pin!(room);
            room.as_mut().enable();
            if self.shared.admit(len, limit) {
                permit.send(frame);
                return true;
            }
            tokio::select! {
                () = room => {}
                () = self.cancel.cancelled() => return false,
                () = tokio::time::sleep(self.shared.stall) => {
                    if self.stall_close() {
                        return false;
                    }
                }
            }
        }
    }

    /// Closes the session if it is stalled; whether it did.
    fn stall_close(&self) -> bool {
        let stalled = self.shared.stalled();
        if stalled {
            self.close(CloseCode::SlowConsumer, NOT_DRAINING);
        }
        stalled
    }

    /// Closes the session with a code and reason (first reason wins).
    pub fn close(&self, code: CloseCode, reason: &str) {
        {
            let mut slot = self.shared.reason.lock();
            if slot.is_none() {
                *slot = Some((code, reason.to_string()));
            }
        }
        self.cancel.cancel();
    }

    /// The token cancelled when the session is closed.
    pub fn cancel_token(&self) -> CancellationToken {
        self.cancel.clone()
    }

    /// Whether the session was closed.
    pub fn is_closed(&self) -> bool {
        self.cancel.is_cancelled() || self.data.is_closed()
    }

    /// Control frames waiting in their lane.
    pub fn control_depth(&self) -> usize {
        self.control.max_capacity() - self.control.capacity()
    }

    /// Waits until at most `depth` control frames wait, or the session is
    /// closed. The session's reader calls it before reading more frames, so
    /// a peer that does not read its acks is back-pressured (not cut) until
    /// the stall clock runs out.
    pub async fn control_room(&self, depth: usize) {
        if self.control_depth() <= depth {
            return;
        }
        let _waiter = RoomWaiter::new(&self.shared);
        loop {
            let room = self.shared.room.notified();
            tokio::pin!(room);
            room.as_mut().enable();
            if self.control_depth() <= depth || self.cancel.is_cancelled() {
                return;
            }
            tokio::select! {
                () = room => {}
                () = self.cancel.cancelled() => return,
            }
        }
    }

    /// Data frames waiting in the queue.
    pub fn depth(&self) -> usize {
        self.data.max_capacity() - self.data.capacity()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lanes(frames: usize, budget: usize, reserve: usize) -> (Outbox, Inbox) {
        outbox(
            frames,
            budget,
            reserve,
            Duration::from_secs(3600),
            &CancellationToken::new(),
        )
    }

    fn frame(len: usize) -> Bytes {
        Bytes::from(vec![0u8; len])
    }

    #[test]
    fn data_over_the_byte_budget_is_full_not_closed_and_fits_again_once_taken() {
        // 1,000 bytes, 400 of them kept for control frames: 600 for data.
        let (out, mut inbox) = lanes(100, 1_000, 400);
        assert_eq!(out.push_data(frame(300)), Pushed::Queued);
        assert_eq!(out.push_data(frame(300)), Pushed::Queued);
        assert_eq!(
            out.push_data(frame(1)),
            Pushed::Full,
            "the frame count has room"
        );
        assert!(!out.is_closed());
        assert_eq!(inbox.queued_bytes(), 600);
        assert_eq!(inbox.try_next().map(|f| f.len()), Some(300));
        assert_eq!(out.push_data(frame(300)), Pushed::Queued);
        // Control frames still have their reserve.
        assert!(out.push(frame(400)));
        assert_eq!(inbox.queued_bytes(), 1_000);
    }

    #[test]
    fn control_over_the_byte_budget_closes_with_slow_consumer() {
        let (out, inbox) = lanes(100, 1_000, 400);
        assert!(out.push(frame(900)));
        assert!(!out.push(frame(200)));
        assert!(out.is_closed());
        let (code, reason) = inbox.close_reason().unwrap();
        assert_eq!(code, CloseCode::SlowConsumer);
        assert!(reason.contains("byte budget"), "{reason}");
        assert_eq!(
            inbox.queued_bytes(),
            900,
            "the refused frame is not counted"
        );
    }

    #[test]
    fn discarding_the_data_lane_frees_its_bytes_and_refuses_more() {
        let (out, mut inbox) = lanes(100, 10_000, 1_000);
        for _ in 0..5 {
            assert_eq!(out.push_data(frame(1_000)), Pushed::Queued);
        }
        assert!(out.push(frame(10)));
        inbox.discard_data();
        assert_eq!(inbox.queued_bytes(), 10, "only the control frame is left");
        assert_eq!(out.push_data(frame(1)), Pushed::Closed);
    }
}
