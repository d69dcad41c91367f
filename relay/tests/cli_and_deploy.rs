//! The operator-facing surface: every example config in `deploy/` is valid,
//! and `oab-relay check-config` names every bad field.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::Path;

#[test]
fn every_example_relay_config_in_deploy_is_valid() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/relay");
    let mut checked = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().and_then(|e| e.to_str()) == Some("toml") {
            oab_relay::config::Config::load(&path).unwrap_or_else(|e| panic!("{e}"));
            checked += 1;
        }
    }
    assert!(checked > 0, "no example configs found in {}", dir.display());
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
