//! Every scenario end to end at toy sizes, with the relay in-process (the
//! relay binary is another package's and is not built for these tests),
//! asserting the correctness checks and the shape of the JSON, never a
//! timing.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::time::Duration;

use oab_loadtest::relay::SharedStoreKind;
use oab_loadtest::relay::{RedisPersistence, RelayMode, StoreKind};
use oab_loadtest::scenario::Common;
use oab_loadtest::scenario::cross_instance::{self, CrossInstanceOptions};
use oab_loadtest::scenario::latency::{self, LatencyOptions};
use oab_loadtest::scenario::sessions::{self, SessionsOptions};
use oab_loadtest::scenario::throughput::{self, ThroughputOptions};
use oab_loadtest::setup::Tuning;

fn common() -> Common {
    Common {
        relay: RelayMode::InProcess,
        redis_persistence: RedisPersistence::None,
        drain: Duration::from_secs(30),
        tuning: Tuning::default(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn throughput_counts_every_frame_on_every_path() {
    let opts = ThroughputOptions {
        sizes: vec![64, 4096],
        stores: vec![StoreKind::Memory, StoreKind::Redis],
        seconds: 0.3,
        max_frames: 20_000,
        // A window smaller than the frames sent, so it is exercised.
        window: 64,
    };
    let report = throughput::run(&opts, &common()).await.unwrap();
    assert!(report.violations.is_empty(), "{:?}", report.violations);
    let cases = report.json["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 6, "2 sizes x (direct, memory, redis)");
    for c in cases {
        let received = c["check"]["received"].as_u64().unwrap();
        assert!(received > 0, "{c}");
        assert_eq!(c["sent"].as_u64().unwrap(), received, "{c}");
        assert!(c["drained"].as_bool().unwrap(), "{c}");
        assert!(c["errors"].as_array().unwrap().is_empty(), "{c}");
        if c["path"] != "direct" {
            assert!(c["vs_direct"].as_f64().unwrap() > 0.0, "{c}");
        }
    }
    assert_eq!(report.json["params"]["window"], 64);
    assert!(report.to_string().contains("relay-redis"));
    // Redis's own rate, by commands and from a script, per size.
    let baselines = report.json["redis_xadd_baseline"].as_array().unwrap();
    assert_eq!(baselines.len(), 2, "{baselines:?}");
    for b in baselines {
        assert_eq!(b["xadd"]["via"], "commands", "{b}");
        assert_eq!(b["script_xadd"]["via"], "script", "{b}");
        for via in ["xadd", "script_xadd"] {
            assert!(b[via]["appended"].as_u64().unwrap() > 0, "{b}");
        }
        assert!(b["script_xadd_vs_xadd"].as_f64().unwrap() > 0.0, "{b}");
    }
    assert!(report.to_string().contains("XADD in a script"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn latency_echoes_every_frame_at_each_load() {
    let opts = LatencyOptions {
        size: 128,
        rates: vec![500.0, 2_000.0],
        max_fraction: Some(0.1),
        max_rate: None,
        probe_seconds: 0.3,
        seconds: 0.3,
        stores: vec![StoreKind::Memory],
        window: 1024,
    };
    let report = latency::run(&opts, &common()).await.unwrap();
    assert!(report.violations.is_empty(), "{:?}", report.violations);
    let levels = report.json["levels"].as_array().unwrap();
    assert_eq!(levels.len(), 3, "two rates and 10% of the probe");
    assert!(report.json["probe"]["frames_per_sec"].as_f64().unwrap() > 0.0);
    let results = report.json["results"].as_array().unwrap();
    assert_eq!(results.len(), 6, "3 levels x (direct, relay-memory)");
    for r in results {
        let sent = r["sent"].as_u64().unwrap();
        assert!(sent > 0, "{r}");
        assert_eq!(r["echo_check"]["received"].as_u64().unwrap(), sent, "{r}");
        assert_eq!(r["rtt"]["count"].as_u64().unwrap(), sent, "{r}");
        assert!(r["rtt"]["p50_us"].as_f64().unwrap() > 0.0, "{r}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_opens_each_peer_once_and_all_stay_alive() {
    let opts = SessionsOptions {
        sessions: 40,
        concurrency: 8,
        store: StoreKind::Memory,
        settle_seconds: 0.0,
    };
    let report = sessions::run(&opts, &common()).await.unwrap();
    assert!(report.violations.is_empty(), "{:?}", report.violations);
    let r = &report.json["result"];
    assert_eq!(r["opened"], 40);
    assert_eq!(r["alive"], 40);
    assert_eq!(r["failed"], 0);
    assert!(r["handshakes_per_sec"].as_f64().unwrap() > 0.0);
    assert_eq!(
        r["rss_relay_only"], false,
        "in-process RSS is the whole process"
    );
}

/// Two in-process relay instances over one redis-server: every frame
/// arrives once and in order on one instance alone, with caller and callee
/// on the same instance of the pair, and across the two (through Redis
/// pub/sub); the instances saw each other before the pair was measured.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cross_instance_delivers_every_frame_on_each_topology() {
    let opts = CrossInstanceOptions {
        stores: vec![SharedStoreKind::Redis],
        size: 256,
        seconds: 0.3,
        max_frames: 5_000,
        // Smaller than the frames sent, so the window is exercised.
        window: 64,
        rates: vec![500.0],
        latency_seconds: 0.3,
        rounds: 1,
        alone: true,
        // Liveness renewed every 500 ms: the pair sees itself quickly.
        node_lease_ms: Some(1500),
    };
    let report = cross_instance::run(&opts, &common()).await.unwrap();
    assert!(report.violations.is_empty(), "{:?}", report.violations);
    let topologies = ["alone", "same-instance", "cross-instance"];
    let tp = report.json["throughput"].as_array().unwrap();
    assert_eq!(tp.len(), 3, "one case per topology");
    for (c, topology) in tp.iter().zip(topologies) {
        assert_eq!(c["topology"], topology, "{c}");
        let case = &c["case"];
        let received = case["check"]["received"].as_u64().unwrap();
        assert!(received > 0, "{c}");
        assert_eq!(case["sent"].as_u64().unwrap(), received, "{c}");
        for field in ["lost", "duplicated", "reordered", "corrupt"] {
            assert_eq!(case["check"][field], 0, "{field}: {c}");
        }
        assert!(case["drained"].as_bool().unwrap(), "{c}");
        assert!(case["errors"].as_array().unwrap().is_empty(), "{c}");
        let nodes = if topology == "alone" { 1.0 } else { 2.0 };
        for n in c["fleet"]["fleet_nodes_after"].as_array().unwrap() {
            assert_eq!(n.as_f64(), Some(nodes), "{c}");
        }
    }
    // Across instances every frame came through relay-2's wake channel.
    let cross = &tp[2];
    let woken = cross["fleet"]["wake_entries"][1].as_f64().unwrap();
    let received = cross["case"]["check"]["received"].as_u64().unwrap() as f64;
    assert!(woken >= received, "{woken} wake-ups for {received} frames");
    let lat = report.json["latency"].as_array().unwrap();
    assert_eq!(lat.len(), 3, "one level per topology");
    for l in lat {
        let level = &l["level"];
        let sent = level["sent"].as_u64().unwrap();
        assert!(sent > 0, "{l}");
        assert_eq!(
            level["echo_check"]["received"].as_u64().unwrap(),
            sent,
            "{l}"
        );
        for check in ["down_check", "echo_check"] {
            for field in ["lost", "duplicated", "reordered", "corrupt"] {
                assert_eq!(level[check][field], 0, "{check}.{field}: {l}");
            }
        }
        assert!(level["errors"].as_array().unwrap().is_empty(), "{l}");
    }
    let summary = report.json["throughput_summary"].as_array().unwrap();
    let cross = summary
        .iter()
        .find(|s| s["topology"] == "cross-instance")
        .unwrap();
    assert!(cross["vs_same_instance"].as_f64().unwrap() > 0.0, "{cross}");
    assert!(report.to_string().contains("cross-instance"));
}
