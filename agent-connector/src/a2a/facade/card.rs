//! Agent cards and the peer list: the facade's two `GET` routes.
//!
//! Owns the card served for a peer (built from the descriptor the peer
//! published through the relay), its `ETag` and `Last-Modified`, and the cached peer list the
//! card lookup falls back to. It never starts, reads or changes a task and
//! never holds the peer-list lock across an await.

use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use oab_wire::{PeerEntry, PeerId};
use serde_json::{Map, Value, json};
use std::collections::HashMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use super::{Facade, Inner, RouterState, peer_of};
use crate::a2a::{HTTP_JSON_BINDING, JSONRPC_BINDING, PROTOCOL_VERSION, profile};

/// The base URL clients reach the facade at: the configured one, else
/// `http://` and the request's `Host` (when it is a plain host name).
fn base_url(inner: &Inner, headers: &HeaderMap) -> String {
    if let Some(u) = &inner.options.public_url {
        return u.trim_end_matches('/').to_string();
    }
    let host = headers
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .filter(|h| {
            !h.is_empty()
                && h.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b".-:[]".contains(&b))
        })
        .unwrap_or("127.0.0.1");
    format!("http://{host}")
}

/// How many peers' card dates a facade keeps. Past it the dates start
/// over (every card then reads as modified when next served: a client
/// fetches it once more, nothing else).
const MAX_CARD_DATES: usize = 4096;

/// When each peer's card was first served with its current content: the
/// card's `Last-Modified`. A card is built anew per request from the
/// descriptor the peer published; its date moves when its ETag does.
#[derive(Debug, Default)]
pub(super) struct CardDates {
    by_peer: HashMap<PeerId, (String, SystemTime)>,
}

impl CardDates {
    /// The date of `peer`'s card with ETag `etag` (whole seconds, as HTTP
    /// dates are): now if the content is new, and always later than the
    /// date of the content it replaces (a change within the same second
    /// still moves the date, so `If-Modified-Since` never hides it).
    fn modified(&mut self, peer: &PeerId, etag: &str) -> SystemTime {
        let before = match self.by_peer.get(peer) {
            Some((e, at)) if e == etag => return *at,
            Some((_, at)) => Some(*at),
            None => None,
        };
        let mut now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(UNIX_EPOCH, |d| {
                UNIX_EPOCH + Duration::from_secs(d.as_secs())
            });
        if let Some(at) = before
            && now <= at
        {
            now = at + Duration::from_secs(1);
        }
        if self.by_peer.len() >= MAX_CARD_DATES && !self.by_peer.contains_key(peer) {
            self.by_peer.clear();
        }
        self.by_peer.insert(peer.clone(), (etag.to_string(), now));
        now
    }
}

/// What the relay says about a peer.
enum PeerLookup {
    /// The relay's fresh list has it (with its published descriptor).
    Found(PeerEntry),
    /// The relay's fresh list does not have it.
    Absent,
    /// The list could not be had in time.
    Unknown,
}

async fn lookup_peer(inner: &Inner, peer: &PeerId) -> PeerLookup {
    let fresh =
        tokio::time::timeout(inner.options.peer_lookup_timeout, inner.caller.list_peers()).await;
    match fresh {
        Ok(Ok(list)) => {
            let found = list.iter().find(|e| &e.peer == peer).cloned();
            *inner.peers.lock() = Some(list);
            found.map_or(PeerLookup::Absent, PeerLookup::Found)
        }
        _ => inner
            .peers
            .lock()
            .as_ref()
            .and_then(|l| l.iter().find(|e| &e.peer == peer).cloned())
            .map_or(PeerLookup::Unknown, PeerLookup::Found),
    }
}

/// The card served for `peer`: the published descriptor with this facade's
/// interfaces (JSON-RPC first, then HTTP+JSON, both at `interface_url`),
/// capabilities and the profile declared; what the facade cannot
/// honour (security schemes, signatures, the callee's own extensions,
/// 0.3 connection fields) removed.
pub fn build_card(peer: &PeerId, descriptor: Option<&Value>, interface_url: &str) -> Value {
    let mut card = descriptor
        .and_then(Value::as_object)
        .cloned()
        .unwrap_or_default();
    for k in [
        "url",
        "preferredTransport",
        "additionalInterfaces",
        "protocolVersion",
        "signatures",
        "securitySchemes",
        "securityRequirements",
        "security",
        "supportsAuthenticatedExtendedCard",
    ] {
        card.remove(k);
    }
    let text_or = |card: &Map<String, Value>, k: &str| {
        card.get(k)
            .and_then(Value::as_str)
            .filter(|s| !s.is_empty())
            .is_none()
    };
    if text_or(&card, "name") {
        card.insert("name".into(), json!(peer.as_str()));
    }
    if text_or(&card, "description") {
        card.insert(
            "description".into(),
            json!(format!("OAB peer {peer}, reached through the OAB relay.")),
        );
    }
    if text_or(&card, "version") {
        card.insert("version".into(), json!("1.0.0"));
    }
    for k in ["defaultInputModes", "defaultOutputModes"] {
        if card
            .get(k)
            .and_then(Value::as_array)
            .is_none_or(Vec::is_empty)
        {
            card.insert(k.into(), json!(["text/plain"]));
        }
    }
    let mut skills: Vec<Value> = card
        .get("skills")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default()
        .into_iter()
        .filter(Value::is_object)
        .collect();
    for s in &mut skills {
        if let Some(o) = s.as_object_mut() {
            o.remove("securityRequirements");
            o.remove("security");
        }
    }
    if skills.is_empty() {
        skills.push(json!({
            "id": "delegate",
            "name": "Delegate a task",
            "description": format!("Delegates a bounded task to {peer} through the OAB relay."),
            "tags": ["oab", "delegation"],
        }));
    }
    card.insert("skills".into(), Value::Array(skills));
    card.insert(
        "supportedInterfaces".into(),
        json!([
            {
                "url": interface_url,
                "protocolBinding": JSONRPC_BINDING,
                "protocolVersion": PROTOCOL_VERSION,
            },
            {
                "url": interface_url,
                "protocolBinding": HTTP_JSON_BINDING,
                "protocolVersion": PROTOCOL_VERSION,
            },
        ]),
    );
    card.insert(
        "capabilities".into(),
        json!({
            "streaming": true,
            "pushNotifications": true,
            "extendedAgentCard": false,
            "extensions": [profile::agent_extension()],
        }),
    );
    Value::Object(card)
}

/// `GET /peers/{namespace}/{name}/.well-known/agent-card.json`.
pub(super) async fn agent_card(
    State(ctx): State<RouterState>,
    Path((namespace, name)): Path<(String, String)>,
    headers: HeaderMap,
) -> Response {
    let Some(peer) = peer_of(&namespace, &name) else {
        return (StatusCode::NOT_FOUND, "no such peer\n").into_response();
    };
    let descriptor = match lookup_peer(&ctx.inner, &peer).await {
        PeerLookup::Found(e) => e.descriptor,
        PeerLookup::Absent => {
            return (StatusCode::NOT_FOUND, "this host may not reach that peer\n").into_response();
        }
        PeerLookup::Unknown => None,
    };
    let url = Facade::interface_url(&base_url(&ctx.inner, &headers), &peer);
    let card = build_card(&peer, descriptor.as_ref(), &url);
    let body = serde_json::to_vec(&card).unwrap_or_default();
    let etag = format!("\"{}\"", &oab_wire::Digest::of(&body).to_string()[7..39]);
    let modified = ctx.inner.card_dates.lock().modified(&peer, &etag);
    // `If-None-Match` wins over `If-Modified-Since` (RFC 9110 §13.1.3).
    let not_modified = match headers.get(header::IF_NONE_MATCH) {
        Some(v) => v
            .to_str()
            .is_ok_and(|v| v.split(',').any(|t| t.trim() == etag || t.trim() == "*")),
        None => headers
            .get(header::IF_MODIFIED_SINCE)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| httpdate::parse_http_date(v).ok())
            .is_some_and(|since| modified <= since),
    };
    let mut resp = if not_modified {
        StatusCode::NOT_MODIFIED.into_response()
    } else {
        ([(header::CONTENT_TYPE, "application/json")], body).into_response()
    };
    if let Ok(v) = HeaderValue::from_str(&etag) {
        resp.headers_mut().insert(header::ETAG, v);
    }
    if let Ok(v) = HeaderValue::from_str(&httpdate::fmt_http_date(modified)) {
        resp.headers_mut().insert(header::LAST_MODIFIED, v);
    }
    // Short-lived: a peer may publish a new card at any time (ETag revalidates).
    resp.headers_mut().insert(
        header::CACHE_CONTROL,
        HeaderValue::from_static("max-age=60"),
    );
    resp
}

/// `GET /peers`: the reachable peers, online state and card URLs.
pub(super) async fn list_peers(State(ctx): State<RouterState>, headers: HeaderMap) -> Response {
    let base = base_url(&ctx.inner, &headers);
    let list = tokio::time::timeout(
        ctx.inner.options.peer_lookup_timeout,
        ctx.inner.caller.list_peers(),
    )
    .await;
    let Ok(Ok(list)) = list else {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            "the relay's peer list is not available\n",
        )
            .into_response();
    };
    *ctx.inner.peers.lock() = Some(list.clone());
    let peers: Vec<Value> = list
        .iter()
        .map(|e| {
            json!({
                "peer": e.peer.as_str(),
                "online": e.online,
                "agentCard": format!("{}.well-known/agent-card.json", Facade::interface_url(&base, &e.peer)),
                "url": Facade::interface_url(&base, &e.peer),
            })
        })
        .collect();
    axum::Json(json!({ "peers": peers })).into_response()
}
