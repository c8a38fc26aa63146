//! What `bench --etcd` runs and reports: the workloads ([`EtcdWorkload`], by their
//! command-line names), the options ([`EtcdBenchOptions`]) and the result
//! ([`EtcdBenchResult`]), with the rule of a passed run.
//!
//! # Invariants
//! - A workload has one name, on the command line, in JSON and in the display;
//!   [`EtcdWorkload::ALL`] lists every workload, in the order scripts report them.
//! - A run passed only with no failed response, at least one success, and a stored check that
//!   did not fail.
//!
//! # What it must not do
//! Measure anything or talk to a server: these are plain data.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// What to measure through etcd's API.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum EtcdWorkload {
    /// `KV.Put` over a key space.
    Put,
    /// Linearizable `KV.Range` of one preloaded key.
    Range,
    /// Serializable `KV.Range` of one preloaded key.
    RangeSerializable,
    /// `KV.Txn`: compare the mod revision of the connection's own key, put it if unchanged
    /// (a compare-and-set that always succeeds, since nobody else writes that key).
    Txn,
    /// `Lease.LeaseGrant` with a server-chosen id.
    LeaseGrant,
    /// `Lease.LeaseKeepAlive`: one stream per connection, one keepalive at a time over the
    /// connection's pre-granted lease.
    LeaseKeepalive,
}

impl EtcdWorkload {
    /// Every workload, in the order scripts report them.
    pub const ALL: [EtcdWorkload; 6] = [
        EtcdWorkload::Put,
        EtcdWorkload::Range,
        EtcdWorkload::RangeSerializable,
        EtcdWorkload::Txn,
        EtcdWorkload::LeaseGrant,
        EtcdWorkload::LeaseKeepalive,
    ];

    /// The workload's name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            EtcdWorkload::Put => "put",
            EtcdWorkload::Range => "range",
            EtcdWorkload::RangeSerializable => "range-serializable",
            EtcdWorkload::Txn => "txn",
            EtcdWorkload::LeaseGrant => "lease-grant",
            EtcdWorkload::LeaseKeepalive => "lease-keepalive",
        }
    }
}

impl fmt::Display for EtcdWorkload {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for EtcdWorkload {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        EtcdWorkload::ALL
            .into_iter()
            .find(|w| w.name() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = EtcdWorkload::ALL.iter().map(|w| w.name()).collect();
                format!("unknown workload {s:?} for --etcd: {}", names.join(", "))
            })
    }
}

/// How to run.
#[derive(Clone, Debug)]
pub struct EtcdBenchOptions {
    pub workload: EtcdWorkload,
    /// etcd API endpoints: `host:port` or `http://host:port`.
    pub endpoints: Vec<String>,
    pub connections: usize,
    pub duration: Duration,
    /// Distinct keys preloaded and read (range).
    pub keys: usize,
    pub value_size: usize,
    /// Processes (the servers) whose CPU time during the measured interval is reported per
    /// successful request (read from `/proc`, Linux only).
    pub cpu_pids: Vec<u32>,
}

/// What was measured.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct EtcdBenchResult {
    pub workload: EtcdWorkload,
    /// The version the first endpoint's `Maintenance.Status` reports (which server this was).
    pub server_version: String,
    pub connections: usize,
    pub seconds: f64,
    /// Checked successes.
    pub ok: u64,
    /// Failed or unchecked responses (not counted in throughput).
    pub errors: u64,
    pub throughput: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
    /// Fewest successes of one connection divided by the most (1.0: perfectly even).
    pub fairness: f64,
    /// Writes found in the store afterwards (put: keys; txn: versions of its keys;
    /// lease-grant: acknowledged leases in the lease list).
    pub stored: Option<u64>,
    /// `ok`, `failed` (put, txn: stored outside [ok, ok + errors]; lease-grant: an acknowledged
    /// lease missing) or `n/a` (the other workloads).
    pub stored_check: String,
    /// CPU time (user + system) of `cpu_pids` during the measured interval, per checked
    /// success, in microseconds: a figure a shared machine's noise moves far less than
    /// throughput.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server_cpu_us_per_op: Option<f64>,
    /// The same for this client process.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_cpu_us_per_op: Option<f64>,
    /// The first failure seen, for diagnosis.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_error: Option<String>,
}

impl EtcdBenchResult {
    /// No failed response, at least one success, and the stored count (if any) as it must be.
    pub fn passed(&self) -> bool {
        self.errors == 0 && self.ok > 0 && self.stored_check != "failed"
    }
}

impl fmt::Display for EtcdBenchResult {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "etcd API {} c={} {:.1}s: {:.0} ops/s, p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms ({} ok, {} errors; server {}",
            self.workload,
            self.connections,
            self.seconds,
            self.throughput,
            self.p50_ms,
            self.p99_ms,
            self.max_ms,
            self.ok,
            self.errors,
            self.server_version,
        )?;
        if let Some(stored) = self.stored {
            write!(f, "; stored {stored}: {}", self.stored_check)?;
        }
        if let Some(cpu) = self.server_cpu_us_per_op {
            write!(f, "; server CPU {cpu:.0} us/op")?;
        }
        if let Some(cpu) = self.client_cpu_us_per_op {
            write!(f, "; client CPU {cpu:.0} us/op")?;
        }
        if let Some(e) = &self.first_error {
            write!(f, "; first error: {e}")?;
        }
        f.write_str(")")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn workload_names_round_trip() {
        for w in EtcdWorkload::ALL {
            assert_eq!(w.name().parse::<EtcdWorkload>(), Ok(w));
            assert_eq!(
                serde_json::to_value(w).unwrap(),
                serde_json::Value::String(w.name().into())
            );
        }
        assert!("get".parse::<EtcdWorkload>().is_err());
    }
}
