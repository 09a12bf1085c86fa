//! The check phase: the limiter checks and spends the plan's limits (`engine::check`: the deny
//! cache and leases decide without I/O, else one store call per slot), the engine judges the
//! verdict, and the request is either answered now (a 429, or a 503 for a fail-closed rule
//! whose store is down) or admitted, holding its slots and reservations; a leaky bucket's
//! request then waits its turn here.

use std::sync::Arc;
use std::time::Duration;

use http::Response;

use crate::engine::{Checked, Decision};
use crate::http::headers::Binding;
use crate::http::respond::{self, GatewayError};
use crate::http::ProxyBody;
use crate::limiter::{Source, Verdict};
use crate::state::State;

use super::ctx::{self, Exchange};
use super::settle;

/// Check `x`'s planned limits. `Some` is the answer made here (a 429); `None`, the request is
/// admitted (`x.admitted`) and, when a leaky bucket said so, has waited its turn.
pub(super) async fn phase(gw: &Arc<State>, x: &mut Exchange<'_>) -> Result<Option<Response<ProxyBody>>, GatewayError> {
    let Some(plan) = x.plan.as_mut() else {
        return Ok(None);
    };
    if plan.checks.is_empty() {
        gw.metrics().traffic.unmatched.inc();
        return Ok(None);
    }
    // The verdict is not kept across the wait below: only what `decide` made of it.
    let queued = {
        let engine = ctx::engine(gw, &x.snap);
        let checked = engine.check(plan, x.now_us).await;
        if let Some(waited) = checked.store_wait {
            gw.metrics().store.check_latency.observe(waited.as_secs_f64());
            if let Some(n) = x.pending.line.as_mut().map(|l| &mut l.note) {
                n.store_us = Some(u64::try_from(waited.as_micros()).unwrap_or(u64::MAX));
            }
        }
        let decision = engine.judge(plan, &checked.verdict);
        if let Some(denied) = decide(gw, x, &checked, decision)? {
            return Ok(Some(denied));
        }
        queue(gw, x, &checked.verdict)
    };
    if let Some((delay_us, mut refund)) = queued {
        // Leaky bucket: wait our turn. If the client leaves, this future is dropped and the
        // guard gives the slot back (and any concurrency slot: the upstream never saw it).
        let _queued = crate::metrics::InFlight::enter(&gw.metrics().traffic.leaky_queue);
        tokio::time::sleep(Duration::from_micros(delay_us)).await;
        refund.spent = None;
    }
    Ok(None)
}

/// Act on the verdict: count it, and either answer now (`Some`: a 429; `Err`: a 503 for a
/// fail-closed rule whose store is down, or refused credentials) or fill `x.admitted` with
/// what the admitted request holds on its way upstream.
fn decide(
    gw: &Arc<State>,
    x: &mut Exchange<'_>,
    checked: &Checked,
    decision: Decision,
) -> Result<Option<Response<ProxyBody>>, GatewayError> {
    let Exchange {
        snap,
        plan: Some(plan),
        admitted,
        pending,
        facts,
        now_us,
        ..
    } = x
    else {
        return Ok(None);
    };
    let verdict = &checked.verdict;
    gw.account(snap, plan, verdict, &plan.identity);
    let idx = match decision {
        Decision::Unavailable { check } => {
            let rule = &snap.rules.rules[plan.checks[check].rule as usize];
            return Err(GatewayError::LimiterUnavailable {
                rule: rule.name.to_string(),
                retry_after_secs: 1,
            });
        }
        Decision::Limited { binding } => Some(binding),
        Decision::Admit { binding } => binding,
        Decision::Refused(p) => return Err(p.into()),
        Decision::Unmatched => None,
    };
    let mut note = pending.line.as_mut().map(|l| &mut l.note);
    if let Some(n) = note.as_deref_mut() {
        // The store was down for a rule that lets requests through unchecked: say so, and
        // which rule, rather than "allowed" by no rule.
        if let Some(c) = plan
            .with_outcomes(verdict)
            .find(|(c, (_, s))| !c.check.shadow && *s == Source::FailOpen)
            .map(|(c, _)| c)
        {
            n.decision = "fail_open";
            n.fail_open = true;
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
            let q = plan.checks[i].enforced(src).quota;
            n.binding = Some(crate::telemetry::BindingLimit {
                limit: q.limit.get(),
                window_ms: q.window_us.get() / 1000,
                remaining: o.remaining,
            });
        }
        if !o.allowed {
            if let Some(n) = note {
                n.decision = "limited";
            }
            let bound = (i, o, src);
            let mut windows = Vec::new();
            let b = ctx::binding_of(plan, snap, &bound, &mut windows);
            gw.metrics().traffic.rate_limited();
            return Ok(Some(limited(gw, &b, facts.grpc, *now_us)));
        }
        admitted.binding = Some((i, o, src));
    }
    if checked.holder != 0 {
        admitted.slots = gw.hold_slots(snap, plan, verdict, checked.holder);
    }
    if snap.settles {
        admitted.after = settle::reserved_by_response_rules(snap, plan, verdict);
    }
    Ok(None)
}

/// The 429 for `binding`, as gRPC for a gRPC client, with its rate-limit headers as of `now_us`.
fn limited(gw: &State, binding: &Binding<'_>, grpc: bool, now_us: u64) -> Response<ProxyBody> {
    let lim = &gw.config().limits;
    let render = if grpc {
        respond::rate_limited_grpc
    } else {
        respond::rate_limited
    };
    render(binding, lim.ietf_headers, lim.legacy_headers, now_us)
}

/// The leaky bucket's wait before an admitted request is forwarded, microseconds, with the
/// guard that gives back what it spent if its client leaves during it; `None` without a wait.
fn queue(gw: &Arc<State>, x: &Exchange<'_>, verdict: &Verdict) -> Option<(u64, settle::RefundGuard)> {
    let delay_us = verdict
        .outcomes
        .iter()
        .filter(|(_, s)| *s == Source::Store || *s == Source::Local)
        .map(|(o, _)| o.delay_us)
        .max()
        .unwrap_or(0);
    let plan = x.plan.as_ref().filter(|_| delay_us > 0)?;
    let refund = settle::RefundGuard {
        gw: gw.clone(),
        spent: Some(verdict.spent(&plan.checks)),
    };
    Some((delay_us, refund))
}
