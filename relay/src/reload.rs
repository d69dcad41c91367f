//! Live reload: re-reading the configuration file while the relay serves.
//!
//! A reload (`SIGHUP`, or `POST /reload` on the admin listener) reads the
//! file again with the same flag and environment overrides the relay started
//! with, validates it exactly as `oab-relay check-config` does, and builds a
//! new [`LiveConfig`]: the peers and their keys, the routes, the TLS
//! certificate and key (read from disk again, so a renewed file in place is
//! picked up), and the limits listed in [`RELOADABLE`]. The hub swaps it in
//! whole ([`crate::hub::Hub::install`]); handshakes, opens and accepts read
//! it once each (an `arc_swap` load, no lock), a session keeps what it read
//! at its handshake, and the frame path never reads it.
//!
//! Everything else (listen addresses, the store, the fleet, frame sizes, the
//! connection caps) needs a restart: a changed value is logged with "needs a
//! restart" and not applied, and the rest of the reload still applies.
//!
//! Never: applies a configuration that failed validation or whose TLS files
//! could not be loaded: the old one keeps serving, the errors are logged,
//! counted (`oab_config_reloads_total{result}`) and returned to the admin
//! caller.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use tracing::{info, warn};

use crate::config::{Config, ConfigError, Directory, FieldError, TlsMode};
use crate::hub::Hub;
pub use crate::live::{Installed, Limiters, LiveConfig, quota};
use crate::metrics::Metrics;
use crate::store::EventStore;
use crate::tls::TlsError;

/// The fields a reload applies, as dotted paths (`peers` and `routes`: the
/// whole lists). When they take effect: `peers`, `routes` and the keys at
/// once (sessions of removed peers and retired keys are closed with
/// `revoked`); the TLS files for new connections; `relay.*` and the session
/// limits for sessions that connect after the reload; `max_open_per_peer`,
/// `max_descriptor` and the request rate at the next open or request;
/// `lifecycle.unknown_grace_ms` at the next sweep. Any other field needs a
/// restart. `docs/configuration.md` marks the same set.
pub const RELOADABLE: &[&str] = &[
    "peers",
    "routes",
    "relay.tls_cert",
    "relay.tls_key",
    "relay.heartbeat_ms",
    "relay.idle_timeout_ms",
    "relay.max_clock_skew_ms",
    "relay.reconnect_hint_ms",
    "limits.max_in_flight",
    "limits.session_queue",
    "limits.session_queue_bytes",
    "limits.slow_consumer_ms",
    "limits.append_batches_in_flight",
    "limits.max_open_per_peer",
    "limits.max_descriptor",
    "rate.peer_frames_per_second",
    "rate.peer_frames_burst",
    "rate.connects_per_second_per_ip",
    "rate.connects_burst_per_ip",
    "rate.peer_requests_per_second",
    "rate.peer_requests_burst",
    "lifecycle.unknown_grace_ms",
];

/// Where a reload reads the configuration from.
#[derive(Debug, Clone)]
pub struct ConfigSource {
    /// The TOML file.
    pub path: PathBuf,
    /// The flag and environment overrides the relay started with, applied
    /// again on every reload.
    pub overrides: Vec<(String, String)>,
}

impl ConfigSource {
    /// Reads, parses and validates the file (the same errors as
    /// `check-config`).
    pub fn read(&self) -> Result<Config, ConfigError> {
        let shown = self.path.display().to_string();
        let text = std::fs::read_to_string(&self.path).map_err(|error| ConfigError::Read {
            path: shown.clone(),
            error,
        })?;
        Config::from_toml_with_overrides(&text, &shown, &self.overrides)
    }
}

/// Takes the [`RELOADABLE`] fields of `new` into a copy of `running`; also
/// returns the other fields whose value differs in `new` (they need a
/// restart). A field added to the config later is restart-only until it is
/// listed here: the comparison covers every field.
pub fn effective(running: &Config, new: &Config) -> (Config, Vec<String>) {
    let mut eff = running.clone();
    eff.peers = new.peers.clone();
    eff.routes = new.routes.clone();
    let (r, n) = (&mut eff.relay, &new.relay);
    r.tls_cert = n.tls_cert.clone();
    r.tls_key = n.tls_key.clone();
    r.heartbeat_ms = n.heartbeat_ms;
    r.idle_timeout_ms = n.idle_timeout_ms;
    r.max_clock_skew_ms = n.max_clock_skew_ms;
    r.reconnect_hint_ms = n.reconnect_hint_ms;
    let (l, n) = (&mut eff.limits, &new.limits);
    l.max_in_flight = n.max_in_flight;
    l.session_queue = n.session_queue;
    l.session_queue_bytes = n.session_queue_bytes;
    l.slow_consumer_ms = n.slow_consumer_ms;
    l.append_batches_in_flight = n.append_batches_in_flight;
    l.max_open_per_peer = n.max_open_per_peer;
    l.max_descriptor = n.max_descriptor;
    eff.rate = new.rate.clone();
    eff.lifecycle.unknown_grace_ms = new.lifecycle.unknown_grace_ms;
    let mut a = BTreeMap::new();
    let mut b = BTreeMap::new();
    flatten("", &serde_json::to_value(&eff).unwrap_or_default(), &mut a);
    flatten("", &serde_json::to_value(new).unwrap_or_default(), &mut b);
    let mut differ: Vec<String> = a
        .keys()
        .chain(b.keys())
        .filter(|k| a.get(*k) != b.get(*k))
        .cloned()
        .collect();
    differ.sort();
    differ.dedup();
    (eff, differ)
}

/// The leaves of a JSON value by dotted path (arrays are leaves).
fn flatten(prefix: &str, v: &serde_json::Value, out: &mut BTreeMap<String, serde_json::Value>) {
    match v {
        serde_json::Value::Object(map) => {
            for (k, v) in map {
                let path = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                flatten(&path, v, out);
            }
        }
        other => {
            out.insert(prefix.to_string(), other.clone());
        }
    }
}

/// Why a reload was not applied. The old configuration keeps serving.
#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    /// The relay was started without a configuration file.
    #[error("no configuration file to reload")]
    NoSource,
    /// The file could not be read, parsed or validated (`check-config`'s
    /// errors).
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The certificate or key could not be loaded.
    #[error("TLS: {0}")]
    Tls(#[from] TlsError),
}

impl ReloadError {
    /// The `result` label: `invalid` for a file that does not parse or
    /// validate, `error` for anything else.
    pub fn result(&self) -> &'static str {
        match self {
            ReloadError::Config(ConfigError::Parse { .. } | ConfigError::Invalid { .. }) => {
                "invalid"
            }
            _ => "error",
        }
    }

    /// The field errors, when validation failed.
    pub fn field_errors(&self) -> &[FieldError] {
        match self {
            ReloadError::Config(ConfigError::Invalid { errors, .. }) => errors,
            _ => &[],
        }
    }
}

/// What an applied reload changed.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ReloadReport {
    /// The new generation.
    pub generation: u64,
    /// Changed fields that were not applied (they need a restart).
    pub needs_restart: Vec<String>,
    /// Peers added.
    pub peers_added: Vec<String>,
    /// Peers removed (their sessions here were closed with `revoked`).
    pub peers_removed: Vec<String>,
    /// Sessions here closed with `revoked` (removed peers, retired keys).
    pub sessions_closed: usize,
}

/// `oab_config_*`: the loaded configuration and the reloads.
#[derive(Debug)]
struct ReloadMetrics {
    generation: prometheus::IntGauge,
    reloads: prometheus::IntCounterVec,
    last_success: prometheus::Gauge,
}

impl ReloadMetrics {
    // Metric names are constants: creation fails only on a programming
    // error (as in `metrics.rs`).
    #[allow(clippy::expect_used)]
    fn new(metrics: &Metrics) -> Self {
        let generation = prometheus::IntGauge::new(
            "oab_config_generation",
            "Generation of the configuration in force: 1 at start, +1 per applied reload.",
        )
        .expect("valid metric");
        let reloads = prometheus::IntCounterVec::new(
            prometheus::Opts::new(
                "oab_config_reloads_total",
                "Configuration reloads by result (ok, invalid: the file failed validation, \
                 error: it could not be read or its TLS files not loaded).",
            ),
            &["result"],
        )
        .expect("valid metric");
        let last_success = prometheus::Gauge::new(
            "oab_config_last_reload_success_timestamp_seconds",
            "When the configuration in force was loaded (start or last applied reload), \
             seconds since the Unix epoch.",
        )
        .expect("valid metric");
        for m in [
            Box::new(generation.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(reloads.clone()),
            Box::new(last_success.clone()),
        ] {
            // A registry that has them already (a second relay over one
            // `Metrics`) keeps the first.
            let _ = metrics.registry.register(m);
        }
        for r in ["ok", "invalid", "error"] {
            reloads.with_label_values(&[r]);
        }
        ReloadMetrics {
            generation,
            reloads,
            last_success,
        }
    }

    fn loaded(&self, generation: u64) {
        self.generation
            .set(i64::try_from(generation).unwrap_or(i64::MAX));
        #[allow(clippy::cast_precision_loss)]
        self.last_success
            .set(oab_wire::identity::now_ms() as f64 / 1000.0);
    }
}

/// Runs reloads one at a time and counts them.
#[derive(Debug)]
pub struct Reloader {
    source: Option<ConfigSource>,
    metrics: ReloadMetrics,
    /// One reload at a time (a `SIGHUP` and a `POST /reload` together).
    running: tokio::sync::Mutex<()>,
}

impl Reloader {
    /// A reloader reading `source` (`None`: every reload fails with
    /// [`ReloadError::NoSource`]); registers the `oab_config_*` metrics.
    pub fn new(source: Option<ConfigSource>, metrics: &Metrics) -> Self {
        let metrics = ReloadMetrics::new(metrics);
        metrics.loaded(1);
        Reloader {
            source,
            metrics,
            running: tokio::sync::Mutex::new(()),
        }
    }

    /// Reads the file and applies it, or keeps the old configuration and
    /// says why. Logged and counted either way.
    pub async fn reload<S: EventStore>(
        &self,
        hub: &Arc<Hub<S>>,
    ) -> Result<ReloadReport, ReloadError> {
        let _one = self.running.lock().await;
        let result = self.apply(hub).await;
        match &result {
            Ok(report) => {
                self.metrics.reloads.with_label_values(&["ok"]).inc();
                self.metrics.loaded(report.generation);
                for field in &report.needs_restart {
                    warn!(%field, "configuration reload: this field changed and needs a restart; not applied");
                }
                info!(
                    generation = report.generation,
                    peers_added = report.peers_added.len(),
                    peers_removed = report.peers_removed.len(),
                    sessions_closed = report.sessions_closed,
                    "configuration reloaded"
                );
            }
            Err(e) => {
                self.metrics.reloads.with_label_values(&[e.result()]).inc();
                warn!(result = e.result(), error = %e, "configuration reload refused; the old configuration keeps serving");
            }
        }
        result
    }

    async fn apply<S: EventStore>(&self, hub: &Arc<Hub<S>>) -> Result<ReloadReport, ReloadError> {
        let source = self.source.clone().ok_or(ReloadError::NoSource)?;
        // File reads off the async workers.
        let read = tokio::task::spawn_blocking(move || {
            let new = source.read()?;
            let tls = match new.relay.tls_mode {
                TlsMode::Terminate => match (&new.relay.tls_cert, &new.relay.tls_key) {
                    (Some(cert), Some(key)) => Some(crate::tls::load_server_config(cert, key)?),
                    // Refused by validation.
                    _ => None,
                },
                TlsMode::BehindLoadBalancer => None,
            };
            Ok::<_, ReloadError>((new, tls))
        })
        .await;
        let (new, tls) = match read {
            Ok(r) => r?,
            Err(e) => {
                return Err(ReloadError::Config(ConfigError::Parse {
                    path: String::new(),
                    message: format!("reading the file failed: {e}"),
                }));
            }
        };
        let old = hub.live();
        let (eff, needs_restart) = effective(&old.config, &new);
        // The mix of new and kept values must hold together too (a route's
        // `max_payload` against a `limits.max_payload` that needs a restart).
        eff.validate().map_err(|errors| ConfigError::Invalid {
            path: self
                .source
                .as_ref()
                .map(|s| s.path.display().to_string())
                .unwrap_or_default(),
            errors,
        })?;
        // The TLS mode needs a restart: keep serving without TLS behind a
        // load balancer, whatever the file says.
        let tls = if eff.relay.tls_mode == TlsMode::Terminate {
            tls.or_else(|| old.tls.clone())
        } else {
            None
        };
        let same_rate =
            serde_json::to_value(&old.config.rate).ok() == serde_json::to_value(&eff.rate).ok();
        let limiters = if same_rate {
            old.limiters.clone()
        } else {
            Arc::new(Limiters::new(&eff))
        };
        let generation = old.generation + 1;
        let installed = hub.install(LiveConfig {
            generation,
            directory: Directory::new(&eff),
            config: Arc::new(eff),
            tls,
            limiters,
        });
        Ok(ReloadReport {
            generation,
            needs_restart,
            peers_added: installed
                .peers_added
                .iter()
                .map(|p| p.to_string())
                .collect(),
            peers_removed: installed
                .peers_removed
                .iter()
                .map(|p| p.to_string())
                .collect(),
            sessions_closed: installed.sessions_closed,
        })
    }
}

/// `POST /reload` on the admin listener: reloads now and answers with the
/// outcome as JSON: `200` and the [`ReloadReport`] when applied, `422` with
/// `check-config`'s message and the field errors when the file is invalid,
/// `500` when it could not be read or its TLS files not loaded, `409` when
/// the relay has no file to reload.
pub fn admin_routes<S: EventStore>(hub: Arc<Hub<S>>, reloader: Arc<Reloader>) -> axum::Router {
    axum::Router::new().route(
        "/reload",
        axum::routing::post(move || {
            let (hub, reloader) = (hub.clone(), reloader.clone());
            async move { reload_response(reloader.reload(&hub).await) }
        }),
    )
}

fn reload_response(
    result: Result<ReloadReport, ReloadError>,
) -> (
    axum::http::StatusCode,
    [(axum::http::HeaderName, &'static str); 1],
    String,
) {
    use axum::http::StatusCode;
    let (status, body) = match result {
        Ok(report) => {
            let mut body = serde_json::to_value(&report).unwrap_or_default();
            body["result"] = "ok".into();
            (StatusCode::OK, body)
        }
        Err(e) => {
            let status = match (&e, e.result()) {
                (ReloadError::NoSource, _) => StatusCode::CONFLICT,
                (_, "invalid") => StatusCode::UNPROCESSABLE_ENTITY,
                _ => StatusCode::INTERNAL_SERVER_ERROR,
            };
            let errors: Vec<serde_json::Value> = e
                .field_errors()
                .iter()
                .map(|f| serde_json::json!({ "field": f.field, "line": f.line, "message": f.message }))
                .collect();
            let body = serde_json::json!({
                "result": e.result(),
                "message": e.to_string(),
                "errors": errors,
            });
            (status, body)
        }
    };
    (
        status,
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        format!("{body}\n"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: &str = r#"
[relay]
id = "relay.test"
tls_cert = "cert.pem"
tls_key = "key.pem"
"#;

    fn config(extra: &str) -> Config {
        Config::from_toml_with_overrides(&format!("{BASE}{extra}"), "t", &[]).unwrap()
    }

    #[test]
    fn reloadable_fields_apply_and_the_others_are_named_and_kept() {
        let running = config("");
        let new = config(
            "listen = \"0.0.0.0:8443\"\nheartbeat_ms = 5000\n\
             [limits]\nmax_payload = 4096\nmax_open_per_peer = 7\n\
             [store]\nurl = \"redis://127.0.0.1:1/\"\n",
        );
        let (eff, restart) = effective(&running, &new);
        assert_eq!(restart, ["limits.max_payload", "relay.listen", "store.url"]);
        assert_eq!(eff.relay.heartbeat_ms, 5000);
        assert_eq!(eff.limits.max_open_per_peer, 7);
        assert_eq!(eff.relay.listen, running.relay.listen);
        assert_eq!(eff.limits.max_payload, running.limits.max_payload);
        assert_eq!(eff.store.url, "memory");
    }

    #[test]
    fn configuration_md_marks_exactly_the_reloadable_fields_live() {
        let doc = include_str!("../../docs/configuration.md");
        let sections = [
            ("## `[relay]`", "relay"),
            ("## `[limits]`", "limits"),
            ("## `[rate]`", "rate"),
            ("## `[store]`", "store"),
            ("## `[lifecycle]`", "lifecycle"),
            ("## `[fleet]`", "fleet"),
            ("## Relay `[[peers]]`", "peers"),
            ("## `[[routes]]`", "routes"),
        ];
        let mut section = None;
        let mut live = Vec::new();
        let mut rows = 0;
        for line in doc.lines() {
            if line.starts_with("## ") {
                section = sections
                    .iter()
                    .find(|(h, _)| line.trim() == *h)
                    .map(|(_, s)| *s);
                continue;
            }
            let Some(section) = section else { continue };
            let Some(field) = line
                .strip_prefix("| `")
                .and_then(|rest| rest.split_once('`'))
                .map(|(f, _)| f)
            else {
                continue;
            };
            rows += 1;
            let mark = line.trim_end().trim_end_matches('|').rsplit('|').next();
            let mark = mark.map(str::trim);
            match (section, mark) {
                ("peers" | "routes", Some("live")) => {}
                (_, Some("live")) => live.push(format!("{section}.{field}")),
                ("peers" | "routes", other) => panic!("{section}.{field}: {other:?}"),
                (_, Some("restart")) => {}
                (_, other) => panic!("{section}.{field}: no reload mark ({other:?})"),
            }
        }
        assert!(rows > 40, "found only {rows} field rows");
        let mut expected: Vec<String> = RELOADABLE
            .iter()
            .filter(|p| p.contains('.'))
            .map(|p| p.to_string())
            .collect();
        expected.sort();
        live.sort();
        assert_eq!(live, expected);
    }

    #[test]
    fn every_reloadable_field_is_taken_from_the_file() {
        // Each listed field, changed alone, is applied and needs no restart.
        let running = config("");
        let base = serde_json::to_value(&running).unwrap();
        for path in RELOADABLE {
            let mut v = base.clone();
            let mut parts = path.split('.');
            let (Some(section), field) = (parts.next(), parts.next()) else {
                continue;
            };
            let Some(field) = field else {
                // `peers`, `routes`: whole lists, covered by the hub tests.
                continue;
            };
            let slot = &mut v[section][field];
            *slot = match slot {
                serde_json::Value::Number(n) => {
                    serde_json::Value::from(n.as_u64().unwrap_or(1).saturating_mul(2).max(2))
                }
                _ => serde_json::Value::from(format!("other-{field}.pem")),
            };
            let new: Config = serde_json::from_value(v).unwrap();
            let (eff, restart) = effective(&running, &new);
            assert!(restart.is_empty(), "{path}: {restart:?}");
            assert_eq!(
                serde_json::to_value(&eff).unwrap()[section][field],
                serde_json::to_value(&new).unwrap()[section][field],
                "{path}"
            );
        }
    }
}
