//! The process family under its standard, unprefixed names (`process_*`, as every Prometheus
//! client library exports them), in a registry of its own appended to the exposition.

use std::time::SystemTime;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::gauge;

/// The process metrics, refreshed at each scrape (Linux; elsewhere they stay 0).
pub struct Process {
    /// `process_*` only, unprefixed.
    pub(super) registry: Registry,
    /// Resident memory, bytes.
    pub resident_memory: Gauge,
    /// Open file descriptors.
    pub open_fds: Gauge,
    /// Process start, unix seconds.
    pub start_time: Gauge,
    /// User + system CPU time, seconds: `process_cpu_seconds_total`.
    pub cpu: Counter<f64, std::sync::atomic::AtomicU64>,
}

impl Process {
    /// Register the family in a registry of its own, with the start time set.
    pub(super) fn register() -> Self {
        let mut r = Registry::default();
        let resident_memory = gauge(&mut r, "process_resident_memory_bytes", "Resident memory size in bytes");
        let open_fds = gauge(&mut r, "process_open_fds", "Number of open file descriptors");
        let start_time = gauge(
            &mut r,
            "process_start_time_seconds",
            "Start time of the process since unix epoch in seconds",
        );
        let cpu = Counter::<f64, std::sync::atomic::AtomicU64>::default();
        r.register(
            "process_cpu_seconds",
            "Total user and system CPU time spent in seconds",
            cpu.clone(),
        );
        let started = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        start_time.set(i64::try_from(started).unwrap_or(0));
        Process {
            registry: r,
            resident_memory,
            open_fds,
            start_time,
            cpu,
        }
    }

    /// Refresh the gauges from `/proc/self` (Linux; elsewhere they stay 0).
    pub fn refresh(&self) {
        if let Ok(statm) = std::fs::read_to_string("/proc/self/statm") {
            if let Some(pages) = statm.split_whitespace().nth(1).and_then(|p| p.parse::<i64>().ok()) {
                self.resident_memory.set(pages.saturating_mul(4096));
            }
        }
        // /proc/self/stat: utime and stime are fields 14 and 15, in clock ticks (100 a second on
        // Linux); the command name (field 2) may contain spaces, so count after its ')'.
        if let Ok(stat) = std::fs::read_to_string("/proc/self/stat") {
            let after = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
            let f: Vec<&str> = after.split_whitespace().collect();
            if let (Some(u), Some(s)) = (
                f.get(11).and_then(|v| v.parse::<i64>().ok()),
                f.get(12).and_then(|v| v.parse::<i64>().ok()),
            ) {
                // Clock ticks are 1/100 s on Linux; the counter only moves forward.
                let secs = u.saturating_add(s) as f64 / 100.0;
                let delta = secs - self.cpu.get();
                if delta > 0.0 {
                    self.cpu.inc_by(delta);
                }
            }
        }
        if let Ok(dir) = std::fs::read_dir("/proc/self/fd") {
            self.open_fds.set(i64::try_from(dir.count()).unwrap_or(i64::MAX));
        }
    }
}
