//! Installing a reloaded configuration (`crate::reload`): the swap, the
//! offline times of added peers, and the sessions a reload revokes.
//!
//! A session is revoked when its peer is no longer configured, or the key it
//! authenticated with is no longer listed or is outside its validity window:
//! it is closed with `revoked` (4508). Sessions of other peers stay up.
//! Delegations already open stay open, whatever the reload did to their
//! route or their parties: they run to their terminal (or their deadline, or
//! `unknown` after the grace period); a removed route refuses new opens only.
//!
//! Never: holds a lock across an await or while closing a session.

use std::sync::Arc;

use oab_wire::identity::{KeyWindow, TrustStore as _};
use oab_wire::{CloseCode, PeerId};
use tracing::info;

use super::{Hub, SessionRef};
use crate::config::Directory;
use crate::live::{Installed, LiveConfig};
use crate::store::EventStore;

/// Why `session` may no longer stay up under `directory` (`None`: it may).
fn revocation(directory: &Directory, session: &SessionRef, now_ms: u64) -> Option<&'static str> {
    let Some(keys) = directory.peer_keys(&session.peer) else {
        return Some("this peer was removed from the relay's configuration");
    };
    match keys.iter().find(|k| k.key_id == session.key_id) {
        None => Some("the key this session authenticated with was retired"),
        Some(k) if k.window(now_ms) != KeyWindow::Valid => {
            Some("the key this session authenticated with is outside its validity window")
        }
        Some(_) => None,
    }
}

impl<S: EventStore> Hub<S> {
    /// The configuration in force (peers, keys, routes, reloadable limits,
    /// TLS). Load it once per handshake, open or request.
    pub fn live(&self) -> Arc<LiveConfig> {
        self.live.load_full()
    }

    /// Swaps in a reloaded configuration and closes the sessions it revokes
    /// (removed peers, retired keys) with `revoked`; every online peer here
    /// gets a fresh `Peers` snapshot when the routes changed.
    pub fn install(self: &Arc<Self>, live: LiveConfig) -> Installed {
        let live = Arc::new(live);
        let old = self.live.swap(live.clone());
        let (new_dir, old_dir) = (&live.directory, &old.directory);
        let peers_added: Vec<PeerId> = new_dir
            .peers
            .iter()
            .filter(|p| !old_dir.is_peer(p))
            .cloned()
            .collect();
        let peers_removed: Vec<PeerId> = old_dir
            .peers
            .iter()
            .filter(|p| !new_dir.is_peer(p))
            .cloned()
            .collect();
        let now = oab_wire::identity::now_ms();
        for p in &peers_added {
            self.metrics
                .peer_sessions
                .with_label_values(&[p.as_str()])
                .set(0);
            // Offline since the reload, as peers configured at start are
            // offline since the start. (Removed peers keep theirs: their
            // open delegations as callee still end `unknown` after the grace.)
            let mut off = self.offline_since.lock();
            if !self.is_online(p) {
                off.entry(p.clone()).or_insert(now);
            }
        }
        let revoked: Vec<(SessionRef, &'static str)> = self
            .sessions
            .lock()
            .values()
            .filter_map(|s| revocation(new_dir, s, now).map(|why| (s.clone(), why)))
            .collect();
        for (s, why) in &revoked {
            info!(peer = %s.peer, session = %s.id, key = %s.key_id, reason = why, "session revoked by a configuration reload");
            s.outbox.close(CloseCode::Revoked, why);
        }
        // Snapshots owed to removed peers are not needed any more (bounds
        // `peers_pushes` by the configured peers).
        self.peers_pushes
            .lock()
            .retain(|p, push| new_dir.is_peer(p) || push.is_running());
        let routes_changed = {
            let (mut a, mut b) = (new_dir.route_list(), old_dir.route_list());
            a.sort();
            b.sort();
            a != b
        };
        if routes_changed {
            let online: Vec<PeerId> = self.sessions.lock().keys().cloned().collect();
            for peer in online.iter().filter(|p| new_dir.is_peer(p)) {
                self.send_peers(peer);
            }
        }
        Installed {
            peers_added,
            peers_removed,
            sessions_closed: revoked.len(),
        }
    }

    /// Closes `session` with `revoked` if the configuration in force no
    /// longer admits it: a handshake that verified against the previous
    /// configuration while a reload was being installed checks again once
    /// registered, so no session escapes a reload.
    pub fn close_if_revoked(&self, session: &SessionRef) {
        let live = self.live.load();
        if let Some(why) = revocation(&live.directory, session, oab_wire::identity::now_ms()) {
            info!(peer = %session.peer, session = %session.id, reason = why, "session revoked by a configuration reload");
            session.outbox.close(CloseCode::Revoked, why);
        }
    }
}
