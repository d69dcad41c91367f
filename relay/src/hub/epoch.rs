//! The store epoch: a new epoch means the store lost its data. The hub then
//! drops every cached view and closes every session so connectors
//! re-handshake and reconcile, and names `epoch_changed` as the reason for
//! delegations the store no longer has.
//!
//! Never tries to repair the store's data; only reports the loss.

use std::sync::atomic::Ordering;

use oab_wire::{CloseCode, GapReason};
use tracing::warn;

use super::{Hub, SessionRef};
use crate::store::EventStore;

impl<S: EventStore> Hub<S> {
    /// The store epoch last seen.
    pub fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Relaxed)
    }

    /// Re-reads the store epoch; on a change, marks the loss and closes every
    /// session so connectors re-handshake and see the new epoch.
    pub async fn check_epoch(&self) {
        let Ok(now) = self.store.epoch().await else {
            return;
        };
        let old = self.epoch.swap(now, Ordering::Relaxed);
        if old != now {
            warn!(
                old,
                new = now,
                "store epoch changed: the store lost its data"
            );
            self.epoch_changed.store(true, Ordering::Relaxed);
            for (_, l) in self.views.lock().drain() {
                l.lock().evicted = true;
            }
            self.gauges.count_views(0);
            let sessions: Vec<SessionRef> = self.sessions.lock().values().cloned().collect();
            for s in sessions {
                s.outbox.close(
                    CloseCode::StoreUnavailable,
                    "the relay's store lost data; reconnect and reconcile",
                );
            }
        }
    }

    /// The reason to give for a delegation the store does not have.
    pub fn missing_reason(&self) -> GapReason {
        if self.epoch_changed.load(Ordering::Relaxed) {
            GapReason::EpochChanged
        } else {
            GapReason::Unknown
        }
    }
}
