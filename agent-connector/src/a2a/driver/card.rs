//! The local server's agent card: where it is, reading it (cached for
//! [`super::DriverOptions::card_ttl`]), and the interface the driver uses.

use std::time::Instant;

use serde_json::Value;

use super::jsonrpc::JsonRpc;
use super::transport::AgentTransport;
use super::{DriverError, DriverInner};
use crate::a2a::{PROTOCOL_BINDING, PROTOCOL_VERSION};

/// The card as read, and what the driver took from it.
#[derive(Debug, Clone)]
pub(super) struct ResolvedCard {
    pub(super) card: Value,
    pub(super) transport: AgentTransport,
    pub(super) streaming: bool,
}

impl DriverInner {
    fn card_url(&self) -> String {
        let u = self.options.url.trim_end_matches('/');
        if u.ends_with(".json") {
            u.to_string()
        } else {
            format!("{u}/.well-known/agent-card.json")
        }
    }

    pub(super) async fn resolve(&self, fresh: bool) -> Result<ResolvedCard, DriverError> {
        if !fresh
            && let Some((at, c)) = self.card.lock().as_ref()
            && at.elapsed() < self.options.card_ttl
        {
            return Ok(c.clone());
        }
        let resp = self
            .http
            .get(self.card_url())
            .timeout(self.options.request_timeout)
            .send()
            .await
            .map_err(|e| DriverError::Http(e.to_string()))?;
        if !resp.status().is_success() {
            return Err(DriverError::Card(format!("HTTP {}", resp.status())));
        }
        let card: Value = resp
            .json()
            .await
            .map_err(|e| DriverError::Card(e.to_string()))?;
        let resolved = ResolvedCard {
            transport: transport_of(&card)?,
            streaming: card
                .pointer("/capabilities/streaming")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            card,
        };
        *self.card.lock() = Some((Instant::now(), resolved.clone()));
        Ok(resolved)
    }
}

/// The first JSON-RPC interface for protocol 1.0 of `card`.
fn transport_of(card: &Value) -> Result<AgentTransport, DriverError> {
    let iface = card
        .get("supportedInterfaces")
        .and_then(Value::as_array)
        .and_then(|list| {
            list.iter().find(|i| {
                i.get("protocolBinding").and_then(Value::as_str) == Some(PROTOCOL_BINDING)
                    && i.get("protocolVersion")
                        .and_then(Value::as_str)
                        .is_some_and(|v| v == PROTOCOL_VERSION || v.starts_with("1.0."))
            })
        })
        .ok_or_else(|| DriverError::Card("no JSON-RPC interface for protocol 1.0".into()))?;
    let url = iface
        .get("url")
        .and_then(Value::as_str)
        .filter(|u| u.starts_with("http://"))
        .ok_or_else(|| DriverError::Card("the JSON-RPC interface has no http:// url".into()))?
        .to_string();
    Ok(AgentTransport::JsonRpc(JsonRpc {
        url,
        tenant: iface
            .get("tenant")
            .and_then(Value::as_str)
            .filter(|t| !t.is_empty())
            .map(str::to_string),
    }))
}
