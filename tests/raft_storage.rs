//! openraft's storage conformance suite against the sled log store and state machine.

use std::sync::Arc;

use leasecore::raft::log_store::LogStore;
use leasecore::raft::state_machine::{DiscardEvents, StateMachine};
use leasecore::raft::{StorageError, TypeConfig};
use leasecore::storage::open_db;
use openraft::testing::{StoreBuilder, Suite};
use openraft::{AnyError, StorageIOError};
use tempfile::TempDir;

struct SledBuilder;

impl StoreBuilder<TypeConfig, LogStore, StateMachine, TempDir> for SledBuilder {
    async fn build(&self) -> Result<(TempDir, LogStore, StateMachine), StorageError> {
        let fail = |e: &dyn std::fmt::Display| {
            StorageError::from(StorageIOError::write(AnyError::error(e.to_string())))
        };
        let dir = TempDir::new().map_err(|e| fail(&e))?;
        let db = open_db(dir.path(), 8 << 20).map_err(|e| fail(&e))?;
        let log = LogStore::open(&db).map_err(|e| fail(&e))?;
        let (sm, _view) =
            StateMachine::open(&db, dir.path(), Arc::new(DiscardEvents)).map_err(|e| fail(&e))?;
        Ok((dir, log, sm))
    }
}

#[test]
fn sled_stores_pass_openraft_suite() {
    Suite::test_all(SledBuilder).expect("openraft storage suite");
}

/// A data directory of storage format 2 (values as JSON under `k/`, a version index under
/// `i/`, one JSON event per change under `h/`) opens with every value intact, as base
/// versions of a history that starts at its revision, and keeps nothing of the old layout.
#[test]
fn a_format_2_state_is_converted_when_opened() {
    use leasecore::domain::kv::Versioned;
    use leasecore::domain::types::Revision;
    let dir = TempDir::new().unwrap();
    let db = open_db(dir.path(), 8 << 20).unwrap();
    let state = db.open_tree(leasecore::storage::TREE_STATE).unwrap();
    let a = Versioned {
        value: "va".into(),
        create_revision: Revision(1),
        mod_revision: Revision(3),
        version: 2,
        lease: None,
    };
    state
        .insert(b"k/a", serde_json::to_vec(&a).unwrap())
        .unwrap();
    state
        .insert(b"i/a\0\x01\0\0\0\0\0\0\0\x03", &0u32.to_be_bytes())
        .unwrap();
    state
        .insert(
            b"h/\0\0\0\0\0\0\0\x03\0\0\0\0",
            br#"{"type":"put"}"#.to_vec(),
        )
        .unwrap();
    state.insert(b"m/revision", b"4".to_vec()).unwrap();
    state
        .insert(b"m/history_start", &0u64.to_be_bytes())
        .unwrap();
    state.insert(b"m/history_swept", b"h/".to_vec()).unwrap();
    let (_sm, view) = StateMachine::open(&db, dir.path(), Arc::new(DiscardEvents)).unwrap();
    assert_eq!(view.get("a"), (Revision(4), Some(a.clone())));
    let all = leasecore::domain::auth::KeyRange {
        start: Vec::new(),
        end: Some(vec![0xFF]),
    };
    assert_eq!(
        leasecore::raft::mvcc_store::range_at(&state, &all, Revision(4)).unwrap(),
        vec![("a".to_string(), a)]
    );
    for old in [&b"k/"[..], b"i/", b"m/history_swept"] {
        assert!(state.scan_prefix(old).next().is_none(), "{old:?} left");
    }
    // Only the event record's format-2 key is gone; the history starts at the revision.
    assert!(state.scan_prefix(b"h/").next().is_none());
}
