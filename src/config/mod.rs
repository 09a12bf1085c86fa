//! Configuration: raw serde structs ([`raw`]), validated into the typed, compiled config used at
//! run time, plus the live reload of the rules and keys files ([`reload`]).
//!
//! Every error names `file:line:col`. Durations are humantime strings (`5ms`, `1s`, `15m`).

pub mod raw;
pub mod reload;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use http::HeaderName;
use ipnet::IpNet;
use serde_saphyr::{Location, Spanned};

use crate::identity::jwt::JwtVerifier;

/// A config error, rendered `file:line:col: message`.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{}:{line}:{col}: {message}", file.display())]
pub struct ConfigError {
    /// The file.
    pub file: PathBuf,
    /// 1-based line (0 when unknown).
    pub line: u64,
    /// 1-based column (0 when unknown).
    pub col: u64,
    /// What is wrong.
    pub message: String,
}

impl ConfigError {
    /// An error at `loc` in `file`.
    pub fn at(file: &Path, loc: &Location, message: impl Into<String>) -> Self {
        ConfigError {
            file: file.to_path_buf(),
            line: loc.line(),
            col: loc.column(),
            message: message.into(),
        }
    }

    /// An error with no position (a missing file).
    pub fn file(file: &Path, message: impl Into<String>) -> Self {
        ConfigError {
            file: file.to_path_buf(),
            line: 0,
            col: 0,
            message: message.into(),
        }
    }
}

/// Read and parse a YAML file into `T`, mapping parse errors to `file:line:col`.
pub fn parse_file<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|e| ConfigError::file(path, format!("cannot read: {e}")))?;
    parse_str(path, &text)
}

/// Parse YAML text (named `path` in errors).
pub fn parse_str<T: serde::de::DeserializeOwned>(path: &Path, text: &str) -> Result<T, ConfigError> {
    serde_saphyr::from_str::<T>(text).map_err(|e| {
        let (line, col) = e.location().map(|l| (l.line(), l.column())).unwrap_or((0, 0));
        let msg = e.without_snippet().to_string();
        // The rendered message may itself carry a position and a snippet: keep its first line.
        let msg = msg.lines().next().unwrap_or("invalid YAML").to_string();
        ConfigError {
            file: path.to_path_buf(),
            line,
            col,
            message: msg,
        }
    })
}

/// Parse a humantime duration held in a spanned string.
pub fn duration(file: &Path, s: &Spanned<String>) -> Result<Duration, ConfigError> {
    humantime::parse_duration(s.value.trim())
        .map_err(|e| ConfigError::at(file, &s.referenced, format!("invalid duration {:?}: {e}", s.value)))
}

fn opt_duration(file: &Path, s: &Option<Spanned<String>>, default: Duration) -> Result<Duration, ConfigError> {
    match s {
        Some(s) => duration(file, s),
        None => Ok(default),
    }
}

/// Which store holds counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreKind {
    /// This process only.
    Memory,
    /// One Redis server.
    Redis,
    /// A Redis Cluster.
    RedisCluster,
}

/// `upstream:`, validated.
#[derive(Debug, Clone)]
pub struct UpstreamConfig {
    /// `http://host:port` (no path).
    pub url: http::Uri,
    /// Scheme of `url`.
    pub scheme: http::uri::Scheme,
    /// Authority of `url`.
    pub authority: http::uri::Authority,
    /// TCP connect timeout.
    pub connect_timeout: Duration,
    /// Deadline for response headers; past it the client gets 504.
    pub request_timeout: Duration,
    /// Idle pooled connections per host.
    pub pool_max_idle_per_host: usize,
}

/// `store:`, validated.
#[derive(Debug, Clone)]
pub struct StoreConfig {
    /// Which store.
    pub kind: StoreKind,
    /// Redis URLs.
    pub urls: Vec<String>,
    /// Hard deadline of one check.
    pub timeout: Duration,
    /// First part of every key.
    pub key_prefix: String,
    /// Secret mixed into identity hashes (empty when unset).
    pub key_salt: String,
    /// Memory store key cap.
    pub memory_max_keys: usize,
    /// Consecutive failures that open the breaker.
    pub breaker_threshold: u32,
    /// Probe period while the breaker is open.
    pub probe_interval: Duration,
}

/// `identity:`, validated.
#[derive(Debug, Clone)]
pub struct IdentityConfig {
    /// Header carrying the API key.
    pub api_key_header: HeaderName,
    /// JWT verification, if configured.
    pub jwt: Option<std::sync::Arc<JwtVerifier>>,
    /// Peers whose X-Forwarded-For is believed.
    pub trusted_proxies: Vec<IpNet>,
    /// IPv6 addresses collapse to this prefix.
    pub ipv6_prefix: u8,
    /// At most this many X-Forwarded-For entries are read, from the right.
    pub max_forwarded_entries: usize,
}

/// `limits:`, validated.
#[derive(Debug, Clone)]
pub struct LimitsConfig {
    /// Send `RateLimit-Policy` / `RateLimit`.
    pub ietf_headers: bool,
    /// Send `X-RateLimit-*`.
    pub legacy_headers: bool,
    /// Remember denials locally.
    pub deny_cache: bool,
    /// Deny cache capacity.
    pub deny_cache_max: usize,
    /// Log one in N shadow denials.
    pub shadow_log_sample: u64,
}

/// `server:`, validated.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Time to receive request headers.
    pub header_read_timeout: Duration,
    /// Idle keep-alive connections close after this.
    pub idle_timeout: Duration,
    /// Concurrent connections.
    pub max_connections: usize,
    /// Largest request body.
    pub max_body_bytes: u64,
    /// Largest header section.
    pub max_header_bytes: usize,
    /// Drain deadline on shutdown.
    pub shutdown_grace: Duration,
}

/// The validated gateway config.
#[derive(Debug, Clone)]
pub struct GatewayConfig {
    /// The gateway file itself.
    pub path: PathBuf,
    /// Proxy address.
    pub listen: SocketAddr,
    /// Admin address.
    pub admin_listen: SocketAddr,
    /// The upstream.
    pub upstream: UpstreamConfig,
    /// Rules file (absolute or relative to the working dir).
    pub rules_file: PathBuf,
    /// API key registry.
    pub keys_file: Option<PathBuf>,
    /// The store.
    pub store: StoreConfig,
    /// Identity.
    pub identity: IdentityConfig,
    /// Headers and the deny cache.
    pub limits: LimitsConfig,
    /// Listener limits.
    pub server: ServerConfig,
}

/// Overrides from the environment (`TOLLGATE_LISTEN`, `TOLLGATE_REDIS_URL(S)`).
#[derive(Debug, Clone, Default)]
pub struct EnvOverrides {
    /// Replaces `listen`.
    pub listen: Option<String>,
    /// Replaces `store.urls` (comma-separated).
    pub redis_urls: Option<String>,
}

impl EnvOverrides {
    /// Read from the process environment.
    pub fn from_env() -> Self {
        EnvOverrides {
            listen: std::env::var("TOLLGATE_LISTEN").ok().filter(|s| !s.is_empty()),
            redis_urls: std::env::var("TOLLGATE_REDIS_URLS")
                .or_else(|_| std::env::var("TOLLGATE_REDIS_URL"))
                .ok()
                .filter(|s| !s.is_empty()),
        }
    }
}

fn addr(file: &Path, s: &Option<Spanned<String>>, default: &str) -> Result<SocketAddr, ConfigError> {
    match s {
        Some(s) => s.value.parse().map_err(|_| {
            ConfigError::at(
                file,
                &s.referenced,
                format!("invalid address {:?} (want ip:port)", s.value),
            )
        }),
        None => default
            .parse()
            .map_err(|_| ConfigError::file(file, "bad default address")),
    }
}

impl GatewayConfig {
    /// Load and validate `path`, applying `env` on top.
    pub fn load(path: &Path, env: &EnvOverrides) -> Result<Self, ConfigError> {
        let raw: raw::RawGateway = parse_file(path)?;
        Self::compile(path, raw, env)
    }

    /// Validate a parsed gateway file.
    pub fn compile(path: &Path, raw: raw::RawGateway, env: &EnvOverrides) -> Result<Self, ConfigError> {
        let f = path;
        let dir = path.parent().unwrap_or(Path::new("."));
        let rel = |p: &str| -> PathBuf {
            let p = Path::new(p);
            if p.is_absolute() {
                p.to_path_buf()
            } else {
                dir.join(p)
            }
        };
        let mut listen = addr(f, &raw.listen, "0.0.0.0:8080")?;
        if let Some(l) = &env.listen {
            listen = l
                .parse()
                .map_err(|_| ConfigError::file(f, format!("TOLLGATE_LISTEN: invalid address {l:?}")))?;
        }
        let admin_listen = addr(f, &raw.admin_listen, "127.0.0.1:9090")?;

        let u = &raw.upstream;
        let url: http::Uri = u
            .url
            .value
            .parse()
            .map_err(|e| ConfigError::at(f, &u.url.referenced, format!("invalid upstream url: {e}")))?;
        let scheme = url.scheme().cloned();
        let authority = url.authority().cloned();
        let (scheme, authority) = match (scheme, authority) {
            (Some(s), Some(a)) if s == http::uri::Scheme::HTTP => (s, a),
            _ => {
                return Err(ConfigError::at(
                    f,
                    &u.url.referenced,
                    "upstream url must be http://host:port (TLS to the upstream is not supported)",
                ))
            }
        };
        let upstream = UpstreamConfig {
            url,
            scheme,
            authority,
            connect_timeout: opt_duration(f, &u.connect_timeout, Duration::from_secs(1))?,
            request_timeout: opt_duration(f, &u.request_timeout, Duration::from_secs(30))?,
            pool_max_idle_per_host: u.pool_max_idle_per_host.unwrap_or(256),
        };

        let s = &raw.store;
        let kind = match s.kind.as_ref().map(|k| (k.value.as_str(), k)) {
            None | Some(("memory", _)) => StoreKind::Memory,
            Some(("redis", _)) => StoreKind::Redis,
            Some(("redis_cluster", _)) => StoreKind::RedisCluster,
            Some((other, k)) => {
                return Err(ConfigError::at(
                    f,
                    &k.referenced,
                    format!("unknown store kind {other:?} (memory | redis | redis_cluster)"),
                ))
            }
        };
        let mut urls = s.urls.clone();
        if let Some(list) = &env.redis_urls {
            urls = list
                .split(',')
                .map(|u| u.trim().to_string())
                .filter(|u| !u.is_empty())
                .collect();
        }
        if kind != StoreKind::Memory && urls.is_empty() {
            return Err(ConfigError::file(f, "store.urls: a redis store needs at least one url"));
        }
        let key_prefix = match &s.key_prefix {
            Some(p) => {
                if p.value.is_empty() || !p.value.chars().all(|c| c.is_ascii_alphanumeric() || "_-.".contains(c)) {
                    return Err(ConfigError::at(
                        f,
                        &p.referenced,
                        "key_prefix: use letters, digits, '_', '-', '.'",
                    ));
                }
                p.value.clone()
            }
            None => "tl".to_string(),
        };
        let key_salt = s
            .key_salt_env
            .as_ref()
            .and_then(|name| std::env::var(name).ok())
            .unwrap_or_default();
        let store = StoreConfig {
            kind,
            urls,
            timeout: opt_duration(f, &s.timeout, Duration::from_millis(20))?,
            key_prefix,
            key_salt,
            memory_max_keys: s.memory_max_keys.unwrap_or(1_000_000),
            breaker_threshold: s.breaker_threshold.unwrap_or(3),
            probe_interval: opt_duration(f, &s.probe_interval, Duration::from_millis(250))?,
        };

        let id = &raw.identity;
        let api_key_header = match &id.api_key_header {
            Some(h) => HeaderName::from_bytes(h.value.as_bytes())
                .map_err(|_| ConfigError::at(f, &h.referenced, "invalid header name"))?,
            None => HeaderName::from_static("x-api-key"),
        };
        let mut trusted_proxies = Vec::new();
        for p in &id.trusted_proxies {
            let net = p
                .value
                .parse::<IpNet>()
                .or_else(|_| p.value.parse::<std::net::IpAddr>().map(IpNet::from))
                .map_err(|_| ConfigError::at(f, &p.referenced, format!("invalid CIDR {:?}", p.value)))?;
            trusted_proxies.push(net);
        }
        let ipv6_prefix = match &id.ipv6_prefix {
            Some(p) if p.value > 128 || p.value == 0 => {
                return Err(ConfigError::at(f, &p.referenced, "ipv6_prefix must be 1..=128"))
            }
            Some(p) => p.value,
            None => 64,
        };
        let jwt = match &id.jwt {
            Some(j) => Some(std::sync::Arc::new(JwtVerifier::compile(f, dir, j)?)),
            None => None,
        };
        let identity = IdentityConfig {
            api_key_header,
            jwt,
            trusted_proxies,
            ipv6_prefix,
            max_forwarded_entries: id.max_forwarded_entries.unwrap_or(32).max(1),
        };

        let l = &raw.limits;
        let (mut ietf, mut legacy) = (true, true);
        if let Some(h) = &l.headers {
            ietf = false;
            legacy = false;
            for fam in &h.value {
                match fam.as_str() {
                    "ietf" => ietf = true,
                    "x-ratelimit" => legacy = true,
                    other => {
                        return Err(ConfigError::at(
                            f,
                            &h.referenced,
                            format!("unknown header family {other:?} (ietf | x-ratelimit)"),
                        ))
                    }
                }
            }
        }
        let limits = LimitsConfig {
            ietf_headers: ietf,
            legacy_headers: legacy,
            deny_cache: l.deny_cache.unwrap_or(true),
            deny_cache_max: l.deny_cache_max.unwrap_or(100_000),
            shadow_log_sample: l.shadow_log_sample.unwrap_or(100).max(1),
        };

        let sv = &raw.server;
        let server = ServerConfig {
            header_read_timeout: opt_duration(f, &sv.header_read_timeout, Duration::from_secs(10))?,
            idle_timeout: opt_duration(f, &sv.idle_timeout, Duration::from_secs(60))?,
            max_connections: sv.max_connections.unwrap_or(10_000).max(1),
            max_body_bytes: sv.max_body_bytes.unwrap_or(64 * 1024 * 1024),
            max_header_bytes: sv.max_header_bytes.unwrap_or(16 * 1024).max(1024),
            shutdown_grace: opt_duration(f, &sv.shutdown_grace, Duration::from_secs(10))?,
        };

        Ok(GatewayConfig {
            path: path.to_path_buf(),
            listen,
            admin_listen,
            upstream,
            rules_file: rel(raw.rules_file.as_ref().map_or("rules.yaml", |r| r.value.as_str())),
            keys_file: raw.keys_file.as_ref().map(|k| rel(&k.value)),
            store,
            identity,
            limits,
            server,
        })
    }
}

#[cfg(test)]
mod tests;
