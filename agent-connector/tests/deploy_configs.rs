//! Every example connector config in `deploy/` is valid.
#![allow(clippy::unwrap_used, clippy::panic)]

#[test]
fn every_example_connector_config_in_deploy_is_valid() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/connector");
    let mut checked = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().and_then(|e| e.to_str()) == Some("toml") {
            let c = oab_connector::config::ConnectorConfig::load(&path)
                .unwrap_or_else(|e| panic!("{e}"));
            // Examples are copied: none may be unable to delegate or lock
            // callers out.
            let warnings = oab_connector::lockout::warnings(&c, oab_wire::identity::now_ms());
            assert!(warnings.is_empty(), "{}: {warnings:?}", path.display());
            checked += 1;
        }
    }
    assert!(checked > 0, "no example configs found in {}", dir.display());
}

/// A facade whose default capabilities `[policy]` does not grant (the
/// policy is also this host's own grant for what it delegates) would have
/// every delegation refused: `check-config` says so and exits 2, instead of
/// "ok".
#[test]
fn check_config_refuses_a_facade_its_policy_does_not_grant() {
    let dir = tempfile::tempdir().unwrap();
    let config = |policy: &str| {
        format!(
            r#"[connector]
relay_url = "wss://relay.example.com/"
identity = "/etc/oab/connector.identity.toml"

[[peers]]
id = "acme/callee"
keys = [{{ key_id = "k1", public_key = "ed25519:VLiJKgQnc1IQU02UPmeG3NtDWkYNa-6PPFtlGxj6oKI" }}]
{policy}
[a2a]
facade_listen = "127.0.0.1:7070"
default_capabilities = ["read:repo"]
"#
        )
    };
    let check = |text: String| {
        let path = dir.path().join("connector.toml");
        std::fs::write(&path, text).unwrap();
        std::process::Command::new(env!("CARGO_BIN_EXE_oab-connector"))
            .arg("check-config")
            .arg(&path)
            .output()
            .unwrap()
    };
    let out = check(config(""));
    assert_eq!(out.status.code(), Some(2), "no [policy]: refused");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("a2a.default_capabilities") && err.contains("policy.allowed_capabilities"),
        "names both fields: {err}"
    );
    let out = check(config("\n[policy]\nallowed_capabilities = [\"read:*\"]\n"));
    assert!(
        out.status.success(),
        "a policy that grants them: ok ({})",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A configuration that validates but cannot work as meant gets a warning
/// naming the field (exit code 0): here a callee whose policy grants
/// nothing, with a deadline bound that cuts every task short.
#[test]
fn check_config_warns_about_a_callee_that_grants_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("connector.toml");
    std::fs::write(
        &path,
        r#"[connector]
relay_url = "wss://relay.example.com/"
identity = "/etc/oab/connector.identity.toml"

[[peers]]
id = "acme/caller"
keys = [{ key_id = "k1", public_key = "ed25519:VLiJKgQnc1IQU02UPmeG3NtDWkYNa-6PPFtlGxj6oKI" }]

[policy]
max_deadline_ms = 1000

[a2a]
driver_url = "http://127.0.0.1:9999"
"#,
    )
    .unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_oab-connector"))
        .arg("check-config")
        .arg(&path)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("warning: policy.allowed_capabilities: empty: callers can be granted nothing"),
        "{err}"
    );
    assert!(
        err.contains("warning: policy.max_deadline_ms: 1000 ms"),
        "{err}"
    );
}

/// `check-config --relay-config` reads the relay's file too: the deploy
/// examples agree (the example connector is `acme/build-host`), and a route
/// ceiling the callee's policy grants nothing of is named.
#[test]
fn check_config_against_the_relay_config() {
    let deploy = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy");
    let run = |connector: &std::path::Path, relay: &std::path::Path, peer: &str| {
        std::process::Command::new(env!("CARGO_BIN_EXE_oab-connector"))
            .arg("check-config")
            .arg(connector)
            .arg("--relay-config")
            .arg(relay)
            .args(["--peer", peer])
            .output()
            .unwrap()
    };
    let out = run(
        &deploy.join("connector/connector.toml"),
        &deploy.join("relay/relay.toml"),
        "acme/build-host",
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(!err.contains("warning:"), "the examples disagree: {err}");
    // The same relay with the route towards build-host capped at something
    // build-host's policy does not allow.
    let dir = tempfile::tempdir().unwrap();
    let relay = std::fs::read_to_string(deploy.join("relay/relay.toml")).unwrap();
    let (head, tail) = relay.split_at(relay.rfind("ceiling = [\"read:*\"]").unwrap());
    let capped = format!(
        "{head}ceiling = [\"write:prod\"]{}",
        &tail["ceiling = [\"read:*\"]".len()..]
    );
    let path = dir.path().join("relay.toml");
    std::fs::write(&path, capped).unwrap();
    let out = run(
        &deploy.join("connector/connector.toml"),
        &path,
        "acme/build-host",
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("warning: relay: routes[1] (acme/review-host -> acme/build-host) has ceiling [\"write:prod\"]"),
        "{err}"
    );
    // A peer the relay does not know.
    let out = run(
        &deploy.join("connector/connector.toml"),
        &path,
        "acme/nobody",
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("acme/nobody is not in the relay's [[peers]]"),
        "{err}"
    );
}
