//! What a scenario hands back: tables for people, one JSON document with
//! every figure and the run's parameters for machines, and the correctness
//! violations `--check` turns into a failing exit status.

use std::fmt;
use std::path::Path;

use anyhow::Context as _;
use hdrhistogram::Histogram;
use serde::Serialize;

/// A scenario's result.
#[derive(Debug)]
pub struct Report {
    /// The scenario name (`throughput`, `latency`, `sessions`).
    pub scenario: &'static str,
    /// Tables to print, in order.
    pub tables: Vec<Table>,
    /// Lines printed under the tables (definitions, caveats).
    pub notes: Vec<String>,
    /// Every figure and parameter.
    pub json: serde_json::Value,
    /// Broken correctness invariants (lost, duplicated, reordered or corrupt
    /// frames; lost sessions). Never a timing.
    pub violations: Vec<String>,
}

impl Report {
    /// Writes the JSON document (with the violations) to `path`, creating
    /// its folder.
    pub fn write_json(&self, path: &Path) -> anyhow::Result<()> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        let mut doc = self.json.clone();
        if let Some(obj) = doc.as_object_mut() {
            obj.insert("violations".into(), serde_json::json!(self.violations));
        }
        let text = serde_json::to_string_pretty(&doc)?;
        std::fs::write(path, text + "\n").with_context(|| format!("writing {}", path.display()))
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for t in &self.tables {
            writeln!(f, "{t}")?;
        }
        for n in &self.notes {
            writeln!(f, "{n}")?;
        }
        if self.violations.is_empty() {
            writeln!(f, "correctness: every check passed")
        } else {
            writeln!(f, "correctness VIOLATIONS:")?;
            for v in &self.violations {
                writeln!(f, "  - {v}")?;
            }
            Ok(())
        }
    }
}

/// A plain-text table with right-aligned numeric columns.
#[derive(Debug, Clone)]
pub struct Table {
    /// Printed above the table.
    pub title: String,
    /// Column headers.
    pub headers: Vec<String>,
    /// Rows of cells.
    pub rows: Vec<Vec<String>>,
}

impl Table {
    /// An empty table.
    pub fn new(title: impl Into<String>, headers: &[&str]) -> Table {
        Table {
            title: title.into(),
            headers: headers.iter().map(|h| (*h).to_string()).collect(),
            rows: Vec::new(),
        }
    }

    /// Adds a row.
    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }
}

impl fmt::Display for Table {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let cols = self.headers.len();
        let mut width: Vec<usize> = self.headers.iter().map(|h| h.chars().count()).collect();
        for r in &self.rows {
            for (w, c) in width.iter_mut().zip(r) {
                *w = (*w).max(c.chars().count());
            }
        }
        writeln!(f, "{}", self.title)?;
        let line = |f: &mut fmt::Formatter<'_>, cells: &[String]| -> fmt::Result {
            for (i, (c, w)) in cells.iter().zip(&width).enumerate().take(cols) {
                if i == 0 {
                    write!(f, "  {c:<w$}")?;
                } else {
                    write!(f, "  {c:>w$}")?;
                }
            }
            writeln!(f)
        };
        line(f, &self.headers)?;
        let rule: Vec<String> = width.iter().map(|w| "-".repeat(*w)).collect();
        line(f, &rule)?;
        for r in &self.rows {
            line(f, r)?;
        }
        Ok(())
    }
}

/// Percentiles of a nanosecond histogram, in microseconds.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Percentiles {
    /// Samples.
    pub count: u64,
    /// Minimum, µs.
    pub min_us: f64,
    /// Median, µs.
    pub p50_us: f64,
    /// 90th percentile, µs.
    pub p90_us: f64,
    /// 99th percentile, µs.
    pub p99_us: f64,
    /// 99.9th percentile, µs.
    pub p999_us: f64,
    /// Maximum, µs.
    pub max_us: f64,
    /// Mean, µs.
    pub mean_us: f64,
}

impl Percentiles {
    /// Summarises a histogram of nanoseconds.
    pub fn of(h: &Histogram<u64>) -> Percentiles {
        if h.is_empty() {
            return Percentiles::default();
        }
        let us = |ns: u64| ns as f64 / 1_000.0;
        Percentiles {
            count: h.len(),
            min_us: us(h.min()),
            p50_us: us(h.value_at_quantile(0.50)),
            p90_us: us(h.value_at_quantile(0.90)),
            p99_us: us(h.value_at_quantile(0.99)),
            p999_us: us(h.value_at_quantile(0.999)),
            max_us: us(h.max()),
            mean_us: h.mean() / 1_000.0,
        }
    }
}

/// A duration in µs as a short human string (`850µs`, `1.25ms`, `2.0s`).
pub fn fmt_us(us: f64) -> String {
    if us < 1_000.0 {
        format!("{us:.0}µs")
    } else if us < 1_000_000.0 {
        format!("{:.2}ms", us / 1_000.0)
    } else {
        format!("{:.1}s", us / 1_000_000.0)
    }
}

/// A count with thousands separators.
pub fn fmt_count(n: f64) -> String {
    let n = n.round() as u64;
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// A byte count in B, KiB or MiB.
pub fn fmt_bytes(n: u64) -> String {
    if n < 1024 {
        format!("{n} B")
    } else if n < 1024 * 1024 {
        format!("{:.1} KiB", n as f64 / 1024.0)
    } else {
        format!("{:.1} MiB", n as f64 / (1024.0 * 1024.0))
    }
}

/// A payload size as given on the command line (`64 B`, `1 KiB`, `16 KiB`).
pub fn fmt_size(n: usize) -> String {
    if n >= 1024 && n.is_multiple_of(1024) {
        format!("{} KiB", n / 1024)
    } else {
        format!("{n} B")
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn numbers_format_for_people() {
        assert_eq!(fmt_count(1234567.4), "1,234,567");
        assert_eq!(fmt_count(999.0), "999");
        assert_eq!(fmt_us(850.2), "850µs");
        assert_eq!(fmt_us(1250.0), "1.25ms");
        assert_eq!(fmt_bytes(2048), "2.0 KiB");
        assert_eq!(fmt_size(16384), "16 KiB");
        assert_eq!(fmt_size(64), "64 B");
    }

    #[test]
    fn table_aligns_columns() {
        let mut t = Table::new("t", &["name", "n"]);
        t.row(vec!["a".into(), "1".into()]);
        t.row(vec!["bbb".into(), "1000".into()]);
        let s = t.to_string();
        assert!(s.contains("\n  a        1\n"), "{s}");
        assert!(s.contains("\n  bbb   1000\n"), "{s}");
        assert!(s.contains("\n  name     n\n"), "{s}");
    }

    #[test]
    fn report_json_includes_violations() {
        let dir = tempfile::tempdir().unwrap();
        let r = Report {
            scenario: "x",
            tables: vec![],
            notes: vec![],
            json: serde_json::json!({"scenario": "x"}),
            violations: vec!["lost".into()],
        };
        let path = dir.path().join("sub/x.json");
        r.write_json(&path).unwrap();
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        assert_eq!(v["violations"][0], "lost");
    }
}
