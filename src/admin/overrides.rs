//! `PUT / GET / DELETE /overrides/...`: runtime overrides, kept in the store so
//! every node sees them within a second, each with an expiry, beating the rules file.
//!
//! `PUT /overrides/{user|ip|org|header:Name}/{value}` with `{"rule": ..., "limits": [...],
//! "expires_at": <unix seconds | RFC 3339>}`; `GET /overrides` lists them (by the value's hash:
//! the raw value is never stored); `DELETE /overrides/{kind}/{value}[?rule=name]` removes them.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::SystemTime;

use http::{Method, Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use serde::Deserialize;
use serde_json::{json, Value};

use super::AdminError;
use crate::http::respond;
use crate::http::ProxyBody;
use crate::limiter::keys::Namespace;
use crate::rules::runtime::{quotas, OverrideLimit, StoredOverride, MAX_OVERRIDE_SECS};
use crate::rules::{KeyKind, Rule};
use crate::state::{Snapshot, State};

/// Largest request body `PUT /overrides` reads.
const MAX_BODY: usize = 64 * 1024;

/// The body of `PUT /overrides/...`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PutBody {
    /// The rule whose limits it replaces.
    rule: String,
    /// The limits that replace the rule's for this identity (at least one).
    limits: Vec<OverrideLimit>,
    /// Unix seconds, or an RFC 3339 time.
    expires_at: Value,
}

fn unprocessable(msg: impl Into<String>) -> Response<ProxyBody> {
    respond::json(
        StatusCode::UNPROCESSABLE_ENTITY,
        &json!({"error": "invalid_override", "message": msg.into()}),
    )
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Does `kind` (as in the URL) name the key kind of `rule`?
fn kind_matches(kind: &str, rule: &Rule) -> bool {
    match &rule.key {
        KeyKind::User => kind == "user",
        KeyKind::Ip => kind == "ip",
        KeyKind::Org => kind == "org",
        KeyKind::Global => false,
        KeyKind::Header(h) => kind
            .strip_prefix("header:")
            .is_some_and(|n| n.eq_ignore_ascii_case(h.as_str())),
    }
}

/// The tag the proxy computes for `value` of key kind `kind` (the same namespace and, for an
/// address, the same IPv6 prefix as a request's identity), or why the value is not one.
fn tag_of(gw: &State, snap: &Snapshot, kind: &str, value: &str) -> Result<String, String> {
    let keys = gw.keys();
    Ok(match kind {
        "ip" => {
            let ip: IpAddr = value.parse().map_err(|_| format!("{value:?} is not an IP address"))?;
            let ip = crate::identity::collapse(ip, gw.config().identity.ipv6_prefix);
            keys.tag(Namespace::Ip, ip.to_string().as_bytes())
        }
        "org" => keys.tag(Namespace::Org, value.as_bytes()),
        "user" => keys.tag(super::identities::caller_namespace(snap, value), value.as_bytes()),
        k if k.starts_with("header:") => keys.tag(Namespace::Header, value.as_bytes()),
        other => return Err(format!("unknown key kind {other:?} (user | ip | org | header:<Name>)")),
    }
    .to_string())
}

/// `expires_at` as unix seconds: a number, or an RFC 3339 string.
fn expiry(v: &Value) -> Result<u64, String> {
    match v {
        Value::Number(n) => n
            .as_u64()
            .ok_or_else(|| "expires_at must be a positive unix time".to_owned()),
        Value::String(s) => humantime::parse_rfc3339_weak(s)
            .map_err(|e| format!("expires_at {s:?}: {e}"))
            .map(|t| t.duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_secs())),
        _ => Err("expires_at must be unix seconds or an RFC 3339 time".into()),
    }
}

/// One override as `GET /overrides` shows it.
fn listed(o: &StoredOverride) -> Value {
    json!({
        "rule": o.rule, "kind": o.kind, "identity_hash": o.tag, "limits": o.limits,
        "expires_at": o.expires_at, "set_at": o.set_at,
    })
}

/// Serve `/overrides` and `/overrides/{kind}/{value}`.
pub(super) async fn handle(gw: &Arc<State>, req: Request<Incoming>, peer: SocketAddr) -> Response<ProxyBody> {
    let path = req.uri().path().to_owned();
    let query = req.uri().query().unwrap_or("").to_owned();
    let method = req.method().clone();
    if path == "/overrides" || path == "/overrides/" {
        if method != Method::GET {
            return AdminError::NotFound.into_response();
        }
        let rt = gw.runtime().load();
        let list: Vec<Value> = rt.stored.iter().map(listed).collect();
        return respond::json_ok(&json!({"overrides": list}));
    }
    let rest = &path["/overrides/".len()..];
    let Some((kind, raw_value)) = rest.split_once('/') else {
        return AdminError::NotFound.into_response();
    };
    let kind = percent_encoding::percent_decode_str(kind)
        .decode_utf8_lossy()
        .to_ascii_lowercase();
    let value = percent_encoding::percent_decode_str(raw_value)
        .decode_utf8_lossy()
        .into_owned();
    if value.is_empty() {
        return AdminError::NotFound.into_response();
    }
    let snap = gw.snapshot().load_full();
    let tag = match tag_of(gw, &snap, &kind, &value) {
        Ok(t) => t,
        Err(e) => return unprocessable(e),
    };
    match method {
        Method::PUT => {
            let body = match http_body_util::Limited::new(req.into_body(), MAX_BODY).collect().await {
                Ok(b) => b.to_bytes(),
                Err(_) => return AdminError::PayloadTooLarge.into_response(),
            };
            let put: PutBody = match serde_json::from_slice(&body) {
                Ok(p) => p,
                Err(e) => return unprocessable(format!("body: {e}")),
            };
            let Some(rule) = snap.rules.rules.iter().find(|r| *r.name == *put.rule) else {
                return unprocessable(format!("no rule named {:?}", put.rule));
            };
            if !kind_matches(&kind, rule) {
                return unprocessable(format!(
                    "rule {:?} is keyed by {}, not {kind}",
                    put.rule,
                    rule.key.to_text()
                ));
            }
            if let Err(e) = quotas(rule, &put.limits) {
                return unprocessable(format!("limits: {e}"));
            }
            let expires_at = match expiry(&put.expires_at) {
                Ok(t) => t,
                Err(e) => return unprocessable(e),
            };
            let now = unix_now();
            if expires_at <= now || expires_at > now + MAX_OVERRIDE_SECS {
                return unprocessable("expires_at must be in the future and within a year");
            }
            let o = StoredOverride {
                rule: put.rule,
                kind: kind.clone(),
                tag,
                limits: put.limits,
                expires_at,
                set_at: now,
            };
            match gw.put_override(&o).await {
                Ok(()) => {
                    tracing::info!(target: "tollgate::audit", caller = %peer, action = "override_set", rule = %o.rule, kind = %o.kind, identity_hash = %o.tag, expires_at = o.expires_at, "admin: PUT /overrides");
                    respond::json_ok(&json!({"result": "ok", "override": listed(&o)}))
                }
                Err(e) => respond::json(StatusCode::SERVICE_UNAVAILABLE, &json!({"error": e.to_string()})),
            }
        }
        Method::GET => {
            let rt = gw.runtime().load();
            let list: Vec<Value> = rt.stored.iter().filter(|o| o.tag == tag).map(listed).collect();
            if list.is_empty() {
                return AdminError::NotFound.into_response();
            }
            respond::json_ok(&json!({"overrides": list}))
        }
        Method::DELETE => {
            let only = query
                .split('&')
                .find_map(|kv| kv.strip_prefix("rule="))
                .map(|r| percent_encoding::percent_decode_str(r).decode_utf8_lossy().into_owned());
            let fields: Vec<String> = gw
                .runtime()
                .load()
                .stored
                .iter()
                .filter(|o| o.tag == tag && only.as_ref().is_none_or(|r| *r == o.rule))
                .map(StoredOverride::field)
                .collect();
            if fields.is_empty() {
                return AdminError::NotFound.into_response();
            }
            for f in &fields {
                if let Err(e) = gw.delete_override(f).await {
                    return respond::json(StatusCode::SERVICE_UNAVAILABLE, &json!({"error": e.to_string()}));
                }
            }
            tracing::info!(target: "tollgate::audit", caller = %peer, action = "override_delete", identity_hash = %tag, removed = fields.len(), "admin: DELETE /overrides");
            respond::json_ok(&json!({"result": "deleted", "removed": fields.len()}))
        }
        _ => AdminError::NotFound.into_response(),
    }
}
