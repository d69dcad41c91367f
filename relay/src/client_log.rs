//! The Redis client's own log lines, rate-limited. The `redis` crate logs
//! through the `log` facade; while a cluster node is down, its cluster
//! connection logs every failed reconnect and every slot refresh, which was
//! 100-300 lines a second per relay. [`install`] puts [`ClientLog`] between
//! `log` and `tracing`: records of the `redis` crate's modules pass at most
//! once per [`WINDOW`] for each module and level, the others are counted,
//! and when the window ends one line says how many were left out and what
//! the last one said. Records of other crates pass unchanged.
//!
//! Never: drops a count. A window's summary is written by the next record of
//! its module and level, or by [`flush_every`], whichever comes first.

use std::collections::HashMap;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// How often one module of the Redis client may log at one level; the
/// summary of what was left out follows at the end of the window.
pub const WINDOW: Duration = Duration::from_secs(10);
/// Modules and levels tracked at once (the `redis` crate has a handful of
/// modules that log). Overflow policy: a record of another module passes
/// without a limit.
const MAX_KEYS: usize = 64;
/// Characters of the last left-out message kept for its summary.
const MAX_LAST_CHARS: usize = 300;
/// Target prefix of the records limited here.
const LIMITED_TARGET: &str = "redis";

/// What was left out in one window of one module and level.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Summary {
    /// The module (the `log` target).
    pub target: String,
    /// The level.
    pub level: log::Level,
    /// Records left out.
    pub suppressed: u64,
    /// The last one's message (cut to 300 characters).
    pub last: String,
}

#[derive(Debug)]
struct Window {
    start: Instant,
    suppressed: u64,
    last: String,
}

/// The limit itself, clock passed in: per module and level, the first
/// record of a window passes and the rest are counted.
#[derive(Debug, Default)]
pub struct Throttle {
    windows: HashMap<(String, log::Level), Window>,
}

impl Throttle {
    /// Takes a record at `now`: whether it passes, and the summary of the
    /// previous window of its module and level if that one ended with
    /// records left out.
    pub fn admit(
        &mut self,
        target: &str,
        level: log::Level,
        message: &dyn std::fmt::Display,
        now: Instant,
    ) -> (bool, Option<Summary>) {
        let key = (target.to_owned(), level);
        match self.windows.get_mut(&key) {
            Some(w) if now.duration_since(w.start) < WINDOW => {
                w.suppressed += 1;
                w.last = message.to_string().chars().take(MAX_LAST_CHARS).collect();
                (false, None)
            }
            Some(w) => {
                let ended = summary(&key, w);
                *w = Window {
                    start: now,
                    suppressed: 0,
                    last: String::new(),
                };
                (true, ended)
            }
            None => {
                if self.windows.len() < MAX_KEYS {
                    self.windows.insert(
                        key,
                        Window {
                            start: now,
                            suppressed: 0,
                            last: String::new(),
                        },
                    );
                }
                (true, None)
            }
        }
    }

    /// The summaries of the windows that ended by `now` with records left
    /// out; those windows are forgotten (the next record passes).
    pub fn due(&mut self, now: Instant) -> Vec<Summary> {
        let mut out = Vec::new();
        self.windows.retain(|key, w| {
            if now.duration_since(w.start) < WINDOW {
                return true;
            }
            out.extend(summary(key, w));
            false
        });
        out
    }
}

fn summary(key: &(String, log::Level), w: &Window) -> Option<Summary> {
    (w.suppressed > 0).then(|| Summary {
        target: key.0.clone(),
        level: key.1,
        suppressed: w.suppressed,
        last: w.last.clone(),
    })
}

/// The `log` logger: Redis client records through [`Throttle`], every
/// record on to `tracing`.
#[derive(Debug, Default)]
pub struct ClientLog {
    throttle: Mutex<Throttle>,
}

impl ClientLog {
    /// Writes the summaries of the windows that have ended.
    pub fn flush_due(&self) {
        let due = self.throttle.lock().due(Instant::now());
        for s in due {
            write_summary(&s);
        }
    }
}

impl log::Log for ClientLog {
    fn enabled(&self, metadata: &log::Metadata<'_>) -> bool {
        metadata.level() <= log::max_level()
    }

    fn log(&self, record: &log::Record<'_>) {
        if !self.enabled(record.metadata()) {
            return;
        }
        if record.target().starts_with(LIMITED_TARGET) {
            let (pass, ended) = self.throttle.lock().admit(
                record.target(),
                record.level(),
                record.args(),
                Instant::now(),
            );
            if let Some(s) = ended {
                write_summary(&s);
            }
            if !pass {
                return;
            }
        }
        let _ = tracing_log::format_trace(record);
    }

    fn flush(&self) {}
}

fn write_summary(s: &Summary) {
    tracing::warn!(
        target: "oab_relay::client_log",
        source = %s.target,
        level = %s.level,
        suppressed = s.suppressed,
        last = %s.last,
        "Redis client messages left out in the last {} s",
        WINDOW.as_secs()
    );
}

static LOGGER: OnceLock<ClientLog> = OnceLock::new();

/// Makes [`ClientLog`] the process's `log` logger, at the level of the
/// `tracing` subscriber already installed (call after it). Fails if another
/// `log` logger is installed.
pub fn install() -> Result<(), log::SetLoggerError> {
    let logger = LOGGER.get_or_init(ClientLog::default);
    log::set_logger(logger)?;
    let level = match tracing::level_filters::LevelFilter::current().into_level() {
        None => log::LevelFilter::Off,
        Some(tracing::Level::ERROR) => log::LevelFilter::Error,
        Some(tracing::Level::WARN) => log::LevelFilter::Warn,
        Some(tracing::Level::INFO) => log::LevelFilter::Info,
        Some(tracing::Level::DEBUG) => log::LevelFilter::Debug,
        Some(tracing::Level::TRACE) => log::LevelFilter::Trace,
    };
    log::set_max_level(level);
    Ok(())
}

/// Writes the summaries of ended windows every [`WINDOW`], so the count of
/// the last burst is written even when the Redis client goes quiet. Runs
/// until dropped.
pub async fn flush_every() {
    let mut tick = tokio::time::interval(WINDOW);
    loop {
        tick.tick().await;
        if let Some(logger) = LOGGER.get() {
            logger.flush_due();
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::*;

    #[test]
    fn one_record_per_window_passes_and_the_rest_are_counted() {
        let mut t = Throttle::default();
        let t0 = Instant::now();
        let target = "redis::cluster_handling::async_connection";
        let warn = log::Level::Warn;
        assert_eq!(t.admit(target, warn, &"down 0", t0), (true, None));
        for i in 1..=250u64 {
            let at = t0 + Duration::from_millis(i * 20);
            assert_eq!(
                t.admit(target, warn, &format!("down {i}"), at),
                (false, None)
            );
        }
        // Another level and another module have their own windows.
        assert!(t.admit(target, log::Level::Info, &"refresh", t0).0);
        assert!(t.admit("redis::aio", warn, &"x", t0).0);
        // Nothing is due before the window ends.
        assert!(t.due(t0 + Duration::from_secs(9)).is_empty());
        // The next record after the window passes and carries the count.
        let (pass, ended) = t.admit(target, warn, &"down again", t0 + WINDOW);
        assert!(pass);
        assert_eq!(
            ended,
            Some(Summary {
                target: target.into(),
                level: warn,
                suppressed: 250,
                last: "down 250".into(),
            })
        );
        // A window with nothing left out has no summary; one with some is
        // due at its end, then forgotten.
        assert!(!t.admit(target, warn, &"once more", t0 + WINDOW).0);
        let due = t.due(t0 + 2 * WINDOW);
        assert_eq!(due.len(), 1, "{due:?}");
        assert_eq!(due[0].suppressed, 1);
        assert!(t.windows.is_empty());
    }
}
