//! `leasecore bench WORKLOAD`: drive a running cluster with load (or run one of the
//! experiments) and report throughput and latency. The workloads live in `leasecore::bench`.

use std::time::Duration;

use clap::Args;
use leasecore::bench::{self, BenchOptions, Workload};
use leasecore::client::ClientError;
use leasecore::domain::flease::Protocol;
use serde::Serialize;

use super::ConnArgs;

#[derive(Args)]
pub struct BenchArgs {
    /// put, get (linearizable), get-local, lease-grant, lease-refresh, flease-acquire,
    /// flease-contended, paxoslease-acquire, paxoslease-contended; or an experiment: watch
    /// (wake-up latency at --watchers), expiry (lateness of --leases never refreshed),
    /// expiry-churn (the same, registered over --duration seconds while scripts/lease-churn.sh
    /// kills leaders), mass-expiry (--leases all due at the same instant, start + --ttl-ms:
    /// write stall, leader changes, apply lag),
    /// handover (one contended resource owned through the Raft lock, Flease and the light-weight
    /// lease over a key, a third of --duration each: acquisitions per second and handover
    /// latency), lease-memory (resident bytes per lease with one key, at --leases), flease-memory and
    /// paxoslease-memory (resident bytes per idle resource, at --resources; serve with a lease
    /// time longer than the run so that no cell is collected meanwhile), mvcc-footprint
    /// (resident and disk bytes per stored version: --versions of each of --keys keys, 128
    /// puts to a transaction; serve with auto-compaction off), apply (no cluster: the state
    /// machine's apply in this process, --keys puts of new keys in groups of --connections
    /// entries, as `--etcd put` makes them; for `valgrind --tool=callgrind`).
    /// With --etcd: put, range (linearizable), range-serializable, txn (compare-and-set of a
    /// key per connection), lease-grant, lease-keepalive (a stream per connection over a
    /// pre-granted lease).
    pub workload: String,
    /// Drive etcd's v3 gRPC API at these endpoints instead of leasecore's HTTP API
    /// (comma-separated `host:port` or `http://host:port`: leasecore's `--etcd-listen` or etcd
    /// itself), with the same gRPC client for both; --endpoints is not used. Every connection
    /// is an HTTP/2 channel of its own with one request in flight, spread over the endpoints;
    /// leases are granted with a 60 s TTL.
    #[arg(long, value_delimiter = ',', value_name = "ENDPOINTS")]
    pub etcd: Option<Vec<String>>,
    /// With --etcd: also report the CPU time these processes (the servers) spent during the
    /// measured interval per successful request, and this client's own (read from /proc,
    /// Linux only).
    #[arg(long, value_delimiter = ',', value_name = "PIDS", requires = "etcd")]
    pub cpu_pids: Vec<u32>,
    /// Contenders for one resource in `handover`.
    #[arg(long, default_value_t = 4)]
    pub contenders: usize,
    /// Watchers for `watch`.
    #[arg(long, default_value_t = 1000)]
    pub watchers: usize,
    /// `watch` over one SSE stream per watcher instead of long polls.
    #[arg(long)]
    pub sse: bool,
    /// `watch` with the watchers spread over this many multi-watch streams
    /// (`POST /v1/watches`), as etcd clients multiplex watches on a few gRPC streams.
    #[arg(long, default_value_t = 0)]
    pub streams: usize,
    /// Puts observed by the watchers in `watch`.
    #[arg(long, default_value_t = 20)]
    pub events: usize,
    /// Leases for `expiry` and `lease-memory`.
    #[arg(long, default_value_t = 10_000)]
    pub leases: usize,
    /// Resources for `flease-memory` and `paxoslease-memory`.
    #[arg(long, default_value_t = 1_000_000)]
    pub resources: usize,
    /// TTL of the leases in `expiry`, `expiry-churn` and `mass-expiry`, in milliseconds.
    #[arg(long, default_value_t = 5000)]
    pub ttl_ms: u64,
    /// Concurrent connections (each sends one request at a time) [default: 16; 64 with --etcd].
    #[arg(long, short = 'c')]
    pub connections: Option<usize>,
    /// How long to run, in seconds (fractions allowed; at least 0.1).
    #[arg(long, short = 'd', default_value_t = 10.0)]
    pub duration: f64,
    /// Distinct keys written and read.
    #[arg(long, default_value_t = 10_000)]
    pub keys: usize,
    /// Value size in bytes.
    #[arg(long, default_value_t = 64)]
    pub value_size: usize,
    /// Versions of each key in `mvcc-footprint`.
    #[arg(long, default_value_t = 10)]
    pub versions: usize,
}

fn print_result<T: Serialize + std::fmt::Debug>(r: &T, json: bool) {
    if json {
        println!(
            "{}",
            serde_json::to_string(r).expect("plain data serializes")
        );
    } else {
        println!("{r:?}");
    }
}

pub async fn run(args: BenchArgs, conn: &ConnArgs) -> Result<(), ClientError> {
    use leasecore::bench::experiments;
    if let Some(endpoints) = &args.etcd {
        return run_etcd(&args, endpoints.clone(), conn.json).await;
    }
    let connections = args.connections.unwrap_or(16).max(1);
    conn.tls.install()?;
    match args.workload.as_str() {
        "watch" => {
            let r = experiments::watch_latency(
                &conn.endpoints,
                args.watchers,
                args.events,
                Duration::from_millis(200),
                args.sse,
                args.streams,
            )
            .await?;
            print_result(&r, conn.json);
            return Ok(());
        }
        "expiry" => {
            let r = experiments::expiry_lateness(
                &conn.endpoints,
                args.leases,
                args.ttl_ms,
                connections,
            )
            .await?;
            print_result(&r, conn.json);
            return Ok(());
        }
        "expiry-churn" => {
            let r = leasecore::bench::churn::expiry_under_churn(
                &conn.endpoints,
                args.leases,
                args.ttl_ms,
                Duration::from_secs_f64(args.duration.max(0.1)),
            )
            .await?;
            print_result(&r, conn.json);
            return Ok(());
        }
        "mass-expiry" => {
            let r = leasecore::bench::churn::mass_expiry(
                &conn.endpoints,
                args.leases,
                args.ttl_ms,
                connections,
            )
            .await?;
            print_result(&r, conn.json);
            return Ok(());
        }
        "handover" => {
            let per = Duration::from_secs_f64((args.duration / 3.0).max(0.5));
            let r = leasecore::bench::handover::run(&conn.endpoints, args.contenders, per).await?;
            print_result(&r, conn.json);
            return Ok(());
        }
        "lease-memory" => {
            let r = experiments::lease_memory(&conn.endpoints, args.leases).await?;
            print_result(&r, conn.json);
            return Ok(());
        }
        "mvcc-footprint" => {
            let r = experiments::mvcc_footprint(
                &conn.endpoints,
                args.keys.max(1),
                args.versions.max(1),
                args.value_size,
                connections,
            )
            .await?;
            print_result(&r, conn.json);
            return Ok(());
        }
        "apply" => {
            let r = bench::apply::apply(args.keys.max(1), connections, 64, args.value_size).await?;
            print_result(&r, conn.json);
            return Ok(());
        }
        "flease-memory" | "paxoslease-memory" => {
            let proto = if args.workload.starts_with("flease") {
                Protocol::Flease
            } else {
                Protocol::PaxosLease
            };
            let r = experiments::flease_memory(&conn.endpoints, proto, args.resources).await?;
            print_result(&r, conn.json);
            return Ok(());
        }
        _ => {}
    }
    let workload: Workload = args.workload.parse().map_err(ClientError::Usage)?;
    let token = conn.bearer().await?.map(leasecore::domain::auth::Secret);
    let opts = BenchOptions {
        token,
        workload,
        endpoints: conn.endpoints.clone(),
        connections,
        duration: Duration::from_secs_f64(args.duration.max(0.1)),
        keys: args.keys.max(1),
        value_size: args.value_size,
    };
    let result = bench::run(&opts).await?;
    print_throughput(&result, result.ok, conn.json, "is the cluster running?")
}

/// `leasecore bench --etcd ENDPOINTS WORKLOAD`: the same gRPC client against any etcd API.
async fn run_etcd(args: &BenchArgs, endpoints: Vec<String>, json: bool) -> Result<(), ClientError> {
    use leasecore::bench::etcd::{self, EtcdBenchOptions, EtcdWorkload};
    let workload: EtcdWorkload = args.workload.parse().map_err(ClientError::Usage)?;
    let opts = EtcdBenchOptions {
        workload,
        endpoints,
        connections: args.connections.unwrap_or(64).max(1),
        duration: Duration::from_secs_f64(args.duration.max(0.1)),
        keys: args.keys.max(1),
        value_size: args.value_size,
        cpu_pids: args.cpu_pids.clone(),
    };
    let result = etcd::run(&opts).await?;
    print_throughput(&result, result.ok, json, "is an etcd API listening there?")
}

/// Print a throughput result (JSON or text); a run with no success is an error (`hint` says
/// what to check).
fn print_throughput<R: Serialize + std::fmt::Display>(
    result: &R,
    ok: u64,
    json: bool,
    hint: &str,
) -> Result<(), ClientError> {
    if json {
        println!(
            "{}",
            serde_json::to_string(result).expect("plain data serializes")
        );
    } else {
        println!("{result}");
    }
    if ok == 0 {
        return Err(ClientError::Unavailable(format!(
            "no request succeeded; {hint}"
        )));
    }
    Ok(())
}
