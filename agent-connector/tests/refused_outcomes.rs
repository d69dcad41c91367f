//! A delegation the relay refuses always reads as refused: through the
//! facade, every `SendMessage` to a peer this host has no route to ends
//! `TASK_STATE_REJECTED` with the relay's code, never `failed` ("events are
//! gone"), including the first request of a connector that has just started
//! (its link not yet up) and on both stores.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod a2a_support;
mod common;

use std::sync::Arc;

use a2a_support::*;
use common::*;
use oab_relay::store::{EventStore, MemoryStore, Retention};
use serde_json::{Value, json};

/// Sends one blocking message to the caller peer (no route from the
/// callee's host to it) and returns the task.
async fn send_unrouted(rpc: &Rpc, id: &str) -> Value {
    let reply = rpc
        .call(
            "SendMessage",
            json!({ "message": message(id, "no route") }),
            V1,
        )
        .await;
    reply["result"]["task"].clone()
}

fn assert_rejected(task: &Value, what: &str) {
    assert_eq!(
        task["status"]["state"], "TASK_STATE_REJECTED",
        "{what}: {task}"
    );
    let said = task["status"]["message"].to_string();
    assert!(said.contains("route_denied"), "{what}: {said}");
}

async fn refusals_read_as_refusals<S: EventStore>(store: Arc<S>) {
    let env = Env::new("");
    let relay = Relay::start(&env, store).await;
    // The first request of a connector that has just started, several times.
    for round in 0..10 {
        let b = connector(&env, &env.callee, relay.addr, None);
        let facade = FacadeServer::start(b.caller().clone(), facade_options()).await;
        let rpc = Rpc::new(facade.url(CALLER));
        let task = send_unrouted(&rpc, &format!("first-{round}")).await;
        assert_rejected(&task, &format!("the first request of start {round}"));
        facade.stop().await;
        b.shutdown().await;
    }
    // And a thousand in a row on one connector.
    let b = connector(&env, &env.callee, relay.addr, None);
    let facade = FacadeServer::start(b.caller().clone(), facade_options()).await;
    let rpc = Rpc::new(facade.url(CALLER));
    for i in 0..1000 {
        let task = send_unrouted(&rpc, &format!("m-{i}")).await;
        assert_rejected(&task, &format!("request {i}"));
    }
    facade.stop().await;
    b.shutdown().await;
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_delegations_read_as_rejected_on_the_memory_store() {
    refusals_read_as_refusals(Arc::new(MemoryStore::new(Retention::default()))).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_delegations_read_as_rejected_on_redis() {
    let redis =
        oab_testkit::redis::RedisServer::start(oab_testkit::redis::Persistence::None).unwrap();
    let store = oab_relay::store::RedisStore::connect(&redis.url(), Retention::default())
        .await
        .unwrap();
    refusals_read_as_refusals(Arc::new(store)).await;
}
