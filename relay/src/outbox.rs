//! The bounded queues towards one session, and the handle that closes it.
//!
//! Two lanes, both bounded, drained control first:
//!
//! - **control** (acks, errors, gaps, pongs, peer lists; capacity
//!   [`CONTROL_CAPACITY`]): small frames the session must not lose. Overflow
//!   means the peer reads nothing at all: the session is closed with
//!   `slow_consumer` (4001).
//! - **data** (delegation frames; capacity `limits.session_queue`): a live
//!   frame that does not fit is **not** dropped and does not close the
//!   session: the subscription falls back to replaying from the durable log,
//!   paced by the receiver ([`Outbox::send_data`] waits for room). Only a
//!   receiver that took nothing off a full queue for `stall` is closed with
//!   `slow_consumer`; it resumes from its cursor after reconnecting, and
//!   nothing is lost because every frame is in the log.
//!
//! Never: blocks a live pusher: `Outbox::push` and `Outbox::push_data` only
//! `try_send`, so the hub can call them under a view's lock; a full control
//! lane closes the session, a full data lane answers `Pushed::Full` and the hub
//! replays instead. Only a replay waits for room (`Outbox::send_data`), and it
//! gives up once the writer took nothing off the data lane for `stall`.

use parking_lot::Mutex;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use oab_wire::CloseCode;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// Capacity of the control lane: acks are cumulative and at most one per
/// log per batch, so a peer that keeps reading never comes close.
pub const CONTROL_CAPACITY: usize = 512;

#[derive(Debug)]
struct Shared {
    reason: Mutex<Option<(CloseCode, String)>>,
    /// When the writer last took a frame off the data lane (ms since `epoch`).
    last_take_ms: AtomicU64,
    epoch: Instant,
    stall: Duration,
}

impl Shared {
    fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
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

/// The receiving side, owned by the session task.
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
        if let Ok(f) = self.control.try_recv() {
            return Some(f);
        }
        let f = self.data.try_recv().ok()?;
        self.taken();
        Some(f)
    }

    /// Records that the writer took a data frame (progress).
    pub fn taken(&self) {
        self.shared
            .last_take_ms
            .store(self.shared.now_ms(), Ordering::Relaxed);
    }
}

/// Queues of `data_capacity` data frames and [`CONTROL_CAPACITY`] control
/// frames; `parent` cancels them (relay shutdown); a full data lane with no
/// progress for `stall` closes the session.
pub fn outbox(
    data_capacity: usize,
    stall: Duration,
    parent: &CancellationToken,
) -> (Outbox, Inbox) {
    let (ctx, crx) = mpsc::channel(CONTROL_CAPACITY);
    let (dtx, drx) = mpsc::channel(data_capacity.max(1));
    let cancel = parent.child_token();
    let shared = Arc::new(Shared {
        reason: Mutex::new(None),
        last_take_ms: AtomicU64::new(0),
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

impl Outbox {
    /// Queues a control frame without waiting. On overflow the session is
    /// closed with `slow_consumer` and `false` is returned.
    pub fn push(&self, frame: Bytes) -> bool {
        match self.control.try_send(frame) {
            Ok(()) => true,
            Err(mpsc::error::TrySendError::Full(_)) => {
                self.close(
                    CloseCode::SlowConsumer,
                    "control queue full; reconnect and resume",
                );
                false
            }
            Err(mpsc::error::TrySendError::Closed(_)) => false,
        }
    }

    /// Queues a live data frame without waiting (see the module doc for the
    /// overflow policy).
    pub fn push_data(&self, frame: Bytes) -> Pushed {
        match self.data.try_send(frame) {
            Ok(()) => Pushed::Queued,
            Err(mpsc::error::TrySendError::Full(_)) => {
                if self.stalled() {
                    self.close(
                        CloseCode::SlowConsumer,
                        "send queue full and not draining; reconnect and resume",
                    );
                    Pushed::Closed
                } else {
                    Pushed::Full
                }
            }
            Err(mpsc::error::TrySendError::Closed(_)) => Pushed::Closed,
        }
    }

    /// Queues a data frame, waiting for room (replays). `false` once the
    /// session is gone, or when it drained nothing for `stall` (then it is
    /// closed with `slow_consumer`).
    pub async fn send_data(&self, frame: Bytes) -> bool {
        loop {
            tokio::select! {
                r = self.data.reserve() => {
                    return match r {
                        Ok(permit) => {
                            permit.send(frame);
                            true
                        }
                        Err(_) => false,
                    };
                }
                () = self.cancel.cancelled() => return false,
                () = tokio::time::sleep(self.shared.stall) => {
                    if self.stalled() {
                        self.close(
                            CloseCode::SlowConsumer,
                            "send queue full and not draining; reconnect and resume",
                        );
                        return false;
                    }
                }
            }
        }
    }

    /// Whether the writer took nothing off the data lane for `stall`.
    fn stalled(&self) -> bool {
        let idle = self
            .shared
            .now_ms()
            .saturating_sub(self.shared.last_take_ms.load(Ordering::Relaxed));
        u128::from(idle) >= self.shared.stall.as_millis()
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

    /// Whether the session was closed.
    pub fn is_closed(&self) -> bool {
        self.cancel.is_cancelled() || self.data.is_closed()
    }

    /// Data frames waiting in the queue.
    pub fn depth(&self) -> usize {
        self.data.max_capacity() - self.data.capacity()
    }
}
