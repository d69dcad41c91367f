//! The Redis store: the production backend, same observable semantics as
//! [`MemoryStore`](super::MemoryStore) (the shared conformance tests run both).
//!
//! # Key layout
//!
//! Every key of one delegation carries the same hash tag, `{<caller>#<request_id>}`
//! (neither id may contain `{`, `}`, `#` or `|`), so Redis Cluster keeps the
//! delegation on one shard and its scripts touch a single slot:
//!
//! | key | type | content |
//! |---|---|---|
//! | `oab:d:{<caller>#<rid>}:meta` | hash | `callee`, `dl` deadline, `dg` digest, `ct` created, `dt`/`ds` down tail / down sender tail, `ut`/`us` the same for up, `term` outcome name or `""`, `tms` terminal ms or `""`, `acc` accepting instance (hex) or `""` |
//! | `oab:d:{<caller>#<rid>}:down` | stream | entry id `<seq>-0`, one field `f` = the exact frame bytes |
//! | `oab:d:{<caller>#<rid>}:up` | stream | same for the up log |
//! | `oab:p:{<peer>}:dlg` | set | delegation keys (`<caller>#<rid>`) where the peer is caller or callee |
//! | `oab:deadlines` | zset (all scores 0) | `<deadline, 20 digits>\|<caller>#<rid>` of open delegations |
//! | `oab:finished` | zset (all scores 0) | `<terminal ms, 20 digits>\|<caller>#<rid>\|<callee>` |
//! | `oab:desc:{<peer>}` | string | the peer's descriptor |
//! | `oab:epoch` | string | random non-zero u64, `SET NX` on first use |
//!
//! The two index zsets are ordered lexicographically (`ZRANGEBYLEX`) instead of
//! by score: a zero-padded decimal prefix orders exactly like the u64 it
//! encodes (a score is an f64 and would round above 2^53), and `#` sorts below
//! every byte allowed in a peer id, so ties order exactly like
//! [`DelegationKey`]'s `Ord`, as in the memory store.
//!
//! # Atomicity
//!
//! `open`, `append`, `read` and the expiry of one delegation are each one Lua
//! script over that delegation's keys only (`EVALSHA`, loaded with
//! `SCRIPT LOAD` on `NOSCRIPT`). The scripts never format numbers in Lua (its
//! `tostring` switches to exponent notation above 1e14): every sequence or
//! time they store arrives as a decimal string from Rust. When a terminal is
//! set, the script also sets `PEXPIRE finished_ttl_ms` on the delegation's
//! keys, so Redis itself drops finished delegations.
//!
//! The cross-delegation indexes (peer sets, deadlines, finished) are updated
//! with separate single-key commands after the script, which is what Redis
//! Cluster allows. They can therefore be stale (a crash between the script and
//! the index update, or `PEXPIRE` dropping a delegation): every reader checks
//! candidates against the meta hash and removes stale members, and an `open`
//! that finds an existing delegation re-adds its index entries.
//!
//! # Batches and failures
//!
//! `append` sends the whole batch as one pipeline of `EVALSHA`s, one round
//! trip (plus one for the indexes when an entry set a terminal). If Redis
//! refuses a script (out of memory under `noeviction`, say) or the connection
//! fails mid-batch, the call returns [`StoreError::Unavailable`] although some
//! entries may be durable; resending is safe: a peer's entries then come back
//! as `Duplicate`, a relay entry as `Conflict` (re-read the tail). Reads and
//! other idempotent commands are retried once after a lost connection, so a
//! Redis restart does not surface to them; `open` and `append` are not.
//!
//! `oab:epoch` detects a Redis that lost everything (a restart without
//! persistence).
//!
//! # Redis Cluster
//!
//! [`RedisStore::connect`] with `redis-cluster://host1:port1,host2:port2`
//! (seed nodes) runs the same code over a cluster connection, which sends
//! each command to the master owning its key's slot. What differs:
//!
//! - Pipelines: the redis crate's cluster connection sends a pipeline to
//!   one node and refuses one whose keys span several slots, so a pipeline
//!   is split by the hash slot of each command's first key (for `EVALSHA`,
//!   the first key after `numkeys`), one pipeline per slot is sent, all
//!   concurrently, and the replies are put back in the order of the
//!   commands. Commands of one slot keep their relative order, so an
//!   `append` batch runs in order per delegation (its keys share one hash
//!   tag); the entries of different delegations may run on several shards
//!   at once, and nothing depends on their order across delegations.
//! - Scripts: `SCRIPT LOAD` goes to every node, masters and replicas (the
//!   redis crate routes it to all nodes and fails unless every one
//!   succeeds), at connect time and again when a batch meets `NOSCRIPT`;
//!   the commands that got `NOSCRIPT` are then sent again, split by slot as
//!   above, so a node that restarted alone only costs its own commands a
//!   second round trip.
//! - `oab:deadlines`, `oab:finished` and `oab:epoch` are single keys, each on
//!   one shard (the indexes are one sorted set each, as on a single node).
//!   A shard that lost its data alone changes the epoch only if it holds
//!   `oab:epoch`; otherwise its delegations just read as unknown.
//! - Retries: the cluster connection itself follows `MOVED`/`ASK`, waits
//!   out `TRYAGAIN`/`CLUSTERDOWN`/`LOADING` and reconnects after a lost
//!   connection, then sends the command, or the whole one-slot pipeline,
//!   again (up to 5 times, all within the 5 s response timeout), `open`
//!   and `append` included. A script that had already run then runs a second time, which
//!   for an append is what a resend does (`Duplicate` for a peer's entry,
//!   `Conflict` for the relay's), never a second copy of an entry; the
//!   finished index of an append that set the terminal is then left to the
//!   stale-entry repair described above.
//!
//! # Differences from the memory store
//!
//! Only in timing: Redis drops a finished delegation `finished_ttl_ms` after
//! its terminal by its own clock, while the memory store keeps it until
//! [`EventStore::expire_finished`] runs with a `now_ms` past that point.
//! `expire_finished` here deletes what is due by the caller's clock (as the
//! memory store does) and cleans the indexes.

use std::collections::HashMap;
use std::time::Duration;

use bytes::Bytes;
use futures_util::future::join_all;
use oab_wire::{DelegationKey, Digest, Direction, InstanceId, Outcome, PeerId, RequestId};
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClientBuilder;
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::Slot;
use redis::{Cmd, Pipeline, RedisError, RedisFuture, Script, ServerErrorKind, Value};

mod fleet;

use super::{
    AppendOutcome, AppendRequest, DelegationMeta, EventStore, OpenOutcome, OpenRequest, Origin,
    ReadOutcome, Retention, StoreError, wake_channel,
};

/// How long one command (or one pipelined batch) may take before it fails.
/// The redis crate's default is 500 ms, which a batch of a few hundred
/// appends behind an AOF rewrite or a busy shard can exceed; a dead server
/// is detected by the connection itself, so this only bounds a stuck one.
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(5);
/// How long one connection attempt may take.
const CONNECTION_TIMEOUT: Duration = Duration::from_secs(2);
/// Reconnect attempts after a connection is lost (and for the first
/// connection), with exponential backoff from [`RECONNECT_MIN_DELAY`] capped
/// at [`RECONNECT_MAX_DELAY`]: about 1.5 s in all before a command fails with
/// [`StoreError::Unavailable`]; the next command starts a new round.
const RECONNECT_RETRIES: usize = 5;
/// First reconnect delay.
const RECONNECT_MIN_DELAY: Duration = Duration::from_millis(50);
/// Longest delay between reconnect attempts.
const RECONNECT_MAX_DELAY: Duration = Duration::from_secs(1);
/// The URL scheme of a Redis Cluster: `redis-cluster://host1:port1,host2:port2`.
const CLUSTER_SCHEME: &str = "redis-cluster://";
/// Port of a cluster seed given without one.
const DEFAULT_PORT: u16 = 6379;
/// Attempts the cluster connection makes per command after a failure
/// (reconnect, `TRYAGAIN`, `CLUSTERDOWN`, redirections), with backoff from
/// [`RECONNECT_MIN_DELAY`] to [`RECONNECT_MAX_DELAY`]; the whole command,
/// retries included, is bounded by [`RESPONSE_TIMEOUT`].
const CLUSTER_RETRIES: u32 = 5;
/// Members of `oab:finished` handled per round trip by `expire_finished`.
const EXPIRE_CHUNK: usize = 512;
/// Largest `PEXPIRE` argument sent: Redis refuses values whose absolute
/// expiry overflows an i64 of milliseconds; 2^53 ms is about 285,000 years.
const MAX_TTL_MS: u64 = 1 << 53;

/// The store epoch key.
const EPOCH_KEY: &str = "oab:epoch";
/// Open delegations by deadline.
const DEADLINES_KEY: &str = "oab:deadlines";
/// Finished delegations by terminal time.
const FINISHED_KEY: &str = "oab:finished";

/// Meta hash fields (short: there is one hash per delegation).
mod field {
    pub(super) const CALLEE: &str = "callee";
    pub(super) const DEADLINE: &str = "dl";
    pub(super) const DIGEST: &str = "dg";
    pub(super) const CREATED: &str = "ct";
    pub(super) const DOWN_TAIL: &str = "dt";
    pub(super) const DOWN_SENDER_TAIL: &str = "ds";
    pub(super) const UP_TAIL: &str = "ut";
    pub(super) const UP_SENDER_TAIL: &str = "us";
    pub(super) const TERMINAL: &str = "term";
    pub(super) const TERMINAL_MS: &str = "tms";
    pub(super) const ACCEPTED_BY: &str = "acc";
}

/// `open`: KEYS meta, down, up; ARGV callee, deadline, digest, now, frame,
/// maxlen, wake channel (or empty). Returns `{'N'}` when it created the
/// delegation (and published `W<frame>` on the wake channel), or
/// `{'E', <HGETALL>}`.
const OPEN_LUA: &str = r"
if redis.call('EXISTS', KEYS[1]) == 1 then
  local out = redis.call('HGETALL', KEYS[1])
  table.insert(out, 1, 'E')
  return out
end
redis.call('DEL', KEYS[2], KEYS[3])
redis.call('HSET', KEYS[1], 'callee', ARGV[1], 'dl', ARGV[2], 'dg', ARGV[3], 'ct', ARGV[4],
  'dt', '1', 'ds', '1', 'ut', '0', 'us', '0', 'term', '', 'tms', '', 'acc', '')
redis.call('XADD', KEYS[2], 'MAXLEN', ARGV[6], '1-0', 'f', ARGV[5])
if ARGV[7] ~= '' then redis.call('PUBLISH', ARGV[7], 'W' .. ARGV[5]) end
return {'N'}
";

/// `append` (one entry): KEYS meta, this log, the other log; ARGV dir
/// (`d`|`u`), seq, origin (`r` for the relay, else the instance hex),
/// terminal (outcome name or empty), frame, now, maxlen, ttl, wake channel
/// (or empty: when set, an appended entry is also published there as
/// `W<frame>`, atomically with the append, so a wake-up is never lost
/// between the two).
///
/// Returns `{'A'}` appended, `{'F', deadline, callee}` appended and it set
/// the terminal, `{'D', sender_tail}`, `{'H', tail}`, `{'C', tail}`,
/// `{'T', outcome or ''}` (already terminal) or `{'U'}` (unknown).
const APPEND_LUA: &str = r"
local m = redis.call('HMGET', KEYS[1], ARGV[1]..'t', ARGV[1]..'s', 'term', 'acc', 'dl', 'callee')
if not m[1] then return {'U'} end
local seq = tonumber(ARGV[2])
local tail = tonumber(m[1])
local cur = m[3] or ''
local term = ARGV[4]
if ARGV[3] == 'r' then
  if seq ~= tail + 1 then return {'C', m[1]} end
  if term ~= '' and cur ~= '' then return {'T', cur} end
  redis.call('HSET', KEYS[1], ARGV[1]..'t', ARGV[2])
else
  if seq <= tail then
    if seq <= tonumber(m[2] or '0') then return {'D', m[2] or '0'} end
    return {'T', cur}
  end
  if seq > tail + 1 then return {'H', m[1]} end
  if cur ~= '' then return {'T', cur} end
  if ARGV[1] == 'u' and (m[4] or '') == '' then
    redis.call('HSET', KEYS[1], 'ut', ARGV[2], 'us', ARGV[2], 'acc', ARGV[3])
  else
    redis.call('HSET', KEYS[1], ARGV[1]..'t', ARGV[2], ARGV[1]..'s', ARGV[2])
  end
end
redis.call('XADD', KEYS[2], 'MAXLEN', ARGV[7], ARGV[2]..'-0', 'f', ARGV[5])
if ARGV[9] ~= '' then redis.call('PUBLISH', ARGV[9], 'W' .. ARGV[5]) end
if cur ~= '' then
  local ttl = redis.call('PTTL', KEYS[1])
  if ttl > 0 then redis.call('PEXPIRE', KEYS[2], ttl) end
  return {'A'}
end
if term ~= '' then
  redis.call('HSET', KEYS[1], 'term', term, 'tms', ARGV[6])
  redis.call('PEXPIRE', KEYS[1], ARGV[8])
  redis.call('PEXPIRE', KEYS[2], ARGV[8])
  redis.call('PEXPIRE', KEYS[3], ARGV[8])
  return {'F', m[5] or '', m[6] or ''}
end
return {'A'}
";

/// `read`: KEYS meta, log; ARGV tail field, after, after + 1, limit.
/// Returns `{'U'}`, `{'L', tail, term}`, `{'T', first, term}` or
/// `{'E', tail, term, id, frame, id, frame, ...}`.
const READ_LUA: &str = r"
local m = redis.call('HMGET', KEYS[1], ARGV[1], 'term')
if not m[1] then return {'U'} end
local term = m[2] or ''
local after = tonumber(ARGV[2])
if after > tonumber(m[1]) then return {'L', m[1], term} end
local first = redis.call('XRANGE', KEYS[2], '-', '+', 'COUNT', 1)
if #first > 0 then
  local fseq = string.match(first[1][1], '^(%d+)')
  if after + 1 < tonumber(fseq) then return {'T', fseq, term} end
end
local out = {'E', m[1], term}
if tonumber(ARGV[4]) > 0 then
  local es = redis.call('XRANGE', KEYS[2], ARGV[3], '+', 'COUNT', ARGV[4])
  for _, e in ipairs(es) do
    out[#out + 1] = e[1]
    out[#out + 1] = e[2][2]
  end
end
return out
";

/// `expire` (one finished delegation): KEYS meta, down, up; ARGV the terminal
/// ms recorded in the index. Deletes the delegation if it is still the one
/// the index entry was made for. Returns 1 if it is gone now, 0 if a newer
/// delegation with the same key lives there.
const EXPIRE_LUA: &str = r"
local t = redis.call('HGET', KEYS[1], 'tms')
if not t then return 1 end
if t ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3])
return 1
";

/// The scripts, hashed once.
#[derive(Debug)]
struct Scripts {
    open: Script,
    append: Script,
    read: Script,
    expire: Script,
}

impl Scripts {
    fn new() -> Self {
        Scripts {
            open: Script::new(OPEN_LUA),
            append: Script::new(APPEND_LUA),
            read: Script::new(READ_LUA),
            expire: Script::new(EXPIRE_LUA),
        }
    }
}

/// The connection to a single Redis or to a Redis Cluster. Both multiplex
/// commands over their sockets and reconnect by themselves; cloning is cheap
/// (the clones share the sockets).
#[derive(Clone)]
enum Conn {
    /// One server.
    Single(ConnectionManager),
    /// A cluster: one connection per node, commands routed by key slot.
    Cluster(ClusterConnection),
}

impl std::fmt::Debug for Conn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Conn::Single(_) => "Conn::Single",
            Conn::Cluster(_) => "Conn::Cluster",
        })
    }
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Conn::Single(c) => c.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Conn::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Conn::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Single(c) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
        }
    }
}

/// URLs that may carry credentials: shown redacted by `Debug`.
struct Urls(Vec<String>);

impl std::fmt::Debug for Urls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.0.iter().map(|u| redact_url(u)))
            .finish()
    }
}

/// The Redis store. Cheap to share (`Arc` it); all methods take `&self` and
/// run over one multiplexed connection (one per node for a cluster) that
/// reconnects by itself.
#[derive(Debug)]
pub struct RedisStore {
    conn: Conn,
    /// What [`RedisStore::pubsub_urls`] returns.
    pubsub_urls: Urls,
    retention: Retention,
    scripts: Scripts,
    /// `max_log_entries` as sent to `XADD MAXLEN` (clamped to an i64).
    maxlen: u64,
    /// `finished_ttl_ms` as sent to `PEXPIRE` (clamped, see [`MAX_TTL_MS`]).
    ttl_ms: u64,
}

/// The keys of one delegation.
struct DelegationKeys {
    meta: String,
    down: String,
    up: String,
}

impl DelegationKeys {
    fn new(key: &DelegationKey) -> Self {
        let base = format!("oab:d:{{{key}}}");
        DelegationKeys {
            meta: format!("{base}:meta"),
            down: format!("{base}:down"),
            up: format!("{base}:up"),
        }
    }

    /// This log and the other one.
    fn logs(&self, dir: Direction) -> (&str, &str) {
        match dir {
            Direction::Down => (&self.down, &self.up),
            Direction::Up => (&self.up, &self.down),
        }
    }
}

fn peer_set_key(peer: &PeerId) -> String {
    format!("oab:p:{{{peer}}}:dlg")
}

fn descriptor_key(peer: &PeerId) -> String {
    format!("oab:desc:{{{peer}}}")
}

fn deadline_member(deadline_ms: u64, key: &DelegationKey) -> String {
    format!("{deadline_ms:020}|{key}")
}

fn finished_member(terminal_ms: u64, key: &DelegationKey, callee: &PeerId) -> String {
    format!("{terminal_ms:020}|{key}|{callee}")
}

/// The exclusive `ZRANGEBYLEX` upper bound for members whose 20-digit prefix
/// is at most `at`.
fn lex_upper_bound(at: u64) -> String {
    match at.checked_add(1) {
        Some(next) => format!("({next:020}"),
        None => "+".to_owned(),
    }
}

/// Parses `<caller>#<request_id>`.
fn parse_key(s: &str) -> Option<DelegationKey> {
    let (caller, rid) = s.split_once('#')?;
    Some(DelegationKey::new(
        PeerId::new(caller).ok()?,
        RequestId::new(rid).ok()?,
    ))
}

/// Parses a `oab:deadlines` member.
fn parse_deadline_member(m: &str) -> Option<(u64, DelegationKey)> {
    let (at, key) = m.split_once('|')?;
    Some((at.parse().ok()?, parse_key(key)?))
}

/// Parses a `oab:finished` member.
fn parse_finished_member(m: &str) -> Option<(u64, DelegationKey, PeerId)> {
    let mut parts = m.split('|');
    let (Some(at), Some(key), Some(callee), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return None;
    };
    Some((at.parse().ok()?, parse_key(key)?, PeerId::new(callee).ok()?))
}

fn parse_outcome(name: &str) -> Option<Outcome> {
    Outcome::ALL.iter().copied().find(|o| o.name() == name)
}

fn parse_instance(hex: &str) -> Option<InstanceId> {
    let mut out = [0u8; 16];
    if hex.len() != 32 {
        return None;
    }
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(InstanceId(out))
}

/// Removes credentials (user info, `pass=` query parameters) from a URL
/// before it goes into an error message.
fn redact_url(url: &str) -> String {
    let (scheme, rest) = url.split_once("://").unwrap_or(("", url));
    let rest = rest.split_once('?').map_or(rest, |(path, _)| path);
    let rest = match rest.split_once('/') {
        Some((authority, path)) => {
            let host = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
            format!("{host}/{path}")
        }
        None => rest.rsplit_once('@').map_or(rest, |(_, h)| h).to_owned(),
    };
    format!("{scheme}://{rest}")
}

/// Whether `url` names a Redis Cluster (`redis-cluster://`, any case).
fn is_cluster_url(url: &str) -> bool {
    url.get(..CLUSTER_SCHEME.len())
        .is_some_and(|scheme| scheme.eq_ignore_ascii_case(CLUSTER_SCHEME))
}

/// The seed nodes of `redis-cluster://[user:password@]host1:port1,host2:port2[/]`
/// as `redis://[user:password@]host:port` URLs: the credentials given on the
/// first host apply to every node. A host without a port gets 6379; IPv6
/// addresses go in brackets. The error never quotes the credentials.
fn cluster_seed_urls(url: &str) -> Result<Vec<String>, String> {
    let rest = url
        .get(CLUSTER_SCHEME.len()..)
        .filter(|_| is_cluster_url(url))
        .ok_or("not a redis-cluster:// URL")?;
    let rest = rest.strip_suffix('/').unwrap_or(rest);
    let (credentials, hosts) = match rest.rsplit_once('@') {
        Some((credentials, hosts)) => (Some(credentials), hosts),
        None => (None, rest),
    };
    if credentials.is_some_and(|c| c.contains(',')) {
        return Err(
            "credentials go before the first host only (user:password@host:port,host:port)".into(),
        );
    }
    if hosts.contains(['/', '?', '#']) {
        return Err("a cluster URL has no database, path or query: \
             redis-cluster://[user:password@]host:port,host:port,..."
            .into());
    }
    let prefix = credentials.map_or(String::new(), |c| format!("{c}@"));
    hosts
        .split(',')
        .map(|seed| {
            let (host, port) = if let Some(v6) = seed.strip_prefix('[') {
                let (addr, after) = v6
                    .split_once(']')
                    .ok_or_else(|| format!("seed {seed:?}: unclosed '['"))?;
                let port = match after {
                    "" => None,
                    after => Some(
                        after
                            .strip_prefix(':')
                            .ok_or_else(|| format!("seed {seed:?}: ':' expected after ']'"))?,
                    ),
                };
                (format!("[{addr}]"), port)
            } else {
                match seed.rsplit_once(':') {
                    Some((host, port)) => (host.to_owned(), Some(port)),
                    None => (seed.to_owned(), None),
                }
            };
            if host.is_empty() || host == "[]" {
                return Err(format!("seed {seed:?}: no host"));
            }
            let port = match port {
                None => DEFAULT_PORT,
                Some(p) => p
                    .parse::<u16>()
                    .ok()
                    .filter(|&p| p != 0)
                    .ok_or_else(|| format!("seed {seed:?}: bad port"))?,
            };
            Ok(format!("redis://{prefix}{host}:{port}"))
        })
        .collect()
}

fn unavailable(context: &str, e: &RedisError) -> StoreError {
    StoreError::Unavailable(format!("redis {context}: {e}"))
}

fn corrupt(what: impl Into<String>) -> StoreError {
    StoreError::Corrupt(what.into())
}

/// A reply for an error message, cut short (it may hold a whole frame).
fn shown(v: &Value) -> String {
    const MAX: usize = 96;
    let mut s = format!("{v:?}");
    if s.len() > MAX {
        let mut cut = MAX;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
        s.push_str("...");
    }
    s
}

fn is_noscript(v: &Value) -> bool {
    matches!(v, Value::ServerError(e) if e.kind() == Some(ServerErrorKind::NoScript))
}

/// A reply's bytes, for string-like replies.
fn bytes_of(v: &Value) -> Option<&[u8]> {
    match v {
        Value::BulkString(b) => Some(b),
        Value::SimpleString(s) => Some(s.as_bytes()),
        Value::Okay => Some(b"OK"),
        _ => None,
    }
}

fn str_of(v: &Value) -> Option<&str> {
    std::str::from_utf8(bytes_of(v)?).ok()
}

fn u64_of(v: &Value) -> Option<u64> {
    match v {
        Value::Int(i) => u64::try_from(*i).ok(),
        _ => str_of(v)?.parse().ok(),
    }
}

/// A script's reply as an array; server errors become `Unavailable`.
fn array(v: Value, context: &str) -> Result<Vec<Value>, StoreError> {
    match v {
        Value::Array(items) => Ok(items),
        Value::ServerError(e) => Err(StoreError::Unavailable(format!("redis {context}: {e}"))),
        other => Err(corrupt(format!(
            "{context}: expected an array, got {}",
            shown(&other)
        ))),
    }
}

/// A hash reply (`HGETALL`: RESP2 flat array or RESP3 map) as a field map.
fn hash_fields(v: Value) -> Result<HashMap<String, Value>, StoreError> {
    let pairs: Vec<(Value, Value)> = match v {
        Value::Map(pairs) => pairs,
        Value::Array(flat) => pairs_of(flat),
        Value::Nil => Vec::new(),
        Value::ServerError(e) => return Err(StoreError::Unavailable(format!("redis: {e}"))),
        other => return Err(corrupt(format!("expected a hash, got {}", shown(&other)))),
    };
    let mut out = HashMap::with_capacity(pairs.len());
    for (k, v) in pairs {
        let k = str_of(&k).ok_or_else(|| corrupt("meta field name is not text"))?;
        out.insert(k.to_owned(), v);
    }
    Ok(out)
}

/// `[k1, v1, k2, v2, ...]` as pairs (a trailing odd item is dropped).
fn pairs_of(flat: Vec<Value>) -> Vec<(Value, Value)> {
    let mut out = Vec::with_capacity(flat.len() / 2);
    let mut it = flat.into_iter();
    while let (Some(k), Some(v)) = (it.next(), it.next()) {
        out.push((k, v));
    }
    out
}

/// Builds a [`DelegationMeta`] from the meta hash fields.
fn parse_meta(
    key: &DelegationKey,
    fields: &HashMap<String, Value>,
) -> Result<DelegationMeta, StoreError> {
    let text = |name: &str| -> Result<&str, StoreError> {
        fields
            .get(name)
            .and_then(str_of)
            .ok_or_else(|| corrupt(format!("delegation {key}: meta field {name} missing")))
    };
    let number = |name: &str| -> Result<u64, StoreError> {
        text(name)?
            .parse()
            .map_err(|_| corrupt(format!("delegation {key}: meta field {name} not a number")))
    };
    let bad = |name: &str| corrupt(format!("delegation {key}: meta field {name} malformed"));
    let terminal = match text(field::TERMINAL)? {
        "" => None,
        name => Some(parse_outcome(name).ok_or_else(|| bad(field::TERMINAL))?),
    };
    let terminal_ms = match text(field::TERMINAL_MS)? {
        "" => None,
        ms => Some(ms.parse().map_err(|_| bad(field::TERMINAL_MS))?),
    };
    let accepted_by = match text(field::ACCEPTED_BY)? {
        "" => None,
        hex => Some(parse_instance(hex).ok_or_else(|| bad(field::ACCEPTED_BY))?),
    };
    Ok(DelegationMeta {
        key: key.clone(),
        callee: PeerId::new(text(field::CALLEE)?).map_err(|_| bad(field::CALLEE))?,
        deadline_ms: number(field::DEADLINE)?,
        digest: Digest::parse(text(field::DIGEST)?).ok_or_else(|| bad(field::DIGEST))?,
        created_ms: number(field::CREATED)?,
        down_tail: number(field::DOWN_TAIL)?,
        up_tail: number(field::UP_TAIL)?,
        down_sender_tail: number(field::DOWN_SENDER_TAIL)?,
        up_sender_tail: number(field::UP_SENDER_TAIL)?,
        terminal,
        terminal_ms,
        accepted_by,
    })
}

/// The terminal name in a script reply: `''` means none.
fn parse_terminal(v: Option<&Value>) -> Result<Option<Outcome>, StoreError> {
    match v.and_then(str_of) {
        Some("") => Ok(None),
        Some(name) => parse_outcome(name)
            .map(Some)
            .ok_or_else(|| corrupt(format!("unknown outcome {name:?}"))),
        None => Err(corrupt("script reply lacks the terminal")),
    }
}

/// Index work that follows an append that set a terminal.
struct Finished {
    key: DelegationKey,
    deadline_ms: u64,
    terminal_ms: u64,
    callee: PeerId,
}

/// Parses one `append` script reply.
fn parse_append(
    req: &AppendRequest,
    v: Value,
) -> Result<(AppendOutcome, Option<Finished>), StoreError> {
    let items = array(v, "append")?;
    let code = items.first().and_then(str_of);
    let num = |i: usize| -> Result<u64, StoreError> {
        items
            .get(i)
            .and_then(u64_of)
            .ok_or_else(|| corrupt(format!("append reply {code:?} lacks a number")))
    };
    let outcome = match code {
        Some("A") => AppendOutcome::Appended { seq: req.seq },
        Some("F") => {
            let deadline_ms = num(1)?;
            let callee = items
                .get(2)
                .and_then(str_of)
                .and_then(|s| PeerId::new(s).ok())
                .ok_or_else(|| corrupt(format!("delegation {}: bad callee", req.key)))?;
            let finished = Finished {
                key: req.key.clone(),
                deadline_ms,
                terminal_ms: req.now_ms,
                callee,
            };
            return Ok((AppendOutcome::Appended { seq: req.seq }, Some(finished)));
        }
        Some("D") => AppendOutcome::Duplicate { tail: num(1)? },
        Some("H") => AppendOutcome::Hole { tail: num(1)? },
        Some("C") => AppendOutcome::Conflict { tail: num(1)? },
        Some("T") => AppendOutcome::AlreadyTerminal {
            // An empty name: the slot holds a relay entry and no terminal was
            // recorded, which the memory store also reports as `unknown`.
            outcome: parse_terminal(items.get(1))?.unwrap_or(Outcome::Unknown),
        },
        Some("U") => AppendOutcome::Unknown,
        other => return Err(corrupt(format!("append: unexpected reply {other:?}"))),
    };
    Ok((outcome, None))
}

/// Parses a `read` script reply.
fn parse_read(v: Value) -> Result<ReadOutcome, StoreError> {
    let items = array(v, "read")?;
    let code = items.first().and_then(str_of);
    if code == Some("U") {
        return Ok(ReadOutcome::Unknown);
    }
    let num = |i: usize| -> Result<u64, StoreError> {
        items
            .get(i)
            .and_then(u64_of)
            .ok_or_else(|| corrupt(format!("read reply {code:?} lacks a number")))
    };
    let terminal = parse_terminal(items.get(2))?;
    match code {
        Some("L") => Ok(ReadOutcome::Lost {
            tail: num(1)?,
            terminal,
        }),
        Some("T") => Ok(ReadOutcome::Trimmed {
            first_available: num(1)?,
            terminal,
        }),
        Some("E") => {
            let tail = num(1)?;
            let mut entries = Vec::with_capacity(items.len().saturating_sub(3) / 2);
            let mut rest = items.into_iter().skip(3);
            while let (Some(id), Some(frame)) = (rest.next(), rest.next()) {
                let seq = str_of(&id)
                    .and_then(|s| s.split_once('-'))
                    .and_then(|(seq, _)| seq.parse::<u64>().ok())
                    .ok_or_else(|| corrupt(format!("read: bad stream id {}", shown(&id))))?;
                let Value::BulkString(frame) = frame else {
                    return Err(corrupt("read: frame is not a bulk string"));
                };
                entries.push((seq, Bytes::from(frame)));
            }
            Ok(ReadOutcome::Entries {
                entries,
                tail,
                terminal,
            })
        }
        other => Err(corrupt(format!("read: unexpected reply {other:?}"))),
    }
}

/// An `EVALSHA` of `script` (the caller adds keys and arguments).
fn evalsha(script: &Script, keys: &[&str]) -> Cmd {
    let mut c = redis::cmd("EVALSHA");
    c.arg(script.get_hash()).arg(keys.len());
    for k in keys {
        c.arg(*k);
    }
    c
}

/// A pipeline that returns per-command results (server errors included)
/// instead of failing as a whole.
fn pipeline() -> Pipeline {
    let mut p = redis::pipe();
    p.ignore_errors();
    p
}

impl RedisStore {
    /// Connects to Redis at `url` (`redis://host:port/db`,
    /// `redis+unix:///path/to/redis.sock`, and the other forms the redis crate
    /// accepts) and loads the scripts.
    ///
    /// `redis-cluster://[user:password@]host1:port1,host2:port2,...` connects
    /// to a Redis Cluster through those seed nodes (any reachable one is
    /// enough to discover the others; the credentials apply to every node):
    /// see the module documentation for what changes.
    ///
    /// The connection reconnects by itself when Redis restarts; commands sent
    /// while it is down fail with [`StoreError::Unavailable`] after the
    /// reconnect attempts (about 1.5 s). Run Redis with `noeviction` (a warning
    /// is logged otherwise) and AOF.
    pub async fn connect(url: &str, retention: Retention) -> Result<RedisStore, StoreError> {
        let shown = redact_url(url);
        let invalid = |e: &dyn std::fmt::Display| {
            StoreError::Unavailable(format!("invalid Redis URL {shown}: {e}"))
        };
        let cannot_connect = |e: RedisError| {
            StoreError::Unavailable(format!("cannot connect to Redis at {shown}: {e}"))
        };
        let (conn, pubsub_urls) = if is_cluster_url(url) {
            let seeds = cluster_seed_urls(url).map_err(|e| invalid(&e))?;
            let client = ClusterClientBuilder::new(seeds.iter().map(String::as_str))
                .connection_timeout(CONNECTION_TIMEOUT)
                .response_timeout(RESPONSE_TIMEOUT)
                .retries(CLUSTER_RETRIES)
                .min_retry_wait(duration_ms(RECONNECT_MIN_DELAY))
                .max_retry_wait(duration_ms(RECONNECT_MAX_DELAY))
                .build()
                .map_err(|e| invalid(&e))?;
            let conn = client
                .get_async_connection()
                .await
                .map_err(cannot_connect)?;
            (Conn::Cluster(conn), seeds)
        } else {
            let client = redis::Client::open(url).map_err(|e| invalid(&e))?;
            let config = ConnectionManagerConfig::new()
                .set_response_timeout(Some(RESPONSE_TIMEOUT))
                .set_connection_timeout(Some(CONNECTION_TIMEOUT))
                .set_number_of_retries(RECONNECT_RETRIES)
                .set_min_delay(RECONNECT_MIN_DELAY)
                .set_max_delay(RECONNECT_MAX_DELAY);
            let conn = ConnectionManager::new_with_config(client, config)
                .await
                .map_err(cannot_connect)?;
            (Conn::Single(conn), vec![url.to_owned()])
        };
        let store = RedisStore {
            conn,
            pubsub_urls: Urls(pubsub_urls),
            retention,
            scripts: Scripts::new(),
            maxlen: retention.max_log_entries.min(i64::MAX as u64),
            ttl_ms: retention.finished_ttl_ms.min(MAX_TTL_MS),
        };
        store.load_scripts().await?;
        store.warn_unless_noeviction().await;
        Ok(store)
    }

    /// The retention this store applies.
    pub fn retention(&self) -> Retention {
        self.retention
    }

    /// Where to open a pub/sub connection: the URL given to
    /// [`connect`](Self::connect) for a single server, or each cluster seed
    /// as `redis://[user:password@]host:port`. The URLs carry the
    /// credentials, if any: do not log them.
    pub fn pubsub_urls(&self) -> Vec<String> {
        self.pubsub_urls.0.clone()
    }

    /// Whether this store runs on a Redis Cluster.
    pub fn is_cluster(&self) -> bool {
        matches!(self.conn, Conn::Cluster(_))
    }

    /// `SCRIPT LOAD`s every script. On a cluster the redis crate sends
    /// `SCRIPT LOAD` to every node and fails unless all succeed (its routing
    /// table: `SCRIPT LOAD` is an all-nodes command), so each master has them.
    async fn load_scripts(&self) -> Result<(), StoreError> {
        let mut conn = self.conn.clone();
        for s in [
            &self.scripts.open,
            &self.scripts.append,
            &self.scripts.read,
            &self.scripts.expire,
        ] {
            s.load_async(&mut conn)
                .await
                .map_err(|e| unavailable("SCRIPT LOAD", &e))?;
        }
        Ok(())
    }

    /// Eviction silently loses logs; say so. Best effort: managed Redis
    /// services often refuse `CONFIG GET`.
    async fn warn_unless_noeviction(&self) {
        let mut conn = self.conn.clone();
        let reply: Result<Value, RedisError> = redis::cmd("CONFIG")
            .arg("GET")
            .arg("maxmemory-policy")
            .query_async(&mut conn)
            .await;
        let policy = match reply {
            Ok(Value::Array(items)) => items.get(1).and_then(str_of).map(str::to_owned),
            Ok(Value::Map(pairs)) => pairs
                .first()
                .and_then(|(_, v)| str_of(v))
                .map(str::to_owned),
            _ => None,
        };
        if let Some(policy) = policy
            && policy != "noeviction"
        {
            tracing::warn!(
                maxmemory_policy = %policy,
                "Redis evicts keys under memory pressure, which silently loses delegation \
                 logs; set maxmemory-policy noeviction"
            );
        }
    }

    /// Runs one command (on a cluster, on the master of its key's slot).
    /// `idempotent` commands are retried once when the connection was lost
    /// (the retry waits for the reconnect), so a Redis restart is invisible
    /// to readers.
    pub(crate) async fn query(
        &self,
        cmd: &Cmd,
        idempotent: bool,
        context: &str,
    ) -> Result<Value, StoreError> {
        let mut conn = self.conn.clone();
        match cmd.query_async::<Value>(&mut conn).await {
            Ok(v) => Ok(v),
            Err(e) if idempotent && retryable(&e) => cmd
                .query_async::<Value>(&mut conn)
                .await
                .map_err(|e| unavailable(context, &e)),
            Err(e) => Err(unavailable(context, &e)),
        }
    }

    /// Runs a pipeline built with [`pipeline`]; one value per command, in the
    /// order of the commands. On a cluster, the commands are split by the
    /// slot of their first key ([`slot_groups`]) and each group is sent as
    /// its own pipeline, all groups concurrently; a single server gets the
    /// pipeline as it is, in one round trip.
    pub(crate) async fn query_pipeline(
        &self,
        pipe: &Pipeline,
        idempotent: bool,
        context: &str,
    ) -> Result<Vec<Value>, StoreError> {
        self.query_pipeline_each(pipe, idempotent, context)
            .await?
            .into_iter()
            .collect()
    }

    /// Like [`Self::query_pipeline`], but on a cluster a slot group whose
    /// node fails gives an error for each of its commands while the other
    /// groups keep their replies. `Err` when the whole pipeline failed.
    async fn query_pipeline_each(
        &self,
        pipe: &Pipeline,
        idempotent: bool,
        context: &str,
    ) -> Result<Vec<Result<Value, StoreError>>, StoreError> {
        let groups = match self.conn {
            Conn::Single(_) => Vec::new(),
            Conn::Cluster(_) => slot_groups(pipe),
        };
        if groups.len() <= 1 {
            let values = self.send_pipeline(pipe, idempotent, context).await?;
            return Ok(values.into_iter().map(Ok).collect());
        }
        let cmds: Vec<&Cmd> = pipe.cmd_iter().collect();
        let mut parts = Vec::with_capacity(groups.len());
        for indices in &groups {
            let mut part = pipeline();
            for &i in indices {
                let cmd = cmds
                    .get(i)
                    .ok_or_else(|| corrupt(format!("{context}: command index out of range")))?;
                part.add_command((*cmd).clone());
            }
            parts.push(part);
        }
        let replies = join_all(
            parts
                .iter()
                .map(|part| self.send_pipeline(part, idempotent, context)),
        )
        .await;
        let mut values: Vec<Result<Value, StoreError>> =
            (0..pipe.len()).map(|_| Ok(Value::Nil)).collect();
        let mut failed = 0;
        for (indices, replies) in groups.iter().zip(replies) {
            match replies {
                Ok(replies) => {
                    for (&i, v) in indices.iter().zip(replies) {
                        if let Some(slot) = values.get_mut(i) {
                            *slot = Ok(v);
                        }
                    }
                }
                Err(e) => {
                    failed += 1;
                    let message = e.to_string();
                    for &i in indices {
                        if let Some(slot) = values.get_mut(i) {
                            *slot = Err(StoreError::Unavailable(message.clone()));
                        }
                    }
                }
            }
        }
        if failed == groups.len() {
            return Err(StoreError::Unavailable(format!(
                "{context}: no node of the cluster answered"
            )));
        }
        Ok(values)
    }

    /// Sends a pipeline as it is (on a cluster, its commands must share one
    /// slot); one value per command.
    async fn send_pipeline(
        &self,
        pipe: &Pipeline,
        idempotent: bool,
        context: &str,
    ) -> Result<Vec<Value>, StoreError> {
        let mut conn = self.conn.clone();
        let values = match pipe.query_async::<Vec<Value>>(&mut conn).await {
            Ok(v) => v,
            Err(e) if idempotent && retryable(&e) => pipe
                .query_async::<Vec<Value>>(&mut conn)
                .await
                .map_err(|e| unavailable(context, &e))?,
            Err(e) => return Err(unavailable(context, &e)),
        };
        if values.len() != pipe.len() {
            return Err(corrupt(format!(
                "{context}: {} replies for {} commands",
                values.len(),
                pipe.len()
            )));
        }
        Ok(values)
    }

    /// Runs `EVALSHA` commands of one script in one pipeline (on a cluster,
    /// one per slot). Commands that got `NOSCRIPT` (Redis restarted or
    /// `SCRIPT FLUSH`, on any node) are sent again, in order, after
    /// `SCRIPT LOAD` (on every node of a cluster); the others keep their
    /// replies (re-running a script that already ran would not be idempotent
    /// for relay entries).
    async fn eval_batch(
        &self,
        script: &Script,
        pipe: Pipeline,
        idempotent: bool,
        context: &str,
    ) -> Result<Vec<Value>, StoreError> {
        self.eval_batch_each(script, pipe, idempotent, context)
            .await?
            .into_iter()
            .collect()
    }

    /// [`Self::eval_batch`] with one result per command: on a cluster, the
    /// commands of a node that failed get an error and the others their
    /// replies ([`Self::query_pipeline_each`]).
    async fn eval_batch_each(
        &self,
        script: &Script,
        pipe: Pipeline,
        idempotent: bool,
        context: &str,
    ) -> Result<Vec<Result<Value, StoreError>>, StoreError> {
        let mut values = self.query_pipeline_each(&pipe, idempotent, context).await?;
        let missing: Vec<usize> = values
            .iter()
            .enumerate()
            .filter(|(_, v)| v.as_ref().is_ok_and(is_noscript))
            .map(|(i, _)| i)
            .collect();
        if missing.is_empty() {
            return Ok(values);
        }
        let mut conn = self.conn.clone();
        script
            .load_async(&mut conn)
            .await
            .map_err(|e| unavailable("SCRIPT LOAD", &e))?;
        let cmds: Vec<&Cmd> = pipe.cmd_iter().collect();
        let mut retry = pipeline();
        for &i in &missing {
            let cmd = cmds
                .get(i)
                .ok_or_else(|| corrupt(format!("{context}: reply index out of range")))?;
            retry.add_command((*cmd).clone());
        }
        let again = self
            .query_pipeline_each(&retry, idempotent, context)
            .await?;
        for (i, v) in missing.into_iter().zip(again) {
            if let Some(slot) = values.get_mut(i) {
                *slot = v;
            }
        }
        Ok(values)
    }

    /// Runs one `EVALSHA`, loading the script on `NOSCRIPT`.
    pub(crate) async fn eval(
        &self,
        script: &Script,
        cmd: Cmd,
        idempotent: bool,
        context: &str,
    ) -> Result<Value, StoreError> {
        let mut pipe = pipeline();
        pipe.add_command(cmd);
        let values = self.eval_batch(script, pipe, idempotent, context).await?;
        values
            .into_iter()
            .next()
            .ok_or_else(|| corrupt(format!("{context}: no reply")))
    }

    /// Makes sure the indexes list this delegation as its state says.
    /// Idempotent; run after `open` created or found it.
    async fn index(&self, meta: &DelegationMeta) -> Result<(), StoreError> {
        let member = meta.key.to_string();
        let mut pipe = pipeline();
        pipe.sadd(peer_set_key(&meta.key.caller), &member)
            .sadd(peer_set_key(&meta.callee), &member);
        match (meta.terminal, meta.terminal_ms) {
            (Some(_), Some(at)) => {
                pipe.zrem(DEADLINES_KEY, deadline_member(meta.deadline_ms, &meta.key))
                    .zadd(
                        FINISHED_KEY,
                        finished_member(at, &meta.key, &meta.callee),
                        0,
                    );
            }
            _ => {
                pipe.zadd(
                    DEADLINES_KEY,
                    deadline_member(meta.deadline_ms, &meta.key),
                    0,
                );
            }
        }
        let values = self.query_pipeline(&pipe, true, "index").await?;
        first_error(&values, "index")
    }

    /// Moves finished delegations from the deadline index to the finished
    /// index. A failure is only logged: the appends are durable, and the
    /// readers of the indexes skip stale entries.
    async fn index_finished(&self, finished: &[Finished]) {
        let mut pipe = pipeline();
        for f in finished {
            pipe.zrem(DEADLINES_KEY, deadline_member(f.deadline_ms, &f.key))
                .zadd(
                    FINISHED_KEY,
                    finished_member(f.terminal_ms, &f.key, &f.callee),
                    0,
                );
        }
        let result = match self.query_pipeline(&pipe, true, "index").await {
            Ok(values) => first_error(&values, "index"),
            Err(e) => Err(e),
        };
        if let Err(e) = result {
            tracing::warn!(error = %e, count = finished.len(), "finished-delegation index update failed");
        }
    }

    /// Metas of `keys` (None where gone), one round trip.
    async fn metas(
        &self,
        keys: &[DelegationKey],
    ) -> Result<Vec<Option<DelegationMeta>>, StoreError> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let mut pipe = pipeline();
        for k in keys {
            pipe.hgetall(DelegationKeys::new(k).meta);
        }
        let values = self.query_pipeline(&pipe, true, "HGETALL").await?;
        keys.iter()
            .zip(values)
            .map(|(k, v)| {
                let fields = hash_fields(v)?;
                if fields.is_empty() {
                    Ok(None)
                } else {
                    parse_meta(k, &fields).map(Some)
                }
            })
            .collect()
    }
}

/// A delay in whole milliseconds, as the cluster client's retry settings take it.
fn duration_ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// Whether a failed command may be sent again: the connection was lost (the
/// connection manager is reconnecting), or a cluster node refused it for now
/// (`TRYAGAIN`, `CLUSTERDOWN`, a redirection the cluster connection could
/// not follow in its own retries), not a timeout (which may have run).
fn retryable(e: &RedisError) -> bool {
    (e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_unrecoverable_error()
        || e.is_cluster_error())
        && !e.is_timeout()
}

/// The commands of `pipe` grouped by the hash slot of their first key, as
/// indexes into the pipeline: groups in the order of their first command,
/// commands in pipeline order within a group. Commands without a key form
/// one group of their own.
fn slot_groups(pipe: &Pipeline) -> Vec<Vec<usize>> {
    let mut groups: Vec<Vec<usize>> = Vec::new();
    let mut by_slot: HashMap<Option<Slot>, usize> = HashMap::new();
    for (i, cmd) in pipe.cmd_iter().enumerate() {
        let slot = first_key(cmd).map(Slot::for_key);
        let group = *by_slot.entry(slot).or_insert_with(|| {
            groups.push(Vec::new());
            groups.len() - 1
        });
        if let Some(g) = groups.get_mut(group) {
            g.push(i);
        }
    }
    groups
}

/// The first key of a command: the argument after the command name, or for
/// the scripting commands the first one after `numkeys`. `None` for a
/// command without keys.
fn first_key(cmd: &Cmd) -> Option<&[u8]> {
    const SCRIPTED: [&[u8]; 6] = [
        b"EVAL",
        b"EVALSHA",
        b"EVAL_RO",
        b"EVALSHA_RO",
        b"FCALL",
        b"FCALL_RO",
    ];
    let mut args = cmd.args_iter().map(|a| match a {
        redis::Arg::Simple(bytes) => Some(bytes),
        _ => None,
    });
    let name = args.next()??;
    if SCRIPTED.iter().any(|s| name.eq_ignore_ascii_case(s)) {
        let _script = args.next()??;
        let numkeys: usize = std::str::from_utf8(args.next()??).ok()?.parse().ok()?;
        if numkeys == 0 {
            return None;
        }
    }
    args.next()?
}

/// The first server error among pipeline replies, as `Unavailable`.
fn first_error(values: &[Value], context: &str) -> Result<(), StoreError> {
    match values.iter().find_map(|v| match v {
        Value::ServerError(e) => Some(e),
        _ => None,
    }) {
        Some(e) => Err(StoreError::Unavailable(format!("redis {context}: {e}"))),
        None => Ok(()),
    }
}

impl EventStore for RedisStore {
    async fn open(&self, req: OpenRequest) -> Result<OpenOutcome, StoreError> {
        let keys = DelegationKeys::new(&req.key);
        let mut cmd = evalsha(&self.scripts.open, &[&keys.meta, &keys.down, &keys.up]);
        cmd.arg(req.callee.as_str())
            .arg(req.deadline_ms)
            .arg(req.digest.to_string())
            .arg(req.now_ms)
            .arg(req.frame.as_ref())
            .arg(self.maxlen)
            .arg(req.wake.as_ref().map(wake_channel).unwrap_or_default());
        let reply = self.eval(&self.scripts.open, cmd, false, "open").await?;
        let mut items = array(reply, "open")?.into_iter();
        let code = items.next();
        match code.as_ref().and_then(str_of) {
            Some("N") => {
                let meta = DelegationMeta {
                    key: req.key,
                    callee: req.callee,
                    deadline_ms: req.deadline_ms,
                    digest: req.digest,
                    created_ms: req.now_ms,
                    down_tail: 1,
                    up_tail: 0,
                    down_sender_tail: 1,
                    up_sender_tail: 0,
                    terminal: None,
                    terminal_ms: None,
                    accepted_by: None,
                };
                // The delegation is durable, but until it is indexed the
                // deadline sweeper cannot see it: report failure so the
                // sender retries, and the retry (`Existing`) indexes it.
                self.index(&meta).await?;
                Ok(OpenOutcome::Created(meta))
            }
            Some("E") => {
                let fields = hash_fields(Value::Array(items.collect()))?;
                let meta = parse_meta(&req.key, &fields)?;
                self.index(&meta).await?;
                Ok(if meta.digest == req.digest {
                    OpenOutcome::Existing(meta)
                } else {
                    OpenOutcome::Mismatch(meta)
                })
            }
            other => Err(corrupt(format!("open: unexpected reply {other:?}"))),
        }
    }

    async fn append(&self, reqs: Vec<AppendRequest>) -> Result<Vec<AppendOutcome>, StoreError> {
        if reqs.is_empty() {
            return Ok(Vec::new());
        }
        let mut pipe = pipeline();
        for req in &reqs {
            let keys = DelegationKeys::new(&req.key);
            let (log, other) = keys.logs(req.dir);
            let mut cmd = evalsha(&self.scripts.append, &[&keys.meta, log, other]);
            cmd.arg(match req.dir {
                Direction::Down => "d",
                Direction::Up => "u",
            })
            .arg(req.seq);
            match req.origin {
                Origin::Relay => cmd.arg("r"),
                Origin::Peer(instance) => cmd.arg(instance.to_hex()),
            };
            cmd.arg(req.terminal.map_or("", Outcome::name))
                .arg(req.frame.as_ref())
                .arg(req.now_ms)
                .arg(self.maxlen)
                .arg(self.ttl_ms)
                .arg(req.wake.as_ref().map(wake_channel).unwrap_or_default());
            pipe.add_command(cmd);
        }
        let replies = self
            .eval_batch_each(&self.scripts.append, pipe, false, "append")
            .await?;
        let mut outcomes = Vec::with_capacity(reqs.len());
        let mut finished = Vec::new();
        for (req, reply) in reqs.iter().zip(replies) {
            let Ok(reply) = reply else {
                // Its shard did not answer; the others went on.
                outcomes.push(AppendOutcome::Unavailable);
                continue;
            };
            let (outcome, fin) = parse_append(req, reply)?;
            outcomes.push(outcome);
            finished.extend(fin);
        }
        if !finished.is_empty() {
            self.index_finished(&finished).await;
        }
        Ok(outcomes)
    }

    async fn read(
        &self,
        key: &DelegationKey,
        dir: Direction,
        after: u64,
        limit: usize,
    ) -> Result<ReadOutcome, StoreError> {
        let keys = DelegationKeys::new(key);
        let (log, _) = keys.logs(dir);
        let tail_field = match dir {
            Direction::Down => field::DOWN_TAIL,
            Direction::Up => field::UP_TAIL,
        };
        let mut cmd = evalsha(&self.scripts.read, &[&keys.meta, log]);
        cmd.arg(tail_field)
            .arg(after)
            // Only used when after <= tail, so it does not overflow in practice.
            .arg(after.saturating_add(1))
            .arg(
                u64::try_from(limit)
                    .unwrap_or(u64::MAX)
                    .min(i64::MAX as u64),
            );
        let reply = self.eval(&self.scripts.read, cmd, true, "read").await?;
        parse_read(reply)
    }

    async fn meta(&self, key: &DelegationKey) -> Result<Option<DelegationMeta>, StoreError> {
        let mut cmd = redis::cmd("HGETALL");
        cmd.arg(DelegationKeys::new(key).meta);
        let fields = hash_fields(self.query(&cmd, true, "HGETALL").await?)?;
        if fields.is_empty() {
            return Ok(None);
        }
        parse_meta(key, &fields).map(Some)
    }

    async fn delegations_of(&self, peer: &PeerId) -> Result<Vec<DelegationMeta>, StoreError> {
        let set = peer_set_key(peer);
        let mut cmd = redis::cmd("SMEMBERS");
        cmd.arg(&set);
        let members = match self.query(&cmd, true, "SMEMBERS").await? {
            Value::Array(items) | Value::Set(items) => items,
            other => {
                return Err(corrupt(format!(
                    "SMEMBERS: unexpected reply {}",
                    shown(&other)
                )));
            }
        };
        let mut stale: Vec<Value> = Vec::new();
        let mut keys = Vec::with_capacity(members.len());
        for m in members {
            match str_of(&m).and_then(parse_key) {
                Some(k) => keys.push(k),
                None => stale.push(m),
            }
        }
        let metas = self.metas(&keys).await?;
        let mut out = Vec::with_capacity(keys.len());
        for (key, meta) in keys.into_iter().zip(metas) {
            match meta {
                Some(meta) if meta.involves(peer) => out.push(meta),
                // Expired (by Redis or `expire_finished`), or a newer
                // delegation with the same key and another callee.
                _ => stale.push(Value::BulkString(key.to_string().into_bytes())),
            }
        }
        if !stale.is_empty() {
            let mut cmd = redis::cmd("SREM");
            cmd.arg(&set);
            for m in &stale {
                if let Some(b) = bytes_of(m) {
                    cmd.arg(b);
                }
            }
            self.query(&cmd, true, "SREM").await?;
        }
        out.sort_by(|a, b| a.key.cmp(&b.key));
        Ok(out)
    }

    async fn due(&self, now_ms: u64, limit: usize) -> Result<Vec<DelegationKey>, StoreError> {
        let mut out: Vec<DelegationKey> = Vec::new();
        let upper = lex_upper_bound(now_ms);
        // Each round either fills the page or removes at least one stale
        // member, so this ends.
        while out.len() < limit {
            let want = limit - out.len();
            let mut cmd = redis::cmd("ZRANGEBYLEX");
            cmd.arg(DEADLINES_KEY)
                .arg("-")
                .arg(&upper)
                .arg("LIMIT")
                .arg(out.len())
                .arg(u64::try_from(want).unwrap_or(u64::MAX).min(i64::MAX as u64));
            let members = match self.query(&cmd, true, "ZRANGEBYLEX").await? {
                Value::Array(items) => items,
                other => {
                    return Err(corrupt(format!(
                        "ZRANGEBYLEX: unexpected reply {}",
                        shown(&other)
                    )));
                }
            };
            if members.is_empty() {
                break;
            }
            let fetched = members.len();
            let mut candidates = Vec::with_capacity(fetched);
            let mut stale: Vec<Vec<u8>> = Vec::new();
            for m in members {
                match str_of(&m).and_then(parse_deadline_member) {
                    Some(c) => candidates.push((c, m)),
                    None => stale.extend(bytes_of(&m).map(<[u8]>::to_vec)),
                }
            }
            let keys: Vec<DelegationKey> = candidates.iter().map(|((_, k), _)| k.clone()).collect();
            let metas = self.metas(&keys).await?;
            for (((deadline, key), member), meta) in candidates.into_iter().zip(metas) {
                match meta {
                    Some(m) if m.terminal.is_none() && m.deadline_ms == deadline => out.push(key),
                    _ => stale.extend(bytes_of(&member).map(<[u8]>::to_vec)),
                }
            }
            if stale.is_empty() {
                if fetched < want {
                    break;
                }
                continue;
            }
            let mut cmd = redis::cmd("ZREM");
            cmd.arg(DEADLINES_KEY);
            for m in &stale {
                cmd.arg(m.as_slice());
            }
            self.query(&cmd, true, "ZREM").await?;
            if fetched < want {
                break;
            }
        }
        Ok(out)
    }

    async fn expire_finished(&self, now_ms: u64) -> Result<u64, StoreError> {
        let cutoff = now_ms.saturating_sub(self.retention.finished_ttl_ms);
        let upper = lex_upper_bound(cutoff);
        let mut expired = 0u64;
        loop {
            let mut cmd = redis::cmd("ZRANGEBYLEX");
            cmd.arg(FINISHED_KEY)
                .arg("-")
                .arg(&upper)
                .arg("LIMIT")
                .arg(0)
                .arg(EXPIRE_CHUNK);
            let members = match self.query(&cmd, true, "ZRANGEBYLEX").await? {
                Value::Array(items) => items,
                other => {
                    return Err(corrupt(format!(
                        "ZRANGEBYLEX: unexpected reply {}",
                        shown(&other)
                    )));
                }
            };
            if members.is_empty() {
                break;
            }
            let fetched = members.len();
            let mut parsed = Vec::with_capacity(fetched);
            let mut scripts = pipeline();
            for m in members {
                let target = str_of(&m).and_then(parse_finished_member);
                let member = match m {
                    Value::BulkString(b) => b,
                    other => return Err(corrupt(format!("ZRANGEBYLEX: member {}", shown(&other)))),
                };
                if let Some((at, key, _)) = &target {
                    let keys = DelegationKeys::new(key);
                    let mut cmd =
                        evalsha(&self.scripts.expire, &[&keys.meta, &keys.down, &keys.up]);
                    cmd.arg(*at);
                    scripts.add_command(cmd);
                }
                parsed.push((member, target));
            }
            let mut gone = if scripts.is_empty() {
                Vec::new()
            } else {
                self.eval_batch(&self.scripts.expire, scripts, true, "expire")
                    .await?
            }
            .into_iter();
            // Per member: ZREM from the index (its reply position and whether
            // the delegation is gone), then the peer sets if it is.
            let mut cleanup = pipeline();
            let mut counted = Vec::with_capacity(parsed.len());
            for (member, target) in parsed {
                let position = cleanup.len();
                cleanup.zrem(FINISHED_KEY, member);
                let Some((_, key, callee)) = target else {
                    // Unreadable: drop it from the index, count nothing.
                    continue;
                };
                let reply = gone.next().unwrap_or(Value::Nil);
                if let Value::ServerError(e) = &reply {
                    return Err(StoreError::Unavailable(format!("redis expire: {e}")));
                }
                if u64_of(&reply) == Some(1) {
                    let k = key.to_string();
                    cleanup
                        .srem(peer_set_key(&key.caller), &k)
                        .srem(peer_set_key(&callee), &k);
                    counted.push(position);
                }
            }
            let removed = self.query_pipeline(&cleanup, true, "expire").await?;
            first_error(&removed, "expire")?;
            // Count an entry once, by whoever removed it from the index.
            expired += counted
                .into_iter()
                .filter(|&i| removed.get(i).and_then(u64_of) == Some(1))
                .count() as u64;
            if fetched < EXPIRE_CHUNK {
                break;
            }
        }
        Ok(expired)
    }

    async fn put_descriptor(&self, peer: &PeerId, descriptor: Bytes) -> Result<(), StoreError> {
        let mut cmd = redis::cmd("SET");
        cmd.arg(descriptor_key(peer)).arg(descriptor.as_ref());
        match self.query(&cmd, true, "SET").await? {
            Value::Okay => Ok(()),
            other => Err(corrupt(format!("SET: unexpected reply {}", shown(&other)))),
        }
    }

    async fn descriptor(&self, peer: &PeerId) -> Result<Option<Bytes>, StoreError> {
        let mut cmd = redis::cmd("GET");
        cmd.arg(descriptor_key(peer));
        match self.query(&cmd, true, "GET").await? {
            Value::Nil => Ok(None),
            Value::BulkString(b) => Ok(Some(Bytes::from(b))),
            other => Err(corrupt(format!("GET: unexpected reply {}", shown(&other)))),
        }
    }

    async fn epoch(&self) -> Result<u64, StoreError> {
        // SET NX creates it on first use, and again after Redis lost its data
        // (restart without persistence): then it differs, which is the point.
        let mut pipe = pipeline();
        pipe.cmd("SET")
            .arg(EPOCH_KEY)
            .arg(super::memory::rand_epoch())
            .arg("NX")
            .get(EPOCH_KEY);
        let values = self.query_pipeline(&pipe, true, "epoch").await?;
        let v = values.get(1).ok_or_else(|| corrupt("epoch: no reply"))?;
        match u64_of(v) {
            Some(epoch) if epoch != 0 => Ok(epoch),
            _ => Err(corrupt(format!(
                "{EPOCH_KEY} holds {}, not a non-zero u64",
                shown(v)
            ))),
        }
    }

    async fn ping(&self) -> Result<(), StoreError> {
        let cmd = redis::cmd("PING");
        match self.query(&cmd, true, "PING").await? {
            Value::SimpleString(s) if s == "PONG" => Ok(()),
            other => Err(corrupt(format!("PING: unexpected reply {}", shown(&other)))),
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::*;

    #[test]
    fn members_order_like_keys_and_numbers() {
        let k = |c: &str, r: &str| {
            DelegationKey::new(PeerId::new(c).unwrap(), RequestId::new(r).unwrap())
        };
        let keys = [
            k("a/b", "z"),
            k("a/b-", "a"),
            k("a/bc", "a"),
            k("a/b", "y0"),
        ];
        let mut by_ord = keys.to_vec();
        by_ord.sort();
        let mut by_member = keys.to_vec();
        by_member.sort_by_key(|k| deadline_member(7, k));
        assert_eq!(by_ord, by_member);
        assert!(deadline_member(9, &keys[0]) < deadline_member(10, &keys[0]));
        assert!(deadline_member(u64::MAX, &keys[0]).starts_with("18446744073709551615|"));
        assert_eq!(lex_upper_bound(9), "(00000000000000000010");
        assert_eq!(lex_upper_bound(u64::MAX), "+");
        let m = finished_member(5, &keys[1], &keys[2].caller);
        assert_eq!(
            parse_finished_member(&m),
            Some((5, keys[1].clone(), keys[2].caller.clone()))
        );
        assert_eq!(
            parse_deadline_member(&deadline_member(3, &keys[3])),
            Some((3, keys[3].clone()))
        );
    }

    #[test]
    fn instance_hex_round_trips() {
        let i = InstanceId::random();
        assert_eq!(parse_instance(&i.to_hex()), Some(i));
        assert_eq!(parse_instance("zz"), None);
    }

    #[test]
    fn urls_are_redacted() {
        assert_eq!(
            redact_url("redis://user:secret@h:6379/0"),
            "redis://h:6379/0"
        );
        assert_eq!(
            redact_url("redis+unix:///tmp/r.sock?pass=secret"),
            "redis+unix:///tmp/r.sock"
        );
        assert_eq!(redact_url("redis://:pw@h"), "redis://h");
        assert_eq!(
            redact_url("redis-cluster://u:secret@h1:7000,h2:7001"),
            "redis-cluster://h1:7000,h2:7001"
        );
    }

    #[test]
    fn cluster_urls_name_the_seeds() {
        assert!(is_cluster_url("redis-cluster://h:1"));
        assert!(is_cluster_url("Redis-Cluster://h:1"));
        assert!(!is_cluster_url("redis://h:1"));
        assert_eq!(
            cluster_seed_urls("redis-cluster://127.0.0.1:7000,127.0.0.1:7001,h3").unwrap(),
            vec![
                "redis://127.0.0.1:7000",
                "redis://127.0.0.1:7001",
                "redis://h3:6379"
            ]
        );
        assert_eq!(
            cluster_seed_urls("redis-cluster://user:p%40ss@a:1,[::1]:2,[::2]/").unwrap(),
            vec![
                "redis://user:p%40ss@a:1",
                "redis://user:p%40ss@[::1]:2",
                "redis://user:p%40ss@[::2]:6379"
            ]
        );
        for bad in [
            "redis-cluster://",
            "redis-cluster://a:1,",
            "redis-cluster://a:1,u:p@b:2",
            "redis-cluster://a:x",
            "redis-cluster://a:0",
            "redis-cluster://a:1/0",
            "redis-cluster://a:1?protocol=resp3",
            "redis-cluster://[::1",
            "redis-cluster://[::1]x",
            "redis://a:1",
        ] {
            let e = cluster_seed_urls(bad).unwrap_err();
            assert!(!e.contains("secret"), "{e}");
        }
        let e = cluster_seed_urls("redis-cluster://u:secret@a:1,u:secret@b:2").unwrap_err();
        assert!(!e.contains("secret"), "{e}");
    }

    #[test]
    fn pipelines_split_by_slot_of_the_first_key() {
        let script = Script::new("return 1");
        let k = |c: &str, r: &str| {
            DelegationKey::new(PeerId::new(c).unwrap(), RequestId::new(r).unwrap())
        };
        let a = DelegationKeys::new(&k("acme/a", "r1"));
        let b = DelegationKeys::new(&k("acme/b", "r1"));
        assert_ne!(Slot::for_key(&a.meta), Slot::for_key(&b.meta));
        assert_eq!(Slot::for_key(&a.meta), Slot::for_key(&a.up));
        let mut pipe = pipeline();
        pipe.add_command(evalsha(&script, &[&a.meta, &a.down, &a.up]))
            .add_command(evalsha(&script, &[&b.meta, &b.down, &b.up]))
            .zadd(DEADLINES_KEY, "m", 0)
            .add_command(evalsha(&script, &[&a.meta, &a.up, &a.down]))
            .cmd("PING")
            .hgetall(&b.meta)
            .add_command(evalsha(&script, &[]));
        assert_eq!(
            slot_groups(&pipe),
            vec![vec![0, 3], vec![1, 5], vec![2], vec![4, 6]]
        );
        let cmds: Vec<&Cmd> = pipe.cmd_iter().collect();
        assert_eq!(first_key(cmds[0]), Some(a.meta.as_bytes()));
        assert_eq!(first_key(cmds[2]), Some(DEADLINES_KEY.as_bytes()));
        assert_eq!(first_key(cmds[4]), None);
        assert_eq!(first_key(cmds[6]), None);
    }
}
