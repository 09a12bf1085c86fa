//! `tollgate config`: the settings in force, each with where its value came from — the gateway
//! file (`file:line:col`), an environment variable that replaced it, or the default. Secrets
//! are never shown: Redis URLs have their password replaced by `***`, and tokens, salts and
//! passwords are named by where they are read from, never by value.

use std::path::Path;

use serde_saphyr::Spanned;

use super::raw::{RawGateway, RawUpstream};
use super::{redact_url, EnvOverrides, GatewayConfig};

/// One setting: its dotted name, its value in force, and where that value came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Setting {
    /// `server.drain`, `store.urls`, ...
    pub name: &'static str,
    /// The value in force, as text (secrets never appear).
    pub value: String,
    /// `gateway.yaml:12:9`, `env TOLLGATE_LISTEN`, or `default`.
    pub source: String,
}

/// Where a raw value came from: its position in `file`, or `default` when it was not written.
fn at<T>(file: &Path, v: Option<&Spanned<T>>) -> String {
    match v {
        Some(s) => format!("{}:{}:{}", file.display(), s.referenced.line(), s.referenced.column()),
        None => "default".to_string(),
    }
}

fn dur(d: std::time::Duration) -> String {
    humantime::format_duration(d).to_string()
}

/// The settings of `cfg`, compiled from `raw` (the same file) under `env`.
pub fn settings(file: &Path, raw: &RawGateway, cfg: &GatewayConfig, env: &EnvOverrides) -> Vec<Setting> {
    let mut out = Vec::new();
    let mut push = |name: &'static str, value: String, source: String| out.push(Setting { name, value, source });
    let no_upstream = RawUpstream::default();
    let u = raw.upstream.as_ref().map_or(&no_upstream, |u| &u.value);
    let (s, st, l) = (&raw.server, &raw.store, &raw.limits);
    push(
        "listen",
        cfg.listen.to_string(),
        match &env.listen {
            Some(_) => "env TOLLGATE_LISTEN".to_string(),
            None => at(file, raw.listen.as_ref()),
        },
    );
    push(
        "admin_listen",
        cfg.admin_listen.to_string(),
        at(file, raw.admin_listen.as_ref()),
    );
    let admin = match (&cfg.admin.token_env, &cfg.admin.token_file) {
        (Some(e), Some(_)) => format!("token from ${e} and admin.token_file"),
        (Some(e), None) => format!("token from ${e}"),
        (None, Some(_)) => "tokens from admin.token_file".to_string(),
        (None, None) => "no token".to_string(),
    };
    push(
        "admin",
        admin,
        at(file, raw.admin.token_env.as_ref().or(raw.admin.token_file.as_ref())),
    );
    let targets: Vec<String> = cfg.upstream.targets.iter().map(|t| t.url.to_string()).collect();
    push(
        "upstream.targets",
        if cfg.proxied {
            targets.join(", ")
        } else {
            "none (no upstream: the rate-limit service alone, tollgate rls)".to_string()
        },
        at(file, u.url.as_ref()).replace("default", &at(file, u.targets.as_ref())),
    );
    push(
        "upstream.protocol",
        cfg.upstream.protocol.as_str().to_string(),
        at(file, u.protocol.as_ref()),
    );
    push(
        "upstream.connect_timeout",
        dur(cfg.upstream.connect_timeout),
        at(file, u.connect_timeout.as_ref()),
    );
    push(
        "upstream.request_timeout",
        dur(cfg.upstream.request_timeout),
        at(file, u.request_timeout.as_ref()),
    );
    push(
        "upstream.max_connections_per_target",
        cfg.upstream.max_connections_per_target.to_string(),
        at(file, u.max_connections_per_target.as_ref()),
    );
    push(
        "store.kind",
        crate::describe::store_kind(cfg.store.kind).to_string(),
        at(file, st.kind.as_ref()),
    );
    let urls: Vec<String> = cfg.store.urls.iter().map(|x| redact_url(x)).collect();
    push(
        "store.urls",
        urls.join(", "),
        match &env.redis_urls {
            Some(_) if !cfg.store.urls.is_empty() => format!("env {}", env.redis_urls_var),
            _ => at(file, st.urls.first()),
        },
    );
    push("store.timeout", dur(cfg.store.timeout), at(file, st.timeout.as_ref()));
    push(
        "store.breaker_threshold",
        cfg.store.breaker_threshold.to_string(),
        at(file, st.breaker_threshold.as_ref()),
    );
    push(
        "store.memory_max_keys",
        cfg.store.memory_max_keys.to_string(),
        at(file, st.memory_max_keys.as_ref()),
    );
    push(
        "store.key_prefix",
        cfg.store.key_prefix.clone(),
        at(file, st.key_prefix.as_ref()),
    );
    push(
        "store.key_salt",
        match &st.key_salt_env {
            Some(e) => format!("from ${}", e.value),
            None => "none (store.key_salt_env is not set)".to_string(),
        },
        at(file, st.key_salt_env.as_ref()),
    );
    push(
        "store.leases",
        if cfg.store.leases.is_some() { "on" } else { "off" }.to_string(),
        at(file, st.leases.as_ref()),
    );
    push("server.drain", dur(cfg.server.drain), at(file, s.drain.as_ref()));
    push(
        "server.shutdown_grace",
        dur(cfg.server.shutdown_grace),
        at(file, s.shutdown_grace.as_ref()),
    );
    push(
        "server.idle_timeout",
        dur(cfg.server.idle_timeout),
        at(file, s.idle_timeout.as_ref()),
    );
    push(
        "server.header_read_timeout",
        dur(cfg.server.header_read_timeout),
        at(file, s.header_read_timeout.as_ref()),
    );
    push(
        "server.max_connections",
        cfg.server.max_connections.to_string(),
        at(file, s.max_connections.as_ref()),
    );
    push(
        "server.max_connections_per_ip",
        cfg.server
            .max_connections_per_ip
            .map_or("off".to_string(), |n| n.to_string()),
        at(file, s.max_connections_per_ip.as_ref()),
    );
    push(
        "server.max_header_bytes",
        cfg.server.max_header_bytes.to_string(),
        at(file, s.max_header_bytes.as_ref()),
    );
    push("limits.deny_cache", cfg.limits.deny_cache.to_string(), {
        if l.deny_cache.is_some() {
            format!("{} (limits.deny_cache)", file.display())
        } else {
            "default".to_string()
        }
    });
    push(
        "limits.max_keys",
        cfg.limits.max_keys.to_string(),
        at(file, l.max_keys.as_ref()),
    );
    identity(file, raw, cfg, &mut out);
    tls(file, raw, cfg, &mut out);
    otlp_settings(file, &raw.tracing, cfg.otlp.as_ref(), &mut out);
    rls(file, raw, cfg, &mut out);
    out
}

/// `rls:`, when the gateway file has it.
fn rls(file: &Path, raw: &RawGateway, cfg: &GatewayConfig, out: &mut Vec<Setting>) {
    let (Some(r), Some(raw_rls)) = (&cfg.rls, &raw.rls) else {
        return;
    };
    let rr = &raw_rls.value;
    let mut push = |name: &'static str, value: String, source: String| out.push(Setting { name, value, source });
    push(
        "rls.listen",
        r.listen
            .map_or_else(|| "off (tollgate rls: 0.0.0.0:8081)".to_string(), |a| a.to_string()),
        at_opt(file, &rr.listen),
    );
    push(
        "rls.config_dir",
        r.config_dir.display().to_string(),
        at(file, Some(&rr.config_dir)),
    );
    let failure = match r.failure {
        crate::limiter::FailurePolicy::Open => "open",
        crate::limiter::FailurePolicy::Closed => "closed",
        crate::limiter::FailurePolicy::Local { .. } => "local",
    };
    push("rls.failure", failure.to_string(), at_opt(file, &rr.failure));
    let headers = match r.headers {
        super::rls::RlsHeaders::None => "none",
        super::rls::RlsHeaders::Ietf => "ietf",
        super::rls::RlsHeaders::XRateLimit => "x-ratelimit",
    };
    push("rls.headers", headers.to_string(), at_opt(file, &rr.headers));
}

/// The position of an optional raw value, or `default`.
fn at_opt<T>(file: &Path, v: &Option<Spanned<T>>) -> String {
    at(file, v.as_ref())
}

/// Who the caller is: the API-key header, the proxies trusted for `X-Forwarded-For`, what a bad
/// credential gets, and JWT verification (its keys named by where they are read from).
fn identity(file: &Path, raw: &RawGateway, cfg: &GatewayConfig, out: &mut Vec<Setting>) {
    let (r, c) = (&raw.identity, &cfg.identity);
    let mut push = |name: &'static str, value: String, source: String| out.push(Setting { name, value, source });
    push(
        "identity.api_key_header",
        c.api_key_header.to_string(),
        at_opt(file, &r.api_key_header),
    );
    let proxies: Vec<String> = c.trusted_proxies.iter().map(|n| n.to_string()).collect();
    push(
        "identity.trusted_proxies",
        if proxies.is_empty() {
            "none (X-Forwarded-For is not read)".to_string()
        } else {
            proxies.join(", ")
        },
        at(file, r.trusted_proxies.first()),
    );
    push(
        "identity.max_forwarded_entries",
        c.max_forwarded_entries.to_string(),
        at_opt(file, &r.max_forwarded_entries),
    );
    push(
        "identity.ipv6_prefix",
        format!("/{}", c.ipv6_prefix),
        at_opt(file, &r.ipv6_prefix),
    );
    push(
        "identity.invalid_credentials",
        match c.invalid_credentials {
            crate::identity::InvalidCredentials::Reject => "reject (401)",
            crate::identity::InvalidCredentials::Ip => "ip (counted as the client address)",
        }
        .to_string(),
        at_opt(file, &r.invalid_credentials),
    );
    let Some(jwt) = &r.jwt else {
        push("identity.jwt", "off".to_string(), "default".to_string());
        return;
    };
    let keys = [
        jwt.secret_env
            .as_ref()
            .map(|e| (format!("HMAC secret from ${}", e.value), e)),
        jwt.public_key_file
            .as_ref()
            .map(|f| (format!("public key file {}", f.value), f)),
        jwt.jwks_file.as_ref().map(|f| (format!("JWKS file {}", f.value), f)),
    ];
    let (what, from): (Vec<String>, Vec<&Spanned<String>>) = keys.into_iter().flatten().unzip();
    push(
        "identity.jwt.keys",
        format!("{} ({})", what.join(", "), jwt.algorithms.value.join(", ")),
        at(file, from.first().copied()),
    );
    push(
        "identity.jwt.header",
        jwt.header.clone().unwrap_or_else(|| "authorization".to_string()),
        at(file, Some(&jwt.algorithms)),
    );
    let claim = |v: &Option<String>| v.clone().unwrap_or_else(|| "any".to_string());
    push(
        "identity.jwt.issuer",
        claim(&jwt.issuer),
        at(file, Some(&jwt.algorithms)),
    );
    push(
        "identity.jwt.audience",
        claim(&jwt.audience),
        at(file, Some(&jwt.algorithms)),
    );
    push(
        "identity.jwt.leeway",
        jwt.leeway.as_ref().map_or("30s".to_string(), |l| l.value.clone()),
        at(file, jwt.leeway.as_ref()),
    );
}

/// TLS on the listener, to the upstream and to the store, the upstream's health check, and the
/// store password (named by its variable, never shown).
fn tls(file: &Path, raw: &RawGateway, cfg: &GatewayConfig, out: &mut Vec<Setting>) {
    let mut push = |name: &'static str, value: String, source: String| out.push(Setting { name, value, source });
    let listener = match &cfg.tls {
        None => "off".to_string(),
        Some(t) => format!(
            "certificate {}, key {}{}",
            t.cert_file.display(),
            t.key_file.display(),
            match (&t.client_ca_file, t.client_auth) {
                (None, _) => String::new(),
                (Some(ca), crate::http::tls::ClientAuth::Required) =>
                    format!(", client certificate required ({})", ca.display()),
                (Some(ca), crate::http::tls::ClientAuth::Optional) =>
                    format!(", client certificate optional ({})", ca.display()),
            }
        ),
    };
    push("tls", listener, at(file, raw.tls.as_ref()));
    let no_upstream = RawUpstream::default();
    let raw_up = raw.upstream.as_ref().map_or(&no_upstream, |u| &u.value);
    let u = &cfg.upstream.tls;
    let raw_u = raw_up.tls.as_ref();
    let mut parts = vec![match &u.ca_file {
        Some(ca) => format!("CA {}", ca.display()),
        None => "system roots".to_string(),
    }];
    if let Some((cert, _)) = &u.client_cert {
        parts.push(format!("client certificate {}", cert.display()));
    }
    if let Some(n) = &u.server_name {
        parts.push(format!("server name {n}"));
    }
    if u.insecure_skip_verify {
        parts.push("INSECURE: certificates not verified".to_string());
    }
    push("upstream.tls", parts.join(", "), at(file, raw_u));
    push(
        "upstream.health_check",
        match &cfg.upstream.health_check {
            Some(h) => format!("GET {} every {}, timeout {}", h.path, dur(h.interval), dur(h.timeout)),
            None => "off (passive ejection only)".to_string(),
        },
        at(file, raw_up.health_check.as_ref().map(|h| &h.path)),
    );
    push(
        "upstream.eject_after",
        format!(
            "{} failures, out for {}",
            cfg.upstream.eject_after,
            dur(cfg.upstream.eject_for)
        ),
        at(file, raw_up.eject_after.as_ref()),
    );
    let st = &raw.store;
    push(
        "store.password",
        match &st.password_env {
            Some(e) => format!("from ${}", e.value),
            None => "none (or in the URL, shown as ***)".to_string(),
        },
        at_opt(file, &st.password_env),
    );
    push(
        "store.tls",
        match st.tls.as_ref().and_then(|t| t.value.ca_file.as_ref()) {
            Some(ca) => format!("CA {}", ca.value),
            None => "system roots for rediss:// URLs".to_string(),
        },
        at(file, st.tls.as_ref()),
    );
}

/// The `tracing.otlp.*` lines of `tollgate config` (header values never shown: only the
/// variables they are read from).
fn otlp_settings(
    file: &Path,
    raw: &super::raw::RawTracing,
    cfg: Option<&super::otlp::OtlpConfig>,
    out: &mut Vec<Setting>,
) {
    let (Some(r), Some(c)) = (raw.otlp.as_ref().map(|o| &o.value), cfg) else {
        out.push(Setting {
            name: "tracing.otlp",
            value: "off".to_string(),
            source: at(file, raw.otlp.as_ref()),
        });
        return;
    };
    let mut push = |name: &'static str, value: String, source: String| out.push(Setting { name, value, source });
    push(
        "tracing.otlp.endpoint",
        c.endpoint.to_string(),
        at(file, Some(&r.endpoint)),
    );
    push(
        "tracing.otlp.sample_ratio",
        c.sample_ratio.to_string(),
        at(file, r.sample_ratio.as_ref()),
    );
    push(
        "tracing.otlp.parent_based",
        c.parent_based.to_string(),
        if r.parent_based.is_some() {
            format!("{} (tracing.otlp.parent_based)", file.display())
        } else {
            "default".to_string()
        },
    );
    push(
        "tracing.otlp.service_name",
        c.service_name.clone(),
        at(file, r.service_name.as_ref()),
    );
    push(
        "tracing.otlp.timeout",
        humantime::format_duration(c.timeout).to_string(),
        at(file, r.timeout.as_ref()),
    );
    push(
        "tracing.otlp.queue_size",
        c.queue_size.to_string(),
        at(file, r.queue_size.as_ref()),
    );
    let headers: Vec<String> = c.headers_from.iter().map(|(n, v)| format!("{n} from ${v}")).collect();
    push(
        "tracing.otlp.headers_env",
        if headers.is_empty() {
            "none".to_string()
        } else {
            headers.join(", ")
        },
        at(file, r.headers_env.values().next()),
    );
}

#[cfg(test)]
mod tests;
