//! The cost family: what rules whose cost the upstream reports (`cost_from`) charged, how far
//! their reservations were from it, responses that reported nothing usable, and reservations
//! still waiting for their cost. Each rule's handles are resolved when the rules load
//! ([`CostMetrics::handles`]), one set per place its cost is read from.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SourceLabels {
    rule: String,
    source: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    rule: String,
    source: String,
    reason: &'static str,
}

/// Why a response's cost was not read (`tollgate_cost_unreported_total{reason}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unreported {
    /// The response had no such field (or header): the reservation stays charged.
    Absent,
    /// The body was not valid JSON (or an event's data was not): the reservation stays
    /// charged, or the number found if it is larger.
    Malformed,
    /// The body was compressed: it cannot be read.
    Encoded,
    /// The response body failed or was cut before its end.
    Failed,
    /// The client left and the rest was not read within `upstream.request_timeout`: charged
    /// `max`.
    Cut,
}

impl Unreported {
    /// Every reason, in the order of [`CostHandles::unreported`].
    const ALL: [Unreported; 5] = [
        Unreported::Absent,
        Unreported::Malformed,
        Unreported::Encoded,
        Unreported::Failed,
        Unreported::Cut,
    ];

    fn label(self) -> &'static str {
        match self {
            Unreported::Absent => "absent",
            Unreported::Malformed => "malformed",
            Unreported::Encoded => "encoded",
            Unreported::Failed => "failed",
            Unreported::Cut => "cut",
        }
    }
}

/// The family's handles.
pub struct CostMetrics {
    charged: Family<SourceLabels, Counter>,
    error: Family<SourceLabels, Histogram, fn() -> Histogram>,
    unreported: Family<ReasonLabels, Counter>,
    /// `tollgate_cost_reservations_in_flight`: requests of this node whose reservation waits
    /// for the cost their response reports.
    pub in_flight: Gauge,
}

/// Buckets of reservation minus actual: both signs, by powers of four.
fn error_histogram() -> Histogram {
    let mut b: Vec<f64> = (0..10).rev().map(|k| -(4f64.powi(k))).collect();
    b.push(0.0);
    b.extend((0..10).map(|k| 4f64.powi(k)));
    Histogram::new(b)
}

impl CostMetrics {
    /// Register the family in `r`.
    pub(super) fn register(r: &mut Registry) -> Self {
        let charged = Family::<SourceLabels, Counter>::default();
        r.register(
            "cost_charged",
            "Units (tokens) charged to keys by rules whose cost the upstream reports, after settlement, by rule and source",
            charged.clone(),
        );
        let error = Family::<SourceLabels, Histogram, fn() -> Histogram>::new_with_constructor(error_histogram);
        r.register(
            "cost_reservation_error",
            "Reservation minus the cost the upstream reported, per settled request, by rule and source (positive: refunded; negative: debited)",
            error.clone(),
        );
        let unreported = Family::<ReasonLabels, Counter>::default();
        r.register(
            "cost_unreported",
            "Responses whose cost could not be read (absent, malformed, encoded, failed, cut), by rule, source and reason",
            unreported.clone(),
        );
        let in_flight = Gauge::default();
        r.register(
            "cost_reservations_in_flight",
            "Requests of this node whose reservation still waits for the cost their response reports",
            in_flight.clone(),
        );
        CostMetrics {
            charged,
            error,
            unreported,
            in_flight,
        }
    }

    /// The handles of `rule` reading its cost from `source` (at rule load).
    pub fn handles(&self, rule: &str, source: &str) -> CostHandles {
        let labels = SourceLabels {
            rule: rule.to_owned(),
            source: source.to_owned(),
        };
        // One `get_or_create` per statement (its read guard lives to the statement's end).
        let charged = self.charged.get_or_create(&labels).clone();
        let error = self.error.get_or_create(&labels).clone();
        let unreported = Unreported::ALL.map(|why| {
            self.unreported
                .get_or_create(&ReasonLabels {
                    rule: rule.to_owned(),
                    source: source.to_owned(),
                    reason: why.label(),
                })
                .clone()
        });
        CostHandles {
            charged,
            error,
            unreported,
        }
    }
}

/// One rule's cost metrics for one place its cost is read from, resolved when the rules load.
#[derive(Debug, Clone)]
pub struct CostHandles {
    charged: Counter,
    error: Histogram,
    unreported: [Counter; 5],
}

impl CostHandles {
    /// `units` were charged; the reservation was `reserved`, and the upstream reported
    /// `reported` (when it did).
    pub fn settled(&self, units: u64, reserved: u64, reported: Option<u64>) {
        self.charged.inc_by(units);
        if let Some(actual) = reported {
            self.error.observe(reserved as f64 - actual as f64);
        }
    }

    /// The cost could not be read, for `why`.
    pub fn unreported(&self, why: Unreported) {
        if let Some(c) = Unreported::ALL
            .iter()
            .position(|w| *w == why)
            .and_then(|i| self.unreported.get(i))
        {
            c.inc();
        }
    }
}
