//! The deployment artefacts of `deploy/` against the real tools:
//! - the container images (`deploy/container`): built with podman from the
//!   binaries this test run built, their root filesystems exported, and the
//!   binaries run from them (chroot, as the image's non-root user);
//! - the Kubernetes manifests (`deploy/k8s`): rendered with `kubectl
//!   kustomize`, every object validated against the Kubernetes schemas
//!   (`kubernetes-validate` in `.venv`), the configs in their ConfigMaps
//!   checked with `check-config`;
//! - monitoring (`deploy/prometheus`, `deploy/grafana`): `promtool check
//!   rules` and the alerts' unit tests, then a real Prometheus that scrapes a
//!   running relay, and every series the rules and the dashboard name looked
//!   up among those it scraped.
//!
//! A test whose tool is missing says so and passes, unless the tool is named
//! in `OAB_DEPLOY_TOOLS_REQUIRED` (scripts/test names the tools it
//! installed): then a missing tool fails.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{RelayProcess, TestEnv, free_port, http_get};
use serde_json::Value;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn on_path(tool: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(tool))
        .find(|p| p.is_file())
}

/// `true` when the test may go on; otherwise it says why it skips (and
/// fails instead when the tool is required).
fn have(tool: &str, found: bool, hint: &str) -> bool {
    if found {
        return true;
    }
    let required = std::env::var("OAB_DEPLOY_TOOLS_REQUIRED").unwrap_or_default();
    if required.split_whitespace().any(|t| t == tool) {
        panic!("{tool} is required (OAB_DEPLOY_TOOLS_REQUIRED) but missing: {hint}");
    }
    eprintln!("SKIPPED: {tool} not found ({hint})");
    false
}

fn run(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn connector_bin() -> Option<PathBuf> {
    // Built by `cargo test --workspace`; not by `-p oab-relay` alone.
    let p = Path::new(env!("CARGO_BIN_EXE_oab-relay")).with_file_name("oab-connector");
    p.is_file().then_some(p)
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

// ---------------------------------------------------------------- image

/// Removes the test's images however the test ends.
struct Images(Vec<String>);

impl Drop for Images {
    fn drop(&mut self) {
        for image in &self.0 {
            let _ = Command::new("podman")
                .args(["rmi", "--force", image])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
        }
    }
}

/// The image's root filesystem, exported into `into`, and its config.
fn export_image(image: &str, into: &Path) -> Value {
    let id = run(Command::new("podman").args(["create", image]));
    let id = id.trim();
    let tar = into.with_extension("tar");
    let exported = Command::new("podman")
        .args(["export", "-o"])
        .arg(&tar)
        .arg(id)
        .status();
    let _ = Command::new("podman")
        .args(["rm", id])
        .stdout(Stdio::null())
        .status();
    assert!(exported.unwrap().success(), "podman export {image}");
    std::fs::create_dir_all(into).unwrap();
    run(Command::new("tar").arg("-xf").arg(&tar).arg("-C").arg(into));
    let inspect = run(Command::new("podman").args(["image", "inspect", image]));
    let v: Value = serde_json::from_str(&inspect).unwrap();
    v[0]["Config"].clone()
}

/// The image's entrypoint and command, run in `root` as the image's user.
fn chroot_cmd(root: &Path, config: &Value, args: Option<&[&str]>) -> Command {
    let user = config["User"].as_str().unwrap();
    let mut argv: Vec<String> = config["Entrypoint"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap().to_string())
        .collect();
    match args {
        Some(a) => argv.extend(a.iter().map(|s| s.to_string())),
        None => argv.extend(
            config["Cmd"]
                .as_array()
                .unwrap()
                .iter()
                .map(|a| a.as_str().unwrap().to_string()),
        ),
    }
    let mut cmd = Command::new("chroot");
    cmd.arg(format!("--userspec={user}"))
        .arg(root)
        .args(&argv)
        // Only the image's environment, as in a container.
        .env_clear();
    for kv in config["Env"].as_array().into_iter().flatten() {
        if let Some((k, v)) = kv.as_str().unwrap().split_once('=') {
            cmd.env(k, v);
        }
    }
    cmd
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn images_run_from_their_exported_roots_as_a_non_root_user() {
    if !have(
        "podman",
        on_path("podman").is_some(),
        "apt-get install podman; the container image is not tested",
    ) {
        return;
    }
    let bin_dir = Path::new(env!("CARGO_BIN_EXE_oab-relay")).parent().unwrap();
    let tag = format!("test-{}", std::process::id());
    let mut images = Images(vec![format!("oab-relay:{tag}")]);
    let mut build = Command::new(repo().join("deploy/container/build"));
    build.arg("--bin-dir").arg(bin_dir).args(["--tag", &tag]);
    if connector_bin().is_some() {
        images.0.push(format!("oab-connector:{tag}"));
    } else {
        eprintln!("no oab-connector binary beside oab-relay: only the relay image is built");
        build.args(["--only", "oab-relay"]);
    }
    let out = run(&mut build);
    for image in &images.0 {
        assert!(out.contains(&format!("built {image}")), "{out}");
    }

    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("relay");
    let config = export_image(&images.0[0], &root);
    assert_eq!(config["User"], "10001:10001", "{config}");
    // FROM scratch: the binary, its libraries and /etc, nothing to run a
    // shell with.
    assert!(root.join("usr/local/bin/oab-relay").is_file());
    assert!(!root.join("bin/sh").exists() && !root.join("usr/bin").exists());
    let passwd = std::fs::read_to_string(root.join("etc/passwd")).unwrap();
    assert!(passwd.contains("oab:x:10001:10001:"), "{passwd}");
    if !have(
        "chroot-as-root",
        is_root(),
        "running the image's binaries needs chroot, so root",
    ) {
        return;
    }

    // The binary runs with the image's loader and libraries only.
    let version = run(&mut chroot_cmd(&root, &config, Some(&["--version"])));
    assert!(version.starts_with("oab-relay "), "{version}");

    // A configuration and a certificate mounted where the image expects
    // them, readable by the image's user (as the Kubernetes Secret is).
    let env = TestEnv::new("");
    let tls = root.join("etc/oab-relay/tls");
    std::fs::create_dir_all(&tls).unwrap();
    for f in ["cert.pem", "key.pem"] {
        let to = tls.join(f);
        std::fs::copy(env.dir.path().join(f), &to).unwrap();
        std::os::unix::fs::chown(&to, Some(0), Some(10001)).unwrap();
        std::fs::set_permissions(&to, std::os::unix::fs::PermissionsExt::from_mode(0o440)).unwrap();
    }
    let text = std::fs::read_to_string(&env.config_path)
        .unwrap()
        .replace(&env.dir.path().display().to_string(), "/etc/oab-relay/tls");
    std::fs::write(root.join("etc/oab-relay/relay.toml"), text).unwrap();
    let checked = run(&mut chroot_cmd(
        &root,
        &config,
        Some(&["check-config", "/etc/oab-relay/relay.toml"]),
    ));
    assert!(checked.contains(": ok ("), "{checked}");

    // It serves with the image's default command, its listeners set from
    // the environment, as uid 10001 in a root it cannot write to.
    let (addr, admin) = (
        SocketAddr::from(([127, 0, 0, 1], free_port())),
        SocketAddr::from(([127, 0, 0, 1], free_port())),
    );
    let mut relay = chroot_cmd(&root, &config, None)
        .env("OAB_RELAY_LISTEN", addr.to_string())
        .env("OAB_RELAY_ADMIN_LISTEN", admin.to_string())
        .env("OAB_RELAY_STORE", "memory")
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let until = Instant::now() + Duration::from_secs(20);
    loop {
        if tokio::net::TcpStream::connect(admin).await.is_ok()
            && http_get(admin, "/readyz").await.ends_with("ready\n")
        {
            break;
        }
        assert!(
            relay.try_wait().unwrap().is_none(),
            "the relay in the image exited"
        );
        assert!(
            Instant::now() < until,
            "the relay in the image never got ready"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // A real session over TLS with the mounted certificate.
    let target = oab_testkit::raw_client::Target {
        addr: addr.to_string(),
        server_name: Some("localhost".into()),
        root_der: env.cert_der.clone(),
    };
    let session = oab_testkit::raw_client::RawClient::connect(
        &target,
        &env.caller,
        oab_wire::InstanceId::random(),
    )
    .await;
    assert!(session.is_ok(), "handshake: {:?}", session.err());
    run(Command::new("kill").args(["-TERM", &relay.id().to_string()]));
    let status = relay.wait().unwrap();
    assert!(status.success(), "drained and exited: {status}");

    if images.0.len() > 1 {
        let root = dir.path().join("connector");
        let config = export_image(&images.0[1], &root);
        assert_eq!(config["User"], "10001:10001", "{config}");
        let version = run(&mut chroot_cmd(&root, &config, Some(&["--version"])));
        assert!(version.starts_with("oab-connector "), "{version}");
        std::fs::copy(
            repo().join("deploy/k8s/connector-sidecar/connector.toml"),
            root.join("etc/oab-connector/connector.toml"),
        )
        .unwrap();
        let checked = run(&mut chroot_cmd(
            &root,
            &config,
            Some(&["check-config", "/etc/oab-connector/connector.toml"]),
        ));
        assert!(checked.contains(": ok ("), "{checked}");
    }
}

// ----------------------------------------------------------- kubernetes

/// The Kubernetes version whose schemas the manifests must pass: the oldest
/// they support (the preStop `sleep` action is on by default from 1.30).
const KUBERNETES_VERSION: &str = "1.30.0";

fn kustomize(dir: &Path) -> String {
    if on_path("kubectl").is_some() {
        run(Command::new("kubectl").arg("kustomize").arg(dir))
    } else {
        run(Command::new("kustomize").arg("build").arg(dir))
    }
}

fn kustomizations(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let p = entry.unwrap().path();
        if p.is_dir() {
            if p.join("kustomization.yaml").is_file() {
                out.push(p.clone());
            }
            kustomizations(&p, out);
        }
    }
}

fn by_kind<'a>(objects: &'a [Value], kind: &str) -> Vec<&'a Value> {
    objects.iter().filter(|o| o["kind"] == kind).collect()
}

fn containers(pod: &Value) -> Vec<&Value> {
    ["containers", "initContainers"]
        .iter()
        .flat_map(|k| pod[k].as_array().into_iter().flatten())
        .collect()
}

#[test]
fn kubernetes_manifests_render_and_every_object_passes_the_schemas() {
    let kubectl = on_path("kubectl").is_some() || on_path("kustomize").is_some();
    if !have(
        "kubectl",
        kubectl,
        "kubectl (with kustomize) or kustomize; the Kubernetes manifests are not tested",
    ) {
        return;
    }
    let venv = repo().join(".venv/bin");
    if !have(
        "kubernetes-validate",
        venv.join("kubernetes-validate").is_file(),
        "scripts/python-env installs it into .venv",
    ) {
        return;
    }
    let mut dirs = Vec::new();
    kustomizations(&repo().join("deploy/k8s"), &mut dirs);
    dirs.sort();
    let names: Vec<String> = dirs
        .iter()
        .map(|d| {
            d.strip_prefix(repo().join("deploy/k8s"))
                .unwrap()
                .display()
                .to_string()
        })
        .collect();
    for needed in [
        "relay",
        "redis",
        "connector-sidecar",
        "overlays/bundled-redis",
        "overlays/managed-redis",
    ] {
        assert!(
            names.iter().any(|n| n == needed),
            "{needed} not in {names:?}"
        );
    }

    let out = tempfile::tempdir().unwrap();
    let mut files = Vec::new();
    let mut objects: Vec<(String, Value)> = Vec::new();
    for (dir, name) in dirs.iter().zip(&names) {
        let yaml = kustomize(dir);
        let file = out.path().join(format!("{}.yaml", name.replace('/', "-")));
        std::fs::write(&file, &yaml).unwrap();
        // The rendered documents as JSON (PyYAML comes with kubernetes-validate).
        let json = run(Command::new(venv.join("python"))
            .args([
                "-c",
                "import json, sys, yaml; json.dump([d for d in yaml.safe_load_all(open(sys.argv[1])) if d], sys.stdout)",
            ])
            .arg(&file));
        let docs: Vec<Value> = serde_json::from_str(&json).unwrap();
        assert!(!docs.is_empty(), "{name} rendered nothing");
        objects.extend(docs.into_iter().map(|d| (name.clone(), d)));
        files.push(file);
    }
    // Strict: an unknown or misspelt field fails too.
    let validated = Command::new(venv.join("kubernetes-validate"))
        .args(["--strict", "--quiet", "-k", KUBERNETES_VERSION])
        .args(&files)
        .output()
        .unwrap();
    assert!(
        validated.status.success(),
        "kubernetes-validate:\n{}{}",
        String::from_utf8_lossy(&validated.stdout),
        String::from_utf8_lossy(&validated.stderr)
    );

    // No secret is committed: the Secrets are created at deploy time.
    assert!(objects.iter().all(|(_, o)| o["kind"] != "Secret"));
    let all: Vec<Value> = objects.iter().map(|(_, o)| o.clone()).collect();

    // Every container runs as non-root on a read-only root filesystem.
    for (name, o) in &objects {
        let pod = &o["spec"]["template"]["spec"];
        for c in containers(pod) {
            let sc = &c["securityContext"];
            let non_root =
                sc["runAsNonRoot"] == true || pod["securityContext"]["runAsNonRoot"] == true;
            if c["name"] != "oab" {
                // `oab` is the placeholder for the operator's own OAB container.
                assert!(non_root, "{name}: container {} may run as root", c["name"]);
                assert_eq!(sc["readOnlyRootFilesystem"], true, "{name}: {}", c["name"]);
            }
        }
    }

    // The relay: several instances, a PDB, readiness on /readyz, a preStop
    // wait inside a grace period that covers the drain.
    let relay_toml = by_kind(&all, "ConfigMap")
        .into_iter()
        .find_map(|c| c["data"]["relay.toml"].as_str())
        .expect("a ConfigMap with relay.toml");
    let relay_cfg =
        oab_relay::config::Config::from_toml_with_overrides(relay_toml, "ConfigMap", &[]).unwrap();
    let deployment = by_kind(&all, "Deployment")
        .into_iter()
        .find(|d| d["metadata"]["name"] == "oab-relay")
        .unwrap();
    assert!(deployment["spec"]["replicas"].as_u64().unwrap() >= 2);
    let pod = &deployment["spec"]["template"]["spec"];
    let relay = &pod["containers"][0];
    assert_eq!(relay["readinessProbe"]["httpGet"]["path"], "/readyz");
    let wait = relay["lifecycle"]["preStop"]["sleep"]["seconds"]
        .as_u64()
        .unwrap();
    let grace = pod["terminationGracePeriodSeconds"].as_u64().unwrap();
    assert!(
        grace * 1000 > wait * 1000 + relay_cfg.relay.drain_timeout_ms,
        "grace {grace} s does not cover preStop {wait} s + drain {} ms",
        relay_cfg.relay.drain_timeout_ms
    );
    assert!(relay["resources"]["requests"]["memory"].is_string());
    assert!(!by_kind(&all, "PodDisruptionBudget").is_empty());
    let l4 = by_kind(&all, "Service")
        .into_iter()
        .find(|s| s["spec"]["type"] == "LoadBalancer")
        .unwrap();
    assert_eq!(l4["spec"]["externalTrafficPolicy"], "Local");
    assert!(
        l4["spec"]["ports"]
            .as_array()
            .unwrap()
            .iter()
            .all(|p| p["protocol"] == "TCP")
    );

    // Redis: a StatefulSet with the AOF on and no eviction.
    assert!(!by_kind(&all, "StatefulSet").is_empty());
    let redis_conf = by_kind(&all, "ConfigMap")
        .into_iter()
        .find_map(|c| c["data"]["redis.conf"].as_str())
        .unwrap();
    let directives: Vec<&str> = redis_conf
        .lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .collect();
    assert!(directives.contains(&"appendonly yes"), "{redis_conf}");
    assert!(
        directives.contains(&"maxmemory-policy noeviction"),
        "{redis_conf}"
    );

    // The connector as a sidecar of the OAB host's pod.
    let host = by_kind(&all, "Deployment")
        .into_iter()
        .find(|d| d["metadata"]["name"] == "oab-host")
        .unwrap();
    let sidecar = &host["spec"]["template"]["spec"]["initContainers"][0];
    assert_eq!(sidecar["restartPolicy"], "Always");

    // The configs in the ConfigMaps pass the binaries' own checks.
    for cm in by_kind(&all, "ConfigMap") {
        for (key, text) in cm["data"].as_object().unwrap() {
            let bin = match key.as_str() {
                "relay.toml" => PathBuf::from(env!("CARGO_BIN_EXE_oab-relay")),
                "connector.toml" => match connector_bin() {
                    Some(b) => b,
                    None => {
                        eprintln!("no oab-connector binary: connector.toml not checked");
                        continue;
                    }
                },
                _ => continue,
            };
            let file = out.path().join(key);
            std::fs::write(&file, text.as_str().unwrap()).unwrap();
            let ok = run(Command::new(bin).arg("check-config").arg(&file));
            assert!(ok.contains(": ok ("), "{ok}");
        }
    }
}

// ----------------------------------------------------------- monitoring

fn prometheus_dir() -> PathBuf {
    repo().join("deploy/prometheus")
}

/// Rule files: every YAML file in deploy/prometheus with a `groups:` key.
fn rule_files() -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(prometheus_dir())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.extension().is_some_and(|e| e == "yml")
                && std::fs::read_to_string(p)
                    .unwrap()
                    .lines()
                    .any(|l| l.starts_with("groups:"))
        })
        .collect();
    files.sort();
    files
}

#[test]
fn alert_rules_pass_promtool_and_their_unit_tests() {
    if !have(
        "promtool",
        on_path("promtool").is_some(),
        "apt-get install prometheus; the alert rules are not tested",
    ) {
        return;
    }
    let rules = rule_files();
    assert!(!rules.is_empty(), "no rule files in deploy/prometheus");
    run(Command::new("promtool")
        .args(["check", "rules"])
        .args(&rules));
    let mut tests: Vec<PathBuf> = std::fs::read_dir(prometheus_dir())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.display().to_string().ends_with(".test.yml"))
        .collect();
    tests.sort();
    assert!(
        !tests.is_empty(),
        "no rule tests (*.test.yml) in deploy/prometheus"
    );
    // Every alert has at least one unit test.
    let tested: String = tests
        .iter()
        .map(|t| std::fs::read_to_string(t).unwrap())
        .collect();
    for rule in &rules {
        for line in std::fs::read_to_string(rule).unwrap().lines() {
            if let Some(name) = line.trim().strip_prefix("- alert: ") {
                assert!(
                    tested.contains(&format!("alertname: {name}")),
                    "alert {name} has no promtool test case"
                );
            }
        }
    }
    run(Command::new("promtool")
        .args(["test", "rules"])
        .args(&tests)
        .current_dir(prometheus_dir()));
    // The scrape example is a valid Prometheus configuration.
    run(Command::new("promtool")
        .args(["check", "config"])
        .arg(prometheus_dir().join("scrape.yml")));
}

/// Metric names in a PromQL expression: identifiers outside quotes that
/// start with `oab_`.
fn metric_names(expr: &str, out: &mut BTreeSet<String>) {
    let mut chars = expr.chars().peekable();
    let mut word = String::new();
    let mut quote = None;
    while let Some(c) = chars.next() {
        if let Some(q) = quote {
            if c == '\\' {
                chars.next();
            } else if c == q {
                quote = None;
            }
            continue;
        }
        if c.is_ascii_alphanumeric() || c == '_' || c == ':' {
            word.push(c);
            continue;
        }
        if word.starts_with("oab_") {
            out.insert(std::mem::take(&mut word));
        }
        word.clear();
        if c == '"' || c == '\'' || c == '`' {
            quote = Some(c);
        }
    }
    if word.starts_with("oab_") {
        out.insert(word);
    }
}

fn exprs_in(v: &Value, out: &mut Vec<String>) {
    match v {
        Value::Object(m) => {
            for (k, v) in m {
                if k == "expr" {
                    out.push(v.as_str().unwrap().to_string());
                } else {
                    exprs_in(v, out);
                }
            }
        }
        Value::Array(a) => a.iter().for_each(|v| exprs_in(v, out)),
        _ => {}
    }
}

async fn get_json(addr: SocketAddr, path: &str) -> Option<Value> {
    let page = http_get(addr, path).await;
    let (head, body) = page.split_once("\r\n\r\n")?;
    head.lines()
        .next()
        .is_some_and(|l| l.contains(" 200 "))
        .then(|| serde_json::from_str(body).ok())
        .flatten()
}

fn url_encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// Kills the Prometheus the test started.
struct Child(std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_scrapes_the_relay_and_every_series_of_rules_and_dashboard_exists() {
    if !have(
        "prometheus",
        on_path("prometheus").is_some(),
        "apt-get install prometheus; the dashboard's and rules' series are not checked",
    ) {
        return;
    }
    let env = TestEnv::new("");
    let relay = RelayProcess::start(&env, "memory").await;

    let dir = tempfile::tempdir().unwrap();
    let rules: Vec<String> = rule_files()
        .iter()
        .map(|p| format!("{:?}", p.canonicalize().unwrap().display().to_string()))
        .collect();
    let config = format!(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n\
         rule_files: [{}]\n\
         scrape_configs:\n  - job_name: oab-relay\n    static_configs:\n      - targets: [\"{}\"]\n",
        rules.join(", "),
        relay.admin
    );
    let config_path = dir.path().join("prometheus.yml");
    std::fs::write(&config_path, config).unwrap();
    let web = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let _prometheus = Child(
        Command::new("prometheus")
            .arg(format!("--config.file={}", config_path.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address={web}"))
            .arg("--log.level=warn")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );

    // Until Prometheus has scraped the relay once, successfully.
    let until = Instant::now() + Duration::from_secs(60);
    loop {
        if tokio::net::TcpStream::connect(web).await.is_ok()
            && let Some(t) = get_json(web, "/api/v1/targets").await
        {
            let targets = t["data"]["activeTargets"]
                .as_array()
                .cloned()
                .unwrap_or_default();
            if targets.iter().any(|t| t["health"] == "up") {
                break;
            }
        }
        assert!(Instant::now() < until, "Prometheus never scraped the relay");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let names = get_json(web, "/api/v1/label/__name__/values")
        .await
        .unwrap();
    let scraped: BTreeSet<String> = names["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n.as_str().unwrap().to_string())
        .filter(|n| n.starts_with("oab_"))
        .collect();
    assert!(scraped.contains("oab_sessions"), "{scraped:?}");

    // The rules as Prometheus loaded them, and the dashboard's queries.
    let loaded = get_json(web, "/api/v1/rules").await.unwrap();
    let mut rule_exprs = Vec::new();
    for g in loaded["data"]["groups"].as_array().unwrap() {
        for r in g["rules"].as_array().unwrap() {
            rule_exprs.push(r["query"].as_str().unwrap().to_string());
        }
    }
    assert!(rule_exprs.len() >= 5, "{rule_exprs:?}");
    let mut dashboards = 0;
    let mut dash_exprs = Vec::new();
    for entry in std::fs::read_dir(repo().join("deploy/grafana")).unwrap() {
        let p = entry.unwrap().path();
        if p.extension().is_some_and(|e| e == "json") {
            let v: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
            exprs_in(&v, &mut dash_exprs);
            dashboards += 1;
        }
    }
    assert!(dashboards > 0 && dash_exprs.len() >= 20, "{dash_exprs:?}");

    let mut used = BTreeSet::new();
    for e in rule_exprs.iter().chain(&dash_exprs) {
        metric_names(e, &mut used);
    }
    let missing: Vec<&String> = used.difference(&scraped).collect();
    assert!(
        missing.is_empty(),
        "named in rules or dashboard but not exported: {missing:?}\nexported: {scraped:?}"
    );

    // Every dashboard query is valid PromQL to this Prometheus, with the
    // dashboard's variables filled in.
    for e in &dash_exprs {
        let q = e
            .replace("$__rate_interval", "1m")
            .replace("$instance", ".*");
        let path = format!("/api/v1/query?query={}", url_encode(&q));
        let answer = get_json(web, &path).await;
        assert!(
            answer.as_ref().is_some_and(|a| a["status"] == "success"),
            "query {q:?}: {answer:?}"
        );
    }
    drop(relay);
}

#[test]
fn metric_names_are_the_identifiers_outside_quotes() {
    let mut n = BTreeSet::new();
    metric_names(
        r#"histogram_quantile(0.99, sum by (le) (rate(oab_ack_latency_seconds_bucket{reason="oab_not_a_name"}[5m]))) / oab_x"#,
        &mut n,
    );
    assert_eq!(
        n.into_iter().collect::<Vec<_>>(),
        ["oab_ack_latency_seconds_bucket", "oab_x"]
    );
}
