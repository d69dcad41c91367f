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

/// Installs the global subscriber (once per process; later calls do nothing).
pub fn init(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("OAB_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // Colour only on a terminal: logs redirected to a file or a journal stay
    // plain text that `grep` matches.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    let _ = match format {
        LogFormat::Json => builder.json().try_init(),
        LogFormat::Text => builder.try_init(),
    };
}
