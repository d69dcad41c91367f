//! The Redis store (in progress).

/// Placeholder until the Redis backend lands.
#[derive(Debug)]
pub struct RedisStore;
