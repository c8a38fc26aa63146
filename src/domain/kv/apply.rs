//! [`KvState::apply`]: one command in, one [`Applied`] out. It hands each command to the change
//! it makes (`keys`, `leases`), and holds the commands made of several changes: compaction,
//! member registration, guarded commands and batches.
//!
//! # Invariants
//! - Each command is a request of its own: `apply` starts a new request, and `claim_revision`
//!   gives its first change the next revision and every later change of it the same one.
//! - Every stamp a command carries advances the lease clock, whether or not the command takes
//!   effect.
//! - A guarded command applies only if its user may send it, checked against the state it
//!   applies to ([`crate::domain::auth::guard`]).
//! - A batch applies exactly as its commands would one entry after another.
//!
//! # What it must not do
//! Read a clock, draw random numbers or read configuration: the outcome is a function of the
//! state and the command alone.

use std::collections::BTreeMap;

use super::{Applied, KvState, rejected};
use crate::domain::command::{Command, KvError, Response};
use crate::domain::members::{MemberRecord, member_key};
use crate::domain::types::Revision;

impl KvState {
    /// Apply one command. Total: any well-formed command applies, no input panics.
    pub fn apply(&mut self, cmd: &Command) -> Applied {
        // Each command is a request of its own (a batch's commands and each expired lease
        // start their own again).
        self.request = None;
        // Every stamp a committed entry carries advances the clock, whether or not its command
        // takes effect (a duplicate registration, a guard that refuses): a stamp is a leader's
        // reading all the same, and the clock then follows the log's latest stamp exactly.
        if let Some(stamp) = cmd.lease_clock_stamp() {
            self.lease_clock_ms = self.lease_clock_ms.max(stamp);
        }
        match cmd {
            Command::Put {
                key,
                value,
                lease,
                prev_revision,
            } => self.put(key, value, lease.as_deref(), *prev_revision),
            Command::Delete { key, prev_revision } => self.delete(key, *prev_revision),
            Command::Txn { txn } => match self.apply_txn(txn) {
                Ok((result, events)) => Applied {
                    response: Response::Txn {
                        revision: self.revision,
                        outcome: result,
                    },
                    events,
                    lease_changes: vec![],
                },
                Err(error) => rejected(error),
            },
            Command::RegisterLease {
                name,
                ttl_ms,
                clock_ms,
            } => self.register_lease(name, *ttl_ms, *clock_ms),
            Command::RevokeLease { name } => self.revoke_lease(name),
            Command::Compact { revision } => self.compact(*revision),
            Command::ExpireLeases { leases } => self.expire_leases(leases),
            Command::CheckpointLeases { checkpoints } => self.checkpoint_leases(checkpoints),
            // Its stamp advanced the clock above; nothing else changes.
            Command::LeaseClock { .. } => Applied {
                response: Response::Empty,
                events: vec![],
                lease_changes: vec![],
            },
            Command::RegisterMember {
                id,
                address,
                ttl_ms,
                meta,
                clock_ms,
            } => self.register_member(id, address, *ttl_ms, meta, *clock_ms),
            Command::Auth { change } => match self.auth.apply(change) {
                Ok(()) => {
                    self.dirty_auth = true;
                    Applied {
                        response: Response::AuthChanged {
                            auth_revision: self.auth.revision,
                        },
                        events: vec![],
                        lease_changes: vec![],
                    }
                }
                Err(error) => rejected(KvError::Auth { error }),
            },
            Command::Guarded { user, command } => {
                if crate::domain::auth::guard::authorize(self, user, command) {
                    self.apply(command)
                } else {
                    rejected(KvError::PermissionDenied)
                }
            }
            Command::Batch { commands } => {
                let mut out = Applied {
                    response: Response::Empty,
                    events: vec![],
                    lease_changes: vec![],
                };
                let mut responses = Vec::with_capacity(commands.len());
                for c in commands {
                    let one = self.apply(c);
                    out.events.extend(one.events);
                    out.lease_changes.extend(one.lease_changes);
                    responses.push(one.response);
                }
                out.response = Response::Batch { responses };
                out
            }
        }
    }

    /// etcd's rules: compacting to the current revision is allowed, to a revision at or below
    /// the mark (nothing to do) answers `compacted`, past the current one `future`.
    fn compact(&mut self, revision: Revision) -> Applied {
        let refused = if revision <= self.compact_revision {
            Some(KvError::Compacted {
                revision,
                compacted: self.compact_revision,
            })
        } else if revision > self.revision {
            Some(KvError::FutureRevision {
                revision,
                current: self.revision,
            })
        } else {
            None
        };
        if let Some(error) = refused {
            return rejected(error);
        }
        self.compact_revision = revision;
        Applied {
            response: Response::Compacted {
                compact_revision: revision,
            },
            events: vec![],
            lease_changes: vec![],
        }
    }

    fn register_member(
        &mut self,
        id: &str,
        address: &str,
        ttl_ms: u64,
        meta: &BTreeMap<String, String>,
        clock_ms: Option<u64>,
    ) -> Applied {
        let name = member_key(id);
        if self.leases.contains_key(&name) {
            return rejected(KvError::MemberExists { id: id.to_string() });
        }
        let mut registered = self.register_lease(&name, ttl_ms, clock_ms);
        let Response::LeaseRegistered {
            revision: lease_revision,
        } = registered.response
        else {
            return registered;
        };
        let record = MemberRecord {
            id: id.to_string(),
            address: address.to_string(),
            meta: meta.clone(),
        };
        let put = self.put(&name, &record.encode(), Some(&name), None);
        let Response::Put { revision } = put.response else {
            return put;
        };
        registered.events.extend(put.events);
        Applied {
            response: Response::MemberRegistered {
                revision,
                lease_revision,
            },
            events: registered.events,
            lease_changes: registered.lease_changes,
        }
    }

    /// The revision of the request being applied: the next one at its first change, the same
    /// one for every later change of that request.
    pub(super) fn claim_revision(&mut self) -> Revision {
        match self.request {
            Some(r) => r,
            None => {
                let r = self.revision.next();
                self.revision = r;
                self.request = Some(r);
                r
            }
        }
    }
}
