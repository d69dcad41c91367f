//! The `Peers` frame: every peer a peer may reach, whether it is online
//! (here or on a live instance) and its published descriptor, and a fresh
//! frame pushed to the callers of a peer whose presence changed.
//!
//! Never touches delegations. A presence or descriptor the store cannot
//! give degrades to offline or no descriptor, never to an error.

use std::sync::Arc;

use bytes::Bytes;
use oab_wire::{Frame, PeerEntry, PeerId, encode};
use tracing::warn;

use super::Hub;
use crate::store::EventStore;

impl<S: EventStore> Hub<S> {
    /// The `Peers` payload for `peer`: every peer it may reach, its online
    /// state and its published descriptor.
    pub async fn peers_payload(&self, peer: &PeerId) -> Bytes {
        let targets: Vec<PeerId> = self.directory.reachable_from(peer).into_iter().collect();
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
        Bytes::from(serde_json::to_vec(&entries).unwrap_or_default())
    }

    /// Pushes a fresh `Peers` frame to every online peer that may reach
    /// `peer` (fleet-wide: through their wake channels).
    pub fn announce_presence(self: &Arc<Self>, peer: &PeerId) {
        let hub = self.clone();
        let peer = peer.clone();
        self.tasks.spawn(async move {
            if hub.fleet.enabled {
                let msg = Bytes::from(format!("P{peer}"));
                let messages = hub
                    .directory
                    .callers_of(&peer)
                    .into_iter()
                    .map(|c| (c, msg.clone()))
                    .collect::<Vec<_>>();
                if let Err(e) = hub.store.publish(messages).await {
                    warn!(error = %e, %peer, "could not announce presence");
                }
                return;
            }
            for caller in hub.directory.callers_of(&peer) {
                hub.push_peers(&caller).await;
            }
        });
    }

    /// Sends `peer` a fresh `Peers` frame if its session is here.
    pub(super) async fn push_peers(&self, peer: &PeerId) {
        let session = self.sessions.lock().get(peer).cloned();
        if let Some(s) = session {
            let payload = self.peers_payload(peer).await;
            if let Ok(bytes) = encode(&Frame::Peers(payload)) {
                s.outbox.push(bytes);
            }
        }
    }
}
