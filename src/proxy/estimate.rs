//! The estimate phase: a request whose limits reserve from its body (`estimate: {json:
//! max_tokens, …}`) has the start of its body read, at most `within` bytes, and each such
//! limit's cost set to the number found there before it is checked. What was read is sent
//! upstream first, then the rest of the body as it arrives: the upstream receives exactly the
//! bytes the estimate was read from.
//!
//! What a limit reserves (ARCHITECTURE.md, "Token budgets"):
//! - the largest number at any of its paths in a complete, valid JSON body, at least 1 and at
//!   most its `cost_from.max`;
//! - its `default` when such a body (or an empty one) has none of them;
//! - its `max` when the number cannot be known from the body: the body does not end within
//!   `within` bytes (a later duplicate could be larger), is not valid JSON, or is compressed;
//! - never more than the limit itself (a request asking for more than the whole budget
//!   reserves all of it, and its overshoot is bounded like any other);
//! - times the largest multiplier found at `times` (`n`: that many answers), when it has one.
//!
//! The bodies being read share one node-wide allowance ([`BUFFERED_MAX`] bytes): a request
//! that would take it past it stops reading and reserves `max`. So a flood of large bodies
//! (many HTTP/2 streams, each holding back its end) costs at most that much memory, whatever
//! `within` says; it only makes their reservations cautious.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{header, Request};
use http_body_util::BodyExt;
use hyper::body::{Body, Frame, SizeHint};

use crate::http::respond::GatewayError;
use crate::http::{BoxError, ProxyBody};
use crate::state::State;
use crate::usage::{BodyKind, Completeness, JsonPath, Scanner};

use super::ctx::Exchange;

/// The most request-body bytes the estimate phase holds at once, all requests together.
pub(super) const BUFFERED_MAX: usize = 64 * 1024 * 1024;

/// Request-body bytes the estimate phase holds now (read, not yet sent upstream).
static BUFFERED: AtomicUsize = AtomicUsize::new(0);

/// Bytes of the node-wide allowance one request holds; given back when dropped.
struct Allowance(usize);

impl Allowance {
    /// Take `n` more bytes of the allowance; false (nothing taken) when it would pass
    /// [`BUFFERED_MAX`].
    fn take(&mut self, n: usize) -> bool {
        let ok = BUFFERED
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |b| {
                b.checked_add(n).filter(|t| *t <= BUFFERED_MAX)
            })
            .is_ok();
        if ok {
            self.0 += n;
        }
        ok
    }
}

impl Drop for Allowance {
    fn drop(&mut self) {
        BUFFERED.fetch_sub(self.0, Ordering::AcqRel);
    }
}

/// Set the cost of every planned limit that reserves from the body, reading at most the largest
/// `within` of them from `req`'s body (which is put back, unchanged, for the upstream).
pub(super) async fn phase(gw: &State, x: &mut Exchange<'_>, req: &mut Request<ProxyBody>) -> Result<(), GatewayError> {
    if !x.snap.estimates {
        return Ok(());
    }
    let (Some(plan), rules) = (x.plan.as_mut(), &x.snap.rules.rules) else {
        return Ok(());
    };
    // A rule's in-flight cap is a concurrency slot: one per request, whatever it reserves.
    let estimate_of = |p: &crate::engine::PlannedCheck| {
        if p.check.is_slot() {
            return None;
        }
        let s = rules.get(p.rule as usize)?.spend_of_slot(p.spend);
        Some((s.estimate?, s.cost_from?.max))
    };
    let Some(within) = plan
        .checks
        .iter()
        .filter_map(|p| estimate_of(p).map(|(e, _)| e.within))
        .max()
    else {
        return Ok(());
    };
    let mut paths: Vec<JsonPath> = Vec::new();
    for (e, _) in plan.checks.iter().filter_map(estimate_of) {
        for p in e.paths.iter().chain(&e.times) {
            if !paths.contains(p) {
                paths.push(p.clone());
            }
        }
    }
    let encoded = req
        .headers()
        .get(header::CONTENT_ENCODING)
        .is_some_and(|v| !v.as_bytes().eq_ignore_ascii_case(b"identity"));
    let body = std::mem::replace(req.body_mut(), crate::http::empty());
    let within_time = gw.config().upstream.request_timeout;
    let read = tokio::time::timeout(
        within_time,
        read_prefix(body, within, Scanner::new(&paths, BodyKind::Json)),
    )
    .await;
    let prefix = match read {
        Ok(Ok(p)) => p,
        Ok(Err(e)) => return Err(e),
        Err(_) => {
            return Err(GatewayError::BadRequest(
                "the request body did not arrive within the time allowed",
            ))
        }
    };
    let known = !encoded && prefix.ended && (prefix.bytes == 0 || prefix.completeness == Completeness::Complete);
    let largest = |of: &[JsonPath]| {
        of.iter()
            .filter_map(|path| paths.iter().position(|q| q == path))
            .filter_map(|i| prefix.scanner.found(i))
            .max()
    };
    for p in plan.checks.iter_mut() {
        let Some((e, max)) = estimate_of(p) else { continue };
        let reserve = if known {
            let times = largest(&e.times).unwrap_or(1).max(1);
            largest(&e.paths).map_or(e.default, |n| n.saturating_mul(times).clamp(1, max))
        } else {
            max
        };
        p.check.cost = reserve.min(p.check.quota.limit.get());
    }
    *req.body_mut() = ProxyBody::boxed(Replayed {
        head: prefix.frames,
        rest: prefix.rest,
        _held: prefix.held,
    });
    Ok(())
}

/// The start of a request body, read and scanned.
struct Prefix {
    /// Its frames, in order, to send first.
    frames: VecDeque<Frame<Bytes>>,
    /// The body after them.
    rest: ProxyBody,
    /// The body ended within the prefix.
    ended: bool,
    /// Data bytes read.
    bytes: usize,
    /// The scan of the data read.
    scanner: Scanner,
    /// The scan's verdict when the body ended within the prefix.
    completeness: Completeness,
    /// Its share of the node-wide allowance, held until the frames are sent.
    held: Allowance,
}

/// Read `body` until it ends or at least `within` data bytes have arrived, or the node-wide
/// allowance runs out, scanning the data with `scanner`. A body over `server.max_body_bytes`
/// is a 413; one that fails (its client left) a 400.
async fn read_prefix(mut body: ProxyBody, within: usize, mut scanner: Scanner) -> Result<Prefix, GatewayError> {
    let mut frames = VecDeque::new();
    let mut bytes = 0usize;
    let mut ended = body.is_end_stream();
    let mut held = Allowance(0);
    let mut room = true;
    while !ended && room && bytes < within {
        match body.frame().await {
            None => ended = true,
            Some(Ok(f)) => {
                if let Some(d) = f.data_ref() {
                    bytes += d.len();
                    scanner.feed(d);
                    room = held.take(d.len());
                }
                let trailers = f.is_trailers();
                frames.push_back(f);
                ended = trailers || body.is_end_stream();
            }
            Some(Err(e)) => {
                return Err(if super::forward::body_over_limit(&*e) {
                    GatewayError::PayloadTooLarge
                } else {
                    GatewayError::BadRequest("the request body could not be read")
                })
            }
        }
    }
    let completeness = if ended {
        scanner.finish()
    } else {
        Completeness::Truncated
    };
    if !room {
        tracing::debug!(
            bytes,
            "request bodies being read for estimates hold the node's allowance; this one reserves max"
        );
    }
    Ok(Prefix {
        frames,
        rest: body,
        ended: ended && room,
        bytes,
        scanner,
        completeness,
        held,
    })
}

/// A request body whose start was read already: those frames first, then the rest.
struct Replayed {
    /// Frames read and not yet sent.
    head: VecDeque<Frame<Bytes>>,
    /// The body after them.
    rest: ProxyBody,
    /// Its share of the node-wide allowance.
    _held: Allowance,
}

impl Body for Replayed {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        match this.head.pop_front() {
            Some(f) => Poll::Ready(Some(Ok(f))),
            None => Pin::new(&mut this.rest).poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.head.is_empty() && self.rest.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        let held: u64 = self
            .head
            .iter()
            .filter_map(|f| f.data_ref().map(|d| d.len() as u64))
            .sum();
        let rest = self.rest.size_hint();
        let mut h = SizeHint::new();
        h.set_lower(rest.lower().saturating_add(held));
        if let Some(u) = rest.upper() {
            h.set_upper(u.saturating_add(held));
        }
        h
    }
}
