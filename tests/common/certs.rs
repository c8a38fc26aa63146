//! Throw-away TLS certificates for tests, made by scripts/certs.sh (needs openssl).

use std::path::{Path, PathBuf};
use std::process::Command;

use leasecore::tls::IdentityFiles;

/// Certificates for `nodes` nodes (and a client) in `dir`; returns `dir`.
pub fn make_certs(dir: &Path, nodes: usize) -> PathBuf {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/certs.sh");
    let out = Command::new("bash")
        .arg(script)
        .arg(dir)
        .arg(nodes.to_string())
        .output()
        .expect("run scripts/certs.sh (needs openssl)");
    assert!(
        out.status.success(),
        "scripts/certs.sh failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    dir.to_path_buf()
}

/// The certificate and key files of `name` (`node-1`, `client`...) in `dir`.
pub fn identity(dir: &Path, name: &str) -> IdentityFiles {
    IdentityFiles {
        cert: dir.join(format!("{name}.pem")),
        key: dir.join(format!("{name}-key.pem")),
    }
}
