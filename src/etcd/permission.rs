//! etcd's key permissions and leasecore's, both ways.
//!
//! etcd grants a permission on a key range `[key, range_end)`; leasecore grants one on a key
//! or on a prefix ([`Permission`]). What etcdctl sends maps exactly:
//!
//! | etcd (`key`, `range_end`)                  | leasecore             |
//! |--------------------------------------------|-----------------------|
//! | `k`, empty (one key)                       | key `k`               |
//! | `k`, `k\0` (the same single key)           | key `k`               |
//! | `k`, the prefix end of `k` (`--prefix`)    | prefix `k`            |
//! | `\0`, `\0` (`--prefix ""`: every key)      | prefix `""`           |
//!
//! Any other range (`--from-key k`: `k`, `\0`; or an arbitrary `[a, b)`) has no leasecore
//! equivalent and is refused with `InvalidArgument`, saying so: granting a wider or a
//! narrower permission than asked would be wrong either way. Read answers give back the
//! forms above, so that a permission read from `RoleGet` revokes as it reads.

use leasecore_etcd_api::authpb;
use tonic::Status;

use super::EtcdError;
use crate::domain::auth::perm::prefix_end;
use crate::domain::auth::{PermKind, Permission};

/// etcd's refusal of an empty or inverted range (`ErrGRPCInvalidAuthMgmt`).
pub const INVALID_AUTH_MGMT: &str = "etcdserver: invalid auth management";

/// The leasecore grant etcd's `perm` names.
pub fn to_leasecore(perm: &authpb::Permission) -> Result<Permission, EtcdError> {
    let kind = match authpb::permission::Type::try_from(perm.perm_type) {
        Ok(authpb::permission::Type::Read) => PermKind::Read,
        Ok(authpb::permission::Type::Write) => PermKind::Write,
        Ok(authpb::permission::Type::Readwrite) => PermKind::Readwrite,
        Err(_) => {
            return Err(EtcdError::invalid(format!(
                "unknown permission type {} (READ is 0, WRITE 1, READWRITE 2)",
                perm.perm_type
            )));
        }
    };
    let (key, prefix) = range(&perm.key, &perm.range_end)?;
    Ok(Permission { kind, key, prefix })
}

/// The leasecore key and prefix flag of etcd's range `[key, range_end)`.
pub fn range(key: &[u8], range_end: &[u8]) -> Result<(String, bool), EtcdError> {
    if key.is_empty() {
        return Err(EtcdError::Status(Status::invalid_argument(
            INVALID_AUTH_MGMT,
        )));
    }
    if key == b"\0" && range_end == b"\0" {
        return Ok((String::new(), true));
    }
    let text = || {
        String::from_utf8(key.to_vec()).map_err(|_| {
            EtcdError::invalid("leasecore stores keys as UTF-8 text; this permission's key is not")
        })
    };
    if range_end.is_empty() {
        return Ok((text()?, false));
    }
    if range_end == b"\0" {
        return Err(EtcdError::invalid(format!(
            "leasecore grants a permission on one key or on a prefix; an open-ended range from \
             {:?} (--from-key) is neither: grant the prefixes it should cover instead",
            String::from_utf8_lossy(key)
        )));
    }
    if range_end <= key {
        return Err(EtcdError::Status(Status::invalid_argument(
            INVALID_AUTH_MGMT,
        )));
    }
    if prefix_end(key).as_deref() == Some(range_end) {
        return Ok((text()?, true));
    }
    if range_end.len() == key.len() + 1 && range_end.starts_with(key) && range_end.ends_with(b"\0")
    {
        return Ok((text()?, false));
    }
    Err(EtcdError::invalid(format!(
        "leasecore grants a permission on one key or on a prefix; the range [{:?}, {:?}) is \
         neither (a prefix p is [p, the prefix end of p), as `etcdctl role grant-permission \
         --prefix` sends it)",
        String::from_utf8_lossy(key),
        String::from_utf8_lossy(range_end)
    )))
}

/// etcd's view of a leasecore grant (what `etcdctl role grant-permission` would have sent).
pub fn to_etcd(p: &Permission) -> authpb::Permission {
    let perm_type = match p.kind {
        PermKind::Read => authpb::permission::Type::Read,
        PermKind::Write => authpb::permission::Type::Write,
        PermKind::Readwrite => authpb::permission::Type::Readwrite,
    } as i32;
    let (key, range_end) = match (p.prefix, p.key.as_bytes()) {
        (true, []) => (b"\0".to_vec(), b"\0".to_vec()),
        (true, key) => (
            key.to_vec(),
            prefix_end(key).unwrap_or_else(|| b"\0".to_vec()),
        ),
        (false, key) => (key.to_vec(), Vec::new()),
    };
    authpb::Permission {
        perm_type,
        key,
        range_end,
    }
}

/// etcd's answer for the root role's permissions: everything, read and write.
pub fn root() -> authpb::Permission {
    authpb::Permission {
        perm_type: authpb::permission::Type::Readwrite as i32,
        key: Vec::new(),
        range_end: b"\0".to_vec(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::Code;

    fn etcd(kind: i32, key: &[u8], end: &[u8]) -> authpb::Permission {
        authpb::Permission {
            perm_type: kind,
            key: key.to_vec(),
            range_end: end.to_vec(),
        }
    }

    fn code(e: EtcdError) -> (Code, String) {
        let s: Status = e.into();
        (s.code(), s.message().to_string())
    }

    #[test]
    fn what_etcdctl_sends_maps_exactly_and_back() {
        for (key, end, want_key, want_prefix) in [
            (&b"a/b"[..], &b""[..], "a/b", false),
            (b"a/b", b"a/c", "a/b", true),
            (b"a/b", b"a/b\0", "a/b", false),
            (b"\0", b"\0", "", true),
            (b"k\x7f", b"k\x80", "k\x7f", true),
        ] {
            for kind in 0..3 {
                let p = to_leasecore(&etcd(kind, key, end)).unwrap();
                assert_eq!((p.key.as_str(), p.prefix), (want_key, want_prefix));
                let back = to_etcd(&p);
                assert_eq!(back.perm_type, kind);
                // Back in the canonical form, which maps to the same grant again.
                let again = to_leasecore(&back).unwrap();
                assert_eq!(again, p);
            }
        }
        assert_eq!(
            to_etcd(&Permission {
                kind: PermKind::Read,
                key: "a/b".into(),
                prefix: true
            })
            .range_end,
            b"a/c"
        );
    }

    #[test]
    fn ranges_leasecore_cannot_hold_are_refused_clearly() {
        let (c, m) = code(to_leasecore(&etcd(0, b"k", b"\0")).unwrap_err());
        assert_eq!(c, Code::InvalidArgument);
        assert!(m.contains("--from-key"), "{m}");
        let (c, m) = code(to_leasecore(&etcd(2, b"a", b"c")).unwrap_err());
        assert_eq!(c, Code::InvalidArgument);
        assert!(m.contains("one key or on a prefix"), "{m}");
        for (key, end) in [(&b""[..], &b""[..]), (b"b", b"a"), (b"a", b"a")] {
            assert_eq!(
                code(to_leasecore(&etcd(0, key, end)).unwrap_err()),
                (Code::InvalidArgument, INVALID_AUTH_MGMT.to_string())
            );
        }
        let (c, m) = code(to_leasecore(&etcd(7, b"a", b"")).unwrap_err());
        assert_eq!(c, Code::InvalidArgument);
        assert!(m.contains("unknown permission type 7"), "{m}");
        let (c, _) = code(to_leasecore(&etcd(0, b"\xff", b"")).unwrap_err());
        assert_eq!(c, Code::InvalidArgument);
    }
}
