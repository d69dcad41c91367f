//! The shards of a Redis Cluster as this relay needs them: which master
//! serves each slot range (`CLUSTER SLOTS`, asked of any node that answers),
//! and whether each of those masters answers `PING`. `/readyz` asks this
//! through [`EventStore::ping`](crate::store::EventStore::ping): an instance
//! needs every shard (the delegations of any peer spread over all the
//! slots), so one unreachable master makes it not ready, and the answer
//! names that master and its slots. Errors of commands on a slot name the
//! master that served it in the last slot map ([`Shards::owner_of`]).
//!
//! It talks to the nodes over its own plain connections, one per node,
//! with a short timeout ([`PROBE_TIMEOUT`]): never through the cluster
//! connection, whose retries and slot refreshes would hold a probe for
//! seconds and add to its log.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use futures_util::future::join_all;
use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, Value};

use crate::store::StoreError;

/// How long a probe of one node (connect, or one command) may take. A
/// stopped process (SIGSTOP) still accepts TCP connections and never
/// answers: this bounds that case.
pub(super) const PROBE_TIMEOUT: Duration = Duration::from_secs(1);
/// Slots of a Redis Cluster.
const SLOTS: u32 = 16_384;

/// One slot range and the master serving it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct SlotRange {
    pub(super) first: u16,
    pub(super) last: u16,
    /// `host:port`.
    pub(super) master: String,
}

/// The cluster's shards, probed on demand.
pub(super) struct Shards {
    /// `redis://` or `redis://user:password@` (a secret: never shown).
    prefix: String,
    /// The seeds' `host:port`.
    seeds: Vec<String>,
    /// One connection per node probed; a failed one is dropped and made
    /// again at the next probe. At most one per node of the slot map and
    /// seed.
    conns: tokio::sync::Mutex<HashMap<String, MultiplexedConnection>>,
    /// The slot map of the last successful `CLUSTER SLOTS`.
    map: parking_lot::Mutex<Vec<SlotRange>>,
}

impl std::fmt::Debug for Shards {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shards")
            .field("seeds", &self.seeds)
            .finish_non_exhaustive()
    }
}

impl Shards {
    /// For the seeds `redis://[user:password@]host:port` (as made by
    /// `cluster_seed_urls`: the same credentials on every seed).
    pub(super) fn new(seed_urls: &[String]) -> Shards {
        let mut prefix = "redis://".to_owned();
        let mut seeds = Vec::new();
        for url in seed_urls {
            let rest = url.strip_prefix("redis://").unwrap_or(url);
            let (credentials, host) = match rest.rsplit_once('@') {
                Some((c, h)) => (Some(c), h),
                None => (None, rest),
            };
            if let Some(c) = credentials {
                prefix = format!("redis://{c}@");
            }
            seeds.push(host.to_owned());
        }
        Shards {
            prefix,
            seeds,
            conns: tokio::sync::Mutex::new(HashMap::new()),
            map: parking_lot::Mutex::new(Vec::new()),
        }
    }

    /// Reads the slot map and pings every master: `Ok` when every slot has
    /// a master that answers; otherwise an error naming each master that
    /// did not, with its slots.
    pub(super) async fn check(&self) -> Result<(), StoreError> {
        let map = self.fetch_map().await?;
        *self.map.lock() = map.clone();
        let covered: u32 = map
            .iter()
            .map(|r| u32::from(r.last.saturating_sub(r.first)) + 1)
            .sum();
        let mut masters: BTreeMap<&str, Vec<String>> = BTreeMap::new();
        for r in &map {
            masters
                .entry(r.master.as_str())
                .or_default()
                .push(format!("{}-{}", r.first, r.last));
        }
        let pings = join_all(masters.keys().map(|addr| self.ping(addr))).await;
        let mut down: Vec<String> = masters
            .iter()
            .zip(pings)
            .filter_map(|((addr, ranges), ping)| {
                ping.err().map(|e| {
                    format!(
                        "master {addr} (slots {}) unreachable: {e}",
                        ranges.join(",")
                    )
                })
            })
            .collect();
        if covered < SLOTS {
            down.push(format!(
                "{} of {SLOTS} slots have no master",
                SLOTS - covered
            ));
        }
        if down.is_empty() {
            Ok(())
        } else {
            Err(StoreError::unavailable("Redis Cluster", down.join("; ")))
        }
    }

    /// The master serving `slot` in the last slot map read, if any.
    pub(super) fn owner_of(&self, slot: u16) -> Option<String> {
        self.map
            .lock()
            .iter()
            .find(|r| r.first <= slot && slot <= r.last)
            .map(|r| r.master.clone())
    }

    /// `CLUSTER SLOTS` from the first node that answers: the masters of the
    /// last map first, then the seeds.
    async fn fetch_map(&self) -> Result<Vec<SlotRange>, StoreError> {
        let mut candidates: Vec<String> =
            self.map.lock().iter().map(|r| r.master.clone()).collect();
        candidates.extend(self.seeds.iter().cloned());
        let mut seen = std::collections::HashSet::new();
        candidates.retain(|c| seen.insert(c.clone()));
        let mut tried = Vec::new();
        for addr in candidates {
            match self
                .command(&addr, redis::cmd("CLUSTER").arg("SLOTS"))
                .await
            {
                Ok(reply) => {
                    let host = addr.rsplit_once(':').map_or(addr.as_str(), |(h, _)| h);
                    if let Some(map) = parse_slots(&reply, host)
                        && !map.is_empty()
                    {
                        return Ok(map);
                    }
                    tried.push(format!("{addr}: no slot map"));
                }
                Err(e) => tried.push(format!("{addr}: {e}")),
            }
        }
        Err(StoreError::unavailable(
            "CLUSTER SLOTS",
            format!("no cluster node answered ({})", tried.join("; ")),
        ))
    }

    async fn ping(&self, addr: &str) -> Result<(), String> {
        match self.command(addr, &redis::cmd("PING")).await? {
            Value::SimpleString(s) if s == "PONG" => Ok(()),
            other => Err(format!("PING answered {other:?}")),
        }
    }

    /// One command to the node at `addr` over its probe connection, within
    /// [`PROBE_TIMEOUT`]; the connection is dropped when it fails.
    async fn command(&self, addr: &str, cmd: &redis::Cmd) -> Result<Value, String> {
        let cached = self.conns.lock().await.get(addr).cloned();
        let mut conn = match cached {
            Some(c) => c,
            None => {
                let client = redis::Client::open(format!("{}{addr}", self.prefix))
                    .map_err(|e| e.to_string())?;
                let config = AsyncConnectionConfig::new()
                    .set_connection_timeout(Some(PROBE_TIMEOUT))
                    .set_response_timeout(Some(PROBE_TIMEOUT));
                let conn = tokio::time::timeout(
                    PROBE_TIMEOUT,
                    client.get_multiplexed_async_connection_with_config(&config),
                )
                .await
                .map_err(|_| "connect timed out".to_owned())?
                .map_err(|e| e.to_string())?;
                self.conns
                    .lock()
                    .await
                    .insert(addr.to_owned(), conn.clone());
                conn
            }
        };
        let reply = tokio::time::timeout(PROBE_TIMEOUT, cmd.query_async::<Value>(&mut conn))
            .await
            .map_err(|_| "timed out".to_owned())
            .and_then(|r| r.map_err(|e| e.to_string()));
        if reply.is_err() {
            self.conns.lock().await.remove(addr);
        }
        reply
    }
}

/// The hash slot of `key`, as Redis Cluster computes it: CRC16 (XMODEM) of
/// its hash tag (the part between the first `{` and the next `}`, when
/// not empty) or of the whole key, modulo 16384.
pub(super) fn slot_of(key: &[u8]) -> u16 {
    let tagged = key
        .iter()
        .position(|&b| b == b'{')
        .and_then(|open| {
            let rest = key.get(open + 1..)?;
            let close = rest.iter().position(|&b| b == b'}')?;
            (close > 0).then(|| rest.get(..close)).flatten()
        })
        .unwrap_or(key);
    let mut crc: u16 = 0;
    for &byte in tagged {
        crc ^= u16::from(byte) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc % 16_384
}

/// The slot ranges of a `CLUSTER SLOTS` reply: `[first, last, [host, port,
/// id, ...], replicas...]` per range. An empty or `?` host means the node
/// asked (`asked_host`). `None` for a reply of another shape.
fn parse_slots(reply: &Value, asked_host: &str) -> Option<Vec<SlotRange>> {
    let Value::Array(ranges) = reply else {
        return None;
    };
    let int = |v: &Value| match v {
        Value::Int(i) => Some(*i),
        _ => None,
    };
    ranges
        .iter()
        .map(|range| {
            let Value::Array(fields) = range else {
                return None;
            };
            let first = u16::try_from(int(fields.first()?)?).ok()?;
            let last = u16::try_from(int(fields.get(1)?)?).ok()?;
            let Value::Array(master) = fields.get(2)? else {
                return None;
            };
            let host = match master.first()? {
                Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
                Value::SimpleString(s) => s.clone(),
                _ => return None,
            };
            let host = if host.is_empty() || host == "?" {
                asked_host.to_owned()
            } else {
                host
            };
            let port = int(master.get(1)?)?;
            let master = if host.contains(':') {
                format!("[{host}]:{port}")
            } else {
                format!("{host}:{port}")
            };
            Some(SlotRange {
                first,
                last,
                master,
            })
        })
        .collect()
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::*;

    #[test]
    fn slot_maps_are_read_from_cluster_slots_replies() {
        let node = |host: &str, port: i64| {
            Value::Array(vec![
                Value::BulkString(host.as_bytes().to_vec()),
                Value::Int(port),
                Value::BulkString(b"id".to_vec()),
            ])
        };
        let reply = Value::Array(vec![
            Value::Array(vec![
                Value::Int(0),
                Value::Int(5460),
                node("10.0.0.1", 7001),
            ]),
            Value::Array(vec![
                Value::Int(5461),
                Value::Int(10922),
                node("", 7002),
                node("10.0.0.9", 7009),
            ]),
            Value::Array(vec![
                Value::Int(10923),
                Value::Int(16383),
                node("::1", 7003),
            ]),
        ]);
        let map = parse_slots(&reply, "10.0.0.5").unwrap();
        let masters: Vec<&str> = map.iter().map(|r| r.master.as_str()).collect();
        assert_eq!(masters, ["10.0.0.1:7001", "10.0.0.5:7002", "[::1]:7003"]);
        assert_eq!((map[2].first, map[2].last), (10923, 16383));
        assert!(parse_slots(&Value::Int(1), "h").is_none());
    }

    #[test]
    fn slots_match_the_redis_crate() {
        for key in [
            &b"oab:deadlines"[..],
            b"{acme/a#r1}:meta",
            b"foo{}{bar}",
            b"{}x",
            b"a{b}c{d}",
            b"",
            b"123456789",
        ] {
            let theirs = format!("{:?}", redis::cluster_routing::Slot::for_key(key));
            assert_eq!(theirs, format!("Slot({})", slot_of(key)), "{key:?}");
        }
        // The reference value of CRC16/XMODEM("123456789") is 0x31C3.
        assert_eq!(slot_of(b"123456789"), 0x31C3);
    }

    #[test]
    fn credentials_stay_in_the_prefix_and_out_of_debug() {
        let s = Shards::new(&[
            "redis://u:hunter2@127.0.0.1:7001".into(),
            "redis://u:hunter2@127.0.0.1:7002".into(),
        ]);
        assert_eq!(s.prefix, "redis://u:hunter2@");
        assert_eq!(s.seeds, ["127.0.0.1:7001", "127.0.0.1:7002"]);
        assert!(!format!("{s:?}").contains("hunter2"));
    }
}
