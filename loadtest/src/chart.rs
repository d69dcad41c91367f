//! A self-contained SVG chart of the `throughput` and `latency` results (no
//! external crates: the SVG text is written here).
//!
//! - (a) frames/s per payload size, each path (direct, relay on each store)
//!   a bar in the size's group, log scale;
//! - (b) round-trip p50 (dashed) and p99 (solid) per offered load, one line
//!   per path, log scale.
//!
//! Input is the JSON the scenarios write: `throughput.json` (`cases[]` with
//! `path`, `payload_bytes`, `frames_per_sec`) and `latency.json`
//! (`results[]` with `path`, `offered_per_sec`, `rtt.p50_us`, `rtt.p99_us`).

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::path::Path;

use anyhow::Context as _;
use serde_json::Value;

use crate::report::{fmt_count, fmt_size, fmt_us};

const WIDTH: f64 = 960.0;
const PANEL_H: f64 = 420.0;
const LEFT: f64 = 90.0;
const RIGHT: f64 = 190.0;
const TOP: f64 = 50.0;
const BOTTOM: f64 = 60.0;

/// Paths in drawing order, with their colours.
const PATHS: [(&str, &str); 3] = [
    ("direct", "#4c72b0"),
    ("relay-memory", "#dd8452"),
    ("relay-redis", "#55a868"),
];

fn color(path: &str) -> &'static str {
    PATHS
        .iter()
        .find(|(p, _)| *p == path)
        .map_or("#8172b3", |(_, c)| c)
}

fn order(path: &str) -> usize {
    PATHS
        .iter()
        .position(|(p, _)| *p == path)
        .unwrap_or(PATHS.len())
}

/// Escapes text for SVG.
fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// A log-10 axis over `[lo, hi]` (positive), rounded out to decades.
#[derive(Debug, Clone, Copy)]
struct LogAxis {
    lo: f64,
    hi: f64,
}

impl LogAxis {
    fn over(values: impl Iterator<Item = f64>) -> LogAxis {
        let (mut lo, mut hi) = (f64::INFINITY, 0.0f64);
        for v in values.filter(|v| *v > 0.0 && v.is_finite()) {
            lo = lo.min(v);
            hi = hi.max(v);
        }
        if !lo.is_finite() {
            return LogAxis { lo: 1.0, hi: 10.0 };
        }
        let lo = 10f64.powf(lo.log10().floor());
        let mut hi = 10f64.powf(hi.log10().ceil());
        if hi <= lo {
            hi = lo * 10.0;
        }
        LogAxis { lo, hi }
    }

    /// 0 at `lo`, 1 at `hi`.
    fn frac(&self, v: f64) -> f64 {
        let v = v.max(self.lo);
        (v.log10() - self.lo.log10()) / (self.hi.log10() - self.lo.log10())
    }

    fn decades(&self) -> Vec<f64> {
        let mut out = Vec::new();
        let mut d = self.lo;
        while d <= self.hi * 1.0001 {
            out.push(d);
            d *= 10.0;
        }
        out
    }
}

/// One bar of panel (a).
#[derive(Debug, Clone)]
struct Bar {
    size: u64,
    path: String,
    fps: f64,
}

/// One point of panel (b).
#[derive(Debug, Clone)]
struct Point {
    load: f64,
    path: String,
    p50: f64,
    p99: f64,
}

fn bars(throughput: &Value) -> Vec<Bar> {
    throughput["cases"]
        .as_array()
        .map(|cases| {
            cases
                .iter()
                .filter_map(|c| {
                    Some(Bar {
                        size: c["payload_bytes"].as_u64()?,
                        path: c["path"].as_str()?.to_string(),
                        fps: c["frames_per_sec"].as_f64()?,
                    })
                })
                .collect()
        })
        .unwrap_or_default()
}

fn points(latency: &Value) -> Vec<Point> {
    latency["results"]
        .as_array()
        .map(|rs| {
            rs.iter()
                .filter_map(|r| {
                    Some(Point {
                        load: r["offered_per_sec"].as_f64()?,
                        path: r["path"].as_str()?.to_string(),
                        p50: r["rtt"]["p50_us"].as_f64()?,
                        p99: r["rtt"]["p99_us"].as_f64()?,
                    })
                })
                .collect()
        })
        .unwrap_or_default()
}

fn sorted_paths<'a>(names: impl Iterator<Item = &'a str>) -> Vec<String> {
    let mut v: Vec<String> = names
        .map(str::to_string)
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    v.sort_by_key(|p| (order(p), p.clone()));
    v
}

/// Renders the chart. Either input may be absent (its panel says so).
pub fn render(throughput: Option<&Value>, latency: Option<&Value>) -> String {
    let height = 2.0 * PANEL_H + 40.0;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{WIDTH}\" height=\"{height}\" \
         viewBox=\"0 0 {WIDTH} {height}\" font-family=\"sans-serif\" font-size=\"12\">"
    );
    let _ = writeln!(
        s,
        "<title>OAB Relay benchmarks: throughput and latency, relay vs direct</title>"
    );
    let _ = writeln!(
        s,
        "<rect x=\"0\" y=\"0\" width=\"{WIDTH}\" height=\"{height}\" fill=\"#ffffff\"/>"
    );
    throughput_panel(&mut s, throughput.map(bars).unwrap_or_default(), 0.0);
    latency_panel(
        &mut s,
        latency.map(points).unwrap_or_default(),
        PANEL_H + 40.0,
    );
    s.push_str("</svg>\n");
    s
}

fn frame_axes(
    s: &mut String,
    y0: f64,
    title: &str,
    y_label: &str,
    axis: LogAxis,
    fmt: fn(f64) -> String,
) {
    let (x1, x2) = (LEFT, WIDTH - RIGHT);
    let (top, bottom) = (y0 + TOP, y0 + PANEL_H - BOTTOM);
    let _ = writeln!(
        s,
        "<text x=\"{x}\" y=\"{y}\" font-size=\"15\" font-weight=\"bold\">{t}</text>",
        x = LEFT,
        y = y0 + 28.0,
        t = esc(title)
    );
    let _ = writeln!(
        s,
        "<text x=\"18\" y=\"{y}\" transform=\"rotate(-90 18 {y})\" text-anchor=\"middle\">{t}</text>",
        y = (top + bottom) / 2.0,
        t = esc(y_label)
    );
    for d in axis.decades() {
        let y = bottom - axis.frac(d) * (bottom - top);
        let _ = writeln!(
            s,
            "<line x1=\"{x1}\" y1=\"{y:.1}\" x2=\"{x2}\" y2=\"{y:.1}\" stroke=\"#dddddd\"/>"
        );
        let _ = writeln!(
            s,
            "<text x=\"{x}\" y=\"{y:.1}\" text-anchor=\"end\" dominant-baseline=\"middle\">{t}</text>",
            x = x1 - 6.0,
            t = esc(&fmt(d))
        );
    }
    let _ = writeln!(
        s,
        "<line x1=\"{x1}\" y1=\"{top}\" x2=\"{x1}\" y2=\"{bottom}\" stroke=\"#333333\"/>"
    );
    let _ = writeln!(
        s,
        "<line x1=\"{x1}\" y1=\"{bottom}\" x2=\"{x2}\" y2=\"{bottom}\" stroke=\"#333333\"/>"
    );
}

fn no_data(s: &mut String, y0: f64, what: &str) {
    let _ = writeln!(
        s,
        "<text x=\"{x}\" y=\"{y}\" text-anchor=\"middle\" fill=\"#999999\">{t}</text>",
        x = WIDTH / 2.0,
        y = y0 + PANEL_H / 2.0,
        t = esc(&format!("no {what} results"))
    );
}

fn legend(s: &mut String, y0: f64, entries: &[(String, &str, bool)]) {
    let x = WIDTH - RIGHT + 20.0;
    for (i, (name, col, dashed)) in entries.iter().enumerate() {
        let y = y0 + TOP + 10.0 + i as f64 * 20.0;
        let dash = if *dashed {
            " stroke-dasharray=\"5,3\""
        } else {
            ""
        };
        let _ = writeln!(
            s,
            "<line x1=\"{x}\" y1=\"{y}\" x2=\"{x2}\" y2=\"{y}\" stroke=\"{col}\" stroke-width=\"6\"{dash}/>",
            x2 = x + 22.0
        );
        let _ = writeln!(
            s,
            "<text x=\"{tx}\" y=\"{y}\" dominant-baseline=\"middle\">{t}</text>",
            tx = x + 30.0,
            t = esc(name)
        );
    }
}

fn throughput_panel(s: &mut String, bars: Vec<Bar>, y0: f64) {
    let title = "(a) throughput: frames/s per payload size, relay vs direct (log scale)";
    let axis = LogAxis::over(bars.iter().map(|b| b.fps));
    frame_axes(s, y0, title, "frames/s", axis, fmt_count);
    if bars.is_empty() {
        no_data(s, y0, "throughput");
        return;
    }
    let sizes: Vec<u64> = bars
        .iter()
        .map(|b| b.size)
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    let paths = sorted_paths(bars.iter().map(|b| b.path.as_str()));
    let (x1, x2) = (LEFT, WIDTH - RIGHT);
    let (top, bottom) = (y0 + TOP, y0 + PANEL_H - BOTTOM);
    let group_w = (x2 - x1) / sizes.len() as f64;
    let bar_w = group_w * 0.8 / paths.len() as f64;
    for (gi, size) in sizes.iter().enumerate() {
        let gx = x1 + gi as f64 * group_w + group_w * 0.1;
        for (pi, path) in paths.iter().enumerate() {
            let Some(b) = bars.iter().find(|b| b.size == *size && &b.path == path) else {
                continue;
            };
            let h = axis.frac(b.fps) * (bottom - top);
            let x = gx + pi as f64 * bar_w;
            let _ = writeln!(
                s,
                "<rect x=\"{x:.1}\" y=\"{y:.1}\" width=\"{w:.1}\" height=\"{h:.1}\" fill=\"{c}\">\
                 <title>{t}</title></rect>",
                y = bottom - h,
                w = bar_w * 0.92,
                c = color(path),
                t = esc(&format!(
                    "{path}, {}: {} frames/s",
                    fmt_size(*size as usize),
                    fmt_count(b.fps)
                ))
            );
        }
        let _ = writeln!(
            s,
            "<text x=\"{x:.1}\" y=\"{y}\" text-anchor=\"middle\">{t}</text>",
            x = x1 + (gi as f64 + 0.5) * group_w,
            y = bottom + 18.0,
            t = esc(&fmt_size(*size as usize))
        );
    }
    let _ = writeln!(
        s,
        "<text x=\"{x}\" y=\"{y}\" text-anchor=\"middle\">payload size</text>",
        x = (x1 + x2) / 2.0,
        y = bottom + 40.0
    );
    let entries: Vec<(String, &str, bool)> =
        paths.iter().map(|p| (p.clone(), color(p), false)).collect();
    legend(s, y0, &entries);
}

fn latency_panel(s: &mut String, points: Vec<Point>, y0: f64) {
    let title = "(b) latency: round-trip p50 (dashed) and p99 (solid) per offered load (log scale)";
    let axis = LogAxis::over(points.iter().flat_map(|p| [p.p50, p.p99]));
    frame_axes(s, y0, title, "round trip", axis, fmt_us);
    if points.is_empty() {
        no_data(s, y0, "latency");
        return;
    }
    let mut loads: Vec<f64> = Vec::new();
    for p in &points {
        if !loads.iter().any(|l| (l - p.load).abs() < 0.5) {
            loads.push(p.load);
        }
    }
    loads.sort_by(f64::total_cmp);
    let paths = sorted_paths(points.iter().map(|p| p.path.as_str()));
    let (x1, x2) = (LEFT, WIDTH - RIGHT);
    let (top, bottom) = (y0 + TOP, y0 + PANEL_H - BOTTOM);
    let step = (x2 - x1) / loads.len() as f64;
    let x_of = |load: f64| -> f64 {
        let i = loads
            .iter()
            .position(|l| (l - load).abs() < 0.5)
            .unwrap_or(0);
        x1 + (i as f64 + 0.5) * step
    };
    let y_of = |v: f64| bottom - axis.frac(v) * (bottom - top);
    for (i, l) in loads.iter().enumerate() {
        let _ = writeln!(
            s,
            "<text x=\"{x:.1}\" y=\"{y}\" text-anchor=\"middle\">{t}</text>",
            x = x1 + (i as f64 + 0.5) * step,
            y = bottom + 18.0,
            t = esc(&format!("{}/s", fmt_count(*l)))
        );
    }
    let _ = writeln!(
        s,
        "<text x=\"{x}\" y=\"{y}\" text-anchor=\"middle\">offered load (frames/s)</text>",
        x = (x1 + x2) / 2.0,
        y = bottom + 40.0
    );
    let mut entries = Vec::new();
    for path in &paths {
        let mut ps: Vec<&Point> = points.iter().filter(|p| &p.path == path).collect();
        ps.sort_by(|a, b| a.load.total_cmp(&b.load));
        let c = color(path);
        for (which, dashed) in [("p50", true), ("p99", false)] {
            let value = |p: &Point| if which == "p50" { p.p50 } else { p.p99 };
            let pts: Vec<String> = ps
                .iter()
                .map(|p| format!("{:.1},{:.1}", x_of(p.load), y_of(value(p))))
                .collect();
            let dash = if dashed {
                " stroke-dasharray=\"6,4\""
            } else {
                ""
            };
            let _ = writeln!(
                s,
                "<polyline points=\"{}\" fill=\"none\" stroke=\"{c}\" stroke-width=\"2\"{dash}/>",
                pts.join(" ")
            );
            for p in &ps {
                let _ = writeln!(
                    s,
                    "<circle cx=\"{:.1}\" cy=\"{:.1}\" r=\"3.5\" fill=\"{c}\"><title>{}</title></circle>",
                    x_of(p.load),
                    y_of(value(p)),
                    esc(&format!(
                        "{path} {which} at {}/s: {}",
                        fmt_count(p.load),
                        fmt_us(value(p))
                    ))
                );
            }
            entries.push((format!("{path} {which}"), c, dashed));
        }
    }
    legend(s, y0, &entries);
}

fn read_json(path: &Path) -> anyhow::Result<Option<Value>> {
    if !path.exists() {
        return Ok(None);
    }
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let v = serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    Ok(Some(v))
}

/// Reads `throughput.json` and `latency.json` from `dir` (each optional, at
/// least one required) and writes the chart to `out`.
pub fn render_dir(dir: &Path, out: &Path) -> anyhow::Result<()> {
    let t = read_json(&dir.join("throughput.json"))?;
    let l = read_json(&dir.join("latency.json"))?;
    anyhow::ensure!(
        t.is_some() || l.is_some(),
        "neither throughput.json nor latency.json in {}",
        dir.display()
    );
    let svg = render(t.as_ref(), l.as_ref());
    if let Some(parent) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent)
            .with_context(|| format!("creating {}", parent.display()))?;
    }
    std::fs::write(out, svg).with_context(|| format!("writing {}", out.display()))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn throughput() -> Value {
        serde_json::json!({"cases": [
            {"path": "direct", "payload_bytes": 64, "frames_per_sec": 400000.0},
            {"path": "relay-memory", "payload_bytes": 64, "frames_per_sec": 150000.0},
            {"path": "relay-redis", "payload_bytes": 64, "frames_per_sec": 60000.0},
            {"path": "direct", "payload_bytes": 16384, "frames_per_sec": 40000.0},
            {"path": "relay-memory", "payload_bytes": 16384, "frames_per_sec": 12000.0},
        ]})
    }

    fn latency() -> Value {
        serde_json::json!({"results": [
            {"path": "direct", "offered_per_sec": 1000.0, "rtt": {"p50_us": 80.0, "p99_us": 200.0}},
            {"path": "relay-memory", "offered_per_sec": 1000.0, "rtt": {"p50_us": 300.0, "p99_us": 900.0}},
            {"path": "direct", "offered_per_sec": 10000.0, "rtt": {"p50_us": 90.0, "p99_us": 400.0}},
            {"path": "relay-memory", "offered_per_sec": 10000.0, "rtt": {"p50_us": 350.0, "p99_us": 2500.0}},
        ]})
    }

    /// Opening tags (not self-closing) minus closing tags, per name.
    fn unbalanced(svg: &str) -> Vec<String> {
        let mut depth: std::collections::BTreeMap<String, i64> = Default::default();
        let mut rest = svg;
        while let Some(at) = rest.find('<') {
            rest = &rest[at + 1..];
            let end = rest.find('>').unwrap();
            let tag = &rest[..end];
            rest = &rest[end + 1..];
            if let Some(name) = tag.strip_prefix('/') {
                *depth.entry(name.trim().to_string()).or_default() -= 1;
            } else if !tag.ends_with('/') {
                let name = tag.split_whitespace().next().unwrap().to_string();
                *depth.entry(name).or_default() += 1;
            }
        }
        depth
            .into_iter()
            .filter(|(_, d)| *d != 0)
            .map(|(n, d)| format!("{n}: {d}"))
            .collect()
    }

    #[test]
    fn svg_is_well_formed_and_names_every_series() {
        let svg = render(Some(&throughput()), Some(&latency()));
        assert!(svg.starts_with("<svg "), "{svg}");
        assert!(svg.trim_end().ends_with("</svg>"));
        assert!(unbalanced(&svg).is_empty(), "{:?}", unbalanced(&svg));
        for name in [
            "direct",
            "relay-memory",
            "relay-redis",
            "direct p50",
            "direct p99",
            "relay-memory p50",
            "relay-memory p99",
            "64 B",
            "16 KiB",
            "10,000/s",
        ] {
            assert!(svg.contains(name), "{name} missing");
        }
        // Five bars, eight latency points.
        assert_eq!(svg.matches("<rect ").count(), 1 + 5);
        assert_eq!(svg.matches("<circle ").count(), 8);
        assert!(!svg.contains("NaN") && !svg.contains("inf"));
    }

    #[test]
    fn missing_inputs_still_give_a_valid_svg() {
        let svg = render(None, Some(&latency()));
        assert!(svg.starts_with("<svg "));
        assert!(unbalanced(&svg).is_empty());
        assert!(svg.contains("no throughput results"));
        let svg = render(Some(&throughput()), None);
        assert!(svg.contains("no latency results"));
    }

    #[test]
    fn render_dir_reads_the_scenario_files() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("throughput.json"), throughput().to_string()).unwrap();
        let out = dir.path().join("c/chart.svg");
        render_dir(dir.path(), &out).unwrap();
        assert!(
            std::fs::read_to_string(out)
                .unwrap()
                .contains("relay-redis")
        );
        assert!(render_dir(&dir.path().join("none"), &dir.path().join("x.svg")).is_err());
    }

    #[test]
    fn log_axis_rounds_to_decades() {
        let a = LogAxis::over([150.0, 42_000.0].into_iter());
        assert_eq!(a.lo, 100.0);
        assert_eq!(a.hi, 100_000.0);
        assert_eq!(a.decades().len(), 4);
        assert!((a.frac(1000.0) - 1.0 / 3.0).abs() < 1e-9);
    }
}
