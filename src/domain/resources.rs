//! Resource limits: the rules that keep a node's connections, disk and memory bounded.
//!
//! - [`peer_address`]: where a member's peer listener is, derived from its client address.
//! - [`ConnTable`]: which connections a listener holds, and which one to give up when it is full.
//! - [`Quota`]: which commands the storage quota refuses.
//! - [`compaction_step`]: when the log calls for a snapshot or a purge (never before it is as
//!   large as the state, so that snapshots of a large state stay amortized).
//!
//! # Invariants
//! - The peer port is the client port + [`PEER_PORT_OFFSET`], on every node: membership stores
//!   one address per node (the client address) and every node derives the same peer address
//!   from it, so configurations and data directories from before the split keep working.
//! - A full listener only ever evicts a connection that has no request in flight: an idle
//!   keep-alive connection or one still dribbling its headers (slowloris). A request being
//!   served is never cut.
//! - The quota refuses only commands that can grow the stored data. Deletes, revokes and
//!   expiries always pass, so a full node can always be brought back under its quota.
//!
//! # What it must not do
//! I/O, clocks or sockets: the shells (`http::serve`, the storage driver) count and act.

use std::collections::BTreeMap;

use super::command::Command;

/// The peer port of a node is its client port plus this.
pub const PEER_PORT_OFFSET: u16 = 1000;

/// The peer address of a member whose client address is `client` (`HOST:PORT`, `[V6]:PORT`).
pub fn peer_address(client: &str) -> Result<String, String> {
    let (host, port) = client
        .rsplit_once(':')
        .ok_or_else(|| format!("{client:?} is not HOST:PORT"))?;
    let port: u16 = port
        .parse()
        .map_err(|_| format!("{client:?} does not end in a port number"))?;
    if host.is_empty() {
        return Err(format!("{client:?} names no host"));
    }
    if port == 0 {
        // Port 0 asks the kernel for any free port: there is nothing to derive from it.
        return Ok(format!("{host}:0"));
    }
    let peer = port.checked_add(PEER_PORT_OFFSET).ok_or_else(|| {
        format!(
            "{client:?}: the peer port would be {port} + {PEER_PORT_OFFSET}, past 65535; use a lower client port"
        )
    })?;
    Ok(format!("{host}:{peer}"))
}

/// A connection's number on its listener (in accept order).
pub type ConnId = u64;

/// What a full listener does with a new connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admission {
    /// Room for it.
    Admit,
    /// Full: admit it and close this idle connection (the one idle the longest).
    Evict(ConnId),
    /// Full of busy connections: close the new one at once.
    Refuse,
}

/// The connections of one listener, with their requests in flight.
#[derive(Debug, Default)]
pub struct ConnTable {
    max: usize,
    next: ConnId,
    /// Connection -> (requests in flight, the order in which it last became idle).
    conns: BTreeMap<ConnId, ConnState>,
    /// Idle connections by when they became idle: the first is the one idle the longest.
    idle: BTreeMap<u64, ConnId>,
    tick: u64,
    /// Connections evicted, marked so that they are not chosen twice.
    evicting: usize,
}

#[derive(Debug)]
struct ConnState {
    in_flight: usize,
    idle_since: Option<u64>,
}

impl ConnTable {
    pub fn new(max: usize) -> Self {
        ConnTable {
            max: max.max(1),
            ..Default::default()
        }
    }

    /// Connections held (evicted ones count until they are gone).
    pub fn len(&self) -> usize {
        self.conns.len()
    }

    pub fn is_empty(&self) -> bool {
        self.conns.is_empty()
    }

    /// A new connection arrived. `Admit` and `Evict` give it an id (it starts idle: it has sent
    /// no request yet).
    pub fn arrive(&mut self) -> (Admission, Option<ConnId>) {
        let admission = if self.conns.len() - self.evicting.min(self.conns.len()) < self.max {
            Admission::Admit
        } else {
            match self.idle.pop_first() {
                Some((_, victim)) => {
                    if let Some(s) = self.conns.get_mut(&victim) {
                        s.idle_since = None;
                        // An evicted connection is on its way out: never idle again.
                        s.in_flight = usize::MAX / 2;
                    }
                    self.evicting += 1;
                    Admission::Evict(victim)
                }
                None => return (Admission::Refuse, None),
            }
        };
        let id = self.next;
        self.next += 1;
        self.tick += 1;
        self.conns.insert(
            id,
            ConnState {
                in_flight: 0,
                idle_since: Some(self.tick),
            },
        );
        self.idle.insert(self.tick, id);
        (admission, Some(id))
    }

    /// A request began on `id`.
    pub fn request_started(&mut self, id: ConnId) {
        if let Some(s) = self.conns.get_mut(&id) {
            s.in_flight = s.in_flight.saturating_add(1);
            if let Some(t) = s.idle_since.take() {
                self.idle.remove(&t);
            }
        }
    }

    /// A request on `id` finished (its response was sent or dropped).
    pub fn request_finished(&mut self, id: ConnId) {
        if let Some(s) = self.conns.get_mut(&id) {
            s.in_flight = s.in_flight.saturating_sub(1);
            if s.in_flight == 0 {
                self.tick += 1;
                s.idle_since = Some(self.tick);
                self.idle.insert(self.tick, id);
            }
        }
    }

    /// Connection `id` is closed.
    pub fn left(&mut self, id: ConnId) {
        if let Some(s) = self.conns.remove(&id) {
            if let Some(t) = s.idle_since {
                self.idle.remove(&t);
            }
            if s.in_flight >= usize::MAX / 4 {
                self.evicting = self.evicting.saturating_sub(1);
            }
        }
    }
}

/// The storage quota: the bytes a node may hold (live keys and values plus the Raft log).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Quota {
    pub max_bytes: u64,
}

/// The quota refused a command.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OverQuota {
    pub used_bytes: u64,
    pub quota_bytes: u64,
}

/// The default quota (etcd's default backend quota).
pub const DEFAULT_QUOTA_BYTES: u64 = 2 << 30;

impl Default for Quota {
    fn default() -> Self {
        Quota {
            max_bytes: DEFAULT_QUOTA_BYTES,
        }
    }
}

impl Quota {
    /// Whether `cmd` may be proposed while the node holds `used_bytes`.
    pub fn admit(&self, cmd: &Command, used_bytes: u64) -> Result<(), OverQuota> {
        if used_bytes < self.max_bytes || !grows(cmd) {
            return Ok(());
        }
        Err(OverQuota {
            used_bytes,
            quota_bytes: self.max_bytes,
        })
    }
}

/// Whether a command can add stored bytes (anything but removals).
fn grows(cmd: &Command) -> bool {
    match cmd {
        Command::Put { .. } | Command::RegisterLease { .. } | Command::RegisterMember { .. } => {
            true
        }
        // Only a put can grow the store: a transaction that cannot run one (deletes and reads,
        // as an etcd client's DeleteRange and read-only Txn are) is what frees the space.
        Command::Txn { txn } => txn.may_put(),
        Command::Delete { .. }
        | Command::RevokeLease { .. }
        | Command::ExpireLeases { .. }
        | Command::CheckpointLeases { .. }
        | Command::LeaseClock { .. }
        | Command::Compact { .. } => false,
        Command::Batch { commands } => commands.iter().any(grows),
        Command::Guarded { command, .. } => grows(command),
        Command::Auth { .. } => true,
    }
}

/// What the log's size calls for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CompactionStep {
    Nothing,
    /// Build a snapshot of the applied state (it covers entries up to the applied index).
    Snapshot,
    /// Delete the log up to and including this index (already covered by a snapshot).
    Purge(u64),
}

/// Where the log and the state stand, as the compaction driver reads them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LogStanding {
    /// Bytes of the stored log entries.
    pub log_bytes: u64,
    /// Bytes of the live state (keys and values), which a snapshot copies whole.
    pub state_bytes: u64,
    pub applied_index: u64,
    /// The latest snapshot covers entries up to here.
    pub snapshot_index: u64,
    /// The log starts after here.
    pub purged_index: u64,
}

/// When to compact: after `entries` applied entries or past `max_log_bytes`, but never before
/// the log is as large as the state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CompactionPolicy {
    /// Snapshot after this many entries since the last snapshot (`--snapshot-threshold`)...
    pub entries: u64,
    /// ...or once the log holds this many bytes (`--snapshot-log-bytes`).
    pub max_log_bytes: u64,
    /// The log need never outgrow this before a snapshot, however large the state: the
    /// storage quota counts the log too, and a log allowed to reach a state near half the
    /// quota would fill it ([`CompactionPolicy::gate_cap_for`]).
    pub gate_cap_bytes: u64,
}

impl CompactionPolicy {
    /// The cap on the amortization gate for a storage quota: an eighth of it, so that the log
    /// waiting for its snapshot never takes more than that of the quota.
    pub fn gate_cap_for(quota: Quota) -> u64 {
        quota.max_bytes / 8
    }
}

/// What `standing` calls for under `policy`.
///
/// A snapshot copies the whole state, so its cost grows with the state, not with what was
/// written since the last one: at a million keys (160 MB), a snapshot every 10,000 small puts
/// took more CPU than the puts and stalled the nodes into elections. So neither trigger fires
/// before the log holds at least as many bytes as the state: snapshots then cost at most about
/// as much as the writes they compact (amortized O(1) per byte written), and the log a restart
/// replays is never larger than the state it loads. The gate is capped (`gate_cap_bytes`, an
/// eighth of the storage quota) so that the waiting log never crowds a large state out of
/// the quota. A small state (the usual case) is
/// snapshotted every `entries` entries as before. Past the byte budget, the entries a snapshot
/// already covers are purged first (openraft keeps some after a snapshot, of any size).
pub fn compaction_step(policy: CompactionPolicy, standing: LogStanding) -> CompactionStep {
    let LogStanding {
        log_bytes,
        state_bytes,
        applied_index,
        snapshot_index,
        purged_index,
    } = standing;
    if log_bytes < state_bytes.min(policy.gate_cap_bytes) {
        return CompactionStep::Nothing;
    }
    let over_bytes = log_bytes > policy.max_log_bytes;
    let due_by_entries = applied_index.saturating_sub(snapshot_index) >= policy.entries.max(1);
    if over_bytes && snapshot_index > purged_index {
        return CompactionStep::Purge(snapshot_index);
    }
    if (over_bytes || due_by_entries) && applied_index > snapshot_index {
        return CompactionStep::Snapshot;
    }
    CompactionStep::Nothing
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peer_address_adds_the_offset() {
        assert_eq!(peer_address("127.0.0.1:7001").unwrap(), "127.0.0.1:8001");
        assert_eq!(peer_address("node1:7001").unwrap(), "node1:8001");
        assert_eq!(peer_address("[::1]:7001").unwrap(), "[::1]:8001");
        assert_eq!(peer_address("0.0.0.0:0").unwrap(), "0.0.0.0:0");
        assert!(peer_address("node1").is_err());
        assert!(peer_address(":7001").is_err());
        assert!(peer_address("h:65000").is_err());
    }

    #[test]
    fn a_full_table_evicts_the_longest_idle_and_never_a_busy_one() {
        let mut t = ConnTable::new(2);
        let (a, ida) = t.arrive();
        assert_eq!(a, Admission::Admit);
        let (_, idb) = t.arrive();
        let (ida, idb) = (ida.unwrap(), idb.unwrap());
        t.request_started(ida);
        // Full: b is idle, a is busy.
        let (adm, idc) = t.arrive();
        assert_eq!(adm, Admission::Evict(idb));
        let idc = idc.unwrap();
        t.request_started(idc);
        // b is on its way out: not counted, not chosen again; everything else is busy.
        assert_eq!(t.arrive(), (Admission::Refuse, None));
        t.left(idb);
        assert_eq!(t.len(), 2);
        assert_eq!(t.arrive(), (Admission::Refuse, None));
        // a finishes its request: it becomes the eviction candidate.
        t.request_finished(ida);
        let (adm, _) = t.arrive();
        assert_eq!(adm, Admission::Evict(ida));
    }

    #[test]
    fn the_oldest_idle_goes_first() {
        let mut t = ConnTable::new(3);
        let ids: Vec<ConnId> = (0..3).map(|_| t.arrive().1.unwrap()).collect();
        // The first one was busy and went idle last.
        t.request_started(ids[0]);
        t.request_finished(ids[0]);
        assert_eq!(t.arrive().0, Admission::Evict(ids[1]));
        assert_eq!(t.arrive().0, Admission::Evict(ids[2]));
    }

    #[test]
    fn the_quota_refuses_only_what_grows() {
        let q = Quota { max_bytes: 100 };
        let put = Command::Put {
            key: "k".into(),
            value: "v".into(),
            lease: None,
            prev_revision: None,
        };
        let del = Command::Delete {
            key: "k".into(),
            prev_revision: None,
        };
        assert!(q.admit(&put, 99).is_ok());
        assert_eq!(
            q.admit(&put, 100),
            Err(OverQuota {
                used_bytes: 100,
                quota_bytes: 100
            })
        );
        assert!(q.admit(&del, 1000).is_ok());
        let batch = Command::Batch {
            commands: vec![del.clone(), put],
        };
        assert!(q.admit(&batch, 1000).is_err());
        assert!(
            q.admit(
                &Command::Batch {
                    commands: vec![del]
                },
                1000
            )
            .is_ok()
        );
    }

    /// A transaction grows the store only if a put may run: one that only deletes or reads
    /// (an etcd client's DeleteRange, a read-only Txn) is what a full store needs to recover.
    #[test]
    fn the_quota_admits_a_txn_that_cannot_put() {
        use crate::domain::auth::perm::KeyRange;
        use crate::domain::txn::{Txn, TxnOp};
        let q = Quota { max_bytes: 100 };
        let delete = TxnOp::DeleteRange {
            range: KeyRange::key("k"),
            prev_kv: false,
        };
        let read = TxnOp::Range {
            spec: serde_json::from_value(serde_json::json!({"range": KeyRange::key("k")})).unwrap(),
            at: None,
        };
        let put = TxnOp::Put {
            key: "k".into(),
            value: "v".into(),
            lease: None,
            ignore_value: false,
            ignore_lease: false,
            prev_kv: false,
        };
        let txn = |success: Vec<TxnOp>, failure: Vec<TxnOp>| Command::Txn {
            txn: Txn {
                compares: Vec::new(),
                success,
                failure,
            },
        };
        let nested = |ops: Vec<TxnOp>| TxnOp::Txn {
            txn: Txn {
                compares: Vec::new(),
                success: ops,
                failure: Vec::new(),
            },
        };
        let guarded = |cmd: Command| Command::Guarded {
            user: String::new(),
            command: Box::new(cmd),
        };
        for admitted in [
            txn(vec![delete.clone()], vec![]),
            txn(vec![read.clone()], vec![read.clone()]),
            txn(vec![nested(vec![delete.clone(), read.clone()])], vec![]),
            guarded(txn(vec![delete.clone()], vec![])),
        ] {
            assert!(q.admit(&admitted, 1000).is_ok(), "{admitted:?}");
        }
        for refused in [
            txn(vec![delete.clone(), put.clone()], vec![]),
            txn(vec![read.clone()], vec![put.clone()]),
            txn(vec![nested(vec![nested(vec![put.clone()])])], vec![]),
            guarded(txn(vec![], vec![put])),
        ] {
            assert!(q.admit(&refused, 1000).is_err(), "{refused:?}");
        }
    }

    fn standing(log: u64, state: u64, applied: u64, snap: u64, purged: u64) -> LogStanding {
        LogStanding {
            log_bytes: log,
            state_bytes: state,
            applied_index: applied,
            snapshot_index: snap,
            purged_index: purged,
        }
    }

    const POLICY: CompactionPolicy = CompactionPolicy {
        entries: 1000,
        max_log_bytes: 100,
        gate_cap_bytes: u64::MAX,
    };

    #[test]
    fn compaction_snapshots_then_purges_past_the_byte_limit() {
        use CompactionStep::*;
        let step = |log, applied, snap, purged| {
            compaction_step(POLICY, standing(log, 10, applied, snap, purged))
        };
        assert_eq!(step(10, 50, 0, 0), Nothing);
        assert_eq!(step(200, 50, 0, 0), Snapshot);
        assert_eq!(step(200, 50, 50, 0), Purge(50));
        // Everything applied is snapshotted and purged: nothing more to do.
        assert_eq!(step(200, 50, 50, 50), Nothing);
    }

    #[test]
    fn compaction_snapshots_every_n_entries_once_the_log_outweighs_the_state() {
        use CompactionStep::*;
        let step = |log, state, applied, snap| {
            compaction_step(POLICY, standing(log, state, applied, snap, snap))
        };
        assert_eq!(step(50, 10, 999, 0), Nothing);
        assert_eq!(step(50, 10, 1000, 0), Snapshot);
        assert_eq!(step(50, 10, 2500, 1500), Snapshot);
        // A large state waits for a log as large, whichever trigger is due.
        assert_eq!(step(50, 1_000_000, 5000, 0), Nothing);
        assert_eq!(step(999_999, 1_000_000, 5000, 0), Nothing);
        assert_eq!(step(1_000_000, 1_000_000, 5000, 0), Snapshot);
        // ...but never past the cap: a state near the quota does not wait for its own size.
        let capped = CompactionPolicy {
            gate_cap_bytes: 2_000,
            ..POLICY
        };
        let big = standing(2_000, 1_000_000, 5000, 0, 0);
        assert_eq!(compaction_step(capped, big), Snapshot);
        assert_eq!(
            CompactionPolicy::gate_cap_for(Quota { max_bytes: 8 << 30 }),
            1 << 30
        );
    }

    proptest::proptest! {
        /// Amortization: whatever the standing, a snapshot is only ever asked for when the
        /// log is at least as large as the state (or the cap), something is applied past the last snapshot,
        /// and a trigger (entries or bytes) is due; a purge only of entries a snapshot covers.
        #[test]
        fn compaction_never_snapshots_more_than_the_log_pays_for(
            log in 0u64..10_000,
            state in 0u64..10_000,
            snap in 0u64..5_000,
            ahead in 0u64..3_000,
            purged_back in 0u64..5_000,
            entries in 1u64..2_000,
            max_log_bytes in 0u64..10_000,
            cap in 0u64..20_000,
        ) {
            let policy = CompactionPolicy { entries, max_log_bytes, gate_cap_bytes: cap };
            let purged = snap.saturating_sub(purged_back);
            let st = standing(log, state, snap + ahead, snap, purged);
            match compaction_step(policy, st) {
                CompactionStep::Snapshot => {
                    proptest::prop_assert!(log >= state.min(cap) && ahead > 0);
                    proptest::prop_assert!(ahead >= entries || log > max_log_bytes);
                }
                CompactionStep::Purge(upto) => {
                    proptest::prop_assert!(log >= state.min(cap) && log > max_log_bytes);
                    proptest::prop_assert!(upto == snap && upto > purged);
                }
                CompactionStep::Nothing => {}
            }
        }
    }
}
