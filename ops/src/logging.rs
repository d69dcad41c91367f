//! The log subscriber both binaries install: the `OAB_LOG` filter (the
//! `RUST_LOG` syntax; unset or invalid: `info`), lines on stderr, as text
//! (colour only on a terminal) or as one JSON object per line.

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LogFormat {
    /// Human-readable lines (the default).
    #[default]
    Text,
    /// One JSON object per line (for log collectors).
    Json,
}

impl std::str::FromStr for LogFormat {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "text" | "" => Ok(LogFormat::Text),
            "json" => Ok(LogFormat::Json),
            other => Err(format!("expected text or json, got {other:?}")),
        }
    }
}

/// Installs the global subscriber (once per process; later calls do nothing
/// and return false). With `bridge_log`, records of crates that log through
/// the `log` crate are written too; without it the caller installs its own
/// `log` logger (the relay rate-limits the Redis client's records).
pub fn init(format: LogFormat, bridge_log: bool) -> bool {
    let filter = tracing_subscriber::EnvFilter::try_from_env("OAB_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // Colour only on a terminal: logs redirected to a file or a journal stay
    // plain text that `grep` matches.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    let installed = match format {
        LogFormat::Json => tracing::subscriber::set_global_default(builder.json().finish()),
        LogFormat::Text => tracing::subscriber::set_global_default(builder.finish()),
    }
    .is_ok();
    if installed && bridge_log {
        let _ = tracing_log::LogTracer::init();
    }
    installed
}

/// An error and its causes as one line (`a: b: c`), as a command prints it
/// when it fails: never a backtrace, and a cause whose text the line
/// already holds (an error that prints its source itself) is not repeated.
pub fn error_line<'a>(
    chain: impl IntoIterator<Item = &'a (dyn std::error::Error + 'static)>,
) -> String {
    let mut out = String::new();
    for cause in chain {
        let text = cause.to_string();
        if text.is_empty() || out.contains(&text) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&text);
    }
    out
}

#[cfg(test)]
mod error_line_tests {
    #[derive(Debug, thiserror::Error)]
    #[error("cannot read f: {source}")]
    struct Outer {
        source: std::io::Error,
    }

    #[test]
    fn a_cause_already_said_is_not_repeated() {
        let e = Outer {
            source: std::io::Error::other("gone"),
        };
        let chain: Vec<&(dyn std::error::Error + 'static)> =
            vec![&e, std::error::Error::source(&e).unwrap_or(&e)];
        assert_eq!(super::error_line(chain), "cannot read f: gone");
    }
}
