//! Locks and elections built from keys, leases and revisions (etcd's v3lock and v3election
//! recipes): the naming and the decisions, pure.
//!
//! A contender for lock (or election) `name` owns one key, `locks/<name>/<lease>` (or
//! `elections/<name>/<lease>`), created with its lease attached and only if absent. The
//! contenders are ordered by their keys' create revisions; the oldest holds the lock (leads).
//! Every other contender waits for the deletion of the one just before it, never for the
//! holder: when the holder goes, one waiter wakes, not all of them (no thundering herd).
//!
//! # Invariants
//! - The holder is the contender with the smallest create revision among the keys present:
//!   the order is the log's order, identical on every replica.
//! - A holder's fencing token is its key's create revision: strictly greater than every
//!   earlier holder's, since a later key is created after the earlier one's.
//! - A contender's key goes with its lease: a holder that dies releases the lock when its
//!   lease expires, and a waiter that dies leaves the queue the same way.
//!
//! # What it must not do
//! Read state or wait: the HTTP layer lists the queue (linearizably), asks [`position`], and
//! waits on the watch hub for the predecessor's deletion.

use super::types::Revision;

/// Lock keys live under this prefix.
pub const LOCKS: &str = "locks/";
/// Election keys live under this prefix.
pub const ELECTIONS: &str = "elections/";

/// Which recipe a queue belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Recipe {
    Lock,
    Election,
    /// etcd's mutex (`concurrency.Mutex`, which etcd's own Lock service, `etcdctl lock` and
    /// Go's clients use): the queue is `<name>/`, the name as the client gave it, and a
    /// contender's key is `<name>/<lease id in hex>`, so that leasecore's Lock service and
    /// etcd's client-side mutex on the same name exclude each other.
    EtcdLock,
    /// etcd's election (`concurrency.Election`: etcd's Election service, `etcdctl elect`), in
    /// the same layout as [`Recipe::EtcdLock`], for the same reason: one leader per name,
    /// whichever client campaigns.
    EtcdElection,
}

impl Recipe {
    fn root(self) -> &'static str {
        match self {
            Recipe::Lock => LOCKS,
            Recipe::Election => ELECTIONS,
            Recipe::EtcdLock | Recipe::EtcdElection => "",
        }
    }

    /// The prefix of `name`'s contenders: `locks/<name>/` (etcd's mutex: `<name>/`).
    pub fn queue(self, name: &str) -> String {
        format!("{}{name}/", self.root())
    }

    /// The key a contender holding `lease` owns in `name`'s queue.
    pub fn key(self, name: &str, lease: &str) -> String {
        match self {
            Recipe::EtcdLock | Recipe::EtcdElection => {
                format!("{}{}", self.queue(name), etcd_key_suffix(lease))
            }
            _ => format!("{}{lease}", self.queue(name)),
        }
    }

    /// Why `name` is refused as this recipe's name. leasecore's own recipes refuse a `/`
    /// (one queue's prefix would hold another's keys); etcd's mutex takes any name, as
    /// etcd does, and with it etcd's rule that `a/` holds `a/b/`'s keys too.
    pub fn check_name(self, what: &str, name: &str) -> Result<(), String> {
        match self {
            Recipe::EtcdLock | Recipe::EtcdElection if name.is_empty() => {
                Err(format!("{what} must not be empty"))
            }
            Recipe::EtcdLock | Recipe::EtcdElection => Ok(()),
            _ => check_name(what, name),
        }
    }
}

/// The part of an etcd mutex key after the name: the lease id in lowercase hex without
/// leading zeros (etcd's `%x`), for a lease of the etcd API (`etcd-` and 16 hex digits);
/// any other lease name as it is.
fn etcd_key_suffix(lease: &str) -> String {
    match lease.strip_prefix("etcd-") {
        Some(hex) if hex.len() == 16 && hex.bytes().all(|b| b.is_ascii_hexdigit()) => {
            let trimmed = hex.trim_start_matches('0');
            if trimmed.is_empty() { "0" } else { trimmed }.to_ascii_lowercase()
        }
        _ => lease.to_string(),
    }
}

/// Why a lock or election name, or a lease used in one, is refused.
pub fn check_name(what: &str, name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err(format!("{what} must not be empty"));
    }
    if name.contains('/') {
        // A '/' would let one queue's prefix contain another's keys.
        return Err(format!("{what} {name:?} must not contain '/'"));
    }
    Ok(())
}

/// Where a contender stands in its queue.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Position {
    /// Its key is the oldest: it holds the lock (leads).
    Holder,
    /// It waits for this key (the next older one) to be deleted.
    After {
        key: String,
        create_revision: Revision,
    },
    /// Its key is not in the queue (its lease expired, or it was unlocked or resigned).
    Gone,
}

/// The position of `mine` among `queue` (key, create revision), in any order.
pub fn position(queue: &[(String, Revision)], mine: &str) -> Position {
    let Some(my_rev) = queue.iter().find(|(k, _)| k == mine).map(|(_, r)| *r) else {
        return Position::Gone;
    };
    queue
        .iter()
        .filter(|(_, r)| *r < my_rev)
        .max_by_key(|(_, r)| *r)
        .map_or(Position::Holder, |(key, r)| Position::After {
            key: key.clone(),
            create_revision: *r,
        })
}

/// The holder (leader) of a queue: its oldest key.
pub fn holder(queue: &[(String, Revision)]) -> Option<&(String, Revision)> {
    queue.iter().min_by_key(|(_, r)| *r)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn q(items: &[(&str, u64)]) -> Vec<(String, Revision)> {
        items
            .iter()
            .map(|(k, r)| (k.to_string(), Revision(*r)))
            .collect()
    }

    #[test]
    fn keys_and_names() {
        assert_eq!(Recipe::Lock.key("db", "w1"), "locks/db/w1");
        assert_eq!(Recipe::Election.queue("primary"), "elections/primary/");
        assert!(check_name("lock name", "db").is_ok());
        assert!(check_name("lock name", "").is_err());
        assert!(check_name("lock name", "a/b").is_err());
        // etcd's mutex: `<name>/<lease id in hex>`, any non-empty name.
        assert_eq!(
            Recipe::EtcdLock.key("mylock", "etcd-694d7b1c0ba7a204"),
            "mylock/694d7b1c0ba7a204"
        );
        assert_eq!(
            Recipe::EtcdLock.key("/jobs/a", "etcd-000000000000002a"),
            "/jobs/a/2a"
        );
        assert_eq!(Recipe::EtcdLock.key("x", "w1"), "x/w1");
        assert!(Recipe::EtcdLock.check_name("lock name", "a/b").is_ok());
        assert!(Recipe::EtcdLock.check_name("lock name", "").is_err());
        assert!(Recipe::Lock.check_name("lock name", "a/b").is_err());
        assert_eq!(
            Recipe::EtcdElection.key("pick", "etcd-00000000000000ff"),
            "pick/ff"
        );
    }

    #[test]
    fn the_oldest_holds_and_each_waiter_waits_for_the_one_before_it() {
        let queue = q(&[("c", 9), ("a", 3), ("b", 5)]);
        assert_eq!(position(&queue, "a"), Position::Holder);
        assert_eq!(
            position(&queue, "b"),
            Position::After {
                key: "a".into(),
                create_revision: Revision(3)
            }
        );
        assert_eq!(
            position(&queue, "c"),
            Position::After {
                key: "b".into(),
                create_revision: Revision(5)
            }
        );
        assert_eq!(position(&queue, "d"), Position::Gone);
        assert_eq!(holder(&queue).map(|(k, _)| k.as_str()), Some("a"));
        assert_eq!(holder(&[]), None);
    }

    proptest! {
        /// Exactly one contender holds; every other waits for a distinct older key, and
        /// following "waits for" from any contender reaches the holder (a chain, no herd).
        #[test]
        fn one_holder_and_a_chain_of_waiters(revs in proptest::collection::btree_set(1u64..1000, 1..30)) {
            let queue: Vec<(String, Revision)> =
                revs.iter().map(|r| (format!("k{r}"), Revision(*r))).collect();
            let holders = queue.iter().filter(|(k, _)| position(&queue, k) == Position::Holder).count();
            prop_assert_eq!(holders, 1);
            let mut waited_for = std::collections::BTreeSet::new();
            for (k, _) in &queue {
                if let Position::After { key, .. } = position(&queue, k) {
                    prop_assert!(waited_for.insert(key.clone()), "two waiters on {}", key);
                }
            }
            prop_assert_eq!(waited_for.len(), queue.len() - 1);
        }
    }
}
