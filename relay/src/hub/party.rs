//! Looking a delegation up on behalf of a peer ([`Hub::view_for`]): one the
//! peer is neither caller nor callee of is reported missing, after the same
//! store work a missing one costs (one read of the callee field), so that
//! neither the answer nor its timing tells other pairs' delegations apart
//! from missing ones. A key names its caller, so a peer that is not the
//! caller can only be the callee: that is what the read checks.
//!
//! Never: answers a peer that is not a party from the view cache alone (a
//! cached answer comes back about one store round trip sooner than a
//! missing delegation's, which is enough to probe for ids).

use std::time::Instant;

use oab_wire::{DelegationKey, PeerId};

use super::{Hub, ViewRef};
use crate::store::{EventStore, StoreError};

impl<S: EventStore> Hub<S> {
    /// The view of `key` if `peer` is its caller or callee, loading it from
    /// the store if needed; `None` if it does not exist or belongs to other
    /// peers. For a peer that is not the key's caller, either `None` costs
    /// exactly one read of the callee field; a callee's first lookup (the
    /// view not cached here) reads the meta after it.
    pub async fn view_for(
        &self,
        key: &DelegationKey,
        peer: &PeerId,
    ) -> Result<Option<ViewRef>, StoreError> {
        let cached = self.views.lock().get(key).cloned();
        if let Some(view) = cached {
            let party = {
                let l = view.lock();
                &l.caller == peer || &l.callee == peer
            };
            if party {
                return Ok(Some(view));
            }
        }
        if &key.caller != peer {
            // Only the callee field tells whether `peer` is a party: read
            // just that, which costs the same for a missing delegation.
            let started = Instant::now();
            let callee = self.store.callee_of(key).await;
            self.observe_store("callee", started, &callee);
            if callee?.as_ref() != Some(peer) {
                return Ok(None);
            }
        }
        // A party's lookup (the caller's delegations are its own to probe).
        let view = self.view(key).await?;
        Ok(view.filter(|v| {
            let l = v.lock();
            &l.caller == peer || &l.callee == peer
        }))
    }
}
