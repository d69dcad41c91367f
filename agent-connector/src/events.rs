//! The event payloads of the OAB Delegation Profile on the relay's logs.
//!
//! Up log (callee -> caller), one JSON object per frame, tagged by `kind`:
//! - `accepted` (always up seq 1 of an executed delegation): the callee
//!   verified the request, reserved it, and is about to execute; carries
//!   the A2A task id;
//! - `status`: progress (an A2A state name, an optional message and data);
//! - `artifact`: an output artifact or a chunk of one;
//! - `result` (the one terminal): the callee-signed result envelope.
//!
//! A terminal appended by the relay (`expired`, `unknown`) is not signed and
//! carries `{"origin":"relay", ...}`; the frame's relay-origin flag marks it.
//!
//! Down log (caller -> callee) after the `Open`: `message` (a follow-up, e.g.
//! an answer to `input-required`), and `Cancel` frames whose payload is
//! `{"reason": "..."}`.
//!
//! This module owns these payload shapes and nothing else.
//!
//! Never: decides anything about what it carries: a `result` event holds the
//! callee's envelope as sent, and only [`crate::caller::Caller::verify`] makes
//! it a result.

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::profile::Artifact;

/// An up-log payload.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum UpPayload {
    /// The callee took the work.
    Accepted {
        /// The A2A task id minted by the callee.
        task_id: String,
    },
    /// Progress.
    Status {
        /// An A2A task state name, e.g. `TASK_STATE_WORKING`.
        state: String,
        /// An optional A2A message.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        message: Option<Value>,
        /// Optional structured data.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        data: Option<Value>,
    },
    /// An artifact, or a chunk of one.
    Artifact {
        /// The artifact (or chunk).
        artifact: Artifact,
        /// Extends an earlier artifact with the same id.
        #[serde(default)]
        append: bool,
        /// The last chunk of this artifact.
        #[serde(default)]
        last_chunk: bool,
    },
    /// The signed result (terminal).
    Result {
        /// The DSSE envelope JSON of a `DelegationResult`.
        envelope: Value,
    },
}

impl UpPayload {
    /// JSON bytes.
    pub fn to_bytes(&self) -> Bytes {
        Bytes::from(serde_json::to_vec(self).unwrap_or_default())
    }
}

/// A down-log payload after the `Open`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum DownPayload {
    /// A follow-up message from the caller.
    Message {
        /// The message (an A2A message object, or free-form JSON).
        message: Value,
    },
}

/// The payload of a `Cancel`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CancelPayload {
    /// Why the caller cancels.
    #[serde(default)]
    pub reason: String,
}
