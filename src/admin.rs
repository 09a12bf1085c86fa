//! The admin listener (`admin_listen`, loopback by default): `/healthz`, `/readyz`, `/metrics`,
//! `/status`, `/rules`, `/reload`, `/explain`, `/keys/{identity}`, and the dashboard (`/`,
//! `/dashboard.json`, `/dashboard/limited/{hash}`: [`dashboard`]).
//!
//! `/healthz`, `/readyz` and `/metrics` are open; every other endpoint needs the admin token when
//! one is configured ([`auth`]). Without a token only loopback `Host` values are answered, and no
//! mutation is taken from a foreign `Origin` ([`auth::from_allowed`]); both get a 403. Every
//! response carries `Cache-Control: no-store`. Mutations (reload, counter reset) are written to
//! the audit log (tracing target `tollgate::audit`) with the caller's address, never with the
//! token.

pub mod auth;
pub mod dashboard;
pub mod error;
mod identities;
mod overrides;
mod views;

use identities::{identity_checks, identity_hash, Candidate};
pub use views::{explain, rules_json, Probe};
use views::{live_json, quota_json};

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use http::{Method, Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::engine::plan::RequestParts;
use crate::http::respond;
use crate::http::ProxyBody;
use crate::limiter::{LimitCheck, Store};
use crate::state::State;
use error::AdminError;

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

/// Answer one admin request: refused (403) when it comes from a foreign Host or Origin, else
/// [`answer`]ed; either way marked `Cache-Control: no-store` (counters, tokens' effects and
/// health change from one second to the next, and a cache must never serve them).
async fn route(gw: Arc<State>, req: Request<Incoming>, peer: SocketAddr) -> Response<ProxyBody> {
    let from = auth::from_allowed(
        gw.config().admin.has_token(),
        gw.config().admin_listen.ip().is_loopback(),
        req.method(),
        req.uri().path(),
        req.headers(),
    );
    let mut resp = match from {
        Ok(()) => answer(gw, req, peer).await,
        Err(why) => {
            tracing::warn!(target: "tollgate::audit", caller = %peer, method = %req.method(), path = %req.uri().path(), "admin request refused: {why}");
            AdminError::Forbidden(why).into_response()
        }
    };
    resp.headers_mut()
        .insert(http::header::CACHE_CONTROL, http::HeaderValue::from_static("no-store"));
    resp
}

async fn answer(gw: Arc<State>, req: Request<Incoming>, peer: SocketAddr) -> Response<ProxyBody> {
    let path = req.uri().path().to_string();
    let query = req.uri().query().unwrap_or("").to_string();
    if !auth::is_open(req.method(), &path) {
        let presented = auth::presented(req.headers());
        match gw.config().admin.access(presented.as_deref()) {
            crate::config::admin::Access::Full => {}
            crate::config::admin::Access::ReadOnly if matches!(*req.method(), Method::GET | Method::HEAD) => {}
            crate::config::admin::Access::ReadOnly => {
                tracing::warn!(target: "tollgate::audit", caller = %peer, method = %req.method(), path = %path, "admin change with a read-only token refused");
                return AdminError::Forbidden("this admin token may only read (GET, HEAD)").into_response();
            }
            crate::config::admin::Access::Denied => {
                if req.headers().contains_key(http::header::AUTHORIZATION) {
                    tracing::warn!(target: "tollgate::audit", caller = %peer, method = %req.method(), path = %path, "admin request with a wrong token refused");
                }
                return AdminError::Unauthorized.into_response();
            }
        }
    }
    match (req.method().clone(), path.as_str()) {
        (Method::GET, "/healthz") => respond::text(StatusCode::OK, "ok\n", "text/plain"),
        // Readiness is "config loaded and listeners up": this listener only runs once both are
        // bound. It never depends on the store, or a store outage would take every replica out
        // of its Service and undo fail-open. `?store=1` asks about the store instead.
        (Method::GET, "/readyz") if query_param(&query, "store").is_none_or(|v| v == "0") => ready(&gw),
        (Method::GET, "/readyz") => match gw.store_ready().await {
            Ok(()) => respond::text(StatusCode::OK, "store ok\n", "text/plain"),
            Err(e) => respond::text(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("store unavailable: {e}\n"),
                "text/plain",
            ),
        },
        // HEAD too: a probe of the endpoint gets the headers (hyper sends no body for HEAD).
        (Method::GET | Method::HEAD, "/metrics") => {
            gw.refresh_gauges();
            respond::text(
                StatusCode::OK,
                gw.metrics().encode(),
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            )
        }
        (Method::GET, "/status") => status(&gw).await,
        (Method::GET, "/") => dashboard::page(),
        (Method::GET, "/dashboard.json") => respond::json(StatusCode::OK, &dashboard::json(&gw)),
        (Method::GET, p) if p.starts_with("/dashboard/limited/") => {
            dashboard::limited(&gw, &p["/dashboard/limited/".len()..]).await
        }
        (Method::GET, "/rules") => respond::json_ok(&rules_json(&gw.snapshot().load())),
        (_, p) if p == "/overrides" || p.starts_with("/overrides/") => overrides::handle(&gw, req, peer).await,
        (Method::POST, "/reload") => reload(&gw, req, peer).await,
        (Method::GET, "/explain") => explain_route(&gw, &req, &query).await,
        (m, p) if p.starts_with("/keys/") && (m == Method::GET || m == Method::DELETE) => keys(&gw, m, p, peer).await,
        _ => AdminError::NotFound.into_response(),
    }
}

/// `POST /reload`: reload the rules and keys now; the audit log names the caller.
async fn reload(gw: &Arc<State>, req: Request<Incoming>, peer: SocketAddr) -> Response<ProxyBody> {
    let _ = req.into_body().collect().await;
    let result = gw.reload(crate::config::reload::Trigger::Admin).await;
    tracing::info!(
        target: "tollgate::audit",
        caller = %peer,
        action = "reload",
        ok = result.is_ok(),
        version = result.as_ref().map_or("", |r| r.version.as_str()),
        changed = result.as_ref().is_ok_and(|r| r.changed),
        error = result.as_ref().err().map(|e| e.to_string()),
        "admin: POST /reload"
    );
    match result {
        Ok(r) => respond::json_ok(&json!({
            "result": "ok",
            "version": r.version,
            "changed": r.changed,
            "rules": r.rules,
            "rule_names": r.rule_names,
            "keys": r.keys,
            "config_file_changed": gw.metrics().reload.config_file_changed.get() == 1,
        })),
        Err(e) => respond::json(
            StatusCode::UNPROCESSABLE_ENTITY,
            &json!({"result": "error", "error": e.to_string()}),
        ),
    }
}

/// `GET /explain?…`: the plan of a request described by the query (method, path, host, ip,
/// headers), with the keys it would spend and, on request, their live state.
async fn explain_route(gw: &Arc<State>, req: &Request<Incoming>, query: &str) -> Response<ProxyBody> {
    let method = query_param(query, "method")
        .unwrap_or("GET".into())
        .to_ascii_uppercase();
    let Ok(method) = Method::from_bytes(method.as_bytes()) else {
        return AdminError::BadRequest("invalid method").into_response();
    };
    let p = query_param(query, "path").unwrap_or("/".into()).into_owned();
    let ip: IpAddr = match query_param(query, "ip") {
        None => IpAddr::from([127, 0, 0, 1]),
        Some(s) => match s.parse() {
            Ok(ip) => ip,
            Err(_) => return AdminError::BadRequest("ip: not an IP address").into_response(),
        },
    };
    // `host=` explains the request as sent under that Host (the admin API's own Host is
    // loopback when it has no token).
    let mut headers = req.headers().clone();
    if let Some(h) = query_param(query, "host") {
        let Ok(v) = http::HeaderValue::from_str(&h) else {
            return AdminError::BadRequest("host: not a valid Host value").into_response();
        };
        headers.insert(http::header::HOST, v);
    }
    let snap = gw.snapshot().load_full();
    let now_secs = gw.clock().now_us() / 1_000_000;
    let runtime = gw.runtime().load_full();
    let probe = views::Probe {
        method: &method,
        path: &p,
        headers: &headers,
        ip,
        now_secs,
    };
    let mut v = explain(gw.config(), gw.keys(), &snap, &runtime, probe);
    // The live state of each planned limit: remaining, requests in flight, penalty left.
    let uri: http::Uri = p.parse().unwrap_or_else(|_| http::Uri::from_static("/"));
    let parts = RequestParts {
        method: &method,
        uri: &uri,
        headers: &headers,
        peer: ip,
    };
    let plan = crate::engine::plan::plan(
        crate::engine::plan::PlanContext {
            snap: &snap,
            runtime: &runtime,
            keys: gw.keys(),
            now_secs,
        },
        &gw.config().identity,
        parts,
    );
    let checks: Vec<LimitCheck> = plan
        .checks
        .iter()
        .map(|c| LimitCheck {
            cost: 0,
            ..c.check.clone()
        })
        .collect();
    if let Ok(states) = gw.limiter().store().peek(&checks).await {
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

/// `GET` / `DELETE /keys/{identity}`: the counters of a caller, or reset them on every node.
async fn keys(gw: &Arc<State>, m: Method, p: &str, peer: SocketAddr) -> Response<ProxyBody> {
    let raw = &p["/keys/".len()..];
    let who = percent_encoding::percent_decode_str(raw)
        .decode_utf8_lossy()
        .into_owned();
    if who.is_empty() {
        return AdminError::NotFound.into_response();
    }
    let snap = gw.snapshot().load();
    let runtime = gw.runtime().load_full();
    let candidates = identity_checks(gw.keys(), &snap, &runtime, &who, gw.clock().now_us() / 1_000_000);
    let all: Vec<LimitCheck> = candidates.checks.iter().map(|c| c.check.clone()).collect();
    // Peek first: which counters exist decides which rules apply to values tollgate cannot
    // enumerate (JWT users, orgs from tokens, header values), and whether it exists at all.
    let states = match gw.limiter().store().peek(&all).await {
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
        return AdminError::UnknownIdentity.into_response();
    }
    if m == Method::DELETE {
        let keys: Vec<LimitCheck> = kept.iter().map(|(c, _)| c.check.clone()).collect();
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
                respond::json_ok(&json!({"result": "reset", "counters": keys.len(), "penalties_lifted": lifted}))
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
            // A limit that settles against a reported cost: what is spent splits into what
            // this node's requests still hold reserved and what has been charged.
            let rule = snap.rules.rules.get(c.planned_rule as usize);
            if let Some(sp) = rule
                .map(|r| r.spend_of_slot(c.spend))
                .filter(|sp| sp.cost_from.is_some())
            {
                let used = q
                    .limit
                    .get()
                    .saturating_sub(s.as_ref().map_or(q.limit.get(), |o| o.remaining));
                let reserved = gw.limiter().reserved_at(&c.check.key);
                v["unit"] = json!(sp.cost_from.and_then(|cf| cf.unit.as_deref()));
                v["reserved"] = json!(reserved);
                v["charged"] = json!(used.saturating_sub(reserved));
            }
            // A global limit: each region's spend of this window, this region's from its store
            // and the others' as last read from theirs.
            if let (Some(regions), true) = (gw.regions(), rule.is_some_and(|r| r.global_scope.is_some())) {
                let own = q
                    .limit
                    .get()
                    .saturating_sub(s.as_ref().map_or(q.limit.get(), |o| o.remaining));
                let index = gw.clock().now_us() / q.window_us.get();
                let mut spend = serde_json::Map::new();
                spend.insert(regions.config().name.to_string(), json!(own));
                for (name, units) in regions.peer_units(c.check.key.as_str(), index) {
                    spend.insert(name.to_string(), json!(units));
                }
                // What is left of the global limit: less every region's spend, as known here.
                let spent: u64 = spend.values().filter_map(Value::as_u64).sum();
                v["remaining"] = json!(q.limit.get().saturating_sub(spent));
                v["scope"] = json!("global");
                v["regions"] = Value::Object(spend);
            }
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

/// `GET /readyz`: ready unless draining or the Redis user lacks a permission the scripts need.
fn ready(gw: &State) -> Response<ProxyBody> {
    // The one store condition readiness follows: a Redis user without the permissions
    // the scripts need is a deployment mistake, not an outage.
    match gw.store_permission_error() {
        _ if gw.draining() => respond::text(
            StatusCode::SERVICE_UNAVAILABLE,
            "not ready: draining for shutdown\n",
            "text/plain",
        ),
        None => respond::text(StatusCode::OK, "ready\n", "text/plain"),
        Some(e) => respond::text(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: the Redis user lacks a permission tollgate needs: {e}\n"),
            "text/plain",
        ),
    }
}

/// `GET /status`: the store, the rules and keys in force, and the last reload.
async fn status(gw: &State) -> Response<ProxyBody> {
    let store = gw.store_ready().await;
    gw.refresh_breaker_gauges();
    let snap = gw.snapshot().load();
    respond::json_ok(&json!({
        "ready": true,
        "store": {
            "kind": crate::describe::store_kind(gw.config().store.kind),
            "ok": store.is_ok(),
            "error": store.err().map(|e| e.to_string()),
            "breakers_open": gw.metrics().store.breaker_open.get(),
        },
        "rules_version": snap.rules.version,
        "rules": snap.rules.rules.len(),
        "api_keys": snap.keys.len(),
        "last_reload_success": gw.metrics().reload.last_success.get() == 1,
        "last_reload_success_at": gw.metrics().reload.last_success_timestamp.get(),
        "config_file_changed": gw.metrics().reload.config_file_changed.get() == 1,
        "version": env!("CARGO_PKG_VERSION"),
        "adaptive": gw.adaptive().map(|a| a.status()),
        "region": gw.regions().map(|r| r.status_json()),
    }))
}
