//! The log entries the leader proposes for what its tracker decided: expiries, checkpoints and
//! the clears that must commit before a refresh is acknowledged.
//!
//! # Invariants
//! - Every entry names each lease by its incarnation (name and registration revision), so an
//!   entry that applies late never touches a newer lease of the same name.
//! - A clear is a checkpoint with no remaining time and no clock.
//!
//! # What it must not do
//! Decide anything: it only translates the tracker's outcomes into [`Command`]s.

use super::{Checkpoint, ClearTicket, Expired};
use crate::domain::command::{Command, LeaseCheckpoint, LeaseRef};

/// The entry that expires these leases (each by its incarnation).
pub fn expire_command(expired: &[Expired]) -> Command {
    Command::ExpireLeases {
        leases: expired
            .iter()
            .map(|e| LeaseRef {
                name: e.name.clone(),
                revision: e.revision,
            })
            .collect(),
    }
}

/// The entry that records these checkpoints.
pub fn checkpoint_command(due: Vec<Checkpoint>) -> Command {
    Command::CheckpointLeases {
        checkpoints: due
            .into_iter()
            .map(|c| LeaseCheckpoint {
                name: c.name,
                revision: c.revision,
                remaining_ms: Some(c.remaining_ms),
                clock_ms: Some(c.clock_ms),
            })
            .collect(),
    }
}

/// The entry that clears a checkpoint before a refresh is acknowledged.
pub fn clear_command(ticket: &ClearTicket) -> Command {
    Command::CheckpointLeases {
        checkpoints: vec![LeaseCheckpoint {
            name: ticket.name.clone(),
            revision: ticket.revision,
            remaining_ms: None,
            clock_ms: None,
        }],
    }
}
