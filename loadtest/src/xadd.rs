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
//!
//! [`Via::Script`] makes the same `XADD`s from a Lua script that does
//! nothing else ([`FLOOR_LUA`], one `EVAL` per chunk, the chunk's entries
//! as its arguments, as the relay's `append` script gets a batch): the rate
//! any script-based append could reach on that server, whatever its checks.

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

/// The script of [`Via::Script`]: KEYS the stream; ARGV `MAXLEN`, then an
/// id and a frame per entry. Returns how many entries it appended.
pub const FLOOR_LUA: &str = "for i = 2, #ARGV - 1, 2 do \
     redis.call('XADD', KEYS[1], 'MAXLEN', ARGV[1], ARGV[i], 'f', ARGV[i + 1]) end \
     return (#ARGV - 1) / 2";

/// How the entries are sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Via {
    /// One pipelined `XADD` command per entry.
    Commands,
    /// One `EVAL` of [`FLOOR_LUA`] per chunk of entries.
    Script,
}

/// What one `XADD` measurement did.
#[derive(Debug, Clone, Serialize)]
pub struct XaddResult {
    /// How the entries were sent.
    pub via: Via,
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
#[allow(clippy::too_many_arguments)]
pub async fn measure(
    via: Via,
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
            // Sequence 1 is the relay's `Open`: entries start at 2 there.
            let ids: Vec<String> = (sent + 2..sent + 2 + CHUNK)
                .map(|seq| format!("{seq}-0"))
                .collect();
            sent += CHUNK;
            match via {
                Via::Commands => {
                    for id in &ids {
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
                }
                Via::Script => {
                    let mut args: Vec<&[u8]> = vec![
                        b"EVAL",
                        FLOOR_LUA.as_bytes(),
                        b"1",
                        stream.as_bytes(),
                        maxlen.as_bytes(),
                    ];
                    for id in &ids {
                        args.push(id.as_bytes());
                        args.push(&entry);
                    }
                    command(&mut out, &args);
                }
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
        via,
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

/// Counts appended entries across reads: one per `XADD` reply (a bulk
/// string), `n` per script reply (an integer); any other reply is an error.
#[derive(Debug, Default)]
struct Replies {
    pending: Vec<u8>,
}

impl Replies {
    /// Takes the bytes of one read; returns how many entries the replies
    /// completed in it counted.
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
            let number = || -> anyhow::Result<u64> {
                std::str::from_utf8(line)
                    .ok()
                    .and_then(|l| l.parse().ok())
                    .with_context(|| format!("reply {:?}", String::from_utf8_lossy(line)))
            };
            match rest.first() {
                // The script's reply: how many entries it appended.
                Some(b':') => {
                    done += number()?;
                    at += eol + 2;
                }
                // An entry id.
                Some(b'$') => {
                    let whole = eol + 2 + usize::try_from(number()?)? + 2;
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

    #[test]
    fn a_script_reply_counts_its_entries() {
        let mut r = Replies::default();
        assert_eq!(r.feed(b":256\r\n:2").unwrap(), 256);
        assert_eq!(r.feed(b"56\r\n$3\r\n2-0\r\n").unwrap(), 257);
        assert!(r.feed(b":x\r\n").is_err());
    }
}
