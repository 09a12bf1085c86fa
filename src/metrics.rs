//! Prometheus metrics (prometheus-client). No label ever holds a user, key or IP: labels are
//! rule names, decisions, result kinds and status classes only. Per-rule handles are resolved
//! when rules load ([`Traffic::rule`]), so the request path only increments atomics.

use std::sync::Arc;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

mod adaptive;
mod cost;
mod otlp;
mod process;
mod regions;
mod reload;
mod rls;
mod store;
mod traffic;
mod upstream;

pub use adaptive::AdaptiveMetrics;
pub use cost::{CostHandles, CostMetrics, Unreported};
pub use otlp::OtlpCounters;
pub use process::Process;
pub use regions::{PeerMetrics, RegionMetrics};
pub use reload::{Reload, Tls};
pub use rls::{RlsDomain, RlsDomainTotals, RlsLabels, RlsLimitLabels, RlsMetrics, MAX_DETAILED_SERIES};
pub use store::{ShardLabels, Store};
pub use traffic::{Decision, Final, RuleMetrics, Traffic};
pub use upstream::{TargetCounters, Upstream};

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabels {
    kind: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabels {
    result: String,
}

/// Decrements its gauge when dropped: counts things in progress (connections, queued requests)
/// whatever way they end.
#[derive(Debug)]
pub struct InFlight(Gauge);

impl InFlight {
    /// Increment `g` until the returned guard is dropped.
    pub fn enter(g: &Gauge) -> Self {
        g.inc();
        InFlight(g.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// Every metric of the process, by family. Each family registers its own metrics
/// (`<Family>::register`) and owns the methods that resolve or count them.
pub struct Metrics {
    /// The registry `/metrics` encodes (`tollgate_*`).
    registry: Registry,
    /// Requests, responses, connections and durations.
    pub traffic: Traffic,
    /// The store: checks, failures, breakers, the deny cache, memory room, leases.
    pub store: Store,
    /// The upstream: answers, per target, retries, ejections, latency.
    pub upstream: Upstream,
    /// Reloads of the rules and keys, and the gateway file on disk.
    pub reload: Reload,
    /// The listener certificate.
    pub tls: Tls,
    /// `process_*`, under the standard names.
    pub process: Process,
    /// `tollgate_otlp_spans_total{result}`: request spans exported, dropped on a full queue,
    /// or lost in a failed export (`crate::telemetry`).
    pub otlp: OtlpCounters,
    /// The Envoy rate-limit service.
    pub rls: RlsMetrics,
    /// Adaptive concurrency (`upstream.adaptive`).
    pub adaptive: AdaptiveMetrics,
    /// Costs the upstream reports (`cost_from`): charged, reservation error, unreported.
    pub cost: CostMetrics,
    /// Peer regions' replication lag, errors and bytes (`store.region`).
    pub regions: RegionMetrics,
}

impl Metrics {
    /// Register every family.
    pub fn new() -> Arc<Self> {
        let mut registry = Registry::with_prefix("tollgate");
        let traffic = Traffic::register(&mut registry);
        let store = Store::register(&mut registry);
        let upstream = Upstream::register(&mut registry);
        let tls = Tls::register(&mut registry);
        let reload = Reload::register(&mut registry);
        let otlp = OtlpCounters::register(&mut registry);
        let rls = RlsMetrics::register(&mut registry);
        let adaptive = AdaptiveMetrics::register(&mut registry);
        let cost = CostMetrics::register(&mut registry);
        let regions = RegionMetrics::register(&mut registry);
        Arc::new(Metrics {
            regions,
            cost,
            adaptive,
            rls,
            registry,
            traffic,
            store,
            upstream,
            reload,
            tls,
            process: Process::register(),
            otlp,
        })
    }

    /// The text exposition: tollgate's metrics, then the standard `process_*` ones, one `# EOF`.
    pub fn encode(&self) -> String {
        let mut s = String::new();
        let _ = prometheus_client::encoding::text::encode_registry(&mut s, &self.registry);
        let _ = prometheus_client::encoding::text::encode_registry(&mut s, &self.process.registry);
        let _ = prometheus_client::encoding::text::encode_eof(&mut s);
        s
    }
}

/// A counter registered in `r` as `name` with `help`.
fn counter(r: &mut Registry, name: &str, help: &str) -> Counter {
    let c = Counter::default();
    r.register(name, help, c.clone());
    c
}

/// A gauge registered in `r` as `name` with `help`.
fn gauge(r: &mut Registry, name: &str, help: &str) -> Gauge {
    let g = Gauge::default();
    r.register(name, help, g.clone());
    g
}
