//! What a run generates before it starts anything: a self-signed certificate
//! for `localhost`, the identities of the two benchmark peers (and of the
//! idle peers of the `sessions` scenario), and a relay config that lists them,
//! all in a temporary directory that is removed when the [`Setup`] is dropped.
//!
//! The config is the relay's defaults except for the values in
//! [`Tuning`], each of which a load test would otherwise trip over (a rate
//! limit, a retention bound); every run records them in its JSON output.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context as _;
use oab_relay::config::Config;
use oab_wire::identity::Identity;
use oab_wire::{KeyId, PeerId};
use serde::Serialize;

/// The benchmark's caller peer (sends the down log).
pub const CALLER: &str = "bench/caller";
/// The benchmark's callee peer (receives the down log, echoes up).
pub const CALLEE: &str = "bench/callee";
/// The relay id and the certificate name.
pub const RELAY_ID: &str = "localhost";

/// Relay settings a load test changes from the defaults, and why.
#[derive(Debug, Clone, Serialize)]
pub struct Tuning {
    /// `rate.peer_frames_per_second` and `rate.peer_frames_burst`. The
    /// default (200,000/s) is below what one peer pushes at small payloads;
    /// a refused frame would turn into a `sequence_gap` storm instead of a
    /// measurement.
    pub peer_frames_per_second: u32,
    /// `rate.connects_per_second_per_ip` and its burst. Every session of the
    /// `sessions` scenario comes from 127.0.0.1; the default (50/s) would
    /// measure the rate limiter.
    pub connects_per_second_per_ip: u32,
    /// `store.max_log_entries`. Bounds the memory one benchmark delegation
    /// holds (the default 10,000 x 64 KiB frames is 640 MiB per log); it
    /// stays above the send window so live delivery never needs a trimmed
    /// entry.
    pub max_log_entries: u64,
    /// `store.finished_ttl_ms`: finished benchmark delegations are dropped
    /// soon, so one case's logs do not weigh on the next.
    pub finished_ttl_ms: u64,
    /// `relay.idle_timeout_ms`: idle sessions stay up for the whole run.
    pub idle_timeout_ms: u64,
    /// `relay.handshake_timeout_ms`: thousands of handshakes queued at once
    /// must not time out while they wait for the CPU.
    pub handshake_timeout_ms: u64,
    /// `limits.max_payload`: at least the largest payload benchmarked.
    pub max_payload: u32,
    /// `limits.slow_consumer_ms` when a scenario changes it (the
    /// `slow-consumer` scenario makes it short); `None`: the relay default.
    pub slow_consumer_ms: Option<u64>,
    /// `relay.heartbeat_ms` when a scenario changes it (`reconnect-storm`
    /// makes it short when it stalls links, so a half-open link is found dead
    /// in a fraction of a second instead of 45 s); `None`: the relay default.
    pub heartbeat_ms: Option<u32>,
    /// `limits.append_batches_in_flight` when the run sets it
    /// (`--append-batches`); `None`: the relay default.
    pub append_batches_in_flight: Option<usize>,
}

impl Default for Tuning {
    fn default() -> Self {
        Tuning {
            peer_frames_per_second: 1_000_000_000,
            connects_per_second_per_ip: 1_000_000,
            max_log_entries: 4_096,
            finished_ttl_ms: 1_000,
            idle_timeout_ms: 600_000,
            handshake_timeout_ms: 60_000,
            max_payload: oab_wire::limits::DEFAULT_MAX_PAYLOAD,
            slow_consumer_ms: None,
            heartbeat_ms: None,
            append_batches_in_flight: None,
        }
    }
}

/// The variable that sets the log filter of the processes a run starts
/// ([`Setup::child_log`]).
pub const CHILD_LOG_ENV: &str = "OAB_LOADTEST_CHILD_LOG";

/// A generated certificate, identities and relay config.
pub struct Setup {
    /// Holds every file; removed on drop.
    pub dir: tempfile::TempDir,
    /// The certificate (DER) clients trust.
    pub cert_der: Vec<u8>,
    /// The TLS server config (relay in-process, direct baseline server).
    pub tls: Arc<rustls::ServerConfig>,
    /// The config file, for a relay child process.
    pub config_path: PathBuf,
    /// The parsed config (store `memory`; a store URL is an override).
    pub config: Config,
    /// The caller identity.
    pub caller: Identity,
    /// The callee identity.
    pub callee: Identity,
    /// Identities of the idle peers (the `sessions` scenario), each its own
    /// configured peer.
    pub idle: Vec<Identity>,
    /// Extra (caller, callee) peers, each with a route caller -> callee
    /// (the `slow-consumer` scenario's independent pairs).
    pub pairs: Vec<(Identity, Identity)>,
    /// Extra callers of the benchmark callee, each with a route to it (the
    /// `soak` scenario's library caller, beside the facade's connector).
    pub extra_callers: Vec<Identity>,
    /// The settings changed from the relay's defaults.
    pub tuning: Tuning,
    /// The log filter (`OAB_LOG`) of the relay and connector processes
    /// started on this setup: `$OAB_LOADTEST_CHILD_LOG`, else `warn` (a
    /// benchmark measures, it does not log; the variable measures what
    /// logging costs); a test that reads their logs sets more.
    pub child_log: String,
    /// The log format (`OAB_LOG_FORMAT`, `text` or `json`) of those
    /// processes.
    pub child_log_format: String,
}

impl std::fmt::Debug for Setup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Setup")
            .field("dir", &self.dir.path())
            .field("idle_peers", &self.idle.len())
            .field("tuning", &self.tuning)
            .finish_non_exhaustive()
    }
}

fn peer(s: &str) -> anyhow::Result<PeerId> {
    PeerId::new(s).with_context(|| format!("peer id {s:?}"))
}

/// The peer ids of extra pair `i`: (caller, callee).
pub fn pair_peer_ids(i: usize) -> (String, String) {
    (format!("pair/c{i:04}"), format!("pair/e{i:04}"))
}

/// The peer id of extra caller `i` (routed to [`CALLEE`]).
pub fn extra_caller_peer_id(i: usize) -> String {
    format!("bench/caller-{i}")
}

/// The peer id of idle peer `i`.
pub fn idle_peer_id(i: usize) -> String {
    format!("idle/p{i:06}")
}

impl Setup {
    /// Generates everything: the two benchmark peers with a route caller ->
    /// callee, plus `idle_peers` peers without routes.
    pub fn new(idle_peers: usize, tuning: Tuning) -> anyhow::Result<Setup> {
        Setup::with_pairs(idle_peers, 0, tuning)
    }

    /// As [`Setup::new`], plus `pairs` extra (caller, callee) peers, each
    /// pair with its own route.
    pub fn with_pairs(idle_peers: usize, pairs: usize, tuning: Tuning) -> anyhow::Result<Setup> {
        Setup::with_callers(idle_peers, pairs, 0, tuning)
    }

    /// As [`Setup::with_pairs`], plus `extra_callers` peers that each have
    /// a route to the benchmark callee.
    pub fn with_callers(
        idle_peers: usize,
        pairs: usize,
        extra_callers: usize,
        tuning: Tuning,
    ) -> anyhow::Result<Setup> {
        oab_relay::tls::install_crypto_provider();
        let dir = tempfile::Builder::new()
            .prefix("oab-loadtest-")
            .tempdir()
            .context("creating a temporary directory")?;
        let ss = oab_relay::tls::self_signed(&[RELAY_ID, "127.0.0.1"])
            .context("generating a certificate")?;
        let cert_path = dir.path().join("cert.pem");
        let key_path = dir.path().join("key.pem");
        oab_relay::tls::write_file(&cert_path, &ss.cert_pem, false)?;
        oab_relay::tls::write_file(&key_path, &ss.key_pem, true)?;
        let key_id = KeyId::new("k1").context("key id")?;
        let caller = Identity::generate(peer(CALLER)?, key_id.clone());
        let callee = Identity::generate(peer(CALLEE)?, key_id.clone());
        let idle = (0..idle_peers)
            .map(|i| Ok(Identity::generate(peer(&idle_peer_id(i))?, key_id.clone())))
            .collect::<anyhow::Result<Vec<_>>>()?;
        let pairs = (0..pairs)
            .map(|i| {
                let (c, e) = pair_peer_ids(i);
                Ok((
                    Identity::generate(peer(&c)?, key_id.clone()),
                    Identity::generate(peer(&e)?, key_id.clone()),
                ))
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        let extra_callers = (0..extra_callers)
            .map(|i| {
                Ok(Identity::generate(
                    peer(&extra_caller_peer_id(i))?,
                    key_id.clone(),
                ))
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        let t = &tuning;
        let slow_consumer = t
            .slow_consumer_ms
            .map(|ms| format!("slow_consumer_ms = {ms}\n"))
            .unwrap_or_default();
        let heartbeat = t
            .heartbeat_ms
            .map(|ms| format!("heartbeat_ms = {ms}\n"))
            .unwrap_or_default();
        let mut text = format!(
            "# Generated by oab-loadtest for one run.\n\
             [relay]\n\
             id = \"{RELAY_ID}\"\n\
             listen = \"127.0.0.1:0\"\n\
             admin_listen = \"127.0.0.2:0\"\n\
             tls_cert = \"{cert}\"\n\
             tls_key = \"{key}\"\n\
             idle_timeout_ms = {idle_timeout}\n\
             handshake_timeout_ms = {handshake_timeout}\n\
             max_handshakes_per_source = 512\n\
             {heartbeat}\n\
             [limits]\n\
             max_payload = {max_payload}\n\
             session_queue_bytes = {queue_bytes}\n\
             {slow_consumer}\n\
             {append_batches}\n\
             [rate]\n\
             peer_frames_per_second = {fps}\n\
             peer_frames_burst = {fps}\n\
             connects_per_second_per_ip = {cps}\n\
             connects_burst_per_ip = {cps}\n\n\
             [store]\n\
             url = \"memory\"\n\
             max_log_entries = {max_log}\n\
             finished_ttl_ms = {ttl}\n\n",
            cert = cert_path.display(),
            key = key_path.display(),
            idle_timeout = t.idle_timeout_ms,
            handshake_timeout = t.handshake_timeout_ms,
            max_payload = t.max_payload,
            // The relay's default (16 MiB), or room for two largest frames
            // when the payloads benchmarked are larger.
            queue_bytes = (16usize << 20).max(2 * (t.max_payload as usize + 64 * 1024) + 64 * 1024),
            fps = t.peer_frames_per_second,
            cps = t.connects_per_second_per_ip,
            max_log = t.max_log_entries,
            ttl = t.finished_ttl_ms,
            append_batches = t
                .append_batches_in_flight
                .map(|n| format!("append_batches_in_flight = {n}"))
                .unwrap_or_default(),
        );
        for id in std::iter::once(&caller)
            .chain(std::iter::once(&callee))
            .chain(idle.iter())
            .chain(pairs.iter().flat_map(|(c, e)| [c, e]))
            .chain(extra_callers.iter())
        {
            let _ = write!(
                text,
                "[[peers]]\nid = \"{}\"\nkeys = [{{ key_id = \"{}\", public_key = \"{}\" }}]\n",
                id.peer,
                id.key_id,
                id.public_key()
            );
        }
        let _ = write!(
            text,
            "\n[[routes]]\nfrom = \"{CALLER}\"\nto = \"{CALLEE}\"\nmax_open = 100000\n\
             ceiling = [\"read:*\"]\n"
        );
        for c in &extra_callers {
            let _ = write!(
                text,
                "\n[[routes]]\nfrom = \"{}\"\nto = \"{CALLEE}\"\nmax_open = 100000\n\
                 ceiling = [\"read:*\"]\n",
                c.peer
            );
        }
        for (c, e) in &pairs {
            let _ = write!(
                text,
                "\n[[routes]]\nfrom = \"{}\"\nto = \"{}\"\nmax_open = 100000\n\
                 ceiling = [\"read:*\"]\n",
                c.peer, e.peer
            );
        }
        let config = Config::from_toml_with_overrides(&text, "generated loadtest config", &[])
            .context("the generated relay config does not validate")?;
        let config_path = dir.path().join("relay.toml");
        oab_relay::tls::write_file(&config_path, &text, false)?;
        let certs = oab_relay::tls::load_certs(&cert_path)?;
        let key = oab_relay::tls::load_key(&key_path)?;
        let tls = oab_relay::tls::server_config(certs, key)?;
        Ok(Setup {
            dir,
            cert_der: ss.cert_der,
            tls,
            config_path,
            config,
            caller,
            callee,
            idle,
            pairs,
            extra_callers,
            tuning,
            child_log: std::env::var(CHILD_LOG_ENV).unwrap_or_else(|_| "warn".into()),
            child_log_format: "text".into(),
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn generated_config_lists_every_peer_and_the_route() {
        let s = Setup::new(3, Tuning::default()).unwrap();
        assert_eq!(s.config.peers.len(), 5);
        assert_eq!(s.config.routes.len(), 1);
        assert_eq!(s.config.rate.peer_frames_per_second, 1_000_000_000);
        assert!(s.config_path.exists());
        assert_eq!(s.idle[2].peer.as_str(), "idle/p000002");
    }

    #[test]
    fn pairs_get_routes_and_slow_consumer_is_configured() {
        let t = Tuning {
            slow_consumer_ms: Some(500),
            heartbeat_ms: Some(100),
            ..Tuning::default()
        };
        let s = Setup::with_pairs(0, 2, t).unwrap();
        assert_eq!(s.config.peers.len(), 6);
        assert_eq!(s.config.routes.len(), 3);
        assert_eq!(s.config.limits.slow_consumer_ms, 500);
        assert_eq!(s.config.relay.heartbeat_ms, 100);
        assert_eq!(s.pairs[1].1.peer.as_str(), "pair/e0001");
    }

    #[test]
    fn extra_callers_are_routed_to_the_callee() {
        let s = Setup::with_callers(0, 0, 2, Tuning::default()).unwrap();
        assert_eq!(s.config.peers.len(), 4);
        assert_eq!(s.config.routes.len(), 3);
        assert_eq!(s.extra_callers[1].peer.as_str(), "bench/caller-1");
        assert!(
            s.config
                .routes
                .iter()
                .any(|r| r.from.as_str() == "bench/caller-1" && r.to.as_str() == CALLEE)
        );
    }
}
