//! `oab-connector`: what an OAB host runs to delegate through the relay.
//!
//! | module | concern |
//! |---|---|
//! | [`trust`] | how the relay's TLS certificate is trusted (WebPKI, CA, pin) |
//! | [`link`] | the one task that owns the relay connection: reconnect, resend, resume |
//! | [`caller`] | delegate, events, get, wait, cancel, list peers, verify |
//! | [`callee`] | the executor trait and the verify -> authorize -> reserve -> run pipeline |
//! | [`connector`] | starting a connector: link, caller, callee runtime |
//! | [`profile`] | the OAB Delegation Profile payloads, signing and verification |
//! | [`authority`] | capabilities, policies, the fail-closed intersection, budgets, depth |
//! | [`nonce`] | request nonces and the callee's replay cache |
//! | [`events`] | the event payloads on the relay's logs |
//! | [`keyfile`] | the identity file on disk (0600, never overwritten) |
//! | [`audit`] | the audit trail |
//! | [`state`] | what a caller persists to resume after a restart |
//! | [`reattach`] | what a callee persists to re-attach to its agents' tasks after a restart |
//! | [`config`] | the `oab-connector` configuration file |
//! | [`status`] | the status operators read: link, relay, descriptor, open delegations |
//! | [`admin`] | the admin endpoint: `/metrics`, `/healthz`, `/readyz`, `/status` |
//! | [`lockout`] | configurations that validate but cannot delegate or lock callers out: `check-config` warnings |
//! | [`demo`] | `oab-connector demo`: one delegation between `dev/alice` and `dev/bob` over a development relay |
//! | [`a2a`] | A2A 1.0: the caller-side facade, the callee-side driver, the profile extension (feature `a2a`; without it only the JSON shapes) |
//! | [`openab`] | an OpenAB control-plane endpoint on loopback: OAB runtimes delegate through it unmodified |
//!
//! Features (`Cargo.toml`): `a2a` (axum, reqwest: the A2A facade and
//! driver) and `cli` (the `oab-connector` binary: `a2a`, clap, anyhow, the
//! tracing subscriber), both on by default. A host that embeds the
//! connector takes `default-features = false`: every module above except
//! `a2a`'s HTTP parts, and no HTTP stack or argument parser. The
//! [`oab-wire`](wire) types the API uses are re-exported ([`wire`], and the
//! common ones at the top level), so a host needs no `oab-wire` dependency
//! of its own.
//!
//! Never: trusts the relay with authority or results: signed requests and
//! results are verified against the peers' keys in the local configuration
//! (`ConnectorOptions::trust`), and the relay's route ceiling can only refuse
//! more, never allow more.

pub mod a2a;
#[cfg(feature = "admin")]
pub mod admin;
pub mod audit;
pub mod authority;
pub mod callee;
pub mod caller;
pub mod config;
pub mod connector;
pub mod demo;
pub mod events;
pub mod keyfile;
pub mod link;
pub mod lockout;
pub mod nonce;
pub mod openab;
pub mod profile;
pub mod reattach;
pub mod state;
pub mod status;
pub mod trust;

/// The wire protocol crate (`oab-wire`), for the types the API uses.
pub use oab_wire as wire;
pub use oab_wire::identity::{Identity, PeerKey, TrustStore};
pub use oab_wire::{DelegationKey, Digest, KeyId, Outcome, PeerEntry, PeerId, RequestId};

pub use callee::{CalleeOptions, Execution, StopReason, TaskExecutor, TaskRun};
pub use caller::{Caller, DelegationEvent, DelegationHandle, EventKind, NewDelegation, Terminal};
pub use connector::{Connector, ConnectorOptions, Reconfiguration};
