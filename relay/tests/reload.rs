//! Live reload of the relay's configuration (SIGHUP and `POST /reload`):
//! a real `oab-relay` process, real TLS, live sessions across the reload.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::*;
use oab_testkit::raw_client::{ClientError, RawClient, Target};
use oab_wire::identity::Identity;
use oab_wire::{
    CloseCode, Digest, Direction, ErrorCode, Frame, InstanceId, KeyId, Open, Outcome, Ping,
};
use serde_json::{Value, json};

/// One `[[peers]]` key as an inline table; `extra` adds fields
/// (`, not_after_ms = 5`).
fn key_of(id: &Identity, extra: &str) -> String {
    format!(
        "{{ key_id = \"{}\", public_key = \"{}\"{extra} }}",
        id.key_id,
        id.public_key()
    )
}

/// Rewrites the relay's config file: its `[relay]` section as generated,
/// then `sections`, the peers (id, keys) and the routes.
fn write_config(
    env: &TestEnv,
    sections: &str,
    peers: &[(&str, Vec<String>)],
    routes: &[(&str, &str)],
) {
    let text = std::fs::read_to_string(&env.config_path).unwrap();
    let relay = text.split("[[peers]]").next().unwrap();
    let relay = relay.split("\n[limits]").next().unwrap();
    let mut out = format!("{relay}\n{sections}\n");
    for (id, keys) in peers {
        out.push_str(&format!(
            "[[peers]]\nid = \"{id}\"\nkeys = [{}]\n",
            keys.join(", ")
        ));
    }
    for (from, to) in routes {
        out.push_str(&format!("[[routes]]\nfrom = \"{from}\"\nto = \"{to}\"\n"));
    }
    std::fs::write(&env.config_path, out).unwrap();
}

/// The generated peers and route, plus `more` peers.
fn same_peers<'a>(env: &TestEnv, more: &[(&'a str, Vec<String>)]) -> Vec<(&'a str, Vec<String>)> {
    let mut v = vec![
        (CALLER, vec![key_of(&env.caller, "")]),
        (CALLEE, vec![key_of(&env.callee, "")]),
        (OTHER, vec![key_of(&env.other, "")]),
    ];
    v.extend(more.iter().cloned());
    v
}

async fn reload(relay: &RelayProcess) -> (u16, Value) {
    let (status, body) = http_post(relay.admin, "/reload").await;
    let v = serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}: {body:?}"));
    (status, v)
}

/// Reads until the relay closes the session; returns the close code and reason.
async fn closed(c: &mut RawClient) -> (u16, String) {
    loop {
        match tokio::time::timeout(std::time::Duration::from_secs(20), c.recv())
            .await
            .expect("no close within 20 s")
        {
            Ok(_) => continue,
            Err(ClientError::Closed { code, reason }) => return (code, reason),
            Err(e) => panic!("not a close: {e}"),
        }
    }
}

/// The session answers a ping: it is up.
async fn answers(c: &mut RawClient, token: u64) {
    c.send(&Frame::Ping(Ping { token })).await.unwrap();
    recv_until(c, |f| {
        matches!(f, Frame::Pong(p) if p.token == token).then_some(())
    })
    .await;
}

fn open_to(request: &str, target: &str) -> Frame {
    let payload: &'static [u8] = b"{}";
    Frame::Open(Open {
        key: key(request),
        target: peer(target),
        deadline_ms: oab_wire::identity::now_ms() + 60_000,
        depth: 1,
        digest: Digest::of(payload),
        ceiling: String::new(),
        trace: None,
        payload: bytes::Bytes::from_static(payload),
    })
}

fn labelled(page: &str, series: &str) -> f64 {
    metric_value(page, series)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unchanged_peers_session_stays_up_across_a_reload_and_still_delegates() {
    let env = TestEnv::new("");
    let relay = RelayProcess::start(&env, "memory").await;
    let mut a = relay.client_as(&env.caller, InstanceId::random()).await;
    let mut b = relay.client_as(&env.callee, InstanceId::random()).await;
    let newcomer = Identity::generate(peer("acme/new"), KeyId::new("k1").unwrap());
    // A peer added, and a field that needs a restart changed.
    write_config(
        &env,
        "[limits]\nmax_payload = 65536\n",
        &same_peers(&env, &[("acme/new", vec![key_of(&newcomer, "")])]),
        &[(CALLER, CALLEE)],
    );
    let (status, v) = reload(&relay).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["result"], "ok");
    assert_eq!(v["generation"], 2);
    assert_eq!(v["sessions_closed"], 0);
    assert_eq!(v["peers_added"], json!(["acme/new"]));
    assert_eq!(v["needs_restart"], json!(["limits.max_payload"]));
    // The sessions from before the reload delegate as before.
    open_and_stream_up(&mut a, &mut b, "after-reload", 3, 3).await;
    b.send(&data(
        "after-reload",
        Direction::Up,
        4,
        Some(Outcome::Completed),
        payload(4),
    ))
    .await
    .unwrap();
    read_to_terminal(&mut a, "after-reload", 0, 4).await;
    let page = relay.metrics().await;
    assert_eq!(metric_value(&page, "oab_config_generation"), 2.0);
    assert_eq!(
        labelled(&page, "oab_config_reloads_total{result=\"ok\"}"),
        1.0
    );
    assert!(metric_value(&page, "oab_config_last_reload_success_timestamp_seconds") > 0.0);
    // The welcome still says what the relay started with: max_payload needs a restart.
    let c = relay.client_as(&env.other, InstanceId::random()).await;
    assert_eq!(c.welcome.max_payload, env.config.limits.max_payload);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_added_by_sighup_can_connect() {
    let env = TestEnv::new("");
    let relay = RelayProcess::start(&env, "memory").await;
    let newcomer = Identity::generate(peer("acme/new"), KeyId::new("k1").unwrap());
    let before = RawClient::connect(&relay.target(), &newcomer, InstanceId::random()).await;
    assert!(
        matches!(before, Err(ClientError::Closed { code, .. }) if code == CloseCode::AuthFailed.as_u16()),
        "{:?}",
        before.err()
    );
    write_config(
        &env,
        "",
        &same_peers(&env, &[("acme/new", vec![key_of(&newcomer, "")])]),
        &[(CALLER, CALLEE), ("acme/new", CALLEE)],
    );
    relay.sighup();
    relay.await_metric("oab_config_generation", 2.0).await;
    let mut n = relay.client_as(&newcomer, InstanceId::random()).await;
    answers(&mut n, 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_peers_session_is_closed_with_revoked() {
    let env = TestEnv::new("");
    let relay = RelayProcess::start(&env, "memory").await;
    let mut a = relay.client_as(&env.caller, InstanceId::random()).await;
    let mut b = relay.client_as(&env.callee, InstanceId::random()).await;
    write_config(
        &env,
        "",
        &[
            (CALLER, vec![key_of(&env.caller, "")]),
            (OTHER, vec![key_of(&env.other, "")]),
        ],
        &[(CALLER, OTHER)],
    );
    let (status, v) = reload(&relay).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["peers_removed"], json!([CALLEE]));
    assert_eq!(v["sessions_closed"], 1);
    let (code, reason) = closed(&mut b).await;
    assert_eq!(code, CloseCode::Revoked.as_u16(), "{reason}");
    assert!(reason.contains("removed"), "{reason}");
    answers(&mut a, 2).await;
    let again = RawClient::connect(&relay.target(), &env.callee, InstanceId::random()).await;
    assert!(
        matches!(again, Err(ClientError::Closed { code, .. }) if code == CloseCode::AuthFailed.as_u16())
    );
    let page = relay.metrics().await;
    assert_eq!(
        labelled(&page, "oab_disconnects_total{reason=\"revoked\"}"),
        1.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_whose_key_was_removed_is_closed_with_revoked() {
    let env = TestEnv::new("");
    let relay = RelayProcess::start(&env, "memory").await;
    let mut a = relay.client_as(&env.caller, InstanceId::random()).await;
    let mut b = relay.client_as(&env.callee, InstanceId::random()).await;
    // The caller rotated to k2; k1 is retired.
    let rotated = Identity::generate(peer(CALLER), KeyId::new("k2").unwrap());
    let mut peers = same_peers(&env, &[]);
    peers[0].1 = vec![key_of(&rotated, "")];
    write_config(&env, "", &peers, &[(CALLER, CALLEE)]);
    relay.sighup();
    let (code, reason) = closed(&mut a).await;
    assert_eq!(code, CloseCode::Revoked.as_u16(), "{reason}");
    assert!(reason.contains("retired"), "{reason}");
    answers(&mut b, 3).await;
    let mut a2 = relay.client_as(&rotated, InstanceId::random()).await;
    answers(&mut a2, 4).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_whose_keys_window_ended_is_closed_with_revoked() {
    let env = TestEnv::new("");
    let relay = RelayProcess::start(&env, "memory").await;
    let mut a = relay.client_as(&env.caller, InstanceId::random()).await;
    let mut b = relay.client_as(&env.callee, InstanceId::random()).await;
    let rotated = Identity::generate(peer(CALLER), KeyId::new("k2").unwrap());
    let ended = oab_wire::identity::now_ms() - 1_000;
    let mut peers = same_peers(&env, &[]);
    peers[0].1 = vec![
        key_of(&env.caller, &format!(", not_after_ms = {ended}")),
        key_of(&rotated, ""),
    ];
    write_config(&env, "", &peers, &[(CALLER, CALLEE)]);
    let (status, v) = reload(&relay).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["sessions_closed"], 1);
    let (code, reason) = closed(&mut a).await;
    assert_eq!(code, CloseCode::Revoked.as_u16(), "{reason}");
    assert!(reason.contains("validity window"), "{reason}");
    answers(&mut b, 5).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_added_route_is_usable_and_a_removed_one_refuses_new_opens_only() {
    let env = TestEnv::new("");
    let relay = RelayProcess::start(&env, "memory").await;
    let mut a = relay.client_as(&env.caller, InstanceId::random()).await;
    let mut b = relay.client_as(&env.callee, InstanceId::random()).await;
    let mut c = relay.client_as(&env.other, InstanceId::random()).await;
    // Open on caller -> callee before the reload.
    a.send(&open_frame("before", b"{}")).await.unwrap();
    await_ack(&mut a, "before", Direction::Down, 1).await;
    recv_until(&mut b, |f| matches!(f, Frame::Open(_)).then_some(())).await;
    // Before: caller -> other is no route.
    a.send(&open_to("to-other-early", OTHER)).await.unwrap();
    let refused = recv_until(&mut a, |f| match f {
        Frame::Error(e) => Some(e.code),
        _ => None,
    })
    .await;
    assert_eq!(refused, ErrorCode::RouteDenied.as_u16());
    write_config(&env, "", &same_peers(&env, &[]), &[(CALLER, OTHER)]);
    let (status, v) = reload(&relay).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["sessions_closed"], 0);
    // The removed route refuses a new open.
    a.send(&open_frame("after", b"{}")).await.unwrap();
    let refused = recv_until(&mut a, |f| match f {
        Frame::Error(e) => Some(e.code),
        _ => None,
    })
    .await;
    assert_eq!(refused, ErrorCode::RouteDenied.as_u16());
    // The added route takes one.
    a.send(&open_to("to-other", OTHER)).await.unwrap();
    await_ack(&mut a, "to-other", Direction::Down, 1).await;
    recv_until(&mut c, |f| {
        matches!(f, Frame::Open(o) if o.key == key("to-other")).then_some(())
    })
    .await;
    // The delegation opened on the removed route runs on to its terminal.
    send_until_acked(&mut b, "before", 0, 3, true).await;
    read_to_terminal(&mut a, "before", 0, 3).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalid_config_is_refused_with_check_configs_errors_and_the_old_one_serves() {
    let env = TestEnv::new("");
    let relay = RelayProcess::start(&env, "memory").await;
    let mut a = relay.client_as(&env.caller, InstanceId::random()).await;
    let mut b = relay.client_as(&env.callee, InstanceId::random()).await;
    write_config(
        &env,
        "[limits]\nmax_open_per_peer = 0\n",
        &same_peers(&env, &[]),
        &[(CALLER, CALLEE), (CALLER, "acme/nobody")],
    );
    let (status, v) = reload(&relay).await;
    assert_eq!(status, 422, "{v}");
    assert_eq!(v["result"], "invalid");
    let fields: Vec<&str> = v["errors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["field"].as_str().unwrap())
        .collect();
    assert!(fields.contains(&"limits.max_open_per_peer"), "{fields:?}");
    assert!(fields.contains(&"routes[1].to"), "{fields:?}");
    // The same errors as `oab-relay check-config` prints.
    let check = std::process::Command::new(env!("CARGO_BIN_EXE_oab-relay"))
        .arg("check-config")
        .arg(&env.config_path)
        .output()
        .unwrap();
    assert_eq!(check.status.code(), Some(2));
    let printed = String::from_utf8_lossy(&check.stderr);
    for e in v["errors"].as_array().unwrap() {
        let at = match e["line"].as_u64() {
            Some(n) => format!(" (line {n})"),
            None => String::new(),
        };
        let line = format!(
            "  - {}{at}: {}",
            e["field"].as_str().unwrap(),
            e["message"].as_str().unwrap()
        );
        assert!(printed.contains(&line), "{line:?} not in {printed}");
    }
    assert_eq!(v["message"].as_str().unwrap().trim(), printed.trim());
    // SIGHUP refuses it too.
    relay.sighup();
    for _ in 0..500 {
        let page = relay.metrics().await;
        if labelled(&page, "oab_config_reloads_total{result=\"invalid\"}") == 2.0 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let page = relay.metrics().await;
    assert_eq!(
        labelled(&page, "oab_config_reloads_total{result=\"invalid\"}"),
        2.0
    );
    assert_eq!(
        labelled(&page, "oab_config_reloads_total{result=\"ok\"}"),
        0.0
    );
    assert_eq!(metric_value(&page, "oab_config_generation"), 1.0);
    // The old configuration serves: the sessions delegate, the peers connect.
    open_and_stream_up(&mut a, &mut b, "still-served", 2, 2).await;
    let mut c = relay.client_as(&env.other, InstanceId::random()).await;
    answers(&mut c, 6).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewed_certificate_is_served_to_new_connections_and_old_sessions_stay() {
    let env = TestEnv::new("");
    let relay = RelayProcess::start(&env, "memory").await;
    let mut a = relay.client_as(&env.caller, InstanceId::random()).await;
    // Renewed in place, as certbot or cert-manager do.
    let renewed = oab_relay::tls::self_signed(&["localhost"]).unwrap();
    std::fs::write(env.dir.path().join("cert.pem"), &renewed.cert_pem).unwrap();
    std::fs::write(env.dir.path().join("key.pem"), &renewed.key_pem).unwrap();
    relay.sighup();
    relay.await_metric("oab_config_generation", 2.0).await;
    let new_root = Target {
        root_der: renewed.cert_der.clone(),
        ..relay.target()
    };
    let mut c = RawClient::connect(&new_root, &env.callee, InstanceId::random())
        .await
        .unwrap();
    answers(&mut c, 7).await;
    // A client that trusts only the old certificate no longer gets in.
    let old = RawClient::connect(&relay.target(), &env.other, InstanceId::random()).await;
    assert!(
        matches!(old, Err(ClientError::Connect(_))),
        "{:?}",
        old.err()
    );
    // The session from before keeps its TLS session.
    answers(&mut a, 8).await;

    // A certificate that cannot be loaded is an error: the renewed one stays.
    std::fs::write(env.dir.path().join("cert.pem"), "not a certificate\n").unwrap();
    let (status, v) = reload(&relay).await;
    assert_eq!(status, 500, "{v}");
    assert_eq!(v["result"], "error");
    let page = relay.metrics().await;
    assert_eq!(
        labelled(&page, "oab_config_reloads_total{result=\"error\"}"),
        1.0
    );
    assert_eq!(metric_value(&page, "oab_config_generation"), 2.0);
    let mut d = RawClient::connect(&new_root, &env.other, InstanceId::random())
        .await
        .unwrap();
    answers(&mut d, 9).await;
}

/// The relay refuses a TLS key file other users can read: at start (it
/// exits, naming the file, its mode and `chmod 600`), and on reload (the
/// old certificate keeps serving).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_key_readable_by_others_is_refused_at_start_and_on_reload() {
    use std::os::unix::fs::PermissionsExt as _;
    let env = TestEnv::new("");
    let key = env.dir.path().join("key.pem");
    let set = |mode| std::fs::set_permissions(&key, std::fs::Permissions::from_mode(mode));
    let fix = format!("chmod 600 {}", key.display());

    set(0o644).unwrap();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_oab-relay"))
        .arg("--config")
        .arg(&env.config_path)
        .args(["--listen", &format!("127.0.0.1:{}", free_port())])
        .args(["--admin-listen", &format!("127.0.0.1:{}", free_port())])
        .args(["--store", "memory"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Bounded: a relay that serves with the key never exits on its own.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            panic!("the relay started with a key file readable by others");
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    };
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
    assert!(!status.success(), "{stderr}");
    assert!(
        stderr.contains(&fix) && stderr.contains("mode 644"),
        "{stderr}"
    );

    // Private again, it starts; made readable again, a reload is refused.
    set(0o600).unwrap();
    let relay = RelayProcess::start(&env, "memory").await;
    set(0o604).unwrap();
    let (status, v) = reload(&relay).await;
    assert_eq!(status, 500, "{v}");
    assert_eq!(v["result"], "error");
    let said = v["message"].as_str().unwrap_or_default();
    assert!(said.contains(&fix), "{v}");
    assert_eq!(
        metric_value(&relay.metrics().await, "oab_config_generation"),
        1.0
    );
    let mut c = relay.client_as(&env.other, InstanceId::random()).await;
    answers(&mut c, 5).await;
}
