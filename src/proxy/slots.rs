//! Concurrency slots held by one request: taken with the request's other limits, released when
//! the upstream exchange really ends: its response body ends or fails, or, once the client has
//! gone, the rest of it has been read or `upstream.request_timeout` has passed (see
//! `settle::HeldBody`); or when an upgraded connection closes. A request that never reached
//! the upstream (its client left a leaky-bucket queue) releases them at once.

use std::sync::Arc;

use prometheus_client::metrics::gauge::Gauge;

use crate::limiter::{Source, Verdict};
use crate::state::State;

use crate::engine::plan::RequestPlan;

/// Holds a request's slots; dropping it releases them (in a spawned task: a drop cannot wait)
/// and lowers the per-rule in-flight gauges.
pub(crate) struct SlotGuard {
    /// The gateway (for its limiter).
    gw: Arc<State>,
    /// The request's holder id.
    holder: u64,
    /// One in-flight gauge per slot held, raised when the guard was made.
    gauges: Vec<Gauge>,
}

impl SlotGuard {
    /// Hold `holder`'s slots (already registered with the limiter) and raise `gauges`.
    pub(crate) fn new(gw: Arc<State>, holder: u64, gauges: Vec<Gauge>) -> Self {
        for g in &gauges {
            g.inc();
        }
        SlotGuard { gw, holder, gauges }
    }
}

impl Drop for SlotGuard {
    fn drop(&mut self) {
        for g in &self.gauges {
            g.dec();
        }
        let (gw, holder) = (self.gw.clone(), self.holder);
        match tokio::runtime::Handle::try_current() {
            Ok(h) => {
                h.spawn(async move { gw.limiter().release(holder).await });
            }
            Err(_) => {
                tracing::debug!("no runtime to release concurrency slots; they expire after store.concurrency_ttl")
            }
        }
    }
}

impl State {
    /// Register the concurrency slots an admitted request took (with the limiter, for renewal,
    /// and in the per-rule gauges) and return the guard that releases them; `None` when it took
    /// none (the rules failed open, or a shadow limit denied).
    pub(super) fn hold_slots(
        self: &Arc<Self>,
        snap: &crate::state::Snapshot,
        plan: &RequestPlan,
        verdict: &Verdict,
        holder: u64,
    ) -> Option<SlotGuard> {
        let mut held = Vec::new();
        let mut gauges = Vec::new();
        for (p, (o, src)) in plan.with_outcomes(verdict) {
            if p.check.is_slot() && o.allowed && matches!(src, Source::Store | Source::Local) {
                held.push((p.enforced(*src).into_owned(), *src));
                gauges.push(snap.rule_metrics[p.rule as usize].in_flight.clone());
            }
        }
        if held.is_empty() {
            return None;
        }
        self.limiter().hold(holder, held);
        Some(SlotGuard::new(self.clone(), holder, gauges))
    }
}
