//! `SubscribeToTask`: a stream of a task's events from now, or, with the
//! profile, from a cursor (`Last-Event-ID` or `OAB-Cursor`); a cursor older than the
//! events still kept starts with the gap noted in the task's metadata.
//! Without the profile a task in a terminal state cannot be subscribed to.
//! Never touches the delegation.

use tokio::sync::mpsc;

use super::params::required_id;
use super::rpc::{Reply, RpcCall};
use super::stream::{StreamPlan, StreamStart};
use crate::a2a::jsonrpc::A2aError;
use crate::a2a::profile;

impl RpcCall {
    /// `SubscribeToTask`: the stream opens with the task as it stands.
    pub(super) fn subscribe_to_task(&self) -> Result<Reply, A2aError> {
        let id = required_id(&self.params)?;
        let cell = self.find_task(id)?;
        let cursor = if self.profile {
            profile::cursor(&self.headers)?
        } else {
            None
        };
        let (after, gap) = {
            let rec = cell.lock();
            if rec.is_terminal() && !self.profile {
                return Err(A2aError::UnsupportedOperation(format!(
                    "task {id} is in a terminal state; it cannot be subscribed to"
                )));
            }
            match cursor {
                Some(c) => {
                    let first = rec.first_kept();
                    let gap = (c + 1 < first).then_some((c, first));
                    (c.min(rec.last_seq), gap)
                }
                None => (rec.last_seq, None),
            }
        };
        let (tx, rx) = mpsc::channel(32);
        self.spawn_stream(
            StreamPlan {
                cell,
                task_id: id.to_string(),
                first: StreamStart::Snapshot { gap },
                after,
            },
            tx,
        );
        Ok(Reply::Stream(rx))
    }
}
