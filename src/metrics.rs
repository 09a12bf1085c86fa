//! Prometheus metrics (prometheus-client). No label ever holds a user, key or IP: labels are
//! rule names, decisions, result kinds and status classes only. Per-rule handles are resolved
//! when rules load ([`Metrics::rule`]), so the request path only increments atomics.

use std::sync::Arc;

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

/// How a rule decided a request.
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum Decision {
    /// Within the limit.
    allowed,
    /// Over the limit: 429.
    denied,
    /// A shadow rule that would have denied.
    would_deny,
    /// Store down, rule fails open: forwarded unchecked.
    fail_open,
    /// Store down, rule fails closed: 503.
    fail_closed,
    /// Store down, decided by the local memory store.
    local,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RuleLabels {
    rule: String,
    decision: Decision,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabels {
    kind: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabels {
    result: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StatusLabels {
    status: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct VersionLabels {
    version: String,
}

/// Counter handles of one rule, one per decision.
#[derive(Debug, Clone, Default)]
pub struct RuleMetrics {
    /// `decision="allowed"`.
    pub allowed: Counter,
    /// `decision="denied"`.
    pub denied: Counter,
    /// `decision="would_deny"`.
    pub would_deny: Counter,
    /// `decision="fail_open"`.
    pub fail_open: Counter,
    /// `decision="fail_closed"`.
    pub fail_closed: Counter,
    /// `decision="local"`.
    pub local: Counter,
}

/// Every metric of the process.
pub struct Metrics {
    /// The registry `/metrics` encodes.
    registry: Registry,
    /// `tollgate_requests_total{rule,decision}`.
    requests: Family<RuleLabels, Counter>,
    /// Requests no rule matched.
    pub unmatched: Counter,
    /// `tollgate_limit_check_duration_seconds`.
    pub check_latency: Histogram,
    /// `tollgate_store_errors_total{kind}` handles.
    pub store_error: Counter,
    /// Timeouts.
    pub store_timeout: Counter,
    /// Checks skipped because the breaker was open.
    pub store_circuit_open: Counter,
    /// Store shards whose circuit breaker is open (0 when healthy; standalone Redis has one).
    pub breaker_open: Gauge,
    /// Deny-cache answers.
    pub deny_cache_hits: Counter,
    /// Live memory-store entries evicted to make room (`kind="live"`).
    pub memory_evicted: Counter,
    /// Of those, entries that were denying (`kind="denying"`): each lets a caller through early.
    pub memory_evicted_denying: Counter,
    /// `tollgate_upstream_responses_total{status}` handles: 1xx..5xx, then "error".
    pub upstream_status: [Counter; 6],
    /// Upstream latency.
    pub upstream_latency: Histogram,
    /// Reloads that succeeded.
    pub reload_ok: Counter,
    /// Reloads refused.
    pub reload_error: Counter,
    /// `tollgate_rules_info{version}`.
    rules_info: Family<VersionLabels, Gauge>,
    /// Responses the gateway itself produced for bad requests and errors.
    local_errors: Family<StatusLabels, Counter>,
}

impl Metrics {
    /// Register every metric.
    pub fn new() -> Arc<Self> {
        let mut registry = Registry::with_prefix("tollgate");
        let requests = Family::<RuleLabels, Counter>::default();
        registry.register("requests", "Requests by rule and decision", requests.clone());
        let unmatched = Counter::default();
        registry.register(
            "unmatched_requests",
            "Requests no rule matched (forwarded)",
            unmatched.clone(),
        );
        let check_latency = Histogram::new(exponential_buckets(0.00005, 2.0, 14));
        registry.register(
            "limit_check_duration_seconds",
            "Latency of one limit check",
            check_latency.clone(),
        );
        let store_errors = Family::<KindLabels, Counter>::default();
        registry.register(
            "store_errors",
            "Store failures by kind (error, timeout, circuit_open)",
            store_errors.clone(),
        );
        let kind = |k: &str| store_errors.get_or_create(&KindLabels { kind: k.into() }).clone();
        let (store_error, store_timeout, store_circuit_open) = (kind("error"), kind("timeout"), kind("circuit_open"));
        let breaker_open = Gauge::default();
        registry.register(
            "store_breaker_open",
            "Store shards (Redis masters) whose circuit breaker is open; 0 when all are healthy",
            breaker_open.clone(),
        );
        let evictions = Family::<KindLabels, Counter>::default();
        registry.register(
            "memory_evictions",
            "Live memory-store entries evicted to make room, by kind (live: all; denying: of those, entries that were denying)",
            evictions.clone(),
        );
        let memory_evicted = evictions.get_or_create(&KindLabels { kind: "live".into() }).clone();
        let memory_evicted_denying = evictions.get_or_create(&KindLabels { kind: "denying".into() }).clone();
        let deny_cache_hits = Counter::default();
        registry.register(
            "deny_cache_hits",
            "Denials answered from the local deny cache",
            deny_cache_hits.clone(),
        );
        let upstream = Family::<StatusLabels, Counter>::default();
        registry.register(
            "upstream_responses",
            "Upstream responses by status class",
            upstream.clone(),
        );
        let st = |s: &str| upstream.get_or_create(&StatusLabels { status: s.into() }).clone();
        let upstream_status = [st("1xx"), st("2xx"), st("3xx"), st("4xx"), st("5xx"), st("error")];
        let upstream_latency = Histogram::new(exponential_buckets(0.0001, 2.0, 18));
        registry.register(
            "upstream_duration_seconds",
            "Upstream time to response headers",
            upstream_latency.clone(),
        );
        let reloads = Family::<ResultLabels, Counter>::default();
        registry.register("reloads", "Rule/key reloads by result", reloads.clone());
        let reload_ok = reloads.get_or_create(&ResultLabels { result: "ok".into() }).clone();
        let reload_error = reloads.get_or_create(&ResultLabels { result: "error".into() }).clone();
        let rules_info = Family::<VersionLabels, Gauge>::default();
        registry.register(
            "rules_info",
            "The loaded rule-set version (value 1)",
            rules_info.clone(),
        );
        let local_errors = Family::<StatusLabels, Counter>::default();
        registry.register(
            "local_responses",
            "Responses made by the gateway itself, by status",
            local_errors.clone(),
        );
        Arc::new(Metrics {
            registry,
            requests,
            unmatched,
            check_latency,
            store_error,
            store_timeout,
            store_circuit_open,
            breaker_open,
            deny_cache_hits,
            memory_evicted,
            memory_evicted_denying,
            upstream_status,
            upstream_latency,
            reload_ok,
            reload_error,
            rules_info,
            local_errors,
        })
    }

    /// Resolve the handles of rule `name` (at load time).
    pub fn rule(&self, name: &str) -> RuleMetrics {
        let get = |decision| {
            self.requests
                .get_or_create(&RuleLabels {
                    rule: name.to_string(),
                    decision,
                })
                .clone()
        };
        RuleMetrics {
            allowed: get(Decision::allowed),
            denied: get(Decision::denied),
            would_deny: get(Decision::would_deny),
            fail_open: get(Decision::fail_open),
            fail_closed: get(Decision::fail_closed),
            local: get(Decision::local),
        }
    }

    /// Record the loaded rule-set version.
    pub fn set_rules_version(&self, version: &str) {
        self.rules_info.clear();
        self.rules_info
            .get_or_create(&VersionLabels {
                version: version.to_string(),
            })
            .set(1);
    }

    /// Count a response the gateway made itself.
    pub fn local_response(&self, status: u16) {
        self.local_errors
            .get_or_create(&StatusLabels {
                status: status.to_string(),
            })
            .inc();
    }

    /// The text exposition.
    pub fn encode(&self) -> String {
        let mut s = String::new();
        let _ = prometheus_client::encoding::text::encode(&mut s, &self.registry);
        s
    }
}
