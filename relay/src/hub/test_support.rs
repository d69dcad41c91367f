//! Pieces shared by the hub's unit tests: a hub on a real redis-server
//! (the fleet on, as in production with Redis) without sessions, sweeper or
//! wake loop, sessions whose queues the tests read, and the store-side steps
//! a peer's session would take. Never starts a listener or a background
//! loop: each test drives the hub itself.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use oab_wire::identity::Identity;
use oab_wire::{
    Data, DelegationKey, Digest, Direction, Frame, InstanceId, KeyId, Open, Outcome, PeerId,
    RequestId, SessionId, encode,
};
use tokio_util::sync::CancellationToken;

use super::{Hub, SessionRef};
use crate::config::Config;
use crate::metrics::Metrics;
use crate::outbox::{Inbox, outbox};
use crate::store::{
    AppendOutcome, AppendRequest, DelegationMeta, EventStore, OpenOutcome, OpenRequest, Origin,
    RedisStore, Retention,
};
use oab_testkit::redis::RedisServer;

pub(super) const CALLER: &str = "acme/caller";
pub(super) const CALLEE: &str = "acme/callee";

/// How long any single wait of these tests may take.
pub(super) const STEP: Duration = Duration::from_secs(10);

pub(super) fn peer(s: &str) -> PeerId {
    PeerId::new(s).unwrap()
}

/// A hub on a Redis store (so with the fleet on, as in production with
/// Redis), without sessions, sweeper or wake loop: the tests drive it.
pub(super) async fn redis_hub(redis: &RedisServer) -> Arc<Hub<RedisStore>> {
    let mut text = String::from(
        "[relay]\nid = \"localhost\"\nlisten = \"127.0.0.1:0\"\n\
         admin_listen = \"127.0.0.1:1\"\ntls_cert = \"unused\"\ntls_key = \"unused\"\n",
    );
    for p in [CALLER, CALLEE] {
        let id = Identity::generate(peer(p), KeyId::new("k1").unwrap());
        text.push_str(&format!(
            "[[peers]]\nid = \"{p}\"\nkeys = [{{ key_id = \"k1\", public_key = \"{}\" }}]\n",
            id.public_key()
        ));
    }
    text.push_str(&format!(
        "[[routes]]\nfrom = \"{CALLER}\"\nto = \"{CALLEE}\"\n"
    ));
    let config = Config::from_toml_with_overrides(&text, "test", &[]).unwrap();
    let store = RedisStore::connect(&redis.url(), Retention::default())
        .await
        .unwrap();
    let epoch = store.epoch().await.unwrap();
    let metrics = Metrics::new(&[peer(CALLER), peer(CALLEE)]);
    let hub = Hub::new(
        Arc::new(store),
        Arc::new(config),
        metrics,
        epoch,
        CancellationToken::new(),
    );
    assert!(hub.fleet.enabled, "a Redis store turns the fleet on");
    hub
}

pub(super) fn session(name: &str) -> (SessionRef, Inbox) {
    let (out, inbox) = outbox(
        64,
        16 << 20,
        2 << 20,
        Duration::from_secs(10),
        &CancellationToken::new(),
    );
    let me = SessionRef {
        id: SessionId::random(),
        peer: peer(name),
        instance: InstanceId::random(),
        key_id: oab_wire::KeyId::new("k1").unwrap(),
        since_ms: oab_wire::identity::now_ms(),
        hello_ms: oab_wire::identity::now_ms(),
        outbox: out,
    };
    (me, inbox)
}

/// Opens a delegation in the store (as the caller's session does before
/// [`Hub::created`]); returns its meta and its `Open` frame.
pub(super) async fn open_in_store(hub: &Hub<RedisStore>, request: &str) -> (DelegationMeta, Bytes) {
    let payload = Bytes::from_static(b"signed request");
    let open = Open {
        key: DelegationKey::new(peer(CALLER), RequestId::new(request).unwrap()),
        target: peer(CALLEE),
        deadline_ms: oab_wire::identity::now_ms() + 60_000,
        depth: 1,
        digest: Digest::of(&payload),
        ceiling: String::new(),
        trace: None,
        payload,
    };
    let frame = encode(&Frame::Open(open.clone())).unwrap();
    let created = hub
        .store
        .open(OpenRequest {
            key: open.key.clone(),
            callee: open.target.clone(),
            deadline_ms: open.deadline_ms,
            digest: open.digest,
            trace: None,
            frame: frame.clone(),
            now_ms: oab_wire::identity::now_ms(),
            wake: None,
        })
        .await
        .unwrap();
    let OpenOutcome::Created(meta) = created else {
        panic!("not created: {created:?}");
    };
    (meta, frame)
}

/// Appends the callee's terminal as its session does: looks the view
/// up, wakes the caller unless it is subscribed here, appends, applies.
pub(super) async fn callee_completes(hub: &Arc<Hub<RedisStore>>, key: &DelegationKey) -> Bytes {
    let frame = encode(&Frame::Data(Data {
        key: key.clone(),
        direction: Direction::Up,
        seq: 1,
        terminal: Some(Outcome::Completed),
        flags: 0,
        payload: Bytes::from_static(b"signed result"),
    }))
    .unwrap();
    let live = hub.view(key).await.unwrap().unwrap();
    let wake = hub.wake_for(&live.lock(), Direction::Up);
    let woke = wake.is_some();
    let appended = hub
        .store
        .append(vec![AppendRequest {
            key: key.clone(),
            dir: Direction::Up,
            seq: 1,
            terminal: Some(Outcome::Completed),
            origin: Origin::Peer {
                peer: peer(CALLEE),
                instance: InstanceId::random(),
            },
            frame: frame.clone(),
            now_ms: oab_wire::identity::now_ms(),
            wake,
        }])
        .await
        .unwrap();
    assert_eq!(appended, vec![AppendOutcome::Appended { seq: 1 }]);
    hub.appended(
        &live,
        key,
        Direction::Up,
        1,
        frame.clone(),
        Some(Outcome::Completed),
        woke,
    );
    frame
}

/// The next data frame queued for a session (bounded wait).
pub(super) async fn next_data(inbox: &mut Inbox) -> Bytes {
    tokio::time::timeout(STEP, inbox.data.recv())
        .await
        .expect("the caller's session gets the entry")
        .expect("the session's queue is open")
}
