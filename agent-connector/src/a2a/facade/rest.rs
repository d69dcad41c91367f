//! The HTTP+JSON binding (SPEC §11): one route per A2A method under the
//! peer's base, each translated into the params object the JSON-RPC
//! binding would carry and answered by the same method table
//! ([`dispatch`]), so both bindings behave alike (the profile, cursors,
//! streams and errors included).
//!
//! Routes, relative to `/peers/{namespace}/{name}/` (and each also under a
//! leading `{tenant}/` segment, whose value goes into the `tenant` member
//! like a JSON-RPC client's; this facade serves one agent per peer and
//! ignores it):
//!
//! | route | method | params |
//! |---|---|---|
//! | `POST message:send` | `SendMessage` | the body |
//! | `POST message:stream` | `SendStreamingMessage` (SSE) | the body |
//! | `GET tasks/{id}` | `GetTask` | `id`; query (`historyLength`) |
//! | `GET tasks` | `ListTasks` | query (`contextId`, `status`, `pageSize`, …) |
//! | `POST tasks/{id}:cancel` | `CancelTask` | the body (optional), `id` |
//! | `GET` or `POST tasks/{id}:subscribe` | `SubscribeToTask` (SSE) | `id` |
//! | `POST tasks/{id}/pushNotificationConfigs` | `CreateTaskPushNotificationConfig` | the body, `taskId` |
//! | `GET tasks/{id}/pushNotificationConfigs` | `ListTaskPushNotificationConfigs` | query, `taskId` |
//! | `GET tasks/{id}/pushNotificationConfigs/{configId}` | `GetTaskPushNotificationConfig` | `taskId`, `id` |
//! | `DELETE tasks/{id}/pushNotificationConfigs/{configId}` | `DeleteTaskPushNotificationConfig` | `taskId`, `id` |
//! | `GET extendedAgentCard` | `GetExtendedAgentCard` | – |
//!
//! Path members win over body or query members of the same name. Query
//! names are camelCase (snake_case accepted, as in bodies); `true`/`false`
//! are read as booleans for `includeArtifacts`; repeated names: the last
//! wins.
//!
//! Checks, in order: the route (unknown: 404, wrong HTTP method: 405 with
//! `Allow`; empty segments before the route are skipped, so
//! `{base}//message:send` is `{base}/message:send`), the media type of a body or of any `Content-Type` sent
//! (`application/json`, `application/a2a+json` or another `+json` type;
//! else 415; a request without a body may omit it), `A2A-Version`
//! (header or query parameter), the body (JSON object), the peer. Every
//! error is a `google.rpc.Status` body ([`A2aError::to_status_body`]) with
//! the HTTP status of the A2A error table; results are the bare proto JSON
//! (`application/json`, or `application/a2a+json` when the request's
//! `Accept` names it: the specification prefers the latter, the
//! conformance kit requires the former), stream events a bare `StreamResponse` per SSE
//! `data:` line. The browser-safety checks (`guard`) run before any route.
//!
//! Never: answers a method itself, or reads the task table.

use axum::body::Bytes;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Map, Value, json};
use tracing::{Instrument as _, warn};

use super::rpc::{
    Binding, Reply, RpcCall, check_media_type, dispatch, echo_profile, query_param, sse_response,
};
use super::{RouterState, peer_of};
use crate::a2a::jsonrpc::{A2aError, VERSION_HEADER, camelize, check_version};
use crate::a2a::profile;

/// The media type of the binding's bodies (SPEC §11, v1.0.1).
const MEDIA_TYPE: &str = "application/a2a+json";
/// What results and errors are labelled unless the request's `Accept`
/// names [`MEDIA_TYPE`]: the conformance kit requires plain JSON.
const PLAIN_MEDIA_TYPE: &str = "application/json";

/// Query parameters read as booleans.
const BOOLEAN_QUERY: &[&str] = &["includeArtifacts"];

/// Where a route takes the method's params from, besides its path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Input {
    /// The JSON body (an object; empty means `{}`).
    Body,
    /// The query string.
    Query,
    /// Nothing (a body, if any, is checked for its media type only).
    None,
}

/// A matched route: the A2A method, where its params come from, and the
/// members its path sets.
#[derive(Debug)]
struct Route {
    method: &'static str,
    input: Input,
    path_params: Map<String, Value>,
}

/// Why no route matched.
#[derive(Debug, PartialEq, Eq)]
enum NoRoute {
    /// No such path.
    NotFound,
    /// The path exists for these HTTP methods only.
    MethodNotAllowed(&'static str),
}

/// Decodes one percent-encoded path segment; `None` if it is not UTF-8 or
/// holds a bad escape.
fn decode_segment(raw: &str) -> Option<String> {
    let bytes = raw.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while let Some(&b) = bytes.get(i) {
        if b == b'%' {
            let hex = bytes.get(i + 1..i + 3)?;
            let hex = std::str::from_utf8(hex).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(b);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// The first segments a route can start with: anything else first is a
/// tenant.
fn is_route_start(segment: &str) -> bool {
    matches!(
        segment,
        "message:send" | "message:stream" | "tasks" | "extendedAgentCard"
    )
}

fn params(pairs: &[(&str, &str)]) -> Map<String, Value> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_string(), Value::String((*v).to_string())))
        .collect()
}

/// Matches the segments after the peer base (without a tenant).
fn route(method: &Method, segments: &[String]) -> Result<Route, NoRoute> {
    let only = |allowed: &'static str, ok: bool, r: Route| {
        if ok {
            Ok(r)
        } else {
            Err(NoRoute::MethodNotAllowed(allowed))
        }
    };
    let is = |m: &Method| method == m;
    let r = |method: &'static str, input: Input, path_params: Map<String, Value>| Route {
        method,
        input,
        path_params,
    };
    let segs: Vec<&str> = segments.iter().map(String::as_str).collect();
    match segs.as_slice() {
        ["message:send"] => only(
            "POST",
            is(&Method::POST),
            r("SendMessage", Input::Body, Map::new()),
        ),
        ["message:stream"] => only(
            "POST",
            is(&Method::POST),
            r("SendStreamingMessage", Input::Body, Map::new()),
        ),
        ["tasks"] => only(
            "GET",
            is(&Method::GET),
            r("ListTasks", Input::Query, Map::new()),
        ),
        ["extendedAgentCard"] => only(
            "GET",
            is(&Method::GET),
            r("GetExtendedAgentCard", Input::None, Map::new()),
        ),
        ["tasks", task] => {
            if let Some(id) = task.strip_suffix(":cancel").filter(|id| !id.is_empty()) {
                only(
                    "POST",
                    is(&Method::POST),
                    r("CancelTask", Input::Body, params(&[("id", id)])),
                )
            } else if let Some(id) = task.strip_suffix(":subscribe").filter(|id| !id.is_empty()) {
                only(
                    "GET, POST",
                    is(&Method::GET) || is(&Method::POST),
                    r("SubscribeToTask", Input::None, params(&[("id", id)])),
                )
            } else if task.is_empty() {
                Err(NoRoute::NotFound)
            } else {
                only(
                    "GET",
                    is(&Method::GET),
                    r("GetTask", Input::Query, params(&[("id", task)])),
                )
            }
        }
        ["tasks", task, "pushNotificationConfigs"] if !task.is_empty() => {
            let p = params(&[("taskId", task)]);
            if is(&Method::POST) {
                Ok(r("CreateTaskPushNotificationConfig", Input::Body, p))
            } else if is(&Method::GET) {
                Ok(r("ListTaskPushNotificationConfigs", Input::Query, p))
            } else {
                Err(NoRoute::MethodNotAllowed("GET, POST"))
            }
        }
        ["tasks", task, "pushNotificationConfigs", config]
            if !task.is_empty() && !config.is_empty() =>
        {
            let p = params(&[("taskId", task), ("id", config)]);
            if is(&Method::GET) {
                Ok(r("GetTaskPushNotificationConfig", Input::Query, p))
            } else if is(&Method::DELETE) {
                Ok(r("DeleteTaskPushNotificationConfig", Input::None, p))
            } else {
                Err(NoRoute::MethodNotAllowed("GET, DELETE"))
            }
        }
        _ => Err(NoRoute::NotFound),
    }
}

/// Splits a request path into the peer's `namespace`, `name` and the
/// decoded segments after the peer base; `None` if it is not under
/// `/peers/{namespace}/{name}/` or a segment does not decode.
fn split_path(path: &str) -> Option<(String, String, Vec<String>)> {
    let mut raw = path.trim_start_matches('/').split('/');
    if raw.next()? != "peers" {
        return None;
    }
    let namespace = decode_segment(raw.next()?)?;
    let name = decode_segment(raw.next()?)?;
    // A client that joins the interface URL (which ends in `/`) and a
    // route (which starts with one) sends `//message:send`: the empty
    // segments before the route name nothing.
    let rest = raw
        .skip_while(|s| s.is_empty())
        .map(decode_segment)
        .collect::<Option<Vec<_>>>()?;
    Some((namespace, name, rest))
}

/// A matched route and the tenant its path named, if any.
fn resolve(method: &Method, rest: &[String]) -> Result<(Route, Option<String>), NoRoute> {
    match rest.split_first() {
        Some((first, tail)) if !is_route_start(first) && !first.is_empty() && !tail.is_empty() => {
            route(method, tail).map(|r| (r, Some(first.clone())))
        }
        _ => route(method, rest).map(|r| (r, None)),
    }
}

/// The query string as params (without `A2A-Version`).
fn query_params(uri: &Uri) -> Result<Map<String, Value>, A2aError> {
    let Query(pairs) = Query::<Vec<(String, String)>>::try_from_uri(uri)
        .map_err(|e| A2aError::InvalidParams(format!("the query string is not valid: {e}")))?;
    let mut map = Map::new();
    for (k, v) in pairs {
        if k.eq_ignore_ascii_case(VERSION_HEADER) {
            continue;
        }
        map.insert(k, Value::String(v));
    }
    camelize(&mut map);
    for key in BOOLEAN_QUERY {
        if let Some(v) = map.get_mut(*key) {
            match v.as_str() {
                Some("true") => *v = Value::Bool(true),
                Some("false") => *v = Value::Bool(false),
                _ => {}
            }
        }
    }
    Ok(map)
}

/// The body as params: a JSON object (empty body: `{}`).
fn body_params(body: &[u8]) -> Result<Map<String, Value>, A2aError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(Map::new());
    }
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(mut m)) => {
            camelize(&mut m);
            Ok(m)
        }
        Ok(_) => Err(A2aError::InvalidRequest(
            "the body must be a JSON object".into(),
        )),
        Err(e) => Err(A2aError::Parse(format!("the body is not JSON: {e}"))),
    }
}

/// The binding's error response: the A2A error's HTTP status (or
/// `status`), its `google.rpc.Status` body.
fn error_response(e: &A2aError, status: Option<StatusCode>, profile: bool) -> Response {
    let mut body = e.to_status_body();
    let http = status.unwrap_or_else(|| {
        StatusCode::from_u16(e.http_status().0).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
    });
    if let Some(code) = body.pointer_mut("/error/code") {
        *code = json!(http.as_u16());
    }
    let mut resp = (
        http,
        [(header::CONTENT_TYPE, MEDIA_TYPE)],
        serde_json::to_vec(&body).unwrap_or_default(),
    )
        .into_response();
    echo_profile(&mut resp, profile);
    resp
}

fn result_response(value: Value, profile: bool) -> Response {
    // A method without a result (a deletion) answers `{}`.
    let value = if value.is_null() { json!({}) } else { value };
    let mut resp = (
        [(header::CONTENT_TYPE, MEDIA_TYPE)],
        serde_json::to_vec(&value).unwrap_or_default(),
    )
        .into_response();
    echo_profile(&mut resp, profile);
    resp
}

/// Every route under `/peers/{namespace}/{name}/` but the card and the
/// JSON-RPC endpoint: matched, checked, translated into params and
/// answered by [`dispatch`].
pub(super) async fn rest(
    State(ctx): State<RouterState>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Result<Bytes, axum::extract::rejection::BytesRejection>,
) -> Response {
    let body = match body {
        Ok(b) => b,
        Err(e) => {
            let profile = profile::requested(&headers);
            return error_response(
                &super::body_refusal(&e),
                Some(StatusCode::PAYLOAD_TOO_LARGE),
                profile,
            );
        }
    };
    let asks_a2a_json = headers
        .get_all(header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(|v| v.contains(MEDIA_TYPE));
    let mut resp = answer(ctx, method, uri, headers, body).await;
    if !asks_a2a_json
        && resp
            .headers()
            .get(header::CONTENT_TYPE)
            .map(HeaderValue::as_bytes)
            == Some(MEDIA_TYPE.as_bytes())
    {
        resp.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static(PLAIN_MEDIA_TYPE),
        );
    }
    resp
}

/// One HTTP+JSON request's response, labelled [`MEDIA_TYPE`] when JSON.
async fn answer(
    ctx: RouterState,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let profile = profile::requested(&headers);
    let Some((namespace, name, rest)) = split_path(uri.path()) else {
        let e = A2aError::InvalidRequest("the path does not decode".into());
        return error_response(&e, None, profile);
    };
    let (route, tenant) = match resolve(&method, &rest) {
        Ok(r) => r,
        Err(NoRoute::NotFound) => {
            let e = A2aError::MethodNotFound(format!(
                "no HTTP+JSON route {} {}",
                method,
                uri.path().chars().take(128).collect::<String>()
            ));
            return error_response(&e, None, profile);
        }
        Err(NoRoute::MethodNotAllowed(allowed)) => {
            let e = A2aError::MethodNotFound(format!("this route takes {allowed}, not {method}"));
            let mut resp = error_response(&e, Some(StatusCode::METHOD_NOT_ALLOWED), profile);
            resp.headers_mut()
                .insert(header::ALLOW, HeaderValue::from_static(allowed));
            return resp;
        }
    };
    // A body, or a declared one (a form post with no fields still says
    // its type), must be JSON.
    if (!body.is_empty() || headers.contains_key(header::CONTENT_TYPE))
        && let Err(e) = check_media_type(&headers, "HTTP+JSON")
    {
        return error_response(&e, Some(StatusCode::UNSUPPORTED_MEDIA_TYPE), profile);
    }
    let version_header = headers.get(VERSION_HEADER).and_then(|v| v.to_str().ok());
    if let Err(e) = check_version(version_header, query_param(uri.query(), VERSION_HEADER)) {
        return error_response(&e, None, profile);
    }
    let params = match route.input {
        Input::Body => body_params(&body),
        Input::Query => query_params(&uri),
        Input::None => Ok(Map::new()),
    };
    let mut params = match params {
        Ok(p) => p,
        Err(e) => return error_response(&e, None, profile),
    };
    params.extend(route.path_params);
    if let Some(t) = tenant {
        params.insert("tenant".into(), Value::String(t));
    }
    let Some(peer) = peer_of(&namespace, &name) else {
        let e = A2aError::InvalidParams(format!("no peer {namespace}/{name}"));
        return error_response(&e, None, profile);
    };
    let span = tracing::debug_span!("a2a", %peer, method = route.method, binding = "HTTP+JSON");
    let call = RpcCall {
        ctx,
        peer,
        binding: Binding::Rest,
        params,
        profile,
        headers,
    };
    match dispatch(&call, route.method).instrument(span).await {
        Ok(Reply::Result(v)) => result_response(v, profile),
        Ok(Reply::Stream(rx)) => sse_response(rx, profile),
        Err(e) => {
            if let A2aError::Internal(detail) = &e {
                warn!(%detail, "a2a call failed");
            }
            error_response(&e, None, profile)
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::indexing_slicing)]
    use super::*;

    fn segs(path: &str) -> Vec<String> {
        path.split('/').map(str::to_string).collect()
    }

    fn ok(method: Method, path: &str) -> (Route, Option<String>) {
        resolve(&method, &segs(path)).unwrap()
    }

    #[test]
    fn routes_name_their_methods_and_path_members() {
        let cases = [
            (Method::POST, "message:send", "SendMessage", json!({})),
            (
                Method::POST,
                "message:stream",
                "SendStreamingMessage",
                json!({}),
            ),
            (Method::GET, "tasks", "ListTasks", json!({})),
            (Method::GET, "tasks/t1", "GetTask", json!({ "id": "t1" })),
            (
                Method::POST,
                "tasks/t1:cancel",
                "CancelTask",
                json!({ "id": "t1" }),
            ),
            (
                Method::GET,
                "tasks/t1:subscribe",
                "SubscribeToTask",
                json!({ "id": "t1" }),
            ),
            (
                Method::POST,
                "tasks/t1:subscribe",
                "SubscribeToTask",
                json!({ "id": "t1" }),
            ),
            (
                Method::POST,
                "tasks/t1/pushNotificationConfigs",
                "CreateTaskPushNotificationConfig",
                json!({ "taskId": "t1" }),
            ),
            (
                Method::GET,
                "tasks/t1/pushNotificationConfigs",
                "ListTaskPushNotificationConfigs",
                json!({ "taskId": "t1" }),
            ),
            (
                Method::GET,
                "tasks/t1/pushNotificationConfigs/c1",
                "GetTaskPushNotificationConfig",
                json!({ "taskId": "t1", "id": "c1" }),
            ),
            (
                Method::DELETE,
                "tasks/t1/pushNotificationConfigs/c1",
                "DeleteTaskPushNotificationConfig",
                json!({ "taskId": "t1", "id": "c1" }),
            ),
            (
                Method::GET,
                "extendedAgentCard",
                "GetExtendedAgentCard",
                json!({}),
            ),
        ];
        for (m, path, want, members) in cases {
            let (r, tenant) = ok(m.clone(), path);
            assert_eq!(r.method, want, "{m} {path}");
            assert_eq!(Value::Object(r.path_params), members, "{m} {path}");
            assert!(tenant.is_none());
            let (r, tenant) = ok(m.clone(), &format!("acme/{path}"));
            assert_eq!(r.method, want, "{m} acme/{path}");
            assert_eq!(tenant.as_deref(), Some("acme"));
        }
        // A task id with a colon in it.
        let (r, _) = ok(Method::GET, "tasks/a:b");
        assert_eq!(r.path_params["id"], "a:b");
        let (r, _) = ok(Method::POST, "tasks/a:b:cancel");
        assert_eq!(r.path_params["id"], "a:b");
    }

    #[test]
    fn unknown_routes_and_methods_are_refused() {
        for path in ["", "nope", "tasks/", "message:send/x", "a/b/c"] {
            assert_eq!(
                resolve(&Method::GET, &segs(path)).unwrap_err(),
                NoRoute::NotFound,
                "{path}"
            );
        }
        let cases = [
            (Method::GET, "message:send", "POST"),
            (Method::PUT, "tasks", "GET"),
            (Method::POST, "tasks/t1", "GET"),
            (Method::GET, "tasks/t1:cancel", "POST"),
            (Method::DELETE, "tasks/t1:subscribe", "GET, POST"),
            (Method::PUT, "tasks/t1/pushNotificationConfigs", "GET, POST"),
            (
                Method::POST,
                "tasks/t/pushNotificationConfigs/c",
                "GET, DELETE",
            ),
            (Method::POST, "extendedAgentCard", "GET"),
        ];
        for (m, path, allowed) in cases {
            assert_eq!(
                resolve(&m, &segs(path)).unwrap_err(),
                NoRoute::MethodNotAllowed(allowed),
                "{m} {path}"
            );
        }
    }

    #[test]
    fn paths_and_queries_decode() {
        let (ns, name, rest) = split_path("/peers/acme/b%2Dx/tasks/t%2F1:cancel").unwrap();
        assert_eq!((ns.as_str(), name.as_str()), ("acme", "b-x"));
        assert_eq!(rest, ["tasks", "t/1:cancel"]);
        assert!(split_path("/peers/acme/b/tasks/%zz").is_none());
        assert!(split_path("/peers/acme/b/tasks/%ff").is_none());
        assert!(split_path("/other/acme/b/tasks").is_none());
        let uri: Uri = "/peers/a/b/tasks?pageSize=2&include_artifacts=true&status=TASK_STATE_WORKING&A2A-Version=1.0&contextId=c%201"
            .parse()
            .unwrap();
        let q = query_params(&uri).unwrap();
        assert_eq!(
            Value::Object(q),
            json!({ "pageSize": "2", "includeArtifacts": true, "status": "TASK_STATE_WORKING", "contextId": "c 1" })
        );
        assert_eq!(body_params(b" ").unwrap(), Map::new());
        assert_eq!(body_params(b"{x").unwrap_err().code(), -32700);
        assert_eq!(body_params(b"[1]").unwrap_err().code(), -32600);
        assert_eq!(
            body_params(br#"{"message":{"message_id":"m"}}"#).unwrap()["message"]["messageId"],
            "m"
        );
    }
}
