//! The request path: identify → match → check → forward / respond.
//!
//! Per request: one `ArcSwap` load of the rule snapshot, identity and matching on borrowed
//! data, one hash per distinct key value, one store call (one round trip per Redis slot), and
//! then either the upstream's streamed response or a local 429/503. No lock is held across an
//! `.await`; metric handles were resolved when the rules loaded.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use http::{header, Request, Response, Version};
use hyper::body::Incoming;

use crate::http::headers::{self, Binding};
use crate::http::request_id::X_REQUEST_ID;
use crate::http::respond::{self, GatewayError, LocalAnswer};
use crate::http::ProxyBody;
use crate::limiter::{Source, Verdict};
use crate::rules::caller;
use crate::state::State;

pub mod access;
mod account;
mod exchange;
pub(crate) mod facts;
mod settle;
mod slots;
mod target;
mod validate;
pub use validate::MAX_HEADERS;

pub use crate::engine::plan::host_for_matching;
use crate::engine::plan::{RequestParts, RequestPlan};
use crate::engine::{Decision, Engine};
use facts::Facts;

/// The headers' view of planned check `i` with outcome `o` reached through `source`: the quota
/// enforced is this node's share of it when the rule fell back to the local store. When the
/// values made at load do not describe it (an override, a local share), `windows` is filled
/// with every limit of its rule in force for the request, for `RateLimit-Policy`.
fn binding_of<'a>(
    plan: &RequestPlan,
    snap: &'a crate::state::Snapshot,
    (i, o, source): &'a (usize, crate::limiter::Outcome, Source),
    windows: &'a mut Vec<crate::limiter::Quota>,
) -> Binding<'a> {
    let (i, source) = (*i, *source);
    let p = &plan.checks[i];
    let enforced = |c: &crate::engine::PlannedCheck| {
        let e = c.enforced(source);
        (e.quota, e.cost)
    };
    let (quota, cost) = enforced(p);
    let fixed = snap
        .rule_headers
        .get(p.rule as usize)
        .and_then(|f| f.iter().find_map(|f| f.describing(&quota, cost)));
    let mut at = 0;
    if fixed.is_none() {
        for (j, c) in plan.checks.iter().enumerate().filter(|(_, c)| c.rule == p.rule) {
            if j == i {
                at = windows.len();
            }
            windows.push(enforced(c).0);
        }
    }
    Binding {
        rule: &snap.rules.rules[p.rule as usize].name,
        quota,
        cost,
        outcome: o,
        fixed,
        windows,
        at,
    }
}

/// Where a request came from: the connection's peer, and the TLS version when it came over
/// TLS. Copied into every request of the connection (no allocation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Peer {
    /// The client's address (the connection's peer).
    pub addr: SocketAddr,
    /// `TLSv1.2` / `TLSv1.3` on a TLS listener; `None` in cleartext.
    pub tls: Option<&'static str>,
}

impl Peer {
    /// A cleartext connection from `addr`.
    pub fn plain(addr: SocketAddr) -> Self {
        Peer { addr, tls: None }
    }
}

/// Header fields tollgate may add to a request on its way upstream: `X-Request-Id`,
/// `traceparent`, `TE`, `X-Forwarded-For`, `-Proto`, `-Host` and `Forwarded`, and `Host` again.
const FORWARD_ROOM: usize = 8;

impl State {
    /// Serve one request; never fails (errors become responses in `crate::http::respond`).
    /// The request id (kept or generated) goes upstream and back; the access log, when on,
    /// gets one line.
    pub async fn handle(self: Arc<Self>, mut req: Request<Incoming>, from: Peer) -> Response<ProxyBody> {
        let peer = from.addr;
        // hyper sizes a request's header map to the fields it parsed; the request id and the
        // forwarding headers would then regrow it (rehashing it) up to four times.
        req.headers_mut().reserve(FORWARD_ROOM);
        let arrived = Instant::now();
        let mut facts = Facts::of(req.headers());
        facts.arrived = Some(arrived);
        let id = facts::ensure_request_id(req.headers_mut(), &facts);
        let grpc = facts.grpc;
        let http1 = req.version() < Version::HTTP_2;
        let line = self.access_sampler().take().then(|| {
            // The trace context now, for the line; a request not logged gets it only when it is
            // forwarded (`outbound`), so a 429 costs nothing for it.
            let trace = crate::http::trace::ensure(req.headers_mut(), false);
            facts.traced = true;
            access::Line {
                id: id.clone(),
                started: arrived,
                method: req.method().clone(),
                path: req.uri().path().to_owned(),
                client: peer,
                tls: from.tls,
                protocol: match req.version() {
                    Version::HTTP_10 => "HTTP/1.0",
                    Version::HTTP_2 => "HTTP/2",
                    _ => "HTTP/1.1",
                },
                host: req
                    .uri()
                    .authority()
                    .and_then(|a| http::HeaderValue::from_str(a.as_str()).ok())
                    .or_else(|| req.headers().get(header::HOST).cloned()),
                user_agent: req.headers().get(header::USER_AGENT).cloned(),
                bytes_in: facts.content_length.and_then(Result::ok),
                trace_id: trace.trace_id_hex(),
                note: access::Note::default(),
            }
        });
        // Dropped with this future if the client leaves before the response: counted and logged.
        let mut pending = access::Pending::new(self.metrics(), line);
        let result = self
            .serve(req, &mut facts, peer, pending.line.as_mut().map(|l| &mut l.note))
            .await;
        let mut resp = self.response_of(result, grpc, pending.line.as_mut().map(|l| &mut l.note));
        self.metrics().traffic.duration.observe(arrived.elapsed().as_secs_f64());
        resp.headers_mut().insert(X_REQUEST_ID.clone(), id);
        if self.draining() {
            // The drain window: the client's next request goes on a new connection, which the
            // balancer no longer sends here (HTTP/2 connections got GOAWAY instead).
            self.drained_request();
            if http1 && resp.status() != http::StatusCode::SWITCHING_PROTOCOLS {
                resp.headers_mut()
                    .insert(header::CONNECTION, http::HeaderValue::from_static("close"));
            }
        }
        match pending.answered() {
            Some(l) => {
                let status = resp.status().as_u16();
                resp.map(|b| ProxyBody::boxed(access::LoggedBody::new(b, l, status)))
            }
            None => resp,
        }
    }

    /// What the client gets for `result`: the response, or the error's; a gRPC client gets
    /// limits and local failures as gRPC statuses.
    fn response_of(
        &self,
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
                        _ if n.decision.is_empty() => "error",
                        _ => n.decision,
                    };
                }
                self.metrics().traffic.local_response(e.status().as_u16());
                LocalAnswer::from(e).render(grpc)
            }
        }
    }

    /// The request path proper: check the request, plan it, decide its limits, then answer
    /// locally or forward it. The steps before the upstream exchange are plain functions (the
    /// limiter waits only when it has to ask the store), so this future holds little.
    async fn serve(
        self: &Arc<Self>,
        mut req: Request<Incoming>,
        facts: &mut Facts,
        peer: SocketAddr,
        mut note: Option<&mut access::Note>,
    ) -> Result<Response<ProxyBody>, GatewayError> {
        let sc = &self.config().server;
        validate::request(&req, facts, sc)?;
        target::settle(&mut req, facts, sc.encoded_slashes)?;
        // An owned handle, not a guard: the snapshot stays alive across the awaits below
        // (store check, leaky-bucket wait, upstream exchange) without pinning an arc-swap slot.
        let snap = self.snapshot().load_full();
        let now_us = self.clock().now_us();
        if facts.underscored {
            self.refuse_underscore_spellings(&snap, req.headers())?;
        }
        let engine = self.engine(&snap);
        let mut plan = {
            let facts = RequestParts {
                method: req.method(),
                uri: req.uri(),
                headers: req.headers(),
                peer: peer.ip(),
            };
            engine.plan(&self.runtime().load(), facts, now_us)
        };
        if let Some(p) = plan.refused {
            return Err(p.into());
        }
        if let Some(n) = note.as_deref_mut() {
            let ident = &plan.identity;
            n.identity_kind = ident.kind.as_str();
            n.identity = caller(ident).tag(self.keys(), "").to_string();
            n.decision = if plan.checks.is_empty() { "unmatched" } else { "allowed" };
        }

        let mut admitted = Admitted::default();
        if plan.checks.is_empty() {
            self.metrics().traffic.unmatched.inc();
        } else {
            let checked = engine.check(&mut plan, now_us).await;
            if let Some(waited) = checked.store_wait {
                self.metrics().store.check_latency.observe(waited.as_secs_f64());
            }
            let decided = Decided {
                verdict: &checked.verdict,
                decision: engine.judge(&plan, &checked.verdict),
                holder: checked.holder,
                now_us,
                grpc: facts.grpc,
            };
            if let Some(denied) = self.decide(&snap, &plan, decided, note.as_deref_mut(), &mut admitted) {
                return denied;
            }
        }
        if admitted.delay_us > 0 {
            // Leaky bucket: wait our turn. If the client leaves, this future is dropped and the
            // guard gives the slot back (and any concurrency slot: the upstream never saw it).
            let _queued = crate::metrics::InFlight::enter(&self.metrics().traffic.leaky_queue);
            tokio::time::sleep(Duration::from_micros(admitted.delay_us)).await;
        }
        if let Some(mut g) = admitted.refund_guard.take() {
            g.spent = None;
        }

        // A cost reported in a trailer: ask the upstream for trailers (an HTTP/1.1 server sends
        // them only to a request that says `TE: trailers`).
        let want_trailers = admitted
            .after
            .iter()
            .any(|(ri, _)| snap.rules.rules[*ri as usize].cost_from.is_some());
        // A request refused on its way out (CONNECT) is settled like an upstream error: a
        // `count_when` rule it does not match gets its reservation back.
        // A request that holds slots or waits to be settled keeps its upstream exchange going
        // even if its client leaves (`exchange::forward_held`).
        let result = match self.outbound(req, facts, peer, want_trailers) {
            Ok(out) if admitted.slots.is_some() || !admitted.after.is_empty() => {
                self.forward_held(&snap, out, (admitted.slots, admitted.after), note)
                    .await
            }
            Ok(out) => self.forward(out, None, note).await.map(|(r, _)| r),
            Err(e) => self.settle_after(&snap, admitted.after, Err(e), None),
        };
        let mut resp = result?;
        if let Some(bound) = admitted.binding {
            let mut windows = Vec::new();
            let b = binding_of(&plan, &snap, &bound, &mut windows);
            let lim = &self.config().limits;
            // The rate-limit headers and the request id: one regrowth at most.
            resp.headers_mut().reserve(6);
            headers::write(resp.headers_mut(), &b, lim.ietf_headers, lim.legacy_headers, now_us);
        }
        Ok(resp)
    }

    /// Refuse a request that spells a header tollgate reads (credentials, rule keys and
    /// conditions, method overrides) with `_` for `-`: a CGI-style upstream reads the two as one
    /// (see `rules::underscore_spelling`).
    fn refuse_underscore_spellings(
        &self,
        snap: &crate::state::Snapshot,
        headers: &http::HeaderMap,
    ) -> Result<(), GatewayError> {
        let id = &self.config().identity;
        let jwt = id.jwt.as_ref().map(|j| j.header());
        let mut reads: Vec<&http::HeaderName> = vec![&header::AUTHORIZATION, &id.api_key_header];
        reads.extend(jwt.as_ref());
        reads.extend(snap.rules.read_headers.iter());
        match crate::rules::underscore_spelling(headers, &reads) {
            Some(_) => Err(GatewayError::BadRequest(
                "a header name spells one tollgate reads with '_' for '-' (an upstream may read it as the other)",
            )),
            None => Ok(()),
        }
    }

    /// The decision engine over `snap` and this gateway's key builder, identity settings and
    /// limiter.
    fn engine<'a>(&'a self, snap: &'a crate::state::Snapshot) -> Engine<'a> {
        Engine {
            snap,
            keys: self.keys(),
            identity: &self.config().identity,
            limiter: self.limiter(),
        }
    }

    /// Act on the limiter's verdict: count it, and either answer now (`Some`: a 429, or a 503
    /// for a fail-closed rule whose store is down) or fill `admitted` with what the admitted
    /// request holds on its way upstream.
    fn decide(
        self: &Arc<Self>,
        snap: &crate::state::Snapshot,
        plan: &RequestPlan,
        decided: Decided<'_>,
        note: Option<&mut access::Note>,
        admitted: &mut Admitted,
    ) -> Option<Result<Response<ProxyBody>, GatewayError>> {
        let Decided {
            verdict,
            decision,
            holder,
            now_us,
            grpc,
        } = decided;
        self.account(snap, plan, verdict, &plan.identity);
        let idx = match decision {
            Decision::Unavailable { check } => {
                let rule = &snap.rules.rules[plan.checks[check].rule as usize];
                return Some(Err(GatewayError::LimiterUnavailable {
                    rule: rule.name.to_string(),
                    retry_after_secs: 1,
                }));
            }
            Decision::Limited { binding } => Some(binding),
            Decision::Admit { binding } => binding,
            Decision::Refused(p) => return Some(Err(p.into())),
            Decision::Unmatched => None,
        };
        let mut note = note;
        if let Some(n) = note.as_deref_mut() {
            // The store was down for a rule that lets requests through unchecked: say so, and
            // which rule, rather than "allowed" by no rule.
            if let Some(c) = plan
                .with_outcomes(verdict)
                .find(|(c, (_, s))| !c.check.shadow && *s == Source::FailOpen)
                .map(|(c, _)| c)
            {
                n.decision = "fail_open";
                n.rule = Some(snap.rules.rules[c.rule as usize].name.clone());
            }
        }
        if let Some(i) = idx {
            let (o, src) = verdict.outcomes[i];
            if let Some(n) = note.as_deref_mut() {
                // A fail-open line keeps the rule that went unchecked, unless another denies.
                if !o.allowed || n.decision != "fail_open" {
                    n.rule = Some(snap.rules.rules[plan.checks[i].rule as usize].name.clone());
                }
            }
            if !o.allowed {
                if let Some(n) = note {
                    n.decision = "limited";
                }
                let bound = (i, o, src);
                let mut windows = Vec::new();
                let b = binding_of(plan, snap, &bound, &mut windows);
                let lim = &self.config().limits;
                self.metrics().traffic.rate_limited();
                let render = if grpc {
                    respond::rate_limited_grpc
                } else {
                    respond::rate_limited
                };
                return Some(Ok(render(&b, lim.ietf_headers, lim.legacy_headers, now_us)));
            }
            admitted.binding = Some((i, o, src));
        }
        if holder != 0 {
            admitted.slots = self.hold_slots(snap, plan, verdict, holder);
        }
        if snap.settles {
            admitted.after = settle::reserved_by_response_rules(snap, plan, verdict);
        }
        admitted.delay_us = verdict
            .outcomes
            .iter()
            .filter(|(_, s)| *s == Source::Store || *s == Source::Local)
            .map(|(o, _)| o.delay_us)
            .max()
            .unwrap_or(0);
        if admitted.delay_us > 0 {
            admitted.refund_guard = Some(settle::RefundGuard {
                gw: self.clone(),
                spent: Some(verdict.spent(&plan.checks)),
            });
        }
        None
    }
}

/// What the limiter decided for a request, as [`State::decide`] reads it: the verdict, the
/// holder of its concurrency slots (0 without), and the instant it was decided at.
#[derive(Clone, Copy)]
struct Decided<'a> {
    verdict: &'a Verdict,
    /// What the engine made of it.
    decision: Decision,
    holder: u64,
    /// A gRPC client's request: a 429 is rendered as gRPC.
    grpc: bool,
    now_us: u64,
}

/// What an admitted request holds on its way upstream.
#[derive(Default)]
struct Admitted {
    /// The limit whose headers the response carries: its check, outcome and source.
    binding: Option<(usize, crate::limiter::Outcome, Source)>,
    /// The concurrency slots it took.
    slots: Option<slots::SlotGuard>,
    /// What its `count_when` / `cost_from` rules reserved, settled once the response is known.
    after: Vec<(u32, settle::Reserved)>,
    /// The leaky bucket's wait before it is forwarded, microseconds.
    delay_us: u64,
    /// Gives back what it spent if the client leaves during that wait.
    refund_guard: Option<settle::RefundGuard>,
}
