//! The admin dashboard: `GET /` serves one self-contained page (HTML, CSS and
//! JS compiled into the binary, no CDN, no build step) that refreshes every 2 s from
//! `GET /dashboard.json`; `GET /dashboard/limited/{hash}` is the detail of one limited identity
//! hash. All three sit behind the admin token like `/status`: a browser opens them with HTTP
//! Basic (any user name, the token as the password), and the page's own requests to the same
//! origin carry those credentials.
//!
//! The history it shows comes from [`crate::activity`]; [`sample_every_second`] feeds it from
//! the existing counters, off the request path.

use super::AdminError;
use std::sync::Arc;
use std::time::Duration;

use http::{Response, StatusCode};
use serde_json::{json, Value};
use tokio::sync::watch;

use crate::activity::{self, ShardView, Tick};
use crate::http::respond;
use crate::http::ProxyBody;
use crate::limiter::{Backend, LimitCheck};
use crate::state::State;

/// The page: HTML with its CSS and JS inlined at compile time.
const PAGE: &str = concat!(
    include_str!("dashboard.html"),
    "<style>\n",
    include_str!("dashboard.css"),
    "</style>\n<script>\n",
    include_str!("dashboard.js"),
    "</script>\n</body>\n</html>\n"
);

/// Rules listed in `/dashboard.json` (the busiest of the last five minutes first).
const MAX_LISTED_RULES: usize = 50;

/// Limited identity hashes listed.
const MAX_LIMITED: usize = 20;

/// `GET /`.
pub fn page() -> Response<ProxyBody> {
    respond::page(PAGE)
}

/// Sample the counters into [`crate::activity::Activity`] once a second until `stop`.
pub async fn sample_every_second(gw: Arc<State>, mut stop: watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.changed() => return,
        }
        sample(&gw);
    }
}

/// The store's shards now (one pseudo-shard for the memory store).
fn shards(gw: &State) -> Vec<ShardView> {
    match gw.limiter().store() {
        Backend::Memory(_) => vec![ShardView {
            addr: "memory".into(),
            breaker_open: false,
            opened_total: 0,
        }],
        Backend::Redis(r) => r
            .shard_states()
            .into_iter()
            .map(|(addr, breaker_open, opened_total)| ShardView {
                addr,
                breaker_open,
                opened_total,
            })
            .collect(),
    }
}

/// One sample: per-rule counters, shards, store errors, upstream traffic.
pub fn sample(gw: &State) {
    let snap = gw.snapshot().load();
    let m = gw.metrics();
    let rules = snap
        .rules
        .rules
        .iter()
        .zip(&snap.rule_metrics)
        .map(|(r, rm)| (&r.name, [rm.allowed.get(), rm.denied.get(), rm.would_deny.get()]))
        .collect();
    let up = &m.upstream.status;
    gw.activity().sample(Tick {
        now: gw.clock().now_us() / 1_000_000,
        rules,
        shards: shards(gw),
        store_errors: m.store.error.get() + m.store.timeout.get() + m.store.circuit_open.get(),
        upstream: [up[..5].iter().map(|c| c.get()).sum(), up[5].get()],
    });
}

/// `GET /dashboard.json`: everything the page shows. Per-rule totals are read from the counters
/// now, so they equal `/metrics`; the per-second series are as of the last sample.
pub fn json(gw: &State) -> Value {
    let act = gw.activity();
    let snap = gw.snapshot().load();
    let m = gw.metrics();
    let mut rules: Vec<(u64, usize, Value)> = snap
        .rules
        .rules
        .iter()
        .zip(&snap.rule_metrics)
        .enumerate()
        .map(|(i, (r, rm))| {
            let s = act.series(&r.name);
            let busy = s.sums.iter().sum::<u64>();
            let v = json!({
                "name": &*r.name,
                "key": r.key.to_text(),
                "shadow": r.shadow,
                "limits": r.limits.iter().map(crate::describe::quota).collect::<Vec<_>>(),
                "totals": {
                    "allowed": rm.allowed.get(),
                    "denied": rm.denied.get(),
                    "would_deny": rm.would_deny.get(),
                },
                "last_5m": {"allowed": s.sums[0], "denied": s.sums[1], "would_deny": s.sums[2]},
                "per_second": s.per_second,
            });
            (busy, i, v)
        })
        .collect();
    let rules_total = rules.len();
    rules.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    rules.truncate(MAX_LISTED_RULES);
    let (shards, history, errors) = act.store();
    let up = act.upstream();
    let up_state = match (up.responses, up.failures) {
        (0, 0) => "idle",
        (0, _) => "down",
        (_, 0) => "up",
        _ => "degraded",
    };
    json!({
        "now": gw.clock().now_us() / 1_000_000,
        "sampled_at": act.now(),
        "version": env!("CARGO_PKG_VERSION"),
        "store": {
            "kind": crate::describe::store_kind(gw.config().store.kind),
            "state": activity::store_state(&shards),
            "shards": shards,
            "errors_last_minute": errors,
            "history": history,
        },
        "rules": {
            "version": snap.rules.version,
            "loaded_at": humantime::format_rfc3339_seconds(snap.loaded_at).to_string(),
            "count": rules_total,
            "api_keys": snap.keys.len(),
            "last_reload_ok": m.reload.last_success.get() == 1,
            "config_file_changed": m.reload.config_file_changed.get() == 1,
            "reloads": act.reloads(),
        },
        "series": {
            "seconds": activity::SERIES_SECONDS,
            "end": act.now(),
            "rules_total": rules_total,
            "rules": rules.into_iter().map(|(_, _, v)| v).collect::<Vec<_>>(),
        },
        "limited": act.top_limited(MAX_LIMITED),
        // One entry per target: ejected ones say so, each with its own answers, failures and
        // ejections since start; the last-minute figures are the upstream's as a whole (the
        // sampler reads the per-class response counters).
        "upstreams": gw.upstream().status().into_iter().zip(gw.upstream().target_totals()).map(|((url, is_in), (answered, failed, ejections))| json!({
            "url": url,
            "state": if is_in { up_state } else { "ejected" },
            "in": is_in,
            "responses_total": answered,
            "failures_total": failed,
            "ejections_total": ejections,
            "responses_last_minute": up.responses,
            "failures_last_minute": up.failures,
            "last_failure_at": up.last_failure_at,
        })).collect::<Vec<_>>(),
        // The Envoy rate-limit service's domains in force, each with its answers since start;
        // `null` when the service does not run.
        "rls": gw.config().rls.as_ref().map(|_| json!({
            "domains": m.rls.domains().into_iter().map(|(d, t)| json!({
                "name": d.name,
                "file": d.file,
                "limits": d.limits,
                "calls_ok": t.calls_ok,
                "calls_over_limit": t.calls_over_limit,
                "descriptors_over_limit": t.descriptors_over_limit,
            })).collect::<Vec<_>>(),
        })),
        // Adaptive concurrency: the limit, in flight, latencies, per-class counts, and the
        // last two minutes of limit and in-flight (one point a second); `null` when off.
        "adaptive": gw.adaptive().map(|a| a.status()),
        // The last ejections, newest first: which target, when (Unix seconds, like `now`), for
        // how long, and the failure that took it out.
        "recent_ejections": gw.upstream().recent_ejections().into_iter().map(|e| json!({
            "target": &*e.target,
            "at": e.at_ms / 1000,
            "out_for_ms": e.out_for_ms,
            "why": e.why,
        })).collect::<Vec<_>>(),
    })
}

/// `GET /dashboard/limited/{hash}`: what is known of one limited identity hash: its denials in
/// the last five minutes per rule, and the current state of each such rule's counters for it
/// (the rule's configured limits; a per-identity override cannot be told from a hash).
pub async fn limited(gw: &State, hash: &str) -> Response<ProxyBody> {
    if hash.len() != 24 || !hash.bytes().all(|b| b.is_ascii_hexdigit()) {
        return AdminError::NotFound.into_response();
    }
    let seen: Vec<_> = gw
        .activity()
        .top_limited(usize::MAX)
        .into_iter()
        .filter(|l| l.hash == hash)
        .collect();
    if seen.is_empty() {
        return AdminError::NotFound.into_response();
    }
    let snap = gw.snapshot().load();
    let mut checks = Vec::new();
    let mut owners = Vec::new();
    for l in &seen {
        let Some(r) = snap.rules.rules.iter().find(|r| *r.name == *l.rule) else {
            continue;
        };
        for (n, q) in r.limits.iter().enumerate() {
            checks.push(LimitCheck {
                key: gw.keys().key(hash, &r.key_name, n),
                quota: *q,
                cost: 0,
                shadow: r.shadow,
                holder: 0,
                penalty: r.penalty,
                lease: None,
            });
            owners.push((
                l.rule.clone(),
                crate::describe::quota(q),
                r.header_unit(n).name,
                r.global_scope.is_some(),
            ));
        }
    }
    let states = match tokio::time::timeout(
        gw.config().store.timeout.max(Duration::from_millis(200)),
        crate::limiter::Store::peek(gw.limiter().store(), &checks),
    )
    .await
    {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => return respond::json(StatusCode::SERVICE_UNAVAILABLE, &json!({"error": e.to_string()})),
        Err(_) => return respond::json(StatusCode::SERVICE_UNAVAILABLE, &json!({"error": "store timeout"})),
    };
    let counters: Vec<Value> = owners
        .iter()
        .zip(&checks)
        .zip(states)
        .map(|(((rule, limit, unit, global), c), s)| {
            let remaining = s.as_ref().map_or(c.quota.limit.get(), |o| o.remaining);
            // A global limit: each region's spend of this window (this region's own, the
            // others' as last read).
            let regions = gw.regions().filter(|_| *global).map(|regions| {
                let index = gw.clock().now_us() / c.quota.window_us.get();
                let mut spend = vec![(
                    regions.config().name.to_string(),
                    c.quota.limit.get().saturating_sub(remaining),
                )];
                spend.extend(
                    regions
                        .peer_units(c.key.as_str(), index)
                        .into_iter()
                        .map(|(n, u)| (n.to_string(), u)),
                );
                spend.into_iter().collect::<std::collections::BTreeMap<_, _>>()
            });
            // A token budget: its unit, and what this node's requests hold reserved in it.
            json!({
                "rule": rule,
                "limit": limit,
                "unit": unit.as_deref(),
                "reserved": gw.limiter().reserved_at(&c.key),
                "remaining": remaining,
                "reset_ms": s.as_ref().map_or(0, |o| o.reset_us / 1000),
                "tracked": s.is_some(),
                "regions": regions,
            })
        })
        .collect();
    respond::json_ok(&json!({
        "hash": hash,
        "denials_last_5m": seen,
        "counters": counters,
    }))
}
