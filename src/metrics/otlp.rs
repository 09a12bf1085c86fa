//! The OTLP exporter's family: request spans exported, dropped, or lost in a failed export.

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

use super::ResultLabels;

/// The OTLP exporter's counters (`tollgate_otlp_spans_total{result}`).
#[derive(Debug, Clone, Default)]
pub struct OtlpCounters {
    /// Spans the collector accepted.
    pub exported: Counter,
    /// Spans dropped because the export queue was full.
    pub dropped: Counter,
    /// Spans of exports that failed.
    pub failed: Counter,
}

impl OtlpCounters {
    /// Register the family in `r`.
    pub(super) fn register(r: &mut Registry) -> Self {
        let spans = Family::<ResultLabels, Counter>::default();
        r.register(
            "otlp_spans",
            "Request spans for OTLP export by result: exported, dropped (the export queue was full), failed (the collector refused or was unreachable)",
            spans.clone(),
        );
        let result = |n: &str| spans.get_or_create(&ResultLabels { result: n.into() }).clone();
        OtlpCounters {
            exported: result("exported"),
            dropped: result("dropped"),
            failed: result("failed"),
        }
    }
}
