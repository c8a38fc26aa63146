//! Prometheus text metrics, hand-rolled: counters and fixed-bucket histograms.
//!
//! Request metrics are kept per (method, route template) so that cardinality is bounded by the
//! router, never by user keys. Gauges that describe Raft are read at scrape time from the
//! consensus layer instead of being copied here.
//!
//! # What it must not do
//! Hold its lock for longer than one map update, or allocate per request on the hot path
//! beyond the first request of a route.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::domain::peer_trust::Refusal;
use crate::http::listener::ConnStats;

/// Upper bounds of the latency buckets, in seconds.
const BUCKETS: [f64; 14] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// Upper bounds of the disk sync buckets, in seconds: finer below a millisecond than
/// [`BUCKETS`], since a healthy SSD syncs in 0.1-0.3 ms and the first sign of a shared or
/// failing disk is that figure doubling.
const SYNC_BUCKETS: [f64; 16] = [
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0,
];

/// A histogram of seconds.
#[derive(Clone, Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    counts: Vec<u64>,
    count: u64,
    sum_secs: f64,
}

impl Default for Histogram {
    /// Latency buckets ([`BUCKETS`]).
    fn default() -> Self {
        Histogram::with_bounds(&BUCKETS)
    }
}

impl Histogram {
    /// A histogram with these bucket upper bounds (ascending).
    pub fn with_bounds(bounds: &'static [f64]) -> Self {
        Histogram {
            bounds,
            counts: vec![0; bounds.len()],
            count: 0,
            sum_secs: 0.0,
        }
    }

    /// Write this histogram in Prometheus text (without HELP/TYPE lines).
    pub fn render(&self, out: &mut String, name: &str, labels: &str) {
        let sep = if labels.is_empty() { "" } else { "," };
        for (bound, n) in self.bounds.iter().zip(self.counts.iter()) {
            let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"{bound}\"}} {n}");
        }
        let _ = writeln!(
            out,
            "{name}_bucket{{{labels}{sep}le=\"+Inf\"}} {}",
            self.count
        );
        // No braces without labels: `name_sum 1.5`, as Prometheus' own clients write it.
        let set = match labels {
            "" => String::new(),
            l => format!("{{{l}}}"),
        };
        let _ = writeln!(out, "{name}_sum{set} {}", self.sum_secs);
        let _ = writeln!(out, "{name}_count{set} {}", self.count);
    }

    pub fn observe(&mut self, secs: f64) {
        for (i, bound) in self.bounds.iter().enumerate() {
            if secs <= *bound {
                self.counts[i] += 1;
            }
        }
        self.count += 1;
        self.sum_secs += secs;
    }
}

/// One (method, route) pair's requests: counts by status, and latency.
#[derive(Default, Clone, Debug)]
struct RouteStats {
    by_status: BTreeMap<u16, u64>,
    latency: Histogram,
}

/// route template -> method -> statistics. Nested, so that a request finds its entry by
/// borrowed strings and allocates only the first time its route and method are seen.
type RouteTable = BTreeMap<String, BTreeMap<String, RouteStats>>;

/// The node's metric registry.
#[derive(Default)]
pub struct Metrics {
    /// Requests by route and method (one lock, one lookup per request).
    requests: Mutex<RouteTable>,
    /// Commands proposed through this node.
    pub proposals: AtomicU64,
    /// Proposals that failed (no leader, timeout, ...), not counting domain rejections.
    pub proposals_failed: AtomicU64,
    /// The client listener's connections.
    pub client_conns: Arc<ConnStats>,
    /// The peer listener's connections.
    pub peer_conns: Arc<ConnStats>,
    /// The etcd API listener's connections (zero when it serves none).
    pub etcd_conns: Arc<ConnStats>,
    /// Peer messages refused, by reason (a fixed set: bounded).
    peer_refused: Mutex<BTreeMap<&'static str, u64>>,
    /// The node's reloadable TLS configs (set once at start; empty without TLS).
    pub tls: std::sync::OnceLock<Vec<Arc<dyn crate::tls::Reload>>>,
    /// What the async runtime's pulse has seen (`runtime::stall`).
    pub runtime_stalls: Arc<StallStats>,
    /// How long the Raft log's syncs take (`raft::log_store`'s sync thread).
    pub log_syncs: Arc<SyncStats>,
}

/// Durations of the Raft log's fdatasync calls: etcd's `etcd_disk_wal_fsync_duration_seconds`,
/// the first thing to read when writes are slow (a slow or shared disk shows here first).
#[derive(Debug)]
pub struct SyncStats {
    times: Mutex<Histogram>,
}

impl Default for SyncStats {
    fn default() -> Self {
        SyncStats {
            times: Mutex::new(Histogram::with_bounds(&SYNC_BUCKETS)),
        }
    }
}

impl SyncStats {
    /// Record one sync that took `took`.
    pub fn observe(&self, took: Duration) {
        let mut h = self.times.lock().unwrap_or_else(|p| p.into_inner());
        h.observe(took.as_secs_f64());
    }

    fn snapshot(&self) -> Histogram {
        self.times.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

/// How late the async runtime has run a task that asked to wake (`runtime::stall`).
#[derive(Debug, Default)]
pub struct StallStats {
    /// Wakes late enough to count as a stall (`domain::health::runtime_stalled`).
    pub stalls: AtomicU64,
    /// The most a wake has run past its time since the node started, in milliseconds.
    pub max_late_ms: AtomicU64,
    /// Wakes so far (the pulse is alive).
    pub ticks: AtomicU64,
}

impl Metrics {
    /// A registry that reports the syncs of this log store.
    pub fn with_log_syncs(log_syncs: Arc<SyncStats>) -> Self {
        Metrics {
            log_syncs,
            ..Metrics::default()
        }
    }

    /// Record one finished request.
    pub fn observe_request(&self, method: &str, route: &str, status: u16, elapsed: Duration) {
        let mut table = self.requests.lock().unwrap_or_else(|p| p.into_inner());
        let by_method = match table.get_mut(route) {
            Some(m) => m,
            None => table.entry(route.to_string()).or_default(),
        };
        let stats = match by_method.get_mut(method) {
            Some(s) => s,
            None => by_method.entry(method.to_string()).or_default(),
        };
        *stats.by_status.entry(status).or_default() += 1;
        stats.latency.observe(elapsed.as_secs_f64());
    }

    /// Count one refused peer message; the count of that reason so far.
    pub fn peer_refused(&self, reason: &'static str) -> u64 {
        let mut m = self.peer_refused.lock().unwrap_or_else(|p| p.into_inner());
        let n = m.entry(reason).or_default();
        *n += 1;
        *n
    }

    /// Render the registry (plus the given gauges) in Prometheus text format.
    pub fn render(&self, gauges: &[(&str, &str, f64)]) -> String {
        let mut out = String::new();
        for (name, help, value) in gauges {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {value}"
            );
        }
        let counters = [
            (
                "leasecore_proposals_total",
                "Commands proposed through this node.",
                self.proposals.load(Ordering::Relaxed),
            ),
            (
                "leasecore_proposals_failed_total",
                "Proposals that did not complete (no leader, timeout, shutdown).",
                self.proposals_failed.load(Ordering::Relaxed),
            ),
            (
                "leasecore_runtime_stalls_total",
                "Times the async runtime ran a ready task later than half the shortest election \
                 timeout (a blocked worker or taken cores: heartbeats waited as long).",
                self.runtime_stalls.stalls.load(Ordering::Relaxed),
            ),
        ];
        for (name, help, value) in counters {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {value}"
            );
        }
        let _ = writeln!(
            out,
            "# HELP leasecore_runtime_stall_max_ms The most the async runtime has run a task \
             that asked to wake past its time since the node started, in milliseconds.\n\
             # TYPE leasecore_runtime_stall_max_ms gauge\nleasecore_runtime_stall_max_ms {}",
            self.runtime_stalls.max_late_ms.load(Ordering::Relaxed)
        );
        let name = "leasecore_raft_log_fsync_duration_seconds";
        let _ = writeln!(
            out,
            "# HELP {name} How long the Raft log's fdatasync calls took (one per group of \
             appends; an acknowledgement waits for one).\n# TYPE {name} histogram"
        );
        self.log_syncs.snapshot().render(&mut out, name, "");
        for (port, stats) in [
            ("client", &self.client_conns),
            ("peer", &self.peer_conns),
            ("etcd", &self.etcd_conns),
        ] {
            for (suffix, help, value) in stats.snapshot() {
                let name = format!("leasecore_{port}_{suffix}");
                let kind = if suffix.ends_with("_total") {
                    "counter"
                } else {
                    "gauge"
                };
                let _ = writeln!(
                    out,
                    "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}"
                );
            }
        }

        let refused = self
            .peer_refused
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let _ = writeln!(
            out,
            "# HELP leasecore_peer_refused_total Peer messages refused, by reason.\n# TYPE leasecore_peer_refused_total counter"
        );
        // Every reason, zeros included, so that rates work from the first scrape.
        for reason in Refusal::ALL.map(Refusal::label) {
            let n = refused.get(reason).copied().unwrap_or(0);
            let _ = writeln!(
                out,
                "leasecore_peer_refused_total{{reason=\"{reason}\"}} {n}"
            );
        }
        if let Some(tls) = self.tls.get().filter(|t| !t.is_empty()) {
            for (name, help, failed) in [
                (
                    "leasecore_tls_reloads_total",
                    "TLS configurations rebuilt from their files (SIGHUP or a changed file).",
                    false,
                ),
                (
                    "leasecore_tls_reload_failures_total",
                    "TLS reloads that failed (the previous configuration stayed in force).",
                    true,
                ),
            ] {
                let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
                for r in tls {
                    let (ok, bad) = r.counts();
                    let what = r.what();
                    let v = if failed { bad } else { ok };
                    let _ = writeln!(out, "{name}{{config=\"{what}\"}} {v}");
                }
            }
        }

        let requests = self
            .requests
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let _ = writeln!(
            out,
            "# HELP leasecore_http_requests_total HTTP requests by route and status.\n# TYPE leasecore_http_requests_total counter"
        );
        // Sorted by method, then route, as the scrape has always listed them.
        let mut rows: Vec<(&str, &str, &RouteStats)> = requests
            .iter()
            .flat_map(|(route, by_method)| {
                by_method
                    .iter()
                    .map(move |(method, stats)| (method.as_str(), route.as_str(), stats))
            })
            .collect();
        rows.sort_by(|a, b| (a.0, a.1).cmp(&(b.0, b.1)));
        for (method, route, stats) in &rows {
            for (status, n) in &stats.by_status {
                let _ = writeln!(
                    out,
                    "leasecore_http_requests_total{{method=\"{method}\",route=\"{route}\",status=\"{status}\"}} {n}"
                );
            }
        }

        let name = "leasecore_http_request_duration_seconds";
        let _ = writeln!(
            out,
            "# HELP {name} HTTP request latency by route.\n# TYPE {name} histogram"
        );
        for (method, route, stats) in &rows {
            stats.latency.render(
                &mut out,
                name,
                &format!("method=\"{method}\",route=\"{route}\""),
            );
        }
        out
    }
}

/// The process metrics Prometheus' client libraries export under these names (and etcd's
/// `/metrics` with them: `etcdctl check datascale` reads `process_resident_memory_bytes`). Each
/// is read at scrape time from /proc (Linux) or `getrusage`; one that cannot be read is left
/// out of the scrape rather than shown as 0.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ProcessStats {
    pub resident_memory_bytes: Option<u64>,
    pub virtual_memory_bytes: Option<u64>,
    pub cpu_seconds: Option<f64>,
    pub open_fds: Option<u64>,
    pub max_fds: Option<u64>,
}

impl ProcessStats {
    /// This process's figures now.
    pub fn read() -> ProcessStats {
        let status = std::fs::read_to_string("/proc/self/status").ok();
        let kib = |field: &str| {
            status
                .as_deref()
                .and_then(|s| status_kib(s, field))
                .map(|kb| kb * 1024)
        };
        ProcessStats {
            resident_memory_bytes: kib("VmRSS:"),
            virtual_memory_bytes: kib("VmSize:"),
            cpu_seconds: cpu_seconds(),
            open_fds: std::fs::read_dir("/proc/self/fd")
                .ok()
                .map(|d| d.count() as u64),
            max_fds: std::fs::read_to_string("/proc/self/limits")
                .ok()
                .and_then(|s| max_open_files(&s)),
        }
    }

    /// Write the figures read, with their HELP and TYPE lines.
    pub fn render(&self, out: &mut String) {
        let rows = [
            (
                "process_resident_memory_bytes",
                "gauge",
                "Resident memory size in bytes.",
                self.resident_memory_bytes.map(|v| v as f64),
            ),
            (
                "process_virtual_memory_bytes",
                "gauge",
                "Virtual memory size in bytes.",
                self.virtual_memory_bytes.map(|v| v as f64),
            ),
            (
                "process_cpu_seconds_total",
                "counter",
                "Total user and system CPU time spent in seconds.",
                self.cpu_seconds,
            ),
            (
                "process_open_fds",
                "gauge",
                "Number of open file descriptors.",
                self.open_fds.map(|v| v as f64),
            ),
            (
                "process_max_fds",
                "gauge",
                "Maximum number of open file descriptors.",
                self.max_fds.map(|v| v as f64),
            ),
        ];
        for (name, kind, help, value) in rows {
            if let Some(value) = value {
                let _ = writeln!(
                    out,
                    "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}"
                );
            }
        }
    }
}

/// A `Name:   123 kB` field of /proc/self/status, in kB.
fn status_kib(status: &str, field: &str) -> Option<u64> {
    status
        .lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|kb| kb.parse().ok())
}

/// The soft limit of "Max open files" in /proc/self/limits (`None` when unlimited).
fn max_open_files(limits: &str) -> Option<u64> {
    limits
        .lines()
        .find_map(|l| l.strip_prefix("Max open files"))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|soft| soft.parse().ok())
}

/// User and system CPU time of the whole process (every thread), in seconds.
fn cpu_seconds() -> Option<f64> {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::uninit();
    // SAFETY: getrusage writes one `rusage` into the pointer it is given, which points at
    // memory of that size; it is read only when the call succeeded.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_SELF, usage.as_mut_ptr()) };
    if rc != 0 {
        return None;
    }
    // SAFETY: the call succeeded, so it filled the struct.
    let usage = unsafe { usage.assume_init() };
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    Some(secs(usage.ru_utime) + secs(usage.ru_stime))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn process_stats_are_read_and_rendered_under_prometheus_names() {
        let p = ProcessStats::read();
        let mut text = String::new();
        p.render(&mut text);
        if cfg!(target_os = "linux") {
            assert!(p.resident_memory_bytes.is_some_and(|b| b > 0), "{p:?}");
            assert!(p.open_fds.is_some_and(|n| n > 0), "{p:?}");
            assert!(text.contains("# TYPE process_resident_memory_bytes gauge\n"));
            assert!(text.contains("\nprocess_resident_memory_bytes "));
        }
        assert!(p.cpu_seconds.is_some(), "{p:?}");
        assert!(text.contains("# TYPE process_cpu_seconds_total counter\n"));
        // Nothing read, nothing shown.
        let mut empty = String::new();
        ProcessStats::default().render(&mut empty);
        assert_eq!(empty, "");
    }

    #[test]
    fn proc_fields_parse() {
        let status = "Name:\tleasecore\nVmSize:\t  123456 kB\nVmRSS:\t    2048 kB\n";
        assert_eq!(status_kib(status, "VmRSS:"), Some(2048));
        assert_eq!(status_kib(status, "VmSize:"), Some(123456));
        assert_eq!(status_kib(status, "VmSwap:"), None);
        let limits = "Limit                     Soft Limit           Hard Limit           Units     \n\
                      Max open files            1024                 524288               files     \n";
        assert_eq!(max_open_files(limits), Some(1024));
        assert_eq!(
            max_open_files(
                "Max open files            unlimited            unlimited            files\n"
            ),
            None
        );
    }

    #[test]
    fn peer_refusals_are_counted_by_reason_zeros_included() {
        let m = Metrics::default();
        assert_eq!(m.peer_refused("not_member"), 1);
        assert_eq!(m.peer_refused("not_member"), 2);
        let text = m.render(&[]);
        assert!(text.contains("leasecore_peer_refused_total{reason=\"not_member\"} 2"));
        assert!(text.contains("leasecore_peer_refused_total{reason=\"inconsistent\"} 0"));
    }

    #[test]
    fn histogram_buckets_are_cumulative() {
        let m = Metrics::default();
        m.observe_request("GET", "/v1/kv/{*key}", 200, Duration::from_millis(3));
        m.observe_request("GET", "/v1/kv/{*key}", 404, Duration::from_millis(700));
        let text = m.render(&[("leasecore_is_leader", "Leader or not.", 1.0)]);
        assert!(text.contains("leasecore_is_leader 1"));
        assert!(text.contains(
            "leasecore_http_requests_total{method=\"GET\",route=\"/v1/kv/{*key}\",status=\"404\"} 1"
        ));
        assert!(text.contains(
            "leasecore_http_request_duration_seconds_bucket{method=\"GET\",route=\"/v1/kv/{*key}\",le=\"0.005\"} 1"
        ));
        assert!(text.contains(
            "leasecore_http_request_duration_seconds_bucket{method=\"GET\",route=\"/v1/kv/{*key}\",le=\"1\"} 2"
        ));
        assert!(text.contains(
            "leasecore_http_request_duration_seconds_count{method=\"GET\",route=\"/v1/kv/{*key}\"} 2"
        ));
    }

    #[test]
    fn log_syncs_render_as_a_histogram_without_labels() {
        let syncs = Arc::new(SyncStats::default());
        let m = Metrics::with_log_syncs(syncs.clone());
        syncs.observe(Duration::from_micros(200));
        syncs.observe(Duration::from_millis(7));
        let text = m.render(&[]);
        let name = "leasecore_raft_log_fsync_duration_seconds";
        for line in [
            format!("# TYPE {name} histogram\n"),
            format!("{name}_bucket{{le=\"0.0001\"}} 0\n"),
            format!("{name}_bucket{{le=\"0.00025\"}} 1\n"),
            format!("{name}_bucket{{le=\"0.0005\"}} 1\n"),
            format!("{name}_bucket{{le=\"0.01\"}} 2\n"),
            format!("{name}_bucket{{le=\"+Inf\"}} 2\n"),
            format!("{name}_count 2\n"),
        ] {
            assert!(text.contains(&line), "{line} in {text}");
        }
        assert!(text.contains(&format!("{name}_sum 0.0072")), "{text}");
    }
}
