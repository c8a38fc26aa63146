//! Backups of the applied state (`GET /v1/snapshot`, `leasecore snapshot save`) and seeding a
//! new cluster's data dir from one (`leasecore snapshot restore`).
//!
//! A backup is taken from one consistent view: the state is copied under the state machine's
//! read lock, which `apply` holds while it changes the state, so the copy is the state after
//! one whole applied batch (one revision), never between two entries.
//!
//! Every node of the new cluster is restored from the same backup with the same voter list:
//! each starts with the same snapshot at the same log id (term 0, node 0, index 1: before any leader of
//! the new cluster, which elects its first leader at term 1 and appends after it), holding the
//! backup's keys, revisions and leases and the new membership. Leases are facts without
//! deadlines: the new leader gives each a full TTL from its promotion.
//!
//! # Invariants
//! - Only an absent or empty directory is written: a restore never overwrites a node's data.
//! - The backup is verified (magic, version, length, checksum, payload decodes) before anything
//!   is written.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use openraft::{BasicNode, CommittedLeaderId, Membership};
use thiserror::Error;

use super::state_machine::StateView;
use super::{LogId, NodeId, SnapshotMeta, StoredMembership};
use crate::storage::backup::{self, BackupError, BackupHeader};

/// Why a restore did not happen.
#[derive(Debug, Error)]
pub enum RestoreError {
    #[error(transparent)]
    Backup(#[from] BackupError),
    #[error("the backup payload does not decode: {0}")]
    Payload(String),
    #[error("{0} exists and is not empty: restore into a new directory")]
    NotEmpty(String),
    #[error("--peers must list this node ({0}) with the address its peers reach it at")]
    NotInPeers(NodeId),
    #[error("{0}")]
    Io(String),
    #[error(transparent)]
    Storage(#[from] crate::storage::StorageError),
}

/// A backup file of this node's applied state, now. Copying holds the state lock for a
/// moment; encoding a large state takes longer: call this off the async workers.
pub fn take(view: &StateView, node_id: NodeId) -> (BackupHeader, Vec<u8>) {
    let (kv, applied_index) = view.with_state(|kv| (kv.snapshot(), view.applied().log_index));
    let header = BackupHeader {
        format_version: backup::FORMAT_VERSION,
        revision: kv.revision.0,
        applied_index,
        node_id,
        keys: kv.keys.len() as u64,
        leases: kv.leases.len() as u64,
        payload_bytes: 0,
        crc32: 0,
    };
    // Plain data with string keys: encoding cannot fail.
    let payload = super::state_machine::encode_payload(kv).unwrap_or_default();
    let file = backup::encode(header.clone(), &payload);
    let header = BackupHeader {
        payload_bytes: payload.len() as u64,
        crc32: backup::checksum(&payload),
        ..header
    };
    (header, file)
}

/// Verify `file` and write a data dir in `dir` for node `id` of a new cluster of `peers`.
pub fn restore_data_dir(
    file: &[u8],
    dir: &Path,
    id: NodeId,
    peers: &BTreeMap<NodeId, String>,
) -> Result<BackupHeader, RestoreError> {
    let (header, payload) = backup::decode(file)?;
    let kv = super::state_machine::decode_payload(payload)
        .map_err(|e| RestoreError::Payload(e.to_string()))?;
    if !peers.contains_key(&id) {
        return Err(RestoreError::NotInPeers(id));
    }
    match std::fs::read_dir(dir) {
        Ok(mut entries) => {
            if entries.next().is_some() {
                return Err(RestoreError::NotEmpty(dir.display().to_string()));
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(RestoreError::Io(format!("{}: {e}", dir.display()))),
    }
    std::fs::create_dir_all(dir)
        .map_err(|e| RestoreError::Io(format!("{}: {e}", dir.display())))?;

    // The same log id on every restored node: openraft's leader id carries a node id, and a
    // per-node one would make the nodes' snapshots different log entries (node 0, like the
    // id openraft gives the entry that initializes a cluster).
    let last = LogId::new(CommittedLeaderId::new(0, 0), 1);
    let voters: BTreeSet<NodeId> = peers.keys().copied().collect();
    let nodes: BTreeMap<NodeId, BasicNode> = peers
        .iter()
        .map(|(id, addr)| (*id, BasicNode::new(addr)))
        .collect();
    let meta = SnapshotMeta {
        last_log_id: Some(last),
        last_membership: StoredMembership::new(Some(last), Membership::new(vec![voters], nodes)),
        snapshot_id: format!("restore-{}", header.revision),
    };
    let db = crate::storage::open_db(dir, 16 << 20)?;
    super::state_machine::seed(&db, dir, &meta, payload, &kv)?;
    super::log_store::seed(&db, last)?;
    Ok(header)
}
