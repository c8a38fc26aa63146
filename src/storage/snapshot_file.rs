//! The latest snapshot, as one file beside the sled database.
//!
//! A snapshot is the whole state: megabytes at scale. Kept inside sled, writing it would ride
//! on the same flushes as the Raft log and stall appends; kept in its own file it is written
//! and fsynced off the write path. Format: `[u64 BE meta length][meta JSON][data]`.
//!
//! # Invariants
//! - Replaced atomically: written to a temporary file, fsynced, renamed over the old one, and
//!   the directory fsynced. A crash leaves the old snapshot or the new one, never a torn one.
//! - Written in chunks, each synced before the next: one fsync of hundreds of megabytes at the
//!   end would flush them all at once, and the Raft log's small fsyncs would queue behind it
//!   (write latency spiked to hundreds of milliseconds during snapshots at a million keys).

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

/// The file name of the latest snapshot in the data directory.
pub const FILE_NAME: &str = "snapshot.bin";
/// Bytes written between two data syncs of the snapshot file.
const SYNC_EVERY: usize = 4 << 20;

/// Where the snapshot of a node lives.
#[derive(Clone, Debug)]
pub struct SnapshotFile {
    path: PathBuf,
}

impl SnapshotFile {
    pub fn new(dir: &Path) -> Self {
        SnapshotFile {
            path: dir.join(FILE_NAME),
        }
    }

    /// Write `meta` and `data` durably, replacing any previous snapshot.
    pub fn write(&self, meta: &[u8], data: &[u8]) -> std::io::Result<()> {
        let tmp = self.path.with_extension("tmp");
        {
            let mut f = fs::File::create(&tmp)?;
            f.write_all(&(meta.len() as u64).to_be_bytes())?;
            f.write_all(meta)?;
            for chunk in data.chunks(SYNC_EVERY) {
                f.write_all(chunk)?;
                f.sync_data()?;
            }
            f.sync_all()?;
        }
        fs::rename(&tmp, &self.path)?;
        if let Some(dir) = self.path.parent() {
            fs::File::open(dir)?.sync_all()?;
        }
        Ok(())
    }

    /// The stored meta alone, if any: what a node reads at every start, without the data
    /// (hundreds of megabytes at a million keys).
    pub fn read_meta(&self) -> std::io::Result<Option<Vec<u8>>> {
        use std::io::Read;
        /// A meta is a log id and a membership: far below this.
        const MAX_META_BYTES: u64 = 64 << 20;
        let mut f = match fs::File::open(&self.path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e),
        };
        let corrupt = || std::io::Error::new(std::io::ErrorKind::InvalidData, "torn snapshot file");
        let mut len = [0u8; 8];
        f.read_exact(&mut len).map_err(|_| corrupt())?;
        let len = u64::from_be_bytes(len);
        if len > MAX_META_BYTES || len > f.metadata()?.len().saturating_sub(8) {
            return Err(corrupt());
        }
        let mut meta = vec![0u8; len as usize];
        f.read_exact(&mut meta).map_err(|_| corrupt())?;
        Ok(Some(meta))
    }

    /// The stored `(meta, data)`, if any.
    pub fn read(&self) -> std::io::Result<Option<(Vec<u8>, Vec<u8>)>> {
        let bytes = match fs::read(&self.path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e),
        };
        let corrupt = || std::io::Error::new(std::io::ErrorKind::InvalidData, "torn snapshot file");
        let len: [u8; 8] = bytes
            .get(..8)
            .and_then(|b| b.try_into().ok())
            .ok_or_else(corrupt)?;
        let end = 8usize
            .checked_add(u64::from_be_bytes(len) as usize)
            .filter(|end| *end <= bytes.len())
            .ok_or_else(corrupt)?;
        Ok(Some((bytes[8..end].to_vec(), bytes[end..].to_vec())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_then_read_and_replace() {
        let dir = tempfile::TempDir::new().unwrap();
        let f = SnapshotFile::new(dir.path());
        assert_eq!(f.read().unwrap(), None);
        assert_eq!(f.read_meta().unwrap(), None);
        f.write(b"{\"m\":1}", b"data-1").unwrap();
        f.write(b"{\"m\":2}", b"data-two").unwrap();
        assert_eq!(
            f.read().unwrap(),
            Some((b"{\"m\":2}".to_vec(), b"data-two".to_vec()))
        );
        assert_eq!(f.read_meta().unwrap(), Some(b"{\"m\":2}".to_vec()));
        fs::write(dir.path().join(FILE_NAME), [0, 0, 0, 0, 0, 0, 0, 99, 1]).unwrap();
        assert!(f.read().is_err());
        assert!(f.read_meta().is_err());
    }
}
