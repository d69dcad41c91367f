//! How commands reach Redis. One command, or one pipeline, is sent over the
//! store's connection, and an idempotent one is sent again once after a lost
//! connection. On a Redis Cluster a pipeline is split by the hash slot of each
//! command's first key, one pipeline per slot, all sent concurrently, and the
//! replies are put back in the order of the commands. An `EVALSHA` batch
//! whose script a node lost (`NOSCRIPT`) is reloaded and only those commands
//! are sent again. It never builds an operation's commands and never reads a
//! reply beyond counting it and spotting `NOSCRIPT`; it sends a command
//! flagged not idempotent again only after `NOSCRIPT` (which means it did not
//! run). The cluster connection's own retries are another matter: see "Redis
//! Cluster" in the parent module's documentation.

use std::collections::HashMap;
use std::sync::Arc;

use futures_util::future::join_all;
use redis::cluster_routing::Slot;
use redis::{Cmd, Pipeline, RedisError, Script, Value};

use super::RedisStore;
use super::replies::{corrupt, is_noscript, unavailable};
use crate::store::StoreError;

/// A pipeline that returns per-command results (server errors included)
/// instead of failing as a whole.
pub(super) fn pipeline() -> Pipeline {
    let mut p = redis::pipe();
    p.ignore_errors();
    p
}

impl RedisStore {
    /// Runs one command (on a cluster, on the master of its key's slot).
    /// `idempotent` commands are retried once when the connection was lost
    /// (the retry waits for the reconnect), so a Redis restart is invisible
    /// to readers.
    pub(super) async fn query(
        &self,
        cmd: &Cmd,
        idempotent: bool,
        context: &str,
    ) -> Result<Value, StoreError> {
        let key = first_key(cmd);
        let failed = |e: RedisError| self.failed(context, &e, key);
        // Sent by the store's own task, which owns a copy (`connection`).
        let cmd = Arc::new(cmd.clone());
        match self.conn.command(key, cmd.clone()).await {
            Ok(v) => Ok(v),
            Err(e) if idempotent && retryable(&e) => {
                self.conn.command(key, cmd).await.map_err(failed)
            }
            Err(e) => Err(failed(e)),
        }
    }

    /// Runs a pipeline built with [`pipeline`]; one value per command, in the
    /// order of the commands. On a cluster, the commands are split by the
    /// slot of their first key ([`slot_groups`]) and each group is sent as
    /// its own pipeline, all groups concurrently; a single server gets the
    /// pipeline as it is, in one round trip.
    pub(super) async fn query_pipeline(
        &self,
        pipe: Pipeline,
        idempotent: bool,
        context: &str,
    ) -> Result<Vec<Value>, StoreError> {
        self.query_pipeline_each(&Arc::new(pipe), idempotent, context)
            .await?
            .into_iter()
            .collect()
    }

    /// Like [`Self::query_pipeline`], but on a cluster a slot group whose
    /// node fails gives an error for each of its commands while the other
    /// groups keep their replies. `Err` when the whole pipeline failed.
    async fn query_pipeline_each(
        &self,
        pipe: &Arc<Pipeline>,
        idempotent: bool,
        context: &str,
    ) -> Result<Vec<Result<Value, StoreError>>, StoreError> {
        let groups = if self.conn.is_cluster() {
            slot_groups(pipe)
        } else {
            Vec::new()
        };
        if groups.len() <= 1 {
            let values = self
                .send_pipeline(pipe.clone(), idempotent, context)
                .await?;
            return Ok(values.into_iter().map(Ok).collect());
        }
        let cmds: Vec<&Cmd> = pipe.cmd_iter().collect();
        let mut parts = Vec::with_capacity(groups.len());
        for indices in &groups {
            let mut part = pipeline();
            for &i in indices {
                let cmd = cmds
                    .get(i)
                    .ok_or_else(|| corrupt(format!("{context}: command index out of range")))?;
                part.add_command((*cmd).clone());
            }
            parts.push(Arc::new(part));
        }
        let replies = join_all(
            parts
                .into_iter()
                .map(|part| self.send_pipeline(part, idempotent, context)),
        )
        .await;
        let mut values: Vec<Result<Value, StoreError>> =
            (0..pipe.len()).map(|_| Ok(Value::Nil)).collect();
        let mut failed = 0;
        for (indices, replies) in groups.iter().zip(replies) {
            match replies {
                Ok(replies) => {
                    for (&i, v) in indices.iter().zip(replies) {
                        if let Some(slot) = values.get_mut(i) {
                            *slot = Ok(v);
                        }
                    }
                }
                Err(e) => {
                    failed += 1;
                    // Every command of the group gets the group's error.
                    let (operation, cause) = match e {
                        StoreError::Unavailable { operation, cause } => (operation, cause),
                        other => (context.to_owned(), other.to_string()),
                    };
                    for &i in indices {
                        if let Some(slot) = values.get_mut(i) {
                            *slot = Err(StoreError::unavailable(operation.clone(), &cause));
                        }
                    }
                }
            }
        }
        if failed == groups.len() {
            // Every group's error names its shard; say which were tried.
            let causes: std::collections::BTreeSet<String> = values
                .iter()
                .filter_map(|v| match v {
                    Err(StoreError::Unavailable { cause, .. }) => Some(cause.clone()),
                    _ => None,
                })
                .collect();
            return Err(StoreError::unavailable(
                context,
                format!(
                    "every shard of this batch failed: {}",
                    causes.into_iter().collect::<Vec<_>>().join("; ")
                ),
            ));
        }
        Ok(values)
    }

    /// Sends a pipeline as it is (on a cluster, its commands must share one
    /// slot); one value per command.
    async fn send_pipeline(
        &self,
        pipe: Arc<Pipeline>,
        idempotent: bool,
        context: &str,
    ) -> Result<Vec<Value>, StoreError> {
        let key = pipe.cmd_iter().next().and_then(first_key);
        let failed = |e: RedisError| self.failed(context, &e, key);
        let values = match self.conn.pipeline(key, pipe.clone()).await {
            Ok(v) => v,
            Err(e) if idempotent && retryable(&e) => self
                .conn
                .pipeline(key, pipe.clone())
                .await
                .map_err(failed)?,
            Err(e) => return Err(failed(e)),
        };
        if values.len() != pipe.len() {
            return Err(corrupt(format!(
                "{context}: {} replies for {} commands",
                values.len(),
                pipe.len()
            )));
        }
        Ok(values)
    }

    /// Runs `EVALSHA` commands of one script in one pipeline (on a cluster,
    /// one per slot). Commands that got `NOSCRIPT` (Redis restarted or
    /// `SCRIPT FLUSH`, on any node) are sent again, in order, after
    /// `SCRIPT LOAD` (on every node of a cluster); the others keep their
    /// replies (re-running a script that already ran would not be idempotent
    /// for relay entries).
    pub(super) async fn eval_batch(
        &self,
        script: &Script,
        pipe: Pipeline,
        idempotent: bool,
        context: &str,
    ) -> Result<Vec<Value>, StoreError> {
        self.eval_batch_each(script, pipe, idempotent, context)
            .await?
            .into_iter()
            .collect()
    }

    /// [`Self::eval_batch`] with one result per command: on a cluster, the
    /// commands of a node that failed get an error and the others their
    /// replies ([`Self::query_pipeline_each`]).
    pub(super) async fn eval_batch_each(
        &self,
        script: &Script,
        pipe: Pipeline,
        idempotent: bool,
        context: &str,
    ) -> Result<Vec<Result<Value, StoreError>>, StoreError> {
        // Shared with the tasks that send it (`connection`), not copied.
        let pipe = Arc::new(pipe);
        let mut values = self.query_pipeline_each(&pipe, idempotent, context).await?;
        let missing: Vec<usize> = values
            .iter()
            .enumerate()
            .filter(|(_, v)| v.as_ref().is_ok_and(is_noscript))
            .map(|(i, _)| i)
            .collect();
        if missing.is_empty() {
            return Ok(values);
        }
        self.conn
            .load_script(script)
            .await
            .map_err(|e| unavailable("SCRIPT LOAD", &e))?;
        let cmds: Vec<&Cmd> = pipe.cmd_iter().collect();
        let mut retry = pipeline();
        for &i in &missing {
            let cmd = cmds
                .get(i)
                .ok_or_else(|| corrupt(format!("{context}: reply index out of range")))?;
            retry.add_command((*cmd).clone());
        }
        let again = self
            .query_pipeline_each(&Arc::new(retry), idempotent, context)
            .await?;
        for (i, v) in missing.into_iter().zip(again) {
            if let Some(slot) = values.get_mut(i) {
                *slot = v;
            }
        }
        Ok(values)
    }

    /// Runs one `EVALSHA`, loading the script on `NOSCRIPT`.
    pub(super) async fn eval(
        &self,
        script: &Script,
        cmd: Cmd,
        idempotent: bool,
        context: &str,
    ) -> Result<Value, StoreError> {
        let mut pipe = pipeline();
        pipe.add_command(cmd);
        let values = self.eval_batch(script, pipe, idempotent, context).await?;
        values
            .into_iter()
            .next()
            .ok_or_else(|| corrupt(format!("{context}: no reply")))
    }
}

impl RedisStore {
    /// The error of a command on `key` that failed with `e`. On a cluster
    /// it names the shard: the slot of the key and the master serving it
    /// (from a redirect the cluster connection could not follow, else from
    /// the last slot map read), instead of the redirect or a bare
    /// "connection refused".
    fn failed(&self, context: &str, e: &RedisError, key: Option<&[u8]>) -> StoreError {
        let (Some(shards), Some(key)) = (&self.shards, key) else {
            return unavailable(context, e);
        };
        let slot = super::shards::slot_of(key);
        let master = e
            .redirect_node()
            .map(|(addr, _)| addr.to_owned())
            .or_else(|| shards.owner_of(slot));
        let shard = match master {
            Some(m) => format!("the shard of slot {slot} (master {m})"),
            None => format!("the shard of slot {slot}"),
        };
        let cause = if e.redirect_node().is_some() {
            format!("{shard} is unreachable (the cluster redirects there)")
        } else {
            format!("{shard} failed: {e}")
        };
        StoreError::unavailable(format!("redis {context}"), cause)
    }
}

/// Whether a failed command may be sent again: the connection was lost (the
/// connection manager is reconnecting), or a cluster node refused it for now
/// (`TRYAGAIN`, `CLUSTERDOWN`, a redirection the cluster connection could
/// not follow in its own retries), not a timeout (which may have run).
pub(super) fn retryable(e: &RedisError) -> bool {
    (e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_unrecoverable_error()
        || e.is_cluster_error())
        && !e.is_timeout()
}

/// The commands of `pipe` grouped by the hash slot of their first key, as
/// indexes into the pipeline: groups in the order of their first command,
/// commands in pipeline order within a group. Commands without a key form
/// one group of their own.
pub(super) fn slot_groups(pipe: &Pipeline) -> Vec<Vec<usize>> {
    let mut groups: Vec<Vec<usize>> = Vec::new();
    let mut by_slot: HashMap<Option<Slot>, usize> = HashMap::new();
    for (i, cmd) in pipe.cmd_iter().enumerate() {
        let slot = first_key(cmd).map(Slot::for_key);
        let group = *by_slot.entry(slot).or_insert_with(|| {
            groups.push(Vec::new());
            groups.len() - 1
        });
        if let Some(g) = groups.get_mut(group) {
            g.push(i);
        }
    }
    groups
}

/// The first key of a command: the argument after the command name, or for
/// the scripting commands the first one after `numkeys`. `None` for a
/// command without keys.
pub(super) fn first_key(cmd: &Cmd) -> Option<&[u8]> {
    const SCRIPTED: [&[u8]; 6] = [
        b"EVAL",
        b"EVALSHA",
        b"EVAL_RO",
        b"EVALSHA_RO",
        b"FCALL",
        b"FCALL_RO",
    ];
    let mut args = cmd.args_iter().map(|a| match a {
        redis::Arg::Simple(bytes) => Some(bytes),
        _ => None,
    });
    let name = args.next()??;
    if SCRIPTED.iter().any(|s| name.eq_ignore_ascii_case(s)) {
        let _script = args.next()??;
        let numkeys: usize = std::str::from_utf8(args.next()??).ok()?.parse().ok()?;
        if numkeys == 0 {
            return None;
        }
    }
    args.next()?
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::*;
    use crate::store::redis::keys::{DEADLINES_KEY, DelegationKeys};
    use crate::store::redis::scripts::evalsha;
    use oab_wire::{DelegationKey, PeerId, RequestId};

    #[test]
    fn pipelines_split_by_slot_of_the_first_key() {
        let script = Script::new("return 1");
        let k = |c: &str, r: &str| {
            DelegationKey::new(PeerId::new(c).unwrap(), RequestId::new(r).unwrap())
        };
        let a = DelegationKeys::new(&k("acme/a", "r1"));
        let b = DelegationKeys::new(&k("acme/b", "r1"));
        assert_ne!(Slot::for_key(&a.meta), Slot::for_key(&b.meta));
        assert_eq!(Slot::for_key(&a.meta), Slot::for_key(&a.up));
        let mut pipe = pipeline();
        pipe.add_command(evalsha(&script, &[&a.meta, &a.down, &a.up]))
            .add_command(evalsha(&script, &[&b.meta, &b.down, &b.up]))
            .zadd(DEADLINES_KEY, "m", 0)
            .add_command(evalsha(&script, &[&a.meta, &a.up, &a.down]))
            .cmd("PING")
            .hgetall(&b.meta)
            .add_command(evalsha(&script, &[]));
        assert_eq!(
            slot_groups(&pipe),
            vec![vec![0, 3], vec![1, 5], vec![2], vec![4, 6]]
        );
        let cmds: Vec<&Cmd> = pipe.cmd_iter().collect();
        assert_eq!(first_key(cmds[0]), Some(a.meta.as_bytes()));
        assert_eq!(first_key(cmds[2]), Some(DEADLINES_KEY.as_bytes()));
        assert_eq!(first_key(cmds[4]), None);
        assert_eq!(first_key(cmds[6]), None);
    }
}
