//! The A2A operations the driver calls, apart from the binding that
//! carries them (`jsonrpc.rs`, `rest.rs`; `transport.rs` picks one).

use serde_json::Value;

/// One A2A operation the driver calls.
#[derive(Debug, Clone, Copy)]
pub(super) enum Call<'a> {
    /// `SendMessage`, blocking: the answer comes at the task's terminal or
    /// interrupted state, so no request timeout applies.
    SendMessage(&'a Value),
    /// `SendStreamingMessage`: an SSE stream.
    SendStreamingMessage(&'a Value),
    /// `SubscribeToTask`: an SSE stream.
    SubscribeToTask(&'a str),
    /// `GetTask`, bounded by [`super::DriverOptions::request_timeout`].
    GetTask(&'a str),
    /// `CancelTask`, bounded by [`super::DriverOptions::request_timeout`].
    CancelTask(&'a str),
}

impl Call<'_> {
    /// The answer is an SSE stream.
    pub(super) fn streams(self) -> bool {
        matches!(
            self,
            Call::SendStreamingMessage(_) | Call::SubscribeToTask(_)
        )
    }

    /// The call is bounded by the request timeout.
    pub(super) fn bounded(self) -> bool {
        matches!(self, Call::GetTask(_) | Call::CancelTask(_))
    }
}
