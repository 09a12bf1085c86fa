//! A cost the response body reports (`cost_from: {json: …}`): the scan that rides the body,
//! and what each reservation is charged once the body is over ([`body_charge`]).

use std::sync::Arc;

use http::Response;

use crate::http::ProxyBody;
use crate::metrics::{InFlight, Unreported};
use crate::rules::CostFrom;
use crate::state::State;
use crate::usage::{BodyKind, Completeness, Scanner};

use super::super::ctx::Reserved;

/// A response body's cost, read as the body streams through.
pub(crate) struct BodyCost {
    /// The scan of the body so far.
    pub(super) scanner: Scanner,
    /// The body is compressed (`Content-Encoding`): nothing in it can be read.
    pub(super) encoded: bool,
    /// The reservations waiting for it.
    pub(super) waiting: Vec<BodyWaiting>,
    /// Counts this request in `tollgate_cost_reservations_in_flight` until it has settled.
    pub(super) in_flight: InFlight,
}

/// One rule's reservation waiting for the cost a response body reports.
pub(super) struct BodyWaiting {
    /// The rule's name (logs).
    pub(super) rule: Arc<str>,
    /// Its cost metrics.
    pub(super) metrics: Option<crate::metrics::CostHandles>,
    /// Where the cost is, and its `max`.
    pub(super) cf: CostFrom,
    /// The position of its path among the scan's.
    pub(super) path: usize,
    /// What it reserved.
    pub(super) spent: Reserved,
}

/// How a response body ended, as [`body_charge`] judges it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct BodyEnd {
    /// The body reached its end (it did not fail).
    pub(crate) ended: bool,
    /// The client left before the end (the rest was read without it).
    pub(crate) left: bool,
    /// The client left and the rest was not read within `request_timeout`.
    pub(crate) cut: bool,
    /// The body was compressed.
    pub(crate) encoded: bool,
    /// The scan's verdict on the body.
    pub(crate) completeness: Completeness,
}

/// What a reservation settles to once its response body is over.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Charge {
    /// The cost to settle against: `None` leaves the reservation as it is.
    pub(crate) settle_to: Option<u64>,
    /// Refunds are allowed (the body was whole and valid and the client stayed): without them
    /// only the checks that reserved less than `settle_to` are debited the difference.
    pub(crate) may_refund: bool,
    /// Units charged in the end (the largest check's).
    pub(crate) charged: u64,
    /// Why the body's number was not simply taken, if it was not.
    pub(crate) unreported: Option<Unreported>,
}

/// What a reservation of `reserved` units is charged, given the number `found` in its response
/// body (already capped at `max`) and how the body `end`ed:
/// - the number, when the body was whole and valid and its client stayed;
/// - the reservation when such a body had no number (`absent`);
/// - `max` when its client left and the rest was not read in time (`cut`);
/// - otherwise (malformed, compressed, failed, or its client left): the reservation or the
///   number, whichever is larger; never a refund.
pub(crate) fn body_charge(reserved: u64, found: Option<u64>, (max, missing_max): (u64, bool), end: BodyEnd) -> Charge {
    if end.cut {
        return Charge {
            settle_to: Some(max),
            may_refund: false,
            charged: max.max(reserved),
            unreported: Some(Unreported::Cut),
        };
    }
    let whole = end.ended && !end.encoded && end.completeness == Completeness::Complete;
    if whole && found.is_none() && missing_max {
        // `missing: max`: the number was kept from the upstream (a stream asked without
        // usage): the most it could have been.
        return Charge {
            settle_to: Some(max),
            may_refund: false,
            charged: max.max(reserved),
            unreported: Some(Unreported::Absent),
        };
    }
    let clean = whole && !end.left;
    if clean {
        return match found {
            Some(v) => Charge {
                settle_to: Some(v),
                may_refund: true,
                charged: v,
                unreported: None,
            },
            None => Charge {
                settle_to: None,
                may_refund: false,
                charged: reserved,
                unreported: Some(Unreported::Absent),
            },
        };
    }
    let unreported = if end.encoded {
        Some(Unreported::Encoded)
    } else if !end.ended {
        Some(Unreported::Failed)
    } else if end.completeness != Completeness::Complete {
        Some(Unreported::Malformed)
    } else if found.is_none() {
        Some(Unreported::Absent)
    } else {
        None
    };
    Charge {
        settle_to: found.filter(|v| *v > reserved),
        may_refund: false,
        charged: found.map_or(reserved, |v| v.max(reserved)),
        unreported,
    }
}

impl BodyCost {
    /// Settle every waiting reservation now that the body is over (`end`, without the scan's
    /// verdict, which is taken here): the settlements to make, each with what it settles to.
    pub(super) fn finish(mut self, gw: &State, mut end: BodyEnd) -> (Vec<(Reserved, u64)>, InFlight) {
        end.completeness = self.scanner.finish();
        end.encoded = self.encoded;
        let mut jobs = Vec::new();
        for w in self.waiting {
            gw.limiter().track_reserved(&w.spent, false);
            let found = self.scanner.found(w.path).map(|v| v.min(w.cf.max));
            let reserved = w.spent.iter().map(|(c, _, _)| c.cost).max().unwrap_or(0);
            let charge = body_charge(reserved, found, (w.cf.max, w.cf.missing_max), end);
            if let Some(m) = &w.metrics {
                m.settled(charge.charged, reserved, found.filter(|_| charge.unreported.is_none()));
                if let Some(why) = charge.unreported {
                    m.unreported(why);
                }
            }
            if let Some(why) = charge.unreported {
                tracing::debug!(rule = %w.rule, source = %w.cf.source, reason = ?why, reserved, found, charged = charge.charged, "the response's cost was not read as reported");
            }
            let Some(to) = charge.settle_to else { continue };
            let spent = if charge.may_refund {
                w.spent
            } else {
                w.spent.into_iter().filter(|(c, _, _)| c.cost < to).collect()
            };
            if !spent.is_empty() {
                jobs.push((spent, to));
            }
        }
        (jobs, self.in_flight)
    }
}

/// The scan of `resp`'s body for the costs `in_body` wait for.
pub(super) fn body_cost(gw: &State, resp: &Response<ProxyBody>, in_body: Vec<BodyWaiting>) -> BodyCost {
    let kind = BodyKind::of_content_type(resp.headers().get(http::header::CONTENT_TYPE).map(|v| v.as_bytes()));
    let encoded = resp
        .headers()
        .get(http::header::CONTENT_ENCODING)
        .is_some_and(|v| !v.as_bytes().eq_ignore_ascii_case(b"identity"));
    let mut paths: Vec<crate::usage::JsonPath> = Vec::new();
    let mut waiting = Vec::with_capacity(in_body.len());
    for mut w in in_body {
        let Some(p) = w.cf.json() else { continue };
        w.path = match paths.iter().position(|q| q == p) {
            Some(i) => i,
            None => {
                paths.push(p.clone());
                paths.len() - 1
            }
        };
        gw.limiter().track_reserved(&w.spent, true);
        waiting.push(w);
    }
    BodyCost {
        scanner: Scanner::new(&paths, kind),
        encoded,
        waiting,
        in_flight: InFlight::enter(&gw.metrics().cost.in_flight),
    }
}
