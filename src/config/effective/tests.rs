//! `tollgate config`: each setting says where its value came from, and no secret is shown.

use super::*;

/// The settings `tollgate config` lists for the gateway file `text` (at `p`) under `env`.
fn settings_of(p: &Path, text: &str, env: &EnvOverrides) -> Vec<Setting> {
    let raw: RawGateway = super::super::parse_str(p, text).unwrap_or_else(|e| panic!("{e}"));
    let compiled = super::super::parse_str(p, text).unwrap_or_else(|e| panic!("{e}"));
    let cfg = GatewayConfig::compile(p, compiled, env).unwrap_or_else(|e| panic!("{e}"));
    settings(p, &raw, &cfg, env)
}

/// The setting named `n`.
fn get(s: &[Setting], n: &str) -> Setting {
    s.iter()
        .find(|x| x.name == n)
        .cloned()
        .unwrap_or_else(|| panic!("no {n} in {s:?}"))
}

#[test]
fn each_setting_says_where_it_came_from_and_no_secret_is_shown() {
    let p = Path::new("/etc/tollgate/gateway.yaml");
    let text = "listen: 127.0.0.1:8080\nupstream: { url: \"http://127.0.0.1:8081\" }\nstore:\n  kind: redis\n  urls: [\"redis://:hunter2@10.0.0.1:6379\"]\n  timeout: 30ms\nserver:\n  drain: 3s\n";
    let env = EnvOverrides {
        listen: Some("0.0.0.0:9999".into()),
        ..Default::default()
    };
    let s = settings_of(p, text, &env);
    let get = |n: &str| get(&s, n);
    assert_eq!(
        (get("listen").value, get("listen").source),
        ("0.0.0.0:9999".into(), "env TOLLGATE_LISTEN".into())
    );
    assert_eq!(get("store.timeout").value, "30ms");
    assert_eq!(get("store.timeout").source, "/etc/tollgate/gateway.yaml:6:12");
    assert_eq!(get("server.drain").source, "/etc/tollgate/gateway.yaml:8:10");
    assert_eq!(get("server.idle_timeout").source, "default");
    let urls = get("store.urls");
    assert!(
        urls.value.contains("***") && !urls.value.contains("hunter2"),
        "{urls:?}"
    );
    assert!(s.iter().all(|x| !x.value.contains("hunter2")));
}

#[test]
fn identity_jwt_tls_and_health_check_settings_are_listed_with_no_secret() {
    let p = Path::new("/etc/tollgate/gateway.yaml");
    // Variables of this test alone: no other test reads it.
    std::env::set_var("EFFECTIVE_TEST_JWT_SECRET", "s3cret-s3cret-s3cret-value");
    std::env::set_var("EFFECTIVE_TEST_REDIS_PASSWORD", "s3cret-redis");
    let text = "upstream:\n  url: \"http://127.0.0.1:8081\"\n  health_check: { path: /healthz, interval: 2s }\n  tls: { server_name: api.internal }\nidentity:\n  api_key_header: x-key\n  trusted_proxies: [10.0.0.0/8]\n  jwt:\n    algorithms: [HS256]\n    secret_env: EFFECTIVE_TEST_JWT_SECRET\n    issuer: https://issuer.example\n    leeway: 10s\nstore:\n  password_env: EFFECTIVE_TEST_REDIS_PASSWORD\n";
    let s = settings_of(p, text, &EnvOverrides::default());
    let get = |n: &str| get(&s, n);
    assert_eq!(get("identity.api_key_header").value, "x-key");
    assert_eq!(get("identity.api_key_header").source, "/etc/tollgate/gateway.yaml:6:19");
    assert_eq!(get("identity.trusted_proxies").value, "10.0.0.0/8");
    assert_eq!(
        get("identity.jwt.keys").value,
        "HMAC secret from $EFFECTIVE_TEST_JWT_SECRET (HS256)"
    );
    assert_eq!(get("identity.jwt.issuer").value, "https://issuer.example");
    assert_eq!(get("identity.jwt.leeway").value, "10s");
    assert_eq!(get("identity.invalid_credentials").source, "default");
    assert_eq!(get("tls").value, "off");
    assert!(get("upstream.tls").value.contains("server name api.internal"), "{s:?}");
    assert_eq!(get("upstream.health_check").value, "GET /healthz every 2s, timeout 1s");
    assert_eq!(get("upstream.health_check").source, "/etc/tollgate/gateway.yaml:3:25");
    assert_eq!(get("store.password").value, "from $EFFECTIVE_TEST_REDIS_PASSWORD");
    assert!(s.iter().all(|x| !x.value.contains("s3cret")), "{s:?}");
}
