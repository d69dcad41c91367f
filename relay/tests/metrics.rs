//! The admin listener: Prometheus text that parses, counters that move,
//! labels that cannot be inflated by clients.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use std::collections::BTreeSet;
use std::sync::Arc;

use common::*;
use oab_relay::store::{MemoryStore, Retention};
use oab_testkit::raw_client::RawClient;
use oab_wire::identity::Identity;
use oab_wire::{Direction, InstanceId, KeyId, PeerId};

/// Parses Prometheus text exposition strictly enough to catch a broken
/// output: every sample line is `name{labels} value`, every metric has HELP
/// and TYPE. Returns the set of series (name + labels).
fn parse_exposition(text: &str) -> BTreeSet<String> {
    let body = text.split("\r\n\r\n").nth(1).unwrap_or(text);
    let mut typed = BTreeSet::new();
    let mut series = BTreeSet::new();
    for line in body.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut parts = rest.split(' ');
            let name = parts.next().unwrap();
            let kind = parts.next().unwrap();
            assert!(["counter", "gauge", "histogram"].contains(&kind), "{line}");
            typed.insert(name.to_string());
            continue;
        }
        if line.starts_with("# HELP ") || line.is_empty() {
            continue;
        }
        let (name_labels, value) = line
            .rsplit_once(' ')
            .unwrap_or_else(|| panic!("bad line {line}"));
        value
            .parse::<f64>()
            .unwrap_or_else(|_| panic!("bad value in {line}"));
        let name = name_labels.split('{').next().unwrap();
        let base = name
            .trim_end_matches("_bucket")
            .trim_end_matches("_sum")
            .trim_end_matches("_count");
        assert!(
            typed.contains(name) || typed.contains(base),
            "untyped sample {line}"
        );
        if let Some(labels) = name_labels.strip_prefix(name)
            && !labels.is_empty()
        {
            assert!(labels.starts_with('{') && labels.ends_with('}'), "{line}");
        }
        series.insert(name_labels.to_string());
    }
    series
}

fn sample(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series).and_then(|v| v.trim().parse().ok()))
        .unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_parse_move_and_resist_label_inflation() {
    let mut env = TestEnv::new(
        "[rate]\nconnects_per_second_per_ip = 1000000\nconnects_burst_per_ip = 1000000\n",
    );
    env.config.relay.max_handshakes = 4096;
    env.config.relay.max_handshakes_per_source = 4096;
    let relay = TestRelay::start(&env, Arc::new(MemoryStore::new(Retention::default()))).await;
    let before = relay.metrics().await;
    let series_before = parse_exposition(&before);
    assert!(before.starts_with("HTTP/1.1 200") || before.starts_with("HTTP/1.0 200"));
    for path in ["/healthz", "/readyz"] {
        assert!(
            http_get(relay.admin, path).await.contains(" 200 "),
            "{path}"
        );
    }

    // Counters move as a delegation runs.
    let mut b = relay.client(&env.callee).await;
    let mut a = relay.client(&env.caller).await;
    a.send(&open_frame("m1", b"{}")).await.unwrap();
    await_ack(&mut a, "m1", Direction::Down, 1).await;
    b.send(&data(
        "m1",
        Direction::Up,
        1,
        None,
        bytes::Bytes::from_static(b"x"),
    ))
    .await
    .unwrap();
    await_ack(&mut b, "m1", Direction::Up, 1).await;
    let after = relay.metrics().await;
    parse_exposition(&after);
    assert_eq!(sample(&after, "oab_handshakes_total{result=\"ok\"}"), 2.0);
    assert_eq!(sample(&after, "oab_sessions"), 2.0);
    assert_eq!(sample(&after, "oab_delegations_opened_total"), 1.0);
    assert!(sample(&after, "oab_frames_total{direction=\"in\",type=\"data\"}") >= 1.0);
    assert_eq!(
        sample(&after, "oab_peer_sessions{peer=\"acme/caller\"}"),
        1.0
    );
    assert!(sample(&after, "oab_ack_latency_seconds_count") >= 2.0);

    // 10,000 handshakes claiming random peer ids add no series.
    let series_mid = parse_exposition(&after);
    let target = relay.target();
    let mut tasks = tokio::task::JoinSet::new();
    for worker in 0..16u32 {
        let target = target.clone();
        tasks.spawn(async move {
            for i in 0..625u32 {
                let claimed = PeerId::new(&format!("attacker{worker}/p{i}")).unwrap();
                let id = Identity::generate(claimed, KeyId::new("k").unwrap());
                let r = RawClient::connect(&target, &id, InstanceId::random()).await;
                assert!(r.is_err(), "unknown peers are refused");
            }
        });
    }
    while let Some(r) = tasks.join_next().await {
        r.unwrap();
    }
    let end = relay.metrics().await;
    let series_end = parse_exposition(&end);
    // Every refused handshake is counted under its cause; should one be
    // counted elsewhere (a timeout on a starved machine, say), the message
    // names where.
    let handshakes: Vec<&str> = end
        .lines()
        .filter(|l| l.starts_with("oab_handshakes_total{"))
        .collect();
    assert_eq!(
        sample(&end, "oab_handshakes_total{result=\"auth_failed\"}"),
        10_000.0,
        "{handshakes:#?}"
    );
    let added: Vec<&String> = series_end.difference(&series_mid).collect();
    assert!(
        added
            .iter()
            .all(|s| s.starts_with("oab_handshakes_total{result=\"auth_failed\"}")),
        "only the fixed auth_failed series may appear: {added:?}"
    );
    assert!(!end.contains("attacker"));
    assert!(series_before.len() <= series_end.len());
    relay.stop().await;
}
