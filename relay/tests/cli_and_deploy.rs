//! The operator-facing surface: every example config in `deploy/` is valid,
//! and `oab-relay check-config` names every bad field.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::path::Path;

#[test]
fn every_example_relay_config_in_deploy_is_valid() {
    for sub in ["relay", "fleet", "k8s/relay"] {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../deploy")
            .join(sub);
        let mut checked = 0;
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().and_then(|e| e.to_str()) == Some("toml") {
                let c = oab_relay::config::Config::load(&path).unwrap_or_else(|e| panic!("{e}"));
                // Examples are copied: none of their values may lock peers out.
                let warnings = oab_relay::lockout::warnings(&c, oab_wire::identity::now_ms());
                assert!(warnings.is_empty(), "{}: {warnings:?}", path.display());
                checked += 1;
            }
        }
        assert!(checked > 0, "no example configs found in {}", dir.display());
    }
}

#[test]
fn fleet_example_instances_differ_only_where_they_must() {
    // Every instance of the fleet example shares relay id, store, peers and
    // routes; each has its own node name and listeners.
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/fleet");
    let configs: Vec<oab_relay::config::Config> = (1..=3)
        .map(|i| {
            oab_relay::config::Config::load(&dir.join(format!("relay-{i}.toml")))
                .unwrap_or_else(|e| panic!("{e}"))
        })
        .collect();
    let first = &configs[0];
    for c in &configs[1..] {
        assert_eq!(c.relay.id, first.relay.id);
        assert_eq!(c.store.url, first.store.url);
        assert_eq!(c.peers.len(), first.peers.len());
        assert_eq!(c.routes.len(), first.routes.len());
    }
    let mut nodes: Vec<_> = configs.iter().map(|c| c.fleet.node.clone()).collect();
    nodes.sort();
    nodes.dedup();
    assert_eq!(nodes.len(), 3, "each instance names itself");
    assert!(nodes.iter().all(Option::is_some));
}

#[test]
fn check_config_names_every_bad_field_and_exits_2() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.toml");
    std::fs::write(
        &bad,
        "[relay]\nid = \"x\"\nheartbeat_ms = 0\n[store]\nurl = \"mysql://x\"\n\
         [[routes]]\nfrom = \"a/b\"\nto = \"c/d\"\n",
    )
    .unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_oab-relay"))
        .arg("check-config")
        .arg(&bad)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    for field in [
        "relay.tls_cert",
        "relay.heartbeat_ms",
        "store.url",
        "routes[0].from",
        "routes[0].to",
    ] {
        assert!(err.contains(field), "{field} missing from: {err}");
    }
    let good = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/relay/relay.toml");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_oab-relay"))
        .arg("check-config")
        .arg(&good)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn unknown_fields_are_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("typo.toml");
    std::fs::write(&bad, "[relay]\nid = \"x\"\nlisten_addr = \"0.0.0.0:1\"\n").unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_oab-relay"))
        .arg("check-config")
        .arg(&bad)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("listen_addr"));
}

/// Logs written to a pipe or a file (not a terminal) carry no colour codes,
/// so `grep` on a log file matches what the docs show.
#[test]
fn logs_to_a_pipe_carry_no_colour_codes() {
    use std::io::{BufRead as _, BufReader};
    // The development relay keeps its files in the working directory.
    let dir = tempfile::tempdir().unwrap();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_oab-relay"))
        .current_dir(dir.path())
        .args([
            "--set",
            "relay.listen=127.0.0.1:0",
            "--set",
            "relay.admin_listen=127.0.0.2:0",
        ])
        .env("OAB_LOG", "info")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    // The reader ends when the relay is killed, so a relay that never logs
    // its listening line fails the assertion below instead of hanging.
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut seen = Vec::new();
    let until = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while let Ok(line) = rx.recv_timeout(until.saturating_duration_since(std::time::Instant::now()))
    {
        let done = line.contains("relay listening");
        seen.push(line);
        if done {
            break;
        }
    }
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(
        seen.iter().any(|l| l.contains("relay listening")),
        "no listening line: {seen:?}"
    );
    assert!(
        seen.iter().all(|l| !l.contains('\u{1b}')),
        "colour codes in a piped log: {seen:?}"
    );
}

/// A relay whose stdout reader is gone (`oab-relay | head -1`, a closed
/// pipe) still starts and serves: its startup banner is best effort.
#[test]
fn a_closed_stdout_does_not_stop_the_relay() {
    use std::io::{BufRead as _, BufReader};
    let dir = tempfile::tempdir().unwrap();
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_oab-relay"))
        .current_dir(dir.path())
        .args([
            "--set",
            "relay.listen=127.0.0.1:0",
            "--set",
            "relay.admin_listen=127.0.0.2:0",
        ])
        .env("OAB_LOG", "info")
        .stdout(writer)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    // Ends with the relay's stderr: a relay that died fails below instead
    // of hanging the test.
    let listening = BufReader::new(stderr)
        .lines()
        .map_while(Result::ok)
        .any(|l| l.contains("relay listening"));
    let still_running = child.try_wait().unwrap().is_none();
    let _ = child.kill();
    child.wait().unwrap();
    assert!(listening, "the relay never listened");
    assert!(still_running, "the relay exited after listening");
}

/// `--version` names the version, the git commit built and the build date.
#[test]
fn version_names_the_commit_and_the_build_date() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_oab-relay"))
        .arg("--version")
        .output()
        .unwrap();
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    let expected_commit = std::process::Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map_or_else(
            || "unknown".to_string(),
            |o| String::from_utf8_lossy(&o.stdout).trim().to_string(),
        );
    assert!(
        text.starts_with(&format!(
            "oab-relay {} (commit {expected_commit}, built ",
            env!("CARGO_PKG_VERSION")
        )),
        "{text}"
    );
    // ... built 2026-12-01T07:30:00Z)
    let date = text
        .trim()
        .rsplit(' ')
        .next()
        .unwrap()
        .trim_end_matches(')');
    assert_eq!(date.len(), 20, "{text}");
    assert!(date.ends_with('Z') && date.as_bytes()[10] == b'T', "{text}");
}

/// The relay's stderr lines until one contains `until` (or 20 s pass, or it
/// exits), then it is killed.
fn relay_log_until(args: &[&str], until: &str) -> Vec<String> {
    use std::io::{BufRead as _, BufReader};
    let dir = tempfile::tempdir().unwrap();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_oab-relay"))
        .current_dir(dir.path())
        .args([
            "--set",
            "relay.listen=127.0.0.1:0",
            "--set",
            "relay.admin_listen=127.0.0.2:0",
        ])
        .args(args)
        .env("OAB_LOG", "info")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut seen = Vec::new();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while let Ok(line) =
        rx.recv_timeout(deadline.saturating_duration_since(std::time::Instant::now()))
    {
        let done = line.contains(until);
        seen.push(line);
        if done {
            break;
        }
    }
    child.kill().unwrap();
    child.wait().unwrap();
    seen
}

/// `--busy-poll-us` is taken and said at start; a window past the cap is
/// refused with the range, before anything starts.
#[test]
fn busy_polling_is_said_at_start_and_a_window_past_the_cap_is_refused() {
    let seen = relay_log_until(
        &["--busy-poll-us", "500", "--worker-threads", "1"],
        "relay listening",
    );
    assert!(
        seen.iter()
            .any(|l| l.contains("busy polling after each frame batch") && l.contains("500")),
        "{seen:#?}"
    );
    assert!(
        seen.iter().any(|l| l.contains("relay listening")),
        "{seen:#?}"
    );
    assert!(!seen.iter().any(|l| l.contains("WARN")), "{seen:#?}");
    // With more workers it says what that costs.
    let seen = relay_log_until(
        &["--busy-poll-us", "500", "--worker-threads", "2"],
        "relay listening",
    );
    assert!(
        seen.iter()
            .any(|l| l.contains("WARN") && l.contains("more than one async worker")),
        "{seen:#?}"
    );
    // Off by default: nothing said.
    let seen = relay_log_until(&[], "relay listening");
    assert!(
        !seen.iter().any(|l| l.contains("busy polling")),
        "{seen:#?}"
    );

    let out = std::process::Command::new(env!("CARGO_BIN_EXE_oab-relay"))
        .args(["--busy-poll-us", "20000"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("expected microseconds from 0 (off) to 10000"),
        "{stderr}"
    );
}

/// A Redis without its AOF loses acknowledged frames on a restart: the relay
/// says so at start (as it does for eviction), and says nothing about a
/// Redis that has it.
#[test]
fn a_redis_without_aof_gets_a_startup_warning() {
    use oab_testkit::redis::{Persistence, RedisServer};
    let plain = RedisServer::start(Persistence::None).unwrap();
    let url = plain.url();
    let seen = relay_log_until(&["--store", &url], "relay listening");
    assert!(
        seen.iter()
            .any(|l| l.contains("WARN") && l.contains("appendonly no")),
        "no AOF warning: {seen:#?}"
    );
    let durable = RedisServer::start(Persistence::Aof).unwrap();
    let url = durable.url();
    let seen = relay_log_until(&["--store", &url], "relay listening");
    assert!(
        seen.iter().any(|l| l.contains("relay listening")),
        "{seen:#?}"
    );
    assert!(
        !seen.iter().any(|l| l.contains("appendonly")),
        "an AOF Redis got a warning: {seen:#?}"
    );
}

/// `check-config` accepts a value that can lock peers out (exit 0) but names
/// it, with what a peer would see.
#[test]
fn check_config_warns_about_values_that_lock_peers_out() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("relay.toml");
    std::fs::write(
        &file,
        "[relay]\nid = \"r\"\ntls_cert = \"/c.pem\"\ntls_key = \"/k.pem\"\nmax_clock_skew_ms = 1000\n",
    )
    .unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_oab-relay"))
        .arg("check-config")
        .arg(&file)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("warning: relay.max_clock_skew_ms: 1000 ms is tight")
            && stderr.contains("4506"),
        "{stderr}"
    );
}

/// Where `program` is on this process's `PATH`.
fn on_path(program: &str) -> std::path::PathBuf {
    std::env::split_paths(&std::env::var_os("PATH").unwrap())
        .map(|d| d.join(program))
        .find(|p| p.is_file())
        .unwrap_or_else(|| panic!("{program} is not on PATH"))
}

/// `scripts/test --help` says what the script installs and how arguments
/// pass to `cargo test`, and installs and runs nothing: it is answered
/// before the first install step, with a `PATH` that holds only `dirname`
/// (no `apt-get`, `sudo`, `redis-server` or `cargo` for it to reach).
#[test]
fn the_test_script_answers_help_without_installing_anything() {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/test");
    let bin = tempfile::tempdir().unwrap();
    std::os::unix::fs::symlink(on_path("dirname"), bin.path().join("dirname")).unwrap();
    for flag in ["--help", "-h"] {
        let out = std::process::Command::new(on_path("bash"))
            .arg(&script)
            .arg(flag)
            .env("PATH", bin.path())
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{flag}: {out:?}");
        for needed in [
            "installs nothing",
            "cargo test",
            "redis-server",
            "haproxy",
            "chromium",
            "podman",
            "prometheus",
        ] {
            assert!(
                text.contains(needed),
                "{flag}: {needed:?} missing from:\n{text}"
            );
        }
        assert!(
            out.stderr.is_empty(),
            "{flag}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// A port nothing listens on right now (bound, then released).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A relay configuration without TLS files whose admin port is `admin`.
fn plain_relay_config(dir: &Path, admin: u16) -> std::path::PathBuf {
    let file = dir.join("relay.toml");
    std::fs::write(
        &file,
        format!(
            "[relay]\nid = \"relay.status-test\"\nlisten = \"127.0.0.1:0\"\n\
             admin_listen = \"127.0.0.1:{admin}\"\ntls_mode = \"behind-load-balancer\"\n"
        ),
    )
    .unwrap();
    file
}

/// A running relay binary, killed on drop.
struct RunningRelay(std::process::Child);

impl Drop for RunningRelay {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `oab-relay --config file` and returns once it printed its admin
/// address.
fn start_relay(file: &Path) -> RunningRelay {
    use std::io::{BufRead as _, BufReader};
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_oab-relay"))
        .arg("--config")
        .arg(file)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let relay = RunningRelay(child);
    let mut printed = Vec::new();
    for line in BufReader::new(stdout).lines() {
        let line = line.unwrap();
        let done = line.starts_with("admin (metrics, health) on");
        printed.push(line);
        if done {
            return relay;
        }
    }
    panic!("the relay exited before printing its admin address: {printed:#?}");
}

/// `oab-relay --config relay.toml status` asks that relay's
/// `relay.admin_listen` (not the development relay's 127.0.0.1:9443), and
/// `--admin` takes the configuration's scheme-less `host:port` form too.
#[test]
fn status_asks_the_admin_port_of_config_and_takes_a_scheme_less_admin() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let file = plain_relay_config(dir.path(), port);
    let _relay = start_relay(&file);
    let status = |args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_oab-relay"))
            .args(args)
            .env_remove("OAB_RELAY_ADMIN_URL")
            .env_remove("OAB_RELAY_CONFIG")
            .output()
            .unwrap()
    };
    let shown = file.display().to_string();
    let admin = format!("127.0.0.1:{port}");
    for args in [
        vec!["--config", &shown, "status"],
        vec!["status", "--config", &shown],
        vec!["status", "--admin", &admin],
    ] {
        let out = status(&args);
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{args:?}: {text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            text.starts_with("relay relay.status-test "),
            "{args:?}: {text}"
        );
    }
    // Nothing on the configured port: the message names it and the field.
    let other = dir.path().join("other");
    std::fs::create_dir(&other).unwrap();
    let silent = plain_relay_config(&other, free_port());
    let out = status(&["--config", &silent.display().to_string(), "status"]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !err.contains(":9443") && err.contains("relay.admin_listen"),
        "{err}"
    );
    assert!(err.contains(&silent.display().to_string()), "{err}");
}

/// `check-config` lists every problem of a file at once, each with its field
/// and its line: here a field name with a typo (with the field meant), a
/// peer key that does not read (naming the peer) and a route to a peer
/// that is not configured.
#[test]
fn check_config_lists_a_typo_a_bad_key_and_a_bad_route_with_their_lines() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("relay.toml");
    let good_key = "ed25519:VLiJKgQnc1IQU02UPmeG3NtDWkYNa-6PPFtlGxj6oKI";
    std::fs::write(
        &file,
        format!(
            "[relay]\n\
             id = \"relay.example.com\"\n\
             tls_cert = \"/etc/oab/fullchain.pem\"\n\
             tls_key = \"/etc/oab/privkey.pem\"\n\
             heartbeat_msec = 15000\n\
             \n\
             [[peers]]\n\
             id = \"acme/build-host\"\n\
             keys = [{{ key_id = \"k1\", public_key = \"{good_key}\" }}]\n\
             \n\
             [[peers]]\n\
             id = \"acme/review-host\"\n\
             keys = [{{ key_id = \"k1\", public_key = \"ed25519:not-a-key\" }}]\n\
             \n\
             [[routes]]\n\
             from = \"acme/build-host\"\n\
             to = \"acme/reveiw-host\"\n"
        ),
    )
    .unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_oab-relay"))
        .arg("check-config")
        .arg(&file)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("3 problem(s)"), "{err}");
    let lines: Vec<&str> = err.lines().collect();
    let problem = |start: &str| {
        lines
            .iter()
            .find(|l| l.trim_start().starts_with(start))
            .unwrap_or_else(|| panic!("no {start:?} in: {err}"))
            .to_string()
    };
    let typo = problem("- relay.heartbeat_msec (line 5): ");
    assert!(typo.ends_with("did you mean relay.heartbeat_ms?"), "{typo}");
    let key = problem("- peers[1].keys[0].public_key (line 13): ");
    assert!(
        key.contains("invalid public key")
            && key.contains("oab-connector keygen")
            && key.contains("acme/review-host"),
        "{key}"
    );
    let route = problem("- routes[0].to (line 17): ");
    assert!(
        route.contains("peer acme/reveiw-host is not configured in [[peers]]"),
        "{route}"
    );
}

/// A date: year, month, day.
type Ymd = (i32, u8, u8);

/// A certificate and its key as PEM, made now; `dates`: notBefore and
/// notAfter, else rcgen's defaults.
fn cert_and_key(dates: Option<(Ymd, Ymd)>) -> (String, String, rcgen::KeyPair) {
    let key = rcgen::KeyPair::generate().unwrap();
    let mut params = rcgen::CertificateParams::new(vec!["localhost".to_string()]).unwrap();
    if let Some(((by, bm, bd), (ay, am, ad))) = dates {
        params.not_before = rcgen::date_time_ymd(by, bm, bd);
        params.not_after = rcgen::date_time_ymd(ay, am, ad);
    }
    let cert = params.self_signed(&key).unwrap();
    (cert.pem(), key.serialize_pem(), key)
}

/// A relay configuration in `dir` with TLS files `cert` and `key` (and the
/// store `store`), on ports of its own.
fn tls_relay_config(dir: &Path, cert: &Path, key: &Path, store: &str) -> std::path::PathBuf {
    let file = dir.join("tls-relay.toml");
    std::fs::write(
        &file,
        format!(
            "[relay]\nid = \"relay.test\"\nlisten = \"127.0.0.1:0\"\n\
             admin_listen = \"127.0.0.1:{}\"\ntls_cert = {:?}\ntls_key = {:?}\n\
             [store]\nurl = {store:?}\n",
            free_port(),
            cert.display().to_string(),
            key.display().to_string()
        ),
    )
    .unwrap();
    file
}

/// Runs `oab-relay --config file` to its exit (it must exit: a refused
/// start), with `RUST_BACKTRACE=1` as on a developer's machine.
fn failed_start(file: &Path) -> (Option<i32>, String, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_oab-relay"))
        .arg("--config")
        .arg(file)
        .env("RUST_BACKTRACE", "1")
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The TLS files of the configuration are named by their field and path
/// when they cannot be used: a missing certificate chain, a key that is
/// not the certificate's (both files named), a certificate request given as
/// the key. Nothing is said to listen; the error is printed once, without
/// a backtrace.
#[test]
fn tls_files_that_cannot_be_used_are_named_by_field_and_path() {
    let dir = tempfile::tempdir().unwrap();
    let (cert_pem, key_pem, key_pair) = cert_and_key(None);
    let (_, other_key_pem, _) = cert_and_key(None);
    let cert = dir.path().join("fullchain.pem");
    let key = dir.path().join("privkey.pem");
    let other_key = dir.path().join("other-key.pem");
    let csr = dir.path().join("relay.csr");
    std::fs::write(&cert, &cert_pem).unwrap();
    oab_relay::tls::write_file(&key, &key_pem, true).unwrap();
    oab_relay::tls::write_file(&other_key, &other_key_pem, true).unwrap();
    let request = rcgen::CertificateParams::new(vec!["localhost".to_string()])
        .unwrap()
        .serialize_request(&key_pair)
        .unwrap()
        .pem()
        .unwrap();
    oab_relay::tls::write_file(&csr, &request, true).unwrap();
    let missing = dir.path().join("missing").join("fullchain.pem");

    let check = |cert: &Path, key: &Path, want: &[String]| {
        let file = tls_relay_config(dir.path(), cert, key, "memory");
        let (code, stdout, stderr) = failed_start(&file);
        assert_eq!(code, Some(1), "{stderr}");
        assert!(!stdout.contains("listening"), "{stdout}");
        for w in want {
            assert!(stderr.contains(w.as_str()), "{w:?} not in: {stderr}");
        }
        assert!(!stderr.contains("acktrace"), "a backtrace: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "printed once: {stderr}");
    };
    check(
        &missing,
        &key,
        &[format!(
            "relay.tls_cert ({}): no such file; check the path",
            missing.display()
        )],
    );
    check(
        &cert,
        &other_key,
        &[format!(
            "relay.tls_key ({}) is not the private key of the certificate in relay.tls_cert ({})",
            other_key.display(),
            cert.display()
        )],
    );
    check(
        &cert,
        &csr,
        &[
            format!(
                "relay.tls_key ({}): not a private key: it holds a CERTIFICATE REQUEST",
                csr.display()
            ),
            "-----BEGIN PRIVATE KEY-----".to_string(),
        ],
    );
}

/// A certificate past its notAfter (or before its notBefore) is served, but
/// said at start: connectors refuse it.
#[test]
fn an_expired_certificate_is_warned_about_at_start_with_its_not_after() {
    let dir = tempfile::tempdir().unwrap();
    for (dates, want) in [
        (
            ((2020, 1, 1), (2021, 1, 1)),
            "the certificate expired at 2021-01-01T00:00:00Z (notAfter)",
        ),
        (
            ((2999, 1, 1), (3000, 1, 1)),
            "the certificate is not valid before 2999-01-01T00:00:00Z (notBefore)",
        ),
    ] {
        let (cert_pem, key_pem, _) = cert_and_key(Some(dates));
        let cert = dir.path().join("fullchain.pem");
        let key = dir.path().join("privkey.pem");
        std::fs::write(&cert, &cert_pem).unwrap();
        oab_relay::tls::write_file(&key, &key_pem, true).unwrap();
        let file = tls_relay_config(dir.path(), &cert, &key, "memory");
        let seen = relay_log_until(
            &["--config", &file.display().to_string()],
            "relay listening",
        );
        let warning = seen
            .iter()
            .find(|l| l.contains("WARN") && l.contains(want))
            .unwrap_or_else(|| panic!("no warning {want:?}: {seen:#?}"));
        assert!(
            warning.contains(&format!("relay.tls_cert ({})", cert.display())),
            "{warning}"
        );
        assert!(
            seen.iter().any(|l| l.contains("relay listening")),
            "{seen:#?}"
        );
        // check-config says the same, as a warning (exit 0).
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_oab-relay"))
            .arg("check-config")
            .arg(&file)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{err}");
        assert!(
            err.contains(&format!("warning: relay.tls_cert ({})", cert.display()))
                && err.contains(want),
            "{err}"
        );
    }
}

/// `check-config` warns (exit 0) about TLS files it finds on this host and
/// cannot use (here a key that is not the certificate's), and says nothing
/// of files that are not here (the file may be checked on another host).
#[test]
fn check_config_warns_about_tls_files_it_cannot_use_here() {
    let dir = tempfile::tempdir().unwrap();
    let cert = dir.path().join("fullchain.pem");
    let key = dir.path().join("privkey.pem");
    let (cert_pem, _, _) = cert_and_key(None);
    let (_, other_key_pem, _) = cert_and_key(None);
    std::fs::write(&cert, cert_pem).unwrap();
    oab_relay::tls::write_file(&key, &other_key_pem, true).unwrap();
    let check = |file: &Path| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_oab-relay"))
            .arg("check-config")
            .arg(file)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "{err}");
        assert!(
            String::from_utf8_lossy(&out.stdout).contains(": ok ("),
            "{err}"
        );
        err
    };
    let err = check(&tls_relay_config(dir.path(), &cert, &key, "memory"));
    assert!(
        err.contains(&format!(
            "warning: relay.tls_key ({}) is not the private key of the certificate in \
             relay.tls_cert ({})",
            key.display(),
            cert.display()
        )) && err.contains("(the relay does not start with it)"),
        "{err}"
    );
    let elsewhere = dir.path().join("elsewhere").join("fullchain.pem");
    let err = check(&tls_relay_config(dir.path(), &elsewhere, &key, "memory"));
    assert!(!err.contains("relay.tls_"), "{err}");
}

/// With Redis unreachable the relay does not say it listens: it names the
/// URL, the reason and the field, and exits non-zero.
#[test]
fn an_unreachable_redis_is_named_before_anything_listens() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("relay.toml");
    let url = format!("redis://127.0.0.1:{}/", free_port());
    std::fs::write(
        &file,
        format!(
            "[relay]\nid = \"relay.test\"\nlisten = \"127.0.0.1:0\"\n\
             admin_listen = \"127.0.0.1:{}\"\ntls_mode = \"behind-load-balancer\"\n\
             [store]\nurl = {url:?}\n",
            free_port()
        ),
    )
    .unwrap();
    let (code, stdout, stderr) = failed_start(&file);
    assert_eq!(code, Some(1), "{stderr}");
    assert!(!stdout.contains("listening"), "{stdout}");
    assert!(
        stderr.contains(&format!("store: cannot reach {url} ("))
            && stderr.contains("refused")
            && stderr.contains("); is Redis running? (store.url)"),
        "{stderr}"
    );
    assert!(!stderr.contains("acktrace"), "{stderr}");
}

/// A configuration file that is not there is a refused configuration:
/// exit code 2 (as docs/configuration.md says), said once, no backtrace.
#[test]
fn a_missing_config_file_exits_2_saying_so_once() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("relay.toml");
    let (code, stdout, stderr) = failed_start(&missing);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(!stdout.contains("listening"), "{stdout}");
    assert_eq!(
        stderr.trim(),
        format!(
            "oab-relay: cannot read {}: No such file or directory (os error 2)",
            missing.display()
        )
    );
}

/// The fleet trial (`deploy/fleet/`) runs on ports of its own: none is a
/// port of the quick start's development relay (listen, admin), or of the
/// demo's facade and agent, which the README tells you to leave running;
/// the load balancers forward to the instances' own ports, and the README
/// names the ports the files use.
#[test]
fn fleet_trial_ports_do_not_clash_with_the_quick_start() {
    let fleet = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/fleet");
    let port_of = |addr: &str| -> u16 { addr.rsplit(':').next().unwrap().parse().unwrap() };
    let dev = tempfile::tempdir().unwrap();
    let setup = oab_relay::dev::prepare(dev.path()).unwrap();
    let dev_config = oab_relay::config::Config::load(&setup.config).unwrap();
    let quick_start = [
        dev_config.relay.listen.port(),
        dev_config.relay.admin_listen.port(),
        port_of(oab_relay::dev::DEV_FACADE_LISTEN),
        port_of(oab_relay::dev::DEV_AGENT_URL),
    ];
    assert_eq!(quick_start, [7443, 9443, 7070, 7080]);
    let haproxy = std::fs::read_to_string(fleet.join("haproxy.cfg")).unwrap();
    let nginx = std::fs::read_to_string(fleet.join("nginx-stream.conf")).unwrap();
    let readme = std::fs::read_to_string(fleet.join("README.md")).unwrap();
    let mut used = Vec::new();
    for n in 1..=3 {
        let c = oab_relay::config::Config::load(&fleet.join(format!("relay-{n}.toml"))).unwrap();
        let (listen, admin) = (c.relay.listen.port(), c.relay.admin_listen.port());
        assert!(
            haproxy.contains(&format!(
                "server relay-{n} 127.0.0.1:{listen} check port {admin}\n"
            )),
            "haproxy.cfg forwards relay-{n} to {listen} (checks {admin})"
        );
        assert!(nginx.contains(&format!("server 127.0.0.1:{listen} ")));
        used.extend([listen, admin]);
    }
    let balancer: u16 = haproxy
        .split("bind :")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap()
        .parse()
        .unwrap();
    assert!(nginx.contains(&format!("listen {balancer};")));
    assert!(readme.contains(&format!("relay_url = \"wss://127.0.0.1:{balancer}/\"")));
    let facade = port_of(
        readme
            .split("facade_listen = \"")
            .nth(1)
            .and_then(|rest| rest.split('"').next())
            .unwrap(),
    );
    used.extend([balancer, facade]);
    for port in &used {
        assert!(
            !quick_start.contains(port),
            "the fleet trial uses {port}, a port of the quick start"
        );
    }
    // The README's list of the trial's ports, and its check that they are
    // all free again after the teardown, name the same ports.
    let (l1, l3, a1, a3) = (used[0], used[4], used[1], used[5]);
    assert!(
        readme.contains(&format!(
            "relays `{l1}`-`{l3}` (admin `{a1}`-`{a3}`),\nthe load balancer `{balancer}`, the A2A facade `{facade}`"
        )),
        "README's port list"
    );
    let teardown = format!("754[123]|954[123]|{balancer}|{facade}|");
    assert_eq!(
        (l1, a1),
        (7541, 9541),
        "the README's teardown regex names 754x and 954x"
    );
    assert!(readme.contains(&teardown), "README's teardown check");
}

/// The fleet README's expected `check-config` line (step 4) is what the
/// binary prints for the fleet's files.
#[test]
fn fleet_readme_shows_what_check_config_prints() {
    let fleet = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/fleet");
    let readme = std::fs::read_to_string(fleet.join("README.md")).unwrap();
    let expected = readme
        .lines()
        .find_map(|l| l.strip_prefix("# relay-1.toml: "))
        .and_then(|rest| rest.split("   (and relay-2").next())
        .unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_oab-relay"))
        .current_dir(&fleet)
        .args(["check-config", "relay-1.toml"])
        .env_remove("OAB_RELAY_CONFIG")
        .output()
        .unwrap();
    let printed = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{printed}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(printed.trim_end(), format!("relay-1.toml: {expected}"));
}
