//! The binding the driver speaks to the local A2A server, chosen from the
//! server's card (see `card.rs`). [`AgentTransport`] has one variant
//! per binding; the driver's turns call it and never see the wire format.

use std::time::Duration;

use oab_wire::TraceId;
use serde_json::Value;

use super::DriverError;
use super::call::Call;
use super::jsonrpc::JsonRpc;
use super::rest::Rest;
use super::sse::SseEvent;
use crate::a2a::AgentBinding;

tokio::task_local! {
    /// The trace of the delegation whose turn is running: each request the
    /// driver sends for it carries a W3C `traceparent` header with this
    /// trace id (a fresh span id per request), so the agent sees the trace
    /// the caller started.
    pub(super) static TRACE: TraceId;
}

/// `req` with the running delegation's `traceparent` header, if any.
pub(super) fn traced(req: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
    match TRACE.try_with(|t| t.traceparent()) {
        Ok(header) => req.header("traceparent", header),
        Err(_) => req,
    }
}

/// How the driver talks to the local A2A server.
#[derive(Debug, Clone)]
pub(super) enum AgentTransport {
    /// JSON-RPC 2.0 (SPEC §9).
    JsonRpc(JsonRpc),
    /// HTTP+JSON, the REST binding (SPEC §11).
    Rest(Rest),
}

impl AgentTransport {
    /// The binding spoken.
    pub(super) fn binding(&self) -> AgentBinding {
        match self {
            AgentTransport::JsonRpc(_) => AgentBinding::JsonRpc,
            AgentTransport::Rest(_) => AgentBinding::HttpJson,
        }
    }

    /// Sends `call`; [`Call::bounded`] calls are bounded by `timeout`.
    pub(super) async fn send(
        &self,
        http: &reqwest::Client,
        call: Call<'_>,
        timeout: Duration,
    ) -> reqwest::Result<reqwest::Response> {
        match self {
            AgentTransport::JsonRpc(t) => t.send(http, call, timeout).await,
            AgentTransport::Rest(t) => t.send(http, call, timeout).await,
        }
    }

    /// A JSON (not SSE) answer: the operation's result (a Task, or a
    /// SendMessageResponse / StreamResponse object), or the A2A error the
    /// server answered with ([`DriverError::Rpc`]).
    pub(super) async fn decode(&self, resp: reqwest::Response) -> Result<Value, DriverError> {
        match self {
            AgentTransport::JsonRpc(t) => t.decode(resp).await,
            AgentTransport::Rest(t) => t.decode(resp).await,
        }
    }

    /// One SSE event of a stream: its StreamResponse, or why the turn fails
    /// (an error the server sent in the stream, or data that is not A2A).
    pub(super) fn event(&self, ev: &SseEvent) -> Result<Value, String> {
        match self {
            AgentTransport::JsonRpc(t) => t.event(ev),
            AgentTransport::Rest(t) => t.event(ev),
        }
    }
}
