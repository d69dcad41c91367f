//! `CancelTask`: asks the relay to cancel the delegation, then waits (up
//! to `cancel_wait`) for the terminal and returns the task as it stands. A
//! cancel never guarantees `canceled`: the callee may finish first. Never
//! holds a task's lock across an await.

use super::params::required_id;
use super::rpc::{Reply, RpcCall};
use crate::a2a::jsonrpc::A2aError;

impl RpcCall {
    /// `CancelTask`: refused for a task already in a terminal state.
    pub(super) async fn cancel_task(&self) -> Result<Reply, A2aError> {
        let id = required_id(&self.params)?;
        let cell = self.find_task(id)?;
        {
            let rec = cell.lock();
            if rec.is_terminal() {
                return Err(A2aError::TaskNotCancelable(format!(
                    "task {id} is already {}",
                    rec.state.as_str()
                )));
            }
        }
        self.inner()
            .caller
            .cancel(&cell.handle, "canceled by the A2A client")
            .await
            .map_err(A2aError::from_caller)?;
        let mut watch = cell.subscribe();
        let wait = async {
            loop {
                {
                    let rec = cell.lock();
                    if rec.is_terminal() || rec.closed.is_some() {
                        return;
                    }
                }
                if watch.changed().await.is_err() {
                    return;
                }
            }
        };
        let _ = tokio::time::timeout(self.inner().options.cancel_wait, wait).await;
        let rec = cell.lock();
        Ok(Reply::Result(rec.render_task(
            &cell,
            id,
            None,
            true,
            self.profile,
        )))
    }
}
