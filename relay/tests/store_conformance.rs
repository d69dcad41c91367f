//! Store conformance: every case runs against [`MemoryStore`] and against
//! [`RedisStore`] on a real `redis-server` (one per test, started by
//! `oab_testkit::redis::RedisServer` on a unix socket), and against
//! [`RedisStore`] on a three-master Redis Cluster (`cluster::every_case`:
//! one cluster for all the cases, flushed between them, since forming a
//! cluster takes about 2 s). Then the Redis-only
//! behaviour (restart with and without persistence, expiry by Redis itself,
//! `NOSCRIPT`, outages), and property tests: random operation sequences
//! applied to a simple reference model, the memory store and the Redis store
//! must give the same results.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::{Duration, Instant};

use bytes::Bytes;
use oab_relay::store::{
    AppendOutcome, AppendRequest, Budget, DelegationMeta, EventStore, MemoryStore, OpenOutcome,
    OpenRequest, Origin, ReadOutcome, RedisStore, Release, Retention, StoreError,
};
use oab_testkit::redis::{Persistence, RedisCluster, RedisServer};
use oab_wire::{DelegationKey, Digest, Direction, InstanceId, Outcome, PeerId, RequestId};

// ---------------------------------------------------------------------------
// Helpers

const DAY_MS: u64 = 24 * 3600 * 1000;

fn retention(max_log_entries: u64) -> Retention {
    Retention {
        max_log_entries,
        // Long: Redis expires finished delegations by its own clock, and the
        // shared cases drive expiry with synthetic times instead.
        finished_ttl_ms: DAY_MS,
        ..Retention::default()
    }
}

/// [`retention`] with byte budgets.
fn budgets(max_log_entries: u64, max_delegation_bytes: u64, max_peer_bytes: u64) -> Retention {
    Retention {
        max_delegation_bytes,
        max_peer_bytes,
        ..retention(max_log_entries)
    }
}

fn peer(s: &str) -> PeerId {
    PeerId::new(s).unwrap()
}

fn key(caller: &str, rid: &str) -> DelegationKey {
    DelegationKey::new(peer(caller), RequestId::new(rid).unwrap())
}

fn open_req(key: &DelegationKey, callee: &str, deadline_ms: u64, now_ms: u64) -> OpenRequest {
    OpenRequest {
        key: key.clone(),
        callee: peer(callee),
        deadline_ms,
        digest: Digest::of(b"payload"),
        trace: None,
        frame: Bytes::from(format!("open {key}")),
        now_ms,
        wake: None,
    }
}

fn frame(key: &DelegationKey, dir: Direction, seq: u64, tag: &str) -> Bytes {
    Bytes::from(format!("{key} {} {seq} {tag}", dir.name()))
}

const INSTANCE_A: InstanceId = InstanceId([0xaa; 16]);
const INSTANCE_B: InstanceId = InstanceId([0xbb; 16]);

/// The callee of most cases.
const CALLEE: &str = "acme/callee";

/// A peer-originated entry from the party of its log: the key's caller
/// (down), or [`CALLEE`] (up); see [`sent_by`] for another sender.
fn peer_entry(key: &DelegationKey, dir: Direction, seq: u64) -> AppendRequest {
    let sender = match dir {
        Direction::Down => key.caller.clone(),
        Direction::Up => peer(CALLEE),
    };
    AppendRequest {
        key: key.clone(),
        dir,
        seq,
        terminal: None,
        origin: Origin::Peer {
            peer: sender,
            instance: INSTANCE_A,
        },
        frame: frame(key, dir, seq, "peer"),
        now_ms: 1_000 + seq % 1_000,
        wake: None,
    }
}

/// A relay-originated entry.
fn relay_entry(
    key: &DelegationKey,
    dir: Direction,
    seq: u64,
    terminal: Option<Outcome>,
) -> AppendRequest {
    AppendRequest {
        terminal,
        origin: Origin::Relay,
        frame: frame(key, dir, seq, "relay"),
        ..peer_entry(key, dir, seq)
    }
}

/// `req` as sent by `sender` (same instance).
fn sent_by(mut req: AppendRequest, sender: &str) -> AppendRequest {
    if let Origin::Peer { peer: p, .. } = &mut req.origin {
        *p = peer(sender);
    }
    req
}

fn terminal_entry(key: &DelegationKey, seq: u64, outcome: Outcome, now_ms: u64) -> AppendRequest {
    AppendRequest {
        terminal: Some(outcome),
        now_ms,
        frame: frame(key, Direction::Up, seq, outcome.name()),
        ..peer_entry(key, Direction::Up, seq)
    }
}

async fn append1<S: EventStore>(s: &S, req: AppendRequest) -> AppendOutcome {
    let out = s.append(vec![req]).await.unwrap();
    assert_eq!(out.len(), 1);
    out[0]
}

async fn created<S: EventStore>(s: &S, req: OpenRequest) -> DelegationMeta {
    match s.open(req).await.unwrap() {
        OpenOutcome::Created(m) => m,
        other => panic!("expected Created, got {other:?}"),
    }
}

async fn entries<S: EventStore>(
    s: &S,
    key: &DelegationKey,
    dir: Direction,
    after: u64,
    limit: usize,
) -> Vec<(u64, Bytes)> {
    match s.read(key, dir, after, limit).await.unwrap() {
        ReadOutcome::Entries { entries, .. } => entries,
        other => panic!("expected Entries, got {other:?}"),
    }
}

async fn redis_store(r: Retention) -> (RedisServer, RedisStore) {
    let server = RedisServer::start(Persistence::None).unwrap();
    let store = RedisStore::connect(&server.url(), r).await.unwrap();
    (server, store)
}

/// A plain connection for inspecting Redis from the tests.
async fn raw(server: &RedisServer) -> redis::aio::MultiplexedConnection {
    redis::Client::open(server.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

/// Starts a [`RedisCluster`] off the async threads (it polls with sleeps).
async fn start_cluster() -> RedisCluster {
    tokio::task::spawn_blocking(RedisCluster::start)
        .await
        .unwrap()
        .unwrap()
}

/// Runs each case against a fresh memory store and a fresh Redis store,
/// as `<case>::memory` and `<case>::redis`, and all of them, one after the
/// other, on one Redis Cluster emptied before each case, as
/// `cluster::every_case` (a failure names its case).
macro_rules! conformance {
    ($($case:ident => $retention:expr;)*) => {
        $(
            mod $case {
                use super::*;

                #[tokio::test]
                async fn memory() {
                    super::$case(&MemoryStore::new($retention)).await;
                }

                #[tokio::test]
                async fn redis() {
                    let (_server, store) = redis_store($retention).await;
                    super::$case(&store).await;
                }
            }
        )*

        mod cluster {
            use super::*;

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn every_case() {
                let cluster = start_cluster().await;
                $(
                    eprintln!("cluster case {}", stringify!($case));
                    cluster.flush_all().unwrap();
                    let store = RedisStore::connect(&cluster.url(), $retention)
                        .await
                        .unwrap();
                    assert!(store.is_cluster());
                    super::$case(&store).await;
                )*
            }
        }
    };
}

conformance! {
    open_create_existing_mismatch => retention(100);
    append_in_order => retention(100);
    duplicate_resend_acknowledged_and_stored_once => retention(100);
    hole_refused => retention(100);
    first_terminal_wins => retention(100);
    relay_origin_compare_and_set => retention(100);
    accepted_by_from_first_up_append => retention(100);
    read_after_cursor => retention(100);
    read_trimmed_after_retention => retention(3);
    read_lost_and_unknown => retention(100);
    due_lists_only_open_delegations_past_deadline => retention(100);
    delegations_of_lists_caller_and_callee_side => retention(100);
    open_delegations_of_lists_only_those_without_a_terminal => retention(100);
    finished_delegations_expire => retention(100);
    a_terminal_leaves_the_open_indexes_whoever_wrote_it => retention(100);
    descriptors => retention(100);
    epoch_is_stable => retention(100);
    batch_append_of_1000_entries => retention(10_000);
    batch_outcomes_follow_request_order => retention(100);
    a_run_in_one_batch_is_judged_as_its_entries => budgets(100, 10_000, 1 << 30);
    append_only_from_the_party => retention(100);
    callee_of_names_the_callee => retention(100);
    delegation_byte_budget => budgets(100, 1_000, 1 << 30);
    delegation_byte_budget_counts_only_what_the_logs_hold => budgets(2, 1_000, 1 << 30);
    a_batch_is_judged_entry_by_entry => budgets(2, 1_000, 1 << 30);
    peer_byte_budget => budgets(100, 1 << 30, 1_000);
    peer_byte_budget_gives_back_trimmed_entries => budgets(2, 1 << 30, 1_000);
    held_bytes_follow_a_long_stream_of_varied_sizes => budgets(STREAM_CAP, STREAM_BUDGET, 1 << 30);
    a_released_delegation_keeps_only_its_outcome => retention(100);
}

// ---------------------------------------------------------------------------
// Shared cases

/// `req` with a frame of `len` bytes.
fn sized(mut req: AppendRequest, len: usize) -> AppendRequest {
    req.frame = Bytes::from(vec![b'x'; len]);
    req
}

/// Bytes of the `Open` frame [`open_req`] stores for `key`.
fn open_len(key: &DelegationKey) -> u64 {
    format!("open {key}").len() as u64
}

/// Only the party of a log appends to it (down: the caller, up: the
/// callee), whatever the sequence; a refused entry leaves no trace.
async fn append_only_from_the_party<S: EventStore>(s: &S) {
    let k = key("acme/caller", "party");
    created(s, open_req(&k, CALLEE, 5_000, 1)).await;
    let refused = [
        sent_by(peer_entry(&k, Direction::Down, 2), CALLEE),
        sent_by(peer_entry(&k, Direction::Down, 2), "acme/other"),
        sent_by(peer_entry(&k, Direction::Up, 1), "acme/caller"),
        sent_by(peer_entry(&k, Direction::Up, 1), "acme/other"),
        sent_by(terminal_entry(&k, 1, Outcome::Completed, 10), "acme/other"),
        // Refused before the sequence checks: a resend, a hole.
        sent_by(peer_entry(&k, Direction::Down, 1), "acme/other"),
        sent_by(peer_entry(&k, Direction::Up, 5), "acme/caller"),
    ];
    let outcomes = s.append(refused.to_vec()).await.unwrap();
    assert_eq!(outcomes, vec![AppendOutcome::NotParty; refused.len()]);
    let m = s.meta(&k).await.unwrap().unwrap();
    assert_eq!(
        (
            m.down_tail,
            m.up_tail,
            m.down_sender_tail,
            m.up_sender_tail,
            m.terminal,
            m.accepted_by
        ),
        (1, 0, 1, 0, None, None)
    );
    assert_eq!(entries(s, &k, Direction::Up, 0, 10).await, vec![]);
    assert_eq!(entries(s, &k, Direction::Down, 1, 10).await, vec![]);
    // The parties still append, the relay too.
    assert_eq!(
        append1(s, peer_entry(&k, Direction::Down, 2)).await,
        AppendOutcome::Appended { seq: 2 }
    );
    assert_eq!(
        append1(s, peer_entry(&k, Direction::Up, 1)).await,
        AppendOutcome::Appended { seq: 1 }
    );
    assert_eq!(
        append1(s, relay_entry(&k, Direction::Up, 2, Some(Outcome::Expired))).await,
        AppendOutcome::Appended { seq: 2 }
    );
    // A delegation that does not exist stays `Unknown` for anyone.
    let nobody = key("acme/caller", "nobody");
    assert_eq!(
        append1(
            s,
            sent_by(peer_entry(&nobody, Direction::Up, 1), "acme/other")
        )
        .await,
        AppendOutcome::Unknown
    );
}

/// `callee_of` reads the one field that tells a party apart, and nothing
/// for a missing delegation.
async fn callee_of_names_the_callee<S: EventStore>(s: &S) {
    let k = key("acme/caller", "who");
    assert_eq!(s.callee_of(&k).await.unwrap(), None);
    created(s, open_req(&k, CALLEE, 5_000, 1)).await;
    assert_eq!(s.callee_of(&k).await.unwrap(), Some(peer(CALLEE)));
    append1(
        s,
        AppendRequest {
            now_ms: 10,
            ..relay_entry(&k, Direction::Up, 1, Some(Outcome::Expired))
        },
    )
    .await;
    assert_eq!(s.expire_finished(10 + DAY_MS).await.unwrap(), 1);
    assert_eq!(s.callee_of(&k).await.unwrap(), None);
}

/// `max_delegation_bytes` = 1,000: the two logs together (the `Open`
/// included) never hold more; a refused entry is not stored; relay entries
/// pass; the other checks come first.
async fn delegation_byte_budget<S: EventStore>(s: &S) {
    let k = key("acme/caller", "budget");
    created(s, open_req(&k, CALLEE, 5_000, 1)).await;
    let open = open_len(&k);
    assert_eq!(
        append1(s, sized(peer_entry(&k, Direction::Down, 2), 400)).await,
        AppendOutcome::Appended { seq: 2 }
    );
    assert_eq!(
        append1(s, sized(peer_entry(&k, Direction::Up, 1), 400)).await,
        AppendOutcome::Appended { seq: 1 }
    );
    // open + 800 held: 1,000 - open - 800 bytes are left.
    let left = (1_000 - open - 800) as usize;
    let over = AppendOutcome::OverBudget {
        budget: Budget::Delegation,
    };
    assert_eq!(
        append1(s, sized(peer_entry(&k, Direction::Up, 2), left + 1)).await,
        over
    );
    assert_eq!(
        append1(s, sized(peer_entry(&k, Direction::Down, 3), left + 1)).await,
        over
    );
    let m = s.meta(&k).await.unwrap().unwrap();
    assert_eq!((m.down_tail, m.up_tail), (2, 1));
    assert_eq!(entries(s, &k, Direction::Up, 1, 10).await, vec![]);
    // A resend is still a duplicate, a stranger still not the party.
    assert_eq!(
        append1(s, sized(peer_entry(&k, Direction::Up, 1), 900)).await,
        AppendOutcome::Duplicate { tail: 1 }
    );
    assert_eq!(
        append1(
            s,
            sent_by(sized(peer_entry(&k, Direction::Up, 2), 900), "acme/other")
        )
        .await,
        AppendOutcome::NotParty
    );
    // Exactly what is left fits.
    assert_eq!(
        append1(s, sized(peer_entry(&k, Direction::Up, 2), left)).await,
        AppendOutcome::Appended { seq: 2 }
    );
    assert_eq!(
        append1(s, sized(peer_entry(&k, Direction::Up, 3), 1)).await,
        over
    );
    // The relay's terminal is never refused for bytes.
    assert_eq!(
        append1(s, relay_entry(&k, Direction::Up, 3, Some(Outcome::Expired))).await,
        AppendOutcome::Appended { seq: 3 }
    );
    assert_eq!(
        s.meta(&k).await.unwrap().unwrap().terminal,
        Some(Outcome::Expired)
    );
}

/// Entries trimmed by `max_log_entries` (2 here) no longer count against
/// `max_delegation_bytes` (1,000).
async fn delegation_byte_budget_counts_only_what_the_logs_hold<S: EventStore>(s: &S) {
    let k = key("acme/caller", "trimmed");
    created(s, open_req(&k, CALLEE, 5_000, 1)).await;
    for seq in 2..=3 {
        assert_eq!(
            append1(s, sized(peer_entry(&k, Direction::Down, seq), 400)).await,
            AppendOutcome::Appended { seq }
        );
    }
    // The open was trimmed: 800 held, so 200 fit.
    assert_eq!(
        append1(s, sized(peer_entry(&k, Direction::Up, 1), 200)).await,
        AppendOutcome::Appended { seq: 1 }
    );
    assert_eq!(
        append1(s, sized(peer_entry(&k, Direction::Up, 2), 1)).await,
        AppendOutcome::OverBudget {
            budget: Budget::Delegation
        }
    );
}

/// One batch of one delegation's entries gets the outcomes, the trims and
/// the held bytes that appending its entries one at a time gives
/// (`max_log_entries` 2, `max_delegation_bytes` 1,000): each entry is judged
/// after the ones before it, including what their trims freed, and a batch
/// longer than the log trims its own first entries.
async fn a_batch_is_judged_entry_by_entry<S: EventStore>(s: &S) {
    let k = key("acme/caller", "batched");
    created(s, open_req(&k, CALLEE, 5_000, 1)).await;
    let outcomes = s
        .append(vec![
            sized(peer_entry(&k, Direction::Down, 2), 400),
            sized(peer_entry(&k, Direction::Down, 3), 400),
            // The open was trimmed by seq 3: 800 held, so 200 fit.
            sized(peer_entry(&k, Direction::Up, 1), 200),
            sized(peer_entry(&k, Direction::Up, 2), 1),
            sized(peer_entry(&k, Direction::Down, 3), 400),
            sized(peer_entry(&k, Direction::Down, 5), 1),
        ])
        .await
        .unwrap();
    assert_eq!(
        outcomes,
        vec![
            AppendOutcome::Appended { seq: 2 },
            AppendOutcome::Appended { seq: 3 },
            AppendOutcome::Appended { seq: 1 },
            AppendOutcome::OverBudget {
                budget: Budget::Delegation
            },
            AppendOutcome::Duplicate { tail: 3 },
            AppendOutcome::Hole { tail: 3 },
        ]
    );

    let k = key("acme/caller", "batched-stream");
    created(s, open_req(&k, CALLEE, 5_000, 1)).await;
    let open = open_len(&k);
    // Twenty entries of 300 in one batch: only the last two stay, so the
    // delegation never holds more than the open and 600.
    let outcomes = s
        .append(
            (1..=20)
                .map(|seq| sized(peer_entry(&k, Direction::Up, seq), 300))
                .collect(),
        )
        .await
        .unwrap();
    assert_eq!(
        outcomes,
        (1..=20)
            .map(|seq| AppendOutcome::Appended { seq })
            .collect::<Vec<_>>()
    );
    assert_eq!(
        entries(s, &k, Direction::Up, 18, 10)
            .await
            .into_iter()
            .map(|(seq, frame)| (seq, frame.len()))
            .collect::<Vec<_>>(),
        vec![(19, 300), (20, 300)]
    );
    assert!(matches!(
        s.read(&k, Direction::Up, 0, 10).await.unwrap(),
        ReadOutcome::Trimmed {
            first_available: 19,
            ..
        }
    ));
    // The held bytes are exact: the budget is checked before the trim, so
    // 400 - open more fit and one byte more does not.
    let room = (1_000 - 600 - open) as usize;
    assert_eq!(
        append1(s, sized(peer_entry(&k, Direction::Up, 21), room + 1)).await,
        AppendOutcome::OverBudget {
            budget: Budget::Delegation
        }
    );
    assert_eq!(
        append1(s, sized(peer_entry(&k, Direction::Up, 21), room)).await,
        AppendOutcome::Appended { seq: 21 }
    );
}

/// `max_peer_bytes` = 1,000 over all of a peer's delegations; each peer has
/// its own; a delegation dropped after its retention gives its bytes back.
async fn peer_byte_budget<S: EventStore>(s: &S) {
    let ks: Vec<DelegationKey> = (0..3)
        .map(|i| key("acme/caller", &format!("peer-{i}")))
        .collect();
    for k in &ks {
        created(s, open_req(k, CALLEE, 5_000, 1)).await;
    }
    let over = AppendOutcome::OverBudget {
        budget: Budget::Peer,
    };
    // In one batch: 400 + 400 fit, the third 400 does not, 200 does.
    let outcomes = s
        .append(vec![
            sized(peer_entry(&ks[0], Direction::Up, 1), 400),
            sized(peer_entry(&ks[1], Direction::Up, 1), 400),
            sized(peer_entry(&ks[2], Direction::Up, 1), 400),
            sized(peer_entry(&ks[2], Direction::Up, 1), 200),
            sized(peer_entry(&ks[2], Direction::Up, 2), 1),
        ])
        .await
        .unwrap();
    assert_eq!(
        outcomes,
        vec![
            AppendOutcome::Appended { seq: 1 },
            AppendOutcome::Appended { seq: 1 },
            over,
            AppendOutcome::Appended { seq: 1 },
            over,
        ]
    );
    assert_eq!(
        entries(s, &ks[2], Direction::Up, 0, 10).await,
        vec![(1, Bytes::from(vec![b'x'; 200]))]
    );
    // A resend is still a duplicate; the caller has its own budget.
    assert_eq!(
        append1(s, sized(peer_entry(&ks[0], Direction::Up, 1), 400)).await,
        AppendOutcome::Duplicate { tail: 1 }
    );
    assert_eq!(
        append1(s, sized(peer_entry(&ks[2], Direction::Down, 2), 900)).await,
        AppendOutcome::Appended { seq: 2 }
    );
    // Refused entries were not charged: the callee is at exactly 1,000.
    assert_eq!(
        append1(s, sized(peer_entry(&ks[1], Direction::Up, 2), 1)).await,
        over
    );
    // The relay ends ks[0]: its 400 bytes leave the callee's budget at
    // once, though the delegation stays stored for its retention (a budget
    // bounds what a peer holds open).
    assert_eq!(
        append1(
            s,
            AppendRequest {
                now_ms: 10,
                ..relay_entry(&ks[0], Direction::Up, 2, Some(Outcome::Expired))
            }
        )
        .await,
        AppendOutcome::Appended { seq: 2 }
    );
    assert_eq!(
        entries(s, &ks[0], Direction::Up, 0, 1).await.len(),
        1,
        "the finished delegation is still readable"
    );
    assert_eq!(
        append1(s, sized(peer_entry(&ks[1], Direction::Up, 2), 400)).await,
        AppendOutcome::Appended { seq: 2 }
    );
    assert_eq!(
        append1(s, sized(peer_entry(&ks[1], Direction::Up, 3), 1)).await,
        over
    );
    // Dropping it later gives nothing back a second time.
    assert_eq!(s.expire_finished(10 + DAY_MS).await.unwrap(), 1);
    assert_eq!(
        append1(s, sized(peer_entry(&ks[1], Direction::Up, 3), 1)).await,
        over
    );
    // A callee's own terminal frees what it charged, in the same call (an
    // empty one: the callee is at exactly its budget).
    assert_eq!(
        append1(
            s,
            AppendRequest {
                terminal: Some(Outcome::Completed),
                ..sized(peer_entry(&ks[1], Direction::Up, 3), 0)
            }
        )
        .await,
        AppendOutcome::Appended { seq: 3 }
    );
    assert_eq!(
        append1(s, sized(peer_entry(&ks[2], Direction::Up, 2), 800)).await,
        AppendOutcome::Appended { seq: 2 }
    );
}

/// What `max_log_entries` (2 here) trims from a peer's log no longer counts
/// against its `max_peer_bytes` (1,000): a long stream keeps flowing.
async fn peer_byte_budget_gives_back_trimmed_entries<S: EventStore>(s: &S) {
    let k = key("acme/caller", "stream");
    created(s, open_req(&k, CALLEE, 5_000, 1)).await;
    // Without the give-back the fourth entry would pass 1,000.
    for seq in 1..=20 {
        assert_eq!(
            append1(s, sized(peer_entry(&k, Direction::Up, seq), 300)).await,
            AppendOutcome::Appended { seq },
            "seq {seq}"
        );
    }
    // Two entries of 300 held: 400 more fit (checked before the trim), 401
    // do not.
    assert_eq!(
        append1(s, sized(peer_entry(&k, Direction::Up, 21), 401)).await,
        AppendOutcome::OverBudget {
            budget: Budget::Peer
        }
    );
    assert_eq!(
        append1(s, sized(peer_entry(&k, Direction::Up, 21), 400)).await,
        AppendOutcome::Appended { seq: 21 }
    );
}

/// `max_log_entries` and `max_delegation_bytes` of [`Stream`]'s cases.
const STREAM_CAP: u64 = 3;
const STREAM_BUDGET: u64 = 3_000;

/// A long stream on both logs of one delegation, far past `STREAM_CAP`, in
/// batches of 1 to 6 entries of pseudo-random sizes and directions, with
/// what the logs must hold modelled beside it.
struct Stream {
    key: DelegationKey,
    /// The sizes each log holds, oldest first: down, up.
    logs: [VecDeque<usize>; 2],
    next: [u64; 2],
    rng: u64,
}

impl Stream {
    async fn open<S: EventStore>(s: &S, rid: &str) -> Stream {
        let key = key("acme/caller", rid);
        created(s, open_req(&key, CALLEE, 5_000, 1)).await;
        let open = usize::try_from(open_len(&key)).unwrap();
        Stream {
            key,
            logs: [VecDeque::from([open]), VecDeque::new()],
            next: [2, 1],
            rng: 7,
        }
    }

    fn held(&self) -> u64 {
        self.logs.iter().flatten().sum::<usize>() as u64
    }

    /// The next entry of log `at` (0 down, 1 up), and its place in the model.
    fn entry(&mut self, at: usize, size: usize) -> AppendRequest {
        let dir = [Direction::Down, Direction::Up][at];
        let seq = self.next[at];
        self.next[at] += 1;
        let log = &mut self.logs[at];
        log.push_back(size);
        if log.len() > STREAM_CAP as usize {
            log.pop_front();
        }
        sized(peer_entry(&self.key, dir, seq), size)
    }

    async fn batches<S: EventStore>(&mut self, s: &S, rounds: usize) {
        for round in 0..rounds {
            let mut batch = Vec::new();
            for _ in 0..=round % 6 {
                self.rng = self
                    .rng
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                let at = usize::from(!(self.rng >> 33).is_multiple_of(3));
                let size = 1 + usize::try_from((self.rng >> 40) % 200).unwrap();
                batch.push(self.entry(at, size));
            }
            let expect: Vec<AppendOutcome> = batch
                .iter()
                .map(|r| AppendOutcome::Appended { seq: r.seq })
                .collect();
            assert_eq!(s.append(batch).await.unwrap(), expect, "round {round}");
            if round % 3 == 2 && self.logs[1].len() == STREAM_CAP as usize {
                self.probe(s, round).await;
            }
        }
    }

    /// The delegation's held bytes are exactly the model's: one byte more
    /// than the room left is refused, the room itself fits. Then three
    /// one-byte entries trim the probe away again.
    async fn probe<S: EventStore>(&mut self, s: &S, round: usize) {
        let room = usize::try_from(STREAM_BUDGET - self.held()).unwrap();
        let over = sized(peer_entry(&self.key, Direction::Up, self.next[1]), room + 1);
        assert_eq!(
            append1(s, over).await,
            AppendOutcome::OverBudget {
                budget: Budget::Delegation
            },
            "round {round}: {room} bytes should be left"
        );
        for size in [room, 1, 1, 1] {
            let req = self.entry(1, size);
            let seq = req.seq;
            assert_eq!(
                append1(s, req).await,
                AppendOutcome::Appended { seq },
                "round {round}"
            );
        }
    }

    /// The up log holds the model's last entries, in order.
    async fn check_up<S: EventStore>(&self, s: &S) {
        let tail = self.next[1] - 1;
        let ReadOutcome::Entries { entries, .. } = s
            .read(&self.key, Direction::Up, tail - STREAM_CAP, 10)
            .await
            .unwrap()
        else {
            panic!("the up log is readable");
        };
        let sizes: Vec<usize> = entries.iter().map(|(_, f)| f.len()).collect();
        assert_eq!(sizes, Vec::from(self.logs[1].clone()));
        let meta = s
            .meta(&self.key)
            .await
            .unwrap()
            .expect("the meta reads back");
        assert_eq!(meta.up_tail, tail);
    }
}

/// A long stream far past `max_log_entries` (3), in batches of varied
/// length, entry sizes and directions: what each trim gives back keeps the
/// delegation's held bytes exact (probed at `max_delegation_bytes` every
/// few batches), on the Redis store also once the logs' sizes are taken
/// from their size lists instead of the logs.
async fn held_bytes_follow_a_long_stream_of_varied_sizes<S: EventStore>(s: &S) {
    let mut stream = Stream::open(s, "long-stream").await;
    stream.batches(s, 60).await;
    stream.check_up(s).await;
    // One batch longer than the log, in one direction.
    let batch: Vec<AppendRequest> = (0..1_100).map(|i| stream.entry(1, 1 + i % 199)).collect();
    let expect: Vec<AppendOutcome> = batch
        .iter()
        .map(|r| AppendOutcome::Appended { seq: r.seq })
        .collect();
    assert_eq!(s.append(batch).await.unwrap(), expect);
    stream.probe(s, 60).await;
    stream.batches(s, 12).await;
    stream.check_up(s).await;
}

/// One batch of a long stream on a single server or in memory: each entry
/// is charged after the trims of the ones before it gave their bytes back,
/// as one at a time, so the whole batch fits a `max_peer_bytes` (1,000)
/// that holds only three of its entries. (A Redis Cluster charges a batch
/// before appending it, the budget being in another slot: there the
/// entries of the same batch past the budget are refused as over budget.)
async fn a_batch_gives_trimmed_bytes_back_as_it_goes<S: EventStore>(s: &S) {
    let k = key("acme/caller", "batched-budget");
    created(s, open_req(&k, CALLEE, 5_000, 1)).await;
    let outcomes = s
        .append(
            (1..=20)
                .map(|seq| sized(peer_entry(&k, Direction::Up, seq), 300))
                .collect(),
        )
        .await
        .unwrap();
    assert_eq!(
        outcomes,
        (1..=20)
            .map(|seq| AppendOutcome::Appended { seq })
            .collect::<Vec<_>>()
    );
    assert_eq!(
        append1(s, sized(peer_entry(&k, Direction::Up, 21), 401)).await,
        AppendOutcome::OverBudget {
            budget: Budget::Peer
        }
    );
    assert_eq!(
        append1(s, sized(peer_entry(&k, Direction::Up, 21), 400)).await,
        AppendOutcome::Appended { seq: 21 }
    );
}

mod a_batch_gives_trimmed_bytes_back_as_it_goes {
    use super::*;

    #[tokio::test]
    async fn memory() {
        super::a_batch_gives_trimmed_bytes_back_as_it_goes(&MemoryStore::new(budgets(
            2,
            1 << 30,
            1_000,
        )))
        .await;
    }

    #[tokio::test]
    async fn redis() {
        let (_server, store) = redis_store(budgets(2, 1 << 30, 1_000)).await;
        super::a_batch_gives_trimmed_bytes_back_as_it_goes(&store).await;
    }
}

async fn open_create_existing_mismatch<S: EventStore>(s: &S) {
    let k = key("acme/caller", "req-1");
    let meta = created(s, open_req(&k, "acme/callee", 5_000, 100)).await;
    assert_eq!(meta.key, k);
    assert_eq!(meta.callee, peer("acme/callee"));
    assert_eq!(meta.deadline_ms, 5_000);
    assert_eq!(meta.created_ms, 100);
    assert_eq!(meta.digest, Digest::of(b"payload"));
    assert_eq!((meta.down_tail, meta.down_sender_tail), (1, 1));
    assert_eq!((meta.up_tail, meta.up_sender_tail), (0, 0));
    assert_eq!(
        (meta.terminal, meta.terminal_ms, meta.accepted_by),
        (None, None, None)
    );
    assert_eq!(s.meta(&k).await.unwrap(), Some(meta.clone()));

    // A retry with the same digest (other frame bytes, later) finds it as it was.
    let mut retry = open_req(&k, "acme/callee", 9_000, 200);
    retry.frame = Bytes::from_static(b"resent open");
    assert_eq!(
        s.open(retry).await.unwrap(),
        OpenOutcome::Existing(meta.clone())
    );

    // Another digest is a mismatch and changes nothing.
    let mut other = open_req(&k, "acme/other", 9_000, 300);
    other.digest = Digest::of(b"another payload");
    assert_eq!(
        s.open(other).await.unwrap(),
        OpenOutcome::Mismatch(meta.clone())
    );

    // Down entry 1 is the first open frame.
    assert_eq!(
        s.read(&k, Direction::Down, 0, 10).await.unwrap(),
        ReadOutcome::Entries {
            entries: vec![(1, Bytes::from(format!("open {k}")))],
            tail: 1,
            terminal: None,
        }
    );
    assert_eq!(s.meta(&k).await.unwrap(), Some(meta));
}

async fn append_in_order<S: EventStore>(s: &S) {
    let k = key("acme/caller", "req-1");
    created(s, open_req(&k, "acme/callee", 5_000, 100)).await;
    for seq in 2..=4 {
        assert_eq!(
            append1(s, peer_entry(&k, Direction::Down, seq)).await,
            AppendOutcome::Appended { seq }
        );
    }
    for seq in 1..=3 {
        assert_eq!(
            append1(s, peer_entry(&k, Direction::Up, seq)).await,
            AppendOutcome::Appended { seq }
        );
    }
    let meta = s.meta(&k).await.unwrap().unwrap();
    assert_eq!((meta.down_tail, meta.down_sender_tail), (4, 4));
    assert_eq!((meta.up_tail, meta.up_sender_tail), (3, 3));
    assert_eq!(meta.tail(Direction::Down), 4);
    let down = entries(s, &k, Direction::Down, 1, 100).await;
    assert_eq!(
        down,
        (2..=4)
            .map(|q| (q, frame(&k, Direction::Down, q, "peer")))
            .collect::<Vec<_>>()
    );
    let up = entries(s, &k, Direction::Up, 0, 100).await;
    assert_eq!(
        up,
        (1..=3)
            .map(|q| (q, frame(&k, Direction::Up, q, "peer")))
            .collect::<Vec<_>>()
    );
}

async fn duplicate_resend_acknowledged_and_stored_once<S: EventStore>(s: &S) {
    let k = key("acme/caller", "req-1");
    created(s, open_req(&k, "acme/callee", 5_000, 100)).await;
    for seq in 2..=3 {
        append1(s, peer_entry(&k, Direction::Down, seq)).await;
    }
    append1(s, peer_entry(&k, Direction::Up, 1)).await;
    for seq in 1..=3 {
        let mut resend = peer_entry(&k, Direction::Down, seq);
        resend.frame = Bytes::from_static(b"different bytes");
        assert_eq!(
            append1(s, resend).await,
            AppendOutcome::Duplicate { tail: 3 },
            "resend of {seq}"
        );
    }
    assert_eq!(
        append1(s, peer_entry(&k, Direction::Up, 1)).await,
        AppendOutcome::Duplicate { tail: 1 }
    );
    // Stored once, with the first bytes.
    let down = entries(s, &k, Direction::Down, 0, 100).await;
    assert_eq!(down.len(), 3);
    assert_eq!(down[1], (2, frame(&k, Direction::Down, 2, "peer")));
    assert_eq!(entries(s, &k, Direction::Up, 0, 100).await.len(), 1);
    let meta = s.meta(&k).await.unwrap().unwrap();
    assert_eq!((meta.down_tail, meta.up_tail), (3, 1));
}

async fn hole_refused<S: EventStore>(s: &S) {
    let k = key("acme/caller", "req-1");
    created(s, open_req(&k, "acme/callee", 5_000, 100)).await;
    assert_eq!(
        append1(s, peer_entry(&k, Direction::Down, 3)).await,
        AppendOutcome::Hole { tail: 1 }
    );
    assert_eq!(
        append1(s, peer_entry(&k, Direction::Up, 2)).await,
        AppendOutcome::Hole { tail: 0 }
    );
    assert_eq!(
        append1(s, peer_entry(&k, Direction::Up, u64::MAX)).await,
        AppendOutcome::Hole { tail: 0 }
    );
    let meta = s.meta(&k).await.unwrap().unwrap();
    assert_eq!((meta.down_tail, meta.up_tail), (1, 0));
    assert_eq!(entries(s, &k, Direction::Up, 0, 10).await, vec![]);
    // The missing one, then the refused one, go in.
    assert_eq!(
        append1(s, peer_entry(&k, Direction::Down, 2)).await,
        AppendOutcome::Appended { seq: 2 }
    );
    assert_eq!(
        append1(s, peer_entry(&k, Direction::Down, 3)).await,
        AppendOutcome::Appended { seq: 3 }
    );
}

async fn first_terminal_wins<S: EventStore>(s: &S) {
    let k = key("acme/caller", "req-1");
    created(s, open_req(&k, "acme/callee", 5_000, 100)).await;
    append1(s, peer_entry(&k, Direction::Up, 1)).await;
    assert_eq!(
        append1(s, terminal_entry(&k, 2, Outcome::Completed, 4_242)).await,
        AppendOutcome::Appended { seq: 2 }
    );
    let meta = s.meta(&k).await.unwrap().unwrap();
    assert_eq!(meta.terminal, Some(Outcome::Completed));
    assert_eq!(meta.terminal_ms, Some(4_242));

    let already = AppendOutcome::AlreadyTerminal {
        outcome: Outcome::Completed,
    };
    // A second terminal, by the callee or by the relay.
    assert_eq!(
        append1(s, terminal_entry(&k, 3, Outcome::Failed, 5_000)).await,
        already
    );
    assert_eq!(
        append1(s, relay_entry(&k, Direction::Up, 3, Some(Outcome::Expired))).await,
        already
    );
    // Frames after the terminal, both logs.
    assert_eq!(append1(s, peer_entry(&k, Direction::Up, 3)).await, already);
    assert_eq!(
        append1(s, peer_entry(&k, Direction::Down, 2)).await,
        already
    );
    // A resend of the terminal is still a duplicate; a hole is still a hole.
    assert_eq!(
        append1(s, terminal_entry(&k, 2, Outcome::Completed, 6_000)).await,
        AppendOutcome::Duplicate { tail: 2 }
    );
    assert_eq!(
        append1(s, peer_entry(&k, Direction::Up, 9)).await,
        AppendOutcome::Hole { tail: 2 }
    );
    let meta = s.meta(&k).await.unwrap().unwrap();
    assert_eq!(meta.terminal, Some(Outcome::Completed));
    assert_eq!(meta.terminal_ms, Some(4_242));
    assert_eq!((meta.up_tail, meta.down_tail), (2, 1));
    match s.read(&k, Direction::Up, 0, 10).await.unwrap() {
        ReadOutcome::Entries {
            entries,
            tail,
            terminal,
        } => {
            assert_eq!(entries.len(), 2);
            assert_eq!(entries[1].1, frame(&k, Direction::Up, 2, "completed"));
            assert_eq!((tail, terminal), (2, Some(Outcome::Completed)));
        }
        other => panic!("{other:?}"),
    }
}

async fn relay_origin_compare_and_set<S: EventStore>(s: &S) {
    let k = key("acme/caller", "req-1");
    created(s, open_req(&k, "acme/callee", 5_000, 100)).await;
    append1(s, peer_entry(&k, Direction::Up, 1)).await;
    // The compare-and-set loses when seq != tail + 1.
    for seq in [0, 1, 3] {
        assert_eq!(
            append1(
                s,
                relay_entry(&k, Direction::Up, seq, Some(Outcome::Expired))
            )
            .await,
            AppendOutcome::Conflict { tail: 1 },
            "seq {seq}"
        );
    }
    // And wins at tail + 1: the relay's `expired` terminal.
    assert_eq!(
        append1(s, relay_entry(&k, Direction::Up, 2, Some(Outcome::Expired))).await,
        AppendOutcome::Appended { seq: 2 }
    );
    let meta = s.meta(&k).await.unwrap().unwrap();
    assert_eq!(meta.terminal, Some(Outcome::Expired));
    assert_eq!((meta.up_tail, meta.up_sender_tail), (2, 1));
    // The callee's own frame 2 arrives late: that slot is the relay's, and
    // the delegation ended: AlreadyTerminal, not Duplicate.
    assert_eq!(
        append1(s, peer_entry(&k, Direction::Up, 2)).await,
        AppendOutcome::AlreadyTerminal {
            outcome: Outcome::Expired
        }
    );
    assert_eq!(
        append1(s, peer_entry(&k, Direction::Up, 1)).await,
        AppendOutcome::Duplicate { tail: 1 }
    );
    // The cancel the relay sends down after expiry goes in after the terminal.
    assert_eq!(
        append1(s, relay_entry(&k, Direction::Down, 2, None)).await,
        AppendOutcome::Appended { seq: 2 }
    );
    assert_eq!(
        append1(s, relay_entry(&k, Direction::Down, 2, None)).await,
        AppendOutcome::Conflict { tail: 2 }
    );
    assert_eq!(
        append1(s, peer_entry(&k, Direction::Down, 2)).await,
        AppendOutcome::AlreadyTerminal {
            outcome: Outcome::Expired
        }
    );
    let meta = s.meta(&k).await.unwrap().unwrap();
    assert_eq!((meta.down_tail, meta.down_sender_tail), (2, 1));
    assert_eq!(
        entries(s, &k, Direction::Down, 1, 10).await,
        vec![(2, frame(&k, Direction::Down, 2, "relay"))]
    );

    // A relay entry that is not a terminal, before any terminal: a peer
    // frame at its slot is refused as terminal-unknown (it can never be
    // stored there), as the memory store defines.
    let k2 = key("acme/caller", "req-2");
    created(s, open_req(&k2, "acme/callee", 5_000, 100)).await;
    assert_eq!(
        append1(s, relay_entry(&k2, Direction::Down, 2, None)).await,
        AppendOutcome::Appended { seq: 2 }
    );
    assert_eq!(
        append1(s, peer_entry(&k2, Direction::Down, 2)).await,
        AppendOutcome::AlreadyTerminal {
            outcome: Outcome::Unknown
        }
    );
    assert_eq!(s.meta(&k2).await.unwrap().unwrap().terminal, None);
}

async fn accepted_by_from_first_up_append<S: EventStore>(s: &S) {
    let k = key("acme/caller", "req-1");
    created(s, open_req(&k, "acme/callee", 5_000, 100)).await;
    append1(s, peer_entry(&k, Direction::Down, 2)).await;
    assert_eq!(s.meta(&k).await.unwrap().unwrap().accepted_by, None);
    let mut first = peer_entry(&k, Direction::Up, 1);
    first.origin = Origin::Peer {
        peer: peer(CALLEE),
        instance: INSTANCE_B,
    };
    append1(s, first).await;
    assert_eq!(
        s.meta(&k).await.unwrap().unwrap().accepted_by,
        Some(INSTANCE_B)
    );
    // Later up entries from another instance do not change it.
    append1(s, peer_entry(&k, Direction::Up, 2)).await;
    assert_eq!(
        s.meta(&k).await.unwrap().unwrap().accepted_by,
        Some(INSTANCE_B)
    );

    // A relay entry (the `unknown` terminal) is not an acceptance.
    let k2 = key("acme/caller", "req-2");
    created(s, open_req(&k2, "acme/callee", 5_000, 100)).await;
    append1(
        s,
        relay_entry(&k2, Direction::Up, 1, Some(Outcome::Unknown)),
    )
    .await;
    let meta = s.meta(&k2).await.unwrap().unwrap();
    assert_eq!(
        (meta.accepted_by, meta.terminal),
        (None, Some(Outcome::Unknown))
    );
}

async fn read_after_cursor<S: EventStore>(s: &S) {
    let k = key("acme/caller", "req-1");
    created(s, open_req(&k, "acme/callee", 5_000, 100)).await;
    for seq in 2..=6 {
        append1(s, peer_entry(&k, Direction::Down, seq)).await;
    }
    assert_eq!(entries(s, &k, Direction::Down, 0, 100).await.len(), 6);
    assert_eq!(
        s.read(&k, Direction::Down, 2, 2).await.unwrap(),
        ReadOutcome::Entries {
            entries: vec![
                (3, frame(&k, Direction::Down, 3, "peer")),
                (4, frame(&k, Direction::Down, 4, "peer")),
            ],
            tail: 6,
            terminal: None,
        }
    );
    assert_eq!(
        s.read(&k, Direction::Down, 6, 10).await.unwrap(),
        ReadOutcome::Entries {
            entries: vec![],
            tail: 6,
            terminal: None,
        }
    );
    assert_eq!(
        s.read(&k, Direction::Down, 0, 0).await.unwrap(),
        ReadOutcome::Entries {
            entries: vec![],
            tail: 6,
            terminal: None,
        }
    );
    assert_eq!(
        entries(s, &k, Direction::Down, 5, usize::MAX).await,
        vec![(6, frame(&k, Direction::Down, 6, "peer"))]
    );
    // The up log is empty.
    assert_eq!(
        s.read(&k, Direction::Up, 0, 10).await.unwrap(),
        ReadOutcome::Entries {
            entries: vec![],
            tail: 0,
            terminal: None,
        }
    );
}

async fn read_trimmed_after_retention<S: EventStore>(s: &S) {
    // max_log_entries = 3
    let k = key("acme/caller", "req-1");
    created(s, open_req(&k, "acme/callee", 5_000, 100)).await;
    for seq in 2..=10 {
        append1(s, peer_entry(&k, Direction::Down, seq)).await;
    }
    for after in [0, 5, 6] {
        assert_eq!(
            s.read(&k, Direction::Down, after, 10).await.unwrap(),
            ReadOutcome::Trimmed {
                first_available: 8,
                terminal: None,
            },
            "after {after}"
        );
    }
    assert_eq!(
        entries(s, &k, Direction::Down, 7, 10).await,
        (8..=10)
            .map(|q| (q, frame(&k, Direction::Down, q, "peer")))
            .collect::<Vec<_>>()
    );
    assert_eq!(
        entries(s, &k, Direction::Down, 9, 10).await,
        vec![(10, frame(&k, Direction::Down, 10, "peer"))]
    );
    // Trimming does not move the tails, and the terminal is reported.
    for seq in 1..=4 {
        append1(s, peer_entry(&k, Direction::Up, seq)).await;
    }
    append1(s, terminal_entry(&k, 5, Outcome::Failed, 2_000)).await;
    assert_eq!(
        s.read(&k, Direction::Up, 1, 10).await.unwrap(),
        ReadOutcome::Trimmed {
            first_available: 3,
            terminal: Some(Outcome::Failed),
        }
    );
    let meta = s.meta(&k).await.unwrap().unwrap();
    assert_eq!((meta.down_tail, meta.up_tail), (10, 5));
    // Duplicates of trimmed entries are still acknowledged.
    assert_eq!(
        append1(s, peer_entry(&k, Direction::Down, 2)).await,
        AppendOutcome::Duplicate { tail: 10 }
    );
}

async fn read_lost_and_unknown<S: EventStore>(s: &S) {
    let k = key("acme/caller", "req-1");
    created(s, open_req(&k, "acme/callee", 5_000, 100)).await;
    assert_eq!(
        s.read(&k, Direction::Down, 2, 10).await.unwrap(),
        ReadOutcome::Lost {
            tail: 1,
            terminal: None,
        }
    );
    assert_eq!(
        s.read(&k, Direction::Up, u64::MAX, 10).await.unwrap(),
        ReadOutcome::Lost {
            tail: 0,
            terminal: None,
        }
    );
    append1(s, terminal_entry(&k, 1, Outcome::Rejected, 200)).await;
    assert_eq!(
        s.read(&k, Direction::Up, 7, 10).await.unwrap(),
        ReadOutcome::Lost {
            tail: 1,
            terminal: Some(Outcome::Rejected),
        }
    );
    let nobody = key("acme/caller", "never-opened");
    assert_eq!(
        s.read(&nobody, Direction::Down, 0, 10).await.unwrap(),
        ReadOutcome::Unknown
    );
    assert_eq!(
        append1(s, peer_entry(&nobody, Direction::Down, 2)).await,
        AppendOutcome::Unknown
    );
    assert_eq!(
        append1(
            s,
            relay_entry(&nobody, Direction::Up, 1, Some(Outcome::Expired))
        )
        .await,
        AppendOutcome::Unknown
    );
    assert_eq!(s.meta(&nobody).await.unwrap(), None);
}

async fn due_lists_only_open_delegations_past_deadline<S: EventStore>(s: &S) {
    let k100 = key("acme/caller", "d100");
    let k200a = key("acme/caller", "d200-a");
    let k200b = key("acme/caller", "d200-b");
    let k200c = key("acme/caller-2", "d200");
    let k200done = key("acme/caller", "d200-done");
    let k300 = key("acme/caller", "d300");
    // Opened out of order.
    for (k, deadline) in [
        (&k300, 300),
        (&k200c, 200),
        (&k200done, 200),
        (&k200b, 200),
        (&k100, 100),
        (&k200a, 200),
    ] {
        created(s, open_req(k, "acme/callee", deadline, 10)).await;
    }
    append1(s, terminal_entry(&k200done, 1, Outcome::Completed, 50)).await;
    assert_eq!(s.due(99, 10).await.unwrap(), vec![]);
    assert_eq!(s.due(100, 10).await.unwrap(), vec![k100.clone()]);
    // By deadline, then key.
    assert_eq!(
        s.due(250, 10).await.unwrap(),
        vec![k100.clone(), k200a.clone(), k200b.clone(), k200c.clone()]
    );
    assert_eq!(
        s.due(u64::MAX, 2).await.unwrap(),
        vec![k100.clone(), k200a.clone()]
    );
    assert_eq!(s.due(u64::MAX, 0).await.unwrap(), vec![]);
    // A terminal (even the relay's) takes it off the list.
    append1(
        s,
        relay_entry(&k100, Direction::Up, 1, Some(Outcome::Expired)),
    )
    .await;
    assert_eq!(
        s.due(u64::MAX, 10).await.unwrap(),
        vec![k200a, k200b, k200c, k300]
    );
}

async fn delegations_of_lists_caller_and_callee_side<S: EventStore>(s: &S) {
    let ab = key("acme/a", "r1");
    let bc = key("acme/b", "r1");
    let ca = key("acme/c", "r9");
    let ab2 = key("acme/a", "r0");
    let m_ab = created(s, open_req(&ab, "acme/b", 5_000, 1)).await;
    let m_bc = created(s, open_req(&bc, "acme/c", 5_000, 1)).await;
    created(s, open_req(&ca, "acme/a", 5_000, 1)).await;
    created(s, open_req(&ab2, "acme/b", 5_000, 1)).await;
    append1(s, sent_by(peer_entry(&ca, Direction::Up, 1), "acme/a")).await;
    let keys = |v: Vec<DelegationMeta>| v.into_iter().map(|m| m.key).collect::<Vec<_>>();
    assert_eq!(
        keys(s.delegations_of(&peer("acme/a")).await.unwrap()),
        vec![ab2.clone(), ab.clone(), ca.clone()]
    );
    assert_eq!(
        keys(s.delegations_of(&peer("acme/b")).await.unwrap()),
        vec![ab2.clone(), ab.clone(), bc.clone()]
    );
    assert_eq!(
        keys(s.delegations_of(&peer("acme/c")).await.unwrap()),
        vec![bc.clone(), ca.clone()]
    );
    assert_eq!(s.delegations_of(&peer("acme/d")).await.unwrap(), vec![]);
    // Full, current metas.
    let of_c = s.delegations_of(&peer("acme/c")).await.unwrap();
    assert_eq!(of_c[0], m_bc);
    assert_eq!(of_c[1], s.meta(&ca).await.unwrap().unwrap());
    assert_eq!(of_c[1].up_tail, 1);
    // Finished delegations are listed until they expire.
    append1(
        s,
        sent_by(terminal_entry(&ab, 1, Outcome::Completed, 20), "acme/b"),
    )
    .await;
    let of_a = s.delegations_of(&peer("acme/a")).await.unwrap();
    assert_eq!(of_a[1].key, m_ab.key);
    assert_eq!(of_a[1].terminal, Some(Outcome::Completed));
}

async fn open_delegations_of_lists_only_those_without_a_terminal<S: EventStore>(s: &S) {
    let ab = key("acme/a", "r1");
    let ab2 = key("acme/a", "r2");
    let ca = key("acme/c", "r9");
    created(s, open_req(&ab, "acme/b", 5_000, 1)).await;
    created(s, open_req(&ab2, "acme/b", 5_000, 1)).await;
    created(s, open_req(&ca, "acme/a", 5_000, 1)).await;
    append1(
        s,
        sent_by(terminal_entry(&ab, 1, Outcome::Completed, 20), "acme/b"),
    )
    .await;
    append1(
        s,
        sent_by(terminal_entry(&ca, 1, Outcome::Failed, 20), "acme/a"),
    )
    .await;
    let keys = |v: Vec<DelegationMeta>| v.into_iter().map(|m| m.key).collect::<Vec<_>>();
    // Caller side and callee side; the finished ones are left out.
    assert_eq!(
        keys(s.open_delegations_of(&peer("acme/a")).await.unwrap()),
        vec![ab2.clone()]
    );
    assert_eq!(
        keys(s.open_delegations_of(&peer("acme/b")).await.unwrap()),
        vec![ab2.clone()]
    );
    assert_eq!(
        s.open_delegations_of(&peer("acme/c")).await.unwrap(),
        vec![]
    );
    // Current metas; the finished ones are still listed by `delegations_of`.
    assert_eq!(
        s.open_delegations_of(&peer("acme/b")).await.unwrap()[0],
        s.meta(&ab2).await.unwrap().unwrap()
    );
    assert_eq!(s.delegations_of(&peer("acme/a")).await.unwrap().len(), 3);
}

async fn finished_delegations_expire<S: EventStore>(s: &S) {
    // finished_ttl_ms = one day; times here are synthetic.
    let done = key("acme/caller", "done");
    let late = key("acme/caller", "done-later");
    let open = key("acme/caller", "still-open");
    created(s, open_req(&done, "acme/callee", 5_000, 100)).await;
    created(s, open_req(&late, "acme/callee", 5_000, 100)).await;
    created(s, open_req(&open, "acme/callee", 5_000, 100)).await;
    append1(s, terminal_entry(&done, 1, Outcome::Completed, 10_000)).await;
    append1(s, terminal_entry(&late, 1, Outcome::Cancelled, 20_000)).await;

    assert_eq!(s.expire_finished(10_000 + DAY_MS - 1).await.unwrap(), 0);
    assert!(s.meta(&done).await.unwrap().is_some());
    assert_eq!(s.expire_finished(10_000 + DAY_MS).await.unwrap(), 1);
    assert_eq!(s.meta(&done).await.unwrap(), None);
    assert_eq!(
        s.read(&done, Direction::Up, 0, 10).await.unwrap(),
        ReadOutcome::Unknown
    );
    assert_eq!(
        append1(s, peer_entry(&done, Direction::Up, 2)).await,
        AppendOutcome::Unknown
    );
    let listed: Vec<_> = s
        .delegations_of(&peer("acme/callee"))
        .await
        .unwrap()
        .into_iter()
        .map(|m| m.key)
        .collect();
    assert_eq!(listed, vec![late.clone(), open.clone()]);
    // Nothing more is due until the next one's time; open ones never expire.
    assert_eq!(s.expire_finished(10_000 + DAY_MS).await.unwrap(), 0);
    assert_eq!(s.expire_finished(u64::MAX).await.unwrap(), 1);
    assert_eq!(s.meta(&late).await.unwrap(), None);
    assert!(s.meta(&open).await.unwrap().is_some());
    assert_eq!(s.due(u64::MAX, 10).await.unwrap(), vec![open.clone()]);
    // The key can be used again: a new delegation.
    let again = created(s, open_req(&done, "acme/other", 7_000, 50_000)).await;
    assert_eq!((again.created_ms, again.terminal), (50_000, None));
    assert_eq!(
        entries(s, &done, Direction::Up, 0, 10).await,
        Vec::<(u64, Bytes)>::new()
    );
    assert_eq!(
        s.delegations_of(&peer("acme/other")).await.unwrap(),
        vec![again]
    );
}

/// A terminal moves its delegation from the open indexes (the peers' open
/// sets, the deadlines) to the finished one, whether the callee wrote it
/// (on a single Redis server the append script does it) or the relay did
/// in a batch where another peer's terminal was refused (the store does it
/// after the script): neither is listed open or due any more, and each
/// expires `finished_ttl_ms` after its own terminal.
async fn a_terminal_leaves_the_open_indexes_whoever_wrote_it<S: EventStore>(s: &S) {
    let by_callee = key("acme/caller", "by-callee");
    let by_relay = key("acme/caller", "by-relay");
    let open = key("acme/caller", "open");
    let keys = |v: Vec<DelegationMeta>| v.into_iter().map(|m| m.key).collect::<Vec<_>>();
    for k in [&by_callee, &by_relay, &open] {
        created(s, open_req(k, CALLEE, 5_000, 100)).await;
    }
    let out = s
        .append(vec![
            peer_entry(&by_callee, Direction::Up, 1),
            terminal_entry(&by_callee, 2, Outcome::Completed, 10_000),
        ])
        .await
        .unwrap();
    assert_eq!(
        out,
        vec![
            AppendOutcome::Appended { seq: 1 },
            AppendOutcome::Appended { seq: 2 }
        ]
    );
    let out = s
        .append(vec![
            sent_by(
                terminal_entry(&by_relay, 1, Outcome::Completed, 20_000),
                "acme/intruder",
            ),
            AppendRequest {
                now_ms: 20_000,
                ..relay_entry(&by_relay, Direction::Up, 1, Some(Outcome::Expired))
            },
        ])
        .await
        .unwrap();
    assert_eq!(out[0], AppendOutcome::NotParty);
    assert_eq!(out[1], AppendOutcome::Appended { seq: 1 });
    for p in ["acme/caller", CALLEE] {
        assert_eq!(
            keys(s.open_delegations_of(&peer(p)).await.unwrap()),
            vec![open.clone()],
            "open delegations of {p}"
        );
    }
    assert_eq!(s.due(u64::MAX, 10).await.unwrap(), vec![open.clone()]);
    assert_eq!(s.expire_finished(10_000 + DAY_MS).await.unwrap(), 1);
    assert_eq!(s.meta(&by_callee).await.unwrap(), None);
    assert!(s.meta(&by_relay).await.unwrap().is_some());
    assert_eq!(s.expire_finished(20_000 + DAY_MS).await.unwrap(), 1);
    assert_eq!(s.meta(&by_relay).await.unwrap(), None);
    assert!(s.meta(&open).await.unwrap().is_some());
}

fn release(key: &DelegationKey, callee: &str, after: u64) -> Release {
    Release {
        key: key.clone(),
        callee: peer(callee),
        after,
    }
}

/// A caller's release compacts a delegation the callee ended, once the
/// caller's cursor is the up log's tail: both logs go, the outcome and the
/// tails stay (a read before the tail is `Trimmed` with nothing available
/// and the outcome; a resent open is `Existing`; resends are duplicates),
/// and the peers' delegation lists no longer name it. Any other release
/// (no terminal, a relay-originated one, another cursor or callee, no such
/// delegation) changes nothing.
async fn a_released_delegation_keeps_only_its_outcome<S: EventStore>(s: &S) {
    let done = key("acme/caller", "done");
    let expired = key("acme/caller", "expired");
    let open = key("acme/caller", "open");
    for k in [&done, &expired, &open] {
        created(s, open_req(k, CALLEE, 5_000, 100)).await;
    }
    let out = s
        .append(vec![
            peer_entry(&done, Direction::Down, 2),
            peer_entry(&done, Direction::Up, 1),
            terminal_entry(&done, 2, Outcome::Completed, 10_000),
            peer_entry(&expired, Direction::Up, 1),
            AppendRequest {
                now_ms: 10_000,
                ..relay_entry(&expired, Direction::Up, 2, Some(Outcome::Expired))
            },
            peer_entry(&open, Direction::Up, 1),
        ])
        .await
        .unwrap();
    assert!(
        out.iter()
            .all(|o| matches!(o, AppendOutcome::Appended { .. })),
        "{out:?}"
    );
    let not_yet = vec![
        release(&done, CALLEE, 1),
        release(&done, "acme/other", 2),
        release(&expired, CALLEE, 2),
        release(&open, CALLEE, 1),
        release(&key("acme/caller", "never"), CALLEE, 1),
    ];
    assert_eq!(s.release(not_yet).await.unwrap(), 0);
    for (k, n) in [(&done, 2), (&expired, 2), (&open, 1)] {
        assert_eq!(entries(s, k, Direction::Up, 0, 10).await.len(), n, "{k}");
    }
    let before = s.meta(&done).await.unwrap().unwrap();

    assert_eq!(s.release(vec![release(&done, CALLEE, 2)]).await.unwrap(), 1);
    assert_eq!(s.meta(&done).await.unwrap(), Some(before.clone()));
    for (dir, after) in [(Direction::Up, 0), (Direction::Up, 1), (Direction::Down, 0)] {
        assert_eq!(
            s.read(&done, dir, after, 10).await.unwrap(),
            ReadOutcome::Trimmed {
                first_available: 0,
                terminal: Some(Outcome::Completed)
            },
            "{dir:?} after {after}"
        );
    }
    assert_eq!(
        s.read(&done, Direction::Up, 2, 10).await.unwrap(),
        ReadOutcome::Entries {
            entries: vec![],
            tail: 2,
            terminal: Some(Outcome::Completed)
        }
    );
    assert!(matches!(
        s.read(&done, Direction::Up, 3, 10).await.unwrap(),
        ReadOutcome::Lost { tail: 2, .. }
    ));
    assert!(matches!(
        s.open(open_req(&done, CALLEE, 5_000, 100)).await.unwrap(),
        OpenOutcome::Existing(_)
    ));
    assert_eq!(
        append1(s, peer_entry(&done, Direction::Up, 1)).await,
        AppendOutcome::Duplicate { tail: 2 }
    );
    assert_eq!(
        append1(s, peer_entry(&done, Direction::Up, 3)).await,
        AppendOutcome::AlreadyTerminal {
            outcome: Outcome::Completed
        }
    );
    let keys = |v: Vec<DelegationMeta>| v.into_iter().map(|m| m.key).collect::<Vec<_>>();
    for p in ["acme/caller", CALLEE] {
        assert_eq!(
            keys(s.delegations_of(&peer(p)).await.unwrap()),
            vec![expired.clone(), open.clone()],
            "delegations of {p}"
        );
    }
    // The others are untouched.
    assert_eq!(entries(s, &expired, Direction::Up, 0, 10).await.len(), 2);
    assert_eq!(entries(s, &open, Direction::Up, 0, 10).await.len(), 1);
}

async fn descriptors<S: EventStore>(s: &S) {
    let a = peer("acme/a");
    assert_eq!(s.descriptor(&a).await.unwrap(), None);
    s.put_descriptor(&a, Bytes::from_static(b"\x00v1\xff"))
        .await
        .unwrap();
    assert_eq!(
        s.descriptor(&a).await.unwrap(),
        Some(Bytes::from_static(b"\x00v1\xff"))
    );
    s.put_descriptor(&a, Bytes::from_static(b"v2"))
        .await
        .unwrap();
    assert_eq!(
        s.descriptor(&a).await.unwrap(),
        Some(Bytes::from_static(b"v2"))
    );
    assert_eq!(s.descriptor(&peer("acme/b")).await.unwrap(), None);
}

async fn epoch_is_stable<S: EventStore>(s: &S) {
    let e = s.epoch().await.unwrap();
    assert_ne!(e, 0);
    for _ in 0..3 {
        assert_eq!(s.epoch().await.unwrap(), e);
    }
    s.ping().await.unwrap();
}

async fn batch_append_of_1000_entries<S: EventStore>(s: &S) {
    let k = key("acme/caller", "big");
    created(s, open_req(&k, "acme/callee", 5_000, 100)).await;
    let batch: Vec<_> = (2..=1001)
        .map(|seq| peer_entry(&k, Direction::Down, seq))
        .collect();
    let out = s.append(batch).await.unwrap();
    assert_eq!(
        out,
        (2..=1001)
            .map(|seq| AppendOutcome::Appended { seq })
            .collect::<Vec<_>>()
    );
    let all = entries(s, &k, Direction::Down, 0, 5_000).await;
    assert_eq!(all.len(), 1001);
    assert!(
        all.iter()
            .skip(1)
            .all(|(q, f)| *f == frame(&k, Direction::Down, *q, "peer"))
    );
    assert_eq!(s.meta(&k).await.unwrap().unwrap().down_tail, 1001);
    assert_eq!(s.append(vec![]).await.unwrap(), vec![]);
}

/// One connection's consecutive entries at one time (what a read batch
/// gives, and what the Redis store appends in one piece): entries after a
/// terminal in the same batch are refused (the next as already terminal,
/// the one after it as a hole), a relay entry between a peer's
/// does not count as the peer's, and a run that overflows the budget part
/// way is appended up to its last entry that fits.
async fn a_run_in_one_batch_is_judged_as_its_entries<S: EventStore>(s: &S) {
    let k = key("acme/caller", "runs");
    created(s, open_req(&k, CALLEE, 5_000, 100)).await;
    let at = |mut req: AppendRequest| {
        req.now_ms = 2_000;
        req
    };
    let mut batch: Vec<_> = (1..=2)
        .map(|seq| at(peer_entry(&k, Direction::Up, seq)))
        .collect();
    batch.push(at(terminal_entry(&k, 3, Outcome::Completed, 2_000)));
    batch.extend((4..=5).map(|seq| at(peer_entry(&k, Direction::Up, seq))));
    let already = AppendOutcome::AlreadyTerminal {
        outcome: Outcome::Completed,
    };
    assert_eq!(
        s.append(batch).await.unwrap(),
        vec![
            AppendOutcome::Appended { seq: 1 },
            AppendOutcome::Appended { seq: 2 },
            AppendOutcome::Appended { seq: 3 },
            already,
            AppendOutcome::Hole { tail: 3 },
        ]
    );
    let m = s.meta(&k).await.unwrap().unwrap();
    assert_eq!((m.up_tail, m.up_sender_tail), (3, 3));
    assert_eq!(
        (m.terminal, m.terminal_ms),
        (Some(Outcome::Completed), Some(2_000))
    );
    assert_eq!(entries(s, &k, Direction::Up, 0, 10).await.len(), 3);

    // The caller's entry, then the relay's.
    let k = key("acme/caller", "mixed");
    created(s, open_req(&k, CALLEE, 5_000, 100)).await;
    let batch = vec![
        at(peer_entry(&k, Direction::Down, 2)),
        at(relay_entry(&k, Direction::Down, 3, None)),
    ];
    assert_eq!(
        s.append(batch).await.unwrap(),
        vec![
            AppendOutcome::Appended { seq: 2 },
            AppendOutcome::Appended { seq: 3 }
        ]
    );
    let m = s.meta(&k).await.unwrap().unwrap();
    assert_eq!((m.down_tail, m.down_sender_tail), (3, 2));
    // The caller's frame for the relay's slot: not the caller's duplicate.
    assert_eq!(
        append1(s, at(peer_entry(&k, Direction::Down, 3))).await,
        AppendOutcome::AlreadyTerminal {
            outcome: Outcome::Unknown
        }
    );

    // 10,000 bytes for the delegation: four entries of 3,000 in one run
    // hold what fits (with the open's frame), the rest are refused and
    // leave no trace.
    let k = key("acme/caller", "full");
    created(s, open_req(&k, CALLEE, 5_000, 100)).await;
    let batch: Vec<_> = (1..=4)
        .map(|seq| sized(at(peer_entry(&k, Direction::Up, seq)), 3_000))
        .collect();
    let over = AppendOutcome::OverBudget {
        budget: Budget::Delegation,
    };
    assert_eq!(
        s.append(batch).await.unwrap(),
        vec![
            AppendOutcome::Appended { seq: 1 },
            AppendOutcome::Appended { seq: 2 },
            AppendOutcome::Appended { seq: 3 },
            over,
        ]
    );
    assert_eq!(s.meta(&k).await.unwrap().unwrap().up_tail, 3);
    let room = 10_000 - 9_000 - open_len(&k) as usize;
    assert_eq!(
        append1(s, sized(at(peer_entry(&k, Direction::Up, 4)), room + 1)).await,
        over
    );
    assert_eq!(
        append1(s, sized(at(peer_entry(&k, Direction::Up, 4)), room)).await,
        AppendOutcome::Appended { seq: 4 }
    );
}

async fn batch_outcomes_follow_request_order<S: EventStore>(s: &S) {
    let k = key("acme/caller", "req-1");
    let other = key("acme/caller", "req-2");
    let nobody = key("acme/caller", "never");
    created(s, open_req(&k, "acme/callee", 5_000, 100)).await;
    created(s, open_req(&other, "acme/callee", 5_000, 100)).await;
    let batch = vec![
        peer_entry(&k, Direction::Down, 2),
        peer_entry(&k, Direction::Down, 3),
        peer_entry(&k, Direction::Down, 3),
        peer_entry(&k, Direction::Down, 5),
        peer_entry(&k, Direction::Down, 4),
        peer_entry(&nobody, Direction::Down, 2),
        terminal_entry(&k, 1, Outcome::Completed, 900),
        peer_entry(&k, Direction::Up, 2),
        relay_entry(&other, Direction::Up, 2, Some(Outcome::Expired)),
        relay_entry(&other, Direction::Up, 1, Some(Outcome::Expired)),
        peer_entry(&other, Direction::Up, 1),
        peer_entry(&k, Direction::Down, 5),
    ];
    assert_eq!(
        s.append(batch).await.unwrap(),
        vec![
            AppendOutcome::Appended { seq: 2 },
            AppendOutcome::Appended { seq: 3 },
            AppendOutcome::Duplicate { tail: 3 },
            AppendOutcome::Hole { tail: 3 },
            AppendOutcome::Appended { seq: 4 },
            AppendOutcome::Unknown,
            AppendOutcome::Appended { seq: 1 },
            AppendOutcome::AlreadyTerminal {
                outcome: Outcome::Completed
            },
            AppendOutcome::Conflict { tail: 0 },
            AppendOutcome::Appended { seq: 1 },
            AppendOutcome::AlreadyTerminal {
                outcome: Outcome::Expired
            },
            AppendOutcome::AlreadyTerminal {
                outcome: Outcome::Completed
            },
        ]
    );
    assert_eq!(s.due(u64::MAX, 10).await.unwrap(), vec![]);
}

// ---------------------------------------------------------------------------
// Redis only

/// Polls `check` until it holds, at most `attempts` times `every` apart.
async fn eventually<F, Fut>(attempts: u32, every: Duration, mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    for _ in 0..attempts {
        if check().await {
            return true;
        }
        tokio::time::sleep(every).await;
    }
    false
}

#[tokio::test]
async fn redis_keys_share_one_hash_tag_and_finished_ones_get_a_ttl() {
    let (server, s) = redis_store(retention(100)).await;
    let mut raw = raw(&server).await;
    let k = key("acme/caller", "req-1");
    created(&s, open_req(&k, "acme/callee", 5_000, 100)).await;
    append1(&s, peer_entry(&k, Direction::Up, 1)).await;
    let mut keys: Vec<String> = redis::cmd("KEYS")
        .arg("oab:d:*")
        .query_async(&mut raw)
        .await
        .unwrap();
    keys.sort();
    assert_eq!(
        keys,
        vec![
            "oab:d:{acme/caller#req-1}:down",
            "oab:d:{acme/caller#req-1}:meta",
            "oab:d:{acme/caller#req-1}:up",
        ]
    );
    // The hash tag (what Redis Cluster hashes): from the first `{` to the
    // next `}`, the same for every key of the delegation.
    let tag = |k: &str| {
        let open = k.find('{').unwrap();
        let close = open + k[open..].find('}').unwrap();
        k[open + 1..close].to_owned()
    };
    assert!(
        keys.iter().all(|k| tag(k) == "acme/caller#req-1"),
        "{keys:?}"
    );
    for k in &keys {
        let ttl: i64 = redis::cmd("PTTL")
            .arg(k)
            .query_async(&mut raw)
            .await
            .unwrap();
        assert_eq!(ttl, -1, "{k} must not expire while open");
    }
    append1(&s, terminal_entry(&k, 2, Outcome::Completed, 1_000)).await;
    for k in &keys {
        let ttl: i64 = redis::cmd("PTTL")
            .arg(k)
            .query_async(&mut raw)
            .await
            .unwrap();
        assert!(ttl > 0 && ttl <= DAY_MS as i64, "{k}: PTTL {ttl}");
    }
    // The relay's cancel after the terminal keeps the same expiry.
    let k2 = key("acme/caller", "req-2");
    created(&s, open_req(&k2, "acme/callee", 5_000, 100)).await;
    append1(
        &s,
        relay_entry(&k2, Direction::Down, 2, Some(Outcome::Expired)),
    )
    .await;
    append1(&s, relay_entry(&k2, Direction::Up, 1, None)).await;
    let ttl: i64 = redis::cmd("PTTL")
        .arg("oab:d:{acme/caller#req-2}:up")
        .query_async(&mut raw)
        .await
        .unwrap();
    assert!(ttl > 0, "up log created after the terminal: PTTL {ttl}");
}

/// A released delegation leaves one key behind: its meta hash, written so
/// that Redis keeps it in its compact encoding, with the TTL its terminal
/// gave it; the logs, the size lists and the index entries are gone.
#[tokio::test]
async fn redis_a_released_delegation_is_one_compact_hash() {
    let (server, s) = redis_store(retention(2)).await;
    let mut raw = raw(&server).await;
    let k = key("acme/caller", "req-1");
    created(&s, open_req(&k, CALLEE, 5_000, 100)).await;
    // Past the log cap, so the size lists exist too.
    let mut batch: Vec<AppendRequest> = (1..=4)
        .map(|seq| peer_entry(&k, Direction::Up, seq))
        .collect();
    batch.push(terminal_entry(&k, 5, Outcome::Completed, 1_000));
    s.append(batch).await.unwrap();
    let mut all: Vec<String> = redis::cmd("KEYS")
        .arg("oab:d:*")
        .query_async(&mut raw)
        .await
        .unwrap();
    all.sort();
    assert!(all.len() > 3, "{all:?}");
    let encoding = |raw: &mut redis::aio::MultiplexedConnection| {
        let mut raw = raw.clone();
        async move {
            let e: String = redis::cmd("OBJECT")
                .arg("ENCODING")
                .arg("oab:d:{acme/caller#req-1}:meta")
                .query_async(&mut raw)
                .await
                .unwrap();
            e
        }
    };
    assert_eq!(
        encoding(&mut raw).await,
        "hashtable",
        "the sha256: digest is 71 bytes"
    );

    assert_eq!(s.release(vec![release(&k, CALLEE, 5)]).await.unwrap(), 1);
    let left: Vec<String> = redis::cmd("KEYS")
        .arg("oab:d:*")
        .query_async(&mut raw)
        .await
        .unwrap();
    assert_eq!(left, vec!["oab:d:{acme/caller#req-1}:meta"]);
    // `listpack` (Redis 7), `ziplist` (Redis 6).
    assert_ne!(encoding(&mut raw).await, "hashtable");
    let ttl: i64 = redis::cmd("PTTL")
        .arg(&left[0])
        .query_async(&mut raw)
        .await
        .unwrap();
    assert!(ttl > 0 && ttl <= DAY_MS as i64, "PTTL {ttl}");
    let finished: u64 = redis::cmd("ZCARD")
        .arg("oab:finished")
        .query_async(&mut raw)
        .await
        .unwrap();
    assert_eq!(finished, 0);
    for p in ["acme/caller", CALLEE] {
        let n: u64 = redis::cmd("SCARD")
            .arg(format!("oab:p:{{{p}}}:dlg"))
            .query_async(&mut raw)
            .await
            .unwrap();
        assert_eq!(n, 0, "delegations of {p}");
    }
    assert_eq!(
        s.meta(&k)
            .await
            .unwrap()
            .map(|m| (m.up_tail, m.terminal, m.digest)),
        Some((5, Some(Outcome::Completed), Digest::of(b"payload")))
    );
}

#[tokio::test]
async fn redis_expires_finished_delegations_by_itself() {
    let r = Retention {
        max_log_entries: 100,
        finished_ttl_ms: 100,
        ..Retention::default()
    };
    let (_server, s) = redis_store(r).await;
    let k = key("acme/caller", "req-1");
    let open = key("acme/caller", "req-2");
    created(&s, open_req(&k, "acme/callee", 5_000, 100)).await;
    created(&s, open_req(&open, "acme/callee", 5_000, 100)).await;
    append1(&s, peer_entry(&k, Direction::Up, 1)).await;
    append1(&s, terminal_entry(&k, 2, Outcome::Completed, 1_000)).await;
    let gone = eventually(500, Duration::from_millis(10), || async {
        s.meta(&k).await.unwrap().is_none()
    })
    .await;
    assert!(gone, "finished delegation still there after 5 s");
    assert_eq!(
        s.read(&k, Direction::Up, 0, 10).await.unwrap(),
        ReadOutcome::Unknown
    );
    let listed: Vec<_> = s
        .delegations_of(&peer("acme/caller"))
        .await
        .unwrap()
        .into_iter()
        .map(|m| m.key)
        .collect();
    assert_eq!(listed, vec![open.clone()]);
    // expire_finished then only cleans the index (and counts it once).
    assert_eq!(s.expire_finished(u64::MAX).await.unwrap(), 1);
    assert_eq!(s.expire_finished(u64::MAX).await.unwrap(), 0);
    assert!(s.meta(&open).await.unwrap().is_some());
    // And the key can be opened afresh.
    created(&s, open_req(&k, "acme/callee", 5_000, 2_000)).await;
}

#[tokio::test]
async fn redis_epoch_changes_after_restart_without_persistence() {
    let (mut server, s) = redis_store(retention(100)).await;
    let k = key("acme/caller", "req-1");
    created(&s, open_req(&k, "acme/callee", 5_000, 100)).await;
    let before = s.epoch().await.unwrap();
    server.restart().unwrap();
    // Reads retry once over the reconnected connection.
    let after = s.epoch().await.unwrap();
    assert_ne!(
        before, after,
        "a store that lost its data must change epoch"
    );
    assert_eq!(s.epoch().await.unwrap(), after);
    assert_eq!(s.meta(&k).await.unwrap(), None);
    assert_eq!(
        s.read(&k, Direction::Down, 1, 10).await.unwrap(),
        ReadOutcome::Unknown
    );
    // Scripts were lost too: NOSCRIPT is handled.
    created(&s, open_req(&k, "acme/callee", 5_000, 100)).await;
}

#[tokio::test]
async fn redis_aof_keeps_data_across_kill_and_restart() {
    let mut server = RedisServer::start(Persistence::Aof).unwrap();
    assert_eq!(server.persistence(), Persistence::Aof);
    let s = RedisStore::connect(&server.url(), retention(100))
        .await
        .unwrap();
    let k = key("acme/caller", "req-1");
    created(&s, open_req(&k, "acme/callee", 5_000, 100)).await;
    let batch: Vec<_> = (2..=50)
        .map(|q| peer_entry(&k, Direction::Down, q))
        .collect();
    s.append(batch).await.unwrap();
    append1(&s, peer_entry(&k, Direction::Up, 1)).await;
    s.put_descriptor(&peer("acme/caller"), Bytes::from_static(b"desc"))
        .await
        .unwrap();
    let epoch = s.epoch().await.unwrap();
    let meta = s.meta(&k).await.unwrap().unwrap();
    let down = entries(&s, &k, Direction::Down, 0, 100).await;

    server.kill().unwrap();
    assert!(!server.is_running());
    // While it is down: errors, not panics.
    match s.append(vec![peer_entry(&k, Direction::Up, 2)]).await {
        Err(StoreError::Unavailable { operation, .. }) => {
            assert_eq!(operation, "redis append")
        }
        other => panic!("expected Unavailable, got {other:?}"),
    }
    assert!(matches!(
        s.ping().await,
        Err(StoreError::Unavailable { .. })
    ));

    server.restart().unwrap();
    s.ping().await.unwrap();
    assert_eq!(s.epoch().await.unwrap(), epoch);
    assert_eq!(s.meta(&k).await.unwrap(), Some(meta));
    assert_eq!(entries(&s, &k, Direction::Down, 0, 100).await, down);
    assert_eq!(
        s.descriptor(&peer("acme/caller")).await.unwrap(),
        Some(Bytes::from_static(b"desc"))
    );
    // Appends continue (the scripts are reloaded after NOSCRIPT).
    assert_eq!(
        append1(&s, peer_entry(&k, Direction::Up, 2)).await,
        AppendOutcome::Appended { seq: 2 }
    );
    assert_eq!(s.due(5_000, 10).await.unwrap(), vec![k]);
}

#[tokio::test]
async fn redis_reloads_scripts_after_script_flush() {
    let (server, s) = redis_store(retention(100)).await;
    let mut raw = raw(&server).await;
    let k = key("acme/caller", "req-1");
    let flush = || {
        let mut raw = raw.clone();
        async move {
            let _: () = redis::cmd("SCRIPT")
                .arg("FLUSH")
                .query_async(&mut raw)
                .await
                .unwrap();
        }
    };
    flush().await;
    created(&s, open_req(&k, "acme/callee", 5_000, 100)).await;
    flush().await;
    let out = s
        .append(
            (2..=10)
                .map(|q| peer_entry(&k, Direction::Down, q))
                .collect(),
        )
        .await
        .unwrap();
    assert_eq!(
        out,
        (2..=10)
            .map(|seq| AppendOutcome::Appended { seq })
            .collect::<Vec<_>>()
    );
    flush().await;
    assert_eq!(entries(&s, &k, Direction::Down, 0, 100).await.len(), 10);
    append1(&s, terminal_entry(&k, 1, Outcome::Completed, 10)).await;
    flush().await;
    assert_eq!(s.expire_finished(u64::MAX).await.unwrap(), 1);
    let _: () = redis::cmd("PING").query_async(&mut raw).await.unwrap();
}

#[tokio::test]
async fn redis_connect_failure_is_unavailable() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!(
        "redis+unix://{}?pass=secret",
        dir.path().join("nothing.sock").display()
    );
    let started = Instant::now();
    match RedisStore::connect(&url, retention(100)).await {
        Err(e @ StoreError::Unavailable { .. }) => {
            let msg = e.to_string();
            assert!(msg.contains("connect to Redis at"), "{msg}");
            assert!(!msg.contains("secret"), "credentials leaked: {msg}");
        }
        Err(other) => panic!("expected Unavailable, got {other:?}"),
        Ok(_) => panic!("connected to nothing"),
    }
    assert!(started.elapsed() < Duration::from_secs(20));
    match RedisStore::connect("not a url", retention(100)).await {
        Err(StoreError::Unavailable { cause, .. }) => {
            assert!(cause.contains("invalid Redis URL"), "{cause}")
        }
        Err(other) => panic!("expected Unavailable, got {other:?}"),
        Ok(_) => panic!("connected to nothing"),
    }
}

/// A peer's byte budget hash lives exactly as long as it holds bytes: each
/// dropped delegation takes its member away, the last one the hash, also
/// when Redis dropped the delegation by itself first; and the expired
/// delegations leave no member in the peers' sets or the finished index.
/// At its cap a Redis log's trims take the sizes they give back from the
/// log's size list: the list exists, holds the newest entries' sizes and
/// has a TTL while the delegation is open. A list out of step with its log
/// is not used, and a log whose list is gone (as one written before lists
/// existed) is read from the log again; either is listed again from its
/// next batch on, with the held bytes exact throughout. The lists go away
/// with the delegation.
/// A relay restarted with a lower `max_log_entries` finds logs longer
/// than its cap: its first append trims each to the cap at once and gives
/// back the bytes of every entry it dropped.
#[tokio::test]
async fn redis_a_log_longer_than_the_cap_is_cut_to_it_with_its_bytes() {
    let (server, s) = redis_store(budgets(10, 2_000, 1 << 30)).await;
    let k = key("acme/caller", "lowered");
    created(&s, open_req(&k, CALLEE, 5_000, 100)).await;
    for seq in 2..=10 {
        append1(&s, sized(peer_entry(&k, Direction::Down, seq), 100)).await;
    }
    drop(s);
    let s = RedisStore::connect(&server.url(), budgets(4, 2_000, 1 << 30))
        .await
        .unwrap();
    assert_eq!(
        append1(&s, sized(peer_entry(&k, Direction::Down, 11), 100)).await,
        AppendOutcome::Appended { seq: 11 }
    );
    assert_eq!(
        entries(&s, &k, Direction::Down, 7, 10)
            .await
            .iter()
            .map(|(q, _)| *q)
            .collect::<Vec<_>>(),
        vec![8, 9, 10, 11]
    );
    // The log holds four entries of 100 bytes: 1,600 bytes of room.
    let over = AppendOutcome::OverBudget {
        budget: Budget::Delegation,
    };
    assert_eq!(
        append1(&s, sized(peer_entry(&k, Direction::Up, 1), 1_601)).await,
        over
    );
    assert_eq!(
        append1(&s, sized(peer_entry(&k, Direction::Up, 1), 1_600)).await,
        AppendOutcome::Appended { seq: 1 }
    );
}

/// The append script writes each entry's stream id as a string it builds
/// itself (the decimal of the sequence's tens, formatted once per ten,
/// and a digit; past 10^15 formatted whole): every id is its sequence,
/// across each decimal carry, inside one run and from run to run.
#[tokio::test]
async fn redis_stream_ids_are_the_sequences_across_every_carry() {
    let (server, s) = redis_store(budgets(10_000, 1 << 30, 1 << 30)).await;
    let mut raw = raw(&server).await;
    let k = key("acme/caller", "carries");
    created(&s, open_req(&k, CALLEE, u64::MAX / 2, 100)).await;
    let meta = format!("oab:d:{{{k}}}:meta");
    let log = format!("oab:d:{{{k}}}:down");
    let mut expected: Vec<u64> = vec![1];
    // Runs from tails chosen next to carries: 9 -> 10, 99 -> 100,
    // 999 -> 1000, and the last ids formatted by tens before 10^15 and
    // whole from it on.
    for (tail, count) in [
        (1_u64, 12_u64),
        (97, 5),
        (998, 3),
        (999_999_999_999_990, 12),
    ] {
        // Move the log's tail (the relay only ever appends at tail + 1).
        let _: () = redis::cmd("HSET")
            .arg(&meta)
            .arg("dt")
            .arg(tail)
            .arg("ds")
            .arg(tail)
            .query_async(&mut raw)
            .await
            .unwrap();
        let seqs: Vec<u64> = (tail + 1..=tail + count).collect();
        let out = s
            .append(
                // One clock reading: the batch is one run.
                seqs.iter()
                    .map(|&q| AppendRequest {
                        now_ms: 5_000,
                        ..peer_entry(&k, Direction::Down, q)
                    })
                    .collect(),
            )
            .await
            .unwrap();
        let appended: Vec<AppendOutcome> = seqs
            .iter()
            .map(|&seq| AppendOutcome::Appended { seq })
            .collect();
        assert_eq!(out, appended, "run after tail {tail}");
        expected.extend(&seqs);
    }
    let range: redis::streams::StreamRangeReply = redis::cmd("XRANGE")
        .arg(&log)
        .arg("-")
        .arg("+")
        .query_async(&mut raw)
        .await
        .unwrap();
    let ids: Vec<String> = range.ids.into_iter().map(|e| e.id).collect();
    let want: Vec<String> = expected.iter().map(|q| format!("{q}-0")).collect();
    assert_eq!(ids, want);
    // Read back by sequence, the frames are those appended at each.
    let near = entries(&s, &k, Direction::Down, 97, 5).await;
    assert_eq!(
        near.iter().map(|(q, _)| *q).collect::<Vec<_>>(),
        vec![98, 99, 100, 101, 102]
    );
    for (seq, f) in &near {
        assert_eq!(*f, frame(&k, Direction::Down, *seq, "peer"), "seq {seq}");
    }
}

#[tokio::test]
async fn redis_size_lists_follow_the_logs_and_go_away_with_them() {
    let r = Retention {
        finished_ttl_ms: 100,
        ..budgets(STREAM_CAP, STREAM_BUDGET, 1 << 30)
    };
    let (server, s) = redis_store(r).await;
    let mut raw = raw(&server).await;
    let mut stream = Stream::open(&s, "listed").await;
    stream.batches(&s, 30).await;
    let base = format!("oab:d:{{{}}}", stream.key);
    let list = |raw: &mut redis::aio::MultiplexedConnection, dir: &'static str| {
        let key = format!("{base}:{dir}:sizes");
        let mut raw = raw.clone();
        async move {
            let v: Vec<usize> = redis::cmd("LRANGE")
                .arg(key)
                .arg(0)
                .arg(-1)
                .query_async(&mut raw)
                .await
                .unwrap();
            v
        }
    };
    for (at, dir) in ["down", "up"].into_iter().enumerate() {
        let listed = list(&mut raw, dir).await;
        let model = Vec::from(stream.logs[at].clone());
        assert!(!listed.is_empty(), "{dir}: no size list at the cap");
        assert!(
            model.ends_with(&listed),
            "{dir}: the list {listed:?} is not the newest of {model:?}"
        );
    }
    // An open delegation's list expires by itself too, if no relay that
    // knows of it ends the delegation.
    let ttl: i64 = redis::cmd("PTTL")
        .arg(format!("{base}:up:sizes"))
        .query_async(&mut raw)
        .await
        .unwrap();
    assert!(ttl > 0, "the up list has no TTL ({ttl})");
    // A list out of step with its log (as after an append by a relay that
    // does not list sizes): it is not used, and listed again.
    let _: () = redis::pipe()
        .cmd("LSET")
        .arg(format!("{base}:up:sizes"))
        .arg(0)
        .arg(999)
        .cmd("HSET")
        .arg(format!("{base}:meta"))
        .arg("uz")
        .arg("1")
        .query_async(&mut raw)
        .await
        .unwrap();
    stream.batches(&s, 30).await;
    stream.check_up(&s).await;
    // Lost lists: the log is read again, then listed again.
    let _: () = redis::pipe()
        .cmd("DEL")
        .arg(format!("{base}:down:sizes"))
        .arg(format!("{base}:up:sizes"))
        .cmd("HDEL")
        .arg(format!("{base}:meta"))
        .arg("dz")
        .arg("uz")
        .query_async(&mut raw)
        .await
        .unwrap();
    stream.batches(&s, 30).await;
    stream.check_up(&s).await;
    assert!(Vec::from(stream.logs[1].clone()).ends_with(&list(&mut raw, "up").await));
    // A terminal: every key of the delegation expires with it.
    let end = relay_entry(
        &stream.key,
        Direction::Up,
        stream.next[1],
        Some(Outcome::Expired),
    );
    append1(&s, end).await;
    let pattern = format!("{base}:*");
    let gone = eventually(100, Duration::from_millis(20), || {
        let mut raw = raw.clone();
        let pattern = pattern.clone();
        async move {
            let left: Vec<String> = redis::cmd("KEYS")
                .arg(pattern)
                .query_async(&mut raw)
                .await
                .unwrap();
            left.is_empty()
        }
    })
    .await;
    assert!(gone, "a key of the finished delegation outlived it");
}

#[tokio::test]
async fn redis_peer_budget_and_index_keys_go_away_with_their_delegations() {
    let r = Retention {
        finished_ttl_ms: 100,
        ..retention(100)
    };
    let (server, s) = redis_store(r).await;
    let mut raw = raw(&server).await;
    let ks: Vec<DelegationKey> = (0..3)
        .map(|i| key("acme/caller", &format!("held-{i}")))
        .collect();
    for k in &ks {
        created(&s, open_req(k, CALLEE, u64::MAX, 1)).await;
        assert_eq!(
            append1(&s, sized(peer_entry(k, Direction::Up, 1), 100)).await,
            AppendOutcome::Appended { seq: 1 }
        );
        assert_eq!(
            append1(&s, sized(peer_entry(k, Direction::Down, 2), 50)).await,
            AppendOutcome::Appended { seq: 2 }
        );
    }
    let held = |raw: redis::aio::MultiplexedConnection, peer: &str| {
        let mut raw = raw;
        let k = format!("oab:pb:{{{peer}}}");
        async move {
            let v: Option<u64> = redis::cmd("HGET")
                .arg(k)
                .arg("total")
                .query_async(&mut raw)
                .await
                .unwrap();
            v
        }
    };
    assert_eq!(held(raw.clone(), CALLEE).await, Some(300));
    assert_eq!(held(raw.clone(), "acme/caller").await, Some(150));
    // The relay ends them all: their bytes leave both budgets at once (the
    // hashes go with their last member); Redis drops the delegations 100 ms
    // later by itself.
    for k in &ks {
        append1(&s, relay_entry(k, Direction::Up, 2, Some(Outcome::Expired))).await;
    }
    assert_eq!(held(raw.clone(), CALLEE).await, None);
    assert_eq!(held(raw.clone(), "acme/caller").await, None);
    let gone = eventually(100, Duration::from_millis(20), || {
        let mut raw = raw.clone();
        let metas: Vec<String> = ks.iter().map(|k| format!("oab:d:{{{k}}}:meta")).collect();
        async move {
            let n: u64 = redis::cmd("EXISTS")
                .arg(metas)
                .query_async(&mut raw)
                .await
                .unwrap();
            n == 0
        }
    })
    .await;
    assert!(gone, "Redis did not drop the finished delegations");
    assert_eq!(s.expire_finished(u64::MAX).await.unwrap(), 3);
    for p in [CALLEE, "acme/caller"] {
        let n: u64 = redis::cmd("EXISTS")
            .arg(format!("oab:pb:{{{p}}}"))
            .query_async(&mut raw)
            .await
            .unwrap();
        assert_eq!(n, 0, "{p}'s budget hash outlived its delegations");
    }
    let mut index: Vec<String> = [CALLEE, "acme/caller"]
        .iter()
        .flat_map(|p| [format!("oab:p:{{{p}}}:dlg"), format!("oab:p:{{{p}}}:open")])
        .collect();
    index.extend(["oab:finished".to_string(), "oab:deadlines".to_string()]);
    for k in index {
        let n: u64 = redis::cmd("EXISTS")
            .arg(&k)
            .query_async(&mut raw)
            .await
            .unwrap();
        assert_eq!(n, 0, "{k} outlived the delegations it indexed");
    }
}

#[tokio::test]
async fn redis_index_entries_left_stale_are_skipped_and_repaired() {
    let (server, s) = redis_store(retention(100)).await;
    let mut raw = raw(&server).await;
    let k = key("acme/caller", "req-1");
    created(&s, open_req(&k, "acme/callee", 500, 100)).await;
    // Simulate a crash between a terminal script and its index update:
    // the deadline entry stays although the delegation finished.
    let _: () = redis::cmd("HSET")
        .arg("oab:d:{acme/caller#req-1}:meta")
        .arg("term")
        .arg("completed")
        .arg("tms")
        .arg("700")
        .query_async(&mut raw)
        .await
        .unwrap();
    assert_eq!(s.due(1_000, 10).await.unwrap(), vec![]);
    let left: i64 = redis::cmd("ZCARD")
        .arg("oab:deadlines")
        .query_async(&mut raw)
        .await
        .unwrap();
    assert_eq!(left, 0, "the stale deadline entry is removed");
    // A crash between the open script and its index update: the retry of
    // `open` (Existing) repairs the indexes.
    let k2 = key("acme/caller", "req-2");
    created(&s, open_req(&k2, "acme/callee", 500, 100)).await;
    let _: () = redis::cmd("DEL")
        .arg("oab:deadlines")
        .arg("oab:p:{acme/callee}:dlg")
        .query_async(&mut raw)
        .await
        .unwrap();
    assert_eq!(s.due(1_000, 10).await.unwrap(), vec![]);
    assert!(matches!(
        s.open(open_req(&k2, "acme/callee", 500, 100))
            .await
            .unwrap(),
        OpenOutcome::Existing(_)
    ));
    assert_eq!(s.due(1_000, 10).await.unwrap(), vec![k2.clone()]);
    assert_eq!(
        s.delegations_of(&peer("acme/callee"))
            .await
            .unwrap()
            .into_iter()
            .map(|m| m.key)
            .collect::<Vec<_>>(),
        vec![k2]
    );
}

// ---------------------------------------------------------------------------
// Redis Cluster only

/// The node of a `RedisCluster` serving `slot`: node `i` serves the `i`th
/// third of the 16,384 slots.
fn node_of_slot(slot: u16) -> usize {
    usize::from(slot / (16_384 / 3)).min(2)
}

/// Plain (not cluster-aware) connections to each node, in node order.
async fn node_conns(cluster: &RedisCluster) -> Vec<redis::aio::MultiplexedConnection> {
    let mut out = Vec::new();
    for url in cluster.node_urls() {
        out.push(
            redis::Client::open(url)
                .unwrap()
                .get_multiplexed_async_connection()
                .await
                .unwrap(),
        );
    }
    out
}

/// `number_of_cached_scripts` from the node's `INFO memory`.
async fn cached_scripts(node: &mut redis::aio::MultiplexedConnection) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("memory")
        .query_async(node)
        .await
        .unwrap();
    info.lines()
        .find_map(|l| l.trim_end().strip_prefix("number_of_cached_scripts:"))
        .unwrap_or_else(|| panic!("no number_of_cached_scripts in {info}"))
        .parse()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_spreads_delegations_over_shards_and_keeps_batch_order() {
    let cluster = start_cluster().await;
    let s = RedisStore::connect(&cluster.url(), retention(100))
        .await
        .unwrap();
    assert!(s.is_cluster());
    assert_eq!(s.pubsub_urls(), cluster.node_urls());
    let mut nodes = node_conns(&cluster).await;

    // The scripts were loaded on every master.
    let loaded = cached_scripts(&mut nodes[0]).await;
    assert!(loaded >= 4, "{loaded} scripts cached");
    for node in &mut nodes {
        assert_eq!(cached_scripts(node).await, loaded);
    }

    // Two delegations per node, placed by asking the cluster where their
    // keys hash: a and d on node 0, b and e on node 1, c and f on node 2.
    let mut by_node: Vec<Vec<DelegationKey>> = vec![Vec::new(); 3];
    for i in 0..1_000 {
        if by_node.iter().all(|ks| ks.len() == 2) {
            break;
        }
        let k = key("acme/caller", &format!("r{i}"));
        let slot: u16 = redis::cmd("CLUSTER")
            .arg("KEYSLOT")
            .arg(format!("oab:d:{{{k}}}:meta"))
            .query_async(&mut nodes[0])
            .await
            .unwrap();
        let ks = &mut by_node[node_of_slot(slot)];
        if ks.len() < 2 {
            ks.push(k);
        }
    }
    let [a, b, c, d, e, f] = [0, 1]
        .map(|round| [0, 1, 2].map(|node| by_node[node][round].clone()))
        .concat()
        .try_into()
        .unwrap_or_else(|ks: Vec<_>| panic!("{ks:?}"));
    let keys = [&a, &b, &c, &d, &e, &f];
    for k in keys {
        created(&s, open_req(k, "acme/callee", 5_000, 100)).await;
    }
    // Each delegation lives on its own node (a node answers only for the
    // slots it serves).
    for (node, ks) in by_node.iter().enumerate() {
        for k in ks {
            let n: u64 = redis::cmd("EXISTS")
                .arg(format!("oab:d:{{{k}}}:meta"))
                .arg(format!("oab:d:{{{k}}}:down"))
                .query_async(&mut nodes[node])
                .await
                .unwrap();
            assert_eq!(n, 2, "{k} on node {node}");
        }
    }

    // One batch over six delegations on three nodes, interleaved: the
    // outcomes come back in request order, and each delegation's entries
    // ran in order.
    let nobody = key("acme/caller", "never");
    let batch = vec![
        peer_entry(&a, Direction::Down, 2),
        peer_entry(&b, Direction::Down, 2),
        peer_entry(&c, Direction::Down, 2),
        peer_entry(&a, Direction::Down, 3),
        peer_entry(&b, Direction::Down, 4),
        peer_entry(&c, Direction::Down, 2),
        terminal_entry(&d, 1, Outcome::Completed, 900),
        peer_entry(&d, Direction::Up, 2),
        relay_entry(&e, Direction::Up, 2, None),
        peer_entry(&nobody, Direction::Down, 2),
        peer_entry(&f, Direction::Up, 1),
        peer_entry(&f, Direction::Up, 2),
        peer_entry(&a, Direction::Down, 4),
    ];
    assert_eq!(
        s.append(batch).await.unwrap(),
        vec![
            AppendOutcome::Appended { seq: 2 },
            AppendOutcome::Appended { seq: 2 },
            AppendOutcome::Appended { seq: 2 },
            AppendOutcome::Appended { seq: 3 },
            AppendOutcome::Hole { tail: 2 },
            AppendOutcome::Duplicate { tail: 2 },
            AppendOutcome::Appended { seq: 1 },
            AppendOutcome::AlreadyTerminal {
                outcome: Outcome::Completed
            },
            AppendOutcome::Conflict { tail: 0 },
            AppendOutcome::Unknown,
            AppendOutcome::Appended { seq: 1 },
            AppendOutcome::Appended { seq: 2 },
            AppendOutcome::Appended { seq: 4 },
        ]
    );
    let seqs = |v: Vec<(u64, Bytes)>| v.into_iter().map(|(q, _)| q).collect::<Vec<_>>();
    assert_eq!(
        seqs(entries(&s, &a, Direction::Down, 0, 10).await),
        [1, 2, 3, 4]
    );
    assert_eq!(seqs(entries(&s, &f, Direction::Up, 0, 10).await), [1, 2]);
    // The cross-shard readers (pipelined HGETALLs over every node).
    let mut sorted: Vec<DelegationKey> = keys.iter().map(|k| (*k).clone()).collect();
    sorted.sort();
    let listed: Vec<DelegationKey> = s
        .delegations_of(&peer("acme/callee"))
        .await
        .unwrap()
        .into_iter()
        .map(|m| m.key)
        .collect();
    assert_eq!(listed, sorted);
    let open: Vec<DelegationKey> = sorted.iter().filter(|k| **k != d).cloned().collect();
    assert_eq!(s.due(u64::MAX, 10).await.unwrap(), open);

    // Scripts flushed on one node only: the batch's commands for that node
    // get NOSCRIPT and are sent again after SCRIPT LOAD, the others not.
    let _: () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query_async(&mut nodes[1])
        .await
        .unwrap();
    assert_eq!(cached_scripts(&mut nodes[1]).await, 0);
    assert_eq!(
        s.append(vec![
            peer_entry(&a, Direction::Down, 5),
            peer_entry(&b, Direction::Down, 3),
            peer_entry(&e, Direction::Down, 2),
            peer_entry(&c, Direction::Down, 3),
        ])
        .await
        .unwrap(),
        vec![
            AppendOutcome::Appended { seq: 5 },
            AppendOutcome::Appended { seq: 3 },
            AppendOutcome::Appended { seq: 2 },
            AppendOutcome::Appended { seq: 3 },
        ]
    );
    assert!(cached_scripts(&mut nodes[1]).await >= 1);

    // Expiry across nodes: two finished delegations on two nodes.
    append1(
        &s,
        relay_entry(&e, Direction::Up, 1, Some(Outcome::Expired)),
    )
    .await;
    assert_eq!(s.expire_finished(u64::MAX).await.unwrap(), 2);
    assert_eq!(s.meta(&d).await.unwrap(), None);
    assert_eq!(s.meta(&e).await.unwrap(), None);
    assert_eq!(
        s.delegations_of(&peer("acme/callee")).await.unwrap().len(),
        4
    );
    let epoch = s.epoch().await.unwrap();
    assert_eq!(s.epoch().await.unwrap(), epoch);
    s.ping().await.unwrap();

    // A node crash and restart (AOF): its delegations come back, and the
    // store reconnects and reloads the scripts by itself.
    let mut cluster = cluster;
    cluster.wait_aof_written(2).unwrap();
    cluster.kill_node(2).unwrap();
    // While node 2 is down, a batch over all three nodes: the entries on
    // the live nodes are stored, the one on node 2 is refused on its own
    // (resent later by its sender), nothing else waits for the dead node.
    assert_eq!(
        s.append(vec![
            peer_entry(&a, Direction::Down, 6),
            peer_entry(&c, Direction::Down, 4),
            peer_entry(&b, Direction::Down, 4),
        ])
        .await
        .unwrap(),
        vec![
            AppendOutcome::Appended { seq: 6 },
            AppendOutcome::Unavailable,
            AppendOutcome::Appended { seq: 4 },
        ]
    );
    // A read whose pipeline spans the dead node fails as a whole, with the
    // dead node's error as it was: the failed command, and Redis's cause
    // (`oab:deadlines` is on node 0; the metas pipeline reaches node 2).
    match s.due(u64::MAX, 100).await {
        Err(StoreError::Unavailable { operation, cause }) => {
            assert_eq!(operation, "redis HGETALL");
            assert!(!cause.contains("unavailable"), "{cause}");
        }
        other => panic!("expected Unavailable, got {other:?}"),
    }
    let cluster = tokio::task::spawn_blocking(move || cluster.restart_node(2).map(|()| cluster))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        seqs(entries(&s, &c, Direction::Down, 0, 10).await),
        [1, 2, 3]
    );
    assert_eq!(
        append1(&s, peer_entry(&c, Direction::Down, 4)).await,
        AppendOutcome::Appended { seq: 4 }
    );
    assert_eq!(
        append1(&s, peer_entry(&f, Direction::Up, 3)).await,
        AppendOutcome::Appended { seq: 3 }
    );
    drop(cluster);
}

#[tokio::test]
async fn cluster_url_errors_are_unavailable_and_redacted() {
    for url in [
        "redis-cluster://user:secret@127.0.0.1:1,u:secret@127.0.0.1:2",
        "redis-cluster://user:secret@127.0.0.1:1/3",
        "redis-cluster://",
    ] {
        match RedisStore::connect(url, retention(100)).await {
            Err(e @ StoreError::Unavailable { .. }) => {
                let msg = e.to_string();
                assert!(msg.contains("invalid Redis URL"), "{msg}");
                assert!(!msg.contains("secret"), "credentials leaked: {msg}");
            }
            Err(other) => panic!("expected Unavailable, got {other:?}"),
            Ok(_) => panic!("{url} accepted"),
        }
    }
    // Nothing listens on port 1.
    let started = Instant::now();
    match RedisStore::connect("redis-cluster://user:secret@127.0.0.1:1", retention(100)).await {
        Err(e @ StoreError::Unavailable { .. }) => {
            let msg = e.to_string();
            assert!(msg.contains("connect to Redis at"), "{msg}");
            assert!(!msg.contains("secret"), "credentials leaked: {msg}");
        }
        Err(other) => panic!("expected Unavailable, got {other:?}"),
        Ok(_) => panic!("connected to nothing"),
    }
    assert!(started.elapsed() < Duration::from_secs(20));
}

// ---------------------------------------------------------------------------
// Property tests: reference model, memory store, Redis store.

/// The rules of the store written as plainly as possible: full logs,
/// trimming computed on read.
#[derive(Debug)]
struct Model {
    retention: Retention,
    delegations: BTreeMap<DelegationKey, ModelDelegation>,
    descriptors: HashMap<PeerId, Bytes>,
}

#[derive(Debug)]
struct ModelDelegation {
    meta: DelegationMeta,
    /// Entry `i` has sequence `i + 1`.
    down: Vec<Bytes>,
    up: Vec<Bytes>,
}

impl Model {
    fn new(retention: Retention) -> Self {
        Model {
            retention,
            delegations: BTreeMap::new(),
            descriptors: HashMap::new(),
        }
    }

    fn tail(&self, key: &DelegationKey, dir: Direction) -> u64 {
        self.delegations.get(key).map_or(0, |d| d.meta.tail(dir))
    }

    /// The delegation's callee (any peer when there is none).
    fn callee(&self, key: &DelegationKey) -> PeerId {
        self.delegations
            .get(key)
            .map_or_else(|| key.caller.clone(), |d| d.meta.callee.clone())
    }

    fn open(&mut self, req: &OpenRequest) -> OpenOutcome {
        if let Some(d) = self.delegations.get(&req.key) {
            return if d.meta.digest == req.digest {
                OpenOutcome::Existing(d.meta.clone())
            } else {
                OpenOutcome::Mismatch(d.meta.clone())
            };
        }
        let meta = DelegationMeta {
            key: req.key.clone(),
            callee: req.callee.clone(),
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
            trace: req.trace,
        };
        self.delegations.insert(
            req.key.clone(),
            ModelDelegation {
                meta: meta.clone(),
                down: vec![req.frame.clone()],
                up: vec![],
            },
        );
        OpenOutcome::Created(meta)
    }

    fn append(&mut self, req: &AppendRequest) -> AppendOutcome {
        let Some(d) = self.delegations.get_mut(&req.key) else {
            return AppendOutcome::Unknown;
        };
        let m = &mut d.meta;
        let tail = m.tail(req.dir);
        let sender_tail = match req.dir {
            Direction::Down => m.down_sender_tail,
            Direction::Up => m.up_sender_tail,
        };
        let ended = m
            .terminal
            .map(|outcome| AppendOutcome::AlreadyTerminal { outcome });
        match &req.origin {
            Origin::Relay => {
                if req.seq != tail + 1 {
                    return AppendOutcome::Conflict { tail };
                }
                if let (Some(_), Some(ended)) = (req.terminal, ended) {
                    return ended;
                }
            }
            Origin::Peer { peer, instance } => {
                let party = match req.dir {
                    Direction::Down => &req.key.caller,
                    Direction::Up => &m.callee,
                };
                if peer != party {
                    return AppendOutcome::NotParty;
                }
                if req.seq <= sender_tail {
                    return AppendOutcome::Duplicate { tail: sender_tail };
                }
                if req.seq <= tail {
                    return ended.unwrap_or(AppendOutcome::AlreadyTerminal {
                        outcome: Outcome::Unknown,
                    });
                }
                if req.seq > tail + 1 {
                    return AppendOutcome::Hole { tail };
                }
                if let Some(ended) = ended {
                    return ended;
                }
                match req.dir {
                    Direction::Down => m.down_sender_tail = req.seq,
                    Direction::Up => {
                        m.up_sender_tail = req.seq;
                        m.accepted_by.get_or_insert(*instance);
                    }
                }
            }
        }
        match req.dir {
            Direction::Down => {
                m.down_tail = req.seq;
                d.down.push(req.frame.clone());
            }
            Direction::Up => {
                m.up_tail = req.seq;
                d.up.push(req.frame.clone());
            }
        }
        if let (Some(outcome), None) = (req.terminal, m.terminal) {
            m.terminal = Some(outcome);
            m.terminal_ms = Some(req.now_ms);
        }
        AppendOutcome::Appended { seq: req.seq }
    }

    fn read(&self, key: &DelegationKey, dir: Direction, after: u64, limit: usize) -> ReadOutcome {
        let Some(d) = self.delegations.get(key) else {
            return ReadOutcome::Unknown;
        };
        let log = match dir {
            Direction::Down => &d.down,
            Direction::Up => &d.up,
        };
        let tail = log.len() as u64;
        let terminal = d.meta.terminal;
        if after > tail {
            return ReadOutcome::Lost { tail, terminal };
        }
        let kept = tail.min(self.retention.max_log_entries);
        let first = tail - kept + 1;
        if kept > 0 && after + 1 < first {
            return ReadOutcome::Trimmed {
                first_available: first,
                terminal,
            };
        }
        let entries = (after + 1..=tail)
            .take(limit)
            .map(|seq| (seq, log[(seq - 1) as usize].clone()))
            .collect();
        ReadOutcome::Entries {
            entries,
            tail,
            terminal,
        }
    }

    fn delegations_of(&self, peer: &PeerId) -> Vec<DelegationMeta> {
        self.delegations
            .values()
            .filter(|d| d.meta.involves(peer))
            .map(|d| d.meta.clone())
            .collect()
    }

    fn due(&self, now_ms: u64, limit: usize) -> Vec<DelegationKey> {
        let mut open: Vec<_> = self
            .delegations
            .values()
            .filter(|d| d.meta.terminal.is_none() && d.meta.deadline_ms <= now_ms)
            .map(|d| (d.meta.deadline_ms, d.meta.key.clone()))
            .collect();
        open.sort();
        open.into_iter().take(limit).map(|(_, k)| k).collect()
    }

    fn expire_finished(&mut self, now_ms: u64) -> u64 {
        let cutoff = now_ms.saturating_sub(self.retention.finished_ttl_ms);
        let before = self.delegations.len();
        self.delegations
            .retain(|_, d| d.meta.terminal_ms.is_none_or(|at| at > cutoff));
        (before - self.delegations.len()) as u64
    }
}

mod props {
    use proptest::prelude::*;
    use proptest::test_runner::{Config, TestCaseError, TestRunner};

    use super::*;

    /// Small id spaces so operations collide often.
    const CALLERS: [&str; 2] = ["acme/a", "acme/b"];
    const PEERS: [&str; 3] = ["acme/a", "acme/b", "acme/c"];
    const REQUESTS: [&str; 2] = ["r1", "r2"];
    /// Synthetic times span several retention periods.
    const TIME: std::ops::Range<u64> = 0..8_000_000;

    fn retention() -> Retention {
        Retention {
            max_log_entries: 3,
            // Real milliseconds for Redis: longer than any test run, so only
            // `expire_finished` (with the synthetic times) removes anything.
            finished_ttl_ms: 3_600_000,
            // Never reached here: the byte budgets have their own cases.
            max_delegation_bytes: 1 << 40,
            max_peer_bytes: 1 << 40,
        }
    }

    #[derive(Debug, Clone)]
    enum SeqPick {
        Next,
        Back(u64),
        Ahead(u64),
        Abs(u64),
    }

    #[derive(Debug, Clone)]
    struct Entry {
        d: (usize, usize),
        dir: Direction,
        seq: SeqPick,
        terminal: Option<Outcome>,
        relay: bool,
        instance: u8,
        /// A sender other than the log's party (index into `PEERS`, which
        /// may still name the party); `None`: the party.
        stranger: Option<usize>,
        now: u64,
    }

    #[derive(Debug, Clone)]
    enum Op {
        Open {
            d: (usize, usize),
            callee: usize,
            digest: u8,
            deadline: u64,
            now: u64,
        },
        Append(Vec<Entry>),
        Read {
            d: (usize, usize),
            dir: Direction,
            /// The cursor, resolved against the log's tail like a sequence.
            after: SeqPick,
            limit: usize,
        },
        Meta((usize, usize)),
        DelegationsOf(usize),
        Due {
            now: u64,
            limit: usize,
        },
        Expire(u64),
        PutDescriptor(usize, u8),
        Descriptor(usize),
    }

    /// An operation with the model's seq choices resolved into requests.
    #[derive(Debug, Clone)]
    enum Call {
        Open(OpenRequest),
        Append(Vec<AppendRequest>),
        Read(DelegationKey, Direction, u64, usize),
        Meta(DelegationKey),
        DelegationsOf(PeerId),
        Due(u64, usize),
        Expire(u64),
        PutDescriptor(PeerId, Bytes),
        Descriptor(PeerId),
    }

    #[derive(Debug, Clone, PartialEq, Eq)]
    enum Reply {
        Open(OpenOutcome),
        Append(Vec<AppendOutcome>),
        Read(ReadOutcome),
        Meta(Option<DelegationMeta>),
        DelegationsOf(Vec<DelegationMeta>),
        Due(Vec<DelegationKey>),
        Expired(u64),
        Done,
        Descriptor(Option<Bytes>),
    }

    fn dkey((c, r): (usize, usize)) -> DelegationKey {
        key(CALLERS[c], REQUESTS[r])
    }

    fn dir() -> impl Strategy<Value = Direction> {
        prop_oneof![Just(Direction::Down), Just(Direction::Up)]
    }

    fn delegation() -> impl Strategy<Value = (usize, usize)> {
        (0..CALLERS.len(), 0..REQUESTS.len())
    }

    fn seq_pick() -> impl Strategy<Value = SeqPick> {
        prop_oneof![
            6 => Just(SeqPick::Next),
            2 => (0..4u64).prop_map(SeqPick::Back),
            1 => (1..3u64).prop_map(SeqPick::Ahead),
            1 => (0..12u64).prop_map(SeqPick::Abs),
        ]
    }

    fn cursor_pick() -> impl Strategy<Value = SeqPick> {
        prop_oneof![
            1 => Just(SeqPick::Next),
            4 => (0..9u64).prop_map(SeqPick::Back),
            1 => (1..3u64).prop_map(SeqPick::Ahead),
            2 => (0..12u64).prop_map(SeqPick::Abs),
        ]
    }

    fn entry() -> impl Strategy<Value = Entry> {
        (
            delegation(),
            dir(),
            seq_pick(),
            prop::option::weighted(0.06, prop::sample::select(Outcome::ALL)),
            prop::bool::weighted(0.2),
            0..2u8,
            prop::option::weighted(0.1, 0..PEERS.len()),
            TIME,
        )
            .prop_map(
                |(d, dir, seq, terminal, relay, instance, stranger, now)| Entry {
                    d,
                    dir,
                    seq,
                    terminal,
                    relay,
                    instance,
                    stranger,
                    now,
                },
            )
    }

    fn open_op() -> impl Strategy<Value = Op> {
        (delegation(), 0..PEERS.len(), 0..2u8, TIME, TIME).prop_map(
            |(d, callee, digest, deadline, now)| Op::Open {
                d,
                callee,
                digest,
                deadline,
                now,
            },
        )
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            3 => open_op(),
            8 => prop::collection::vec(entry(), 1..8).prop_map(Op::Append),
            3 => (delegation(), dir(), cursor_pick(), 0..6usize)
                .prop_map(|(d, dir, after, limit)| Op::Read { d, dir, after, limit }),
            1 => delegation().prop_map(Op::Meta),
            1 => (0..PEERS.len()).prop_map(Op::DelegationsOf),
            1 => (TIME, 0..4usize).prop_map(|(now, limit)| Op::Due { now, limit }),
            1 => TIME.prop_map(Op::Expire),
            1 => (0..PEERS.len(), any::<u8>()).prop_map(|(p, v)| Op::PutDescriptor(p, v)),
            1 => (0..PEERS.len()).prop_map(Op::Descriptor),
        ]
    }

    /// A few opens first (so most operations find a delegation), then
    /// anything.
    fn ops() -> impl Strategy<Value = Vec<Op>> {
        (
            prop::collection::vec(open_op(), 2..8),
            prop::collection::vec(op(), 1..50),
        )
            .prop_map(|(mut opens, rest)| {
                opens.extend(rest);
                opens
            })
    }

    /// Runs the ops on the model, resolving sequence choices against its
    /// state, and returns the calls with the model's replies.
    fn resolve(ops: &[Op]) -> Vec<(Call, Reply)> {
        let mut model = Model::new(retention());
        let mut out = Vec::with_capacity(ops.len());
        for (i, op) in ops.iter().enumerate() {
            let (call, reply) = match op {
                Op::Open {
                    d,
                    callee,
                    digest,
                    deadline,
                    now,
                } => {
                    let req = OpenRequest {
                        key: dkey(*d),
                        callee: peer(PEERS[*callee]),
                        deadline_ms: *deadline,
                        digest: Digest::of(&[*digest]),
                        trace: None,
                        frame: Bytes::from(format!("open #{i}")),
                        now_ms: *now,
                        wake: None,
                    };
                    let reply = Reply::Open(model.open(&req));
                    (Call::Open(req), reply)
                }
                Op::Append(entries) => {
                    let mut reqs = Vec::with_capacity(entries.len());
                    let mut replies = Vec::with_capacity(entries.len());
                    for (j, e) in entries.iter().enumerate() {
                        let key = dkey(e.d);
                        let tail = model.tail(&key, e.dir);
                        let seq = match e.seq {
                            SeqPick::Next => tail + 1,
                            SeqPick::Back(k) => tail.saturating_sub(k),
                            SeqPick::Ahead(k) => tail + 1 + k,
                            SeqPick::Abs(n) => n,
                        };
                        let origin = if e.relay {
                            Origin::Relay
                        } else {
                            Origin::Peer {
                                peer: match (e.stranger, e.dir) {
                                    (Some(p), _) => peer(PEERS[p]),
                                    (None, Direction::Down) => key.caller.clone(),
                                    (None, Direction::Up) => model.callee(&key),
                                },
                                instance: InstanceId([e.instance; 16]),
                            }
                        };
                        let req = AppendRequest {
                            frame: Bytes::from(format!("op {i}.{j} seq {seq}")),
                            key,
                            dir: e.dir,
                            seq,
                            terminal: e.terminal,
                            origin,
                            now_ms: e.now,
                            wake: None,
                        };
                        replies.push(model.append(&req));
                        reqs.push(req);
                    }
                    (Call::Append(reqs), Reply::Append(replies))
                }
                Op::Read {
                    d,
                    dir,
                    after,
                    limit,
                } => {
                    let key = dkey(*d);
                    let tail = model.tail(&key, *dir);
                    let after = match after {
                        SeqPick::Next => tail,
                        SeqPick::Back(k) => tail.saturating_sub(*k),
                        SeqPick::Ahead(k) => tail + k,
                        SeqPick::Abs(n) => *n,
                    };
                    let reply = Reply::Read(model.read(&key, *dir, after, *limit));
                    (Call::Read(key, *dir, after, *limit), reply)
                }
                Op::Meta(d) => {
                    let key = dkey(*d);
                    let reply = Reply::Meta(model.delegations.get(&key).map(|d| d.meta.clone()));
                    (Call::Meta(key), reply)
                }
                Op::DelegationsOf(p) => {
                    let p = peer(PEERS[*p]);
                    let reply = Reply::DelegationsOf(model.delegations_of(&p));
                    (Call::DelegationsOf(p), reply)
                }
                Op::Due { now, limit } => {
                    (Call::Due(*now, *limit), Reply::Due(model.due(*now, *limit)))
                }
                Op::Expire(now) => (
                    Call::Expire(*now),
                    Reply::Expired(model.expire_finished(*now)),
                ),
                Op::PutDescriptor(p, v) => {
                    let p = peer(PEERS[*p]);
                    let bytes = Bytes::from(vec![*v; 3]);
                    model.descriptors.insert(p.clone(), bytes.clone());
                    (Call::PutDescriptor(p, bytes), Reply::Done)
                }
                Op::Descriptor(p) => {
                    let p = peer(PEERS[*p]);
                    let reply = Reply::Descriptor(model.descriptors.get(&p).cloned());
                    (Call::Descriptor(p), reply)
                }
            };
            out.push((call, reply));
        }
        out
    }

    async fn apply<S: EventStore>(s: &S, call: &Call) -> Reply {
        match call.clone() {
            Call::Open(req) => Reply::Open(s.open(req).await.unwrap()),
            Call::Append(reqs) => Reply::Append(s.append(reqs).await.unwrap()),
            Call::Read(k, dir, after, limit) => {
                Reply::Read(s.read(&k, dir, after, limit).await.unwrap())
            }
            Call::Meta(k) => Reply::Meta(s.meta(&k).await.unwrap()),
            Call::DelegationsOf(p) => Reply::DelegationsOf(s.delegations_of(&p).await.unwrap()),
            Call::Due(now, limit) => Reply::Due(s.due(now, limit).await.unwrap()),
            Call::Expire(now) => Reply::Expired(s.expire_finished(now).await.unwrap()),
            Call::PutDescriptor(p, b) => {
                s.put_descriptor(&p, b).await.unwrap();
                Reply::Done
            }
            Call::Descriptor(p) => Reply::Descriptor(s.descriptor(&p).await.unwrap()),
        }
    }

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap()
    }

    fn runner(cases: u32) -> TestRunner {
        TestRunner::new(Config {
            cases,
            // No regression files next to the sources from a manual runner.
            failure_persistence: None,
            ..Config::default()
        })
    }

    /// Which kinds of result a reply shows, so the property tests can
    /// prove they exercised every rule rather than passing vacuously.
    fn kinds(reply: &Reply) -> Vec<&'static str> {
        match reply {
            Reply::Open(OpenOutcome::Created(_)) => vec!["open created"],
            Reply::Open(OpenOutcome::Existing(_)) => vec!["open existing"],
            Reply::Open(OpenOutcome::Mismatch(_)) => vec!["open mismatch"],
            Reply::Append(outcomes) => outcomes
                .iter()
                .map(|o| match o {
                    AppendOutcome::Appended { .. } => "appended",
                    AppendOutcome::Duplicate { .. } => "duplicate",
                    AppendOutcome::Hole { .. } => "hole",
                    AppendOutcome::AlreadyTerminal { .. } => "already terminal",
                    AppendOutcome::Conflict { .. } => "conflict",
                    AppendOutcome::Unknown => "append unknown",
                    AppendOutcome::Unavailable => "append unavailable",
                    AppendOutcome::NotParty => "not the party",
                    AppendOutcome::OverBudget { .. } => "over budget",
                })
                .collect(),
            Reply::Read(ReadOutcome::Entries { entries, .. }) if !entries.is_empty() => {
                vec!["read entries"]
            }
            Reply::Read(ReadOutcome::Trimmed { .. }) => vec!["read trimmed"],
            Reply::Read(ReadOutcome::Lost { .. }) => vec!["read lost"],
            Reply::Read(ReadOutcome::Unknown) => vec!["read unknown"],
            Reply::Meta(Some(m)) if m.terminal.is_some() => vec!["terminal"],
            Reply::DelegationsOf(v) if v.len() > 1 => vec!["delegations of"],
            Reply::Due(v) if !v.is_empty() => vec!["due"],
            Reply::Expired(n) if *n > 0 => vec!["expired"],
            _ => vec![],
        }
    }

    const EXPECTED_KINDS: &[&str] = &[
        "open created",
        "open existing",
        "open mismatch",
        "appended",
        "duplicate",
        "hole",
        "already terminal",
        "conflict",
        "append unknown",
        "not the party",
        "read entries",
        "read trimmed",
        "read lost",
        "read unknown",
        "terminal",
        "delegations of",
        "due",
        "expired",
    ];

    /// The memory store agrees with the reference model.
    #[test]
    fn memory_store_matches_model() {
        let rt = runtime();
        let seen = std::sync::Mutex::new(std::collections::BTreeSet::new());
        runner(256)
            .run(&ops(), |ops| {
                rt.block_on(async {
                    let store = MemoryStore::new(retention());
                    for (i, (call, expected)) in resolve(&ops).into_iter().enumerate() {
                        let got = apply(&store, &call).await;
                        prop_assert_eq!(&got, &expected, "op {} {:?}", i, call);
                        seen.lock().unwrap().extend(kinds(&got));
                    }
                    Ok::<(), TestCaseError>(())
                })
            })
            .unwrap();
        let seen = seen.into_inner().unwrap();
        let missing: Vec<_> = EXPECTED_KINDS
            .iter()
            .filter(|k| !seen.contains(*k))
            .collect();
        assert!(missing.is_empty(), "never exercised: {missing:?}");
    }

    /// The Redis store agrees with the memory store (and so with the model).
    #[test]
    fn redis_store_matches_memory_store() {
        let rt = runtime();
        let server = RedisServer::start(Persistence::None).unwrap();
        let (redis_store, raw) = rt.block_on(async {
            let store = RedisStore::connect(&server.url(), retention())
                .await
                .unwrap();
            (store, raw(&server).await)
        });
        let seen = std::sync::Mutex::new(std::collections::BTreeSet::new());
        runner(64)
            .run(&ops(), |ops| {
                let mut raw = raw.clone();
                rt.block_on(async {
                    let _: () = redis::cmd("FLUSHALL").query_async(&mut raw).await.unwrap();
                    let memory = MemoryStore::new(retention());
                    for (i, (call, expected)) in resolve(&ops).into_iter().enumerate() {
                        let from_memory = apply(&memory, &call).await;
                        let from_redis = apply(&redis_store, &call).await;
                        prop_assert_eq!(&from_redis, &from_memory, "op {} {:?}", i, call);
                        prop_assert_eq!(&from_memory, &expected, "op {} {:?}", i, call);
                        seen.lock().unwrap().extend(kinds(&from_redis));
                    }
                    Ok::<(), TestCaseError>(())
                })
            })
            .unwrap();
        let seen = seen.into_inner().unwrap();
        let missing: Vec<_> = EXPECTED_KINDS
            .iter()
            .filter(|k| !seen.contains(*k))
            .collect();
        assert!(missing.is_empty(), "never exercised: {missing:?}");
    }
}

// ---------------------------------------------------------------------------
// Throughput (run explicitly, preferably in release mode:
// `cargo test --release -p oab-relay --test store_conformance -- --ignored --nocapture`)

async fn measure_append_throughput(persistence: Persistence) {
    const TOTAL: u64 = 100_000;
    const BATCH: u64 = 256;
    const DELEGATIONS: u64 = 64;
    const IN_FLIGHT: usize = 4;
    let server = RedisServer::start(persistence).unwrap();
    let s = RedisStore::connect(&server.url(), Retention::default())
        .await
        .unwrap();
    let keys: Vec<DelegationKey> = (0..DELEGATIONS)
        .map(|i| key("acme/caller", &format!("bench-{i}")))
        .collect();
    for k in &keys {
        created(&s, open_req(k, "acme/callee", u64::MAX, 1)).await;
    }
    let payload = Bytes::from(vec![0x5a; 256]);
    // Entry n goes to delegation n % 64 with sequence n / 64 + 2.
    let batch_of = |b: u64| -> Vec<AppendRequest> {
        (b * BATCH..((b + 1) * BATCH).min(TOTAL))
            .map(|n| AppendRequest {
                key: keys[(n % DELEGATIONS) as usize].clone(),
                dir: Direction::Down,
                seq: n / DELEGATIONS + 2,
                terminal: None,
                origin: Origin::Peer {
                    peer: peer("acme/caller"),
                    instance: INSTANCE_A,
                },
                frame: payload.clone(),
                now_ms: 2,
                wake: None,
            })
            .collect()
    };
    let batches = TOTAL.div_ceil(BATCH);

    // One batch at a time.
    let started = Instant::now();
    for b in 0..batches {
        let out = s.append(batch_of(b)).await.unwrap();
        assert!(
            out.iter()
                .all(|o| matches!(o, AppendOutcome::Appended { .. }))
        );
    }
    let serial = started.elapsed();

    // Again, IN_FLIGHT batches at a time over the one multiplexed
    // connection. Each lane has its own delegations, so the order of
    // batches within a lane is all that must hold (it does: a lane awaits
    // its batch before sending the next).
    let lanes: Vec<Vec<DelegationKey>> = (0..IN_FLIGHT)
        .map(|l| {
            (0..DELEGATIONS / IN_FLIGHT as u64)
                .map(|i| key("acme/caller", &format!("lane-{l}-{i}")))
                .collect()
        })
        .collect();
    for k in lanes.iter().flatten() {
        created(&s, open_req(k, "acme/callee", u64::MAX, 1)).await;
    }
    let started = Instant::now();
    let per_lane = TOTAL / IN_FLIGHT as u64;
    let results = futures_util::future::join_all(lanes.iter().map(|lane| {
        let s = &s;
        let payload = payload.clone();
        async move {
            let per = lane.len() as u64;
            let mut b = 0;
            while b * BATCH < per_lane {
                let batch: Vec<_> = (b * BATCH..((b + 1) * BATCH).min(per_lane))
                    .map(|n| AppendRequest {
                        key: lane[(n % per) as usize].clone(),
                        dir: Direction::Down,
                        seq: n / per + 2,
                        terminal: None,
                        origin: Origin::Peer {
                            peer: peer("acme/caller"),
                            instance: INSTANCE_A,
                        },
                        frame: payload.clone(),
                        now_ms: 2,
                        wake: None,
                    })
                    .collect();
                let out = s.append(batch).await.unwrap();
                assert!(
                    out.iter()
                        .all(|o| matches!(o, AppendOutcome::Appended { .. }))
                );
                b += 1;
            }
        }
    }))
    .await;
    let concurrent = started.elapsed();
    assert_eq!(results.len(), IN_FLIGHT);
    let rate = |d: Duration, n: u64| n as f64 / d.as_secs_f64();
    println!(
        "{persistence:?}: {TOTAL} appends of 256 B in batches of {BATCH}: \
         one batch in flight {:.0}/s ({serial:.2?}); {IN_FLIGHT} in flight {:.0}/s ({concurrent:.2?})",
        rate(serial, TOTAL),
        rate(concurrent, per_lane * IN_FLIGHT as u64),
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "throughput measurement; run with --ignored --nocapture, ideally --release"]
async fn redis_append_throughput_no_persistence() {
    measure_append_throughput(Persistence::None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "throughput measurement; run with --ignored --nocapture, ideally --release"]
async fn redis_append_throughput_aof_everysec() {
    measure_append_throughput(Persistence::Aof).await;
}
