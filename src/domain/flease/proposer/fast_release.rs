//! [`FastRelease`]: a release through the ballot that committed the lease, one round trip and
//! no read phase.
//!
//! # Invariants
//! - Only acknowledgements for the granting ballot, from distinct members, count; a duplicate
//!   counts once.
//! - It succeeds once a quorum released, and fails once a quorum can no longer be reached (an
//!   acceptor moved on to a later ballot): the caller then runs a full release round.
//!
//! # What it must not do
//! Write a value or take a new ballot: an acceptor releases only the lease it accepted at the
//! granting ballot, and a fast release that cannot reach a quorum changes nothing else.

use std::collections::BTreeSet;

use crate::domain::flease::{Ballot, Envelope, Msg, Now, Protocol};
use crate::domain::types::NodeId;

/// A release through the ballot that committed the lease: `Release(grant_k)` to every member,
/// done when a quorum says it released it. One round trip and no read phase; a quorum that
/// cannot be reached (an acceptor moved on to a later ballot) means "use a full release round".
#[derive(Clone, Debug)]
pub struct FastRelease {
    grant_k: Ballot,
    members: Vec<NodeId>,
    released: BTreeSet<NodeId>,
    refused: BTreeSet<NodeId>,
}

impl FastRelease {
    /// The `Release`s to send (self included).
    #[allow(clippy::too_many_arguments)]
    pub fn start(
        proto: Protocol,
        me: NodeId,
        resource: &str,
        owner: &str,
        members: &[NodeId],
        grant_k: Ballot,
        now: Now,
    ) -> (FastRelease, Vec<Envelope>) {
        let msgs = members
            .iter()
            .map(|to| Envelope {
                proto,
                resource: resource.to_string(),
                from: me,
                to: *to,
                sent_at: now.wall,
                body: Msg::Release {
                    grant_k,
                    owner: owner.to_string(),
                },
            })
            .collect();
        let release = FastRelease {
            grant_k,
            members: members.to_vec(),
            released: BTreeSet::new(),
            refused: BTreeSet::new(),
        };
        (release, msgs)
    }

    /// An acknowledgement: `Some(true)` once a quorum released, `Some(false)` once a quorum can
    /// no longer be reached, else `None`.
    pub fn on_reply(&mut self, env: &Envelope) -> Option<bool> {
        let Msg::ReleaseAck { grant_k, released } = env.body else {
            return None;
        };
        if grant_k != self.grant_k || !self.members.contains(&env.from) {
            return None;
        }
        if released {
            self.released.insert(env.from);
        } else {
            self.refused.insert(env.from);
        }
        let quorum = crate::domain::flease::quorum(self.members.len());
        if self.released.len() >= quorum {
            Some(true)
        } else if self.members.len() - self.refused.len() < quorum {
            Some(false)
        } else {
            None
        }
    }
}
