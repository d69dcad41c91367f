//! The Redis store: the production backend, same observable semantics as
//! [`MemoryStore`](super::MemoryStore) (the shared conformance tests run both).
//!
//! This module owns the [`RedisStore`] type, connecting (single server or
//! cluster), the cross-delegation indexes and the [`EventStore`]
//! implementation: each operation builds its commands here and hands them
//! to the modules below. It never formats a key name (`keys`), never holds
//! a script's text (`scripts`), and sends every command of an operation
//! through `cluster`, which decides how it reaches the nodes.
//!
//! | module | owns |
//! |---|---|
//! | `keys` | key names, hash tags, index members and their parsers (the key layout) |
//! | `scripts` | the Lua scripts (`lua/*.lua`), `EVALSHA` commands, `SCRIPT LOAD` at connect |
//! | `replies` | reply parsing: meta hashes, script replies, fleet replies, the errors they become |
//! | `cluster` | sending commands: retries, pipelines split per hash slot, `NOSCRIPT` reload |
//! | `connection` | the connection: requests driven by a task of the store's own (no caller can hold it up), and the watchdog that replaces a connection that stopped answering |
//! | `url` | URL parsing (`redis-cluster://` seeds) and credential redaction |
//! | `fleet` | the [`FleetStore`](super::FleetStore) implementation: presence, liveness, leases, wake-ups |
//!
//! Every key of one delegation carries the same hash tag,
//! `{<caller>#<request_id>}`, so Redis Cluster keeps the delegation on one
//! shard and its scripts touch a single slot; the full layout is in `keys.rs`.
//!
//! # Atomicity
//!
//! `open`, `append`, `read` and the expiry of one delegation are each one Lua
//! script over that delegation's keys (`open` on a single server also over
//! the index keys, below; `EVALSHA`, loaded with
//! `SCRIPT LOAD` on `NOSCRIPT`). The scripts never format numbers with Lua's
//! `tostring` (it switches to exponent notation above 1e14): times arrive as
//! decimal strings from Rust, and the sequences of a run (its first one
//! from Rust, the others one by one after it) are written with
//! `string.format('%d')` or passed to `redis.call` as numbers, which Redis
//! formats with `%.17g`: both exact for every integer a double holds (up to
//! 2^53, where a log's tail, one more per append, never gets). When a terminal is
//! set, the script also sets `PEXPIRE finished_ttl_ms` on the delegation's
//! keys, so Redis itself drops finished delegations.
//!
//! The cross-delegation indexes (peer sets, deadlines, finished) are updated
//! with separate single-key commands after the script, which is what Redis
//! Cluster allows; on a single server the `open` script indexes the
//! delegation it creates itself (one round trip per open), and the `append`
//! script of a batch with the callee's terminal moves the delegation from
//! the open indexes to the finished one itself (the terminal is then
//! delivered one round trip sooner; a terminal the relay writes, on expiry
//! for one, is still indexed after its script), and the `expire` script
//! of a finished delegation takes it out of `oab:finished` and the peer
//! sets and gives its bytes back to both peers' budgets (one call per
//! delegation instead of three, and one round trip per chunk). They can
//! therefore be stale (a crash between the script and the index update, or
//! `PEXPIRE` dropping a delegation): every reader checks candidates against
//! the meta hash and removes stale members, and an `open` that finds an
//! existing delegation re-adds its index entries.
//!
//! # Batches and failures
//!
//! `append` sends the whole batch as one pipeline of `EVALSHA`s, one per
//! delegation in the batch (a run of one delegation's entries is one script
//! call: its meta hash is read and written once, its logs trimmed once), one
//! round trip after the peer budget's (plus one for the indexes when an
//! entry set a terminal; on a single server a batch is one round trip, the
//! budgets and the callee's terminal's index in its script). If Redis
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

mod cluster;
mod connection;
mod fleet;
mod keys;
mod replies;
mod scripts;
mod shards;
mod url;

pub use self::url::{RedactedUrl, describe_store_url};

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use oab_wire::{DelegationKey, Direction, InstanceId, Outcome, PeerId};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClientBuilder;
use redis::{Pipeline, RedisError, Value};

use self::cluster::pipeline;
use self::connection::{Conn, Connection, Dial};
use self::keys::{
    DEADLINES_KEY, DelegationKeys, EPOCH_KEY, FINISHED_KEY, deadline_member, descriptor_key,
    finished_member, lex_upper_bound, meta_field, parse_deadline_member, parse_finished_member,
    parse_key, peer_bytes_key, peer_open_key, peer_set_key,
};
use self::replies::{
    Finished, GroupReply, bytes_of, corrupt, excerpt, first_error, hash_fields, parse_append,
    parse_meta, parse_read, reply_array, split_append, str_of, u64_of,
};
use self::scripts::{Scripts, evalsha};
use self::url::{RedactedUrls, cluster_seed_urls, is_cluster_url, redact_url};
use super::{
    AppendOutcome, AppendRequest, DelegationMeta, EventStore, OpenOutcome, OpenRequest, Origin,
    ReadOutcome, Retention, StoreError, wake_channel,
};

/// How long one command (or one pipelined batch) may take before it fails.
/// The redis crate's default is 500 ms, which a batch of a few hundred
/// appends behind an AOF rewrite or a busy shard can exceed; a dead server
/// is detected by the connection itself, so this only bounds a stuck one.
/// A connection on which a request got no answer for this long, and that
/// answered nothing else meanwhile, is replaced (`connection`).
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
/// Attempts the cluster connection makes per command after a failure
/// (reconnect, `TRYAGAIN`, `CLUSTERDOWN`, redirections), with backoff from
/// [`RECONNECT_MIN_DELAY`] to [`RECONNECT_MAX_DELAY`]; the whole command,
/// retries included, is bounded by [`RESPONSE_TIMEOUT`].
const CLUSTER_RETRIES: u32 = 5;
/// Requests a single server's connection takes into its writer's queue
/// without making the sender wait (the redis crate's default is 50). A
/// request that finds that queue full waits its turn, and one that finds
/// room is sent at once, so a request made later can overtake a waiting
/// one: a session's append batches in flight would then reach Redis out of
/// order (the later one refused as a hole, and resent). Only requests in
/// flight are queued (each bounded by [`RESPONSE_TIMEOUT`], and gone with
/// its connection when the watchdog replaces it), and the queue takes
/// memory only for what it holds, so this is set far above any load.
const WRITER_QUEUE: usize = 1 << 20;
/// Members of `oab:finished` handled per round trip by `expire_finished`.
const EXPIRE_CHUNK: usize = 512;
/// A member of `oab:finished` as read (its bytes) and parsed: terminal ms,
/// the delegation and its callee (`None`: unreadable).
type FinishedEntry = (Vec<u8>, Option<(u64, DelegationKey, PeerId)>);
/// Largest `PEXPIRE` argument sent: Redis refuses values whose absolute
/// expiry overflows an i64 of milliseconds; 2^53 ms is about 285,000 years.
const MAX_TTL_MS: u64 = 1 << 53;

/// The Redis store. Cheap to share (`Arc` it); all methods take `&self` and
/// run over one multiplexed connection (one per node for a cluster) that
/// reconnects by itself, and is replaced when it stops answering.
#[derive(Debug)]
pub struct RedisStore {
    conn: Connection,
    /// `oab_store_connections_replaced_total`: the connection's
    /// replacements (see [`EventStore::register_metrics`]).
    replaced: prometheus::IntCounter,
    /// What [`RedisStore::pubsub_urls`] returns.
    pubsub_urls: RedactedUrls,
    retention: Retention,
    scripts: Scripts,
    /// `max_log_entries` as sent to `XADD MAXLEN` (clamped to an i64).
    maxlen: u64,
    /// `finished_ttl_ms` as sent to `PEXPIRE` (clamped, see [`MAX_TTL_MS`]).
    ttl_ms: u64,
    /// On a cluster: its masters and slots, for readiness and for errors
    /// that name the shard that failed.
    shards: Option<self::shards::Shards>,
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
            StoreError::unavailable(
                format!("connect to Redis at {shown}"),
                format!("invalid Redis URL: {e}"),
            )
        };
        let cannot_connect =
            |e: RedisError| StoreError::unavailable(format!("connect to Redis at {shown}"), e);
        let (first, dial, pubsub_urls) = if is_cluster_url(url) {
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
            (Conn::Cluster(conn), Dial::Cluster { client }, seeds)
        } else {
            let client = redis::Client::open(url).map_err(|e| invalid(&e))?;
            let config = ConnectionManagerConfig::new()
                .set_response_timeout(Some(RESPONSE_TIMEOUT))
                .set_connection_timeout(Some(CONNECTION_TIMEOUT))
                .set_number_of_retries(RECONNECT_RETRIES)
                .set_min_delay(RECONNECT_MIN_DELAY)
                .set_max_delay(RECONNECT_MAX_DELAY)
                .set_pipeline_buffer_size(WRITER_QUEUE);
            let conn = ConnectionManager::new_with_config(client.clone(), config.clone())
                .await
                .map_err(cannot_connect)?;
            (
                Conn::Single(conn),
                Dial::Single { client, config },
                vec![url.to_owned()],
            )
        };
        let shards =
            matches!(first, Conn::Cluster(_)).then(|| self::shards::Shards::new(&pubsub_urls));
        let replaced = replacement_counter();
        let conn = Connection::new(
            first,
            dial,
            RESPONSE_TIMEOUT,
            shown.to_string(),
            replaced.clone(),
        );
        let store = RedisStore {
            shards,
            conn,
            replaced,
            pubsub_urls: RedactedUrls(pubsub_urls),
            retention,
            scripts: Scripts::new(),
            maxlen: retention.max_log_entries.min(i64::MAX as u64),
            ttl_ms: retention.finished_ttl_ms.min(MAX_TTL_MS),
        };
        store.load_scripts().await?;
        store.warn_about_durability().await;
        if let Some(shards) = &store.shards
            && let Err(e) = shards.check().await
        {
            tracing::warn!(error = %e, "Redis Cluster not fully reachable");
        }
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
        self.conn.is_cluster()
    }

    /// How many times the store's connection was replaced because it
    /// stopped answering (`oab_store_connections_replaced_total`).
    pub fn connections_replaced(&self) -> u64 {
        self.replaced.get()
    }

    /// A value of `CONFIG GET name`, or `None` when Redis refuses the command
    /// (managed Redis services often do) or answers something else.
    async fn config_value(&self, name: &str) -> Option<String> {
        let mut cmd = redis::cmd("CONFIG");
        cmd.arg("GET").arg(name);
        let reply = self.conn.command(None, Arc::new(cmd)).await;
        match reply {
            Ok(Value::Array(items)) => items.get(1).and_then(str_of).map(str::to_owned),
            Ok(Value::Map(pairs)) => pairs
                .first()
                .and_then(|(_, v)| str_of(v))
                .map(str::to_owned),
            _ => None,
        }
    }

    /// Eviction silently loses logs, and without the AOF a Redis restart
    /// loses everything acknowledged since the last snapshot: say so at
    /// start. Best effort: where `CONFIG GET` is refused nothing is said.
    async fn warn_about_durability(&self) {
        let policy = self.config_value("maxmemory-policy").await;
        let appendonly = self.config_value("appendonly").await;
        for warning in durability_warnings(policy.as_deref(), appendonly.as_deref()) {
            tracing::warn!("{warning}");
        }
    }

    /// Up to `count` members of the index zset `key` below `upper`
    /// (`ZRANGEBYLEX key - upper LIMIT offset count`).
    async fn range_below(
        &self,
        key: &str,
        upper: &str,
        offset: u64,
        count: u64,
    ) -> Result<Vec<Value>, StoreError> {
        let mut cmd = redis::cmd("ZRANGEBYLEX");
        cmd.arg(key)
            .arg("-")
            .arg(upper)
            .arg("LIMIT")
            .arg(offset)
            .arg(count);
        match self.query(&cmd, true, "ZRANGEBYLEX").await? {
            Value::Array(items) => Ok(items),
            other => Err(corrupt(format!(
                "ZRANGEBYLEX: unexpected reply {}",
                excerpt(&other)
            ))),
        }
    }

    /// Makes sure the indexes list this delegation as its state says.
    /// Idempotent; run after `open` found it, and on a cluster after it
    /// created it (a single server's `open` script indexes what it creates).
    async fn ensure_indexed(&self, meta: &DelegationMeta) -> Result<(), StoreError> {
        let member = meta.key.to_string();
        let mut pipe = pipeline();
        pipe.sadd(peer_set_key(&meta.key.caller), &member)
            .sadd(peer_set_key(&meta.callee), &member);
        match (meta.terminal, meta.terminal_ms) {
            (Some(_), Some(at)) => {
                pipe.srem(peer_open_key(&meta.key.caller), &member)
                    .srem(peer_open_key(&meta.callee), &member);
                pipe.zrem(DEADLINES_KEY, deadline_member(meta.deadline_ms, &meta.key))
                    .zadd(
                        FINISHED_KEY,
                        finished_member(at, &meta.key, &meta.callee),
                        0,
                    );
            }
            _ => {
                pipe.sadd(peer_open_key(&meta.key.caller), &member)
                    .sadd(peer_open_key(&meta.callee), &member);
                pipe.zadd(
                    DEADLINES_KEY,
                    deadline_member(meta.deadline_ms, &meta.key),
                    0,
                );
            }
        }
        let values = self.query_pipeline(pipe, true, "index").await?;
        first_error(&values, "index")
    }

    /// Moves finished delegations from the deadline index to the finished
    /// index. A failure is only logged: the appends are durable, and the
    /// readers of the indexes skip stale entries.
    async fn index_finished(&self, finished: &[Finished]) {
        let mut pipe = pipeline();
        for f in finished {
            let member = f.key.to_string();
            pipe.srem(peer_open_key(&f.key.caller), &member)
                .srem(peer_open_key(&f.callee), &member);
            pipe.zrem(DEADLINES_KEY, deadline_member(f.deadline_ms, &f.key))
                .zadd(
                    FINISHED_KEY,
                    finished_member(f.terminal_ms, &f.key, &f.callee),
                    0,
                );
        }
        let result = match self.query_pipeline(pipe, true, "index").await {
            Ok(values) => first_error(&values, "index"),
            Err(e) => Err(e),
        };
        if let Err(e) = result {
            tracing::warn!(error = %e, count = finished.len(), "finished-delegation index update failed");
        }
    }

    /// The metas of the delegations in the peer index `set` that still
    /// involve `peer` (only those without a terminal when `open_only`);
    /// members that are gone, or finished in an index of open ones, are
    /// removed from the set.
    async fn delegations_in(
        &self,
        set: &str,
        peer: &PeerId,
        open_only: bool,
    ) -> Result<Vec<DelegationMeta>, StoreError> {
        let mut cmd = redis::cmd("SMEMBERS");
        cmd.arg(set);
        let members = match self.query(&cmd, true, "SMEMBERS").await? {
            Value::Array(items) | Value::Set(items) => items,
            other => {
                return Err(corrupt(format!(
                    "SMEMBERS: unexpected reply {}",
                    excerpt(&other)
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
        let mut gone = Vec::new();
        for (key, meta) in keys.into_iter().zip(metas) {
            match meta {
                Some(meta) if meta.involves(peer) && !(open_only && meta.terminal.is_some()) => {
                    out.push(meta);
                }
                // Finished, in the index of open ones: it stays stored.
                Some(meta) if meta.involves(peer) => {
                    stale.push(Value::BulkString(key.to_string().into_bytes()));
                }
                // Expired (by Redis or `expire_finished`), or a newer
                // delegation with the same key and another callee.
                _ => {
                    stale.push(Value::BulkString(key.to_string().into_bytes()));
                    gone.push(key);
                }
            }
        }
        // Their bytes leave the peer's budget (a repair: `expire_finished`
        // does it, unless the finished index missed the delegation).
        self.uncharge(gone.iter().map(|key| (peer, key, None)))
            .await;
        if !stale.is_empty() {
            let mut cmd = redis::cmd("SREM");
            cmd.arg(set);
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

    /// Charges each peer entry of an append batch to its sender's byte
    /// budget (`charge` script, before the append scripts: the budget hash
    /// and the delegation are in different hash slots). First one `charge`
    /// per sending peer for all its entries (a batch comes from one
    /// session, so usually one command); only a peer whose entries do not
    /// all fit is charged again entry by entry, in order, which gives each
    /// entry the answer it would get alone.
    async fn charge(&self, reqs: &[AppendRequest]) -> Result<Vec<Charge>, StoreError> {
        let mut charges: Vec<Charge> = reqs
            .iter()
            .map(|r| match r.origin {
                Origin::Relay => Charge::Exempt,
                Origin::Peer { .. } => Charge::Skipped,
            })
            .collect();
        let mut peers: Vec<(&PeerId, Vec<usize>)> = Vec::new();
        for (i, req) in reqs.iter().enumerate() {
            if let Origin::Peer { peer, .. } = &req.origin {
                match peers.iter_mut().find(|(p, _)| *p == peer) {
                    Some((_, entries)) => entries.push(i),
                    None => peers.push((peer, vec![i])),
                }
            }
        }
        if peers.is_empty() {
            return Ok(charges);
        }
        // One pair per delegation: a batch's entries of one delegation are
        // charged together (the script adds each pair to its member).
        let command = |peer: &PeerId, entries: &[usize]| {
            let mut cmd = evalsha(&self.scripts.charge, &[&peer_bytes_key(peer)]);
            cmd.arg(self.retention.max_peer_bytes);
            let mut pairs: Vec<(&DelegationKey, usize)> = Vec::new();
            let mut index: HashMap<&DelegationKey, usize> = HashMap::new();
            for req in entries.iter().filter_map(|&i| reqs.get(i)) {
                match index.get(&req.key).and_then(|&p| pairs.get_mut(p)) {
                    Some((_, bytes)) => *bytes += req.frame.len(),
                    None => {
                        index.insert(&req.key, pairs.len());
                        pairs.push((&req.key, req.frame.len()));
                    }
                }
            }
            for (key, bytes) in pairs {
                cmd.arg(key.to_string()).arg(bytes);
            }
            cmd
        };
        let mut pipe = pipeline();
        for (peer, entries) in &peers {
            pipe.add_command(command(peer, entries));
        }
        let Some(replies) = self.charge_replies(pipe).await? else {
            return Ok(charges);
        };
        let mut one_by_one = Vec::new();
        for ((peer, entries), reply) in peers.iter().zip(replies) {
            match reply {
                Ok(v) if u64_of(&v) == Some(1) => {
                    for &i in entries {
                        if let Some(c) = charges.get_mut(i) {
                            *c = Charge::Charged;
                        }
                    }
                }
                Ok(_) => one_by_one.extend(entries.iter().map(|&i| (*peer, i))),
                Err(_) => {}
            }
        }
        if one_by_one.is_empty() {
            return Ok(charges);
        }
        let mut pipe = pipeline();
        for (peer, i) in &one_by_one {
            pipe.add_command(command(peer, &[*i]));
        }
        let Some(replies) = self.charge_replies(pipe).await? else {
            return Ok(charges);
        };
        for ((_, i), reply) in one_by_one.iter().zip(replies) {
            if let (Some(c), Ok(v)) = (charges.get_mut(*i), reply) {
                *c = if u64_of(&v) == Some(1) {
                    Charge::Charged
                } else {
                    Charge::Refused
                };
            }
        }
        Ok(charges)
    }

    /// Runs a pipeline of `charge` commands: `None` when, on a cluster, no
    /// budget shard answered (the entries then go uncharged, see
    /// [`Charge::Skipped`]); a single server that does not answer fails the
    /// append as it would anyway.
    async fn charge_replies(
        &self,
        pipe: Pipeline,
    ) -> Result<Option<Vec<Result<Value, StoreError>>>, StoreError> {
        match self
            .eval_batch_each(&self.scripts.charge, pipe, false, "append")
            .await
        {
            Ok(replies) => Ok(Some(replies)),
            Err(e) if !self.is_cluster() => Err(e),
            Err(e) => {
                tracing::warn!(error = %e, "peer byte budgets unavailable; appending uncharged");
                Ok(None)
            }
        }
    }

    /// Gives bytes back to peers' budgets: `(peer, delegation, bytes)`,
    /// `None` for everything the delegation holds of that peer's budget. A
    /// failure is only logged: the budget then stays charged (the safe
    /// side) until the delegation is dropped.
    async fn uncharge<'a>(
        &self,
        items: impl Iterator<Item = (&'a PeerId, &'a DelegationKey, Option<u64>)>,
    ) {
        let mut pipe = pipeline();
        for (peer, key, bytes) in items {
            let mut cmd = evalsha(&self.scripts.uncharge, &[&peer_bytes_key(peer)]);
            cmd.arg(key.to_string())
                .arg(bytes.map(|b| b.to_string()).unwrap_or_default());
            pipe.add_command(cmd);
        }
        if pipe.is_empty() {
            return;
        }
        let result = self
            .eval_batch(&self.scripts.uncharge, pipe, false, "uncharge")
            .await
            .and_then(|values| first_error(&values, "uncharge"));
        if let Err(e) = result {
            tracing::warn!(error = %e, "giving bytes back to a peer budget failed");
        }
    }

    /// One chunk of [`EventStore::expire_finished`] on a cluster, where the
    /// index and budget keys live in other slots than the delegation's: the
    /// `expire` scripts, then a cleanup pipeline (the index members, and the
    /// peer sets of the delegations gone), then `uncharge` calls; three
    /// round trips. Returns the delegations this call expired.
    async fn expire_chunk_split(&self, chunk: Vec<FinishedEntry>) -> Result<u64, StoreError> {
        let mut scripts = pipeline();
        for (_, target) in &chunk {
            if let Some((at, key, _)) = target {
                let keys = DelegationKeys::new(key);
                let mut cmd = evalsha(&self.scripts.expire, &keys.script_keys());
                cmd.arg(*at);
                scripts.add_command(cmd);
            }
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
        let mut counted = Vec::with_capacity(chunk.len());
        let mut dropped = Vec::new();
        for (member, target) in chunk {
            let position = cleanup.len();
            cleanup.zrem(FINISHED_KEY, member);
            let Some((_, key, callee)) = target else {
                // Unreadable: drop it from the index, count nothing.
                continue;
            };
            let reply = gone.next().unwrap_or(Value::Nil);
            if let Value::ServerError(e) = &reply {
                return Err(StoreError::unavailable("redis expire", e));
            }
            if u64_of(&reply) == Some(1) {
                let k = key.to_string();
                cleanup
                    .srem(peer_set_key(&key.caller), &k)
                    .srem(peer_set_key(&callee), &k);
                counted.push(position);
                dropped.push((key, callee));
            }
        }
        let removed = self.query_pipeline(cleanup, true, "expire").await?;
        first_error(&removed, "expire")?;
        // The dropped delegations' bytes leave their peers' budgets.
        self.uncharge(
            dropped
                .iter()
                .flat_map(|(key, callee)| [(&key.caller, key, None), (callee, key, None)]),
        )
        .await;
        // Count an entry once, by whoever removed it from the index.
        Ok(counted
            .into_iter()
            .filter(|&i| removed.get(i).and_then(u64_of) == Some(1))
            .count() as u64)
    }

    /// One chunk of [`EventStore::expire_finished`] on a single server: per
    /// member, one `expire` script call that deletes the delegation, takes
    /// the member out of the index and the peer sets and gives the
    /// delegation's bytes back to both budgets; one round trip. Returns the
    /// delegations this call expired.
    async fn expire_chunk_fused(&self, chunk: Vec<FinishedEntry>) -> Result<u64, StoreError> {
        let mut scripts = pipeline();
        let mut unreadable = pipeline();
        for (member, target) in chunk {
            let Some((at, key, callee)) = target else {
                // Unreadable: drop it from the index, count nothing.
                unreadable.zrem(FINISHED_KEY, member);
                continue;
            };
            let keys = DelegationKeys::new(&key);
            let (caller_set, callee_set) = (peer_set_key(&key.caller), peer_set_key(&callee));
            let (caller_bytes, callee_bytes) =
                (peer_bytes_key(&key.caller), peer_bytes_key(&callee));
            let [meta, down, up, down_sizes, up_sizes] = keys.script_keys();
            let mut cmd = evalsha(
                &self.scripts.expire,
                &[
                    meta,
                    down,
                    up,
                    down_sizes,
                    up_sizes,
                    FINISHED_KEY,
                    &caller_set,
                    &callee_set,
                    &caller_bytes,
                    &callee_bytes,
                ],
            );
            cmd.arg(at).arg(member).arg(key.to_string());
            scripts.add_command(cmd);
        }
        if !unreadable.is_empty() {
            let removed = self.query_pipeline(unreadable, true, "expire").await?;
            first_error(&removed, "expire")?;
        }
        if scripts.is_empty() {
            return Ok(0);
        }
        let mut expired = 0u64;
        let replies = self
            .eval_batch(&self.scripts.expire, scripts, true, "expire")
            .await?;
        for reply in replies {
            // Count an entry once, by whoever removed it from the index, and
            // only if the delegation is gone.
            let counted = match reply_array(reply, "expire")?.as_slice() {
                [gone, removed] => u64_of(gone) == Some(1) && u64_of(removed) == Some(1),
                other => {
                    return Err(corrupt(format!(
                        "expire: expected {{gone, removed}}, got {} values",
                        other.len()
                    )));
                }
            };
            expired += u64::from(counted);
        }
        Ok(expired)
    }

    /// Metas of `keys` (None where gone), one round trip.
    async fn metas(
        &self,
        keys: &[DelegationKey],
    ) -> Result<Vec<Option<DelegationMeta>>, StoreError> {
        let mut out = Vec::with_capacity(keys.len());
        // In pipelines of at most `METAS_PER_PIPELINE`, one after the other:
        // the store's requests reach Redis in the order they are made, so
        // one pipeline of every open delegation of a busy peer (its
        // welcome) would hold every other peer's appends behind its replies.
        for chunk in keys.chunks(METAS_PER_PIPELINE) {
            let mut pipe = pipeline();
            for k in chunk {
                pipe.hgetall(DelegationKeys::new(k).meta);
            }
            let values = self.query_pipeline(pipe, true, "HGETALL").await?;
            for (k, v) in chunk.iter().zip(values) {
                let fields = hash_fields(v)?;
                out.push(if fields.is_empty() {
                    None
                } else {
                    Some(parse_meta(k, &fields)?)
                });
            }
        }
        Ok(out)
    }
}

/// Most delegation records read in one pipeline (a welcome's list, the
/// sweeper's page): other requests go between two pipelines.
const METAS_PER_PIPELINE: usize = 256;

/// What the peer budget said about one entry of an append batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Charge {
    /// A relay entry: not charged.
    Exempt,
    /// Charged; given back if the entry is not appended.
    Charged,
    /// The budget is full: the append script refuses the entry (after its
    /// own checks, so a resend is still a `Duplicate`).
    Refused,
    /// The budget's shard (a Redis Cluster node) did not answer: the entry
    /// is appended uncharged, held to its delegation's budget only, so that
    /// a shard outage stalls only the delegations on that shard, not every
    /// peer whose budget lives there.
    Skipped,
}

/// Most entries one `append` script call takes: a longer run of one
/// delegation's entries is split into calls of this many, in order, so one
/// call never holds Redis for long.
const MAX_ENTRIES_PER_APPEND_CALL: usize = 256;

/// The entries of an append batch grouped by delegation, each group in the
/// batch's order and at most [`MAX_ENTRIES_PER_APPEND_CALL`] long: one
/// `append` script call each. Groups come in the order of their first entry;
/// nothing depends on the order across delegations.
fn append_groups(reqs: &[AppendRequest]) -> Vec<Vec<usize>> {
    let mut groups: Vec<Vec<usize>> = Vec::new();
    let mut open: HashMap<&DelegationKey, usize> = HashMap::new();
    for (i, req) in reqs.iter().enumerate() {
        match open.get(&req.key).and_then(|&g| groups.get_mut(g)) {
            Some(group) if group.len() < MAX_ENTRIES_PER_APPEND_CALL => group.push(i),
            _ => {
                open.insert(&req.key, groups.len());
                groups.push(vec![i]);
            }
        }
    }
    groups
}

/// A group's entries (indexes into `reqs`) cut into the runs the `append`
/// script takes: consecutive entries of one log with consecutive
/// sequences, the same sender connection, time, wake channel and charge,
/// and a terminal only on a run's last entry. The script appends a run
/// whose checks all pass at once, so the common batch (one connection's
/// frames in order) is one run.
fn append_runs(group: &[usize], reqs: &[AppendRequest], charges: &[Charge]) -> Vec<Vec<usize>> {
    let mut runs: Vec<Vec<usize>> = Vec::new();
    let mut prev: Option<usize> = None;
    for &i in group {
        let (Some(req), Some(charge)) = (reqs.get(i), charges.get(i)) else {
            continue;
        };
        let joins = prev
            .and_then(|p| Some((reqs.get(p)?, charges.get(p)?)))
            .is_some_and(|(before, before_charge)| {
                before.terminal.is_none()
                    && before.dir == req.dir
                    && before.seq.checked_add(1) == Some(req.seq)
                    && before.origin == req.origin
                    && before.now_ms == req.now_ms
                    && before.wake == req.wake
                    && (*before_charge == Charge::Refused) == (*charge == Charge::Refused)
            });
        match runs.last_mut() {
            Some(run) if joins => run.push(i),
            _ => runs.push(vec![i]),
        }
        prev = Some(i);
    }
    runs
}

/// `oab_store_connections_replaced_total`, registered in the relay's registry
/// by [`EventStore::register_metrics`].
// The name and help are constants, so this fails only on a programming
// error, which the conformance tests (every store connects) rule out.
#[allow(clippy::expect_used)]
fn replacement_counter() -> prometheus::IntCounter {
    prometheus::IntCounter::new(
        "oab_store_connections_replaced_total",
        "Redis connections replaced because a request got no answer within the response \
         timeout and the connection answered nothing else meanwhile.",
    )
    .expect("valid metric")
}

/// A delay in whole milliseconds, as the cluster client's retry settings take it.
fn duration_ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

impl EventStore for RedisStore {
    fn keys_of(&self, key: &DelegationKey) -> Vec<String> {
        let k = keys::DelegationKeys::new(key);
        vec![k.meta, k.down, k.up, k.down_sizes, k.up_sizes]
    }

    fn kind(&self) -> &'static str {
        if self.is_cluster() {
            "redis cluster"
        } else {
            "redis"
        }
    }

    fn register_metrics(&self, registry: &prometheus::Registry) -> prometheus::Result<()> {
        registry.register(Box::new(self.replaced.clone()))
    }

    async fn open(&self, req: OpenRequest) -> Result<OpenOutcome, StoreError> {
        let keys = DelegationKeys::new(&req.key);
        // A single server indexes a created delegation in the script itself:
        // the whole open is one round trip. A cluster cannot (the index keys
        // live in other hash slots): it indexes after the script.
        let in_script = !self.is_cluster();
        let index_keys = [
            peer_set_key(&req.key.caller),
            peer_set_key(&req.callee),
            peer_open_key(&req.key.caller),
            peer_open_key(&req.callee),
        ];
        let mut script_keys: Vec<&str> = vec![&keys.meta, &keys.down, &keys.up];
        if in_script {
            script_keys.extend(index_keys.iter().map(String::as_str));
            script_keys.push(DEADLINES_KEY);
        }
        let mut cmd = evalsha(&self.scripts.open, &script_keys);
        cmd.arg(req.callee.as_str())
            .arg(req.deadline_ms)
            .arg(req.digest.to_string())
            .arg(req.now_ms)
            .arg(req.frame.as_ref())
            .arg(self.maxlen)
            .arg(req.wake.as_ref().map(wake_channel).unwrap_or_default())
            .arg(req.trace.map(|t| t.to_hex()).unwrap_or_default());
        if in_script {
            cmd.arg(req.key.to_string())
                .arg(deadline_member(req.deadline_ms, &req.key));
        }
        let reply = self.eval(&self.scripts.open, cmd, false, "open").await?;
        let mut items = reply_array(reply, "open")?.into_iter();
        let code = items.next();
        match code.as_ref().and_then(str_of) {
            Some("N") => {
                let meta = DelegationMeta::opened(&req);
                // The delegation is durable, but until it is indexed the
                // deadline sweeper cannot see it: report failure so the
                // sender retries, and the retry (`Existing`) indexes it.
                if !in_script {
                    self.ensure_indexed(&meta).await?;
                }
                Ok(OpenOutcome::Created(meta))
            }
            Some("E") => {
                let fields = hash_fields(Value::Array(items.collect()))?;
                let meta = parse_meta(&req.key, &fields)?;
                // A compacted delegation (its digest rewritten as bare hex)
                // left the indexes on purpose.
                let compacted = fields
                    .get(meta_field::DIGEST)
                    .and_then(str_of)
                    .is_some_and(|d| !d.starts_with("sha256:"));
                if !compacted {
                    self.ensure_indexed(&meta).await?;
                }
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
        // On a single server the append script charges the peer budgets
        // itself (their hashes are among its keys), so a batch is one round
        // trip and batches reach Redis in the order they were sent. A
        // cluster keeps each budget in its own slot: it is charged first
        // (`charge`) and given back after (`uncharge`).
        let fused = !self.is_cluster();
        let charges = if fused {
            vec![Charge::Exempt; reqs.len()]
        } else {
            self.charge(&reqs).await?
        };
        let groups = append_groups(&reqs);
        let mut pipe = pipeline();
        for group in &groups {
            let Some(first) = group.first().and_then(|&i| reqs.get(i)) else {
                continue;
            };
            let keys = DelegationKeys::new(&first.key);
            // Fused: the budget hashes of the group's senders follow the
            // delegation's keys, and each entry names its sender's (1-based;
            // 0 for the relay's entries).
            let mut budget_keys: Vec<(&PeerId, String)> = Vec::new();
            if fused {
                for req in group.iter().filter_map(|&i| reqs.get(i)) {
                    if let Origin::Peer { peer, .. } = &req.origin
                        && !budget_keys.iter().any(|(p, _)| *p == peer)
                    {
                        budget_keys.push((peer, peer_bytes_key(peer)));
                    }
                }
            }
            // Fused, with the callee's terminal among the entries: the
            // finished-index keys and both peers' budget hashes follow, and
            // the script moves the delegation out of the open indexes and
            // its bytes out of both budgets itself (the callee's set
            // named by the terminal's sender, which the script checks
            // against the meta's callee; otherwise it leaves the index to
            // `index_finished` below).
            let index_keys = fused
                .then(|| {
                    group.iter().filter_map(|&i| reqs.get(i)).find_map(|req| {
                        match (&req.origin, req.dir, req.terminal) {
                            (Origin::Peer { peer, .. }, Direction::Up, Some(_)) => Some([
                                peer_open_key(&first.key.caller),
                                peer_open_key(peer),
                                DEADLINES_KEY.to_string(),
                                FINISHED_KEY.to_string(),
                                peer_bytes_key(&first.key.caller),
                                peer_bytes_key(peer),
                            ]),
                            _ => None,
                        }
                    })
                })
                .flatten();
            let mut key_names: Vec<&str> = keys.script_keys().to_vec();
            key_names.extend(budget_keys.iter().map(|(_, k)| k.as_str()));
            if let Some(index) = &index_keys {
                key_names.extend(index.iter().map(String::as_str));
            }
            let mut cmd = evalsha(&self.scripts.append, &key_names);
            cmd.arg(self.maxlen)
                .arg(self.ttl_ms)
                .arg(first.key.caller.as_str())
                .arg(self.retention.max_delegation_bytes)
                .arg(self.retention.max_peer_bytes)
                .arg(first.key.to_string())
                .arg(if index_keys.is_some() { "1" } else { "0" });
            // The group's entries go in runs (`append_runs`): one header of
            // nine arguments, then each entry's frame. A group's entries
            // mostly come from one connection: its instance is formatted
            // once.
            let mut origin_hex: Option<(InstanceId, String)> = None;
            for run in append_runs(group, &reqs, &charges) {
                let (Some(req), Some(last)) = (
                    run.first().and_then(|&i| reqs.get(i)),
                    run.last().and_then(|&i| reqs.get(i)),
                ) else {
                    continue;
                };
                cmd.arg(run.len())
                    .arg(match req.dir {
                        Direction::Down => "d",
                        Direction::Up => "u",
                    })
                    .arg(req.seq);
                let sender = match &req.origin {
                    Origin::Relay => {
                        cmd.arg("r");
                        None
                    }
                    Origin::Peer { peer, instance } => {
                        match &origin_hex {
                            Some((at, hex)) if at == instance => cmd.arg(hex.as_str()),
                            _ => {
                                let hex = instance.to_hex();
                                cmd.arg(hex.as_str());
                                origin_hex = Some((*instance, hex));
                                &mut cmd
                            }
                        };
                        Some(peer)
                    }
                };
                cmd.arg(last.terminal.map_or("", Outcome::name))
                    .arg(req.now_ms)
                    .arg(req.wake.as_ref().map(wake_channel).unwrap_or_default())
                    .arg(sender.map_or("", |p| p.as_str()));
                if fused {
                    let index = sender
                        .and_then(|p| budget_keys.iter().position(|(b, _)| *b == p))
                        .map_or(0, |at| at + 1);
                    cmd.arg(index);
                } else {
                    let refused =
                        run.first().and_then(|&i| charges.get(i)) == Some(&Charge::Refused);
                    cmd.arg(if refused { "0" } else { "1" });
                }
                for &i in &run {
                    if let Some(req) = reqs.get(i) {
                        cmd.arg(req.frame.as_ref());
                    }
                }
            }
            pipe.add_command(cmd);
        }
        let group_replies = if pipe.is_empty() {
            Vec::new()
        } else {
            self.eval_batch_each(&self.scripts.append, pipe, false, "append")
                .await?
        };
        // Each entry's reply, in the order of `reqs`: its group's reply and
        // its place there; `None` where its group's shard did not answer.
        let mut split: Vec<GroupReply> = Vec::with_capacity(groups.len());
        let mut place: Vec<Option<(usize, usize)>> = vec![None; reqs.len()];
        for (group, reply) in groups.iter().zip(group_replies) {
            let Ok(reply) = reply else { continue };
            let g = split.len();
            split.push(split_append(reply, group.len())?);
            for (j, &i) in group.iter().enumerate() {
                if let Some(slot) = place.get_mut(i) {
                    *slot = Some((g, j));
                }
            }
        }
        let mut outcomes = Vec::with_capacity(reqs.len());
        let mut finished = Vec::new();
        let mut give_back = Vec::new();
        for ((req, charge), at) in reqs.iter().zip(charges).zip(place) {
            let Some((group, entry)) = at.and_then(|(g, j)| {
                let group = split.get(g)?;
                Some((group, group.entries.get(j)?))
            }) else {
                // Its shard did not answer; the others went on. A charge
                // taken for it stays until its delegation is dropped (the
                // entry may be stored).
                outcomes.push(AppendOutcome::Unavailable);
                continue;
            };
            let (outcome, fin, trimmed) = parse_append(req, entry, group)?;
            if charge == Charge::Charged {
                match outcome {
                    AppendOutcome::Appended { .. } if trimmed > 0 => {
                        give_back.push((req, trimmed));
                    }
                    AppendOutcome::Appended { .. } => {}
                    _ => give_back.push((req, req.frame.len() as u64)),
                }
            }
            outcomes.push(outcome);
            finished.extend(fin);
        }
        if !give_back.is_empty() {
            // One give-back per peer and delegation: a run of entries at the
            // log's cap each trims one, and their bytes go back together.
            let mut totals: Vec<(&PeerId, &DelegationKey, u64)> = Vec::new();
            let mut index: HashMap<(&PeerId, &DelegationKey), usize> = HashMap::new();
            for (req, bytes) in &give_back {
                let Origin::Peer { peer, .. } = &req.origin else {
                    continue;
                };
                match index
                    .get(&(peer, &req.key))
                    .and_then(|&t| totals.get_mut(t))
                {
                    Some((_, _, total)) => *total += bytes,
                    None => {
                        index.insert((peer, &req.key), totals.len());
                        totals.push((peer, &req.key, *bytes));
                    }
                }
            }
            self.uncharge(
                totals
                    .into_iter()
                    .map(|(peer, key, bytes)| (peer, key, Some(bytes))),
            )
            .await;
        }
        if !finished.is_empty() {
            // A finished delegation leaves its peers' budgets at once (they
            // bound what a peer holds open, not what retention keeps), in
            // the same round trip as the index update (a callee's own
            // terminal on a single server: the append script did both). An
            // entry charged meanwhile and then refused `AlreadyTerminal`
            // gives back only what its member still holds. A failure leaves
            // the charge until the delegation is dropped.
            let uncharge = self.uncharge(
                finished
                    .iter()
                    .flat_map(|f| [(&f.key.caller, &f.key, None), (&f.callee, &f.key, None)]),
            );
            tokio::join!(self.index_finished(&finished), uncharge);
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
            Direction::Down => meta_field::DOWN_TAIL,
            Direction::Up => meta_field::UP_TAIL,
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

    async fn callee_of(&self, key: &DelegationKey) -> Result<Option<PeerId>, StoreError> {
        let mut cmd = redis::cmd("HGET");
        cmd.arg(DelegationKeys::new(key).meta)
            .arg(meta_field::CALLEE);
        match self.query(&cmd, true, "HGET").await? {
            Value::Nil => Ok(None),
            v => str_of(&v)
                .and_then(|s| PeerId::new(s).ok())
                .map(Some)
                .ok_or_else(|| corrupt(format!("delegation {key}: bad callee {}", excerpt(&v)))),
        }
    }

    async fn delegations_of(&self, peer: &PeerId) -> Result<Vec<DelegationMeta>, StoreError> {
        self.delegations_in(&peer_set_key(peer), peer, false).await
    }

    async fn delegation_keys_of(&self, peer: &PeerId) -> Result<Vec<DelegationKey>, StoreError> {
        let set = peer_set_key(peer);
        let mut keys = Vec::new();
        let mut cursor = "0".to_string();
        loop {
            let mut cmd = redis::cmd("SSCAN");
            cmd.arg(&set).arg(&cursor).arg("COUNT").arg(1000);
            let reply = self.query(&cmd, true, "SSCAN").await?;
            let Value::Array(parts) = reply else {
                return Err(corrupt(format!(
                    "SSCAN: unexpected reply {}",
                    excerpt(&reply)
                )));
            };
            let (Some(next), Some(Value::Array(members) | Value::Set(members))) =
                (parts.first().and_then(str_of), parts.get(1))
            else {
                return Err(corrupt("SSCAN: unexpected reply shape"));
            };
            keys.extend(members.iter().filter_map(|m| str_of(m).and_then(parse_key)));
            if next == "0" {
                return Ok(keys);
            }
            cursor = next.to_string();
        }
    }

    async fn open_delegations_of(&self, peer: &PeerId) -> Result<Vec<DelegationMeta>, StoreError> {
        self.delegations_in(&peer_open_key(peer), peer, true).await
    }

    async fn release(&self, releases: Vec<super::Release>) -> Result<u64, StoreError> {
        if releases.is_empty() {
            return Ok(0);
        }
        let fused = !self.is_cluster();
        let mut scripts = pipeline();
        for r in &releases {
            let keys = DelegationKeys::new(&r.key);
            let member = r.key.to_string();
            let (caller_set, callee_set) = (peer_set_key(&r.key.caller), peer_set_key(&r.callee));
            let [meta, down, up, down_sizes, up_sizes] = keys.script_keys();
            let mut cmd = if fused {
                evalsha(
                    &self.scripts.compact,
                    &[
                        meta,
                        down,
                        up,
                        down_sizes,
                        up_sizes,
                        &caller_set,
                        &callee_set,
                        FINISHED_KEY,
                    ],
                )
            } else {
                evalsha(&self.scripts.compact, &keys.script_keys())
            };
            cmd.arg(r.after)
                .arg(member)
                .arg(r.callee.as_str())
                .arg(self.retention.finished_ttl_ms.min(MAX_TTL_MS));
            scripts.add_command(cmd);
        }
        let replies = self
            .eval_batch(&self.scripts.compact, scripts, true, "compact")
            .await?;
        let mut compacted = 0u64;
        // On a cluster the indexes live in other slots: taken out here.
        let mut indexes = pipeline();
        for (r, reply) in releases.iter().zip(replies) {
            if let Value::ServerError(e) = &reply {
                return Err(StoreError::unavailable("redis compact", e));
            }
            let items = reply_array(reply, "compact")?;
            if items.first().and_then(u64_of) != Some(1) {
                continue;
            }
            compacted += 1;
            if items.get(2).and_then(u64_of) == Some(1) {
                continue;
            }
            let terminal_ms = items
                .get(1)
                .and_then(u64_of)
                .ok_or_else(|| corrupt("compact: no terminal time"))?;
            let k = r.key.to_string();
            indexes
                .srem(peer_set_key(&r.key.caller), &k)
                .srem(peer_set_key(&r.callee), &k)
                .zrem(
                    FINISHED_KEY,
                    finished_member(terminal_ms, &r.key, &r.callee),
                );
        }
        if !indexes.is_empty() {
            let removed = self.query_pipeline(indexes, true, "compact").await?;
            first_error(&removed, "compact")?;
        }
        Ok(compacted)
    }

    async fn due(&self, now_ms: u64, limit: usize) -> Result<Vec<DelegationKey>, StoreError> {
        let mut out: Vec<DelegationKey> = Vec::new();
        let upper = lex_upper_bound(now_ms);
        // Each round either fills the page or removes at least one stale
        // member, so this ends.
        while out.len() < limit {
            let want = limit - out.len();
            let count = u64::try_from(want).unwrap_or(u64::MAX).min(i64::MAX as u64);
            let members = self
                .range_below(DEADLINES_KEY, &upper, out.len() as u64, count)
                .await?;
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
            let members = self
                .range_below(FINISHED_KEY, &upper, 0, EXPIRE_CHUNK as u64)
                .await?;
            if members.is_empty() {
                break;
            }
            let fetched = members.len();
            let mut chunk = Vec::with_capacity(fetched);
            for m in members {
                let target = str_of(&m).and_then(parse_finished_member);
                let Value::BulkString(member) = m else {
                    return Err(corrupt(format!("ZRANGEBYLEX: member {}", excerpt(&m))));
                };
                chunk.push((member, target));
            }
            expired += if self.is_cluster() {
                self.expire_chunk_split(chunk).await?
            } else {
                self.expire_chunk_fused(chunk).await?
            };
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
            other => Err(corrupt(format!(
                "SET: unexpected reply {}",
                excerpt(&other)
            ))),
        }
    }

    async fn descriptor(&self, peer: &PeerId) -> Result<Option<Bytes>, StoreError> {
        let mut cmd = redis::cmd("GET");
        cmd.arg(descriptor_key(peer));
        match self.query(&cmd, true, "GET").await? {
            Value::Nil => Ok(None),
            Value::BulkString(b) => Ok(Some(Bytes::from(b))),
            other => Err(corrupt(format!(
                "GET: unexpected reply {}",
                excerpt(&other)
            ))),
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
        let values = self.query_pipeline(pipe, true, "epoch").await?;
        let v = values.get(1).ok_or_else(|| corrupt("epoch: no reply"))?;
        match u64_of(v) {
            Some(epoch) if epoch != 0 => Ok(epoch),
            _ => Err(corrupt(format!(
                "{EPOCH_KEY} holds {}, not a non-zero u64",
                excerpt(v)
            ))),
        }
    }

    async fn ping(&self) -> Result<(), StoreError> {
        if let Some(shards) = &self.shards {
            // Every master that serves slots must answer: see `shards`.
            return shards.check().await;
        }
        let cmd = redis::cmd("PING");
        match self.query(&cmd, true, "PING").await? {
            Value::SimpleString(s) if s == "PONG" => Ok(()),
            other => Err(corrupt(format!(
                "PING: unexpected reply {}",
                excerpt(&other)
            ))),
        }
    }
}

/// What Redis's `maxmemory-policy` and `appendonly` settings (as `CONFIG
/// GET` answered them; `None`: not known) put at risk.
fn durability_warnings(policy: Option<&str>, appendonly: Option<&str>) -> Vec<String> {
    let mut out = Vec::new();
    if let Some(policy) = policy
        && policy != "noeviction"
    {
        out.push(format!(
            "Redis evicts keys under memory pressure (maxmemory-policy {policy}), which silently \
             loses delegation logs; set maxmemory-policy noeviction"
        ));
    }
    if appendonly == Some("no") {
        out.push(
            "Redis runs without its append-only file (appendonly no): a Redis restart loses \
             every delegation frame acknowledged since its last snapshot; set appendonly yes \
             (deploy/redis/redis.conf)"
                .to_string(),
        );
    }
    out
}

#[cfg(test)]
mod durability_tests {
    use super::durability_warnings;

    #[test]
    fn eviction_and_a_missing_aof_are_named_and_unknown_settings_are_not() {
        assert!(durability_warnings(Some("noeviction"), Some("yes")).is_empty());
        assert!(durability_warnings(None, None).is_empty());
        let w = durability_warnings(Some("allkeys-lru"), Some("no"));
        assert_eq!(w.len(), 2, "{w:?}");
        assert!(w[0].contains("allkeys-lru") && w[0].contains("noeviction"));
        assert!(w[1].contains("appendonly no") && w[1].contains("appendonly yes"));
    }
}

#[cfg(test)]
mod run_tests {
    use super::{Charge, append_runs};
    use crate::store::{AppendRequest, Origin};
    use bytes::Bytes;
    use oab_wire::{DelegationKey, Direction, InstanceId, Outcome, PeerId, RequestId};

    fn peer(name: &str) -> PeerId {
        PeerId::new(name).unwrap_or_else(|_| unreachable!())
    }

    fn entry(seq: u64, origin: &Origin) -> AppendRequest {
        AppendRequest {
            key: DelegationKey::new(
                peer("acme/caller"),
                RequestId::new("r-1").unwrap_or_else(|_| unreachable!()),
            ),
            dir: Direction::Up,
            seq,
            terminal: None,
            origin: origin.clone(),
            frame: Bytes::from_static(b"frame"),
            now_ms: 7,
            wake: None,
        }
    }

    #[test]
    fn one_connections_frames_in_order_are_one_run_and_anything_else_starts_a_new_one() {
        let callee = Origin::Peer {
            peer: peer("acme/callee"),
            instance: InstanceId::random(),
        };
        let other_instance = Origin::Peer {
            peer: peer("acme/callee"),
            instance: InstanceId::random(),
        };
        let mut reqs: Vec<AppendRequest> = (1..=4).map(|s| entry(s, &callee)).collect();
        // A terminal ends its run.
        reqs[3].terminal = Some(Outcome::Completed);
        reqs.push(entry(5, &callee));
        // A gap, the other log, another connection, the relay, another
        // clock reading, a wake channel, a refused charge: each a run.
        reqs.push(entry(7, &callee));
        let mut down = entry(8, &callee);
        down.dir = Direction::Down;
        reqs.push(down);
        reqs.push(entry(9, &other_instance));
        reqs.push(entry(10, &Origin::Relay));
        let mut later = entry(11, &Origin::Relay);
        later.now_ms = 8;
        reqs.push(later);
        let mut woken = entry(12, &Origin::Relay);
        woken.now_ms = 8;
        woken.wake = Some(peer("acme/caller"));
        reqs.push(woken);
        let mut refused = entry(13, &callee);
        refused.now_ms = 8;
        reqs.push(refused);
        let mut charged = entry(14, &callee);
        charged.now_ms = 8;
        reqs.push(charged);
        let mut charges = vec![Charge::Exempt; reqs.len()];
        charges[11] = Charge::Refused;
        let group: Vec<usize> = (0..reqs.len()).collect();
        assert_eq!(
            append_runs(&group, &reqs, &charges),
            vec![
                vec![0, 1, 2, 3],
                vec![4],
                vec![5],
                vec![6],
                vec![7],
                vec![8],
                vec![9],
                vec![10],
                vec![11],
                vec![12],
            ]
        );
        charges[11] = Charge::Charged;
        assert_eq!(append_runs(&[11, 12], &reqs, &charges), vec![vec![11, 12]]);
        // Refused and charged entries never share a run, and a run holds
        // only the group's entries, in the group's order.
        assert_eq!(append_runs(&[1, 2], &reqs, &charges), vec![vec![1, 2]]);
        assert_eq!(
            append_runs(&[2, 1], &reqs, &charges),
            vec![vec![2], vec![1]]
        );
    }
}
