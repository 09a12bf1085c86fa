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

/// Most distinct descriptor names that show request values (`detailed_metric`,
/// `value_to_metric`) one process labels a series with; past it they are counted under their
/// entry's configured name, and in `tollgate_rls_detailed_metric_overflow_total`.
pub const MAX_DETAILED_SERIES: usize = 1_000;

/// The labels of one configured limit's answers: its domain, its descriptor's metric name
/// (envoyproxy/ratelimit's stats key: `domain.key_value.key`, or with request values under
/// `detailed_metric` / `value_to_metric`, bounded by [`MAX_DETAILED_SERIES`]) and the answer.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RlsLimitLabels {
    /// The domain.
    pub domain: String,
    /// The descriptor's metric name.
    pub descriptor: String,
    /// `within_limit` or `over_limit`.
    pub outcome: &'static str,
}

/// One domain in force, as the dashboard lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RlsDomain {
    /// The domain.
    pub name: String,
    /// The file it was read from (its name in the config directory).
    pub file: String,
    /// Its descriptor entries with a limit.
    pub limits: usize,
}

/// What the service answered for one domain since start (read from the counters).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RlsDomainTotals {
    /// Calls answered `OK`.
    pub calls_ok: u64,
    /// Calls answered `OVER_LIMIT`.
    pub calls_over_limit: u64,
    /// Descriptors over their limit.
    pub descriptors_over_limit: u64,
}

/// The Envoy rate-limit service's metrics.
#[derive(Debug, Clone, Default)]
pub struct RlsMetrics {
    /// `tollgate_rls_limit_descriptors_total{domain,descriptor,outcome}`: per configured limit.
    pub limits: Family<RlsLimitLabels, Counter>,
    /// `tollgate_rls_detailed_metric_overflow_total`: descriptors counted under their
    /// configured name because [`MAX_DETAILED_SERIES`] request-valued names were in use.
    pub detailed_overflow: Counter,
    /// The domains in force (set when the config directory loads), for the dashboard.
    domains: std::sync::Arc<std::sync::RwLock<Vec<RlsDomain>>>,
    /// The request-valued names labelled so far (at most [`MAX_DETAILED_SERIES`]).
    detailed: std::sync::Arc<std::sync::Mutex<std::collections::HashSet<String>>>,
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
            "rls_limit_descriptors",
            "Envoy rate-limit service descriptors that met a configured limit, by domain, descriptor metric name and answer",
            m.limits.clone(),
        );
        registry.register(
            "rls_detailed_metric_overflow",
            "Descriptors counted under their configured name because the request-valued (detailed_metric / value_to_metric) names in use reached their bound",
            m.detailed_overflow.clone(),
        );
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

impl RlsMetrics {
    /// Count one descriptor of `domain` that met a limit: `name` is its metric name, shown as
    /// is when it is the configured one (`shows_values` false: bounded by the config files),
    /// and, when it shows request values, only while fewer than [`MAX_DETAILED_SERIES`] such
    /// names are in use; past that, under `configured`.
    pub fn limit_answered(&self, domain: &str, name: (&str, &str), shows_values: bool, over: bool) {
        let (name, configured) = name;
        let descriptor = if shows_values && !self.admit_detailed(name) {
            self.detailed_overflow.inc();
            configured
        } else {
            name
        };
        self.limits
            .get_or_create(&RlsLimitLabels {
                domain: domain.to_string(),
                descriptor: descriptor.to_string(),
                outcome: if over { "over_limit" } else { "within_limit" },
            })
            .inc();
    }

    /// The domains now in force replace the list the dashboard shows.
    pub fn set_domains(&self, domains: Vec<RlsDomain>) {
        *self.domains.write().unwrap_or_else(std::sync::PoisonError::into_inner) = domains;
    }

    /// The domains in force, by name, each with its totals since start.
    pub fn domains(&self) -> Vec<(RlsDomain, RlsDomainTotals)> {
        let domains = self
            .domains
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        domains
            .into_iter()
            .map(|d| {
                let get = |f: &Family<RlsLabels, Counter>, outcome: &'static str| {
                    f.get_or_create(&RlsLabels {
                        domain: d.name.clone(),
                        outcome,
                    })
                    .get()
                };
                let totals = RlsDomainTotals {
                    calls_ok: get(&self.calls, "ok"),
                    calls_over_limit: get(&self.calls, "over_limit"),
                    descriptors_over_limit: get(&self.descriptors, "over_limit"),
                };
                (d, totals)
            })
            .collect()
    }

    /// `name` may label a series: it already does, or there is room for one more.
    fn admit_detailed(&self, name: &str) -> bool {
        let mut seen = self.detailed.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if seen.contains(name) {
            return true;
        }
        if seen.len() >= MAX_DETAILED_SERIES {
            return false;
        }
        seen.insert(name.to_string());
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_valued_names_are_bounded_and_the_rest_count_under_the_configured_name() {
        let m = RlsMetrics::default();
        for i in 0..MAX_DETAILED_SERIES + 50 {
            let name = format!("bench.client_{i}");
            m.limit_answered("bench", (&name, "bench.client"), true, false);
        }
        m.limit_answered("bench", ("bench.client_0", "bench.client"), true, true);
        m.limit_answered("bench", ("bench.tenant_acme", "bench.tenant_acme"), false, true);
        let get = |d: &str, outcome: &'static str| {
            m.limits
                .get_or_create(&RlsLimitLabels {
                    domain: "bench".into(),
                    descriptor: d.into(),
                    outcome,
                })
                .get()
        };
        assert_eq!(m.detailed_overflow.get(), 50);
        assert_eq!(
            get("bench.client", "within_limit"),
            50,
            "the overflow, under the configured name"
        );
        assert_eq!(get("bench.client_0", "within_limit"), 1);
        assert_eq!(get("bench.client_0", "over_limit"), 1, "a name in use keeps its series");
        assert_eq!(
            get(&format!("bench.client_{}", MAX_DETAILED_SERIES - 1), "within_limit"),
            1
        );
        assert_eq!(get(&format!("bench.client_{}", MAX_DETAILED_SERIES), "within_limit"), 0);
        assert_eq!(
            get("bench.tenant_acme", "over_limit"),
            1,
            "configured names are never bounded"
        );
    }
}
