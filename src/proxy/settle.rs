//! Quota that depends on the response: `count_when` refunds a reservation whose response does
//! not match, `cost_from` settles a reservation against the cost the upstream reports in a
//! response header or, for a streamed response, in a trailer. Also the refund of a leaky-bucket
//! client that leaves while it waits its turn.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use hyper::body::{Body, Frame, SizeHint};

use http::Response;

use crate::http::respond::GatewayError;
use crate::http::{BoxError, ProxyBody};
use crate::limiter::{local_share, FailurePolicy, LimitCheck, Source, Verdict};
use crate::rules::CostFrom;
use crate::state::State;

use super::plan::RequestPlan;

/// What one rule of an admitted request reserved: its checks, each with the instant its check
/// was decided and the store that decided it.
pub(crate) type Reserved = Vec<(LimitCheck, u64, Source)>;

/// Refund `spent` in a spawned task (the response does not wait for it).
pub(crate) fn spawn_refund(gw: &Arc<State>, spent: Reserved) {
    let gw = gw.clone();
    tokio::spawn(async move { gw.limiter().refund(&spent).await });
}

/// Settle `spent` against the reported cost `actual` in a spawned task.
pub(crate) fn spawn_settle(gw: &Arc<State>, spent: Reserved, actual: u64) {
    let gw = gw.clone();
    tokio::spawn(async move { gw.limiter().settle(&spent, actual).await });
}

/// A response body that settles reservations when a trailer reports the real cost. A body that
/// ends without the trailer leaves the estimate spent.
pub(crate) struct SettleBody {
    /// The upstream's body.
    inner: ProxyBody,
    /// The gateway (for its limiter).
    gw: Arc<State>,
    /// Per rule still waiting: where the cost is reported, and what it reserved.
    waiting: Vec<(CostFrom, Reserved)>,
}

impl SettleBody {
    /// `inner`, settling `waiting` from its trailers.
    pub(crate) fn new(inner: ProxyBody, gw: Arc<State>, waiting: Vec<(CostFrom, Reserved)>) -> Self {
        SettleBody { inner, gw, waiting }
    }
}

impl Body for SettleBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let r = Pin::new(&mut self.inner).poll_frame(cx);
        if let Poll::Ready(Some(Ok(frame))) = &r {
            if let Some(trailers) = frame.trailers_ref() {
                let waiting = std::mem::take(&mut self.waiting);
                for (cf, spent) in waiting {
                    match trailers.get(&cf.header).and_then(|v| cf.parse(v)) {
                        Some(actual) => spawn_settle(&self.gw, spent, actual),
                        None => {
                            tracing::debug!(header = %cf.header, "no usable cost in the trailers; the estimate stays spent")
                        }
                    }
                }
            }
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
    /// Settle what response-dependent rules reserved, now that the response (or the error that
    /// replaced it) is known: refund a `count_when` rule whose status does not match; settle a
    /// `cost_from` rule from the response header, or from the trailers as the body streams.
    pub(super) fn settle_after(
        self: &Arc<Self>,
        snap: &crate::state::Snapshot,
        after: Vec<(u32, Reserved)>,
        result: Result<Response<ProxyBody>, GatewayError>,
    ) -> Result<Response<ProxyBody>, GatewayError> {
        let status = match &result {
            Ok(r) => r.status().as_u16(),
            Err(e) => e.status().as_u16(),
        };
        let mut waiting = Vec::new();
        for (ri, spent) in after {
            let rule = &snap.rules.rules[ri as usize];
            if rule.count_when.as_ref().is_some_and(|m| !m.matches(status)) {
                spawn_refund(self, spent);
                continue;
            }
            let (Some(cf), Ok(resp)) = (&rule.cost_from, &result) else {
                continue;
            };
            match resp.headers().get(&cf.header) {
                Some(v) => match cf.parse(v) {
                    Some(actual) => spawn_settle(self, spent, actual),
                    None => {
                        tracing::debug!(rule = %rule.name, header = %cf.header, "unusable cost header; the estimate stays spent")
                    }
                },
                None => waiting.push((cf.clone(), spent)),
            }
        }
        let resp = result?;
        Ok(if waiting.is_empty() {
            resp
        } else {
            let gw = self.clone();
            resp.map(|b| ProxyBody::boxed(SettleBody::new(b, gw, waiting)))
        })
    }
}

/// What each `count_when` / `cost_from` rule of an admitted request reserved, by rule.
pub(super) fn reserved_by_response_rules(
    snap: &crate::state::Snapshot,
    plan: &RequestPlan,
    verdict: &Verdict,
) -> Vec<(u32, Reserved)> {
    let mut out: Vec<(u32, Reserved)> = Vec::new();
    for (p, (o, src)) in plan.checks.iter().zip(&verdict.outcomes) {
        let rule = &snap.rules.rules[p.rule as usize];
        if (rule.count_when.is_none() && rule.cost_from.is_none())
            || !o.allowed
            || p.check.cost == 0
            || !matches!(src, Source::Store | Source::Local)
        {
            continue;
        }
        let c = match (src, p.policy) {
            (Source::Local, FailurePolicy::Local { share }) => local_share(&p.check, share),
            _ => p.check.clone(),
        };
        match out.last_mut() {
            Some((ri, v)) if *ri == p.rule => v.push((c, o.at_us, *src)),
            _ => out.push((p.rule, vec![(c, o.at_us, *src)])),
        }
    }
    out
}

/// Gives back a leaky-bucket slot, and everything else the request spent, when the waiting
/// request is dropped (client disconnected): each in the store and the window it was spent in.
pub(super) struct RefundGuard {
    /// The gateway (for its limiter).
    pub(super) gw: Arc<State>,
    /// What to refund; `None` once the request went through.
    pub(super) spent: Option<Vec<(LimitCheck, u64, Source)>>,
}

impl Drop for RefundGuard {
    fn drop(&mut self) {
        if let Some(spent) = self.spent.take() {
            let gw = self.gw.clone();
            if let Ok(h) = tokio::runtime::Handle::try_current() {
                h.spawn(async move {
                    gw.limiter().refund(&spent).await;
                    tracing::debug!("client left while queued; leaky-bucket slot refunded");
                });
            }
        }
    }
}
