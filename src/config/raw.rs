//! Raw serde structs: exactly what the YAML files say, before validation. Unknown fields are
//! errors. Fields that validation may refuse are [`Spanned`] so the error names line and column.

use serde::Deserialize;
use serde_saphyr::Spanned;

pub use crate::identity::raw::{RawJwt, RawKey, RawKeys};
pub use crate::rules::raw::{
    RawCostFrom, RawCountWhen, RawDefaults, RawMatch, RawOverride, RawPenalty, RawRule, RawRules, RawStatus, RawWindow,
};

/// `gateway.yaml`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawGateway {
    /// Proxy listen address.
    pub listen: Option<Spanned<String>>,
    /// Admin listen address.
    pub admin_listen: Option<Spanned<String>>,
    /// Admin API access.
    #[serde(default)]
    pub admin: RawAdmin,
    /// The upstream API (required but for a file with `rls:`, which `tollgate rls` serves
    /// with no proxy).
    pub upstream: Option<Spanned<RawUpstream>>,
    /// TLS on the proxy listener.
    pub tls: Option<Spanned<RawTls>>,
    /// One structured line per request: `true`, `false`, or a sampled fraction in (0, 1].
    pub access_log: Option<Spanned<RawAccessLog>>,
    /// Rules file, relative to the gateway file.
    pub rules_file: Option<Spanned<String>>,
    /// API key registry, relative to the gateway file.
    pub keys_file: Option<Spanned<String>>,
    /// Where counters live.
    #[serde(default)]
    pub store: RawStore,
    /// How callers are identified.
    #[serde(default)]
    pub identity: RawIdentity,
    /// Response headers and the deny cache.
    #[serde(default)]
    pub limits: RawLimits,
    /// Listener limits and timeouts.
    #[serde(default)]
    pub server: RawServer,
    /// Span export (`tracing.otlp`).
    #[serde(default)]
    pub tracing: RawTracing,
    /// The Envoy rate-limit service (off unless given).
    pub rls: Option<Spanned<RawRls>>,
}

/// `rls:` — the Envoy rate-limit service front end.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawRls {
    /// gRPC (and `/json`, `/healthcheck`) listen address; off unless set (`tollgate rls`
    /// defaults it).
    pub listen: Option<Spanned<String>>,
    /// The directory of envoyproxy/ratelimit config files (`*.yaml`, one domain each),
    /// relative to the gateway file.
    pub config_dir: Spanned<String>,
    /// Failure policy of every domain that names none: `open` (default), `closed`, `local`.
    pub failure: Option<Spanned<String>>,
    /// Response headers for Envoy to add: `none` (default), `ietf`, `x-ratelimit`.
    pub headers: Option<Spanned<String>>,
}

/// `tls:` (the proxy listener).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawTls {
    /// PEM certificate chain.
    pub cert_file: Spanned<String>,
    /// PEM private key.
    pub key_file: Spanned<String>,
    /// PEM CA bundle that client certificates must chain to (mutual TLS).
    pub client_ca_file: Option<Spanned<String>>,
    /// `required` (default with a `client_ca_file`) or `optional`.
    pub client_auth: Option<Spanned<String>>,
}

/// `access_log:` — `true`, `false`, or the fraction of requests logged.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(untagged)]
pub enum RawAccessLog {
    /// Every request, or none.
    All(bool),
    /// A sampled fraction, in (0, 1].
    Rate(f64),
}

/// `upstream.tls:`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawUpstreamTls {
    /// PEM CA bundle trusted instead of the webpki roots.
    pub ca_file: Option<Spanned<String>>,
    /// PEM client certificate chain (mutual TLS to the upstream).
    pub client_cert_file: Option<Spanned<String>>,
    /// PEM client private key.
    pub client_key_file: Option<Spanned<String>>,
    /// Do not verify the upstream's certificate (warned at every start).
    pub insecure_skip_verify: Option<Spanned<bool>>,
    /// The TLS server name (SNI, and the name the certificate must carry) for every https://
    /// target, instead of each target URL's host.
    pub server_name: Option<Spanned<String>>,
}

/// `upstream.health_check:`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawHealthCheck {
    /// Path asked with `GET`; a 2xx or 3xx answer is healthy.
    pub path: Spanned<String>,
    /// How often each target is asked.
    pub interval: Option<Spanned<String>>,
    /// Deadline of one check.
    pub timeout: Option<Spanned<String>>,
}

/// `store.leases:`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawLeases {
    /// On by default for Redis stores.
    pub enabled: Option<bool>,
    /// `50/s`: a key seen less often never gets a lease.
    pub min_rate: Option<Spanned<String>>,
    /// Longest life of a lease.
    pub ttl: Option<Spanned<String>>,
    /// Most of a limit one lease may hold.
    pub max_share: Option<Spanned<f64>>,
}

/// `store.tls:`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawStoreTls {
    /// PEM CA bundle the Redis servers' certificates chain to.
    pub ca_file: Option<Spanned<String>>,
}

/// `upstream:`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawUpstream {
    /// `http://host:port` or `https://host:port` (one target).
    pub url: Option<Spanned<String>>,
    /// Several instances of the same API.
    pub targets: Option<Spanned<Vec<Spanned<String>>>>,
    /// http1 | h2c | h2 | auto: what the connections to the targets speak.
    pub protocol: Option<Spanned<String>>,
    /// TLS to `https://` targets.
    pub tls: Option<Spanned<RawUpstreamTls>>,
    /// Consecutive failures (connect errors, 5xx) that eject a target.
    pub eject_after: Option<Spanned<u32>>,
    /// How long an ejected target stays out (doubling while it keeps failing).
    pub eject_for: Option<Spanned<String>>,
    /// Active health check.
    pub health_check: Option<RawHealthCheck>,
    /// TCP connect timeout.
    pub connect_timeout: Option<Spanned<String>>,
    /// Deadline for the upstream's response headers.
    pub request_timeout: Option<Spanned<String>>,
    /// Idle pooled connections kept per host.
    pub pool_max_idle_per_host: Option<usize>,
    /// Open connections to one target at most.
    pub max_connections_per_target: Option<Spanned<usize>>,
    /// Adaptive concurrency: a limit on requests in flight, learned from latency.
    pub adaptive: Option<crate::adaptive::raw::RawAdaptive>,
}

/// `store:`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawStore {
    /// memory | redis | redis_cluster.
    pub kind: Option<Spanned<String>>,
    /// Redis URLs (cluster: any seeds).
    #[serde(default)]
    pub urls: Vec<Spanned<String>>,
    /// Deadline of one limit check.
    pub timeout: Option<Spanned<String>>,
    /// First part of every store key.
    pub key_prefix: Option<Spanned<String>>,
    /// Name of an env var holding a secret mixed into key hashes.
    pub key_salt_env: Option<Spanned<String>>,
    /// Memory store: tracked-key cap.
    pub memory_max_keys: Option<Spanned<usize>>,
    /// Consecutive failures that open the circuit breaker.
    pub breaker_threshold: Option<Spanned<u32>>,
    /// How often an open breaker probes the store.
    pub probe_interval: Option<Spanned<String>>,
    /// How long a concurrency slot lives without renewal.
    pub concurrency_ttl: Option<Spanned<String>>,
    /// `none` (default) or `replicated`: writes wait for a replica.
    pub durability: Option<Spanned<String>>,
    /// Leases for hot keys.
    pub leases: Option<Spanned<RawLeases>>,
    /// `auto` (default), `functions` or `eval`: how the limit script is run on Redis.
    pub scripting: Option<Spanned<String>>,
    /// Name of an env var holding the Redis password.
    pub password_env: Option<Spanned<String>>,
    /// TLS to Redis (`rediss://` URLs).
    pub tls: Option<Spanned<RawStoreTls>>,
    /// This gateway's region (`scope: global` rules count every region's spend).
    pub region: Option<Spanned<String>>,
    /// The other regions and how global limits are shared with them.
    pub regions: Option<Spanned<crate::regions::RawRegions>>,
}

/// `identity:`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawIdentity {
    /// Header carrying the API key.
    pub api_key_header: Option<Spanned<String>>,
    /// JWT verification.
    pub jwt: Option<RawJwt>,
    /// CIDRs whose X-Forwarded-For is believed.
    #[serde(default)]
    pub trusted_proxies: Vec<Spanned<String>>,
    /// IPv6 prefix length that identifies one client.
    pub ipv6_prefix: Option<Spanned<u8>>,
    /// Most X-Forwarded-For entries read from the right.
    pub max_forwarded_entries: Option<Spanned<usize>>,
    /// What a present but invalid credential gets: `reject` (401) or `ip`.
    pub invalid_credentials: Option<Spanned<String>>,
}

/// `limits:`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawLimits {
    /// Header families: ietf, x-ratelimit.
    pub headers: Option<Spanned<Vec<String>>>,
    /// Remember denials locally.
    pub deny_cache: Option<bool>,
    /// Deny cache capacity.
    pub deny_cache_max: Option<Spanned<usize>>,
    /// One in N shadow denials is logged.
    pub shadow_log_sample: Option<Spanned<u64>>,
    /// Most API keys `keys_file` may hold.
    pub max_keys: Option<Spanned<usize>>,
    /// Most rules `rules_file` may hold.
    pub max_rules: Option<Spanned<usize>>,
}

/// `server:`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawServer {
    /// Time a client has to send its request headers.
    pub header_read_timeout: Option<Spanned<String>>,
    /// HTTP/2: how long a connection without open streams stays open (and the keep-alive
    /// ping interval).
    pub idle_timeout: Option<Spanned<String>>,
    /// Concurrent client connections.
    pub max_connections: Option<Spanned<usize>>,
    /// Concurrent client connections from one address (0: no cap).
    pub max_connections_per_ip: Option<Spanned<usize>>,
    /// Request bodies larger than this get 413.
    pub max_body_bytes: Option<u64>,
    /// Largest request header section, bytes.
    pub max_header_bytes: Option<Spanned<usize>>,
    /// Time in-flight requests get on shutdown.
    pub shutdown_grace: Option<Spanned<String>>,
    /// The drain window after SIGTERM.
    pub drain: Option<Spanned<String>>,
    /// `work_stealing` or `thread_per_core`.
    pub runtime: Option<RawRuntime>,
    /// `reject` (default) or `keep`: what a path with `%2F` / `%5C` gets.
    pub encoded_slashes: Option<RawEncodedSlashes>,
    /// The protocols a client may upgrade to (`Upgrade:`); default `[websocket]`.
    pub upgrades: Option<Vec<Spanned<String>>>,
}

/// `server.encoded_slashes`.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RawEncodedSlashes {
    /// 400.
    Reject,
    /// Kept encoded, as data.
    Keep,
}

/// `server.runtime`.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RawRuntime {
    /// One tokio runtime whose workers steal each other's tasks.
    WorkStealing,
    /// One single-threaded runtime per worker, each with its own listener.
    ThreadPerCore,
}

/// `admin:`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawAdmin {
    /// Name of the environment variable holding the admin token.
    pub token_env: Option<Spanned<String>>,
    /// A file of admin tokens, one per line (`read-only <token>` for a token that may only
    /// read), re-read when it changes: rotation without a restart.
    pub token_file: Option<Spanned<String>>,
    /// Allow a non-loopback `admin_listen` without a token.
    pub insecure: Option<Spanned<bool>>,
}

/// `tracing:`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawTracing {
    /// Span export over OTLP/HTTP.
    pub otlp: Option<Spanned<RawOtlp>>,
}

/// `tracing.otlp:`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawOtlp {
    /// The collector's traces URL, `http://host:port/v1/traces`.
    pub endpoint: Spanned<String>,
    /// The fraction of allowed requests exported, in [0, 1].
    pub sample_ratio: Option<Spanned<f64>>,
    /// Follow the incoming `traceparent`'s sampled flag for allowed requests.
    pub parent_based: Option<bool>,
    /// `service.name` of the exported resource.
    pub service_name: Option<Spanned<String>>,
    /// Deadline of one export request.
    pub timeout: Option<Spanned<String>>,
    /// Finished spans waiting for export at most; more are dropped (and counted).
    pub queue_size: Option<Spanned<usize>>,
    /// Request headers sent to the collector, each value read from the environment variable
    /// named here (`authorization: OTLP_AUTH`): a credential never sits in the file.
    #[serde(default)]
    pub headers_env: std::collections::BTreeMap<String, Spanned<String>>,
}
