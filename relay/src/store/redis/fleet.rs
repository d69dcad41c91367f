//! Fleet coordination on the Redis store (see [`crate::store::fleet`]):
//! the [`FleetStore`] implementation of [`RedisStore`], presence claims,
//! node liveness, leases and wake-up publishing. Key names are in
//! [`super::keys`], the scripts in [`super::scripts`]. It never writes a
//! delegation's keys.
//!
//! Every command touches one key, or `oab:nodes` with its incarnations (one
//! hash slot: the tag `{oab:nodes}` hashes like the key `oab:nodes`), so all
//! of it works on Redis Cluster; the
//! wake channels are classic pub/sub, which a cluster broadcasts to all
//! nodes. Times come from Redis's own clock (`TIME`), so the instances'
//! clocks need not agree.

use bytes::Bytes;
use oab_wire::{PeerId, SessionId};
use redis::{Script, Value};

use super::RedisStore;
use super::keys::{INCARNATIONS_KEY, NODES_KEY, presence_key};
use super::replies::{liveness, reply_text, reply_u64};
use super::scripts::fleet_scripts;
use crate::store::StoreError;
use crate::store::fleet::{FleetStore, Liveness, Presence, wake_channel};

fn evalsha_one_key(script: &Script, key: &str) -> redis::Cmd {
    let mut c = redis::cmd("EVALSHA");
    c.arg(script.get_hash()).arg(1).arg(key);
    c
}

/// `EVALSHA` over the liveness keys (one hash slot).
fn evalsha_nodes(script: &Script) -> redis::Cmd {
    let mut c = redis::cmd("EVALSHA");
    c.arg(script.get_hash())
        .arg(2)
        .arg(NODES_KEY)
        .arg(INCARNATIONS_KEY);
    c
}

impl FleetStore for RedisStore {
    fn wake_urls(&self) -> Vec<String> {
        self.pubsub_urls()
    }

    async fn claim_presence(
        &self,
        peer: &PeerId,
        node: &str,
        incarnation: &str,
        session: SessionId,
        floor: u64,
        connection: crate::store::fleet::Connection,
    ) -> Result<Option<u64>, StoreError> {
        let s = &fleet_scripts().claim;
        let mut cmd = evalsha_one_key(s, &presence_key(peer));
        cmd.arg(node)
            .arg(session.to_string())
            .arg(floor.min(crate::store::fleet::MAX_GENERATION))
            .arg(incarnation)
            .arg(connection.instance.to_hex())
            .arg(connection.hello_ms.min(crate::store::fleet::MAX_GENERATION))
            .arg(
                connection
                    .window_ms
                    .min(crate::store::fleet::MAX_GENERATION),
            );
        let v = self.eval(s, cmd, false, "claim presence").await?;
        if matches!(&v, redis::Value::BulkString(b) if b.as_slice() == b"S")
            || matches!(&v, redis::Value::SimpleString(t) if t == "S")
        {
            return Ok(None);
        }
        reply_u64(&v)
            .map(Some)
            .ok_or_else(|| StoreError::Corrupt("claim presence: not a number".into()))
    }

    async fn release_presence(&self, peer: &PeerId, session: SessionId) -> Result<(), StoreError> {
        let s = &fleet_scripts().release;
        let mut cmd = evalsha_one_key(s, &presence_key(peer));
        cmd.arg(session.to_string());
        self.eval(s, cmd, true, "release presence").await?;
        Ok(())
    }

    async fn presence(&self, peers: &[PeerId]) -> Result<Vec<Option<Presence>>, StoreError> {
        if peers.is_empty() {
            return Ok(Vec::new());
        }
        let mut pipe = redis::pipe();
        pipe.ignore_errors();
        for p in peers {
            pipe.cmd("HMGET")
                .arg(presence_key(p))
                .arg("node")
                .arg("session")
                .arg("gen")
                .arg("inc");
        }
        let values = self.query_pipeline(pipe, true, "presence").await?;
        Ok(values
            .iter()
            .map(|v| match v {
                Value::Array(items) => match (
                    items.first().and_then(reply_text),
                    items.get(1).and_then(reply_text),
                    items.get(2).and_then(reply_u64),
                ) {
                    (Some(node), Some(session), Some(generation)) => Some(Presence {
                        node,
                        // Absent in a record claimed by an instance that
                        // does not record incarnations.
                        incarnation: items.get(3).and_then(reply_text).unwrap_or_default(),
                        session,
                        generation,
                    }),
                    _ => None,
                },
                _ => None,
            })
            .collect())
    }

    async fn renew_node(
        &self,
        node: &str,
        incarnation: &str,
        lease_ms: u64,
    ) -> Result<Liveness, StoreError> {
        let s = &fleet_scripts().renew;
        let mut cmd = evalsha_nodes(s);
        cmd.arg(node).arg(lease_ms).arg(incarnation);
        liveness(&self.eval(s, cmd, true, "renew node").await?)
    }

    async fn acquire_lease(
        &self,
        name: &str,
        node: &str,
        lease_ms: u64,
    ) -> Result<bool, StoreError> {
        let s = &fleet_scripts().lease;
        let mut cmd = evalsha_one_key(s, &format!("oab:lease:{name}"));
        cmd.arg(node).arg(lease_ms);
        let v = self.eval(s, cmd, false, "lease").await?;
        Ok(reply_u64(&v) == Some(1))
    }

    async fn release_lease(&self, name: &str, node: &str) -> Result<(), StoreError> {
        let s = &fleet_scripts().unlease;
        let mut cmd = evalsha_one_key(s, &format!("oab:lease:{name}"));
        cmd.arg(node);
        self.eval(s, cmd, true, "release lease").await?;
        Ok(())
    }

    async fn retire_node(
        &self,
        node: &str,
        incarnation: &str,
        lease_ms: u64,
    ) -> Result<(), StoreError> {
        let s = &fleet_scripts().retire;
        let mut cmd = evalsha_nodes(s);
        cmd.arg(node).arg(lease_ms).arg(incarnation);
        self.eval(s, cmd, true, "retire node").await?;
        Ok(())
    }

    async fn publish(&self, messages: Vec<(PeerId, Bytes)>) -> Result<(), StoreError> {
        if messages.is_empty() {
            return Ok(());
        }
        let mut pipe = redis::pipe();
        pipe.ignore_errors();
        for (peer, payload) in &messages {
            pipe.cmd("PUBLISH")
                .arg(wake_channel(peer))
                .arg(payload.as_ref());
        }
        self.query_pipeline(pipe, false, "publish").await?;
        Ok(())
    }
}
