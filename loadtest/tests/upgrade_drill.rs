//! A short rolling upgrade on real processes: `oab-loadtest --check
//! upgrade-drill --delegations 20 --ticks 40 --tick-ms 250`, once with
//! SIGKILL and once with SIGTERM. Two `oab-relay` processes of one fleet on
//! one `redis-server`, HAProxy in front, connector A and connector B as
//! `oab-connector` processes, the official-SDK sample agent behind B and a
//! library caller in this process; each process is restarted in turn while
//! every delegation runs. Asserts the scenario's checks (every progress
//! update the agent emitted reaches the caller once and in order, every
//! delegation ends with the agent's outcome and a verified result) and the
//! shape of its JSON, never a timing.
//!
//! Needs the `oab-relay` and `oab-connector` binaries of the same build
//! profile (`cargo test --workspace` builds them), HAProxy and the
//! virtualenv of `scripts/python-env` (`scripts/test` installs both).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::path::PathBuf;
use std::time::Duration;

use oab_loadtest::relay::{ProcessStop, RedisPersistence, RelayMode};
use oab_loadtest::scenario::Common;
use oab_loadtest::scenario::upgrade_drill::{self, UpgradeDrillOptions, find_haproxy};
use oab_loadtest::setup::Tuning;

/// The folder `cargo` puts this profile's binaries in (this test runs from
/// its `deps/` subfolder).
fn bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let path = exe
        .parent()
        .and_then(|deps| deps.parent())
        .map(|profile| profile.join(name))
        .unwrap();
    assert!(
        path.is_file(),
        "no {name} binary at {path:?}: build it first (cargo build -p oab-relay -p oab-connector)"
    );
    path
}

fn options(stop: ProcessStop) -> UpgradeDrillOptions {
    let tree = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let python = tree.join(".venv/bin/python");
    assert!(
        python.is_file(),
        "{} is missing: run scripts/python-env first (it creates .venv with the official a2a-sdk)",
        python.display()
    );
    let haproxy = find_haproxy(None);
    assert!(
        haproxy.is_file(),
        "haproxy is not installed (scripts/test installs Debian's haproxy)"
    );
    UpgradeDrillOptions {
        delegations: 20,
        ticks: 40,
        tick_ms: 250,
        stop,
        step_timeout: Duration::from_secs(60),
        connector_bin: bin("oab-connector"),
        python,
        interop_dir: tree.join("agent-connector/tests/interop"),
        haproxy,
    }
}

/// Runs the drill with `stop` and asserts its checks.
async fn drill(stop: ProcessStop) {
    let common = Common {
        relay: RelayMode::Process(bin("oab-relay")),
        // The drill chooses the AOF policy itself (`always` for SIGKILL).
        redis_persistence: RedisPersistence::None,
        drain: Duration::from_secs(30),
        tuning: Tuning::default(),
    };
    let opts = options(stop);
    let report = upgrade_drill::run(&opts, &common).await.unwrap();
    assert!(report.violations.is_empty(), "{report}");
    let steps: Vec<&str> = report.json["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["process"].as_str().unwrap())
        .collect();
    assert_eq!(
        steps,
        [
            "relay-1",
            "relay-2",
            "connector B",
            "connector A",
            "library caller",
            "redis"
        ],
        "every process restarted once, in order"
    );
    for path in ["library", "facade"] {
        let t = &report.json[path];
        assert_eq!(t["delegations"], 10, "{path}: {t}");
        assert_eq!(t["completed"], 10, "{path}: {t}");
        assert_eq!(t["events"], 10 * 40, "{path}: {t}");
        assert_eq!(t["lost"], 0, "{path}: {t}");
        assert_eq!(t["duplicated"], 0, "{path}: {t}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rolling_upgrade_smoke_every_process_killed_in_turn_loses_and_repeats_nothing() {
    oab_relay::tls::install_crypto_provider();
    drill(ProcessStop::Kill).await;
    drill(ProcessStop::Term).await;
}
