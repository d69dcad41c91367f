//! A relay that runs for months: what the hub keeps per delegation returns
//! to its baseline while sessions live, and no peer's presence traffic or
//! request flood cuts or starves another peer.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::*;
use oab_relay::store::EventStore;
use oab_testkit::raw_client::{ClientError, RawClient};
use oab_wire::{Direction, ErrorCode, Frame, Outcome, Ping, Resume};

both_stores! {
    finished_delegations_leave_the_hub_while_their_sessions_live => finished_leave_the_hub;
}

/// Delegations run to their terminal over one pair of sessions that stays
/// connected.
const DELEGATIONS: usize = 20;

/// Polls the relay's `/metrics` until `name` reads `want` (bounded).
async fn wait_for_metric(relay: &TestRelay, name: &str, want: f64) {
    let until = Instant::now() + Duration::from_secs(20);
    loop {
        let value = metric_value(&relay.metrics().await, name);
        if value == want {
            return;
        }
        assert!(
            Instant::now() < until,
            "{name} stayed at {value}, expected {want}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Sends a ping and reads until its pong, handing every other frame to `f`.
async fn until_pong(c: &mut RawClient, nonce: u64, mut f: impl FnMut(&Frame)) {
    c.send(&Frame::Ping(Ping { token: nonce })).await.unwrap();
    loop {
        match recv(c).await {
            Frame::Pong(p) if p.token == nonce => return,
            other => f(&other),
        }
    }
}

async fn finished_leave_the_hub<S: EventStore>(store: Arc<S>) {
    let env = TestEnv::new("");
    let relay = TestRelay::start(&env, store).await;
    let mut a = relay.client(&env.caller).await;
    let mut b = relay.client(&env.callee).await;
    for i in 0..DELEGATIONS {
        let request = format!("life-{i}");
        a.send(&open_frame(&request, b"{}")).await.unwrap();
        await_ack(&mut a, &request, Direction::Down, 1).await;
        recv_until(&mut b, |f| matches!(f, Frame::Open(_)).then_some(())).await;
        b.send(&data(
            &request,
            Direction::Up,
            1,
            Some(Outcome::Completed),
            payload(1),
        ))
        .await
        .unwrap();
        await_ack(&mut b, &request, Direction::Up, 1).await;
        read_to_terminal(&mut a, &request, 0, 1).await;
    }
    // The gauges follow the hub's state as it changes: the last
    // delegation's view and its two subscriptions are there now.
    let page = relay.metrics().await;
    assert!(metric_value(&page, "oab_hub_views") >= 1.0, "{page}");
    assert!(
        metric_value(&page, "oab_hub_subscriptions") >= 2.0,
        "{page}"
    );
    // Both sessions stay connected; the hub forgets the finished work.
    wait_for_metric(&relay, "oab_hub_views", 0.0).await;
    wait_for_metric(&relay, "oab_hub_subscriptions", 0.0).await;
    assert_eq!(metric_value(&relay.metrics().await, "oab_sessions"), 2.0);
    until_pong(&mut a, 1, |_| {}).await;
    until_pong(&mut b, 2, |_| {}).await;

    // A late resume of a pruned delegation is answered from the store.
    a.send(&Frame::Resume(Resume {
        key: key("life-0"),
        direction: Direction::Up,
        after: 0,
    }))
    .await
    .unwrap();
    read_to_terminal(&mut a, "life-0", 0, 1).await;
    relay.stop().await;
}

/// A descriptor of about `size` bytes, numbered `n`.
fn descriptor(n: usize, size: usize) -> Bytes {
    Bytes::from(
        serde_json::json!({ "n": n, "pad": "x".repeat(size) })
            .to_string()
            .into_bytes(),
    )
}

/// The number in a `Peers` frame's descriptor of the callee, if any.
fn published_number(payload: &[u8]) -> Option<u64> {
    let entries: serde_json::Value = serde_json::from_slice(payload).ok()?;
    entries
        .as_array()?
        .iter()
        .find(|e| e["peer"] == CALLEE)?
        .get("descriptor")?
        .get("n")?
        .as_u64()
}

/// 1,000 publishes of a 60 KiB descriptor in one burst, while the
/// publisher's caller reads nothing: the caller keeps its session and ends
/// with the newest descriptor. (Before, each publish queued a full snapshot
/// on the caller's control lane and the burst closed it with
/// `slow_consumer`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publish_burst_cuts_none_of_the_publishers_callers() {
    const BURST: usize = 1_000;
    // The burst is within the publisher's request meter: this is about the
    // snapshots the burst causes, not about refusing it.
    let env = TestEnv::new("[rate]\npeer_requests_burst = 100000\n");
    let relay = TestRelay::start(
        &env,
        Arc::new(oab_relay::store::MemoryStore::new(
            oab_relay::store::Retention::default(),
        )),
    )
    .await;
    let mut a = relay.client(&env.caller).await;
    let mut b = relay.client(&env.callee).await;
    for n in 0..BURST {
        b.feed(&Frame::Publish(descriptor(n, 60 * 1024)))
            .await
            .unwrap();
    }
    b.flush().await.unwrap();
    // Every publish was handled once the pong is back.
    until_pong(&mut b, 1, |f| {
        if let Frame::Error(e) = f {
            panic!("publish refused: {e:?}");
        }
    })
    .await;

    let mut snapshots = 0;
    loop {
        let frame = match tokio::time::timeout(Duration::from_secs(20), a.recv()).await {
            Ok(Ok(frame)) => frame,
            Ok(Err(ClientError::Closed { code, reason })) => {
                panic!("the caller was cut after {snapshots} snapshots: {code} {reason}")
            }
            Ok(Err(e)) => panic!("the caller's connection failed: {e}"),
            Err(_) => panic!("the newest descriptor never arrived ({snapshots} snapshots)"),
        };
        if let Frame::Peers(p) = frame {
            snapshots += 1;
            if published_number(&p) == Some(BURST as u64 - 1) {
                break;
            }
        }
    }
    until_pong(&mut a, 2, |_| {}).await;
    eprintln!("{BURST} publishes reached the non-reading caller as {snapshots} Peers snapshots");
    assert!(snapshots < BURST);
    relay.stop().await;
}

/// A peer that sends 2,000 `PeersQuery` for a 60 KiB descriptor and reads
/// nothing meanwhile: the queries beyond its request meter are refused with
/// `rate_limited`, the answered ones share snapshots, and the peer keeps its
/// session. (Before, every query queued a full snapshot: the flood closed
/// the session with `slow_consumer`, or made the relay send one 60 KiB
/// snapshot per 6-byte query.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peers_query_flood_is_metered_and_coalesced() {
    const QUERIES: usize = 2_000;
    let env = TestEnv::new("");
    let relay = TestRelay::start(
        &env,
        Arc::new(oab_relay::store::MemoryStore::new(
            oab_relay::store::Retention::default(),
        )),
    )
    .await;
    let mut a = relay.client(&env.caller).await;
    let mut b = relay.client(&env.callee).await;
    b.send(&Frame::Publish(descriptor(7, 60 * 1024)))
        .await
        .unwrap();
    until_pong(&mut b, 1, |_| {}).await;

    let query = oab_wire::encode(&Frame::PeersQuery).unwrap();
    for _ in 0..QUERIES {
        a.feed(&Frame::PeersQuery).await.unwrap();
    }
    a.flush().await.unwrap();
    let (mut snapshots, mut snapshot_bytes, mut refused) = (0usize, 0usize, 0usize);
    until_pong(&mut a, 2, |f| match f {
        Frame::Peers(p) => {
            snapshots += 1;
            snapshot_bytes += p.len();
        }
        Frame::Error(e) if e.code == ErrorCode::RateLimited.as_u16() => refused += 1,
        other => panic!("unexpected {other:?}"),
    })
    .await;
    let sent = QUERIES * query.len();
    eprintln!(
        "{QUERIES} queries ({sent} bytes): {refused} refused, {snapshots} snapshots ({snapshot_bytes} bytes) before the pong"
    );
    assert!(refused > 0, "the flood was not metered");
    // At most one snapshot waits in the session's queue: the relay answers
    // a batch of queries with one snapshot, not one each.
    assert!(
        snapshots <= (QUERIES - refused) / 8,
        "{snapshots} snapshots for {} answered queries",
        QUERIES - refused
    );
    // The flooding peer's meter is its own: another peer is answered.
    b.send(&Frame::PeersQuery).await.unwrap();
    recv_until(&mut b, |f| match f {
        Frame::Peers(_) => Some(()),
        Frame::Error(e) => panic!("the other peer was refused: {e:?}"),
        _ => None,
    })
    .await;
    relay.stop().await;
}

/// A flood of `Resume`s is metered per peer: beyond the meter each is
/// refused with `rate_limited` (about the resumed log, so the peer asks
/// again later), at most the meter's worth start a replay, and another
/// peer's resume is still served. (Before, every resume ran a store read and
/// a replay.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resume_flood_is_metered_per_peer() {
    const RESUMES: usize = 500;
    const PER_SECOND: u64 = 10;
    const BURST: u64 = 50;
    let env = TestEnv::new(&format!(
        "[rate]\npeer_requests_per_second = {PER_SECOND}\npeer_requests_burst = {BURST}\n"
    ));
    let relay = TestRelay::start(
        &env,
        Arc::new(oab_relay::store::MemoryStore::new(
            oab_relay::store::Retention::default(),
        )),
    )
    .await;
    let mut a = relay.client(&env.caller).await;
    let mut b = relay.client(&env.callee).await;
    open_and_stream_up(&mut a, &mut b, "flood", 3, 3).await;
    let replays_before = metric_value(&relay.metrics().await, "oab_replays_total");

    let started = Instant::now();
    for _ in 0..RESUMES {
        a.feed(&Frame::Resume(Resume {
            key: key("flood"),
            direction: Direction::Up,
            after: 0,
        }))
        .await
        .unwrap();
    }
    a.flush().await.unwrap();
    let mut refused = 0u64;
    until_pong(&mut a, 1, |f| {
        if let Frame::Error(e) = f {
            assert_eq!(e.code, ErrorCode::RateLimited.as_u16(), "{e:?}");
            assert_eq!(e.key.as_ref(), Some(&key("flood")));
            assert_eq!(e.direction, Direction::Up);
            refused += 1;
        }
    })
    .await;
    let elapsed = started.elapsed().as_secs() + 1;
    let replays = metric_value(&relay.metrics().await, "oab_replays_total") - replays_before;
    eprintln!("{RESUMES} resumes: {refused} refused, {replays} replays started");
    // A token bucket admits at most its burst plus its rate over the time
    // the flood took.
    let admitted = RESUMES as u64 - refused;
    assert!(
        admitted <= BURST + PER_SECOND * elapsed,
        "{admitted} resumes admitted in {elapsed} s"
    );
    assert!(replays <= admitted as f64);

    // The callee's meter is its own: its resume is served.
    b.send(&Frame::Resume(Resume {
        key: key("flood"),
        direction: Direction::Down,
        after: 0,
    }))
    .await
    .unwrap();
    recv_until(&mut b, |f| match f {
        Frame::Open(o) if o.key == key("flood") => Some(()),
        Frame::Error(e) => panic!("the other peer was refused: {e:?}"),
        _ => None,
    })
    .await;
    relay.stop().await;
}

/// Finished delegations of the callee kept for retention.
const FINISHED: usize = 100_000;

/// Opens `request` in the store and, when `finish`, appends its terminal.
fn open_request(request: &str) -> oab_relay::store::OpenRequest {
    let Frame::Open(open) = open_frame(request, b"{}") else {
        unreachable!()
    };
    oab_relay::store::OpenRequest {
        key: open.key.clone(),
        callee: open.target.clone(),
        deadline_ms: open.deadline_ms,
        digest: open.digest,
        trace: None,
        frame: oab_wire::encode(&Frame::Open(open)).unwrap(),
        now_ms: oab_wire::identity::now_ms(),
        wake: None,
    }
}

/// Opens `<prefix>-0` .. `<prefix>-<n-1>` in `store`, 256 at a time; each
/// must be new.
async fn open_all<S: EventStore>(store: &Arc<S>, prefix: &str, n: usize) {
    use futures_util::StreamExt as _;
    let opened: Vec<_> = futures_util::stream::iter(0..n)
        .map(|i| {
            let store = store.clone();
            let request = open_request(&format!("{prefix}-{i}"));
            async move { store.open(request).await }
        })
        .buffer_unordered(256)
        .collect()
        .await;
    assert!(
        opened
            .iter()
            .all(|o| matches!(o, Ok(oab_relay::store::OpenOutcome::Created(_))))
    );
}

fn terminal_request(request: &str) -> oab_relay::store::AppendRequest {
    oab_relay::store::AppendRequest {
        key: key(request),
        dir: Direction::Up,
        seq: 1,
        terminal: Some(Outcome::Completed),
        origin: oab_relay::store::Origin::Peer {
            peer: open_request(request).callee,
            instance: oab_wire::InstanceId::random(),
        },
        frame: oab_wire::encode(&data(
            request,
            Direction::Up,
            1,
            Some(Outcome::Completed),
            payload(1),
        ))
        .unwrap(),
        now_ms: oab_wire::identity::now_ms(),
        wake: None,
    }
}

/// Calls of one Redis command since the last `CONFIG RESETSTAT`.
async fn command_calls(con: &mut ::redis::aio::MultiplexedConnection, command: &str) -> u64 {
    let info: String = ::redis::cmd("INFO")
        .arg("commandstats")
        .query_async(con)
        .await
        .unwrap();
    let prefix = format!("cmdstat_{command}:calls=");
    info.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .and_then(|rest| rest.split(',').next())
        .map_or(0, |n| n.parse().unwrap())
}

/// A callee with 100,000 finished delegations in the retention window and
/// 3 open ones: its handshake reads the 3 open ones only (the store's index
/// of open delegations), and its welcome lists exactly them. (Before, each
/// handshake read every delegation in the window, twice: 200,000 `HGETALL`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handshake_reads_only_the_open_delegations() {
    use oab_relay::store::{RedisStore, Retention};
    use oab_testkit::redis::{Persistence, RedisServer};

    let env = TestEnv::new("");
    let redis = RedisServer::start(Persistence::None).unwrap();
    let store = Arc::new(
        RedisStore::connect(&redis.url(), Retention::default())
            .await
            .unwrap(),
    );
    let started = Instant::now();
    open_all(&store, "done", FINISHED).await;
    let indexes: Vec<usize> = (0..FINISHED).collect();
    for chunk in indexes.chunks(1_000) {
        let reqs = chunk
            .iter()
            .map(|i| terminal_request(&format!("done-{i}")))
            .collect();
        let outcomes = store.append(reqs).await.unwrap();
        assert!(
            outcomes
                .iter()
                .all(|o| matches!(o, oab_relay::store::AppendOutcome::Appended { .. }))
        );
    }
    for i in 0..3 {
        store
            .open(open_request(&format!("open-{i}")))
            .await
            .unwrap();
    }
    eprintln!(
        "{FINISHED} finished delegations stored in {:?}",
        started.elapsed()
    );

    let relay = TestRelay::start(&env, store).await;
    let client = ::redis::Client::open(redis.url()).unwrap();
    let mut con = client.get_multiplexed_async_connection().await.unwrap();
    let _: () = ::redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async(&mut con)
        .await
        .unwrap();
    let b = relay.client(&env.callee).await;
    let hgetall = command_calls(&mut con, "hgetall").await;
    let listed: Vec<oab_wire::DelegationCursor> =
        serde_json::from_slice(&b.welcome.payload).unwrap();
    eprintln!("handshake: {hgetall} HGETALL, {} listed", listed.len());
    let mut keys: Vec<String> = listed.iter().map(|c| c.key.to_string()).collect();
    keys.sort();
    assert_eq!(
        keys,
        (0..3)
            .map(|i| key(&format!("open-{i}")).to_string())
            .collect::<Vec<_>>()
    );
    // The 3 open ones, read twice (before and after ending lost work),
    // plus whatever the relay's own upkeep reads meanwhile: nowhere near
    // one per finished delegation.
    assert!(hgetall < 100, "{hgetall} HGETALL for one handshake");
    relay.stop().await;
}

/// A callee's welcome over its 4 MiB bound still lists every delegation
/// the callee accepted (they come first; what is cut follows as fresh
/// opens): a callee that kept its instance across a restart learns from
/// their `up` tails not to run them again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_welcome_over_its_bound_keeps_the_work_the_callee_accepted() {
    use oab_relay::store::{MemoryStore, Origin, Retention};

    const OPEN: usize = 40_000;
    const ACCEPTED: usize = 10;
    let env = TestEnv::new("");
    let store = Arc::new(MemoryStore::new(Retention::default()));
    open_all(&store, "open", OPEN).await;
    // The last ones opened were accepted by the callee's instance.
    let instance = oab_wire::InstanceId::random();
    let accepted: Vec<String> = (OPEN - ACCEPTED..OPEN)
        .map(|i| format!("open-{i}"))
        .collect();
    let reqs = accepted
        .iter()
        .map(|r| {
            let mut a = terminal_request(r);
            a.terminal = None;
            a.origin = Origin::Peer {
                peer: env.callee.peer.clone(),
                instance,
            };
            a.frame = oab_wire::encode(&data(r, Direction::Up, 1, None, payload(1))).unwrap();
            a
        })
        .collect();
    let outcomes = store.append(reqs).await.unwrap();
    assert!(
        outcomes
            .iter()
            .all(|o| matches!(o, oab_relay::store::AppendOutcome::Appended { .. }))
    );

    let relay = TestRelay::start(&env, store).await;
    let b = relay.client_as(&env.callee, instance).await;
    let listed: Vec<oab_wire::DelegationCursor> =
        serde_json::from_slice(&b.welcome.payload).unwrap();
    assert!(
        listed.len() < OPEN,
        "the list was cut ({} of {OPEN})",
        listed.len()
    );
    for r in &accepted {
        let k = key(r);
        let c = listed
            .iter()
            .find(|c| c.key == k)
            .unwrap_or_else(|| panic!("{r} is not listed"));
        assert_eq!(c.up, 1, "{r}");
    }
}
