//! Who is calling: a pure function from request headers and the peer address to an
//! [`Identity`]. No I/O; the key registry and JWT keys are loaded beforehand.
//!
//! Exactly one identity per request, strongest first: a valid JWT, else a registered API key,
//! else the client IP. An invalid token or an unknown key is *not* an identity (otherwise a
//! client could mint fresh credentials to reset its quota): with `invalid_credentials: reject`
//! (the default) the request is refused with a 401 ([`CredentialProblem::Invalid`]); with
//! `invalid_credentials: ip` it falls through to the next kind. A credential header sent twice,
//! or an API key header holding a list, is ambiguous and always refused (400).

pub mod jwt;
mod keyfile;
pub mod keys;
pub mod raw;

use std::net::{IpAddr, Ipv6Addr};
use std::sync::Arc;

use http::{HeaderMap, HeaderName};
use ipnet::IpNet;

use jwt::JwtKeys;
pub use keys::KeyRegistry;

/// `identity:`, validated.
#[derive(Debug, Clone)]
pub struct IdentityConfig {
    /// Header carrying the API key.
    pub api_key_header: HeaderName,
    /// JWT verification, if configured.
    pub jwt: Option<std::sync::Arc<JwtKeys>>,
    /// Peers whose X-Forwarded-For is believed.
    pub trusted_proxies: Vec<IpNet>,
    /// IPv6 addresses collapse to this prefix.
    pub ipv6_prefix: u8,
    /// At most this many X-Forwarded-For entries are read, from the right.
    pub max_forwarded_entries: usize,
    /// What a present credential that identifies no one gets.
    pub invalid_credentials: InvalidCredentials,
}

/// `identity.invalid_credentials`: what a request whose credential is present but does not
/// identify anyone (an unknown API key, a JWT that does not verify or has expired) gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum InvalidCredentials {
    /// Refused with a 401 before any limit is checked (the default).
    #[default]
    Reject,
    /// Identified by the client IP, as if it had sent no credential.
    Ip,
}

/// Why a request's credentials were refused before any limit was checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CredentialProblem {
    /// A credential header sent twice, or an API key header holding a list: which one the
    /// upstream would read is unknown, so neither is believed (400).
    Ambiguous(&'static str),
    /// A credential that is present but identifies no one, under
    /// `invalid_credentials: reject` (401). The credential itself is never echoed.
    Invalid,
}

/// Which credential identified the caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum IdentityKind {
    /// A verified JWT.
    Jwt,
    /// A registered API key.
    ApiKey,
    /// Only the client IP.
    Ip,
}

impl IdentityKind {
    /// Lower-case name for logs and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            IdentityKind::Jwt => "jwt",
            IdentityKind::ApiKey => "api_key",
            IdentityKind::Ip => "ip",
        }
    }
}

/// The tier of callers that have none.
pub const ANONYMOUS: &str = "anonymous";

/// [`ANONYMOUS`] as a shared string, so an anonymous request allocates no tier.
static ANONYMOUS_TIER: std::sync::LazyLock<Arc<str>> = std::sync::LazyLock::new(|| Arc::from(ANONYMOUS));

/// The caller of one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    /// Which credential identified it.
    pub kind: IdentityKind,
    /// JWT user, API key id, or the client IP (collapsed) as text. Never a secret.
    pub id: IdText,
    /// Tier from the token or key registry; [`ANONYMOUS`] otherwise.
    pub tier: Arc<str>,
    /// Org, when the token or key names one.
    pub org: Option<Arc<str>>,
    /// The client IP, IPv6 collapsed to its prefix, IPv4-mapped IPv6 as IPv4.
    pub ip: IpAddr,
}

/// Identify the caller. `now_secs` is the Unix time used for JWT `exp`/`nbf`. A request whose
/// credentials are refused ([`identify_checked`]) is identified by its IP here.
pub fn identify(
    headers: &HeaderMap,
    peer: IpAddr,
    keys: &KeyRegistry,
    cfg: &IdentityConfig,
    now_secs: u64,
) -> Identity {
    identify_checked(headers, peer, keys, cfg, now_secs).0
}

/// Identify the caller, and say whether its credentials must be refused. When the second value
/// is `Some`, the request must not be checked against any limit or forwarded: it is answered
/// with that problem (the identity is then the client IP, for logs only).
pub fn identify_checked(
    headers: &HeaderMap,
    peer: IpAddr,
    keys: &KeyRegistry,
    cfg: &IdentityConfig,
    now_secs: u64,
) -> (Identity, Option<CredentialProblem>) {
    let ip = client_ip(headers, peer, cfg);
    let by_ip = || Identity {
        kind: IdentityKind::Ip,
        id: ip_text(ip),
        tier: ANONYMOUS_TIER.clone(),
        org: None,
        ip,
    };
    let reject = cfg.invalid_credentials == InvalidCredentials::Reject;
    // The API key, checked for ambiguity before anything else identifies the caller.
    let mut key_fields = headers.get_all(&cfg.api_key_header).iter();
    let key_value = key_fields.next().map(|v| v.as_bytes()).filter(|v| !v.is_empty());
    if key_fields.next().is_some() {
        return (
            by_ip(),
            Some(CredentialProblem::Ambiguous("more than one API key header field")),
        );
    }
    let key = key_value.map(|v| (v, keys.lookup(v)));
    if let Some((v, None)) = key {
        if v.contains(&b',') {
            return (
                by_ip(),
                Some(CredentialProblem::Ambiguous("an API key header holding a list")),
            );
        }
    }
    if let Some(jwt) = &cfg.jwt {
        match jwt.verify_headers(headers, now_secs) {
            Ok(Some(c)) => {
                let id = Identity {
                    kind: IdentityKind::Jwt,
                    id: IdText::Shared(c.user),
                    tier: c.tier.unwrap_or_else(|| ANONYMOUS_TIER.clone()),
                    org: c.org,
                    ip,
                };
                return (id, None);
            }
            Ok(None) => {}
            Err(p @ CredentialProblem::Ambiguous(_)) => return (by_ip(), Some(p)),
            Err(CredentialProblem::Invalid) if reject => return (by_ip(), Some(CredentialProblem::Invalid)),
            Err(CredentialProblem::Invalid) => {}
        }
    }
    match key {
        Some((_, Some(k))) => {
            let id = Identity {
                kind: IdentityKind::ApiKey,
                id: IdText::Shared(k.id.clone()),
                tier: k.tier.clone(),
                org: k.org.clone(),
                ip,
            };
            (id, None)
        }
        Some((_, None)) if reject => (by_ip(), Some(CredentialProblem::Invalid)),
        _ => (by_ip(), None),
    }
}

/// The IP as text, written inline: no allocation per request.
pub fn ip_text(ip: IpAddr) -> IdText {
    let mut t = IpText {
        len: 0,
        buf: [0; IP_TEXT_MAX],
    };
    write_ip(&mut t, ip);
    IdText::Ip(t)
}

/// Longest text of an address (`INET6_ADDRSTRLEN` less the terminating zero).
const IP_TEXT_MAX: usize = 45;

/// An address as text, inline.
#[derive(Clone, Copy)]
pub struct IpText {
    /// Bytes used.
    len: u8,
    /// The text (ASCII).
    buf: [u8; IP_TEXT_MAX],
}

impl IpText {
    /// The text's bytes (ASCII), without the UTF-8 check [`IpText::as_str`] makes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.buf[..usize::from(self.len)]
    }

    /// The text.
    pub fn as_str(&self) -> &str {
        // Only `write_ip`'s ASCII is ever written.
        std::str::from_utf8(&self.buf[..usize::from(self.len)]).unwrap_or_default()
    }
}

impl std::fmt::Write for IpText {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        let at = usize::from(self.len);
        let end = at + s.len();
        if end > IP_TEXT_MAX {
            return Err(std::fmt::Error);
        }
        self.buf[at..end].copy_from_slice(s.as_bytes());
        self.len = end as u8;
        Ok(())
    }
}

/// An [`Identity`]'s id: shared text (a JWT user, a registered key id) or a client address
/// kept inline, so an anonymous request allocates no id. Reads as `&str`.
#[derive(Clone)]
pub enum IdText {
    /// Text shared with the token's claims or the key registry.
    Shared(Arc<str>),
    /// A client address.
    Ip(IpText),
}

impl IdText {
    /// The id's bytes (for hashing), without the UTF-8 check reading it as `&str` makes.
    pub fn as_bytes(&self) -> &[u8] {
        match self {
            IdText::Shared(s) => s.as_bytes(),
            IdText::Ip(t) => t.as_bytes(),
        }
    }

    /// The id as text.
    pub fn as_str(&self) -> &str {
        match self {
            IdText::Shared(s) => s,
            IdText::Ip(t) => t.as_str(),
        }
    }
}

impl std::ops::Deref for IdText {
    type Target = str;
    fn deref(&self) -> &str {
        self.as_str()
    }
}

impl From<&str> for IdText {
    fn from(s: &str) -> Self {
        IdText::Shared(Arc::from(s))
    }
}

impl From<Arc<str>> for IdText {
    fn from(s: Arc<str>) -> Self {
        IdText::Shared(s)
    }
}

impl PartialEq for IdText {
    fn eq(&self, other: &Self) -> bool {
        self.as_str() == other.as_str()
    }
}

impl Eq for IdText {}

impl std::fmt::Display for IdText {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::fmt::Debug for IdText {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(self.as_str(), f)
    }
}

/// Append `ip` as text. IPv4 (the common case) skips `core::fmt` (its cost per address is in
/// docs/performance.md); IPv6 uses `Display` (RFC 5952 form).
pub fn write_ip(out: &mut impl std::fmt::Write, ip: IpAddr) {
    match ip {
        IpAddr::V4(v4) => {
            let mut buf = itoa::Buffer::new();
            for (i, octet) in v4.octets().iter().enumerate() {
                if i > 0 {
                    let _ = out.write_char('.');
                }
                let _ = out.write_str(buf.format(*octet));
            }
        }
        IpAddr::V6(_) => {
            let _ = write!(out, "{ip}");
        }
    }
}

fn trusted(ip: IpAddr, nets: &[IpNet]) -> bool {
    nets.iter().any(|n| n.contains(&ip))
}

/// Parse one X-Forwarded-For entry: `ip`, `ip:port`, `[v6]` or `[v6]:port`.
fn parse_forwarded(entry: &str) -> Option<IpAddr> {
    let e = entry.trim();
    if let Ok(ip) = e.parse::<IpAddr>() {
        return Some(ip);
    }
    if let Some(rest) = e.strip_prefix('[') {
        let end = rest.find(']')?;
        return rest[..end].parse().ok();
    }
    let (host, port) = e.rsplit_once(':')?;
    if port.bytes().all(|b| b.is_ascii_digit()) {
        return host.parse::<std::net::Ipv4Addr>().ok().map(IpAddr::V4);
    }
    None
}

/// The client IP: the peer, or with trusted proxies the right-most X-Forwarded-For entry that is
/// not a trusted proxy (at most `max_forwarded_entries` entries are read). Garbage in the part
/// of the header that is read falls back to the peer address. Always collapsed.
pub fn client_ip(headers: &HeaderMap, peer: IpAddr, cfg: &IdentityConfig) -> IpAddr {
    let peer = peer.to_canonical();
    let mut client = peer;
    if !cfg.trusted_proxies.is_empty() && trusted(peer, &cfg.trusted_proxies) {
        let mut read = 0usize;
        'outer: for value in headers.get_all("x-forwarded-for").iter().rev() {
            // Split the raw bytes: non-ASCII a client put to the left of the entries its proxies
            // appended must not hide them (it only matters if reached: garbage, below).
            for entry in value.as_bytes().rsplit(|&b| b == b',') {
                let Ok(entry) = std::str::from_utf8(entry) else {
                    client = peer;
                    break 'outer;
                };
                if entry.trim().is_empty() {
                    continue;
                }
                read += 1;
                if read > cfg.max_forwarded_entries {
                    break 'outer;
                }
                match parse_forwarded(entry) {
                    Some(ip) => {
                        client = ip.to_canonical();
                        if !trusted(client, &cfg.trusted_proxies) {
                            break 'outer;
                        }
                    }
                    None => {
                        client = peer;
                        break 'outer;
                    }
                }
            }
        }
    }
    collapse(client, cfg.ipv6_prefix)
}

/// IPv4-mapped IPv6 becomes IPv4; other IPv6 is masked to `/prefix`.
pub fn collapse(ip: IpAddr, prefix: u8) -> IpAddr {
    match ip.to_canonical() {
        IpAddr::V4(v4) => IpAddr::V4(v4),
        IpAddr::V6(v6) => {
            let bits = u128::from(v6);
            let p = u32::from(prefix.min(128));
            let mask = if p == 0 { 0 } else { u128::MAX << (128 - p) };
            IpAddr::V6(Ipv6Addr::from(bits & mask))
        }
    }
}

#[cfg(test)]
mod tests;
