//! Redis's own rate for the relay's writes, without the relay: pipelined
//! `XADD`s on the relay's `redis-server`, in the same run, so a relay
//! figure on the Redis store can be given as a ratio to what that Redis does
//! on its own.
//!
//! The shape is the relay's: one stream per delegation log, each entry one
//! `XADD <stream> MAXLEN <max_log_entries> <seq>-0 f <frame>` with the frame
//! as long as the relay case's frames (prefix, header, payload), over the
//! same unix socket the relay uses. Commands go in chunks of [`CHUNK`] (the
//! relay's read batch) with at most `window` unanswered, the window of the
//! relay case. What the relay adds per entry (its Lua script's checks and
//! meta hash, the peer byte budget) is what the ratio measures.

use std::path::Path;
use std::time::Duration;

use anyhow::{Context as _, bail};
use serde::Serialize;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::time::Instant;

/// Commands written at a time: the relay's read batch (`session::MAX_BATCH`).
pub const CHUNK: u64 = 256;
/// How long the whole measurement may take beyond its sending time before
/// it fails (a Redis that stopped answering).
const DRAIN: Duration = Duration::from_secs(10);

/// What one `XADD` measurement did.
#[derive(Debug, Clone, Serialize)]
pub struct XaddResult {
    /// Bytes per entry (the relay case's frame length).
    pub entry_bytes: usize,
    /// Unanswered commands at most.
    pub window: u64,
    /// Commands per write.
    pub chunk: u64,
    /// Entries appended (every reply was an entry id).
    pub appended: u64,
    /// First write to last reply, seconds.
    pub seconds: f64,
    /// Entries per second.
    pub per_sec: f64,
}

/// Appends `entry_bytes`-long entries to a fresh stream `stream` on the
/// `redis-server` at `socket` for `seconds` (or `max` entries), keeping at
/// most `window` unanswered, then deletes the stream.
pub async fn measure(
    socket: &Path,
    stream: &str,
    entry_bytes: usize,
    max_log_entries: u64,
    window: u64,
    seconds: f64,
    max: u64,
) -> anyhow::Result<XaddResult> {
    let mut s = tokio::net::UnixStream::connect(socket)
        .await
        .with_context(|| format!("connecting to redis at {}", socket.display()))?;
    let entry = vec![b'x'; entry_bytes];
    let window = window.max(CHUNK);
    let maxlen = max_log_entries.to_string();
    let t0 = Instant::now();
    let stop_sending = t0 + Duration::from_secs_f64(seconds);
    let give_up = stop_sending + DRAIN;
    let (mut sent, mut answered) = (0u64, 0u64);
    let mut out = Vec::with_capacity((entry_bytes + 96) * CHUNK as usize);
    let mut replies = Replies::default();
    let mut buf = vec![0u8; 64 * 1024];
    let mut last = t0;
    loop {
        let sending = Instant::now() < stop_sending && sent < max;
        while sending && sent - answered + CHUNK <= window {
            out.clear();
            for _ in 0..CHUNK {
                sent += 1;
                // Sequence 1 is the relay's `Open`: entries start at 2 there.
                let id = format!("{}-0", sent + 1);
                command(
                    &mut out,
                    &[
                        b"XADD",
                        stream.as_bytes(),
                        b"MAXLEN",
                        maxlen.as_bytes(),
                        id.as_bytes(),
                        b"f",
                        &entry,
                    ],
                );
            }
            s.write_all(&out).await.context("writing XADDs")?;
        }
        if answered == sent && !sending {
            break;
        }
        let n = tokio::time::timeout_at(give_up, s.read(&mut buf))
            .await
            .context("redis stopped answering XADDs")?
            .context("reading XADD replies")?;
        if n == 0 {
            bail!("redis closed the connection");
        }
        answered += replies.feed(buf.get(..n).unwrap_or_default())?;
        last = Instant::now();
    }
    let mut del = Vec::new();
    command(&mut del, &[b"DEL", stream.as_bytes()]);
    s.write_all(&del).await.context("DEL")?;
    let _ = tokio::time::timeout(DRAIN, s.read(&mut buf)).await;
    let secs = last.duration_since(t0).as_secs_f64();
    Ok(XaddResult {
        entry_bytes,
        window,
        chunk: CHUNK,
        appended: answered,
        seconds: secs,
        per_sec: if secs > 0.0 {
            answered as f64 / secs
        } else {
            0.0
        },
    })
}

/// Appends one command in RESP to `out`.
fn command(out: &mut Vec<u8>, args: &[&[u8]]) {
    out.extend_from_slice(format!("*{}\r\n", args.len()).as_bytes());
    for a in args {
        out.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
        out.extend_from_slice(a);
        out.extend_from_slice(b"\r\n");
    }
}

/// Counts `XADD` replies (bulk strings) across reads; any other reply is an
/// error.
#[derive(Debug, Default)]
struct Replies {
    pending: Vec<u8>,
}

impl Replies {
    /// Takes the bytes of one read; returns how many replies completed.
    fn feed(&mut self, bytes: &[u8]) -> anyhow::Result<u64> {
        self.pending.extend_from_slice(bytes);
        let mut at = 0usize;
        let mut done = 0u64;
        loop {
            let rest = self.pending.get(at..).unwrap_or_default();
            let Some(eol) = rest.windows(2).position(|w| w == b"\r\n") else {
                break;
            };
            let line = rest.get(1..eol).unwrap_or_default();
            match rest.first() {
                Some(b'$') => {
                    let len: usize = std::str::from_utf8(line)
                        .ok()
                        .and_then(|l| l.parse().ok())
                        .with_context(|| {
                            format!("XADD reply {:?}", String::from_utf8_lossy(line))
                        })?;
                    let whole = eol + 2 + len + 2;
                    if rest.len() < whole {
                        break;
                    }
                    at += whole;
                    done += 1;
                }
                _ => bail!(
                    "XADD answered {:?}",
                    String::from_utf8_lossy(rest.get(..eol).unwrap_or_default())
                ),
            }
        }
        self.pending.drain(..at);
        Ok(done)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replies_are_counted_across_reads_and_errors_fail() {
        let mut r = Replies::default();
        assert_eq!(r.feed(b"$3\r\n2-0\r\n$3\r\n3-").unwrap(), 1);
        assert_eq!(r.feed(b"0\r\n").unwrap(), 1);
        assert!(r.feed(b"-ERR out of memory\r\n").is_err());
    }
}
