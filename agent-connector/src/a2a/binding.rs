//! The protocol bindings the callee-side driver speaks to a local A2A
//! server (the `protocolBinding` of an interface in an agent card).

use serde::{Deserialize, Serialize};

/// An A2A protocol binding the driver implements, named as agent cards
/// name it (`JSONRPC`, `HTTP+JSON`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum AgentBinding {
    /// `JSONRPC`: JSON-RPC 2.0 over HTTP, streams as SSE (SPEC §9).
    #[serde(rename = "JSONRPC")]
    JsonRpc,
    /// `HTTP+JSON`: the REST binding, google.rpc.Status errors, streams as
    /// SSE (SPEC §11).
    #[serde(rename = "HTTP+JSON")]
    HttpJson,
}

impl AgentBinding {
    /// Every binding the driver implements.
    pub const ALL: [AgentBinding; 2] = [AgentBinding::JsonRpc, AgentBinding::HttpJson];

    /// The card's name for the binding.
    pub const fn as_str(self) -> &'static str {
        match self {
            AgentBinding::JsonRpc => "JSONRPC",
            AgentBinding::HttpJson => "HTTP+JSON",
        }
    }

    /// The binding a card's `protocolBinding` names (exactly, as the
    /// specification spells it), if the driver implements it.
    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|b| b.as_str() == name)
    }
}

impl std::fmt::Display for AgentBinding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}
