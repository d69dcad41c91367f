//! The docs as a new user follows them: their own shell blocks, extracted
//! from the Markdown (not copied), run by `bash` in a fresh scratch folder
//! with the built binaries on `PATH`, each fixed port of the docs moved to a
//! free one. A command that no longer works as written fails here.
//!
//! - `deploy/README.md`, "Trial: two hosts through a relay on Redis, with a
//!   private CA, on one machine" (the README's "Running a relay for real"
//!   points to it): a private CA made with `openssl`, two identities, Redis
//!   with the shipped `redis.conf`, a relay on it, two connectors, the echo
//!   agent, one A2A `SendMessage` through the relay, the teardown.
//! - `README.md`, "Quick start" with "See a delegation cross the relay":
//!   the development relay (left running), the demo, the A2A demo with
//!   `--keep` ended by Ctrl-C. `cargo run -p <bin> [-- args]` runs the
//!   built binary with the same arguments, plus the flags the README names
//!   for ports that are taken; `scripts/test` is skipped (this test runs
//!   inside it).
//! - `docs/openab.md`, "Switching an OAB host over": the trial's CA,
//!   identities, Redis and relay (whose route is the one the section asks
//!   for), the bearer key made as the section makes it, each host's
//!   connector with the section's `[openab]` block as written, then OAB's
//!   runtimes as its `[control_plane]` block names them (a worker
//!   `prod/reviewer` on host B, a primary `prod/koudu` on host A, at the
//!   block's URL) and one `cp/delegate` from the primary that completes
//!   with the worker's answer.
//!
//! Needs the `oab-relay` and `oab-connector` binaries of the same build
//! profile (`cargo test --workspace` builds them), `bash`, `openssl`,
//! `curl`, `redis-server`, `redis-cli` and `python3`.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use oab_testkit::docs::shell_blocks;

/// The folder `cargo` puts this profile's binaries in (this test runs from
/// its `deps/` subfolder), checked to hold both binaries.
fn bin_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .unwrap()
        .to_path_buf();
    for name in ["oab-relay", "oab-connector"] {
        assert!(
            dir.join(name).is_file(),
            "no {name} binary in {dir:?}: build it first (cargo build -p oab-relay -p oab-connector)"
        );
    }
    dir
}

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .canonicalize()
        .unwrap()
}

/// A port nothing listens on now.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// `script` with each of the docs' fixed `ports` moved to a free port (each
/// must occur in it: a doc that changed its ports changes this list).
fn on_free_ports(mut script: String, ports: &[&str]) -> String {
    for port in ports {
        assert!(
            script.contains(port),
            "the docs no longer use port {port}; update this test's list"
        );
        script = script.replace(port, &free_port().to_string());
    }
    script
}

/// Stops what a script left running, however the test ends: the script's
/// process group, and the daemon whose pid file it wrote.
struct Leftovers {
    group: Option<i32>,
    pid_file: PathBuf,
}

impl Drop for Leftovers {
    fn drop(&mut self) {
        if let Some(g) = self.group {
            // SAFETY-free: `kill(1)` on the group, as a shell user would.
            let _ = std::process::Command::new("kill")
                .args(["-9", "--", &format!("-{g}")])
                .stderr(Stdio::null())
                .status();
        }
        if let Ok(pid) = std::fs::read_to_string(&self.pid_file) {
            let _ = std::process::Command::new("kill")
                .arg(pid.trim())
                .stderr(Stdio::null())
                .status();
        }
    }
}

/// What a script printed, and what it left running (stopped when this is
/// dropped).
struct Ran {
    ok: bool,
    stdout: String,
    stderr: String,
    _leftovers: Leftovers,
}

/// Runs `script` with `bash` in `dir`, with the binaries first on `PATH`,
/// `env` set, and none of the variables a developer's shell might carry
/// that change what the binaries read. What it starts in the background
/// (with its output redirected) keeps running until the result is dropped.
async fn run_with(script: &str, dir: &Path, pid_file: &str, env: &[(&str, &str)]) -> Ran {
    let path = format!(
        "{}:{}",
        bin_dir().display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let mut cmd = tokio::process::Command::new("bash");
    cmd.arg("-c")
        .arg(script)
        .current_dir(dir)
        .env("PATH", path)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .kill_on_drop(true);
    for var in std::env::vars().map(|(k, _)| k) {
        if var.starts_with("OAB_") || var == "RUST_LOG" || var == "RUST_BACKTRACE" {
            cmd.env_remove(var);
        }
    }
    cmd.envs(env.iter().copied());
    let child = cmd.spawn().unwrap();
    let leftovers = Leftovers {
        group: child.id().and_then(|id| i32::try_from(id).ok()),
        pid_file: dir.join(pid_file),
    };
    let out = tokio::time::timeout(Duration::from_secs(180), child.wait_with_output())
        .await
        .expect("the walkthrough finishes in 3 minutes")
        .unwrap();
    Ran {
        ok: out.status.success(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        _leftovers: leftovers,
    }
}

/// [`run_with`] without extra variables, to the end of everything it
/// started: (exit success, stdout, stderr).
async fn run(script: &str, dir: &Path, pid_file: &str) -> (bool, String, String) {
    let ran = run_with(script, dir, pid_file, &[]).await;
    (ran.ok, ran.stdout, ran.stderr)
}

/// The tail of each log file the script wrote in `dir`, for a failure
/// message.
fn logs(dir: &Path) -> String {
    let mut out = String::new();
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let p = entry.path();
        if p.extension().is_some_and(|e| e == "log") {
            let text = std::fs::read_to_string(&p).unwrap_or_default();
            let tail: Vec<&str> = text.lines().rev().take(15).collect();
            out.push_str(&format!("--- {}\n", p.display()));
            for l in tail.into_iter().rev() {
                out.push_str(l);
                out.push('\n');
            }
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_two_host_trial_of_the_deploy_guide_runs_as_written() {
    let root = repo();
    let guide = std::fs::read_to_string(root.join("deploy/README.md")).unwrap();
    let blocks = shell_blocks(
        &guide,
        "Trial: two hosts through a relay on Redis, with a private CA, on one machine",
    )
    .unwrap();
    assert_eq!(blocks.len(), 7, "the trial's seven steps: {blocks:#?}");
    // Steps 1-6 in one shell, as "run each block from the scratch folder"
    // in one terminal has it, stopping at the first failing command; then
    // the teardown, whatever it finds.
    let mut script = String::from("set -eo pipefail\n");
    for step in &blocks[..6] {
        script.push_str(step);
    }
    script.push_str("echo '<steps done>'\nset +e\n");
    script.push_str(&blocks[6]);
    let script = on_free_ports(script, &["16379", "17443", "19443", "17070", "19999"])
        .replace("/path/to/oab-relay", &root.display().to_string());
    let scratch = tempfile::tempdir().unwrap();
    let (ok, stdout, stderr) = run(&script, scratch.path(), "redis.pid").await;
    let context = format!(
        "stdout:\n{stdout}\nstderr:\n{stderr}\n{}",
        logs(scratch.path())
    );
    assert!(ok, "the trial failed\n{context}");
    assert!(stdout.contains("<steps done>"), "{context}");
    // What the guide says each step shows.
    assert!(
        stdout.contains("relay.pem: OK"),
        "step 1's verify\n{context}"
    );
    assert!(stdout.contains("PONG"), "step 3's Redis\n{context}");
    assert_eq!(
        stdout.matches("connected to the relay").count(),
        2,
        "step 6: both connectors in session\n{context}"
    );
    assert!(
        stdout.contains("echo: hello over the relay"),
        "step 6: \"The answer carries \\\"echo: hello over the relay\\\"\"\n{context}"
    );
    assert!(
        guide.contains("The answer carries `\"echo: hello over the relay\"`"),
        "the guide's promise this test checks"
    );
}

/// One command line of a README block, without its trailing `# comment`.
fn command_lines(block: &str) -> Vec<String> {
    block
        .lines()
        .map(|l| l.split(" #").next().unwrap_or("").trim().to_string())
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readme_quick_start_and_demos_run_as_written() {
    let root = repo();
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    // "Quick start" and its "See a delegation cross the relay".
    let mut commands = Vec::new();
    for block in shell_blocks(&readme, "Quick start").unwrap() {
        commands.extend(command_lines(&block));
    }
    assert_eq!(
        commands,
        [
            "cargo run -p oab-relay",
            "scripts/test",
            "cargo run -p oab-relay",
            "cargo run -p oab-connector -- demo",
            "cargo run -p oab-connector -- demo --a2a --keep",
        ],
        "the README's first commands changed: update how this test runs them"
    );
    // `cargo run -p <bin> [-- args]` runs the built binary (the same
    // process, so Ctrl-C reaches it), on free ports: the development
    // relay's listeners, and the demo's relay URL and its two listeners
    // (the flags the README names for taken ports).
    let (relay, admin, facade, agent) = (free_port(), free_port(), free_port(), free_port());
    let binary = |command: &str| -> String {
        let rest = command
            .strip_prefix("cargo run -p ")
            .unwrap_or_else(|| panic!("not a cargo run: {command}"));
        let (name, args) = match rest.split_once(" -- ") {
            Some((name, args)) => (name, args),
            None => (rest, ""),
        };
        match name {
            "oab-relay" => format!(
                "oab-relay {args} --listen 127.0.0.1:{relay} --admin-listen 127.0.0.1:{admin}"
            ),
            "oab-connector" if args.contains("--a2a") => format!(
                "oab-connector {args} --relay-url wss://localhost:{relay}/ \
                 --facade-listen 127.0.0.1:{facade} --agent-listen 127.0.0.1:{agent}"
            ),
            "oab-connector" => format!("oab-connector {args} --relay-url wss://localhost:{relay}/"),
            other => panic!("the README runs {other}: teach this test how"),
        }
    };
    let mut script = String::from(
        r#"set -eo pipefail
wait_for() {
  for i in $(seq 600); do grep -q "$2" "$1" && return 0; sleep 0.1; done
  echo "walkthrough: no '$2' in $1 after 60 s:" >&2; cat "$1" >&2; return 1
}
"#,
    );
    let mut relay_started = false;
    for (i, command) in commands.iter().enumerate() {
        script.push_str(&format!("echo '<step {i}: {command}>'\n"));
        if command == "cargo run -p oab-relay" {
            // "Leave it running": started once, in the background.
            if !relay_started {
                script.push_str(&format!(
                    "{} > relay.out 2>&1 & RELAY=$!\nwait_for relay.out 'listening on'\n",
                    binary(command)
                ));
                relay_started = true;
            }
        } else if command == "scripts/test" {
            // This test runs inside it.
            script.push_str("echo '<skipped: this test runs inside scripts/test>'\n");
        } else if command.ends_with("--keep") {
            // Up until Ctrl-C, which ends it with 0 once the result is in.
            script.push_str(&format!(
                "{} > keep.out 2>&1 & KEEP=$!\n\
                 wait_for keep.out 'point any A2A 1.0 client at'\n\
                 kill -INT $KEEP; status=0; wait $KEEP || status=$?\n\
                 cat keep.out; echo \"<keep exited $status>\"\n",
                binary(command)
            ));
        } else {
            script.push_str(&format!("{}\n", binary(command)));
        }
    }
    script.push_str("kill -INT $RELAY; wait $RELAY || true; cat relay.out\n");
    let scratch = tempfile::tempdir().unwrap();
    let (ok, stdout, stderr) = run(&script, scratch.path(), "no.pid").await;
    let context = format!("stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(ok, "the README's commands failed\n{context}");
    // The quick start's relay: the development setup it describes.
    for file in [
        "relay.toml",
        "dev-alice.connector.toml",
        "dev-bob.connector.toml",
    ] {
        assert!(
            scratch.path().join(".oab-dev").join(file).is_file(),
            ".oab-dev/{file}\n{context}"
        );
    }
    // The demo: "It exits 0 on a verified `completed` result", and the A2A
    // one keeps its facade until Ctrl-C, which "prints `demo stopped
    // (Ctrl-C): ...` and exits 0".
    assert_eq!(
        stdout.matches("verified result").count(),
        2,
        "both demos verified the result\n{context}"
    );
    assert!(stdout.contains("demo stopped (Ctrl-C)"), "{context}");
    assert!(stdout.contains("<keep exited 0>"), "{context}");
    for promise in [
        "It exits 0 on a verified `completed` result.",
        "Ctrl-C prints `demo stopped (Ctrl-C): ...` and exits 0",
    ] {
        assert!(
            readme.replace('\n', " ").contains(promise),
            "the README's promise this test checks: {promise}"
        );
    }
}

/// The deploy guide's trial heading, whose first steps (CA, identities,
/// Redis, relay) the OpenAB walkthrough builds on.
const TRIAL: &str = "Trial: two hosts through a relay on Redis, with a private CA, on one machine";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openab_switch_over_runs_as_written() {
    use oab_loadtest::cp;

    let root = repo();
    let guide = std::fs::read_to_string(root.join("deploy/README.md")).unwrap();
    let trial = shell_blocks(&guide, TRIAL).unwrap();
    let openab = std::fs::read_to_string(root.join("docs/openab.md")).unwrap();
    let blocks = oab_testkit::docs::blocks_under(&openab, "Switching an OAB host over").unwrap();
    let find = |what: &str, f: &dyn Fn(&oab_testkit::docs::Block) -> bool| {
        blocks
            .iter()
            .find(|b| f(b))
            .unwrap_or_else(|| panic!("docs/openab.md no longer has {what}: {blocks:#?}"))
            .text
            .clone()
    };
    let runtime = find("OAB's [control_plane] block", &|b| {
        b.info == "toml" && b.text.contains("[control_plane]")
    });
    let host_a = find("host A's [openab] block", &|b| {
        b.info == "toml" && b.text.starts_with("[openab]") && b.text.contains("type = \"primary\"")
    });
    let host_b = find("host B's [openab] block", &|b| {
        b.info == "toml" && b.text.starts_with("[openab]") && b.text.contains("type = \"worker\"")
    });
    let make_key = find("the key-making block", &|b| {
        b.is_shell() && b.text.contains("openssl rand")
    });
    let route = find("the relay's route", &|b| b.text.contains("[[routes]]"));
    // The route the OpenAB section asks for is the trial relay's own.
    let trial_relay = &trial[3];
    for line in route.lines().filter(|l| !l.starts_with('#')) {
        assert!(
            trial_relay.contains(line),
            "the trial's relay lacks the OpenAB route line {line:?}"
        );
    }
    // The runtime's CP URL, and the endpoint it names, per host.
    let url = runtime
        .lines()
        .find_map(|l| l.trim().strip_prefix("url = \""))
        .and_then(|l| l.split('"').next())
        .unwrap()
        .to_string();
    assert_eq!(url, "ws://127.0.0.1:9800/cp", "OAB's URL in the docs");
    let scratch = tempfile::tempdir().unwrap();
    let keys = scratch.path().join("keys");
    std::fs::create_dir(&keys).unwrap();
    let keys = keys.display().to_string();
    let (port_a, port_b) = (free_port(), free_port());
    let host_a = host_a
        .replace("127.0.0.1:9800", &format!("127.0.0.1:{port_a}"))
        .replace("/etc/oab-connector", &keys);
    let host_b = host_b.replace("127.0.0.1:9800", &format!("127.0.0.1:{port_b}"));
    // Steps 1-4 of the trial; the key as the OpenAB section makes it;
    // each host's connector: its relay, its peer and its grant, then the
    // section's `[openab]` block as written.
    let mut script = String::from("set -eo pipefail\n");
    for step in &trial[..4] {
        script.push_str(step);
    }
    script.push_str(&make_key.replace("/etc/oab-connector", &keys));
    script.push_str(&format!(
        r#"for host in a b; do
  if [ $host = a ]; then me=build-host; other=acme/review-host; key=$RH; else me=review-host; other=acme/build-host; key=$BH; fi
  cat > host-$host.toml <<EOT
[connector]
relay_url = "wss://localhost:17443/"
relay_id = "localhost"
identity = "$PWD/$me.identity.toml"
relay_ca = "$PWD/relay-ca.pem"

[[peers]]
id = "$other"
keys = [{{ key_id = "2026-11", public_key = "$key" }}]

[policy]
allowed_capabilities = ["read:*"]

EOT
done
cat >> host-a.toml <<'EOT'
{host_a}EOT
cat >> host-b.toml <<'EOT'
{host_b}EOT
oab-connector check-config host-a.toml
oab-connector check-config host-b.toml
oab-connector run --config host-b.toml > host-b.log 2>&1 &
oab-connector run --config host-a.toml > host-a.log 2>&1 &
for i in $(seq 100); do
  grep -q "connected to the relay" host-a.log && grep -q "connected to the relay" host-b.log && break
  sleep 0.2
done
grep -h "connected to the relay" host-a.log host-b.log
echo "OPENAB_CP_KEY=$OPENAB_CP_KEY"
"#
    ));
    let script = on_free_ports(script, &["16379", "17443", "19443"])
        .replace("/path/to/oab-relay", &root.display().to_string());
    let worker_key = oab_wire::digest::hex(&oab_wire::Digest::of(b"walkthrough").0);
    let ran = run_with(
        &script,
        scratch.path(),
        "redis.pid",
        &[("OAB_CP_KEY_REVIEWER", worker_key.as_str())],
    )
    .await;
    let context = format!(
        "stdout:\n{}\nstderr:\n{}\n{}",
        ran.stdout,
        ran.stderr,
        logs(scratch.path())
    );
    assert!(ran.ok, "the setup failed\n{context}");
    assert_eq!(
        ran.stdout.matches("connected to the relay").count(),
        2,
        "both hosts in session\n{context}"
    );
    // The key the section exported for the runtime (`auth_key =
    // "${OPENAB_CP_KEY}"`), and the file it wrote for the endpoint.
    let primary_key = ran
        .stdout
        .lines()
        .find_map(|l| l.strip_prefix("OPENAB_CP_KEY="))
        .unwrap()
        .to_string();
    assert_eq!(primary_key.len(), 64, "openssl rand -hex 32\n{context}");
    let mode = std::os::unix::fs::PermissionsExt::mode(
        &std::fs::metadata(format!("{keys}/cp-koudu.key"))
            .unwrap()
            .permissions(),
    );
    assert_eq!(mode & 0o777, 0o600, "umask 077: the key file is 0600");
    // OAB's runtimes, as its config names them: the worker `prod/reviewer`
    // on host B, the primary `prod/koudu` on host A, each at the URL of its
    // own host's endpoint.
    let url_b = url.replace("9800", &port_b.to_string());
    let mut worker = None;
    for _ in 0..100 {
        match cp::connect_url(&url_b, &worker_key, false).await {
            Ok(ws) => {
                worker = Some(ws);
                break;
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
    let mut worker =
        worker.unwrap_or_else(|| panic!("host B's endpoint never answered\n{context}"));
    let beat = cp::register(&mut worker, "prod", "reviewer", "worker", "w-1", 4)
        .await
        .unwrap();
    let stop = tokio_util::sync::CancellationToken::new();
    let serving = tokio::spawn(cp::run_worker(worker, beat, stop.clone(), false));
    let url_a = url.replace("9800", &port_a.to_string());
    let mut primary = cp::Primary::connect_url(&url_a, &primary_key, "reviewer", false)
        .await
        .unwrap();
    // One delegation, from the primary on host A to the worker on host B,
    // through both connectors and the relay.
    let run = primary
        .run("walkthrough", 1, 0.0, 1, Duration::from_secs(30))
        .await
        .unwrap();
    assert_eq!(
        run.completed,
        1,
        "{:?}\n{}",
        run.errors,
        logs(scratch.path())
    );
    assert!(run.errors.is_empty(), "{:?}", run.errors);
    stop.cancel();
    let _ = serving.await;
}
