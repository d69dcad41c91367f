//! What an operator sees from the `oab-connector` binary when something is
//! wrong: every message names the field (and the file) and says what to do.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use std::io::{BufRead as _, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

fn connector() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_oab-connector"));
    c.env_remove("OAB_CONNECTOR_ADMIN_URL")
        .env_remove("OAB_CONNECTOR_CONFIG")
        .env_remove("RUST_BACKTRACE");
    c
}

/// A port nothing listens on right now (bound, then released).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Writes an identity for `peer` into `dir` with `oab-connector keygen`.
fn keygen(dir: &Path, peer: &str) -> PathBuf {
    let out_file = dir.join(format!("{}.identity.toml", peer.replace('/', "-")));
    let out = connector()
        .args(["keygen", "--peer", peer, "--key-id", "k1", "--out"])
        .arg(&out_file)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    out_file
}

/// A running `oab-connector run`, killed on drop, with its stderr lines.
struct Running {
    child: Child,
    lines: Receiver<String>,
    seen: Vec<String>,
}

impl Running {
    fn start(config: &Path, env: &[(&str, &str)]) -> Running {
        let mut child = connector()
            .arg("run")
            .arg("--config")
            .arg(config)
            .env("OAB_LOG", "info")
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stderr = child.stderr.take().unwrap();
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Running {
            child,
            lines,
            seen: Vec::new(),
        }
    }

    /// The first line (from now) that contains `what`, within 30 s.
    fn line_with(&mut self, what: &str) -> String {
        let deadline = Instant::now() + Duration::from_secs(30);
        while let Ok(line) = self
            .lines
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
        {
            self.seen.push(line.clone());
            if line.contains(what) {
                return line;
            }
        }
        panic!("no line with {what:?}: {:#?}", self.seen);
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `oab-connector status --config connector.toml` asks that connector's
/// `admin.listen` (the scheme-less form of the file is taken by --admin
/// too), and its table has no empty lines at the top.
#[test]
fn status_asks_the_admin_listen_of_config() {
    let dir = tempfile::tempdir().unwrap();
    let identity = keygen(dir.path(), "acme/status");
    let admin = free_port();
    let config = dir.path().join("connector.toml");
    std::fs::write(
        &config,
        format!(
            "[connector]\nrelay_url = \"ws://127.0.0.1:{}/\"\nidentity = {:?}\n\n\
             [admin]\nlisten = \"127.0.0.1:{admin}\"\n",
            free_port(),
            identity.display().to_string()
        ),
    )
    .unwrap();
    let mut running = Running::start(&config, &[]);
    running.line_with("admin endpoint listening");
    let shown = config.display().to_string();
    let admin_addr = format!("127.0.0.1:{admin}");
    for args in [
        vec!["status", "--config", &shown],
        vec!["status", "--admin", &admin_addr],
    ] {
        let out = connector().args(&args).output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{args:?}: {text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(text.starts_with("connector acme/status "), "{text}");
        assert!(!text.contains("\n\n\n"), "two blank lines: {text:?}");
        let second = text.lines().nth(2).unwrap_or_default();
        assert!(second.starts_with("relay "), "{text:?}");
    }
    // A configuration without [admin] listen: said, with the fix.
    let bare = dir.path().join("bare.toml");
    std::fs::write(
        &bare,
        format!(
            "[connector]\nrelay_url = \"wss://relay.example/\"\nidentity = {:?}\n",
            identity.display().to_string()
        ),
    )
    .unwrap();
    let out = connector()
        .args(["status", "--config"])
        .arg(&bare)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("admin.listen is not set") && err.contains("listen = \"127.0.0.1:9444\""),
        "{err}"
    );
}

/// `check-config` lists every problem of a file at once, each with its
/// field and line: a field name with a typo (with the field meant), a peer
/// key that does not read (naming the peer) and a relay URL without its
/// scheme.
#[test]
fn check_config_lists_every_problem_with_its_line() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("connector.toml");
    std::fs::write(
        &file,
        "[connector]\n\
         relay_url = \"relay.example.com:7443\"\n\
         identity = \"/etc/oab/connector.identity.toml\"\n\
         relay_ca_file = \"/etc/oab/ca.pem\"\n\
         \n\
         [[peers]]\n\
         id = \"acme/review-host\"\n\
         keys = [{ key_id = \"k1\", public_key = \"ed25519:short\" }]\n",
    )
    .unwrap();
    let out = connector().arg("check-config").arg(&file).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    let problem = |start: &str| {
        err.lines()
            .find(|l| l.trim_start().starts_with(start))
            .unwrap_or_else(|| panic!("no {start:?} in: {err}"))
            .to_string()
    };
    let url = problem("- connector.relay_url (line 2): must start with wss://");
    assert!(!url.is_empty());
    let typo = problem("- connector.relay_ca_file (line 4): ");
    assert!(typo.ends_with("did you mean connector.relay_ca?"), "{typo}");
    let key = problem("- peers[0].keys[0].public_key (line 8): ");
    assert!(
        key.contains("invalid public key")
            && key.contains("oab-connector keygen")
            && key.contains("acme/review-host"),
        "{key}"
    );
    assert_eq!(err.matches("\n  - ").count(), 3, "only the three: {err}");
}

/// A connector configuration in `dir` for `identity`, towards `relay_url`,
/// with `extra` lines in `[connector]`.
fn connector_config(dir: &Path, identity: &Path, relay_url: &str, extra: &str) -> PathBuf {
    let config = dir.join("run.toml");
    std::fs::write(
        &config,
        format!(
            "[connector]\nrelay_url = {relay_url:?}\nidentity = {:?}\n{extra}\n",
            identity.display().to_string()
        ),
    )
    .unwrap();
    config
}

/// Runs `oab-connector` with `args` to its exit, with `RUST_BACKTRACE=1` as
/// on a developer's machine: exit code and stderr.
fn exits(args: &[&str]) -> (Option<i32>, String) {
    let out = connector()
        .args(args)
        .env("RUST_BACKTRACE", "1")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!err.contains("acktrace"), "a backtrace: {err}");
    (out.status.code(), err)
}

/// Files of the configuration that are not there are named by their field
/// and path, with what to do; a configuration file that is not there exits
/// 2 (a refused configuration), said once.
#[test]
fn missing_files_are_named_by_their_field() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nothing.identity.toml");
    let config = connector_config(dir.path(), &missing, "wss://relay.example:7443/", "");
    let (code, err) = exits(&["run", "--config", &config.display().to_string()]);
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains(&format!(
            "connector.identity ({}): no such file; make one with `oab-connector keygen",
            missing.display()
        )),
        "{err}"
    );
    assert_eq!(
        err.matches("connector.identity (").count(),
        1,
        "said once: {err}"
    );

    let identity = keygen(dir.path(), "acme/files");
    let ca = dir.path().join("relay-ca.pem");
    let config = connector_config(
        dir.path(),
        &identity,
        "wss://relay.example:7443/",
        &format!("relay_ca = {:?}", ca.display().to_string()),
    );
    let (code, err) = exits(&["run", "--config", &config.display().to_string()]);
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains(&format!(
            "connector.relay_ca ({}): no such file; check the path",
            ca.display()
        )),
        "{err}"
    );

    // check-config checks the files it finds here (a CA file without a
    // certificate: a warning, exit 0), and says nothing of those not here.
    let out = connector()
        .arg("check-config")
        .arg(&config)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && !err.contains("relay_ca"), "{err}");
    std::fs::write(&ca, "not a certificate\n").unwrap();
    let out = connector()
        .arg("check-config")
        .arg(&config)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains(&format!(
            "warning: connector.relay_ca ({}): no CERTIFICATE block; give the PEM certificate \
             of the CA that signed the relay's certificate (the connector does not start with it)",
            ca.display()
        )),
        "{err}"
    );

    let gone = dir.path().join("gone.toml");
    let (code, err) = exits(&["run", "--config", &gone.display().to_string()]);
    assert_eq!(code, Some(2), "{err}");
    assert_eq!(
        err.trim(),
        format!(
            "oab-connector: cannot read {}: No such file or directory (os error 2)",
            gone.display()
        )
    );
}

/// `keygen` over an existing file refuses once, saying what to do.
#[test]
fn keygen_over_an_existing_file_says_so_once() {
    let dir = tempfile::tempdir().unwrap();
    let file = keygen(dir.path(), "acme/once");
    let (code, err) = exits(&[
        "keygen",
        "--peer",
        "acme/once",
        "--key-id",
        "k2",
        "--out",
        &file.display().to_string(),
    ]);
    assert_eq!(code, Some(1), "{err}");
    assert_eq!(
        err.trim(),
        format!(
            "oab-connector: {} already exists; an identity file is never overwritten: give \
             another --out, or move the old file away first",
            file.display()
        )
    );
}

/// A link that never came up says so at WARN with the URL: nothing on the
/// port ("connection refused"), or a port that answers the TLS hello in
/// plain HTTP (the relay's admin port).
#[test]
fn a_link_that_never_came_up_names_the_url_at_warn() {
    let dir = tempfile::tempdir().unwrap();
    let identity = keygen(dir.path(), "acme/link");
    let url = format!("ws://127.0.0.1:{}/", free_port());
    let config = connector_config(dir.path(), &identity, &url, "");
    let mut running = Running::start(&config, &[]);
    let line = running.line_with("cannot reach the relay");
    assert!(
        line.contains("WARN")
            && line.contains(&format!(
                "cannot reach the relay at {url}: connection refused"
            ))
            && line.contains("connector.relay_url"),
        "{line}"
    );
    drop(running);

    // An HTTP server (as the admin port is) answering the TLS hello.
    let http = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = http.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for stream in http.incoming() {
            let Ok(mut stream) = stream else { break };
            let mut buf = [0u8; 1024];
            let _ = std::io::Read::read(&mut stream, &mut buf);
            let _ = std::io::Write::write_all(
                &mut stream,
                b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\nconnection: close\r\n\r\n",
            );
        }
    });
    let url = format!("wss://127.0.0.1:{port}/");
    let config = connector_config(dir.path(), &identity, &url, "");
    let mut running = Running::start(&config, &[]);
    let line = running.line_with("cannot reach the relay");
    assert!(
        line.contains("WARN")
            && line.contains(&format!(
                "cannot reach the relay at {url}: 127.0.0.1:{port} does not speak TLS"
            ))
            && line.contains("admin port")
            && line.contains("relay.listen"),
        "{line}"
    );
}

/// A relay whose id is not `connector.relay_id`: the link stops, naming the
/// field, the relay's own id and what to set.
#[test]
fn a_relay_id_mismatch_names_connector_relay_id_and_the_relays_id() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let env = common::Env::new("");
    let relay = runtime.block_on(common::Relay::start(
        &env,
        std::sync::Arc::new(oab_relay::store::MemoryStore::new(
            oab_relay::store::Retention::default(),
        )),
    ));
    let dir = tempfile::tempdir().unwrap();
    let identity = dir.path().join("callee.identity.toml");
    oab_connector::keyfile::save(&env.callee, &identity).unwrap();
    let pin = oab_wire::digest::hex(&oab_wire::Digest::of(&env.cert_der).0);
    let url = format!("wss://localhost:{}/", relay.addr.port());
    let config = connector_config(
        dir.path(),
        &identity,
        &url,
        &format!("relay_id = \"relay.example.com\"\nrelay_pin_sha256 = \"sha256:{pin}\""),
    );
    let mut running = Running::start(&config, &[]);
    let line = running.line_with("connector.relay_id");
    // (the text log shows the reason as it is, quotes unescaped)
    assert!(
        line.contains(&format!(
            "connector.relay_id is \"relay.example.com\", but the relay at {url} names itself \"localhost\""
        )),
        "{line}"
    );
    assert!(line.contains("set connector.relay_id = "), "{line}");
    drop(running);
    runtime.block_on(relay.stop());
}

/// A relay whose certificate (from the private CA of `connector.relay_ca`)
/// has expired: the warning says it is the relay's to renew, with its
/// notAfter, not that the connector's trust settings are wrong.
#[test]
fn an_expired_relay_certificate_is_named_as_the_relays_to_renew() {
    oab_relay::tls::install_crypto_provider();
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let ca = rcgen::CertifiedIssuer::self_signed(ca_params, ca_key).unwrap();
    let leaf_key = rcgen::KeyPair::generate().unwrap();
    let mut leaf_params = rcgen::CertificateParams::new(vec!["localhost".to_string()]).unwrap();
    leaf_params.not_before = rcgen::date_time_ymd(2020, 1, 1);
    leaf_params.not_after = rcgen::date_time_ymd(2021, 1, 1);
    let leaf = leaf_params.signed_by(&leaf_key, &ca).unwrap();
    let key: rustls::pki_types::PrivateKeyDer<'static> =
        rustls::pki_types::pem::PemObject::from_pem_slice(leaf_key.serialize_pem().as_bytes())
            .unwrap();
    let tls = oab_relay::tls::server_config(vec![leaf.der().clone()], key).unwrap();

    let env = common::Env::new("");
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let listener = runtime
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let port = listener.local_addr().unwrap().port();
    let stop = tokio_util::sync::CancellationToken::new();
    let relay = runtime.spawn(oab_relay::run(
        listener,
        None,
        std::sync::Arc::new(env.config.clone()),
        std::sync::Arc::new(oab_relay::store::MemoryStore::new(
            oab_relay::store::Retention::default(),
        )),
        Some(tls),
        stop.clone(),
    ));

    let dir = tempfile::tempdir().unwrap();
    let identity = dir.path().join("callee.identity.toml");
    oab_connector::keyfile::save(&env.callee, &identity).unwrap();
    let ca_file = dir.path().join("relay-ca.pem");
    std::fs::write(&ca_file, ca.pem()).unwrap();
    let config = connector_config(
        dir.path(),
        &identity,
        &format!("wss://localhost:{port}/"),
        &format!("relay_ca = {:?}", ca_file.display().to_string()),
    );
    let mut running = Running::start(&config, &[]);
    let line = running.line_with("the relay's certificate was refused");
    assert!(line.contains("WARN"), "{line}");
    assert!(
        line.contains("the relay's certificate expired at 2021-01-01T00:00:00Z (its notAfter)")
            && line.contains("renewed on the relay (relay.tls_cert"),
        "{line}"
    );
    assert!(!line.contains("subjectAltName"), "{line}");
    drop(running);
    stop.cancel();
    let _ = runtime.block_on(relay);
}

/// SIGTERM to `oab-connector run`: it says it is stopping (with the
/// delegations open on each side and the frames not yet acknowledged),
/// then that it stopped, and exits 0.
#[test]
fn sigterm_is_logged_with_the_open_delegations_and_the_exit() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let env = common::Env::new("");
    let relay = runtime.block_on(common::Relay::start(
        &env,
        std::sync::Arc::new(oab_relay::store::MemoryStore::new(
            oab_relay::store::Retention::default(),
        )),
    ));
    let dir = tempfile::tempdir().unwrap();
    let identity = dir.path().join("callee.identity.toml");
    oab_connector::keyfile::save(&env.callee, &identity).unwrap();
    let pin = oab_wire::digest::hex(&oab_wire::Digest::of(&env.cert_der).0);
    let url = format!("wss://localhost:{}/", relay.addr.port());
    let config = connector_config(
        dir.path(),
        &identity,
        &url,
        &format!("relay_pin_sha256 = \"sha256:{pin}\""),
    );
    let mut running = Running::start(&config, &[]);
    running.line_with("connected to the relay");
    let status = Command::new("kill")
        .args(["-TERM", &running.child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let line = running.line_with("stopping");
    assert!(
        line.contains("INFO")
            && line.contains("signal=\"SIGTERM\"")
            && line.contains("open_as_caller=0")
            && line.contains("open_as_callee=0")
            && line.contains("unacked_frames=0")
            && line.contains("closing the listeners, then the relay link"),
        "{line}"
    );
    let line = running.line_with("connector stopped");
    assert!(line.contains("INFO"), "{line}");
    let deadline = Instant::now() + Duration::from_secs(20);
    let code = loop {
        if let Some(s) = running.child.try_wait().unwrap() {
            break s.code();
        }
        assert!(Instant::now() < deadline, "still running after SIGTERM");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(code, Some(0));
    drop(running);
    runtime.block_on(relay.stop());
}
