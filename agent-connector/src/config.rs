//! The `oab-connector` configuration file (TOML), validated strictly.
//!
//! ```toml
//! [connector]
//! relay_url = "wss://relay.example.com:7443/"
//! relay_id = "relay.example.com"          # optional pin of the relay's id
//! identity = "/etc/oab/connector.identity.toml"
//! relay_ca = "/etc/oab/relay-ca.pem"       # or relay_pin_sha256, or neither (WebPKI)
//! challenge_only_binding = false           # true behind a TLS-terminating load balancer
//! state_dir = "/var/lib/oab-connector"     # caller cursors (optional)
//!
//! [[peers]]
//! id = "acme/build-bot"
//! keys = [{ key_id = "2026-11", public_key = "ed25519:..." }]
//!
//! [policy]                                  # what this host lets callers do
//! allowed_capabilities = ["read:*", "run:tests"]
//! allow_writes = false
//! max_concurrent = 16
//! max_concurrent_per_peer = 4
//! ```
//!
//! It owns the file's shape, its validation (every problem at once, each naming
//! its field) and the peers' keys in lookup form ([`ConnectorConfig::trust`]).
//!
//! Never: reads the identity file or any other secret: it holds the identity
//! file's path, and `keyfile` reads it (the facade token file likewise, read
//! by `oab-connector run`). Never accepts a facade address off loopback: the
//! facade's optional token guards against other local users and web pages,
//! not against a network.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use oab_wire::identity::PeerKey;
use oab_wire::{Digest, PeerId, RelayId};
use serde::{Deserialize, Serialize};

/// The whole file.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConnectorConfig {
    /// Relay connection and identity.
    pub connector: ConnectorSection,
    /// Peers this host talks to, with their public keys.
    #[serde(default)]
    pub peers: Vec<PeerConfig>,
    /// What this host allows delegations it serves to do.
    #[serde(default)]
    pub policy: PolicySection,
    /// The A2A 1.0 endpoints: the facade for local A2A clients (caller side)
    /// and the driver towards a local A2A server (callee side).
    #[serde(default)]
    pub a2a: A2aSection,
    /// The OpenAB control-plane endpoint (`docs/openab.md`).
    #[serde(default)]
    pub openab: OpenAbSection,
    /// The admin endpoint: `/metrics`, `/healthz`, `/readyz`, `/status`.
    #[serde(default)]
    pub admin: AdminSection,
}

/// `[admin]`
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdminSection {
    /// Where the admin endpoint listens (`127.0.0.1:9444`). Unset (the
    /// default): no admin endpoint. Every route is read-only and carries no
    /// secret, but `/status` names peers and delegations: keep it on
    /// loopback or a private network.
    #[serde(default)]
    pub listen: Option<std::net::SocketAddr>,
}

/// The prefix of the connector's environment overrides
/// (`OAB_CONNECTOR__ADMIN__LISTEN=127.0.0.1:9444` sets `admin.listen`).
pub const ENV_PREFIX: &str = "OAB_CONNECTOR__";

/// `[a2a]`
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct A2aSection {
    /// Loopback address of the caller-side facade (A2A JSON-RPC and
    /// HTTP+JSON, one agent per remote peer under
    /// `/peers/{namespace}/{name}/`). Unset: no facade.
    #[serde(default)]
    pub facade_listen: Option<std::net::SocketAddr>,
    /// The base URL local clients use to reach the facade (in agent cards).
    #[serde(default)]
    pub public_url: Option<String>,
    /// How long a facade connection may take to send a request's headers
    /// (from its start, or from the end of its previous response); past it
    /// the connection is closed. ms, > 0.
    #[serde(default = "default_facade_header_timeout_ms")]
    pub facade_header_timeout_ms: u64,
    /// A file (mode 0600) holding a local bearer token: when set, every
    /// facade request must carry `Authorization: Bearer <token>`. Read once
    /// at start; the token is never logged. The environment variable
    /// `OAB_CONNECTOR_FACADE_TOKEN` sets a token too (and wins over the
    /// file).
    #[serde(default)]
    pub facade_token_file: Option<PathBuf>,
    /// Capabilities requested for delegations from plain A2A clients.
    #[serde(default)]
    pub default_capabilities: Vec<String>,
    /// Deadline for delegations from plain A2A clients, ms from the request.
    #[serde(default)]
    pub default_timeout_ms: Option<u64>,
    /// The local A2A 1.0 server that serves delegations for this host
    /// (`http://127.0.0.1:9999`). Unset: incoming delegations are refused.
    #[serde(default)]
    pub driver_url: Option<String>,
    /// How long a delegation whose local task waits for input
    /// (`input-required`) waits for the caller's follow-up before it ends
    /// `failed` and frees its concurrency slot, ms. Unset: two minutes.
    #[serde(default)]
    pub input_timeout_ms: Option<u64>,
    /// The binding the driver speaks to the local A2A server: `"JSONRPC"`
    /// or `"HTTP+JSON"`. Unset: the first of the two the server's card
    /// lists with protocol version 1.0 (the card's order of preference).
    #[serde(default)]
    pub driver_binding: Option<crate::a2a::AgentBinding>,
    /// Facade push notifications: attempts per notification; after the
    /// last failed one the notification is dropped (logged and counted)
    /// and the next one is tried. 1 to [`PUSH_MAX_ATTEMPTS_LIMIT`].
    #[serde(default = "default_push_max_attempts")]
    pub push_max_attempts: u32,
    /// Pause after a notification's first failed attempt, ms; doubles
    /// after each further one up to `push_backoff_max_ms`. > 0.
    #[serde(default = "default_push_backoff_initial_ms")]
    pub push_backoff_initial_ms: u64,
    /// Longest pause between two attempts, ms. At least
    /// `push_backoff_initial_ms`, at most [`PUSH_BACKOFF_MAX_MS_LIMIT`].
    #[serde(default = "default_push_backoff_max_ms")]
    pub push_backoff_max_ms: u64,
    /// Time for one attempt (connect, TLS, request and status line), ms;
    /// past it the attempt failed. 1 to [`PUSH_ATTEMPT_TIMEOUT_MS_LIMIT`].
    #[serde(default = "default_push_attempt_timeout_ms")]
    pub push_attempt_timeout_ms: u64,
    /// Push configs one task may have; past it a new one is refused
    /// (-32602). 1 to `push_max_configs`.
    #[serde(default = "default_push_max_configs_per_task")]
    pub push_max_configs_per_task: usize,
    /// Push configs the facade holds in all; past it the configs of
    /// forgotten tasks, then those that delivered their terminal, are
    /// dropped, and if it is still full a new one is refused (-32602).
    /// 1 to [`PUSH_MAX_CONFIGS_LIMIT`].
    #[serde(default = "default_push_max_configs")]
    pub push_max_configs: usize,
    /// Notifications that may wait per config; past it the oldest waiting
    /// are skipped (logged and counted). 1 to
    /// [`PUSH_MAX_PENDING_PER_CONFIG_LIMIT`].
    #[serde(default = "default_push_max_pending_per_config")]
    pub push_max_pending_per_config: u64,
    /// Accept `http://` webhooks on hosts other than loopback (their token
    /// and credentials then cross the network in clear).
    #[serde(default)]
    pub push_allow_plain_http: bool,
}

/// The default of `a2a.facade_header_timeout_ms`: a local client sends its
/// headers at once; 10 s leaves room for a loaded host, and bounds how long
/// a silent or slow connection holds the facade's resources.
pub const DEFAULT_FACADE_HEADER_TIMEOUT_MS: u64 = 10_000;

fn default_facade_header_timeout_ms() -> u64 {
    DEFAULT_FACADE_HEADER_TIMEOUT_MS
}

/// Most `a2a.push_max_attempts`.
pub const PUSH_MAX_ATTEMPTS_LIMIT: u32 = 100;
/// Most `a2a.push_backoff_max_ms` (one hour).
pub const PUSH_BACKOFF_MAX_MS_LIMIT: u64 = 3_600_000;
/// Most `a2a.push_attempt_timeout_ms` (five minutes; SPEC §13.2
/// recommends 10-30 s).
pub const PUSH_ATTEMPT_TIMEOUT_MS_LIMIT: u64 = 300_000;
/// Most `a2a.push_max_configs`: a config holds up to about 10.5 KiB (URL
/// 2 KiB, token and credentials 4 KiB each, id, scheme), so about 1 GiB at
/// this bound.
pub const PUSH_MAX_CONFIGS_LIMIT: usize = 100_000;
/// Most `a2a.push_max_pending_per_config` (a cursor distance: the waiting
/// notifications are the task table's events, bounded there).
pub const PUSH_MAX_PENDING_PER_CONFIG_LIMIT: u64 = 1_000_000;

fn default_push_max_attempts() -> u32 {
    8
}
fn default_push_backoff_initial_ms() -> u64 {
    500
}
fn default_push_backoff_max_ms() -> u64 {
    60_000
}
fn default_push_attempt_timeout_ms() -> u64 {
    10_000
}
fn default_push_max_configs_per_task() -> usize {
    10
}
fn default_push_max_configs() -> usize {
    1_000
}
fn default_push_max_pending_per_config() -> u64 {
    1_000
}

impl Default for A2aSection {
    fn default() -> Self {
        A2aSection {
            facade_listen: None,
            public_url: None,
            facade_header_timeout_ms: default_facade_header_timeout_ms(),
            facade_token_file: None,
            default_capabilities: Vec::new(),
            default_timeout_ms: None,
            driver_url: None,
            input_timeout_ms: None,
            driver_binding: None,
            push_max_attempts: default_push_max_attempts(),
            push_backoff_initial_ms: default_push_backoff_initial_ms(),
            push_backoff_max_ms: default_push_backoff_max_ms(),
            push_attempt_timeout_ms: default_push_attempt_timeout_ms(),
            push_max_configs_per_task: default_push_max_configs_per_task(),
            push_max_configs: default_push_max_configs(),
            push_max_pending_per_config: default_push_max_pending_per_config(),
            push_allow_plain_http: false,
        }
    }
}

impl A2aSection {
    /// The facade's push settings these fields give.
    #[cfg(feature = "a2a")]
    pub fn push_options(&self) -> crate::a2a::PushOptions {
        use std::time::Duration;
        crate::a2a::PushOptions {
            max_configs_per_task: self.push_max_configs_per_task,
            max_configs: self.push_max_configs,
            max_pending_per_config: self.push_max_pending_per_config,
            max_attempts: self.push_max_attempts,
            initial_backoff: Duration::from_millis(self.push_backoff_initial_ms),
            max_backoff: Duration::from_millis(self.push_backoff_max_ms),
            request_timeout: Duration::from_millis(self.push_attempt_timeout_ms),
            allow_plain_http: self.push_allow_plain_http,
        }
    }

    /// The problems of the `push_*` fields, each naming its field.
    fn push_problems(&self) -> Vec<String> {
        let mut errors = Vec::new();
        // `of`: what the upper bound is, when it is another field.
        let mut range = |field: &str, value: u64, min: u64, max: u64, of: &str| {
            if value < min || value > max {
                errors.push(format!(
                    "a2a.{field}: {value} is out of bounds; must be between {min} and {max}{of}"
                ));
            }
        };
        let wide = |n: usize| u64::try_from(n).unwrap_or(u64::MAX);
        range(
            "push_max_attempts",
            u64::from(self.push_max_attempts),
            1,
            u64::from(PUSH_MAX_ATTEMPTS_LIMIT),
            "",
        );
        range(
            "push_backoff_max_ms",
            self.push_backoff_max_ms,
            1,
            PUSH_BACKOFF_MAX_MS_LIMIT,
            "",
        );
        range(
            "push_backoff_initial_ms",
            self.push_backoff_initial_ms,
            1,
            // An out-of-bounds `push_backoff_max_ms` is reported on its own.
            match self.push_backoff_max_ms {
                n @ 1..=PUSH_BACKOFF_MAX_MS_LIMIT => n,
                _ => PUSH_BACKOFF_MAX_MS_LIMIT,
            },
            " (a2a.push_backoff_max_ms)",
        );
        range(
            "push_attempt_timeout_ms",
            self.push_attempt_timeout_ms,
            1,
            PUSH_ATTEMPT_TIMEOUT_MS_LIMIT,
            "",
        );
        range(
            "push_max_configs",
            wide(self.push_max_configs),
            1,
            wide(PUSH_MAX_CONFIGS_LIMIT),
            "",
        );
        range(
            "push_max_configs_per_task",
            wide(self.push_max_configs_per_task),
            1,
            // An out-of-bounds `push_max_configs` is reported on its own.
            wide(match self.push_max_configs {
                n @ 1..=PUSH_MAX_CONFIGS_LIMIT => n,
                _ => PUSH_MAX_CONFIGS_LIMIT,
            }),
            " (a2a.push_max_configs)",
        );
        range(
            "push_max_pending_per_config",
            self.push_max_pending_per_config,
            1,
            PUSH_MAX_PENDING_PER_CONFIG_LIMIT,
            "",
        );
        errors
    }
}

pub use crate::openab::config::{OpenAbRuntime, OpenAbSection, OpenAbServe, OpenAbTarget};

/// `[connector]`
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConnectorSection {
    /// `wss://host:port/`.
    pub relay_url: String,
    /// Expected relay id (refuse a relay that names itself otherwise).
    #[serde(default)]
    pub relay_id: Option<RelayId>,
    /// This host's identity file (written by `oab-connector keygen`).
    pub identity: PathBuf,
    /// PEM certificate of the private CA that signs the relay's certificate.
    /// The relay's own certificate must be an end-entity certificate
    /// (`CA:FALSE`, the relay's host name in `subjectAltName`): a certificate
    /// made with a plain `openssl req -x509` is a CA certificate and is
    /// refused (`CaUsedAsEndEntity`). To trust one self-signed relay
    /// certificate without a CA, pin it with `relay_pin_sha256` instead.
    #[serde(default)]
    pub relay_ca: Option<PathBuf>,
    /// SHA-256 pin of the relay's certificate (`sha256:<hex>`).
    #[serde(default)]
    pub relay_pin_sha256: Option<String>,
    /// Bind the handshake to the challenge only (relay behind a TLS-terminating LB).
    #[serde(default)]
    pub challenge_only_binding: bool,
    /// Where caller-side delegation state is persisted (optional).
    #[serde(default)]
    pub state_dir: Option<PathBuf>,
}

/// `[[peers]]`
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PeerConfig {
    /// The peer id.
    pub id: PeerId,
    /// Its keys.
    pub keys: Vec<PeerKey>,
}

/// `[policy]`: the callee side's limits for delegations this host serves,
/// and also this host's own grant for the delegations it starts (through
/// the facade, the OpenAB endpoint or the library): a capability it does
/// not list here cannot be requested from another host either.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PolicySection {
    /// Capabilities a caller may be granted here (`read:*` style wildcards).
    #[serde(default)]
    pub allowed_capabilities: Vec<String>,
    /// Whether delegations served here may write at all.
    #[serde(default)]
    pub allow_writes: bool,
    /// Delegations run at once; beyond it new ones are refused `saturated`.
    #[serde(default = "default_max_concurrent")]
    pub max_concurrent: usize,
    /// Delegations run at once per calling peer.
    #[serde(default = "default_max_concurrent_per_peer")]
    pub max_concurrent_per_peer: usize,
    /// Longest deadline accepted, ms.
    #[serde(default = "default_max_deadline_ms")]
    pub max_deadline_ms: u64,
    /// Deepest delegation served here, and started here (1: a delegation
    /// is never delegated further; at most [`crate::authority::MAX_DEPTH`]).
    /// Only the OpenAB endpoint starts deeper ones
    /// (`[openab.namespaces]`), which it may not set deeper than this.
    #[serde(default = "default_policy_max_depth")]
    pub max_depth: u8,
    /// Requests remembered per calling peer against replays (each until it
    /// can no longer be accepted, at most `replay_window_ms`); beyond it
    /// new ones are refused `saturated`.
    #[serde(default = "default_max_live_requests_per_peer")]
    pub max_live_requests_per_peer: usize,
    /// The replay window, ms: a signed request issued longer ago is
    /// refused `stale_request`, whatever its deadline (also one that waited
    /// that long in the relay's log while this host was away).
    #[serde(default = "default_replay_window_ms")]
    pub replay_window_ms: u64,
}

impl PolicySection {
    /// The policy these settings give: the depth, the deadline bound, and no
    /// budget bound of its own (budgets come from each request). Fails on a
    /// capability pattern that does not parse (`ConnectorConfig::load` has
    /// checked them already).
    pub fn policy(&self) -> Result<crate::authority::Policy, crate::authority::AuthorityError> {
        Ok(crate::authority::Policy {
            allowed_capabilities: crate::authority::CapabilitySet::parse(
                &self.allowed_capabilities,
            )?,
            allow_writes: self.allow_writes,
            max_depth: self.max_depth,
            budgets: crate::profile::Budgets {
                tokens: u64::MAX,
                cost_micros: u64::MAX,
                risk: crate::profile::RiskLevel::High,
                output_bytes: u64::MAX,
            },
            max_deadline_ms: self.max_deadline_ms,
        })
    }
}

fn default_max_concurrent() -> usize {
    64
}
fn default_max_concurrent_per_peer() -> usize {
    16
}
fn default_max_deadline_ms() -> u64 {
    3_600_000
}
fn default_policy_max_depth() -> u8 {
    crate::authority::DEFAULT_MAX_DEPTH
}
fn default_max_live_requests_per_peer() -> usize {
    crate::nonce::NonceCache::DEFAULT_PER_CALLER
}
fn default_replay_window_ms() -> u64 {
    crate::nonce::NonceCache::DEFAULT_MAX_AGE_MS
}

impl Default for PolicySection {
    fn default() -> Self {
        PolicySection {
            allowed_capabilities: Vec::new(),
            allow_writes: false,
            max_concurrent: default_max_concurrent(),
            max_concurrent_per_peer: default_max_concurrent_per_peer(),
            max_deadline_ms: default_max_deadline_ms(),
            max_depth: default_policy_max_depth(),
            max_live_requests_per_peer: default_max_live_requests_per_peer(),
            replay_window_ms: default_replay_window_ms(),
        }
    }
}

/// Why a configuration could not be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// Reading failed.
    #[error("cannot read {path}: {error}")]
    Read {
        /// File.
        path: String,
        /// Error.
        error: std::io::Error,
    },
    /// Parsing failed (the message names line and field).
    #[error("{path}: {message}")]
    Parse {
        /// File.
        path: String,
        /// Message.
        message: String,
    },
    /// Values are inconsistent; every problem is listed.
    #[error("{path}:\n{}", .errors.iter().map(|e| format!("  - {e}")).collect::<Vec<_>>().join("\n"))]
    Invalid {
        /// File.
        path: String,
        /// Problems, each naming its field.
        errors: Vec<String>,
    },
}

impl ConnectorConfig {
    /// `[policy]` is also this host's own grant for the delegations it
    /// starts: a facade whose default capabilities the policy does not
    /// cover would have every delegation refused (`capability_denied`), so
    /// that is a configuration error, not a surprise at the first request.
    fn facade_grant_problems(&self) -> Vec<String> {
        use crate::authority::{Capability, CapabilitySet};
        if self.a2a.facade_listen.is_none() {
            return Vec::new();
        }
        let Ok(grant) = CapabilitySet::parse(&self.policy.allowed_capabilities) else {
            return Vec::new(); // reported as policy.allowed_capabilities
        };
        self.a2a
            .default_capabilities
            .iter()
            .filter(|c| Capability::new(c).is_ok_and(|cap| !grant.covers(&cap)))
            .map(|c| {
                format!(
                    "a2a.default_capabilities: {c:?} is not in policy.allowed_capabilities, which is \
                     also this host's own grant for the delegations it starts; every delegation \
                     from the facade would be refused (capability_denied)"
                )
            })
            .collect()
    }
    /// Reads, parses and validates a file.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        Self::load_with_overrides(path, &[])
    }

    /// Reads a file, applies `overrides` (`section.field`, value; from
    /// `--set` and `OAB_CONNECTOR__*`, see [`oab_ops::overrides`]) in order,
    /// then parses and validates the result.
    pub fn load_with_overrides(
        path: &Path,
        overrides: &[(String, String)],
    ) -> Result<Self, ConfigError> {
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|error| ConfigError::Read {
            path: shown.clone(),
            error,
        })?;
        Self::from_toml_with_overrides(&text, &shown, overrides)
    }

    /// Parses TOML text (`origin` names it in errors) with `overrides`
    /// applied, then validates.
    pub fn from_toml_with_overrides(
        text: &str,
        origin: &str,
        overrides: &[(String, String)],
    ) -> Result<Self, ConfigError> {
        let checked = oab_ops::config_check::Checked::<ConnectorConfig>::read(text, overrides);
        let invalid = match &checked.value {
            Some(c) => c.validate().err().unwrap_or_default(),
            None => Vec::new(),
        };
        let invalid = invalid.into_iter().map(|e| match e.split_once(": ") {
            Some((field, message)) => (field.to_string(), message.to_string()),
            None => (String::new(), e),
        });
        let errors: Vec<String> = checked
            .all_problems(invalid)
            .iter()
            .map(ToString::to_string)
            .collect();
        match checked.value {
            Some(c) if errors.is_empty() => Ok(c),
            _ => Err(ConfigError::Invalid {
                path: origin.to_string(),
                errors,
            }),
        }
    }

    /// Checks every value.
    pub fn validate(&self) -> Result<(), Vec<String>> {
        let mut errors = Vec::new();
        let c = &self.connector;
        if !c.relay_url.starts_with("wss://") && !c.relay_url.starts_with("ws://") {
            errors.push(
                "connector.relay_url: must start with wss:// (or ws://, without TLS: only for a \
                 relay with tls_mode = \"behind-load-balancer\" reached without the load \
                 balancer, in a test)"
                    .to_string(),
            );
        }
        if c.relay_ca.is_some() && c.relay_pin_sha256.is_some() {
            errors
                .push("connector.relay_pin_sha256: set either relay_ca or a pin, not both".into());
        }
        if let Some(pin) = &c.relay_pin_sha256
            && Digest::parse(pin).is_none()
        {
            errors.push("connector.relay_pin_sha256: expected sha256:<64 hex digits>".into());
        }
        let mut seen = std::collections::HashSet::new();
        for (i, p) in self.peers.iter().enumerate() {
            if !seen.insert(&p.id) {
                errors.push(format!("peers[{i}].id: {} is listed twice", p.id));
            }
            if p.keys.is_empty() {
                errors.push(format!("peers[{i}].keys: at least one key is required"));
            }
        }
        if let Some(addr) = self.a2a.facade_listen
            && !addr.ip().is_loopback()
        {
            errors.push(format!(
                "a2a.facade_listen: {addr} is not a loopback address; the facade has no authentication of its own"
            ));
        }
        if let Some(url) = &self.a2a.driver_url
            && !url.starts_with("http://")
        {
            errors.push("a2a.driver_url: must be an http:// URL of a local A2A server".into());
        }
        errors.extend(self.openab.validate());
        let max = crate::authority::MAX_DEPTH;
        if self.policy.max_depth == 0 || self.policy.max_depth > max {
            errors.push(format!("policy.max_depth: must be 1 to {max}"));
        }
        errors.extend(self.openab.depth_problems(self.policy.max_depth));
        if self.openab.serves() && self.a2a.driver_url.is_some() {
            errors.push(
                "openab.serve: a2a.driver_url is set too; delegations are served by one of them"
                    .into(),
            );
        }
        if let Err(e) = crate::authority::CapabilitySet::parse(&self.policy.allowed_capabilities) {
            errors.push(format!("policy.allowed_capabilities: {e}"));
        }
        errors.extend(self.facade_grant_problems());
        errors.extend(self.a2a.push_problems());
        if self.a2a.input_timeout_ms == Some(0) {
            errors.push("a2a.input_timeout_ms: must be greater than 0".into());
        }
        if self.a2a.facade_header_timeout_ms == 0 {
            errors.push("a2a.facade_header_timeout_ms: must be greater than 0".into());
        }
        if let (Some(admin), Some(facade)) = (self.admin.listen, self.a2a.facade_listen)
            && admin == facade
        {
            errors.push(format!(
                "admin.listen: {admin} is also a2a.facade_listen; give each its own port"
            ));
        }
        if let (Some(admin), Some(openab)) = (self.admin.listen, self.openab.listen)
            && admin == openab
        {
            errors.push(format!(
                "admin.listen: {admin} is also openab.listen; give each its own port"
            ));
        }
        if self.policy.max_concurrent == 0 {
            errors.push("policy.max_concurrent: must be greater than 0".into());
        }
        if self.policy.max_concurrent_per_peer == 0 {
            errors.push("policy.max_concurrent_per_peer: must be greater than 0".into());
        }
        if self.policy.replay_window_ms == 0 {
            errors.push("policy.replay_window_ms: must be greater than 0 (the default is 600000, ten minutes)".into());
        }
        if self.policy.max_live_requests_per_peer == 0 {
            errors.push("policy.max_live_requests_per_peer: must be greater than 0".into());
        }
        if errors.is_empty() {
            Ok(())
        } else {
            Err(errors)
        }
    }

    /// The peers' keys in lookup form.
    pub fn trust(&self) -> HashMap<PeerId, Vec<PeerKey>> {
        self.peers
            .iter()
            .map(|p| (p.id.clone(), p.keys.clone()))
            .collect()
    }

    /// The fields of `new` that differ from `self` and that a reload does
    /// not apply (they need a restart): every field except [`RELOADABLE`].
    pub fn needs_restart(&self, new: &ConnectorConfig) -> Vec<String> {
        let mut kept = new.clone();
        kept.peers = self.peers.clone();
        kept.connector.relay_ca = self.connector.relay_ca.clone();
        kept.connector.relay_pin_sha256 = self.connector.relay_pin_sha256.clone();
        kept.policy.allowed_capabilities = self.policy.allowed_capabilities.clone();
        kept.policy.allow_writes = self.policy.allow_writes;
        kept.policy.max_deadline_ms = self.policy.max_deadline_ms;
        let mut a = std::collections::BTreeMap::new();
        let mut b = std::collections::BTreeMap::new();
        flatten("", &serde_json::to_value(self).unwrap_or_default(), &mut a);
        flatten("", &serde_json::to_value(&kept).unwrap_or_default(), &mut b);
        let mut differ: Vec<String> = a
            .keys()
            .chain(b.keys())
            .filter(|k| a.get(*k) != b.get(*k))
            .cloned()
            .collect();
        differ.sort();
        differ.dedup();
        differ
    }
}

/// The fields `oab-connector run` applies on `SIGHUP` (dotted paths;
/// `peers`: the whole list): the peers' keys, the policy's capabilities,
/// writes and deadline, and the relay trust (the CA file is read again).
/// Any other field needs a restart. `docs/configuration.md` marks the same.
pub const RELOADABLE: &[&str] = &[
    "peers",
    "connector.relay_ca",
    "connector.relay_pin_sha256",
    "policy.allowed_capabilities",
    "policy.allow_writes",
    "policy.max_deadline_ms",
];

/// The leaves of a JSON value by dotted path (arrays are leaves).
fn flatten(
    prefix: &str,
    v: &serde_json::Value,
    out: &mut std::collections::BTreeMap<String, serde_json::Value>,
) {
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::panic)]
    use super::*;

    #[test]
    fn configuration_md_marks_exactly_the_reloadable_fields_live() {
        let doc = include_str!("../../docs/configuration.md");
        let sections = [
            ("## `[connector]`", "connector"),
            ("## Connector `[[peers]]`", "peers"),
            ("## `[policy]`", "policy"),
            ("## `[a2a]`", "a2a"),
            ("## `[openab]`", "openab"),
            ("## `[admin]`", "admin"),
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
            let mark = line
                .trim_end()
                .trim_end_matches('|')
                .rsplit('|')
                .next()
                .map(str::trim);
            match (section, mark) {
                ("peers", Some("live")) => {}
                ("peers", other) => panic!("peers.{field}: {other:?}"),
                (_, Some("live")) => live.push(format!("{section}.{field}")),
                (_, Some("restart")) => {}
                (_, other) => panic!("{section}.{field}: no reload mark ({other:?})"),
            }
        }
        assert!(rows > 20, "found only {rows} field rows");
        let mut expected: Vec<String> = RELOADABLE
            .iter()
            .filter(|p| p.contains('.'))
            .map(|p| p.to_string())
            .collect();
        expected.sort();
        live.sort();
        assert_eq!(live, expected);
    }

    const MINIMAL: &str =
        "[connector]\nrelay_url = \"wss://relay.example:7443/\"\nidentity = \"id.toml\"\n";

    #[cfg(feature = "a2a")]
    #[test]
    fn the_push_fields_default_to_the_facades_push_options() {
        let c = ConnectorConfig::from_toml_with_overrides(MINIMAL, "t", &[]).unwrap();
        assert_eq!(
            format!("{:?}", c.a2a.push_options()),
            format!("{:?}", crate::a2a::PushOptions::default())
        );
        assert_eq!(
            format!("{:?}", A2aSection::default().push_options()),
            format!("{:?}", crate::a2a::PushOptions::default())
        );
    }

    #[cfg(feature = "a2a")]
    #[test]
    fn the_push_fields_reach_the_push_options() {
        let text = format!(
            "{MINIMAL}[a2a]\npush_max_attempts = 3\npush_backoff_initial_ms = 20\n\
             push_backoff_max_ms = 700\npush_attempt_timeout_ms = 1500\n\
             push_max_configs_per_task = 2\npush_max_configs = 40\n\
             push_max_pending_per_config = 9\npush_allow_plain_http = true\n"
        );
        let o = ConnectorConfig::from_toml_with_overrides(&text, "t", &[])
            .unwrap()
            .a2a
            .push_options();
        assert_eq!(o.max_attempts, 3);
        assert_eq!(o.initial_backoff, std::time::Duration::from_millis(20));
        assert_eq!(o.max_backoff, std::time::Duration::from_millis(700));
        assert_eq!(o.request_timeout, std::time::Duration::from_millis(1500));
        assert_eq!(o.max_configs_per_task, 2);
        assert_eq!(o.max_configs, 40);
        assert_eq!(o.max_pending_per_config, 9);
        assert!(o.allow_plain_http);
    }

    #[test]
    fn push_fields_out_of_bounds_are_refused_naming_the_field() {
        let cases: [(&str, &str); 13] = [
            (
                "push_max_attempts = 0",
                "a2a.push_max_attempts: 0 is out of bounds; must be between 1 and 100",
            ),
            (
                "push_max_attempts = 101",
                "a2a.push_max_attempts: 101 is out of bounds",
            ),
            (
                "push_backoff_initial_ms = 0",
                "a2a.push_backoff_initial_ms: 0 is out of bounds",
            ),
            (
                "push_backoff_initial_ms = 70000",
                "a2a.push_backoff_initial_ms: 70000 is out of bounds; must be between 1 and 60000 (a2a.push_backoff_max_ms)",
            ),
            (
                "push_backoff_max_ms = 0",
                "a2a.push_backoff_max_ms: 0 is out of bounds",
            ),
            (
                "push_backoff_max_ms = 3600001",
                "a2a.push_backoff_max_ms: 3600001 is out of bounds",
            ),
            (
                "push_attempt_timeout_ms = 0",
                "a2a.push_attempt_timeout_ms: 0 is out of bounds",
            ),
            (
                "push_attempt_timeout_ms = 300001",
                "a2a.push_attempt_timeout_ms: 300001 is out of bounds",
            ),
            (
                "push_max_configs = 0",
                "a2a.push_max_configs: 0 is out of bounds",
            ),
            (
                "push_max_configs = 100001",
                "a2a.push_max_configs: 100001 is out of bounds",
            ),
            (
                "push_max_configs_per_task = 1001",
                "a2a.push_max_configs_per_task: 1001 is out of bounds; must be between 1 and 1000 (a2a.push_max_configs)",
            ),
            (
                "push_max_pending_per_config = 0",
                "a2a.push_max_pending_per_config: 0 is out of bounds",
            ),
            (
                "push_max_pending_per_config = 1000001",
                "a2a.push_max_pending_per_config: 1000001 is out of bounds",
            ),
        ];
        for (line, want) in cases {
            let text = format!("{MINIMAL}[a2a]\n{line}\n");
            match ConnectorConfig::from_toml_with_overrides(&text, "t", &[]) {
                Err(ConfigError::Invalid { errors, .. }) => {
                    assert_eq!(errors.len(), 1, "{line}: {errors:?}");
                    // The field, its line (the fifth), the message.
                    let (field, message) = want.split_once(": ").unwrap();
                    let want = format!("{field} (line 5): {message}");
                    assert!(errors[0].starts_with(&want), "{line}: {errors:?}");
                }
                other => panic!("{line}: {other:?}"),
            }
        }
        // The bounds themselves are accepted.
        let text = format!(
            "{MINIMAL}[a2a]\npush_max_attempts = 100\npush_backoff_initial_ms = 3600000\n\
             push_backoff_max_ms = 3600000\npush_attempt_timeout_ms = 1\n\
             push_max_configs_per_task = 100000\npush_max_configs = 100000\n\
             push_max_pending_per_config = 1000000\n"
        );
        ConnectorConfig::from_toml_with_overrides(&text, "t", &[]).unwrap();
        // A negative value is a parse error naming the field.
        let text = format!("{MINIMAL}[a2a]\npush_max_attempts = -1\n");
        let err = ConnectorConfig::from_toml_with_overrides(&text, "t", &[])
            .unwrap_err()
            .to_string();
        assert!(err.contains("push_max_attempts"), "{err}");
    }

    #[test]
    fn a_reload_names_the_changed_fields_that_need_a_restart() {
        let text =
            "[connector]\nrelay_url = \"wss://relay.example:7443/\"\nidentity = \"id.toml\"\n";
        let running: ConnectorConfig = toml::from_str(text).unwrap();
        let mut new = running.clone();
        new.connector.relay_url = "wss://other.example:7443/".into();
        new.connector.relay_pin_sha256 = Some("sha256:00".into());
        new.policy.allow_writes = true;
        new.policy.max_concurrent = 3;
        new.peers = Vec::new();
        assert_eq!(
            running.needs_restart(&new),
            ["connector.relay_url", "policy.max_concurrent"]
        );
    }
}
