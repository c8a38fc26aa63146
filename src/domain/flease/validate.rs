//! What an acceptor accepts from the network: the names' size limits (shared with the client
//! API) and the bounds no honest proposer can exceed. Pure.
//!
//! An honest proposer:
//! - sends `Read`, `Write` and `Release` to an acceptor (replies travel back in HTTP answers,
//!   never as requests);
//! - puts its own node id in its ballots (`k.node == from`), and addresses the message to us;
//! - draws ballot eras from its wall clock, so an era is never far ahead of ours: within the
//!   skew bound `eps` for Flease, within [`PAXOS_CLOCK_AHEAD_MS`] for PaxosLease (which assumes
//!   no clock synchronization, only a bound on rate drift; a day ahead is a broken clock, not
//!   drift), plus one era of counter overflow;
//! - writes a Flease lease that ends at most `t_max + eps` past our wall clock (its round
//!   started at `t0 <= our now + eps`), or a PaxosLease span of at most `t_max`;
//! - uses epochs derived from its wall clock in microseconds plus the number of grants since.
//!
//! A message outside these bounds is refused (no answer, counted by the shell): a forged
//! "highest ballot" or an everlasting lease would otherwise block a resource for ever, and a
//! ballot or epoch at `u64::MAX` would overflow the next proposer's arithmetic.
//!
//! # What it must not do
//! Read a clock: `now` comes in.

use std::collections::BTreeSet;

use super::{Ballot, Envelope, FleaseConfig, Msg, Now, Protocol, Slot};
use crate::domain::types::NodeId;

/// The longest resource name, in bytes.
pub const MAX_RESOURCE_BYTES: usize = 1024;
/// The longest owner name, in bytes.
pub const MAX_OWNER_BYTES: usize = 256;
/// How far ahead of ours a PaxosLease proposer's wall clock may be (ballot eras, epochs).
pub const PAXOS_CLOCK_AHEAD_MS: u64 = 24 * 3600 * 1000;
/// Grants (epoch increments) allowed beyond the wall-clock part of an epoch.
const EPOCH_SLACK: u64 = 1 << 32;

/// A resource name a client or a peer may use.
pub fn check_resource(resource: &str) -> Result<(), String> {
    if resource.is_empty() || resource.len() > MAX_RESOURCE_BYTES {
        return Err(format!("resource must be 1 to {MAX_RESOURCE_BYTES} bytes"));
    }
    Ok(())
}

/// An owner name a client or a peer may use.
pub fn check_owner(owner: &str) -> Result<(), String> {
    if owner.is_empty() || owner.len() > MAX_OWNER_BYTES {
        return Err(format!("owner must be 1 to {MAX_OWNER_BYTES} bytes"));
    }
    Ok(())
}

/// Whether the acceptor of node `me` may handle `env`, sent by node `sender` (the transport's
/// sender) to a node whose membership is `members` (empty: unknown, not checked). `Err` says
/// why not.
pub fn check_incoming(
    env: &Envelope,
    sender: NodeId,
    me: NodeId,
    members: &BTreeSet<NodeId>,
    cfg: &FleaseConfig,
    now: Now,
) -> Result<(), String> {
    if env.from != sender {
        return Err(format!("message from {} sent by node {sender}", env.from));
    }
    if env.to != me {
        return Err(format!("message for node {} reached node {me}", env.to));
    }
    check_resource(&env.resource)?;
    let ahead_ms = match env.proto {
        Protocol::Flease => cfg.eps_ms,
        Protocol::PaxosLease => PAXOS_CLOCK_AHEAD_MS,
    };
    let latest_wall = now.wall.0.saturating_add(ahead_ms);
    let ballot = |k: &Ballot, own: bool| -> Result<(), String> {
        if own && k.node != env.from {
            return Err(format!(
                "ballot of node {} sent by node {}",
                k.node, env.from
            ));
        }
        if !members.is_empty() && !members.contains(&k.node) {
            return Err(format!("ballot of node {}, not a member", k.node));
        }
        let max_era = (latest_wall / cfg.ballot_era_ms.max(1)).saturating_add(1);
        if k.era > max_era {
            return Err(format!("ballot era {} is in the future", k.era));
        }
        Ok(())
    };
    let max_epoch = latest_wall.saturating_mul(1000).saturating_add(EPOCH_SLACK);
    match &env.body {
        Msg::Read { k } => ballot(k, true),
        Msg::Write { k, value } => {
            ballot(k, true)?;
            if value.epoch() > max_epoch {
                return Err(format!("epoch {} is impossible", value.epoch()));
            }
            match value {
                Slot::Lease { owner, expires, .. } => {
                    check_owner(owner)?;
                    let latest = now
                        .wall
                        .0
                        .saturating_add(cfg.t_max_ms)
                        .saturating_add(cfg.eps_ms);
                    if expires.0 > latest {
                        return Err(format!(
                            "a lease until {} is longer than the lease time allows",
                            expires.0
                        ));
                    }
                    Ok(())
                }
                Slot::Span { owner, span_ms, .. } => {
                    check_owner(owner)?;
                    if *span_ms > cfg.t_max_ms {
                        return Err(format!(
                            "a span of {span_ms} ms is longer than the lease time"
                        ));
                    }
                    Ok(())
                }
                Slot::Released { .. } => Ok(()),
                Slot::Empty | Slot::Timed { .. } => Err("a value never written".into()),
            }
        }
        Msg::Release { grant_k, owner } => {
            check_owner(owner)?;
            ballot(grant_k, false)
        }
        Msg::ReadAck { .. }
        | Msg::ReadNack { .. }
        | Msg::WriteAck { .. }
        | Msg::WriteNack { .. }
        | Msg::ReleaseAck { .. } => Err("a reply sent to an acceptor".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::flease::{TEST_CONFIG, test_at};
    use crate::domain::types::WallMillis;

    const NOW: u64 = 1_700_000_000_000;

    fn members() -> BTreeSet<NodeId> {
        [1, 2, 3].into_iter().collect()
    }

    fn k(node: NodeId, era: u64) -> Ballot {
        Ballot {
            era,
            counter: 3,
            boot: 7,
            node,
        }
    }

    fn env(proto: Protocol, body: Msg) -> Envelope {
        Envelope {
            proto,
            resource: "r".into(),
            from: 2,
            to: 1,
            sent_at: WallMillis(NOW),
            body,
        }
    }

    fn era_now() -> u64 {
        NOW / TEST_CONFIG.ballot_era_ms
    }

    fn check(e: &Envelope) -> Result<(), String> {
        check_incoming(e, 2, 1, &members(), &TEST_CONFIG, test_at(NOW))
    }

    fn lease(owner: &str, expires: u64) -> Slot {
        Slot::Lease {
            owner: owner.into(),
            expires: WallMillis(expires),
            epoch: NOW * 1000,
        }
    }

    #[test]
    fn an_honest_round_passes() {
        let write = Msg::Write {
            k: k(2, era_now()),
            value: lease("alice", NOW + TEST_CONFIG.t_max_ms),
        };
        assert_eq!(check(&env(Protocol::Flease, write)), Ok(()));
        assert_eq!(
            check(&env(Protocol::Flease, Msg::Read { k: k(2, era_now()) })),
            Ok(())
        );
        let span = Msg::Write {
            k: k(2, era_now()),
            value: Slot::Span {
                owner: "alice".into(),
                span_ms: TEST_CONFIG.t_max_ms,
                epoch: 5,
            },
        };
        assert_eq!(check(&env(Protocol::PaxosLease, span)), Ok(()));
        // A release of a lease granted through another member's ballot.
        let release = Msg::Release {
            grant_k: k(3, era_now()),
            owner: "alice".into(),
        };
        assert_eq!(check(&env(Protocol::Flease, release)), Ok(()));
    }

    #[test]
    fn forged_highest_ballots_and_everlasting_leases_are_refused() {
        let max = Ballot {
            era: u64::MAX,
            counter: u32::MAX,
            boot: u64::MAX,
            node: 2,
        };
        for proto in [Protocol::Flease, Protocol::PaxosLease] {
            assert!(check(&env(proto, Msg::Read { k: max })).is_err());
        }
        let forever = Msg::Write {
            k: k(2, era_now()),
            value: lease("attacker", u64::MAX),
        };
        assert!(check(&env(Protocol::Flease, forever)).is_err());
        let long_span = Msg::Write {
            k: k(2, era_now()),
            value: Slot::Span {
                owner: "attacker".into(),
                span_ms: TEST_CONFIG.t_max_ms + 1,
                epoch: 5,
            },
        };
        assert!(check(&env(Protocol::PaxosLease, long_span)).is_err());
        let max_epoch = Msg::Write {
            k: k(2, era_now()),
            value: Slot::Released { epoch: u64::MAX },
        };
        assert!(check(&env(Protocol::Flease, max_epoch)).is_err());
    }

    #[test]
    fn the_lease_time_bound_is_t_max_plus_eps() {
        let at = |expires| Msg::Write {
            k: k(2, era_now()),
            value: lease("a", expires),
        };
        let edge = NOW + TEST_CONFIG.t_max_ms + TEST_CONFIG.eps_ms;
        assert_eq!(check(&env(Protocol::Flease, at(edge))), Ok(()));
        assert!(check(&env(Protocol::Flease, at(edge + 1))).is_err());
    }

    #[test]
    fn identities_must_agree() {
        // A ballot of another node than the sender.
        assert!(check(&env(Protocol::Flease, Msg::Read { k: k(3, era_now()) })).is_err());
        // A ballot of a non-member.
        let mut e = env(
            Protocol::Flease,
            Msg::Read {
                k: k(99, era_now()),
            },
        );
        e.from = 99;
        assert!(check_incoming(&e, 99, 1, &members(), &TEST_CONFIG, test_at(NOW)).is_err());
        // `from` is not the transport's sender.
        let e = env(Protocol::Flease, Msg::Read { k: k(2, era_now()) });
        assert!(check_incoming(&e, 3, 1, &members(), &TEST_CONFIG, test_at(NOW)).is_err());
        // Addressed to another node.
        assert!(check_incoming(&e, 2, 3, &members(), &TEST_CONFIG, test_at(NOW)).is_err());
    }

    #[test]
    fn names_over_their_limits_and_replies_are_refused() {
        let mut e = env(Protocol::Flease, Msg::Read { k: k(2, era_now()) });
        e.resource = "r".repeat(MAX_RESOURCE_BYTES + 1);
        assert!(check(&e).is_err());
        e.resource = String::new();
        assert!(check(&e).is_err());
        let big_owner = Msg::Write {
            k: k(2, era_now()),
            value: lease(&"o".repeat(MAX_OWNER_BYTES + 1), NOW),
        };
        assert!(check(&env(Protocol::Flease, big_owner)).is_err());
        let reply = Msg::WriteAck { k: k(2, era_now()) };
        assert!(check(&env(Protocol::Flease, reply)).is_err());
    }
}
