//! The adaptive concurrency family (`crate::adaptive`): the limit, what is in flight and
//! waiting under it, the latencies it is learned from, and each class's admissions and
//! refusals. All zero while `upstream.adaptive` is off.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

use crate::adaptive::{Class, Gauges};

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ClassLabels {
    class: String,
    outcome: &'static str,
}

/// The family's handles; per-class counters are resolved once, by [`AdaptiveMetrics::gauges`].
pub struct AdaptiveMetrics {
    base: Gauges,
    requests: Family<ClassLabels, Counter>,
}

impl AdaptiveMetrics {
    /// Register the family in `r`.
    pub(super) fn register(r: &mut Registry) -> Self {
        let base = Gauges::default();
        r.register(
            "adaptive_limit",
            "The adaptive concurrency limit: requests this node lets be in flight to the upstream",
            base.limit.clone(),
        );
        r.register(
            "adaptive_in_flight",
            "Requests in flight to the upstream under the adaptive limit",
            base.in_flight.clone(),
        );
        r.register(
            "adaptive_queued",
            "Requests waiting for room under the adaptive limit",
            base.queued.clone(),
        );
        r.register(
            "adaptive_latency_seconds",
            "The last window's median latency to the upstream's response head",
            base.latency.clone(),
        );
        r.register(
            "adaptive_baseline_latency_seconds",
            "The learned no-load latency the adaptive limit aims near (times tolerance)",
            base.baseline.clone(),
        );
        let requests = Family::<ClassLabels, Counter>::default();
        r.register(
            "adaptive_requests",
            "Requests by priority class and outcome (admitted, queue_timeout, queue_full)",
            requests.clone(),
        );
        AdaptiveMetrics { base, requests }
    }

    /// The handles an adaptive limiter with `classes` keeps current.
    pub fn gauges(&self, classes: &[Class]) -> Gauges {
        let mut g = self.base.clone();
        g.per_class = classes
            .iter()
            .map(|c| {
                ["admitted", "queue_timeout", "queue_full"].map(|outcome| {
                    self.requests
                        .get_or_create(&ClassLabels {
                            class: c.name.to_string(),
                            outcome,
                        })
                        .clone()
                })
            })
            .collect();
        g
    }
}
