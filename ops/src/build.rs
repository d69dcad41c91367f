//! Build information, fixed at compile time by this crate's `build.rs`.
//!
//! The commit is the workspace's (`git rev-parse --short HEAD` when built,
//! `unknown` without git), the date is `SOURCE_DATE_EPOCH` or the time the
//! build script last ran (it reruns when HEAD moves), in UTC.

/// The version of the workspace's crates.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
/// The git commit built (short), or `unknown`.
pub const COMMIT: &str = env!("OAB_GIT_COMMIT");
/// The build date, UTC, RFC 3339 (`2026-12-01T07:30:00Z`).
pub const DATE: &str = env!("OAB_BUILD_DATE");
/// What `--version` prints after the binary's name:
/// `0.1.0 (commit 5ccbb06, built 2026-12-01T07:30:00Z)`.
pub const LONG_VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (commit ",
    env!("OAB_GIT_COMMIT"),
    ", built ",
    env!("OAB_BUILD_DATE"),
    ")"
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_long_version_names_the_version_commit_and_date() {
        assert!(LONG_VERSION.starts_with(VERSION));
        assert!(LONG_VERSION.contains(COMMIT) && LONG_VERSION.contains(DATE));
        assert!(!COMMIT.is_empty());
        // 2026-12-01T07:30:00Z
        assert_eq!(DATE.len(), 20, "{DATE}");
        assert!(DATE.ends_with('Z') && DATE.as_bytes()[10] == b'T', "{DATE}");
    }
}
