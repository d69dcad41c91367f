//! Build information for `--version` and `/status`: the git commit (short)
//! and the build date (UTC), passed to the crate as `OAB_GIT_COMMIT` and
//! `OAB_BUILD_DATE`.
//!
//! - Commit: `git rev-parse --short HEAD`; `unknown` without git or outside a
//!   repository (a source tarball), or `OAB_GIT_COMMIT` when set (an image
//!   build that has no `.git`).
//! - Date: `SOURCE_DATE_EPOCH` when set (reproducible builds), else the time
//!   this script ran.
//!
//! The script reruns only when HEAD moves (a commit, a checkout) or one of
//! those variables changes, not on every build: `cargo:rerun-if-changed` on
//! the HEAD file, the ref it points to and `packed-refs`. So the date is when
//! the current commit was first built here.

#![allow(dead_code)] // src/time.rs has more than the date this script needs

use std::path::PathBuf;
use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    if !out.status.success() {
        return None;
    }
    let s = String::from_utf8(out.stdout).ok()?.trim().to_string();
    (!s.is_empty()).then_some(s)
}

include!("src/time.rs");

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=src/time.rs");
    println!("cargo:rerun-if-env-changed=SOURCE_DATE_EPOCH");
    println!("cargo:rerun-if-env-changed=OAB_GIT_COMMIT");
    // Only files that exist: cargo reruns a script whose watched file is
    // missing on every build.
    for path in [
        git(&["rev-parse", "--git-path", "HEAD"]),
        git(&["rev-parse", "--git-path", "packed-refs"]),
        git(&["symbolic-ref", "-q", "HEAD"]).and_then(|r| git(&["rev-parse", "--git-path", &r])),
    ]
    .into_iter()
    .flatten()
    {
        let p = PathBuf::from(&path);
        if p.exists() {
            println!("cargo:rerun-if-changed={}", p.display());
        }
    }
    let commit = std::env::var("OAB_GIT_COMMIT")
        .ok()
        .filter(|s| !s.trim().is_empty())
        .or_else(|| git(&["rev-parse", "--short", "HEAD"]))
        .unwrap_or_else(|| "unknown".into());
    let secs = std::env::var("SOURCE_DATE_EPOCH")
        .ok()
        .and_then(|s| s.trim().parse::<i64>().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs() as i64)
        });
    let date = utc_rfc3339(secs);
    println!("cargo:rustc-env=OAB_GIT_COMMIT={commit}");
    println!("cargo:rustc-env=OAB_BUILD_DATE={date}");
}
