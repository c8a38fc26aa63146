//! The backup file: a snapshot payload behind a header that says what it holds and checks it.
//!
//! Layout: `magic (8 bytes "LCBACKUP") | header length (u32 BE) | header (JSON) | payload`.
//! The header carries the format version, the store revision, counts, the payload length and
//! the payload's CRC-32 (crc32fast, the checksum sled itself uses). The payload is exactly the
//! Raft snapshot payload the state machine builds and installs, so a restore can hand it to
//! openraft as it is.
//!
//! # Invariants
//! - `decode` accepts only a file whose magic, version, length and checksum all match: a
//!   truncated or altered backup is refused, never restored in part.
//! - A file may end as etcd's snapshots do (what `etcdctl snapshot save` insists on): zero
//!   padding to a multiple of 512 bytes, then the SHA-256 of everything before it. Both are
//!   checked, then ignored.
//! - Pure: bytes in, bytes out; the callers read and write files.

use serde::{Deserialize, Serialize};
use sha2::Digest;
use thiserror::Error;

/// The first bytes of every backup file.
pub const MAGIC: &[u8; 8] = b"LCBACKUP";
/// The format this code writes and reads.
pub const FORMAT_VERSION: u32 = 1;
/// The largest header accepted (it is a few hundred bytes).
const MAX_HEADER: usize = 64 << 10;

/// What a backup holds, readable without decoding the payload.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BackupHeader {
    pub format_version: u32,
    /// The store revision the state was taken at.
    pub revision: u64,
    /// The Raft log index it was taken at, on the node that took it.
    pub applied_index: u64,
    /// The node that took it.
    pub node_id: u64,
    pub keys: u64,
    pub leases: u64,
    pub payload_bytes: u64,
    /// CRC-32 (IEEE) of the payload.
    pub crc32: u32,
}

/// Why a file is not a usable backup.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum BackupError {
    #[error("not a leasecore backup (bad magic)")]
    NotABackup,
    #[error("backup format {0} is not supported (this build reads format {FORMAT_VERSION})")]
    Version(u32),
    #[error("the backup is truncated or corrupt: {0}")]
    Corrupt(String),
    #[error("checksum mismatch: header says {expected:08x}, payload has {actual:08x}")]
    Checksum { expected: u32, actual: u32 },
}

/// The CRC-32 of `payload`.
pub fn checksum(payload: &[u8]) -> u32 {
    crc32fast::hash(payload)
}

/// A backup file of `payload`, described by `header` (its length and checksum are filled in).
pub fn encode(mut header: BackupHeader, payload: &[u8]) -> Vec<u8> {
    header.format_version = FORMAT_VERSION;
    header.payload_bytes = payload.len() as u64;
    header.crc32 = checksum(payload);
    let head = serde_json::to_vec(&header).expect("a header always encodes");
    let mut out = Vec::with_capacity(MAGIC.len() + 4 + head.len() + payload.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&(head.len() as u32).to_be_bytes());
    out.extend_from_slice(&head);
    out.extend_from_slice(payload);
    out
}

/// etcdctl expects a snapshot's body to be a whole number of these (bbolt's pages).
const ETCD_PAGE: usize = 512;

/// `file` as etcd's `Snapshot` stream sends a database: zero-padded to a multiple of 512
/// bytes, then its SHA-256 (which `etcdctl snapshot save` checks).
pub fn with_etcd_hash(mut file: Vec<u8>) -> Vec<u8> {
    file.resize(file.len().div_ceil(ETCD_PAGE) * ETCD_PAGE, 0);
    let hash = sha2::Sha256::digest(&file);
    file.extend_from_slice(&hash);
    file
}

/// The header and payload of a backup file, verified.
pub fn decode(file: &[u8]) -> Result<(BackupHeader, &[u8]), BackupError> {
    if file.len() < MAGIC.len() || &file[..MAGIC.len()] != MAGIC {
        return Err(BackupError::NotABackup);
    }
    let rest = &file[MAGIC.len()..];
    let len: [u8; 4] = rest
        .get(..4)
        .and_then(|b| b.try_into().ok())
        .ok_or_else(|| BackupError::Corrupt("no header length".into()))?;
    let len = u32::from_be_bytes(len) as usize;
    if len > MAX_HEADER {
        return Err(BackupError::Corrupt(format!("header of {len} bytes")));
    }
    let head = rest
        .get(4..4 + len)
        .ok_or_else(|| BackupError::Corrupt("header cut short".into()))?;
    let header: BackupHeader =
        serde_json::from_slice(head).map_err(|e| BackupError::Corrupt(e.to_string()))?;
    if header.format_version != FORMAT_VERSION {
        return Err(BackupError::Version(header.format_version));
    }
    let mut payload = &rest[4 + len..];
    let extra = (payload.len() as u64).saturating_sub(header.payload_bytes) as usize;
    if (32..32 + ETCD_PAGE).contains(&extra) {
        let (body, hash) = file.split_at(file.len() - 32);
        let padding = &payload[payload.len() - extra..payload.len() - 32];
        if sha2::Sha256::digest(body).as_slice() != hash || padding.iter().any(|b| *b != 0) {
            return Err(BackupError::Corrupt(
                "the trailing SHA-256 (etcd's snapshot hash) does not match".into(),
            ));
        }
        payload = &payload[..payload.len() - extra];
    }
    if payload.len() as u64 != header.payload_bytes {
        return Err(BackupError::Corrupt(format!(
            "payload of {} bytes, header says {}",
            payload.len(),
            header.payload_bytes
        )));
    }
    let actual = checksum(payload);
    if actual != header.crc32 {
        return Err(BackupError::Checksum {
            expected: header.crc32,
            actual,
        });
    }
    Ok((header, payload))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header() -> BackupHeader {
        BackupHeader {
            format_version: 0,
            revision: 42,
            applied_index: 50,
            node_id: 1,
            keys: 2,
            leases: 1,
            payload_bytes: 0,
            crc32: 0,
        }
    }

    #[test]
    fn round_trip() {
        let file = encode(header(), b"{\"kv\":{}}");
        let (h, payload) = decode(&file).unwrap();
        assert_eq!(payload, b"{\"kv\":{}}");
        assert_eq!((h.revision, h.format_version, h.payload_bytes), (42, 1, 9));
    }

    #[test]
    fn etcds_trailing_hash_is_checked_then_ignored() {
        let file = encode(header(), b"{\"kv\":{}}");
        let hashed = with_etcd_hash(file.clone());
        assert_eq!(decode(&hashed).unwrap().1, b"{\"kv\":{}}");
        let mut bad = hashed.clone();
        *bad.last_mut().unwrap() ^= 1;
        assert!(matches!(decode(&bad), Err(BackupError::Corrupt(_))));
    }

    #[test]
    fn every_damage_is_refused() {
        let file = encode(header(), b"payload bytes");
        assert_eq!(decode(b"junk"), Err(BackupError::NotABackup));
        assert!(matches!(
            decode(&file[..file.len() - 1]),
            Err(BackupError::Corrupt(_))
        ));
        assert!(matches!(decode(&file[..10]), Err(BackupError::Corrupt(_))));
        let mut flipped = file.clone();
        *flipped.last_mut().unwrap() ^= 1;
        assert!(matches!(
            decode(&flipped),
            Err(BackupError::Checksum { .. })
        ));
        let mut longer = file;
        longer.push(b'x');
        assert!(matches!(decode(&longer), Err(BackupError::Corrupt(_))));
    }
}
