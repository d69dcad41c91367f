//! The `Peers` frame: every peer a peer may reach, whether it is online
//! (here or on a live instance) and its published descriptor, and a fresh
//! frame pushed to the callers of a peer whose presence changed.
//!
//! **Coalescing.** A session has at most one `Peers` snapshot waiting in
//! its queue. A change (a publish, a session coming or going) or a
//! `PeersQuery` while one waits is remembered, and once the session's writer
//! took the waiting snapshot one newer snapshot is sent for all of them: a
//! burst of publishes, or a peer that queries and never reads, costs one
//! snapshot in the queue, not one per event.
//!
//! Never touches delegations. A presence or descriptor the store cannot
//! give degrades to offline or no descriptor, never to an error.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use bytes::Bytes;
use oab_wire::{Frame, PeerEntry, PeerId, encode};
use tokio::sync::Notify;
use tracing::warn;

use super::Hub;
use crate::store::EventStore;

/// Cost of a `PeersQuery` or a `Publish` on the peer's request meter
/// (`rate.peer_requests_per_second`): each reads (or writes) the store once
/// per reachable peer and sends a `Peers` snapshot of up to
/// `limits.max_descriptor` bytes per reachable peer to each receiver.
pub const PEERS_REQUEST_COST: u32 = 10;

/// Cost of a `Resume` on the peer's request meter: one meta read and a
/// replay from the store.
pub const RESUME_COST: u32 = 1;

/// The `Peers` snapshots owed to one peer's session here. One per
/// configured peer that ever got a snapshot (bounded by the directory),
/// kept for the life of the relay.
#[derive(Debug, Default)]
pub(super) struct PeersPush {
    /// A task sends this peer's snapshots now.
    running: bool,
    /// Something changed, or the peer asked, after the running task read
    /// the snapshot: it sends one more.
    again: bool,
    /// The snapshot waiting in the session's queue, if any.
    waiting: Arc<WaitingSnapshot>,
}

/// Whether a peer's `Peers` snapshot waits in its session's queue.
#[derive(Debug, Default)]
pub(super) struct WaitingSnapshot {
    waiting: AtomicBool,
    taken: Notify,
}

/// The bytes of a queued snapshot. Dropped when the session's writer took
/// the frame, or with the queue when the session ends: either way the
/// snapshot no longer waits.
struct SnapshotBytes {
    frame: Bytes,
    waiting: Arc<WaitingSnapshot>,
}

impl AsRef<[u8]> for SnapshotBytes {
    fn as_ref(&self) -> &[u8] {
        &self.frame
    }
}

impl Drop for SnapshotBytes {
    fn drop(&mut self) {
        self.waiting.waiting.store(false, Ordering::Release);
        self.waiting.taken.notify_waiters();
    }
}

impl WaitingSnapshot {
    /// Returns once no snapshot waits (or at shutdown: `false`).
    async fn taken(&self, shutdown: &tokio_util::sync::CancellationToken) -> bool {
        loop {
            let taken = self.taken.notified();
            tokio::pin!(taken);
            taken.as_mut().enable();
            if !self.waiting.load(Ordering::Acquire) {
                return true;
            }
            tokio::select! {
                () = taken => {}
                () = shutdown.cancelled() => return false,
            }
        }
    }
}

impl PeersPush {
    /// Whether a task sends this peer's snapshots now.
    pub(super) fn is_running(&self) -> bool {
        self.running
    }
}

impl<S: EventStore> Hub<S> {
    /// The `Peers` payload for `peer`: every peer it may reach, its online
    /// state and its published descriptor, within `limits.max_payload`
    /// bytes (over it the largest descriptors are left out first).
    pub async fn peers_payload(&self, peer: &PeerId) -> Bytes {
        let targets: Vec<PeerId> = self.live().directory.reachable_from(peer);
        let elsewhere: Vec<bool> = if self.fleet.enabled {
            match self.store.presence(&targets).await {
                Ok(p) => p
                    .iter()
                    .map(|p| {
                        p.as_ref()
                            .is_some_and(|p| self.fleet.node_alive(&p.node, &p.incarnation))
                    })
                    .collect(),
                Err(_) => vec![false; targets.len()],
            }
        } else {
            vec![false; targets.len()]
        };
        let mut entries = Vec::new();
        for (target, elsewhere) in targets.into_iter().zip(elsewhere) {
            let descriptor = self
                .store
                .descriptor(&target)
                .await
                .ok()
                .flatten()
                .and_then(|b| serde_json::from_slice(&b).ok());
            entries.push(PeerEntry {
                online: elsewhere || self.is_online(&target),
                peer: target,
                descriptor,
            });
        }
        Bytes::from(bounded_peers_payload(
            entries,
            self.config.limits.max_payload as usize,
        ))
    }

    /// Pushes a fresh `Peers` frame to every online peer that may reach
    /// `peer` (fleet-wide: through their wake channels).
    pub fn announce_presence(self: &Arc<Self>, peer: &PeerId) {
        if !self.fleet.enabled {
            for caller in self.live().directory.callers_of(peer) {
                self.send_peers(&caller);
            }
            return;
        }
        let hub = self.clone();
        let peer = peer.clone();
        self.tasks.spawn(async move {
            let msg = Bytes::from(format!("P{peer}"));
            let messages = hub
                .live()
                .directory
                .callers_of(&peer)
                .into_iter()
                .map(|c| (c, msg.clone()))
                .collect::<Vec<_>>();
            if let Err(e) = hub.store.publish(messages).await {
                warn!(error = %e, %peer, "could not announce presence");
            }
        });
    }

    /// Sends `peer` a fresh `Peers` frame if its session is here: at once
    /// when none of its snapshots waits in its queue, otherwise once the
    /// waiting one is taken, as one snapshot for every change and query
    /// that came meanwhile (see the module comment).
    pub fn send_peers(self: &Arc<Self>, peer: &PeerId) {
        let waiting = {
            let mut pushes = self.peers_pushes.lock();
            let push = pushes.entry(peer.clone()).or_default();
            if push.running {
                push.again = true;
                return;
            }
            push.running = true;
            push.waiting.clone()
        };
        let hub = self.clone();
        let peer = peer.clone();
        self.tasks
            .spawn(async move { hub.push_peers(peer, waiting).await });
    }

    /// The task behind [`Self::send_peers`]: one snapshot at a time, each
    /// after the previous one left the session's queue.
    async fn push_peers(self: Arc<Self>, peer: PeerId, waiting: Arc<WaitingSnapshot>) {
        loop {
            let live = waiting.taken(&self.shutdown).await;
            if let Some(push) = self.peers_pushes.lock().get_mut(&peer) {
                push.again = false;
            }
            let session = self.sessions.lock().get(&peer).cloned();
            if let Some(s) = session.filter(|_| live) {
                let payload = self.peers_payload(&peer).await;
                if let Ok(frame) = encode(&Frame::Peers(payload)) {
                    waiting.waiting.store(true, Ordering::Release);
                    let frame = Bytes::from_owner(SnapshotBytes {
                        frame,
                        waiting: waiting.clone(),
                    });
                    // A full control lane closes the session (its policy);
                    // the dropped frame then no longer waits.
                    s.outbox.push(frame);
                }
            }
            let mut pushes = self.peers_pushes.lock();
            let Some(push) = pushes.get_mut(&peer) else {
                return;
            };
            if !push.again || !live {
                push.running = false;
                return;
            }
        }
    }
}

/// The JSON of `entries` in at most `max` bytes, so a `Peers` frame always
/// fits the payload limit the relay announces and the session's write
/// buffer. Over it, the largest descriptors are left out first (their
/// entries stay, without a descriptor: the peer is still listed with its
/// online state); entries are dropped from the end only if the list without
/// descriptors is still too long.
fn bounded_peers_payload(mut entries: Vec<PeerEntry>, max: usize) -> Vec<u8> {
    let mut payload = serde_json::to_vec(&entries).unwrap_or_default();
    if payload.len() <= max {
        return payload;
    }
    let listed = entries.len();
    let mut sizes: Vec<(usize, usize)> = entries
        .iter()
        .enumerate()
        .filter_map(|(i, e)| {
            let d = e.descriptor.as_ref()?;
            Some((serde_json::to_vec(d).map_or(0, |v| v.len()), i))
        })
        .collect();
    sizes.sort_unstable_by(|a, b| b.cmp(a));
    let mut over = payload.len() - max;
    let mut left_out = 0usize;
    for (size, i) in sizes {
        if over == 0 {
            break;
        }
        if let Some(e) = entries.get_mut(i) {
            e.descriptor = None;
            left_out += 1;
        }
        // The descriptor and its `,"descriptor":` go.
        over = over.saturating_sub(size + 14);
    }
    payload = serde_json::to_vec(&entries).unwrap_or_default();
    while payload.len() > max && !entries.is_empty() {
        let keep = (entries.len() * max / payload.len()).min(entries.len() - 1);
        entries.truncate(keep);
        payload = serde_json::to_vec(&entries).unwrap_or_default();
    }
    warn!(
        listed,
        kept = entries.len(),
        descriptors_left_out = left_out,
        max,
        "peer list over the payload limit; descriptors left out"
    );
    payload
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(name: &str, descriptor_len: usize) -> PeerEntry {
        PeerEntry {
            peer: PeerId::new(name).unwrap(),
            online: true,
            descriptor: (descriptor_len > 0)
                .then(|| serde_json::json!({ "card": "x".repeat(descriptor_len) })),
        }
    }

    #[test]
    fn a_peer_list_over_the_limit_leaves_out_the_largest_descriptors_first() {
        let entries = vec![
            entry("acme/a", 100),
            entry("acme/b", 5_000),
            entry("acme/c", 200),
        ];
        let out = bounded_peers_payload(entries, 2_000);
        assert!(out.len() <= 2_000);
        let back: Vec<PeerEntry> = serde_json::from_slice(&out).unwrap();
        assert_eq!(back.len(), 3, "every peer is still listed");
        assert!(back[1].descriptor.is_none());
        assert!(back[0].descriptor.is_some() && back[2].descriptor.is_some());
    }

    #[test]
    fn a_list_too_long_even_without_descriptors_is_cut_to_the_limit() {
        let entries: Vec<PeerEntry> = (0..1_000)
            .map(|i| entry(&format!("acme/p{i}"), 0))
            .collect();
        let out = bounded_peers_payload(entries, 4_096);
        assert!(out.len() <= 4_096);
        let back: Vec<PeerEntry> = serde_json::from_slice(&out).unwrap();
        assert!(!back.is_empty() && back.len() < 1_000);
    }

    #[test]
    fn a_list_within_the_limit_is_unchanged() {
        let entries = vec![entry("acme/a", 100)];
        let whole = serde_json::to_vec(&entries).unwrap();
        assert_eq!(bounded_peers_payload(entries, 1 << 20), whole);
    }
}
