//! `POST /v1/txn`: a transaction in `/v1`'s JSON (keys and values as text, revisions as
//! numbers), translated to the domain's [`Txn`] and proposed as one [`Command::Txn`]: the
//! same command, checks and permissions as etcd's `Txn`.
//!
//! ```json
//! {"compare": [{"key": "cfg", "target": "mod_revision", "op": "=", "value": 0}],
//!  "success": [{"put": {"key": "cfg", "value": "v1"}}],
//!  "failure": [{"get": {"key": "cfg"}}]}
//! ```
//!
//! # What it must not do
//! Decide: the translation is total and mechanical; validation is `Limits::check_command`
//! and `Limits::check_text_writes` (through `admit_text`), authorization `guard`, semantics
//! the domain's.

use axum::Json;
use axum::extract::State;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::AppState;
use super::error::ApiError;
use super::extract::ApiJson;
use super::kv::{admit_text, propose, unexpected};
use crate::domain::auth::KeyRange;
use crate::domain::command::{Command, Response};
use crate::domain::range::RangeSpec;
use crate::domain::txn::{Compare, CompareOp, CompareTarget, OpResult, Txn, TxnOp, TxnResult};
use crate::domain::types::Revision;
use crate::runtime::auth::Caller;
use leasecore_client::api::KeyValue;

/// The body of `POST /v1/txn`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TxnRequest {
    #[serde(default)]
    compare: Vec<CompareJson>,
    #[serde(default)]
    success: Vec<OpJson>,
    #[serde(default)]
    failure: Vec<OpJson>,
}

/// A key, a range `[key, range_end)` (`range_end` `"\u0000"`: every key from `key` on), or
/// every key under the prefix `key`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Keys {
    key: String,
    #[serde(default)]
    range_end: Option<String>,
    #[serde(default)]
    prefix: bool,
}

impl Keys {
    fn range(&self) -> Result<KeyRange, ApiError> {
        match (&self.range_end, self.prefix) {
            (Some(_), true) => Err(ApiError::invalid("give range_end or prefix, not both")),
            (None, true) => Ok(KeyRange::prefix(&self.key)),
            (Some(end), false) => Ok(KeyRange::from_etcd(self.key.as_bytes(), end.as_bytes())),
            (None, false) => Ok(KeyRange::key(&self.key)),
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CompareJson {
    key: String,
    #[serde(default)]
    range_end: Option<String>,
    #[serde(default)]
    prefix: bool,
    target: TargetName,
    #[serde(default)]
    op: OpName,
    /// Text for `value`; a number for `version`, `create_revision`, `mod_revision`; a lease
    /// name or `null` for `lease`.
    #[serde(default)]
    value: Value,
}

#[derive(Clone, Copy, Deserialize)]
#[serde(rename_all = "snake_case")]
enum TargetName {
    Value,
    Version,
    CreateRevision,
    ModRevision,
    Lease,
}

#[derive(Clone, Copy, Default, Deserialize)]
enum OpName {
    #[default]
    #[serde(rename = "=")]
    Equal,
    #[serde(rename = "!=")]
    NotEqual,
    #[serde(rename = ">")]
    Greater,
    #[serde(rename = "<")]
    Less,
}

#[derive(Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
enum OpJson {
    Put(PutJson),
    Delete(DeleteJson),
    Get(GetJson),
    Txn(TxnRequest),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PutJson {
    key: String,
    #[serde(default)]
    value: String,
    #[serde(default)]
    lease: Option<String>,
    #[serde(default)]
    ignore_value: bool,
    #[serde(default)]
    ignore_lease: bool,
    #[serde(default)]
    prev_kv: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DeleteJson {
    key: String,
    #[serde(default)]
    range_end: Option<String>,
    #[serde(default)]
    prefix: bool,
    #[serde(default)]
    prev_kv: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct GetJson {
    key: String,
    #[serde(default)]
    range_end: Option<String>,
    #[serde(default)]
    prefix: bool,
    /// At most this many keys (0: all).
    #[serde(default)]
    limit: u64,
    #[serde(default)]
    keys_only: bool,
    #[serde(default)]
    count_only: bool,
}

fn number(v: &Value, what: &str) -> Result<u64, ApiError> {
    v.as_u64()
        .ok_or_else(|| ApiError::invalid(format!("a {what} compare needs a number as value")))
}

fn compare(c: CompareJson) -> Result<Compare, ApiError> {
    let range = Keys {
        key: c.key,
        range_end: c.range_end,
        prefix: c.prefix,
    }
    .range()?;
    let target = match c.target {
        TargetName::Value => CompareTarget::Value(
            c.value
                .as_str()
                .ok_or_else(|| ApiError::invalid("a value compare needs text as value"))?
                .as_bytes()
                .to_vec(),
        ),
        TargetName::Version => CompareTarget::Version(number(&c.value, "version")?),
        TargetName::CreateRevision => {
            CompareTarget::CreateRevision(Revision(number(&c.value, "create_revision")?))
        }
        TargetName::ModRevision => {
            CompareTarget::ModRevision(Revision(number(&c.value, "mod_revision")?))
        }
        TargetName::Lease => CompareTarget::Lease(match &c.value {
            Value::Null => None,
            Value::String(s) => Some(s.clone()),
            _ => {
                return Err(ApiError::invalid(
                    "a lease compare needs a lease name or null",
                ));
            }
        }),
    };
    let op = match c.op {
        OpName::Equal => CompareOp::Equal,
        OpName::NotEqual => CompareOp::NotEqual,
        OpName::Greater => CompareOp::Greater,
        OpName::Less => CompareOp::Less,
    };
    Ok(Compare { range, op, target })
}

fn op(o: OpJson) -> Result<TxnOp, ApiError> {
    Ok(match o {
        OpJson::Put(p) => TxnOp::Put {
            key: p.key,
            value: p.value,
            lease: p.lease,
            ignore_value: p.ignore_value,
            ignore_lease: p.ignore_lease,
            prev_kv: p.prev_kv,
        },
        OpJson::Delete(d) => TxnOp::DeleteRange {
            range: Keys {
                key: d.key,
                range_end: d.range_end,
                prefix: d.prefix,
            }
            .range()?,
            prev_kv: d.prev_kv,
        },
        OpJson::Get(g) => {
            let mut spec = RangeSpec::all(
                Keys {
                    key: g.key,
                    range_end: g.range_end,
                    prefix: g.prefix,
                }
                .range()?,
            );
            spec.limit = g.limit;
            spec.keys_only = g.keys_only;
            spec.count_only = g.count_only;
            TxnOp::Range { spec, at: None }
        }
        OpJson::Txn(t) => TxnOp::Txn { txn: txn(t)? },
    })
}

fn txn(t: TxnRequest) -> Result<Txn, ApiError> {
    Ok(Txn {
        compares: t
            .compare
            .into_iter()
            .map(compare)
            .collect::<Result<_, _>>()?,
        success: t.success.into_iter().map(op).collect::<Result<_, _>>()?,
        failure: t.failure.into_iter().map(op).collect::<Result<_, _>>()?,
    })
}

/// The answer to `POST /v1/txn`.
#[derive(Serialize)]
pub struct TxnResponse {
    /// Whether every compare held (then `success` ran, else `failure`).
    succeeded: bool,
    /// The store revision after the transaction (its own, if it changed anything).
    revision: Revision,
    results: Vec<OpResultJson>,
}

#[derive(Serialize)]
#[serde(rename_all = "snake_case")]
enum OpResultJson {
    Put {
        #[serde(skip_serializing_if = "Option::is_none")]
        prev: Option<KeyValue>,
    },
    Delete {
        deleted: u64,
        #[serde(skip_serializing_if = "Vec::is_empty")]
        prev: Vec<KeyValue>,
    },
    Get {
        items: Vec<KeyValue>,
        more: bool,
        count: u64,
    },
    Txn {
        succeeded: bool,
        results: Vec<OpResultJson>,
    },
}

fn kvs(list: Vec<(String, crate::domain::kv::Versioned)>) -> Vec<KeyValue> {
    list.into_iter().map(|(k, v)| KeyValue::new(k, v)).collect()
}

fn results(r: TxnResult) -> Vec<OpResultJson> {
    r.results
        .into_iter()
        .map(|r| match r {
            OpResult::Put { prev } => OpResultJson::Put {
                prev: prev.map(|(k, v)| KeyValue::new(k, v)),
            },
            OpResult::DeleteRange { deleted, prev } => OpResultJson::Delete {
                deleted,
                prev: kvs(prev),
            },
            OpResult::Range { result, .. } => OpResultJson::Get {
                items: kvs(result.kvs),
                more: result.more,
                count: result.count,
            },
            OpResult::Txn { result } => OpResultJson::Txn {
                succeeded: result.succeeded,
                results: results(result),
            },
        })
        .collect()
}

/// `POST /v1/txn`.
pub async fn txn_handler(
    State(state): State<AppState>,
    caller: Caller,
    ApiJson(body): ApiJson<TxnRequest>,
) -> Result<Json<TxnResponse>, ApiError> {
    let cmd = Command::Txn { txn: txn(body)? };
    admit_text(&state, &cmd)?;
    let cmd = super::auth::guard(&state, &caller, cmd)?;
    match propose(&state, cmd).await? {
        Response::Txn { revision, outcome } => Ok(Json(TxnResponse {
            succeeded: outcome.succeeded,
            revision,
            results: results(outcome),
        })),
        other => Err(unexpected(other)),
    }
}
