//! `KvState`: the replicated key-value state machine, applied identically on every replica.
//!
//! # Invariants
//! - `apply` is a pure function of the current state and the command: no clock, no randomness,
//!   no configuration. The same log applied twice gives byte-identical state ([`KvState::encode`]).
//! - The store revision advances by exactly one for every key that changes, and only then. A
//!   rejected command (CAS mismatch, unknown lease) or a delete of a missing key changes nothing,
//!   revision included.
//! - Each key carries `create_revision` (the revision that created this incarnation),
//!   `mod_revision` (the last change) and `version` (changes since creation, starting at 1).
//!   Deleting a key ends its incarnation: a later put starts again at version 1.
//! - Every change produces exactly one [`Event`], carrying the key's new revision.
//!
//! # What it must not do
//! It never persists anything. The storage adapter asks for the keys touched since its last
//! write ([`KvState::take_dirty`]) and persists them in the same atomic batch as the applied
//! log index, so a restart never sees a half-applied entry.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use super::command::{Cause, Command, Event, EventKind, KvError, Response};
use super::types::Revision;

/// One key's current value and its history counters.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Versioned {
    pub value: String,
    pub create_revision: Revision,
    pub mod_revision: Revision,
    pub version: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease: Option<String>,
}

/// The outcome of applying one command: the client's answer and the watchers' events.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Applied {
    pub response: Response,
    pub events: Vec<Event>,
}

/// The whole replicated state, as written in snapshots.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvSnapshot {
    pub revision: Revision,
    pub keys: BTreeMap<String, Versioned>,
}

/// The replicated key-value state.
#[derive(Debug, Default)]
pub struct KvState {
    /// The store revision: the revision of the latest change.
    revision: Revision,
    /// Every live key, in key order.
    keys: BTreeMap<String, Versioned>,
    /// Keys changed since the last [`KvState::take_dirty`] (for the storage adapter).
    dirty: BTreeSet<String>,
}

impl KvState {
    /// An empty store at revision 0.
    pub fn new() -> Self {
        Self::default()
    }

    /// Rebuild a state from a snapshot (or from the persisted keys).
    pub fn from_snapshot(snapshot: KvSnapshot) -> Self {
        KvState {
            revision: snapshot.revision,
            keys: snapshot.keys,
            dirty: BTreeSet::new(),
        }
    }

    /// The store revision.
    pub fn revision(&self) -> Revision {
        self.revision
    }

    /// The number of live keys.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// Whether the store holds no key.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// One key.
    pub fn get(&self, key: &str) -> Option<&Versioned> {
        self.keys.get(key)
    }

    /// Keys starting with `prefix`, in key order, at most `limit` of them.
    pub fn list(&self, prefix: &str, limit: usize) -> Vec<(&str, &Versioned)> {
        self.keys
            .range::<str, _>((
                std::ops::Bound::Included(prefix),
                std::ops::Bound::Unbounded,
            ))
            .take_while(|(k, _)| k.starts_with(prefix))
            .take(limit)
            .map(|(k, v)| (k.as_str(), v))
            .collect()
    }

    /// Apply one command. Total: any well-formed command applies, no input panics.
    pub fn apply(&mut self, cmd: &Command) -> Applied {
        match cmd {
            Command::Put {
                key,
                value,
                lease,
                prev_revision,
            } => self.put(key, value, lease.as_deref(), *prev_revision),
            Command::Delete { key, prev_revision } => self.delete(key, *prev_revision),
        }
    }

    fn put(
        &mut self,
        key: &str,
        value: &str,
        lease: Option<&str>,
        prev_revision: Option<Revision>,
    ) -> Applied {
        if let Some(error) = self.check_prev(key, prev_revision) {
            return rejected(error);
        }
        if let Some(lease) = lease {
            // Leases arrive with the lease issue; until then no lease exists.
            return rejected(KvError::LeaseNotFound {
                lease: lease.to_string(),
            });
        }
        let revision = self.revision.next();
        self.revision = revision;
        let entry = match self.keys.get(key) {
            Some(old) => Versioned {
                value: value.to_string(),
                create_revision: old.create_revision,
                mod_revision: revision,
                version: old.version + 1,
                lease: lease.map(str::to_string),
            },
            None => Versioned {
                value: value.to_string(),
                create_revision: revision,
                mod_revision: revision,
                version: 1,
                lease: lease.map(str::to_string),
            },
        };
        self.keys.insert(key.to_string(), entry);
        self.dirty.insert(key.to_string());
        Applied {
            response: Response::Put { revision },
            events: vec![Event {
                kind: EventKind::Put,
                key: key.to_string(),
                value: Some(value.to_string()),
                revision,
                lease: lease.map(str::to_string),
                cause: Cause::Client,
            }],
        }
    }

    fn delete(&mut self, key: &str, prev_revision: Option<Revision>) -> Applied {
        if let Some(error) = self.check_prev(key, prev_revision) {
            return rejected(error);
        }
        match self.remove_key(key, Cause::Client) {
            Some(event) => Applied {
                response: Response::Delete {
                    revision: event.revision,
                    deleted: 1,
                },
                events: vec![event],
            },
            None => Applied {
                response: Response::Delete {
                    revision: self.revision,
                    deleted: 0,
                },
                events: vec![],
            },
        }
    }

    /// Remove a key at a new revision, returning its delete event; `None` if absent.
    fn remove_key(&mut self, key: &str, cause: Cause) -> Option<Event> {
        let old = self.keys.remove(key)?;
        let revision = self.revision.next();
        self.revision = revision;
        self.dirty.insert(key.to_string());
        Some(Event {
            kind: EventKind::Delete,
            key: key.to_string(),
            value: None,
            revision,
            lease: old.lease,
            cause,
        })
    }

    /// The compare-and-set check: `Some(error)` when `prev` is given and does not match.
    fn check_prev(&self, key: &str, prev: Option<Revision>) -> Option<KvError> {
        let expected = prev?;
        let actual = self
            .keys
            .get(key)
            .map(|v| v.mod_revision)
            .unwrap_or_default();
        (actual != expected).then(|| KvError::RevisionMismatch {
            key: key.to_string(),
            expected,
            actual,
        })
    }

    /// The keys changed since the last call, in key order, with their current state (`None`:
    /// deleted). The storage adapter persists exactly these.
    pub fn take_dirty(&mut self) -> Vec<(String, Option<&Versioned>)> {
        let dirty = std::mem::take(&mut self.dirty);
        dirty
            .into_iter()
            .map(|k| {
                let v = self.keys.get(&k);
                (k, v)
            })
            .collect()
    }

    /// A copy of the whole state, for a snapshot.
    pub fn snapshot(&self) -> KvSnapshot {
        KvSnapshot {
            revision: self.revision,
            keys: self.keys.clone(),
        }
    }

    /// The canonical encoding of the state: equal states give equal bytes.
    pub fn encode(&self) -> Vec<u8> {
        #[derive(Serialize)]
        struct View<'a> {
            revision: Revision,
            keys: &'a BTreeMap<String, Versioned>,
        }
        serde_json::to_vec(&View {
            revision: self.revision,
            keys: &self.keys,
        })
        .expect("serializing plain data cannot fail")
    }
}

fn rejected(error: KvError) -> Applied {
    Applied {
        response: Response::Rejected { error },
        events: vec![],
    }
}

#[cfg(test)]
mod tests {
    use super::*;
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
    fn dirty_keys_are_reported_once_with_their_final_state() {
        let mut kv = KvState::new();
        kv.apply(&put("a", "1"));
        kv.apply(&put("b", "1"));
        kv.apply(&put("a", "2"));
        kv.apply(&del("b"));
        let dirty: Vec<(String, Option<String>)> = kv
            .take_dirty()
            .into_iter()
            .map(|(k, v)| (k, v.map(|v| v.value.clone())))
            .collect();
        assert_eq!(
            dirty,
            vec![
                ("a".to_string(), Some("2".to_string())),
                ("b".to_string(), None)
            ]
        );
        assert!(kv.take_dirty().is_empty());
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

    fn command_strategy() -> impl Strategy<Value = Command> {
        let key = prop::sample::select(vec!["a", "b", "c", "a/1", "a/2", "é"]);
        prop_oneof![
            (key.clone(), "[a-z]{0,4}", prop::option::of(0u64..8)).prop_map(|(k, v, prev)| {
                Command::Put {
                    key: k.to_string(),
                    value: v,
                    lease: None,
                    prev_revision: prev.map(Revision),
                }
            }),
            (key, prop::option::of(0u64..8)).prop_map(|(k, prev)| Command::Delete {
                key: k.to_string(),
                prev_revision: prev.map(Revision),
            }),
        ]
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
            }
            prop_assert_eq!(a.encode(), b.encode());
        }

        /// Revisions: one step per event, events carry strictly increasing revisions, and each
        /// key's counters stay consistent.
        #[test]
        fn revisions_advance_once_per_change(log in prop::collection::vec(command_strategy(), 0..60)) {
            let mut kv = KvState::new();
            for cmd in &log {
                let before = kv.revision();
                let out = kv.apply(cmd);
                prop_assert_eq!(kv.revision().0 - before.0, out.events.len() as u64);
                for (i, e) in out.events.iter().enumerate() {
                    prop_assert_eq!(e.revision.0, before.0 + 1 + i as u64);
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
}
