//! Frame helpers the link's parts share: the relay's frame limits checked
//! before a frame is queued, and a `Resume` queued for sending. A leaf of
//! the link: it knows frames, not the link's state.

use bytes::Bytes;
use oab_wire::codec::peek_prefix;
use oab_wire::{DelegationKey, Direction, Frame, FrameError, Limits, Resume, encode};

use super::LinkError;

/// Whether the relay takes `frame` (an encoded frame) under `limits`:
/// [`LinkError::TooLarge`] names the part over its limit.
pub(super) fn within_limits(limits: &Limits, frame: &Bytes) -> Result<(), LinkError> {
    let too_large = |part, size: usize, limit: usize| LinkError::TooLarge {
        part,
        size: u64::try_from(size).unwrap_or(u64::MAX),
        limit: u64::try_from(limit).unwrap_or(u64::MAX),
    };
    match peek_prefix(frame, limits) {
        Ok(_) => Ok(()),
        Err(FrameError::PayloadTooLarge { len, max }) => Err(too_large("payload", len, max)),
        Err(FrameError::HeaderTooLarge { len, max }) => Err(too_large("header", len, max)),
        Err(e) => Err(LinkError::Frame(e.to_string())),
    }
}

/// Queues a `Resume` of `dir` after `after`.
pub(super) fn queue_resume(key: &DelegationKey, dir: Direction, after: u64, out: &mut Vec<Bytes>) {
    if let Ok(b) = encode(&Frame::Resume(Resume {
        key: key.clone(),
        direction: dir,
        after,
    })) {
        out.push(b);
    }
}
