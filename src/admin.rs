//! The admin listener (`admin_listen`, loopback by default): `/healthz`, `/readyz`, `/metrics`,
//! `/status`, `/rules`, `/reload`, `/explain`, `/keys/{identity}`, and the dashboard (`/`,
//! `/dashboard.json`, `/dashboard/limited/{hash}`: [`dashboard`]).
//!
//! `/healthz`, `/readyz` and `/metrics` are open; every other endpoint needs the admin token when
//! one is configured ([`auth`]). Mutations (reload, counter reset) are written to the audit log
//! (tracing target `tollgate::audit`) with the caller's address, never with the token.

pub mod auth;
pub mod dashboard;
mod overrides;

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use http::{HeaderMap, Method, Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::config::GatewayConfig;
use crate::http::respond::{self, GatewayError};
use crate::http::ProxyBody;
use crate::limiter::keys::{KeyBuilder, Namespace};
use crate::limiter::{LimitCheck, Store, StoreKey};
use crate::proxy::plan::{request_host, LimitsFrom, RequestParts};
use crate::rules::runtime::RuntimeOverrides;
use crate::rules::{caller, normalize, window_text, KeyKind, RequestInfo, Rule};
use crate::state::{Snapshot, State};

/// Time an admin client has to send its request headers (the admin port is for people and
/// scrapers on a short network path; a slow one is cut off instead of holding a task).
const ADMIN_HEADER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Serve the admin API until `stop`.
pub async fn serve(gw: Arc<State>, listener: TcpListener, mut stop: watch::Receiver<bool>) {
    tokio::spawn(dashboard::sample_every_second(gw.clone(), stop.clone()));
    loop {
        let (stream, peer) = tokio::select! {
            x = crate::http::accept(&listener) => x,
            _ = stop.changed() => return,
        };
        let gw = gw.clone();
        tokio::spawn(async move {
            let svc = service_fn(move |req| {
                let gw = gw.clone();
                async move { Ok::<_, std::convert::Infallible>(route(gw, req, peer).await) }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(ADMIN_HEADER_TIMEOUT)
                .serve_connection(TokioIo::new(stream), svc)
                .await;
        });
    }
}

fn query_param<'a>(q: &'a str, name: &str) -> Option<std::borrow::Cow<'a, str>> {
    q.split('&').find_map(|kv| {
        let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
        (k == name).then(|| percent_encoding::percent_decode_str(v).decode_utf8_lossy())
    })
}

async fn route(gw: Arc<State>, req: Request<Incoming>, peer: SocketAddr) -> Response<ProxyBody> {
    let path = req.uri().path().to_string();
    let query = req.uri().query().unwrap_or("").to_string();
    if !auth::is_open(req.method(), &path) && !auth::allowed(gw.config().admin.token.as_ref(), req.headers()) {
        if req.headers().contains_key(http::header::AUTHORIZATION) {
            tracing::warn!(target: "tollgate::audit", caller = %peer, method = %req.method(), path = %path, "admin request with a wrong token refused");
        }
        return GatewayError::Unauthorized.into_response();
    }
    match (req.method().clone(), path.as_str()) {
        (Method::GET, "/healthz") => respond::text(StatusCode::OK, "ok\n", "text/plain"),
        // Readiness is "config loaded and listeners up": this listener only runs once both are
        // bound. It never depends on the store, or a store outage would take every replica out
        // of its Service and undo fail-open. `?store=1` asks about the store instead.
        (Method::GET, "/readyz") if query_param(&query, "store").is_none_or(|v| v == "0") => {
            respond::text(StatusCode::OK, "ready\n", "text/plain")
        }
        (Method::GET, "/readyz") => match gw.store_ready().await {
            Ok(()) => respond::text(StatusCode::OK, "store ok\n", "text/plain"),
            Err(e) => respond::text(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("store unavailable: {e}\n"),
                "text/plain",
            ),
        },
        (Method::GET, "/metrics") => {
            gw.refresh_gauges();
            respond::text(
                StatusCode::OK,
                gw.metrics().encode(),
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            )
        }
        (Method::GET, "/status") => {
            let store = gw.store_ready().await;
            let snap = gw.snapshot().load();
            respond::json_ok(&json!({
                "ready": true,
                "store": {
                    "kind": crate::describe::store_kind(gw.config().store.kind),
                    "ok": store.is_ok(),
                    "error": store.err().map(|e| e.to_string()),
                    "breakers_open": gw.metrics().breaker_open.get(),
                },
                "rules_version": snap.rules.version,
                "rules": snap.rules.rules.len(),
                "api_keys": snap.keys.len(),
                "last_reload_success": gw.metrics().last_reload_success.get() == 1,
                "last_reload_success_at": gw.metrics().last_reload_success_timestamp.get(),
                "config_file_changed": gw.metrics().config_file_changed.get() == 1,
                "version": env!("CARGO_PKG_VERSION"),
            }))
        }
        (Method::GET, "/") => dashboard::page(),
        (Method::GET, "/dashboard.json") => respond::json(StatusCode::OK, &dashboard::json(&gw)),
        (Method::GET, p) if p.starts_with("/dashboard/limited/") => {
            dashboard::limited(&gw, &p["/dashboard/limited/".len()..]).await
        }
        (Method::GET, "/rules") => respond::json_ok(&rules_json(&gw.snapshot().load())),
        (_, p) if p == "/overrides" || p.starts_with("/overrides/") => overrides::handle(&gw, req, peer).await,
        (Method::POST, "/reload") => {
            let _ = req.into_body().collect().await;
            let result = gw.reload(crate::config::reload::Trigger::Admin).await;
            tracing::info!(
                target: "tollgate::audit",
                caller = %peer,
                action = "reload",
                ok = result.is_ok(),
                version = result.as_ref().map_or("", |r| r.version.as_str()),
                changed = result.as_ref().is_ok_and(|r| r.changed),
                "admin: POST /reload"
            );
            match result {
                Ok(r) => respond::json_ok(&json!({
                    "result": "ok",
                    "version": r.version,
                    "changed": r.changed,
                    "rules": r.rules,
                    "keys": r.keys,
                    "config_file_changed": gw.metrics().config_file_changed.get() == 1,
                })),
                Err(e) => respond::json(
                    StatusCode::UNPROCESSABLE_ENTITY,
                    &json!({"result": "error", "error": e.to_string()}),
                ),
            }
        }
        (Method::GET, "/explain") => {
            let method = query_param(&query, "method")
                .unwrap_or("GET".into())
                .to_ascii_uppercase();
            let Ok(method) = Method::from_bytes(method.as_bytes()) else {
                return GatewayError::BadRequest("invalid method").into_response();
            };
            let p = query_param(&query, "path").unwrap_or("/".into()).into_owned();
            let ip: IpAddr = query_param(&query, "ip")
                .and_then(|s| s.parse().ok())
                .unwrap_or(IpAddr::from([127, 0, 0, 1]));
            let snap = gw.snapshot().load_full();
            let now_secs = gw.clock().now_us() / 1_000_000;
            let runtime = gw.runtime().load_full();
            let mut v = explain(
                gw.config(),
                gw.keys(),
                &snap,
                &runtime,
                &method,
                &p,
                req.headers(),
                ip,
                now_secs,
            );
            // The live state of each planned limit: remaining, requests in flight, penalty left.
            let uri: http::Uri = p.parse().unwrap_or_else(|_| http::Uri::from_static("/"));
            let parts = RequestParts {
                method: &method,
                uri: &uri,
                headers: req.headers(),
                peer: ip,
            };
            let plan = crate::proxy::plan::plan(&snap, &runtime, gw.keys(), &gw.config().identity, parts, now_secs);
            let checks: Vec<LimitCheck> = plan
                .checks
                .iter()
                .map(|c| LimitCheck {
                    cost: 0,
                    ..c.check.clone()
                })
                .collect();
            if let Ok(states) = gw.limiter().store.peek(&checks).await {
                let live: Vec<Value> = plan
                    .checks
                    .iter()
                    .zip(&checks)
                    .zip(&states)
                    .map(|((p, c), st)| {
                        let q = &c.quota;
                        let mut e = json!({
                            "rule": &*snap.rules.rules[p.rule as usize].name,
                            "store_key": c.key.as_str(),
                            "limit": q.limit.get(),
                            "remaining": st.as_ref().map_or(q.limit.get(), |o| o.remaining),
                        });
                        if let (Value::Object(o), Value::Object(w)) = (&mut e, live_json(c, st.as_ref())) {
                            o.extend(w);
                        }
                        e
                    })
                    .collect();
                v["live"] = Value::Array(live);
            }
            respond::json_ok(&v)
        }
        (m, p) if p.starts_with("/keys/") && (m == Method::GET || m == Method::DELETE) => {
            let raw = &p["/keys/".len()..];
            let who = percent_encoding::percent_decode_str(raw)
                .decode_utf8_lossy()
                .into_owned();
            if who.is_empty() {
                return GatewayError::NotFound.into_response();
            }
            let snap = gw.snapshot().load();
            let runtime = gw.runtime().load_full();
            let candidates = identity_checks(gw.keys(), &snap, &runtime, &who, gw.clock().now_us() / 1_000_000);
            let all: Vec<LimitCheck> = candidates.checks.iter().map(|c| c.check.clone()).collect();
            // Peek first: which counters exist decides which rules apply to values tollgate cannot
            // enumerate (JWT users, orgs from tokens, header values), and whether it exists at all.
            let states = match gw.limiter().store.peek(&all).await {
                Ok(s) => s,
                Err(e) => {
                    return respond::json(StatusCode::SERVICE_UNAVAILABLE, &json!({"error": e.to_string()}));
                }
            };
            let kept: Vec<(&Candidate, Option<crate::limiter::Outcome>)> = candidates
                .checks
                .iter()
                .zip(states)
                .filter(|(c, s)| c.certain || s.is_some())
                .collect();
            let tracked = kept.iter().any(|(_, s)| s.is_some());
            if !candidates.known && !tracked {
                return GatewayError::UnknownIdentity.into_response();
            }
            if m == Method::DELETE {
                let keys: Vec<StoreKey> = kept.iter().map(|(c, _)| c.check.key.clone()).collect();
                return match gw.limiter().reset(&keys).await {
                    Ok(()) => {
                        let mut lifted = 0;
                        for (c, s) in &kept {
                            if s.as_ref().is_some_and(|o| o.penalty_us > 0) {
                                lifted += 1;
                                if let Some(i) = snap.rules.rules.iter().position(|r| *r.name == *c.rule) {
                                    snap.rule_metrics[i].penalty_lifted.inc();
                                }
                            }
                        }
                        tracing::info!(
                            target: "tollgate::audit",
                            caller = %peer,
                            action = "reset",
                            identity_hash = %identity_hash(gw.keys(), &snap, &who),
                            counters = keys.len(),
                            penalties_lifted = lifted,
                            "admin: DELETE /keys: counters reset"
                        );
                        respond::json_ok(
                            &json!({"result": "reset", "counters": keys.len(), "penalties_lifted": lifted}),
                        )
                    }
                    Err(e) => respond::json(
                        StatusCode::SERVICE_UNAVAILABLE,
                        &json!({"result": "error", "error": e.to_string()}),
                    ),
                };
            }
            let counters: Vec<Value> = kept
                .iter()
                .map(|(c, s)| {
                    let q = &c.check.quota;
                    let mut v = json!({
                        "rule": c.rule,
                        "key_kind": c.kind,
                        "algorithm": q.algorithm.as_str(),
                        "limit": q.limit.get(),
                        "remaining": s.as_ref().map_or(q.limit.get(), |o| o.remaining),
                        "reset_ms": s.as_ref().map_or(0, |o| o.reset_us / 1000),
                        "tracked": s.is_some(),
                    });
                    if let (Value::Object(o), Value::Object(w)) = (&mut v, quota_json(q)) {
                        o.extend(w);
                    }
                    if let (Value::Object(o), Value::Object(w)) = (&mut v, live_json(&c.check, s.as_ref())) {
                        o.extend(w);
                    }
                    v
                })
                .collect();
            respond::json_ok(&json!({
                "identity": candidates.kind,
                "identity_hash": identity_hash(gw.keys(), &snap, &who),
                "counters": counters,
            }))
        }
        _ => GatewayError::NotFound.into_response(),
    }
}

/// One counter an identity value may have.
struct Candidate {
    /// The check (cost 0) naming the counter.
    check: LimitCheck,
    /// Its rule.
    rule: String,
    /// The rule's key kind.
    kind: String,
    /// The rule certainly applies to this value (a registered key id's user rules, an IP's ip
    /// and user rules, a registered org's org rules); otherwise only when a counter exists.
    certain: bool,
}

/// What `/keys/{identity}` knows about a value before looking at the store.
struct Candidates {
    /// Every counter it may have.
    checks: Vec<Candidate>,
    /// Known without counters: a registered key id or org, an IP, or an override's id.
    known: bool,
    /// What the value was taken for: `api_key`, `ip`, `org` or `user` (a JWT user, a header value).
    kind: &'static str,
}

/// Every counter an identity value (user id, key id, IP, org, header value) can have, with
/// the namespace each rule's key kind gives that value (see `limiter::keys`): a registered key
/// id is an API key, an address is an IP, anything else a JWT user.
fn identity_checks(
    keys: &KeyBuilder,
    snap: &Snapshot,
    runtime: &RuntimeOverrides,
    who: &str,
    now_secs: u64,
) -> Candidates {
    let is_ip = who.parse::<IpAddr>().is_ok();
    let is_key = snap.keys.has_id(who);
    let is_org = snap.keys.entries().any(|(_, e)| e.org.as_deref() == Some(who));
    let caller_ns = if is_key {
        Namespace::ApiKey
    } else if is_ip {
        Namespace::Ip
    } else {
        Namespace::Jwt
    };
    // The caller's tier is known for a registered key (its tier) and for an IP as a caller
    // (anonymous): a `user` rule for another tier applies only if a counter says it once did
    // (the key's tier changed). `ip` and `org` rules are shared by callers of every tier.
    let key_tier: Option<std::sync::Arc<str>> = match snap.keys.entries().find(|(_, e)| &*e.id == who) {
        Some((_, e)) => Some(e.tier.clone()),
        None if is_ip => Some(std::sync::Arc::from(crate::identity::ANONYMOUS)),
        None => None,
    };
    let mut checks = Vec::new();
    let mut has_override = false;
    for (ri, r) in snap.rules.rules.iter().enumerate() {
        let other_tier =
            r.key == KeyKind::User && matches!((&r.tier, &key_tier), (Some(t), Some(k)) if t.as_str() != &**k);
        let (ns, certain) = match r.key {
            KeyKind::Global => continue,
            KeyKind::User => (caller_ns, is_key || is_ip),
            KeyKind::Ip if is_ip => (Namespace::Ip, true),
            KeyKind::Ip => continue,
            KeyKind::Org if is_ip => continue,
            KeyKind::Org => (Namespace::Org, is_org),
            KeyKind::Header(_) => (Namespace::Header, false),
        };
        let over = r.overrides.get(who);
        has_override |= over.is_some();
        // The keys the proxy would use for this value: the plan's own key builder.
        let mut planned = crate::proxy::plan::PlannedChecks::new();
        let value = crate::rules::KeyValue::Value(ns, who.as_bytes());
        let ri = u32::try_from(ri).unwrap_or(u32::MAX);
        let who_id = crate::identity::IdText::from(who);
        crate::proxy::plan::rule_checks(
            snap,
            runtime,
            now_secs,
            keys,
            ri,
            value,
            &who_id,
            &mut None,
            &mut planned,
        );
        for p in planned {
            checks.push(Candidate {
                check: LimitCheck { cost: 0, ..p.check },
                rule: r.name.to_string(),
                kind: r.key.to_text(),
                certain: (certain && !other_tier) || over.is_some(),
            });
        }
    }
    let kind = if is_key {
        "api_key"
    } else if is_ip {
        "ip"
    } else if is_org {
        "org"
    } else {
        "user"
    };
    Candidates {
        checks,
        known: is_key || is_ip || is_org || has_override,
        kind,
    }
}

/// What the store holds for a limit now, beyond remaining and reset: requests in flight for a
/// concurrency limit, and the time left in the penalty box.
fn live_json(c: &LimitCheck, state: Option<&crate::limiter::Outcome>) -> Value {
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
fn quota_json(q: &crate::limiter::Quota) -> Value {
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

/// The hash an identity value is logged under (its caller namespace, as in `identity_checks`).
fn identity_hash(keys: &KeyBuilder, snap: &Snapshot, who: &str) -> String {
    let ns = if snap.keys.has_id(who) {
        Namespace::ApiKey
    } else if who.parse::<IpAddr>().is_ok() {
        Namespace::Ip
    } else {
        Namespace::Jwt
    };
    keys.tag(ns, who.as_bytes()).to_string()
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
        "penalty": r.penalty.map(|p| json!({"base": window_text(p.base_us.get()), "max": window_text(p.max_us.get())})),
        "count_when": r.count_when.as_ref().map(|m| m.to_text()),
        "cost_from": r.cost_from.as_ref().map(|c| json!({"header": c.header.as_str(), "max": c.max})),
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

/// What `tollgate explain` and `GET /explain` show: identity, each matching rule and why it won
/// or lost, and the store keys.
#[allow(clippy::too_many_arguments)]
pub fn explain(
    config: &GatewayConfig,
    keys: &KeyBuilder,
    snap: &Snapshot,
    runtime: &RuntimeOverrides,
    method: &Method,
    path: &str,
    headers: &HeaderMap,
    ip: IpAddr,
    now_secs: u64,
) -> Value {
    // The same plan the proxy builds for this request: one place decides the keys.
    let uri: http::Uri = path.parse().unwrap_or_else(|_| http::Uri::from_static("/"));
    let parts = RequestParts {
        method,
        uri: &uri,
        headers,
        peer: ip,
    };
    let plan = crate::proxy::plan::plan(snap, runtime, keys, &config.identity, parts, now_secs);
    let ident = &plan.identity;
    let norm = normalize(uri.path());
    let info = RequestInfo {
        method,
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
                if planned.is_empty() {
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
    })
}
