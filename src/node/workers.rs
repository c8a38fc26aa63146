//! How many async worker threads a node runs: the cores it may use, shared among the nodes
//! of its cluster that run on the same machine.
//!
//! Why: a node with more workers than it has cores to itself pays for every one of them. On
//! two cores shared by three nodes (a local cluster, the tests, the benchmark), two tokio
//! workers per node woke each other for work the other had just taken: ten context switches
//! per put on the leader instead of four and a half, eight on a follower instead of under
//! four; with one worker each, puts at one connection ran about 19% faster and every other
//! measured workload as fast or faster (`docs/write-path.md`, fifteenth round). A node alone
//! on its machine keeps a worker per core.
//!
//! The rule: nodes listed at loopback addresses, when this node is one of them, share this
//! machine; each gets `cores / such nodes` workers, at least one. `--worker-threads` (or
//! `LEASECORE_WORKER_THREADS`, or `worker_threads` in the configuration file) overrides it,
//! for nodes that share a machine without saying so (containers of one host, say).
//!
//! # What it must not do
//! Touch the runtime: this only counts; `main` builds the runtime from the answer.

use std::collections::BTreeMap;
use std::net::IpAddr;

use crate::domain::types::NodeId;

/// How the worker count was chosen, for the log line that reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WorkerSizing {
    /// `--worker-threads` (or its variable or configuration key).
    Given,
    /// The available cores shared among this many nodes listed on this machine's loopback.
    Shared { cores: usize, nodes: usize },
}

/// The worker count, and how it was chosen. `given` is the operator's setting; `peers` the
/// listed voters (this node included, or not yet: a joining node lists none); `own` this
/// node's own address (its `--advertise`, or its `--listen`).
pub fn worker_threads(
    given: Option<usize>,
    cores: usize,
    me: NodeId,
    peers: &BTreeMap<NodeId, String>,
    own: &str,
) -> (usize, WorkerSizing) {
    if let Some(n) = given {
        return (n.max(1), WorkerSizing::Given);
    }
    let mine = peers.get(&me).map_or(own, String::as_str);
    let nodes = if is_loopback(mine) {
        let others = peers
            .iter()
            .filter(|(id, addr)| **id != me && is_loopback(addr))
            .count();
        others + 1
    } else {
        1
    };
    let cores = cores.max(1);
    (
        (cores / nodes).max(1),
        WorkerSizing::Shared { cores, nodes },
    )
}

/// Whether `addr` (`host:port`, `[v6]:port`, a bare host, with or without `http(s)://`)
/// names this machine's loopback.
fn is_loopback(addr: &str) -> bool {
    let addr = addr
        .strip_prefix("http://")
        .or_else(|| addr.strip_prefix("https://"))
        .unwrap_or(addr);
    let addr = addr.split('/').next().unwrap_or(addr);
    let host = match addr.strip_prefix('[') {
        Some(rest) => rest.split(']').next().unwrap_or(rest),
        None => match addr.rsplit_once(':') {
            // One colon: host and port. More: a bare IPv6 address.
            Some((host, _)) if !host.contains(':') => host,
            _ => addr,
        },
    };
    host.eq_ignore_ascii_case("localhost")
        || host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peers(list: &[(NodeId, &str)]) -> BTreeMap<NodeId, String> {
        list.iter().map(|(id, a)| (*id, a.to_string())).collect()
    }

    #[test]
    fn loopback_addresses_are_recognised_in_every_form() {
        for a in [
            "127.0.0.1:7001",
            "127.0.0.5:1",
            "localhost:7001",
            "LOCALHOST",
            "[::1]:7001",
            "::1",
            "http://127.0.0.1:7001",
            "https://localhost:7001/",
        ] {
            assert!(is_loopback(a), "{a}");
        }
        for a in [
            "10.0.0.1:7001",
            "node-1:7001",
            "[fe80::1]:7001",
            "192.168.1.2",
            "http://leasecore-1:7001",
            "",
        ] {
            assert!(!is_loopback(a), "{a}");
        }
    }

    #[test]
    fn nodes_on_one_machine_share_its_cores() {
        let local = peers(&[
            (1, "127.0.0.1:7001"),
            (2, "127.0.0.1:7002"),
            (3, "127.0.0.1:7003"),
        ]);
        assert_eq!(
            worker_threads(None, 2, 1, &local, "127.0.0.1:7001"),
            (1, WorkerSizing::Shared { cores: 2, nodes: 3 })
        );
        assert_eq!(worker_threads(None, 8, 2, &local, "").0, 2);
        assert_eq!(worker_threads(None, 12, 3, &local, "").0, 4);
        // Never none.
        assert_eq!(worker_threads(None, 0, 1, &local, "").0, 1);
    }

    #[test]
    fn a_node_alone_on_its_machine_keeps_a_worker_per_core() {
        let spread = peers(&[
            (1, "10.0.0.1:7001"),
            (2, "10.0.0.2:7001"),
            (3, "10.0.0.3:7001"),
        ]);
        assert_eq!(
            worker_threads(None, 4, 1, &spread, "0.0.0.0:7001"),
            (4, WorkerSizing::Shared { cores: 4, nodes: 1 })
        );
        // A single node, and a node that joins (no list yet), on loopback.
        assert_eq!(
            worker_threads(None, 4, 1, &BTreeMap::new(), "127.0.0.1:7001").0,
            4
        );
        // Loopback peers of a node that is not itself on loopback are not its machine's.
        let mixed = peers(&[(1, "10.0.0.1:7001"), (2, "127.0.0.1:7002")]);
        assert_eq!(worker_threads(None, 4, 1, &mixed, "").0, 4);
    }

    #[test]
    fn the_operator_decides_when_told() {
        let local = peers(&[(1, "127.0.0.1:7001"), (2, "127.0.0.1:7002")]);
        assert_eq!(
            worker_threads(Some(3), 2, 1, &local, ""),
            (3, WorkerSizing::Given)
        );
        assert_eq!(worker_threads(Some(0), 2, 1, &local, "").0, 1);
    }
}
