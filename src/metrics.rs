//! Prometheus metrics (prometheus-client). No label ever holds a user, key or IP: labels are
//! rule names, decisions, result kinds and status classes only. Per-rule handles are resolved
//! when rules load ([`Metrics::rule`]), so the request path only increments atomics.

use std::sync::Arc;
use std::time::SystemTime;

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
struct RuleOnly {
    rule: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PenaltyLabels {
    rule: String,
    event: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabels {
    kind: String,
}

/// The Envoy rate-limit service's labels: a configured domain (or `unknown`: bounded by the
/// config files, never by request values) and what was answered.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RlsLabels {
    /// The domain, when configured; `unknown` otherwise.
    pub domain: String,
    /// `ok`, `over_limit`, `shadow_over_limit`, `unlimited`, `no_limit`, `store_unavailable`
    /// (descriptors); `ok`, `over_limit`, `invalid` (calls).
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

/// A store shard: its master's `host:port` (never a password).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ShardLabels {
    /// `host:port`.
    pub shard: String,
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
struct TargetLabels {
    target: String,
    status: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EjectLabels {
    target: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CodeLabels {
    code: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BuildLabels {
    version: &'static str,
}

/// How a request ended, for `tollgate_responses_total{result}`: one count per request.
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum Final {
    /// The upstream answered 1xx.
    upstream_1xx,
    /// The upstream answered 2xx.
    upstream_2xx,
    /// The upstream answered 3xx.
    upstream_3xx,
    /// The upstream answered 4xx.
    upstream_4xx,
    /// The upstream answered 5xx.
    upstream_5xx,
    /// tollgate answered 429 (over quota).
    rate_limited,
    /// tollgate answered 503 (store down on a fail-closed rule, or over `max_connections`).
    unavailable,
    /// tollgate answered another 4xx (bad request, body too large, ...).
    local_4xx,
    /// tollgate answered another 5xx (502 and 504: upstream unreachable or too slow).
    local_5xx,
    /// The client left before the response (nginx's 499, Envoy's `DC`).
    client_abort,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FinalLabels {
    result: Final,
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

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ChangeLabels {
    file: &'static str,
    change: &'static str,
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
    /// `tollgate_concurrency_in_flight{rule}`: slots this node's requests hold now.
    pub in_flight: Gauge,
    /// `tollgate_penalties_total{rule,event="started"}`: penalties started or escalated by
    /// this node's requests.
    pub penalty_started: Counter,
    /// `tollgate_penalties_total{rule,event="lifted"}`: penalties lifted through the admin API.
    pub penalty_lifted: Counter,
}

/// Every metric of the process.
pub struct Metrics {
    /// The registry `/metrics` encodes.
    registry: Registry,
    /// `tollgate_requests_total{rule,decision}`.
    requests: Family<RuleLabels, Counter>,
    /// `tollgate_concurrency_in_flight{rule}`.
    in_flight: Family<RuleOnly, Gauge>,
    /// `tollgate_penalties_total{rule,event}`.
    penalties: Family<PenaltyLabels, Counter>,
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
    /// `tollgate_store_shard_breaker_open{shard}`: 1 while that shard's breaker is open.
    pub shard_breaker_open: Family<ShardLabels, Gauge>,
    /// `tollgate_store_permission_errors_total`: permission checks that found the Redis user
    /// lacking a permission (`NOPERM`).
    pub store_permission_errors: Counter,
    /// Deny-cache answers.
    pub deny_cache_hits: Counter,
    /// Live memory-store entries evicted to make room (`kind="live"`).
    pub memory_evicted: Counter,
    /// Checks the memory store refused because only denying keys and held slots were left
    /// (`kind="refused"`); the rule's failure policy answered them.
    pub memory_refused: Counter,
    /// `tollgate_upstream_responses_total{status}` handles 1xx..5xx, then
    /// `tollgate_upstream_failures_total` (no response: refused, reset, timed out).
    pub upstream_status: [Counter; 6],
    /// `tollgate_upstream_target_responses_total{target,status}`, resolved per target by
    /// [`Metrics::target_counters`].
    upstream_targets: Family<TargetLabels, Counter>,
    /// `tollgate_upstream_target_ejections_total{target}`.
    upstream_target_ejections: Family<EjectLabels, Counter>,
    /// Upstream latency.
    pub upstream_latency: Histogram,
    /// Reloads that succeeded.
    pub reload_ok: Counter,
    /// Reloads refused.
    pub reload_error: Counter,
    /// 1 when the last reload succeeded (and at start), 0 after a refused one.
    pub last_reload_success: Gauge,
    /// Unix time of the last successful load (start or reload).
    pub last_reload_success_timestamp: Gauge,
    /// `tollgate_reload_changes_total{file,change}`.
    reload_changes: Family<ChangeLabels, Counter>,
    /// 1 while gateway.yaml on disk differs from the one this process started with.
    pub config_file_changed: Gauge,
    /// `tollgate_rules_info{version}`.
    rules_info: Family<VersionLabels, Gauge>,
    /// Responses the gateway itself produced, by exact code.
    local_errors: Family<CodeLabels, Counter>,
    /// `tollgate_responses_total{result}`, one handle per [`Final`], in its order.
    finals: [Counter; 10],
    /// Client connections open now (proxy listener).
    pub open_connections: Gauge,
    /// Requests waiting their turn in a leaky bucket now.
    pub leaky_queue: Gauge,
    /// Keys the memory store tracks (the primary store when memory, else the `failure: local`
    /// fallback), refreshed at each scrape.
    pub memory_store_keys: Gauge,
    /// Leases of hot keys: taken, returned, unused units returned, requests decided locally.
    pub leases: crate::limiter::lease::LeaseMetrics,
    /// Process resident memory, refreshed at each scrape (Linux).
    pub process_resident_memory: Gauge,
    /// Process open file descriptors, refreshed at each scrape (Linux).
    pub process_open_fds: Gauge,
    /// Process start, unix seconds.
    pub process_start_time: Gauge,
    /// User + system CPU time, seconds, refreshed at each scrape (Linux):
    /// `process_cpu_seconds_total`, by its standard name.
    pub process_cpu: Counter<f64, std::sync::atomic::AtomicU64>,
    /// The process metrics under their standard, unprefixed names (`process_*`, as every
    /// Prometheus client library exports them), appended to the exposition.
    process_registry: Registry,
    /// Requests from their head to their response's head (whether tollgate or the upstream
    /// answered), seconds: `tollgate_request_duration_seconds`. The access log's `duration_ms`
    /// covers the body too.
    pub request_duration: Histogram,
    /// What tollgate adds to a forwarded request: its whole duration less the time waiting for
    /// the upstream's response head, seconds: `tollgate_request_overhead_seconds`.
    pub request_overhead: Histogram,
    /// The listener certificate's `notAfter`, unix seconds (0 without TLS):
    /// `tollgate_tls_certificate_expiry_timestamp_seconds`.
    pub tls_cert_expiry: Gauge,
    /// Listener certificate reloads that took effect.
    pub tls_reload_ok: Counter,
    /// Listener certificate reloads refused (the old certificate kept serving).
    pub tls_reload_error: Counter,
    /// Upstream requests sent a second time after their first attempt failed.
    pub upstream_retries: Counter,
    /// Upstream targets taken out (passive ejection or a failed health check).
    pub upstream_ejections: Counter,
    /// The Envoy rate-limit service's.
    pub rls: RlsMetrics,
}

/// One upstream target's counters (see [`Metrics::target_counters`]).
#[derive(Debug, Clone, Default)]
pub struct TargetCounters {
    /// Answers by status class 1xx..5xx, then requests that got no answer.
    pub status: [Counter; 6],
    /// Times the target was taken out.
    pub ejections: Counter,
}

impl Metrics {
    /// Register every metric.
    pub fn new() -> Arc<Self> {
        let mut registry = Registry::with_prefix("tollgate");
        let requests = Family::<RuleLabels, Counter>::default();
        registry.register("requests", "Requests by rule and decision", requests.clone());
        let in_flight = Family::<RuleOnly, Gauge>::default();
        registry.register(
            "concurrency_in_flight",
            "Concurrency slots held by this node's requests, by rule",
            in_flight.clone(),
        );
        let penalties = Family::<PenaltyLabels, Counter>::default();
        registry.register(
            "penalties",
            "Penalty boxes started (or escalated) by this node's requests and lifted by an admin, by rule",
            penalties.clone(),
        );
        let unmatched = Counter::default();
        registry.register(
            "unmatched_requests",
            "Requests no rule matched (forwarded)",
            unmatched.clone(),
        );
        let check_latency = Histogram::new(exponential_buckets(0.00005, 2.0, 14));
        registry.register(
            "limit_check_duration_seconds",
            "Latency of one limit check that asked the store (Redis); decisions made on the node (memory store, deny cache, leases) take well under a microsecond and are not timed",
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
        let shard_breaker_open = Family::<ShardLabels, Gauge>::default();
        registry.register(
            "store_shard_breaker_open",
            "1 while the circuit breaker of this store shard (a Redis master, by host:port) is open",
            shard_breaker_open.clone(),
        );
        let store_permission_errors = Counter::default();
        registry.register(
            "store_permission_errors",
            "Permission checks (at start and every 5 s) that found the Redis user lacking a permission tollgate needs (NOPERM); /readyz fails while the last one did",
            store_permission_errors.clone(),
        );
        let evictions = Family::<KindLabels, Counter>::default();
        registry.register(
            "memory_evictions",
            "Memory-store room made or refused, by kind (live: admitting entries evicted to make room; refused: checks refused a new key because only denying keys and held slots were left)",
            evictions.clone(),
        );
        let memory_evicted = evictions.get_or_create(&KindLabels { kind: "live".into() }).clone();
        let memory_refused = evictions.get_or_create(&KindLabels { kind: "refused".into() }).clone();
        let leases = crate::limiter::lease::LeaseMetrics::default();
        for (name, help, c) in [
            (
                "leases_taken",
                "Leases of hot keys granted to this node by the store",
                &leases.taken,
            ),
            (
                "leases_returned",
                "Leases this node ended (expired, replaced, reload, shutdown)",
                &leases.returned,
            ),
            (
                "lease_units_unused",
                "Units of ended leases given back to the store unused",
                &leases.unused,
            ),
            (
                "lease_decisions",
                "Requests this node decided from its leases, without a store call",
                &leases.local,
            ),
        ] {
            registry.register(name, help, c.clone());
        }
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
        let upstream_failures = Counter::default();
        registry.register(
            "upstream_failures",
            "Upstream requests that got no response (refused, reset, timed out)",
            upstream_failures.clone(),
        );
        let upstream_status = [st("1xx"), st("2xx"), st("3xx"), st("4xx"), st("5xx"), upstream_failures];
        let upstream_targets = Family::<TargetLabels, Counter>::default();
        registry.register(
            "upstream_target_responses",
            "Upstream answers by target and status class (failed: no response: refused, reset, timed out)",
            upstream_targets.clone(),
        );
        let upstream_target_ejections = Family::<EjectLabels, Counter>::default();
        registry.register(
            "upstream_target_ejections",
            "Times each upstream target was taken out (passive ejection or a failed health check)",
            upstream_target_ejections.clone(),
        );
        let upstream_latency = Histogram::new(exponential_buckets(0.0001, 2.0, 18));
        registry.register(
            "upstream_duration_seconds",
            "Upstream time to response headers",
            upstream_latency.clone(),
        );
        let tls_reloads = Family::<ResultLabels, Counter>::default();
        registry.register(
            "tls_certificate_reloads",
            "Listener certificate reloads by result (error: the old certificate kept serving)",
            tls_reloads.clone(),
        );
        let tls_reload_ok = tls_reloads.get_or_create(&ResultLabels { result: "ok".into() }).clone();
        let tls_cert_expiry = Gauge::default();
        registry.register(
            "tls_certificate_expiry_timestamp_seconds",
            "When the listener certificate now served expires (its notAfter), unix seconds; alert well before it",
            tls_cert_expiry.clone(),
        );
        let tls_reload_error = tls_reloads
            .get_or_create(&ResultLabels { result: "error".into() })
            .clone();
        let upstream_retries = Counter::default();
        registry.register(
            "upstream_retries",
            "Upstream requests retried after a failed attempt",
            upstream_retries.clone(),
        );
        let upstream_ejections = Counter::default();
        registry.register(
            "upstream_ejections",
            "Upstream targets taken out after failures",
            upstream_ejections.clone(),
        );
        let reloads = Family::<ResultLabels, Counter>::default();
        registry.register("reloads", "Rule/key reloads by result", reloads.clone());
        let reload_ok = reloads.get_or_create(&ResultLabels { result: "ok".into() }).clone();
        let reload_error = reloads.get_or_create(&ResultLabels { result: "error".into() }).clone();
        let last_reload_success = Gauge::default();
        registry.register(
            "last_reload_success",
            "1 if the last load of the rules and keys (start or reload) succeeded, 0 if it was refused",
            last_reload_success.clone(),
        );
        let last_reload_success_timestamp = Gauge::default();
        registry.register(
            "last_reload_success_timestamp_seconds",
            "Unix time of the last successful load of the rules and keys",
            last_reload_success_timestamp.clone(),
        );
        let reload_changes = Family::<ChangeLabels, Counter>::default();
        registry.register(
            "reload_changes",
            "Rules and API keys added, removed or changed by reloads",
            reload_changes.clone(),
        );
        let config_file_changed = Gauge::default();
        registry.register(
            "config_file_changed",
            "1 while the gateway config file differs from the one running (restart to apply it)",
            config_file_changed.clone(),
        );
        let rules_info = Family::<VersionLabels, Gauge>::default();
        registry.register(
            "rules_info",
            "The loaded rule-set version (value 1)",
            rules_info.clone(),
        );
        let local_errors = Family::<CodeLabels, Counter>::default();
        registry.register(
            "local_responses",
            "Responses made by the gateway itself, by exact status code",
            local_errors.clone(),
        );
        let finals = Family::<FinalLabels, Counter>::default();
        registry.register(
            "responses",
            "Requests by how they ended (one count per request): upstream_1xx..5xx, rate_limited, unavailable, local_4xx, local_5xx",
            finals.clone(),
        );
        let finals = [
            Final::upstream_1xx,
            Final::upstream_2xx,
            Final::upstream_3xx,
            Final::upstream_4xx,
            Final::upstream_5xx,
            Final::rate_limited,
            Final::unavailable,
            Final::local_4xx,
            Final::local_5xx,
            Final::client_abort,
        ]
        .map(|result| finals.get_or_create(&FinalLabels { result }).clone());
        let build_info = Family::<BuildLabels, Gauge>::default();
        registry.register("build_info", "tollgate's version (value 1)", build_info.clone());
        build_info
            .get_or_create(&BuildLabels {
                version: env!("CARGO_PKG_VERSION"),
            })
            .set(1);
        let gauge = |registry: &mut Registry, name: &str, help: &str| {
            let g = Gauge::default();
            registry.register(name, help, g.clone());
            g
        };
        let open_connections = gauge(
            &mut registry,
            "open_connections",
            "Client connections open on the proxy listener",
        );
        let leaky_queue = gauge(
            &mut registry,
            "leaky_bucket_queued_requests",
            "Requests admitted by a leaky bucket and waiting their turn",
        );
        let memory_store_keys = gauge(
            &mut registry,
            "memory_store_keys",
            "Keys tracked by the memory store (the primary store, or the failure: local fallback)",
        );
        let mut process_registry = Registry::default();
        let process_resident_memory = gauge(
            &mut process_registry,
            "process_resident_memory_bytes",
            "Resident memory size in bytes",
        );
        let process_open_fds = gauge(
            &mut process_registry,
            "process_open_fds",
            "Number of open file descriptors",
        );
        let process_start_time = gauge(
            &mut process_registry,
            "process_start_time_seconds",
            "Start time of the process since unix epoch in seconds",
        );
        let process_cpu = Counter::<f64, std::sync::atomic::AtomicU64>::default();
        process_registry.register(
            "process_cpu_seconds",
            "Total user and system CPU time spent in seconds",
            process_cpu.clone(),
        );
        let request_duration = Histogram::new(exponential_buckets(0.0001, 2.0, 18));
        registry.register(
            "request_duration_seconds",
            "Requests on the proxy listener, from the request head to the response head (whoever answered)",
            request_duration.clone(),
        );
        let request_overhead = Histogram::new(exponential_buckets(0.00001, 2.0, 18));
        registry.register(
            "request_overhead_seconds",
            "What tollgate adds to a forwarded request: its whole duration less the wait for the upstream's response head (limits, queueing, forwarding)",
            request_overhead.clone(),
        );
        let rls = RlsMetrics::default();
        registry.register(
            "rls_descriptors",
            "Envoy rate-limit service descriptors answered, by domain and outcome",
            rls.descriptors.clone(),
        );
        registry.register(
            "rls_calls",
            "Envoy rate-limit service calls, by domain and overall answer",
            rls.calls.clone(),
        );
        registry.register(
            "rls_config_reload_errors",
            "Envoy rate-limit config directory reloads refused (the previous config stays in force)",
            rls.reload_errors.clone(),
        );
        registry.register(
            "rls_config_reloads",
            "Envoy rate-limit config directory reloads that took effect",
            rls.reloads.clone(),
        );
        process_start_time.set(
            i64::try_from(
                SystemTime::now()
                    .duration_since(SystemTime::UNIX_EPOCH)
                    .map_or(0, |d| d.as_secs()),
            )
            .unwrap_or(0),
        );
        Arc::new(Metrics {
            rls,
            registry,
            requests,
            in_flight,
            penalties,
            unmatched,
            check_latency,
            store_error,
            store_timeout,
            store_circuit_open,
            breaker_open,
            shard_breaker_open,
            store_permission_errors,
            deny_cache_hits,
            memory_evicted,
            memory_refused,
            leases,
            upstream_status,
            upstream_targets,
            upstream_target_ejections,
            upstream_latency,
            reload_ok,
            reload_error,
            last_reload_success,
            last_reload_success_timestamp,
            reload_changes,
            config_file_changed,
            rules_info,
            local_errors,
            finals,
            open_connections,
            leaky_queue,
            memory_store_keys,
            process_resident_memory,
            process_open_fds,
            process_start_time,
            process_cpu,
            process_registry,
            request_duration,
            request_overhead,
            tls_cert_expiry,
            tls_reload_ok,
            tls_reload_error,
            upstream_retries,
            upstream_ejections,
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
        // One `get_or_create` per statement: its read guard lives to the end of the statement,
        // and a second one in the same expression would wait for it forever (write lock).
        let in_flight = self
            .in_flight
            .get_or_create(&RuleOnly { rule: name.to_string() })
            .clone();
        let penalty = |event| {
            self.penalties
                .get_or_create(&PenaltyLabels {
                    rule: name.to_string(),
                    event,
                })
                .clone()
        };
        let penalty_started = penalty("started");
        let penalty_lifted = penalty("lifted");
        RuleMetrics {
            allowed: get(Decision::allowed),
            denied: get(Decision::denied),
            would_deny: get(Decision::would_deny),
            fail_open: get(Decision::fail_open),
            fail_closed: get(Decision::fail_closed),
            local: get(Decision::local),
            in_flight,
            penalty_started,
            penalty_lifted,
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

    /// Count what one reload changed in `file` (`rules` or `keys`).
    pub fn reload_changed(&self, file: &'static str, added: u64, removed: u64, changed: u64) {
        for (change, n) in [("added", added), ("removed", removed), ("changed", changed)] {
            if n > 0 {
                self.reload_changes
                    .get_or_create(&ChangeLabels { file, change })
                    .inc_by(n);
            }
        }
    }

    /// Record a successful load (start or reload) at unix time `now`.
    pub fn reload_succeeded(&self, now: SystemTime) {
        self.last_reload_success.set(1);
        let secs = now.duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        self.last_reload_success_timestamp
            .set(i64::try_from(secs).unwrap_or(i64::MAX));
    }

    /// Count a response the gateway made itself (not the 429 of the deny path: see
    /// [`Metrics::rate_limited`]), in `local_responses{code}` and `responses{result}`.
    pub fn local_response(&self, status: u16) {
        self.local_errors
            .get_or_create(&CodeLabels {
                code: status.to_string(),
            })
            .inc();
        let result = match status {
            429 => Final::rate_limited,
            503 => Final::unavailable,
            500..=599 => Final::local_5xx,
            _ => Final::local_4xx,
        };
        self.finals[result as usize].inc();
    }

    /// Count a request whose client left before its response.
    pub fn client_abort(&self) {
        self.finals[Final::client_abort as usize].inc();
    }

    /// Count a 429 answered on the deny path (hot: one atomic add).
    pub fn rate_limited(&self) {
        self.finals[Final::rate_limited as usize].inc();
    }

    /// Count a response forwarded from the upstream with `status`.
    pub fn upstream_response(&self, status: u16) {
        let result = match status {
            100..=199 => Final::upstream_1xx,
            200..=299 => Final::upstream_2xx,
            300..=399 => Final::upstream_3xx,
            400..=499 => Final::upstream_4xx,
            _ => Final::upstream_5xx,
        };
        self.finals[result as usize].inc();
    }

    /// Forget the per-rule series of a rule that no longer exists (after a reload).
    pub fn forget_rule(&self, name: &str) {
        for decision in [
            Decision::allowed,
            Decision::denied,
            Decision::would_deny,
            Decision::fail_open,
            Decision::fail_closed,
            Decision::local,
        ] {
            self.requests.remove(&RuleLabels {
                rule: name.to_string(),
                decision,
            });
        }
        self.in_flight.remove(&RuleOnly { rule: name.to_string() });
        for event in ["started", "lifted"] {
            self.penalties.remove(&PenaltyLabels {
                rule: name.to_string(),
                event,
            });
        }
    }

    /// One target's counters, resolved once when the upstream is built: its answers by status
    /// class (1xx..5xx, then `failed`), and its ejections. `target` is its URL (no credentials:
    /// an upstream URL has none).
    pub fn target_counters(&self, target: &str) -> TargetCounters {
        let c = |status: &'static str| {
            self.upstream_targets
                .get_or_create(&TargetLabels {
                    target: target.to_string(),
                    status,
                })
                .clone()
        };
        TargetCounters {
            status: [c("1xx"), c("2xx"), c("3xx"), c("4xx"), c("5xx"), c("failed")],
            ejections: self
                .upstream_target_ejections
                .get_or_create(&EjectLabels {
                    target: target.to_string(),
                })
                .clone(),
        }
    }

    /// Refresh the process gauges from `/proc/self` (Linux; elsewhere they stay 0).
    pub fn refresh_process(&self) {
        if let Ok(statm) = std::fs::read_to_string("/proc/self/statm") {
            if let Some(pages) = statm.split_whitespace().nth(1).and_then(|p| p.parse::<i64>().ok()) {
                self.process_resident_memory.set(pages.saturating_mul(4096));
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
                let delta = secs - self.process_cpu.get();
                if delta > 0.0 {
                    self.process_cpu.inc_by(delta);
                }
            }
        }
        if let Ok(dir) = std::fs::read_dir("/proc/self/fd") {
            self.process_open_fds
                .set(i64::try_from(dir.count()).unwrap_or(i64::MAX));
        }
    }

    /// The text exposition: tollgate's metrics, then the standard `process_*` ones, one `# EOF`.
    pub fn encode(&self) -> String {
        let mut s = String::new();
        let _ = prometheus_client::encoding::text::encode_registry(&mut s, &self.registry);
        let _ = prometheus_client::encoding::text::encode_registry(&mut s, &self.process_registry);
        let _ = prometheus_client::encoding::text::encode_eof(&mut s);
        s
    }
}
