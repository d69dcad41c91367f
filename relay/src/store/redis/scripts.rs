//! The Lua scripts of the Redis store: the delegation scripts (`open`,
//! `append`, `read`, `expire`) and the fleet scripts (presence, liveness,
//! leases), each hashed once, the `EVALSHA` command that names one, and the
//! `SCRIPT LOAD` of the delegation scripts at connect time (a fleet script is
//! loaded when its first `EVALSHA` meets `NOSCRIPT`). It never parses a
//! reply and never picks the node a command goes to; reloading a script a
//! node lost (`NOSCRIPT`) is [`super::cluster`]'s.
//!
//! Each script's text is `lua/<name>.lua`, included byte for byte (the
//! leading newline too): a script's SHA1 is its `EVALSHA` name, so any edit
//! to a file, whitespace included, gives the script a new name, and relays
//! of the old and the new version sharing one Redis then each load their own.

use redis::{Cmd, Script};

use super::RedisStore;
use super::replies::unavailable;
use crate::store::StoreError;

/// `open`: KEYS meta, down, up, and on a single server (not a cluster: these
/// keys are in other hash slots) also the caller's and the callee's
/// delegation sets, their sets of open delegations and `oab:deadlines`;
/// ARGV callee, deadline, digest, now, frame, maxlen, wake channel (or
/// empty), the caller's trace id (hex, or empty for none), and with the
/// index keys the index member (`<caller>#<rid>`) and the deadline member. Returns `{'N'}` when it created the delegation (and
/// published `W<frame>` on the wake channel, and, given the index keys,
/// indexed it: one round trip for the whole open), or `{'E', <HGETALL>}`.
const OPEN_LUA: &str = include_str!("lua/open.lua");

/// `append` (a batch of one delegation's entries, in order): KEYS meta,
/// down log, up log, down and up size lists, then on a single server the byte budget hash of each
/// sender among the entries, then (when ARGV 7 is `1`) the finished-index
/// keys: the caller's and the callee's open-delegation sets,
/// `oab:deadlines` and `oab:finished`, and the caller's and the callee's
/// byte budget hashes (the terminal takes the delegation's member out of
/// both); ARGV maxlen, ttl, the delegation's
/// caller, `max_delegation_bytes`, `max_peer_bytes`, the delegation's
/// budget member (`<caller>#<rid>`), whether the index keys follow (`1`,
/// on a single server for a batch with the callee's terminal, or `0`),
/// then the entries in runs: per run nine header arguments, then the run's
/// frames, one argument each. The header: the run's entry count, dir
/// (`d`|`u`), the first entry's seq (the others follow it one by one),
/// origin (`r` for the relay, else the instance hex), the terminal of the
/// run's last entry (outcome name or empty; the others have none), now,
/// wake channel (or empty: when set, an appended entry is also published
/// there as `W<frame>`, atomically with the append, so a wake-up is never
/// lost between the two), sender peer, and the budget: with budget keys,
/// the 1-based index of the sender's among them (`0` for the relay's
/// entries), which the script charges and gives trimmed bytes back to
/// itself, as the `charge` and `uncharge` scripts do; without (a cluster,
/// where a budget lives in another slot), `1` if the sender's bytes were
/// charged by `charge` before or `0` if that budget refused them. One
/// connection's frames in order are one run: nine arguments per entry
/// (before) cost Redis about a third of the script's time in argument
/// conversion and per-entry checks.
///
/// Each entry is judged as if it were appended alone after the ones before
/// it (a run that passes every check as a whole, its sequence and party
/// once and the budgets against its total size, is appended without the
/// per-entry checks, which could not refuse any of its entries; any other
/// run is judged entry by entry): a peer's entry is refused `{'P'}` unless the sender is the caller
/// (down) or the meta's callee (up); then the sequence checks; then
/// `{'B', 'd'}` if the two logs' held bytes (`db` + `ub`) plus the frame
/// pass `max_delegation_bytes`, `{'B', 'p'}` if the peer budget refused it.
/// Every append adds the frame to its log's held bytes and takes off what
/// the log's `MAXLEN` trims because of it. The meta hash is read once and
/// written once (the held bytes `db`/`ub` with the tails, no `HINCRBY`), a
/// budget hash once per sender, each log is trimmed once (exact `MAXLEN`,
/// the same entries as one trim per append would drop), and `XLEN` runs
/// only for a log that gets an entry and whose tail plus the batch's
/// entries could pass `MAXLEN` (a log holds at most one entry per sequence
/// up to its tail, so below that nothing is trimmed). From a log's first
/// batch at its cap on, every entry appended to it also has its byte
/// length pushed on its size list, and a trim takes the sizes of the
/// entries it drops from that list (`LRANGE`, then `LTRIM`), and only those
/// of entries older than the list from the log itself (`XRANGE`, which
/// hands the frames to Lua: 10-30% of the script's time at the cap when
/// every trimmed size came that way). Meta `dz`/`uz` is the log's tail when
/// its list was last in step with it; a list whose mark is not the tail
/// (an append by a relay that does not list sizes) is dropped and started
/// again. A list has the delegation's TTL, or while the delegation is open
/// its deadline plus the finished TTL (ARGV 2).
///
/// Returns `{'U'}` when the delegation is unknown, else a code and a value
/// per entry, then the delegation's deadline and callee (for the index
/// entry of a terminal): `A, trimmed` appended, `F, trimmed` appended and it
/// set the terminal (`trimmed`: bytes the trim dropped from this log because
/// of this entry, an integer; for a run appended whole, the run's on its
/// last entry, the same sum per sender and delegation, which is what the
/// cluster's give-back adds up), `R, count` for that many entries of a run
/// appended whole before its last (appended, nothing trimmed: one pair
/// where there were `count`), `I, trimmed` the same, and the script moved
/// the delegation from the open indexes to the finished one and its bytes
/// out of both peers' budgets itself (with the index keys, and the callee's
/// set and budget being the meta callee's), `D, sender_tail`, `H, tail`, `C, tail`,
/// `T, outcome or ''` (already terminal), `P, ''` or `B, 'd'|'p'`. The
/// stream id of an entry is its sequence (`<seq>-0`), passed to `XADD` as a
/// string the script builds (the decimal of the sequence's tens, formatted
/// once per ten, and a digit), and a listed size as a string formatted once
/// per distinct size: Redis formats a Lua number argument with
/// `snprintf("%.17g")`, which was about an eighth of the script's
/// instructions per entry at the cap.
const APPEND_LUA: &str = include_str!("lua/append.lua");

/// `charge`: KEYS the peer's byte budget hash; ARGV `max_peer_bytes`, then
/// pairs of delegation member (`<caller>#<rid>`) and bytes. Adds every
/// pair's bytes to its member and their sum to `total`, unless `total`
/// would pass the budget: then nothing. Returns 1 if charged, 0 if refused.
const CHARGE_LUA: &str = include_str!("lua/charge.lua");

/// `uncharge`: KEYS the peer's byte budget hash; ARGV delegation member,
/// bytes (empty: everything the member holds). Gives back at most what the
/// member holds, drops the member at zero and the hash when `total` is
/// zero. Returns 1.
const UNCHARGE_LUA: &str = include_str!("lua/uncharge.lua");

/// `read`: KEYS meta, log; ARGV tail field, after, after + 1, limit.
/// Returns `{'U'}`, `{'L', tail, term}`, `{'T', first, term}` or
/// `{'E', tail, term, id, frame, id, frame, ...}`.
const READ_LUA: &str = include_str!("lua/read.lua");

/// `expire` (one finished delegation): KEYS meta, down, up, the two size
/// lists (deleted only when the meta says the log has one); ARGV the terminal
/// ms recorded in the index. Deletes the delegation if it is still the one
/// the index entry was made for. Returns 1 if it is gone now, 0 if a newer
/// delegation with the same key lives there.
///
/// On a single server it also cleans up after it (one call instead of a
/// cleanup pipeline and two `uncharge` calls): KEYS then `oab:finished`,
/// the caller's and the callee's delegation sets and their byte budget
/// hashes; ARGV then the finished-index member and the delegation's member
/// (`<caller>#<rid>`). It removes the index member, and when the delegation
/// is gone also the set members and whatever the delegation still holds of
/// each budget (as `uncharge` with no bytes does), and returns `{gone,
/// removed}`, `removed` being 1 if this call took the member out of
/// `oab:finished`.
const EXPIRE_LUA: &str = include_str!("lua/expire.lua");

/// `compact` (a caller's release of a finished delegation): KEYS meta, down
/// log, up log, down and up size lists, and on a single server the caller's
/// and the callee's delegation sets and `oab:finished`; ARGV the caller's
/// up cursor, the index member (`<caller>#<rid>`), the callee, the
/// finished TTL (used only if the meta has lost its own). When the
/// meta has a terminal, its up tail is the cursor and also the callee's
/// last entry (not a relay-originated terminal), and its callee is the one
/// given, it deletes both logs and their size lists, writes the meta anew
/// (the same fields, the digest as bare hex so that every value fits
/// Redis's compact hash encoding, the held bytes 0) with the TTL the
/// terminal gave it and, given the index keys, takes the
/// member out of the two sets and the finished index: `{1, <terminal ms>,
/// 1}`; without them `{1, <terminal ms>, 0}` (the caller does that in the
/// index's own slots). Otherwise nothing: `{0}`.
const COMPACT_LUA: &str = include_str!("lua/compact.lua");

/// `claim`: KEYS presence; ARGV node, session, floor, incarnation, connector
/// instance (hex), `Hello` time (ms), window (ms). Returns `S` without a
/// change when the stored claim is the same connector instance's with a
/// later `Hello`, by at most the window (a given-up attempt finishing late).
/// Otherwise returns the new generation: above the stored one, above `floor`
/// (the highest generation the claiming instance has seen for the peer), and
/// at least Redis's clock in microseconds, so that it stays above every
/// earlier claim even after the store lost the record (see
/// `FleetStore::claim_presence`). Numbers stay below 2^53, exact in Lua.
const CLAIM_LUA: &str = include_str!("lua/claim.lua");

/// `release`: KEYS presence; ARGV session. Clears node and session if the
/// record still names this session.
const RELEASE_LUA: &str = include_str!("lua/release.lua");

/// `renew`: KEYS nodes, incarnations; ARGV node, lease ms, incarnation.
/// Scores by Redis time, drops nodes and notices whose lease ended, drops
/// earlier incarnations of this node (their process is gone: node names are
/// unique), and returns the live node names and the incarnation members.
const RENEW_LUA: &str = include_str!("lua/renew.lua");

/// `retire`: KEYS nodes, incarnations; ARGV node, lease ms, incarnation.
/// Removes the node and leaves a departure notice for one lease, so the
/// other instances read the departure as a clean leave.
const RETIRE_LUA: &str = include_str!("lua/retire.lua");

/// `lease`: KEYS lease; ARGV node, lease ms. Takes a free lease or renews
/// our own; 1 if held by `node` now.
const LEASE_LUA: &str = include_str!("lua/lease.lua");

/// `unlease`: KEYS lease; ARGV node. Deletes the lease if `node` holds it.
const UNLEASE_LUA: &str = include_str!("lua/unlease.lua");

/// The scripts, hashed once.
#[derive(Debug)]
pub(super) struct Scripts {
    pub(super) open: Script,
    pub(super) append: Script,
    pub(super) read: Script,
    pub(super) expire: Script,
    pub(super) compact: Script,
    pub(super) charge: Script,
    pub(super) uncharge: Script,
}

impl Scripts {
    pub(super) fn new() -> Self {
        Scripts {
            open: Script::new(OPEN_LUA),
            append: Script::new(APPEND_LUA),
            read: Script::new(READ_LUA),
            expire: Script::new(EXPIRE_LUA),
            compact: Script::new(COMPACT_LUA),
            charge: Script::new(CHARGE_LUA),
            uncharge: Script::new(UNCHARGE_LUA),
        }
    }
}

/// The fleet scripts, hashed once.
#[derive(Debug)]
pub(super) struct FleetScripts {
    pub(super) claim: Script,
    pub(super) release: Script,
    pub(super) renew: Script,
    pub(super) retire: Script,
    pub(super) lease: Script,
    pub(super) unlease: Script,
}

impl FleetScripts {
    fn new() -> Self {
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

/// The fleet scripts, hashed on first use.
pub(super) fn fleet_scripts() -> &'static FleetScripts {
    static SCRIPTS: std::sync::OnceLock<FleetScripts> = std::sync::OnceLock::new();
    SCRIPTS.get_or_init(FleetScripts::new)
}

/// An `EVALSHA` of `script` (the caller adds keys and arguments).
pub(super) fn evalsha(script: &Script, keys: &[&str]) -> Cmd {
    let mut c = redis::cmd("EVALSHA");
    c.arg(script.get_hash()).arg(keys.len());
    for k in keys {
        c.arg(*k);
    }
    c
}

impl RedisStore {
    /// `SCRIPT LOAD`s every script. On a cluster the redis crate sends
    /// `SCRIPT LOAD` to every node and fails unless all succeed (its routing
    /// table: `SCRIPT LOAD` is an all-nodes command), so each master has them.
    pub(super) async fn load_scripts(&self) -> Result<(), StoreError> {
        for s in [
            &self.scripts.open,
            &self.scripts.append,
            &self.scripts.read,
            &self.scripts.expire,
            &self.scripts.compact,
            &self.scripts.charge,
            &self.scripts.uncharge,
        ] {
            self.conn
                .load_script(s)
                .await
                .map_err(|e| unavailable("SCRIPT LOAD", &e))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The scripts' `EVALSHA` names (SHA1 of the text) are those of the
    /// scripts as they were before they moved into `lua/` files, so relays of
    /// both versions on one Redis share them. A script changed on purpose
    /// changes its line here.
    #[test]
    fn scripts_keep_their_sha1_names() {
        for (name, text, sha1) in [
            ("open", OPEN_LUA, "e9956c194665047a386c674e10e4ea4d2a14e0f6"),
            (
                "append",
                APPEND_LUA,
                "c98fdb4ea963d872e4ff6ba274f3d496781923b5",
            ),
            (
                "charge",
                CHARGE_LUA,
                "5eefbc9586d4caea5df5f095b47433bb7a7ed6dd",
            ),
            (
                "uncharge",
                UNCHARGE_LUA,
                "e6220f8204f3e0f0575c91cb3380492f46fa0fa1",
            ),
            ("read", READ_LUA, "56750e75b4699ea95f566561b1af0b143a13809f"),
            (
                "compact",
                COMPACT_LUA,
                "4eaad3a582d5f1ae4676d6fabe33c3f2016e3553",
            ),
            (
                "expire",
                EXPIRE_LUA,
                "aee0513c298a2313a486bbfb0c1e313b23a64158",
            ),
            (
                "claim",
                CLAIM_LUA,
                "ab3dc2847326d5f1b8474bc68bdff371acc4253f",
            ),
            (
                "release",
                RELEASE_LUA,
                "c8ccdd79c42f73eb6fa0cb787ece20220bd45d8b",
            ),
            (
                "renew",
                RENEW_LUA,
                "a765e2a6664a1a5c1cb0144452e40b482833b661",
            ),
            (
                "retire",
                RETIRE_LUA,
                "94de9e605b94a48151c013618901383d994e8ce3",
            ),
            (
                "lease",
                LEASE_LUA,
                "aa8a06052f6bbf349b973482be2a126c38a2a616",
            ),
            (
                "unlease",
                UNLEASE_LUA,
                "c0fe86dca9a7825a3e95860568351409cafd1294",
            ),
        ] {
            assert_eq!(Script::new(text).get_hash(), sha1, "lua/{name}.lua");
        }
    }
}
