//! A2A 1.0 JSON shapes used at both ends: task states, timestamps, message
//! validation and the conversion between A2A artifacts and the profile's
//! [`Artifact`].
//!
//! A2A objects are handled as JSON values (camelCase, ProtoJSON enum
//! strings), not as typed structs: the facade and the driver forward
//! members they do not know, as the spec asks servers to tolerate them.
//!
//! Never: keeps state or touches a socket or a file, and never indexes into a
//! JSON value: every member is read with `get` and a fallback, so no client's
//! or server's JSON can make these functions panic.

use serde_json::{Map, Value, json};

use super::jsonrpc::A2aError;
use crate::profile::Artifact;

/// The media type of a profile [`Artifact`] that carries A2A parts which do
/// not fit its single text/data/url slot (several parts, raw bytes, file
/// names, part metadata): its `data` is `{"parts": [...], "description",
/// "metadata"}` and converts back losslessly.
pub const PARTS_MEDIA_TYPE: &str = "application/vnd.oab.a2a-parts+json";

/// A task state (SPEC "TaskState"), parsed from its 1.0 wire name or its
/// 0.3 name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TaskState {
    /// `TASK_STATE_SUBMITTED`.
    Submitted,
    /// `TASK_STATE_WORKING`.
    Working,
    /// `TASK_STATE_INPUT_REQUIRED` (interrupted).
    InputRequired,
    /// `TASK_STATE_AUTH_REQUIRED` (interrupted).
    AuthRequired,
    /// `TASK_STATE_COMPLETED` (terminal).
    Completed,
    /// `TASK_STATE_FAILED` (terminal).
    Failed,
    /// `TASK_STATE_CANCELED` (terminal).
    Canceled,
    /// `TASK_STATE_REJECTED` (terminal).
    Rejected,
}

impl TaskState {
    /// The 1.0 wire string.
    pub fn as_str(self) -> &'static str {
        match self {
            TaskState::Submitted => "TASK_STATE_SUBMITTED",
            TaskState::Working => "TASK_STATE_WORKING",
            TaskState::InputRequired => "TASK_STATE_INPUT_REQUIRED",
            TaskState::AuthRequired => "TASK_STATE_AUTH_REQUIRED",
            TaskState::Completed => "TASK_STATE_COMPLETED",
            TaskState::Failed => "TASK_STATE_FAILED",
            TaskState::Canceled => "TASK_STATE_CANCELED",
            TaskState::Rejected => "TASK_STATE_REJECTED",
        }
    }

    /// Parses a 1.0 (`TASK_STATE_WORKING`) or 0.3 (`working`) name.
    pub fn parse(s: &str) -> Option<TaskState> {
        Some(match s {
            "TASK_STATE_SUBMITTED" | "submitted" => TaskState::Submitted,
            "TASK_STATE_WORKING" | "working" => TaskState::Working,
            "TASK_STATE_INPUT_REQUIRED" | "input-required" | "input_required" => {
                TaskState::InputRequired
            }
            "TASK_STATE_AUTH_REQUIRED" | "auth-required" | "auth_required" => {
                TaskState::AuthRequired
            }
            "TASK_STATE_COMPLETED" | "completed" => TaskState::Completed,
            "TASK_STATE_FAILED" | "failed" => TaskState::Failed,
            "TASK_STATE_CANCELED" | "canceled" | "cancelled" => TaskState::Canceled,
            "TASK_STATE_REJECTED" | "rejected" => TaskState::Rejected,
            _ => return None,
        })
    }

    /// Completed, failed, canceled or rejected: the task never changes again.
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            TaskState::Completed | TaskState::Failed | TaskState::Canceled | TaskState::Rejected
        )
    }

    /// Input or auth required: the agent waits for the client.
    pub fn is_interrupted(self) -> bool {
        matches!(self, TaskState::InputRequired | TaskState::AuthRequired)
    }
}

/// Milliseconds since the Unix epoch, now.
pub fn now_ms() -> u64 {
    oab_wire::identity::now_ms()
}

/// ISO-8601 UTC with milliseconds and a `Z` suffix (SPEC §5.6), e.g.
/// `2026-11-01T12:00:00.000Z`.
pub fn iso_from_ms(ms: u64) -> String {
    let secs = ms / 1000;
    let millis = ms % 1000;
    let days = i64::try_from(secs / 86_400).unwrap_or(i64::MAX / 2);
    let rem = secs % 86_400;
    let (y, m, d) = civil_from_days(days);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{millis:03}Z",
        rem / 3600,
        (rem % 3600) / 60,
        rem % 60
    )
}

/// Parses `YYYY-MM-DDTHH:MM:SS[.fff...](Z|+00:00)` into Unix milliseconds.
/// Other offsets are applied; anything else is `None`.
pub fn ms_from_iso(s: &str) -> Option<u64> {
    let b = s.as_bytes();
    let num = |r: std::ops::Range<usize>| -> Option<i64> {
        let t = s.get(r)?;
        if !t.bytes().all(|c| c.is_ascii_digit()) {
            return None;
        }
        t.parse().ok()
    };
    if b.len() < 19 || b.get(4) != Some(&b'-') || b.get(7) != Some(&b'-') {
        return None;
    }
    if !matches!(b.get(10), Some(b'T' | b't' | b' ')) || b.get(13) != Some(&b':') {
        return None;
    }
    let (y, mo, d) = (num(0..4)?, num(5..7)?, num(8..10)?);
    let (h, mi, sec) = (num(11..13)?, num(14..16)?, num(17..19)?);
    if !(1..=12).contains(&mo) || !(1..=31).contains(&d) || h > 23 || mi > 59 || sec > 60 {
        return None;
    }
    let mut i = 19;
    let mut millis = 0i64;
    if b.get(i) == Some(&b'.') {
        i += 1;
        let start = i;
        while b.get(i).is_some_and(u8::is_ascii_digit) {
            i += 1;
        }
        let frac = s.get(start..i)?;
        if frac.is_empty() {
            return None;
        }
        let padded: String = frac.chars().chain("000".chars()).take(3).collect();
        millis = padded.parse().ok()?;
    }
    let offset_min = match s.get(i..)? {
        "Z" | "z" => 0,
        tz if tz.len() == 6 && matches!(tz.as_bytes().first(), Some(b'+' | b'-')) => {
            let sign = if tz.starts_with('-') { -1 } else { 1 };
            let hh: i64 = tz.get(1..3)?.parse().ok()?;
            let mm: i64 = tz.get(4..6)?.parse().ok()?;
            sign * (hh * 60 + mm)
        }
        _ => return None,
    };
    let days = days_from_civil(y, mo, d);
    let total = ((days * 86_400 + h * 3600 + mi * 60 + sec) - offset_min * 60) * 1000 + millis;
    u64::try_from(total).ok()
}

// Howard Hinnant's civil calendar algorithms (public domain).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = u32::try_from(doy - (153 * mp + 2) / 5 + 1).unwrap_or(1);
    let m = u32::try_from(if mp < 10 { mp + 3 } else { mp - 9 }).unwrap_or(1);
    (if m <= 2 { y + 1 } else { y }, m, d)
}

fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = if m > 2 { m - 3 } else { m + 9 };
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// A fresh random id with a prefix, e.g. `ctx-3f2a...`.
pub fn fresh_id(prefix: &str) -> String {
    format!("{prefix}-{}", oab_wire::InstanceId::random().to_hex())
}

/// Checks a client's message (PROTO `Message`): an object with a non-empty
/// string `messageId`, a `role` of `ROLE_USER` (or 0.3 `user`), and at
/// least one part, each part holding exactly one of `text`, `raw`, `url`,
/// `data`.
pub fn validate_user_message(message: &Value) -> Result<(), A2aError> {
    let invalid = |m: &str| Err(A2aError::InvalidParams(format!("message: {m}")));
    let Some(obj) = message.as_object() else {
        return invalid("must be an object");
    };
    match obj.get("messageId") {
        Some(Value::String(s)) if !s.is_empty() => {}
        _ => return invalid("messageId must be a non-empty string"),
    }
    match obj.get("role").and_then(Value::as_str) {
        Some("ROLE_USER" | "user") => {}
        Some(other) => return invalid(&format!("role {other:?} is not ROLE_USER")),
        None => return invalid("role is required"),
    }
    let Some(parts) = obj.get("parts").and_then(Value::as_array) else {
        return invalid("parts must be an array");
    };
    if parts.is_empty() {
        return invalid("parts must hold at least one part");
    }
    for (i, part) in parts.iter().enumerate() {
        let Some(p) = part.as_object() else {
            return invalid(&format!("parts[{i}] must be an object"));
        };
        let kinds = ["text", "raw", "url", "data"]
            .iter()
            .filter(|k| p.contains_key(**k))
            .count();
        if kinds != 1 {
            return invalid(&format!(
                "parts[{i}] must hold exactly one of text, raw, url, data"
            ));
        }
        if p.get("text").is_some_and(|t| !t.is_string())
            || p.get("raw").is_some_and(|t| !t.is_string())
            || p.get("url").is_some_and(|t| !t.is_string())
        {
            return invalid(&format!("parts[{i}]: text, raw and url are strings"));
        }
    }
    for key in ["taskId", "contextId"] {
        if obj.get(key).is_some_and(|v| !v.is_string()) {
            return invalid(&format!("{key} must be a string"));
        }
    }
    if obj.get("metadata").is_some_and(|m| !m.is_object()) {
        return invalid("metadata must be an object");
    }
    Ok(())
}

/// The text parts of a message, joined by newlines.
pub fn message_text(message: &Value) -> String {
    message
        .get("parts")
        .and_then(Value::as_array)
        .map(|parts| {
            parts
                .iter()
                .filter_map(|p| p.get("text").and_then(Value::as_str))
                .collect::<Vec<_>>()
                .join("\n")
        })
        .unwrap_or_default()
}

/// An agent message with one text part (no ids: they are added when the
/// message is rendered for a task).
pub fn agent_text_message(text: &str) -> Value {
    json!({
        "messageId": fresh_id("msg"),
        "role": "ROLE_AGENT",
        "parts": [{ "text": text }],
    })
}

/// An agent message with one data part.
pub fn agent_data_message(data: Value) -> Value {
    json!({
        "messageId": fresh_id("msg"),
        "role": "ROLE_AGENT",
        "parts": [{ "data": data }],
    })
}

/// A message as the facade keeps it: an object with a `messageId` (one is
/// made when missing), a `role` (agent by default), `parts`, and without
/// `taskId`/`contextId` (the renderer sets those).
pub fn normalise_message(message: &Value, default_role: &str) -> Option<Value> {
    let mut obj = message.as_object()?.clone();
    obj.remove("taskId");
    obj.remove("contextId");
    if !obj.get("messageId").is_some_and(Value::is_string) {
        obj.insert("messageId".into(), Value::String(fresh_id("msg")));
    }
    if !obj.get("role").is_some_and(Value::is_string) {
        obj.insert("role".into(), Value::String(default_role.into()));
    }
    if !obj.get("parts").is_some_and(Value::is_array) {
        obj.insert("parts".into(), Value::Array(Vec::new()));
    }
    Some(Value::Object(obj))
}

/// A stored message with the ids of the task it is shown in.
pub fn render_message(message: &Value, task_id: Option<&str>, context_id: &str) -> Value {
    let mut m = message.clone();
    if let Some(obj) = m.as_object_mut() {
        obj.insert("contextId".into(), Value::String(context_id.into()));
        match task_id {
            Some(t) => {
                obj.insert("taskId".into(), Value::String(t.into()));
            }
            None => {
                obj.remove("taskId");
            }
        }
    }
    m
}

/// A profile [`Artifact`] as an A2A artifact.
pub fn artifact_to_a2a(a: &Artifact) -> Value {
    let mut out = Map::new();
    out.insert("artifactId".into(), Value::String(a.artifact_id.clone()));
    if !a.name.is_empty() {
        out.insert("name".into(), Value::String(a.name.clone()));
    }
    if a.media_type == PARTS_MEDIA_TYPE
        && let Some(data) = a.data.as_ref().and_then(Value::as_object)
    {
        out.insert(
            "parts".into(),
            data.get("parts")
                .cloned()
                .unwrap_or(Value::Array(Vec::new())),
        );
        for key in ["description", "metadata", "extensions"] {
            if let Some(v) = data.get(key) {
                out.insert(key.into(), v.clone());
            }
        }
        return Value::Object(out);
    }
    let mut part = Map::new();
    if let Some(t) = &a.text {
        part.insert("text".into(), Value::String(t.clone()));
        if a.media_type != "text/plain" && !a.media_type.is_empty() {
            part.insert("mediaType".into(), Value::String(a.media_type.clone()));
        }
    } else if let Some(u) = &a.url {
        part.insert("url".into(), Value::String(u.clone()));
        if !a.media_type.is_empty() {
            part.insert("mediaType".into(), Value::String(a.media_type.clone()));
        }
    } else {
        part.insert("data".into(), a.data.clone().unwrap_or(Value::Null));
        if a.media_type != "application/json" && !a.media_type.is_empty() {
            part.insert("mediaType".into(), Value::String(a.media_type.clone()));
        }
    }
    out.insert("parts".into(), Value::Array(vec![Value::Object(part)]));
    Value::Object(out)
}

/// An A2A artifact as a profile [`Artifact`]: a lone plain text, data or
/// url part maps to that slot; anything else keeps its parts under
/// [`PARTS_MEDIA_TYPE`]. `None` when it has no string `artifactId`.
pub fn artifact_from_a2a(v: &Value) -> Option<Artifact> {
    let obj = v.as_object()?;
    let artifact_id = obj.get("artifactId")?.as_str()?.to_string();
    let name = obj
        .get("name")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string();
    let parts = obj.get("parts").and_then(Value::as_array);
    let simple = obj.get("description").is_none()
        && obj.get("metadata").is_none()
        && obj.get("extensions").is_none();
    if let (true, Some([part])) = (simple, parts.map(Vec::as_slice))
        && let Some(p) = part.as_object()
        && p.keys()
            .all(|k| matches!(k.as_str(), "text" | "data" | "url" | "mediaType"))
    {
        let media = p.get("mediaType").and_then(Value::as_str);
        let base = Artifact {
            artifact_id: artifact_id.clone(),
            name: name.clone(),
            media_type: String::new(),
            text: None,
            data: None,
            url: None,
        };
        if let Some(t) = p.get("text").and_then(Value::as_str) {
            return Some(Artifact {
                media_type: media.unwrap_or("text/plain").into(),
                text: Some(t.into()),
                ..base
            });
        }
        if let Some(u) = p.get("url").and_then(Value::as_str)
            && media.is_some()
        {
            return Some(Artifact {
                media_type: media.unwrap_or_default().into(),
                url: Some(u.into()),
                ..base
            });
        }
        if let Some(d) = p.get("data") {
            return Some(Artifact {
                media_type: media.unwrap_or("application/json").into(),
                data: Some(d.clone()),
                ..base
            });
        }
    }
    let mut data = Map::new();
    data.insert(
        "parts".into(),
        parts
            .cloned()
            .map(Value::Array)
            .unwrap_or(Value::Array(Vec::new())),
    );
    for key in ["description", "metadata", "extensions"] {
        if let Some(v) = obj.get(key) {
            data.insert(key.into(), v.clone());
        }
    }
    Some(Artifact {
        artifact_id,
        name,
        media_type: PARTS_MEDIA_TYPE.into(),
        text: None,
        data: Some(Value::Object(data)),
        url: None,
    })
}

/// Merges an artifact update into a task's artifacts: `append` extends the
/// parts of the artifact with the same id; otherwise the artifact replaces
/// the one with its id, or is added.
pub fn merge_artifact(artifacts: &mut Vec<Value>, update: &Value, append: bool) {
    let id = update.get("artifactId").and_then(Value::as_str);
    let existing = artifacts
        .iter_mut()
        .find(|a| a.get("artifactId").and_then(Value::as_str) == id);
    match existing {
        Some(a) if append => {
            let new_parts = update
                .get("parts")
                .and_then(Value::as_array)
                .cloned()
                .unwrap_or_default();
            if let Some(parts) = a.get_mut("parts").and_then(Value::as_array_mut) {
                parts.extend(new_parts);
            }
        }
        Some(a) => *a = update.clone(),
        None => artifacts.push(update.clone()),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn timestamps_round_trip() {
        assert_eq!(iso_from_ms(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(iso_from_ms(1_800_000_000_123), "2027-01-15T08:00:00.123Z");
        for ms in [0, 951_782_400_000, 1_800_000_000_123, 4_102_444_800_999] {
            assert_eq!(ms_from_iso(&iso_from_ms(ms)), Some(ms));
        }
        assert_eq!(
            ms_from_iso("2027-01-15T09:00:00+01:00"),
            Some(1_800_000_000_000)
        );
        assert_eq!(
            ms_from_iso("2027-01-15T08:00:00.5Z"),
            Some(1_800_000_000_500)
        );
        for bad in [
            "",
            "2027-01-15",
            "2027-13-01T00:00:00Z",
            "2027-01-15T08:00:00",
        ] {
            assert_eq!(ms_from_iso(bad), None, "{bad}");
        }
    }

    #[test]
    fn states_parse_both_generations() {
        assert_eq!(TaskState::parse("working"), Some(TaskState::Working));
        assert_eq!(
            TaskState::parse("TASK_STATE_INPUT_REQUIRED"),
            Some(TaskState::InputRequired)
        );
        assert!(TaskState::Rejected.is_terminal());
        assert!(TaskState::AuthRequired.is_interrupted());
        assert_eq!(TaskState::parse("TASK_STATE_UNSPECIFIED"), None);
    }

    #[test]
    fn artifacts_round_trip() {
        let cases = [
            json!({"artifactId":"a","name":"n","parts":[{"text":"hi"}]}),
            json!({"artifactId":"a","parts":[{"data":{"k":1}}]}),
            json!({"artifactId":"a","parts":[{"url":"https://x/y","mediaType":"text/plain"}]}),
            json!({"artifactId":"a","parts":[{"raw":"dGNr","filename":"o.txt","mediaType":"text/plain"}]}),
            json!({"artifactId":"a","description":"d","parts":[{"text":"1"},{"text":"2"}]}),
        ];
        for c in cases {
            let p = artifact_from_a2a(&c).unwrap();
            assert_eq!(artifact_to_a2a(&p), c);
        }
    }

    #[test]
    fn messages_are_checked() {
        let ok = json!({"messageId":"m","role":"ROLE_USER","parts":[{"text":"x"}]});
        assert!(validate_user_message(&ok).is_ok());
        for bad in [
            json!({"role":"ROLE_USER","parts":[{"text":"x"}]}),
            json!({"messageId":"m","role":"ROLE_AGENT","parts":[{"text":"x"}]}),
            json!({"messageId":"m","role":"ROLE_USER","parts":[]}),
            json!({"messageId":"m","role":"ROLE_USER","parts":[{"text":"x","data":1}]}),
            json!("text"),
        ] {
            assert_eq!(validate_user_message(&bad).unwrap_err().code(), -32602);
        }
    }

    #[test]
    fn appends_extend_parts() {
        let mut arts = Vec::new();
        merge_artifact(
            &mut arts,
            &json!({"artifactId":"a","parts":[{"text":"1"}]}),
            true,
        );
        merge_artifact(
            &mut arts,
            &json!({"artifactId":"a","parts":[{"text":"2"}]}),
            true,
        );
        assert_eq!(
            arts,
            vec![json!({"artifactId":"a","parts":[{"text":"1"},{"text":"2"}]})]
        );
        merge_artifact(
            &mut arts,
            &json!({"artifactId":"a","parts":[{"text":"3"}]}),
            false,
        );
        assert_eq!(arts, vec![json!({"artifactId":"a","parts":[{"text":"3"}]})]);
    }
}
