//! The open-delegation counts behind the caps: per caller and per route,
//! raised when a delegation is created here, lowered when its terminal is
//! seen, and reseeded from the store at each handshake of the caller
//! (delegations may have ended on another instance meanwhile).
//!
//! Never reads the store itself and never awaits: `may_open` is answered
//! from memory on the frame path.

use std::collections::HashMap;

use oab_wire::PeerId;

use super::Hub;
use crate::store::{DelegationMeta, EventStore};

/// Open delegations per caller and per route. Keys are configured peers
/// and routes, so both maps are bounded by the configuration; a caller's
/// entries are replaced at each of its handshakes (`seed_counts`).
#[derive(Debug, Default)]
pub(super) struct OpenCounts {
    per_caller: HashMap<PeerId, u32>,
    per_route: HashMap<(PeerId, PeerId), u32>,
}

impl<S: EventStore> Hub<S> {
    /// Adjusts open-delegation counts.
    pub(super) fn count_open(&self, caller: &PeerId, callee: &PeerId, delta: i32) {
        let mut c = self.open_counts.lock();
        let a = c.per_caller.entry(caller.clone()).or_insert(0);
        *a = a.saturating_add_signed(delta);
        let b = c
            .per_route
            .entry((caller.clone(), callee.clone()))
            .or_insert(0);
        *b = b.saturating_add_signed(delta);
    }

    /// Sets the open counts of a caller from the store (at each handshake:
    /// delegations may have ended on another instance meanwhile).
    pub fn seed_counts(&self, caller: &PeerId, metas: &[DelegationMeta]) {
        let mut c = self.open_counts.lock();
        c.per_caller.remove(caller);
        c.per_route.retain(|(from, _), _| from != caller);
        for m in metas
            .iter()
            .filter(|m| &m.key.caller == caller && m.terminal.is_none())
        {
            *c.per_caller.entry(caller.clone()).or_insert(0) += 1;
            *c.per_route
                .entry((caller.clone(), m.callee.clone()))
                .or_insert(0) += 1;
        }
    }

    /// Open delegations per route (caller, callee) as this instance counts
    /// them (`/status`): routes with none are left out.
    pub fn open_per_route(&self) -> Vec<((PeerId, PeerId), u32)> {
        let c = self.open_counts.lock();
        c.per_route
            .iter()
            .filter(|(_, n)| **n > 0)
            .map(|(k, n)| (k.clone(), *n))
            .collect()
    }

    /// Whether a caller may open one more delegation on a route.
    pub fn may_open(&self, caller: &PeerId, callee: &PeerId, route_max: u32) -> bool {
        self.may_open_beside(caller, callee, route_max, InFlightOpens::default())
    }

    /// Whether a caller may open one more delegation on a route beside
    /// `in_flight`: opens of its session that passed this check and are
    /// not counted yet (their store calls are still running).
    pub fn may_open_beside(
        &self,
        caller: &PeerId,
        callee: &PeerId,
        route_max: u32,
        in_flight: InFlightOpens,
    ) -> bool {
        let c = self.open_counts.lock();
        let per_caller = c
            .per_caller
            .get(caller)
            .copied()
            .unwrap_or(0)
            .saturating_add(in_flight.caller);
        let per_route = c
            .per_route
            .get(&(caller.clone(), callee.clone()))
            .copied()
            .unwrap_or(0)
            .saturating_add(in_flight.route);
        per_caller < self.live().config.limits.max_open_per_peer && per_route < route_max
    }
}

/// A session's opens that passed [`Hub::may_open_beside`] and are not
/// counted yet: those of the caller, and those of them on the route being
/// checked.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct InFlightOpens {
    /// Of the caller, on every route.
    pub caller: u32,
    /// Of the caller on the route being checked.
    pub route: u32,
}
