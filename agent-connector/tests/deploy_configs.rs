//! Every example connector config in `deploy/` is valid.
#![allow(clippy::unwrap_used, clippy::panic)]

#[test]
fn every_example_connector_config_in_deploy_is_valid() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/connector");
    let mut checked = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().and_then(|e| e.to_str()) == Some("toml") {
            oab_connector::config::ConnectorConfig::load(&path).unwrap_or_else(|e| panic!("{e}"));
            checked += 1;
        }
    }
    assert!(checked > 0, "no example configs found in {}", dir.display());
}
