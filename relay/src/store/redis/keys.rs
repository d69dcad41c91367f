//! Key names of the Redis store and the members of its index sets: the
//! hash tags that keep one delegation (and the node liveness keys) in one
//! cluster slot, the zero-padded members that order like the numbers they
//! carry, and the parsers that read those members back. Pure string
//! formatting: it never sends a command and never reads a reply.
//!
//! # Delegation keys
//!
//! Every key of one delegation carries the same hash tag, `{<caller>#<request_id>}`
//! (neither id may contain `{`, `}`, `#` or `|`), so Redis Cluster keeps the
//! delegation on one shard and its scripts touch a single slot:
//!
//! | key | type | content |
//! |---|---|---|
//! | `oab:d:{<caller>#<rid>}:meta` | hash | `callee`, `dl` deadline, `dg` digest (`sha256:<hex>`; bare hex once compacted), `ct` created, `dt`/`ds` down tail / down sender tail, `ut`/`us` the same for up, `term` outcome name or `""`, `tms` terminal ms or `""`, `acc` accepting instance (hex) or `""`, `tr` the caller's trace id (hex; only when its `Open` carried one, gone once compacted), `db`/`ub` bytes the down / up log holds (for `max_delegation_bytes`), `dz`/`uz` the down / up log's tail when its size list was last in step with it |
//! | `oab:d:{<caller>#<rid>}:down` | stream | entry id `<seq>-0`, one field `f` = the exact frame bytes |
//! | `oab:d:{<caller>#<rid>}:up` | stream | same for the up log |
//! | `oab:d:{<caller>#<rid>}:down:sizes`, `…:up:sizes` | list | from the log's first append batch at `max_log_entries` on, the byte length of each of its newest entries, oldest first: what a trim gives back to the budgets, read without reading the frames; the entries older than the list are read from the log. Used only while meta `dz`/`uz` (the log's tail when the list was last in step) is the log's tail; TTL: the delegation's, or while it is open its deadline plus `finished_ttl_ms` |
//! | `oab:p:{<peer>}:dlg` | set | delegation keys (`<caller>#<rid>`) where the peer is caller or callee |
//! | `oab:p:{<peer>}:open` | set | the same for delegations without a terminal: added at open, removed when the terminal is indexed (readers remove finished or gone members they find) |
//! | `oab:deadlines` | zset (all scores 0) | `<deadline, 20 digits>\|<caller>#<rid>` of open delegations |
//! | `oab:finished` | zset (all scores 0) | `<terminal ms, 20 digits>\|<caller>#<rid>\|<callee>` |
//! | `oab:desc:{<peer>}` | string | the peer's descriptor |
//! | `oab:pb:{<peer>}` | hash | the peer's byte budget (`max_peer_bytes`): `total`, and per delegation it sent entries to, `<caller>#<rid>` = bytes charged; a member is removed when its delegation finishes (or is dropped), the hash when `total` is zero |
//! | `oab:epoch` | string | random non-zero u64, `SET NX` on first use |
//!
//! A delegation its caller released (`compact` script) is its meta hash
//! alone, written anew with the digest as bare hex (so every value fits
//! Redis's compact hash encoding: `sha256:<hex>` is 71 bytes, over the
//! default `hash-max-listpack-value` of 64) and `db`/`ub` 0, keeping the
//! TTL its terminal gave it; its logs and size lists are deleted and it is
//! no longer a member of the `dlg` sets or `oab:finished` (Redis expires
//! it by itself).
//!
//! The two index zsets are ordered lexicographically (`ZRANGEBYLEX`) instead of
//! by score: a zero-padded decimal prefix orders exactly like the u64 it
//! encodes (a score is an f64 and would round above 2^53), and `#` sorts below
//! every byte allowed in a peer id, so ties order exactly like
//! [`DelegationKey`]'s `Ord`, as in the memory store.
//!
//! # Fleet keys
//!
//! | key | type | content |
//! |---|---|---|
//! | `oab:presence:{<peer>}` | hash | `node`, `inc` (the node's incarnation), `session` (hex), `gen` (the last claim's generation; kept when released) |
//! | `oab:nodes` | zset | node name scored by the end of its liveness lease (Redis clock, ms) |
//! | `{oab:nodes}:incarnations` | zset | `<node>\|<incarnation>` of each live process, scored like `oab:nodes`; `<node>\|<incarnation>\|left` for one that left cleanly, scored by the end of the lease it gave up (removed then) |
//! | `oab:lease:<name>` | string | the holding node, with `PX` the lease |
//!
//! Every fleet key is a single key, or `oab:nodes` with its incarnations (one
//! hash slot: the tag `{oab:nodes}` hashes like the key `oab:nodes`).

use oab_wire::{DelegationKey, Direction, PeerId, RequestId};

/// The store epoch key.
pub(super) const EPOCH_KEY: &str = "oab:epoch";
/// Open delegations by deadline.
pub(super) const DEADLINES_KEY: &str = "oab:deadlines";
/// Finished delegations by terminal time.
pub(super) const FINISHED_KEY: &str = "oab:finished";

/// Meta hash fields (short: there is one hash per delegation).
pub(super) mod meta_field {
    pub(in crate::store::redis) const CALLEE: &str = "callee";
    pub(in crate::store::redis) const DEADLINE: &str = "dl";
    pub(in crate::store::redis) const DIGEST: &str = "dg";
    pub(in crate::store::redis) const CREATED: &str = "ct";
    pub(in crate::store::redis) const DOWN_TAIL: &str = "dt";
    pub(in crate::store::redis) const DOWN_SENDER_TAIL: &str = "ds";
    pub(in crate::store::redis) const UP_TAIL: &str = "ut";
    pub(in crate::store::redis) const UP_SENDER_TAIL: &str = "us";
    pub(in crate::store::redis) const TERMINAL: &str = "term";
    pub(in crate::store::redis) const TERMINAL_MS: &str = "tms";
    pub(in crate::store::redis) const ACCEPTED_BY: &str = "acc";
    /// The caller's trace id (hex); absent when its `Open` carried none,
    /// and once the delegation is compacted.
    pub(in crate::store::redis) const TRACE: &str = "tr";
}

/// The keys of one delegation.
pub(super) struct DelegationKeys {
    pub(super) meta: String,
    pub(super) down: String,
    pub(super) up: String,
    pub(super) down_sizes: String,
    pub(super) up_sizes: String,
}

impl DelegationKeys {
    pub(super) fn new(key: &DelegationKey) -> Self {
        let base = format!("oab:d:{{{key}}}");
        DelegationKeys {
            meta: format!("{base}:meta"),
            down: format!("{base}:down"),
            up: format!("{base}:up"),
            down_sizes: format!("{base}:down:sizes"),
            up_sizes: format!("{base}:up:sizes"),
        }
    }

    /// The keys the `append` and `expire` scripts take first, in this
    /// order: meta, down log, up log, and the two logs' size lists.
    pub(super) fn script_keys(&self) -> [&str; 5] {
        [
            &self.meta,
            &self.down,
            &self.up,
            &self.down_sizes,
            &self.up_sizes,
        ]
    }

    /// This log and the other one.
    pub(super) fn logs(&self, dir: Direction) -> (&str, &str) {
        match dir {
            Direction::Down => (&self.down, &self.up),
            Direction::Up => (&self.up, &self.down),
        }
    }
}

pub(super) fn peer_set_key(peer: &PeerId) -> String {
    format!("oab:p:{{{peer}}}:dlg")
}

/// The set of `peer`'s delegations without a terminal: what a handshake
/// reads, so its cost does not grow with the finished ones.
pub(super) fn peer_open_key(peer: &PeerId) -> String {
    format!("oab:p:{{{peer}}}:open")
}

/// The peer's byte budget hash.
pub(super) fn peer_bytes_key(peer: &PeerId) -> String {
    format!("oab:pb:{{{peer}}}")
}

pub(super) fn descriptor_key(peer: &PeerId) -> String {
    format!("oab:desc:{{{peer}}}")
}

pub(super) fn deadline_member(deadline_ms: u64, key: &DelegationKey) -> String {
    format!("{deadline_ms:020}|{key}")
}

pub(super) fn finished_member(terminal_ms: u64, key: &DelegationKey, callee: &PeerId) -> String {
    format!("{terminal_ms:020}|{key}|{callee}")
}

/// The exclusive `ZRANGEBYLEX` upper bound for members whose 20-digit prefix
/// is at most `at`.
pub(super) fn lex_upper_bound(at: u64) -> String {
    match at.checked_add(1) {
        Some(next) => format!("({next:020}"),
        None => "+".to_owned(),
    }
}

/// Parses `<caller>#<request_id>`.
pub(super) fn parse_key(s: &str) -> Option<DelegationKey> {
    let (caller, rid) = s.split_once('#')?;
    Some(DelegationKey::new(
        PeerId::new(caller).ok()?,
        RequestId::new(rid).ok()?,
    ))
}

/// Parses a `oab:deadlines` member.
pub(super) fn parse_deadline_member(m: &str) -> Option<(u64, DelegationKey)> {
    let (at, key) = m.split_once('|')?;
    Some((at.parse().ok()?, parse_key(key)?))
}

/// Parses a `oab:finished` member.
pub(super) fn parse_finished_member(m: &str) -> Option<(u64, DelegationKey, PeerId)> {
    let mut parts = m.split('|');
    let (Some(at), Some(key), Some(callee), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return None;
    };
    Some((at.parse().ok()?, parse_key(key)?, PeerId::new(callee).ok()?))
}

/// Node liveness zset.
pub(super) const NODES_KEY: &str = "oab:nodes";
/// Incarnations of the live nodes, and departure notices; in the hash slot
/// of [`NODES_KEY`].
pub(super) const INCARNATIONS_KEY: &str = "{oab:nodes}:incarnations";
/// Suffix of a departure notice in [`INCARNATIONS_KEY`].
pub(super) const LEFT_SUFFIX: &str = "|left";

pub(super) fn presence_key(peer: &PeerId) -> String {
    format!("oab:presence:{{{peer}}}")
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
}
