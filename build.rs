//! Records the git commit the binary is built from (`leasecore --version`, `GET /version`).
//!
//! `LEASECORE_GIT_COMMIT` in the build environment wins (a Docker build has no `.git`); else
//! `git rev-parse`; else "unknown". Never fails the build.

use std::process::Command;

fn main() {
    println!("cargo:rerun-if-env-changed=LEASECORE_GIT_COMMIT");
    // A new commit moves HEAD or the branch it names.
    println!("cargo:rerun-if-changed=.git/HEAD");
    if let Ok(head) = std::fs::read_to_string(".git/HEAD")
        && let Some(reference) = head.trim().strip_prefix("ref: ")
    {
        println!("cargo:rerun-if-changed=.git/{reference}");
    }
    let commit = std::env::var("LEASECORE_GIT_COMMIT")
        .ok()
        .filter(|c| !c.trim().is_empty())
        .or_else(git_commit)
        .unwrap_or_else(|| "unknown".to_string());
    println!("cargo:rustc-env=LEASECORE_GIT_COMMIT={commit}");
}

fn git_commit() -> Option<String> {
    let out = Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .output()
        .ok()?;
    let commit = String::from_utf8(out.stdout).ok()?.trim().to_string();
    (out.status.success() && !commit.is_empty()).then_some(commit)
}
