//! The local server's agent card: where it is, reading it (cached for
//! [`super::DriverOptions::card_ttl`]), and the interface the driver uses
//! (the card's order of preference, or [`super::DriverOptions::binding`]).

use std::time::Instant;

use serde_json::Value;

use super::jsonrpc::JsonRpc;
use super::rest::Rest;
use super::transport::AgentTransport;
use super::{DriverError, DriverInner};
use crate::a2a::{AgentBinding, PROTOCOL_VERSION};

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
            transport: transport_of(&card, self.options.binding)?,
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

/// The interface the driver uses: the first of the card's
/// `supportedInterfaces` (listed in the server's order of preference, SPEC
/// §8.3) whose binding the driver speaks (`forced`, when set; else
/// `JSONRPC` or `HTTP+JSON`), whose `protocolVersion` is 1.0 and whose
/// `url` is `http://`. None: [`DriverError::NoInterface`], naming what the
/// card offers.
pub(super) fn transport_of(
    card: &Value,
    forced: Option<AgentBinding>,
) -> Result<AgentTransport, DriverError> {
    let list = card
        .get("supportedInterfaces")
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or_default();
    let mut offered = Vec::new();
    for iface in list {
        let name = iface
            .get("protocolBinding")
            .and_then(Value::as_str)
            .unwrap_or("?");
        let version = iface
            .get("protocolVersion")
            .and_then(Value::as_str)
            .unwrap_or("?");
        let url = iface.get("url").and_then(Value::as_str).unwrap_or("");
        let usable = AgentBinding::parse(name)
            .filter(|b| forced.is_none_or(|f| f == *b))
            .filter(|_| version == PROTOCOL_VERSION || version.starts_with("1.0."))
            .filter(|_| url.starts_with("http://"));
        let Some(binding) = usable else {
            let mut o: String = format!("{name} {version} at {url}")
                .chars()
                .take(200)
                .collect();
            if offered.len() < 8 {
                if !url.starts_with("http://") {
                    o.push_str(" (not http://)");
                }
                offered.push(o);
            }
            continue;
        };
        let tenant = iface
            .get("tenant")
            .and_then(Value::as_str)
            .filter(|t| !t.is_empty())
            .map(str::to_string);
        return match binding {
            AgentBinding::JsonRpc => Ok(AgentTransport::JsonRpc(JsonRpc {
                url: url.to_string(),
                tenant,
            })),
            AgentBinding::HttpJson => Rest::new(url, tenant.as_deref())
                .map(AgentTransport::Rest)
                .map_err(|e| DriverError::Card(format!("the HTTP+JSON interface: {e}"))),
        };
    }
    let wanted = match forced {
        Some(b) => format!("{b} (forced by the driver's options)"),
        None => "JSONRPC or HTTP+JSON".into(),
    };
    Err(DriverError::NoInterface {
        wanted,
        offered: if offered.is_empty() {
            "no interface".into()
        } else {
            offered.join(", ")
        },
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use serde_json::json;

    use super::*;

    fn card(ifaces: Value) -> Value {
        json!({ "name": "x", "supportedInterfaces": ifaces })
    }

    fn chosen(card: &Value, forced: Option<AgentBinding>) -> AgentBinding {
        transport_of(card, forced).unwrap().binding()
    }

    #[test]
    fn the_cards_order_of_preference_decides() {
        let rest_first = card(json!([
            { "protocolBinding": "GRPC", "protocolVersion": "1.0", "url": "http://h:1" },
            { "protocolBinding": "HTTP+JSON", "protocolVersion": "1.0", "url": "http://h:2/rest" },
            { "protocolBinding": "JSONRPC", "protocolVersion": "1.0", "url": "http://h:3/rpc" },
        ]));
        assert_eq!(chosen(&rest_first, None), AgentBinding::HttpJson);
        let rpc_first = card(json!([
            { "protocolBinding": "JSONRPC", "protocolVersion": "1.0", "url": "http://h:3/rpc" },
            { "protocolBinding": "HTTP+JSON", "protocolVersion": "1.0", "url": "http://h:2/rest" },
        ]));
        assert_eq!(chosen(&rpc_first, None), AgentBinding::JsonRpc);
        // An override picks its binding wherever the card lists it.
        assert_eq!(
            chosen(&rest_first, Some(AgentBinding::JsonRpc)),
            AgentBinding::JsonRpc
        );
        assert_eq!(
            chosen(&rpc_first, Some(AgentBinding::HttpJson)),
            AgentBinding::HttpJson
        );
    }

    #[test]
    fn only_protocol_1_0_at_plain_http_counts() {
        let c = card(json!([
            { "protocolBinding": "JSONRPC", "protocolVersion": "0.3", "url": "http://h:1" },
            { "protocolBinding": "JSONRPC", "protocolVersion": "1.0", "url": "https://h:2" },
            { "protocolBinding": "HTTP+JSON", "protocolVersion": "1.0.1", "url": "http://h:3" },
        ]));
        assert_eq!(chosen(&c, None), AgentBinding::HttpJson);
    }

    #[test]
    fn a_card_without_a_usable_interface_says_what_it_offers() {
        let c = card(json!([
            { "protocolBinding": "GRPC", "protocolVersion": "1.0", "url": "http://h:1" },
            { "protocolBinding": "JSONRPC", "protocolVersion": "0.3", "url": "http://h:2" },
        ]));
        let e = transport_of(&c, None).unwrap_err();
        assert_eq!(
            e,
            DriverError::NoInterface {
                wanted: "JSONRPC or HTTP+JSON".into(),
                offered: "GRPC 1.0 at http://h:1, JSONRPC 0.3 at http://h:2".into(),
            }
        );
        let rpc_only = card(json!([
            { "protocolBinding": "JSONRPC", "protocolVersion": "1.0", "url": "http://h:2" },
        ]));
        let e = transport_of(&rpc_only, Some(AgentBinding::HttpJson)).unwrap_err();
        assert!(
            e.to_string()
                .contains("HTTP+JSON (forced by the driver's options)"),
            "{e}"
        );
        let e = transport_of(&json!({ "name": "x" }), None).unwrap_err();
        assert!(e.to_string().contains("no interface"), "{e}");
    }
}
