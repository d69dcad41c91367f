//! Callers' releases of finished delegations. A caller that has processed
//! a delegation's terminal says so with a `Resume` of the up log after the
//! terminal's sequence (protocol §8.10): there is nothing left to send it,
//! so the relay compacts the delegation in the store instead of
//! subscribing ([`crate::store::EventStore::release`]): both logs go, the
//! meta record stays for the rest of the retention.
//!
//! The session recognises a release from the delegation's view without
//! awaiting ([`Hub::take_release`]) and queues it; one task per instance
//! ([`Hub::run_releases`]) hands the queue to the store in batches of
//! [`RELEASE_BATCH`], so a busy caller's releases share round trips and
//! never hold its session's loop.
//!
//! **Overflow policy:** the queue holds at most `store.release_queue`
//! ([`DEFAULT_RELEASE_QUEUE`] unless configured);
//! a release past it, or in a batch the store failed, is dropped and
//! counted (`oab_releases_total{result="dropped"}`): the delegation is then
//! kept whole until `finished_ttl_ms`, as if never released. Nothing a
//! peer can read changes.

use std::collections::VecDeque;
use std::sync::Arc;

use oab_wire::{DelegationKey, Direction, PeerId};
use parking_lot::Mutex;
use tokio::sync::Notify;
use tracing::debug;

use super::Hub;
use super::views::{DelegationView, ViewRef};
use crate::store::{EventStore, Release};

pub use crate::config::DEFAULT_RELEASE_QUEUE;

/// Releases per store call.
pub const RELEASE_BATCH: usize = 256;

/// The queue of releases waiting for the store.
#[derive(Debug, Default)]
pub(super) struct Releases {
    pending: Mutex<VecDeque<Release>>,
    wake: Notify,
}

/// The release `view` makes of a `Resume(dir, after)` from `peer`: the
/// caller resuming the up log of a finished delegation after its tail.
pub(super) fn release_of(
    view: &DelegationView,
    key: &DelegationKey,
    peer: &PeerId,
    dir: Direction,
    after: u64,
) -> Option<Release> {
    (dir == Direction::Up
        && &view.caller == peer
        && view.terminal.is_some()
        && view.tails[1] == after
        && !view.evicted)
        .then(|| Release {
            key: key.clone(),
            callee: view.callee.clone(),
            after,
        })
}

impl<S: EventStore> Hub<S> {
    /// Whether `peer`'s `Resume(key, dir, after)` is a release, judged from
    /// the cached view only (a delegation whose view is not cached here is
    /// resumed as usual, and [`Hub::release_with`] takes it then). Queues
    /// it when it is.
    pub fn take_release(
        &self,
        key: &DelegationKey,
        peer: &PeerId,
        dir: Direction,
        after: u64,
    ) -> bool {
        if dir != Direction::Up || &key.caller != peer {
            return false;
        }
        let Some(view) = self.views.lock().get(key).cloned() else {
            return false;
        };
        self.release_with(&view, key, peer, dir, after)
    }

    /// [`Hub::take_release`] with a view in hand (one just loaded from
    /// the store).
    pub fn release_with(
        &self,
        view: &ViewRef,
        key: &DelegationKey,
        peer: &PeerId,
        dir: Direction,
        after: u64,
    ) -> bool {
        let release = release_of(&view.lock(), key, peer, dir, after);
        match release {
            Some(r) => {
                self.queue_release(r);
                true
            }
            None => false,
        }
    }

    /// Queues a release for the store (dropped and counted when the queue
    /// is full).
    pub(super) fn queue_release(&self, release: Release) {
        let mut pending = self.releases.pending.lock();
        if pending.len() >= self.config.store.release_queue {
            drop(pending);
            self.metrics.releases.with_label_values(&["dropped"]).inc();
            return;
        }
        pending.push_back(release);
        drop(pending);
        self.releases.wake.notify_one();
    }

    /// Hands queued releases to the store until shutdown, a batch at a
    /// time (what queues during a store call goes in the next one).
    pub async fn run_releases(self: Arc<Self>) {
        loop {
            tokio::select! {
                () = self.shutdown.cancelled() => return,
                () = self.releases.wake.notified() => {}
            }
            loop {
                let batch: Vec<Release> = {
                    let mut pending = self.releases.pending.lock();
                    let n = pending.len().min(RELEASE_BATCH);
                    pending.drain(..n).collect()
                };
                if batch.is_empty() {
                    break;
                }
                let n = batch.len() as u64;
                let started = std::time::Instant::now();
                let result = self.store.release(batch).await;
                self.observe_store("release", started, &result);
                let m = &self.metrics.releases;
                match result {
                    Ok(compacted) => {
                        m.with_label_values(&["compacted"]).inc_by(compacted);
                        m.with_label_values(&["ignored"])
                            .inc_by(n.saturating_sub(compacted));
                    }
                    Err(e) => {
                        debug!(error = %e, releases = n, "store unavailable; releases dropped");
                        m.with_label_values(&["dropped"]).inc_by(n);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use oab_testkit::redis::{Persistence, RedisServer};
    use oab_wire::RequestId;

    use super::super::test_support::{CALLEE, CALLER, peer, redis_hub};
    use super::*;

    /// The queue holds `store.release_queue` releases; one more is dropped
    /// and counted, and nothing already queued is lost.
    #[tokio::test]
    async fn a_release_past_the_queue_is_dropped_and_counted() {
        let redis = RedisServer::start(Persistence::None).unwrap();
        let hub = redis_hub(&redis).await;
        let bound = hub.config.store.release_queue;
        let release = |i: usize| Release {
            key: DelegationKey::new(peer(CALLER), RequestId::new(&format!("r{i}")).unwrap()),
            callee: peer(CALLEE),
            after: 1,
        };
        for i in 0..=bound {
            hub.queue_release(release(i));
        }
        let dropped = hub.metrics.releases.with_label_values(&["dropped"]).get();
        assert_eq!(dropped, 1);
        let pending = hub.releases.pending.lock();
        assert_eq!(pending.len(), bound);
        assert_eq!(pending.front(), Some(&release(0)));
        assert_eq!(pending.back(), Some(&release(bound - 1)));
    }
}
