//! Values that validate but can lock peers out or keep them from
//! delegating: `oab-relay check-config` prints them as warnings (exit code
//! still 0) and the relay logs them at start.
//!
//! Each warning names its field and what a peer would see. The thresholds
//! are not limits of the protocol: they are values below which an ordinary
//! deployment (NTP-synchronised clocks, signed requests of a few KiB, a
//! connector's default heartbeat and backoff) starts getting refused.
//!
//! Never: refuses a configuration: [`crate::config::Config::validate`] does
//! that; a warning is something an operator may mean (a test relay with a
//! one-second deadline, say).

use oab_wire::identity::KeyWindow;

use crate::config::{Config, FieldError};

/// Below this clock skew bound, a connector whose clock drifts like an
/// ordinary NTP client's (well under a second) plus network delay can be
/// refused `4506 clock_skew`, a code connectors do not retry.
pub const MIN_CLOCK_SKEW_MS: u64 = 5_000;

/// Below this handshake deadline, a connector across a slow link (TLS,
/// upgrade, signature, store lookup) can time out on every attempt.
pub const MIN_HANDSHAKE_TIMEOUT_MS: u64 = 2_000;

/// Below this route deadline bound, most real tasks cannot be delegated at
/// all (`invalid_deadline`).
pub const MIN_ROUTE_DEADLINE_MS: u64 = 10_000;

/// Below this payload bound, signed requests (an `Open`'s payload is the
/// caller's signed request envelope, about 1 to 3 KiB) are refused
/// `payload_too_large`.
pub const MIN_PAYLOAD_BYTES: u32 = 8_192;

/// Below this per-peer frame rate (or burst), a delegation that streams
/// progress gets `rate_limited` refusals.
pub const MIN_FRAME_RATE: u32 = 100;

/// Below this retention, a caller that reconnects a little later loses its
/// finished delegations' results (`Gap`).
pub const MIN_FINISHED_TTL_MS: u64 = 60_000;

/// Every warning for `config` at `now_ms` (ms since the Unix epoch).
pub fn warnings(config: &Config, now_ms: u64) -> Vec<FieldError> {
    let mut out = Vec::new();
    let mut warn = |field: String, message: String| {
        out.push(FieldError {
            field,
            message,
            line: None,
        })
    };
    let r = &config.relay;
    if r.max_clock_skew_ms < MIN_CLOCK_SKEW_MS {
        warn(
            "relay.max_clock_skew_ms".into(),
            format!(
                "{} ms is tight: a connector whose clock is off by more is refused with 4506 \
                 clock_skew, which connectors do not retry (at least {MIN_CLOCK_SKEW_MS} ms)",
                r.max_clock_skew_ms
            ),
        );
    }
    if r.handshake_timeout_ms < MIN_HANDSHAKE_TIMEOUT_MS {
        warn(
            "relay.handshake_timeout_ms".into(),
            format!(
                "{} ms: connectors on a slow link may never finish TLS, upgrade and hello in \
                 time (at least {MIN_HANDSHAKE_TIMEOUT_MS} ms)",
                r.handshake_timeout_ms
            ),
        );
    }
    if r.idle_timeout_ms < 2 * u64::from(r.heartbeat_ms) {
        warn(
            "relay.idle_timeout_ms".into(),
            format!(
                "{} ms is less than two heartbeats ({} ms each): a connector whose ping is a \
                 little late is cut with 4006 idle_timeout",
                r.idle_timeout_ms, r.heartbeat_ms
            ),
        );
    }
    if config.limits.max_payload < MIN_PAYLOAD_BYTES {
        warn(
            "limits.max_payload".into(),
            format!(
                "{} bytes: signed requests (1 to 3 KiB) and results may not fit; they are \
                 refused payload_too_large",
                config.limits.max_payload
            ),
        );
    }
    let rate = &config.rate;
    for (field, value) in [
        ("rate.peer_frames_per_second", rate.peer_frames_per_second),
        ("rate.peer_frames_burst", rate.peer_frames_burst),
    ] {
        if value < MIN_FRAME_RATE {
            warn(
                field.into(),
                format!(
                    "{value}: a delegation that streams progress gets rate_limited refusals \
                     (at least {MIN_FRAME_RATE})"
                ),
            );
        }
    }
    if rate.peer_requests_burst < crate::hub::PEERS_REQUEST_COST {
        warn(
            "rate.peer_requests_burst".into(),
            format!(
                "{}: a PeersQuery or Publish costs {}, so every one is refused rate_limited \
                 (peers are never listed, agent cards never published)",
                rate.peer_requests_burst,
                crate::hub::PEERS_REQUEST_COST
            ),
        );
    }
    if config.store.finished_ttl_ms < MIN_FINISHED_TTL_MS {
        warn(
            "store.finished_ttl_ms".into(),
            format!(
                "{} ms: a caller that reconnects later than this after a delegation ended gets \
                 a gap instead of its result (at least {MIN_FINISHED_TTL_MS} ms)",
                config.store.finished_ttl_ms
            ),
        );
    }
    for (i, p) in config.peers.iter().enumerate() {
        for (j, k) in p.keys.iter().enumerate() {
            let window = match k.window(now_ms) {
                KeyWindow::Valid => continue,
                KeyWindow::Expired => "its validity ended (not_after_ms is in the past)",
                KeyWindow::NotYetValid => "it is not valid yet (not_before_ms is in the future)",
            };
            let usable = p.keys.iter().any(|k| k.window(now_ms) == KeyWindow::Valid);
            warn(
                format!("peers[{i}].keys[{j}]"),
                format!(
                    "key {} of {}: {window}; {}",
                    k.key_id,
                    p.id,
                    if usable {
                        "its other key still works"
                    } else {
                        "the peer has no valid key now and is refused 4504 auth_failed"
                    }
                ),
            );
        }
        if !config.routes.iter().any(|r| r.from == p.id || r.to == p.id) {
            warn(
                format!("peers[{i}].id"),
                format!(
                    "{} is in no [[routes]] entry: it can connect but can neither delegate nor \
                     be delegated to",
                    p.id
                ),
            );
        }
    }
    for (i, route) in config.routes.iter().enumerate() {
        if route.max_deadline_ms < MIN_ROUTE_DEADLINE_MS {
            warn(
                format!("routes[{i}].max_deadline_ms"),
                format!(
                    "{} ms: every delegation {} -> {} must ask for a shorter deadline, else it \
                     is refused invalid_deadline",
                    route.max_deadline_ms, route.from, route.to
                ),
            );
        }
        if let Some(max) = route.max_payload
            && max < MIN_PAYLOAD_BYTES
        {
            warn(
                format!("routes[{i}].max_payload"),
                format!(
                    "{max} bytes: signed requests (1 to 3 KiB) and results may not fit; they are \
                     refused payload_too_large"
                ),
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    const BASE: &str = r#"
[relay]
id = "relay.example.com"
tls_cert = "/c.pem"
tls_key = "/k.pem"

[[peers]]
id = "acme/a"
keys = [{ key_id = "k1", public_key = "ed25519:iojj3XQJ8ZX9UtstPLpdcspnCb8dlBIb83SIAbQPb1w" }]

[[peers]]
id = "acme/b"
keys = [{ key_id = "k1", public_key = "ed25519:iojj3XQJ8ZX9UtstPLpdcspnCb8dlBIb83SIAbQPb1w" }]

[[routes]]
from = "acme/a"
to = "acme/b"
"#;

    fn fields(overrides: &[(&str, &str)], extra: &str) -> Vec<String> {
        let text = format!("{BASE}{extra}");
        let o: Vec<(String, String)> = overrides
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let c = Config::from_toml_with_overrides(&text, "t", &o).unwrap();
        warnings(&c, 1_000_000)
            .into_iter()
            .map(|w| w.field)
            .collect()
    }

    #[test]
    fn defaults_warn_about_nothing() {
        assert_eq!(fields(&[], ""), Vec::<String>::new());
    }

    #[test]
    fn each_lock_out_value_is_named() {
        let cases: &[(&str, &str, &str)] = &[
            ("relay.max_clock_skew_ms", "1000", "relay.max_clock_skew_ms"),
            (
                "relay.handshake_timeout_ms",
                "500",
                "relay.handshake_timeout_ms",
            ),
            ("relay.idle_timeout_ms", "20000", "relay.idle_timeout_ms"),
            ("limits.max_payload", "1024", "limits.max_payload"),
            (
                "rate.peer_frames_per_second",
                "10",
                "rate.peer_frames_per_second",
            ),
            ("rate.peer_requests_burst", "5", "rate.peer_requests_burst"),
            ("store.finished_ttl_ms", "1000", "store.finished_ttl_ms"),
        ];
        for (path, value, field) in cases {
            assert_eq!(
                fields(&[(path, value)], ""),
                vec![field.to_string()],
                "{path}={value}"
            );
        }
    }

    #[test]
    fn routes_keys_and_unrouted_peers_are_named() {
        let route = "[[routes]]\nfrom = \"acme/b\"\nto = \"acme/a\"\nmax_deadline_ms = 1000\nmax_payload = 1024\n";
        assert_eq!(
            fields(&[], route),
            vec!["routes[1].max_deadline_ms", "routes[1].max_payload"]
        );
        let lonely = "[[peers]]\nid = \"acme/c\"\nkeys = [\
            { key_id = \"old\", public_key = \"ed25519:iojj3XQJ8ZX9UtstPLpdcspnCb8dlBIb83SIAbQPb1w\", not_after_ms = 999 },\
            { key_id = \"new\", public_key = \"ed25519:iojj3XQJ8ZX9UtstPLpdcspnCb8dlBIb83SIAbQPb1w\", not_before_ms = 2000000 }]\n";
        let text = format!("{BASE}{lonely}");
        let c = Config::from_toml_with_overrides(&text, "t", &[]).unwrap();
        let w = warnings(&c, 1_000_000);
        let shown: Vec<String> = w.iter().map(ToString::to_string).collect();
        assert_eq!(w.len(), 3, "{shown:#?}");
        assert!(shown[0].starts_with("peers[2].keys[0]") && shown[0].contains("ended"));
        assert!(shown[1].starts_with("peers[2].keys[1]") && shown[1].contains("not valid yet"));
        assert!(shown[1].contains("no valid key now"));
        assert!(shown[2].starts_with("peers[2].id") && shown[2].contains("no [[routes]]"));
    }
}
