//! The upstream's family: answers by status class, overall and per target, retries, ejections
//! and latency.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use super::counter;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StatusLabels {
    status: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TargetLabels {
    target: String,
    status: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EjectLabels {
    target: String,
}

/// The upstream's metrics; every handle is registered once, in [`Upstream::register`].
pub struct Upstream {
    /// `tollgate_upstream_responses_total{status}` handles 1xx..5xx, then
    /// `tollgate_upstream_failures_total` (no response: refused, reset, timed out).
    pub status: [Counter; 6],
    /// `tollgate_upstream_target_responses_total{target,status}`, resolved per target by
    /// [`Upstream::target_counters`].
    targets: Family<TargetLabels, Counter>,
    /// `tollgate_upstream_target_ejections_total{target}`.
    target_ejections: Family<EjectLabels, Counter>,
    /// Upstream time to response headers.
    pub latency: Histogram,
    /// Upstream requests sent a second time after their first attempt failed.
    pub retries: Counter,
    /// Upstream targets taken out (passive ejection or a failed health check).
    pub ejections: Counter,
}

/// One upstream target's counters (see [`Upstream::target_counters`]).
#[derive(Debug, Clone, Default)]
pub struct TargetCounters {
    /// Answers by status class 1xx..5xx, then requests that got no answer.
    pub status: [Counter; 6],
    /// Times the target was taken out.
    pub ejections: Counter,
}

impl Upstream {
    /// Register the family in `r`.
    pub(super) fn register(r: &mut Registry) -> Self {
        let upstream = Family::<StatusLabels, Counter>::default();
        r.register(
            "upstream_responses",
            "Upstream responses by status class",
            upstream.clone(),
        );
        let st = |s: &str| upstream.get_or_create(&StatusLabels { status: s.into() }).clone();
        let failures = counter(
            r,
            "upstream_failures",
            "Upstream requests that got no response (refused, reset, timed out)",
        );
        let status = [st("1xx"), st("2xx"), st("3xx"), st("4xx"), st("5xx"), failures];
        let targets = Family::<TargetLabels, Counter>::default();
        r.register(
            "upstream_target_responses",
            "Upstream answers by target and status class (failed: no response: refused, reset, timed out)",
            targets.clone(),
        );
        let target_ejections = Family::<EjectLabels, Counter>::default();
        r.register(
            "upstream_target_ejections",
            "Times each upstream target was taken out (passive ejection or a failed health check)",
            target_ejections.clone(),
        );
        let latency = Histogram::new(exponential_buckets(0.0001, 2.0, 18));
        r.register(
            "upstream_duration_seconds",
            "Upstream time to response headers",
            latency.clone(),
        );
        let retries = counter(
            r,
            "upstream_retries",
            "Upstream requests retried after a failed attempt",
        );
        let ejections = counter(r, "upstream_ejections", "Upstream targets taken out after failures");
        Upstream {
            status,
            targets,
            target_ejections,
            latency,
            retries,
            ejections,
        }
    }

    /// One target's counters, resolved once when the upstream is built: its answers by status
    /// class (1xx..5xx, then `failed`), and its ejections. `target` is its URL (no credentials:
    /// an upstream URL has none).
    pub fn target_counters(&self, target: &str) -> TargetCounters {
        let c = |status: &'static str| {
            self.targets
                .get_or_create(&TargetLabels {
                    target: target.to_string(),
                    status,
                })
                .clone()
        };
        TargetCounters {
            status: [c("1xx"), c("2xx"), c("3xx"), c("4xx"), c("5xx"), c("failed")],
            ejections: self
                .target_ejections
                .get_or_create(&EjectLabels {
                    target: target.to_string(),
                })
                .clone(),
        }
    }
}
