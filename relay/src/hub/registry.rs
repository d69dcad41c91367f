//! Who is online here: the session table (one session per peer on this
//! instance), registering and unregistering sessions, the fleet-wide
//! presence claim made before the `Welcome`, and the offline times that
//! start a callee's `unknown` grace period.
//!
//! Never reads or appends a log: a session that ends only drops its
//! subscriptions (and nudges the peer's session elsewhere). Never holds the
//! session table's lock across an await.

use std::sync::Arc;

use bytes::Bytes;
use oab_wire::{CloseCode, PeerId};
use tracing::{info, warn};

use super::wakeups::nudge;
use super::{Hub, SessionRef};
use crate::store::{EventStore, StoreError};

impl<S: EventStore> Hub<S> {
    /// The sessions online here now, in no particular order (`/status`).
    pub fn sessions_here(&self) -> Vec<SessionRef> {
        self.sessions.lock().values().cloned().collect()
    }

    /// Whether a peer holds a session now.
    pub fn is_online(&self, peer: &PeerId) -> bool {
        self.sessions.lock().contains_key(peer)
    }

    /// Records a newly authenticated session; the older session of the same
    /// peer, if any, is closed with `replaced`. Returns `false`, and records
    /// nothing, when the peer's session is a connection of the same
    /// connector process with a later `Hello`: this one is an attempt the
    /// connector gave up while the relay finished its handshake (its
    /// handshakes wait for the store), and replacing the live one would
    /// close the connection in use with `replaced`, which the connector
    /// takes as another process holding its identity.
    pub fn register(self: &Arc<Self>, session: SessionRef) -> bool {
        let old = {
            let mut sessions = self.sessions.lock();
            if let Some(cur) = sessions.get(&session.peer)
                && cur.instance == session.instance
                && cur.hello_ms > session.hello_ms
            {
                info!(
                    peer = %session.peer,
                    session = %session.id,
                    current = %cur.id,
                    "a later connection of this connector is the session: this earlier one is closed"
                );
                return false;
            }
            sessions.insert(session.peer.clone(), session.clone())
        };
        self.offline_since.lock().remove(&session.peer);
        if let Some(old) = old {
            self.metrics.replaced.inc();
            info!(peer = %session.peer, old = %old.id, new = %session.id, "session replaced");
            old.outbox.close(
                CloseCode::Replaced,
                "a newer session of this peer replaced this one",
            );
        } else {
            self.metrics
                .peer_sessions
                .with_label_values(&[session.peer.as_str()])
                .set(1);
        }
        self.metrics.sessions.inc();
        if !self.fleet.enabled {
            self.announce_presence(&session.peer);
        }
        true
    }

    /// Makes a registered session the peer's session fleet-wide: subscribes
    /// its wake channel, claims its presence record, and announces the claim
    /// so an older session of the peer on another instance is closed. Runs
    /// before the `Welcome`. A no-op without a shared store.
    pub async fn claim_presence(self: &Arc<Self>, me: &SessionRef) -> Result<(), StoreError> {
        if !self.fleet.enabled {
            return Ok(());
        }
        // The floor is read before `subscribe` marks the session held.
        let floor = self.fleet.floor(&me.peer);
        self.fleet.subscribe(&me.peer, me.id).await?;
        // A given-up attempt finishes its handshake at most about this long
        // after its Hello (the handshake deadline, plus the store's
        // retries); the window bounds how long a connector whose clock
        // stepped back is refused.
        let connection = crate::store::Connection {
            instance: me.instance,
            hello_ms: me.hello_ms,
            window_ms: self
                .config
                .relay
                .handshake_timeout_ms
                .saturating_mul(2)
                .max(10_000),
        };
        let Some(generation) = self
            .store
            .claim_presence(
                &me.peer,
                &self.fleet.node,
                &self.fleet.incarnation,
                me.id,
                floor,
                connection,
            )
            .await?
        else {
            info!(peer = %me.peer, session = %me.id, "a later connection of this connector holds the peer elsewhere: this earlier one is closed");
            me.outbox.close(
                CloseCode::Superseded,
                "a later connection of this connector is the session",
            );
            return Ok(());
        };
        if !self.fleet.hold(&me.peer, me.id, generation) {
            info!(peer = %me.peer, session = %me.id, "a newer session of this peer holds it elsewhere");
            me.outbox.close(
                CloseCode::Replaced,
                "a newer session of this peer replaced this one",
            );
        }
        let claim = format!("T{generation}|{}|{}", me.id, self.fleet.node);
        self.store
            .publish(vec![(me.peer.clone(), Bytes::from(claim))])
            .await?;
        self.announce_presence(&me.peer);
        Ok(())
    }

    /// Forgets a session that ended and drops its subscriptions.
    pub fn unregister(self: &Arc<Self>, session: &SessionRef) {
        let subscribed = self
            .session_subscriptions
            .lock()
            .remove(&session.id)
            .unwrap_or_default();
        self.gauges
            .subscriptions
            .sub(i64::try_from(subscribed.len()).unwrap_or(i64::MAX));
        self.metrics.sessions.dec();
        let went_offline = {
            let mut sessions = self.sessions.lock();
            if sessions
                .get(&session.peer)
                .is_some_and(|s| s.id == session.id)
            {
                sessions.remove(&session.peer);
                true
            } else {
                false
            }
        };
        let mut nudges = Vec::new();
        for (key, dir) in subscribed {
            let live = self.views.lock().get(&key).cloned();
            if let Some(live) = live {
                let mut l = live.lock();
                let tail = *l.tail_mut(dir);
                let slot = l.sub_mut(dir);
                if slot.as_ref().is_some_and(|s| s.session == session.id) {
                    *slot = None;
                    // Entries delivered only to this session may be what the
                    // peer's new session on another instance replayed just
                    // before: tell it where the log stands.
                    if self.fleet.enabled {
                        nudges.push((session.peer.clone(), nudge(&key, dir, tail)));
                    }
                }
            }
        }
        if went_offline {
            self.metrics
                .peer_sessions
                .with_label_values(&[session.peer.as_str()])
                .set(0);
            self.offline_since
                .lock()
                .insert(session.peer.clone(), oab_wire::identity::now_ms());
        }
        if self.fleet.enabled {
            let released = went_offline && self.fleet.release(&session.peer, session.id);
            let hub = self.clone();
            let (peer, id) = (session.peer.clone(), session.id);
            self.tasks.spawn(async move {
                if !nudges.is_empty() {
                    let _ = hub.store.publish(nudges).await;
                }
                if released {
                    if let Err(e) = hub.store.release_presence(&peer, id).await {
                        warn!(error = %e, %peer, "could not release the presence record");
                    }
                    hub.announce_presence(&peer);
                    // Stop taking the peer's wake-ups at once (they would be
                    // dropped here anyway), unless it came back meanwhile.
                    hub.fleet.prune_subscriptions().await;
                }
            });
        } else if went_offline {
            self.announce_presence(&session.peer);
        }
    }

    /// Whether `peer`'s session is held by another live instance (`None`
    /// when the store could not say).
    pub(super) async fn online_elsewhere(&self, peer: &PeerId) -> Option<bool> {
        let presence = self.store.presence(std::slice::from_ref(peer)).await.ok()?;
        Some(
            presence
                .into_iter()
                .next()
                .flatten()
                .is_some_and(|p| self.fleet.node_alive(&p.node, &p.incarnation)),
        )
    }
}
