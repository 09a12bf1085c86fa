//! Quota that depends on the response: `count_when` refunds a reservation whose response does
//! not match, `cost_from` settles a reservation against the cost the upstream reports in a
//! response header or, for a streamed response, in a trailer.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use hyper::body::{Body, Frame, SizeHint};

use crate::http::{BoxError, ProxyBody};
use crate::limiter::{LimitCheck, Source};
use crate::rules::CostFrom;
use crate::state::State;

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
