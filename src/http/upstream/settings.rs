//! What `upstream:` compiles to: the targets, their protocol, TLS and health check, the
//! timeouts and caps. Owned here, composed by `config` (ARCHITECTURE.md, "Layering").

use std::time::Duration;

use super::super::tls::UpstreamTls;

/// `upstream.protocol`: what the connections to the targets speak.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum UpstreamProtocol {
    /// HTTP/1.1, one request at a time per pooled connection (the default).
    #[default]
    Http1,
    /// HTTP/2 without TLS (prior knowledge), on `http://` targets: a few shared connections
    /// carry many concurrent streams.
    H2c,
    /// HTTP/2 over TLS, agreed by ALPN, on `https://` targets; a target that does not agree to
    /// `h2` fails the connection.
    H2,
    /// Whatever ALPN agrees on `https://` targets (h2 preferred, else HTTP/1.1); HTTP/1.1 on
    /// `http://` targets.
    Auto,
}

impl UpstreamProtocol {
    /// The name used in the config.
    pub fn as_str(self) -> &'static str {
        match self {
            UpstreamProtocol::Http1 => "http1",
            UpstreamProtocol::H2c => "h2c",
            UpstreamProtocol::H2 => "h2",
            UpstreamProtocol::Auto => "auto",
        }
    }
}

/// One upstream instance.
#[derive(Debug, Clone)]
pub struct Target {
    /// `http(s)://host:port` as configured (no path).
    pub url: http::Uri,
    /// `https://`.
    pub tls: bool,
    /// The host, without brackets: the SNI name (or IP) of a TLS target.
    pub host: String,
    /// `host:port` to connect to (the default port filled in).
    pub addr: String,
}

impl Target {
    /// A plain-HTTP target at `addr` (the demo's echo upstream).
    pub fn plain(addr: std::net::SocketAddr) -> Self {
        let url = http::Uri::builder()
            .scheme("http")
            .authority(addr.to_string())
            .path_and_query("/")
            .build()
            .unwrap_or_default();
        Target {
            url,
            tls: false,
            host: addr.ip().to_string(),
            addr: addr.to_string(),
        }
    }
}

/// `upstream.health_check:`, validated.
#[derive(Debug, Clone)]
pub struct HealthCheck {
    /// Path asked with `GET`.
    pub path: http::uri::PathAndQuery,
    /// Period.
    pub interval: Duration,
    /// Deadline of one check.
    pub timeout: Duration,
}

/// `upstream:`, validated.
#[derive(Debug, Clone)]
pub struct UpstreamConfig {
    /// The first target's `http(s)://host:port` (no path), for logs and summaries.
    pub url: http::Uri,
    /// Scheme of `url`.
    pub scheme: http::uri::Scheme,
    /// Authority of `url`.
    pub authority: http::uri::Authority,
    /// Every instance of the upstream (`upstream.url` is one target); at least one.
    pub targets: Vec<Target>,
    /// What the connections to the targets speak (`upstream.protocol`).
    pub protocol: UpstreamProtocol,
    /// TLS to `https://` targets.
    pub tls: UpstreamTls,
    /// Consecutive failures (connect errors, 5xx answers) that eject a target.
    pub eject_after: u32,
    /// How long an ejected target first stays out; doubled each time it fails again on return.
    pub eject_for: Duration,
    /// Optional active health check of every target.
    pub health_check: Option<HealthCheck>,
    /// TCP connect timeout.
    pub connect_timeout: Duration,
    /// Deadline for response headers; past it the client gets 504.
    pub request_timeout: Duration,
    /// Idle pooled connections per host.
    pub pool_max_idle_per_host: usize,
    /// Open connections to one target at most (`upstream.max_connections_per_target`). A
    /// request that needs a new connection while its target is at the cap waits up to
    /// `connect_timeout` for a pooled one to come free or a connection to close, then gets 503.
    pub max_connections_per_target: usize,
}
