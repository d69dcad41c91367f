//! `oab-loadtest`: parses flags, sets up tracing and the runtime, runs one
//! scenario from the library, prints its tables and writes its JSON.

use std::io::IsTerminal as _;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Args, Parser, Subcommand, ValueEnum};
use oab_loadtest::connector_process::find_connector_bin;
use oab_loadtest::relay::{
    ProcessStop, RedisPersistence, RelayMode, SharedStoreKind, StoreKind, find_relay_bin,
};
use oab_loadtest::report::Report;
use oab_loadtest::scenario::a2a_sdk::A2aSdkOptions;
use oab_loadtest::scenario::cancel_race::CancelRaceOptions;
use oab_loadtest::scenario::cross_instance::CrossInstanceOptions;
use oab_loadtest::scenario::delegations::{DelegationsMode, DelegationsOptions};
use oab_loadtest::scenario::latency::LatencyOptions;
use oab_loadtest::scenario::reconnect_storm::{LinkFault, ReconnectStormOptions};
use oab_loadtest::scenario::sessions::SessionsOptions;
use oab_loadtest::scenario::slow_consumer::SlowConsumerOptions;
use oab_loadtest::scenario::soak::SoakOptions;
use oab_loadtest::scenario::throughput::ThroughputOptions;
use oab_loadtest::scenario::upgrade_drill::{UpgradeDrillOptions, find_haproxy};
use oab_loadtest::scenario::{self, Common};
use oab_loadtest::setup::Tuning;

/// The allocator of the relay's and the connector's binaries (jemalloc),
/// so the connectors and the relay this process runs in-process are
/// measured as operators run them. With glibc's `malloc`, `malloc`, `free`
/// and `malloc_consolidate` were about 17% of this process's samples at 256
/// delegations in flight (BENCHMARKS.md, "Delegations end to end").
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

const ABOUT: &str = "Benchmarks for OAB Relay, on this machine's loopback.";

const LONG_ABOUT: &str = "\
Benchmarks for OAB Relay, on this machine's loopback.

Each scenario starts what it needs (the relay, a redis-server for the Redis
store, a direct WSS baseline), runs bounded in time and count, prints a table,
writes every figure and parameter as JSON (--out, default
loadtest-results/<scenario>.json), and stops everything it started, also on
Ctrl-C.

The relay runs as a child process (the oab-relay binary next to this one, or
--relay-bin): its memory and CPU are its own, and its pid is logged so that
`perf record -g -p <pid>` can profile it during a run. --relay in-process runs
it inside this process instead. The relay and connector processes log at
OAB_LOG=warn, or at the filter in OAB_LOADTEST_CHILD_LOG (to measure what
logging costs: `OAB_LOADTEST_CHILD_LOG=info` is a relay's default).

The generated relay config differs from the defaults only where a load test
would otherwise measure a limiter: peer frame rate and connection rate limits
raised, max_log_entries 4096 and finished_ttl_ms 1000 (bounded memory per
benchmark delegation), idle and handshake timeouts raised. The JSON records
them under relay.tuning.

Scenarios:
  throughput  frames/s and MB/s per payload size, relay (memory and/or Redis
              store) against a direct WSS connection, with ratios; on Redis
              also against that redis-server's own pipelined XADD rate and
              the same XADDs from a script that does nothing else
  latency     round-trip p50/p90/p99/p99.9 at several offered loads,
              relay against direct
  sessions    relay memory per idle authenticated session, handshakes/s
  delegations whole delegations/s connector -> relay -> connector (open,
              10 events, signed result, verify) at 1 and 256 in flight,
              round-trip p50/p99, connector overhead per event vs raw frames;
              --mode cp: OpenAB control-plane round trips/s, CP primary ->
              connector -> relay -> connector -> CP worker vs direct
  cancel-race delegations cancelled at random around completion: caller
              and callee must agree on exactly one terminal each
  reconnect-storm
              delegations streaming while proxies cut, reset, stall
              (half-open) and hold away both connectors' links at random
              (and --kill-relay-every SIGKILLs and restarts the relay,
              --kill-redis-every SIGKILLs and restarts redis-server on its
              AOF): the events the caller received equal those the callee
              emitted, one terminal at the caller by a deadline matching
              the relay's log, one executor run each; reconnect-to-replay
              p50/p99; longest pause per Redis outage
  slow-consumer
              pairs stream while one receiver stops reading for longer
              than the relay's slow_consumer_ms: its close (4001), the
              relay's RSS, its exact resume, the pairs' p99 during/before
  cross-instance
              two relay instances over one Redis (or Redis Cluster):
              throughput and round-trip latency with caller and callee on
              one instance against one on each, in the same run, with
              ratios
  soak        200,000 delegations (library caller and A2A facade ->
              relay on Redis -> connector B's A2A driver -> an agent
              answering at once), relay and both connectors as their own
              processes: RSS of each, both state_dirs, Redis keys and
              used_memory at checkpoints; growth per delegation over the
              second half and back at idle; Redis bytes per finished
              delegation
  a2a-sdk     blocking A2A SendMessage, official Python SDK client and
              agent, direct and through facade -> relay (Redis) -> driver
              (each its own process): delegations/s, CPU per delegation
              of every process, Redis commands per delegation
  upgrade-drill
              a rolling upgrade under load: two relays (Redis, AOF) behind
              HAProxy, both connectors and the library caller, Redis, each
              restarted in turn (SIGKILL or SIGTERM); every delegation
              against what the official-SDK agent emitted
  chart       an SVG of throughput.json and latency.json (no scenario)

Short correctness smoke runs (each well under 20 s in a debug build):
  oab-loadtest --check cancel-race --count 200
  oab-loadtest --check reconnect-storm --delegations 4 --events 100 --cuts 20
  oab-loadtest --check reconnect-storm --delegations 6 --events 60 --event-interval-ms 20 \
      --cuts 6 --faults away,stall,reset
  oab-loadtest --check --redis-persistence aof-always reconnect-storm --delegations 20 --events 300 \
      --cuts 0 --kill-redis-every 3
  oab-loadtest --check slow-consumer --pairs 2 --stall-seconds 2
  oab-loadtest --check cross-instance --rounds 1 --seconds 1 --latency-seconds 1 --node-lease-ms 1500

The short soak (about 90 s in a debug build; needs oab-connector built):
  oab-loadtest --check soak --delegations 10000 --finished-ttl-ms 3000 --probe 500 \
      --in-flight 8 --facade-in-flight 64

The short upgrade drill (about 15 s in a debug build; needs oab-connector,
haproxy and scripts/python-env):
  oab-loadtest --check upgrade-drill --delegations 20 --ticks 40 --tick-ms 250 --stop term

Exit status: 0 done; 1 a correctness invariant failed and --check was given
(frames lost, duplicated, reordered or corrupt; sessions lost; a delegation
without exactly one verified terminal, or without its terminal at the
caller by a deadline; caller, callee and the relay's log disagreeing; an
event lost, duplicated, reordered or never emitted; an executor run twice;
a footprint growing with the delegations in soak; never a timing); 2 the run could not be carried out; 130 interrupted.";

#[derive(Debug, Parser)]
#[command(name = "oab-loadtest", version, about = ABOUT, long_about = LONG_ABOUT)]
struct Cli {
    /// Exit with status 1 if a correctness invariant fails: a frame lost,
    /// duplicated, reordered or corrupt, or a session lost; a delegation
    /// without exactly one verified terminal (or without its terminal at the
    /// caller by a deadline), caller, callee and the relay's log disagreeing
    /// on it, an event lost, duplicated, reordered or never emitted, or an
    /// executor run more than once; in `soak`, a process's memory, a
    /// `state_dir` or Redis growing with the number of delegations. Timings
    /// never fail a run.
    #[arg(long, global = true)]
    check: bool,
    /// Where to write the JSON results [default: loadtest-results/<scenario>.json].
    #[arg(long, global = true, value_name = "FILE")]
    out: Option<PathBuf>,
    /// How to run the relay: `process` (the oab-relay binary as a child),
    /// `in-process`, or `auto` (process if the binary is found, else in-process).
    #[arg(long, global = true, value_enum, default_value_t = RelayArg::Auto)]
    relay: RelayArg,
    /// The oab-relay binary [default: next to this executable].
    #[arg(long, global = true, value_name = "PATH")]
    relay_bin: Option<PathBuf>,
    /// Persistence of the redis-server behind the Redis store: `none`,
    /// `aof` (append-only file, fsync every second, as most production
    /// runs), or `aof-always` (fsync before every reply: nothing
    /// acknowledged is lost to a SIGKILL).
    #[arg(long, global = true, value_enum, default_value_t = PersistenceArg::None)]
    redis_persistence: PersistenceArg,
    /// After a case stops sending, seconds to wait for outstanding frames
    /// before counting them as lost.
    #[arg(long, global = true, default_value_t = 30.0, value_name = "SECONDS")]
    drain_seconds: f64,
    /// The relay's store.max_log_entries for the run (at least the window).
    #[arg(long, global = true, default_value_t = 4096, value_name = "N")]
    max_log_entries: u64,
    /// The relay's limits.append_batches_in_flight for the run (default: the
    /// relay's own default).
    #[arg(long, global = true, value_name = "N")]
    append_batches: Option<usize>,
    /// Async worker threads of this process (its endpoints and its
    /// in-process connectors) [default: one per CPU]. The relay child takes
    /// OAB_RELAY_WORKER_THREADS from the environment.
    #[arg(long, global = true, value_name = "N")]
    worker_threads: Option<usize>,
    /// Busy polling in this process, microseconds (0, the default: off), as
    /// `oab-relay --busy-poll-us` does it: after each frame batch an
    /// in-process connector reads, this process's runtime keeps polling its
    /// sockets for that long. The relay child takes OAB_RELAY_BUSY_POLL_US
    /// from the environment.
    #[arg(long, global = true, value_name = "US", value_parser = oab_ops::busy_poll::parse_window)]
    busy_poll_us: Option<Duration>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum RelayArg {
    Auto,
    Process,
    InProcess,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum PersistenceArg {
    None,
    Aof,
    AofAlways,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum ModeArg {
    Library,
    Cp,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum StoreArg {
    Memory,
    Redis,
    Both,
}

impl StoreArg {
    fn stores(self) -> Vec<StoreKind> {
        match self {
            StoreArg::Memory => vec![StoreKind::Memory],
            StoreArg::Redis => vec![StoreKind::Redis],
            StoreArg::Both => vec![StoreKind::Memory, StoreKind::Redis],
        }
    }
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Frames/s and MB/s through the relay per payload size, against a direct
    /// WSS connection between the same two endpoints measured in the same run.
    ///
    /// Per payload size and path (direct, relay on each store), a fresh
    /// delegation: the caller pipelines Data frames on its down log for
    /// --seconds (or --max-frames), keeping at most --window frames beyond the
    /// highest sequence both acknowledged (by the relay; directly by the
    /// callee) and received; the callee checks and counts every frame.
    /// Reports frames/s, payload MB/s, relay/direct ratio, one-way delay under
    /// that load, relay CPU per frame, and lost/duplicated/reordered frames.
    Throughput(ThroughputArgs),
    /// Round-trip latency percentiles at several offered loads, relay against
    /// direct.
    ///
    /// The caller sends down Data frame n stamped with its send time, on a
    /// fixed schedule (open loop: frame i at start + i/rate); the callee echoes
    /// it as up Data n-1 with the same payload; the caller records receipt -
    /// send on the same clock (both endpoints are in this process). Through
    /// the relay that is 4 WebSocket hops and 2 durable appends, directly 2
    /// hops. Loads: --rates plus --max-fraction of the maximum pipelined
    /// throughput of the first relay store (a --probe-seconds probe, or
    /// --max-rate). p99 (sched) measures from the scheduled send time, so a
    /// saturated sender shows instead of hiding (coordinated omission).
    Latency(LatencyArgs),
    /// Relay memory per idle authenticated session, and handshakes per second.
    ///
    /// Generates --sessions peers (each its own identity in the relay
    /// config), reads the relay's VmRSS from /proc/<pid>/status, opens every
    /// session (--concurrency handshakes at a time: TCP, TLS 1.3, upgrade,
    /// challenge, signed hello, welcome), reads VmRSS again, checks each
    /// session answers a Ping, closes them and reads VmRSS once more.
    Sessions(SessionsArgs),
    /// End-to-end delegations per second through the relay, connector to
    /// connector, and the connector's overhead per event against raw frames.
    ///
    /// A caller connector delegates to a callee connector whose in-process
    /// executor emits --events status events and completes; each delegation
    /// is open -> accepted -> events -> signed result -> verify() on the
    /// caller. Per --in-flight level (closed loop), for --seconds: verified
    /// delegations/s and delegate-to-verified round-trip p50/p99. The same
    /// run measures raw pipelined Data frames of one event's payload size
    /// through the same relay; overhead/event = 1/(connector events/s) -
    /// 1/(raw frames/s). --check fails on any delegation without exactly one
    /// verified terminal.
    ///
    /// --mode cp: an OpenAB primary (a CP client) keeps --in-flight
    /// `cp/delegate` going on one connection to connector A's CP endpoint;
    /// each becomes a signed delegation through the relay (TLS) to connector
    /// B, whose endpoint hands it to a CP worker that completes at once.
    /// Round trips/s and p50/p99 per level, beside the same primary over one
    /// direct WebSocket to a worker. --check fails on any delegation
    /// without exactly one completed result, or on a closed primary.
    Delegations(DelegationsArgs),
    /// Cancels racing completion: both sides agree on exactly one terminal.
    ///
    /// --count delegations (--in-flight at once); the callee's executor
    /// finishes after a random 0..--turns scheduler turns, the caller cancels
    /// after a random 0..--turns turns. The caller's view (the terminal
    /// wait() returns, verified when signed) is compared with the callee's
    /// (the terminal its audit trail recorded once the relay acknowledged
    /// it). Reports the split between outcomes; --check fails on a
    /// disagreement or a missing or duplicate terminal.
    CancelRace(CancelRaceArgs),
    /// Link faults on both connectors, relay kills and Redis outages while
    /// delegations stream events.
    ///
    /// Each connector reaches the relay through its own fault proxy.
    /// --delegations delegations (--in-flight at once) stream --events paced
    /// status events each while one driver per proxy applies --cuts faults
    /// (half per link) chosen from --faults: cuts, resets, half-open stalls,
    /// and `away` (the fresh link stalls right after its reconnect while
    /// delegations finish at the callee); with --kill-relay-every the relay
    /// child is killed (SIGKILL) and restarted on the same port and Redis
    /// store; with --kill-redis-every redis-server is killed (SIGKILL) and
    /// restarted on its AOF while delegations are cancelled. Per delegation:
    /// the status events the caller received against those the callee's
    /// executor emitted (lost, duplicated, reordered, unexpected: must be
    /// 0), exactly one terminal at the caller within
    /// --terminal-grace-seconds of the executor finishing, one acknowledged
    /// terminal at the callee, one executor run, and on Redis the caller's
    /// terminal and last sequence against the relay's record; the time from
    /// a reconnect to the first replayed event, p50/p99; per Redis outage
    /// its length and the longest pause over it. --check fails on any
    /// invariant, never on timing.
    ReconnectStorm(ReconnectStormArgs),
    /// One receiver stops reading while other pairs stream.
    ///
    /// --pairs pairs (own peers, own delegation) stream paced Data frames
    /// (--rate per second, --size payload) for --before-seconds +
    /// --stall-seconds + --after-seconds; one more delegation streams
    /// (--stalled-rate, --stalled-size) to a receiver that reads nothing
    /// for --stall-seconds. The generated relay config sets
    /// limits.slow_consumer_ms (--slow-consumer-ms, recorded in the JSON
    /// tuning). Reports whether the stalled receiver was closed with 4001
    /// slow_consumer (or only switched to replay), the relay's VmRSS growth
    /// during the stall, its reconnect and Resume from its cursor (every
    /// frame exactly once, in order), and the pairs' one-way p99 during the
    /// stall against before it (target: at most +10%). --check fails on
    /// lost, duplicated, reordered or corrupt frames only.
    SlowConsumer(SlowConsumerArgs),
    /// Cross-instance delivery against one instance: two relay instances
    /// over one store, in the same run.
    ///
    /// Starts a redis-server (--store redis-cluster: a three-master Redis
    /// Cluster) and relay instances on it, each a fleet member (--set
    /// fleet.node=relay-N), and before measuring with two instances waits
    /// (bounded) until each instance's oab_fleet_nodes (admin /metrics)
    /// shows both. Topologies: alone (relay-1 with no other instance
    /// running: the single-relay baseline; --no-alone skips it),
    /// same-instance (caller and callee on relay-1 while relay-2 runs:
    /// nothing is published, the receiver is subscribed where it is appended)
    /// and cross-instance (caller on relay-1, callee on relay-2: each frame
    /// goes relay-1 -> Redis PUBLISH -> relay-2). Per topology: pipelined
    /// --size frames/s for --seconds (the throughput scenario's windowed
    /// method) and round-trip p50/p90/p99 at each of --rates (the latency
    /// scenario's echo). Same and cross alternate for --rounds rounds, in
    /// the other order each round; the tables give medians, cross/same
    /// ratios per round and of the medians, relay CPU per frame (every
    /// instance together) and redis CPU per frame (INFO cpu). --check
    /// fails on lost, duplicated, reordered or corrupt frames, never on a
    /// timing.
    CrossInstance(CrossInstanceArgs),
    /// Draws an SVG chart of the throughput and latency results.
    ///
    /// Reads throughput.json and latency.json from --in (either may be
    /// missing) and writes a self-contained SVG: (a) frames/s per payload
    /// size, relay vs direct, grouped bars on a log scale; (b) round-trip
    /// p50/p99 per offered load, relay vs direct. Runs nothing; --out is
    /// the SVG file.
    Chart(ChartArgs),
    /// Many delegations through the relay and two connector processes:
    /// does anything grow with their number?
    ///
    /// The relay (oab-relay, Redis store) and two `oab-connector run`
    /// processes: connector A serves the A2A facade, connector B drives an
    /// agent inside this process that answers every message with a
    /// completed task at once. Half the delegations go through a library
    /// connector in this process (delegate, wait, verify, --in-flight
    /// workers), half are blocking A2A SendMessage requests (with the
    /// delegation profile) to connector A's facade (--facade-in-flight
    /// workers); with either set to 0, all go the other way. First a retention probe (--probe delegations,
    /// sampled at once: Redis keys and bytes and state_dir files and bytes
    /// per finished delegation), then --delegations sampled at
    /// --checkpoints points, then idle until Redis has dropped the finished
    /// delegations (store.finished_ttl_ms plus 10 s at most) and a last
    /// sample. --check fails when a delegation did not complete, or when
    /// a process's RSS grows by 50 B or more per delegation over the second
    /// half or from the start of the second half to idle, or a state_dir or Redis
    /// is not back at idle within 50 B per delegation (growth under a
    /// noise floor never fails).
    Soak(SoakArgs),
    /// Blocking A2A SendMessage calls, official Python SDK client and
    /// agent, directly and through OAB, with each process's CPU per
    /// delegation.
    ///
    /// bench.py --blocking (the official a2a-sdk client) -> sample_agent.py
    /// (the official SDK server, completing each call at once), once
    /// directly and once through connector A's facade -> the relay (Redis
    /// store) -> connector B's driver, all `oab-connector run` / `oab-relay`
    /// child processes, --rounds times alternating the order. Reports
    /// delegations/s against direct, call latency, CPU µs per delegation of
    /// the agent, the relay, both connectors and Redis, and Redis commands
    /// per delegation. Needs the virtualenv of scripts/python-env. --check
    /// fails on a failed call.
    A2aSdk(A2aSdkArgs),
    /// A rolling upgrade while delegations run: every process restarted in
    /// turn.
    ///
    /// Two relay instances (one fleet on one redis-server with an AOF)
    /// behind HAProxy, connector A (facade) and connector B (driver in
    /// front of the official-SDK sample agent) as `oab-connector run`
    /// processes with state folders, and a library caller in this process.
    /// --delegations run, half through each caller path, each --ticks
    /// progress updates --tick-ms apart. Then relay-1, relay-2, connector
    /// B, connector A, the library caller and Redis are restarted one at a
    /// time (--stop kill: SIGKILL; term: SIGTERM), each once every running
    /// delegation carries traffic again after the one before. --check
    /// fails when a delegation's progress updates differ from what the
    /// agent emitted (lost, duplicated, reordered), its outcome differs
    /// from the agent's (unknown included), its result does not verify, or
    /// traffic does not resume within --step-timeout-seconds. Needs
    /// haproxy and the virtualenv of scripts/python-env.
    UpgradeDrill(UpgradeDrillArgs),
}

#[derive(Debug, Args)]
struct UpgradeDrillArgs {
    /// Delegations running through the restarts, both paths together.
    #[arg(long, default_value_t = 500)]
    delegations: u32,
    /// Progress updates per delegation.
    #[arg(long, default_value_t = 120)]
    ticks: u32,
    /// Milliseconds between two progress updates.
    #[arg(long, default_value_t = 1000)]
    tick_ms: u64,
    /// How each process is stopped before it is started again.
    #[arg(long, value_enum, default_value = "kill")]
    stop: ProcessStop,
    /// How long traffic may take to resume after each restart.
    #[arg(long, default_value_t = 60.0)]
    step_timeout_seconds: f64,
    /// The oab-connector binary [default: next to this executable].
    #[arg(long, value_name = "PATH")]
    connector_bin: Option<PathBuf>,
    /// The Python with the official a2a-sdk [default: .venv/bin/python of
    /// the source tree, made by scripts/python-env].
    #[arg(long, value_name = "PATH")]
    python: Option<PathBuf>,
    /// The folder with sample_agent.py [default:
    /// agent-connector/tests/interop of the source tree].
    #[arg(long, value_name = "DIR")]
    interop_dir: Option<PathBuf>,
    /// The haproxy binary [default: haproxy on PATH, else /usr/sbin/haproxy].
    #[arg(long, value_name = "PATH")]
    haproxy: Option<PathBuf>,
}

#[derive(Debug, Args)]
struct A2aSdkArgs {
    /// Measured calls per path and round.
    #[arg(long, default_value_t = 2_000)]
    tasks: u64,
    /// Calls in flight at once.
    #[arg(long, default_value_t = 8)]
    concurrency: u64,
    /// Unmeasured calls before each run.
    #[arg(long, default_value_t = 50)]
    warmup: u64,
    /// Rounds, each running both paths (the order alternates).
    #[arg(long, default_value_t = 2)]
    rounds: u32,
    /// The oab-connector binary [default: next to this executable].
    #[arg(long, value_name = "PATH")]
    connector_bin: Option<PathBuf>,
    /// The Python with the official a2a-sdk [default: .venv/bin/python of
    /// the source tree, made by scripts/python-env].
    #[arg(long, value_name = "PATH")]
    python: Option<PathBuf>,
    /// The folder with bench.py and sample_agent.py [default:
    /// agent-connector/tests/interop of the source tree].
    #[arg(long, value_name = "DIR")]
    interop_dir: Option<PathBuf>,
}

#[derive(Debug, Args)]
struct SoakArgs {
    /// Delegations of the main run, both paths together.
    #[arg(long, default_value_t = 200_000)]
    delegations: u64,
    /// Library-path workers, one delegation in flight each (0: every
    /// delegation goes through the facade).
    #[arg(long, default_value_t = 16)]
    in_flight: usize,
    /// Facade-path workers, one blocking SendMessage in flight each (0:
    /// every delegation goes through the library caller).
    #[arg(long, default_value_t = 128)]
    facade_in_flight: usize,
    /// Samples during the main run.
    #[arg(long, default_value_t = 20)]
    checkpoints: u32,
    /// Delegations of the retention probe before the main run (keep it
    /// short of --finished-ttl-ms, so all of them are still retained when
    /// it is sampled).
    #[arg(long, default_value_t = 2_000)]
    probe: u64,
    /// The relay's store.finished_ttl_ms: how long Redis keeps a finished
    /// delegation. Keep it well under half the run, so Redis is at its
    /// plateau in the second half.
    #[arg(long, default_value_t = 10_000, value_name = "MS")]
    finished_ttl_ms: u64,
    /// The oab-connector binary [default: next to this executable].
    #[arg(long, value_name = "PATH")]
    connector_bin: Option<PathBuf>,
    /// How long one delegation may take before it counts as failed.
    #[arg(long, default_value_t = 60.0, value_name = "SECS")]
    delegation_timeout_seconds: f64,
    /// Each delegation's deadline, seconds (the callee keeps a request
    /// against replays for at most its replay window, whatever the
    /// deadline). Up to the connectors' max_deadline_ms of 1 h.
    #[arg(long, default_value_t = 10.0, value_name = "SECS")]
    deadline_seconds: f64,
    /// Delegations started per second, both paths together; 0 runs as fast
    /// as the workers go. Give enough workers for the rate (in flight =
    /// rate x round trip).
    #[arg(long, default_value_t = 0.0, value_name = "PER_SECOND")]
    rate: f64,
}

#[derive(Debug, Args)]
struct SlowConsumerArgs {
    /// Healthy (caller, callee) pairs streaming meanwhile.
    #[arg(long, default_value_t = 4)]
    pairs: usize,
    /// Frames per second per healthy pair.
    #[arg(long, default_value_t = 1000.0)]
    rate: f64,
    /// Payload per healthy pair frame (e.g. 256, 1k).
    #[arg(long, default_value = "256", value_parser = parse_size)]
    size: usize,
    /// Frames per second towards the stalled receiver.
    #[arg(long, default_value_t = 1000.0)]
    stalled_rate: f64,
    /// Payload per frame towards the stalled receiver (large, so socket
    /// buffers and the relay's queue fill soon).
    #[arg(long, default_value = "8k", value_parser = parse_size)]
    stalled_size: usize,
    /// Streaming time before the stall, seconds.
    #[arg(long, default_value_t = 2.0)]
    before_seconds: f64,
    /// How long the receiver reads nothing, seconds (> slow_consumer_ms).
    #[arg(long, default_value_t = 4.0)]
    stall_seconds: f64,
    /// Streaming time after the stall, seconds.
    #[arg(long, default_value_t = 2.0)]
    after_seconds: f64,
    /// The relay's limits.slow_consumer_ms for the run.
    #[arg(long, default_value_t = 500)]
    slow_consumer_ms: u64,
    /// The relay's store.
    #[arg(long, value_enum, default_value_t = StoreArg::Memory)]
    store: StoreArg,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum SharedStoreArg {
    Redis,
    RedisCluster,
    Both,
}

impl SharedStoreArg {
    fn stores(self) -> Vec<SharedStoreKind> {
        match self {
            SharedStoreArg::Redis => vec![SharedStoreKind::Redis],
            SharedStoreArg::RedisCluster => vec![SharedStoreKind::RedisCluster],
            SharedStoreArg::Both => vec![SharedStoreKind::Redis, SharedStoreKind::RedisCluster],
        }
    }
}

#[derive(Debug, Args)]
struct CrossInstanceArgs {
    /// The shared store: `redis` (one redis-server, persistence as
    /// --redis-persistence), `redis-cluster` (three masters, AOF everysec),
    /// or `both` (one fleet each, in turn).
    #[arg(long, value_enum, default_value_t = SharedStoreArg::Redis)]
    store: SharedStoreArg,
    /// Payload size (a k suffix means KiB).
    #[arg(long, value_parser = parse_size, default_value = "256")]
    size: usize,
    /// Sending time per throughput case, seconds.
    #[arg(long, default_value_t = 3.0)]
    seconds: f64,
    /// Frames per throughput case at most.
    #[arg(long, default_value_t = 5_000_000)]
    max_frames: u64,
    /// Unconfirmed frames in flight at most (the relay announces 1,024);
    /// also the latency cases' frames sent and not yet echoed at most.
    #[arg(long, default_value_t = 1024)]
    window: u64,
    /// Fixed offered loads of the latency cases, frames per second,
    /// comma-separated (keep them below the cross-instance throughput).
    #[arg(long, value_delimiter = ',', default_value = "1000,10000")]
    rates: Vec<f64>,
    /// Sending time per latency level, seconds.
    #[arg(long, default_value_t = 3.0)]
    latency_seconds: f64,
    /// Rounds of same-instance and cross-instance cases (alternating).
    #[arg(long, default_value_t = 3)]
    rounds: u32,
    /// Skip the baseline of one instance with no other running.
    #[arg(long)]
    no_alone: bool,
    /// fleet.node_lease_ms of every instance [default: the relay's]; they
    /// see each other within a third of it.
    #[arg(long, value_name = "MS")]
    node_lease_ms: Option<u64>,
}

#[derive(Debug, Args)]
struct ChartArgs {
    /// The folder holding throughput.json and latency.json.
    #[arg(long = "in", default_value = "loadtest-results", value_name = "DIR")]
    input: PathBuf,
}

#[derive(Debug, Args)]
struct DelegationsArgs {
    /// library: the connector's caller API; cp: OpenAB's control-plane
    /// protocol through the connectors' CP endpoints (--events and
    /// --baseline-seconds do not apply).
    #[arg(long, value_enum, default_value_t = ModeArg::Library)]
    mode: ModeArg,
    /// Delegations in flight at once, comma-separated: one measurement each.
    #[arg(long, value_delimiter = ',', default_value = "1,256")]
    in_flight: Vec<usize>,
    /// Status events each delegation's executor emits.
    #[arg(long, default_value_t = 10)]
    events: u32,
    /// Time per in-flight level, seconds.
    #[arg(long, default_value_t = 5.0)]
    seconds: f64,
    /// Delegations per level at most.
    #[arg(long, default_value_t = 1_000_000)]
    max_delegations: u64,
    /// Time of the raw-frame baseline per store, seconds.
    #[arg(long, default_value_t = 2.0)]
    baseline_seconds: f64,
    /// Relay store(s) to measure.
    #[arg(long, value_enum, default_value_t = StoreArg::Redis)]
    store: StoreArg,
    /// cp mode: the CP clients (the primary and the worker) behave as
    /// OpenAB's own client does: Nagle's algorithm on (no TCP_NODELAY) and
    /// each frame in a write of its own (the worker's ack, then its result;
    /// the primary's ack of a result, then its next cp/delegate). By default
    /// they set TCP_NODELAY and write what they have at once together.
    #[arg(long)]
    cp_nagle: bool,
    /// cp mode: measure the external CP server at this URL
    /// (`ws://host:port/path`, e.g. an openab-cp's `ws://127.0.0.1:9800/cp`)
    /// instead of the direct and relay paths. The primary and the worker
    /// both connect to it, as OAB runtimes do to openab-cp; its config must
    /// bind the key `bench-primary-key-0123456789` to the primary
    /// `prod/koudu` and `bench-worker-key-0123456789` to the worker
    /// `prod/reviewer` (with a `max_delegated_sessions_cap` at least the
    /// largest --in-flight).
    #[arg(long, value_name = "URL")]
    cp_url: Option<String>,
}

#[derive(Debug, Args)]
struct CancelRaceArgs {
    /// Delegations, each cancelled around its completion.
    #[arg(long, default_value_t = 1000)]
    count: u32,
    /// Delegations in flight at once.
    #[arg(long, default_value_t = 256)]
    in_flight: usize,
    /// Upper bound of the random scheduler turns before the executor
    /// completes and before the caller cancels.
    #[arg(long, default_value_t = 400)]
    turns: u64,
    /// Seed of the random timing (0: from the clock; the seed used is reported).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// How long to wait for each terminal, seconds.
    #[arg(long, default_value_t = 120.0)]
    wait_seconds: f64,
    /// The relay's store.
    #[arg(long, value_enum, default_value_t = StoreArg::Redis)]
    store: StoreArg,
}

#[derive(Debug, Args)]
struct ReconnectStormArgs {
    /// Delegations in the run.
    #[arg(long, default_value_t = 20)]
    delegations: u32,
    /// Delegations streaming at once; when one ends the next starts
    /// [default: all of them at once].
    #[arg(long, value_name = "N")]
    in_flight: Option<u32>,
    /// Status events per delegation.
    #[arg(long, default_value_t = 500)]
    events: u32,
    /// Executor pause before each event, milliseconds.
    #[arg(long, default_value_t = 10.0)]
    event_interval_ms: f64,
    /// Link faults to make, half on the caller's link and half on the
    /// callee's (each one of --faults, hitting a live connection).
    #[arg(long, default_value_t = 200)]
    cuts: u32,
    /// The faults to choose from at random, comma-separated: `cut` (close
    /// the live connections), `reset` (TCP RST), `stall` (half-open: nothing
    /// forwarded, no close, for up to twice the link's dead time of three
    /// heartbeats; the link survives or the connector reconnects), `away`
    /// (close the link, let the connector reconnect, stall that fresh link at
    /// once and refuse new connections until, on the caller's side, a
    /// delegation finished at the callee meanwhile; on the callee's side for
    /// a random time). `away` is how delegations finish while the caller's
    /// side is away.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "cut,reset,stall,away"
    )]
    faults: Vec<LinkFault>,
    /// The relay's heartbeat for the run, milliseconds: a stalled link is
    /// found dead after three, and during a Redis outage pings are traffic
    /// on both links [default: 100 when --faults stalls links or with
    /// --kill-redis-every, else the relay's 15,000].
    #[arg(long, value_name = "MS")]
    heartbeat_ms: Option<u32>,
    /// Longest `away` fault, seconds (at least the link's dead time).
    #[arg(long, default_value_t = 5.0, value_name = "SECS")]
    away_max_seconds: f64,
    /// A delegation without its terminal at the caller this many seconds
    /// after the callee's executor finished fails --check (as does one
    /// unfinished at --timeout-seconds).
    #[arg(long, default_value_t = 20.0, value_name = "SECS")]
    terminal_grace_seconds: f64,
    /// Kill the relay child (SIGKILL) and restart it every SECS seconds
    /// (needs --store redis).
    #[arg(long, value_name = "SECS")]
    kill_relay_every: Option<f64>,
    /// Kill redis-server (SIGKILL, mid-append: delegations keep streaming)
    /// every SECS seconds, keep it down --redis-outage-ms, restart it on its
    /// AOF (needs --store redis and --redis-persistence aof-always, where
    /// nothing acknowledged is lost to a SIGKILL, or aof, appendfsync
    /// everysec, which may lose acknowledged writes when the kill lands
    /// while a background fsync is slow: those delegations then end with a
    /// gap). During each outage --cancels-per-outage running
    /// delegations are cancelled; they must end cancelled (or completed if
    /// the executor finished first) after it. Reports per outage its length
    /// and the longest pause of any delegation overlapping it, against the
    /// stated bound (a timing: never fails --check).
    #[arg(long, value_name = "SECS")]
    kill_redis_every: Option<f64>,
    /// How long redis-server stays down per outage, milliseconds.
    #[arg(long, default_value_t = 1000, value_name = "MS")]
    redis_outage_ms: u64,
    /// Running delegations the caller cancels during each Redis outage.
    #[arg(long, default_value_t = 1, value_name = "N")]
    cancels_per_outage: u32,
    /// Restart the caller's connector every SECS seconds: the scenario
    /// stops it (its link closes, its streams end) and starts a new one on
    /// the same state folder, which takes the open delegations back
    /// (restore); each reader subscribes again after the last sequence it
    /// read, and commits every event meanwhile. Delegations that finish
    /// during the restart must still reach the caller exactly once.
    #[arg(long, value_name = "SECS")]
    restart_caller_every: Option<f64>,
    /// Delegate through the caller connector's A2A facade instead of the
    /// library: each delegation is an A2A 1.0 SendStreamingMessage (HTTP
    /// JSON-RPC, SSE, with the delegation profile, whose metadata carries
    /// each event's data and sequences), cancelled with CancelTask; the
    /// same checks apply to what the A2A client read. Not with
    /// --restart-caller-every.
    #[arg(long)]
    a2a: bool,
    /// Seed of the random fault timing (0: from the clock; reported).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// The whole run's time limit, seconds; unfinished delegations count as
    /// missing their terminal.
    #[arg(long, default_value_t = 300.0)]
    timeout_seconds: f64,
    /// The relay's store.
    #[arg(long, value_enum, default_value_t = StoreArg::Redis)]
    store: StoreArg,
}

fn one_store(store: StoreArg, scenario: &str) -> anyhow::Result<StoreKind> {
    match store {
        StoreArg::Memory => Ok(StoreKind::Memory),
        StoreArg::Redis => Ok(StoreKind::Redis),
        StoreArg::Both => anyhow::bail!("{scenario} runs on one store: memory or redis"),
    }
}

#[derive(Debug, Args)]
struct ThroughputArgs {
    /// Payload sizes, comma-separated; a k suffix means KiB (at least 24 B,
    /// at most 1 MiB).
    #[arg(long, value_delimiter = ',', value_parser = parse_size,
          default_value = "64,256,1k,16k,64k")]
    sizes: Vec<usize>,
    /// Relay store(s) to measure; the direct baseline always runs.
    #[arg(long, value_enum, default_value_t = StoreArg::Both)]
    store: StoreArg,
    /// Sending time per case, seconds.
    #[arg(long, default_value_t = 5.0)]
    seconds: f64,
    /// Frames per case at most.
    #[arg(long, default_value_t = 5_000_000)]
    max_frames: u64,
    /// Unconfirmed frames in flight at most (the relay announces 1,024).
    #[arg(long, default_value_t = 1024)]
    window: u64,
}

#[derive(Debug, Args)]
struct LatencyArgs {
    /// Payload size (a k suffix means KiB).
    #[arg(long, value_parser = parse_size, default_value = "256")]
    size: usize,
    /// Fixed offered loads, frames per second, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1000,10000")]
    rates: Vec<f64>,
    /// Also offer this fraction of the measured maximum (0 disables).
    #[arg(long, default_value_t = 0.5)]
    max_fraction: f64,
    /// Take the fraction of this rate instead of probing the maximum.
    #[arg(long)]
    max_rate: Option<f64>,
    /// Seconds of the probe that measures the maximum.
    #[arg(long, default_value_t = 3.0)]
    probe_seconds: f64,
    /// Sending time per load level, seconds.
    #[arg(long, default_value_t = 5.0)]
    seconds: f64,
    /// Relay store(s) to measure; the direct baseline always runs.
    #[arg(long, value_enum, default_value_t = StoreArg::Both)]
    store: StoreArg,
    /// Frames sent and not yet echoed at most.
    #[arg(long, default_value_t = 1024)]
    window: u64,
}

#[derive(Debug, Args)]
struct SessionsArgs {
    /// Idle authenticated sessions to open (each its own peer).
    #[arg(long, default_value_t = 2000)]
    sessions: usize,
    /// Handshakes in progress at once (the relay admits 512 by default).
    #[arg(long, default_value_t = 64)]
    concurrency: usize,
    /// The relay's store.
    #[arg(long, value_enum, default_value_t = StoreArg::Memory)]
    store: StoreArg,
    /// After the last session closed, seconds to sample the relay's RSS
    /// (with --check, it must have given back all but 25% of what the
    /// sessions added by then; the relay's allocator returns freed pages
    /// over about 10 s).
    #[arg(long, default_value_t = 15.0)]
    settle_seconds: f64,
}

/// `64`, `16k`, `16KiB`, `1m`: bytes.
fn parse_size(s: &str) -> Result<usize, String> {
    let t = s.trim().to_ascii_lowercase();
    let (num, mult) = if let Some(n) = t.strip_suffix("kib").or_else(|| t.strip_suffix('k')) {
        (n, 1024)
    } else if let Some(n) = t.strip_suffix("mib").or_else(|| t.strip_suffix('m')) {
        (n, 1024 * 1024)
    } else {
        (t.strip_suffix('b').unwrap_or(&t), 1)
    };
    let n: usize = num
        .trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a size (e.g. 256, 16k, 1m)"))?;
    let bytes = n * mult;
    let min = oab_loadtest::traffic::STAMP_LEN;
    let max = oab_wire::limits::DEFAULT_MAX_PAYLOAD as usize;
    if !(min..=max).contains(&bytes) {
        return Err(format!("{s}: payloads are {min} B to {max} B"));
    }
    Ok(bytes)
}

fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("OAB_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("oab_loadtest=info,warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_target(false)
        .without_time()
        .init();
}

fn common(cli: &Cli) -> Result<Common, String> {
    let relay = match cli.relay {
        RelayArg::InProcess => RelayMode::InProcess,
        RelayArg::Process => match find_relay_bin(cli.relay_bin.as_deref()) {
            Some(bin) => RelayMode::Process(bin),
            None => {
                return Err("the oab-relay binary is not next to this executable: build it \
                     (cargo build --release -p oab-relay), pass --relay-bin, or use --relay in-process"
                    .into());
            }
        },
        RelayArg::Auto => match find_relay_bin(cli.relay_bin.as_deref()) {
            Some(bin) => RelayMode::Process(bin),
            None => {
                tracing::warn!(
                    "oab-relay binary not found next to this executable: running the relay in-process"
                );
                RelayMode::InProcess
            }
        },
    };
    if !(cli.drain_seconds > 0.0 && cli.drain_seconds.is_finite()) {
        return Err("--drain-seconds must be positive".into());
    }
    let tuning = Tuning {
        max_log_entries: cli.max_log_entries.max(1),
        append_batches_in_flight: cli.append_batches,
        ..Tuning::default()
    };
    Ok(Common {
        relay,
        redis_persistence: match cli.redis_persistence {
            PersistenceArg::None => RedisPersistence::None,
            PersistenceArg::Aof => RedisPersistence::Aof,
            PersistenceArg::AofAlways => RedisPersistence::AofAlways,
        },
        drain: Duration::from_secs_f64(cli.drain_seconds),
        tuning,
    })
}

fn positive(name: &str, v: f64) -> Result<(), String> {
    if v > 0.0 && v.is_finite() {
        Ok(())
    } else {
        Err(format!("{name} must be positive"))
    }
}

async fn run(cli: &Cli, common: &Common) -> anyhow::Result<Report> {
    match &cli.command {
        Command::Throughput(a) => {
            positive("--seconds", a.seconds).map_err(anyhow::Error::msg)?;
            let opts = ThroughputOptions {
                sizes: a.sizes.clone(),
                stores: a.store.stores(),
                seconds: a.seconds,
                max_frames: a.max_frames.max(1),
                window: a.window.max(1),
            };
            scenario::throughput::run(&opts, common).await
        }
        Command::Latency(a) => {
            positive("--seconds", a.seconds).map_err(anyhow::Error::msg)?;
            positive("--probe-seconds", a.probe_seconds).map_err(anyhow::Error::msg)?;
            let opts = LatencyOptions {
                size: a.size,
                rates: a.rates.clone(),
                max_fraction: (a.max_fraction > 0.0).then_some(a.max_fraction),
                max_rate: a.max_rate,
                probe_seconds: a.probe_seconds,
                seconds: a.seconds,
                stores: a.store.stores(),
                window: a.window.max(1),
            };
            scenario::latency::run(&opts, common).await
        }
        Command::Sessions(a) => {
            let store = one_store(a.store, "sessions")?;
            let opts = SessionsOptions {
                sessions: a.sessions.max(1),
                concurrency: a.concurrency.max(1),
                store,
                settle_seconds: a.settle_seconds,
            };
            scenario::sessions::run(&opts, common).await
        }
        Command::Delegations(a) => {
            positive("--seconds", a.seconds).map_err(anyhow::Error::msg)?;
            positive("--baseline-seconds", a.baseline_seconds).map_err(anyhow::Error::msg)?;
            let opts = DelegationsOptions {
                mode: match a.mode {
                    ModeArg::Library => DelegationsMode::Library,
                    ModeArg::Cp => DelegationsMode::Cp,
                },
                stores: a.store.stores(),
                in_flight: a.in_flight.iter().map(|n| (*n).max(1)).collect(),
                events: a.events,
                seconds: a.seconds,
                max_delegations: a.max_delegations.max(1),
                baseline_seconds: a.baseline_seconds,
                cp_nagle: a.cp_nagle,
                cp_url: a.cp_url.clone(),
            };
            if opts.cp_url.is_some() && opts.mode != DelegationsMode::Cp {
                anyhow::bail!("--cp-url needs --mode cp");
            }
            scenario::delegations::run(&opts, common).await
        }
        Command::CancelRace(a) => {
            positive("--wait-seconds", a.wait_seconds).map_err(anyhow::Error::msg)?;
            let opts = CancelRaceOptions {
                store: one_store(a.store, "cancel-race")?,
                count: a.count.max(1),
                in_flight: a.in_flight.max(1),
                turns: a.turns.max(1),
                seed: a.seed,
                wait_seconds: a.wait_seconds,
            };
            scenario::cancel_race::run(&opts, common).await
        }
        Command::ReconnectStorm(a) => {
            positive("--event-interval-ms", a.event_interval_ms).map_err(anyhow::Error::msg)?;
            positive("--timeout-seconds", a.timeout_seconds).map_err(anyhow::Error::msg)?;
            positive("--away-max-seconds", a.away_max_seconds).map_err(anyhow::Error::msg)?;
            positive("--terminal-grace-seconds", a.terminal_grace_seconds)
                .map_err(anyhow::Error::msg)?;
            for (name, v) in [
                ("--kill-relay-every", a.kill_relay_every),
                ("--kill-redis-every", a.kill_redis_every),
                ("--restart-caller-every", a.restart_caller_every),
            ] {
                if let Some(k) = v {
                    positive(name, k).map_err(anyhow::Error::msg)?;
                }
            }
            let opts = ReconnectStormOptions {
                store: one_store(a.store, "reconnect-storm")?,
                delegations: a.delegations.max(1),
                in_flight: a.in_flight.unwrap_or(0),
                events: a.events.max(1),
                event_interval: Duration::from_secs_f64(a.event_interval_ms / 1000.0),
                cuts: a.cuts,
                faults: a.faults.clone(),
                heartbeat_ms: a.heartbeat_ms.map(|h| h.max(10)),
                away_max: Duration::from_secs_f64(a.away_max_seconds),
                terminal_grace: Duration::from_secs_f64(a.terminal_grace_seconds),
                kill_relay_every: a.kill_relay_every.map(Duration::from_secs_f64),
                kill_redis_every: a.kill_redis_every.map(Duration::from_secs_f64),
                redis_outage: Duration::from_millis(a.redis_outage_ms),
                cancels_per_outage: a.cancels_per_outage,
                restart_caller_every: a.restart_caller_every.map(Duration::from_secs_f64),
                a2a: a.a2a,
                seed: a.seed,
                timeout: Duration::from_secs_f64(a.timeout_seconds),
            };
            scenario::reconnect_storm::run(&opts, common).await
        }
        Command::SlowConsumer(a) => {
            for (name, v) in [
                ("--rate", a.rate),
                ("--stalled-rate", a.stalled_rate),
                ("--before-seconds", a.before_seconds),
                ("--stall-seconds", a.stall_seconds),
                ("--after-seconds", a.after_seconds),
            ] {
                positive(name, v).map_err(anyhow::Error::msg)?;
            }
            let opts = SlowConsumerOptions {
                store: one_store(a.store, "slow-consumer")?,
                pairs: a.pairs,
                rate: a.rate,
                size: a.size,
                stalled_rate: a.stalled_rate,
                stalled_size: a.stalled_size,
                before_seconds: a.before_seconds,
                stall_seconds: a.stall_seconds,
                after_seconds: a.after_seconds,
                slow_consumer_ms: a.slow_consumer_ms.max(1),
            };
            scenario::slow_consumer::run(&opts, common).await
        }
        Command::CrossInstance(a) => {
            positive("--seconds", a.seconds).map_err(anyhow::Error::msg)?;
            positive("--latency-seconds", a.latency_seconds).map_err(anyhow::Error::msg)?;
            for r in &a.rates {
                positive("--rates", *r).map_err(anyhow::Error::msg)?;
            }
            let opts = CrossInstanceOptions {
                stores: a.store.stores(),
                size: a.size,
                seconds: a.seconds,
                max_frames: a.max_frames.max(1),
                window: a.window.max(1),
                rates: a.rates.clone(),
                latency_seconds: a.latency_seconds,
                rounds: a.rounds.max(1),
                alone: !a.no_alone,
                node_lease_ms: a.node_lease_ms,
            };
            scenario::cross_instance::run(&opts, common).await
        }
        Command::Soak(a) => {
            positive("--delegation-timeout-seconds", a.delegation_timeout_seconds)
                .map_err(anyhow::Error::msg)?;
            let connector_bin = find_connector_bin(a.connector_bin.as_deref()).context(
                "the oab-connector binary is not next to this executable: build it \
                 (cargo build --release -p oab-connector) or pass --connector-bin",
            )?;
            if a.in_flight == 0 && a.facade_in_flight == 0 {
                anyhow::bail!(
                    "--in-flight and --facade-in-flight are both 0: give one path workers"
                );
            }
            let opts = SoakOptions {
                delegations: a.delegations.max(1),
                in_flight: a.in_flight,
                facade_in_flight: a.facade_in_flight,
                checkpoints: a.checkpoints.max(2),
                probe: a.probe,
                finished_ttl_ms: a.finished_ttl_ms.max(1),
                connector_bin,
                delegation_timeout: Duration::from_secs_f64(a.delegation_timeout_seconds),
                deadline: Duration::from_secs_f64(a.deadline_seconds.clamp(1.0, 3600.0)),
                rate: a.rate.max(0.0),
            };
            scenario::soak::run(&opts, common).await
        }
        Command::A2aSdk(a) => {
            let connector_bin = find_connector_bin(a.connector_bin.as_deref()).context(
                "the oab-connector binary is not next to this executable: build it \
                 (cargo build --release -p oab-connector) or pass --connector-bin",
            )?;
            let tree = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
            let opts = A2aSdkOptions {
                tasks: a.tasks.max(1),
                concurrency: a.concurrency.max(1),
                warmup: a.warmup,
                rounds: a.rounds.max(1),
                connector_bin,
                python: a
                    .python
                    .clone()
                    .unwrap_or_else(|| tree.join(".venv/bin/python")),
                interop_dir: a
                    .interop_dir
                    .clone()
                    .unwrap_or_else(|| tree.join("agent-connector/tests/interop")),
            };
            scenario::a2a_sdk::run(&opts, common).await
        }
        Command::UpgradeDrill(a) => {
            positive("--step-timeout-seconds", a.step_timeout_seconds)
                .map_err(anyhow::Error::msg)?;
            let connector_bin = find_connector_bin(a.connector_bin.as_deref()).context(
                "the oab-connector binary is not next to this executable: build it \
                 (cargo build --release -p oab-connector) or pass --connector-bin",
            )?;
            let tree = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
            let opts = UpgradeDrillOptions {
                delegations: a.delegations.max(2),
                ticks: a.ticks.max(1),
                tick_ms: a.tick_ms.max(1),
                stop: a.stop,
                step_timeout: Duration::from_secs_f64(a.step_timeout_seconds),
                connector_bin,
                python: a
                    .python
                    .clone()
                    .unwrap_or_else(|| tree.join(".venv/bin/python")),
                interop_dir: a
                    .interop_dir
                    .clone()
                    .unwrap_or_else(|| tree.join("agent-connector/tests/interop")),
                haproxy: find_haproxy(a.haproxy.as_deref()),
            };
            scenario::upgrade_drill::run(&opts, common).await
        }
        Command::Chart(_) => anyhow::bail!("chart runs no scenario"),
    }
}

async fn interrupted() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        if let (Ok(mut term), Ok(mut int)) = (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
            return;
        }
    }
    let _ = tokio::signal::ctrl_c().await;
}

#[allow(clippy::print_stdout, clippy::print_stderr)]
fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Command::Chart(a) = &cli.command {
        let out = cli.out.clone().unwrap_or_else(|| a.input.join("chart.svg"));
        return match oab_loadtest::chart::render_dir(&a.input, &out) {
            Ok(()) => {
                println!("chart: {}", out.display());
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("oab-loadtest: {e:#}");
                ExitCode::from(2)
            }
        };
    }
    init_tracing();
    oab_relay::tls::install_crypto_provider();
    let common = match common(&cli) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("oab-loadtest: {e}");
            return ExitCode::from(2);
        }
    };
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if let Some(n) = cli.worker_threads.filter(|&n| n > 0) {
        builder.worker_threads(n);
    }
    let runtime = match builder.enable_all().build() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("oab-loadtest: starting the runtime: {e}");
            return ExitCode::from(2);
        }
    };
    // Dropping the scenario's future on a signal drops the relay, the
    // redis-server and every connection: their Drop kills the children.
    let outcome = runtime.block_on(async {
        if let Some(window) = cli.busy_poll_us
            && oab_ops::busy_poll::start(window)
        {
            tracing::info!(
                window_us = u64::try_from(window.as_micros()).unwrap_or(u64::MAX),
                "busy polling in the load generator"
            );
        }
        tokio::select! {
            r = run(&cli, &common) => Some(r),
            () = interrupted() => None,
        }
    });
    runtime.shutdown_timeout(Duration::from_secs(2));
    let report = match outcome {
        None => {
            eprintln!("oab-loadtest: interrupted; stopped everything it started");
            return ExitCode::from(130);
        }
        Some(Err(e)) => {
            eprintln!("oab-loadtest: {e:#}");
            return ExitCode::from(2);
        }
        Some(Ok(r)) => r,
    };
    println!("{report}");
    let out = cli
        .out
        .clone()
        .unwrap_or_else(|| PathBuf::from(format!("loadtest-results/{}.json", report.scenario)));
    let mut report = report;
    if let Some(doc) = report.json.as_object_mut() {
        // How this process and the relay child ran: busy polling and
        // worker threads change every timing.
        let env = |name: &str| std::env::var(name).ok();
        doc.insert(
            "runtime".into(),
            serde_json::json!({
                "load_generator": {
                    "worker_threads": cli.worker_threads,
                    "busy_poll_us": cli.busy_poll_us.map(|d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX)),
                },
                "relay_env": {
                    "OAB_RELAY_WORKER_THREADS": env("OAB_RELAY_WORKER_THREADS"),
                    "OAB_RELAY_BUSY_POLL_US": env("OAB_RELAY_BUSY_POLL_US"),
                },
            }),
        );
    }
    match report.write_json(&out) {
        Ok(()) => println!("results: {}", out.display()),
        Err(e) => {
            eprintln!("oab-loadtest: {e:#}");
            return ExitCode::from(2);
        }
    }
    if cli.check && !report.violations.is_empty() {
        eprintln!(
            "oab-loadtest: --check: {} correctness violation(s)",
            report.violations.len()
        );
        return ExitCode::from(1);
    }
    ExitCode::SUCCESS
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use clap::CommandFactory as _;

    #[test]
    fn cli_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn sizes_parse_with_suffixes_and_bounds() {
        assert_eq!(parse_size("64").unwrap(), 64);
        assert_eq!(parse_size("16k").unwrap(), 16 * 1024);
        assert_eq!(parse_size("64KiB").unwrap(), 64 * 1024);
        assert_eq!(parse_size("1m").unwrap(), 1024 * 1024);
        assert!(parse_size("8").is_err());
        assert!(parse_size("2m").is_err());
        assert!(parse_size("lots").is_err());
    }
}
