//! The per-request context every phase works on: one [`Exchange`] per request, made when its
//! head arrives and filled in as the phases run (ARCHITECTURE.md, "The request lifecycle"). It
//! lives in the request's future (never boxed), and holds nothing a later phase does not read.

use std::sync::Arc;
use std::time::Instant;

use http::{HeaderValue, Request, Version};

use crate::engine::plan::RequestPlan;
use crate::engine::{Engine, PlannedCheck};
use crate::http::headers::Binding;
use crate::limiter::{LimitCheck, Outcome, Quota, Source};
use crate::state::{Snapshot, State};

use super::access::{self, Pending};
use super::facts::{self, Facts};
use super::slots::SlotGuard;
use super::Peer;

/// Header fields tollgate may add to a request on its way upstream: `X-Request-Id`,
/// `traceparent`, `TE`, `X-Forwarded-For`, `-Proto`, `-Host` and `Forwarded`, and `Host` again.
const FORWARD_ROOM: usize = 8;

/// What one rule of an admitted request reserved: its checks, each with the instant its check
/// was decided and the store that decided it.
pub(crate) type Reserved = Vec<(LimitCheck, u64, Source)>;

/// One request on its way through the phases.
pub(super) struct Exchange<'a> {
    /// Its header section, read once (validate, forward).
    pub(super) facts: Facts,
    /// Where it came from.
    pub(super) peer: Peer,
    /// Its request id (kept or generated), sent upstream and back.
    pub(super) id: HeaderValue,
    /// When its head reached the request path.
    pub(super) arrived: Instant,
    /// It came over HTTP/1 (a drain closes its connection).
    pub(super) http1: bool,
    /// The rules in force, loaded once: an owned handle, not a guard, so that it stays alive
    /// across the awaits (store check, leaky-bucket wait, upstream exchange) without pinning an
    /// arc-swap slot.
    pub(super) snap: Arc<Snapshot>,
    /// The instant its limits are decided at, microseconds.
    pub(super) now_us: u64,
    /// Its caller and limits (the plan phase); `None` before.
    pub(super) plan: Option<RequestPlan>,
    /// What it holds once admitted (the check phase).
    pub(super) admitted: Admitted,
    /// Its access line when it is logged; dropped unanswered, it logs the client's abort.
    pub(super) pending: Pending<'a>,
}

/// What an admitted request holds on its way upstream.
#[derive(Default)]
pub(super) struct Admitted {
    /// The limit whose headers the response carries: its check, outcome and source.
    pub(super) binding: Option<(usize, Outcome, Source)>,
    /// The concurrency slots it took.
    pub(super) slots: Option<SlotGuard>,
    /// What its `count_when` / `cost_from` rules reserved, settled once the response is known.
    pub(super) after: Vec<(u32, u8, Reserved)>,
    /// Its room under the adaptive concurrency limit (the admit phase), handed to the
    /// upstream exchange, which gives it back with the latency when the response head arrives.
    pub(super) permit: Option<crate::adaptive::Permit>,
}

impl Admitted {
    /// It holds something until its upstream exchange really ends (`forward::held`): slots,
    /// reservations, or room under the adaptive limit (a client that resets must not free it
    /// while the upstream still works on its request).
    pub(super) fn holds(&self) -> bool {
        self.slots.is_some() || !self.after.is_empty() || self.permit.is_some()
    }
}

impl<'a> Exchange<'a> {
    /// The context of `req`, from `peer`: its facts and request id (written into `req` when it
    /// had none worth keeping), the snapshot and the instant it is decided at.
    pub(super) fn new(gw: &'a State, req: &mut Request<hyper::body::Incoming>, peer: Peer) -> Self {
        // hyper sizes a request's header map to the fields it parsed; the request id and the
        // forwarding headers would then regrow it (rehashing it) up to four times.
        req.headers_mut().reserve(FORWARD_ROOM);
        let arrived = Instant::now();
        let facts = Facts::of(req.headers());
        let id = facts::ensure_request_id(req.headers_mut(), &facts);
        Exchange {
            facts,
            peer,
            id,
            arrived,
            http1: req.version() < Version::HTTP_2,
            snap: gw.snapshot().load_full(),
            now_us: gw.clock().now_us(),
            plan: None,
            admitted: Admitted::default(),
            pending: Pending::new(gw.metrics(), None),
        }
    }

    /// What the request path learned, for its access line; `None` when it is not logged.
    pub(super) fn note(&mut self) -> Option<&mut access::Note> {
        self.pending.line.as_mut().map(|l| &mut l.note)
    }
}

/// The decision engine over `snap` and the gateway's key builder, identity settings and
/// limiter.
pub(super) fn engine<'a>(gw: &'a State, snap: &'a Snapshot) -> Engine<'a> {
    Engine {
        snap,
        keys: gw.keys(),
        identity: &gw.config().identity,
        limiter: gw.limiter(),
        regions: gw.regions().map(|r| &**r),
    }
}

/// The headers' view of planned check `i` with outcome `o` reached through `source`: the quota
/// enforced is this node's share of it when the rule fell back to the local store. When the
/// values made at load do not describe it (an override, a local share), `windows` is filled
/// with every limit of its rule in force for the request, for `RateLimit-Policy`.
pub(super) fn binding_of<'a>(
    plan: &RequestPlan,
    snap: &'a Snapshot,
    (i, o, source): &'a (usize, Outcome, Source),
    windows: &'a mut Vec<Quota>,
) -> Binding<'a> {
    let (i, source) = (*i, *source);
    let p = &plan.checks[i];
    let enforced = |c: &PlannedCheck| {
        let e = c.enforced(source);
        (e.quota, e.cost)
    };
    let (quota, cost) = enforced(p);
    // What its headers count: requests of its cost, or units such as tokens one by one.
    let units = snap.rule_units.get(p.rule as usize).map_or(&[][..], Vec::as_slice);
    let pos = plan.checks[..i].iter().filter(|c| c.rule == p.rule).count();
    let cost = units.get(pos).map_or(cost, |u| u.cost);
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
        units,
    }
}
