//! The bounded queue towards one session, and the handle that closes it.
//!
//! Overflow policy: a live frame that does not fit closes the session with
//! `slow_consumer` (4001). Nothing is lost by that: every frame is in the
//! durable log and the peer resumes from its cursor after reconnecting.
//! Replays use the awaiting [`Outbox::send`] instead, so a replay is paced by
//! the receiver rather than disconnecting it.

use std::sync::{Arc, Mutex};

use bytes::Bytes;
use oab_wire::CloseCode;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// The sending side of a session's queue, plus its close control. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Outbox {
    tx: mpsc::Sender<Bytes>,
    cancel: CancellationToken,
    reason: Arc<Mutex<Option<(CloseCode, String)>>>,
}

/// The receiving side, owned by the session task.
#[derive(Debug)]
pub struct Inbox {
    /// Frames to write.
    pub rx: mpsc::Receiver<Bytes>,
    /// Cancelled when someone closes the session.
    pub cancel: CancellationToken,
    reason: Arc<Mutex<Option<(CloseCode, String)>>>,
}

impl Inbox {
    /// Why the session was closed, if someone closed it.
    pub fn close_reason(&self) -> Option<(CloseCode, String)> {
        self.reason
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

/// A queue of `capacity` frames; `parent` cancels it (relay shutdown).
pub fn outbox(capacity: usize, parent: &CancellationToken) -> (Outbox, Inbox) {
    let (tx, rx) = mpsc::channel(capacity.max(1));
    let cancel = parent.child_token();
    let reason = Arc::new(Mutex::new(None));
    (
        Outbox {
            tx,
            cancel: cancel.clone(),
            reason: reason.clone(),
        },
        Inbox { rx, cancel, reason },
    )
}

impl Outbox {
    /// Queues a frame without waiting. On overflow the session is closed with
    /// `slow_consumer` and `false` is returned.
    pub fn push(&self, frame: Bytes) -> bool {
        match self.tx.try_send(frame) {
            Ok(()) => true,
            Err(mpsc::error::TrySendError::Full(_)) => {
                self.close(
                    CloseCode::SlowConsumer,
                    "send queue full; reconnect and resume",
                );
                false
            }
            Err(mpsc::error::TrySendError::Closed(_)) => false,
        }
    }

    /// Queues a frame, waiting for room. `false` once the session is gone.
    pub async fn send(&self, frame: Bytes) -> bool {
        tokio::select! {
            r = self.tx.send(frame) => r.is_ok(),
            () = self.cancel.cancelled() => false,
        }
    }

    /// Closes the session with a code and reason (first reason wins).
    pub fn close(&self, code: CloseCode, reason: &str) {
        {
            let mut slot = self.reason.lock().unwrap_or_else(|p| p.into_inner());
            if slot.is_none() {
                *slot = Some((code, reason.to_string()));
            }
        }
        self.cancel.cancel();
    }

    /// Whether the session was closed.
    pub fn is_closed(&self) -> bool {
        self.cancel.is_cancelled() || self.tx.is_closed()
    }

    /// Frames waiting in the queue.
    pub fn depth(&self) -> usize {
        self.tx.max_capacity() - self.tx.capacity()
    }
}
