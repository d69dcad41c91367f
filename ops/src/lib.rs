//! `oab-ops`: what both binaries (`oab-relay`, `oab-connector`) offer
//! operators in the same way.
//!
//! | module | concern |
//! |---|---|
//! | [`build`] | version, git commit and build date (`--version`, `/status`) |
//! | [`busy_poll`] | `--busy-poll-us`: keeping an async worker polling for a while after each frame batch |
//! | [`config_check`] | reading a configuration file so that every problem is listed with its field and line |
//! | [`overrides`] | `--set section.field=value` and `PREFIX__SECTION__FIELD=value` on a TOML document |
//! | [`logging`] | the tracing subscriber: `OAB_LOG` filter, `text` or `json` lines on stderr |
//! | [`admin_client`] | a small HTTP/1.1 GET for the loopback admin endpoints (`status` commands) |
//! | [`table`] | plain-text tables for the `status` commands |
//! | [`time`] | dates and durations as text |
//!
//! Never: serves anything, reads a secret or touches the network beyond the
//! one admin URL an operator names.

pub mod admin_client;
pub mod build;
pub mod busy_poll;
pub mod config_check;
pub mod logging;
pub mod overrides;
pub mod table;
/// Dates and durations as text: RFC 3339 in UTC, short durations (also
/// used by `build.rs` for the build date).
pub mod time;
