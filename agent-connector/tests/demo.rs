//! `oab-connector demo` end to end: the real `oab-relay` binary in
//! development mode in a fresh folder, then the real `oab-connector demo` in
//! that folder, which must print the progress events and a verified
//! completed result and exit 0.
//!
//! The relay binary comes from this profile's target folder: `cargo test
//! --workspace` builds it; running this test alone needs
//! `cargo build -p oab-relay` first.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::{BufRead as _, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

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
        "no {name} binary at {path:?}: build it first (cargo build -p oab-relay)"
    );
    path
}

/// Kills the relay when the test ends, however it ends.
struct Relay(Child);

impl Drop for Relay {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts a development relay in `dir` on a port the OS picks; returns it
/// once it listens, with its port (read from its "listening on" line).
fn start_dev_relay(dir: &std::path::Path) -> (Relay, u16) {
    // The admin listener must differ from relay.listen, and both `:0`
    // would be equal: take a free port for it (only the metrics endpoint,
    // which this test does not use, could lose the race).
    let admin = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let mut child = Command::new(bin("oab-relay"))
        .current_dir(dir)
        .args(["--listen", "127.0.0.1:0", "--admin-listen"])
        .arg(admin.to_string())
        .env_remove("OAB_RELAY_CONFIG")
        .env_remove("OAB_RELAY_DEV_DIR")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let relay = Relay(child);
    let mut seen = String::new();
    let mut lines = BufReader::new(stdout).lines();
    for line in lines.by_ref() {
        let line = line.unwrap();
        seen.push_str(&line);
        seen.push('\n');
        if let Some(rest) = line.split("listening on wss://127.0.0.1:").nth(1) {
            let port = rest.trim().parse().unwrap();
            // Keep reading what it prints: a closed pipe would fail its
            // next `println!` and stop it.
            std::thread::spawn(move || lines.for_each(drop));
            return (relay, port);
        }
    }
    panic!("the relay exited before listening; it printed:\n{seen}");
}

#[test]
fn demo_delegates_through_the_dev_relay_and_prints_a_verified_result() {
    let dir = tempfile::tempdir().unwrap();
    let (_relay, port) = start_dev_relay(dir.path());
    let out = Command::new(env!("CARGO_BIN_EXE_oab-connector"))
        .current_dir(dir.path())
        .args(["demo", "--relay-url"])
        .arg(format!("wss://localhost:{port}/"))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "demo failed ({}):\n{stdout}\n{stderr}",
        out.status
    );
    for step in 1..=oab_connector::demo::PROGRESS_STEPS {
        let want = format!(
            "progress TASK_STATE_WORKING step {step} of {}",
            oab_connector::demo::PROGRESS_STEPS
        );
        assert!(stdout.contains(&want), "no {want:?} in:\n{stdout}");
    }
    for want in [
        "dev/bob connected",
        "dev/alice connected",
        "terminal completed",
        "verified result",
        "outcome:         completed",
        "executor:        dev/bob key dev-1 (ed25519:",
        "capabilities:    read:repo (read-only: true)",
        "request digest:  sha256:",
        "result digest:   sha256:",
        "dev/bob read the task",
    ] {
        assert!(stdout.contains(want), "no {want:?} in:\n{stdout}");
    }
    // Events print in order: every progress event before the terminal.
    let last_progress = stdout.rfind("progress TASK_STATE_WORKING").unwrap();
    assert!(last_progress < stdout.find("terminal completed").unwrap());
}

#[test]
fn demo_without_a_dev_setup_says_to_start_the_relay() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_oab-connector"))
        .current_dir(dir.path())
        .arg("demo")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("cargo run -p oab-relay"), "{stderr}");
    assert!(stderr.contains("relay.toml is missing"), "{stderr}");
}

/// Kills a process when the test ends, however it ends.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn dev_setup_writes_connector_configs_that_check_config_accepts() {
    let dir = tempfile::tempdir().unwrap();
    let (_relay, _port) = start_dev_relay(dir.path());
    for peer in ["dev-alice", "dev-bob"] {
        let file = dir.path().join(format!(".oab-dev/{peer}.connector.toml"));
        let out = Command::new(env!("CARGO_BIN_EXE_oab-connector"))
            .arg("check-config")
            .arg(&file)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{file:?}: {stderr}");
        assert!(!stderr.contains("warning:"), "{file:?}: {stderr}");
    }
}

#[test]
fn demo_a2a_delegates_through_the_facade_and_driver_and_keeps_the_facade_for_any_client() {
    let dir = tempfile::tempdir().unwrap();
    let (_relay, port) = start_dev_relay(dir.path());
    let mut child = Command::new(env!("CARGO_BIN_EXE_oab-connector"))
        .current_dir(dir.path())
        .args(["demo", "--a2a", "--keep", "--facade-listen", "127.0.0.1:0"])
        .args(["--agent-listen", "127.0.0.1:0", "--relay-url"])
        .arg(format!("wss://localhost:{port}/"))
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let _demo = Killed(child);
    // Read until the demo says where an A2A client can reach the facade
    // (it prints that once the delegation is verified); EOF first means it
    // failed.
    let mut seen = String::new();
    let mut agent = None;
    let mut lines = BufReader::new(stdout).lines();
    for line in lines.by_ref() {
        let line = line.unwrap();
        seen.push_str(&line);
        seen.push('\n');
        if let Some(rest) = line.split("point any A2A 1.0 client at ").nth(1) {
            agent = Some(rest.trim_end_matches(", e.g.:").to_string());
            break;
        }
    }
    let agent = agent.unwrap_or_else(|| panic!("the demo ended early:\n{seen}"));
    std::thread::spawn(move || lines.for_each(drop));
    for step in 1..=oab_connector::demo::PROGRESS_STEPS {
        let want = format!(
            "progress TASK_STATE_WORKING step {step} of {}",
            oab_connector::demo::PROGRESS_STEPS
        );
        assert!(seen.contains(&want), "no {want:?} in:\n{seen}");
    }
    for want in [
        "dev/bob connected (callee, A2A driver), its agent card published",
        "dev/alice connected (caller, A2A facade",
        "terminal TASK_STATE_COMPLETED: dev/bob read the task",
        "the facade said verified: true",
        "outcome:         completed",
        "executor:        dev/bob key dev-1 (ed25519:",
        "capabilities:    read:repo (read-only: true)",
        "request digest:  sha256:",
        "artifact:        summary (text/plain): dev/bob read the task",
    ] {
        assert!(seen.contains(want), "no {want:?} in:\n{seen}");
    }
    let last_progress = seen.rfind("progress TASK_STATE_WORKING").unwrap();
    assert!(last_progress < seen.find("terminal TASK_STATE_COMPLETED").unwrap());
    assert!(
        agent.starts_with("http://127.0.0.1:") && agent.ends_with("/peers/dev/bob/"),
        "{agent}"
    );
    // Any A2A client: a plain blocking SendMessage, no profile.
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let answer: serde_json::Value = runtime.block_on(async {
        let body = serde_json::json!({
            "jsonrpc": "2.0", "id": 7, "method": "SendMessage",
            "params": { "message": {
                "messageId": "m-1", "role": "ROLE_USER",
                "parts": [{ "text": "count these four words" }],
            }},
        });
        tokio::time::timeout(
            std::time::Duration::from_secs(30),
            reqwest::Client::new()
                .post(&agent)
                .header("A2A-Version", "1.0")
                .json(&body)
                .send(),
        )
        .await
        .expect("the facade answers in time")
        .unwrap()
        .json()
        .await
        .unwrap()
    });
    assert_eq!(
        answer.pointer("/result/task/status/state"),
        Some(&serde_json::json!("TASK_STATE_COMPLETED")),
        "{answer}"
    );
    assert!(
        answer
            .to_string()
            .contains("dev/bob read the task: 4 words"),
        "{answer}"
    );
}

/// The lines a child writes to a pipe, read on a thread.
fn lines_of(pipe: impl std::io::Read + Send + 'static) -> std::sync::mpsc::Receiver<String> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(pipe).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

/// Reads `lines` into `seen` until one contains `what` (at most 60 s).
fn line_with(lines: &std::sync::mpsc::Receiver<String>, seen: &mut String, what: &str) -> String {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while let Ok(line) =
        lines.recv_timeout(deadline.saturating_duration_since(std::time::Instant::now()))
    {
        seen.push_str(&line);
        seen.push('\n');
        if line.contains(what) {
            return line;
        }
    }
    panic!("no line with {what:?} in:\n{seen}");
}

/// Sends `signal` to `child` and waits (at most 20 s) for its exit code.
fn signal_and_wait(child: &mut Child, signal: &str) -> Option<i32> {
    let status = Command::new("kill")
        .args([signal, &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return s.code();
        }
        assert!(
            std::time::Instant::now() < deadline,
            "still running after {signal}"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// `demo --a2a --keep`: a lost relay is reported (WARN, with what to do), a
/// blocking `SendMessage` with the relay gone ends with its task as it
/// stands instead of hanging, and Ctrl-C says the demo stopped.
#[test]
fn demo_keep_reports_a_lost_relay_answers_send_message_and_says_it_stopped() {
    let dir = tempfile::tempdir().unwrap();
    let (relay, port) = start_dev_relay(dir.path());
    let mut child = Command::new(env!("CARGO_BIN_EXE_oab-connector"))
        .current_dir(dir.path())
        .args(["demo", "--a2a", "--keep", "--facade-listen", "127.0.0.1:0"])
        .args(["--agent-listen", "127.0.0.1:0", "--relay-url"])
        .arg(format!("wss://localhost:{port}/"))
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let lines = lines_of(child.stdout.take().unwrap());
    let mut demo = Killed(child);
    let mut seen = String::new();
    let line = line_with(&lines, &mut seen, "point any A2A 1.0 client at ");
    let agent = line
        .split("point any A2A 1.0 client at ")
        .nth(1)
        .unwrap()
        .trim_end_matches(", e.g.:")
        .to_string();
    drop(relay);
    let warn = line_with(&lines, &mut seen, "lost the relay");
    assert!(
        warn.starts_with("WARN lost the relay at wss://localhost:")
            && warn.contains("cargo run -p oab-relay")
            && warn.contains("Ctrl-C")
            && warn.contains("SendMessage"),
        "{warn}"
    );
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let started = std::time::Instant::now();
    let answer: serde_json::Value = runtime.block_on(async {
        let body = serde_json::json!({
            "jsonrpc": "2.0", "id": 8, "method": "SendMessage",
            "params": { "message": {
                "messageId": "m-gone", "role": "ROLE_USER",
                "parts": [{ "text": "anyone there" }],
            }},
        });
        tokio::time::timeout(
            std::time::Duration::from_secs(30),
            reqwest::Client::new()
                .post(&agent)
                .header("A2A-Version", "1.0")
                .json(&body)
                .send(),
        )
        .await
        .expect("SendMessage ends with the relay gone")
        .unwrap()
        .json()
        .await
        .unwrap()
    });
    assert!(
        started.elapsed() < std::time::Duration::from_secs(30),
        "{answer}"
    );
    assert!(answer.pointer("/result/task/id").is_some(), "{answer}");
    assert_eq!(
        answer.pointer("/result/task/status/state"),
        Some(&serde_json::json!("TASK_STATE_SUBMITTED")),
        "{answer}"
    );
    let code = signal_and_wait(&mut demo.0, "-INT");
    let stopped = line_with(&lines, &mut seen, "demo stopped");
    assert_eq!(
        stopped,
        "demo stopped (Ctrl-C): the facade is closed and both connectors disconnected"
    );
    assert_eq!(code, Some(0), "{seen}");
}

/// Ctrl-C before the delegation finished (here: the relay URL answers
/// nothing): the demo says it stopped and exits 130.
#[test]
fn demo_stopped_by_ctrl_c_before_the_result_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let (_relay, _port) = start_dev_relay(dir.path());
    // Accepts connections (the kernel's backlog) and never answers.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = silent.local_addr().unwrap().port();
    let mut child = Command::new(env!("CARGO_BIN_EXE_oab-connector"))
        .current_dir(dir.path())
        .args(["demo", "--a2a", "--facade-listen", "127.0.0.1:0"])
        .args(["--agent-listen", "127.0.0.1:0", "--relay-url"])
        .arg(format!("wss://localhost:{port}/"))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let lines = lines_of(child.stdout.take().unwrap());
    let errors = lines_of(child.stderr.take().unwrap());
    let mut demo = Killed(child);
    let mut seen = String::new();
    // Printed once the demo runs (its signal handler is in place by then).
    line_with(&lines, &mut seen, "relay:");
    let code = signal_and_wait(&mut demo.0, "-INT");
    let mut err = String::new();
    let line = line_with(&errors, &mut err, "demo stopped");
    assert_eq!(
        line,
        "demo stopped (Ctrl-C) before the delegation finished; the connectors are disconnected"
    );
    assert_eq!(code, Some(130));
    drop(silent);
}
