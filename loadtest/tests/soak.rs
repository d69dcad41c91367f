//! The short soak: 4,000 warm-up and 10,000 measured delegations through the relay (Redis store, its
//! own process) and two `oab-connector` processes, half through a library
//! caller and half through connector A's A2A facade, with the scenario's
//! `--check` assertions: every delegation completed, and no process's RSS,
//! no `state_dir` and no Redis footprint grows with the number of
//! delegations (see `oab_loadtest::scenario::soak` for the bounds).
//!
//! It runs the `oab-relay` and `oab-connector` binaries of the same build
//! profile, which `cargo test --workspace` (and so `scripts/test`) builds;
//! run alone, build them first:
//!
//! ```text
//! cargo build -p oab-relay -p oab-connector && cargo test -p oab-loadtest --test soak
//! ```
//!
//! Size: a debug build does 130-230 delegations/s on 2 shared cores
//! (relay, both connectors, Redis and this process on them), so 10,000
//! plus the probe take 60-80 s; 20,000 took 161 s, over the 2 minutes a
//! test in `scripts/test` may take. A release build would run 20,000 in
//! 40 s but costs a second full build of the workspace (13 minutes here). With 5,000
//! delegations in the second half and the 2 MiB RSS noise floor, this run
//! flags a process growing by more than ~420 B per delegation (today's
//! leaks are 2-25 KB); the full run (200,000 delegations, release build,
//! `oab-loadtest --check soak`, figures in BENCHMARKS.md) holds every
//! footprint to 50 B.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::path::PathBuf;
use std::time::Duration;

use oab_loadtest::relay::{RedisPersistence, RelayMode};
use oab_loadtest::scenario::Common;
use oab_loadtest::scenario::soak::{self, SoakOptions};
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn short_soak_keeps_memory_disk_and_redis_flat() {
    oab_relay::tls::install_crypto_provider();
    let common = Common {
        relay: RelayMode::Process(bin("oab-relay")),
        redis_persistence: RedisPersistence::None,
        drain: Duration::from_secs(30),
        tuning: Tuning::default(),
    };
    let opts = SoakOptions {
        delegations: 10_000,
        in_flight: 8,
        facade_in_flight: 64,
        checkpoints: 10,
        // Long enough that connector A's bounded caches (the facade's 2,000
        // finished tasks, the link's 1,000 finished delegations) are full
        // before the main run: the checks judge the main run's second half.
        probe: 4_000,
        // Short, so Redis is at its plateau well before the second half
        // and idle comes within seconds of the end.
        finished_ttl_ms: 3_000,
        connector_bin: bin("oab-connector"),
        delegation_timeout: Duration::from_secs(60),
        deadline: soak::DELEGATION_DEADLINE,
        rate: 0.0,
    };
    let report = soak::run(&opts, &common).await.unwrap();
    assert!(report.violations.is_empty(), "{report}");
    println!("{report}");
    let checkpoints = report.json["checkpoints"].as_array().unwrap();
    let idle = checkpoints.last().unwrap();
    assert_eq!(idle["phase"], "idle");
    assert_eq!(
        idle["delegations"].as_u64().unwrap(),
        opts.probe + opts.delegations,
        "every delegation of the probe and the main run completed"
    );
    assert!(idle["library"].as_u64().unwrap() > 0 && idle["facade"].as_u64().unwrap() > 0);
}
