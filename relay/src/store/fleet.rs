//! What several relay instances sharing one store need from it: presence
//! (which instance holds a peer's session), instance liveness, leases for
//! fleet-wide work, and wake-up messages.
//!
//! A store used by one process only (the memory store) keeps the defaults:
//! no presence records, every lease granted, nothing published. The Redis
//! store implements them (see `redis::fleet`).
//!
//! # Wake channels
//!
//! Each peer has one channel, [`wake_channel`]; the instance holding the
//! peer's session subscribes to it before it sends the `Welcome`. Messages
//! (the first byte is the kind):
//!
//! | kind | rest | meaning |
//! |---|---|---|
//! | `W` | an entry's exact frame bytes | a durable entry of a log this peer receives (published by the store script that appended it) |
//! | `N` | `<d\|u>\|<tail>\|<caller>#<request_id>` | the log has entries up to `tail`: a receiver behind it replays from the store |
//! | `T` | `<generation>\|<session>\|<node>` | the peer's session moved: an instance holding an older generation closes it (`replaced`) |
//! | `P` | `<peer>` | a peer this one may reach came or went: push a fresh `Peers` frame |
//!
//! Never: decides anything about a session: the store records claims, liveness
//! and leases and publishes messages; closing a superseded session and
//! resynchronising are the hub's. A wake message is never the only copy of
//! anything: an entry it carries is in its log first, so a lost message costs a
//! resynchronisation, never data.

use std::future::Future;

use bytes::Bytes;
use oab_wire::{PeerId, SessionId};

use super::StoreError;

/// Prefix of every wake channel.
const WAKE_PREFIX: &str = "oab:wake:";

/// The channel that wakes the instance holding `peer`'s session.
pub fn wake_channel(peer: &PeerId) -> String {
    format!("{WAKE_PREFIX}{peer}")
}

/// The peer whose wake channel `channel` is (`None` for any other name).
pub fn peer_of_channel(channel: &[u8]) -> Option<PeerId> {
    let name = std::str::from_utf8(channel).ok()?;
    PeerId::new(name.strip_prefix(WAKE_PREFIX)?).ok()
}

/// The largest generation a claim hands out or takes as its floor (2^53 - 1:
/// exact in the store's Lua numbers).
pub const MAX_GENERATION: u64 = (1 << 53) - 1;

/// A peer's session as recorded fleet-wide.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Presence {
    /// The instance holding it.
    pub node: String,
    /// That instance's incarnation (its process start); `""` in a record
    /// written by an instance that does not record one.
    pub incarnation: String,
    /// The session (hex).
    pub session: String,
    /// Increases with every claim of this peer, also across a loss of the
    /// store's data: the newest session wins.
    pub generation: u64,
}

/// The relay instances sharing the store, as one liveness renewal saw them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Liveness {
    /// Live instances: name and incarnation (`""` for an instance that does
    /// not record one).
    pub live: Vec<(String, String)>,
    /// Instances that left cleanly within the last lease: name and
    /// incarnation.
    pub left: Vec<(String, String)>,
}

/// Which connection of a connector a session is, for [`FleetStore::claim_presence`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Connection {
    /// The connector process (`Hello.instance`).
    pub instance: oab_wire::InstanceId,
    /// Its clock in the signed `Hello` (ms since the Unix epoch).
    pub hello_ms: u64,
    /// How much earlier than the stored claim's `Hello` a claim of the same
    /// instance may be and still be refused (it bounds how long a connector
    /// whose clock stepped back is turned away).
    pub window_ms: u64,
}

/// Fleet coordination through the store. Defaults are those of a store used
/// by a single relay process.
pub trait FleetStore {
    /// URLs for the wake-channel subscriber; empty when the store is not
    /// shared between processes (then no fleet coordination runs).
    fn wake_urls(&self) -> Vec<String> {
        Vec::new()
    }

    /// Records that `node` (in its process `incarnation`) now holds `peer`'s
    /// session `session`; returns the
    /// claim's generation: strictly increasing per peer, above `floor` (the
    /// highest generation the claiming instance has seen for this peer), and
    /// never below the store's clock in microseconds. A store that lost the
    /// record (a flush, a restart without persistence, a failover that lost
    /// the last writes) therefore still hands out a generation above every
    /// claim made before the loss: the clock has moved on since, and the
    /// floor covers a clock that stepped back.
    ///
    /// `None`, and no change, when the record is a claim of the same
    /// connector process ([`Connection::instance`]) with a later `Hello`, by
    /// at most [`Connection::window_ms`]: `connection` is an attempt the connector gave up
    /// that finished its handshake late, and must not take the peer from the
    /// connection in use (`docs/protocol.md` §7.4). The window bounds how
    /// long a connector whose clock stepped back is refused.
    fn claim_presence(
        &self,
        _peer: &PeerId,
        _node: &str,
        _incarnation: &str,
        _session: SessionId,
        _floor: u64,
        _connection: Connection,
    ) -> impl Future<Output = Result<Option<u64>, StoreError>> + Send {
        async { Ok(Some(0)) }
    }

    /// Removes the presence record if it still names `session`.
    fn release_presence(
        &self,
        _peer: &PeerId,
        _session: SessionId,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        async { Ok(()) }
    }

    /// The presence records of `peers`, in order.
    fn presence(
        &self,
        peers: &[PeerId],
    ) -> impl Future<Output = Result<Vec<Option<Presence>>, StoreError>> + Send {
        let n = peers.len();
        async move { Ok(vec![None; n]) }
    }

    /// Renews the liveness of `node` in its process `incarnation` for
    /// `lease_ms`, and returns every live node (this one included) and the
    /// recent clean departures. Earlier incarnations of `node` are dropped:
    /// their process is gone.
    fn renew_node(
        &self,
        node: &str,
        incarnation: &str,
        _lease_ms: u64,
    ) -> impl Future<Output = Result<Liveness, StoreError>> + Send {
        let me = (node.to_owned(), incarnation.to_owned());
        async move {
            Ok(Liveness {
                live: vec![me],
                left: Vec::new(),
            })
        }
    }

    /// Takes or renews the lease `name` for `node`; `true` while `node`
    /// holds it.
    fn acquire_lease(
        &self,
        _name: &str,
        _node: &str,
        _lease_ms: u64,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send {
        async { Ok(true) }
    }

    /// Gives up the lease `name` if `node` holds it (a clean shutdown: the
    /// next instance takes over at once instead of after the lease).
    fn release_lease(
        &self,
        _name: &str,
        _node: &str,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        async { Ok(()) }
    }

    /// Removes `node` (in its process `incarnation`) from the live
    /// instances, leaving a notice for `lease_ms` that it left cleanly (a
    /// clean shutdown).
    fn retire_node(
        &self,
        _node: &str,
        _incarnation: &str,
        _lease_ms: u64,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        async { Ok(()) }
    }

    /// Publishes messages on the wake channels of the given peers.
    fn publish(
        &self,
        _messages: Vec<(PeerId, Bytes)>,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        async { Ok(()) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wake_channels_name_their_peer_and_nothing_else() {
        let peer = PeerId::new("acme/callee").unwrap_or_else(|_| unreachable!());
        assert_eq!(peer_of_channel(wake_channel(&peer).as_bytes()), Some(peer));
        for other in [
            &b"oab:wake:"[..],
            b"oab:wak:acme/callee",
            b"\xffoab:wake:a/b",
        ] {
            assert_eq!(peer_of_channel(other), None);
        }
    }
}
