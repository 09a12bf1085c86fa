//! The admit phase (adaptive concurrency, ARCHITECTURE.md "Adaptive concurrency"): an
//! admitted request takes room under the upstream's adaptive limit before it is forwarded,
//! waiting up to its priority class's queue time; refused, it gets a 503 naming its class,
//! and what its rules reserved is settled as for any answer the upstream did not give.

use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};
use std::time::Instant;

use bytes::Bytes;
use hyper::body::{Body, Frame, SizeHint};

use crate::adaptive::Permit;
use crate::http::respond::GatewayError;
use crate::http::{BoxError, ProxyBody};
use crate::state::{Snapshot, State, NO_CLASS};

use super::ctx::Exchange;

/// Take room for `x` (kept in `x.admitted.permit`, then by the upstream exchange until the
/// response body ends), or the 503 of its class. Nothing to do when `upstream.adaptive` is off.
pub(super) async fn phase(gw: &Arc<State>, x: &mut Exchange<'_>) -> Result<(), GatewayError> {
    let Some(adaptive) = gw.adaptive() else {
        return Ok(());
    };
    let class = class_of(&x.snap, x, adaptive.config().default_class());
    match adaptive.acquire(class).await {
        Ok(permit) => {
            x.admitted.permit = Some(permit);
            Ok(())
        }
        Err(why) => Err(GatewayError::Overloaded {
            class: adaptive.class_name(class),
            reason: why.as_str(),
        }),
    }
}

/// The highest class any rule chosen for the request names, else `default`.
fn class_of(snap: &Snapshot, x: &Exchange<'_>, default: usize) -> usize {
    let named = x
        .plan
        .as_ref()
        .into_iter()
        .flat_map(|p| p.checks.iter())
        .filter_map(|c| snap.rule_class.get(c.rule as usize).copied())
        .filter(|c| *c != NO_CLASS)
        .min();
    named.map_or(default, usize::from)
}

/// A request body that notes when it ended (`ended`), so that the latency sample of a request
/// whose client uploads slowly starts when the upstream had the whole request, not before.
pub(super) struct TimedBody {
    pub(super) inner: ProxyBody,
    pub(super) ended: Arc<OnceLock<Instant>>,
}

impl Body for TimedBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let r = Pin::new(&mut self.inner).poll_frame(cx);
        // The upstream client may stop polling at the last frame (the body says it has ended)
        // instead of polling for the end.
        let ended = match &r {
            Poll::Ready(None) => true,
            Poll::Ready(Some(Ok(_))) => self.inner.is_end_stream(),
            _ => false,
        };
        if ended {
            let _ = self.ended.set(Instant::now());
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

/// An upstream response body that holds the request's room under the adaptive limit until it
/// ends, fails or is dropped: a streamed answer counts for as long as the upstream sends it.
pub(super) struct PermitBody {
    pub(super) inner: ProxyBody,
    pub(super) permit: Option<Permit>,
}

impl Body for PermitBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let r = Pin::new(&mut self.inner).poll_frame(cx);
        if let Poll::Ready(None | Some(Err(_))) = &r {
            self.permit = None;
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
