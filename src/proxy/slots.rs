//! Concurrency slots held by one request: taken with the request's other limits, released when
//! the response body ends or fails, when the client goes away (the request's future, or the
//! body, is dropped), or when an upgraded connection closes.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use hyper::body::{Body, Frame, SizeHint};
use prometheus_client::metrics::gauge::Gauge;

use crate::http::{BoxError, ProxyBody};
use crate::limiter::{local_share, FailurePolicy, Source, Verdict};
use crate::state::State;

use super::plan::RequestPlan;

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

/// A response body that keeps the request's slots until it ends, fails or is dropped.
pub(crate) struct GuardedBody {
    /// The upstream's body.
    inner: ProxyBody,
    /// `None` once released.
    guard: Option<SlotGuard>,
}

impl GuardedBody {
    /// `inner`, releasing `guard` with it.
    pub(crate) fn new(inner: ProxyBody, guard: SlotGuard) -> Self {
        GuardedBody {
            inner,
            guard: Some(guard),
        }
    }
}

impl Body for GuardedBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let r = Pin::new(&mut self.inner).poll_frame(cx);
        if matches!(r, Poll::Ready(None) | Poll::Ready(Some(Err(_)))) {
            self.guard = None;
        }
        r
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
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
        for (p, (o, src)) in plan.checks.iter().zip(&verdict.outcomes) {
            if p.check.is_slot() && o.allowed && matches!(src, Source::Store | Source::Local) {
                let c = match (src, p.policy) {
                    (Source::Local, FailurePolicy::Local { share }) => local_share(&p.check, share),
                    _ => p.check.clone(),
                };
                held.push((c, *src));
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
