//! `oab-loadtest`: benchmarks and fault scenarios for OAB Relay.
//!
//! Everything runs on this machine's loopback, bounded in time and count,
//! and stops by itself; the relay (a child process by default) and any
//! `redis-server` it needs are started for the run and killed when it ends.
//!
//! | module | concern |
//! |---|---|
//! | [`proxy`] | a fault-injecting TCP proxy (latency, bandwidth, drop, stall, reset, blackhole), usable from any crate's tests |
//! | [`setup`] | the generated certificate, identities and relay config of a run |
//! | [`relay`] | the relay under test: child process or in-process, memory or Redis store; a fleet of instances over one Redis |
//! | [`direct`] | the physical baseline: a direct WSS connection between the two endpoints |
//! | [`traffic`] | benchmark frames, their stamps, and the receivers' correctness checks |
//! | [`endpoint`] | what caller and callee do on a WebSocket: pipelined send, paced send, count, echo |
//! | [`connectors`] | real connectors against the relay under test: options, requests, a waitable audit sink |
//! | [`connector_process`] | a connector as its own process: the `oab-connector` binary on a generated config, its RSS and `state_dir` size |
//! | [`cp`] | OpenAB control-plane runtimes: a primary keeping N delegations in flight, a worker, a direct CP worker for the baseline |
//! | [`a2a_agent`] | an A2A agent that answers every message with a completed task at once, behind a connector's driver |
//! | [`scenario`] | `throughput`, `latency`, `sessions`, `delegations`, `cancel-race`, `reconnect-storm`, `slow-consumer`, `cross-instance`, `soak` |
//! | [`xadd`] | Redis's own pipelined `XADD` rate on the relay's `redis-server`, the Redis store's baseline, and the same `XADD`s from a script that does nothing else |
//! | [`report`] | tables, JSON documents, violations |
//! | [`chart`] | an SVG chart of the throughput and latency results |
//!
//! The binary `oab-loadtest` parses flags and calls [`scenario`]; `--help`
//! explains each scenario.

pub mod a2a_agent;
pub mod chart;
pub mod connector_process;
pub mod connectors;
pub mod cp;
pub mod direct;
pub mod endpoint;
pub mod proxy;
pub mod relay;
pub mod report;
pub mod scenario;
pub mod setup;
pub mod traffic;
pub mod xadd;
