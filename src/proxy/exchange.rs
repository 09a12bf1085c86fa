//! The exchange with the upstream: the request made ready to forward (hop-by-hop headers
//! stripped, `X-Forwarded-*` and `Forwarded` added, trailers asked for when needed), sent with
//! its retry and deadline, and the response checked and streamed back (upgrades spliced).

use std::net::SocketAddr;
use std::time::Instant;

use http::{header, HeaderValue, Method, Request, Response, Version};
use http_body_util::Limited;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;

use crate::http::respond::GatewayError;
use crate::http::upstream::{self as up, Replay};
use crate::http::{forward, ProxyBody};
use crate::state::State;

use super::{access, slots};

impl State {
    /// Send the request upstream and return its streamed response.
    pub(super) async fn forward(
        &self,
        mut req: Request<Incoming>,
        peer: SocketAddr,
        slots: Option<slots::SlotGuard>,
        want_trailers: bool,
        note: Option<&mut access::Note>,
    ) -> Result<Response<ProxyBody>, GatewayError> {
        let upgrade = forward::upgrade_of(req.headers());
        let client_upgrade = upgrade.as_ref().map(|_| hyper::upgrade::on(&mut req));
        let body_is_end = hyper::body::Body::is_end_stream(req.body());
        let (parts, body) = req.into_parts();
        let mut out = Request::new(ProxyBody::Request(Limited::new(
            body,
            self.config().server.max_body_bytes as usize,
        )));
        let method = parts.method.clone(); // for the error log; no allocation for standard methods
        *out.method_mut() = parts.method;
        *out.uri_mut() = forward::origin_form(parts.uri.path_and_query());
        *out.version_mut() = Version::HTTP_11;
        let mut h = parts.headers;
        let host = h.get(header::HOST).cloned().or_else(|| {
            parts
                .uri
                .authority()
                .and_then(|a| HeaderValue::from_str(a.as_str()).ok())
        });
        // Trailers pass through (gRPC's status is one): a client that accepts them asks the
        // upstream for them too, as does a rule that reads its cost from one.
        let client_trailers = forward::lists_token(&h, &header::TE, "trailers");
        forward::strip_hop_by_hop(&mut h, upgrade);
        if want_trailers || client_trailers {
            h.insert(header::TE, HeaderValue::from_static("trailers"));
        }
        forward::add_forwarded_proto(&mut h, peer.ip(), host.as_ref(), self.config().tls.is_some());
        // HTTP/2 requests carry the host in the URI; a `Connection` may have named `Host`.
        if let Some(host) = host.filter(|_| !h.contains_key(header::HOST)) {
            h.insert(header::HOST, host);
        }
        *out.headers_mut() = h;
        if *out.method() == Method::CONNECT {
            return Err(GatewayError::BadRequest("CONNECT is not supported"));
        }

        // A retry may replay this request (DESIGN.md §11). With one target nothing is copied:
        // only an attempt that was never written is sent again.
        let replay =
            (client_upgrade.is_none() && up::replayable(out.method(), out.headers(), body_is_end)).then(|| {
                (self.upstream().len() > 1).then(|| Replay {
                    method: out.method().clone(),
                    uri: out.uri().clone(),
                    headers: out.headers().clone(),
                })
            });
        let retry = match &replay {
            None => up::Retry::No,
            Some(None) => up::Retry::Unsent,
            Some(Some(r)) => up::Retry::Copy(r),
        };
        let started = Instant::now();
        let result =
            tokio::time::timeout(self.config().upstream.request_timeout, self.upstream().send(out, retry)).await;
        let waited = started.elapsed();
        self.metrics().upstream_latency.observe(waited.as_secs_f64());
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
                self.metrics().upstream_status[5].inc();
                if let Some(suppressed) = self.upstream_log().allow() {
                    tracing::warn!(method = %method, path = %parts.uri.path(), upstream = %self.config().upstream.authority, timeout_ms = self.config().upstream.request_timeout.as_millis() as u64, suppressed, "upstream timed out (repeats logged at most once a second, `suppressed` counts the others)");
                }
                return Err(GatewayError::GatewayTimeout);
            }
            Ok(Err(f)) if body_over_limit(&f.error) => {
                // A body without Content-Length (chunked, HTTP/2) went over `max_body_bytes`
                // while it streamed: the upstream got an aborted body, never a complete one.
                return Err(GatewayError::PayloadTooLarge);
            }
            Ok(Err(f)) => {
                self.metrics().upstream_status[5].inc();
                if let Some(suppressed) = self.upstream_log().allow() {
                    tracing::warn!(method = %method, path = %parts.uri.path(), upstream = %f.target, attempts = f.attempts, error = %f.error, suppressed, "upstream request failed (repeats logged at most once a second, `suppressed` counts the others)");
                }
                return Err(GatewayError::BadGateway(f.error.to_string()));
            }
            Ok(Ok(x)) => x.response,
        };
        let class = (resp.status().as_u16() / 100).clamp(1, 5) as usize - 1;
        self.metrics().upstream_status[class].inc();
        self.metrics().upstream_response(resp.status().as_u16());

        if resp.status() == http::StatusCode::SWITCHING_PROTOCOLS {
            let Some(client_up) = client_upgrade else {
                // A 101 the client never asked for would hand it a connection in a protocol
                // it does not speak: refuse it (the upstream connection is dropped with it).
                if let Some(suppressed) = self.upstream_log().allow() {
                    tracing::warn!(method = %method, path = %parts.uri.path(), upstream = %self.config().upstream.authority, suppressed, "upstream answered 101 to a request that asked for no upgrade");
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
            return Ok(resp.map(ProxyBody::Upstream));
        }
        forward::strip_hop_by_hop(resp.headers_mut(), None);
        let resp = resp.map(ProxyBody::Upstream);
        Ok(match slots {
            Some(g) => resp.map(|b| ProxyBody::boxed(slots::GuardedBody::new(b, g))),
            None => resp,
        })
    }
}

/// Did the upstream request fail because the client's body went over `max_body_bytes`?
fn body_over_limit(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur = Some(e);
    while let Some(err) = cur {
        if err.is::<http_body_util::LengthLimitError>() {
            return true;
        }
        cur = err.source();
    }
    false
}
