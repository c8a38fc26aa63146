//! `KvState` against its rules: revisions and versions, compare-and-set, compaction, leases and
//! their keys, members, batches and snapshots, and determinism over random logs (proptest).
//!
//! # Invariants
//! - Each test starts from an empty state and changes it through `apply` only, as a replica
//!   does; it checks the outcome through the answers, the events and the reads.
//!
//! # What it must not do
//! Set the state's fields directly: a state no log can reach proves nothing.

use std::collections::{BTreeMap, BTreeSet};

use super::*;
use crate::domain::command::{Cause, Command, EventKind, LeaseCheckpoint, LeaseRef};
use crate::domain::members::MemberRecord;
use proptest::prelude::*;

fn put(key: &str, value: &str) -> Command {
    Command::Put {
        key: key.into(),
        value: value.into(),
        lease: None,
        prev_revision: None,
    }
}

fn cas_put(key: &str, value: &str, prev: u64) -> Command {
    Command::Put {
        key: key.into(),
        value: value.into(),
        lease: None,
        prev_revision: Some(Revision(prev)),
    }
}

fn del(key: &str) -> Command {
    Command::Delete {
        key: key.into(),
        prev_revision: None,
    }
}

#[test]
fn compaction_follows_etcds_rules_and_changes_no_revision() {
    let mut kv = KvState::new();
    kv.apply(&put("a", "1"));
    kv.apply(&put("a", "2"));
    let compact = |kv: &mut KvState, r| {
        kv.apply(&Command::Compact {
            revision: Revision(r),
        })
    };
    assert_eq!(
        compact(&mut kv, 3).response,
        rejected(KvError::FutureRevision {
            revision: Revision(3),
            current: Revision(2)
        })
        .response
    );
    let done = compact(&mut kv, 2);
    assert_eq!(
        done.response,
        Response::Compacted {
            compact_revision: Revision(2)
        }
    );
    assert!(done.events.is_empty());
    assert_eq!(
        (kv.revision(), kv.compact_revision()),
        (Revision(2), Revision(2))
    );
    // Again at or below the mark: compacted, as etcd answers.
    assert!(matches!(
        compact(&mut kv, 1).response,
        Response::Rejected {
            error: KvError::Compacted { .. }
        }
    ));
    assert!(kv.check_revision(Revision(1)).is_err());
    assert!(kv.check_revision(Revision(2)).is_ok());
    // Replicated: a snapshot carries the mark.
    let restored = KvState::from_snapshot(kv.snapshot());
    assert_eq!(restored.compact_revision(), Revision(2));
    assert_eq!(restored.encode(), kv.encode());
}

#[test]
fn data_bytes_follow_live_keys_and_values_and_survive_a_snapshot() {
    let mut kv = KvState::new();
    kv.apply(&put("ab", "123"));
    assert_eq!(kv.data_bytes(), 5);
    // An overwrite replaces the old value's bytes; it does not add to them.
    kv.apply(&put("ab", "1"));
    kv.apply(&put("c", ""));
    assert_eq!(kv.data_bytes(), 4);
    assert_eq!(KvState::from_snapshot(kv.snapshot()).data_bytes(), 4);
    kv.apply(&del("ab"));
    kv.apply(&del("missing"));
    assert_eq!(kv.data_bytes(), 1);
}

#[test]
fn put_get_delete_track_revisions_and_versions() {
    let mut kv = KvState::new();
    assert_eq!(
        kv.apply(&put("a", "1")).response,
        Response::Put {
            revision: Revision(1)
        }
    );
    assert_eq!(
        kv.apply(&put("b", "x")).response,
        Response::Put {
            revision: Revision(2)
        }
    );
    kv.apply(&put("a", "2"));
    let a = kv.get("a").unwrap();
    assert_eq!(
        (
            a.value.as_str(),
            a.create_revision,
            a.mod_revision,
            a.version
        ),
        ("2", Revision(1), Revision(3), 2)
    );
    let deleted = kv.apply(&del("a"));
    assert_eq!(
        deleted.response,
        Response::Delete {
            revision: Revision(4),
            deleted: 1
        }
    );
    assert_eq!(deleted.events[0].kind, EventKind::Delete);
    assert_eq!(kv.get("a"), None);
    // A new incarnation starts over at version 1.
    kv.apply(&put("a", "3"));
    let a = kv.get("a").unwrap();
    assert_eq!((a.create_revision, a.version), (Revision(5), 1));
}

#[test]
fn deleting_a_missing_key_changes_nothing() {
    let mut kv = KvState::new();
    kv.apply(&put("a", "1"));
    let out = kv.apply(&del("zzz"));
    assert_eq!(
        out.response,
        Response::Delete {
            revision: Revision(1),
            deleted: 0
        }
    );
    assert!(out.events.is_empty());
    assert_eq!(kv.revision(), Revision(1));
}

#[test]
fn compare_and_set_succeeds_on_match_and_rejects_on_mismatch() {
    let mut kv = KvState::new();
    // 0 means "must not exist".
    assert_eq!(
        kv.apply(&cas_put("a", "1", 0)).response,
        Response::Put {
            revision: Revision(1)
        }
    );
    let mismatch = kv.apply(&cas_put("a", "2", 0));
    assert_eq!(
        mismatch.response,
        Response::Rejected {
            error: KvError::RevisionMismatch {
                key: "a".into(),
                expected: Revision(0),
                actual: Revision(1)
            }
        }
    );
    assert!(mismatch.events.is_empty());
    assert_eq!(kv.revision(), Revision(1));
    assert_eq!(kv.get("a").unwrap().value, "1");
    assert_eq!(
        kv.apply(&cas_put("a", "2", 1)).response,
        Response::Put {
            revision: Revision(2)
        }
    );
    // CAS delete.
    let stale = kv.apply(&Command::Delete {
        key: "a".into(),
        prev_revision: Some(Revision(1)),
    });
    assert!(matches!(stale.response, Response::Rejected { .. }));
    let ok = kv.apply(&Command::Delete {
        key: "a".into(),
        prev_revision: Some(Revision(2)),
    });
    assert_eq!(
        ok.response,
        Response::Delete {
            revision: Revision(3),
            deleted: 1
        }
    );
}

#[test]
fn put_with_unknown_lease_is_rejected_and_changes_nothing() {
    let mut kv = KvState::new();
    let out = kv.apply(&Command::Put {
        key: "a".into(),
        value: "v".into(),
        lease: Some("nope".into()),
        prev_revision: None,
    });
    assert_eq!(
        out.response,
        Response::Rejected {
            error: KvError::LeaseNotFound {
                lease: "nope".into()
            }
        }
    );
    assert!(kv.is_empty());
    assert_eq!(kv.revision(), Revision(0));
}

#[test]
fn prefix_listing_is_sorted_bounded_and_exact() {
    let mut kv = KvState::new();
    for k in ["b/2", "a", "b/1", "b", "c", "b/3", "b0"] {
        kv.apply(&put(k, k));
    }
    let keys: Vec<&str> = kv.list("b/", 100).into_iter().map(|(k, _)| k).collect();
    assert_eq!(keys, ["b/1", "b/2", "b/3"]);
    let keys: Vec<&str> = kv.list("b/", 2).into_iter().map(|(k, _)| k).collect();
    assert_eq!(keys, ["b/1", "b/2"]);
    assert_eq!(kv.list("", 100).len(), 7);
    assert!(kv.list("zz", 100).is_empty());
}

#[test]
fn snapshot_round_trip_preserves_state() {
    let mut kv = KvState::new();
    kv.apply(&put("a", "1"));
    kv.apply(&put("b", "2"));
    kv.apply(&del("a"));
    let restored = KvState::from_snapshot(kv.snapshot());
    assert_eq!(restored.encode(), kv.encode());
    assert_eq!(restored.revision(), Revision(3));
}

fn lease_put(key: &str, lease: &str) -> Command {
    Command::Put {
        key: key.into(),
        value: "v".into(),
        lease: Some(lease.into()),
        prev_revision: None,
    }
}

fn register(name: &str) -> Command {
    Command::RegisterLease {
        name: name.into(),
        ttl_ms: 1000,
        clock_ms: None,
    }
}

fn expire(name: &str, revision: u64) -> Command {
    Command::ExpireLeases {
        leases: vec![LeaseRef {
            name: name.into(),
            revision: Revision(revision),
        }],
    }
}

fn lease_keys(kv: &KvState, name: &str) -> Vec<String> {
    kv.lease(name).unwrap().keys.iter().cloned().collect()
}

#[test]
fn a_member_is_a_lease_and_an_attached_key_in_one_entry() {
    let mut kv = KvState::new();
    let reg = Command::RegisterMember {
        id: "n1".into(),
        address: "h:1".into(),
        ttl_ms: 3000,
        meta: BTreeMap::new(),
        clock_ms: None,
    };
    let out = kv.apply(&reg);
    assert_eq!(
        out.response,
        Response::MemberRegistered {
            revision: Revision(1),
            lease_revision: Revision(1)
        }
    );
    assert_eq!(out.events.len(), 1);
    assert_eq!(lease_keys(&kv, "members/n1"), ["members/n1"]);
    let v = kv.get("members/n1").unwrap();
    assert_eq!(MemberRecord::decode(&v.value).unwrap().address, "h:1");
    // A live registration blocks another of the same id.
    assert_eq!(
        kv.apply(&reg).response,
        Response::Rejected {
            error: KvError::MemberExists { id: "n1".into() }
        }
    );
    // Expiry takes the key with it.
    let gone = kv.apply(&expire("members/n1", 1));
    assert_eq!(gone.events[0].key, "members/n1");
    assert_eq!(gone.events[0].cause, Cause::LeaseExpired);
    assert!(kv.get("members/n1").is_none());
}

#[test]
fn a_batch_applies_like_consecutive_entries() {
    let cmds = vec![
        put("a", "1"),
        cas_put("a", "2", 0),
        register("l"),
        lease_put("b", "l"),
    ];
    let mut one_by_one = KvState::new();
    let singles: Vec<Response> = cmds.iter().map(|c| one_by_one.apply(c).response).collect();
    let mut batched = KvState::new();
    let out = batched.apply(&Command::Batch {
        commands: cmds.clone(),
    });
    assert_eq!(out.response, Response::Batch { responses: singles });
    assert_eq!(batched.encode(), one_by_one.encode());
    assert_eq!(out.events.len(), 2);
    assert_eq!(out.lease_changes.len(), 1);
}

#[test]
fn register_and_duplicate_registration() {
    let mut kv = KvState::new();
    let out = kv.apply(&register("l"));
    assert_eq!(
        out.response,
        Response::LeaseRegistered {
            revision: Revision(1)
        }
    );
    assert_eq!(
        out.lease_changes,
        vec![LeaseChange::Registered {
            name: "l".into(),
            revision: Revision(1),
            ttl_ms: 1000,
            checkpointed: false,
        }]
    );
    let dup = kv.apply(&register("l"));
    assert_eq!(
        dup.response,
        Response::Rejected {
            error: KvError::LeaseExists { lease: "l".into() }
        }
    );
    assert!(dup.lease_changes.is_empty());
    assert_eq!(kv.revision(), Revision(1));
}

#[test]
fn attach_reattach_and_detach() {
    let mut kv = KvState::new();
    kv.apply(&register("l1"));
    kv.apply(&register("l2"));
    kv.apply(&lease_put("k", "l1"));
    assert_eq!(lease_keys(&kv, "l1"), ["k"]);
    assert_eq!(kv.get("k").unwrap().lease.as_deref(), Some("l1"));
    // Re-attach to another lease: it leaves the first.
    kv.apply(&lease_put("k", "l2"));
    assert!(lease_keys(&kv, "l1").is_empty());
    assert_eq!(lease_keys(&kv, "l2"), ["k"]);
    // A put without a lease detaches.
    kv.apply(&put("k", "plain"));
    assert!(lease_keys(&kv, "l2").is_empty());
    assert_eq!(kv.get("k").unwrap().lease, None);
    // Deleting a key detaches it.
    kv.apply(&lease_put("k", "l2"));
    kv.apply(&del("k"));
    assert!(lease_keys(&kv, "l2").is_empty());
}

#[test]
fn expiry_deletes_keys_in_order_and_expiring_twice_is_a_no_op() {
    let mut kv = KvState::new();
    kv.apply(&register("l")); // revision 1
    kv.apply(&lease_put("b", "l")); // 2
    kv.apply(&lease_put("a", "l")); // 3
    kv.apply(&put("other", "x")); // 4
    let out = kv.apply(&expire("l", 1));
    let deleted: Vec<(&str, u64, Cause)> = out
        .events
        .iter()
        .map(|e| (e.key.as_str(), e.revision.0, e.cause))
        .collect();
    assert_eq!(
        deleted,
        [("a", 5, Cause::LeaseExpired), ("b", 5, Cause::LeaseExpired)],
        "one revision for the lease and all its keys"
    );
    assert_eq!(
        out.response,
        Response::LeasesExpired {
            revision: Revision(5),
            expired: vec!["l".into()]
        }
    );
    assert_eq!(
        out.lease_changes,
        vec![LeaseChange::Removed {
            name: "l".into(),
            cause: Cause::LeaseExpired
        }]
    );
    assert!(kv.lease("l").is_none() && kv.get("a").is_none() && kv.get("b").is_none());
    assert!(kv.get("other").is_some());
    // Again: nothing happens.
    let again = kv.apply(&expire("l", 1));
    assert!(again.events.is_empty() && again.lease_changes.is_empty());
    assert_eq!(kv.revision(), Revision(5));
}

#[test]
fn a_late_expiry_never_removes_a_newer_incarnation() {
    let mut kv = KvState::new();
    kv.apply(&register("l")); // 1
    kv.apply(&expire("l", 1)); // 2
    kv.apply(&register("l")); // 3: a new incarnation
    let stale = kv.apply(&expire("l", 1));
    assert!(stale.lease_changes.is_empty());
    assert_eq!(kv.lease("l").unwrap().revision, Revision(3));
}

#[test]
fn revoke_reports_deleted_keys_and_unknown_leases_are_rejected() {
    let mut kv = KvState::new();
    kv.apply(&register("l"));
    kv.apply(&lease_put("x", "l"));
    let out = kv.apply(&Command::RevokeLease { name: "l".into() });
    assert_eq!(
        out.response,
        Response::LeaseRevoked {
            revision: Revision(3),
            deleted_keys: vec!["x".into()]
        }
    );
    assert_eq!(out.events[0].cause, Cause::LeaseRevoked);
    let missing = kv.apply(&Command::RevokeLease { name: "l".into() });
    assert!(matches!(
        missing.response,
        Response::Rejected {
            error: KvError::LeaseNotFound { .. }
        }
    ));
}

#[test]
fn checkpoints_record_and_clear_without_a_revision() {
    let mut kv = KvState::new();
    kv.apply(&register("l"));
    let cp = |remaining| Command::CheckpointLeases {
        checkpoints: vec![LeaseCheckpoint {
            name: "l".into(),
            revision: Revision(1),
            remaining_ms: remaining,
            clock_ms: None,
        }],
    };
    kv.apply(&cp(Some(400)));
    assert_eq!(kv.lease("l").unwrap().checkpoint_ms, Some(400));
    assert_eq!(kv.lease_facts()[0].checkpoint_ms, Some(400));
    kv.apply(&cp(None));
    assert_eq!(kv.lease("l").unwrap().checkpoint_ms, None);
    assert_eq!(kv.revision(), Revision(1));
    // A checkpoint of another incarnation is ignored.
    kv.apply(&Command::CheckpointLeases {
        checkpoints: vec![LeaseCheckpoint {
            name: "l".into(),
            revision: Revision(9),
            remaining_ms: Some(1),
            clock_ms: None,
        }],
    });
    assert_eq!(kv.lease("l").unwrap().checkpoint_ms, None);
}

fn command_strategy() -> impl Strategy<Value = Command> {
    let key = prop::sample::select(vec!["a", "b", "c", "a/1", "a/2", "é"]);
    let lease = prop::sample::select(vec!["l1", "l2"]);
    prop_oneof![
        (
            key.clone(),
            "[a-z]{0,4}",
            prop::option::of(lease.clone()),
            prop::option::of(0u64..8)
        )
            .prop_map(|(k, v, l, prev)| Command::Put {
                key: k.to_string(),
                value: v,
                lease: l.map(str::to_string),
                prev_revision: prev.map(Revision),
            }),
        (key, prop::option::of(0u64..8)).prop_map(|(k, prev)| Command::Delete {
            key: k.to_string(),
            prev_revision: prev.map(Revision),
        }),
        lease.clone().prop_map(register),
        lease
            .clone()
            .prop_map(|l| Command::RevokeLease { name: l.into() }),
        (lease, 0u64..20).prop_map(|(l, r)| expire(l, r)),
    ]
}

/// `lease.keys` and `key.lease` describe the same relation.
fn attachments_agree(kv: &KvState) -> bool {
    let by_key = kv
        .list("", usize::MAX)
        .into_iter()
        .filter_map(|(k, v)| v.lease.clone().map(|l| (l, k.to_string())));
    let by_key: BTreeSet<(String, String)> = by_key.collect();
    let by_lease: BTreeSet<(String, String)> = kv
        .leases()
        .iter()
        .flat_map(|(n, l)| l.keys.iter().map(move |k| (n.clone(), k.clone())))
        .collect();
    by_key == by_lease
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    /// The same log applied twice gives byte-identical state and identical results.
    #[test]
    fn apply_is_deterministic(log in prop::collection::vec(command_strategy(), 0..60)) {
        let mut a = KvState::new();
        let mut b = KvState::new();
        for cmd in &log {
            prop_assert_eq!(a.apply(cmd), b.apply(cmd));
            prop_assert!(attachments_agree(&a));
        }
        prop_assert_eq!(a.encode(), b.encode());
    }

    /// Revisions: one step per request that changes something (its changes share the
    /// revision), events in non-decreasing revision order within the span the command
    /// advanced, and each key's counters consistent.
    #[test]
    fn revisions_advance_once_per_request(log in prop::collection::vec(command_strategy(), 0..60)) {
        let mut kv = KvState::new();
        for cmd in &log {
            let before = kv.revision();
            let out = kv.apply(cmd);
            let advance = kv.revision().0 - before.0;
            let changes = (out.events.len() + out.lease_changes.len()) as u64;
            let mut distinct = std::collections::BTreeSet::new();
            let mut last = before;
            for e in &out.events {
                prop_assert!(e.revision > before && e.revision >= last && e.revision <= kv.revision());
                last = e.revision;
                distinct.insert(e.revision);
            }
            prop_assert!(advance <= changes, "a revision without a change");
            prop_assert!(distinct.len() as u64 <= advance);
            prop_assert_eq!(changes > 0, advance > 0);
            let mut inner = cmd;
            while let Command::Guarded { command, .. } = inner {
                inner = command;
            }
            if !matches!(inner, Command::Batch { .. } | Command::ExpireLeases { .. }) {
                prop_assert!(advance <= 1, "one request, one revision: {:?}", inner);
            }
            for (_, v) in kv.list("", usize::MAX) {
                prop_assert!(v.create_revision <= v.mod_revision);
                prop_assert!(v.mod_revision <= kv.revision());
                prop_assert!(v.version >= 1);
            }
        }
        // The snapshot restores the same bytes.
        prop_assert_eq!(KvState::from_snapshot(kv.snapshot()).encode(), kv.encode());
    }
}

/// The puts that create keys leave their allocations for the key index, in order, the state's
/// own (shared, not copied), at most `CREATED_KEYS_KEPT` between two takes; an overwrite
/// creates nothing.
#[test]
fn created_keys_are_the_states_own_allocations_in_order() {
    let mut kv = KvState::new();
    kv.apply(&put("b", "1"));
    kv.apply(&put("a", "1"));
    kv.apply(&put("b", "2"));
    let created = kv.take_created_keys();
    assert_eq!(created.iter().map(|k| &**k).collect::<Vec<_>>(), ["b", "a"]);
    let own = kv.stored_key("b").unwrap();
    assert!(std::sync::Arc::ptr_eq(&own, &created[0]));
    assert!(kv.take_created_keys().is_empty(), "taken once");
    for i in 0..CREATED_KEYS_KEPT + 10 {
        kv.apply(&put(&format!("k{i}"), "v"));
    }
    assert_eq!(kv.take_created_keys().len(), CREATED_KEYS_KEPT);
}
