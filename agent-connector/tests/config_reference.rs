//! `docs/configuration.md` lists exactly the fields the configuration
//! structs accept, for `relay.toml` (`oab_relay::config::Config`) and
//! `connector.toml` (`oab_connector::config::ConnectorConfig`), so the
//! reference cannot drift from the code.
//!
//! The accepted fields come from the parsers themselves, not from a list
//! kept here: every struct of both files is `deny_unknown_fields`, so a
//! table holding only an unknown key `__probe__` is refused with serde's
//! "unknown field `__probe__`, expected one of `a`, `b`, ..." naming every
//! field that table accepts. The test probes the top level, then each field
//! as a table and as an array of tables: a field whose probe is answered
//! that way is a struct (recursed into); any other answer makes it a value.
//!
//! What it assumes of the doc, kept simple: the relay's part comes first and
//! the connector's starts at the heading `## oab-connector command line`; a
//! heading (or a line starting with a backticked `[section]` /
//! `[[section]]`) names the section its tables describe; a table row's
//! first cell names fields in backticks (several allowed: `` `a`, `b` ``),
//! relative to that section, `keys[].key_id` for a field of an array of
//! tables. Rows under a heading without a section (command lines, logging)
//! are not fields.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeSet;

use serde::de::DeserializeOwned;

const PROBE: &str = "__probe__";

/// One step of a path: a field, as a table or an array of tables.
#[derive(Clone)]
struct Step {
    name: String,
    array: bool,
}

/// A TOML document that puts a table holding only `__probe__` at `path`.
fn probe_document(path: &[Step]) -> String {
    let mut inner = toml::Table::new();
    inner.insert(PROBE.into(), toml::Value::Integer(1));
    let mut value = toml::Value::Table(inner);
    for step in path.iter().rev() {
        if step.array {
            value = toml::Value::Array(vec![value]);
        }
        let mut t = toml::Table::new();
        t.insert(step.name.clone(), value);
        value = toml::Value::Table(t);
    }
    toml::to_string(&value).unwrap()
}

/// The fields the struct at `path` accepts, or `None` when there is no
/// struct there (the probe was refused for another reason).
fn fields_at<T: DeserializeOwned>(path: &[Step]) -> Option<Vec<String>> {
    let doc = probe_document(path);
    let err = match toml::from_str::<T>(&doc) {
        Ok(_) => return None,
        Err(e) => e.to_string(),
    };
    let marker = format!("unknown field `{PROBE}`, ");
    let rest = err.split(&marker).nth(1)?;
    let line = rest.lines().next().unwrap_or("");
    if line.contains("there are no fields") {
        return Some(Vec::new());
    }
    // "expected one of `a`, `b`" or "expected `a`": every backticked name.
    Some(
        line.split('`')
            .skip(1)
            .step_by(2)
            .map(str::to_string)
            .collect(),
    )
}

/// Every field path `T` accepts (`section`, `section.field`,
/// `peers.keys.key_id`), found by probing.
fn accepted<T: DeserializeOwned>() -> BTreeSet<String> {
    fn walk<T: DeserializeOwned>(path: &mut Vec<Step>, out: &mut BTreeSet<String>) {
        let Some(fields) = fields_at::<T>(path) else {
            return;
        };
        for f in fields {
            let mut shown: Vec<&str> = path.iter().map(|s| s.name.as_str()).collect();
            shown.push(&f);
            out.insert(shown.join("."));
            for array in [false, true] {
                path.push(Step {
                    name: f.clone(),
                    array,
                });
                let is_struct = fields_at::<T>(path).is_some();
                if is_struct {
                    walk::<T>(path, out);
                }
                path.pop();
                if is_struct {
                    break;
                }
            }
        }
    }
    let mut out = BTreeSet::new();
    walk::<T>(&mut Vec::new(), &mut out);
    out
}

/// The backticked names in `text`.
fn backticked(text: &str) -> Vec<&str> {
    text.split('`').skip(1).step_by(2).collect()
}

/// `[relay]` -> `relay`, `[[openab.runtimes]]` -> `openab.runtimes`.
fn section_name(token: &str) -> Option<&str> {
    let t = token.trim();
    let inner = t.strip_prefix("[[").and_then(|t| t.strip_suffix("]]"));
    let inner = inner.or_else(|| t.strip_prefix('[').and_then(|t| t.strip_suffix(']')))?;
    (!inner.is_empty()
        && inner
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "._".contains(c)))
    .then_some(inner)
}

/// The field paths the doc lists, relay part and connector part.
fn documented(doc: &str) -> (BTreeSet<String>, BTreeSet<String>) {
    let (mut relay, mut connector) = (BTreeSet::new(), BTreeSet::new());
    let mut in_connector = false;
    let mut section: Option<String> = None;
    let mut in_code_block = false;
    for line in doc.lines() {
        if line.trim_start().starts_with("```") {
            in_code_block = !in_code_block;
            continue;
        }
        if in_code_block {
            continue;
        }
        let out = if in_connector {
            &mut connector
        } else {
            &mut relay
        };
        if line.starts_with('#') {
            if line.starts_with("## oab-connector command line") {
                in_connector = true;
            }
            section = backticked(line)
                .into_iter()
                .find_map(section_name)
                .map(str::to_string);
            let out = if in_connector {
                &mut connector
            } else {
                &mut relay
            };
            if let Some(s) = &section {
                out.insert(s.clone());
            }
            continue;
        }
        if line.starts_with("`[")
            && let Some(s) = backticked(line).first().and_then(|t| section_name(t))
        {
            section = Some(s.to_string());
            out.insert(s.to_string());
            continue;
        }
        let Some(row) = line.strip_prefix('|') else {
            continue;
        };
        let first = row.split('|').next().unwrap_or("").trim();
        if first == "field" || first.chars().all(|c| "-: ".contains(c)) {
            continue; // header or separator row
        }
        let Some(s) = &section else {
            continue; // command lines, logging: not config fields
        };
        for name in backticked(first) {
            out.insert(format!("{s}.{}", name.replace("[].", ".")));
        }
    }
    (relay, connector)
}

fn diff(what: &str, code: &BTreeSet<String>, doc: &BTreeSet<String>) -> Vec<String> {
    let mut problems = Vec::new();
    for f in code.difference(doc) {
        problems.push(format!(
            "{what}: `{f}` is accepted by the config structs but not in docs/configuration.md"
        ));
    }
    for f in doc.difference(code) {
        problems.push(format!(
            "{what}: `{f}` is in docs/configuration.md but the config structs do not accept it"
        ));
    }
    problems
}

fn doc_text() -> String {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/configuration.md");
    std::fs::read_to_string(path).unwrap()
}

#[test]
fn the_probe_finds_nested_structs_and_arrays_of_tables() {
    // The probe itself: it must see through both kinds of nesting, or the
    // comparison below would pass on a list that is too short.
    let relay = accepted::<oab_relay::config::Config>();
    for want in [
        "relay",
        "relay.id",
        "limits.max_header",
        "peers",
        "peers.keys",
        "peers.keys.key_id",
        "routes.ceiling",
    ] {
        assert!(relay.contains(want), "{want} not found in {relay:?}");
    }
    let connector = accepted::<oab_connector::config::ConnectorConfig>();
    for want in [
        "connector.relay_url",
        "openab.runtimes.key_file",
        "openab.targets.peer",
        "a2a.driver_url",
    ] {
        assert!(
            connector.contains(want),
            "{want} not found in {connector:?}"
        );
    }
}

#[test]
fn the_doc_parser_reads_sections_rows_and_arrays_of_tables() {
    let doc = "## `[relay]`\n\n| field | type |\n|---|---|\n| `id` | string |\n\n\
               ## Relay `[[peers]]`\n\n| field |\n|---|\n| `keys[].key_id` | x |\n\n\
               ## oab-connector command line\n\n| flag |\n|---|\n| `run --config` | x |\n\n\
               ## `[openab]`\n\n`[[openab.serve]]`, callee side:\n\n| field |\n|---|\n| `peer`, `workers` | x |\n";
    let (relay, connector) = documented(doc);
    let set = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<BTreeSet<_>>();
    assert_eq!(
        relay,
        set(&["relay", "relay.id", "peers", "peers.keys.key_id"])
    );
    assert_eq!(
        connector,
        set(&[
            "openab",
            "openab.serve",
            "openab.serve.peer",
            "openab.serve.workers"
        ])
    );
}

#[test]
fn configuration_md_lists_exactly_the_fields_the_config_structs_accept() {
    let (doc_relay, doc_connector) = documented(&doc_text());
    let mut problems = diff(
        "relay.toml",
        &accepted::<oab_relay::config::Config>(),
        &doc_relay,
    );
    problems.extend(diff(
        "connector.toml",
        &accepted::<oab_connector::config::ConnectorConfig>(),
        &doc_connector,
    ));
    assert!(problems.is_empty(), "\n{}", problems.join("\n"));
}
