//! Reading typed members out of a method's params (or its `configuration`):
//! strings, the task id, booleans, counts and `historyLength`. A member of
//! the wrong type is `InvalidParams` naming the member. Never touches a task.

use serde_json::{Map, Value};

use crate::a2a::jsonrpc::A2aError;

/// The string member `key`, if present.
pub(super) fn param_str<'a>(
    params: &'a Map<String, Value>,
    key: &str,
) -> Result<Option<&'a str>, A2aError> {
    match params.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.as_str())),
        Some(_) => Err(A2aError::InvalidParams(format!("{key} must be a string"))),
    }
}

/// The task id (`id`), which every task method requires.
pub(super) fn required_id(params: &Map<String, Value>) -> Result<&str, A2aError> {
    param_str(params, "id")?
        .filter(|s| !s.is_empty())
        .ok_or_else(|| A2aError::InvalidParams("id is required".into()))
}

/// The boolean member `key`, if present.
pub(super) fn param_bool(params: &Map<String, Value>, key: &str) -> Result<Option<bool>, A2aError> {
    match params.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(_) => Err(A2aError::InvalidParams(format!("{key} must be a boolean"))),
    }
}

/// The non-negative integer member `key` (a number or a decimal string),
/// if present.
pub(super) fn param_count(params: &Map<String, Value>, key: &str) -> Result<Option<u64>, A2aError> {
    match params.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .or_else(|| v.as_str().and_then(|s| s.parse().ok()))
            .map(Some)
            .ok_or_else(|| {
                A2aError::InvalidParams(format!("{key} must be a non-negative integer"))
            }),
    }
}

/// `historyLength`: how many history messages to show (`None`: all).
pub(super) fn history_length(params: &Map<String, Value>) -> Result<Option<usize>, A2aError> {
    Ok(param_count(params, "historyLength")?.map(|n| usize::try_from(n).unwrap_or(usize::MAX)))
}
