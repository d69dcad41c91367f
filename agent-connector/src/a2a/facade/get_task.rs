//! `GetTask`: one task as it stands, answered from the task table (so it
//! works while the callee or the relay is away). Never waits and never
//! touches the delegation.

use super::params::{history_length, required_id};
use super::rpc::{Reply, RpcCall};
use crate::a2a::jsonrpc::A2aError;

impl RpcCall {
    /// `GetTask`: the task `id` with at most `historyLength` messages.
    pub(super) fn get_task(&self) -> Result<Reply, A2aError> {
        let id = required_id(&self.params)?;
        let history = history_length(&self.params)?;
        let cell = self.find_task(id)?;
        let rec = cell.lock();
        Ok(Reply::Result(rec.render_task(
            &cell,
            id,
            history,
            true,
            self.profile,
        )))
    }
}
