//! A2A 1.0 at both ends of a delegation (see `docs/a2a.md`).
//!
//! | module | concern |
//! |---|---|
//! | [`jsonrpc`] | the JSON-RPC 2.0 envelope, the A2A error codes (and the refusals mapped to them), the `A2A-Version` check |
//! | [`model`] | A2A 1.0 JSON shapes: task states, timestamps, messages, artifacts |
//! | [`profile`] | the OAB Delegation Profile extension: URI, activation, cursor, contract, metadata |
//! | `tasks` | the facade's task table: delegation events folded into A2A tasks and events |
//! | [`facade`] | caller side: per-peer agent cards, the JSON-RPC and HTTP+JSON bindings with SSE, one module per A2A method |
//! | [`server`] | serving the facade on an injected listener until a shutdown token fires |
//! | [`driver`] | callee side: a [`crate::TaskExecutor`] that forwards to a local A2A 1.0 server (JSON-RPC or HTTP+JSON) |
//! | `binding` | [`AgentBinding`]: the bindings the driver speaks |
//! | `defaults` | [`DelegationDefaults`]: what a delegation asks for when its client says nothing |
//!
//! Feature `a2a` (on by default) builds the HTTP parts (`facade`, `server`,
//! `driver`, `profile`; axum and reqwest). Without it only the JSON shapes
//! (`jsonrpc`, `model`) and [`DelegationDefaults`] remain, which the OpenAB
//! endpoint uses.
//!
//! Wiring, in a host process:
//! - caller side: `Facade::new(connector.caller().clone(), FacadeOptions::default())`,
//!   then [`server::serve`] on a loopback listener; an A2A client points at
//!   `http://<addr>/peers/<namespace>/<name>/`;
//! - callee side: `A2aDriver::new(DriverOptions::new(url))` as the
//!   [`crate::CalleeOptions::executor`], and [`driver::A2aDriver::agent_card`]
//!   published with [`crate::Connector::publish`] so callers' facades can show it.
//!
//! Never: lets A2A decide authority: a client's delegation contract is a
//! request that the caller's `authorize_outgoing` checks like any other, and
//! the A2A server behind the driver runs only what the callee runtime accepted.

mod binding;
mod defaults;
#[cfg(feature = "a2a")]
pub mod driver;
#[cfg(feature = "a2a")]
pub mod facade;
pub mod jsonrpc;
pub mod model;
#[cfg(feature = "a2a")]
pub mod profile;
#[cfg(feature = "a2a")]
pub mod server;
#[cfg(feature = "a2a")]
mod tasks;
#[cfg(feature = "a2a")]
pub mod write_deadline;

pub use binding::AgentBinding;
pub use defaults::DelegationDefaults;
#[cfg(feature = "a2a")]
pub use driver::{A2aDriver, DriverError, DriverOptions, publish_card};
#[cfg(feature = "a2a")]
pub use facade::{
    Facade, FacadeOptions, FacadeToken, PushConfigCounts, PushOptions, PushStats, TokenError,
};
pub use jsonrpc::A2aError;
#[cfg(feature = "a2a")]
pub use profile::PROFILE_URI;
#[cfg(feature = "a2a")]
pub use server::serve;

/// The A2A protocol version both ends speak (Major.Minor, never a patch).
pub const PROTOCOL_VERSION: &str = "1.0";

/// The JSON-RPC 2.0 binding: the facade's first interface, and the one the
/// driver speaks to the callee's A2A server.
pub const JSONRPC_BINDING: &str = "JSONRPC";

/// The HTTP+JSON (REST) binding: the facade's second interface.
pub const HTTP_JSON_BINDING: &str = "HTTP+JSON";
