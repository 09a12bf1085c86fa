//! The forward phase: the request made ready for the upstream (hop-by-hop headers stripped,
//! `X-Forwarded-*` and `Forwarded` added, trailers asked for when needed), sent with its retry
//! and deadline, and the response checked and streamed back (upgrades spliced). A request that
//! holds something until its exchange really ends is forwarded and settled in a task of its
//! own ([`held`]), so that its client leaving does not end the exchange.

use std::sync::Arc;
use std::time::Instant;

use http::{header, HeaderValue, Method, Request, Response, Version};
use hyper::upgrade::OnUpgrade;
use hyper_util::rt::TokioIo;

use crate::http::respond::GatewayError;
use crate::http::upstream::{self as up, Replay};
use crate::http::{forward, ProxyBody};
use crate::state::State;

use super::ctx::Exchange;
use super::{access, slots};

/// Forward `req` and return the upstream's response. A request that holds slots or waits to be
/// settled keeps its upstream exchange going even if its client leaves, and is settled there
/// ([`held`]); what it holds is then no longer in `x.admitted`.
pub(super) async fn phase(
    gw: &Arc<State>,
    x: &mut Exchange<'_>,
    req: Request<ProxyBody>,
) -> Result<Response<ProxyBody>, GatewayError> {
    // A cost reported in a trailer: ask the upstream for trailers (an HTTP/1.1 server sends
    // them only to a request that says `TE: trailers`). A cost in the body: ask for it
    // uncompressed, so that it can be read.
    let mut want_trailers = false;
    let mut want_plain = false;
    for (ri, slot, _) in &x.admitted.after {
        match x.snap.rules.rules[*ri as usize].spend_of_slot(*slot).cost_from {
            Some(cf) if cf.json().is_some() => want_plain = true,
            Some(_) => want_trailers = true,
            None => {}
        }
    }
    // A request refused on its way out (CONNECT) is settled like an upstream error (the settle
    // phase): a `count_when` rule it does not match gets its reservation back.
    let mut out = gw.outbound(req, x, (want_trailers, want_plain))?;
    let holds = x.admitted.holds();
    out.permit = x.admitted.permit.take();
    if holds {
        held(gw, x, out).await
    } else {
        gw.forward(out, None, x.note()).await.map(|(r, _)| r)
    }
}

/// A request made ready for the upstream.
pub(super) struct Outbound {
    /// The request as it is sent: origin-form URI, HTTP/1.1, hop-by-hop headers gone, this hop
    /// appended to the forwarding headers.
    req: Request<ProxyBody>,
    /// The client's side of an upgrade it asked for.
    client_upgrade: Option<OnUpgrade>,
    /// Whether a failed attempt may be sent again ([`up::Retry`]): `None` no; `Some(None)`
    /// only when it was never written; `Some(Some(copy))` from this copy.
    replay: Option<Option<Replay>>,
    /// When the request head reached the request path.
    arrived: Instant,
    /// Its room under the adaptive concurrency limit: its latency is recorded when the
    /// response head arrives, and it is given back when the response body ends (at once for an
    /// upgrade or a failed exchange).
    permit: Option<crate::adaptive::Permit>,
    /// When the request's body had all been sent (adaptive requests with a body only): the
    /// latency sample starts there.
    body_ended: Option<Arc<std::sync::OnceLock<Instant>>>,
}

impl State {
    /// Make `req` ready to forward: strip its hop-by-hop headers, add this hop to
    /// `X-Forwarded-*` and `Forwarded`, ask for trailers when the client (or a rule reading its
    /// cost from one) wants them, and keep what a retry needs.
    fn outbound(
        &self,
        mut req: Request<ProxyBody>,
        x: &Exchange<'_>,
        (want_trailers, want_plain): (bool, bool),
    ) -> Result<Outbound, GatewayError> {
        let facts = &x.facts;
        if req.method() == Method::CONNECT {
            return Err(GatewayError::BadRequest("CONNECT is not supported"));
        }
        // Only allow-listed upgrades (`server.upgrades`) pass. Any other (`h2c`, say) is
        // forwarded as a plain request: an upgraded connection is one request to the limits,
        // and a tunnel of HTTP/2 through it would pass every later request unchecked.
        let upgrade = super::facts::upgrade_of(req.headers(), facts)
            .filter(|v| forward::upgrade_allowed(v, &self.config().server.upgrades));
        let client_upgrade = upgrade.as_ref().map(|_| hyper::upgrade::on(&mut req));
        let body_is_end = hyper::body::Body::is_end_stream(req.body());
        let (mut parts, body) = req.into_parts();
        let h = &mut parts.headers;
        let host = facts.host.clone().or_else(|| {
            parts
                .uri
                .authority()
                .and_then(|a| HeaderValue::from_str(a.as_str()).ok())
        });
        // Trailers pass through (gRPC's status is one): a client that accepts them asks the
        // upstream for them too, as does a rule that reads its cost from one.
        forward::strip_hop_by_hop(h, upgrade);
        if !facts.traced {
            // W3C trace context (`http::trace`): continued, or started here.
            crate::http::trace::ensure(h, false);
        }
        if want_trailers || facts.te_trailers {
            h.insert(header::TE, HeaderValue::from_static("trailers"));
        }
        if want_plain {
            h.insert(header::ACCEPT_ENCODING, HeaderValue::from_static("identity"));
        }
        forward::add_forwarded_proto(h, x.peer.addr.ip(), host.as_ref(), self.config().tls.is_some());
        // HTTP/2 requests carry the host in the URI; a `Connection` may have named `Host`.
        if let Some(host) = host.filter(|_| !h.contains_key(header::HOST)) {
            h.insert(header::HOST, host);
        }
        parts.uri = forward::origin_form(parts.uri.path_and_query());
        parts.version = Version::HTTP_11;
        // hyper's own markers of the client's connection are not the upstream's.
        parts.extensions.clear();
        let mut body = body;
        let mut body_ended = None;
        if x.admitted.permit.is_some() && !body_is_end {
            let ended = Arc::new(std::sync::OnceLock::new());
            body = ProxyBody::boxed(super::admit::TimedBody {
                inner: body,
                ended: ended.clone(),
            });
            body_ended = Some(ended);
        }
        let req = Request::from_parts(parts, body);
        // A retry may replay this request. With one target nothing is copied:
        // only an attempt that was never written is sent again.
        let replay =
            (client_upgrade.is_none() && up::replayable(req.method(), req.headers(), body_is_end)).then(|| {
                (self.upstream().len() > 1).then(|| Replay {
                    method: req.method().clone(),
                    uri: req.uri().clone(),
                    headers: req.headers().clone(),
                })
            });
        Ok(Outbound {
            req,
            arrived: x.arrived,
            client_upgrade,
            replay,
            permit: None,
            body_ended,
        })
    }

    /// Send `out` upstream (with its retry, within `request_timeout`) and return its streamed
    /// response, hop-by-hop headers stripped, with the request's `slots` for its body to hold
    /// (`None` when an upgrade took them: they stay held while the upgraded connection is
    /// open). An error ends the exchange, and releases the slots.
    async fn forward(
        &self,
        out: Outbound,
        slots: Option<slots::SlotGuard>,
        note: Option<&mut access::Note>,
    ) -> Result<(Response<ProxyBody>, Option<slots::SlotGuard>), GatewayError> {
        let Outbound {
            req,
            client_upgrade,
            replay,
            arrived,
            mut permit,
            body_ended,
        } = out;
        let method = req.method().clone(); // for the error log; no allocation for standard methods
        let path = req.uri().clone(); // the same: a reference count
        let retry = match &replay {
            None => up::Retry::No,
            Some(None) => up::Retry::Unsent,
            Some(Some(r)) => up::Retry::Copy(r),
        };
        let started = Instant::now();
        // A coarse deadline (`http::coarse_timer`): within a few ms, and cheaper than a
        // tokio timer registered and cancelled for every request.
        let result =
            crate::rt::coarse_timer::timeout(self.config().upstream.request_timeout, self.upstream().send(req, retry))
                .await;
        let waited = started.elapsed();
        if let Some(p) = permit.as_mut() {
            // The upstream's part only: from when it had the whole request.
            let from = body_ended.as_ref().and_then(|e| e.get().copied());
            let latency = from.map_or(waited, |t| t.elapsed());
            let body_sent = body_ended.as_ref().is_none_or(|e| e.get().is_some());
            // An answer below 500 is a good sample; no answer, or a 5xx, a failure. A failure
            // of the client's making (a body cut off or too large, a timeout while it was still
            // uploading) or of this gateway's (its connection cap) says nothing of the upstream.
            let sample = match &result {
                Ok(Ok(x)) => Some(x.response.status().as_u16() < 500),
                Err(_) => body_sent.then_some(false),
                Ok(Err(f)) if body_over_limit(&f.error) || client_body_failed(&f.error) || f.error.is_saturated() => {
                    None
                }
                Ok(Err(_)) => Some(false),
            };
            if let Some(ok) = sample {
                p.sample(latency, ok);
            }
        }
        self.metrics().upstream.latency.observe(waited.as_secs_f64());
        // Everything but the upstream's own wait: limits, queueing, forwarding.
        let overhead = arrived.elapsed().saturating_sub(waited);
        self.metrics().traffic.overhead.observe(overhead.as_secs_f64());
        if let Some(n) = note {
            n.upstream_us = u64::try_from(waited.as_micros()).unwrap_or(u64::MAX);
            match &result {
                Ok(Ok(x)) => (n.target, n.attempts) = (Some(x.target.clone()), x.attempts),
                Ok(Err(f)) => (n.target, n.attempts) = (Some(f.target.clone()), f.attempts),
                Err(_) => {}
            }
        }
        let mut resp = match result {
            Err(_) => {
                self.metrics().upstream.status[5].inc();
                if let Some(suppressed) = self.upstream_log().allow() {
                    tracing::warn!(method = %method, path = %path.path(), upstream = %self.config().upstream.authority, timeout_ms = self.config().upstream.request_timeout.as_millis() as u64, suppressed, "upstream timed out (repeats logged at most once a second, `suppressed` counts the others)");
                }
                return Err(GatewayError::GatewayTimeout);
            }
            Ok(Err(f)) if body_over_limit(&f.error) => {
                // A body without Content-Length (chunked, HTTP/2) went over `max_body_bytes`
                // while it streamed: the upstream got an aborted body, never a complete one.
                return Err(GatewayError::PayloadTooLarge);
            }
            Ok(Err(f)) if client_body_failed(&f.error) => {
                // The client's own body broke off or did not parse (a bad chunk size, say):
                // its fault, not the upstream's.
                return Err(GatewayError::BadRequest("malformed or incomplete request body"));
            }
            Ok(Err(f)) if f.error.is_saturated() => {
                if let Some(suppressed) = self.upstream_log().allow() {
                    tracing::warn!(method = %method, path = %path.path(), upstream = %f.target, suppressed, "upstream connection cap reached (upstream.max_connections_per_target); answered 503 (repeats logged at most once a second, `suppressed` counts the others)");
                }
                return Err(GatewayError::Unavailable("the upstream connection limit is reached"));
            }
            Ok(Err(f)) => {
                self.metrics().upstream.status[5].inc();
                if let Some(suppressed) = self.upstream_log().allow() {
                    tracing::warn!(method = %method, path = %path.path(), upstream = %f.target, attempts = f.attempts, error = %f.error, suppressed, "upstream request failed (repeats logged at most once a second, `suppressed` counts the others)");
                }
                return Err(GatewayError::BadGateway(f.error.to_string()));
            }
            Ok(Ok(x)) => x.response,
        };
        let class = (resp.status().as_u16() / 100).clamp(1, 5) as usize - 1;
        self.metrics().upstream.status[class].inc();
        self.metrics().traffic.upstream_response(resp.status().as_u16());

        if resp.status() == http::StatusCode::SWITCHING_PROTOCOLS {
            let Some(client_up) = client_upgrade else {
                // A 101 the client never asked for would hand it a connection in a protocol
                // it does not speak: refuse it (the upstream connection is dropped with it).
                if let Some(suppressed) = self.upstream_log().allow() {
                    tracing::warn!(method = %method, path = %path.path(), upstream = %self.config().upstream.authority, suppressed, "upstream answered 101 to a request that asked for no upgrade");
                }
                return Err(GatewayError::BadGateway(
                    "the upstream switched protocols for a request that asked for no upgrade".into(),
                ));
            };
            {
                let upstream_up = hyper::upgrade::on(&mut resp);
                tokio::spawn(async move {
                    // The request's slots stay held while the upgraded connection is open.
                    let _slots = slots;
                    match tokio::try_join!(client_up, upstream_up) {
                        Ok((c, u)) => {
                            let mut c = TokioIo::new(c);
                            let mut u = TokioIo::new(u);
                            let _ = tokio::io::copy_bidirectional(&mut c, &mut u).await;
                        }
                        Err(e) => tracing::debug!(error = %e, "upgrade failed"),
                    }
                });
            }
            let keep = resp.headers().get(header::UPGRADE).cloned();
            forward::strip_hop_by_hop(resp.headers_mut(), keep);
            // An upgraded connection is one request to the adaptive limit: its room is given
            // back here, at the 101 (a long-lived websocket would otherwise hold it for hours).
            drop(permit);
            return Ok((resp.map(ProxyBody::Upstream), None));
        }
        forward::strip_hop_by_hop(resp.headers_mut(), None);
        let resp = match permit {
            None => resp.map(ProxyBody::Upstream),
            Some(p) => resp.map(|b| {
                ProxyBody::boxed(super::admit::PermitBody {
                    inner: ProxyBody::Upstream(b),
                    permit: Some(p),
                })
            }),
        };
        Ok((resp, slots))
    }
}

/// [`State::forward`] for a request that holds something until its upstream exchange really
/// ends (concurrency slots, reservations of response-dependent rules), taken from
/// `x.admitted`, then settled ([`State::settle_after`]). The exchange runs in a task of its
/// own, so a client that goes away (this future dropped) does not end it: the upstream
/// request goes on within `request_timeout`, its response is settled all the same, and a body
/// no client reads is drained (`settle::HeldBody`) before the slots are released.
async fn held(gw: &Arc<State>, x: &mut Exchange<'_>, out: Outbound) -> Result<Response<ProxyBody>, GatewayError> {
    let (slots, after) = (x.admitted.slots.take(), std::mem::take(&mut x.admitted.after));
    let (gw, snap) = (gw.clone(), x.snap.clone());
    let note = x.note();
    let logged = note.is_some();
    let (tx, rx) = tokio::sync::oneshot::channel();
    // Shutdown waits for this exchange, and then for what its response holds (`settle::Hold`).
    let pending = gw.limiter().pending();
    tokio::spawn(async move {
        let _pending = pending;
        let mut n = logged.then(access::Note::default);
        let (result, slots) = match gw.forward(out, slots, n.as_mut()).await {
            Ok((r, s)) => (Ok(r), s),
            Err(e) => (Err(e), None),
        };
        let result = gw.settle_after(&snap, after, result, slots);
        // Without a client to take it, the response is dropped here: a body that still
        // holds something is then read to its end by a task of its own.
        let _ = tx.send((result, n));
    });
    match rx.await {
        Ok((result, n)) => {
            if let (Some(note), Some(n)) = (note, n) {
                (note.target, note.attempts, note.upstream_us) = (n.target, n.attempts, n.upstream_us);
            }
            result
        }
        // The task ended without an answer (it panicked): the exchange is over.
        Err(_) => Err(GatewayError::BadGateway(
            "the upstream exchange ended unexpectedly".into(),
        )),
    }
}

/// Did the upstream request (or the read of a request body) fail because the client's body
/// went over `max_body_bytes`?
pub(super) fn body_over_limit(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur = Some(e);
    while let Some(err) = cur {
        if err.is::<http_body_util::LengthLimitError>() {
            return true;
        }
        cur = err.source();
    }
    false
}

/// Did the upstream request fail because the client's request body failed as it was read (a
/// malformed chunk, a connection closed mid-body)? The upstream client reports a body that
/// failed as its "user" error, caused by the error of the client's side: another
/// `hyper::Error`, from reading the incoming body.
fn client_body_failed(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur = Some(e);
    let mut outer_user = false;
    while let Some(err) = cur {
        if let Some(h) = err.downcast_ref::<hyper::Error>() {
            if outer_user {
                return true;
            }
            if !h.is_user() {
                return false;
            }
            outer_user = true;
        }
        cur = err.source();
    }
    false
}
