//! Request nonces and the callee's replay cache.
//!
//! Every signed delegation request carries a random 16-byte [`Nonce`]. The
//! callee remembers the nonces of requests it verified in a [`NonceCache`]
//! and refuses one it has seen under another delegation key, so the same
//! signed bytes cannot be replayed to start a second delegation (a relay can
//! re-send an `Open`, and a hostile relay could re-stamp its header with a
//! new request id).
//!
//! **Keyed by nonce alone.** The cache maps a nonce to the delegation key and
//! request digest it first arrived with:
//!
//! | seen before? | same key | same digest | answer |
//! |---|---|---|---|
//! | no | - | - | [`NonceCheck::Fresh`] (remembered) |
//! | yes | yes | yes | [`NonceCheck::Redelivery`]: the same request again; answer from the existing delegation, never run it twice |
//! | yes | yes | no | [`NonceError::IdempotencyMismatch`] |
//! | yes | no | - | [`NonceError::NonceReused`] |
//!
//! **Bounded by a freshness window, then by count per caller.** A request
//! is acceptable only while it is fresh: `issued_ms` (signed by the caller)
//! no older than the replay window `max_age_ms` (default 10 minutes, the
//! connector's `policy.replay_window_ms`) and no further in the future than
//! `max_skew_ms`, and its deadline not passed. An entry is kept exactly as
//! long as its request could still be accepted (`min(deadline_ms,
//! issued_ms + max_age_ms, cap)`, where `cap` is the effective deadline the
//! callee granted), so dropping it afterwards opens no replay window. The
//! window, not the work's deadline, bounds how long an entry lives: a
//! caller at a steady rate holds `rate × window` entries, whatever its
//! deadlines (as AWS SigV4 bounds a signed request by its 5-minute window). Each caller has a share of
//! `per_caller` live entries: a caller whose share is full is refused with
//! [`NonceError::Saturated`] (fail closed, retryable) instead of evicting a
//! live entry, which would reopen the window; other callers' shares are
//! untouched. `capacity` bounds all shares together (the callee runtime
//! sets it to `per_caller` times the configured callers, so one caller
//! filling its share never refuses another).
//!
//! **Pruned** when the request can no longer be accepted (`purge`, on every
//! check and every footprint read), never at the delegation's terminal: the
//! entry is what refuses a replay of the finished request.
//!
//! The window is also how long an `Open` may wait in the relay's log while
//! the callee is away: one that arrives later is refused `stale_request`
//! (the caller reads a signed rejection saying so). Set the window to the
//! longest time a callee may be away while callers wait for it; the cache
//! then holds that much more. Entries keep keyed 64-bit fingerprints of the
//! delegation key and request digest, not the ids themselves (at most
//! about 130 bytes an entry in all). The cache lives in memory: a callee process that
//! restarts accepts again, within the window, a request it had seen before;
//! the relay never opens a delegation twice under one request id, so only
//! a relay that rewrites the `Open`'s header could use that.
//!
//! Only verified, authorized and admitted requests go into the cache (the
//! callee runtime checks it after it took the concurrency permits, see
//! [`crate::profile::verify_open_request`]), so neither unauthenticated
//! input nor a refused request fills it.
//!
//! Never: evicts a live entry to make room, and never forgets an entry while
//! its request could still be accepted.

use std::collections::{BTreeSet, HashMap};

use oab_wire::{DelegationKey, Digest, PeerId};

use crate::profile::DelegationRequest;
pub use crate::profile::Nonce;

/// Why the replay cache refused a request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NonceError {
    /// The nonce was already used by another delegation (a replay, possibly
    /// under a new request id).
    #[error("nonce already used by another delegation")]
    NonceReused,
    /// The nonce and delegation key are known, but the request bytes differ.
    #[error("request id reused with a different request")]
    IdempotencyMismatch,
    /// The request is older than the replay window or its deadline passed.
    #[error("request issued at {issued_ms} is stale at {now_ms}")]
    StaleRequest {
        /// When the caller says it issued the request.
        issued_ms: u64,
        /// Now.
        now_ms: u64,
    },
    /// The request claims to be issued further in the future than the allowed skew.
    #[error("request issued at {issued_ms} is in the future at {now_ms}")]
    ClockSkew {
        /// When the caller says it issued the request.
        issued_ms: u64,
        /// Now.
        now_ms: u64,
    },
    /// The cache is full of live entries; retry later.
    #[error("replay cache is full ({capacity} live requests)")]
    Saturated {
        /// The configured capacity.
        capacity: usize,
    },
}

impl NonceError {
    /// Stable snake_case code for logs, audit records and refusals.
    pub fn code(&self) -> &'static str {
        match self {
            NonceError::NonceReused => "nonce_reused",
            NonceError::IdempotencyMismatch => "idempotency_mismatch",
            NonceError::StaleRequest { .. } => "stale_request",
            NonceError::ClockSkew { .. } => "clock_skew",
            NonceError::Saturated { .. } => "saturated",
        }
    }

    /// Whether presenting the same request again later may succeed.
    pub fn is_retryable(&self) -> bool {
        matches!(self, NonceError::Saturated { .. })
    }
}

/// What the cache says about a verified request it accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NonceCheck {
    /// First sighting; the nonce is now remembered.
    Fresh,
    /// The same request (same key, same bytes) again: answer from the
    /// existing delegation, never start the work a second time.
    Redelivery,
}

/// What the cache keeps of a request: keyed fingerprints of its delegation
/// key and of its bytes (SipHash under the cache's own random key, so a
/// caller cannot aim at a collision), and its caller's slot: 24 bytes
/// where the ids themselves took about 250.
#[derive(Debug, Clone, Copy)]
struct Entry {
    key: u64,
    digest: u64,
    caller: u32,
}

/// The callee's bounded replay cache (see the module docs for the rules).
#[derive(Debug)]
pub struct NonceCache {
    capacity: usize,
    per_caller: usize,
    max_age_ms: u64,
    max_skew_ms: u64,
    /// Pruned with its `by_expiry` twin when the request can no longer be
    /// accepted (`purge`).
    entries: HashMap<Nonce, Entry>,
    by_expiry: BTreeSet<(u64, Nonce)>,
    /// Live entries per caller slot (see `callers`).
    live: Vec<usize>,
    /// Each caller's slot. A slot is kept for the process's life: callers
    /// are configured peers (only verified requests reach the cache), so
    /// there are few.
    callers: HashMap<PeerId, u32>,
    /// The fingerprints' key.
    hasher: std::hash::RandomState,
}

impl NonceCache {
    /// Default capacity of a cache made with [`NonceCache::default`]: one
    /// caller's default share.
    pub const DEFAULT_CAPACITY: usize = Self::DEFAULT_PER_CALLER;
    /// Default share of one caller: 2,097,152 live requests. An entry costs
    /// at most about 130 bytes (measured: 128 at a million entries, the
    /// map, the expiry index and the tables' slack), so a full share is
    /// about 260 MiB, reached only by a caller that sustains 3,495
    /// delegations a second for the whole replay window (10 minutes): more
    /// than one relay serves on two cores (about 3,200 a second). At 500 a
    /// second the cache holds 300,000 entries, under 40 MiB.
    pub const DEFAULT_PER_CALLER: usize = 2 * 1024 * 1024;
    /// Default replay window: 10 minutes. A request issued longer ago is
    /// refused `stale_request` whatever its deadline, so entries live at
    /// most this long and the cache holds only what a window of traffic
    /// leaves. An `Open` that waited longer than this in the relay's log
    /// (its callee was away) is refused the same way: raise the window to
    /// cover the longest time a callee may be away while callers wait.
    pub const DEFAULT_MAX_AGE_MS: u64 = 10 * 60 * 1000;
    /// Default tolerance for a caller clock ahead of ours: one minute, the
    /// same order as the handshake's clock skew bound.
    pub const DEFAULT_MAX_SKEW_MS: u64 = 60_000;

    /// A cache with explicit bounds, each caller's share the whole
    /// `capacity` (see [`NonceCache::with_per_caller`]). A `capacity` of
    /// zero refuses everything.
    pub fn new(capacity: usize, max_age_ms: u64, max_skew_ms: u64) -> Self {
        NonceCache {
            capacity,
            per_caller: capacity,
            max_age_ms,
            max_skew_ms,
            entries: HashMap::new(),
            by_expiry: BTreeSet::new(),
            live: Vec::new(),
            callers: HashMap::new(),
            hasher: std::hash::RandomState::new(),
        }
    }

    /// Limits each caller to `per_caller` live entries.
    #[must_use]
    pub fn with_per_caller(mut self, per_caller: usize) -> Self {
        self.per_caller = per_caller;
        self
    }

    /// Live entries of `caller`.
    pub fn len_for(&self, caller: &PeerId) -> usize {
        self.callers
            .get(caller)
            .and_then(|&i| self.live.get(i as usize))
            .copied()
            .unwrap_or(0)
    }

    /// The slot of `caller`, made on its first request.
    fn slot(&mut self, caller: &PeerId) -> u32 {
        if let Some(&i) = self.callers.get(caller) {
            return i;
        }
        let i = u32::try_from(self.live.len()).unwrap_or(u32::MAX);
        self.live.push(0);
        self.callers.insert(caller.clone(), i);
        i
    }

    /// Live entries.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no entry is live.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Forgets entries whose request can no longer be accepted at `now_ms`.
    pub fn purge(&mut self, now_ms: u64) {
        while let Some(&(expires_ms, nonce)) = self.by_expiry.first() {
            if expires_ms > now_ms {
                break;
            }
            self.by_expiry.remove(&(expires_ms, nonce));
            if let Some(e) = self.entries.remove(&nonce)
                && let Some(n) = self.live.get_mut(e.caller as usize)
            {
                *n = n.saturating_sub(1);
            }
        }
    }

    /// Checks a **verified** request that arrived under delegation `key`
    /// (from the `Open` header), and remembers it when it is fresh, until
    /// `min(deadline_ms, issued_ms + max_age_ms, cap_ms)`; `cap_ms` is the
    /// deadline the callee granted (`u64::MAX`: none).
    pub fn check(
        &mut self,
        key: &DelegationKey,
        request: &DelegationRequest,
        request_digest: &Digest,
        now_ms: u64,
        cap_ms: u64,
    ) -> Result<NonceCheck, NonceError> {
        self.purge(now_ms);
        use std::hash::BuildHasher as _;
        let key_fp = self.hasher.hash_one(key);
        let digest_fp = self.hasher.hash_one(request_digest.0);
        if let Some(seen) = self.entries.get(&request.nonce) {
            return if seen.key != key_fp {
                Err(NonceError::NonceReused)
            } else if seen.digest != digest_fp {
                Err(NonceError::IdempotencyMismatch)
            } else {
                Ok(NonceCheck::Redelivery)
            };
        }
        let issued_ms = request.issued_ms;
        if issued_ms > now_ms.saturating_add(self.max_skew_ms) {
            return Err(NonceError::ClockSkew { issued_ms, now_ms });
        }
        let expires_ms = request
            .deadline_ms
            .min(issued_ms.saturating_add(self.max_age_ms))
            .min(cap_ms);
        if expires_ms <= now_ms {
            return Err(NonceError::StaleRequest { issued_ms, now_ms });
        }
        if self.len_for(&key.caller) >= self.per_caller {
            return Err(NonceError::Saturated {
                capacity: self.per_caller,
            });
        }
        if self.entries.len() >= self.capacity {
            return Err(NonceError::Saturated {
                capacity: self.capacity,
            });
        }
        let caller = self.slot(&key.caller);
        if let Some(n) = self.live.get_mut(caller as usize) {
            *n += 1;
        }
        self.entries.insert(
            request.nonce,
            Entry {
                key: key_fp,
                digest: digest_fp,
                caller,
            },
        );
        self.by_expiry.insert((expires_ms, request.nonce));
        Ok(NonceCheck::Fresh)
    }
}

impl Default for NonceCache {
    fn default() -> Self {
        NonceCache::new(
            Self::DEFAULT_CAPACITY,
            Self::DEFAULT_MAX_AGE_MS,
            Self::DEFAULT_MAX_SKEW_MS,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::tests::sample_request;
    use oab_wire::RequestId;

    fn key(req: &str) -> DelegationKey {
        DelegationKey::new(PeerId::new("acme/a").unwrap(), RequestId::new(req).unwrap())
    }

    const NOW: u64 = 1_000_000;

    #[test]
    fn nonce_text_round_trips_and_is_strict() {
        let n = Nonce::random();
        let s = n.to_string();
        assert_eq!(s.len(), 22);
        assert_eq!(Nonce::parse(&s), Some(n));
        let json = serde_json::to_string(&n).unwrap();
        assert_eq!(serde_json::from_str::<Nonce>(&json).unwrap(), n);
        for bad in [
            "",
            "AAAA",
            "!!!!!!!!!!!!!!!!!!!!!!",
            &format!("{s}=="),
            &s[..21],
        ] {
            assert_eq!(Nonce::parse(bad), None, "{bad}");
        }
        assert_ne!(Nonce::random(), Nonce::random());
    }

    #[test]
    fn nonce_cache_rules() {
        let req = sample_request(NOW);
        let d1 = Digest::of(b"one");
        let d2 = Digest::of(b"two");
        let mut cache = NonceCache::new(8, 60_000, 1_000);
        assert_eq!(
            cache.check(&key("r1"), &req, &d1, NOW, u64::MAX),
            Ok(NonceCheck::Fresh)
        );
        // Same key, same bytes: a redelivery (idempotent), not a refusal.
        assert_eq!(
            cache.check(&key("r1"), &req, &d1, NOW + 1, u64::MAX),
            Ok(NonceCheck::Redelivery)
        );
        // The same signed request under a NEW request id hits the cache.
        let err = cache
            .check(&key("r2"), &req, &d1, NOW + 2, u64::MAX)
            .unwrap_err();
        assert_eq!(err.code(), "nonce_reused");
        // Same key, other bytes.
        let err = cache
            .check(&key("r1"), &req, &d2, NOW + 3, u64::MAX)
            .unwrap_err();
        assert_eq!(err.code(), "idempotency_mismatch");
        assert_eq!(cache.len(), 1);
    }

    #[test]
    fn nonce_cache_freshness_table() {
        let d = Digest::of(b"x");
        // (issued offset from NOW, deadline offset from NOW, expected code or None)
        let cases: &[(i64, i64, Option<&str>)] = &[
            (0, 10_000, None),
            (-59_999, 10_000, None),
            (-60_000, 10_000, Some("stale_request")),
            (1_000, 10_000, None),
            (1_001, 10_000, Some("clock_skew")),
            (0, 0, Some("stale_request")),
            (0, -1, Some("stale_request")),
            // Older than the window: refused whatever the deadline.
            (-60_000, 3_600_000, Some("stale_request")),
            (-59_999, 3_600_000, None),
        ];
        for &(issued, deadline, want) in cases {
            let mut cache = NonceCache::new(8, 60_000, 1_000);
            let mut req = sample_request(NOW);
            req.issued_ms = NOW.saturating_add_signed(issued);
            req.deadline_ms = NOW.saturating_add_signed(deadline);
            let got = cache.check(&key("r"), &req, &d, NOW, u64::MAX);
            assert_eq!(got.err().map(|e| e.code()), want, "{issued} {deadline}");
        }
    }

    #[test]
    fn nonce_cache_is_bounded_and_frees_expired_entries() {
        let d = Digest::of(b"x");
        let mut cache = NonceCache::new(2, 60_000, 1_000);
        let mut a = sample_request(NOW);
        a.deadline_ms = NOW + 100;
        let b = sample_request(NOW);
        let c = sample_request(NOW);
        assert!(cache.check(&key("a"), &a, &d, NOW, u64::MAX).is_ok());
        assert!(cache.check(&key("b"), &b, &d, NOW, u64::MAX).is_ok());
        let err = cache.check(&key("c"), &c, &d, NOW, u64::MAX).unwrap_err();
        assert_eq!(err.code(), "saturated");
        assert!(err.is_retryable());
        // Once `a` can no longer be accepted, its slot is free again...
        assert_eq!(
            cache.check(&key("c"), &c, &d, NOW + 100, u64::MAX),
            Ok(NonceCheck::Fresh)
        );
        assert_eq!(cache.len(), 2);
        // ...and replaying `a` now fails as stale, not as fresh.
        let err = cache
            .check(&key("a"), &a, &d, NOW + 100, u64::MAX)
            .unwrap_err();
        assert_eq!(err.code(), "stale_request");
        // Zero capacity refuses everything.
        let mut none = NonceCache::new(0, 60_000, 1_000);
        assert_eq!(
            none.check(&key("a"), &b, &d, NOW, u64::MAX)
                .unwrap_err()
                .code(),
            "saturated"
        );
        assert!(NonceCache::default().is_empty());
    }

    fn key_of(caller: &str, req: &str) -> DelegationKey {
        DelegationKey::new(PeerId::new(caller).unwrap(), RequestId::new(req).unwrap())
    }

    #[test]
    fn a_caller_that_fills_its_share_does_not_refuse_another() {
        let d = Digest::of(b"x");
        // Two callers, a share of two each.
        let mut cache = NonceCache::new(4, 60_000, 1_000).with_per_caller(2);
        for r in ["a1", "a2"] {
            let req = sample_request(NOW);
            assert_eq!(
                cache.check(&key_of("acme/a", r), &req, &d, NOW, u64::MAX),
                Ok(NonceCheck::Fresh)
            );
        }
        let err = cache
            .check(
                &key_of("acme/a", "a3"),
                &sample_request(NOW),
                &d,
                NOW,
                u64::MAX,
            )
            .unwrap_err();
        assert_eq!(err.code(), "saturated");
        for r in ["b1", "b2"] {
            assert_eq!(
                cache.check(
                    &key_of("acme/b", r),
                    &sample_request(NOW),
                    &d,
                    NOW,
                    u64::MAX
                ),
                Ok(NonceCheck::Fresh),
                "caller b's request {r}"
            );
        }
        assert_eq!(cache.len_for(&PeerId::new("acme/a").unwrap()), 2);
        assert_eq!(cache.len_for(&PeerId::new("acme/b").unwrap()), 2);
    }

    #[test]
    fn an_entry_lives_no_longer_than_the_deadline_the_callee_granted() {
        let d = Digest::of(b"x");
        let mut cache = NonceCache::new(8, 24 * 3_600_000, 1_000);
        // The caller asks for a day; the callee granted a minute.
        let mut req = sample_request(NOW);
        req.deadline_ms = NOW + 24 * 3_600_000;
        let k = key_of("acme/a", "r");
        assert_eq!(
            cache.check(&k, &req, &d, NOW, NOW + 60_000),
            Ok(NonceCheck::Fresh)
        );
        cache.purge(NOW + 59_999);
        assert_eq!(cache.len(), 1);
        cache.purge(NOW + 60_000);
        assert!(cache.is_empty());
        assert_eq!(cache.len_for(&PeerId::new("acme/a").unwrap()), 0);
    }

    /// The window, not the deadline, bounds how long a request is kept: a
    /// one-hour deadline is forgotten once its window passed.
    #[test]
    fn an_entry_lives_no_longer_than_the_window() {
        let d = Digest::of(b"x");
        let mut cache = NonceCache::new(8, 60_000, 1_000);
        let mut req = sample_request(NOW);
        req.deadline_ms = NOW + 3_600_000;
        assert_eq!(
            cache.check(&key("r"), &req, &d, NOW, u64::MAX),
            Ok(NonceCheck::Fresh)
        );
        cache.purge(NOW + 59_999);
        assert_eq!(cache.len(), 1);
        cache.purge(NOW + 60_000);
        assert!(cache.is_empty());
        // Replayed after its window: stale, with nothing remembered.
        let err = cache
            .check(&key("r2"), &req, &d, NOW + 60_000, u64::MAX)
            .unwrap_err();
        assert_eq!(err.code(), "stale_request");
    }

    /// One caller at a steady 500 requests a second with one-hour
    /// deadlines, for 700 simulated seconds, with the default window
    /// and share: nothing is refused, and the cache holds one window of
    /// traffic, not one deadline of it.
    #[test]
    fn a_steady_caller_is_never_refused_and_holds_one_window() {
        let d = Digest::of(b"x");
        let mut cache = NonceCache::default();
        let window = NonceCache::DEFAULT_MAX_AGE_MS;
        let rate_per_s = 500u64;
        let mut peak = 0;
        for i in 0..rate_per_s * 700 {
            let now = NOW + i * 1_000 / rate_per_s;
            let mut req = sample_request(now);
            req.deadline_ms = now + 3_600_000;
            let k = key(&format!("r{i}"));
            assert_eq!(
                cache.check(&k, &req, &d, now, u64::MAX),
                Ok(NonceCheck::Fresh),
                "request {i}"
            );
            peak = peak.max(cache.len());
        }
        let one_window = usize::try_from(rate_per_s * window / 1_000).unwrap();
        assert!(
            peak <= one_window + 1,
            "{peak} entries held; one window is {one_window}"
        );
        assert!(peak >= one_window - 1, "{peak} entries held");
    }
}
