//! `oab-relay`: the public relay of OAB Relay. Connectors of two OAB hosts
//! dial out to it over WSS; it authenticates each by its ed25519 identity,
//! routes delegation frames between configured peers without reading their
//! payloads, keeps every delegation's events in durable logs, replays them
//! after reconnects, rate-limits, and exports metrics.
//!
//! | module | concern |
//! |---|---|
//! | [`config`] | the TOML configuration, validation, peer and route lookup |
//! | [`lockout`] | values that validate but can lock peers out: `check-config` warnings |
//! | [`tls`] | rustls server config (TLS 1.3), exporter, dev certificates |
//! | [`server`] | `run(listener, ...)`: accept loop, caps, upgrade, admin, sweeper |
//! | [`admission`] | before authentication: handshake slots per source, read budget, TCP options |
//! | [`proxy_protocol`] | PROXY protocol v1/v2 headers from trusted load balancers: the real client address |
//! | [`session`] | one connection: handshake, frame loop, batching, acks |
//! | [`wakes`] | polling a session's reader and writer in one task without self-wakes |
//! | [`hub`] | shared state: sessions, delegation views, delivery and replay, wake-ups |
//! | [`fleet`] | several instances over one store: presence, wake-ups, leases |
//! | [`live`] | the configuration in force and its rate limiters |
//! | [`reload`] | live reload: re-reading the file, which fields apply, the generation |
//! | [`refusal`] | every refused frame's `Error` code and text, in one place |
//! | [`outbox`] | the bounded per-session queue and its overflow policy |
//! | [`store`] | the durable log interface and its memory and Redis backends |
//! | [`metrics`] | Prometheus metrics |
//! | [`status`] | `/status` on the admin port, its page, and `oab-relay status`'s tables |
//! | [`inspect`] | where one delegation is (`/delegation`, `oab-relay inspect`), the oldest open ones |
//! | [`client_log`] | the Redis client's log records, rate-limited into `tracing` |
//! | [`dev`] | the quick start: development certificate, identities, config |
//!
//! Never: parses or rewrites a delegation frame's payload. The relay stores,
//! forwards and replays the exact bytes a peer sent; it reads headers only,
//! hashes an `Open`'s payload to check its digest, and stamps the route's
//! capability ceiling into the `Open`'s header.

pub mod admission;
pub mod client_log;
pub mod config;
pub mod dev;
pub mod fleet;
pub mod hub;
pub mod inspect;
pub mod live;
pub mod lockout;
pub mod metrics;
pub mod outbox;
pub mod proxy_protocol;
pub mod refusal;
pub mod reload;
pub mod server;
pub mod session;
pub mod status;
pub mod store;
pub mod tls;
pub mod wakes;

pub use server::run;
