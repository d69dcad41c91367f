//! `ListTasks`: this peer's tasks from the task table, filtered (context,
//! state, status time), newest status first, in pages whose token is the
//! offset (`o<n>`). Never waits and never touches a delegation.

use serde_json::{Value, json};

use super::params::{history_length, param_bool, param_count, param_str};
use super::rpc::{Reply, RpcCall};
use crate::a2a::jsonrpc::A2aError;
use crate::a2a::model::{TaskState, ms_from_iso};

impl RpcCall {
    /// `ListTasks`: one page of this peer's tasks matching the filters.
    pub(super) fn list_tasks(&self) -> Result<Reply, A2aError> {
        let p = &self.params;
        let context = param_str(p, "contextId")?;
        let status = match param_str(p, "status")? {
            None | Some("" | "TASK_STATE_UNSPECIFIED") => None,
            Some(s) => Some(
                TaskState::parse(s)
                    .ok_or_else(|| A2aError::InvalidParams(format!("unknown status {s:?}")))?,
            ),
        };
        let page_size = match param_count(p, "pageSize")? {
            None | Some(0) => 50,
            Some(n @ 1..=100) => n as usize,
            Some(n) => {
                return Err(A2aError::InvalidParams(format!(
                    "pageSize {n} is outside 1..=100"
                )));
            }
        };
        let offset = match param_str(p, "pageToken")? {
            None | Some("") => 0,
            Some(t) => t
                .strip_prefix("o")
                .and_then(|n| n.parse::<usize>().ok())
                .ok_or_else(|| {
                    A2aError::InvalidParams("pageToken is not one this server made".into())
                })?,
        };
        let history = history_length(p)?;
        let after_ms = match param_str(p, "statusTimestampAfter")? {
            None | Some("") => None,
            Some(s) => Some(ms_from_iso(s).ok_or_else(|| {
                A2aError::InvalidParams("statusTimestampAfter is not an ISO-8601 timestamp".into())
            })?),
        };
        let include_artifacts = param_bool(p, "includeArtifacts")?.unwrap_or(false);
        let mut rows: Vec<(u64, u64, Value)> = Vec::new();
        for cell in self.inner().tasks.of_peer(&self.peer) {
            let id = cell.public_id();
            let rec = cell.lock();
            if context.is_some_and(|c| c != rec.context_id)
                || status.is_some_and(|s| s != rec.state)
                || after_ms.is_some_and(|t| rec.status_ms <= t)
            {
                continue;
            }
            let task = rec.render_task(&cell, &id, history, include_artifacts, self.profile);
            rows.push((rec.status_ms, rec.created_ms, task));
        }
        rows.sort_by_key(|r| std::cmp::Reverse((r.0, r.1)));
        let total = rows.len();
        let tasks: Vec<Value> = rows
            .into_iter()
            .skip(offset)
            .take(page_size)
            .map(|r| r.2)
            .collect();
        let next = if offset + tasks.len() < total {
            format!("o{}", offset + tasks.len())
        } else {
            String::new()
        };
        Ok(Reply::Result(json!({
            "tasks": tasks,
            "nextPageToken": next,
            "pageSize": page_size,
            "totalSize": total,
        })))
    }
}
