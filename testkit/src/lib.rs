//! `oab-testkit`: what the tests (and the load tester) of OAB Relay use to
//! run the real thing, kept out of the production crates.
//!
//! | module | concern |
//! |---|---|
//! | [`redis`] | a real `redis-server` or three-master Redis Cluster as child processes, killed and restarted on demand |
//! | [`raw_client`] | a minimal protocol client: TLS, upgrade, handshake, then raw frames |
//! | [`reply_proxy`] | a TCP proxy that can hold the replies of the connections it forwards (a store connection that stops answering) |
//! | [`docs`] | the shell blocks of the project's Markdown, for tests that run the docs as written |
//!
//! The relay and the connector take this crate as a dev-dependency only;
//! `oab-loadtest`, itself a test tool, depends on it.
//!
//! Never: a dependency of a production crate, and never a mock: every helper
//! runs the real program (`redis-server`) or speaks the real protocol over a
//! real socket.

pub mod docs;
pub mod raw_client;
#[cfg(unix)]
pub mod redis;
pub mod reply_proxy;
