//! The settle phase: quota that depends on the response, and the response's rate-limit
//! headers. Quota that depends on the response: `count_when` refunds a reservation whose response does
//! not match, `cost_from` settles a reservation against the cost the upstream reports in a
//! response header or, for a streamed response, in a trailer. Also what a response holds until
//! its upstream exchange really ends (its concurrency slots, the reservations still waiting for
//! a trailer), and the refund of a leaky-bucket client that leaves while it waits its turn.
//!
//! A client that leaves never ends the exchange early: the upstream's answer is still read
//! (and discarded), for at most `upstream.request_timeout`, so slots stay held while the
//! upstream works and a cost it reports is still charged. What a `cost_from` rule charges:
//! - the cost the upstream reports (header or trailer), at most `max`, whether or not the client
//!   stayed to read it;
//! - the estimate when the exchange ended without a usable report (the response had none, the
//!   upstream failed or timed out): what the client would have paid had it stayed;
//! - `max` when the client left and tollgate stopped reading after `request_timeout` without
//!   the report: the real cost is unknown and may be anything up to `max`, and leaving must
//!   never cost less than staying would have.
//!
//! A cost in the body (`cost_from: {json: usage.total_tokens}`) is read as the body streams
//! through ([`crate::usage::Scanner`]: nothing is buffered, no byte is held back) and settled
//! when the body ends ([`body_charge`]): the number reported, at most `max`, when the body was
//! whole and valid; the reservation when it had no such number; the reservation or the number
//! found, whichever is larger, when the body was malformed, compressed or cut off, or its
//! client left before the end (leaving never refunds).

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Response};
use http_body_util::BodyExt;
use hyper::body::{Body, Frame, SizeHint};
use tokio::task::JoinHandle;

use crate::http::respond::GatewayError;
use crate::http::{BoxError, ProxyBody};
use crate::limiter::{LimitCheck, Source, Verdict};
use crate::rules::CostFrom;
use crate::state::State;
use crate::usage::Completeness;

use super::ctx::{self, Exchange, Reserved};
use super::slots::SlotGuard;
use crate::engine::plan::RequestPlan;

/// Refund `spent` in a spawned task (the response does not wait for it).
pub(crate) fn spawn_refund(gw: &Arc<State>, spent: Reserved) {
    let gw = gw.clone();
    tokio::spawn(async move { gw.limiter().refund(&spent).await });
}

/// Settle `spent` against the reported cost `actual` in a spawned task; its handle says when
/// the settlement has landed.
pub(crate) fn spawn_settle(gw: &Arc<State>, spent: Reserved, actual: u64) -> JoinHandle<()> {
    let gw = gw.clone();
    tokio::spawn(async move { gw.limiter().settle(&spent, actual).await })
}

/// What a response holds until its upstream exchange really ends: the request's concurrency
/// slots, and the reservations still waiting for the cost a trailer reports. Dropping it
/// settles what is still waiting (the estimate stays spent, or `max` is charged when the read
/// was cut short) and then, once every settlement of the request has landed, releases the
/// slots: a `cost_from` rule's in-flight cap is never freed before its debit counts.
pub(crate) struct Hold {
    /// The gateway (for its limiter).
    gw: Arc<State>,
    /// The request's slots, if it took any.
    slots: Option<SlotGuard>,
    /// Per rule still waiting: where the cost is reported, and what it reserved.
    waiting: Vec<(CostFrom, Reserved)>,
    /// Settlements under way (costs a header or a trailer reported).
    settling: Vec<JoinHandle<()>>,
    /// The client left and the rest of the answer was not read within `request_timeout`: what
    /// still waits is charged its `max`.
    cut: bool,
    /// The reservations waiting for a cost in the body, and the body's scan.
    body: Option<BodyCost>,
    /// The upstream's body reached its end.
    ended: bool,
    /// The client left before the end of the body's data (data came after it left).
    left: bool,
    /// Counts this response's exchange and settlements as under way (shutdown waits).
    _pending: crate::limiter::PendingGuard,
}

impl Hold {
    /// Scan a data frame of the body for its cost.
    fn feed(&mut self, data: &[u8]) {
        if let Some(b) = self.body.as_mut().filter(|b| !b.encoded) {
            b.scanner.feed(data);
        }
    }

    /// Settle each waiting reservation from `trailers`; one without a usable value keeps its
    /// estimate (the upstream answered, and reported nothing).
    fn trailers(&mut self, trailers: &HeaderMap) {
        for (cf, spent) in std::mem::take(&mut self.waiting) {
            let Some(header) = cf.header() else { continue };
            let reported = trailers
                .contains_key(header)
                .then(|| cf.parse_all(trailers.get_all(header)))
                .flatten();
            match reported {
                Some(actual) => self.settling.push(spawn_settle(&self.gw, spent, actual)),
                None => {
                    tracing::debug!(%header, "no usable cost in the trailers; the estimate stays spent")
                }
            }
        }
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        let waiting = std::mem::take(&mut self.waiting);
        let settling = std::mem::take(&mut self.settling);
        let slots = self.slots.take();
        let cut = self.cut;
        if !waiting.is_empty() && !cut {
            tracing::debug!("the response ended without its cost; the estimate stays spent");
        }
        let end = BodyEnd {
            ended: self.ended,
            left: self.left,
            cut,
            encoded: false,
            completeness: Completeness::Complete,
        };
        let pending = self.gw.limiter().pending();
        let (jobs, counted) = match self.body.take() {
            Some(b) => {
                let (jobs, counted) = b.finish(&self.gw, end);
                (jobs, Some(counted))
            }
            None => (Vec::new(), None),
        };
        if settling.is_empty() && jobs.is_empty() && (waiting.is_empty() || !cut) {
            drop(slots);
            return;
        }
        let gw = self.gw.clone();
        match tokio::runtime::Handle::try_current() {
            Ok(h) => {
                h.spawn(async move {
                    for s in settling {
                        let _ = s.await;
                    }
                    if cut {
                        for (cf, spent) in waiting {
                            tracing::debug!(source = %cf.source, max = cf.max, "the client left and the cost never came within upstream.request_timeout; charged max");
                            gw.limiter().settle(&spent, cf.max).await;
                        }
                    }
                    for (spent, to) in jobs {
                        gw.limiter().settle(&spent, to).await;
                    }
                    drop(counted);
                    drop(slots);
                    drop(pending);
                });
            }
            Err(_) => tracing::debug!("no runtime to settle a response's cost; the estimate stays spent"),
        }
    }
}

/// A response body that keeps its [`Hold`] until the upstream's body ends or fails, settling
/// reservations from its trailers on the way. Dropped before that (the client went away), it
/// hands the rest of the body and the hold to a task that reads it to its end, discarding the
/// data, for at most `upstream.request_timeout` ([`drain`]).
pub(crate) struct HeldBody {
    /// The upstream's body.
    inner: ProxyBody,
    /// `None` once released.
    hold: Option<Hold>,
}

impl Body for HeldBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        let r = Pin::new(&mut this.inner).poll_frame(cx);
        match &r {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(h) = this.hold.as_mut() {
                    if let Some(d) = frame.data_ref() {
                        h.feed(d);
                    } else if let Some(t) = frame.trailers_ref() {
                        h.trailers(t);
                    }
                }
            }
            Poll::Ready(None) => {
                if let Some(h) = this.hold.as_mut() {
                    h.ended = true;
                }
                this.hold = None;
            }
            Poll::Ready(Some(Err(_))) => this.hold = None,
            Poll::Pending => {}
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

impl Drop for HeldBody {
    fn drop(&mut self) {
        let Some(mut hold) = self.hold.take() else { return };
        if self.inner.is_end_stream() {
            hold.ended = true;
            return;
        }
        let body = std::mem::replace(&mut self.inner, crate::http::empty());
        let within = hold.gw.config().upstream.request_timeout;
        if let Ok(h) = tokio::runtime::Handle::try_current() {
            h.spawn(drain(body, hold, within));
        }
    }
}

/// Read what is left of an upstream response whose client went away, discarding the data (it
/// is never buffered), until it ends, fails or `within` passes: the exchange goes on as if the
/// client were there, so the slots stay held while the upstream works and a trailer's cost is
/// still learned. Cut short by `within`, what still waits for a cost is charged its `max`.
async fn drain(mut body: ProxyBody, mut hold: Hold, within: Duration) {
    let read = tokio::time::timeout(within, async {
        while let Some(frame) = body.frame().await {
            match frame {
                Ok(f) => {
                    if let Some(d) = f.data_ref() {
                        // Data the client never got: it left before the end (a client that
                        // read all the data and left before the end marker did not).
                        hold.left |= !d.is_empty();
                        hold.feed(d);
                    } else if let Some(t) = f.trailers_ref() {
                        hold.trailers(t);
                    }
                }
                Err(_) => return,
            }
        }
        hold.ended = true;
    })
    .await;
    if read.is_err() {
        hold.cut = true;
    }
}

/// Settle what `x.admitted` still holds against `result` (the upstream's response, or the
/// error that replaced it; [`State::settle_after`]), and give an admitted response the
/// rate-limit headers of its binding limit.
pub(super) fn phase(
    gw: &Arc<State>,
    x: &mut Exchange<'_>,
    result: Result<Response<ProxyBody>, GatewayError>,
) -> Result<Response<ProxyBody>, GatewayError> {
    let (after, slots) = (std::mem::take(&mut x.admitted.after), x.admitted.slots.take());
    let mut resp = gw.settle_after(&x.snap, after, result, slots)?;
    if let (Some(bound), Some(plan)) = (&x.admitted.binding, &x.plan) {
        let mut windows = Vec::new();
        let b = ctx::binding_of(plan, &x.snap, bound, &mut windows);
        let lim = &gw.config().limits;
        // The rate-limit headers and the request id: one regrowth at most.
        resp.headers_mut().reserve(6);
        crate::http::headers::write(resp.headers_mut(), &b, lim.ietf_headers, lim.legacy_headers, x.now_us);
    }
    Ok(resp)
}

impl State {
    /// Settle what response-dependent rules reserved, now that the response (or the error that
    /// replaced it) is known: refund a `count_when` rule whose status does not match; settle a
    /// `cost_from` rule from the response header, or from the trailers as the body streams.
    /// A response that still holds something (the request's `slots`, reservations waiting for
    /// a trailer) carries it in a [`HeldBody`] until its upstream exchange really ends; an
    /// error ends the exchange, and the slots with it.
    pub(super) fn settle_after(
        self: &Arc<Self>,
        snap: &crate::state::Snapshot,
        after: Vec<(u32, u8, Reserved)>,
        result: Result<Response<ProxyBody>, GatewayError>,
        slots: Option<SlotGuard>,
    ) -> Result<Response<ProxyBody>, GatewayError> {
        if after.is_empty() && slots.is_none() {
            return result;
        }
        let status = match &result {
            Ok(r) => r.status().as_u16(),
            Err(e) => e.status().as_u16(),
        };
        let mut waiting = Vec::new();
        let mut settling = Vec::new();
        let mut in_body: Vec<BodyWaiting> = Vec::new();
        for (ri, slot, spent) in after {
            let rule = &snap.rules.rules[ri as usize];
            if rule.count_when.as_ref().is_some_and(|m| !m.matches(status)) {
                spawn_refund(self, spent);
                continue;
            }
            let (Some(cf), Ok(resp)) = (rule.spend_of_slot(slot).cost_from, &result) else {
                continue;
            };
            let metrics = snap
                .cost_metrics
                .get(ri as usize)
                .and_then(|m| m.iter().find(|(s, _)| *s == slot))
                .map(|(_, h)| h);
            let Some(header) = cf.header() else {
                in_body.push(BodyWaiting {
                    rule: rule.name.clone(),
                    metrics: metrics.cloned(),
                    cf: cf.clone(),
                    path: 0,
                    spent,
                });
                continue;
            };
            if !resp.headers().contains_key(header) {
                waiting.push((cf.clone(), spent));
                continue;
            }
            match cf.parse_all(resp.headers().get_all(header)) {
                Some(actual) => {
                    let reserved = spent.iter().map(|(c, _, _)| c.cost).max().unwrap_or(0);
                    if let Some(m) = metrics {
                        m.settled(actual, reserved, Some(actual));
                    }
                    settling.push(spawn_settle(self, spent, actual));
                }
                None => {
                    tracing::debug!(rule = %rule.name, %header, "unusable cost header; the estimate stays spent")
                }
            }
        }
        let resp = result?;
        let body = (!in_body.is_empty()).then(|| body_cost(self, &resp, in_body));
        if slots.is_none() && waiting.is_empty() && body.is_none() {
            return Ok(resp);
        }
        let hold = Hold {
            gw: self.clone(),
            slots,
            waiting,
            settling,
            cut: false,
            body,
            ended: false,
            left: false,
            _pending: self.limiter().pending(),
        };
        Ok(resp.map(|b| {
            ProxyBody::boxed(HeldBody {
                inner: b,
                hold: Some(hold),
            })
        }))
    }
}

/// What each `count_when` / `cost_from` rule of an admitted request reserved, by rule and
/// spend (the checks of one spend settle against one reported cost).
pub(super) fn reserved_by_response_rules(
    snap: &crate::state::Snapshot,
    plan: &RequestPlan,
    verdict: &Verdict,
) -> Vec<(u32, u8, Reserved)> {
    let mut out: Vec<(u32, u8, Reserved)> = Vec::new();
    for (p, (o, src)) in plan.with_outcomes(verdict) {
        let rule = &snap.rules.rules[p.rule as usize];
        // A `cost_from` rule's in-flight cap is a slot, held with the response, not settled.
        if (rule.count_when.is_none() && rule.spend_of_slot(p.spend).cost_from.is_none())
            || p.check.is_slot()
            || !o.allowed
            || p.check.cost == 0
            || !matches!(src, Source::Store | Source::Local)
        {
            continue;
        }
        let c = p.enforced(*src).into_owned();
        match out.iter_mut().find(|(ri, slot, _)| *ri == p.rule && *slot == p.spend) {
            Some((_, _, v)) => v.push((c, o.at_us, *src)),
            None => out.push((p.rule, p.spend, vec![(c, o.at_us, *src)])),
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

mod body;
use body::{body_cost, BodyCost, BodyEnd, BodyWaiting};

#[cfg(test)]
mod tests;
