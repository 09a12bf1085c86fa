//! The Envoy rate-limit service's family: calls and descriptors by domain and outcome.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

/// The Envoy rate-limit service's labels: a configured domain (or `unknown`: bounded by the
/// config files, never by request values) and what was answered.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RlsLabels {
    /// The domain, when configured; `unknown` otherwise.
    pub domain: String,
    /// `ok`, `over_limit`, `unlimited`, `no_limit` (descriptors); `ok`, `over_limit`,
    /// `invalid` (calls).
    pub outcome: &'static str,
}

/// The Envoy rate-limit service's metrics.
#[derive(Debug, Clone, Default)]
pub struct RlsMetrics {
    /// `tollgate_rls_descriptors_total{domain,outcome}`.
    pub descriptors: Family<RlsLabels, Counter>,
    /// `tollgate_rls_calls_total{domain,outcome}`.
    pub calls: Family<RlsLabels, Counter>,
    /// `tollgate_rls_config_reload_errors_total`: config directory reloads refused.
    pub reload_errors: Counter,
    /// `tollgate_rls_config_reloads_total`: config directory reloads that took effect.
    pub reloads: Counter,
}

impl RlsMetrics {
    /// Register the family in `registry`.
    pub fn register(registry: &mut Registry) -> Self {
        let m = RlsMetrics::default();
        registry.register(
            "rls_descriptors",
            "Envoy rate-limit service descriptors answered, by domain and outcome",
            m.descriptors.clone(),
        );
        registry.register(
            "rls_calls",
            "Envoy rate-limit service calls, by domain and overall answer",
            m.calls.clone(),
        );
        registry.register(
            "rls_config_reload_errors",
            "Envoy rate-limit config directory reloads refused (the previous config stays in force)",
            m.reload_errors.clone(),
        );
        registry.register(
            "rls_config_reloads",
            "Envoy rate-limit config directory reloads that took effect",
            m.reloads.clone(),
        );
        m
    }
}
