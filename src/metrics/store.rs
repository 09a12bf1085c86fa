//! The store's family: checks that asked it, its failures and breakers, the deny cache, the
//! memory store's room, and leases.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use super::{counter, gauge, KindLabels};

/// A store shard: its master's `host:port` (never a password).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ShardLabels {
    /// `host:port`.
    pub shard: String,
}

/// The store's metrics; every handle is registered once, in [`Store::register`].
pub struct Store {
    /// `tollgate_limit_check_duration_seconds`.
    pub check_latency: Histogram,
    /// `tollgate_store_errors_total{kind="error"}`.
    pub error: Counter,
    /// `tollgate_store_errors_total{kind="timeout"}`.
    pub timeout: Counter,
    /// `tollgate_store_errors_total{kind="circuit_open"}`: checks skipped because the breaker
    /// was open.
    pub circuit_open: Counter,
    /// Store shards whose circuit breaker is open (0 when healthy; standalone Redis has one).
    pub breaker_open: Gauge,
    /// `tollgate_store_shard_breaker_open{shard}`: 1 while that shard's breaker is open.
    pub shard_breaker_open: Family<ShardLabels, Gauge>,
    /// `tollgate_store_permission_errors_total`: permission checks that found the Redis user
    /// lacking a permission (`NOPERM`).
    pub permission_errors: Counter,
    /// Deny-cache answers.
    pub deny_cache_hits: Counter,
    /// Live memory-store entries evicted to make room (`kind="live"`).
    pub memory_evicted: Counter,
    /// Checks the memory store refused because only denying keys and held slots were left
    /// (`kind="refused"`); the rule's failure policy answered them.
    pub memory_refused: Counter,
    /// Keys the memory store tracks (the primary store when memory, else the `failure: local`
    /// fallback), refreshed at each scrape.
    pub memory_keys: Gauge,
    /// Leases of hot keys: taken, returned, unused units returned, requests decided locally.
    pub leases: crate::limiter::lease::LeaseMetrics,
}

impl Store {
    /// Register the family in `r`.
    pub(super) fn register(r: &mut Registry) -> Self {
        let check_latency = Histogram::new(exponential_buckets(0.00005, 2.0, 14));
        r.register(
            "limit_check_duration_seconds",
            "Latency of one limit check that asked the store (Redis); decisions made on the node (memory store, deny cache, leases) take well under a microsecond and are not timed",
            check_latency.clone(),
        );
        let errors = Family::<KindLabels, Counter>::default();
        r.register(
            "store_errors",
            "Store failures by kind (error, timeout, circuit_open)",
            errors.clone(),
        );
        let kind = |k: &str| errors.get_or_create(&KindLabels { kind: k.into() }).clone();
        let (error, timeout, circuit_open) = (kind("error"), kind("timeout"), kind("circuit_open"));
        let breaker_open = gauge(
            r,
            "store_breaker_open",
            "Store shards (Redis masters) whose circuit breaker is open; 0 when all are healthy",
        );
        let shard_breaker_open = Family::<ShardLabels, Gauge>::default();
        r.register(
            "store_shard_breaker_open",
            "1 while the circuit breaker of this store shard (a Redis master, by host:port) is open",
            shard_breaker_open.clone(),
        );
        let permission_errors = counter(
            r,
            "store_permission_errors",
            "Permission checks (at start and every 5 s) that found the Redis user lacking a permission tollgate needs (NOPERM); /readyz fails while the last one did",
        );
        let evictions = Family::<KindLabels, Counter>::default();
        r.register(
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
            r.register(name, help, c.clone());
        }
        let deny_cache_hits = counter(r, "deny_cache_hits", "Denials answered from the local deny cache");
        let memory_keys = gauge(
            r,
            "memory_store_keys",
            "Keys tracked by the memory store (the primary store, or the failure: local fallback)",
        );
        Store {
            check_latency,
            error,
            timeout,
            circuit_open,
            breaker_open,
            shard_breaker_open,
            permission_errors,
            deny_cache_hits,
            memory_evicted,
            memory_refused,
            memory_keys,
            leases,
        }
    }
}
