//! Prometheus metrics. Labels come only from fixed sets (frame types, close
//! codes, outcomes) and from configured peer ids, never from anything a
//! client claims, so an attacker cannot create series.
//!
//! It owns the registry, the counters of the frame path resolved once at start
//! (`Metrics::hot`), and the text rendered for `/metrics`.
//!
//! Never: takes a label value from a frame, or from a handshake before it
//! authenticated: labels are fixed names or configured peer ids.

use prometheus::{
    Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry,
};

/// Every metric the relay exports.
#[derive(Debug, Clone)]
pub struct Metrics {
    /// The registry `/metrics` renders.
    pub registry: Registry,
    /// Authenticated sessions now.
    pub sessions: IntGauge,
    /// Sessions per configured peer (0 or 1).
    pub peer_sessions: IntGaugeVec,
    /// Connections now (any phase).
    pub connections: IntGauge,
    /// Handshakes by result; `shed`: an unauthenticated connection closed
    /// to give its slot to a newer one when every handshake slot was held.
    pub handshakes: IntCounterVec,
    /// Frames by type and direction (`in` from peers, `out` to peers).
    pub frames: IntCounterVec,
    /// Bytes by direction.
    pub bytes: IntCounterVec,
    /// Delegations opened.
    pub delegations_opened: IntCounter,
    /// Terminals by outcome.
    pub terminals: IntCounterVec,
    /// Resume requests served.
    pub replays: IntCounter,
    /// Frames sent from the log during replays.
    pub replayed_frames: IntCounter,
    /// Gaps by reason.
    pub gaps: IntCounterVec,
    /// Error frames sent, by code.
    pub errors: IntCounterVec,
    /// Session closes by reason (close code name, or `transport`).
    pub disconnects: IntCounterVec,
    /// Sessions replaced by a newer session of the same peer.
    pub replaced: IntCounter,
    /// Messages taken from the wake channels (several instances over one
    /// store), by kind: `entry`, `nudge`, `claim`, `presence`, and `resync`
    /// rounds after missed messages.
    pub wakes: IntCounterVec,
    /// Rounds of re-reading every log served here from the store, by cause:
    /// `subscriber_reconnected`, `wake_queue_overflow`, and another
    /// instance's departure: `instance_lost` (its liveness lapsed),
    /// `instance_restarted` (a new process under its name within the
    /// lease), `instance_left` (a clean shutdown).
    pub resyncs: IntCounterVec,
    /// How long each resynchronisation took: re-reading the logs read here
    /// and the open delegations of the peers connected here (what
    /// retention keeps of finished ones is not read).
    pub resync_seconds: Histogram,
    /// 1 while this instance holds the fleet-wide sweeper lease.
    pub sweeper_leader: IntGauge,
    /// Live relay instances sharing the store, as last seen.
    pub fleet_nodes: IntGauge,
    /// Time from receiving a frame to queuing its ack.
    pub ack_latency: Histogram,
    /// Store operation latency by operation.
    pub store_latency: HistogramVec,
    /// Store operations that failed, by operation.
    pub store_errors: IntCounterVec,
    /// Frames dropped by rate limiting.
    pub rate_limited: IntCounterVec,
    /// Callers' releases of finished delegations, by result: `compacted`
    /// (both logs dropped), `ignored` (the store found nothing to compact:
    /// a relay-originated terminal, or already gone), `dropped` (the
    /// queue was full or the store failed; retention drops it later).
    pub releases: IntCounterVec,
    /// Connections refused before the handshake, by reason.
    pub refused: IntCounterVec,
    /// Hot-path handles, resolved once: frames in by type (indexed by the
    /// type byte), data frames out, bytes in and out.
    pub hot: HotCounters,
}

/// Counters of the frame path, resolved once so a frame costs an atomic add
/// instead of a label lookup.
#[derive(Debug, Clone)]
pub struct HotCounters {
    frames_in: Vec<prometheus::IntCounter>,
    /// Data frames delivered live.
    pub data_out: prometheus::IntCounter,
    /// Bytes received.
    pub bytes_in: prometheus::IntCounter,
    /// Bytes sent.
    pub bytes_out: prometheus::IntCounter,
    /// Store `append` latency.
    pub append_latency: prometheus::Histogram,
}

impl HotCounters {
    /// The counter of frames received of a type.
    pub fn frame_in(&self, t: oab_wire::FrameType) -> Option<&prometheus::IntCounter> {
        self.frames_in.get(t as usize)
    }
}

/// The `result` values of `oab_handshakes_total` (server.rs, session.rs).
const HANDSHAKE_RESULTS: &[&str] = &[
    "ok",
    "auth_failed",
    "version",
    "clock_skew",
    "binding",
    "timeout",
    "overloaded",
    "oversized",
    "transport",
    "protocol",
    "malformed",
    "store",
    "tls",
    "upgrade",
    "shed",
];

/// The `kind` values of `oab_wake_messages_total` (hub/wakeups.rs).
const WAKE_KINDS: &[&str] = &["entry", "nudge", "claim", "presence", "resync"];

/// The `op` values of `oab_store_errors_total` (`Hub::observe_store` callers).
const STORE_OPS: &[&str] = &["append", "read", "open", "meta", "callee", "due", "expire"];

/// The `scope` values of `oab_rate_limited_total`.
const RATE_LIMIT_SCOPES: &[&str] = &["peer", "request"];

/// The `reason` values of `oab_connections_refused_total` (server.rs and
/// `SlotRefusal::metric_label`).
const REFUSAL_REASONS: &[&str] = &[
    "rate_limited",
    "max_connections",
    "max_handshakes",
    "max_handshakes_per_source",
];

// Metric names and labels are compile-time constants, so construction can
// only fail on a programming error, which the unit test below rules out.
#[allow(clippy::expect_used)]
fn counter_vec(reg: &Registry, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    let c = IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric");
    reg.register(Box::new(c.clone())).expect("unique metric");
    c
}

#[allow(clippy::expect_used)]
fn gauge(reg: &Registry, name: &str, help: &str) -> IntGauge {
    let g = IntGauge::new(name, help).expect("valid metric");
    reg.register(Box::new(g.clone())).expect("unique metric");
    g
}

#[allow(clippy::expect_used)]
fn counter(reg: &Registry, name: &str, help: &str) -> IntCounter {
    let c = IntCounter::new(name, help).expect("valid metric");
    reg.register(Box::new(c.clone())).expect("unique metric");
    c
}

/// Latency buckets from 10 µs to 10 s.
fn latency_buckets() -> Vec<f64> {
    vec![
        0.000_01, 0.000_025, 0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01,
        0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0,
    ]
}

impl Metrics {
    /// Registers every metric; `peers` are the configured peer ids.
    #[allow(clippy::expect_used)]
    pub fn new(peers: &[oab_wire::PeerId]) -> Self {
        let reg = Registry::new();
        let peer_sessions = IntGaugeVec::new(
            Opts::new(
                "oab_peer_sessions",
                "Live sessions per configured peer (0 or 1).",
            ),
            &["peer"],
        )
        .expect("valid metric");
        reg.register(Box::new(peer_sessions.clone()))
            .expect("unique metric");
        for p in peers {
            peer_sessions.with_label_values(&[p.as_str()]).set(0);
        }
        let resync_seconds = Histogram::with_opts(
            HistogramOpts::new(
                "oab_resync_seconds",
                "Time a resynchronisation from the store took.",
            )
            .buckets(latency_buckets()),
        )
        .expect("valid metric");
        reg.register(Box::new(resync_seconds.clone()))
            .expect("unique metric");
        let ack_latency = Histogram::with_opts(
            HistogramOpts::new(
                "oab_ack_latency_seconds",
                "Time from receiving a log frame to queuing its ack (includes the durable append).",
            )
            .buckets(latency_buckets()),
        )
        .expect("valid metric");
        reg.register(Box::new(ack_latency.clone()))
            .expect("unique metric");
        let store_latency = HistogramVec::new(
            HistogramOpts::new("oab_store_latency_seconds", "Store operation latency.")
                .buckets(latency_buckets()),
            &["op"],
        )
        .expect("valid metric");
        reg.register(Box::new(store_latency.clone()))
            .expect("unique metric");
        let frames = counter_vec(
            &reg,
            "oab_frames_total",
            "Frames by type and direction.",
            &["type", "direction"],
        );
        let bytes = counter_vec(
            &reg,
            "oab_bytes_total",
            "Frame bytes by direction.",
            &["direction"],
        );
        let mut frames_in = vec![frames.with_label_values(&["unknown", "in"])];
        for t in 1..=u8::MAX {
            match oab_wire::FrameType::from_u8(t) {
                Some(ft) => frames_in.push(frames.with_label_values(&[ft.name(), "in"])),
                None => break,
            }
        }
        let hot = HotCounters {
            frames_in,
            data_out: frames.with_label_values(&["data", "out"]),
            bytes_in: bytes.with_label_values(&["in"]),
            bytes_out: bytes.with_label_values(&["out"]),
            append_latency: store_latency.with_label_values(&["append"]),
        };
        let m = Metrics {
            hot,
            sessions: gauge(&reg, "oab_sessions", "Authenticated sessions."),
            connections: gauge(&reg, "oab_connections", "Open connections in any phase."),
            handshakes: counter_vec(
                &reg,
                "oab_handshakes_total",
                "Session handshakes by result.",
                &["result"],
            ),
            frames,
            bytes,
            delegations_opened: counter(
                &reg,
                "oab_delegations_opened_total",
                "Delegations created.",
            ),
            terminals: counter_vec(
                &reg,
                "oab_terminals_total",
                "Terminal outcomes appended.",
                &["outcome"],
            ),
            replays: counter(&reg, "oab_replays_total", "Resume requests served."),
            replayed_frames: counter(
                &reg,
                "oab_replayed_frames_total",
                "Frames sent from the log by replays.",
            ),
            gaps: counter_vec(
                &reg,
                "oab_gaps_total",
                "Gap frames sent, by reason.",
                &["reason"],
            ),
            errors: counter_vec(
                &reg,
                "oab_errors_total",
                "Error frames sent, by code.",
                &["code"],
            ),
            disconnects: counter_vec(
                &reg,
                "oab_disconnects_total",
                "Session closes by reason.",
                &["reason"],
            ),
            sweeper_leader: gauge(
                &reg,
                "oab_sweeper_leader",
                "1 while this instance runs the fleet-wide lifecycle sweeps.",
            ),
            fleet_nodes: gauge(
                &reg,
                "oab_fleet_nodes",
                "Live relay instances sharing the store, as last seen.",
            ),
            wakes: counter_vec(
                &reg,
                "oab_wake_messages_total",
                "Wake-channel messages handled by this instance, by kind (and resync rounds).",
                &["kind"],
            ),
            resyncs: {
                let c = counter_vec(
                    &reg,
                    "oab_resyncs_total",
                    "Resynchronisations from the store, by cause.",
                    &["cause"],
                );
                for cause in ResyncCause::ALL {
                    c.with_label_values(&[cause.label()]);
                }
                c
            },
            replaced: counter(
                &reg,
                "oab_sessions_replaced_total",
                "Sessions replaced by a newer session of the same peer.",
            ),
            store_errors: counter_vec(
                &reg,
                "oab_store_errors_total",
                "Failed store operations.",
                &["op"],
            ),
            rate_limited: counter_vec(
                &reg,
                "oab_rate_limited_total",
                "Frames or connections refused by rate limits.",
                &["scope"],
            ),
            releases: counter_vec(
                &reg,
                "oab_releases_total",
                "Callers' releases of finished delegations, by result.",
                &["result"],
            ),
            refused: counter_vec(
                &reg,
                "oab_connections_refused_total",
                "Connections refused before the handshake.",
                &["reason"],
            ),
            peer_sessions,
            ack_latency,
            resync_seconds,
            store_latency,
            registry: reg,
        };
        m.zero_known_series();
        m
    }

    /// Creates every series of a fixed label set at 0, so each metric is on
    /// `/metrics` from the start: `rate()` and `increase()` then count an
    /// event that happens in a series' first scrape interval (a series that
    /// first appears at 1 has no earlier sample to differ from), alert rules
    /// and dashboards find every name, and a missing series means a missing
    /// relay rather than no events yet.
    fn zero_known_series(&self) {
        use oab_wire::{CloseCode, ErrorCode, GapReason, Outcome};
        for result in HANDSHAKE_RESULTS {
            self.handshakes.with_label_values(&[result]);
        }
        for outcome in Outcome::ALL {
            self.terminals.with_label_values(&[outcome.name()]);
        }
        for reason in (1..=u8::MAX).map_while(GapReason::from_u8) {
            self.gaps.with_label_values(&[reason.name()]);
        }
        for code in ErrorCode::ALL {
            self.errors.with_label_values(&[code.name()]);
        }
        for code in CloseCode::ALL {
            self.disconnects.with_label_values(&[code.name()]);
        }
        self.disconnects.with_label_values(&["transport"]);
        for kind in WAKE_KINDS {
            self.wakes.with_label_values(&[kind]);
        }
        for op in STORE_OPS {
            self.store_errors.with_label_values(&[op]);
        }
        for scope in RATE_LIMIT_SCOPES {
            self.rate_limited.with_label_values(&[scope]);
        }
        for reason in REFUSAL_REASONS {
            self.refused.with_label_values(&[reason]);
        }
    }

    /// The text exposition of every metric.
    pub fn render(&self) -> String {
        use prometheus::Encoder as _;
        let mut buf = Vec::new();
        let _ = prometheus::TextEncoder::new().encode(&self.registry.gather(), &mut buf);
        String::from_utf8(buf).unwrap_or_default()
    }
}

/// Why this instance re-reads the logs it serves from the store
/// (`oab_resyncs_total{cause}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResyncCause {
    /// A wake subscriber connection was lost and is back.
    SubscriberReconnected,
    /// A wake queue overflowed and dropped messages.
    WakeQueueOverflow,
    /// Another instance stopped renewing its liveness.
    InstanceLost,
    /// Another instance came back as a new process under the same name
    /// within its lease.
    InstanceRestarted,
    /// Another instance shut down cleanly.
    InstanceLeft,
}

impl ResyncCause {
    /// Every cause, for the metric's label values.
    pub const ALL: [ResyncCause; 5] = [
        ResyncCause::SubscriberReconnected,
        ResyncCause::WakeQueueOverflow,
        ResyncCause::InstanceLost,
        ResyncCause::InstanceRestarted,
        ResyncCause::InstanceLeft,
    ];

    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            ResyncCause::SubscriberReconnected => "subscriber_reconnected",
            ResyncCause::WakeQueueOverflow => "wake_queue_overflow",
            ResyncCause::InstanceLost => "instance_lost",
            ResyncCause::InstanceRestarted => "instance_restarted",
            ResyncCause::InstanceLeft => "instance_left",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_metrics_register_and_render() {
        let m = Metrics::new(&[oab_wire::PeerId::new("acme/a").unwrap()]);
        m.frames.with_label_values(&["data", "in"]).inc();
        let text = m.render();
        assert!(
            text.contains("oab_frames_total{direction=\"in\",type=\"data\"} 1"),
            "{text}"
        );
        assert!(text.contains("oab_peer_sessions{peer=\"acme/a\"} 0"));
    }

    #[test]
    fn every_metric_is_exported_before_its_first_event() {
        let text = Metrics::new(&[]).render();
        for family in [
            "oab_handshakes_total{result=\"auth_failed\"} 0",
            "oab_terminals_total{outcome=\"completed\"} 0",
            "oab_gaps_total{reason=\"trimmed\"} 0",
            "oab_errors_total{code=",
            "oab_disconnects_total{reason=\"slow_consumer\"} 0",
            "oab_disconnects_total{reason=\"transport\"} 0",
            "oab_store_errors_total{op=\"append\"} 0",
            "oab_rate_limited_total{scope=\"peer\"} 0",
            "oab_connections_refused_total{reason=\"max_handshakes\"} 0",
            "oab_store_latency_seconds_bucket{op=\"append\"",
            "oab_resyncs_total{cause=",
            "oab_wake_messages_total{kind=\"entry\"} 0",
        ] {
            assert!(text.contains(family), "{family} missing from:\n{text}");
        }
        // Only fixed label sets are zeroed: no series per peer or frame.
        let series = text.lines().filter(|l| !l.starts_with('#')).count();
        assert!(series < 400, "{series} series");
    }
}
