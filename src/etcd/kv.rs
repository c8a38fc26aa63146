//! The `KV` service: Range, Put, DeleteRange, Txn and Compact.
//!
//! Writes are one [`Command::Txn`] each (a plain Put is the store's [`Command::Put`]),
//! checked (`admit`) and authorized (`guard`) as the `/v1` writes are, then proposed
//! (followers forward). Reads are linearizable unless the request is `serializable`, and
//! are served from this node's applied state: the current one, or its MVCC history for a
//! range at a past revision. A Txn that only reads and asks
//! for a past revision somewhere is a read too ([`ReadTxn`]). In a Txn that writes, such a
//! range is checked where the txn applies (compacted, future: the txn fails whole, as in
//! etcd) and read from this member's history once the txn applied here (`read_deferred`):
//! the state machine holds only the present. `Compact` is a replicated [`Command::Compact`].

use leasecore_etcd_api::etcdserverpb::kv_server::Kv;
use leasecore_etcd_api::etcdserverpb::{
    CompactionRequest, CompactionResponse, DeleteRangeRequest, DeleteRangeResponse, PutRequest,
    PutResponse, RangeRequest, RangeResponse, RequestOp, ResponseHeader, ResponseOp, TxnRequest,
    TxnResponse, compare, range_request, request_op, response_op,
};
use tonic::{Request, Response, Status};

use super::{Etcd, EtcdError, key_value, lease_name};
use crate::domain::auth::{Access, KeyRange};
use crate::domain::command::{Command, Response as Applied};
use crate::domain::range::{
    MAX_RESULT_BYTES, RangeResult, RangeSpec, ResultBudget, SortOrder, SortTarget, evaluate_within,
};
use crate::domain::txn::{
    Compare, CompareOp, CompareTarget, KeysAt, OpResult, ReadFor, ReadOp, ReadTxn, Txn, TxnOp,
    TxnResult, evaluate_read_only, fill_deferred, has_deferred,
};
use crate::domain::types::Revision;
use crate::domain::{key_bytes, value_bytes};
use crate::http::auth::check;
use crate::http::kv::{Consistency, admit, read_point, unexpected};
use crate::raft::off_workers;
use crate::raft::state_machine::{HistoryError, StateView};

impl Etcd {
    /// Propose `txn` for the caller of `req`; the store revision after it, and its result.
    async fn write<T>(
        &self,
        req: &Request<T>,
        txn: Txn,
    ) -> Result<(Revision, TxnResult), EtcdError> {
        let caller = self.caller(req)?;
        match self.submit(&caller, Command::Txn { txn }).await? {
            Applied::Txn { revision, outcome } => Ok((revision, outcome)),
            other => Err(unexpected(other).into()),
        }
    }

    /// Serve a transaction that only reads: checked as any transaction, the caller allowed to
    /// read every range of it, linearizable unless every range is serializable; then read at
    /// one revision (the past ranges at theirs) from the history.
    async fn read_txn<T>(
        &self,
        req: &Request<T>,
        read: ReadTxn,
        serializable: bool,
    ) -> Result<TxnResponse, EtcdError> {
        let caller = self.caller(req)?;
        admit(&self.state, &Command::Txn { txn: read.as_txn() })?;
        for range in read.ranges() {
            check(&self.state, &caller, Access::Read, range)?;
        }
        if !serializable {
            read_point(&self.state, Consistency::Linearizable).await?;
        }
        let view = self.state.consensus.view();
        let now = view.with_state(|kv| kv.revision());
        self.read_answer(|mut budget| {
            let result = evaluate_read_only(
                &read,
                now,
                &mut |what, at| read_for(view, what, at),
                &mut budget,
            )?;
            Ok(self.txn_response(now, result))
        })
        .await
    }

    /// Work over the whole store (Maintenance `Hash`, `HashKV`, `LeaseLeases`): a large
    /// read's turn, and off the async workers with the state's lock announced as held long,
    /// as a large read is built. On 310,000 keys a hash held a node's one worker for 286 ms.
    pub(super) async fn whole_store_work<R>(
        &self,
        work: impl FnOnce() -> R,
    ) -> Result<R, EtcdError> {
        let _turn = large_turn(&self.large_reads, LARGE_READ_WAIT).await?;
        let _long = off_workers::long_hold();
        Ok(off_workers::run(work))
    }

    /// Build a read's answer with `build`, given the bytes it may take. First within
    /// [`MAX_RESULT_BYTES`], where it was asked: the common read, a few milliseconds at most
    /// under the state's read lock. One that needs more (up to `--etcd-max-read-answer-bytes`)
    /// is a *large read*, built again with the whole budget: at most [`LARGE_READS_AT_ONCE`]
    /// at a time on this node, each waiting its turn for up to [`LARGE_READ_WAIT`], and off
    /// the async workers, announced as a long hold of the state's lock so that the apply and
    /// the readers that wait for that lock meanwhile wait off them too.
    ///
    /// Why: four reads of 200 MiB at once, built on the node's one worker, held it for 1.2 s;
    /// heartbeats waited as long and the leader stepped down.
    async fn read_answer<R>(
        &self,
        build: impl Fn(ResultBudget) -> Result<R, EtcdError>,
    ) -> Result<R, EtcdError> {
        let limit = self.state.limits.max_read_answer_bytes;
        read_within(limit, &self.large_reads, LARGE_READ_WAIT, build).await
    }

    /// Read the ranges at a past revision that the applied transaction `t` left to this node
    /// ([`fill_deferred`]), once this node has applied it. The transaction has applied: a
    /// failure now cannot say that nothing was done, so it is etcd's "request timed out"
    /// (outcome unknown to the client), naming the revision it applied at.
    async fn read_deferred(
        &self,
        t: &Txn,
        revision: Revision,
        out: &mut TxnResult,
    ) -> Result<(), EtcdError> {
        if !has_deferred(out) {
            return Ok(());
        }
        let view = self.state.consensus.view();
        let applied_here = view
            .wait_revision(revision, std::time::Duration::from_secs(10))
            .await;
        let filled = if applied_here {
            fill_deferred(
                t,
                out,
                &mut |what, at| read_for(view, what, at),
                &mut ResultBudget::default(),
            )
            .map_err(|e| Status::from(e).message().to_string())
        } else {
            Err("this member did not apply it in time".to_string())
        };
        filled.map_err(|why| {
            EtcdError::Status(Status::unavailable(format!(
                "etcdserver: request timed out: the txn applied at revision {revision}, but \
                 its range at a past revision could not be read on this member ({why})"
            )))
        })
    }

    /// One operation as a transaction of its own (etcd's Put and DeleteRange), and its result.
    async fn write_one<T>(
        &self,
        req: &Request<T>,
        op: TxnOp,
    ) -> Result<(Revision, Option<OpResult>), EtcdError> {
        let txn = Txn {
            success: vec![op],
            ..Txn::default()
        };
        let (revision, mut out) = self.write(req, txn).await?;
        Ok((revision, out.results.pop()))
    }

    /// A Put that asks for nothing but the write: the store's own [`Command::Put`], which is
    /// what a one-operation transaction does when it applies, in a smaller log entry and
    /// without the transaction's checks and results (an etcd client's most common write).
    async fn put_plain(&self, req: Request<PutRequest>) -> Result<Revision, EtcdError> {
        let caller = self.caller(&req)?;
        let p = req.into_inner();
        let cmd = Command::Put {
            key: key(p.key)?,
            value: value_bytes::store(p.value),
            lease: (p.lease != 0).then(|| lease_name(p.lease)),
            prev_revision: None,
        };
        match self.submit(&caller, cmd).await? {
            Applied::Put { revision } => Ok(revision),
            other => Err(unexpected(other).into()),
        }
    }

    fn range_response(&self, revision: Revision, r: RangeResult) -> RangeResponse {
        RangeResponse {
            header: self.header_at(revision),
            kvs: r.kvs.iter().map(|(k, v)| key_value(k, v)).collect(),
            more: r.more,
            count: r.count as i64,
        }
    }

    /// etcd's answer to a transaction: the whole header on the transaction's own, and on each
    /// operation's a header of its revision alone, as etcd's applier writes them (a nested
    /// transaction's none).
    fn txn_response(&self, revision: Revision, t: TxnResult) -> TxnResponse {
        let before = if txn_changes(&t) {
            Revision(revision.0.saturating_sub(1))
        } else {
            revision
        };
        let mut changed = false;
        TxnResponse {
            header: self.header_at(revision),
            succeeded: t.succeeded,
            responses: op_responses(t.results, revision, before, &mut changed),
        }
    }
}

/// Answers over [`MAX_RESULT_BYTES`] one node builds at a time ([`Etcd::read_answer`]): with
/// the largest (256 MiB by default) each holds its keys' values two or three times over while
/// it is built and sent, so this bounds what large reads hold at once.
pub(super) const LARGE_READS_AT_ONCE: usize = 2;

/// How long a large read waits for its turn before it is refused.
const LARGE_READ_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// [`Etcd::read_answer`], given the read limit, the node's turns for large reads and how long
/// a large read waits for one.
async fn read_within<R>(
    limit: usize,
    turns: &tokio::sync::Semaphore,
    wait: std::time::Duration,
    build: impl Fn(ResultBudget) -> Result<R, EtcdError>,
) -> Result<R, EtcdError> {
    match build(ResultBudget::new(limit.min(MAX_RESULT_BYTES))) {
        Err(e) if limit > MAX_RESULT_BYTES && too_large(&e) => {}
        built => return built,
    }
    let _turn = large_turn(turns, wait).await?;
    let _long = off_workers::long_hold();
    off_workers::run(|| build(ResultBudget::new(limit)))
}

/// A turn for a large read, or for work over the whole store: waited for up to `wait`.
async fn large_turn(
    turns: &tokio::sync::Semaphore,
    wait: std::time::Duration,
) -> Result<tokio::sync::SemaphorePermit<'_>, EtcdError> {
    match tokio::time::timeout(wait, turns.acquire()).await {
        Ok(Ok(turn)) => Ok(turn),
        _ => {
            // etcd's exact text, which clients map to their typed error; the reason is here.
            tracing::info!(
                at_once = LARGE_READS_AT_ONCE,
                over_bytes = MAX_RESULT_BYTES,
                waited_s = wait.as_secs(),
                "a large read (or a hash of the whole store) found no turn free and was \
                 refused: narrow the read (limit, keys_only) or retry"
            );
            Err(EtcdError::Status(Status::resource_exhausted(
                "etcdserver: too many requests",
            )))
        }
    }
}

/// Whether `e` refuses an answer for its size.
fn too_large(e: &EtcdError) -> bool {
    matches!(e, EtcdError::Api(a) if a.code == "result_too_large")
}

/// Whether a transaction's results changed the store (and so took a revision).
fn txn_changes(t: &TxnResult) -> bool {
    t.results.iter().any(|r| match r {
        OpResult::Put { .. } => true,
        OpResult::DeleteRange { deleted, .. } => *deleted > 0,
        OpResult::Range { .. } => false,
        OpResult::Txn { result } => txn_changes(result),
    })
}

/// The operations' answers, in order. Each header holds the revision the operation saw, as in
/// etcd: a read before the transaction's first change reads the revision before it (`before`),
/// and everything from that change on, the transaction's own (`after`).
fn op_responses(
    results: Vec<OpResult>,
    after: Revision,
    before: Revision,
    changed: &mut bool,
) -> Vec<ResponseOp> {
    let only = |revision: Revision| {
        Some(ResponseHeader {
            revision: revision.0 as i64,
            ..ResponseHeader::default()
        })
    };
    results
        .into_iter()
        .map(|r| {
            let response = match r {
                OpResult::Put { prev } => {
                    *changed = true;
                    response_op::Response::ResponsePut(PutResponse {
                        header: only(after),
                        prev_kv: prev.map(|(k, v)| key_value(&k, &v)),
                    })
                }
                OpResult::DeleteRange { deleted, prev } => {
                    *changed |= deleted > 0;
                    response_op::Response::ResponseDeleteRange(DeleteRangeResponse {
                        header: only(if *changed { after } else { before }),
                        deleted: deleted as i64,
                        prev_kvs: prev.iter().map(|(k, v)| key_value(k, v)).collect(),
                    })
                }
                OpResult::Range { result, .. } => {
                    response_op::Response::ResponseRange(RangeResponse {
                        header: only(if *changed { after } else { before }),
                        kvs: result.kvs.iter().map(|(k, v)| key_value(k, v)).collect(),
                        more: result.more,
                        count: result.count as i64,
                    })
                }
                OpResult::Txn { result } => response_op::Response::ResponseTxn(TxnResponse {
                    header: None,
                    succeeded: result.succeeded,
                    responses: op_responses(result.results, after, before, changed),
                }),
            };
            ResponseOp {
                response: Some(response),
            }
        })
        .collect()
}

/// A key that must be non-empty, in its stored form ([`key_bytes::store`]).
fn key(bytes: Vec<u8>) -> Result<String, EtcdError> {
    if bytes.is_empty() {
        return Err(EtcdError::invalid("key is not provided"));
    }
    Ok(key_bytes::store(bytes))
}

fn revision_filter(v: i64) -> u64 {
    u64::try_from(v).unwrap_or(0)
}

fn range_spec(r: &RangeRequest) -> Result<RangeSpec, EtcdError> {
    if r.key.is_empty() {
        return Err(EtcdError::invalid("key is not provided"));
    }
    let sort_order = match range_request::SortOrder::try_from(r.sort_order) {
        Ok(range_request::SortOrder::None) => SortOrder::None,
        Ok(range_request::SortOrder::Ascend) => SortOrder::Ascend,
        Ok(range_request::SortOrder::Descend) => SortOrder::Descend,
        Err(_) => return Err(EtcdError::invalid("invalid sort option")),
    };
    let sort_target = match range_request::SortTarget::try_from(r.sort_target) {
        Ok(range_request::SortTarget::Key) => SortTarget::Key,
        Ok(range_request::SortTarget::Version) => SortTarget::Version,
        Ok(range_request::SortTarget::Create) => SortTarget::Create,
        Ok(range_request::SortTarget::Mod) => SortTarget::Mod,
        Ok(range_request::SortTarget::Value) => SortTarget::Value,
        Err(_) => return Err(EtcdError::invalid("invalid sort option")),
    };
    Ok(RangeSpec {
        range: KeyRange::from_etcd(&r.key, &r.range_end),
        limit: u64::try_from(r.limit).unwrap_or(0),
        sort_order,
        sort_target,
        keys_only: r.keys_only,
        count_only: r.count_only,
        min_mod_revision: revision_filter(r.min_mod_revision),
        max_mod_revision: revision_filter(r.max_mod_revision),
        min_create_revision: revision_filter(r.min_create_revision),
        max_create_revision: revision_filter(r.max_create_revision),
    })
}

fn put_op(p: PutRequest) -> Result<TxnOp, EtcdError> {
    Ok(TxnOp::Put {
        key: key(p.key)?,
        value: value_bytes::store(p.value),
        lease: (p.lease != 0).then(|| lease_name(p.lease)),
        ignore_value: p.ignore_value,
        ignore_lease: p.ignore_lease,
        prev_kv: p.prev_kv,
    })
}

fn delete_op(d: DeleteRangeRequest) -> Result<TxnOp, EtcdError> {
    if d.key.is_empty() {
        return Err(EtcdError::invalid("key is not provided"));
    }
    Ok(TxnOp::DeleteRange {
        range: KeyRange::from_etcd(&d.key, &d.range_end),
        prev_kv: d.prev_kv,
    })
}

fn compare(c: leasecore_etcd_api::etcdserverpb::Compare) -> Result<Compare, EtcdError> {
    let op = match compare::CompareResult::try_from(c.result) {
        Ok(compare::CompareResult::Equal) => CompareOp::Equal,
        Ok(compare::CompareResult::NotEqual) => CompareOp::NotEqual,
        Ok(compare::CompareResult::Greater) => CompareOp::Greater,
        Ok(compare::CompareResult::Less) => CompareOp::Less,
        Err(_) => return Err(EtcdError::invalid("invalid compare result")),
    };
    let rev = |r: i64| Revision(u64::try_from(r).unwrap_or(0));
    // The union may be absent when its value is the zero value: the target says which.
    let target = match (compare::CompareTarget::try_from(c.target), c.target_union) {
        (Ok(compare::CompareTarget::Version), u) => CompareTarget::Version(match u {
            Some(compare::TargetUnion::Version(v)) => u64::try_from(v).unwrap_or(0),
            _ => 0,
        }),
        (Ok(compare::CompareTarget::Create), u) => CompareTarget::CreateRevision(match u {
            Some(compare::TargetUnion::CreateRevision(v)) => rev(v),
            _ => Revision(0),
        }),
        (Ok(compare::CompareTarget::Mod), u) => CompareTarget::ModRevision(match u {
            Some(compare::TargetUnion::ModRevision(v)) => rev(v),
            _ => Revision(0),
        }),
        // In the stored form, as the values it compares with.
        (Ok(compare::CompareTarget::Value), u) => CompareTarget::Value(match u {
            Some(compare::TargetUnion::Value(v)) => value_bytes::store(v).into_bytes(),
            _ => Vec::new(),
        }),
        (Ok(compare::CompareTarget::Lease), u) => CompareTarget::Lease(match u {
            Some(compare::TargetUnion::Lease(id)) if id != 0 => Some(lease_name(id)),
            _ => None,
        }),
        (Err(_), _) => return Err(EtcdError::invalid("invalid compare target")),
    };
    if c.key.is_empty() {
        return Err(EtcdError::invalid("key is not provided"));
    }
    Ok(Compare {
        range: KeyRange::from_etcd(&c.key, &c.range_end),
        op,
        target,
    })
}

fn ops(ops: Vec<RequestOp>) -> Result<Vec<TxnOp>, EtcdError> {
    ops.into_iter()
        .map(|op| match op.request {
            Some(request_op::Request::RequestPut(p)) => put_op(p),
            Some(request_op::Request::RequestDeleteRange(d)) => delete_op(d),
            // A range at a past revision is checked where the txn applies (compacted, future)
            // and read from the history by the member that answers (`read_deferred`). (A txn
            // that only reads is served as a read: `read_only`.)
            Some(request_op::Request::RequestRange(r)) => Ok(TxnOp::Range {
                spec: range_spec(&r)?,
                at: (r.revision > 0).then_some(Revision(r.revision as u64)),
            }),
            Some(request_op::Request::RequestTxn(t)) => Ok(TxnOp::Txn { txn: txn(t)? }),
            None => Err(EtcdError::invalid("a txn operation is empty")),
        })
        .collect()
}

/// The transaction as a [`ReadTxn`] when it only reads (`None` otherwise: it goes through the
/// log as every other transaction), and whether every range of it is `serializable`.
fn read_only(t: &TxnRequest) -> Result<Option<(ReadTxn, bool)>, EtcdError> {
    /// Whether every op only reads; whether all are serializable.
    fn scan(t: &TxnRequest) -> (bool, bool) {
        let (mut reads, mut serializable) = (true, true);
        for op in t.success.iter().chain(&t.failure) {
            match &op.request {
                Some(request_op::Request::RequestRange(r)) => serializable &= r.serializable,
                Some(request_op::Request::RequestTxn(inner)) => {
                    let (r, s) = scan(inner);
                    reads &= r;
                    serializable &= s;
                }
                _ => reads = false,
            }
        }
        (reads, serializable)
    }
    fn convert(t: &TxnRequest) -> Result<ReadTxn, EtcdError> {
        let ops = |ops: &[RequestOp]| -> Result<Vec<ReadOp>, EtcdError> {
            ops.iter()
                .map(|op| match &op.request {
                    Some(request_op::Request::RequestRange(r)) => Ok(ReadOp::Range {
                        spec: range_spec(r)?,
                        at: (r.revision > 0).then_some(Revision(r.revision as u64)),
                    }),
                    Some(request_op::Request::RequestTxn(inner)) => Ok(ReadOp::Txn {
                        txn: convert(inner)?,
                    }),
                    _ => Err(EtcdError::invalid("a txn operation is empty")),
                })
                .collect()
        };
        Ok(ReadTxn {
            compares: t
                .compare
                .iter()
                .cloned()
                .map(compare)
                .collect::<Result<_, _>>()?,
            success: ops(&t.success)?,
            failure: ops(&t.failure)?,
        })
    }
    // Every transaction that only reads is served as a read, as etcd serves it (after a read
    // barrier unless serializable): it takes no log entry, and its answer has a read's budget.
    match scan(t) {
        (true, serializable) => Ok(Some((convert(t)?, serializable))),
        _ => Ok(None),
    }
}

fn txn(t: TxnRequest) -> Result<Txn, EtcdError> {
    Ok(Txn {
        compares: t
            .compare
            .into_iter()
            .map(compare)
            .collect::<Result<_, _>>()?,
        success: ops(t.success)?,
        failure: ops(t.failure)?,
    })
}

#[tonic::async_trait]
impl Kv for Etcd {
    async fn range(&self, req: Request<RangeRequest>) -> Result<Response<RangeResponse>, Status> {
        let caller = self.caller(&req)?;
        let r = req.into_inner();
        let spec = range_spec(&r)?;
        if !r.serializable {
            read_point(&self.state, Consistency::Linearizable)
                .await
                .map_err(EtcdError::from)?;
        }
        check(&self.state, &caller, Access::Read, &spec.range).map_err(EtcdError::from)?;
        let view = self.state.consensus.view();
        let answer = if r.revision <= 0 {
            // Now: evaluated in place, without copying the range. Charged before anything is
            // copied: a range larger than the budget is refused without building it.
            self.read_answer(|mut budget| {
                let (revision, result) = view.with_state(|kv| {
                    (
                        kv.revision(),
                        evaluate_within(&spec, kv.range(&spec.range), &mut budget),
                    )
                });
                Ok(self.range_response(revision, result?))
            })
            .await
        } else {
            // Read a few keys at a time within the budget: a range at a past revision larger
            // than the budget is refused before it is read whole.
            self.read_answer(|mut budget| {
                let (revision, kvs) = view
                    .range_within(&spec, Some(Revision(r.revision as u64)), budget)
                    .map_err(history_error)?;
                let result =
                    evaluate_within(&spec, kvs.iter().map(|(k, v)| (k.as_str(), v)), &mut budget)?;
                Ok(self.range_response(revision, result))
            })
            .await
        };
        Ok(Response::new(answer?))
    }

    async fn put(&self, req: Request<PutRequest>) -> Result<Response<PutResponse>, Status> {
        let p = req.get_ref();
        if !p.prev_kv && !p.ignore_value && !p.ignore_lease {
            let revision = self.put_plain(req).await?;
            return Ok(Response::new(PutResponse {
                header: self.header_at(revision),
                prev_kv: None,
            }));
        }
        let op = put_op(req.get_ref().clone())?;
        let (revision, result) = self.write_one(&req, op).await?;
        let prev_kv = match result {
            Some(OpResult::Put { prev }) => prev.map(|(k, v)| key_value(&k, &v)),
            _ => None,
        };
        Ok(Response::new(PutResponse {
            header: self.header_at(revision),
            prev_kv,
        }))
    }

    async fn delete_range(
        &self,
        req: Request<DeleteRangeRequest>,
    ) -> Result<Response<DeleteRangeResponse>, Status> {
        let op = delete_op(req.get_ref().clone())?;
        let (revision, result) = self.write_one(&req, op).await?;
        let (deleted, prev_kvs) = match result {
            Some(OpResult::DeleteRange { deleted, prev }) => (
                deleted as i64,
                prev.iter().map(|(k, v)| key_value(k, v)).collect(),
            ),
            _ => (0, Vec::new()),
        };
        Ok(Response::new(DeleteRangeResponse {
            header: self.header_at(revision),
            deleted,
            prev_kvs,
        }))
    }

    async fn txn(&self, req: Request<TxnRequest>) -> Result<Response<TxnResponse>, Status> {
        if let Some((read, serializable)) = read_only(req.get_ref())? {
            return Ok(Response::new(
                self.read_txn(&req, read, serializable).await?,
            ));
        }
        let t = txn(req.get_ref().clone())?;
        let past = t.read_revisions();
        if past.is_empty() {
            let (revision, out) = self.write(&req, t).await?;
            return Ok(Response::new(self.txn_response(revision, out)));
        }
        // A range at a revision this member no longer holds: refused before anything is
        // proposed. (The compaction mark is checked again where the txn applies.)
        let floor = self.state.consensus.view().history_floor();
        if past.iter().any(|at| *at < floor) {
            return Err(EtcdError::compacted(crate::domain::history::Compacted {
                compacted: floor,
            })
            .into());
        }
        let (revision, mut out) = self.write(&req, t.clone()).await?;
        self.read_deferred(&t, revision, &mut out).await?;
        Ok(Response::new(self.txn_response(revision, out)))
    }

    async fn compact(
        &self,
        req: Request<CompactionRequest>,
    ) -> Result<Response<CompactionResponse>, Status> {
        let caller = self.caller(&req)?;
        let r = req.into_inner();
        let cmd = Command::Compact {
            revision: Revision(u64::try_from(r.revision).unwrap_or(0)),
        };
        // `physical` (wait until the space is reclaimed) needs no wait here: what compaction
        // drops is unreadable from the moment it applies.
        match self.submit(&caller, cmd).await? {
            Applied::Compacted { .. } => Ok(Response::new(CompactionResponse {
                header: self.header(),
            })),
            other => Err(EtcdError::from(unexpected(other)).into()),
        }
    }
}

/// A history read's failure, in etcd's words.
/// A transaction's read at a revision from this node's state or history: a range's answer
/// within what is left of the budget ([`StateView::range_within`]).
fn read_for(view: &StateView, what: ReadFor<'_>, at: Revision) -> Result<KeysAt, EtcdError> {
    let read = match what {
        ReadFor::Compare(range) => view.range_at(range, Some(at)),
        ReadFor::Answer(spec, budget) => view.range_within(spec, Some(at), budget),
    };
    read.map(|(_, kvs)| kvs).map_err(history_error)
}

pub(super) fn history_error(e: HistoryError) -> EtcdError {
    match e {
        HistoryError::Compacted { floor, .. } => {
            EtcdError::compacted(crate::domain::history::Compacted { compacted: floor })
        }
        HistoryError::Future { .. } => EtcdError::future_revision(),
        HistoryError::Storage(e) => EtcdError::Status(Status::internal(e.to_string())),
        HistoryError::TooLarge(e) => e.into(),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::mpsc;
    use std::time::Duration;

    use super::*;
    use crate::domain::kv::Versioned;

    fn value_of(len: usize) -> Versioned {
        Versioned {
            value: "x".repeat(len),
            create_revision: Revision(1),
            mod_revision: Revision(1),
            version: 1,
            lease: None,
        }
    }

    /// A build that needs `need` bytes: refused within a smaller budget; within a large
    /// enough one it says it started and blocks until `release` says so (the long build).
    fn build_needing(
        need: usize,
        started: mpsc::Sender<()>,
        release: Arc<std::sync::Mutex<mpsc::Receiver<()>>>,
    ) -> impl Fn(ResultBudget) -> Result<usize, EtcdError> {
        move |mut budget| {
            let value = value_of(need);
            budget.charge("k", Some(&value)).map_err(EtcdError::from)?;
            started.send(()).unwrap();
            let release = release.lock().unwrap();
            release.recv_timeout(Duration::from_secs(20)).unwrap();
            Ok(need)
        }
    }

    #[test]
    fn a_small_read_is_built_once_and_a_larger_one_than_the_limit_is_refused() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let turns = tokio::sync::Semaphore::new(LARGE_READS_AT_ONCE);
        let calls = AtomicUsize::new(0);
        let small = rt.block_on(read_within(64 << 20, &turns, Duration::from_secs(1), |b| {
            calls.fetch_add(1, Ordering::SeqCst);
            let mut b = b;
            b.charge("k", None).map_err(EtcdError::from)?;
            Ok(1)
        }));
        assert_eq!(small.unwrap(), 1);
        assert_eq!(
            calls.load(Ordering::SeqCst),
            1,
            "built within the first budget, once"
        );
        let huge = rt.block_on(read_within(8 << 20, &turns, Duration::from_secs(1), |b| {
            let mut b = b;
            let value = value_of(9 << 20);
            b.charge("k", Some(&value)).map_err(EtcdError::from)?;
            Ok(())
        }));
        assert!(
            too_large(&huge.unwrap_err()),
            "past the read limit: refused for its size"
        );
    }

    /// On a runtime of one worker (a node's, where nodes share the cores): large reads are
    /// built off the worker, so the node's other tasks (its Raft core, its heartbeats) run
    /// meanwhile; and no more than [`LARGE_READS_AT_ONCE`] are built at a time.
    #[test]
    fn large_reads_are_built_off_the_worker_a_few_at_a_time() {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let turns = Arc::new(tokio::sync::Semaphore::new(LARGE_READS_AT_ONCE));
        let (started_tx, started) = mpsc::channel::<()>();
        let (release_tx, release_rx) = mpsc::channel::<()>();
        let release = Arc::new(std::sync::Mutex::new(release_rx));
        let reads = 4;
        let handles: Vec<_> = (0..reads)
            .map(|_| {
                let build =
                    build_needing(MAX_RESULT_BYTES * 2, started_tx.clone(), release.clone());
                let turns = turns.clone();
                rt.spawn(async move {
                    read_within(64 << 20, &turns, Duration::from_secs(20), build).await
                })
            })
            .collect();
        let wait = Duration::from_secs(10);
        started.recv_timeout(wait).expect("a large read started");
        // A large read is being built (blocked in its build): another task of the runtime
        // still runs.
        let (ran_tx, ran_rx) = mpsc::channel();
        rt.spawn(async move { ran_tx.send(()).unwrap() });
        assert!(
            ran_rx.recv_timeout(wait).is_ok(),
            "a large read's build held the runtime's only worker"
        );
        // As many builds as there are turns, and no more until one ends.
        for _ in 1..LARGE_READS_AT_ONCE {
            started
                .recv_timeout(wait)
                .expect("a second large read started");
        }
        assert!(
            started.recv_timeout(Duration::from_millis(200)).is_err(),
            "more large reads built at once than there are turns"
        );
        for n in LARGE_READS_AT_ONCE..reads {
            release_tx.send(()).unwrap();
            started
                .recv_timeout(wait)
                .unwrap_or_else(|_| panic!("large read {n} got a turn"));
        }
        for _ in 0..LARGE_READS_AT_ONCE {
            release_tx.send(()).unwrap();
        }
        for h in handles {
            assert_eq!(rt.block_on(h).unwrap().unwrap(), MAX_RESULT_BYTES * 2);
        }
    }
}
