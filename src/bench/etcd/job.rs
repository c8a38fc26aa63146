//! One connection's closed loop: a [`Job`] sends one request of its workload at a time until
//! the deadline, checks every answer and tallies it ([`Tally`]): a checked success's latency,
//! or a failure.
//!
//! # Invariants
//! - Only a checked success counts: a put's revision must be above the connection's last, a
//!   range must find the preloaded value, a txn must succeed as a compare-and-set above the
//!   key's last mod revision, a grant must return a lease with the whole TTL, a keepalive must
//!   renew the connection's own lease with the whole TTL.
//! - Only the request is timed: learning the txn key's mod revision (at the start, and after a
//!   failure whose outcome is unknown) is not.
//! - A connection writes only keys of its own (under the run's prefix, with its number):
//!   connections never contend for a key.
//! - A keepalive stream that failed is dropped; the next keepalive opens a new one.
//!
//! # What it must not do
//! Count a failure as a success, or stop at one: a failure is tallied and the loop goes on
//! (after yielding, so that failing calls cannot hold a worker), unless the connection itself
//! has closed; then the connection's loop ends, having tallied that once.

use std::time::Instant;

use leasecore_etcd_api::etcdserverpb::{
    Compare, LeaseGrantRequest, LeaseGrantResponse, LeaseKeepAliveRequest, LeaseKeepAliveResponse,
    PutRequest, PutResponse, RangeRequest, RangeResponse, RequestOp, TxnRequest, TxnResponse,
    compare, request_op, response_op,
};

use super::{EtcdWorkload, LEASE_TTL_S, header_revision, key_name};
use crate::bench::grpc_conn::{GrpcConn, GrpcStream};
use crate::bench::value_for;

const PUT: &str = "/etcdserverpb.KV/Put";
const RANGE: &str = "/etcdserverpb.KV/Range";
const TXN: &str = "/etcdserverpb.KV/Txn";
const LEASE_GRANT: &str = "/etcdserverpb.Lease/LeaseGrant";
const LEASE_KEEP_ALIVE: &str = "/etcdserverpb.Lease/LeaseKeepAlive";

/// One connection's work.
pub(super) struct Job {
    pub(super) w: usize,
    /// Where put and txn write (see [`run_prefix`](super::run_prefix)).
    pub(super) prefix: String,
    pub(super) workload: EtcdWorkload,
    pub(super) keys: usize,
    pub(super) value_size: usize,
    /// The pre-granted lease of the keepalive workload.
    pub(super) lease: Option<i64>,
    pub(super) deadline: Instant,
}

/// One connection's figures.
#[derive(Default)]
pub(super) struct Tally {
    pub(super) latencies_us: Vec<u32>,
    pub(super) errors: u64,
    pub(super) first_error: Option<String>,
    /// lease-grant: the leases acknowledged.
    pub(super) granted: Vec<i64>,
}

impl Tally {
    fn record(&mut self, sent: Instant, checked: Result<(), String>) {
        match checked {
            Ok(()) => self
                .latencies_us
                .push(sent.elapsed().as_micros().min(u128::from(u32::MAX)) as u32),
            Err(e) => self.fail(e),
        }
    }

    fn fail(&mut self, e: String) {
        self.errors += 1;
        if self.first_error.is_none() {
            self.first_error = Some(e);
        }
    }
}

impl Job {
    pub(super) async fn run(self, mut conn: GrpcConn) -> Tally {
        let mut t = Tally::default();
        // Connections start at different keys so that they do not write one key in lockstep.
        let mut i = self.w.wrapping_mul(7919) % self.keys;
        // The revision of this connection's last write: each must be above it.
        let mut last = 0i64;
        // put: this connection's writes so far (each to a new key).
        let mut written = 0usize;
        // txn: this connection's key (new), and its mod revision if known.
        let txn_key = format!("{}{:04}", self.prefix, self.w).into_bytes();
        let mut txn_mod: Option<i64> = Some(0);
        let mut keepalive: Option<GrpcStream> = None;
        let mut failed_before = 0;
        while Instant::now() < self.deadline {
            if conn.is_closed() {
                // Every call would fail at once: one failure says it, and the connection's
                // work ends.
                t.fail("the connection closed".into());
                break;
            }
            if t.errors > failed_before {
                // A call that fails at once never waits, so never yields: let others run.
                failed_before = t.errors;
                tokio::task::yield_now().await;
            }
            match self.workload {
                EtcdWorkload::Put => {
                    written += 1;
                    let req = PutRequest {
                        key: format!("{}{:04}/{written:08}", self.prefix, self.w).into_bytes(),
                        value: value_for(i, self.value_size).into_bytes(),
                        ..PutRequest::default()
                    };
                    let sent = Instant::now();
                    let checked = match conn.unary::<_, PutResponse>(PUT, &req).await {
                        Ok(r) => {
                            let rev = header_revision(r.header.as_ref());
                            let checked = if rev > last {
                                Ok(())
                            } else {
                                Err(format!("put: revision {rev} not above {last}"))
                            };
                            last = last.max(rev);
                            checked
                        }
                        Err(e) => Err(format!("put: {e}")),
                    };
                    t.record(sent, checked);
                }
                EtcdWorkload::Range | EtcdWorkload::RangeSerializable => {
                    let key = key_name(i);
                    let req = RangeRequest {
                        key: key.clone(),
                        serializable: self.workload == EtcdWorkload::RangeSerializable,
                        ..RangeRequest::default()
                    };
                    let sent = Instant::now();
                    let checked = match conn.unary::<_, RangeResponse>(RANGE, &req).await {
                        Ok(r) => {
                            let found = r.kvs.first();
                            if r.count == 1
                                && r.kvs.len() == 1
                                && found.is_some_and(|kv| {
                                    kv.key == key
                                        && kv.value == value_for(i, self.value_size).as_bytes()
                                })
                            {
                                Ok(())
                            } else {
                                Err(format!(
                                    "range {}: {} keys, not the preloaded value",
                                    String::from_utf8_lossy(&key),
                                    r.kvs.len()
                                ))
                            }
                        }
                        Err(e) => Err(format!("range: {e}")),
                    };
                    t.record(sent, checked);
                }
                EtcdWorkload::Txn => {
                    let key = txn_key.clone();
                    let Some(expected) = txn_mod else {
                        // Learn the key's mod revision (not timed): at the start, and after a
                        // failure whose outcome is unknown.
                        let read = RangeRequest {
                            key,
                            ..RangeRequest::default()
                        };
                        match conn.unary::<_, RangeResponse>(RANGE, &read).await {
                            Ok(r) => txn_mod = Some(r.kvs.first().map_or(0, |kv| kv.mod_revision)),
                            Err(e) => t.fail(format!("txn's key: {e}")),
                        }
                        continue;
                    };
                    let req = cas_put(&key, expected, value_for(i, self.value_size));
                    let sent = Instant::now();
                    let checked = match conn.unary::<_, TxnResponse>(TXN, &req).await {
                        Ok(r) => {
                            let (checked, now) = check_cas(&r, expected);
                            txn_mod = now;
                            checked
                        }
                        Err(e) => {
                            txn_mod = None;
                            Err(format!("txn: {e}"))
                        }
                    };
                    t.record(sent, checked);
                }
                EtcdWorkload::LeaseGrant => {
                    let req = LeaseGrantRequest {
                        ttl: LEASE_TTL_S,
                        id: 0,
                    };
                    let sent = Instant::now();
                    let checked = match conn.unary::<_, LeaseGrantResponse>(LEASE_GRANT, &req).await
                    {
                        Ok(g) => {
                            if g.id > 0 && g.ttl >= LEASE_TTL_S && g.error.is_empty() {
                                t.granted.push(g.id);
                                Ok(())
                            } else {
                                Err(format!(
                                    "lease grant: id {}, ttl {} ({})",
                                    g.id, g.ttl, g.error
                                ))
                            }
                        }
                        Err(e) => Err(format!("lease grant: {e}")),
                    };
                    t.record(sent, checked);
                }
                EtcdWorkload::LeaseKeepalive => {
                    let Some(id) = self.lease else {
                        t.fail("no pre-granted lease".into());
                        return t;
                    };
                    let sent = Instant::now();
                    let checked = match keep_alive_once(&mut conn, &mut keepalive, id).await {
                        Ok(r) if r.id == id && r.ttl == LEASE_TTL_S => Ok(()),
                        Ok(r) => Err(format!("keepalive of {id}: id {}, ttl {}", r.id, r.ttl)),
                        Err(e) => Err(e),
                    };
                    if checked.is_err() {
                        keepalive = None; // open a new stream
                    }
                    t.record(sent, checked);
                }
            }
            i = (i + 1) % self.keys;
        }
        t
    }
}

/// A compare-and-set: put `key` if its mod revision is still `expected` (0: it does not
/// exist), else read it.
fn cas_put(key: &[u8], expected: i64, value: String) -> TxnRequest {
    TxnRequest {
        compare: vec![Compare {
            result: compare::CompareResult::Equal as i32,
            target: compare::CompareTarget::Mod as i32,
            key: key.to_vec(),
            range_end: Vec::new(),
            target_union: Some(compare::TargetUnion::ModRevision(expected)),
        }],
        success: vec![RequestOp {
            request: Some(request_op::Request::RequestPut(PutRequest {
                key: key.to_vec(),
                value: value.into_bytes(),
                ..PutRequest::default()
            })),
        }],
        failure: vec![RequestOp {
            request: Some(request_op::Request::RequestRange(RangeRequest {
                key: key.to_vec(),
                ..RangeRequest::default()
            })),
        }],
    }
}

/// Check a [`cas_put`]'s answer: it must have succeeded with one put at a revision above
/// `expected`. Returns the check and the key's mod revision now, if known.
fn check_cas(r: &TxnResponse, expected: i64) -> (Result<(), String>, Option<i64>) {
    let rev = header_revision(r.header.as_ref());
    let put = matches!(
        r.responses.as_slice(),
        [leasecore_etcd_api::etcdserverpb::ResponseOp {
            response: Some(response_op::Response::ResponsePut(_))
        }]
    );
    if r.succeeded && put && rev > expected {
        return (Ok(()), Some(rev));
    }
    // A failed compare read the key: its mod revision now.
    let now = match r.responses.as_slice() {
        [
            leasecore_etcd_api::etcdserverpb::ResponseOp {
                response: Some(response_op::Response::ResponseRange(range)),
            },
        ] => Some(range.kvs.first().map_or(0, |kv| kv.mod_revision)),
        _ => None,
    };
    (
        Err(format!(
            "txn: succeeded {}, {} responses, revision {rev} after {expected}",
            r.succeeded,
            r.responses.len()
        )),
        now,
    )
}

/// Send one keepalive for `id` on the connection's stream (opened when there is none) and
/// wait for its answer.
async fn keep_alive_once(
    conn: &mut GrpcConn,
    stream: &mut Option<GrpcStream>,
    id: i64,
) -> Result<LeaseKeepAliveResponse, String> {
    let open = match stream {
        Some(s) => s,
        None => stream.insert(
            conn.open_stream(LEASE_KEEP_ALIVE)
                .await
                .map_err(|e| format!("keepalive stream: {e}"))?,
        ),
    };
    conn.exchange(open, &LeaseKeepAliveRequest { id })
        .await
        .map_err(|e| format!("keepalive of {id}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cas_answer_is_checked() {
        use leasecore_etcd_api::etcdserverpb::{
            PutResponse, RangeResponse, ResponseHeader, ResponseOp,
        };
        let header = |revision| {
            Some(ResponseHeader {
                revision,
                ..ResponseHeader::default()
            })
        };
        let put = TxnResponse {
            header: header(8),
            succeeded: true,
            responses: vec![ResponseOp {
                response: Some(response_op::Response::ResponsePut(PutResponse::default())),
            }],
        };
        assert_eq!(check_cas(&put, 5), (Ok(()), Some(8)));
        assert!(check_cas(&put, 8).0.is_err());
        let lost = TxnResponse {
            header: header(9),
            succeeded: false,
            responses: vec![ResponseOp {
                response: Some(response_op::Response::ResponseRange(RangeResponse {
                    kvs: vec![leasecore_etcd_api::mvccpb::KeyValue {
                        mod_revision: 7,
                        ..Default::default()
                    }],
                    ..RangeResponse::default()
                })),
            }],
        };
        let (checked, now) = check_cas(&lost, 5);
        assert!(checked.is_err());
        assert_eq!(now, Some(7));
    }
}
