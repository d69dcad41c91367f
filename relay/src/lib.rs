//! `oab-relay`: the public relay server of OAB Relay.

pub mod store;
pub mod testing;
