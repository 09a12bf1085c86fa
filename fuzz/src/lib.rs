//! The fuzz checks: each takes arbitrary bytes, feeds them to tollgate, and panics when a
//! property fails. The fuzz targets in `fuzz_targets/` call them; `tests/fuzz_regressions.rs` in
//! the main crate includes this file and replays the saved inputs in `regressions/<target>/`.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::Path;
use std::sync::{Arc, OnceLock};

use http::{HeaderMap, HeaderName, HeaderValue, Method};
use tollgate::config::raw::{RawGateway, RawKeys};
use tollgate::config::{parse_str, EnvOverrides, GatewayConfig, IdentityConfig};
use tollgate::identity::jwt::JwtKeys;
use tollgate::identity::{client_ip, collapse, identify, IdentityKind, KeyRegistry};
use tollgate::rules::{normalize, Pattern, PatternClass, RequestInfo, RuleSet};

/// The HMAC secret of the fuzzed JWT verifier (set in the process environment once).
pub const JWT_SECRET: &str = "tollgate-fuzz-secret-0123456789";
/// Env var carrying [`JWT_SECRET`].
const JWT_SECRET_ENV: &str = "TOLLGATE_FUZZ_JWT_SECRET";
/// The one registered API key of the fuzzed registry.
pub const API_KEY: &str = "fuzz-api-key";
/// Issuer and audience the verifier requires.
pub const ISSUER: &str = "https://auth.example.com";
/// Audience the verifier requires.
pub const AUDIENCE: &str = "api";
/// Clock leeway of the verifier, seconds.
pub const LEEWAY: u64 = 30;

/// A gateway config compiled from `identity_yaml` (no file is read: the paths do not exist).
fn compile_gateway(identity_yaml: &str) -> GatewayConfig {
    let p = Path::new("/nonexistent-tollgate-fuzz/gateway.yaml");
    let yaml = format!("upstream: {{ url: http://127.0.0.1:1 }}\nidentity:\n{identity_yaml}");
    let raw: RawGateway = parse_str(p, &yaml).unwrap_or_else(|e| panic!("fixture config: {e}"));
    GatewayConfig::compile(p, raw, &EnvOverrides::default()).unwrap_or_else(|e| panic!("fixture config: {e}"))
}

/// The HS256 verifier every JWT check uses.
pub fn verifier() -> &'static Arc<JwtKeys> {
    static V: OnceLock<Arc<JwtKeys>> = OnceLock::new();
    V.get_or_init(|| {
        std::env::set_var(JWT_SECRET_ENV, JWT_SECRET);
        let cfg = compile_gateway(&format!(
            "  jwt:\n    algorithms: [HS256, HS384]\n    secret_env: {JWT_SECRET_ENV}\n    issuer: {ISSUER}\n    audience: {AUDIENCE}\n    leeway: {LEEWAY}s\n"
        ));
        match cfg.identity.jwt {
            Some(j) => j,
            None => panic!("fixture config has no jwt"),
        }
    })
}

/// Identity configs: without and with trusted proxies and JWT.
fn identity_configs() -> &'static [IdentityConfig; 2] {
    static C: OnceLock<[IdentityConfig; 2]> = OnceLock::new();
    C.get_or_init(|| {
        let plain = compile_gateway("  ipv6_prefix: 64\n").identity;
        let mut trusting = compile_gateway(
            "  trusted_proxies: [127.0.0.0/8, \"::1/128\", 10.0.0.0/8, \"fd00::/8\"]\n  ipv6_prefix: 64\n",
        )
        .identity;
        trusting.jwt = Some(verifier().clone());
        [plain, trusting]
    })
}

fn registry() -> &'static KeyRegistry {
    static K: OnceLock<KeyRegistry> = OnceLock::new();
    K.get_or_init(|| {
        let p = Path::new("keys.yaml");
        let yaml = format!(
            "keys:\n  - {{ id: cust_1, sha256: {}, tier: pro, org: acme }}\n",
            tollgate::identity::keys::hash_key(API_KEY)
        );
        let raw: RawKeys = parse_str(p, &yaml).unwrap_or_else(|e| panic!("fixture keys: {e}"));
        KeyRegistry::compile(p, raw).unwrap_or_else(|e| panic!("fixture keys: {e}"))
    })
}

/// A few requests every compiled rule set is matched against.
fn probe_rules(set: &RuleSet) {
    let mut h = HeaderMap::new();
    h.insert("x-beta", HeaderValue::from_static("1"));
    h.insert("x-client", HeaderValue::from_static("c1"));
    for (m, p) in [
        (Method::GET, "/"),
        (Method::POST, "/api/v1/login"),
        (Method::GET, "/api/v1/users/42/x"),
        (Method::PUT, "/a/b/c/d/e/f"),
    ] {
        for tier in ["anonymous", "free", "pro"] {
            let info = RequestInfo {
                method: &m,
                method_override: None,
                path: p,
                host: Some("api.example"),
                headers: &h,
                tier,
            };
            let chosen = set.select(&info);
            assert!(chosen.len() <= set.kinds.len(), "more chosen rules than key kinds");
            for &i in &chosen {
                let r = &set.rules[i as usize];
                assert!(
                    r.pattern.matches(p),
                    "rule {} chosen for {p} but its pattern does not match",
                    r.name
                );
            }
            let _ = set.explain(&info);
        }
    }
}

/// `config`: the first byte picks rules.yaml (even) or gateway.yaml (odd); the rest is the file.
/// Parsing and validation must return `Ok` or a positioned error, never panic; a rule set that
/// loads must match requests without panicking.
pub fn config(data: &[u8]) {
    let Some((&sel, rest)) = data.split_first() else { return };
    let Ok(text) = std::str::from_utf8(rest) else { return };
    if sel & 1 == 0 {
        match RuleSet::from_str(Path::new("rules.yaml"), text) {
            Ok(set) => {
                for r in &set.rules {
                    assert!(!r.limits.is_empty(), "rule {} has no limits", r.name);
                }
                probe_rules(&set);
            }
            Err(e) => {
                let _ = e.to_string();
            }
        }
    } else {
        let p = Path::new("/nonexistent-tollgate-fuzz/gateway.yaml");
        match parse_str::<RawGateway>(p, text) {
            Ok(raw) => {
                if let Err(e) = GatewayConfig::compile(p, raw, &EnvOverrides::default()) {
                    let _ = e.to_string();
                }
            }
            Err(e) => {
                let _ = e.to_string();
            }
        }
    }
}

/// Properties of a normalised path: starts with '/', no empty or dot segment, no `;`, no
/// trailing slash (but "/"), and a fixed point of [`normalize`].
pub fn assert_normal(input: &str, n: &str) {
    assert!(n.starts_with('/'), "{input:?} -> {n:?}: no leading '/'");
    assert!(!n.contains("//"), "{input:?} -> {n:?}: empty segment");
    assert!(!n.contains(';'), "{input:?} -> {n:?}: ';' params kept");
    assert!(n == "/" || !n.ends_with('/'), "{input:?} -> {n:?}: trailing slash");
    for seg in n.split('/').skip(1) {
        assert!(seg != "." && seg != "..", "{input:?} -> {n:?}: dot segment");
    }
    let again = normalize(n);
    assert_eq!(again, n, "normalize is not idempotent: {input:?} -> {n:?} -> {again:?}");
}

fn is_unreserved(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_' | '~')
}

/// Re-spell a normalised path the ways a client might to dodge a rule: `//`, `/./`,
/// `/x/../`, `;params`, percent-encoded unreserved characters (either hex case), and a
/// trailing slash. `noise` drives the choices.
pub fn respell(n: &str, noise: &[u8]) -> String {
    let mut k = 0usize;
    let mut next = || {
        let b = noise.get(k % noise.len().max(1)).copied().unwrap_or(0);
        k += 1;
        b.wrapping_add((k as u8).wrapping_mul(31))
    };
    let mut out = String::new();
    for seg in n.split('/').skip(1).filter(|s| !s.is_empty()) {
        match next() % 5 {
            0 => out.push_str("//"),
            1 => out.push_str("/./"),
            2 => out.push_str("/zz/../"),
            _ => out.push('/'),
        }
        // The two characters after a '%' belong to its escape: re-spelling them changes the path.
        let mut skip = 0u8;
        for c in seg.chars() {
            let in_escape = skip > 0 || c == '%';
            skip = if c == '%' { 2 } else { skip.saturating_sub(1) };
            if !in_escape && is_unreserved(c) && next() % 3 == 0 {
                let hex = format!("%{:02X}", c as u32);
                out.push_str(&if next() & 1 == 0 { hex.to_ascii_lowercase() } else { hex });
            } else {
                out.push(c);
            }
        }
        if next() % 4 == 0 {
            out.push_str(";jsessionid=1");
        }
    }
    if next() & 1 == 0 {
        out.push('/');
    }
    if out.is_empty() {
        out.push('/');
    }
    out
}

/// `path`: `pattern \n path`. The normaliser's output is normal and stable, every re-spelling of
/// a path normalises to the same path (no spelling dodges a rule), and an exact pattern
/// matches exactly its own path.
pub fn path(data: &[u8]) {
    let Ok(s) = std::str::from_utf8(data) else { return };
    let (pat, path) = s.split_once('\n').unwrap_or((s, s));
    let n = normalize(path);
    assert_normal(path, &n);
    let re = respell(&n, data);
    let n2 = normalize(&re);
    assert_eq!(n2, n, "re-spelling {re:?} of {path:?} normalises differently");
    if let Ok(p) = Pattern::parse(pat) {
        let m = p.matches(&n);
        if p.class == PatternClass::Exact {
            assert_eq!(m, *n == *p.source, "exact pattern {pat:?} vs {n:?}");
        }
        if p.class == PatternClass::Prefix && pat == "/**" {
            assert!(m, "/** must match {n:?}");
        }
    }
}

/// Peers the identity check can take.
fn peer(b: u8) -> IpAddr {
    match b % 6 {
        0 => IpAddr::V4(Ipv4Addr::new(127, 0, 0, 1)),
        1 => IpAddr::V4(Ipv4Addr::new(203, 0, 113, 9)),
        2 => IpAddr::V6(Ipv6Addr::LOCALHOST),
        3 => IpAddr::V6(Ipv6Addr::new(0x2001, 0xdb8, 1, 2, 3, 4, 5, 6)),
        4 => IpAddr::V6(Ipv4Addr::new(10, 1, 2, 3).to_ipv6_mapped()),
        _ => IpAddr::V6(Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 1)),
    }
}

/// `identity`: byte 0 picks the peer and the config, byte 1 `max_forwarded_entries`, the rest
/// is header values split on `\n`, assigned in turn to X-Forwarded-For, X-API-Key,
/// Authorization. Whatever the bytes: no panic, an untrusted peer's X-Forwarded-For is ignored,
/// IPv6 is collapsed to /64, IPv4-mapped is IPv4, an unknown key or bad token is no identity,
/// and the upstream sees the real peer as the last X-Forwarded-For entry.
pub fn identity(data: &[u8]) {
    if data.len() < 2 {
        return;
    }
    let (sel, max, rest) = (data[0], data[1], &data[2..]);
    let peer = peer(sel);
    let mut cfg = identity_configs()[usize::from(sel / 6 % 2)].clone();
    cfg.max_forwarded_entries = usize::from(max % 40).max(1);
    let names = [
        HeaderName::from_static("x-forwarded-for"),
        HeaderName::from_static("x-api-key"),
        http::header::AUTHORIZATION,
    ];
    let mut h = HeaderMap::new();
    for (i, v) in rest.split(|&b| b == b'\n').enumerate().take(64) {
        if let Ok(v) = HeaderValue::from_bytes(v) {
            h.append(names[i % names.len()].clone(), v);
        }
    }
    let ip = client_ip(&h, peer, &cfg);
    let trusted = cfg.trusted_proxies.iter().any(|n| n.contains(&peer.to_canonical()));
    if !trusted {
        assert_eq!(
            ip,
            collapse(peer, 64),
            "an untrusted peer's X-Forwarded-For was believed"
        );
    }
    if let IpAddr::V6(v6) = ip {
        assert_eq!(
            u128::from(v6) & ((1u128 << 64) - 1),
            0,
            "IPv6 {v6} not collapsed to /64"
        );
        assert!(v6.to_ipv4_mapped().is_none(), "IPv4-mapped {v6} not canonical");
    }
    let id = identify(&h, peer, registry(), &cfg, 1_800_000_000);
    assert_eq!(id.ip, ip);
    match id.kind {
        IdentityKind::Ip => assert_eq!(&*id.id, ip.to_string()),
        IdentityKind::ApiKey => {
            assert!(
                h.get("x-api-key").is_some_and(|v| v.as_bytes() == API_KEY.as_bytes()),
                "unknown API key accepted"
            );
            assert_eq!(&*id.id, "cust_1");
        }
        IdentityKind::Jwt => {
            let v = h
                .get(http::header::AUTHORIZATION)
                .map(|v| v.as_bytes().to_vec())
                .unwrap_or_default();
            assert!(
                v.starts_with(b"Bearer ") || v.starts_with(b"bearer "),
                "JWT identity without a bearer header"
            );
        }
    }
    let mut fwd = h.clone();
    tollgate::http::forward::add_forwarded(&mut fwd, peer, None);
    let xff = fwd.get("x-forwarded-for").and_then(|v| v.to_str().ok()).unwrap_or("");
    let last = xff.rsplit(',').next().unwrap_or("").trim();
    assert_eq!(
        last,
        peer.to_canonical().to_string(),
        "upstream X-Forwarded-For does not end with the peer"
    );
}

/// `jwt`: byte 0 picks the mode. Even: the rest is a token string verified as is. Odd: byte 1
/// picks the algorithm and the rest is a claims object signed with the real secret, so the
/// claim checks (exp, nbf, iss, aud, user/tier/org claim types) are exercised. A token that
/// verifies has a current `exp`, the right `iss` and `aud`, and a short non-empty user.
pub fn jwt(data: &[u8]) {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let now = 1_800_000_000u64;
    let v = verifier();
    let (token, claims) = if mode & 1 == 0 {
        let Ok(s) = std::str::from_utf8(rest) else { return };
        (s.to_string(), None)
    } else {
        let Some((&alg, body)) = rest.split_first() else { return };
        let Ok(claims) = serde_json::from_slice::<serde_json::Map<String, serde_json::Value>>(body) else {
            return;
        };
        let alg = match alg % 4 {
            0 => jsonwebtoken::Algorithm::HS256,
            1 => jsonwebtoken::Algorithm::HS384,
            2 => jsonwebtoken::Algorithm::HS512,
            _ => jsonwebtoken::Algorithm::HS256,
        };
        let mut header = jsonwebtoken::Header::new(alg);
        if mode & 2 != 0 {
            header.kid = Some("k1".into());
        }
        let Ok(key) = jsonwebtoken::EncodingKey::from_secret(JWT_SECRET.as_bytes()) else {
            return;
        };
        let Ok(t) = jsonwebtoken::encode(&header, &claims, &key) else {
            return;
        };
        if alg == jsonwebtoken::Algorithm::HS512 {
            assert!(
                v.verify(&t, now).is_none(),
                "HS512 token accepted though only HS256/HS384 are configured"
            );
            return;
        }
        (t, Some(claims))
    };
    let got = v.verify(&token, now);
    if let Some(c) = &got {
        assert!(!c.user.is_empty() && c.user.len() <= 256, "user claim {:?}", c.user);
        let claims = match claims {
            Some(c) => c,
            // A token given as is verified: it must carry a signature made with the secret.
            None => signed_claims(&token)
                .unwrap_or_else(|| panic!("a token not signed with the secret verified: {token:?}")),
        };
        // A NumericDate may be fractional: exp counts as its floor, nbf as its ceiling.
        let exp = claims.get("exp").and_then(|e| e.as_f64());
        assert!(
            exp.is_some_and(|e| now as f64 <= e.floor() + LEEWAY as f64),
            "accepted exp {:?}",
            claims.get("exp")
        );
        if let Some(nbf) = claims.get("nbf") {
            assert!(
                nbf.as_f64().is_some_and(|n| n.ceil() <= (now + LEEWAY) as f64),
                "accepted nbf {nbf}"
            );
        }
        assert_eq!(claims.get("iss").and_then(|i| i.as_str()), Some(ISSUER));
        let aud_ok = match claims.get("aud") {
            Some(serde_json::Value::String(a)) => a == AUDIENCE,
            Some(serde_json::Value::Array(a)) => a.iter().any(|x| x.as_str() == Some(AUDIENCE)),
            _ => false,
        };
        assert!(aud_ok, "accepted aud {:?}", claims.get("aud"));
    }
    let mut h = HeaderMap::new();
    if let Ok(hv) = HeaderValue::from_str(&format!("Bearer {token}")) {
        h.insert(http::header::AUTHORIZATION, hv);
        assert_eq!(
            v.verify_headers(&h, now).is_ok_and(|c| c.is_some()),
            got.is_some(),
            "header and direct verification disagree"
        );
    }
}

/// The claims of `token` if it is signed with [`JWT_SECRET`] (HS256/HS384), nothing else checked.
fn signed_claims(token: &str) -> Option<serde_json::Map<String, serde_json::Value>> {
    let key = jsonwebtoken::DecodingKey::from_secret(JWT_SECRET.as_bytes()).ok()?;
    let mut v = jsonwebtoken::Validation::new(jsonwebtoken::Algorithm::HS256);
    v.algorithms = vec![jsonwebtoken::Algorithm::HS256, jsonwebtoken::Algorithm::HS384];
    v.validate_exp = false;
    v.validate_nbf = false;
    v.validate_aud = false;
    v.required_spec_claims.clear();
    jsonwebtoken::decode::<serde_json::Map<String, serde_json::Value>>(token, &key, &v)
        .ok()
        .map(|d| d.claims)
}
