//! Gateway config parsing and validation.

use std::path::Path;

use super::*;

fn compile(yaml: &str, env: &EnvOverrides) -> Result<GatewayConfig, ConfigError> {
    let path = Path::new("/etc/tollgate/gateway.yaml");
    let raw: raw::RawGateway = parse_str(path, yaml)?;
    GatewayConfig::compile(path, raw, env)
}

#[test]
fn defaults_are_safe() {
    let c = compile("upstream: { url: http://127.0.0.1:8081 }\n", &EnvOverrides::default()).unwrap();
    assert!(
        c.admin_listen.ip().is_loopback(),
        "the admin API is loopback-only by default"
    );
    assert_eq!(c.store.kind, StoreKind::Memory);
    assert_eq!(c.store.timeout, Duration::from_millis(20));
    assert_eq!(c.identity.ipv6_prefix, 64);
    assert!(c.limits.deny_cache && c.limits.ietf_headers && c.limits.legacy_headers);
    assert_eq!(
        c.rules_file,
        Path::new("/etc/tollgate/rules.yaml"),
        "relative to the gateway file"
    );
}

#[test]
fn env_overrides_apply() {
    let env = EnvOverrides {
        listen: Some("127.0.0.1:18080".into()),
        redis_urls: Some("redis://a:1, redis://b:2".into()),
    };
    let c = compile(
        "upstream: { url: http://127.0.0.1:8081 }\nstore: { kind: redis_cluster }\n",
        &env,
    )
    .unwrap();
    assert_eq!(c.listen.to_string(), "127.0.0.1:18080");
    assert_eq!(c.store.urls, vec!["redis://a:1", "redis://b:2"]);
    let bad = EnvOverrides {
        listen: Some("nope".into()),
        redis_urls: None,
    };
    assert!(compile("upstream: { url: http://127.0.0.1:8081 }\n", &bad)
        .unwrap_err()
        .message
        .contains("TOLLGATE_LISTEN"));
}

#[test]
fn errors_name_file_line_and_column() {
    let cases = [
        ("upstream: { url: http://127.0.0.1:8081 }\nstore:\n  timeot: 5ms\n", "/etc/tollgate/gateway.yaml:3:3:", "unknown field"),
        ("upstream: { url: http://127.0.0.1:8081 }\nstore:\n  timeout: 5 parsecs\n", "/etc/tollgate/gateway.yaml:3:12:", "invalid duration"),
        ("upstream: { url: https://api.example }\n", "/etc/tollgate/gateway.yaml:1:18:", "http://host:port"),
        ("upstream: { url: http://127.0.0.1:8081 }\nstore: { kind: etcd }\n", "/etc/tollgate/gateway.yaml:2:16:", "unknown store kind"),
        ("upstream: { url: http://127.0.0.1:8081 }\nidentity: { trusted_proxies: [10.0.0.0/33] }\n", "/etc/tollgate/gateway.yaml:2:31:", "invalid CIDR"),
        ("upstream: { url: http://127.0.0.1:8081 }\nidentity: { jwt: { algorithms: [none], secret_env: X } }\n", "/etc/tollgate/gateway.yaml:2:32:", "never accepted"),
        ("upstream: { url: http://127.0.0.1:8081 }\nidentity: { jwt: { algorithms: [HS256, RS256], secret_env: X } }\n", "/etc/tollgate/gateway.yaml:2:32:", "one key family"),
    ];
    for (yaml, at, what) in cases {
        let e = compile(yaml, &EnvOverrides::default()).unwrap_err().to_string();
        assert!(e.starts_with(at), "{e} (want {at})");
        assert!(e.contains(what), "{e} (want {what})");
    }
}
