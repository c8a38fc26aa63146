//! `leasecore snapshot save|status|restore`: backups of a running cluster, and new clusters
//! seeded from them.
//!
//! - `save FILE` fetches `GET /v1/snapshot` (linearizable, one revision), verifies it, and
//!   writes it atomically (temporary file, fsync, rename): a failed save leaves no file.
//! - `status FILE` verifies a backup and prints what it holds.
//! - `restore FILE --data DIR --id N --peers ...` writes a new data dir (see
//!   `leasecore::raft::backup`); run it once per node of the new cluster, with the same FILE
//!   and --peers, then start each node with `leasecore serve` and the same flags.
//!
//! It decides nothing about the state: formats and checks live in the library.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use clap::Subcommand;
use leasecore::domain::types::NodeId;
use leasecore::raft::backup::restore_data_dir;
use leasecore::storage::backup::{self, BackupHeader};

#[derive(Subcommand)]
pub enum SnapshotCmd {
    /// Save a consistent backup of the running cluster to FILE.
    Save {
        /// Where to write the backup (replaced atomically; nothing is written on failure).
        file: PathBuf,
        /// Back up the first answering node's own applied state, without a quorum round (when
        /// quorum is lost for good; see the README's disaster recovery).
        #[arg(long)]
        local: bool,
    },
    /// Verify a backup and print what it holds.
    Status {
        /// The backup file to verify.
        file: PathBuf,
    },
    /// Write a data dir for node --id of a new cluster (--peers) from a backup.
    Restore {
        /// The backup file to seed the new cluster from.
        file: PathBuf,
        /// The data dir to create (must not exist, or be empty).
        #[arg(long)]
        data: PathBuf,
        /// This node's id in the new cluster.
        #[arg(long)]
        id: NodeId,
        /// The new cluster's voters, this node included: ID=HOST:PORT,...
        #[arg(long, value_parser = super::serve::parse_peers)]
        peers: BTreeMap<NodeId, String>,
    },
}

/// Run one snapshot command; `endpoints` are the nodes `save` may ask.
pub async fn run(
    cmd: SnapshotCmd,
    endpoints: &[String],
    json: bool,
    token: Option<String>,
) -> ExitCode {
    let result = match cmd {
        SnapshotCmd::Save { file, local } => save(&file, endpoints, local, token).await,
        SnapshotCmd::Status { file } => std::fs::read(&file)
            .map_err(|e| format!("reading {}: {e}", file.display()))
            .and_then(|bytes| {
                backup::decode(&bytes)
                    .map(|(h, _)| h)
                    .map_err(|e| format!("{}: {e}", file.display()))
            }),
        SnapshotCmd::Restore {
            file,
            data,
            id,
            peers,
        } => std::fs::read(&file)
            .map_err(|e| format!("reading {}: {e}", file.display()))
            .and_then(|bytes| {
                restore_data_dir(&bytes, &data, id, &peers).map_err(|e| e.to_string())
            })
            .inspect(|_| {
                let list: Vec<String> = peers.iter().map(|(i, a)| format!("{i}={a}")).collect();
                eprintln!(
                    "restored into {}; start it with: leasecore serve --id {id} --data {} --listen {} --peers {}",
                    data.display(),
                    data.display(),
                    peers[&id],
                    list.join(",")
                );
            }),
    };
    match result {
        Ok(header) => {
            print_header(&header, json);
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn print_header(h: &BackupHeader, json: bool) {
    if json {
        println!("{}", serde_json::to_string(h).unwrap_or_default());
    } else {
        println!(
            "revision {}  keys {}  leases {}  applied_index {} (node {})  payload {} bytes  crc32 {:08x}  format {}",
            h.revision,
            h.keys,
            h.leases,
            h.applied_index,
            h.node_id,
            h.payload_bytes,
            h.crc32,
            h.format_version
        );
    }
}

/// Fetch a backup from the first endpoint that serves one, verify it, write it atomically.
async fn save(
    file: &Path,
    endpoints: &[String],
    local: bool,
    token: Option<String>,
) -> Result<BackupHeader, String> {
    let http = leasecore::client::http_builder()
        // A large state takes a while to encode and send; bounded all the same.
        .timeout(Duration::from_secs(600))
        .connect_timeout(Duration::from_secs(5))
        .build()
        .map_err(|e| e.to_string())?;
    let mut errors = Vec::new();
    for ep in endpoints {
        let mut url = format!("{}/v1/snapshot", ep.trim_end_matches('/'));
        if local {
            url.push_str("?consistency=local");
        }
        let mut req = http.get(&url);
        if let Some(t) = &token {
            req = req.bearer_auth(t);
        }
        let resp = match req.send().await {
            Ok(r) => r,
            Err(e) => {
                errors.push(format!("{ep}: {e}"));
                continue;
            }
        };
        let status = resp.status();
        let body = match resp.bytes().await {
            Ok(b) => b,
            Err(e) => {
                errors.push(format!("{ep}: {e}"));
                continue;
            }
        };
        if !status.is_success() {
            errors.push(format!("{ep}: {status} {}", String::from_utf8_lossy(&body)));
            continue;
        }
        let header = backup::decode(&body)
            .map(|(h, _)| h)
            .map_err(|e| format!("{ep} sent a bad backup: {e}"))?;
        write_atomically(file, &body).map_err(|e| format!("writing {}: {e}", file.display()))?;
        return Ok(header);
    }
    Err(format!(
        "no endpoint served a backup: {}",
        errors.join("; ")
    ))
}

fn write_atomically(file: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let mut tmp = file.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
    }
    std::fs::rename(&tmp, file)
}
