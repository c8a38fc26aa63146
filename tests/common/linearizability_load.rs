//! The clients of the linearizability test (`tests/linearizability.rs`): each is bound to one
//! node and runs one operation at a time on a few keys, through `/v1` (plain HTTP, so that
//! every request is exactly one attempt) or the etcd API (`etcd-client`), and records each
//! operation's call time, return time and answer, classified as the APIs document it:
//!
//! - a definite answer (a value read, a write applied, a compare that held or not) is a
//!   completed operation;
//! - "nothing was done" (`/v1` 503 `no_leader`, `no_quorum`, `shutting_down`; the etcd API's
//!   `Unavailable` with the same three errors' messages; a connection that was never made) is
//!   [`Got::Failed`], left out of the history;
//! - anything else (a timeout, a broken connection, `outcome_unknown`, 504, another etcd
//!   `Unavailable`, an answer nobody expects) is [`Got::Unknown`]: it may take effect at any
//!   time after its call, or never, and the client continues as a new logical process.
//!
//! A compare-and-set always follows a read of the same key by the same client and expects
//! what it read, in one of three forms: `/v1` `PUT ?prev_revision=` (the revision read),
//! `/v1` `POST /v1/txn` and etcd `Txn` (comparing the value, or the `mod_revision`, with a
//! `get` in the failure branch so that a failed compare also says what it saw).
//!
//! This file must not judge: it records, and turns records into the checker's operations.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use etcd_client::{Compare, CompareOp, ConnectOptions, Txn, TxnOp, TxnOpResponse};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value as Json, json};

use super::checker::{self, Input, Op, Output, State, Value};

/// One attempt's deadline: a paused node costs a client this much per operation.
const OP_TIMEOUT: Duration = Duration::from_secs(2);
/// After an error, a client waits this long before its next operation, so that a node that is
/// down is not hammered (and does not fill the history with attempts).
const BACKOFF: Duration = Duration::from_millis(30);

/// What an operation asked.
#[derive(Clone, Debug)]
pub enum Did {
    Read,
    Write(String),
    Cas { expect: Option<String>, new: String },
}

/// What it got.
#[derive(Clone, Debug)]
pub enum Got {
    Read(Option<String>),
    Written,
    Swapped,
    /// The compare failed; what the answer showed of the key, if it did (`Some(None)`: absent).
    NotSwapped(Option<Option<String>>),
    /// Nothing was done (left out of the history).
    Failed(String),
    /// No definite answer.
    Unknown(String),
}

/// One operation as a client saw it; times in nanoseconds since the test's origin.
#[derive(Clone, Debug)]
pub struct Rec {
    pub process: u64,
    pub client: usize,
    pub node: usize,
    pub via: &'static str,
    pub key: usize,
    pub call: u64,
    pub ret: u64,
    pub did: Did,
    pub got: Got,
    /// A value and the revision an answer showed it at (a write's own revision, or a read's
    /// `mod_revision`).
    pub revision: Option<(String, u64)>,
    /// A `/v1` compare-and-set refused with 409: the key's revision then (its value is looked
    /// up among the revisions answers showed).
    pub actual: Option<u64>,
}

pub fn key_name(key: usize) -> String {
    format!("lin/k{key}")
}

pub struct Setup {
    pub id: usize,
    pub node: usize,
    pub keys: usize,
    /// The node's `/v1` base URL and etcd endpoint.
    pub url: String,
    pub etcd: String,
    pub origin: Instant,
    pub seed: u64,
    pub records: Arc<Mutex<Vec<Rec>>>,
    /// Read from the serving node's own state (`consistency=local`, etcd `serializable`):
    /// not linearizable, for checking that the test can fail.
    pub local_reads: bool,
    /// Definite answers so far, over every client (the test waits on it).
    pub answered: Arc<AtomicU64>,
    /// The next logical process id, over every client.
    pub processes: Arc<AtomicU64>,
}

pub struct Client {
    s: Setup,
    http: reqwest::Client,
    etcd: etcd_client::Client,
    rng: StdRng,
    process: u64,
    written: u64,
}

/// An answer: what was got, the (value, revision) it showed, and a 409's actual revision.
type Answer = (Got, Option<(String, u64)>, Option<u64>);

impl Client {
    pub async fn new(s: Setup) -> Client {
        let http = reqwest::Client::builder()
            .timeout(OP_TIMEOUT)
            .connect_timeout(Duration::from_millis(500))
            .build()
            .unwrap();
        let opts = ConnectOptions::new()
            .with_connect_timeout(Duration::from_millis(500))
            .with_timeout(OP_TIMEOUT);
        let etcd = etcd_client::Client::connect([s.etcd.clone()], Some(opts))
            .await
            .expect("etcd-client connects");
        Client {
            rng: StdRng::seed_from_u64(s.seed),
            process: s.id as u64,
            written: 0,
            http,
            etcd,
            s,
        }
    }

    fn now(&self) -> u64 {
        self.s.origin.elapsed().as_nanos() as u64
    }

    fn fresh_value(&mut self) -> String {
        self.written += 1;
        format!("c{}-{}", self.s.id, self.written)
    }

    pub async fn run(mut self, stop: Arc<AtomicBool>) {
        while !stop.load(Ordering::Relaxed) {
            let key = self.rng.random_range(0..self.s.keys);
            let etcd = self.rng.random_bool(0.5);
            match self.rng.random_range(0..20) {
                0..7 => {
                    self.read(key, etcd).await;
                }
                7..13 => {
                    let v = self.fresh_value();
                    self.write(key, etcd, v).await;
                }
                _ => {
                    if let Some(seen) = self.read(key, etcd).await {
                        let new = self.fresh_value();
                        let form = self.rng.random_range(0..5);
                        self.cas(key, form, seen, new).await;
                    }
                }
            }
        }
    }

    /// Time `answer`, record it, and move to a new logical process after an unknown outcome.
    async fn record(
        &mut self,
        key: usize,
        via: &'static str,
        did: Did,
        answer: impl Future<Output = Answer>,
    ) -> Answer {
        let call = self.now();
        let (got, revision, actual) =
            tokio::time::timeout(OP_TIMEOUT + Duration::from_secs(1), answer)
                .await
                .unwrap_or_else(|_| (Got::Unknown("no answer in time".into()), None, None));
        let ret = self.now();
        let rec = Rec {
            process: self.process,
            client: self.s.id,
            node: self.s.node,
            via,
            key,
            call,
            ret,
            did,
            got: got.clone(),
            revision: revision.clone(),
            actual,
        };
        self.s.records.lock().unwrap().push(rec);
        match &got {
            Got::Unknown(_) => {
                self.process = self.s.processes.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(BACKOFF).await;
            }
            Got::Failed(_) => tokio::time::sleep(BACKOFF).await,
            _ => {
                self.s.answered.fetch_add(1, Ordering::Relaxed);
            }
        }
        (got, revision, actual)
    }

    /// A linearizable read; the value and its revision when it answered.
    async fn read(&mut self, key: usize, etcd: bool) -> Option<(Option<String>, u64)> {
        let (http, mut client) = (self.http.clone(), self.etcd.clone());
        let local = self.s.local_reads;
        let url = format!(
            "{}/v1/kv/{}{}",
            self.s.url,
            key_name(key),
            if local { "?consistency=local" } else { "" }
        );
        let answer = async move {
            if etcd {
                let opts = local.then(|| etcd_client::GetOptions::new().with_serializable());
                match client.get(key_name(key), opts).await {
                    Ok(r) => {
                        let kv = r
                            .kvs()
                            .first()
                            .map(|kv| (text(kv.value()), kv.mod_revision() as u64));
                        (Got::Read(kv.as_ref().map(|k| k.0.clone())), kv, None)
                    }
                    Err(e) => (etcd_error(&e), None, None),
                }
            } else {
                match v1(http.get(url)).await {
                    Ok((200, body)) => {
                        let kv = kv_of(&body);
                        (Got::Read(Some(kv.0.clone())), Some(kv), None)
                    }
                    Ok((404, body)) if code(&body) == "key_not_found" => {
                        (Got::Read(None), None, None)
                    }
                    Ok((status, body)) => (v1_error(status, &body), None, None),
                    Err(got) => (got, None, None),
                }
            }
        };
        let via = if etcd { "etcd Range" } else { "v1 GET" };
        match self.record(key, via, Did::Read, answer).await {
            (Got::Read(v), revision, _) => Some((v, revision.map_or(0, |r| r.1))),
            _ => None,
        }
    }

    async fn write(&mut self, key: usize, etcd: bool, value: String) {
        let (http, mut client) = (self.http.clone(), self.etcd.clone());
        let url = format!("{}/v1/kv/{}", self.s.url, key_name(key));
        let v = value.clone();
        let answer = async move {
            if etcd {
                match client.put(key_name(key), v.clone(), None).await {
                    Ok(r) => {
                        let rev = r.header().map_or(0, |h| h.revision()) as u64;
                        (Got::Written, Some((v, rev)), None)
                    }
                    Err(e) => (etcd_error(&e), None, None),
                }
            } else {
                match v1(http.put(url).json(&json!({ "value": v }))).await {
                    Ok((200, body)) => (
                        Got::Written,
                        Some((v, body["revision"].as_u64().unwrap())),
                        None,
                    ),
                    Ok((status, body)) => (v1_error(status, &body), None, None),
                    Err(got) => (got, None, None),
                }
            }
        };
        let via = if etcd { "etcd Put" } else { "v1 PUT" };
        self.record(key, via, Did::Write(value), answer).await;
    }

    /// Compare-and-set `new` over `seen` (a value and its revision, 0 when absent) in one of
    /// five forms: `PUT ?prev_revision=`, then `/v1/txn` and etcd `Txn` comparing either the
    /// value or the `mod_revision` (the absent key is always compared by revision 0).
    async fn cas(&mut self, key: usize, form: u8, seen: (Option<String>, u64), new: String) {
        let (http, mut client) = (self.http.clone(), self.etcd.clone());
        let base = self.s.url.clone();
        let (expect, rev) = seen;
        let did = Did::Cas {
            expect: expect.clone(),
            new: new.clone(),
        };
        let by_value = matches!(form, 1 | 3) && expect.is_some();
        let via = match (form, by_value) {
            (0, _) => "v1 PUT prev_revision",
            (1 | 2, true) => "v1 txn value",
            (1 | 2, false) => "v1 txn mod_revision",
            (_, true) => "etcd Txn value",
            (_, false) => "etcd Txn mod_revision",
        };
        let answer = async move {
            let name = key_name(key);
            if form == 0 {
                let url = format!("{base}/v1/kv/{name}?prev_revision={rev}");
                return match v1(http.put(url).json(&json!({ "value": new }))).await {
                    Ok((200, body)) => (
                        Got::Swapped,
                        Some((new, body["revision"].as_u64().unwrap())),
                        None,
                    ),
                    Ok((409, body)) if code(&body) == "revision_mismatch" => {
                        let actual = body["error"]["actual"].as_u64().expect("actual");
                        (
                            Got::NotSwapped((actual == 0).then_some(None)),
                            None,
                            Some(actual),
                        )
                    }
                    Ok((status, body)) => (v1_error(status, &body), None, None),
                    Err(got) => (got, None, None),
                };
            }
            if form <= 2 {
                let compare = match &expect {
                    Some(v) if by_value => json!({"key": name, "target": "value", "value": v}),
                    _ => json!({"key": name, "target": "mod_revision", "value": rev}),
                };
                let txn = json!({
                    "compare": [compare],
                    "success": [{"put": {"key": name, "value": new}}],
                    "failure": [{"get": {"key": name}}],
                });
                return match v1(http.post(format!("{base}/v1/txn")).json(&txn)).await {
                    Ok((200, body)) if body["succeeded"] == json!(true) => (
                        Got::Swapped,
                        Some((new, body["revision"].as_u64().unwrap())),
                        None,
                    ),
                    Ok((200, body)) => {
                        let item = body["results"][0]["get"]["items"].get(0).map(kv_of);
                        (
                            Got::NotSwapped(Some(item.as_ref().map(|k| k.0.clone()))),
                            item,
                            None,
                        )
                    }
                    Ok((status, body)) => (v1_error(status, &body), None, None),
                    Err(got) => (got, None, None),
                };
            }
            let compare = match &expect {
                Some(v) if by_value => Compare::value(name.clone(), CompareOp::Equal, v.clone()),
                _ => Compare::mod_revision(name.clone(), CompareOp::Equal, rev as i64),
            };
            let txn = Txn::new()
                .when([compare])
                .and_then([TxnOp::put(name.clone(), new.clone(), None)])
                .or_else([TxnOp::get(name, None)]);
            match client.txn(txn).await {
                Ok(r) if r.succeeded() => {
                    let rev = r.header().map_or(0, |h| h.revision()) as u64;
                    (Got::Swapped, Some((new, rev)), None)
                }
                Ok(r) => {
                    let item = match r.op_responses().first() {
                        Some(TxnOpResponse::Get(g)) => g
                            .kvs()
                            .first()
                            .map(|kv| (text(kv.value()), kv.mod_revision() as u64)),
                        other => panic!("a failed compare's get answered {other:?}"),
                    };
                    (
                        Got::NotSwapped(Some(item.as_ref().map(|k| k.0.clone()))),
                        item,
                        None,
                    )
                }
                Err(e) => (etcd_error(&e), None, None),
            }
        };
        self.record(key, via, did, answer).await;
    }
}

fn text(b: &[u8]) -> String {
    String::from_utf8(b.to_vec()).expect("values are text")
}

/// A `/v1` answer's status and body, or what a failed request means.
async fn v1(req: reqwest::RequestBuilder) -> Result<(u16, Json), Got> {
    let resp = req.send().await.map_err(|e| {
        if e.is_connect() {
            // The connection was never made: nothing was sent.
            Got::Failed("connection refused".into())
        } else if e.is_timeout() {
            Got::Unknown("timeout".into())
        } else {
            Got::Unknown(format!("request: {e}"))
        }
    })?;
    let status = resp.status().as_u16();
    let body = resp
        .json()
        .await
        .map_err(|e| Got::Unknown(format!("{status}, body: {e}")))?;
    Ok((status, body))
}

fn code(body: &Json) -> &str {
    body["error"]["code"].as_str().unwrap_or("")
}

fn kv_of(body: &Json) -> (String, u64) {
    (
        body["value"].as_str().expect("a value").to_string(),
        body["mod_revision"].as_u64().expect("a mod_revision"),
    )
}

fn v1_error(status: u16, body: &Json) -> Got {
    let code = code(body);
    match (status, code) {
        (503, "no_leader" | "no_quorum" | "shutting_down") => {
            Got::Failed(format!("{status} {code}"))
        }
        // A request of ours the API refused: a bug of the test, not an outcome.
        (400 | 404 | 405 | 413, _) => panic!("/v1 refused a request of the test: {status} {body}"),
        _ => Got::Unknown(format!("{status} {code}")),
    }
}

fn etcd_error(e: &etcd_client::Error) -> Got {
    match e {
        etcd_client::Error::GRpcStatus(s) => {
            let m = s.message();
            // The messages of `no_leader`, `no_quorum` and `shutting_down` (src/etcd/status.rs).
            let nothing_done = m == "etcdserver: no leader"
                || m == "etcdserver: the leader could not reach a quorum"
                || m == "etcdserver: the node is shutting down"
                || m.starts_with("etcdserver: no leader, and the cluster has lost its quorum");
            if s.code() == tonic::Code::Unavailable && nothing_done {
                Got::Failed(format!("etcd {}", m.trim_start_matches("etcdserver: ")))
            } else if m.contains("tcp connect error") || m.contains("Connection refused") {
                // The connection was never made: nothing was sent.
                Got::Failed("etcd connection refused".into())
            } else if s.code() == tonic::Code::InvalidArgument {
                panic!("the etcd API refused a request of the test: {s:?}")
            } else {
                Got::Unknown(format!(
                    "etcd {:?}: {}",
                    s.code(),
                    m.chars().take(60).collect::<String>()
                ))
            }
        }
        other => Got::Unknown(format!(
            "etcd: {}",
            other.to_string().chars().take(60).collect::<String>()
        )),
    }
}

/// Counts of operations by interface and outcome, for the log.
pub fn summary(recs: &[Rec]) -> String {
    let mut by: BTreeMap<String, usize> = BTreeMap::new();
    for r in recs {
        let outcome = match &r.got {
            Got::Read(_) | Got::Written | Got::Swapped => "ok".to_string(),
            Got::NotSwapped(_) => "compare failed".to_string(),
            Got::Failed(why) => format!("failed: {why}"),
            Got::Unknown(why) => format!("unknown: {why}"),
        };
        *by.entry(format!("{:<22} {outcome}", r.via)).or_default() += 1;
    }
    by.iter()
        .map(|(k, n)| format!("  {n:>6}  {k}"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// One key's history for the checker: its operations, the index of each one's record, and
/// the values' names (a checker value is an index into them).
pub fn history(recs: &[Rec], key: usize) -> (Vec<Op>, Vec<usize>, Vec<String>) {
    let mut ids: HashMap<String, Value> = HashMap::new();
    let mut names: Vec<String> = Vec::new();
    let mut id = |s: &String| -> Value {
        *ids.entry(s.clone()).or_insert_with(|| {
            names.push(s.clone());
            (names.len() - 1) as Value
        })
    };
    // Every revision this key's answers showed, with its value (unique: the test checks it).
    let at: BTreeMap<u64, &String> = recs
        .iter()
        .filter(|r| r.key == key)
        .filter_map(|r| r.revision.as_ref().map(|(v, rev)| (*rev, v)))
        .collect();
    let (mut ops, mut index) = (Vec::new(), Vec::new());
    for (i, r) in recs.iter().enumerate().filter(|(_, r)| r.key == key) {
        let input = match &r.did {
            Did::Read => Input::Read,
            Did::Write(v) => Input::Write(id(v)),
            Did::Cas { expect, new } => Input::Cas {
                expect: expect.as_ref().map(&mut id),
                new: id(new),
            },
        };
        let output = match &r.got {
            Got::Failed(_) => continue,
            Got::Unknown(_) if input == Input::Read => continue,
            Got::Unknown(_) => Output::Unknown,
            Got::Read(v) => Output::Read(v.as_ref().map(&mut id)),
            Got::Written => Output::Written,
            Got::Swapped => Output::Swapped,
            Got::NotSwapped(seen) => {
                // A 409 names the revision it found; what it found is the value at it.
                let seen = seen.clone().or_else(|| {
                    r.actual
                        .and_then(|a| at.get(&a))
                        .map(|v| Some((*v).clone()))
                });
                Output::NotSwapped(seen.as_ref().map(|s| s.as_ref().map(&mut id)))
            }
        };
        let ret = (output != Output::Unknown).then_some(r.ret);
        ops.push(Op {
            call: r.call,
            ret,
            input,
            output,
        });
        index.push(i);
    }
    (ops, index, names)
}

/// Who ran an operation, for a person.
pub fn who(r: &Rec) -> String {
    format!("c{} p{} node {} {}", r.client, r.process, r.node, r.via)
}

/// The operations left out of a key's history (answered "nothing was done") that wrote a
/// value the culprits of `v` saw or expected: if there is one, the API broke that promise.
pub fn left_out(recs: &[Rec], key: usize, v: &checker::Violation, index: &[usize]) -> String {
    let mut seen: Vec<&str> = Vec::new();
    for c in &v.culprits {
        let r = &recs[index[*c]];
        if let Got::Read(Some(x)) | Got::NotSwapped(Some(Some(x))) = &r.got {
            seen.push(x);
        }
        if let Did::Cas {
            expect: Some(x), ..
        } = &r.did
        {
            seen.push(x);
        }
    }
    let mut out = String::new();
    for r in recs
        .iter()
        .filter(|r| r.key == key && matches!(r.got, Got::Failed(_)))
    {
        let wrote = match &r.did {
            Did::Write(x) | Did::Cas { new: x, .. } => x.as_str(),
            Did::Read => continue,
        };
        if seen.contains(&wrote) {
            out.push_str(&format!(
                "  left out as not done, yet its value was seen: {} at {:.3} .. {:.3} ms, {:?} -> {:?}\n",
                who(r),
                r.call as f64 / 1e6,
                r.ret as f64 / 1e6,
                r.did,
                r.got
            ));
        }
    }
    out
}

/// A checker state's name.
pub fn state_name(names: &[String], s: State) -> String {
    s.map_or("(absent)".into(), |v| names[v as usize].clone())
}
