//! Cluster membership as leased keys: the key layout and the record, nothing more.
//!
//! A member `id` is the lease `members/{id}` and the key `members/{id}` attached to it, created
//! together by one `RegisterMember` entry. Heartbeats refresh the lease; when the lease expires
//! or is revoked, the key goes with it, and watchers of `members/` see the delete (cause
//! `lease_expired` or `lease_revoked`). No timer of its own: membership reuses the lease path.

use super::limits::InvalidInput;

/// The prefix of member keys and leases.
pub const MEMBERS_PREFIX: &str = "members/";
/// The longest member id, in bytes.
pub const MAX_MEMBER_ID_BYTES: usize = 256;

/// The key (and lease name) of member `id`.
pub fn member_key(id: &str) -> String {
    format!("{MEMBERS_PREFIX}{id}")
}

/// The member id of a member key, if it is one.
pub fn member_id(key: &str) -> Option<&str> {
    key.strip_prefix(MEMBERS_PREFIX).filter(|id| !id.is_empty())
}

/// A member id: non-empty, at most 256 bytes, no `/`, no control characters.
pub fn check_member_id(id: &str) -> Result<(), InvalidInput> {
    if id.is_empty() || id.len() > MAX_MEMBER_ID_BYTES {
        return Err(InvalidInput::Invalid(format!(
            "member id must be 1 to {MAX_MEMBER_ID_BYTES} bytes"
        )));
    }
    if id.contains('/') || id.chars().any(char::is_control) {
        return Err(InvalidInput::Invalid(
            "member id must not contain '/' or control characters".into(),
        ));
    }
    Ok(())
}

pub use leasecore_client::api::MemberRecord;

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    #[test]
    fn ids_and_keys() {
        assert_eq!(member_key("n1"), "members/n1");
        assert_eq!(member_id("members/n1"), Some("n1"));
        assert_eq!(member_id("members/"), None);
        assert_eq!(member_id("other/n1"), None);
        assert!(check_member_id("n1").is_ok());
        assert!(check_member_id("").is_err());
        assert!(check_member_id("a/b").is_err());
        assert!(check_member_id(&"x".repeat(257)).is_err());
    }

    #[test]
    fn records_round_trip_canonically() {
        let r = MemberRecord {
            id: "n1".into(),
            address: "10.0.0.1:80".into(),
            meta: BTreeMap::from([("zone".into(), "b".into()), ("az".into(), "a".into())]),
        };
        let v = r.encode();
        assert_eq!(
            v,
            r#"{"id":"n1","address":"10.0.0.1:80","meta":{"az":"a","zone":"b"}}"#
        );
        assert_eq!(MemberRecord::decode(&v), Some(r));
    }
}
