//! The JSON-RPC endpoint: the checks every request passes (media type,
//! envelope, `A2A-Version`, peer), the method table, and how a method's
//! reply becomes an HTTP response (JSON, or an SSE stream).
//!
//! Each method is answered by a function of [`RpcCall`] in a module of its
//! own; this module never reads or changes a task itself. The HTTP+JSON
//! binding (`rest`) builds the same [`RpcCall`] with [`Binding::Rest`] and
//! goes through the same method table ([`dispatch`]); the binding only
//! decides how results and errors are framed. Errors become bodies through
//! [`A2aError::to_response`] or [`A2aError::to_status_body`], never built
//! here.

use std::convert::Infallible;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, RawQuery, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use oab_wire::PeerId;
use serde_json::{Map, Value};
use tokio::sync::mpsc;
use tracing::{Instrument as _, warn};

use super::{Inner, RouterState, peer_of};
use crate::a2a::jsonrpc::{
    A2aError, RpcRequest, VERSION_HEADER, check_version, parse_request, result_response,
};
use crate::a2a::profile::{self, PROFILE_URI};
use crate::a2a::tasks::TaskCell;

/// How a call's answers are framed.
#[derive(Debug, Clone)]
pub(super) enum Binding {
    /// JSON-RPC 2.0: every answer (stream events included) is a response
    /// object echoing the request's id.
    JsonRpc(Value),
    /// HTTP+JSON: bare results and stream events; errors are a
    /// `google.rpc.Status` body.
    Rest,
}

impl Binding {
    /// The body (or SSE data) that carries `result`.
    pub(super) fn result(&self, result: Value) -> Value {
        match self {
            Binding::JsonRpc(id) => result_response(id, result),
            Binding::Rest => result,
        }
    }

    /// The body (or SSE `error` event data) that carries `e`.
    pub(super) fn error(&self, e: &A2aError) -> Value {
        match self {
            Binding::JsonRpc(id) => e.to_response(id),
            Binding::Rest => e.to_status_body(),
        }
    }
}

/// One A2A call (from either binding), as every method function gets it.
pub(super) struct RpcCall {
    pub(super) ctx: RouterState,
    /// The peer named by the route.
    pub(super) peer: PeerId,
    /// How answers are framed (for JSON-RPC, with the request's id).
    pub(super) binding: Binding,
    pub(super) params: Map<String, Value>,
    /// Whether the request activated the OAB Delegation Profile.
    pub(super) profile: bool,
    pub(super) headers: HeaderMap,
}

/// What a method answers.
pub(super) enum Reply {
    /// A `result`.
    Result(Value),
    /// An SSE stream of results.
    Stream(mpsc::Receiver<Event>),
}

fn json_response(value: &Value, profile: bool) -> Response {
    let body = serde_json::to_vec(value).unwrap_or_default();
    let mut resp = ([(header::CONTENT_TYPE, "application/json")], body).into_response();
    echo_profile(&mut resp, profile);
    resp
}

pub(super) fn echo_profile(resp: &mut Response, profile: bool) {
    if profile {
        resp.headers_mut().insert(
            profile::EXTENSIONS_HEADER,
            HeaderValue::from_static(PROFILE_URI),
        );
    }
}

pub(super) fn query_param<'a>(query: Option<&'a str>, name: &str) -> Option<&'a str> {
    query?
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .find(|(k, _)| k.eq_ignore_ascii_case(name))
        .map(|(_, v)| v)
}

/// The request must say `Content-Type: application/json` (or a `+json`
/// type; parameters allowed). A missing type, `text/plain` and the form
/// types are what a browser sends cross-site without a CORS preflight, so
/// they are refused before any method runs.
pub(super) fn check_media_type(headers: &HeaderMap, binding: &str) -> Result<(), A2aError> {
    let Some(ct) = headers.get(header::CONTENT_TYPE) else {
        return Err(A2aError::ContentTypeNotSupported(format!(
            "no Content-Type; the {binding} binding takes application/json"
        )));
    };
    let media = ct
        .to_str()
        .unwrap_or_default()
        .split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase();
    if media == "application/json"
        || (media.starts_with("application/") && media.ends_with("+json"))
    {
        Ok(())
    } else {
        Err(A2aError::ContentTypeNotSupported(format!(
            "Content-Type {:?}; the {binding} binding takes application/json",
            media.chars().take(64).collect::<String>()
        )))
    }
}

/// `POST /peers/{namespace}/{name}/`: one JSON-RPC request, checked
/// (media type, envelope, `A2A-Version`, peer), then answered by its method.
pub(super) async fn rpc(
    State(ctx): State<RouterState>,
    Path((namespace, name)): Path<(String, String)>,
    RawQuery(query): RawQuery,
    headers: HeaderMap,
    body: Result<Bytes, axum::extract::rejection::BytesRejection>,
) -> Response {
    let profile = profile::requested(&headers);
    let body = match body {
        Ok(b) => b,
        // A JSON-RPC error, with HTTP 200 as every other.
        Err(e) => {
            return json_response(&super::body_refusal(&e).to_response(&Value::Null), profile);
        }
    };
    if let Err(e) = check_media_type(&headers, "JSON-RPC") {
        let mut resp = json_response(&e.to_response(&Value::Null), profile);
        *resp.status_mut() = StatusCode::UNSUPPORTED_MEDIA_TYPE;
        return resp;
    }
    let RpcRequest { id, method, params } = match parse_request(&body) {
        Ok(r) => r,
        Err((id, e)) => return json_response(&e.to_response(&id), profile),
    };
    let version_header = headers.get(VERSION_HEADER).and_then(|v| v.to_str().ok());
    let version_query = query_param(query.as_deref(), VERSION_HEADER);
    if let Err(e) = check_version(version_header, version_query) {
        return json_response(&e.to_response(&id), profile);
    }
    let Some(peer) = peer_of(&namespace, &name) else {
        let e = A2aError::InvalidParams(format!("no peer {namespace}/{name}"));
        return json_response(&e.to_response(&id), profile);
    };
    let span = tracing::debug_span!("a2a", %peer, %method);
    let call = RpcCall {
        ctx,
        peer,
        binding: Binding::JsonRpc(id.clone()),
        params,
        profile,
        headers,
    };
    let reply = dispatch(&call, &method).instrument(span).await;
    match reply {
        Ok(Reply::Result(v)) => json_response(&result_response(&id, v), profile),
        Ok(Reply::Stream(rx)) => sse_response(rx, profile),
        Err(e) => {
            if let A2aError::Internal(detail) = &e {
                warn!(%detail, "a2a call failed");
            }
            json_response(&e.to_response(&id), profile)
        }
    }
}

/// An SSE response fed by `rx` (the producer is `stream`).
pub(super) fn sse_response(rx: mpsc::Receiver<Event>, profile: bool) -> Response {
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|ev| (Ok::<_, Infallible>(ev), rx))
    });
    let mut resp = Sse::new(stream)
        .keep_alive(KeepAlive::default())
        .into_response();
    echo_profile(&mut resp, profile);
    resp
}

/// The method table: each A2A 1.0 method and the function that answers it.
/// Both bindings call it (`rest` with the method its route names).
pub(super) async fn dispatch(call: &RpcCall, method: &str) -> Result<Reply, A2aError> {
    match method {
        "SendMessage" => call.send_message(false).await,
        "SendStreamingMessage" => call.send_message(true).await,
        "GetTask" => call.get_task(),
        "ListTasks" => call.list_tasks(),
        "CancelTask" => call.cancel_task().await,
        "SubscribeToTask" => call.subscribe_to_task(),
        "GetExtendedAgentCard" => Err(A2aError::ExtendedAgentCardNotConfigured),
        "CreateTaskPushNotificationConfig" => call.create_push_config().await,
        "GetTaskPushNotificationConfig" => call.get_push_config(),
        "ListTaskPushNotificationConfigs" => call.list_push_configs(),
        "DeleteTaskPushNotificationConfig" => call.delete_push_config().await,
        other => Err(A2aError::MethodNotFound(other.chars().take(64).collect())),
    }
}

impl RpcCall {
    /// The facade behind the route.
    pub(super) fn inner(&self) -> &Inner {
        &self.ctx.inner
    }

    /// The task `id` of this call's peer, or `TaskNotFound`.
    pub(super) fn find_task(&self, id: &str) -> Result<Arc<TaskCell>, A2aError> {
        self.inner()
            .tasks
            .find(&self.peer, id)
            .ok_or_else(|| A2aError::TaskNotFound(id.chars().take(256).collect()))
    }
}
