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
