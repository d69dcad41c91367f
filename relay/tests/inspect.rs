//! `oab-relay inspect` and `/delegation` on the admin port: a running, a
//! finished, a stuck (callee offline) and an unknown delegation, looked up by
//! key, by the A2A facade's task id and by a CP delegation id, on a fleet of
//! two `oab-relay` processes over a real `redis-server` with the caller on
//! one instance and the callee on the other; and `/status`'s latest
//! refusals and `/delegations`' oldest open ones.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use common::*;
use oab_relay::inspect::{Inspection, OldestOpen};
use oab_relay::status::RelayStatus;
use oab_testkit::redis::{Persistence, RedisServer};
use oab_wire::{Direction, Frame, InstanceId};

/// `GET path` on an admin port: the status code and the JSON body.
async fn get_json(admin: SocketAddr, path: &str) -> (u16, serde_json::Value) {
    let answer = http_get(admin, path).await;
    let status: u16 = answer
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status in {answer}"));
    let body = answer.split_once("\r\n\r\n").map(|(_, b)| b).unwrap_or("");
    let json = serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {answer}"));
    (status, json)
}

async fn inspect(admin: SocketAddr, id: &str) -> (u16, serde_json::Value) {
    let q = oab_ops::admin_client::query_value(id);
    get_json(admin, &format!("/delegation?id={q}")).await
}

async fn inspection(admin: SocketAddr, id: &str) -> Inspection {
    let (status, body) = inspect(admin, id).await;
    assert_eq!(status, 200, "{body}");
    serde_json::from_value(body).unwrap()
}

/// Polls the inspection until `f` holds (a bounded number of times).
async fn inspection_until(
    admin: SocketAddr,
    id: &str,
    what: &str,
    f: impl Fn(&Inspection) -> bool,
) -> Inspection {
    let mut last = None;
    for _ in 0..400 {
        let i = inspection(admin, id).await;
        if f(&i) {
            return i;
        }
        last = Some(i);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("{what}: not seen within 20 s; last: {last:#?}");
}

/// `oab-relay inspect <args>`: exit status, stdout, stderr.
fn cli(args: &[&str]) -> (Option<i32>, String, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_oab-relay"))
        .arg("inspect")
        .args(args)
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test]
async fn inspect_shows_where_a_delegation_is_across_a_fleet() {
    let redis = RedisServer::start(Persistence::None).unwrap();
    let env = TestEnv::new("");
    let sets = |node: &'static str| {
        [
            node,
            "fleet.node_lease_ms=1500",
            "fleet.sweeper_lease_ms=1000",
        ]
    };
    let one = RelayProcess::start_with(&env, &redis.url(), &sets("fleet.node=relay-1")).await;
    let two = RelayProcess::start_with(&env, &redis.url(), &sets("fleet.node=relay-2")).await;
    let mut b = two.client_as(&env.callee, InstanceId::random()).await;
    let mut a = one.client_as(&env.caller, InstanceId::random()).await;
    let admin_one = format!("http://{}", one.admin);

    // Running: opened on relay-1, accepted and streaming on relay-2, one
    // follow-up from the caller.
    open_and_stream_up(&mut a, &mut b, "run-1", 3, 3).await;
    a.send(&data("run-1", Direction::Down, 2, None, payload(2)))
        .await
        .unwrap();
    await_ack(&mut a, "run-1", Direction::Down, 2).await;
    let k = key("run-1");
    // relay-1 sees relay-2's session once its liveness renewal has seen
    // relay-2 join.
    let i = inspection_until(
        one.admin,
        &k.to_string(),
        "three events delivered and the callee seen on relay-2",
        |i| i.up.delivered_here == Some(3) && i.callee.online,
    )
    .await;
    assert_eq!(i.key, k.to_string());
    assert_eq!(i.state, "open");
    assert_eq!(i.outcome, None);
    assert_eq!(i.answered_by, "relay-1");
    assert_eq!(
        (i.caller.peer.as_str(), i.caller.served_by.as_deref()),
        (CALLER, Some("relay-1"))
    );
    assert_eq!(
        (i.callee.peer.as_str(), i.callee.served_by.as_deref()),
        (CALLEE, Some("relay-2"))
    );
    assert_eq!(
        i.callee.session.as_deref(),
        Some(b.welcome.session.to_string().as_str())
    );
    assert!(i.accepted);
    assert_eq!((i.down.stored, i.down.acknowledged), (2, 2));
    // The callee's session is on relay-2: relay-1 delivers nothing down.
    assert_eq!(i.down.delivered_here, None);
    assert_eq!((i.up.stored, i.up.acknowledged), (3, 3));
    assert_eq!(i.follow_ups, [2]);
    assert!(i.cancels.is_empty() && i.down_log_read);
    assert!(
        i.store_keys
            .contains(&format!("oab:d:{{{CALLER}#run-1}}:meta")),
        "{:?}",
        i.store_keys
    );
    assert!(
        i.waiting_for[0].contains(&format!("the callee {CALLEE} (online on relay-2)"))
            && i.waiting_for[0].contains("agent is running it"),
        "{:?}",
        i.waiting_for
    );
    assert!(i.created_ms <= i.now_ms && i.deadline_ms > i.now_ms);

    // The same delegation by the A2A facade's task id, on the callee's
    // instance: there the down log's deliveries are known.
    recv_until(&mut b, |f| {
        matches!(f, Frame::Data(d) if d.seq == 2).then_some(())
    })
    .await;
    let i2 = inspection_until(
        two.admin,
        &k.a2a_task_id(),
        "the follow-up delivered",
        |i| i.down.delivered_here == Some(2),
    )
    .await;
    assert_eq!(i2.key, k.to_string());
    assert_eq!(i2.answered_by, "relay-2");
    assert_eq!(i2.up.delivered_here, None);

    // The command prints it.
    let (code, out, err) = cli(&["--admin", &admin_one, &k.to_string()]);
    assert_eq!(code, Some(0), "{out}{err}");
    assert!(out.contains(&format!("delegation {k}")), "{out}");
    assert!(out.contains("state        open"), "{out}");
    assert!(
        out.contains(&format!("callee       {CALLEE} online on relay-2")),
        "{out}"
    );
    assert!(out.contains("follow-ups   2 (down entries)"), "{out}");
    assert!(out.contains("agent is running it"), "{out}");

    // Finished: the callee's terminal, read by the caller.
    send_until_acked(&mut b, "run-1", 3, 4, true).await;
    read_to_terminal(&mut a, "run-1", 3, 4).await;
    let i = inspection_until(one.admin, &k.to_string(), "finished", |i| {
        i.state == "finished"
    })
    .await;
    assert_eq!(i.outcome.as_deref(), Some("completed"));
    assert!(i.terminal_ms.is_some_and(|t| t >= i.created_ms));
    assert_eq!(i.up.stored, 4);
    assert!(i.waiting_for.is_empty(), "{:?}", i.waiting_for);
    let (code, out, _) = cli(&["--admin", &admin_one, &k.a2a_task_id()]);
    assert_eq!(code, Some(0));
    assert!(
        out.contains("finished: completed") && out.contains("waiting for  nothing"),
        "{out}"
    );

    // A CP delegation id: the connector's CP endpoint names the request
    // `cp-<id>-<16 random hex>`.
    let cp_request = oab_wire::RequestId::for_cp_delegation("deleg-7").to_string();
    a.send(&open_frame(&cp_request, b"{}")).await.unwrap();
    await_ack(&mut a, &cp_request, Direction::Down, 1).await;
    let i = inspection(one.admin, "deleg-7").await;
    assert_eq!(i.key, key(&cp_request).to_string());

    // Stuck: the callee goes away; a new delegation waits for it.
    drop(b);
    a.send(&open_frame("stuck-1", b"{}")).await.unwrap();
    await_ack(&mut a, "stuck-1", Direction::Down, 1).await;
    let stuck = key("stuck-1").to_string();
    let i = inspection_until(one.admin, &stuck, "the callee offline", |i| {
        !i.callee.online
    })
    .await;
    assert_eq!(i.state, "open");
    assert!(!i.accepted);
    assert_eq!(i.callee.served_by, None);
    assert_eq!(
        i.waiting_for[0],
        format!("the callee {CALLEE} (offline) to come online: the open waits in the store")
    );
    let (code, out, _) = cli(&["--admin", &admin_one, &stuck]);
    assert_eq!(code, Some(0));
    assert!(
        out.contains(&format!("callee       {CALLEE} offline")),
        "{out}"
    );
    assert!(out.contains("accepted     not yet"), "{out}");

    // The oldest open delegations: the CP one, then the stuck one (run-1
    // finished).
    let (status, body) = get_json(one.admin, "/delegations?limit=10").await;
    assert_eq!(status, 200, "{body}");
    let oldest: OldestOpen = serde_json::from_value(body).unwrap();
    let keys: Vec<&str> = oldest.delegations.iter().map(|d| d.key.as_str()).collect();
    assert_eq!(keys, [key(&cp_request).to_string(), stuck.clone()]);
    assert_eq!(oldest.open, 2);
    assert!(!oldest.delegations[1].accepted);

    // Unknown: 404, and the command exits 1 saying so.
    let missing = key("never-opened").to_string();
    let (status, body) = inspect(one.admin, &missing).await;
    assert_eq!(status, 404, "{body}");
    assert!(
        body["error"].as_str().unwrap().contains("no delegation"),
        "{body}"
    );
    let (code, out, err) = cli(&["--admin", &admin_one, &missing]);
    assert_eq!(code, Some(1), "{out}{err}");
    assert!(
        err.contains(&format!("no delegation {missing} in the store")),
        "{err}"
    );
    let (status, _) = inspect(one.admin, "task-00000000000000000000000000000000").await;
    assert_eq!(status, 404);
    // Not an id at all: 400 naming the forms.
    let (status, body) = inspect(one.admin, &format!("{CALLER}#a#b")).await;
    assert_eq!(status, 400, "{body}");
    assert!(
        body["error"].as_str().unwrap().contains("A2A task id"),
        "{body}"
    );
    drop(a);
}

#[tokio::test]
async fn status_lists_the_latest_refusals_newest_first() {
    let redis = RedisServer::start(Persistence::None).unwrap();
    let env = TestEnv::new("");
    let relay = RelayProcess::start(&env, &redis.url()).await;
    let mut a = relay.client_as(&env.caller, InstanceId::random()).await;
    // A follow-up for a delegation that does not exist, then one for
    // another that does not either.
    for request in ["ghost-1", "ghost-2"] {
        a.send(&data(
            request,
            Direction::Down,
            2,
            None,
            Bytes::from_static(b"x"),
        ))
        .await
        .unwrap();
        recv_until(&mut a, |f| matches!(f, Frame::Error(_)).then_some(())).await;
    }
    let (status, body) = get_json(relay.admin, "/status").await;
    assert_eq!(status, 200);
    let s: RelayStatus = serde_json::from_value(body).unwrap();
    let latest: Vec<(&str, &str, Option<&str>)> = s
        .recent_refusals
        .iter()
        .map(|r| (r.peer.as_str(), r.code.as_str(), r.key.as_deref()))
        .collect();
    let (g1, g2) = (key("ghost-1").to_string(), key("ghost-2").to_string());
    assert_eq!(
        latest,
        [
            (CALLER, "unknown_delegation", Some(g2.as_str())),
            (CALLER, "unknown_delegation", Some(g1.as_str())),
        ]
    );
    assert_eq!(s.recent_refusals[0].seq, 2);
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_oab-relay"))
        .args(["status", "--admin", &relay.admin.to_string()])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("latest refusals (newest first"), "{text}");
    let row = text.lines().find(|l| l.contains(&g2)).unwrap_or_default();
    assert!(
        row.contains("unknown_delegation") && row.contains(CALLER),
        "{text}"
    );
    drop(a);
}
