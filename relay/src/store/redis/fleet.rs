//! Fleet coordination on the Redis store (see [`crate::store::fleet`]).
//!
//! | key | type | content |
//! |---|---|---|
//! | `oab:presence:{<peer>}` | hash | `node`, `inc` (the node's incarnation), `session` (hex), `gen` (the last claim's generation; kept when released) |
//! | `oab:nodes` | zset | node name scored by the end of its liveness lease (Redis clock, ms) |
//! | `{oab:nodes}:incarnations` | zset | `<node>\|<incarnation>` of each live process, scored like `oab:nodes`; `<node>\|<incarnation>\|left` for one that left cleanly, scored by the end of the lease it gave up (removed then) |
//! | `oab:lease:<name>` | string | the holding node, with `PX` the lease |
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
use crate::store::StoreError;
use crate::store::fleet::{FleetStore, Liveness, Presence, wake_channel};

/// Node liveness zset.
const NODES_KEY: &str = "oab:nodes";
/// Incarnations of the live nodes, and departure notices; in the hash slot
/// of [`NODES_KEY`].
const INCARNATIONS_KEY: &str = "{oab:nodes}:incarnations";
/// Suffix of a departure notice in [`INCARNATIONS_KEY`].
const LEFT_SUFFIX: &str = "|left";

/// `claim`: KEYS presence; ARGV node, session, floor, incarnation. Returns the new
/// generation: above the stored one, above `floor` (the highest generation
/// the claiming instance has seen for the peer), and at least Redis's clock
/// in microseconds, so that it stays above every earlier claim even after
/// the store lost the record (see `FleetStore::claim_presence`). Numbers stay
/// below 2^53, exact in Lua.
const CLAIM_LUA: &str = r"
local t = redis.call('TIME')
local gen = tonumber(t[1]) * 1000000 + tonumber(t[2])
local stored = tonumber(redis.call('HGET', KEYS[1], 'gen') or '0') or 0
local floor = tonumber(ARGV[3]) or 0
if stored + 1 > gen then gen = stored + 1 end
if floor + 1 > gen then gen = floor + 1 end
gen = string.format('%.0f', gen)
redis.call('HSET', KEYS[1], 'gen', gen, 'node', ARGV[1], 'session', ARGV[2], 'inc', ARGV[4])
return gen
";

/// `release`: KEYS presence; ARGV session. Clears node and session if the
/// record still names this session.
const RELEASE_LUA: &str = r"
if redis.call('HGET', KEYS[1], 'session') == ARGV[1] then
  redis.call('HDEL', KEYS[1], 'node', 'session')
  return 1
end
return 0
";

/// `renew`: KEYS nodes, incarnations; ARGV node, lease ms, incarnation.
/// Scores by Redis time, drops nodes and notices whose lease ended, drops
/// earlier incarnations of this node (their process is gone: node names are
/// unique), and returns the live node names and the incarnation members.
const RENEW_LUA: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lease_end = now + tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], lease_end, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. now)
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', '(' .. now)
local prefix = ARGV[1] .. '|'
local mine = prefix .. ARGV[3]
for _, m in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do
  if m ~= mine and string.sub(m, 1, #prefix) == prefix
     and not string.find(m, '|', #prefix + 1, true) then
    redis.call('ZREM', KEYS[2], m)
  end
end
redis.call('ZADD', KEYS[2], lease_end, mine)
return {redis.call('ZRANGE', KEYS[1], 0, -1), redis.call('ZRANGE', KEYS[2], 0, -1)}
";

/// `retire`: KEYS nodes, incarnations; ARGV node, lease ms, incarnation.
/// Removes the node and leaves a departure notice for one lease, so the
/// other instances read the departure as a clean leave.
const RETIRE_LUA: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local member = ARGV[1] .. '|' .. ARGV[3]
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], member)
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[2]), member .. '|left')
return 1
";

/// `lease`: KEYS lease; ARGV node, lease ms. Takes a free lease or renews
/// our own; 1 if held by `node` now.
const LEASE_LUA: &str = r"
local cur = redis.call('GET', KEYS[1])
if cur == false or cur == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
";

/// `unlease`: KEYS lease; ARGV node. Deletes the lease if `node` holds it.
const UNLEASE_LUA: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
";

fn presence_key(peer: &PeerId) -> String {
    format!("oab:presence:{{{peer}}}")
}

fn evalsha(script: &Script, key: &str) -> redis::Cmd {
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

/// The liveness a renewal returned: live node names, and the incarnation
/// members (`<node>|<incarnation>`, or with `|left` for a departure).
/// A live node without an incarnation member (an instance that does not
/// record one) is live with incarnation `""`.
fn liveness(v: &Value) -> Result<Liveness, StoreError> {
    let corrupt = || StoreError::Corrupt(format!("renew node: unexpected reply {v:?}"));
    let Value::Array(parts) = v else {
        return Err(corrupt());
    };
    let (Some(Value::Array(names)), Some(Value::Array(members))) = (parts.first(), parts.get(1))
    else {
        return Err(corrupt());
    };
    let mut out = Liveness::default();
    let mut incarnations = std::collections::HashMap::new();
    // Ascending by lease end: a later renewal of the same name wins.
    for m in members.iter().filter_map(text) {
        if let Some(gone) = m.strip_suffix(LEFT_SUFFIX) {
            if let Some((node, inc)) = gone.split_once('|') {
                out.left.push((node.to_owned(), inc.to_owned()));
            }
        } else if let Some((node, inc)) = m.split_once('|') {
            incarnations.insert(node.to_owned(), inc.to_owned());
        }
    }
    for name in names.iter().filter_map(text) {
        let inc = incarnations.remove(&name).unwrap_or_default();
        out.live.push((name, inc));
    }
    Ok(out)
}

fn text(v: &Value) -> Option<String> {
    match v {
        Value::BulkString(b) => String::from_utf8(b.clone()).ok(),
        Value::SimpleString(s) => Some(s.clone()),
        Value::Int(i) => Some(i.to_string()),
        _ => None,
    }
}

fn int(v: &Value) -> Option<u64> {
    match v {
        Value::Int(i) => u64::try_from(*i).ok(),
        other => text(other)?.parse().ok(),
    }
}

/// The fleet scripts, hashed once.
#[derive(Debug)]
pub(super) struct FleetScripts {
    claim: Script,
    release: Script,
    renew: Script,
    retire: Script,
    lease: Script,
    unlease: Script,
}

impl FleetScripts {
    pub(super) fn new() -> Self {
        FleetScripts {
            claim: Script::new(CLAIM_LUA),
            release: Script::new(RELEASE_LUA),
            renew: Script::new(RENEW_LUA),
            retire: Script::new(RETIRE_LUA),
            lease: Script::new(LEASE_LUA),
            unlease: Script::new(UNLEASE_LUA),
        }
    }
}

fn scripts() -> &'static FleetScripts {
    static SCRIPTS: std::sync::OnceLock<FleetScripts> = std::sync::OnceLock::new();
    SCRIPTS.get_or_init(FleetScripts::new)
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
    ) -> Result<u64, StoreError> {
        let s = &scripts().claim;
        let mut cmd = evalsha(s, &presence_key(peer));
        cmd.arg(node)
            .arg(session.to_string())
            .arg(floor.min(crate::store::fleet::MAX_GENERATION))
            .arg(incarnation);
        let v = self.eval(s, cmd, false, "claim presence").await?;
        int(&v).ok_or_else(|| StoreError::Corrupt("claim presence: not a number".into()))
    }

    async fn release_presence(&self, peer: &PeerId, session: SessionId) -> Result<(), StoreError> {
        let s = &scripts().release;
        let mut cmd = evalsha(s, &presence_key(peer));
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
        let values = self.query_pipeline(&pipe, true, "presence").await?;
        Ok(values
            .iter()
            .map(|v| match v {
                Value::Array(items) => match (
                    items.first().and_then(text),
                    items.get(1).and_then(text),
                    items.get(2).and_then(int),
                ) {
                    (Some(node), Some(session), Some(generation)) => Some(Presence {
                        node,
                        // Absent in a record claimed by an instance that
                        // does not record incarnations.
                        incarnation: items.get(3).and_then(text).unwrap_or_default(),
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
        let s = &scripts().renew;
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
        let s = &scripts().lease;
        let mut cmd = evalsha(s, &format!("oab:lease:{name}"));
        cmd.arg(node).arg(lease_ms);
        let v = self.eval(s, cmd, false, "lease").await?;
        Ok(int(&v) == Some(1))
    }

    async fn release_lease(&self, name: &str, node: &str) -> Result<(), StoreError> {
        let s = &scripts().unlease;
        let mut cmd = evalsha(s, &format!("oab:lease:{name}"));
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
        let s = &scripts().retire;
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
        self.query_pipeline(&pipe, false, "publish").await?;
        Ok(())
    }
}
