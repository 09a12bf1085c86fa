//! One `ShouldRateLimit` call: validate the request, match each descriptor, turn the matches
//! into limiter checks (one store call for the whole request, all or nothing), and the
//! verdict into envoyproxy/ratelimit's response (ARCHITECTURE.md, "The Envoy rate-limit
//! service"). No I/O but the limiter's; no panics: bad input is a [`Refusal`].

use std::sync::Arc;

use envoy_types::pb::envoy::config::core::v3::HeaderValue;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{Code, DescriptorStatus, RateLimit};
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::Duration as PbDuration;
use smallvec::SmallVec;

use super::config::{Domains, Limits, RlsLimit, Unit};
use super::matcher;
use crate::config::rls::RlsHeaders;
use crate::limiter::keys::{KeyBuilder, Namespace};
use crate::limiter::{Algorithm, FailurePolicy, LimitCheck, Limiter, Outcome, PolicedCheck, Quota, Source, Verdict};

/// Most descriptors one request may carry.
pub const MAX_DESCRIPTORS: usize = 64;
/// Most entries one descriptor may carry.
pub const MAX_ENTRIES: usize = 32;
/// Longest key or value of an entry, and longest domain, in bytes.
pub const MAX_TEXT: usize = 1024;
/// Largest `hits_addend` (per request or per descriptor).
pub const MAX_HITS: u64 = 1_000_000_000;

/// Why a request is refused with `INVALID_ARGUMENT` (nothing checked, nothing spent).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Refusal(pub String);

fn refuse<T>(msg: impl Into<String>) -> Result<T, Refusal> {
    Err(Refusal(msg.into()))
}

/// A limiter check with its failure policy.
#[derive(Debug, Clone)]
pub struct RlsCheck {
    /// The check.
    pub check: LimitCheck,
    /// When the store cannot answer.
    pub policy: FailurePolicy,
    /// May be decided from a lease.
    pub leasable: bool,
}

impl AsRef<LimitCheck> for RlsCheck {
    fn as_ref(&self) -> &LimitCheck {
        &self.check
    }
}

impl PolicedCheck for RlsCheck {
    fn policy(&self) -> FailurePolicy {
        self.policy
    }
    fn leasable(&self) -> bool {
        self.leasable
    }
}

/// One limit of one descriptor: where its answer comes from.
#[derive(Debug, Clone, Copy)]
enum Slot {
    /// The check at this index of the plan.
    Check(usize),
    /// `requests_per_unit: 0`: always over the limit, never sent to the store.
    Blocked,
}

/// What a descriptor became.
#[derive(Debug)]
enum Planned {
    /// No limit applies (unmatched, or replaced).
    Nothing,
    /// `unlimited: true`.
    Unlimited,
    /// Limits, each with its slot.
    Limited {
        limits: Arc<Limits>,
        slots: SmallVec<[(RlsLimit, Slot); 2]>,
        /// Its metric name when it shows request values (`matcher::Matched::detailed`).
        detailed: Option<String>,
    },
}

/// A descriptor's match: the limits, the value each entry's counter is keyed by, and its
/// metric name when it shows request values.
type Match<'a> = (Arc<Limits>, SmallVec<[&'a str; 4]>, Option<String>);

/// A request's plan: per descriptor what it became, and the checks for the limiter.
#[derive(Debug, Default)]
pub struct Plan {
    descriptors: Vec<Planned>,
    /// The limiter's checks, one per distinct counter.
    pub checks: Vec<RlsCheck>,
    /// Some descriptor is blocked (`requests_per_unit: 0`) and not in shadow mode: the request
    /// is over the limit, and the checks only peek.
    blocked: bool,
}

/// The hits one descriptor adds: its own `hits_addend` when set (0 allowed: a peek), else the
/// request's, where 0 (unset) means 1. As envoyproxy/ratelimit's `GetHitsAddends`.
fn hits(req: &RateLimitRequest, d: &RateLimitDescriptor) -> Result<u64, Refusal> {
    let h = match &d.hits_addend {
        Some(v) => v.value,
        None => u64::from(req.hits_addend.max(1)),
    };
    if h > MAX_HITS {
        return refuse(format!("hits_addend {h} is larger than {MAX_HITS}"));
    }
    Ok(h)
}

/// Validate `req` and plan it against `domains`. Keys are built by `keys` from the domain and
/// each entry's key and value (or a shared wildcard pattern), hashed: no request byte reaches
/// the store.
pub fn plan(domains: &Domains, keys: &KeyBuilder, req: &RateLimitRequest) -> Result<Plan, Refusal> {
    if req.domain.is_empty() {
        return refuse("rate limit domain must not be empty");
    }
    if req.domain.len() > MAX_TEXT {
        return refuse(format!("rate limit domain is longer than {MAX_TEXT} bytes"));
    }
    if req.descriptors.is_empty() {
        return refuse("rate limit descriptor list must not be empty");
    }
    if req.descriptors.len() > MAX_DESCRIPTORS {
        return refuse(format!("more than {MAX_DESCRIPTORS} descriptors in one request"));
    }
    for d in &req.descriptors {
        if d.entries.len() > MAX_ENTRIES {
            return refuse(format!("a descriptor has more than {MAX_ENTRIES} entries"));
        }
        if d.entries
            .iter()
            .any(|e| e.key.len() > MAX_TEXT || e.value.len() > MAX_TEXT)
        {
            return refuse(format!(
                "a descriptor entry's key or value is longer than {MAX_TEXT} bytes"
            ));
        }
        if d.is_negative_hits {
            return refuse("is_negative_hits is not supported");
        }
        hits(req, d)?;
    }
    let domain = domains.by_name.get(&req.domain);
    let mut plan = Plan::default();
    // Match first, so `replaces` sees every descriptor's match.
    let mut matched: Vec<Option<Match<'_>>> = Vec::with_capacity(req.descriptors.len());
    for d in &req.descriptors {
        let entries: SmallVec<[(&str, &str); 4]> =
            d.entries.iter().map(|e| (e.key.as_str(), e.value.as_str())).collect();
        let m = match (domain, &d.limit) {
            (None, _) => None,
            (Some(_), Some(o)) => match override_limits(&req.domain, o.requests_per_unit, o.unit) {
                Some(l) => Some((Arc::new(l), entries.iter().map(|(_, v)| *v).collect(), None)),
                // An unknown unit would otherwise leave the descriptor with no limit at all.
                None => return refuse(format!("limit.unit: unknown unit {}", o.unit)),
            },
            (Some(dom), None) => matcher::find(dom, &entries).map(|m| (m.limits.clone(), m.values, m.detailed)),
        };
        matched.push(m);
    }
    let replaced: Vec<&str> = matched
        .iter()
        .flatten()
        .flat_map(|(l, _, _)| l.replaces.iter().map(String::as_str))
        .collect();
    for (d, m) in req.descriptors.iter().zip(matched.iter()) {
        let Some((limits, values, detailed)) = m else {
            plan.descriptors.push(Planned::Nothing);
            continue;
        };
        if limits.unlimited {
            plan.descriptors.push(Planned::Unlimited);
            continue;
        }
        if !limits.name.is_empty() && replaced.contains(&limits.name.as_str()) {
            plan.descriptors.push(Planned::Nothing);
            continue;
        }
        let cost = hits(req, d)?;
        let tag = keys.tag(Namespace::Descriptor, &key_bytes(&req.domain, d, values));
        let mut slots = SmallVec::new();
        for (n, l) in limits.limits.iter().enumerate() {
            let slot = match l.quota {
                None => {
                    plan.blocked |= !limits.shadow;
                    Slot::Blocked
                }
                Some(q) => Slot::Check(plan.add(keys.key(&tag, "rls", n), q, cost, limits)?),
            };
            slots.push((*l, slot));
        }
        plan.descriptors.push(Planned::Limited {
            limits: limits.clone(),
            slots,
            detailed: detailed.clone(),
        });
    }
    if plan.blocked {
        for c in &mut plan.checks {
            c.check.cost = 0;
        }
    }
    Ok(plan)
}

/// The limits of a descriptor's own `limit` (Envoy's per-route override): a fixed window.
fn override_limits(domain: &str, rpu: u32, unit: i32) -> Option<Limits> {
    let unit = Unit::from_proto(unit)?;
    Some(Limits {
        name: String::new(),
        replaces: Vec::new(),
        unlimited: false,
        shadow: false,
        limits: vec![RlsLimit::new(unit, rpu, Algorithm::FixedWindow, None)],
        failure: FailurePolicy::Open,
        metric: format!("{domain}.override"),
        detailed_metric: false,
    })
}

/// What a descriptor's counter is keyed by: the domain and each entry's key and value (the
/// shared pattern for a `share_threshold` wildcard), length-prefixed so no two differ only in
/// where one ends.
fn key_bytes(domain: &str, d: &RateLimitDescriptor, values: &[&str]) -> Vec<u8> {
    let mut b = Vec::with_capacity(64);
    let mut put = |s: &str| {
        b.extend_from_slice(&(s.len() as u32).to_be_bytes());
        b.extend_from_slice(s.as_bytes());
    };
    put(domain);
    for (e, v) in d.entries.iter().zip(values) {
        put(&e.key);
        put(v);
    }
    b
}

impl Plan {
    /// The index of the check of `key`: a new one, or the same counter met again in this
    /// request with its cost added (two checks of one counter in one call would each see the
    /// count before the other's spending).
    ///
    /// One counter named with two different limits in one request (a descriptor and the same
    /// descriptor with its own `limit`, or two different `limit`s) is refused: each limit would
    /// compare the count before the other's hits, and admit past both.
    fn add(
        &mut self,
        key: crate::limiter::StoreKey,
        quota: Quota,
        cost: u64,
        limits: &Limits,
    ) -> Result<usize, Refusal> {
        if let Some(i) = self.checks.iter().position(|c| c.check.key == key) {
            if self.checks[i].check.quota != quota {
                return refuse("one descriptor is named twice in this request with different limits");
            }
            let c = &mut self.checks[i].check;
            c.cost = c.cost.saturating_add(cost);
            return Ok(i);
        }
        let mut check = LimitCheck::new(key, quota, cost);
        check.shadow = limits.shadow;
        self.checks.push(RlsCheck {
            check,
            policy: limits.failure,
            leasable: crate::limiter::lease::algorithm_leases(quota.algorithm),
        });
        Ok(self.checks.len() - 1)
    }

    /// Per descriptor, in the request's order, the metric name of the limit it met (the one
    /// showing request values, else the entry's own) and the entry's own; `None` when no
    /// limit applies.
    pub fn metric_names(&self) -> impl Iterator<Item = Option<(&str, &str)>> + '_ {
        self.descriptors.iter().map(|d| match d {
            Planned::Limited { limits, detailed, .. } => {
                Some((detailed.as_deref().unwrap_or(&limits.metric), limits.metric.as_str()))
            }
            Planned::Nothing | Planned::Unlimited => None,
        })
    }

    /// Check the plan's limits (all or nothing) and answer. `now_us` is the limiter's clock.
    pub async fn run(&self, limiter: &Limiter, now_us: u64, headers: RlsHeaders) -> (RateLimitResponse, Verdict) {
        let verdict = if self.checks.is_empty() {
            Verdict::default()
        } else {
            crate::engine::check_limits(limiter, &self.checks, now_us).await.0
        };
        let response = self.answer(&verdict, now_us, headers);
        (response, verdict)
    }

    /// The response for `verdict`.
    pub fn answer(&self, verdict: &Verdict, now_us: u64, headers: RlsHeaders) -> RateLimitResponse {
        // The request spent only if every non-shadow limit admitted it.
        let admitted = !self.blocked
            && verdict
                .outcomes
                .iter()
                .zip(&self.checks)
                .all(|((o, s), c)| c.check.shadow || (o.allowed && *s != Source::FailClosed));
        let mut statuses = Vec::with_capacity(self.descriptors.len());
        let mut over = false;
        for d in &self.descriptors {
            let st = match d {
                Planned::Nothing => status(Code::Ok, None, 0, None),
                Planned::Unlimited => status(Code::Ok, None, u32::MAX, None),
                Planned::Limited { limits, slots, .. } => {
                    let cx = Cx {
                        verdict,
                        checks: &self.checks,
                        admitted,
                        now_us,
                    };
                    let st = descriptor_status(cx, limits, slots);
                    over |= st.code == Code::OverLimit as i32;
                    st
                }
            };
            statuses.push(st);
        }
        let overall = if over || !admitted { Code::OverLimit } else { Code::Ok };
        let response_headers_to_add = rate_limit_headers(&statuses, headers);
        RateLimitResponse {
            overall_code: overall as i32,
            statuses,
            response_headers_to_add,
            ..RateLimitResponse::default()
        }
    }
}

/// What the status of one descriptor reads.
#[derive(Clone, Copy)]
struct Cx<'a> {
    verdict: &'a Verdict,
    checks: &'a [RlsCheck],
    admitted: bool,
    now_us: u64,
}

fn status(code: Code, limit: Option<RateLimit>, remaining: u32, reset_secs: Option<u64>) -> DescriptorStatus {
    DescriptorStatus {
        code: code as i32,
        current_limit: limit,
        limit_remaining: remaining,
        duration_until_reset: reset_secs.map(|s| PbDuration {
            seconds: i64::try_from(s).unwrap_or(i64::MAX),
            nanos: 0,
        }),
        quota: None,
    }
}

/// One limit's state as told to Envoy.
struct Told {
    over: bool,
    remaining: u64,
    reset_secs: Option<u64>,
    /// Longest wait, for choosing the binding denial.
    wait_us: u64,
}

fn ceil_secs(us: u64) -> u64 {
    us.div_ceil(1_000_000)
}

/// envoyproxy/ratelimit's `duration_until_reset` of a fixed window: to the end of the
/// epoch-aligned window.
fn window_reset(unit: Unit, now_us: u64) -> u64 {
    let secs = unit.secs();
    secs - (now_us / 1_000_000) % secs
}

fn told(cx: Cx<'_>, l: &RlsLimit, slot: Slot) -> Told {
    let Slot::Check(i) = slot else {
        return Told {
            over: true,
            remaining: 0,
            reset_secs: Some(window_reset(l.unit, cx.now_us)),
            wait_us: u64::MAX,
        };
    };
    let (o, src): (Outcome, Source) = cx
        .verdict
        .outcomes
        .get(i)
        .copied()
        .unwrap_or((Outcome::default(), Source::FailOpen));
    let check = cx.checks.get(i).map(|c| &c.check);
    let fixed = check.is_some_and(|c| c.quota.algorithm == Algorithm::FixedWindow);
    match src {
        Source::FailOpen => {
            return Told {
                over: false,
                remaining: u64::from(l.requests_per_unit),
                reset_secs: None,
                wait_us: 0,
            }
        }
        Source::FailClosed => {
            return Told {
                over: true,
                remaining: 0,
                reset_secs: None,
                wait_us: 0,
            }
        }
        _ => {}
    }
    let reset = |us: u64| {
        if fixed {
            window_reset(l.unit, cx.now_us)
        } else {
            ceil_secs(us)
        }
    };
    if !o.allowed {
        return Told {
            over: true,
            remaining: 0,
            reset_secs: Some(reset(o.retry_after_us.max(o.reset_us))),
            wait_us: o.retry_after_us,
        };
    }
    // Admitted by this limit, but the request was refused elsewhere: nothing was spent here.
    let cost = check.map_or(0, |c| c.cost);
    let remaining = if cx.admitted {
        o.remaining
    } else {
        o.remaining
            .saturating_add(cost)
            .min(check.map_or(u64::MAX, |c| c.quota.limit.get()))
    };
    Told {
        over: false,
        remaining,
        reset_secs: Some(reset(o.reset_us)),
        wait_us: 0,
    }
}

/// A descriptor's status: its binding limit (the denial with the longest wait, else the one
/// with the least left).
fn descriptor_status(cx: Cx<'_>, limits: &Limits, slots: &[(RlsLimit, Slot)]) -> DescriptorStatus {
    let mut best: Option<(&RlsLimit, Told)> = None;
    for (l, slot) in slots {
        let t = told(cx, l, *slot);
        let better = match &best {
            None => true,
            Some((_, b)) => match (t.over, b.over) {
                (true, false) => true,
                (false, true) => false,
                (true, true) => t.wait_us > b.wait_us,
                (false, false) => t.remaining < b.remaining,
            },
        };
        if better {
            best = Some((l, t));
        }
    }
    let Some((l, t)) = best else {
        return status(Code::Ok, None, 0, None);
    };
    let code = if t.over && !limits.shadow {
        Code::OverLimit
    } else {
        Code::Ok
    };
    let limit = RateLimit {
        name: limits.name.clone(),
        requests_per_unit: l.requests_per_unit,
        unit: l.unit.proto(),
    };
    status(
        code,
        Some(limit),
        u32::try_from(t.remaining).unwrap_or(u32::MAX),
        t.reset_secs,
    )
}

/// The headers Envoy adds to the client's response, from the descriptor nearest its limit
/// (an over-limit one first), as envoyproxy/ratelimit picks it.
fn rate_limit_headers(statuses: &[DescriptorStatus], headers: RlsHeaders) -> Vec<HeaderValue> {
    if headers == RlsHeaders::None {
        return Vec::new();
    }
    let pick = statuses
        .iter()
        .filter(|s| s.current_limit.is_some())
        .min_by_key(|s| (s.code != Code::OverLimit as i32, s.limit_remaining));
    let Some(s) = pick else { return Vec::new() };
    let Some(l) = &s.current_limit else { return Vec::new() };
    let reset = s.duration_until_reset.as_ref().map_or(0, |d| d.seconds.max(0));
    let window = Unit::from_proto(l.unit).map_or(1, Unit::secs);
    let h = |k: &str, v: String| HeaderValue {
        key: k.to_string(),
        value: v,
        ..HeaderValue::default()
    };
    match headers {
        RlsHeaders::None => Vec::new(),
        RlsHeaders::XRateLimit => vec![
            h("X-RateLimit-Limit", l.requests_per_unit.to_string()),
            h("X-RateLimit-Remaining", s.limit_remaining.to_string()),
            h("X-RateLimit-Reset", reset.to_string()),
        ],
        RlsHeaders::Ietf => vec![
            h(
                "RateLimit-Policy",
                format!("\"rls\";q={};w={window}", l.requests_per_unit),
            ),
            h("RateLimit", format!("\"rls\";r={};t={reset}", s.limit_remaining)),
        ],
    }
}
