//! What the caller's state folder costs per delegation: the journal with
//! group commit ([`FileState`]) against the layout of earlier versions (one
//! JSON file per delegation, each save a temporary file, `fdatasync` and
//! rename, run on the async thread that saves, as `Caller` did), both on a
//! real folder on this machine's disk.
//!
//! A measurement, not a pass/fail test. Each delegation does what connector
//! A does for one: a save before its open (cursor 0), a save at the commit
//! of its terminal (finished), and the removal of the delegation that aged
//! out of the finished retention. It prints saves per second and the
//! process's CPU time (user + system, `/proc/self/stat`) per save and per
//! delegation, for each layout, back to back. Ignored in normal runs:
//!
//! ```text
//! cargo test --release -p oab-connector --test state_bench -- --ignored --nocapture
//! ```
//!
//! `STATE_BENCH_DELEGATIONS` (default 4,000) and `STATE_BENCH_TASKS`
//! (concurrent tasks, default 16) change its size; the runtime has two
//! worker threads, as the connector's does on a two-core host.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::print_stdout
)]

use std::collections::VecDeque;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use oab_connector::nonce::Nonce;
use oab_connector::profile::{
    Budgets, DelegationRequest, PROFILE_VERSION, ParentContext, RiskLevel, Task,
};
use oab_connector::state::{FileState, SavedDelegation};
use oab_connector::{DelegationKey, Digest, PeerId, RequestId};

/// Finished delegations each task keeps before removing the oldest.
const KEEP_PER_TASK: usize = 25;

fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// User + system CPU time of this process, in microseconds.
fn cpu_us() -> u64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap();
    // Fields after the parenthesised command name; utime and stime are the
    // 14th and 15th fields, in clock ticks (100 per second on Linux).
    let after = &stat[stat.rfind(')').unwrap() + 2..];
    let fields: Vec<&str> = after.split(' ').collect();
    let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    ticks * 10_000
}

/// A record of the size connector A saves (a signed request with a short
/// task, about 1.5 KiB of JSON).
fn record(task: usize, i: usize) -> SavedDelegation {
    let caller = PeerId::new("acme/caller").unwrap();
    let request_id = RequestId::new(&format!("req-{task}-{i}")).unwrap();
    let request = DelegationRequest {
        v: PROFILE_VERSION,
        request_id: request_id.clone(),
        caller: caller.clone(),
        callee: PeerId::new("acme/callee").unwrap(),
        nonce: Nonce::random(),
        issued_ms: 1_800_000_000_000,
        task: Task {
            text: "summarise the failing tests of the nightly build".into(),
            context: serde_json::json!({"repo": "acme/app", "branch": "main"})
                .as_object()
                .cloned()
                .unwrap(),
            a2a_message: None,
        },
        capabilities: vec!["read:repo".into(), "run:tests".into()],
        depth: 1,
        read_only: true,
        deadline_ms: 1_800_000_060_000,
        budgets: Budgets {
            tokens: 10_000,
            cost_micros: 500_000,
            risk: RiskLevel::Medium,
            output_bytes: 65_536,
        },
        parent: ParentContext {
            agent: "build-bot".into(),
            trace_id: "trace-1".into(),
            execution_id: None,
        },
    };
    let envelope = format!(
        "{{\"payload\":\"{}\",\"sig\":\"{}\",\"kid\":\"k1\"}}",
        "A".repeat(900),
        "B".repeat(86)
    );
    SavedDelegation {
        key: DelegationKey::new(caller, request_id),
        callee: PeerId::new("acme/callee").unwrap(),
        request_digest: Digest::of(envelope.as_bytes()),
        envelope,
        request,
        cursor: 0,
        finished: false,
    }
}

/// The per-delegation files of earlier versions (their `FileState::save`
/// and `remove`, verbatim but for error types).
struct PerFile {
    dir: PathBuf,
}

impl PerFile {
    fn path(&self, key: &DelegationKey) -> PathBuf {
        self.dir
            .join(format!("{}.json", key.to_string().replace('/', "~")))
    }

    fn save(&self, saved: &SavedDelegation) {
        let path = self.path(&saved.key);
        let tmp = path.with_extension("json.tmp");
        let bytes = serde_json::to_vec(saved).unwrap();
        let mut f = std::fs::File::create(&tmp).unwrap();
        f.write_all(&bytes).unwrap();
        f.sync_data().unwrap();
        std::fs::rename(&tmp, &path).unwrap();
    }

    fn remove(&self, key: &DelegationKey) {
        match std::fs::remove_file(self.path(key)) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => panic!("{e}"),
        }
    }
}

/// What one layout does per delegation.
enum Layout {
    PerFile(Arc<PerFile>),
    Journal(FileState),
}

impl Layout {
    async fn save(&self, saved: &SavedDelegation) {
        match self {
            Layout::PerFile(p) => p.save(saved),
            Layout::Journal(s) => s.save(saved).await.unwrap(),
        }
    }

    /// The commit of the terminal, with the removal of the delegation that
    /// aged out, as `Caller::commit` does each (both durable when it
    /// returns).
    async fn commit(&self, saved: &SavedDelegation, aged_out: Option<DelegationKey>) {
        match self {
            Layout::PerFile(p) => {
                p.save(saved);
                if let Some(key) = aged_out {
                    p.remove(&key);
                }
            }
            Layout::Journal(s) => {
                let gone: Vec<_> = aged_out.into_iter().collect();
                s.save_and_remove(saved, &gone).await.unwrap();
            }
        }
    }
}

/// Runs `delegations` delegations from `tasks` tasks; prints the figures.
async fn run(name: &str, layout: Arc<Layout>, delegations: usize, tasks: usize) {
    let per_task = delegations / tasks;
    let (cpu0, t0) = (cpu_us(), Instant::now());
    let work: Vec<_> = (0..tasks)
        .map(|task| {
            let layout = layout.clone();
            tokio::spawn(async move {
                let mut finished = VecDeque::new();
                for i in 0..per_task {
                    let mut s = record(task, i);
                    layout.save(&s).await;
                    s.cursor = 3;
                    s.finished = true;
                    finished.push_back(s.key.clone());
                    let aged_out = if finished.len() > KEEP_PER_TASK {
                        finished.pop_front()
                    } else {
                        None
                    };
                    layout.commit(&s, aged_out).await;
                }
            })
        })
        .collect();
    for w in work {
        w.await.unwrap();
    }
    let (cpu, secs) = (cpu_us() - cpu0, t0.elapsed().as_secs_f64());
    let n = per_task * tasks;
    let saves = 2 * n;
    let syncs = match &*layout {
        Layout::Journal(s) => format!(", {} syncs", s.syncs()),
        Layout::PerFile(_) => format!(", {saves} syncs"),
    };
    println!(
        "{name:>8}: {n} delegations ({saves} saves) from {tasks} tasks in {secs:.2} s: {:.0} saves/s, {:.1} µs CPU per save, {:.1} µs CPU per delegation{syncs}",
        saves as f64 / secs,
        cpu as f64 / saves as f64,
        cpu as f64 / n as f64,
    );
}

fn count_files(dir: &Path) -> usize {
    std::fs::read_dir(dir).unwrap().count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement; run with --ignored --nocapture"]
async fn state_saves_per_file_and_journal() {
    let delegations = env_or("STATE_BENCH_DELEGATIONS", 4_000);
    let tasks = env_or("STATE_BENCH_TASKS", 16).max(1);

    let dir = tempfile::tempdir_in(std::env::temp_dir()).unwrap();
    let per_file = Arc::new(Layout::PerFile(Arc::new(PerFile {
        dir: dir.path().to_path_buf(),
    })));
    run("per-file", per_file, delegations, tasks).await;
    println!("per-file: {} files left", count_files(dir.path()));

    let dir = tempfile::tempdir_in(std::env::temp_dir()).unwrap();
    let state = FileState::open(dir.path()).unwrap();
    run(
        "journal",
        Arc::new(Layout::Journal(state.clone())),
        delegations,
        tasks,
    )
    .await;
    println!(
        " journal: {} records live, journal {} bytes",
        state.count().unwrap(),
        state.journal_bytes()
    );
}
