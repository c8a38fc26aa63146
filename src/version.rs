//! What this build is: the package version, the git commit, the HTTP API version and the
//! on-disk format it reads and writes. Shown by `leasecore --version` and `GET /version`, so
//! that an operator can tell which binary answers before a rolling upgrade.

use serde::{Deserialize, Serialize};

/// The package version (Cargo.toml).
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
/// The commit the binary was built from (`build.rs`), or "unknown".
pub const GIT_COMMIT: &str = env!("LEASECORE_GIT_COMMIT");
/// The HTTP API's version: the `/v1` prefix of its routes.
pub const API_VERSION: &str = "v1";

/// `GET /version`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VersionInfo {
    pub version: String,
    pub git_commit: String,
    pub api_version: String,
    /// The data directory format this build reads and writes.
    pub storage_format: u32,
    /// The backup file format `snapshot save` writes.
    pub backup_format: u32,
}

impl VersionInfo {
    pub fn of_this_build() -> Self {
        VersionInfo {
            version: VERSION.to_string(),
            git_commit: GIT_COMMIT.to_string(),
            api_version: API_VERSION.to_string(),
            storage_format: crate::storage::STORAGE_FORMAT,
            backup_format: crate::storage::backup::FORMAT_VERSION,
        }
    }

    /// The text of `leasecore --version`'s long form.
    pub fn long(&self) -> String {
        format!(
            "{} (commit {})\nAPI: {}\nstorage format: {}\nbackup format: {}",
            self.version,
            self.git_commit,
            self.api_version,
            self.storage_format,
            self.backup_format
        )
    }
}
