//! The JSON views of rules and limits: `GET /rules`, `/explain` (and `tollgate explain`), and
//! the live state of one limit.

use std::net::IpAddr;

use http::{HeaderMap, Method};
use serde_json::{json, Value};

use crate::config::GatewayConfig;
use crate::engine::plan::{request_host, LimitsFrom, RequestParts};
use crate::limiter::keys::KeyBuilder;
use crate::limiter::LimitCheck;
use crate::rules::runtime::RuntimeOverrides;
use crate::rules::{caller, normalize, window_text, RequestInfo, Rule};
use crate::state::Snapshot;

/// What the store holds for a limit now, beyond remaining and reset: requests in flight for a
/// concurrency limit, and the time left in the penalty box.
pub(super) fn live_json(c: &LimitCheck, state: Option<&crate::limiter::Outcome>) -> Value {
    let mut v = json!({});
    if c.is_slot() {
        let limit = c.quota.limit.get();
        let free = state.map_or(limit, |o| if o.penalty_us > 0 { limit } else { o.remaining });
        v["in_flight"] = json!(limit.saturating_sub(free));
    }
    if c.penalty.is_some() {
        let left = state.map_or(0, |o| o.penalty_us);
        v["penalty_left_ms"] = json!(left.div_ceil(1000));
    }
    v
}

/// A limit as it is written: `{rate, capacity}` for a bucket, `{limit, window}` for a window,
/// `{limit}` (in flight at once) for concurrency.
pub(super) fn quota_json(q: &crate::limiter::Quota) -> Value {
    use crate::limiter::Algorithm;
    match q.algorithm {
        Algorithm::TokenBucket | Algorithm::LeakyBucket => {
            json!({"rate": crate::describe::rate(q.interval_us.get()), "capacity": q.limit.get()})
        }
        Algorithm::Concurrency => json!({"limit": q.limit.get(), "slot_ttl": window_text(q.window_us.get())}),
        _ if q.calendar.is_some() => {
            use crate::limiter::algorithm::calendar::CalendarUnit;
            let (unit, off) = q.calendar.map_or((CalendarUnit::Day, 0), |c| (c.unit, c.offset_s));
            let w = match unit {
                CalendarUnit::Day => "1d",
                CalendarUnit::Week => "1w",
                CalendarUnit::Month => "1mo",
            };
            let a = off.unsigned_abs();
            let tz = format!(
                "{}{:02}:{:02}",
                if off < 0 { '-' } else { '+' },
                a / 3600,
                a % 3600 / 60
            );
            json!({"limit": q.limit.get(), "window": w, "align": "calendar", "timezone": tz})
        }
        _ => json!({"limit": q.limit.get(), "window": window_text(q.window_us.get())}),
    }
}

fn cost_from_json(c: &crate::rules::CostFrom) -> Value {
    json!({
        "header": c.header().map(|h| h.as_str()),
        "json": c.json().map(|p| p.as_str()),
        "max": c.max,
        "unit": c.unit.as_deref(),
        "in_flight": c.in_flight.map(|q| q.limit.get()),
    })
}

fn estimate_json(e: &crate::rules::Estimate) -> Value {
    json!({
        "json": e.paths.iter().map(|p| p.as_str()).collect::<Vec<_>>(),
        "default": e.default,
        "within": e.within,
    })
}

fn rule_json(r: &Rule) -> Value {
    json!({
        "name": &*r.name,
        "line": r.line,
        "match": {
            "path": r.pattern.source,
            "methods": r.methods.as_ref().map(|m| m.iter().map(|x| x.to_string()).collect::<Vec<_>>()),
            "tier": r.tier, "host": r.host,
            "header": r.headers.iter().map(|(k, v)| (k.to_string(), v.clone())).collect::<std::collections::BTreeMap<_, _>>(),
        },
        "key": r.key.to_text(),
        "algorithm": r.limits.first().map(|q| q.algorithm.as_str()),
        "limits": r.limits.iter().map(quota_json).collect::<Vec<_>>(),
        "cost": r.cost,
        "failure": crate::describe::failure(&r.failure),
        "shadow": r.shadow,
        "scope": if r.global_scope.is_some() { "global" } else { "region" },
        "penalty": r.penalty.map(|p| json!({"base": window_text(p.base_us.get()), "max": window_text(p.max_us.get())})),
        "count_when": r.count_when.as_ref().map(|m| m.to_text()),
        "cost_from": r.cost_from.as_ref().map(cost_from_json),
        "estimate": r.estimate.as_ref().map(estimate_json),
        "limit_spends": r.limit_spends.iter().enumerate().filter_map(|(n, s)| s.as_ref().map(|s| json!({
            "limit": n, "cost": s.cost,
            "cost_from": s.cost_from.as_ref().map(cost_from_json),
            "estimate": s.estimate.as_ref().map(estimate_json),
        }))).collect::<Vec<_>>(),
        "overrides": r.overrides.keys().collect::<Vec<_>>(),
    })
}

/// `GET /rules`.
pub fn rules_json(snap: &Snapshot) -> Value {
    json!({
        "version": snap.rules.version,
        "loaded_at": humantime::format_rfc3339_seconds(snap.loaded_at).to_string(),
        "api_keys": snap.keys.len(),
        "rules": snap.rules.rules.iter().map(rule_json).collect::<Vec<_>>(),
    })
}

/// The request `/explain` and `tollgate explain` ask about, and the instant they ask at.
#[derive(Clone, Copy)]
pub struct Probe<'a> {
    /// The method of the request asked about.
    pub method: &'a Method,
    /// Its path (a query allowed).
    pub path: &'a str,
    /// Its headers.
    pub headers: &'a HeaderMap,
    /// The client address it comes from.
    pub ip: IpAddr,
    /// Now, unix seconds.
    pub now_secs: u64,
}

/// What `tollgate explain` and `GET /explain` show: identity, each matching rule and why it won
/// or lost, and the store keys.
pub fn explain(
    config: &GatewayConfig,
    keys: &KeyBuilder,
    snap: &Snapshot,
    runtime: &RuntimeOverrides,
    probe: Probe<'_>,
) -> Value {
    let Probe {
        method,
        path,
        headers,
        ip,
        now_secs,
    } = probe;
    // The same plan the proxy builds for this request: one place decides the keys.
    let uri: http::Uri = path.parse().unwrap_or_else(|_| http::Uri::from_static("/"));
    let parts = RequestParts {
        method,
        uri: &uri,
        headers,
        peer: ip,
    };
    let plan = crate::engine::plan::plan(
        crate::engine::plan::PlanContext {
            snap,
            runtime,
            keys,
            now_secs,
        },
        &config.identity,
        parts,
    );
    let ident = &plan.identity;
    let norm = normalize(uri.path());
    let overridden = crate::rules::method_override(headers);
    let info = RequestInfo {
        method,
        method_override: overridden.as_ref(),
        path: &norm,
        host: request_host(headers, &uri),
        headers,
        tier: &ident.tier,
    };
    let matches: Vec<Value> = snap
        .rules
        .explain(&info)
        .into_iter()
        .map(|c| {
            let r = &snap.rules.rules[c.rule as usize];
            let s = r.specificity;
            let mut v = json!({
                "rule": &*r.name,
                "key": r.key.to_text(),
                "chosen": c.chosen,
                "why": format!(
                    "{:?} path {} (literal length {}), {}, {}{}",
                    s.class, r.pattern.source, s.literal_len,
                    if s.methods { "method-specific" } else { "any method" },
                    if s.tier { "tier-specific" } else { "any tier" },
                    if c.chosen { "; most specific of its key kind" } else { "; a more specific rule of the same key kind wins" }
                ),
                "shadow": r.shadow,
            });
            if c.chosen {
                let planned: Vec<Value> = plan
                    .checks
                    .iter()
                    .filter(|p| p.rule == c.rule)
                    .map(|p| {
                        let q = &p.check.quota;
                        json!({"store_key": p.check.key.as_str(), "algorithm": q.algorithm.as_str(), "limit": q.limit.get(), "window": window_text(q.window_us.get()), "cost": p.check.cost})
                    })
                    .collect();
                if plan.refused.is_some() {
                    v["skipped"] = Value::String("the request is refused for its credentials (see refused): no limit is checked".into());
                } else if planned.is_empty() {
                    v["skipped"] = Value::String("the request has no value for this key kind (no org / no header)".into());
                } else {
                    v["limits"] = Value::Array(planned);
                    let from = plan.checks.iter().find(|p| p.rule == c.rule).map(|p| p.from);
                    v["override"] = match from {
                        Some(LimitsFrom::Runtime { expires_at_us }) => json!({
                            "source": "runtime",
                            "expires_at": expires_at_us / 1_000_000,
                            "why": if r.overrides.contains_key(&*ident.id) {
                                "set through the admin API (PUT /overrides); it beats this identity's override in the rules file"
                            } else {
                                "set through the admin API (PUT /overrides)"
                            },
                        }),
                        Some(LimitsFrom::FileOverride) => json!({"source": "rules_file", "why": "this identity's override in the rules file"}),
                        _ => Value::Null,
                    };
                }
            }
            v
        })
        .collect();
    json!({
        "request": {"method": method.as_str(), "path": uri.path(), "normalized_path": &*norm},
        "identity": {
            "kind": ident.kind.as_str(),
            "id": if ident.kind == crate::identity::IdentityKind::Ip { ident.id.to_string() } else { format!("{} (hash {})", ident.id, caller(ident).tag(keys, "")) },
            "tier": &*ident.tier,
            "org": ident.org.as_deref(),
            "ip": ident.ip.to_string(),
        },
        "matches": matches,
        // What the proxy answers instead of checking limits, if anything (never the credential).
        "refused": match plan.refused {
            None => Value::Null,
            Some(crate::identity::CredentialProblem::Invalid) => json!({"status": 401, "error": "invalid_credentials"}),
            Some(crate::identity::CredentialProblem::Ambiguous(why)) => json!({"status": 400, "error": "bad_request", "message": why}),
        },
    })
}
