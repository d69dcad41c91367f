//! Configuration overrides, the same for both binaries: a dotted path and a
//! value, from `--set PATH=VALUE` or from the environment
//! (`OAB_RELAY__STORE__URL=...`, `OAB_CONNECTOR__ADMIN__LISTEN=...`), set in
//! the parsed TOML document before it is turned into the typed config and
//! validated, so an override meets the same checks as the file.
//!
//! Never: reaches into arrays of tables (`[[peers]]`, `[[routes]]`): a path
//! names plain sections and fields only.

/// Why an override could not be applied.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OverrideError {
    /// `--set` without `=`.
    #[error("--set {0:?}: expected PATH=VALUE")]
    NotPathValue(String),
    /// An empty path or an empty part (`relay..listen`).
    #[error("override {0:?}: empty path")]
    EmptyPath(String),
    /// A part of the path names a value that is not a table.
    #[error("{path}: {section} is not a table")]
    NotATable {
        /// The whole path.
        path: String,
        /// The part that is not a table.
        section: String,
    },
}

/// Sets one value in a parsed TOML document by dotted path
/// (`relay.listen`, `store.url`). The value is read as a TOML literal when it
/// is one (`250`, `true`, `["a"]`), else as a string.
pub fn apply_override(doc: &mut toml::Table, path: &str, raw: &str) -> Result<(), OverrideError> {
    let parts: Vec<&str> = path.split('.').collect();
    if parts.iter().any(|p| p.is_empty()) {
        return Err(OverrideError::EmptyPath(path.to_string()));
    }
    let Some((last, sections)) = parts.split_last() else {
        return Err(OverrideError::EmptyPath(path.to_string()));
    };
    let mut table = doc;
    for section in sections {
        let entry = table
            .entry(section.to_string())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        table = entry
            .as_table_mut()
            .ok_or_else(|| OverrideError::NotATable {
                path: path.to_string(),
                section: section.to_string(),
            })?;
    }
    let value = toml::from_str::<toml::Table>(&format!("v = {raw}"))
        .ok()
        .and_then(|mut t| t.remove("v"))
        .unwrap_or_else(|| toml::Value::String(raw.to_string()));
    table.insert(last.to_string(), value);
    Ok(())
}

/// Overrides from the environment: every variable `<prefix>SECTION__FIELD`
/// sets `section.field` (lower-cased; double underscores separate the path),
/// in name order so the result does not depend on the environment's order.
/// `prefix` ends with `__` (`OAB_RELAY__`), so `OAB_RELAY_CONFIG` and the
/// like are not taken.
pub fn env_overrides(prefix: &str) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = std::env::vars()
        .filter_map(|(k, v)| {
            let rest = k.strip_prefix(prefix)?;
            Some((rest.to_ascii_lowercase().replace("__", "."), v))
        })
        .collect();
    out.sort();
    out
}

/// Parses one `--set PATH=VALUE` (both trimmed).
pub fn parse_set(s: &str) -> Result<(String, String), OverrideError> {
    let (k, v) = s
        .split_once('=')
        .ok_or_else(|| OverrideError::NotPathValue(s.to_string()))?;
    Ok((k.trim().to_string(), v.trim().to_string()))
}

/// Parses `text` as a TOML document and applies `overrides` in order (the
/// last one wins). Errors are the parser's message or the override's.
pub fn document_with_overrides(
    text: &str,
    overrides: &[(String, String)],
) -> Result<toml::Table, String> {
    let mut doc: toml::Table = toml::from_str(text).map_err(|e| e.to_string())?;
    for (path, value) in overrides {
        apply_override(&mut doc, path, value).map_err(|e| e.to_string())?;
    }
    Ok(doc)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn values_are_toml_literals_when_they_are_one_else_strings() {
        let mut doc = toml::Table::new();
        for (path, raw) in [
            ("a.n", "250"),
            ("a.b", "true"),
            ("a.list", "[\"x\"]"),
            ("a.url", "redis://10.0.0.5:6379/"),
            ("top", "plain"),
        ] {
            apply_override(&mut doc, path, raw).unwrap();
        }
        let a = doc["a"].as_table().unwrap();
        assert_eq!(a["n"].as_integer(), Some(250));
        assert_eq!(a["b"].as_bool(), Some(true));
        assert_eq!(a["list"].as_array().unwrap().len(), 1);
        assert_eq!(a["url"].as_str(), Some("redis://10.0.0.5:6379/"));
        assert_eq!(doc["top"].as_str(), Some("plain"));
    }

    #[test]
    fn bad_paths_are_named() {
        let mut doc: toml::Table = toml::from_str("x = 1").unwrap();
        assert_eq!(
            apply_override(&mut doc, "x.y", "2"),
            Err(OverrideError::NotATable {
                path: "x.y".into(),
                section: "x".into()
            })
        );
        assert!(matches!(
            apply_override(&mut doc, "a..b", "2"),
            Err(OverrideError::EmptyPath(_))
        ));
        assert!(matches!(
            parse_set("novalue"),
            Err(OverrideError::NotPathValue(_))
        ));
        assert_eq!(
            parse_set(" admin.listen = 127.0.0.1:1 ").unwrap(),
            ("admin.listen".into(), "127.0.0.1:1".into())
        );
    }
}
