//! The log phase, around the others: the access line opened when the request arrives (when it
//! is sampled), and, once the response is made, what the client gets for the result (an error
//! rendered as a local answer), the request's metrics, its request id and the drain's
//! `Connection: close`. The line itself is written when the body ends, or as a 499 when the
//! client leaves first (`access`).

use http::{header, Request, Response, Version};
use hyper::body::Incoming;

use crate::http::request_id::X_REQUEST_ID;
use crate::http::respond::{GatewayError, LocalAnswer};
use crate::http::ProxyBody;
use crate::state::State;

use super::access;
use super::ctx::Exchange;

/// Open the request's access line when the sampler takes it, or its record when spans are
/// exported (a line only exported copies no host or user agent, and writes no log line).
pub(super) fn open(gw: &State, x: &mut Exchange<'_>, req: &mut Request<Incoming>) {
    let logged = gw.access_sampler().take();
    if !logged && gw.exporter().is_none() {
        return;
    }
    // The trace context now, for the line and the span; a request neither logged nor exported
    // gets it only when it is forwarded (`forward::outbound`), so a 429 costs nothing for it.
    let (trace, span) = access::trace(req.headers_mut(), gw.exporter());
    x.facts.traced = true;
    x.pending.line = Some(access::Line {
        id: x.id.clone(),
        started: x.arrived,
        method: req.method().clone(),
        uri: req.uri().clone(),
        client: x.peer.addr,
        tls: x.peer.tls,
        protocol: match req.version() {
            Version::HTTP_10 => "HTTP/1.0",
            Version::HTTP_2 => "HTTP/2",
            _ => "HTTP/1.1",
        },
        host: logged
            .then(|| {
                req.uri()
                    .authority()
                    .and_then(|a| http::HeaderValue::from_str(a.as_str()).ok())
                    .or_else(|| req.headers().get(header::HOST).cloned())
            })
            .flatten(),
        user_agent: logged.then(|| req.headers().get(header::USER_AGENT).cloned()).flatten(),
        bytes_in: x.facts.content_length.and_then(Result::ok),
        trace_id: trace.trace_id_hex(),
        note: access::Note {
            logged,
            ..access::Note::default()
        },
        span,
    });
}

/// The response for `result`, with the request's metrics, its request id and, while draining,
/// `Connection: close`; its body writes the access line when it ends.
pub(super) fn phase(
    gw: &State,
    x: &mut Exchange<'_>,
    result: Result<Response<ProxyBody>, GatewayError>,
) -> Response<ProxyBody> {
    let mut resp = answer(gw, result, x.facts.grpc, x.note());
    gw.metrics().traffic.duration.observe(x.arrived.elapsed().as_secs_f64());
    // Taken, not cloned: the request id has no other reader once the response is made.
    let id = std::mem::replace(&mut x.id, http::HeaderValue::from_static(""));
    resp.headers_mut().insert(X_REQUEST_ID.clone(), id);
    if gw.draining() {
        // The drain window: the client's next request goes on a new connection, which the
        // balancer no longer sends here (HTTP/2 connections got GOAWAY instead).
        gw.drained_request();
        if x.http1 && resp.status() != http::StatusCode::SWITCHING_PROTOCOLS {
            resp.headers_mut()
                .insert(header::CONNECTION, http::HeaderValue::from_static("close"));
        }
    }
    match x.pending.answered() {
        Some(l) => {
            let status = resp.status().as_u16();
            resp.map(|b| ProxyBody::boxed(access::LoggedBody::new(b, l, status)))
        }
        None => resp,
    }
}

/// What the client gets for `result`: the response, or the error's; a gRPC client gets
/// limits and local failures as gRPC statuses.
fn answer(
    gw: &State,
    result: Result<Response<ProxyBody>, GatewayError>,
    grpc: bool,
    note: Option<&mut access::Note>,
) -> Response<ProxyBody> {
    match result {
        Ok(r) => r,
        Err(e) => {
            if let Some(n) = note {
                n.decision = match &e {
                    GatewayError::LimiterUnavailable { rule, .. } => {
                        n.rule = Some(rule.as_str().into());
                        "unavailable"
                    }
                    GatewayError::Overloaded { .. } => "overloaded",
                    _ if n.decision.is_empty() => "error",
                    _ => n.decision,
                };
            }
            gw.metrics().traffic.local_response(e.status().as_u16());
            LocalAnswer::from(e).render(grpc)
        }
    }
}
