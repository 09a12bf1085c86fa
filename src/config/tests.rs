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
fn connection_caps_are_on_by_default() {
    let env = EnvOverrides::default();
    let c = compile("upstream: { url: http://127.0.0.1:8081 }\n", &env).unwrap();
    assert_eq!(c.server.max_connections_per_ip, Some(64));
    assert_eq!(c.upstream.max_connections_per_target, 1024);
    // One address never fills a small gateway by itself: a quarter of max_connections.
    let c = compile(
        "upstream: { url: http://127.0.0.1:8081 }\nserver: { max_connections: 50 }\n",
        &env,
    )
    .unwrap();
    assert_eq!(c.server.max_connections_per_ip, Some(12));
    let c = compile(
        "upstream: { url: http://127.0.0.1:8081, max_connections_per_target: 8 }\nserver: { max_connections_per_ip: 0 }\n",
        &env,
    )
    .unwrap();
    assert_eq!(c.server.max_connections_per_ip, None, "0 turns the cap off");
    assert_eq!(c.upstream.max_connections_per_target, 8);
    let e = compile(
        "upstream: { url: http://127.0.0.1:8081, max_connections_per_target: 0 }\n",
        &env,
    )
    .unwrap_err();
    assert!(e.to_string().contains("upstream.max_connections_per_target"), "{e}");
}

#[test]
fn env_overrides_apply() {
    let env = EnvOverrides {
        listen: Some("127.0.0.1:18080".into()),
        redis_urls: Some("redis://a:1, redis://b:2".into()),
        ..EnvOverrides::default()
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
        ..EnvOverrides::default()
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
        ("upstream: { url: ftp://api.example }\n", "/etc/tollgate/gateway.yaml:1:18:", "http://host:port"),
        ("upstream: { url: http://127.0.0.1:8081 }\nstore: { kind: etcd }\n", "/etc/tollgate/gateway.yaml:2:16:", "unknown store kind"),
        ("upstream: { url: http://127.0.0.1:8081 }\nidentity: { trusted_proxies: [10.0.0.0/33] }\n", "/etc/tollgate/gateway.yaml:2:31:", "invalid CIDR"),
        ("upstream: { url: http://127.0.0.1:8081 }\nidentity: { jwt: { algorithms: [none], secret_env: X } }\n", "/etc/tollgate/gateway.yaml:2:32:", "never accepted"),
        ("upstream: { url: http://127.0.0.1:8081 }\nidentity: { jwt: { algorithms: [HS256, RS256], secret_env: X } }\n", "/etc/tollgate/gateway.yaml:2:32:", "one key family"),
        ("upstream: { url: http://127.0.0.1:8081 }\nidentity: { jwt: { algorithms: [HS256], secret_env: X, public_key_file: k.pem } }\n", "/etc/tollgate/gateway.yaml:2:53:", "choose one"),
        ("upstream: { url: http://127.0.0.1:8081 }\nidentity: { jwt: { algorithms: [RS256], leeway: 100d } }\n", "/etc/tollgate/gateway.yaml:2:49:", "more than 5m"),
        ("upstream: { url: http://127.0.0.1:8081 }\nidentity: { invalid_credentials: anonymous }\n", "/etc/tollgate/gateway.yaml:2:34:", "reject | ip"),
    ];
    for (yaml, at, what) in cases {
        let e = compile(yaml, &EnvOverrides::default()).unwrap_err().to_string();
        assert!(e.starts_with(at), "{e} (want {at})");
        assert!(e.contains(what), "{e} (want {what})");
    }
}

#[test]
fn values_run_cannot_honour_are_refused_with_their_position() {
    let u = "upstream: { url: http://127.0.0.1:8081 }\n";
    let cases = [
        (
            "store: { kind: redis, urls: [127.0.0.1:6379] }\n",
            "gateway.yaml:2:30:",
            "needs a scheme",
        ),
        (
            "store: { kind: redis, urls: [\"redis://h:notaport\"] }\n",
            "gateway.yaml:2:30:",
            "did not parse",
        ),
        ("store:\n  timeout: 0ms\n", "gateway.yaml:3:12:", "store.timeout"),
        (
            "store:\n  breaker_threshold: 0\n",
            "gateway.yaml:3:22:",
            "store.breaker_threshold: 0",
        ),
        (
            "server:\n  max_connections: 0\n",
            "gateway.yaml:3:20:",
            "server.max_connections: 0",
        ),
        (
            "store:\n  probe_interval: 0s\n",
            "gateway.yaml:3:19:",
            "store.probe_interval",
        ),
        (
            "server:\n  max_header_bytes: 100\n",
            "gateway.yaml:3:21:",
            "at least 1024",
        ),
        (
            "store:\n  key_salt_env: TOLLGATE_TEST_SALT_THAT_IS_NEVER_SET\n",
            "gateway.yaml:3:17:",
            "is not set",
        ),
    ];
    for (yaml, at, what) in cases {
        let e = compile(&format!("{u}{yaml}"), &EnvOverrides::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains(at), "{e} (want {at})");
        assert!(e.contains(what), "{e} (want {what})");
    }
    // A memory store does not read its urls; nothing to refuse there.
    compile(&format!("{u}store: {{ urls: [nonsense] }}\n"), &EnvOverrides::default()).unwrap();
}

#[test]
fn redis_url_from_the_environment_is_checked_too_and_noted_when_ignored() {
    let env = EnvOverrides {
        redis_urls: Some("127.0.0.1:6379".into()),
        redis_urls_var: "TOLLGATE_REDIS_URL",
        ..EnvOverrides::default()
    };
    let e = compile(
        "upstream: { url: http://127.0.0.1:8081 }\nstore: { kind: redis, urls: [redis://r:6379] }\n",
        &env,
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("TOLLGATE_REDIS_URL") && e.contains("needs a scheme"), "{e}");
    let c = compile("upstream: { url: http://127.0.0.1:8081 }\n", &env).unwrap();
    assert!(
        c.notes
            .iter()
            .any(|n| n.contains("TOLLGATE_REDIS_URL is set but ignored")),
        "{:?}",
        c.notes
    );
}

#[test]
fn redact_url_hides_passwords() {
    assert_eq!(
        redact_url("redis://default:hunter2@r:6379/0"),
        "redis://default:***@r:6379/0"
    );
    assert_eq!(redact_url("rediss://hunter2@r:6379"), "rediss://***@r:6379");
    assert_eq!(redact_url("redis://r:6379"), "redis://r:6379");
    assert_eq!(redact_url("user:hunter2@r:6379"), "***@r:6379");
    assert!(!redact_url("redis://u:p@ss@r:1").contains("p@ss"));
}

#[test]
fn unknown_fields_suggest_the_closest_and_print_the_position_once() {
    let e = compile(
        "upstream: { url: http://127.0.0.1:8081 }\nstore:\n  timeot: 5ms\n",
        &EnvOverrides::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.starts_with("/etc/tollgate/gateway.yaml:3:3: unknown field `timeot`"),
        "{e}"
    );
    assert!(e.ends_with("did you mean `timeout`?"), "{e}");
    assert!(!e.contains("at line"), "position printed twice: {e}");
    let e = compile(
        "upstream: { url: http://127.0.0.1:8081 }\nstore:\n  zzzzzz: 5ms\n",
        &EnvOverrides::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(!e.contains("did you mean"), "no suggestion when nothing is close: {e}");
}

#[test]
fn upstream_targets_tls_and_access_log_validate_with_positions() {
    let c = compile(
        "upstream:\n  targets: [http://10.0.0.1:8080, \"https://api.internal\"]\n  eject_after: 5\n  eject_for: 2s\n  health_check: { path: /healthz, interval: 1s }\naccess_log: 0.25\n",
        &EnvOverrides::default(),
    )
    .unwrap();
    assert_eq!(c.upstream.targets.len(), 2);
    assert_eq!(c.upstream.targets[1].addr, "api.internal:443");
    assert_eq!(c.upstream.targets[1].host, "api.internal");
    assert!(c.upstream.targets[1].tls && !c.upstream.targets[0].tls);
    assert_eq!(c.upstream.eject_after, 5);
    assert_eq!(c.upstream.eject_for, Duration::from_secs(2));
    assert_eq!(c.upstream.health_check.as_ref().unwrap().path.as_str(), "/healthz");
    assert_eq!(c.access_log, AccessLog::Sampled { rate: 0.25, one_in: 4 });
    let c = compile(
        "upstream: { url: http://h:1 }\naccess_log: true\n",
        &EnvOverrides::default(),
    )
    .unwrap();
    assert_eq!(c.access_log, AccessLog::All);
    assert_eq!(c.upstream.targets.len(), 1);

    let cases = [
        ("listen: 127.0.0.1:1\n", "gateway.yaml", "missing field `upstream`"),
        (
            "upstream: { url: http://h:1, targets: [http://h:2] }\n",
            "gateway.yaml:1:18:",
            "not both",
        ),
        ("upstream: { targets: [] }\n", "gateway.yaml:1:22:", "at least one"),
        (
            "upstream: { targets: [http://h:1, http://h:1] }\n",
            "gateway.yaml:1:35:",
            "listed twice",
        ),
        (
            "upstream: { targets: [http://h:1/api] }\n",
            "gateway.yaml:1:23:",
            "a path is not supported",
        ),
        (
            "upstream: { connect_timeout: 1s }\n",
            "gateway.yaml:1:11:",
            "needs url or targets",
        ),
        (
            "upstream: { url: http://h:1 }\naccess_log: 2\n",
            "gateway.yaml:2:13:",
            "fraction",
        ),
        (
            "upstream: { url: http://h:1 }\ntls: { cert_file: /nonexistent.pem, key_file: k.pem }\n",
            "gateway.yaml:2:19:",
            "cannot read",
        ),
        (
            "upstream: { url: https://h:1, tls: { client_cert_file: c.pem } }\n",
            "gateway.yaml:1:56:",
            "go together",
        ),
        (
            "upstream: { url: http://h:1 }\nstore: { kind: redis, urls: [\"redis://r:6379\"], tls: { ca_file: x } }\n",
            "gateway.yaml:2:54:",
            "rediss://",
        ),
        (
            "upstream: { url: http://h:1 }\nstore: { password_env: TOLLGATE_TEST_SURELY_UNSET_PW }\n",
            "gateway.yaml:2:24:",
            "is not set",
        ),
    ];
    for (yaml, at, what) in cases {
        let e = compile(yaml, &EnvOverrides::default()).unwrap_err().to_string();
        assert!(e.contains(at), "{e} (want {at})");
        assert!(e.contains(what), "{e} (want {what})");
    }
}

#[test]
fn insecure_skip_verify_is_a_note_and_the_password_never_prints() {
    let c = compile(
        "upstream: { url: \"https://h:1\", tls: { insecure_skip_verify: true } }\n",
        &EnvOverrides::default(),
    )
    .unwrap();
    assert!(c.upstream.tls.insecure_skip_verify);
    assert!(
        c.notes.iter().any(|n| n.contains("insecure_skip_verify")),
        "{:?}",
        c.notes
    );
    let s = Secret("hunter2".into());
    assert!(!format!("{s:?}").contains("hunter2"));
}

#[test]
fn leases_are_on_for_redis_off_for_memory_and_validated_with_positions() {
    let env = EnvOverrides::default();
    let up = "upstream: { url: http://127.0.0.1:8081 }\n";
    let memory = compile(up, &env).unwrap();
    assert_eq!(memory.store.leases, None, "one node has nothing to lease");
    let redis = compile(
        &format!("{up}store: {{ kind: redis, urls: [redis://127.0.0.1:6379] }}\n"),
        &env,
    )
    .unwrap();
    assert_eq!(redis.store.leases, Some(crate::limiter::lease::LeaseConfig::default()));
    let tuned = compile(
        &format!("{up}store: {{ kind: redis_cluster, urls: [redis://127.0.0.1:7000], leases: {{ min_rate: 10/s, ttl: 1s, max_share: 0.25 }} }}\n"),
        &env,
    )
    .unwrap()
    .store
    .leases
    .unwrap();
    assert_eq!(
        (tuned.min_rate.get(), tuned.ttl_us.get(), tuned.max_share_ppm.get()),
        (10, 1_000_000, 250_000)
    );
    let off = compile(
        &format!("{up}store: {{ kind: redis, urls: [redis://127.0.0.1:6379], leases: {{ enabled: false }} }}\n"),
        &env,
    )
    .unwrap();
    assert_eq!(off.store.leases, None);
    for (leases, want) in [
        ("{ ttl: 1ms }", "store.leases.ttl: \"1ms\" must be between 10ms and 10s"),
        (
            "{ max_share: 0.6 }",
            "store.leases.max_share: 0.6 must be more than 0 and at most 0.5",
        ),
        ("{ max_share: 0 }", "store.leases.max_share: 0 must be more than 0"),
        (
            "{ min_rate: 1/m }",
            "store.leases.min_rate: \"1/m\" must be between 1/s",
        ),
        ("{ min_rate: fast }", "store.leases.min_rate: rate \"fast\""),
        ("{ sizes: 3 }", "sizes"),
    ] {
        let e = compile(
            &format!("{up}store: {{ kind: redis, urls: [redis://127.0.0.1:6379], leases: {leases} }}\n"),
            &env,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains(want), "{leases}: {e}");
        assert!(
            e.starts_with("/etc/tollgate/gateway.yaml:2:"),
            "{leases}: no position in {e}"
        );
    }
}

#[test]
fn upstream_protocol_defaults_to_http1_and_must_suit_the_targets() {
    let p = |yaml: &str| compile(yaml, &EnvOverrides::default()).map(|c| c.upstream.protocol);
    assert_eq!(p("upstream: { url: http://h:1 }\n").unwrap(), UpstreamProtocol::Http1);
    assert_eq!(
        p("upstream: { url: http://h:1, protocol: h2c }\n").unwrap(),
        UpstreamProtocol::H2c
    );
    assert_eq!(
        p("upstream: { url: \"https://h:1\", protocol: h2 }\n").unwrap(),
        UpstreamProtocol::H2
    );
    assert_eq!(
        p("upstream: { targets: [http://h:1, \"https://h:2\"], protocol: auto }\n").unwrap(),
        UpstreamProtocol::Auto
    );
    let cases = [
        (
            "upstream: { url: http://h:1, protocol: http2 }\n",
            "gateway.yaml:1:40:",
            "unknown value",
        ),
        (
            "upstream: { url: http://h:1, protocol: h2 }\n",
            "gateway.yaml:1:40:",
            "use h2c",
        ),
        (
            "upstream: { url: \"https://h:1\", protocol: h2c }\n",
            "gateway.yaml:1:43:",
            "use h2 or auto",
        ),
    ];
    for (yaml, at, what) in cases {
        let e = compile(yaml, &EnvOverrides::default()).unwrap_err().to_string();
        assert!(e.contains(at), "{e} (want {at})");
        assert!(e.contains(what), "{e} (want {what})");
    }
}

#[test]
fn store_scripting_is_auto_by_default_and_takes_three_values() {
    let u = "upstream: { url: http://127.0.0.1:8081 }\n";
    let env = EnvOverrides::default();
    let redis = |extra: &str| format!("{u}store:\n  kind: redis\n  urls: [redis://r:6379]\n{extra}");
    assert_eq!(compile(&redis(""), &env).unwrap().store.scripting, Scripting::Auto);
    for (v, want) in [
        ("auto", Scripting::Auto),
        ("functions", Scripting::Functions),
        ("eval", Scripting::Eval),
    ] {
        let c = compile(&redis(&format!("  scripting: {v}\n")), &env).unwrap();
        assert_eq!(c.store.scripting, want, "{v}");
    }
    let e = compile(&redis("  scripting: evalsha\n"), &env).unwrap_err().to_string();
    assert!(e.starts_with("/etc/tollgate/gateway.yaml:5:14:"), "{e}");
    assert!(e.contains("auto | functions | eval"), "{e}");
    let e = compile(&format!("{u}store: {{ kind: memory, scripting: eval }}\n"), &env)
        .unwrap_err()
        .to_string();
    assert!(e.contains("store.scripting needs a Redis store"), "{e}");
}

#[test]
fn tracing_otlp_is_off_by_default_and_validates_with_positions() {
    let env = EnvOverrides::default();
    let c = compile("upstream: { url: http://h:1 }\n", &env).unwrap();
    assert!(c.otlp.is_none(), "span export is off unless configured");
    let c = compile(
        "upstream: { url: http://h:1 }\ntracing:\n  otlp:\n    endpoint: http://127.0.0.1:4318/v1/traces\n",
        &env,
    )
    .unwrap();
    let o = c.otlp.unwrap();
    assert_eq!(o.sample_ratio, otlp::DEFAULT_SAMPLE_RATIO);
    assert_eq!((o.service_name.as_str(), o.parent_based), ("tollgate", false));
    assert_eq!(o.queue_size, otlp::DEFAULT_QUEUE_SIZE);
    for (yaml, at, says) in [
        (
            "    endpoint: https://c:4318/v1/traces\n",
            "gateway.yaml:4:15:",
            "http://",
        ),
        ("    endpoint: \"not a url\"\n", "gateway.yaml:4:15:", "not a URL"),
        (
            "    endpoint: http://c:4318/v1/traces\n    sample_ratio: 1.5\n",
            "gateway.yaml:5:19:",
            "[0, 1]",
        ),
        (
            "    endpoint: http://c:4318/v1/traces\n    queue_size: 0\n",
            "gateway.yaml:5:17:",
            "at least 1",
        ),
        (
            "    endpoint: http://c:4318/v1/traces\n    headers_env: { authorization: TOLLGATE_TEST_UNSET_OTLP_VAR }\n",
            "gateway.yaml:5:35:",
            "is not set",
        ),
        ("    sample_ratio: 0.5\n", "gateway.yaml:4:", "missing field `endpoint`"),
    ] {
        let text = format!("upstream: {{ url: http://h:1 }}\ntracing:\n  otlp:\n{yaml}");
        let e = compile(&text, &env)
            .err()
            .unwrap_or_else(|| panic!("accepted: {text}"))
            .to_string();
        assert!(e.contains(at) && e.contains(says), "{text}\n→ {e}");
    }
}

#[test]
fn with_the_rate_limit_service_the_store_deadline_defaults_to_half_of_envoys_timeout() {
    let rls = "rls: { config_dir: /tmp/none }\n";
    let c = compile(rls, &EnvOverrides::default()).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(c.store.timeout, RLS_STORE_TIMEOUT);
    let c = compile(&format!("{rls}store: {{ timeout: 50ms }}\n"), &EnvOverrides::default())
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(c.store.timeout, Duration::from_millis(50), "a set deadline is kept");
}
