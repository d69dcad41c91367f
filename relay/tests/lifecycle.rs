//! Delegation lifecycle through a real relay: deadlines, lost callees,
//! cancel racing completion.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use std::sync::Arc;

use bytes::Bytes;
use common::*;
use oab_relay::store::EventStore;
use oab_wire::frame::FLAG_RELAY_ORIGIN;
use oab_wire::{Cancel, Direction, ErrorCode, Frame, InstanceId, Open, Outcome, Resume};

both_stores! {
    deadline_expires_at_the_caller_and_cancels_at_the_callee => deadline;
    callee_back_as_new_instance_ends_accepted_work_unknown => new_instance;
    callee_gone_past_grace_ends_accepted_work_unknown => grace;
    cancel_racing_completion_1000_times_agrees_on_one_terminal => cancel_race;
}

const FAST: &str = "[lifecycle]\nsweep_interval_ms = 20\nunknown_grace_ms = 300000\n";

async fn deadline<S: EventStore>(store: Arc<S>) {
    let env = TestEnv::new(FAST);
    let relay = TestRelay::start(&env, store).await;
    let mut b = relay.client(&env.callee).await;
    let mut a = relay.client(&env.caller).await;
    let mut open = open_frame("d1", b"{}");
    if let Frame::Open(o) = &mut open {
        o.deadline_ms = oab_wire::identity::now_ms() + 300;
    }
    a.send(&open).await.unwrap();
    await_ack(&mut a, "d1", Direction::Down, 1).await;
    recv_until(&mut b, |f| matches!(f, Frame::Open(_)).then_some(())).await;
    // The callee accepts and then never finishes.
    b.send(&data(
        "d1",
        Direction::Up,
        1,
        None,
        Bytes::from_static(b"working"),
    ))
    .await
    .unwrap();
    let expired = recv_until(&mut a, |f| match f {
        Frame::Data(d) if d.terminal.is_some() => Some(d.clone()),
        _ => None,
    })
    .await;
    assert_eq!(expired.terminal, Some(Outcome::Expired));
    assert_eq!(expired.seq, 2);
    // The same outcome and reason on every store (and the reason a callee
    // stopped by its deadline signs: `oab_wire::EXPIRED_REASON`).
    let entry: serde_json::Value = serde_json::from_slice(&expired.payload).unwrap();
    assert_eq!(entry["origin"], "relay");
    assert_eq!(entry["outcome"], "expired");
    assert_eq!(entry["reason"], oab_wire::EXPIRED_REASON);
    assert_ne!(
        expired.flags & FLAG_RELAY_ORIGIN,
        0,
        "marked relay-originated"
    );
    let cancel = recv_until(&mut b, |f| match f {
        Frame::Cancel(c) => Some(c.clone()),
        _ => None,
    })
    .await;
    assert_eq!(cancel.seq, 2);
    assert_ne!(cancel.flags & FLAG_RELAY_ORIGIN, 0);
    // The callee's late result is refused: the first terminal won.
    b.send(&data(
        "d1",
        Direction::Up,
        2,
        Some(Outcome::Completed),
        Bytes::new(),
    ))
    .await
    .unwrap();
    let code = recv_until(&mut b, |f| match f {
        Frame::Error(e) => Some(e.code),
        _ => None,
    })
    .await;
    assert_eq!(code, ErrorCode::AlreadyTerminal.as_u16());
    relay.stop().await;
}

async fn accept_then<S: EventStore>(
    relay: &TestRelay,
    env: &TestEnv,
    request: &str,
    instance: InstanceId,
) -> (
    oab_testkit::raw_client::RawClient,
    oab_testkit::raw_client::RawClient,
) {
    let _ = std::marker::PhantomData::<S>;
    let mut b = relay.client_as(&env.callee, instance).await;
    let mut a = relay.client(&env.caller).await;
    a.send(&open_frame(request, b"{}")).await.unwrap();
    await_ack(&mut a, request, Direction::Down, 1).await;
    recv_until(&mut b, |f| matches!(f, Frame::Open(_)).then_some(())).await;
    b.send(&data(
        request,
        Direction::Up,
        1,
        None,
        Bytes::from_static(b"accepted"),
    ))
    .await
    .unwrap();
    await_ack(&mut b, request, Direction::Up, 1).await;
    (a, b)
}

async fn new_instance<S: EventStore>(store: Arc<S>) {
    let env = TestEnv::new(FAST);
    let relay = TestRelay::start(&env, store).await;
    let (mut a, b) = accept_then::<S>(&relay, &env, "u1", InstanceId::random()).await;
    drop(b);
    // The callee's process restarted: a new instance id.
    let b2 = relay.client_as(&env.callee, InstanceId::random()).await;
    let listed: Vec<oab_wire::DelegationCursor> =
        serde_json::from_slice(&b2.welcome.payload).unwrap();
    assert!(
        !listed.iter().any(|c| c.key == key("u1")),
        "never offered as open work"
    );
    let t = recv_until(&mut a, |f| match f {
        Frame::Data(d) if d.terminal.is_some() => Some(d.clone()),
        _ => None,
    })
    .await;
    assert_eq!(t.terminal, Some(Outcome::Unknown));
    assert_ne!(t.flags & FLAG_RELAY_ORIGIN, 0);
    // The same instance reconnecting (a network cut) keeps its work.
    let instance = InstanceId::random();
    let (mut a, b) = accept_then::<S>(&relay, &env, "u2", instance).await;
    drop(b);
    let mut b = relay.client_as(&env.callee, instance).await;
    b.send(&data(
        "u2",
        Direction::Up,
        2,
        Some(Outcome::Completed),
        Bytes::new(),
    ))
    .await
    .unwrap();
    let t = recv_until(&mut a, |f| match f {
        Frame::Data(d) if d.terminal.is_some() => Some(d.terminal),
        _ => None,
    })
    .await;
    assert_eq!(t, Some(Outcome::Completed));
    relay.stop().await;
}

async fn grace<S: EventStore>(store: Arc<S>) {
    let env = TestEnv::new("[lifecycle]\nsweep_interval_ms = 20\nunknown_grace_ms = 200\n");
    let relay = TestRelay::start(&env, store).await;
    let (mut a, b) = accept_then::<S>(&relay, &env, "g1", InstanceId::random()).await;
    drop(b);
    let t = recv_until(&mut a, |f| match f {
        Frame::Data(d) if d.terminal.is_some() => Some(d.terminal),
        _ => None,
    })
    .await;
    assert_eq!(t, Some(Outcome::Unknown));
    relay.stop().await;
}

/// A tiny deterministic generator for random timing (no extra crates).
struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }
}

async fn cancel_race<S: EventStore>(store: Arc<S>) {
    const N: u64 = 1000;
    // These raw clients never reconnect, so give their queues room for every
    // open and cancel at once (slow consumers are tested elsewhere).
    let mut env = TestEnv::new(FAST);
    env.config.limits.session_queue = 8192;
    let relay = TestRelay::start(&env, store).await;
    let mut a = relay.client(&env.caller).await;
    let mut b = relay.client(&env.callee).await;
    let seed = oab_wire::identity::now_ms();
    println!("cancel race seed {seed}");
    let mut rng = Lcg(seed);
    // Callee: answers each open with `completed` after a random number of
    // other frames, or with `cancelled` if the cancel arrives first.
    let callee = tokio::spawn(async move {
        let mut finished = std::collections::HashMap::<String, Outcome>::new();
        let mut pending: Vec<(String, u64)> = Vec::new();
        let mut decided = std::collections::HashMap::<String, Outcome>::new();
        let mut rng = Lcg(seed ^ 0xabcdef);
        while decided.len() < N as usize {
            // A quiet millisecond is a scheduling tick for the random delays.
            let f = match tokio::time::timeout(std::time::Duration::from_millis(1), recv(&mut b))
                .await
            {
                Ok(f) => f,
                Err(_) => Frame::Pong(oab_wire::Ping { token: 0 }),
            };
            match f {
                Frame::Open(o) => {
                    let id = o.key.request_id.to_string();
                    pending.push((id, rng.next() % 1500));
                }
                Frame::Cancel(c) => {
                    let id = c.key.request_id.to_string();
                    if !finished.contains_key(&id) {
                        finished.insert(id.clone(), Outcome::Cancelled);
                        pending.retain(|(p, _)| p != &id);
                        b.send(&data(
                            &id,
                            Direction::Up,
                            1,
                            Some(Outcome::Cancelled),
                            Bytes::new(),
                        ))
                        .await
                        .unwrap();
                    }
                }
                Frame::Ack(ack) if ack.direction == Direction::Up => {
                    let id = ack.key.request_id.to_string();
                    if let Some(o) = finished.get(&id) {
                        decided.insert(id, *o);
                    }
                }
                Frame::Error(e) if e.code == ErrorCode::AlreadyTerminal.as_u16() => {
                    // Our terminal lost; the winner is named in the message.
                    let id = e.key.as_ref().unwrap().request_id.to_string();
                    let winner = Outcome::ALL
                        .iter()
                        .copied()
                        .find(|o| e.message.ends_with(o.name()))
                        .unwrap();
                    decided.insert(id, winner);
                }
                Frame::Error(e) => panic!("callee got {e:?}"),
                _ => {}
            }
            // Complete the pending delegations whose random delay ran out.
            let mut still = Vec::new();
            for (id, left) in pending.drain(..) {
                if left == 0 {
                    finished.insert(id.clone(), Outcome::Completed);
                    b.send(&data(
                        &id,
                        Direction::Up,
                        1,
                        Some(Outcome::Completed),
                        Bytes::new(),
                    ))
                    .await
                    .unwrap();
                } else {
                    still.push((id, left - 1));
                }
            }
            pending = still;
        }
        decided
    });
    // Caller: opens all, cancels each after a random number of frames.
    let mut seen = std::collections::HashMap::<String, Outcome>::new();
    let mut to_cancel: Vec<(String, u64)> = Vec::new();
    for i in 0..N {
        let id = format!("race-{i}");
        let body = Bytes::from(format!("{{\"i\":{i}}}"));
        a.send(&Frame::Open(Open {
            key: key(&id),
            target: peer(CALLEE),
            deadline_ms: oab_wire::identity::now_ms() + 120_000,
            depth: 1,
            digest: oab_wire::Digest::of(&body),
            ceiling: String::new(),
            trace: None,
            payload: body,
        }))
        .await
        .unwrap();
        to_cancel.push((id, rng.next() % 400));
    }
    while seen.len() < N as usize {
        let f = match tokio::time::timeout(std::time::Duration::from_millis(1), recv(&mut a)).await
        {
            Ok(f) => f,
            Err(_) => Frame::Pong(oab_wire::Ping { token: 0 }),
        };
        if let Frame::Data(d) = &f
            && let Some(t) = d.terminal
        {
            let id = d.key.request_id.to_string();
            assert!(
                seen.insert(id, t).is_none(),
                "two terminals for one delegation"
            );
        }
        let mut still = Vec::new();
        for (id, left) in to_cancel.drain(..) {
            if left == 0 {
                a.send(&Frame::Cancel(Cancel {
                    key: key(&id),
                    seq: 2,
                    flags: 0,
                    payload: Bytes::new(),
                }))
                .await
                .unwrap();
            } else {
                still.push((id, left - 1));
            }
        }
        to_cancel = still;
    }
    let decided = callee.await.unwrap();
    assert_eq!(decided.len(), N as usize);
    let mut split = std::collections::HashMap::<Outcome, usize>::new();
    for (id, outcome) in &seen {
        assert_eq!(decided.get(id), Some(outcome), "both sides agree on {id}");
        *split.entry(*outcome).or_default() += 1;
    }
    println!("cancel race outcomes: {split:?}");
    // A resume of a finished log replays the same single terminal.
    a.send(&Frame::Resume(Resume {
        key: key("race-0"),
        direction: Direction::Up,
        after: 0,
    }))
    .await
    .unwrap();
    let replayed = recv_until(&mut a, |f| match f {
        Frame::Data(d) if d.key == key("race-0") => Some(d.terminal),
        _ => None,
    })
    .await;
    assert_eq!(replayed, seen.get("race-0").copied());
    relay.stop().await;
}

/// A store that stores an open and then reports a failure, once: as when
/// Redis runs the open script and the connection drops before its reply.
struct OpenCommitsThenFails {
    inner: oab_relay::store::MemoryStore,
    fail_next_open: std::sync::atomic::AtomicBool,
}

impl oab_relay::store::FleetStore for OpenCommitsThenFails {}

impl EventStore for OpenCommitsThenFails {
    async fn open(
        &self,
        req: oab_relay::store::OpenRequest,
    ) -> Result<oab_relay::store::OpenOutcome, oab_relay::store::StoreError> {
        let outcome = self.inner.open(req).await?;
        if self
            .fail_next_open
            .swap(false, std::sync::atomic::Ordering::SeqCst)
        {
            return Err(oab_relay::store::StoreError::unavailable(
                "open",
                "connection lost after the open was stored",
            ));
        }
        Ok(outcome)
    }
    async fn append(
        &self,
        reqs: Vec<oab_relay::store::AppendRequest>,
    ) -> Result<Vec<oab_relay::store::AppendOutcome>, oab_relay::store::StoreError> {
        self.inner.append(reqs).await
    }
    async fn read(
        &self,
        key: &oab_wire::DelegationKey,
        dir: Direction,
        after: u64,
        limit: usize,
    ) -> Result<oab_relay::store::ReadOutcome, oab_relay::store::StoreError> {
        self.inner.read(key, dir, after, limit).await
    }
    async fn meta(
        &self,
        key: &oab_wire::DelegationKey,
    ) -> Result<Option<oab_relay::store::DelegationMeta>, oab_relay::store::StoreError> {
        self.inner.meta(key).await
    }
    async fn callee_of(
        &self,
        key: &oab_wire::DelegationKey,
    ) -> Result<Option<oab_wire::PeerId>, oab_relay::store::StoreError> {
        self.inner.callee_of(key).await
    }
    async fn delegations_of(
        &self,
        peer: &oab_wire::PeerId,
    ) -> Result<Vec<oab_relay::store::DelegationMeta>, oab_relay::store::StoreError> {
        self.inner.delegations_of(peer).await
    }
    async fn due(
        &self,
        now_ms: u64,
        limit: usize,
    ) -> Result<Vec<oab_wire::DelegationKey>, oab_relay::store::StoreError> {
        self.inner.due(now_ms, limit).await
    }
    async fn expire_finished(&self, now_ms: u64) -> Result<u64, oab_relay::store::StoreError> {
        self.inner.expire_finished(now_ms).await
    }
    async fn put_descriptor(
        &self,
        peer: &oab_wire::PeerId,
        descriptor: Bytes,
    ) -> Result<(), oab_relay::store::StoreError> {
        self.inner.put_descriptor(peer, descriptor).await
    }
    async fn descriptor(
        &self,
        peer: &oab_wire::PeerId,
    ) -> Result<Option<Bytes>, oab_relay::store::StoreError> {
        self.inner.descriptor(peer).await
    }
    async fn epoch(&self) -> Result<u64, oab_relay::store::StoreError> {
        self.inner.epoch().await
    }
    async fn ping(&self) -> Result<(), oab_relay::store::StoreError> {
        self.inner.ping().await
    }
}

/// The store stored an open but its answer was lost: the relay refuses it
/// as `store_unavailable`, the caller resends it, and the resend (found in
/// the store) is delivered to the callee and subscribes the caller, exactly
/// as a first open would be, instead of being only acknowledged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_resent_after_a_store_error_that_did_commit_is_delivered() {
    let store = Arc::new(OpenCommitsThenFails {
        inner: oab_relay::store::MemoryStore::new(oab_relay::store::Retention::default()),
        fail_next_open: std::sync::atomic::AtomicBool::new(true),
    });
    let env = TestEnv::new("");
    let relay = TestRelay::start(&env, store).await;
    let mut b = relay.client(&env.callee).await;
    let mut a = relay.client(&env.caller).await;
    let open = open_frame("o1", b"{}");
    a.send(&open).await.unwrap();
    let refused = recv_until(&mut a, |f| match f {
        Frame::Error(e) => Some(e.code),
        _ => None,
    })
    .await;
    assert_eq!(refused, ErrorCode::StoreUnavailable.as_u16());
    a.send(&open).await.unwrap();
    await_ack(&mut a, "o1", Direction::Down, 1).await;
    // The callee gets the open live, and the caller its up log.
    recv_until(&mut b, |f| {
        matches!(f, Frame::Open(o) if o.key == key("o1")).then_some(())
    })
    .await;
    b.send(&data("o1", Direction::Up, 1, None, payload(1)))
        .await
        .unwrap();
    let got = recv_until(&mut a, |f| match f {
        Frame::Data(d) if d.key == key("o1") => Some(d.seq),
        _ => None,
    })
    .await;
    assert_eq!(got, 1);
    relay.stop().await;
}
