//! What a delegation asks for when its client leaves members out: the
//! A2A facade's and the OpenAB endpoint's defaults (no HTTP stack needed).

use std::time::Duration;

use crate::profile::{Budgets, RiskLevel};

/// What a delegation asks for when the client says nothing (a plain A2A
/// client, or a profile contract that leaves members out).
#[derive(Debug, Clone, PartialEq)]
pub struct DelegationDefaults {
    /// Capabilities requested (exact names).
    pub capabilities: Vec<String>,
    /// Whether the callee must not change anything.
    pub read_only: bool,
    /// Time from the request until the deadline.
    pub timeout: Duration,
    /// Budgets (zero is zero).
    pub budgets: Budgets,
    /// The caller-side agent named in the request's provenance.
    pub agent: String,
}

impl Default for DelegationDefaults {
    /// Read-only, no capabilities, ten minutes, small budgets at low risk.
    fn default() -> Self {
        DelegationDefaults {
            capabilities: Vec::new(),
            read_only: true,
            timeout: Duration::from_secs(600),
            budgets: Budgets {
                tokens: 100_000,
                cost_micros: 1_000_000,
                risk: RiskLevel::Low,
                output_bytes: 1_000_000,
            },
            agent: "a2a-facade".into(),
        }
    }
}
