//! `/status` on the admin port, `oab-relay status`, and the status page:
//! live sessions (real TLS WebSocket clients), an open delegation, a fleet of
//! two `oab-relay` processes over a real `redis-server` (and that server
//! killed), and the page rendered by a headless Chromium.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use oab_relay::status::RelayStatus;
use oab_relay::store::{MemoryStore, Retention};
use oab_testkit::redis::{Persistence, RedisServer};
use oab_wire::{Direction, InstanceId};

/// The body of an HTTP answer.
fn body(answer: &str) -> &str {
    answer
        .split_once("\r\n\r\n")
        .map(|(_, b)| b)
        .unwrap_or_default()
}

async fn status_of(admin: std::net::SocketAddr) -> RelayStatus {
    let answer = http_get(admin, "/status").await;
    assert!(
        answer.starts_with("HTTP/1.0 200") || answer.starts_with("HTTP/1.1 200"),
        "{answer}"
    );
    serde_json::from_str(body(&answer)).unwrap_or_else(|e| panic!("{e}: {answer}"))
}

/// Polls `/status` until `f` holds (a bounded number of times).
async fn status_until(
    admin: std::net::SocketAddr,
    what: &str,
    f: impl Fn(&RelayStatus) -> bool,
) -> RelayStatus {
    let mut last = None;
    for _ in 0..400 {
        let s = status_of(admin).await;
        if f(&s) {
            return s;
        }
        last = Some(s);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("{what}: not seen within 20 s; last status: {last:#?}");
}

#[tokio::test]
async fn status_lists_live_sessions_open_delegations_the_store_and_the_build() {
    let env = TestEnv::new("");
    let relay = TestRelay::start(&env, Arc::new(MemoryStore::new(Retention::default()))).await;
    let before = oab_wire::identity::now_ms();
    let (caller_instance, callee_instance) = (InstanceId::random(), InstanceId::random());
    let mut b = relay.client_as(&env.callee, callee_instance).await;
    let mut a = relay.client_as(&env.caller, caller_instance).await;
    let after = oab_wire::identity::now_ms();
    a.send(&open_frame("st-1", b"{}")).await.unwrap();
    await_ack(&mut a, "st-1", Direction::Down, 1).await;

    let s = status_until(relay.admin, "the open delegation counted", |s| {
        s.routes.iter().any(|r| r.open == 1)
    })
    .await;
    assert_eq!(s.relay.id, "localhost");
    assert_eq!(s.relay.version, env!("CARGO_PKG_VERSION"));
    assert!(!s.relay.commit.is_empty() && s.relay.built.ends_with('Z'));
    // Every configured peer, in order; the two connected ones online here.
    let names: Vec<&str> = s.peers.iter().map(|p| p.peer.as_str()).collect();
    assert_eq!(names, [CALLER, CALLEE, OTHER]);
    for (p, instance, session) in [
        (&s.peers[0], caller_instance, a.welcome.session),
        (&s.peers[1], callee_instance, b.welcome.session),
    ] {
        assert!(p.online, "{p:?}");
        assert_eq!(p.instance.as_deref(), Some(instance.to_string().as_str()));
        assert_eq!(p.session.as_deref(), Some(session.to_string().as_str()));
        assert_eq!(p.served_by.as_deref(), Some(s.relay.node.as_str()));
        let since = p.since_ms.unwrap();
        assert!(
            (before..=after).contains(&since),
            "{before} <= {since} <= {after}"
        );
    }
    assert!(!s.peers[2].online && s.peers[2].session.is_none());
    // The configured route caller -> callee, with the open delegation.
    assert_eq!(s.routes.len(), 1);
    let r = &s.routes[0];
    assert_eq!(
        (r.caller.as_str(), r.callee.as_str(), r.open),
        (CALLER, CALLEE, 1)
    );
    assert!(r.max_open > 0);
    assert!(s.fleet.is_none(), "the memory store is not shared");
    assert_eq!(s.store.kind, "memory");
    assert!(s.store.reachable && s.store.last_error.is_none());

    // The terminal ends it; the caller leaving takes it offline.
    send_until_acked(&mut b, "st-1", 0, 1, true).await;
    status_until(relay.admin, "the delegation's end counted", |s| {
        s.routes[0].open == 0
    })
    .await;
    a.close().await;
    let s = status_until(relay.admin, "the caller offline", |s| !s.peers[0].online).await;
    assert!(s.peers[0].since_ms.is_none() && s.peers[1].online);

    // The page is served from the same port, self-contained.
    for path in ["/status.html", "/"] {
        let page = http_get(relay.admin, path).await;
        assert!(page.contains("text/html"), "{page}");
        assert!(page.contains("fetch(\"/status\""), "{page}");
        assert!(!page.contains("src=\"http") && !page.contains("href=\"http"));
    }
    relay.stop().await;
}

/// Two `oab-relay` processes over one Redis: each shows the other's peer
/// online there, both members, and `oab-relay status` prints it; with Redis
/// killed, the store is unreachable and its last error is shown.
#[tokio::test]
async fn a_fleet_shows_peers_on_other_instances_and_the_store_going_down() {
    let mut redis = RedisServer::start(Persistence::None).unwrap();
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
    let b_instance = InstanceId::random();
    let b = two.client_as(&env.callee, b_instance).await;
    let a = one.client_as(&env.caller, InstanceId::random()).await;

    let s = status_until(one.admin, "both members and the callee elsewhere", |s| {
        s.fleet.as_ref().is_some_and(|f| f.members.len() == 2) && s.peers[1].online
    })
    .await;
    assert_eq!(s.relay.node, "relay-1");
    assert_eq!(s.store.kind, "redis");
    assert!(s.store.reachable);
    let f = s.fleet.as_ref().unwrap();
    let members: Vec<(&str, bool)> = f
        .members
        .iter()
        .map(|m| (m.node.as_str(), m.this))
        .collect();
    assert_eq!(members, [("relay-1", true), ("relay-2", false)]);
    assert_eq!(f.wake_links_connected, f.wake_links);
    // The caller here; the callee on relay-2, its session id from the
    // presence record (its instance and start are known there only).
    assert_eq!(s.peers[0].served_by.as_deref(), Some("relay-1"));
    let callee = &s.peers[1];
    assert_eq!(callee.served_by.as_deref(), Some("relay-2"));
    assert_eq!(
        callee.session.as_deref(),
        Some(b.welcome.session.to_string().as_str())
    );
    assert!(callee.instance.is_none() && callee.since_ms.is_none());
    let s2 = status_of(two.admin).await;
    assert_eq!(
        s2.peers[1].instance.as_deref(),
        Some(b_instance.to_string().as_str())
    );

    // The command prints the same as tables.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_oab-relay"))
        .args(["status", "--admin", &format!("http://{}", one.admin)])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("store: redis, reachable"), "{text}");
    assert!(text.contains("fleet: 2 member(s)"), "{text}");
    assert!(text.contains("peers: 2 of 3 online"), "{text}");
    let callee_line = text.lines().find(|l| l.starts_with(CALLEE)).unwrap();
    assert!(
        callee_line.contains("online") && callee_line.contains("relay-2"),
        "{text}"
    );
    assert!(text.contains(&format!("{CALLER} -> {CALLEE}")), "{text}");
    let json = std::process::Command::new(env!("CARGO_BIN_EXE_oab-relay"))
        .args([
            "status",
            "--json",
            "--admin",
            &format!("http://{}", one.admin),
        ])
        .output()
        .unwrap();
    let parsed: RelayStatus = serde_json::from_slice(&json.stdout).unwrap();
    assert_eq!(parsed.fleet.unwrap().members.len(), 2);

    redis.kill().unwrap();
    let s = status_until(one.admin, "the store unreachable", |s| !s.store.reachable).await;
    let e = s.store.last_error.as_ref().expect("a last error");
    assert!(!e.error.is_empty() && e.at_ms > 0, "{e:?}");
    drop((a, b));
}

#[tokio::test]
async fn oab_relay_status_without_a_relay_says_where_it_looked() {
    let port = free_port();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_oab-relay"))
        .args(["status", "--admin", &format!("http://127.0.0.1:{port}")])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(&format!("127.0.0.1:{port}/status")), "{err}");
    assert!(err.contains("relay.admin_listen"), "{err}");
}

/// The Chromium binary: `OAB_CHROMIUM`, else `chromium` or
/// `chromium-browser` on the `PATH`.
fn chromium() -> Option<std::path::PathBuf> {
    if let Some(p) = std::env::var_os("OAB_CHROMIUM") {
        return Some(p.into());
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .flat_map(|d| [d.join("chromium"), d.join("chromium-browser")])
        .find(|p| p.is_file())
}

/// The status page in a real browser: its script fetches `/status` and
/// renders the peers and their state.
#[tokio::test]
async fn the_status_page_shows_the_peers_online_in_headless_chromium() {
    let Some(browser) = chromium() else {
        eprintln!(
            "SKIPPED the_status_page_shows_the_peers_online_in_headless_chromium: no chromium \
             on the PATH (Debian: apt-get install chromium; scripts/test installs it), or set \
             OAB_CHROMIUM"
        );
        return;
    };
    let env = TestEnv::new("");
    let relay = TestRelay::start(&env, Arc::new(MemoryStore::new(Retention::default()))).await;
    let caller_instance = InstanceId::random();
    let _b = relay.client_as(&env.callee, InstanceId::random()).await;
    let mut a = relay.client_as(&env.caller, caller_instance).await;
    status_until(relay.admin, "both online", |s| {
        s.peers[0].online && s.peers[1].online
    })
    .await;

    // An open delegation the callee has not accepted, and a refusal.
    a.send(&open_frame("page-1", b"{}")).await.unwrap();
    await_ack(&mut a, "page-1", Direction::Down, 1).await;
    a.send(&data("ghost-1", Direction::Down, 2, None, payload(2)))
        .await
        .unwrap();
    recv_until(&mut a, |f| {
        matches!(f, oab_wire::Frame::Error(_)).then_some(())
    })
    .await;

    let dom = render_page(&browser, &format!("http://{}/status.html", relay.admin)).await;
    // The rows the script built from /status (not the page's source: the
    // peer names exist only in the JSON).
    let row = |peer: &str| {
        dom.split("<tr>")
            .find(|r| r.contains(&format!("<td class=\"peer\">{peer}</td>")))
            .unwrap_or_else(|| panic!("no row for {peer} in the rendered page:\n{dom}"))
            .to_string()
    };
    let caller = row(CALLER);
    assert!(caller.contains(">online<"), "{caller}");
    assert!(caller.contains(&caller_instance.to_string()), "{caller}");
    assert!(row(CALLEE).contains(">online<"));
    assert!(row(OTHER).contains(">offline<"));
    assert!(dom.contains("memory: "), "{dom}");
    assert!(dom.contains(", config generation 1"), "{dom}");
    assert!(dom.contains("(2 of 3 online)"), "{dom}");
    assert!(
        dom.contains(&format!("<td>{CALLER}</td><td>{CALLEE}</td>")),
        "{dom}"
    );
    // The open delegation and the refusal, each linking to its inspect view.
    let page_key = key("page-1").to_string();
    let link = |k: &str| {
        format!(
            "<a class=\"delegation\" href=\"#inspect={}\">{k}</a>",
            oab_ops::admin_client::query_value(k)
        )
    };
    let oldest = dom
        .split("<tr>")
        .find(|r| r.contains(&link(&page_key)))
        .unwrap_or_else(|| panic!("no open-longest row for {page_key}:\n{dom}"));
    assert!(oldest.contains("not yet"), "{oldest}");
    let ghost = key("ghost-1").to_string();
    let refusal = dom
        .split("<tr>")
        .find(|r| r.contains(&link(&ghost)))
        .unwrap_or_else(|| panic!("no refusal row for {ghost}:\n{dom}"));
    assert!(refusal.contains("<td>unknown_delegation</td>"), "{refusal}");

    // The inspect view of the open delegation.
    let dom = render_page(
        &browser,
        &format!(
            "http://{}/status.html#inspect={}",
            relay.admin,
            oab_ops::admin_client::query_value(&page_key)
        ),
    )
    .await;
    assert!(
        dom.contains(&format!("<code id=\"inspect-key\">{page_key}</code>")),
        "{dom}"
    );
    assert!(dom.contains("<dd>open</dd>"), "{dom}");
    let waits = dom
        .split("<ul class=\"waiting-for\">")
        .nth(1)
        .unwrap_or_else(|| panic!("no waiting-for list:\n{dom}"));
    assert!(
        waits.contains(&format!("the callee {CALLEE} (online on "))
            && waits.contains("to accept it"),
        "{waits}"
    );
    relay.stop().await;
}

/// The DOM of `url` after its scripts ran in headless Chromium.
async fn render_page(browser: &std::path::Path, url: &str) -> String {
    let profile = tempfile::tempdir().unwrap();
    let mut cmd = tokio::process::Command::new(browser);
    cmd.args([
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        "--virtual-time-budget=5000",
    ])
    .arg(format!("--user-data-dir={}", profile.path().display()))
    .arg("--dump-dom")
    .arg(url)
    .kill_on_drop(true);
    let out = tokio::time::timeout(Duration::from_secs(90), cmd.output())
        .await
        .expect("chromium did not finish within 90 s")
        .unwrap();
    assert!(
        out.status.success(),
        "chromium failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}
