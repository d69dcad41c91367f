//! What a resumed stream's leading task snapshot holds beside what the
//! driver already sent up. A2A has no replay: `SubscribeToTask` (and
//! `GetTask` after a restart) starts with the task as it stands, so what
//! the task went through while the driver did not follow it is read from
//! the snapshot's history ([`missed_messages`]); and a server that taps its
//! event queue before it reads the task (the official SDK's does, so that
//! nothing falls between the two) may stream again, right after the
//! snapshot, events the snapshot already holds ([`Overlap`]).

use std::collections::{HashMap, HashSet};

use serde_json::Value;

use super::Session;

/// The status messages the server's task went through while this
/// connector was down: the agent's messages in the task's history after
/// the last one sent up (a server moves each status's message into the
/// history when the next status replaces it; the current status is not
/// among them). None when the last one sent up is not in the history (it
/// is the current status's, or the server keeps no history), or when the
/// saved state did not track messages.
pub(super) fn missed_messages(s: &Session, task: &Value) -> Vec<Value> {
    if s.history_unknown {
        return Vec::new();
    }
    let Some(history) = task.get("history").and_then(Value::as_array) else {
        return Vec::new();
    };
    let from_agent = |m: &&Value| {
        matches!(
            m.get("role").and_then(Value::as_str),
            Some("ROLE_AGENT" | "agent")
        )
    };
    let agent: Vec<&Value> = history.iter().filter(from_agent).collect();
    let start = match &s.last_message {
        None => 0,
        Some(last) => {
            match agent
                .iter()
                .position(|m| m.get("messageId").and_then(Value::as_str) == Some(last))
            {
                Some(i) => i + 1,
                None => return Vec::new(),
            }
        }
    };
    agent.into_iter().skip(start).cloned().collect()
}

/// What a resumed stream's leading snapshot held: the live events right
/// after it that repeat it are not sent up again. Cleared at the first live
/// event that is not in it (the stream has passed the snapshot).
#[derive(Debug, Default)]
pub(super) struct Overlap {
    /// The ids of the messages in the snapshot (its history and its
    /// status).
    messages: HashSet<String>,
    /// The snapshot's artifacts, by id, as they were in it.
    artifacts: HashMap<String, Value>,
}

impl Overlap {
    /// What `task` (a resumed stream's snapshot) holds.
    pub(super) fn of(task: &Value) -> Self {
        let id = |m: &Value| {
            m.get("messageId")
                .and_then(Value::as_str)
                .map(str::to_string)
        };
        let mut messages: HashSet<String> = task
            .get("history")
            .and_then(Value::as_array)
            .map(|h| h.iter().filter_map(id).collect())
            .unwrap_or_default();
        if let Some(m) = task.get("status").and_then(|st| st.get("message")) {
            messages.extend(id(m));
        }
        let artifacts = task
            .get("artifacts")
            .and_then(Value::as_array)
            .map(|arts| {
                arts.iter()
                    .filter_map(|a| {
                        let id = a.get("artifactId").and_then(Value::as_str)?;
                        Some((id.to_string(), a.clone()))
                    })
                    .collect()
            })
            .unwrap_or_default();
        Overlap {
            messages,
            artifacts,
        }
    }

    /// Whether a live status repeats one the snapshot held: its message is
    /// in the snapshot (a status without a message repeats nothing the
    /// caller would see again: the driver sends it up only when the state
    /// changes).
    pub(super) fn repeats_status(&self, status: Option<&Value>) -> bool {
        status
            .and_then(|st| st.get("message"))
            .and_then(|m| m.get("messageId"))
            .and_then(Value::as_str)
            .is_some_and(|id| self.messages.contains(id))
    }

    /// Whether a live artifact update repeats the snapshot: it replaces
    /// (not appends to) an artifact the snapshot held with the same
    /// artifact.
    pub(super) fn repeats_artifact(&self, artifact: &Value, append: bool) -> bool {
        !append
            && artifact
                .get("artifactId")
                .and_then(Value::as_str)
                .and_then(|id| self.artifacts.get(id))
                .is_some_and(|held| held == artifact)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use serde_json::json;

    fn task(history: &[(&str, &str)]) -> Value {
        let history: Vec<Value> = history
            .iter()
            .map(|(role, id)| json!({ "role": role, "messageId": id, "parts": [{ "text": id }] }))
            .collect();
        json!({ "id": "t", "history": history, "status": { "state": "TASK_STATE_WORKING" } })
    }

    fn ids(v: &[Value]) -> Vec<&str> {
        v.iter().filter_map(|m| m["messageId"].as_str()).collect()
    }

    #[test]
    fn the_agents_messages_after_the_last_one_sent_up_were_missed() {
        let t = task(&[
            ("ROLE_USER", "ask"),
            ("ROLE_AGENT", "tick 1"),
            ("ROLE_AGENT", "tick 2"),
            ("ROLE_USER", "follow-up"),
            ("ROLE_AGENT", "tick 3"),
        ]);
        let mut s = Session {
            last_message: Some("tick 1".into()),
            ..Session::default()
        };
        assert_eq!(ids(&missed_messages(&s, &t)), ["tick 2", "tick 3"]);
        s.last_message = None;
        assert_eq!(
            ids(&missed_messages(&s, &t)),
            ["tick 1", "tick 2", "tick 3"]
        );
        // The last one sent is the current status's: not in the history.
        s.last_message = Some("tick 4".into());
        assert!(missed_messages(&s, &t).is_empty());
        // A record that did not track messages recovers none.
        s.last_message = None;
        s.history_unknown = true;
        assert!(missed_messages(&s, &t).is_empty());
    }

    #[test]
    fn live_events_the_snapshot_held_are_repeats_until_one_is_not() {
        let mut t = task(&[("ROLE_USER", "ask"), ("ROLE_AGENT", "tick 1")]);
        t["status"]["message"] = json!({ "role": "ROLE_AGENT", "messageId": "tick 2" });
        t["artifacts"] = json!([{ "artifactId": "a", "parts": [{ "text": "x" }] }]);
        let o = Overlap::of(&t);
        let status =
            |id: &str| json!({ "state": "TASK_STATE_WORKING", "message": { "messageId": id } });
        assert!(o.repeats_status(Some(&status("tick 1"))));
        assert!(o.repeats_status(Some(&status("tick 2"))));
        assert!(!o.repeats_status(Some(&status("tick 3"))));
        assert!(!o.repeats_status(Some(&json!({ "state": "TASK_STATE_WORKING" }))));
        let same = json!({ "artifactId": "a", "parts": [{ "text": "x" }] });
        let changed = json!({ "artifactId": "a", "parts": [{ "text": "y" }] });
        assert!(o.repeats_artifact(&same, false));
        assert!(!o.repeats_artifact(&same, true));
        assert!(!o.repeats_artifact(&changed, false));
    }
}
