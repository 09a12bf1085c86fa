//! Configuration: raw serde structs ([`raw`]), validated into the typed, compiled config used at
//! run time, plus the live reload of the rules and keys files ([`reload`]).
//!
//! Every error names `file:line:col`. Durations are humantime strings (`5ms`, `1s`, `15m`).

pub mod admin;
pub mod effective;
pub mod leases;
pub mod net;
pub mod otlp;
pub mod raw;
pub mod reload;
pub mod rls;

pub use crate::http::tls::{ClientAuth, ListenerTls, UpstreamTls};
pub use crate::http::upstream::settings::{HealthCheck, Target, UpstreamConfig, UpstreamProtocol};
pub use crate::identity::IdentityConfig;
pub use crate::limiter::redis::{redact_url, Scripting};
pub use crate::yaml::{duration, parse_file, parse_str, ConfigError, Secret};
pub use net::{AccessLog, StoreAuth};

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use http::HeaderName;
use ipnet::IpNet;
use serde_saphyr::Spanned;

use crate::identity::jwt::JwtKeys;

/// `server.max_connections_per_ip` when unset (and `max_connections` is at least four times it).
pub const DEFAULT_MAX_CONNECTIONS_PER_IP: usize = 64;

/// `store.timeout` when unset in a file with an `rls:` section: half of Envoy's default 20 ms
/// timeout for a `ShouldRateLimit` call.
pub const RLS_STORE_TIMEOUT: Duration = Duration::from_millis(10);

/// `upstream.max_connections_per_target` when unset.
pub const DEFAULT_MAX_CONNECTIONS_PER_TARGET: usize = 1024;

fn opt_duration(file: &Path, s: &Option<Spanned<String>>, default: Duration) -> Result<Duration, ConfigError> {
    match s {
        Some(s) => duration(file, s),
        None => Ok(default),
    }
}

/// A duration that must be more than zero (`field` names it in the error).
fn positive_duration(
    file: &Path,
    s: &Option<Spanned<String>>,
    field: &str,
    default: Duration,
) -> Result<Duration, ConfigError> {
    let d = opt_duration(file, s, default)?;
    match s {
        Some(s) if d.is_zero() => Err(ConfigError::at(
            file,
            &s.referenced,
            format!("{field}: {:?} is zero; it must be more than 0", s.value),
        )),
        _ => Ok(d),
    }
}

/// A count that must be at least `min` (`field` names it in the error). Nothing is silently
/// raised: a value `run` could not honour is refused by `check` too.
fn at_least<T>(file: &Path, s: &Option<Spanned<T>>, field: &str, min: T, default: T) -> Result<T, ConfigError>
where
    T: Copy + PartialOrd + std::fmt::Display,
{
    match s {
        Some(v) if v.value < min => Err(ConfigError::at(
            file,
            &v.referenced,
            format!("{field}: {} is too small; it must be at least {min}", v.value),
        )),
        Some(v) => Ok(v.value),
        None => Ok(default),
    }
}

/// Check one Redis URL the way the store will open it: scheme `redis://` (or `rediss://`), and
/// parsed by the Redis client. Returns a message naming the (redacted) URL.
fn check_redis_url(url: &str) -> Result<(), String> {
    use redis::IntoConnectionInfo;
    let shown = redact_url(url);
    let scheme = url.split_once("://").map(|(s, _)| s);
    if !matches!(scheme, Some("redis") | Some("rediss")) {
        return Err(format!(
            "Redis URL {shown:?} needs a scheme: redis://host:port (or rediss://)"
        ));
    }
    url.into_connection_info()
        .map(|_| ())
        .map_err(|e| format!("Redis URL {shown:?} did not parse: {e}"))
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

/// A note when the listener certificate has expired or expires within 14 days (logged at
/// every start and shown by `tollgate check`).
fn certificate_note(cert_file: &Path) -> Option<String> {
    let der = crate::http::tls::load_certs(cert_file).ok()?.into_iter().next()?;
    let expiry = crate::http::tls::not_after(&der)?;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let when = humantime::format_rfc3339_seconds(std::time::UNIX_EPOCH + std::time::Duration::from_secs(expiry));
    if expiry <= now {
        Some(format!(
            "tls.cert_file {}: the certificate EXPIRED at {when}",
            cert_file.display()
        ))
    } else if expiry - now < 14 * 86_400 {
        Some(format!(
            "tls.cert_file {}: the certificate expires at {when}, in {} days",
            cert_file.display(),
            (expiry - now) / 86_400
        ))
    } else {
        None
    }
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
    /// How long a concurrency slot lives without renewal (running requests renew theirs every
    /// third of it; a crashed gateway's slots free themselves after it). At least 3 s.
    pub concurrency_ttl: Duration,
    /// `store.durability: replicated`: every Redis write waits (`WAIT 1`) for a replica within
    /// `timeout`, else the check is a store failure.
    pub replicated: bool,
    /// `store.scripting`: Redis functions, `EVALSHA`, or functions where the server has them.
    pub scripting: Scripting,
    /// Redis password and TLS roots.
    pub auth: StoreAuth,
    /// Leases for hot keys (`store.leases`); `None` on the memory store or when disabled.
    pub leases: Option<crate::limiter::lease::LeaseConfig>,
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
    /// Most API keys `keys_file` may hold (the parser's budget is sized from it).
    pub max_keys: usize,
    /// Most rules `rules_file` may hold.
    pub max_rules: usize,
}

/// `server:`, validated.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Time to receive request headers.
    pub header_read_timeout: Duration,
    /// HTTP/2: a connection with no open stream for this long is sent GOAWAY and closed (pings
    /// do not keep it open); also the interval of keep-alive pings, and a connection whose peer
    /// does not answer one within `server::H2_PING_TIMEOUT` is closed. (HTTP/1.1 keep-alive
    /// connections are closed by `header_read_timeout` instead.)
    pub idle_timeout: Duration,
    /// Concurrent connections.
    pub max_connections: usize,
    /// Concurrent connections from one client address (an IPv6 client counts by its
    /// `identity.ipv6_prefix`); `None`: no cap. Connections from `identity.trusted_proxies` are
    /// not capped (each carries many clients).
    pub max_connections_per_ip: Option<usize>,
    /// Largest request body.
    pub max_body_bytes: u64,
    /// Largest header section.
    pub max_header_bytes: usize,
    /// Drain deadline on shutdown.
    pub shutdown_grace: Duration,
    /// The drain window after SIGTERM, before `shutdown_grace` begins: still serving (and
    /// accepting), `/readyz` failing, HTTP/1.1 answered with `Connection: close`, HTTP/2 sent
    /// GOAWAY. `0s` turns it off.
    pub drain: Duration,
    /// How the proxy's connections are spread over the worker threads.
    pub runtime: Runtime,
    /// What a request path with an encoded `/` or `\` gets.
    pub encoded_slashes: crate::rules::EncodedSlashes,
    /// The protocols (lower case) a client may upgrade to; other `Upgrade` requests are
    /// forwarded as plain requests, without the upgrade.
    pub upgrades: Vec<String>,
}

/// How the proxy's connections are spread over its worker threads (`server.runtime`). The
/// number of workers is `TOKIO_WORKER_THREADS`, or one per core.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Runtime {
    /// One tokio runtime whose workers take connections from one listener and steal each
    /// other's tasks (one worker: a single-threaded runtime).
    WorkStealing,
    /// One single-threaded runtime per worker, each accepting from its own `SO_REUSEPORT`
    /// listener on the same address: the kernel spreads new connections, and a connection's
    /// tasks never leave its thread. The default: with two workers it served 16 % more
    /// requests on one hot key at 9 % less CPU each, and the same on many keys
    /// (docs/performance.md).
    #[default]
    ThreadPerCore,
}

impl Runtime {
    /// How many workers serve connections: `TOKIO_WORKER_THREADS` when it is a positive
    /// number, else one per core.
    pub fn workers() -> usize {
        std::env::var("TOKIO_WORKER_THREADS")
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
            .filter(|n| *n > 0)
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
    }
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
    /// Who may use the admin API.
    pub admin: admin::AdminConfig,
    /// Where admitted requests go: the targets, protocol, TLS, timeouts, caps and ejection.
    /// A placeholder nothing is sent to when `proxied` is false.
    pub upstream: UpstreamConfig,
    /// The file has an `upstream:`: `tollgate run` serves the proxy. Without one (a file for
    /// `tollgate rls` alone) there are no proxy, no upstream and, unless `rules_file` is
    /// given, no rules.
    pub proxied: bool,
    /// TLS on the proxy listener (`None`: plain HTTP).
    pub tls: Option<ListenerTls>,
    /// Which requests get an access line (all, none, or a sampled fraction).
    pub access_log: AccessLog,
    /// Rules file (absolute or relative to the working dir).
    pub rules_file: PathBuf,
    /// API key registry.
    pub keys_file: Option<PathBuf>,
    /// Where `rules_file` is written in the gateway file (line, column), so an error about a
    /// file that cannot be read points there.
    pub rules_file_at: Option<(u64, u64)>,
    /// Where `keys_file` is written in the gateway file (line, column).
    pub keys_file_at: Option<(u64, u64)>,
    /// Where counts are kept (memory, Redis, Redis Cluster), with its deadline and breakers.
    pub store: StoreConfig,
    /// How the caller is identified: API-key header, JWT, trusted proxies, IPv6 prefix.
    pub identity: IdentityConfig,
    /// Headers and the deny cache.
    pub limits: LimitsConfig,
    /// Listener limits.
    pub server: ServerConfig,
    /// Span export over OTLP (`None`: off).
    pub otlp: Option<otlp::OtlpConfig>,
    /// The Envoy rate-limit service (`rls:`), when configured.
    pub rls: Option<rls::RlsSettings>,
    /// Adaptive concurrency toward the upstream (`upstream.adaptive`; `None`: off).
    pub adaptive: Option<crate::adaptive::AdaptiveConfig>,
    /// This gateway's region and its peers (`store.region`, `store.regions`; `None`: one region).
    pub regions: Option<crate::regions::RegionsConfig>,
    /// Things an operator should know that are not errors (an ignored environment override, a
    /// risky combination). `check` prints them; `run` logs each as a warning at start.
    pub notes: Vec<String>,
}

/// Overrides from the environment (`TOLLGATE_LISTEN`, `TOLLGATE_REDIS_URL(S)`).
#[derive(Debug, Clone)]
pub struct EnvOverrides {
    /// Replaces `listen`.
    pub listen: Option<String>,
    /// Replaces `store.urls` (comma-separated).
    pub redis_urls: Option<String>,
    /// The variable `redis_urls` came from (for messages).
    pub redis_urls_var: &'static str,
}

impl EnvOverrides {
    /// Read from the process environment.
    pub fn from_env() -> Self {
        let var = |n: &str| std::env::var(n).ok().filter(|s| !s.is_empty());
        let (redis_urls, redis_urls_var) = match (var("TOLLGATE_REDIS_URLS"), var("TOLLGATE_REDIS_URL")) {
            (Some(v), _) => (Some(v), "TOLLGATE_REDIS_URLS"),
            (None, Some(v)) => (Some(v), "TOLLGATE_REDIS_URL"),
            (None, None) => (None, "TOLLGATE_REDIS_URLS"),
        };
        EnvOverrides {
            listen: var("TOLLGATE_LISTEN"),
            redis_urls,
            redis_urls_var,
        }
    }
}

impl Default for EnvOverrides {
    /// No overrides.
    fn default() -> Self {
        EnvOverrides {
            listen: None,
            redis_urls: None,
            redis_urls_var: "TOLLGATE_REDIS_URLS",
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
        let mut notes = Vec::new();
        if let Some(l) = &env.listen {
            let from_file = listen;
            listen = l
                .parse()
                .map_err(|_| ConfigError::file(f, format!("TOLLGATE_LISTEN: invalid address {l:?}")))?;
            if listen != from_file {
                // Never silently: the file says one thing and the process does another.
                notes.push(format!(
                    "TOLLGATE_LISTEN={listen} replaces listen ({from_file} in {})",
                    f.display()
                ));
            }
        }
        let admin_listen = addr(f, &raw.admin_listen, "127.0.0.1:9090")?;
        let admin = admin::compile(f, &raw.admin, admin_listen, raw.admin_listen.as_ref(), &mut notes)?;

        let upstream = match &raw.upstream {
            Some(u) => net::upstream(f, dir, u, &mut notes)?,
            None if raw.rls.is_some() => net::unused_upstream(f, dir)?,
            None => return Err(ConfigError::file(
                f,
                "missing field `upstream` (only a file with an `rls:` section, for `tollgate rls`, may leave it out)",
            )),
        };
        let mut store = store_section(f, dir, &raw.store, env, &mut notes)?;
        if raw.rls.is_some() && raw.store.timeout.is_none() {
            // Envoy gives the whole rate-limit call 20 ms by default: the store's part of it
            // stays well under that, so a slow store is answered by the failure policy in time.
            store.timeout = RLS_STORE_TIMEOUT;
        }
        let identity = identity_section(f, dir, &raw.identity)?;
        let limits = limits_section(f, &raw.limits)?;
        let server = server_section(f, &raw.server, upstream.request_timeout, &mut notes)?;

        let tls = match &raw.tls {
            Some(t) => Some(net::listener_tls(f, dir, t)?),
            None => None,
        };
        if let Some(note) = tls.as_ref().and_then(|t| certificate_note(&t.cert_file)) {
            notes.push(note);
        }
        let access_log = net::access_log(f, &raw.access_log)?;
        let otlp = otlp::compile(f, &raw.tracing)?;
        let rls = match &raw.rls {
            Some(r) => Some(rls::compile(f, dir, r)?),
            None => None,
        };
        let adaptive = match raw.upstream.as_ref().and_then(|u| u.value.adaptive.as_ref()) {
            Some(a) => Some(crate::adaptive::AdaptiveConfig::compile(f, a)?),
            None => None,
        };
        let regions = crate::regions::RegionsConfig::compile(
            f,
            raw.store.region.as_ref(),
            raw.store.regions.as_ref(),
            store.kind != StoreKind::Memory,
        )?;
        Ok(GatewayConfig {
            rls,
            adaptive,
            regions,
            path: path.to_path_buf(),
            listen,
            admin_listen,
            admin,
            upstream,
            proxied: raw.upstream.is_some(),
            tls,
            access_log,
            rules_file: rel(raw.rules_file.as_ref().map_or("rules.yaml", |r| r.value.as_str())),
            keys_file: raw.keys_file.as_ref().map(|k| rel(&k.value)),
            rules_file_at: raw
                .rules_file
                .as_ref()
                .map(|r| (r.referenced.line(), r.referenced.column())),
            keys_file_at: raw
                .keys_file
                .as_ref()
                .map(|k| (k.referenced.line(), k.referenced.column())),
            store,
            identity,
            limits,
            server,
            otlp,
            notes,
        })
    }
}

/// `store:`, with `TOLLGATE_REDIS_URLS` applied (noted in `notes`) and its secrets read from
/// the environment.
fn store_section(
    f: &Path,
    dir: &Path,
    s: &raw::RawStore,
    env: &EnvOverrides,
    notes: &mut Vec<String>,
) -> Result<StoreConfig, ConfigError> {
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
    let mut urls = Vec::with_capacity(s.urls.len());
    for u in &s.urls {
        if kind != StoreKind::Memory {
            check_redis_url(&u.value).map_err(|m| ConfigError::at(f, &u.referenced, format!("store.urls: {m}")))?;
        }
        urls.push(u.value.clone());
    }
    if let Some(list) = &env.redis_urls {
        if kind == StoreKind::Memory {
            notes.push(format!(
                "{} is set but ignored: store.kind is memory",
                env.redis_urls_var
            ));
        } else {
            notes.push(format!(
                "{} replaces store.urls ({} url(s) in {})",
                env.redis_urls_var,
                s.urls.len(),
                f.display()
            ));
            urls = list
                .split(',')
                .map(|u| u.trim().to_string())
                .filter(|u| !u.is_empty())
                .collect();
            for u in &urls {
                check_redis_url(u).map_err(|m| ConfigError::file(f, format!("{}: {m}", env.redis_urls_var)))?;
            }
        }
    }
    if kind != StoreKind::Memory && urls.is_empty() {
        let at = s.kind.as_ref().map(|k| &k.referenced);
        let msg = "store.urls: a redis store needs at least one url";
        return Err(match at {
            Some(loc) => ConfigError::at(f, loc, msg),
            None => ConfigError::file(f, msg),
        });
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
    // A missing salt must never silently mean "no salt": a pod without the Secret would
    // build different keys from the rest of the fleet and split every counter.
    let key_salt = match &s.key_salt_env {
        Some(name) => crate::yaml::required_env(f, name, "store.key_salt_env")?,
        None => String::new(),
    };
    let auth = net::store_auth(f, dir, s, if kind == StoreKind::Memory { &[] } else { &urls })?;
    Ok(StoreConfig {
        leases: leases::leases(f, &s.leases, kind)?,
        auth,
        kind,
        urls,
        timeout: positive_duration(f, &s.timeout, "store.timeout", Duration::from_millis(20))?,
        key_prefix,
        key_salt,
        memory_max_keys: at_least(f, &s.memory_max_keys, "store.memory_max_keys", 1, 1_000_000)?,
        breaker_threshold: at_least(f, &s.breaker_threshold, "store.breaker_threshold", 1, 3)?,
        probe_interval: positive_duration(f, &s.probe_interval, "store.probe_interval", Duration::from_millis(250))?,
        concurrency_ttl: {
            let ttl = positive_duration(f, &s.concurrency_ttl, "store.concurrency_ttl", Duration::from_secs(30))?;
            if let (Some(at), true) = (&s.concurrency_ttl, ttl < Duration::from_secs(3)) {
                return Err(ConfigError::at(
                    f,
                    &at.referenced,
                    "store.concurrency_ttl must be at least 3s (slots are renewed every third of it)",
                ));
            }
            ttl
        },
        replicated: match &s.durability {
            None => false,
            Some(d) if d.value == "none" => false,
            Some(d) if d.value == "replicated" => {
                if kind == StoreKind::Memory {
                    return Err(ConfigError::at(
                        f,
                        &d.referenced,
                        "store.durability: replicated needs a Redis store (kind: redis or redis_cluster)",
                    ));
                }
                true
            }
            Some(d) => {
                return Err(ConfigError::at(
                    f,
                    &d.referenced,
                    format!("store.durability: unknown value {:?} (none | replicated)", d.value),
                ))
            }
        },
        scripting: match &s.scripting {
            None => Scripting::Auto,
            Some(v) if kind == StoreKind::Memory => {
                return Err(ConfigError::at(
                    f,
                    &v.referenced,
                    "store.scripting needs a Redis store (kind: redis or redis_cluster)",
                ))
            }
            Some(v) => match v.value.as_str() {
                "auto" => Scripting::Auto,
                "functions" => Scripting::Functions,
                "eval" => Scripting::Eval,
                other => {
                    return Err(ConfigError::at(
                        f,
                        &v.referenced,
                        format!("store.scripting: unknown value {other:?} (auto | functions | eval)"),
                    ))
                }
            },
        },
    })
}

/// `identity:`: the API key header, trusted proxies, the IPv6 prefix, JWT keys, and what an
/// invalid credential gets.
fn identity_section(f: &Path, dir: &Path, id: &raw::RawIdentity) -> Result<IdentityConfig, ConfigError> {
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
        Some(j) => Some(std::sync::Arc::new(JwtKeys::compile(f, dir, j)?)),
        None => None,
    };
    let invalid_credentials = match &id.invalid_credentials {
        None => crate::identity::InvalidCredentials::Reject,
        Some(v) => match v.value.as_str() {
            "reject" => crate::identity::InvalidCredentials::Reject,
            "ip" => crate::identity::InvalidCredentials::Ip,
            other => {
                return Err(ConfigError::at(
                    f,
                    &v.referenced,
                    format!("identity.invalid_credentials: unknown value {other:?} (reject | ip)"),
                ))
            }
        },
    };
    Ok(IdentityConfig {
        invalid_credentials,
        api_key_header,
        jwt,
        trusted_proxies,
        ipv6_prefix,
        max_forwarded_entries: at_least(f, &id.max_forwarded_entries, "identity.max_forwarded_entries", 1, 32)?,
    })
}

/// `limits:`: header families, the deny cache, and the sizes of the rules and keys files.
fn limits_section(f: &Path, l: &raw::RawLimits) -> Result<LimitsConfig, ConfigError> {
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
    Ok(LimitsConfig {
        ietf_headers: ietf,
        legacy_headers: legacy,
        deny_cache: l.deny_cache.unwrap_or(true),
        deny_cache_max: at_least(f, &l.deny_cache_max, "limits.deny_cache_max", 1, 100_000)?,
        shadow_log_sample: at_least(f, &l.shadow_log_sample, "limits.shadow_log_sample", 1, 100)?,
        max_keys: at_least(
            f,
            &l.max_keys,
            "limits.max_keys",
            1,
            crate::identity::keys::DEFAULT_MAX_KEYS,
        )?,
        max_rules: at_least(f, &l.max_rules, "limits.max_rules", 1, crate::rules::DEFAULT_MAX_RULES)?,
    })
}

/// `server:`: timeouts, caps, drain and the runtime. `request_timeout` (the upstream's) is the
/// default shutdown grace; a shorter grace is noted.
fn server_section(
    f: &Path,
    sv: &raw::RawServer,
    request_timeout: Duration,
    notes: &mut Vec<String>,
) -> Result<ServerConfig, ConfigError> {
    let mut server = ServerConfig {
        header_read_timeout: positive_duration(
            f,
            &sv.header_read_timeout,
            "server.header_read_timeout",
            Duration::from_secs(10),
        )?,
        idle_timeout: positive_duration(f, &sv.idle_timeout, "server.idle_timeout", Duration::from_secs(60))?,
        max_connections: at_least(f, &sv.max_connections, "server.max_connections", 1, 10_000)?,
        max_connections_per_ip: None,
        max_body_bytes: sv.max_body_bytes.unwrap_or(64 * 1024 * 1024),
        max_header_bytes: at_least(f, &sv.max_header_bytes, "server.max_header_bytes", 1024, 16 * 1024)?,
        // By default in-flight requests get as long to finish as the upstream gets to answer.
        shutdown_grace: opt_duration(f, &sv.shutdown_grace, request_timeout)?,
        drain: opt_duration(f, &sv.drain, DEFAULT_DRAIN)?,
        runtime: match sv.runtime {
            None => Runtime::default(),
            Some(raw::RawRuntime::WorkStealing) => Runtime::WorkStealing,
            Some(raw::RawRuntime::ThreadPerCore) => Runtime::ThreadPerCore,
        },
        encoded_slashes: match sv.encoded_slashes {
            None | Some(raw::RawEncodedSlashes::Reject) => crate::rules::EncodedSlashes::Reject,
            Some(raw::RawEncodedSlashes::Keep) => crate::rules::EncodedSlashes::Keep,
        },
        upgrades: upgrades(f, &sv.upgrades)?,
    };
    // Default: 64, or a quarter of `max_connections` when that is less, so that one address
    // never fills the gateway by itself; 0 turns the cap off.
    server.max_connections_per_ip = match &sv.max_connections_per_ip {
        Some(v) if v.value == 0 => None,
        Some(v) => Some(v.value),
        None => Some((server.max_connections / 4).clamp(1, DEFAULT_MAX_CONNECTIONS_PER_IP)),
    };
    if server.shutdown_grace < request_timeout {
        notes.push(format!(
            "server.shutdown_grace ({}) is shorter than request_timeout ({}): a slow request in flight at shutdown is cut off",
            humantime::format_duration(server.shutdown_grace),
            humantime::format_duration(request_timeout)
        ));
    }
    Ok(server)
}

#[cfg(test)]
mod tests;

/// `server.drain` when not set: long enough for a balancer or kube-proxy to take the instance
/// out before it stops accepting.
const DEFAULT_DRAIN: Duration = Duration::from_secs(5);

/// `server.upgrades`: protocol names (an `Upgrade` token without its `/version`), lower case;
/// `[websocket]` when absent.
fn upgrades(f: &Path, raw: &Option<Vec<Spanned<String>>>) -> Result<Vec<String>, ConfigError> {
    let Some(list) = raw else {
        return Ok(vec!["websocket".to_owned()]);
    };
    let mut out = Vec::with_capacity(list.len());
    for p in list {
        let name = p.value.trim();
        let token = !name.is_empty()
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b));
        if !token {
            return Err(ConfigError::at(
                f,
                &p.referenced,
                format!(
                    "server.upgrades: {:?} is not a protocol name (a token such as websocket)",
                    p.value
                ),
            ));
        }
        out.push(name.to_ascii_lowercase());
    }
    Ok(out)
}
