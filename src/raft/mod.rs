//! The openraft adapter: log store, state machine and peer network on top of the pure domain.
//!
//! This layer translates between openraft's traits and leasecore's types. It decodes entries,
//! calls [`crate::domain`], persists what the domain changed, and publishes applied progress. It
//! decides nothing: every rule it needs lives in `domain`.
//!
//! # Layout
//! - [`log_store`]: `RaftLogStorage`: entries in [`segment_log`] files, marks in sled; a
//!   follower's append is acknowledged only after its fdatasync, the leader's own at once
//!   ([`durability`] says what holds back the commit until it is durable).
//! - [`state_machine`]: `RaftStateMachine` on sled, mirrored in memory for reads.
//! - [`network`]: the peer client (append, vote, snapshot, forwarded proposals and reads).
//! - [`consensus`]: [`Consensus`](consensus::Consensus), the handle the HTTP layer and the drivers use: propose a
//!   command (forwarding to the leader), confirm leadership for reads, change membership.

pub mod backup;
pub mod consensus;
pub mod durability;
pub mod entry_cache;
pub mod history_fill;
pub mod log_store;
mod log_sync;
pub mod mvcc_store;
pub mod network;
pub mod off_workers;
pub mod peer_stream;
pub mod segment_log;
pub mod state_machine;
pub mod state_view;
pub mod state_writes;
pub mod vote_hold;

use openraft::BasicNode;

use crate::domain::command::{Command, Response};
pub use crate::domain::types::NodeId;

openraft::declare_raft_types!(
    /// leasecore's openraft type configuration.
    pub TypeConfig:
        D = LogCommand,
        R = Response,
        NodeId = NodeId,
        Node = BasicNode,
        Entry = openraft::Entry<TypeConfig>,
        SnapshotData = Vec<u8>,
        AsyncRuntime = openraft::TokioRuntime,
);

/// A log entry's command, shared rather than copied: openraft clones an entry each time it
/// reads one (the entry cache answers every read with a clone: the state machine's, and the
/// replication's once per follower), and a deep copy of a batch of puts (each key and value a
/// `String`) was about 2% of the leader's CPU under writes. The wire and log encodings are the
/// command's own.
///
/// It also keeps its entry's encoding once the leader's log store has made it
/// ([`log_store::entry_bytes`]): the appends to the followers send those very bytes instead of
/// encoding the entry again for each follower (MessagePack is context-free: an entry inside an
/// append encodes as it does alone). A follower keeps the bytes each entry arrived as
/// (`network::read_append`), and its log store writes them instead of encoding the entry again.
#[derive(Clone)]
pub struct LogCommand(std::sync::Arc<SharedCommand>);

struct SharedCommand {
    cmd: Command,
    /// The encoding of the entry at this log id that holds the command.
    encoded: std::sync::OnceLock<(LogId, bytes::Bytes)>,
}

impl LogCommand {
    pub fn new(cmd: Command) -> LogCommand {
        LogCommand(std::sync::Arc::new(SharedCommand {
            cmd,
            encoded: std::sync::OnceLock::new(),
        }))
    }

    /// The encoding of the entry `at` that holds this command, if one was kept.
    pub fn encoded_entry(&self, at: LogId) -> Option<bytes::Bytes> {
        self.0
            .encoded
            .get()
            .filter(|(id, _)| *id == at)
            .map(|(_, bytes)| bytes.clone())
    }

    /// Keep `bytes` as the encoding of the entry `at` that holds this command (the first kept
    /// stays: an entry is encoded the same every time).
    pub fn keep_encoded_entry(&self, at: LogId, bytes: bytes::Bytes) {
        let _ = self.0.encoded.set((at, bytes));
    }
}

impl std::fmt::Debug for LogCommand {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.cmd.fmt(f)
    }
}

impl PartialEq for LogCommand {
    fn eq(&self, other: &LogCommand) -> bool {
        self.0.cmd == other.0.cmd
    }
}

impl Eq for LogCommand {}

impl From<Command> for LogCommand {
    fn from(cmd: Command) -> LogCommand {
        LogCommand::new(cmd)
    }
}

impl std::ops::Deref for LogCommand {
    type Target = Command;
    fn deref(&self) -> &Command {
        &self.0.cmd
    }
}

impl serde::Serialize for LogCommand {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.0.cmd.serialize(s)
    }
}

impl<'de> serde::Deserialize<'de> for LogCommand {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<LogCommand, D::Error> {
        Command::deserialize(d).map(LogCommand::new)
    }
}

/// The openraft handle for leasecore.
pub type Raft = openraft::Raft<TypeConfig>;
/// openraft's leadership view (the channel drivers wake on for role changes).
pub type ServerMetrics = openraft::metrics::RaftServerMetrics<NodeId, openraft::BasicNode>;
/// openraft's storage error for our node id.
pub type StorageError = openraft::StorageError<NodeId>;
/// A log id.
pub type LogId = openraft::LogId<NodeId>;
/// A log entry.
pub type Entry = openraft::Entry<TypeConfig>;
/// Snapshot metadata.
pub type SnapshotMeta = openraft::SnapshotMeta<NodeId, BasicNode>;
/// Membership as stored with an applied log id.
pub type StoredMembership = openraft::StoredMembership<NodeId, BasicNode>;

/// Wrap any error as openraft's opaque error payload.
pub(crate) fn any_err<E: std::error::Error + 'static>(e: &E) -> openraft::AnyError {
    openraft::AnyError::new(e)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Logs and snapshots written before entries shared their command hold the command's own
    /// encodings: a `LogCommand` must write and read exactly those.
    #[test]
    fn a_shared_command_encodes_as_the_command() {
        let cmd = Command::Put {
            key: "k".into(),
            value: "v".into(),
            lease: Some("l".into()),
            prev_revision: None,
        };
        let shared = LogCommand::new(cmd.clone());
        let packed = rmp_serde::to_vec(&cmd).unwrap();
        assert_eq!(rmp_serde::to_vec(&shared).unwrap(), packed);
        let back: LogCommand = rmp_serde::from_slice(&packed).unwrap();
        assert_eq!(*back, cmd);
        let text = serde_json::to_vec(&cmd).unwrap();
        assert_eq!(serde_json::to_vec(&shared).unwrap(), text);
        assert_eq!(*serde_json::from_slice::<LogCommand>(&text).unwrap(), cmd);
    }
}
