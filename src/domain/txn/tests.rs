//! Transactions: every compare target and operator, the edge validation, the apply (branches,
//! nested compares, one revision, refusals that change nothing), ranges at a past revision
//! deferred and filled, and read-only transactions over a history.
//!
//! # Invariants
//! - The apply is exercised through `KvState::apply` with `Command::Txn`, as a replica applies
//!   an entry; the history a read-only transaction reads is a closure standing for the MVCC one.
//!
//! # What it must not do
//! Set the state's fields directly: a state no log can reach proves nothing.

use super::*;
use crate::domain::command::{Event, KvError};
use crate::domain::kv::KvState;
use crate::domain::range::{
    KV_OVERHEAD_BYTES, MAX_RESULT_BYTES, RangeSpec, ResultBudget, ResultTooLarge,
};

fn v(value: &str, create: u64, modr: u64, version: u64, lease: Option<&str>) -> Versioned {
    Versioned {
        value: value.into(),
        create_revision: Revision(create),
        mod_revision: Revision(modr),
        version,
        lease: lease.map(str::to_string),
    }
}

fn cmp(op: CompareOp, target: CompareTarget) -> Compare {
    Compare {
        range: KeyRange::key("k"),
        op,
        target,
    }
}

#[test]
fn a_missing_key_is_zero_for_counters_and_fails_every_value_compare() {
    let none: [&Versioned; 0] = [];
    assert!(holds(
        &cmp(CompareOp::Equal, CompareTarget::ModRevision(Revision(0))),
        none
    ));
    assert!(holds(
        &cmp(CompareOp::Equal, CompareTarget::Version(0)),
        none
    ));
    assert!(holds(
        &cmp(CompareOp::Equal, CompareTarget::Lease(None)),
        none
    ));
    for op in [
        CompareOp::Equal,
        CompareOp::NotEqual,
        CompareOp::Greater,
        CompareOp::Less,
    ] {
        assert!(!holds(&cmp(op, CompareTarget::Value(vec![])), none));
    }
}

#[test]
fn each_target_and_operator() {
    let a = v("b", 3, 7, 2, Some("l1"));
    let one = [&a];
    let t = |op, target| holds(&cmp(op, target), one);
    assert!(t(CompareOp::Equal, CompareTarget::Value(b"b".to_vec())));
    assert!(t(CompareOp::Greater, CompareTarget::Value(b"a".to_vec())));
    assert!(t(CompareOp::Less, CompareTarget::Value(b"ba".to_vec())));
    assert!(t(CompareOp::NotEqual, CompareTarget::Version(1)));
    assert!(t(
        CompareOp::Less,
        CompareTarget::CreateRevision(Revision(4))
    ));
    assert!(t(CompareOp::Equal, CompareTarget::ModRevision(Revision(7))));
    assert!(!t(
        CompareOp::Greater,
        CompareTarget::ModRevision(Revision(7))
    ));
    assert!(t(CompareOp::Equal, CompareTarget::Lease(Some("l1".into()))));
    assert!(t(CompareOp::Greater, CompareTarget::Lease(None)));
}

#[test]
fn value_compares_are_exact_and_in_the_order_of_the_raw_bytes() {
    use crate::domain::value_bytes::store;
    let stored = store(vec![0xff, 0x10]);
    assert_eq!(stored, "\0/xA=");
    let a = v(&stored, 1, 1, 1, None);
    let one = [&a];
    let t = |op, raw: &[u8]| {
        holds(
            &cmp(op, CompareTarget::Value(store(raw.to_vec()).into_bytes())),
            one,
        )
    };
    assert!(t(CompareOp::Equal, &[0xff, 0x10]));
    assert!(!t(CompareOp::Equal, &[0xff]));
    assert!(t(CompareOp::NotEqual, &[0xff]));
    // In raw bytes order, though the stored forms order otherwise ("\0/xA=" < "\0AQ==").
    assert!(t(CompareOp::Greater, &[0x01]));
    assert!(!t(CompareOp::Less, &[0x01]));
    assert!(t(CompareOp::Greater, &[0xff]));
    assert!(t(CompareOp::Less, &[0xff, 0x11]));
    // Text against bytes: b"a" < [0xff], as bytes.
    let text = v("a", 1, 1, 1, None);
    assert!(holds(
        &cmp(
            CompareOp::Less,
            CompareTarget::Value(store(vec![0xff]).into_bytes())
        ),
        [&text]
    ));
    // A target that is not UTF-8 (written before encoded values existed) is its own bytes.
    assert!(holds(
        &cmp(CompareOp::Less, CompareTarget::Value(vec![0xff])),
        [&text]
    ));
}

#[test]
fn over_a_range_every_present_key_must_hold() {
    let a = v("x", 1, 1, 1, None);
    let b = v("x", 2, 5, 3, None);
    let both = [&a, &b];
    let mut c = cmp(CompareOp::Equal, CompareTarget::Value(b"x".to_vec()));
    c.range = KeyRange::from_etcd(b"k", b"z");
    assert!(holds(&c, both));
    c.target = CompareTarget::Version(1);
    assert!(!holds(&c, both), "b is at version 3");
    c.op = CompareOp::Greater;
    c.target = CompareTarget::ModRevision(Revision(0));
    assert!(holds(&c, both));
}

fn apply(kv: &mut KvState, txn: Txn) -> (Revision, TxnResult, Vec<Event>) {
    let applied = kv.apply(&crate::domain::command::Command::Txn { txn });
    match applied.response {
        crate::domain::command::Response::Txn { revision, outcome } => {
            (revision, outcome, applied.events)
        }
        other => panic!("unexpected {other:?}"),
    }
}

fn del(range: KeyRange, prev_kv: bool) -> TxnOp {
    TxnOp::DeleteRange { range, prev_kv }
}

/// A range at `at` (None: the txn's own revision) of one key.
fn get_at(key: &str, at: Option<u64>) -> TxnOp {
    TxnOp::Range {
        spec: RangeSpec::all(KeyRange::key(key)),
        at: at.map(Revision),
    }
}

#[test]
fn ranges_at_a_past_revision_in_a_writing_txn_are_checked_on_apply_and_read_after() {
    let mut kv = KvState::new();
    for v in ["v1", "v2", "v3"] {
        apply(
            &mut kv,
            Txn {
                success: vec![put("k", v)],
                ..Txn::default()
            },
        );
    }
    // The store is at 3. A past range is left to the answering node, checked; the txn's
    // own revision (after its put) and its start (before any change) read the present.
    let t = Txn {
        success: vec![
            get_at("k", Some(1)),
            get_at("k", Some(3)),
            put("other", "x"),
            get_at("k", Some(3)),
            get_at("other", Some(4)),
        ],
        ..Txn::default()
    };
    let (rev, mut out, _) = apply(&mut kv, t.clone());
    assert_eq!(rev, Revision(4));
    assert!(has_deferred(&out));
    let value = |r: &OpResult| match r {
        OpResult::Range { result, deferred } => {
            (result.kvs.first().map(|(_, v)| v.value.clone()), *deferred)
        }
        other => panic!("{other:?}"),
    };
    assert_eq!(value(&out.results[0]), (None, Some(Revision(1))));
    assert_eq!(value(&out.results[1]), (Some("v3".into()), None));
    assert_eq!(value(&out.results[3]), (None, Some(Revision(3))));
    assert_eq!(value(&out.results[4]), (Some("x".into()), None));
    // The answering node reads the deferred ones from its history.
    let mut asked = Vec::new();
    fill_deferred(
        &t,
        &mut out,
        &mut |what, at| {
            let range = what.range();
            asked.push(at);
            let value = if at == Revision(1) { "v1" } else { "v3" };
            let key = String::from_utf8(range.start.clone()).unwrap();
            Ok::<_, ResultTooLarge>(vec![(key, v(value, 1, at.0, at.0, None))])
        },
        &mut ResultBudget::default(),
    )
    .unwrap();
    assert_eq!(asked, [Revision(1), Revision(3)]);
    assert!(!has_deferred(&out));
    assert_eq!(value(&out.results[0]), (Some("v1".into()), None));
    assert_eq!(value(&out.results[3]), (Some("v3".into()), None));

    // The store is at 4. A future revision fails the txn whole (6 is ahead even after its
    // put, which makes 5), as does a revision below the compaction mark; nothing changes.
    let before = kv.revision();
    for (at, refused) in [(6, "after a put"), (7, "after a put")] {
        let applied = kv.apply(&crate::domain::command::Command::Txn {
            txn: Txn {
                success: vec![put("z", "1"), get_at("k", Some(at))],
                ..Txn::default()
            },
        });
        assert!(
            matches!(
                applied.response,
                crate::domain::command::Response::Rejected {
                    error: KvError::FutureRevision { .. }
                }
            ),
            "{refused}: {:?}",
            applied.response
        );
    }
    // Without a change before it, the txn's own revision is the store's: 5 is ahead.
    let applied = kv.apply(&crate::domain::command::Command::Txn {
        txn: Txn {
            success: vec![get_at("k", Some(5)), put("z", "1")],
            ..Txn::default()
        },
    });
    assert!(matches!(
        applied.response,
        crate::domain::command::Response::Rejected {
            error: KvError::FutureRevision { .. }
        }
    ));
    kv.apply(&crate::domain::command::Command::Compact {
        revision: Revision(2),
    });
    let applied = kv.apply(&crate::domain::command::Command::Txn {
        txn: Txn {
            success: vec![put("z", "1"), get_at("k", Some(1))],
            ..Txn::default()
        },
    });
    assert!(matches!(
        applied.response,
        crate::domain::command::Response::Rejected {
            error: KvError::Compacted { .. }
        }
    ));
    assert_eq!(kv.revision(), before);
    assert!(kv.get("z").is_none());
}

#[test]
fn one_revision_for_every_change_and_one_event_per_key() {
    let mut kv = KvState::new();
    apply(
        &mut kv,
        Txn {
            success: vec![put("a", "1"), put("b", "2")],
            ..Txn::default()
        },
    );
    assert_eq!(kv.revision(), Revision(1));
    let (rev, out, events) = apply(
        &mut kv,
        Txn {
            success: vec![put("c", "3"), del(KeyRange::from_etcd(b"a", b"c"), true)],
            ..Txn::default()
        },
    );
    assert_eq!(rev, Revision(2));
    assert!(out.succeeded);
    assert_eq!(events.len(), 3);
    assert!(events.iter().all(|e| e.revision == Revision(2)));
    let OpResult::DeleteRange { deleted, prev } = &out.results[1] else {
        panic!()
    };
    assert_eq!(*deleted, 2);
    assert_eq!(
        prev.iter().map(|(k, _)| k.as_str()).collect::<Vec<_>>(),
        ["a", "b"]
    );
    assert_eq!(kv.len(), 1);
}

#[test]
fn compares_choose_the_branch_and_nested_compares_see_the_state_before() {
    let mut kv = KvState::new();
    let create = |key: &str| Txn {
        compares: vec![Compare {
            range: KeyRange::key(key),
            op: CompareOp::Equal,
            target: CompareTarget::ModRevision(Revision(0)),
        }],
        success: vec![put(key, "new")],
        failure: vec![TxnOp::Range {
            spec: RangeSpec::all(KeyRange::key(key)),
            at: None,
        }],
    };
    let (_, out, _) = apply(&mut kv, create("k"));
    assert!(out.succeeded);
    let (rev, out, events) = apply(&mut kv, create("k"));
    assert!(!out.succeeded);
    assert!(events.is_empty());
    assert_eq!(
        rev,
        Revision(1),
        "a txn that changes nothing takes no revision"
    );
    let OpResult::Range { result, .. } = &out.results[0] else {
        panic!()
    };
    assert_eq!(result.kvs[0].1.value, "new");
    // The nested compare is evaluated before the outer put of "n" runs.
    let outer = Txn {
        success: vec![put("n", "x"), TxnOp::Txn { txn: create("n") }],
        ..Txn::default()
    };
    assert_eq!(check(&outer, 128), Err(TxnInvalid::DuplicateKey));
    let outer = Txn {
        success: vec![put("m", "x"), TxnOp::Txn { txn: create("z") }],
        ..Txn::default()
    };
    let (_, out, events) = apply(&mut kv, outer);
    let OpResult::Txn { result } = &out.results[1] else {
        panic!()
    };
    assert!(result.succeeded);
    assert_eq!(events.len(), 2);
}

#[test]
fn a_put_that_keeps_a_missing_key_refuses_the_whole_txn() {
    let mut kv = KvState::new();
    let keep = TxnOp::Put {
        key: "gone".into(),
        value: String::new(),
        lease: None,
        ignore_value: true,
        ignore_lease: false,
        prev_kv: false,
    };
    let applied = kv.apply(&crate::domain::command::Command::Txn {
        txn: Txn {
            success: vec![put("a", "1"), keep],
            ..Txn::default()
        },
    });
    assert_eq!(
        applied.response,
        crate::domain::command::Response::Rejected {
            error: KvError::KeyNotFound { key: "gone".into() }
        }
    );
    assert!(kv.is_empty() && kv.revision() == Revision(0));
}

/// A read-only transaction reads its compares and present ranges at its revision and the
/// others at theirs, nested ones too, from the history.
#[test]
fn a_read_only_txn_reads_each_range_at_its_revision() {
    // The history of key `a`: "1" at revision 1, "2" at revision 2, deleted at 3.
    let history =
        |range: &KeyRange, at: Revision| -> Result<Vec<(String, Versioned)>, ResultTooLarge> {
            let a = match at.0 {
                1 => Some(v("1", 1, 1, 1, None)),
                2 => Some(v("2", 1, 2, 2, None)),
                _ => None,
            };
            Ok(a.filter(|_| range.contains(b"a"))
                .map(|v| ("a".to_string(), v))
                .into_iter()
                .collect())
        };
    let get = |at: Option<u64>| ReadOp::Range {
        spec: RangeSpec::all(KeyRange::key("a")),
        at: at.map(Revision),
    };
    let value_is = |value: &str| Compare {
        range: KeyRange::key("a"),
        op: CompareOp::Equal,
        target: CompareTarget::Value(value.as_bytes().to_vec()),
    };
    let values = |r: &OpResult| match r {
        OpResult::Range { result, .. } => result
            .kvs
            .iter()
            .map(|(_, v)| v.value.clone())
            .collect::<Vec<_>>(),
        other => panic!("{other:?}"),
    };
    let txn = ReadTxn {
        compares: vec![value_is("2")],
        success: vec![
            get(Some(1)),
            get(None),
            ReadOp::Txn {
                txn: ReadTxn {
                    compares: vec![value_is("1")],
                    success: vec![get(None)],
                    failure: vec![get(Some(1))],
                },
            },
        ],
        failure: vec![get(Some(3))],
    };
    let out = evaluate_read_only(
        &txn,
        Revision(2),
        &mut |r, at| history(r.range(), at),
        &mut ResultBudget::default(),
    )
    .unwrap();
    assert!(out.succeeded);
    assert_eq!(values(&out.results[0]), ["1"]);
    assert_eq!(values(&out.results[1]), ["2"]);
    match &out.results[2] {
        OpResult::Txn { result } => {
            assert!(!result.succeeded, "the nested compare reads revision 2 too");
            assert_eq!(values(&result.results[0]), ["1"]);
        }
        other => panic!("{other:?}"),
    }
    // At revision 3 the key is gone: the failure branch runs.
    let out = evaluate_read_only(
        &txn,
        Revision(3),
        &mut |r, at| history(r.range(), at),
        &mut ResultBudget::default(),
    )
    .unwrap();
    assert!(!out.succeeded);
    assert!(values(&out.results[0]).is_empty());
    assert_eq!(txn.ranges().len(), 7);
    assert_eq!(txn.as_txn().success.len(), 3);
}

#[test]
fn the_edge_refuses_what_etcd_refuses() {
    let twice = Txn {
        success: vec![put("a", "1"), put("a", "2")],
        ..Txn::default()
    };
    assert_eq!(check(&twice, 128), Err(TxnInvalid::DuplicateKey));
    let in_deleted = Txn {
        success: vec![del(KeyRange::prefix("a"), false), put("ab", "2")],
        ..Txn::default()
    };
    assert_eq!(check(&in_deleted, 128), Err(TxnInvalid::DuplicateKey));
    // The two branches of a nested txn may put the same key, once.
    let branches = Txn {
        success: vec![TxnOp::Txn {
            txn: Txn {
                success: vec![put("a", "1")],
                failure: vec![put("a", "2")],
                ..Txn::default()
            },
        }],
        ..Txn::default()
    };
    assert_eq!(check(&branches, 128), Ok(()));
    let many = Txn {
        success: (0..3).map(|i| put(&i.to_string(), "")).collect(),
        ..Txn::default()
    };
    assert_eq!(check(&many, 2), Err(TxnInvalid::TooManyOps));
    let empty = Txn {
        success: vec![put("", "")],
        ..Txn::default()
    };
    assert_eq!(check(&empty, 128), Err(TxnInvalid::EmptyKey));
}

/// A transaction whose ranges would answer more than [`MAX_RESULT_BYTES`] is refused before its
/// first change (counted on the state before it, so every member decides the same), and one
/// just within the limit applies.
#[test]
fn a_txn_whose_answer_would_pass_the_result_limit_changes_nothing() {
    let mut kv = KvState::default();
    let value = "x".repeat(1 << 20);
    for i in 0..3 {
        kv.apply(&crate::domain::command::Command::Put {
            key: format!("big/{i}"),
            value: value.clone(),
            lease: None,
            prev_revision: None,
        });
    }
    let range = || TxnOp::Range {
        spec: RangeSpec::all(KeyRange::prefix("big/")),
        at: None,
    };
    let marker = || TxnOp::Put {
        key: "marker".into(),
        value: "v".into(),
        lease: None,
        ignore_value: false,
        ignore_lease: false,
        prev_kv: false,
    };
    let before = kv.revision();
    // 3 MiB per range: the second one passes 4 MiB.
    let too_large = Txn {
        success: vec![marker(), range(), range()],
        ..Txn::default()
    };
    match kv.apply_txn(&too_large) {
        Err(KvError::ResultTooLarge { limit, bytes }) => {
            assert_eq!(limit, MAX_RESULT_BYTES as u64);
            assert!(bytes > limit);
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(kv.revision(), before);
    assert!(kv.get("marker").is_none());
    // A delete's prev_kv counts too.
    let delete = Txn {
        success: vec![
            range(),
            TxnOp::DeleteRange {
                range: KeyRange::prefix("big/"),
                prev_kv: true,
            },
        ],
        ..Txn::default()
    };
    assert!(matches!(
        kv.apply_txn(&delete),
        Err(KvError::ResultTooLarge { .. })
    ));
    assert_eq!(kv.revision(), before);
    // One range of 3 MiB (plus its overhead) fits.
    let (out, _) = kv
        .apply_txn(&Txn {
            success: vec![marker(), range()],
            ..Txn::default()
        })
        .unwrap();
    assert_eq!(out.results.len(), 2);
    const { assert!(3 * ((1 << 20) + KV_OVERHEAD_BYTES) < MAX_RESULT_BYTES) };
    assert!(kv.get("marker").is_some());
}

#[test]
fn only_ranges_and_lease_ends_may_touch_many_keys() {
    use crate::domain::command::Command;
    let del = |range: KeyRange| TxnOp::DeleteRange {
        range,
        prev_kv: false,
    };
    let read = |range: KeyRange| TxnOp::Range {
        spec: RangeSpec::all(range),
        at: None,
    };
    let one = |op: TxnOp| Txn {
        compares: vec![],
        success: vec![op],
        failure: vec![],
    };
    // One key each: bounded, whatever the op.
    assert!(!one(put("k", "v")).may_touch_many_keys());
    assert!(!one(del(KeyRange::key("k"))).may_touch_many_keys());
    assert!(!one(read(KeyRange::key("k"))).may_touch_many_keys());
    assert!(
        !Txn {
            compares: vec![cmp(CompareOp::Equal, CompareTarget::Version(1))],
            success: vec![],
            failure: vec![put("k", "v")],
        }
        .may_touch_many_keys()
    );
    // A range anywhere: in a compare, either branch, or a nested transaction.
    assert!(one(del(KeyRange::prefix("p/"))).may_touch_many_keys());
    assert!(one(read(KeyRange::from_etcd(b"a", b"\0"))).may_touch_many_keys());
    let nested = one(TxnOp::Txn {
        txn: Txn {
            compares: vec![],
            success: vec![],
            failure: vec![del(KeyRange::prefix(""))],
        },
    });
    assert!(nested.may_touch_many_keys());
    assert!(
        Txn {
            compares: vec![Compare {
                range: KeyRange::prefix("p/"),
                op: CompareOp::Equal,
                target: CompareTarget::Version(1),
            }],
            success: vec![],
            failure: vec![],
        }
        .may_touch_many_keys()
    );
    // Commands: through batches and guards; a lease's end deletes its keys.
    let txn = |t: Txn| Command::Txn { txn: t };
    assert!(!txn(one(put("k", "v"))).may_touch_many_keys());
    let guarded = Command::Guarded {
        user: "u".into(),
        command: Box::new(Command::Batch {
            commands: vec![txn(one(put("k", "v"))), txn(nested)],
        }),
    };
    assert!(guarded.may_touch_many_keys());
    assert!(Command::RevokeLease { name: "l".into() }.may_touch_many_keys());
    assert!(
        !Command::Delete {
            key: "k".into(),
            prev_revision: None
        }
        .may_touch_many_keys()
    );
}
