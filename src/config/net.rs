//! The network parts of `gateway.yaml`: TLS on the proxy listener, the upstream
//! targets with their protocol, TLS, ejection and health check, the store's TLS and password, and the
//! access log. Certificates and keys are parsed here already, so `tollgate check` refuses a file
//! that `run` could not load, with the line and column of the field that names it.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_saphyr::Spanned;

use super::raw::{RawAccessLog, RawStore, RawTls, RawUpstream};
use super::{at_least, positive_duration, ConfigError};
use crate::http::tls::{self, ClientAuth, ListenerTls, UpstreamTls};
use crate::http::upstream::settings::{HealthCheck, Target, UpstreamConfig, UpstreamProtocol};
use crate::yaml::Secret;

/// `access_log:`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum AccessLog {
    /// No access log (the default).
    Off,
    /// One line per request.
    All,
    /// One request in `one_in` is logged (`access_log: 0.01` logs one in 100).
    Sampled {
        /// The configured fraction.
        rate: f64,
        /// Every how many requests one is logged.
        one_in: u64,
    },
}

/// `store.password_env` and `store.tls`, validated.
#[derive(Debug, Clone, Default)]
pub struct StoreAuth {
    /// The Redis password (`AUTH`), read from `password_env`.
    pub password: Option<Secret>,
    /// PEM CA bundle for `rediss://` (else the system's roots).
    pub ca_file: Option<PathBuf>,
}

/// `path` relative to the gateway file's directory `dir`.
fn rel(dir: &Path, p: &str) -> PathBuf {
    let p = Path::new(p);
    if p.is_absolute() {
        p.to_path_buf()
    } else {
        dir.join(p)
    }
}

/// The listener's `tls:`; the certificate and key are loaded once to prove they can be.
pub fn listener_tls(f: &Path, dir: &Path, raw: &Spanned<RawTls>) -> Result<ListenerTls, ConfigError> {
    let t = &raw.value;
    let cert_file = rel(dir, &t.cert_file.value);
    let key_file = rel(dir, &t.key_file.value);
    tls::load_certified_key(&cert_file, &key_file).map_err(|e| {
        let at = match e {
            tls::TlsError::Key { .. } | tls::TlsError::Mismatch => &t.key_file.referenced,
            _ => &t.cert_file.referenced,
        };
        ConfigError::at(f, at, format!("tls: {e}"))
    })?;
    let client_ca_file = match &t.client_ca_file {
        Some(ca) => {
            let p = rel(dir, &ca.value);
            tls::load_roots(&p).map_err(|e| ConfigError::at(f, &ca.referenced, format!("tls.client_ca_file: {e}")))?;
            Some(p)
        }
        None => None,
    };
    let client_auth = match &t.client_auth {
        None => ClientAuth::Required,
        Some(a) if client_ca_file.is_none() => {
            return Err(ConfigError::at(
                f,
                &a.referenced,
                "tls.client_auth needs tls.client_ca_file (the CA client certificates must chain to)",
            ))
        }
        Some(a) => match a.value.as_str() {
            "required" => ClientAuth::Required,
            "optional" => ClientAuth::Optional,
            other => {
                return Err(ConfigError::at(
                    f,
                    &a.referenced,
                    format!("tls.client_auth: unknown value {other:?} (required | optional)"),
                ))
            }
        },
    };
    Ok(ListenerTls {
        cert_file,
        key_file,
        client_ca_file,
        client_auth,
    })
}

/// One target URL: `http://host[:port]` or `https://host[:port]`, nothing after the authority.
fn target(f: &Path, s: &Spanned<String>) -> Result<Target, ConfigError> {
    let bad = |m: String| ConfigError::at(f, &s.referenced, m);
    let url: http::Uri = s
        .value
        .parse()
        .map_err(|e| bad(format!("invalid upstream url {:?}: {e}", s.value)))?;
    let tls = match url.scheme_str() {
        Some("http") => false,
        Some("https") => true,
        _ => {
            return Err(bad(format!(
                "upstream url {:?} must be http://host:port or https://host:port",
                s.value
            )))
        }
    };
    let Some(authority) = url.authority() else {
        return Err(bad(format!("upstream url {:?} has no host", s.value)));
    };
    if authority.as_str().contains('@') {
        return Err(bad(format!(
            "upstream url {:?}: credentials in the URL are not supported",
            s.value
        )));
    }
    if url
        .path_and_query()
        .is_some_and(|p| p.as_str() != "/" && !p.as_str().is_empty())
    {
        return Err(bad(format!(
            "upstream url {:?}: a path is not supported (requests keep their own path)",
            s.value
        )));
    }
    let host = authority
        .host()
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_string();
    let port = authority.port_u16().unwrap_or(if tls { 443 } else { 80 });
    let addr = if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    };
    if tls {
        rustls::pki_types::ServerName::try_from(host.as_str()).map_err(|_| {
            bad(format!(
                "upstream url {:?}: {host:?} is not a valid TLS server name",
                s.value
            ))
        })?;
    }
    Ok(Target { url, tls, host, addr })
}

/// The upstream of a gateway file without one (`tollgate rls` alone): a placeholder that no
/// request is sent to, so that the state every front end shares can be built the same way.
pub fn unused_upstream(f: &Path, dir: &Path) -> Result<UpstreamConfig, ConfigError> {
    let raw: Spanned<RawUpstream> = crate::yaml::parse_str(f, "url: http://127.0.0.1:9\n")?;
    upstream(f, dir, &raw, &mut Vec::new())
}

/// Validate `upstream:`: the targets, their protocol and TLS, ejection, the health check, the
/// timeouts and caps.
pub fn upstream(
    f: &Path,
    dir: &Path,
    raw: &Spanned<RawUpstream>,
    notes: &mut Vec<String>,
) -> Result<UpstreamConfig, ConfigError> {
    let u = &raw.value;
    let targets = match (&u.url, &u.targets) {
        (Some(url), None) => vec![target(f, url)?],
        (None, Some(list)) if list.value.is_empty() => {
            return Err(ConfigError::at(
                f,
                &list.referenced,
                "upstream.targets: give at least one URL",
            ))
        }
        (None, Some(list)) => {
            let mut out = Vec::with_capacity(list.value.len());
            for t in &list.value {
                let t2 = target(f, t)?;
                if out.iter().any(|o: &Target| o.url == t2.url) {
                    return Err(ConfigError::at(
                        f,
                        &t.referenced,
                        format!("upstream.targets: {:?} is listed twice", t.value),
                    ));
                }
                out.push(t2);
            }
            out
        }
        (Some(url), Some(_)) => {
            return Err(ConfigError::at(
                f,
                &url.referenced,
                "upstream: give either url (one target) or targets (several), not both",
            ))
        }
        (None, None) => return Err(ConfigError::at(f, &raw.referenced, "upstream: needs url or targets")),
    };
    let protocol = protocol(f, &u.protocol, &targets)?;
    let mut tls = UpstreamTls::default();
    if let Some(t) = &u.tls {
        let tv = &t.value;
        if !targets.iter().any(|t| t.tls) {
            notes.push("upstream.tls is set but no target is https://: it is not used".to_string());
        }
        if let Some(ca) = &tv.ca_file {
            let p = rel(dir, &ca.value);
            tls::load_roots(&p)
                .map_err(|e| ConfigError::at(f, &ca.referenced, format!("upstream.tls.ca_file: {e}")))?;
            tls.ca_file = Some(p);
        }
        match (&tv.client_cert_file, &tv.client_key_file) {
            (Some(c), Some(k)) => {
                let (cp, kp) = (rel(dir, &c.value), rel(dir, &k.value));
                tls::load_certified_key(&cp, &kp).map_err(|e| {
                    let at = match e {
                        tls::TlsError::Key { .. } | tls::TlsError::Mismatch => &k.referenced,
                        _ => &c.referenced,
                    };
                    ConfigError::at(f, at, format!("upstream.tls: {e}"))
                })?;
                tls.client_cert = Some((cp, kp));
            }
            (None, None) => {}
            (Some(x), None) | (None, Some(x)) => {
                return Err(ConfigError::at(
                    f,
                    &x.referenced,
                    "upstream.tls: client_cert_file and client_key_file go together",
                ))
            }
        }
        if let Some(n) = &tv.server_name {
            rustls::pki_types::ServerName::try_from(n.value.as_str()).map_err(|_| {
                ConfigError::at(
                    f,
                    &n.referenced,
                    format!("upstream.tls.server_name: {:?} is not a valid TLS server name", n.value),
                )
            })?;
            tls.server_name = Some(n.value.clone());
        }
        if let Some(i) = &tv.insecure_skip_verify {
            tls.insecure_skip_verify = i.value;
            if i.value {
                notes.push(
                    "upstream.tls.insecure_skip_verify is true: the upstream's certificate is NOT verified; anyone on the path can impersonate it"
                        .to_string(),
                );
            }
        }
    }
    let health_check = match &u.health_check {
        Some(h) => {
            let path: http::uri::PathAndQuery = h
                .path
                .value
                .parse()
                .ok()
                .filter(|p: &http::uri::PathAndQuery| p.as_str().starts_with('/'))
                .ok_or_else(|| {
                    ConfigError::at(
                        f,
                        &h.path.referenced,
                        format!("upstream.health_check.path: {:?} is not a path", h.path.value),
                    )
                })?;
            Some(HealthCheck {
                path,
                interval: positive_duration(f, &h.interval, "upstream.health_check.interval", Duration::from_secs(5))?,
                timeout: positive_duration(f, &h.timeout, "upstream.health_check.timeout", Duration::from_secs(1))?,
            })
        }
        None => None,
    };
    let first = &targets[0].url;
    let (Some(scheme), Some(authority)) = (first.scheme().cloned(), first.authority().cloned()) else {
        return Err(ConfigError::at(
            f,
            &raw.referenced,
            "upstream: a target has no scheme or host",
        ));
    };
    Ok(UpstreamConfig {
        url: first.clone(),
        scheme,
        authority,
        eject_after: at_least(f, &u.eject_after, "upstream.eject_after", 1, 3)?,
        eject_for: positive_duration(f, &u.eject_for, "upstream.eject_for", Duration::from_secs(10))?,
        connect_timeout: positive_duration(
            f,
            &u.connect_timeout,
            "upstream.connect_timeout",
            Duration::from_secs(1),
        )?,
        request_timeout: positive_duration(
            f,
            &u.request_timeout,
            "upstream.request_timeout",
            Duration::from_secs(30),
        )?,
        pool_max_idle_per_host: u.pool_max_idle_per_host.unwrap_or(256),
        max_connections_per_target: at_least(
            f,
            &u.max_connections_per_target,
            "upstream.max_connections_per_target",
            1,
            super::DEFAULT_MAX_CONNECTIONS_PER_TARGET,
        )?,
        targets,
        protocol,
        tls,
        health_check,
    })
}

/// `upstream.protocol`, checked against the targets' schemes: `h2` needs `https://` targets
/// (ALPN is part of TLS), `h2c` needs `http://` ones.
fn protocol(f: &Path, raw: &Option<Spanned<String>>, targets: &[Target]) -> Result<UpstreamProtocol, ConfigError> {
    let Some(p) = raw else {
        return Ok(UpstreamProtocol::Http1);
    };
    let protocol = match p.value.as_str() {
        "http1" => UpstreamProtocol::Http1,
        "h2c" => UpstreamProtocol::H2c,
        "h2" => UpstreamProtocol::H2,
        "auto" => UpstreamProtocol::Auto,
        other => {
            return Err(ConfigError::at(
                f,
                &p.referenced,
                format!("upstream.protocol: unknown value {other:?} (http1 | h2c | h2 | auto)"),
            ))
        }
    };
    let mismatch = match protocol {
        UpstreamProtocol::H2 => targets.iter().find(|t| !t.tls).map(|t| {
            format!(
                "upstream.protocol: h2 is HTTP/2 over TLS, but {} is http:// (use h2c for HTTP/2 without TLS)",
                t.url
            )
        }),
        UpstreamProtocol::H2c => targets.iter().find(|t| t.tls).map(|t| {
            format!(
                "upstream.protocol: h2c is HTTP/2 without TLS, but {} is https:// (use h2 or auto)",
                t.url
            )
        }),
        UpstreamProtocol::Http1 | UpstreamProtocol::Auto => None,
    };
    match mismatch {
        Some(m) => Err(ConfigError::at(f, &p.referenced, m)),
        None => Ok(protocol),
    }
}

/// `store.password_env` and `store.tls`. A named variable that is unset or empty refuses to
/// start: a fleet member without the Secret must not talk to Redis unauthenticated.
pub fn store_auth(f: &Path, dir: &Path, s: &RawStore, urls: &[String]) -> Result<StoreAuth, ConfigError> {
    let password = match &s.password_env {
        Some(name) => Some(Secret(crate::yaml::required_env(f, name, "store.password_env")?)),
        None => None,
    };
    if let Some(t) = &s.tls {
        if !urls.iter().any(|u| u.starts_with("rediss://")) {
            return Err(ConfigError::at(
                f,
                &t.referenced,
                "store.tls needs rediss:// URLs in store.urls (redis:// is plain TCP)",
            ));
        }
    }
    let ca_file = match s.tls.as_ref().and_then(|t| t.value.ca_file.as_ref()) {
        Some(ca) => {
            let p = rel(dir, &ca.value);
            tls::load_roots(&p).map_err(|e| ConfigError::at(f, &ca.referenced, format!("store.tls.ca_file: {e}")))?;
            Some(p)
        }
        None => None,
    };
    Ok(StoreAuth { password, ca_file })
}

/// `access_log:`.
pub fn access_log(f: &Path, raw: &Option<Spanned<RawAccessLog>>) -> Result<AccessLog, ConfigError> {
    Ok(match raw.as_ref().map(|r| (r.value, r)) {
        None | Some((RawAccessLog::All(false), _)) => AccessLog::Off,
        Some((RawAccessLog::All(true), _)) => AccessLog::All,
        Some((RawAccessLog::Rate(r), at)) => {
            if !(r > 0.0 && r <= 1.0) {
                return Err(ConfigError::at(
                    f,
                    &at.referenced,
                    format!("access_log: {r} is not true, false or a fraction in (0, 1]"),
                ));
            }
            let one_in = (1.0 / r).round().max(1.0) as u64;
            if one_in == 1 {
                AccessLog::All
            } else {
                AccessLog::Sampled { rate: r, one_in }
            }
        }
    })
}
