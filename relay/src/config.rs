//! The relay's configuration: one TOML file, validated strictly, every
//! value overridable by a flag or an environment variable (see `main.rs`).
//!
//! Unknown fields are errors (`deny_unknown_fields`), every default is named
//! here, and [`Config::validate`] reports every problem at once, each naming
//! its field (`routes[2].to: peer acme/x is not configured`).
//!
//! It also owns [`Directory`]: the peers' keys and the routes in lookup form,
//! which the handshake and the session consult.
//!
//! Never: opens a socket, touches the store or reads a key or certificate file:
//! it holds the peers' public keys and the paths of the TLS files (`tls.rs`
//! reads those). Never stops validating at the first bad field.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use oab_wire::identity::{PeerKey, TrustStore};
use oab_wire::{Limits, PeerId, RelayId};
use serde::{Deserialize, Serialize};

use crate::store::Retention;
use crate::store::redis::RedactedUrl;

/// The whole configuration file.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Listener, TLS and session settings.
    pub relay: RelaySection,
    /// Frame and resource limits.
    #[serde(default)]
    pub limits: LimitsSection,
    /// Rate limits.
    #[serde(default)]
    pub rate: RateSection,
    /// The durable store.
    #[serde(default)]
    pub store: StoreSection,
    /// Delegation lifecycle timers.
    #[serde(default)]
    pub lifecycle: LifecycleSection,
    /// Several instances over one Redis (or Redis Cluster).
    #[serde(default)]
    pub fleet: FleetSection,
    /// The peers allowed to connect. A peer not listed cannot connect.
    #[serde(default)]
    pub peers: Vec<PeerConfig>,
    /// Allowed `from -> to` routes. A route not listed cannot be used.
    #[serde(default)]
    pub routes: Vec<RouteConfig>,
}

/// How TLS reaches the relay.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum TlsMode {
    /// The relay terminates TLS 1.3 itself; handshakes are bound to the TLS
    /// session (RFC 9266 exporter).
    Terminate,
    /// A load balancer terminates TLS and forwards plain WebSocket traffic;
    /// handshakes are bound to the challenge only. Never expose this listener
    /// directly.
    BehindLoadBalancer,
}

/// `[relay]`
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RelaySection {
    /// The relay id signed into every handshake (e.g. its public host name).
    pub id: RelayId,
    /// Where connectors connect.
    #[serde(default = "default_listen")]
    pub listen: SocketAddr,
    /// Where `/metrics`, `/healthz` and `/readyz` are served (keep it private).
    #[serde(default = "default_admin_listen")]
    pub admin_listen: SocketAddr,
    /// How TLS reaches the relay.
    #[serde(default = "default_tls_mode")]
    pub tls_mode: TlsMode,
    /// PEM certificate chain (required with `tls_mode = "terminate"`).
    #[serde(default)]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key (required with `tls_mode = "terminate"`).
    #[serde(default)]
    pub tls_key: Option<PathBuf>,
    /// Interval at which connectors should ping when idle, ms.
    #[serde(default = "default_heartbeat_ms")]
    pub heartbeat_ms: u32,
    /// A session with no frame for this long is closed (`idle_timeout`), ms.
    #[serde(default = "default_idle_timeout_ms")]
    pub idle_timeout_ms: u64,
    /// Deadline for TLS + WebSocket upgrade + session handshake, ms.
    #[serde(default = "default_handshake_timeout_ms")]
    pub handshake_timeout_ms: u64,
    /// Largest accepted clock difference in a hello, ms.
    #[serde(default = "default_max_clock_skew_ms")]
    pub max_clock_skew_ms: u64,
    /// Cap on open connections (handshaking or authenticated); beyond it new
    /// connections are closed at once.
    #[serde(default = "default_max_connections")]
    pub max_connections: usize,
    /// Cap on connections in the handshake phase at once (from accept until
    /// the `Welcome` is written); beyond it new connections are closed at once.
    #[serde(default = "default_max_handshakes")]
    pub max_handshakes: usize,
    /// Of `max_handshakes`, how many one source (`source_prefix_v4` /
    /// `source_prefix_v6`) may hold at once; beyond it that source's new
    /// connections are closed at once, so it takes
    /// `max_handshakes / max_handshakes_per_source` sources to hold every
    /// slot. Raise it for many connectors behind one NAT address that all
    /// reconnect at once (they retry with backoff meanwhile).
    #[serde(default = "default_max_handshakes_per_source")]
    pub max_handshakes_per_source: usize,
    /// Prefix length an IPv4 client address is cut to for
    /// `max_handshakes_per_source` and `rate.connects_*_per_ip` (32: each
    /// address is its own source).
    #[serde(default = "default_source_prefix_v4")]
    pub source_prefix_v4: u8,
    /// Prefix length an IPv6 client address is cut to (64: one host usually
    /// holds a whole /64, so its addresses count as one source).
    #[serde(default = "default_source_prefix_v6")]
    pub source_prefix_v6: u8,
    /// Idle time before the kernel sends TCP keepalive probes on an accepted
    /// connection (then one every third of it, 3 probes), ms; 0 leaves
    /// keepalive off. Detects a peer gone behind a half-open link while the
    /// session writes nothing.
    #[serde(default = "default_tcp_keepalive_ms")]
    pub tcp_keepalive_ms: u64,
    /// `TCP_USER_TIMEOUT` on accepted connections: how long written data
    /// (or keepalive probes) may stay unacknowledged before the kernel
    /// closes the connection, ms; 0 leaves the kernel default (about 15 min
    /// of retransmissions).
    #[serde(default = "default_tcp_user_timeout_ms")]
    pub tcp_user_timeout_ms: u64,
    /// On shutdown, how long sessions get to drain before being cut, ms.
    #[serde(default = "default_drain_timeout_ms")]
    pub drain_timeout_ms: u64,
    /// Reconnect hint sent in `Drain`, ms.
    #[serde(default = "default_reconnect_hint_ms")]
    pub reconnect_hint_ms: u32,
    /// PROXY protocol headers from load balancers (off by default).
    #[serde(default)]
    pub proxy_protocol: crate::proxy_protocol::ProxyProtocol,
}

/// `[limits]`
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitsSection {
    /// Maximum frame header, bytes.
    #[serde(default = "default_max_header")]
    pub max_header: u16,
    /// Maximum frame payload, bytes (a route may set less).
    #[serde(default = "default_max_payload")]
    pub max_payload: u32,
    /// Unacknowledged frames a connector may have in flight per delegation
    /// direction (published in the welcome; frames beyond are a hole).
    #[serde(default = "default_max_in_flight")]
    pub max_in_flight: u32,
    /// Delegation frames queued towards one session. Overflow policy: a live
    /// frame that does not fit is delivered from the log instead, at the
    /// receiver's pace (nothing is dropped); see `slow_consumer_ms`.
    #[serde(default = "default_session_queue")]
    pub session_queue: usize,
    /// Bytes queued towards one session, both queues together (control
    /// and delegation frames). Overflow policy: as for `session_queue`, a
    /// live delegation frame over the budget is delivered from the log
    /// instead; control frames (acks, errors, peer lists) keep
    /// one largest frame plus `outbox::CONTROL_HEADROOM_BYTES` of it, and a
    /// control frame over the whole budget closes the session with
    /// `slow_consumer` (4001). At least two largest frames plus that
    /// headroom.
    #[serde(default = "default_session_queue_bytes")]
    pub session_queue_bytes: usize,
    /// A session with queued frames that takes none of them for this long is
    /// closed with `slow_consumer` (4001), and so is one whose socket takes
    /// no bytes of a pending write for this long; it resumes from its cursor
    /// later, ms. The clock runs only while something waits to be written.
    #[serde(default = "default_slow_consumer_ms")]
    pub slow_consumer_ms: u64,
    /// Append batches one session keeps in flight to the store at once
    /// (1 to [`MAX_APPEND_BATCHES_IN_FLIGHT`]): the next batch of a peer's
    /// frames is handed to the store while earlier ones are still being
    /// made durable, and their acks and deliveries are released strictly
    /// in order. Overflow policy: back-pressure; with this many in flight
    /// the session reads nothing more from the peer until the oldest is
    /// answered. A failed batch fails every later one already in flight
    /// (none of them is acknowledged).
    #[serde(default = "default_append_batches_in_flight")]
    pub append_batches_in_flight: usize,
    /// Open (non-terminal) delegations per caller peer.
    #[serde(default = "default_max_open_per_peer")]
    pub max_open_per_peer: u32,
    /// Largest descriptor (agent card) a peer may publish, bytes.
    #[serde(default = "default_max_descriptor")]
    pub max_descriptor: usize,
}

/// `[rate]`
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RateSection {
    /// Frames per second one authenticated peer may send (sustained).
    #[serde(default = "default_peer_fps")]
    pub peer_frames_per_second: u32,
    /// Burst above the sustained rate.
    #[serde(default = "default_peer_burst")]
    pub peer_frames_burst: u32,
    /// New connections per second from one source (the address cut to
    /// `relay.source_prefix_v4` / `source_prefix_v6`), before auth.
    #[serde(default = "default_ip_cps")]
    pub connects_per_second_per_ip: u32,
    /// Burst of new connections per source.
    #[serde(default = "default_ip_burst")]
    pub connects_burst_per_ip: u32,
    /// Requests per second one peer may make besides log frames
    /// (sustained), in cost units: a `Resume` costs 1 (a meta read and a
    /// replay), a `PeersQuery` or a `Publish` costs 10 (a read or write per
    /// reachable peer and a `Peers` snapshot to each receiver). A request
    /// over the limit is refused with `rate_limited`; the peer asks again
    /// later.
    #[serde(default = "default_peer_requests_per_second")]
    pub peer_requests_per_second: u32,
    /// Burst of requests above the sustained rate, in cost units. The
    /// default lets a reconnecting peer resume `limits.max_open_per_peer`
    /// delegations at once.
    #[serde(default = "default_peer_requests_burst")]
    pub peer_requests_burst: u32,
}

/// `[store]`. `Debug` shows `url` with its password replaced by `***`.
#[derive(Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StoreSection {
    /// `memory` (default: one process, lost on restart) or a Redis URL
    /// (`redis://host:6379/`, `redis+unix:///path/redis.sock`).
    #[serde(default = "default_store_url")]
    pub url: String,
    /// Entries kept per delegation log; older entries are trimmed and a
    /// reader asking for them gets a `Gap`.
    #[serde(default = "default_max_log_entries")]
    pub max_log_entries: u64,
    /// How long a finished delegation stays readable after its terminal, ms.
    #[serde(default = "default_finished_ttl_ms")]
    pub finished_ttl_ms: u64,
    /// Bytes one delegation's two logs may hold (the `Open` included;
    /// trimmed entries no longer count). A `Data` or `Cancel` that would pass
    /// it is refused with `payload_too_large` and not stored. Default 128 MiB.
    #[serde(default = "default_max_delegation_bytes")]
    pub max_delegation_bytes: u64,
    /// Bytes one peer may hold in its open delegations: its `Data` and
    /// `Cancel` entries, less trimmed ones (a delegation's bytes leave the
    /// budget when it finishes). An entry that would pass it is refused
    /// with `payload_too_large` and not stored. Default 512 MiB.
    #[serde(default = "default_max_peer_bytes")]
    pub max_peer_bytes: u64,
    /// Callers' releases of finished delegations waiting for the store, per
    /// instance (about 100 bytes each). Overflow: a release is dropped
    /// (`oab_releases_total{result="dropped"}`) and its delegation is kept
    /// whole until `finished_ttl_ms`. Default 65,536.
    #[serde(default = "default_release_queue")]
    pub release_queue: usize,
}

impl std::fmt::Debug for StoreSection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let Self {
            url,
            max_log_entries,
            finished_ttl_ms,
            max_delegation_bytes,
            max_peer_bytes,
            release_queue,
        } = self;
        f.debug_struct("StoreSection")
            .field("url", &RedactedUrl(url))
            .field("max_log_entries", max_log_entries)
            .field("finished_ttl_ms", finished_ttl_ms)
            .field("max_delegation_bytes", max_delegation_bytes)
            .field("max_peer_bytes", max_peer_bytes)
            .field("release_queue", release_queue)
            .finish()
    }
}

/// `[lifecycle]`
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LifecycleSection {
    /// A callee that accepted work and stays away this long gets its open
    /// delegations closed as `unknown`, ms.
    #[serde(default = "default_unknown_grace_ms")]
    pub unknown_grace_ms: u64,
    /// How often deadlines and retention are swept, ms.
    #[serde(default = "default_sweep_interval_ms")]
    pub sweep_interval_ms: u64,
}

/// `[fleet]`: several relay instances sharing one Redis store. Ignored with
/// the memory store (one instance).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FleetSection {
    /// This instance's name in presence records and logs (letters, digits,
    /// `-`, `_`, `.`; at most 64). Default: a random id per process.
    #[serde(default)]
    pub node: Option<String>,
    /// An instance whose liveness record is not renewed for this long is
    /// gone: its sessions count as offline fleet-wide (renewed every third
    /// of it), ms.
    #[serde(default = "default_node_lease_ms")]
    pub node_lease_ms: u64,
    /// The fleet-wide sweeper lease: deadlines, `unknown` after the grace
    /// period and retention run on the one instance holding it; another
    /// instance takes over this long after the holder died, ms.
    #[serde(default = "default_sweeper_lease_ms")]
    pub sweeper_lease_ms: u64,
    /// Wake-up messages from Redis queued towards this instance. Overflow
    /// policy: further messages are dropped and the instance resynchronises
    /// every subscribed log from the store (nothing is lost, delivery is
    /// late).
    #[serde(default = "default_wake_queue")]
    pub wake_queue: usize,
}

/// `[[peers]]`
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PeerConfig {
    /// The peer id.
    pub id: PeerId,
    /// Its public keys (two during a rotation).
    pub keys: Vec<PeerKey>,
}

/// `[[routes]]`
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteConfig {
    /// The caller.
    pub from: PeerId,
    /// The callee.
    pub to: PeerId,
    /// Open delegations on this route at once.
    #[serde(default = "default_route_max_open")]
    pub max_open: u32,
    /// Largest payload on this route (at most `limits.max_payload`).
    #[serde(default)]
    pub max_payload: Option<u32>,
    /// Longest deadline a caller may ask for, ms from now.
    #[serde(default = "default_route_max_deadline_ms")]
    pub max_deadline_ms: u64,
    /// Deepest delegation depth allowed (1: no re-delegation).
    #[serde(default = "default_route_max_depth")]
    pub max_depth: u8,
    /// Capability ceiling stamped on forwarded opens (empty: none stated).
    #[serde(default)]
    pub ceiling: Vec<String>,
}

fn default_listen() -> SocketAddr {
    SocketAddr::from(([0, 0, 0, 0], 7443))
}
fn default_admin_listen() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 9443))
}
fn default_tls_mode() -> TlsMode {
    TlsMode::Terminate
}
/// Connectors ping every 15 s when idle: well under common load balancer
/// idle timeouts (60 s), cheap at thousands of sessions.
fn default_heartbeat_ms() -> u32 {
    15_000
}
/// Three missed heartbeats.
fn default_idle_timeout_ms() -> u64 {
    45_000
}
fn default_handshake_timeout_ms() -> u64 {
    10_000
}
fn default_max_clock_skew_ms() -> u64 {
    60_000
}
fn default_max_connections() -> usize {
    20_000
}
fn default_max_handshakes() -> usize {
    512
}
/// One source may hold 1/16 of the default 512 handshake slots.
fn default_max_handshakes_per_source() -> usize {
    32
}
fn default_source_prefix_v4() -> u8 {
    32
}
fn default_source_prefix_v6() -> u8 {
    64
}
/// Half the idle timeout: a silent dead peer is found by the kernel in
/// about 30 s + 3 probes 10 s apart.
fn default_tcp_keepalive_ms() -> u64 {
    30_000
}
/// A minute of unacknowledged writes: well above any round trip, below the
/// kernel's default of about 15 minutes of retransmissions.
fn default_tcp_user_timeout_ms() -> u64 {
    60_000
}
fn default_drain_timeout_ms() -> u64 {
    10_000
}
fn default_reconnect_hint_ms() -> u32 {
    1_000
}
fn default_max_header() -> u16 {
    oab_wire::limits::DEFAULT_MAX_HEADER
}
fn default_max_payload() -> u32 {
    oab_wire::limits::DEFAULT_MAX_PAYLOAD
}
fn default_max_in_flight() -> u32 {
    1_024
}
/// 1,024 frames: at 256 B a frame about 256 KiB per session at worst.
fn default_session_queue() -> usize {
    1_024
}
fn default_session_queue_bytes() -> usize {
    16 * 1024 * 1024
}
/// Most [`LimitsSection::append_batches_in_flight`] may be: each batch in
/// flight reserves room for one reply per frame in the session's control
/// lane (see `session::control_capacity`).
pub const MAX_APPEND_BATCHES_IN_FLIGHT: usize = 16;
/// Four batches: the next batches of a peer's frames go to the store while
/// earlier ones are made durable (BENCHMARKS.md, "Append batches in
/// flight", for the measured gain). A batch that overtakes an earlier one
/// in the store is answered at what the session acknowledged, so the peer
/// resends it (see `session::OverlapAcks`).
fn default_append_batches_in_flight() -> usize {
    4
}
fn default_slow_consumer_ms() -> u64 {
    10_000
}
fn default_max_open_per_peer() -> u32 {
    10_000
}
fn default_max_descriptor() -> usize {
    64 * 1024
}
fn default_peer_fps() -> u32 {
    200_000
}
fn default_peer_burst() -> u32 {
    400_000
}
fn default_ip_cps() -> u32 {
    50
}
fn default_ip_burst() -> u32 {
    200
}
fn default_peer_requests_per_second() -> u32 {
    1_000
}
fn default_peer_requests_burst() -> u32 {
    10_000
}
fn default_store_url() -> String {
    "memory".to_string()
}
fn default_max_log_entries() -> u64 {
    Retention::default().max_log_entries
}
fn default_finished_ttl_ms() -> u64 {
    Retention::default().finished_ttl_ms
}
fn default_max_delegation_bytes() -> u64 {
    Retention::default().max_delegation_bytes
}
fn default_max_peer_bytes() -> u64 {
    Retention::default().max_peer_bytes
}
/// Default `store.release_queue`: releases waiting for the store, at most
/// (about 100 bytes each).
pub const DEFAULT_RELEASE_QUEUE: usize = 65_536;
fn default_release_queue() -> usize {
    DEFAULT_RELEASE_QUEUE
}
fn default_unknown_grace_ms() -> u64 {
    120_000
}
fn default_sweep_interval_ms() -> u64 {
    250
}
fn default_node_lease_ms() -> u64 {
    10_000
}
fn default_sweeper_lease_ms() -> u64 {
    10_000
}
fn default_wake_queue() -> usize {
    65_536
}
fn default_route_max_open() -> u32 {
    1_000
}
fn default_route_max_deadline_ms() -> u64 {
    24 * 3600 * 1000
}
fn default_route_max_depth() -> u8 {
    1
}

macro_rules! section_default {
    ($ty:ident { $($field:ident: $f:ident),* $(,)? }) => {
        impl Default for $ty {
            fn default() -> Self {
                $ty { $($field: $f()),* }
            }
        }
    };
}

section_default!(LimitsSection {
    max_header: default_max_header,
    max_payload: default_max_payload,
    max_in_flight: default_max_in_flight,
    session_queue: default_session_queue,
    session_queue_bytes: default_session_queue_bytes,
    slow_consumer_ms: default_slow_consumer_ms,
    append_batches_in_flight: default_append_batches_in_flight,
    max_open_per_peer: default_max_open_per_peer,
    max_descriptor: default_max_descriptor,
});
section_default!(RateSection {
    peer_frames_per_second: default_peer_fps,
    peer_frames_burst: default_peer_burst,
    connects_per_second_per_ip: default_ip_cps,
    connects_burst_per_ip: default_ip_burst,
    peer_requests_per_second: default_peer_requests_per_second,
    peer_requests_burst: default_peer_requests_burst,
});
section_default!(StoreSection {
    url: default_store_url,
    max_log_entries: default_max_log_entries,
    finished_ttl_ms: default_finished_ttl_ms,
    max_delegation_bytes: default_max_delegation_bytes,
    max_peer_bytes: default_max_peer_bytes,
    release_queue: default_release_queue,
});
impl Default for FleetSection {
    fn default() -> Self {
        FleetSection {
            node: None,
            node_lease_ms: default_node_lease_ms(),
            sweeper_lease_ms: default_sweeper_lease_ms(),
            wake_queue: default_wake_queue(),
        }
    }
}
section_default!(LifecycleSection {
    unknown_grace_ms: default_unknown_grace_ms,
    sweep_interval_ms: default_sweep_interval_ms,
});

/// A configuration problem, naming its field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldError {
    /// Dotted path of the field (`routes[1].to`).
    pub field: String,
    /// What is wrong.
    pub message: String,
    /// Its line in the file, when known.
    pub line: Option<usize>,
}

impl std::fmt::Display for FieldError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.line {
            Some(line) => write!(f, "{} (line {line}): {}", self.field, self.message),
            None if self.field.is_empty() => write!(f, "{}", self.message),
            None => write!(f, "{}: {}", self.field, self.message),
        }
    }
}

impl From<oab_ops::config_check::Problem> for FieldError {
    fn from(p: oab_ops::config_check::Problem) -> Self {
        match (p.field.is_empty(), p.line) {
            // A syntax error: its line is its field.
            (true, Some(line)) => FieldError {
                field: format!("line {line}"),
                message: p.message,
                line: None,
            },
            _ => FieldError {
                field: p.field,
                message: p.message,
                line: p.line,
            },
        }
    }
}

/// Why a configuration could not be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read {path}: {error}")]
    Read {
        /// The file.
        path: String,
        /// The I/O error.
        error: std::io::Error,
    },
    /// The file is not valid TOML for this schema.
    #[error("{path}: {message}")]
    Parse {
        /// The file.
        path: String,
        /// The parser's message (it names the line and the field).
        message: String,
    },
    /// The values are inconsistent.
    #[error("{path}: {} problem(s):\n{}", .errors.len(), .errors.iter().map(|e| format!("  - {e}")).collect::<Vec<_>>().join("\n"))]
    Invalid {
        /// The file.
        path: String,
        /// Every problem found.
        errors: Vec<FieldError>,
    },
}

pub use oab_ops::overrides::apply_override;

/// Collects overrides from the environment: `OAB_RELAY__SECTION__FIELD=value`
/// sets `section.field` (double underscores separate the path); see
/// [`oab_ops::overrides::env_overrides`].
pub fn env_overrides() -> Vec<(String, String)> {
    oab_ops::overrides::env_overrides(ENV_PREFIX)
}

/// The prefix of the relay's environment overrides.
pub const ENV_PREFIX: &str = "OAB_RELAY__";

impl Config {
    /// Parses TOML text with `key=value` overrides applied, then validates;
    /// every problem of the file is listed, each with its field and line
    /// ([`oab_ops::config_check`]): a field name that is not one, a value
    /// that does not read, and what [`Config::validate`] finds in the rest.
    pub fn from_toml_with_overrides(
        text: &str,
        origin: &str,
        overrides: &[(String, String)],
    ) -> Result<Config, ConfigError> {
        let checked = oab_ops::config_check::Checked::<Config>::read(text, overrides);
        let invalid = match &checked.value {
            Some(config) => config.validate().err().unwrap_or_default(),
            None => Vec::new(),
        };
        let errors: Vec<FieldError> = checked
            .all_problems(invalid.into_iter().map(|e| (e.field, e.message)))
            .into_iter()
            .map(FieldError::from)
            .collect();
        match checked.value {
            Some(config) if errors.is_empty() => Ok(config),
            _ => Err(ConfigError::Invalid {
                path: origin.to_string(),
                errors,
            }),
        }
    }

    /// Parses TOML text (`origin` names it in errors) without validating.
    pub fn parse(text: &str, origin: &str) -> Result<Config, ConfigError> {
        toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: origin.to_string(),
            message: e.to_string(),
        })
    }

    /// Reads, parses and validates a file.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|error| ConfigError::Read {
            path: shown.clone(),
            error,
        })?;
        Config::from_toml_with_overrides(&text, &shown, &[])
    }

    /// Checks every value; returns every problem found.
    pub fn validate(&self) -> Result<(), Vec<FieldError>> {
        let mut errors = Vec::new();
        let mut err = |field: String, message: String| {
            errors.push(FieldError {
                field,
                message,
                line: None,
            })
        };
        let r = &self.relay;
        if r.tls_mode == TlsMode::Terminate {
            if r.tls_cert.is_none() {
                err(
                    "relay.tls_cert".into(),
                    "required when tls_mode = \"terminate\"".into(),
                );
            }
            if r.tls_key.is_none() {
                err(
                    "relay.tls_key".into(),
                    "required when tls_mode = \"terminate\"".into(),
                );
            }
        }
        if r.listen == r.admin_listen {
            err(
                "relay.admin_listen".into(),
                "must differ from relay.listen".into(),
            );
        }
        if r.heartbeat_ms == 0 {
            err("relay.heartbeat_ms".into(), "must be greater than 0".into());
        }
        if r.idle_timeout_ms <= u64::from(r.heartbeat_ms) {
            err(
                "relay.idle_timeout_ms".into(),
                format!(
                    "must be greater than relay.heartbeat_ms ({})",
                    r.heartbeat_ms
                ),
            );
        }
        for (name, v) in [
            ("relay.handshake_timeout_ms", r.handshake_timeout_ms),
            ("relay.drain_timeout_ms", r.drain_timeout_ms),
        ] {
            if v == 0 {
                err(name.into(), "must be greater than 0".into());
            }
        }
        for (name, v) in [
            ("relay.max_connections", r.max_connections),
            ("relay.max_handshakes", r.max_handshakes),
            (
                "relay.max_handshakes_per_source",
                r.max_handshakes_per_source,
            ),
            ("limits.session_queue", self.limits.session_queue),
        ] {
            if v == 0 {
                err(name.into(), "must be greater than 0".into());
            }
        }
        for (field, message) in r.proxy_protocol.problems() {
            err(field, message);
        }
        if r.source_prefix_v4 > 32 {
            err("relay.source_prefix_v4".into(), "must be at most 32".into());
        }
        if r.source_prefix_v6 > 128 {
            err(
                "relay.source_prefix_v6".into(),
                "must be at most 128".into(),
            );
        }
        if let Err(m) = self.wire_limits().validate() {
            let field = if m.starts_with("max_header") {
                "limits.max_header"
            } else {
                "limits.max_payload"
            };
            err(field.into(), m);
        }
        let max_frame = self.wire_limits().max_frame();
        let least = 2 * max_frame + crate::outbox::CONTROL_HEADROOM_BYTES;
        if self.limits.session_queue_bytes < least {
            err(
                "limits.session_queue_bytes".into(),
                format!(
                    "must be at least {least} bytes: one largest frame for delegation frames, \
                     one more and {} for control frames",
                    crate::outbox::CONTROL_HEADROOM_BYTES
                ),
            );
        }
        if !(1..=MAX_APPEND_BATCHES_IN_FLIGHT).contains(&self.limits.append_batches_in_flight) {
            err(
                "limits.append_batches_in_flight".into(),
                format!("must be from 1 to {MAX_APPEND_BATCHES_IN_FLIGHT}"),
            );
        }
        if self.limits.max_in_flight == 0 {
            err(
                "limits.max_in_flight".into(),
                "must be greater than 0".into(),
            );
        }
        if self.limits.max_open_per_peer == 0 {
            err(
                "limits.max_open_per_peer".into(),
                "must be greater than 0".into(),
            );
        }
        for (name, v) in [
            (
                "rate.peer_frames_per_second",
                self.rate.peer_frames_per_second,
            ),
            ("rate.peer_frames_burst", self.rate.peer_frames_burst),
            (
                "rate.connects_per_second_per_ip",
                self.rate.connects_per_second_per_ip,
            ),
            (
                "rate.connects_burst_per_ip",
                self.rate.connects_burst_per_ip,
            ),
            (
                "rate.peer_requests_per_second",
                self.rate.peer_requests_per_second,
            ),
            ("rate.peer_requests_burst", self.rate.peer_requests_burst),
        ] {
            if v == 0 {
                err(name.into(), "must be greater than 0".into());
            }
        }
        let url = &self.store.url;
        if url != "memory"
            && !url.starts_with("redis://")
            && !url.starts_with("rediss://")
            && !url.starts_with("redis+unix://")
            && !url.starts_with("unix://")
            && !url.starts_with("redis-cluster://")
        {
            err(
                "store.url".into(),
                "must be \"memory\", a redis://, rediss:// or redis+unix:// URL, or \
                 redis-cluster://host:port,host:port,..."
                    .into(),
            );
        }
        let f = &self.fleet;
        if let Some(node) = &f.node
            && (node.is_empty()
                || node.len() > 64
                || !node
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b)))
        {
            err(
                "fleet.node".into(),
                "1 to 64 letters, digits, '-', '_' or '.'".into(),
            );
        }
        for (name, v) in [
            ("fleet.node_lease_ms", f.node_lease_ms),
            ("fleet.sweeper_lease_ms", f.sweeper_lease_ms),
        ] {
            if v < 300 {
                err(name.into(), "must be at least 300".into());
            }
        }
        if f.wake_queue == 0 {
            err("fleet.wake_queue".into(), "must be greater than 0".into());
        }
        if self.store.release_queue == 0 {
            err(
                "store.release_queue".into(),
                "must be greater than 0".into(),
            );
        }
        for (name, v) in [
            ("store.max_log_entries", self.store.max_log_entries),
            (
                "store.max_delegation_bytes",
                self.store.max_delegation_bytes,
            ),
            ("store.max_peer_bytes", self.store.max_peer_bytes),
        ] {
            if v == 0 {
                err(name.into(), "must be greater than 0".into());
            }
        }
        if self.lifecycle.sweep_interval_ms == 0 {
            err(
                "lifecycle.sweep_interval_ms".into(),
                "must be greater than 0".into(),
            );
        }
        let mut seen = HashSet::new();
        for (i, p) in self.peers.iter().enumerate() {
            if !seen.insert(&p.id) {
                err(
                    format!("peers[{i}].id"),
                    format!("peer {} is listed twice", p.id),
                );
            }
            if p.keys.is_empty() {
                err(
                    format!("peers[{i}].keys"),
                    "at least one key is required".into(),
                );
            }
            let mut key_ids = HashSet::new();
            for (j, k) in p.keys.iter().enumerate() {
                if !key_ids.insert(&k.key_id) {
                    err(
                        format!("peers[{i}].keys[{j}].key_id"),
                        format!("key id {} is listed twice", k.key_id),
                    );
                }
                if let (Some(nb), Some(na)) = (k.not_before_ms, k.not_after_ms)
                    && nb > na
                {
                    err(
                        format!("peers[{i}].keys[{j}].not_after_ms"),
                        "is before not_before_ms".into(),
                    );
                }
            }
        }
        let mut route_seen = HashSet::new();
        for (i, route) in self.routes.iter().enumerate() {
            for (field, peer) in [("from", &route.from), ("to", &route.to)] {
                if !seen.contains(peer) {
                    err(
                        format!("routes[{i}].{field}"),
                        format!("peer {peer} is not configured in [[peers]]"),
                    );
                }
            }
            if route.from == route.to {
                err(
                    format!("routes[{i}].to"),
                    "a peer cannot delegate to itself".into(),
                );
            }
            if !route_seen.insert((&route.from, &route.to)) {
                err(
                    format!("routes[{i}]"),
                    format!("route {} -> {} is listed twice", route.from, route.to),
                );
            }
            if route.max_open == 0 {
                err(
                    format!("routes[{i}].max_open"),
                    "must be greater than 0".into(),
                );
            }
            if let Some(mp) = route.max_payload
                && (mp == 0 || mp > self.limits.max_payload)
            {
                err(
                    format!("routes[{i}].max_payload"),
                    format!(
                        "must be between 1 and limits.max_payload ({})",
                        self.limits.max_payload
                    ),
                );
            }
            if route.max_deadline_ms == 0 {
                err(
                    format!("routes[{i}].max_deadline_ms"),
                    "must be greater than 0".into(),
                );
            }
            if route.max_depth == 0 {
                err(
                    format!("routes[{i}].max_depth"),
                    "must be at least 1".into(),
                );
            }
            let ceiling_len = route.ceiling.iter().map(|c| c.len() + 1).sum::<usize>();
            let room = usize::from(self.limits.max_header)
                .saturating_sub(oab_wire::limits::OPEN_HEADER_WITHOUT_CEILING);
            if ceiling_len > room {
                err(
                    format!("routes[{i}].ceiling"),
                    format!(
                        "{ceiling_len} bytes of capability names do not fit in a stamped open \
                         (limits.max_header leaves {room}); raise limits.max_header or shorten the list"
                    ),
                );
            }
            for (j, c) in route.ceiling.iter().enumerate() {
                // A name, or a prefix pattern ending in `:*` (`read:*`).
                let name = c.strip_suffix(":*").unwrap_or(c);
                let ok = !name.is_empty()
                    && name.bytes().all(|b| {
                        b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-' | b':' | b'/')
                    });
                if !ok {
                    err(
                        format!("routes[{i}].ceiling[{j}]"),
                        "capability names use A-Z a-z 0-9 . _ - : / only, optionally ending in :*"
                            .into(),
                    );
                }
            }
        }
        if errors.is_empty() {
            Ok(())
        } else {
            Err(errors)
        }
    }

    /// The frame limits the relay enforces.
    pub fn wire_limits(&self) -> Limits {
        Limits {
            max_header: self.limits.max_header,
            max_payload: self.limits.max_payload,
        }
    }

    /// Retention for the store.
    pub fn retention(&self) -> Retention {
        Retention {
            max_log_entries: self.store.max_log_entries,
            finished_ttl_ms: self.store.finished_ttl_ms,
            max_delegation_bytes: self.store.max_delegation_bytes,
            max_peer_bytes: self.store.max_peer_bytes,
        }
    }
}

/// The peers and routes in lookup form.
#[derive(Debug, Clone, Default)]
pub struct Directory {
    keys: HashMap<PeerId, Vec<PeerKey>>,
    routes: HashMap<(PeerId, PeerId), RouteConfig>,
    /// Every configured peer, in config order (stable metric labels).
    pub peers: Vec<PeerId>,
}

impl Directory {
    /// Builds the lookup tables from a validated config.
    pub fn new(config: &Config) -> Self {
        Directory {
            keys: config
                .peers
                .iter()
                .map(|p| (p.id.clone(), p.keys.clone()))
                .collect(),
            routes: config
                .routes
                .iter()
                .map(|r| ((r.from.clone(), r.to.clone()), r.clone()))
                .collect(),
            peers: config.peers.iter().map(|p| p.id.clone()).collect(),
        }
    }

    /// The route from `from` to `to`, if configured.
    pub fn route(&self, from: &PeerId, to: &PeerId) -> Option<&RouteConfig> {
        self.routes.get(&(from.clone(), to.clone()))
    }

    /// Every route as `(from, to)`, in no particular order.
    pub fn route_list(&self) -> Vec<(PeerId, PeerId)> {
        self.routes.keys().cloned().collect()
    }

    /// Whether `peer` is configured.
    pub fn is_peer(&self, peer: &PeerId) -> bool {
        self.keys.contains_key(peer)
    }

    /// Peers `from` may delegate to.
    pub fn reachable_from(&self, from: &PeerId) -> Vec<PeerId> {
        let mut v: Vec<PeerId> = self
            .routes
            .keys()
            .filter(|(f, _)| f == from)
            .map(|(_, t)| t.clone())
            .collect();
        v.sort();
        v
    }

    /// Peers that may delegate to `to`.
    pub fn callers_of(&self, to: &PeerId) -> Vec<PeerId> {
        let mut v: Vec<PeerId> = self
            .routes
            .keys()
            .filter(|(_, t)| t == to)
            .map(|(f, _)| f.clone())
            .collect();
        v.sort();
        v
    }
}

impl TrustStore for Directory {
    fn peer_keys(&self, peer: &PeerId) -> Option<&[PeerKey]> {
        self.keys.get(peer).map(Vec::as_slice)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINIMAL: &str = r#"
[relay]
id = "relay.test"
tls_cert = "cert.pem"
tls_key = "key.pem"
"#;

    #[test]
    fn minimal_config_gets_named_defaults() {
        let c = Config::parse(MINIMAL, "t").unwrap();
        c.validate().unwrap();
        assert_eq!(c.store.url, "memory");
        assert_eq!(c.relay.heartbeat_ms, 15_000);
        assert_eq!(c.limits.max_payload, 1024 * 1024);
    }

    #[test]
    fn overrides_set_typed_values_by_path() {
        let overrides = vec![
            ("relay.heartbeat_ms".to_string(), "250".to_string()),
            ("store.url".to_string(), "redis://127.0.0.1:1/".to_string()),
        ];
        let c = Config::from_toml_with_overrides(MINIMAL, "t", &overrides).unwrap();
        assert_eq!(c.relay.heartbeat_ms, 250);
        assert_eq!(c.store.url, "redis://127.0.0.1:1/");
        let bad = vec![("relay.heartbeat_ms".to_string(), "0".to_string())];
        let e = Config::from_toml_with_overrides(MINIMAL, "t", &bad).unwrap_err();
        assert!(e.to_string().contains("relay.heartbeat_ms"), "{e}");
    }

    #[test]
    fn debug_of_a_config_shows_no_store_password() {
        for url in [
            "redis://:hunter2@127.0.0.1:6379/",
            "redis-cluster://user:hunter2@h1:7001,h2:7002",
        ] {
            let overrides = vec![("store.url".to_string(), url.to_string())];
            let c = Config::from_toml_with_overrides(MINIMAL, "t", &overrides).unwrap();
            assert_eq!(c.store.url, url);
            let shown = format!("{c:?}");
            assert!(!shown.contains("hunter2"), "{shown}");
            let host = if url.contains("h1") {
                "h1:7001,h2:7002"
            } else {
                "127.0.0.1:6379"
            };
            assert!(shown.contains(host), "{shown}");
            assert!(format!("{c:#?}").contains("max_log_entries"));
        }
    }

    #[test]
    fn unknown_fields_are_refused_with_their_name() {
        let text = format!("{MINIMAL}\n[limits]\nmax_paylod = 3\n");
        let e = Config::parse(&text, "t").unwrap_err().to_string();
        assert!(e.contains("max_paylod"), "{e}");
    }

    #[test]
    fn validation_names_every_bad_field() {
        let text = r#"
[relay]
id = "relay.test"
heartbeat_ms = 0
[store]
url = "postgres://x"
[[peers]]
id = "acme/a"
keys = []
[[routes]]
from = "acme/a"
to = "acme/zz"
max_depth = 0
ceiling = ["ok", "bad name"]
"#;
        let c = Config::parse(text, "t").unwrap();
        let errs = c.validate().unwrap_err();
        let fields: Vec<&str> = errs.iter().map(|e| e.field.as_str()).collect();
        for f in [
            "relay.tls_cert",
            "relay.tls_key",
            "relay.heartbeat_ms",
            "store.url",
            "peers[0].keys",
            "routes[0].to",
            "routes[0].max_depth",
            "routes[0].ceiling[1]",
        ] {
            assert!(fields.contains(&f), "missing {f} in {fields:?}");
        }
    }
}
