//! Table-driven identity tests: spoofed X-Forwarded-For, IPv6 rotation, every JWT attack.

use std::net::IpAddr;
use std::path::Path;

use http::{HeaderMap, HeaderValue};
use jsonwebtoken::{encode, Algorithm, EncodingKey, Header};
use serde_json::json;

use super::*;
use crate::config::{parse_str, raw::RawGateway, EnvOverrides, GatewayConfig};

const NOW: u64 = 1_800_000_000;
const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/jwt");

fn config(identity_yaml: &str) -> IdentityConfig {
    let yaml = format!("upstream: {{ url: http://127.0.0.1:1 }}\nidentity:\n{identity_yaml}");
    let path = Path::new(FIXTURES).join("gateway.yaml");
    let raw: RawGateway = parse_str(&path, &yaml).unwrap();
    GatewayConfig::compile(&path, raw, &EnvOverrides::default())
        .unwrap()
        .identity
}

fn rs_config() -> IdentityConfig {
    config(
        "  trusted_proxies: [10.0.0.0/8]\n  jwt:\n    algorithms: [RS256]\n    public_key_file: rsa_public.pem\n    issuer: https://auth.example.com\n    audience: api\n    leeway: 30s\n",
    )
}

fn rsa_key() -> EncodingKey {
    EncodingKey::from_rsa_pem(&std::fs::read(format!("{FIXTURES}/rsa_private.pem")).unwrap()).unwrap()
}

fn claims(exp_offset: i64) -> serde_json::Value {
    json!({
        "sub": "alice", "tier": "pro", "org": "acme",
        "iss": "https://auth.example.com", "aud": "api",
        "exp": (NOW as i64 + exp_offset) as u64, "nbf": NOW - 10,
    })
}

fn bearer(token: &str) -> HeaderMap {
    let mut h = HeaderMap::new();
    h.insert(
        "authorization",
        HeaderValue::from_str(&format!("Bearer {token}")).unwrap(),
    );
    h
}

fn peer() -> IpAddr {
    "203.0.113.7".parse().unwrap()
}

fn who(h: &HeaderMap, cfg: &IdentityConfig) -> Identity {
    identify(h, peer(), &KeyRegistry::empty(), cfg, NOW)
}

#[test]
fn valid_rs256_token_identifies_the_user() {
    let cfg = rs_config();
    let t = encode(&Header::new(Algorithm::RS256), &claims(600), &rsa_key()).unwrap();
    let id = who(&bearer(&t), &cfg);
    assert_eq!(id.kind, IdentityKind::Jwt);
    assert_eq!(&*id.id, "alice");
    assert_eq!(&*id.tier, "pro");
    assert_eq!(id.org.as_deref(), Some("acme"));
}

#[test]
fn jwt_attacks_yield_no_identity() {
    let cfg = rs_config();
    let b64 = |v: &serde_json::Value| {
        use base64_like::encode_url;
        encode_url(v.to_string().as_bytes())
    };
    let good = encode(&Header::new(Algorithm::RS256), &claims(600), &rsa_key()).unwrap();
    let parts: Vec<&str> = good.split('.').collect();
    let none_token = format!("{}.{}.", b64(&json!({"alg": "none", "typ": "JWT"})), parts[1]);
    // HS/RS confusion: HMAC-signed with the RSA *public* key as the secret.
    let public_pem = std::fs::read(format!("{FIXTURES}/rsa_public.pem")).unwrap();
    let confused = encode(
        &Header::new(Algorithm::HS256),
        &claims(600),
        &EncodingKey::from_secret(&public_pem).unwrap(),
    )
    .unwrap();
    let expired = encode(&Header::new(Algorithm::RS256), &claims(-3600), &rsa_key()).unwrap();
    let bad_sig = format!(
        "{}.{}.{}",
        parts[0],
        parts[1],
        parts[2].chars().rev().collect::<String>()
    );
    let mut future = claims(600);
    future["nbf"] = json!(NOW + 3600);
    let not_yet = encode(&Header::new(Algorithm::RS256), &future, &rsa_key()).unwrap();
    let mut wrong_iss = claims(600);
    wrong_iss["iss"] = json!("https://evil.example");
    let wrong_iss = encode(&Header::new(Algorithm::RS256), &wrong_iss, &rsa_key()).unwrap();
    let mut wrong_aud = claims(600);
    wrong_aud["aud"] = json!("other");
    let wrong_aud = encode(&Header::new(Algorithm::RS256), &wrong_aud, &rsa_key()).unwrap();
    let huge = "a".repeat(30_000);
    let cases = [
        ("alg none", none_token),
        ("HS/RS confusion", confused),
        ("expired", expired),
        ("bad signature", bad_sig),
        ("nbf in the future", not_yet),
        ("wrong issuer", wrong_iss),
        ("wrong audience", wrong_aud),
        ("garbage", "not.a.jwt".to_string()),
        ("30 KB token", huge),
    ];
    for (name, token) in cases {
        let id = who(&bearer(&token), &cfg);
        assert_eq!(id.kind, IdentityKind::Ip, "{name}: must not identify");
        assert_eq!(&*id.tier, ANONYMOUS, "{name}");
    }
}

#[test]
fn leeway_applies_to_exp() {
    let cfg = rs_config();
    let t = encode(&Header::new(Algorithm::RS256), &claims(-20), &rsa_key()).unwrap();
    assert_eq!(
        who(&bearer(&t), &cfg).kind,
        IdentityKind::Jwt,
        "20 s past exp is within 30 s leeway"
    );
}

#[test]
fn es256_and_hs256_configs() {
    let cfg = config("  jwt:\n    algorithms: [ES256]\n    public_key_file: ec_public.pem\n");
    let key = EncodingKey::from_ec_pem(&std::fs::read(format!("{FIXTURES}/ec_private_pk8.pem")).unwrap()).unwrap();
    let t = encode(&Header::new(Algorithm::ES256), &claims(600), &key).unwrap();
    assert_eq!(who(&bearer(&t), &cfg).kind, IdentityKind::Jwt);

    std::env::set_var("TOLLGATE_TEST_HS_SECRET", "0123456789abcdef0123456789abcdef");
    let cfg = config("  jwt:\n    algorithms: [HS256]\n    secret_env: TOLLGATE_TEST_HS_SECRET\n");
    let t = encode(
        &Header::new(Algorithm::HS256),
        &claims(600),
        &EncodingKey::from_secret(b"0123456789abcdef0123456789abcdef").unwrap(),
    )
    .unwrap();
    assert_eq!(who(&bearer(&t), &cfg).kind, IdentityKind::Jwt);
    let forged = encode(
        &Header::new(Algorithm::HS256),
        &claims(600),
        &EncodingKey::from_secret(b"another-secret-of-32-bytes-long!").unwrap(),
    )
    .unwrap();
    assert_eq!(who(&bearer(&forged), &cfg).kind, IdentityKind::Ip);
}

#[test]
fn spoofed_forwarded_for_from_untrusted_peer_is_ignored() {
    let cfg = rs_config();
    let mut h = HeaderMap::new();
    h.insert("x-forwarded-for", HeaderValue::from_static("1.2.3.4"));
    // The peer (203.0.113.7) is not a trusted proxy: its XFF is ignored.
    assert_eq!(client_ip(&h, peer(), &cfg), peer());
}

#[test]
fn forwarded_for_read_right_to_left_past_trusted_proxies() {
    let cfg = rs_config();
    let proxy: IpAddr = "10.1.2.3".parse().unwrap();
    let table: &[(&[&str], &str)] = &[
        (&["198.51.100.9"], "198.51.100.9"),
        // The client prepends a spoofed entry: the right-most untrusted one wins.
        (&["6.6.6.6, 198.51.100.9"], "198.51.100.9"),
        (&["6.6.6.6, 198.51.100.9, 10.9.9.9"], "198.51.100.9"),
        // Several header lines are one list.
        (&["6.6.6.6", "198.51.100.9, 10.9.9.9"], "198.51.100.9"),
        (&["198.51.100.9:4711"], "198.51.100.9"),
        (&["[2001:db8::1]:443"], "2001:db8::"),
        // Garbage falls back to the peer.
        (&["not-an-ip"], "10.1.2.3"),
        (&["198.51.100.9, garbage"], "10.1.2.3"),
        // IPv4-mapped IPv6 is IPv4.
        (&["::ffff:198.51.100.9"], "198.51.100.9"),
    ];
    for (xff, want) in table {
        let mut h = HeaderMap::new();
        for v in *xff {
            h.append("x-forwarded-for", HeaderValue::from_str(v).unwrap());
        }
        assert_eq!(client_ip(&h, proxy, &cfg).to_string(), *want, "{xff:?}");
    }
}

#[test]
fn huge_forwarded_for_is_bounded() {
    let cfg = rs_config();
    let list: Vec<String> = (0..5000).map(|i| format!("10.0.{}.{}", i / 250, i % 250)).collect();
    let mut h = HeaderMap::new();
    h.insert(
        "x-forwarded-for",
        HeaderValue::from_str(&format!("1.1.1.1, {}", list.join(", "))).unwrap(),
    );
    // Only the last 32 entries are read; all trusted, so the left-most read one is the client.
    let ip = client_ip(&h, "10.0.0.1".parse().unwrap(), &cfg);
    assert_ne!(ip.to_string(), "1.1.1.1");
}

#[test]
fn ipv6_rotation_inside_a_64_is_one_client() {
    let cfg = rs_config();
    let h = HeaderMap::new();
    let a = client_ip(&h, "2001:db8:1:2:aaaa::1".parse().unwrap(), &cfg);
    let b = client_ip(&h, "2001:db8:1:2:ffff:1:2:3".parse().unwrap(), &cfg);
    let c = client_ip(&h, "2001:db8:1:3::1".parse().unwrap(), &cfg);
    assert_eq!(a, b);
    assert_eq!(a.to_string(), "2001:db8:1:2::");
    assert_ne!(a, c);
    assert_eq!(
        collapse("::ffff:192.0.2.1".parse().unwrap(), 64).to_string(),
        "192.0.2.1"
    );
}

#[test]
fn api_keys_identify_only_when_registered() {
    let cfg = rs_config();
    let path = Path::new("keys.yaml");
    let raw = parse_str(
        path,
        &format!(
            "keys:\n  - id: cust_42\n    sha256: {}\n    tier: pro\n    org: acme\n",
            keys::hash_key("s3cret")
        ),
    )
    .unwrap();
    let reg = KeyRegistry::compile(path, raw).unwrap();
    let mut h = HeaderMap::new();
    h.insert("x-api-key", HeaderValue::from_static("s3cret"));
    let id = identify(&h, peer(), &reg, &cfg, NOW);
    assert_eq!((id.kind, &*id.id, &*id.tier), (IdentityKind::ApiKey, "cust_42", "pro"));
    h.insert("x-api-key", HeaderValue::from_static("minted-fresh-key"));
    let id = identify(&h, peer(), &reg, &cfg, NOW);
    assert_eq!(id.kind, IdentityKind::Ip, "an unknown key is not an identity");
    // Non-UTF-8 bytes are just an unknown key.
    h.insert("x-api-key", HeaderValue::from_bytes(b"\xff\xfe").unwrap());
    assert_eq!(identify(&h, peer(), &reg, &cfg, NOW).kind, IdentityKind::Ip);
}

/// Minimal base64url without padding, for hand-built tokens.
mod base64_like {
    pub(super) fn encode_url(data: &[u8]) -> String {
        const T: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
        let mut out = String::new();
        for chunk in data.chunks(3) {
            let b = [chunk[0], *chunk.get(1).unwrap_or(&0), *chunk.get(2).unwrap_or(&0)];
            let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
            for i in 0..=chunk.len() {
                out.push(T[((n >> (18 - 6 * i)) & 63) as usize] as char);
            }
        }
        out
    }
}

#[test]
fn jwks_keys_are_chosen_by_kid() {
    let cfg = config("  jwt:\n    algorithms: [RS256]\n    jwks_file: jwks.json\n");
    let mut header = Header::new(Algorithm::RS256);
    header.kid = Some("k1".into());
    let t = encode(&header, &claims(600), &rsa_key()).unwrap();
    assert_eq!(who(&bearer(&t), &cfg).kind, IdentityKind::Jwt);
    header.kid = Some("unknown".into());
    let t = encode(&header, &claims(600), &rsa_key()).unwrap();
    assert_eq!(who(&bearer(&t), &cfg).kind, IdentityKind::Ip, "unknown kid");
}

#[test]
fn a_cached_token_still_expires() {
    let cfg = rs_config();
    let t = encode(&Header::new(Algorithm::RS256), &claims(600), &rsa_key()).unwrap();
    assert_eq!(
        identify(&bearer(&t), peer(), &KeyRegistry::empty(), &cfg, NOW).kind,
        IdentityKind::Jwt
    );
    // Second use is served from the verified-token cache...
    assert_eq!(
        identify(&bearer(&t), peer(), &KeyRegistry::empty(), &cfg, NOW + 60).kind,
        IdentityKind::Jwt
    );
    // ...which re-checks exp against the clock.
    assert_eq!(
        identify(&bearer(&t), peer(), &KeyRegistry::empty(), &cfg, NOW + 3600).kind,
        IdentityKind::Ip
    );
}

/// The YAML parser's budgets are sized from `limits.max_keys`, so a registry past
/// the old ceiling (~35,000 keys) loads, and one over the limit gets an error that names
/// the setting instead of the parser's "budget breached: Nodes { .. }".
#[test]
fn a_large_registry_loads_and_an_oversized_one_names_its_limit() {
    use std::fmt::Write;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("keys.yaml");
    let mut text = String::from("keys:\n");
    let _ = writeln!(
        text,
        "  - {{ id: real, sha256: {}, tier: pro }}",
        crate::identity::keys::hash_key("the-real-secret")
    );
    for i in 1..40_000u32 {
        let _ = writeln!(
            text,
            "  - {{ id: k{i}, sha256: {i:064x}, tier: pro, org: o{} }}",
            i % 100
        );
    }
    std::fs::write(&path, &text).unwrap();
    let reg = KeyRegistry::load(&path).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(reg.len(), 40_000);
    assert!(reg.lookup(b"the-real-secret").is_some());

    let err = KeyRegistry::load_max(&path, 39_999).unwrap_err().to_string();
    assert!(
        err.contains("40000 keys is over limits.max_keys (39999); raise it in gateway.yaml"),
        "{err}"
    );
    let err = KeyRegistry::load_max(&path, 1_000).unwrap_err().to_string();
    assert!(err.contains("raise limits.max_keys in gateway.yaml"), "{err}");
    assert!(!err.contains("Nodes {"), "{err}");
}

#[test]
fn ip_text_is_inline_and_holds_the_longest_address() {
    for text in [
        "203.0.113.7",
        "255.255.255.255",
        "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff",
        "2001:db8::",
        "::ffff:255.255.255.255",
    ] {
        let ip: IpAddr = text.parse().unwrap();
        let id = ip_text(ip);
        assert!(matches!(id, IdText::Ip(_)), "{text} kept inline");
        assert_eq!(id.as_str(), ip.to_string(), "{text}");
        assert_eq!(
            id,
            IdText::from(ip.to_string().as_str()),
            "inline and shared text compare equal"
        );
    }
}

/// `who`, with the refusal.
fn checked(h: &HeaderMap, cfg: &IdentityConfig, keys: &KeyRegistry) -> (Identity, Option<CredentialProblem>) {
    identify_checked(h, peer(), keys, cfg, NOW)
}

#[test]
fn fractional_exp_is_floored_and_nbf_ceiled() {
    let cfg = rs_config();
    let at = |exp: f64, nbf: f64| {
        let mut c = claims(600);
        c["exp"] = json!(exp);
        c["nbf"] = json!(nbf);
        let t = encode(&Header::new(Algorithm::RS256), &c, &rsa_key()).unwrap();
        checked(&bearer(&t), &cfg, &KeyRegistry::empty())
    };
    let now = NOW as f64;
    assert_eq!(at(now + 600.5, now - 10.5).0.kind, IdentityKind::Jwt);
    // 30 s leeway: exp NOW-30.5 floors to NOW-31 (expired); ceiled it would still pass.
    assert_eq!(at(now - 30.5, now - 100.0).1, Some(CredentialProblem::Invalid));
    assert_eq!(at(now - 29.5, now - 100.0).0.kind, IdentityKind::Jwt);
    // nbf NOW+30.5 ceils to NOW+31: not yet valid; floored it would pass.
    assert_eq!(at(now + 600.0, now + 30.5).1, Some(CredentialProblem::Invalid));
}

#[test]
fn bearer_scheme_is_case_insensitive_with_any_whitespace() {
    let cfg = rs_config();
    let t = encode(&Header::new(Algorithm::RS256), &claims(600), &rsa_key()).unwrap();
    for spelling in ["BEARER ", "bEaReR ", "Bearer\t", "Bearer \t  ", "  Bearer  "] {
        let mut h = HeaderMap::new();
        h.insert(
            "authorization",
            HeaderValue::from_str(&format!("{spelling}{t}")).unwrap(),
        );
        assert_eq!(
            checked(&h, &cfg, &KeyRegistry::empty()).0.kind,
            IdentityKind::Jwt,
            "{spelling:?}"
        );
    }
    // Another scheme is not this gateway's credential: the IP, no refusal.
    let mut h = HeaderMap::new();
    h.insert(
        "authorization",
        HeaderValue::from_static("Basic YWxhZGRpbjpvcGVuc2VzYW1l"),
    );
    assert_eq!(
        checked(&h, &cfg, &KeyRegistry::empty()),
        (who(&HeaderMap::new(), &cfg), None)
    );
}

#[test]
fn ambiguous_and_invalid_credentials_are_refused_unless_configured_as_ip() {
    let yaml = format!("keys:\n  - {{ id: cust_1, sha256: {} }}\n", keys::hash_key("good-key"));
    let path = Path::new("keys.yaml");
    let keys = KeyRegistry::compile(path, parse_str(path, &yaml).unwrap()).unwrap();
    let with = |vals: &[&str]| {
        let mut h = HeaderMap::new();
        for v in vals {
            h.append("x-api-key", HeaderValue::from_str(v).unwrap());
        }
        h
    };
    let reject = config("  invalid_credentials: reject\n");
    let ip = config("  invalid_credentials: ip\n");
    for cfg in [&reject, &ip] {
        assert_eq!(checked(&with(&["good-key"]), cfg, &keys).0.kind, IdentityKind::ApiKey);
        for vals in [
            &["good-key", "good-key"][..],
            &["bogus", "good-key"],
            &["good-key, bogus"],
        ] {
            assert!(
                matches!(
                    checked(&with(vals), cfg, &keys).1,
                    Some(CredentialProblem::Ambiguous(_))
                ),
                "{vals:?}"
            );
        }
    }
    assert_eq!(
        checked(&with(&["bogus"]), &reject, &keys).1,
        Some(CredentialProblem::Invalid)
    );
    let (id, refused) = checked(&with(&["bogus"]), &ip, &keys);
    assert_eq!((id.kind, refused), (IdentityKind::Ip, None));
    // An empty field is no credential.
    assert_eq!(checked(&with(&[""]), &reject, &keys).1, None);
    // The default is `reject`.
    assert_eq!(
        config("  ipv6_prefix: 64\n").invalid_credentials,
        InvalidCredentials::Reject
    );
}
