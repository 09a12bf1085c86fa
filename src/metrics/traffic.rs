//! The traffic family: requests by rule and decision, how each request ended, the responses
//! tollgate made itself, connections, the leaky-bucket queue, and request durations.

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use super::{counter, gauge};

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

/// The traffic metrics; every handle is registered once, in [`Traffic::register`].
pub struct Traffic {
    /// `tollgate_requests_total{rule,decision}`.
    requests: Family<RuleLabels, Counter>,
    /// `tollgate_concurrency_in_flight{rule}`.
    in_flight: Family<RuleOnly, Gauge>,
    /// `tollgate_penalties_total{rule,event}`.
    penalties: Family<PenaltyLabels, Counter>,
    /// Requests no rule matched.
    pub unmatched: Counter,
    /// Responses the gateway itself produced, by exact code.
    local_errors: Family<CodeLabels, Counter>,
    /// `tollgate_responses_total{result}`, one handle per [`Final`], in its order.
    finals: [Counter; 10],
    /// Client connections open now (proxy listener).
    pub open_connections: Gauge,
    /// Requests waiting their turn in a leaky bucket now.
    pub leaky_queue: Gauge,
    /// Requests from their head to their response's head (whether tollgate or the upstream
    /// answered), seconds: `tollgate_request_duration_seconds`. The access log's `duration_ms`
    /// covers the body too.
    pub duration: Histogram,
    /// What tollgate adds to a forwarded request: its whole duration less the time waiting for
    /// the upstream's response head, seconds: `tollgate_request_overhead_seconds`.
    pub overhead: Histogram,
}

impl Traffic {
    /// Register the family in `r`, with `tollgate_build_info` set.
    pub(super) fn register(r: &mut Registry) -> Self {
        let requests = Family::<RuleLabels, Counter>::default();
        r.register("requests", "Requests by rule and decision", requests.clone());
        let in_flight = Family::<RuleOnly, Gauge>::default();
        r.register(
            "concurrency_in_flight",
            "Concurrency slots held by this node's requests, by rule",
            in_flight.clone(),
        );
        let penalties = Family::<PenaltyLabels, Counter>::default();
        r.register(
            "penalties",
            "Penalty boxes started (or escalated) by this node's requests and lifted by an admin, by rule",
            penalties.clone(),
        );
        let unmatched = counter(r, "unmatched_requests", "Requests no rule matched (forwarded)");
        let local_errors = Family::<CodeLabels, Counter>::default();
        r.register(
            "local_responses",
            "Responses made by the gateway itself, by exact status code",
            local_errors.clone(),
        );
        let finals = Family::<FinalLabels, Counter>::default();
        r.register(
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
        r.register("build_info", "tollgate's version (value 1)", build_info.clone());
        build_info
            .get_or_create(&BuildLabels {
                version: env!("CARGO_PKG_VERSION"),
            })
            .set(1);
        let open_connections = gauge(r, "open_connections", "Client connections open on the proxy listener");
        let leaky_queue = gauge(
            r,
            "leaky_bucket_queued_requests",
            "Requests admitted by a leaky bucket and waiting their turn",
        );
        let duration = Histogram::new(exponential_buckets(0.0001, 2.0, 18));
        r.register(
            "request_duration_seconds",
            "Requests on the proxy listener, from the request head to the response head (whoever answered)",
            duration.clone(),
        );
        let overhead = Histogram::new(exponential_buckets(0.00001, 2.0, 18));
        r.register(
            "request_overhead_seconds",
            "What tollgate adds to a forwarded request: its whole duration less the wait for the upstream's response head (limits, queueing, forwarding)",
            overhead.clone(),
        );
        Traffic {
            requests,
            in_flight,
            penalties,
            unmatched,
            local_errors,
            finals,
            open_connections,
            leaky_queue,
            duration,
            overhead,
        }
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
}
