//! The configuration in force: what a reload ([`crate::reload`]) builds
//! and the hub swaps in whole ([`crate::hub::Hub::install`]), and the rate
//! limiters it carries. Below both, so neither depends on the other for it.

use std::net::IpAddr;
use std::num::NonZeroU32;
use std::sync::Arc;

use governor::{DefaultKeyedRateLimiter, Quota, RateLimiter};
use oab_wire::PeerId;
use rustls::ServerConfig;

use crate::config::{Config, Directory};

/// A token bucket quota; a zero rate or burst (refused by validation) is
/// read as 1.
pub fn quota(per_second: u32, burst: u32) -> Quota {
    let rate = NonZeroU32::new(per_second).unwrap_or(NonZeroU32::MIN);
    let burst = NonZeroU32::new(burst).unwrap_or(rate);
    Quota::per_second(rate).allow_burst(burst)
}

/// The rate limiters of `[rate]`. A reload that leaves `[rate]` unchanged
/// keeps them (and their state); one that changes it starts new ones.
/// Each keeps an entry per key until pruned (`server.rs` prunes the current
/// ones every 10 s).
#[derive(Debug)]
pub struct Limiters {
    /// New connections per source (`rate.connects_*_per_ip`).
    pub connects: DefaultKeyedRateLimiter<IpAddr>,
    /// Frames per peer (`rate.peer_frames_*`); a session keeps the one it
    /// got at its handshake.
    pub peer_frames: Arc<DefaultKeyedRateLimiter<PeerId>>,
    /// Requests besides log frames per peer (`rate.peer_requests_*`).
    pub requests: DefaultKeyedRateLimiter<PeerId>,
}

impl Limiters {
    /// The limiters of a validated config.
    pub fn new(config: &Config) -> Self {
        let r = &config.rate;
        Limiters {
            connects: RateLimiter::keyed(quota(
                r.connects_per_second_per_ip,
                r.connects_burst_per_ip,
            )),
            peer_frames: Arc::new(RateLimiter::keyed(quota(
                r.peer_frames_per_second,
                r.peer_frames_burst,
            ))),
            requests: RateLimiter::keyed(quota(r.peer_requests_per_second, r.peer_requests_burst)),
        }
    }
}

/// The configuration in force: swapped whole by a reload.
#[derive(Debug)]
pub struct LiveConfig {
    /// 1 at start, one more at each applied reload (`oab_config_generation`).
    pub generation: u64,
    /// The configuration: the file's values for the [`RELOADABLE`](crate::reload::RELOADABLE) fields,
    /// the values the relay started with for the others.
    pub config: Arc<Config>,
    /// Its peers, keys and routes in lookup form.
    pub directory: Directory,
    /// The TLS server config for new connections (`None` behind a load
    /// balancer).
    pub tls: Option<Arc<ServerConfig>>,
    /// The rate limiters.
    pub limiters: Arc<Limiters>,
}

impl LiveConfig {
    /// Generation 1: the configuration the relay started with.
    pub fn first(config: Arc<Config>, tls: Option<Arc<ServerConfig>>) -> Self {
        LiveConfig {
            generation: 1,
            directory: Directory::new(&config),
            limiters: Arc::new(Limiters::new(&config)),
            config,
            tls,
        }
    }
}

/// What the hub reports after installing a new [`LiveConfig`].
#[derive(Debug, Default)]
pub struct Installed {
    /// Peers added.
    pub peers_added: Vec<PeerId>,
    /// Peers removed.
    pub peers_removed: Vec<PeerId>,
    /// Sessions closed with `revoked`.
    pub sessions_closed: usize,
}
