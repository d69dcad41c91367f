//! Reading a configuration file so that every problem in it is listed at
//! once, each with its field and its line: `check-config` and the start of
//! both binaries.
//!
//! The TOML is parsed with its spans; overrides (`--set`, environment) are
//! set in it; then the typed configuration is read from it again and again:
//! each failure (an unknown field, a value of the wrong type or form, a
//! missing field) is noted with the field it sits in and its line, and that
//! field (or, for a missing field, the table that needs it) is taken out
//! before the next try. What is left is the typed value its caller validates;
//! [`Checked::validation`] gives those problems their lines and drops the
//! ones that only follow from what was taken out.
//!
//! Never: stops at the first problem it can read past, or reports a problem
//! that only follows from another one it reported.

use std::collections::{BTreeSet, HashMap};
use std::ops::Range;

use serde::de::DeserializeOwned;
use toml::Spanned;
use toml::de::{DeTable, DeValue, ValueDeserializer};

/// One problem of a configuration file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// Dotted path of the field (`relay.listen`, `peers[1].keys`); empty
    /// for a syntax error.
    pub field: String,
    /// The line of the file it is on (1-based), when it is in the file
    /// (not in an override).
    pub line: Option<usize>,
    /// What is wrong, and what to do.
    pub message: String,
}

impl std::fmt::Display for Problem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (self.field.is_empty(), self.line) {
            (false, Some(line)) => write!(f, "{} (line {line}): {}", self.field, self.message),
            (false, None) => write!(f, "{}: {}", self.field, self.message),
            (true, Some(line)) => write!(f, "line {line}: {}", self.message),
            (true, None) => write!(f, "{}", self.message),
        }
    }
}

/// A configuration read as far as it could be.
#[derive(Debug)]
pub struct Checked<T> {
    /// The typed value, without the fields named in `problems` (`None`
    /// when the file is not TOML, or a required part could not be read).
    pub value: Option<T>,
    /// Every problem found while reading, in the order found.
    pub problems: Vec<Problem>,
    /// The line of every field in the file, by dotted path.
    lines: HashMap<String, usize>,
    /// Paths taken out (in the file's own indexing).
    removed: BTreeSet<String>,
    /// The `id` values of array elements taken out (`[[peers]]`), so that
    /// "peer x is not configured" does not follow a bad peer entry.
    removed_ids: Vec<String>,
    /// The paths set by overrides.
    overridden: Vec<String>,
}

/// A path segment.
#[derive(Debug, Clone)]
enum Seg {
    Key(String),
    Index(usize),
}

fn path_string(segs: &[Seg]) -> String {
    let mut out = String::new();
    for s in segs {
        match s {
            Seg::Key(k) => {
                if !out.is_empty() {
                    out.push('.');
                }
                out.push_str(k);
            }
            Seg::Index(i) => out.push_str(&format!("[{i}]")),
        }
    }
    out
}

/// An entry of the document: a key of a table (by its key's span) or an
/// element of an array (by its span); spans never change, so they name an
/// entry across edits.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Entry {
    Key(Range<usize>),
    Element(Range<usize>),
}

/// An entry containing a position, with its path and whether it holds a
/// table.
#[derive(Debug, Clone)]
struct Found {
    path: Vec<Seg>,
    entry: Entry,
    value_span: Range<usize>,
    is_table: bool,
    /// The `id` of an array element that is a table with one.
    id: Option<String>,
}

fn contains(span: &Range<usize>, pos: usize) -> bool {
    span.start <= pos && (pos < span.end || span.start == span.end && pos == span.start)
}

/// The entries containing `pos`, outermost first. A parent's span need not
/// cover its children's (an array of tables spans its first header only),
/// so every child is searched.
fn entries_at(
    table: &DeTable<'_>,
    pos: usize,
    prefix: &mut Vec<Seg>,
    out: &mut Vec<Found>,
) -> bool {
    for (k, v) in table.iter() {
        prefix.push(Seg::Key(k.get_ref().to_string()));
        let at = out.len();
        let inside = value_entries_at(v, pos, prefix, out);
        if inside || contains(&k.span(), pos) || contains(&v.span(), pos) {
            out.insert(
                at,
                Found {
                    path: prefix.clone(),
                    entry: Entry::Key(k.span()),
                    value_span: v.span(),
                    is_table: matches!(v.get_ref(), DeValue::Table(_)),
                    id: None,
                },
            );
            prefix.pop();
            return true;
        }
        prefix.pop();
    }
    false
}

fn value_entries_at(
    v: &Spanned<DeValue<'_>>,
    pos: usize,
    prefix: &mut Vec<Seg>,
    out: &mut Vec<Found>,
) -> bool {
    match v.get_ref() {
        DeValue::Table(t) => entries_at(t, pos, prefix, out),
        DeValue::Array(items) => {
            for (i, item) in items.iter().enumerate() {
                prefix.push(Seg::Index(i));
                let at = out.len();
                let inside = value_entries_at(item, pos, prefix, out);
                if inside || contains(&item.span(), pos) {
                    out.insert(
                        at,
                        Found {
                            path: prefix.clone(),
                            entry: Entry::Element(item.span()),
                            value_span: item.span(),
                            is_table: matches!(item.get_ref(), DeValue::Table(_)),
                            id: id_of(item.get_ref()),
                        },
                    );
                    prefix.pop();
                    return true;
                }
                prefix.pop();
            }
            false
        }
        _ => false,
    }
}

/// Takes `entry` out of the document; returns the `id` string of a table
/// taken out, if it has one.
fn remove<'i>(table: &mut DeTable<'i>, entry: &Entry) -> Option<Option<String>> {
    if let Entry::Key(span) = entry {
        let found = table
            .iter()
            .find(|(k, _)| k.span() == *span)
            .map(|(k, _)| k.get_ref().to_string());
        if let Some(key) = found {
            let v = table.remove(key.as_str());
            return Some(v.and_then(|v| id_of(v.get_ref())));
        }
    }
    for (_, v) in table.iter_mut() {
        if let Some(r) = remove_in_value(v.get_mut(), entry) {
            return Some(r);
        }
    }
    None
}

fn remove_in_value<'i>(v: &mut DeValue<'i>, entry: &Entry) -> Option<Option<String>> {
    match v {
        DeValue::Table(t) => remove(t, entry),
        DeValue::Array(items) => {
            if let Entry::Element(span) = entry
                && let Some(i) = items.iter().position(|item| item.span() == *span)
            {
                let id = items.get(i).and_then(|item| id_of(item.get_ref()));
                let kept: toml::de::DeArray<'i> =
                    std::mem::replace(items, toml::de::DeArray::new())
                        .into_iter()
                        .enumerate()
                        .filter(|(j, _)| *j != i)
                        .map(|(_, item)| item)
                        .collect();
                *items = kept;
                return Some(id);
            }
            for item in items.iter_mut() {
                if let Some(r) = remove_in_value(item.get_mut(), entry) {
                    return Some(r);
                }
            }
            None
        }
        _ => None,
    }
}

fn id_of(v: &DeValue<'_>) -> Option<String> {
    match v {
        DeValue::Table(t) => t
            .get("id")
            .and_then(|id| id.get_ref().as_str())
            .map(str::to_string),
        _ => None,
    }
}

/// Every field's line, by path.
fn index_lines(
    table: &DeTable<'_>,
    prefix: &mut Vec<Seg>,
    line: &dyn Fn(usize) -> Option<usize>,
    out: &mut HashMap<String, usize>,
) {
    for (k, v) in table.iter() {
        prefix.push(Seg::Key(k.get_ref().to_string()));
        if let Some(l) = line(k.span().start) {
            out.entry(path_string(prefix)).or_insert(l);
        }
        index_value_lines(v, prefix, line, out);
        prefix.pop();
    }
}

fn index_value_lines(
    v: &Spanned<DeValue<'_>>,
    prefix: &mut Vec<Seg>,
    line: &dyn Fn(usize) -> Option<usize>,
    out: &mut HashMap<String, usize>,
) {
    match v.get_ref() {
        DeValue::Table(t) => index_lines(t, prefix, line, out),
        DeValue::Array(items) => {
            for (i, item) in items.iter().enumerate() {
                prefix.push(Seg::Index(i));
                if let Some(l) = line(item.span().start) {
                    out.insert(path_string(prefix), l);
                }
                index_value_lines(item, prefix, line, out);
                prefix.pop();
            }
        }
        _ => {}
    }
}

/// Sets `path` to `raw` (a TOML literal when it is one, else a string) in
/// the document, creating tables on the way; `span` marks the override.
fn set_override<'a>(
    root: &mut DeTable<'a>,
    path: &'a str,
    raw: &'a str,
    span: Range<usize>,
) -> Result<(), String> {
    let parts: Vec<&'a str> = path.split('.').collect();
    if parts.iter().any(|p| p.is_empty()) {
        return Err(format!("override {path:?}: empty path"));
    }
    let Some((last, sections)) = parts.split_last() else {
        return Err(format!("override {path:?}: empty path"));
    };
    let mut table = root;
    for section in sections {
        let key = Spanned::new(span.clone(), std::borrow::Cow::Borrowed(*section));
        let entry = table
            .entry(key)
            .or_insert_with(|| Spanned::new(span.clone(), DeValue::Table(DeTable::new())));
        match entry.get_mut() {
            DeValue::Table(t) => table = t,
            _ => return Err(format!("{path}: {section} is not a table")),
        }
    }
    let value = match DeValue::parse(raw) {
        Ok(v) => v.into_inner(),
        Err(_) => DeValue::String(std::borrow::Cow::Borrowed(raw)),
    };
    table.remove(*last);
    table.insert(
        Spanned::new(span.clone(), std::borrow::Cow::Borrowed(*last)),
        Spanned::new(span, value),
    );
    Ok(())
}

/// The start of each line, to turn a byte offset into a line number.
fn line_starts(text: &str) -> Vec<usize> {
    std::iter::once(0)
        .chain(text.match_indices('\n').map(|(i, _)| i + 1))
        .collect()
}

/// The closest of `candidates` to `name`, if close enough to be a typo.
pub fn closest<'c>(name: &str, candidates: impl IntoIterator<Item = &'c str>) -> Option<&'c str> {
    let limit = (name.chars().count() / 3).max(2);
    let candidates: Vec<&'c str> = candidates.into_iter().collect();
    let near = candidates
        .iter()
        .map(|c| (edit_distance(name, c), *c))
        .filter(|(d, _)| *d <= limit)
        .min_by_key(|(d, _)| *d)
        .map(|(_, c)| c);
    // Else a name with a word more or less (`listen_addr` for `listen`).
    near.or_else(|| {
        candidates
            .iter()
            .filter(|c| c.len() >= 3 && (name.contains(**c) || c.contains(name)))
            .max_by_key(|c| c.len())
            .copied()
    })
}

/// Levenshtein distance, over characters.
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut prev = row.first().copied().unwrap_or(0);
        if let Some(first) = row.first_mut() {
            *first = i + 1;
        }
        for (j, cb) in b.iter().enumerate() {
            let above = row.get(j + 1).copied().unwrap_or(usize::MAX);
            let left = row.get(j).copied().unwrap_or(usize::MAX);
            let diag = prev + usize::from(ca != *cb);
            prev = above;
            if let Some(cell) = row.get_mut(j + 1) {
                *cell = diag
                    .min(above.saturating_add(1))
                    .min(left.saturating_add(1));
            }
        }
    }
    row.last().copied().unwrap_or(0)
}

/// The names in backticks of a serde message (`expected one of `a`, `b``).
fn backticked(s: &str) -> Vec<&str> {
    s.split('`').skip(1).step_by(2).collect()
}

/// A serde message about `field` in the words of this project: an unknown
/// field gets the nearest known one ("did you mean").
fn explain(message: &str, path: &[Seg]) -> String {
    let message = message.trim();
    if let Some(rest) = message.strip_prefix("unknown field `") {
        let (name, expected) = rest.split_once('`').unwrap_or((rest, ""));
        let known = backticked(expected);
        let parent = path_string(path.get(..path.len().saturating_sub(1)).unwrap_or_default());
        let full = |s: &str| {
            if parent.is_empty() {
                s.to_string()
            } else {
                format!("{parent}.{s}")
            }
        };
        return match closest(name, known.iter().copied()) {
            Some(s) => format!("unknown field; did you mean {}?", full(s)),
            None if known.is_empty() => "unknown field; this table takes no fields".into(),
            None => format!(
                "unknown field; the fields here are {}",
                known.iter().map(|k| full(k)).collect::<Vec<_>>().join(", ")
            ),
        };
    }
    if let Some(rest) = message.strip_prefix("unknown variant `") {
        let (name, expected) = rest.split_once('`').unwrap_or((rest, ""));
        let known = backticked(expected);
        if let Some(s) = closest(name, known.iter().copied()) {
            return format!("unknown value {name:?}; did you mean {s:?}?");
        }
    }
    message.to_string()
}

impl<T: DeserializeOwned> Checked<T> {
    /// Reads `text` with `overrides` (dotted path, value) set in it.
    pub fn read(text: &str, overrides: &[(String, String)]) -> Checked<T> {
        let starts = line_starts(text);
        let end = text.len();
        let line =
            |pos: usize| (pos < end || pos == 0).then(|| starts.partition_point(|&s| s <= pos));
        let mut checked = Checked {
            value: None,
            problems: Vec::new(),
            lines: HashMap::new(),
            removed: BTreeSet::new(),
            removed_ids: Vec::new(),
            overridden: overrides.iter().map(|(p, _)| p.clone()).collect(),
        };
        let (root, errors) = DeTable::parse_recoverable(text);
        if !errors.is_empty() {
            for e in errors {
                checked.problems.push(Problem {
                    field: String::new(),
                    line: e.span().and_then(|s| line(s.start)),
                    message: format!("not valid TOML: {}", e.message().trim()),
                });
            }
            return checked;
        }
        let root_span = root.span();
        let mut doc = root.into_inner();
        index_lines(&doc, &mut Vec::new(), &line, &mut checked.lines);
        // Each override gets a span of its own past the end of the text.
        for (i, (path, raw)) in overrides.iter().enumerate() {
            let span = end + 1 + i..end + 2 + i;
            if let Err(message) = set_override(&mut doc, path, raw, span) {
                checked.problems.push(Problem {
                    field: path.clone(),
                    line: None,
                    message,
                });
            }
        }
        let original = doc.clone();
        let override_of = |pos: usize| {
            pos.checked_sub(end + 1)
                .and_then(|i| overrides.get(i))
                .map(|(p, _)| p.clone())
        };
        // The error before, to stop if taking a field out changed nothing.
        let mut previous: Option<(Option<Range<usize>>, String)> = None;
        for _ in 0..256 {
            let de = ValueDeserializer::from(Spanned::new(
                root_span.clone(),
                DeValue::Table(doc.clone()),
            ));
            let e = match T::deserialize(de) {
                Ok(v) => {
                    checked.value = Some(v);
                    break;
                }
                Err(e) => e,
            };
            let this = (e.span(), e.message().to_string());
            if previous.as_ref() == Some(&this) {
                break;
            }
            previous = Some(this);
            let pos = e.span().map_or(0, |s| s.start);
            let mut found = Vec::new();
            entries_at(&original, pos, &mut Vec::new(), &mut found);
            let message = e.message().trim().to_string();
            let in_override = |path: &str| match override_of(pos) {
                Some(o) => (o, None, " (set by an override: --set or the environment)"),
                None => (path.to_string(), line(pos), ""),
            };
            if let Some(rest) = message.strip_prefix("missing field `") {
                let name = rest.split('`').next().unwrap_or_default();
                // The table that lacks it: the one the error spans, else
                // the innermost table around it; none: the document.
                let holder = match e.span() {
                    Some(span) => found
                        .iter()
                        .rev()
                        .find(|f| f.is_table && f.value_span == span)
                        .or_else(|| {
                            found
                                .iter()
                                .rev()
                                .find(|f| f.is_table && span.start != root_span.start)
                        }),
                    None => None,
                };
                let table_path = holder.map(|f| path_string(&f.path)).unwrap_or_default();
                let full = if table_path.is_empty() {
                    name.to_string()
                } else {
                    format!("{table_path}.{name}")
                };
                if !checked.removed.contains(&full) {
                    let (field, at, _) = in_override(&full);
                    let field = if override_of(pos).is_some() {
                        full.clone()
                    } else {
                        field
                    };
                    let (line, message) = if holder.is_none() {
                        (
                            None,
                            format!("the [{name}] section is required and missing; add it"),
                        )
                    } else {
                        (at, "is required and missing; add it".to_string())
                    };
                    checked.problems.push(Problem {
                        field,
                        line,
                        message,
                    });
                }
                let Some(holder) = holder else { break };
                checked.removed.insert(table_path);
                match remove(&mut doc, &holder.entry) {
                    Some(id) => checked.removed_ids.extend(id),
                    None => break,
                }
                continue;
            }
            // The innermost entry around it not yet taken out (an empty list
            // spans where its taken-out element was).
            let Some(inner) = found
                .iter()
                .rev()
                .find(|f| !checked.removed.contains(&path_string(&f.path)))
            else {
                let (field, at, note) = in_override("");
                checked.problems.push(Problem {
                    field,
                    line: at,
                    message: format!("{message}{note}"),
                });
                break;
            };
            let path = path_string(&inner.path);
            // A table or list that fails only because something in it was
            // taken out (`invalid length 0`): taken out in turn, unsaid.
            let holds_removed = checked.removed.iter().any(|r| {
                r.strip_prefix(path.as_str())
                    .is_some_and(|rest| rest.starts_with(['.', '[']))
            });
            if holds_removed {
                checked.removed.insert(path);
                match remove(&mut doc, &inner.entry) {
                    Some(id) => checked.removed_ids.extend(id),
                    None => break,
                }
                continue;
            }
            let (field, at, note) = in_override(&path);
            // Which entry of a list it is in, by its id (`[[peers]]`).
            let is_id = matches!(inner.path.last(), Some(Seg::Key(k)) if k == "id");
            let entry = found
                .iter()
                .find_map(|f| f.id.as_ref().filter(|_| f.path.len() < inner.path.len()))
                .filter(|_| !is_id)
                .map(|id| format!(" (in the entry of {id})"))
                .unwrap_or_default();
            checked.problems.push(Problem {
                field,
                line: at,
                message: format!("{}{entry}{note}", explain(&message, &inner.path)),
            });
            checked.removed.insert(path);
            match remove(&mut doc, &inner.entry) {
                Some(id) => checked.removed_ids.extend(id),
                None => break,
            }
        }
        // In the file's order; those of overrides last.
        checked.problems.sort_by_key(|p| (p.line.is_none(), p.line));
        checked
    }
}

impl<T> Checked<T> {
    /// The line of `field` (a dotted path), or of the nearest enclosing
    /// table or entry that is in the file.
    pub fn line_of(&self, field: &str) -> Option<usize> {
        let mut path = field;
        loop {
            if let Some(l) = self.lines.get(path) {
                return Some(*l);
            }
            let cut = path.rfind(['.', '['])?;
            path = path.get(..cut)?;
        }
    }

    /// `field` of the value (whose arrays lack the elements taken out) in
    /// the file's indexing (`routes[1]` is `routes[2]` when `routes[0]` was
    /// taken out).
    fn original_field(&self, field: &str) -> String {
        let mut out = String::new();
        let mut rest = field;
        while let Some(open) = rest.find('[') {
            let (head, tail) = rest.split_at(open);
            out.push_str(head);
            let Some(close) = tail.find(']') else { break };
            let Ok(mut index) = tail.get(1..close).unwrap_or_default().parse::<usize>() else {
                break;
            };
            let mut original = 0;
            loop {
                if self.removed.contains(&format!("{out}[{original}]")) {
                    original += 1;
                    continue;
                }
                if index == 0 {
                    break;
                }
                index -= 1;
                original += 1;
            }
            out.push_str(&format!("[{original}]"));
            rest = tail.get(close + 1..).unwrap_or_default();
        }
        out.push_str(rest);
        out
    }

    /// Every problem: those found reading and those of the value's own
    /// validation ([`Checked::validation`]), in the file's order (those
    /// without a line last).
    pub fn all_problems(&self, errors: impl IntoIterator<Item = (String, String)>) -> Vec<Problem> {
        let mut all = self.problems.clone();
        all.extend(self.validation(errors));
        all.sort_by_key(|p| (p.line.is_none(), p.line));
        all
    }

    /// The problems of the value's own validation (field, message), with
    /// their lines, in the file's indexing; those about a field taken out,
    /// one that held it, or a peer whose entry was taken out, are left out:
    /// the problem that took it out is already listed.
    pub fn validation(&self, errors: impl IntoIterator<Item = (String, String)>) -> Vec<Problem> {
        errors
            .into_iter()
            .map(|(field, message)| (self.original_field(&field), message))
            .filter(|(field, message)| {
                // At, under or holding a field taken out (`peers[1].keys`
                // is left without the key taken out of it).
                let nested = |outer: &str, inner: &str| {
                    inner == outer
                        || inner
                            .strip_prefix(outer)
                            .is_some_and(|rest| rest.starts_with(['.', '[']))
                };
                let under_removed = self
                    .removed
                    .iter()
                    .any(|r| nested(r, field) || nested(field, r));
                let about_removed_id = self.removed_ids.iter().any(|id| {
                    message
                        .split(|c: char| c.is_whitespace() || c == ',' || c == ':')
                        .any(|w| w == id)
                });
                !under_removed && !about_removed_id
            })
            .map(|(field, message)| {
                let overridden = self.overridden.iter().any(|o| {
                    field == *o
                        || field
                            .strip_prefix(o.as_str())
                            .is_some_and(|rest| rest.starts_with(['.', '[']))
                });
                if overridden {
                    Problem {
                        field,
                        line: None,
                        message: format!(
                            "{message} (set by an override: --set or the environment)"
                        ),
                    }
                } else {
                    Problem {
                        line: self.line_of(&field),
                        field,
                        message,
                    }
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::indexing_slicing)]
    use super::*;

    #[derive(Debug, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Doc {
        main: Main,
        #[serde(default)]
        items: Vec<Item>,
    }

    #[derive(Debug, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Main {
        name: String,
        #[serde(default)]
        listen: Option<std::net::SocketAddr>,
        #[serde(default)]
        count: u32,
    }

    #[derive(Debug, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Item {
        id: String,
        size: u8,
    }

    #[test]
    fn every_problem_is_listed_with_its_line() {
        let text = "[main]\nname = \"x\"\nlisten_addr = \"0.0.0.0:1\"\ncount = -3\n\n\
                    [[items]]\nid = \"a\"\nsize = 1\n\n[[items]]\nid = \"b\"\nsize = 300\n\n\
                    [[items]]\nid = \"c\"\nsize = 2\n";
        let c = Checked::<Doc>::read(text, &[]);
        let shown: Vec<String> = c.problems.iter().map(ToString::to_string).collect();
        assert_eq!(c.problems.len(), 3, "{shown:#?}");
        assert_eq!(
            shown[0],
            "main.listen_addr (line 3): unknown field; did you mean main.listen?"
        );
        assert!(shown[1].starts_with("main.count (line 4): "), "{shown:#?}");
        assert!(
            shown[2].starts_with("items[1].size (line 12): "),
            "{shown:#?}"
        );
        assert_eq!(c.value.as_ref().unwrap().items.len(), 2);
        // Validation problems of the value get the file's index and line;
        // those about what was taken out are dropped.
        // (the value's items[1] is the file's items[2]).
        let v = c.validation([
            ("items[1].size".to_string(), "too big".to_string()),
            ("main.count".to_string(), "bad".to_string()),
            ("main.name".to_string(), "bad".to_string()),
            ("items[0].id".to_string(), "same as b".to_string()),
        ]);
        assert_eq!(v.len(), 2, "{v:?}");
        assert_eq!(v[0].to_string(), "items[2].size (line 16): too big");
        assert_eq!(v[1].to_string(), "main.name (line 2): bad");
        // All of them together, in the file's order.
        let all: Vec<Option<usize>> = c
            .all_problems([("main.name".to_string(), "bad".to_string())])
            .iter()
            .map(|p| p.line)
            .collect();
        assert_eq!(all, [Some(2), Some(3), Some(4), Some(12)]);
    }

    #[test]
    fn missing_fields_and_syntax_errors_and_overrides_are_named() {
        let c = Checked::<Doc>::read("[main]\ncount = 1\n[[items]]\nid = \"a\"\n", &[]);
        let shown: Vec<String> = c.problems.iter().map(ToString::to_string).collect();
        assert_eq!(shown.len(), 2, "{shown:#?}");
        assert!(
            shown[0].starts_with("main.name (line 1): is required"),
            "{shown:#?}"
        );
        assert!(
            shown[1].starts_with("items[0].size (line 3): is required"),
            "{shown:#?}"
        );
        let c = Checked::<Doc>::read("[main\nname = 1\n", &[]);
        assert_eq!(c.problems[0].line, Some(1), "{:?}", c.problems);
        assert!(c.problems[0].message.starts_with("not valid TOML"));
        let c = Checked::<Doc>::read(
            "[main]\nname = \"x\"\n",
            &[("main.count".into(), "many".into())],
        );
        let shown = c.problems[0].to_string();
        assert!(
            shown.starts_with("main.count: ") && shown.contains("override"),
            "{shown}"
        );
        let c = Checked::<Doc>::read("", &[]);
        assert_eq!(
            c.problems[0].to_string(),
            "main: the [main] section is required and missing; add it"
        );
        let c = Checked::<Doc>::read("[[main]]\nname = \"x\"\n", &[]);
        assert_eq!(c.problems.len(), 1, "{:?}", c.problems);
        // A list left empty by what was taken out is not a problem again.
        let c = Checked::<Doc>::read("[main]\nname = \"x\"\n[[items]]\nid = 1\nsize = 1\n", &[]);
        assert_eq!(c.problems.len(), 1, "{:?}", c.problems);
        let c = Checked::<Doc>::read(
            "[main]\nname = \"x\"\n",
            &[("main.count".into(), "7".into())],
        );
        assert_eq!(c.value.unwrap().main.count, 7);
    }

    #[test]
    fn typos_find_their_field() {
        assert_eq!(
            closest("listen_addr", ["id", "listen", "admin_listen"]),
            Some("listen")
        );
        assert_eq!(
            closest("max_paylod", ["max_header", "max_payload"]),
            Some("max_payload")
        );
        assert_eq!(closest("zzz", ["listen"]), None);
    }
}
