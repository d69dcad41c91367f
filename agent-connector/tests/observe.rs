//! What operators watch on a connector: the admin endpoint (`/metrics`,
//! `/healthz`, `/readyz`, `/status`) over a real relay on TLS loopback with
//! a delegation in flight, the relay going away, a published descriptor;
//! and the `oab-connector` binary run with its admin endpoint set from the
//! environment, JSON logs, `oab-connector status`, `--set` in
//! `check-config`, and `--version`.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use oab_connector::status::ConnectorStatus;
use oab_relay::store::{MemoryStore, Retention};
use oab_wire::{Digest, Outcome};
use tokio_util::sync::CancellationToken;

/// Every metric family the connector exports (docs/configuration.md and
/// deploy/README.md list the same).
const FAMILIES: [&str; 18] = [
    "oab_connector_acks_total",
    "oab_connector_build_info",
    "oab_connector_delegations_finished_total",
    "oab_connector_delegations_opened_total",
    "oab_connector_descriptor_published",
    "oab_connector_frames_total",
    "oab_connector_link_state",
    "oab_connector_link_up",
    "oab_connector_open_delegations",
    "oab_connector_publishes_total",
    "oab_connector_push_configs",
    "oab_connector_push_failed_attempts_total",
    "oab_connector_push_notifications_total",
    "oab_connector_reconnects_total",
    "oab_connector_relay_errors_total",
    "oab_connector_relay_reachable",
    "oab_connector_sessions_total",
    "oab_connector_unacked_frames",
];

/// A minimal HTTP/1.0 GET: status code and body.
async fn get(addr: SocketAddr, path: &str) -> (u16, String) {
    let r = oab_ops::admin_client::get(&format!("http://{addr}{path}"), Duration::from_secs(10))
        .await
        .unwrap();
    (r.status, String::from_utf8(r.body).unwrap())
}

/// The value of the sample `series` (name with its labels as exported, e.g.
/// `oab_connector_open_delegations{side="caller"}`); panics if absent.
fn sample(page: &str, series: &str) -> u64 {
    page.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("no {series} in\n{page}"))
}

/// Polls `/metrics` until `series` has `value` (bounded).
async fn metric_until(admin: SocketAddr, series: &str, value: u64) -> String {
    let mut page = String::new();
    for _ in 0..400 {
        page = get(admin, "/metrics").await.1;
        if sample(&page, series) == value {
            return page;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("{series} never reached {value}:\n{page}");
}

async fn serve_admin(
    link: oab_connector::link::LinkHandle,
    stop: &CancellationToken,
) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(oab_connector::admin::serve(
        listener,
        link,
        stop.child_token(),
    ));
    addr
}

/// Every sample's name is one of [`FAMILIES`] and every label value comes
/// from the fixed sets.
fn check_names_and_labels(page: &str) {
    let families: BTreeSet<&str> = FAMILIES.into_iter().collect();
    let mut seen = BTreeSet::new();
    let outcomes: Vec<&str> = Outcome::ALL
        .iter()
        .map(|o| o.name())
        .chain(["refused"])
        .collect();
    let codes: Vec<&str> = oab_wire::ErrorCode::ALL
        .iter()
        .map(|c| c.name())
        .chain(["other"])
        .collect();
    for line in page
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
    {
        let (series, _) = line.rsplit_once(' ').unwrap();
        let (name, labels) = series.split_once('{').unwrap_or((series, ""));
        assert!(families.contains(name), "unexpected series {name}");
        seen.insert(name);
        for pair in labels
            .trim_end_matches('}')
            .split(',')
            .filter(|p| !p.is_empty())
        {
            let (k, v) = pair.split_once('=').unwrap();
            let v = v.trim_matches('"');
            let ok = match k {
                "side" => ["caller", "callee"].contains(&v),
                "outcome" => outcomes.contains(&v),
                "direction" => ["in", "out"].contains(&v),
                "state" => ["connecting", "connected", "stopped"].contains(&v),
                "code" => codes.contains(&v),
                "result" => ["delivered", "dropped", "skipped"].contains(&v),
                "delivery" => ["active", "ended"].contains(&v),
                "version" => v == env!("CARGO_PKG_VERSION"),
                "commit" => !v.is_empty(),
                _ => false,
            };
            assert!(ok, "{name}: label {k}={v:?} is not from a fixed set");
        }
    }
    assert_eq!(seen, families, "every family has samples");
}

#[tokio::test]
async fn the_admin_endpoint_follows_the_link_and_the_delegations_on_both_sides() {
    let env = Env::new("");
    let relay = Relay::start(&env, Arc::new(MemoryStore::new(Retention::default()))).await;
    let exec = Paced::gated(2, Duration::from_millis(1), 1);
    let b = connector(&env, &env.callee, relay.addr, Some(exec.clone()));
    let a = connector(&env, &env.caller, relay.addr, None);
    let stop = CancellationToken::new();
    let admin_a = serve_admin(a.link().clone(), &stop).await;
    let admin_b = serve_admin(b.link().clone(), &stop).await;
    a.connected().await.unwrap();
    b.connected().await.unwrap();

    assert_eq!(get(admin_a, "/healthz").await, (200, "ok\n".into()));
    assert_eq!(get(admin_a, "/readyz").await, (200, "ready\n".into()));
    let page = get(admin_a, "/metrics").await.1;
    check_names_and_labels(&page);
    assert_eq!(sample(&page, "oab_connector_link_up"), 1);
    assert_eq!(
        sample(&page, "oab_connector_link_state{state=\"connected\"}"),
        1
    );
    assert_eq!(sample(&page, "oab_connector_relay_reachable"), 1);
    assert_eq!(sample(&page, "oab_connector_sessions_total"), 1);
    // No facade here: the push series are exported at 0.
    for series in [
        "oab_connector_push_notifications_total{result=\"delivered\"}",
        "oab_connector_push_notifications_total{result=\"dropped\"}",
        "oab_connector_push_notifications_total{result=\"skipped\"}",
        "oab_connector_push_failed_attempts_total",
        "oab_connector_push_configs{delivery=\"active\"}",
        "oab_connector_push_configs{delivery=\"ended\"}",
    ] {
        assert_eq!(sample(&page, series), 0, "{series}");
    }

    // A delegation held open by the callee's gate: open on both sides.
    let h = a
        .caller()
        .delegate(&peer(CALLEE), spec("watch me"))
        .await
        .unwrap();
    metric_until(
        admin_a,
        "oab_connector_open_delegations{side=\"caller\"}",
        1,
    )
    .await;
    metric_until(
        admin_b,
        "oab_connector_open_delegations{side=\"callee\"}",
        1,
    )
    .await;
    let page = metric_until(
        admin_b,
        "oab_connector_delegations_opened_total{side=\"callee\"}",
        1,
    )
    .await;
    assert_eq!(
        sample(&page, "oab_connector_open_delegations{side=\"caller\"}"),
        0
    );
    let page = get(admin_a, "/metrics").await.1;
    assert_eq!(
        sample(
            &page,
            "oab_connector_delegations_opened_total{side=\"caller\"}"
        ),
        1
    );
    assert!(
        sample(&page, "oab_connector_acks_total") >= 1,
        "the open was acknowledged"
    );
    assert!(sample(&page, "oab_connector_frames_total{direction=\"out\"}") >= 1);
    assert!(sample(&page, "oab_connector_frames_total{direction=\"in\"}") >= 1);

    let (code, body) = get(admin_a, "/status").await;
    assert_eq!(code, 200, "{body}");
    let s: ConnectorStatus = serde_json::from_str(&body).unwrap();
    assert_eq!(s.peer, CALLER);
    assert_eq!(s.link.state, "connected");
    assert!(s.link.relay_reachable && s.link.session.is_some());
    assert_eq!(
        s.relay.url,
        format!("wss://localhost:{}/", relay.addr.port())
    );
    assert_eq!(
        (s.delegations.open_caller, s.delegations.open_callee),
        (1, 0)
    );
    assert_eq!(s.delegations.listed.len(), 1, "{s:?}");
    let listed = &s.delegations.listed[0];
    assert_eq!(listed.key, format!("{CALLER}#{}", h.key.request_id));
    assert_eq!(
        (listed.side.as_str(), listed.counterpart.as_str()),
        ("caller", CALLEE)
    );
    assert!(s.descriptor.is_none());
    let table = s.render();
    assert!(
        table.contains(&listed.key) && table.contains("1 as caller"),
        "{table}"
    );

    // The gate opens: the delegation completes, counted once on each side.
    exec.open_gate();
    let t = a.caller().wait(&h, Duration::from_secs(30)).await.unwrap();
    assert_eq!(t.outcome, Outcome::Completed);
    let page = metric_until(
        admin_a,
        "oab_connector_delegations_finished_total{side=\"caller\",outcome=\"completed\"}",
        1,
    )
    .await;
    assert_eq!(
        sample(&page, "oab_connector_open_delegations{side=\"caller\"}"),
        0
    );
    let page = metric_until(
        admin_b,
        "oab_connector_delegations_finished_total{side=\"callee\",outcome=\"completed\"}",
        1,
    )
    .await;
    assert_eq!(
        sample(&page, "oab_connector_open_delegations{side=\"callee\"}"),
        0
    );

    // A published descriptor shows as published on this session.
    a.publish(&serde_json::json!({ "name": "caller card" }))
        .await
        .unwrap();
    let page = metric_until(admin_a, "oab_connector_descriptor_published", 1).await;
    assert_eq!(sample(&page, "oab_connector_publishes_total"), 1);
    let s: ConnectorStatus = serde_json::from_str(&get(admin_a, "/status").await.1).unwrap();
    let d = s.descriptor.unwrap();
    assert!(d.published && d.bytes > 10, "{d:?}");

    // The relay goes away: not ready, link down, reconnects counted, the
    // disconnect named; the descriptor waits for the next session.
    relay.stop().await;
    metric_until(admin_a, "oab_connector_link_up", 0).await;
    let (code, body) = get(admin_a, "/readyz").await;
    assert_eq!(code, 503, "{body}");
    assert!(body.starts_with("connecting to the relay"), "{body}");
    let page = metric_until(admin_a, "oab_connector_descriptor_published", 0).await;
    assert!(sample(&page, "oab_connector_reconnects_total") >= 1);
    assert_eq!(sample(&page, "oab_connector_relay_reachable"), 0);
    assert_eq!(
        sample(&page, "oab_connector_link_state{state=\"connecting\"}"),
        1
    );
    let s: ConnectorStatus = serde_json::from_str(&get(admin_a, "/status").await.1).unwrap();
    assert_eq!(s.link.state, "connecting");
    assert!(s.link.session.is_none() && !s.link.relay_reachable);
    assert!(s.link.last_disconnect.is_some(), "{s:?}");
    stop.cancel();
    a.shutdown().await;
    b.shutdown().await;
}

/// A refused open is counted as `refused`, not left open.
#[tokio::test]
async fn a_refused_open_is_counted_and_not_left_open() {
    let env = Env::new("");
    let relay = Relay::start(&env, Arc::new(MemoryStore::new(Retention::default()))).await;
    // The callee as caller: no route from it to the caller.
    let b = connector(&env, &env.callee, relay.addr, None);
    let stop = CancellationToken::new();
    let admin = serve_admin(b.link().clone(), &stop).await;
    b.connected().await.unwrap();
    // Refused at once, or (the open queued) on the wait.
    if let Ok(h) = b.caller().delegate(&peer(CALLER), spec("no route")).await {
        let r = b.caller().wait(&h, Duration::from_secs(30)).await;
        assert!(r.is_err(), "{r:?}");
    }
    let page = metric_until(
        admin,
        "oab_connector_delegations_finished_total{side=\"caller\",outcome=\"refused\"}",
        1,
    )
    .await;
    assert_eq!(
        sample(&page, "oab_connector_open_delegations{side=\"caller\"}"),
        0
    );
    assert_eq!(
        sample(
            &page,
            "oab_connector_relay_errors_total{code=\"route_denied\"}"
        ),
        1
    );
    stop.cancel();
    b.shutdown().await;
    relay.stop().await;
}

/// Writes a caller `connector.toml` for the binary.
fn config_file(env: &Env, dir: &std::path::Path, relay: SocketAddr) -> std::path::PathBuf {
    let identity = dir.join("caller.identity.toml");
    oab_connector::keyfile::save(&env.caller, &identity).unwrap();
    let pin = oab_wire::digest::hex(&Digest::of(&env.cert_der).0);
    let text = format!(
        "[connector]\nrelay_url = \"wss://localhost:{}/\"\nidentity = \"{}\"\n\
         relay_pin_sha256 = \"sha256:{pin}\"\n\n[[peers]]\nid = \"{}\"\n\
         keys = [{{ key_id = \"k1\", public_key = \"{}\" }}]\n",
        relay.port(),
        identity.display(),
        env.callee.peer,
        env.callee.public_key()
    );
    let path = dir.join("connector.toml");
    std::fs::write(&path, text).unwrap();
    path
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// `oab-connector run` with `config`, its admin endpoint on `admin` (from
/// the environment), JSON logs at `info` on a piped stderr, and `env`.
fn run_with_json_logs(
    config: &std::path::Path,
    admin: SocketAddr,
    env: &[(&str, &str)],
) -> tokio::process::Child {
    tokio::process::Command::new(env!("CARGO_BIN_EXE_oab-connector"))
        .args(["run", "--log-format", "json", "--config"])
        .arg(config)
        .env("OAB_CONNECTOR__ADMIN__LISTEN", admin.to_string())
        .env("OAB_LOG", "info")
        .envs(env.iter().copied())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap()
}

#[tokio::test]
async fn the_binary_serves_its_admin_endpoint_from_an_env_override_with_json_logs() {
    use tokio::io::AsyncBufReadExt as _;
    let env = Env::new("");
    let relay = Relay::start(&env, Arc::new(MemoryStore::new(Retention::default()))).await;
    let dir = tempfile::tempdir().unwrap();
    let config = config_file(&env, dir.path(), relay.addr);
    let admin = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let mut child = run_with_json_logs(&config, admin, &[]);
    // Every log line is one JSON object; one says the admin endpoint listens.
    let mut lines = tokio::io::BufReader::new(child.stderr.take().unwrap()).lines();
    let announced = tokio::time::timeout(Duration::from_secs(30), async {
        while let Some(line) = lines.next_line().await.unwrap() {
            let v: serde_json::Value = serde_json::from_str(&line)
                .unwrap_or_else(|e| panic!("not a JSON log line ({e}): {line}"));
            if v["fields"]["message"]
                .as_str()
                .is_some_and(|m| m.starts_with("admin endpoint listening"))
            {
                assert_eq!(v["fields"]["addr"], admin.to_string());
                return;
            }
        }
        panic!("the connector exited before its admin endpoint listened");
    })
    .await;
    assert!(announced.is_ok(), "no admin line within 30 s");
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });

    let mut ready = false;
    for _ in 0..400 {
        if get(admin, "/readyz").await.0 == 200 {
            ready = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(ready, "the connector never became ready");

    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_oab-connector"))
        .args(["status", "--admin", &format!("http://{admin}")])
        .output()
        .await
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.starts_with(&format!("connector {CALLER} (instance ")),
        "{text}"
    );
    let row = |name: &str| {
        text.lines()
            .find(|l| l.starts_with(name))
            .unwrap_or_else(|| panic!("no {name} row in\n{text}"))
            .to_string()
    };
    assert!(row("link ").ends_with("connected"), "{text}");
    assert!(row("relay ").contains(&format!("wss://localhost:{}/", relay.addr.port())));
    assert!(row("relay reachable").ends_with("yes"), "{text}");
    assert!(row("descriptor").ends_with("none published"), "{text}");
    assert!(
        text.contains("open delegations: 0 as caller, 0 as callee"),
        "{text}"
    );
    let json = tokio::process::Command::new(env!("CARGO_BIN_EXE_oab-connector"))
        .args(["status", "--json", "--admin", &format!("http://{admin}")])
        .output()
        .await
        .unwrap();
    let s: ConnectorStatus = serde_json::from_slice(&json.stdout).unwrap();
    assert_eq!(
        (s.peer.as_str(), s.link.state.as_str()),
        (CALLER, "connected")
    );
    let _ = child.kill().await;
    relay.stop().await;
}

#[test]
fn check_config_applies_set_and_environment_overrides_and_names_the_field() {
    let env = Env::new("");
    let dir = tempfile::tempdir().unwrap();
    let config = config_file(&env, dir.path(), SocketAddr::from(([127, 0, 0, 1], 7443)));
    let run = |args: &[&str], envs: &[(&str, &str)]| {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_oab-connector"));
        cmd.arg("check-config").arg(&config).args(args);
        for (k, v) in envs {
            cmd.env(k, v);
        }
        cmd.output().unwrap()
    };
    let ok = run(&["--set", "admin.listen=127.0.0.1:9444"], &[]);
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    for out in [
        run(&["--set", "admin.listen=nowhere"], &[]),
        run(&[], &[("OAB_CONNECTOR__ADMIN__LISTEN", "nowhere")]),
    ] {
        assert_eq!(out.status.code(), Some(2));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("admin") && err.contains("listen"), "{err}");
    }
    // The same port for the admin endpoint and the facade is refused.
    let out = run(
        &[
            "--set",
            "admin.listen=127.0.0.1:9444",
            "--set",
            "a2a.facade_listen=127.0.0.1:9444",
        ],
        &[],
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&out.stderr)
            .contains("admin.listen: 127.0.0.1:9444 is also a2a.facade_listen")
    );
}

#[test]
fn version_names_the_commit_and_the_build_date() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_oab-connector"))
        .arg("--version")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    assert_eq!(
        text.trim(),
        format!("oab-connector {}", oab_ops::build::LONG_VERSION),
        "{text}"
    );
    assert!(text.contains(&format!("(commit {}, built ", oab_ops::build::COMMIT)));
}

#[tokio::test]
async fn oab_connector_status_without_a_connector_says_where_it_looked() {
    let port = free_port();
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_oab-connector"))
        .args(["status", "--admin", &format!("http://127.0.0.1:{port}")])
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!("127.0.0.1:{port}/status")) && err.contains("[admin] listen"),
        "{err}"
    );
}

/// `run --busy-poll-us` (here from the environment) says so at start, with
/// the window and the worker count it got, and the connector connects and
/// serves as without it; a window past the cap is refused before anything
/// starts.
#[tokio::test]
async fn a_busy_polling_connector_says_so_and_connects() {
    use tokio::io::AsyncBufReadExt as _;
    let env = Env::new("");
    let relay = Relay::start(&env, Arc::new(MemoryStore::new(Retention::default()))).await;
    let dir = tempfile::tempdir().unwrap();
    let config = config_file(&env, dir.path(), relay.addr);
    let admin = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let mut child = run_with_json_logs(
        &config,
        admin,
        &[
            ("OAB_CONNECTOR_BUSY_POLL_US", "300"),
            ("OAB_CONNECTOR_WORKER_THREADS", "1"),
        ],
    );
    let mut lines = tokio::io::BufReader::new(child.stderr.take().unwrap()).lines();
    // Up to the admin endpoint's line: the busy-polling line came first.
    let said = tokio::time::timeout(Duration::from_secs(30), async {
        let mut said = None;
        while let Some(line) = lines.next_line().await.unwrap() {
            let v: serde_json::Value = serde_json::from_str(&line)
                .unwrap_or_else(|e| panic!("not a JSON log line ({e}): {line}"));
            let message = v["fields"]["message"].as_str().unwrap_or_default();
            // One worker: no warning about more.
            assert!(
                !(v["level"] == "WARN" && message.contains("busy polling")),
                "{line}"
            );
            if message.starts_with("busy polling after each frame batch") {
                said = Some(v.clone());
            }
            if message.starts_with("admin endpoint listening") {
                return said;
            }
        }
        panic!("the connector exited before its admin endpoint listened");
    })
    .await
    .expect("no admin line within 30 s")
    .expect("no busy-polling line before the admin line");
    assert_eq!(said["fields"]["window_us"], 300);
    assert_eq!(said["fields"]["workers"], 1);
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    let page = metric_until(admin, "oab_connector_link_up", 1).await;
    assert!(page.contains("oab_connector_link_up 1"), "{page}");
    let _ = child.kill().await;

    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_oab-connector"))
        .args(["run", "--busy-poll-us", "20000", "--config"])
        .arg(&config)
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("expected microseconds from 0 (off) to 10000"),
        "{stderr}"
    );
    relay.stop().await;
}
