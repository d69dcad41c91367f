//! The relay binary logs one INFO line per session end, with the peer, the
//! session id, why it ended and how long it lasted (the README: sessions
//! are logged authenticated, replaced, closed).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::{CALLEE, CALLER, LoggedRelay, TestEnv};
use oab_testkit::raw_client::RawClient;
use oab_wire::InstanceId;

/// The `session=<id>` of the relay's `session authenticated` line for
/// `peer` that is not in `seen`.
async fn new_session(relay: &LoggedRelay, peer: &str, seen: &[String]) -> String {
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let log = relay.log();
        let found = log
            .lines()
            .filter(|l| l.contains("session authenticated") && l.contains(&format!("peer={peer} ")))
            .filter_map(|l| l.split("session=").nth(1))
            .filter_map(|rest| rest.split_whitespace().next())
            .map(str::to_string)
            .find(|s| !seen.contains(s));
        if let Some(s) = found {
            return s;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no new session of {peer}:\n{log}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_session_end_is_logged_at_info_with_its_reason_and_duration() {
    let env = TestEnv::new("");
    let mut relay = LoggedRelay::start(
        &env,
        "memory",
        &["relay.heartbeat_ms=200", "relay.idle_timeout_ms=1500"],
        "info",
    )
    .await;
    let target = relay.target(&env);
    let mut seen = Vec::new();

    // Closed by the peer.
    let a = RawClient::connect(&target, &env.caller, InstanceId::random())
        .await
        .unwrap();
    let s = new_session(&relay, CALLER, &seen).await;
    seen.push(s.clone());
    a.close().await;
    let line = relay
        .await_line(&[
            "INFO",
            "session ended",
            &format!("peer={CALLER}"),
            &format!("session={s}"),
            "reason=closed by peer",
            "duration=",
        ])
        .await;
    assert!(!line.contains("code="), "{line}");

    // Replaced by a newer session of the same peer.
    let _b1 = RawClient::connect(&target, &env.callee, InstanceId::random())
        .await
        .unwrap();
    let s1 = new_session(&relay, CALLEE, &seen).await;
    seen.push(s1.clone());
    let _b2 = RawClient::connect(&target, &env.callee, InstanceId::random())
        .await
        .unwrap();
    let s2 = new_session(&relay, CALLEE, &seen).await;
    seen.push(s2.clone());
    relay
        .await_line(&[
            "INFO",
            "session ended",
            &format!("session={s1}"),
            "reason=replaced: ",
            "code=4505",
            "duration=",
        ])
        .await;

    // Idle timeout: the raw client sends nothing (no pings, no frames).
    relay
        .await_line(&[
            "INFO",
            "session ended",
            &format!("session={s2}"),
            "reason=idle_timeout: no frame within the idle timeout",
            "code=4006",
        ])
        .await;

    // Shutdown: a session open at SIGTERM.
    let _c = RawClient::connect(&target, &env.caller, InstanceId::random())
        .await
        .unwrap();
    let s3 = new_session(&relay, CALLER, &seen).await;
    relay.terminate().await;
    relay
        .await_line(&[
            "INFO",
            "session ended",
            &format!("peer={CALLER}"),
            &format!("session={s3}"),
            "reason=shutdown: relay shutting down",
            "code=4000",
        ])
        .await;
    // Exactly one line per session.
    let log = relay.log();
    for s in [&s, &s1, &s2, &s3] {
        let n = log
            .lines()
            .filter(|l| l.contains("session ended") && l.contains(&format!("session={s}")))
            .count();
        assert_eq!(n, 1, "session {s}:\n{log}");
    }
}

/// A session closed because its peer stopped reading is logged with the
/// slow-consumer reason and close code: the caller opens a delegation and
/// then reads nothing while the callee streams 64 KiB events up to it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_consumer_session_end_is_logged_with_its_reason() {
    use bytes::Bytes;
    use oab_wire::{Direction, Frame};

    let env = TestEnv::new("");
    let relay = LoggedRelay::start(&env, "memory", &["limits.slow_consumer_ms=300"], "info").await;
    let target = relay.target(&env);
    let mut seen = Vec::new();
    let mut b = RawClient::connect(&target, &env.callee, InstanceId::random())
        .await
        .unwrap();
    seen.push(new_session(&relay, CALLEE, &seen).await);
    let mut a = RawClient::connect(&target, &env.caller, InstanceId::random())
        .await
        .unwrap();
    let s = new_session(&relay, CALLER, &seen).await;
    a.send(&common::open_frame("stuck", b"{}")).await.unwrap();
    common::await_ack(&mut a, "stuck", Direction::Down, 1).await;
    common::recv_until(&mut b, |f| matches!(f, Frame::Open(_)).then_some(())).await;
    // From here on `a` reads nothing. Rounds of 16 events of 64 KiB until
    // the relay says it closed `a`, or 64 MiB (past the relay's write buffer
    // and both kernel socket buffers); the line may follow the close's own
    // deadline.
    let ended = [
        "INFO",
        "session ended",
        &format!("peer={CALLER}"),
        &format!("session={s}"),
        "reason=slow_consumer: the connection took nothing for slow_consumer_ms",
        "code=4001",
        "duration=",
    ];
    let payload = Bytes::from(vec![b'x'; 64 * 1024]);
    let mut seq = 0u64;
    while seq < 1024
        && !relay
            .log()
            .lines()
            .any(|l| ended.iter().all(|p| l.contains(p)))
    {
        for _ in 0..16 {
            seq += 1;
            b.feed(&common::data(
                "stuck",
                Direction::Up,
                seq,
                None,
                payload.clone(),
            ))
            .await
            .unwrap();
        }
        b.flush().await.unwrap();
        common::await_ack(&mut b, "stuck", Direction::Up, seq).await;
    }
    relay.await_line(&ended).await;
    drop(a);
}
