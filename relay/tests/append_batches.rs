//! Several append batches in flight per session
//! (`limits.append_batches_in_flight`) against a store that runs a later
//! batch's appends before an earlier one's, as the Redis store can (a
//! batch's budget charge and its appends are two round trips, so a later
//! batch's second step can reach Redis first).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};

use bytes::Bytes;
use common::*;
use oab_relay::store::{
    AppendOutcome, AppendRequest, DelegationMeta, EventStore, FleetStore, MemoryStore, OpenOutcome,
    OpenRequest, ReadOutcome, Retention, StoreError,
};
use oab_wire::{DelegationKey, Direction, ErrorCode, Frame, PeerId};
use tokio::sync::Notify;

/// The up entry whose append call the store holds back.
const HELD_SEQ: u64 = 2;

/// Not yet held / holding / released.
const WAITING: u8 = 0;
const HOLDING: u8 = 1;
const RELEASED: u8 = 2;

/// A memory store whose append call carrying up entry [`HELD_SEQ`] waits
/// until the next append call has run: that later batch overtakes it.
struct OvertakingStore {
    inner: MemoryStore,
    state: AtomicU8,
    /// Notified once the held call waits.
    held: Notify,
    /// Notified once the overtaking call ran.
    release: Notify,
}

impl FleetStore for OvertakingStore {}

impl EventStore for OvertakingStore {
    async fn open(&self, req: OpenRequest) -> Result<OpenOutcome, StoreError> {
        self.inner.open(req).await
    }
    async fn append(&self, reqs: Vec<AppendRequest>) -> Result<Vec<AppendOutcome>, StoreError> {
        let carries_held = reqs
            .iter()
            .any(|r| r.dir == Direction::Up && r.seq == HELD_SEQ);
        if carries_held
            && self
                .state
                .compare_exchange(WAITING, HOLDING, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
        {
            self.held.notify_one();
            self.release.notified().await;
            return self.inner.append(reqs).await;
        }
        let outcomes = self.inner.append(reqs).await;
        if self
            .state
            .compare_exchange(HOLDING, RELEASED, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
        {
            self.release.notify_one();
        }
        outcomes
    }
    async fn read(
        &self,
        key: &DelegationKey,
        dir: Direction,
        after: u64,
        limit: usize,
    ) -> Result<ReadOutcome, StoreError> {
        self.inner.read(key, dir, after, limit).await
    }
    async fn meta(&self, key: &DelegationKey) -> Result<Option<DelegationMeta>, StoreError> {
        self.inner.meta(key).await
    }
    async fn callee_of(&self, key: &DelegationKey) -> Result<Option<PeerId>, StoreError> {
        self.inner.callee_of(key).await
    }
    async fn delegations_of(&self, peer: &PeerId) -> Result<Vec<DelegationMeta>, StoreError> {
        self.inner.delegations_of(peer).await
    }
    async fn due(&self, now_ms: u64, limit: usize) -> Result<Vec<DelegationKey>, StoreError> {
        self.inner.due(now_ms, limit).await
    }
    async fn expire_finished(&self, now_ms: u64) -> Result<u64, StoreError> {
        self.inner.expire_finished(now_ms).await
    }
    async fn put_descriptor(&self, peer: &PeerId, descriptor: Bytes) -> Result<(), StoreError> {
        self.inner.put_descriptor(peer, descriptor).await
    }
    async fn descriptor(&self, peer: &PeerId) -> Result<Option<Bytes>, StoreError> {
        self.inner.descriptor(peer).await
    }
    async fn epoch(&self) -> Result<u64, StoreError> {
        self.inner.epoch().await
    }
    async fn ping(&self) -> Result<(), StoreError> {
        self.inner.ping().await
    }
}

/// Up entry 2 goes to the store in one batch and entry 3 in the next,
/// which the store runs first: 3 finds the log at 1 (a hole) and 2 is
/// stored after it. The relay acknowledges 2 and refuses 3 as a sequence
/// gap at 2, never at 1: a refusal below an ack the callee already has
/// would tell it the store lost acknowledged entries (it would stop
/// sending, and the delegation would run into its deadline). The callee
/// resends after the refusal's sequence, and the caller, subscribed on the
/// same relay, gets 1, 2, 3 in order, exactly once, with no gap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_that_overtook_an_earlier_one_in_the_store_is_refused_at_the_acked_tail() {
    let store = Arc::new(OvertakingStore {
        inner: MemoryStore::new(Retention::default()),
        state: AtomicU8::new(WAITING),
        held: Notify::new(),
        release: Notify::new(),
    });
    let env = TestEnv::new("[limits]\nappend_batches_in_flight = 2\n");
    let relay = TestRelay::start(&env, store.clone()).await;
    let mut b = relay.client(&env.callee).await;
    let mut a = relay.client(&env.caller).await;
    let request = "overtaken";
    let k = key(request);
    open_and_stream_up(&mut a, &mut b, request, 1, 1).await;

    // Entry 2: its batch's store call waits.
    b.send(&data(request, Direction::Up, 2, None, payload(2)))
        .await
        .unwrap();
    store.held.notified().await;
    // Entry 3: read as the next batch, in flight beside the first, and run
    // by the store before it.
    b.send(&data(request, Direction::Up, 3, None, payload(3)))
        .await
        .unwrap();

    // Answered in order: the ack of 2, then the refusal of 3.
    let mut acked = 1;
    let resend_after = loop {
        match recv(&mut b).await {
            Frame::Ack(ack) if ack.key == k && ack.direction == Direction::Up => {
                acked = acked.max(ack.seq);
            }
            Frame::Error(e) if e.code == ErrorCode::SequenceGap.as_u16() => {
                assert_eq!(e.key.as_ref(), Some(&k));
                assert!(
                    e.seq >= acked,
                    "a sequence gap at {} after an ack of {acked} says the store lost acknowledged entries",
                    e.seq
                );
                break e.seq;
            }
            Frame::Error(e) => panic!("unexpected {e:?}"),
            _ => {}
        }
    };
    assert_eq!(acked, 2, "entry 2 was stored and acknowledged");
    assert_eq!(resend_after, 2, "the relay holds 2: resend from 3");

    // The callee resends after the refusal's sequence.
    let done = send_until_acked(&mut b, request, resend_after, 3, false).await;
    assert_eq!(done, 3);

    // The caller gets every entry once, in order, and no gap.
    let mut last = 0;
    while last < 3 {
        match recv(&mut a).await {
            Frame::Data(d) if d.key == k => {
                assert_eq!(d.seq, last + 1, "no loss, duplicate or reordering");
                assert_eq!(d.payload, payload(d.seq));
                assert_eq!(d.terminal, None);
                last = d.seq;
            }
            Frame::Gap(g) => panic!("the caller was told of a gap: {g:?}"),
            _ => {}
        }
    }
    relay.stop().await;
}
