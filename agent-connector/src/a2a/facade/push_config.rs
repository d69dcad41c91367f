//! The push notification config methods (SPEC §3.1.7–3.1.10):
//! `CreateTaskPushNotificationConfig`, `GetTaskPushNotificationConfig`,
//! `ListTaskPushNotificationConfigs`, `DeleteTaskPushNotificationConfig`,
//! and the `taskPushNotificationConfig` of a send ([`config_of_send`]).
//!
//! Each method is a function from its typed params (the proto request in
//! camelCase, as every binding hands it over) to its result, so the
//! JSON-RPC method table and any other binding call the same code.
//!
//! - Create: params are a `TaskPushNotificationConfig`; `taskId` must name
//!   a task of the peer (else `TaskNotFound`), `url` is required and must
//!   pass the webhook rule (else `InvalidParams`, see `webhook`). Without
//!   an `id` one is minted; an existing `id` replaces that config. Result:
//!   the stored config. Delivery starts after the task's last event.
//! - Get: `taskId`, `id`; an unknown config is `TaskNotFound` (SPEC §3.1.8).
//! - List: `taskId`, `pageSize` (unset or 0: all; at most 100), opaque
//!   `pageToken`; result `{configs, nextPageToken}` (`""` on the last page).
//! - Delete: `taskId`, `id`; idempotent (an unknown config is no error);
//!   result `{}` (`google.protobuf.Empty`).
//!
//! Configs are saved (with a state folder) before Create answers.

use std::sync::Arc;

use oab_wire::PeerId;
use serde_json::{Map, Value, json};

use super::Inner;
use super::params::{param_count, param_str};
use super::push::{NewConfig, PushAuth, PushConfig, commit_terminal, persist};
use super::rpc::{Reply, RpcCall};
use crate::a2a::jsonrpc::A2aError;
use crate::a2a::model::fresh_id;
use crate::a2a::tasks::TaskCell;

/// Longest config id, token, scheme or credentials accepted (bytes).
const MAX_ID_BYTES: usize = 256;
const MAX_SECRET_BYTES: usize = 4_096;
const MAX_SCHEME_BYTES: usize = 64;
/// Largest `pageSize` of `ListTaskPushNotificationConfigs`.
const MAX_PAGE_SIZE: u64 = 100;

/// A header value: printable ASCII (spaces allowed), no line breaks.
fn header_safe(s: &str) -> bool {
    s.bytes().all(|b| (0x20..0x7f).contains(&b))
}

/// Reads a `TaskPushNotificationConfig` (or a send's
/// `taskPushNotificationConfig`) into a config starting at `next`.
pub(super) fn parse_config(
    inner: &Inner,
    v: &Map<String, Value>,
    next: u64,
    profile: bool,
) -> Result<PushConfig, A2aError> {
    let bad = |m: &str| A2aError::InvalidParams(m.to_string());
    let url = param_str(v, "url")?
        .filter(|u| !u.is_empty())
        .ok_or_else(|| bad("url is required"))?;
    inner.push.check_url(url)?;
    let id = match param_str(v, "id")?.filter(|s| !s.is_empty()) {
        Some(id) if id.len() <= MAX_ID_BYTES && id.bytes().all(|b| b.is_ascii_graphic()) => {
            id.to_string()
        }
        Some(_) => {
            return Err(bad(
                "id must be at most 256 bytes of printable ASCII without spaces",
            ));
        }
        None => fresh_id("push"),
    };
    let token = match param_str(v, "token")?.filter(|s| !s.is_empty()) {
        Some(t) if t.len() <= MAX_SECRET_BYTES && header_safe(t) => Some(t.to_string()),
        Some(_) => return Err(bad("token must be at most 4096 bytes of printable ASCII")),
        None => None,
    };
    let authentication = match v.get("authentication") {
        None | Some(Value::Null) => None,
        Some(Value::Object(a)) => {
            let scheme = param_str(a, "scheme")?
                .filter(|s| !s.is_empty())
                .ok_or_else(|| bad("authentication.scheme is required"))?;
            if scheme.len() > MAX_SCHEME_BYTES
                || !scheme
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
            {
                return Err(bad(
                    "authentication.scheme must be an HTTP auth scheme name",
                ));
            }
            let credentials = match param_str(a, "credentials")?.filter(|s| !s.is_empty()) {
                Some(c) if c.len() <= MAX_SECRET_BYTES && header_safe(c) => Some(c.to_string()),
                Some(_) => {
                    return Err(bad(
                        "authentication.credentials must be at most 4096 bytes of printable ASCII",
                    ));
                }
                None => None,
            };
            Some(PushAuth {
                scheme: scheme.to_string(),
                credentials,
            })
        }
        Some(_) => return Err(bad("authentication must be an object")),
    };
    Ok(PushConfig {
        id,
        task_id: None,
        url: url.to_string(),
        token,
        authentication,
        profile,
        next,
    })
}

/// The `taskPushNotificationConfig` of a send's `configuration`, checked
/// (before any delegation starts); `None` when there is none.
pub(super) fn config_of_send(
    inner: &Inner,
    configuration: &Map<String, Value>,
    profile: bool,
) -> Result<Option<PushConfig>, A2aError> {
    match configuration.get("taskPushNotificationConfig") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Object(c)) => parse_config(inner, c, 0, profile).map(Some),
        Some(_) => Err(A2aError::InvalidParams(
            "taskPushNotificationConfig must be an object".into(),
        )),
    }
}

/// Registers a send's config for `cell` and saves it; `from_start`: the
/// webhook gets the task as created and every event (a new task), else the
/// events after the task's last one (a follow-up or a re-sent message).
pub(super) async fn register_for_send(
    inner: &Arc<Inner>,
    cell: &Arc<TaskCell>,
    mut config: PushConfig,
    task_id: Option<String>,
    from_start: bool,
) -> Result<(), A2aError> {
    config.task_id = task_id;
    config.next = if from_start {
        0
    } else {
        cell.lock().last_seq + 1
    };
    inner.push.register(inner, cell, NewConfig { config })?;
    save(inner, cell).await;
    Ok(())
}

async fn save(inner: &Arc<Inner>, cell: &TaskCell) {
    if let Err(e) = persist(inner, &cell.handle.key).await {
        tracing::warn!(error = %e, "could not save a push notification config; a restart will not take it back");
    }
}

/// The task `id` of `peer`, or `TaskNotFound`.
fn task_of(inner: &Inner, peer: &PeerId, id: &str) -> Result<Arc<TaskCell>, A2aError> {
    inner
        .tasks
        .find(peer, id)
        .ok_or_else(|| A2aError::TaskNotFound(id.chars().take(256).collect()))
}

fn required<'a>(params: &'a Map<String, Value>, key: &str) -> Result<&'a str, A2aError> {
    param_str(params, key)?
        .filter(|s| !s.is_empty())
        .ok_or_else(|| A2aError::InvalidParams(format!("{key} is required")))
}

/// `CreateTaskPushNotificationConfig`.
pub(super) async fn create_task_push_notification_config(
    inner: &Arc<Inner>,
    peer: &PeerId,
    params: &Map<String, Value>,
    profile: bool,
) -> Result<Value, A2aError> {
    let task_id = required(params, "taskId")?;
    let cell = task_of(inner, peer, task_id)?;
    let next = cell.lock().last_seq + 1;
    let mut config = parse_config(inner, params, next, profile)?;
    config.task_id = Some(task_id.to_string());
    let stored = inner.push.register(inner, &cell, NewConfig { config })?;
    save(inner, &cell).await;
    Ok(stored.to_a2a(task_id))
}

/// `GetTaskPushNotificationConfig`.
pub(super) fn get_task_push_notification_config(
    inner: &Inner,
    peer: &PeerId,
    params: &Map<String, Value>,
) -> Result<Value, A2aError> {
    let task_id = required(params, "taskId")?;
    let id = required(params, "id")?;
    let cell = task_of(inner, peer, task_id)?;
    inner
        .push
        .list(&cell)
        .into_iter()
        .find(|c| c.id == id)
        .map(|c| c.to_a2a(task_id))
        .ok_or_else(|| {
            A2aError::TaskNotFound(format!(
                "task {} has no push notification config {}",
                task_id.chars().take(256).collect::<String>(),
                id.chars().take(256).collect::<String>()
            ))
        })
}

/// `ListTaskPushNotificationConfigs`.
pub(super) fn list_task_push_notification_configs(
    inner: &Inner,
    peer: &PeerId,
    params: &Map<String, Value>,
) -> Result<Value, A2aError> {
    let task_id = required(params, "taskId")?;
    let cell = task_of(inner, peer, task_id)?;
    let size = match param_count(params, "pageSize")? {
        None | Some(0) => usize::MAX,
        Some(n) if n <= MAX_PAGE_SIZE => usize::try_from(n).unwrap_or(usize::MAX),
        Some(_) => {
            return Err(A2aError::InvalidParams(format!(
                "pageSize must be between 1 and {MAX_PAGE_SIZE}"
            )));
        }
    };
    let start = match param_str(params, "pageToken")?.filter(|s| !s.is_empty()) {
        None => 0,
        Some(t) => t
            .strip_prefix("o")
            .and_then(|n| n.parse::<usize>().ok())
            .ok_or_else(|| {
                A2aError::InvalidParams("pageToken is not one this facade made".into())
            })?,
    };
    let all = inner.push.list(&cell);
    let page: Vec<Value> = all
        .iter()
        .skip(start)
        .take(size)
        .map(|c| c.to_a2a(task_id))
        .collect();
    let end = start.saturating_add(page.len());
    let next = if end < all.len() {
        format!("o{end}")
    } else {
        String::new()
    };
    Ok(json!({ "configs": page, "nextPageToken": next }))
}

/// `DeleteTaskPushNotificationConfig`.
pub(super) async fn delete_task_push_notification_config(
    inner: &Arc<Inner>,
    peer: &PeerId,
    params: &Map<String, Value>,
) -> Result<Value, A2aError> {
    let task_id = required(params, "taskId")?;
    let id = required(params, "id")?;
    let cell = task_of(inner, peer, task_id)?;
    let commit = inner.push.remove(&cell, id);
    save(inner, &cell).await;
    if let Some(ev) = commit {
        commit_terminal(inner, &cell, ev).await;
    }
    Ok(json!({}))
}

impl RpcCall {
    /// `CreateTaskPushNotificationConfig` over JSON-RPC.
    pub(super) async fn create_push_config(&self) -> Result<Reply, A2aError> {
        create_task_push_notification_config(
            &self.ctx.inner,
            &self.peer,
            &self.params,
            self.profile,
        )
        .await
        .map(Reply::Result)
    }

    /// `GetTaskPushNotificationConfig` over JSON-RPC.
    pub(super) fn get_push_config(&self) -> Result<Reply, A2aError> {
        get_task_push_notification_config(self.inner(), &self.peer, &self.params).map(Reply::Result)
    }

    /// `ListTaskPushNotificationConfigs` over JSON-RPC.
    pub(super) fn list_push_configs(&self) -> Result<Reply, A2aError> {
        list_task_push_notification_configs(self.inner(), &self.peer, &self.params)
            .map(Reply::Result)
    }

    /// `DeleteTaskPushNotificationConfig` over JSON-RPC.
    pub(super) async fn delete_push_config(&self) -> Result<Reply, A2aError> {
        delete_task_push_notification_config(&self.ctx.inner, &self.peer, &self.params)
            .await
            .map(Reply::Result)
    }
}
