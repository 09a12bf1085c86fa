//! Operator readiness, against the real `tollgate` binary: readiness without Redis, start-up
//! refusals that `tollgate check` reports the same way, `check` output, reload reporting,
//! the admin token and the admin audit log.

mod support;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use support::*;

/// Every variable the binary reads from the environment, so a developer's shell never leaks in.
const ENV_VARS: &[&str] = &[
    "TOLLGATE_CONFIG",
    "TOLLGATE_LISTEN",
    "TOLLGATE_REDIS_URL",
    "TOLLGATE_REDIS_URLS",
    "TOLLGATE_ADMIN_TOKEN",
    "TOLLGATE_TEST_SALT",
];

/// A `tollgate` command with a clean environment plus `env`.
fn tollgate(env: &[(&str, &str)]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_tollgate"));
    for v in ENV_VARS {
        c.env_remove(v);
    }
    c.env("RUST_LOG", "info");
    for (k, v) in env {
        c.env(k, v);
    }
    c
}

/// `tollgate check --config <p>`.
fn check(p: &Path, env: &[(&str, &str)]) -> Output {
    tollgate(env)
        .args(["check", "--config"])
        .arg(p)
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Write gateway.yaml (`body` is everything after `admin_listen`) and rules.yaml into `dir`.
fn write(dir: &Path, port: u16, admin: &str, body: &str, rules: &str) -> PathBuf {
    std::fs::write(dir.join("rules.yaml"), rules).unwrap();
    let p = dir.join("gateway.yaml");
    std::fs::write(
        &p,
        format!("listen: 127.0.0.1:{port}\nadmin_listen: {admin}\n{body}rules_file: rules.yaml\n"),
    )
    .unwrap();
    p
}

/// Start `run --config p` with `env`; wait until both ports accept connections. The log
/// (JSON) is `tollgate.log` beside `p`.
fn run(p: &Path, env: &[(&str, &str)], port: u16, admin_port: u16) -> BinaryGateway {
    let mut cmd = tollgate(env);
    cmd.args(["--log-format", "json", "run", "--config"]).arg(p);
    BinaryGateway::spawn(&mut cmd, p.with_file_name("tollgate.log"), &[port, admin_port])
}

/// `run` must exit with failure within 10 s; returns the reason its JSON ERROR line gives.
fn run_refused(p: &Path, env: &[(&str, &str)]) -> String {
    let mut child = tollgate(env)
        .args(["run", "--config"])
        .arg(p)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let status = eventually_some_blocking(Duration::from_secs(10), || child.try_wait().unwrap());
    let Some(status) = status else {
        let _ = child.kill();
        panic!("tollgate started, it should have refused");
    };
    assert!(!status.success());
    let mut err = String::new();
    use std::io::Read;
    child.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    // Logs are JSON off a terminal, and so is the start-up error: one ERROR line whose `error`
    // field is the reason.
    let reason = err
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|v| v["level"] == "ERROR")
        .and_then(|v| v["error"].as_str().map(str::to_owned));
    reason.unwrap_or_else(|| panic!("no JSON ERROR line with the reason: {err}"))
}

fn upstream_yaml(up: &str) -> String {
    format!("upstream:\n  url: {up}\n  connect_timeout: 500ms\n  request_timeout: 2s\n")
}

const RULES: &str = "rules:\n  - { name: open, match: { path: \"/open/**\" }, key: ip, limit: 1000, window: 1m, failure: open }\n  - { name: closed, match: { path: \"/closed/**\" }, key: ip, limit: 1000, window: 1m, failure: closed }\n";

fn status_of(url: &str) -> u16 {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async { client().get(url).send().await.map(|r| r.status().as_u16()).unwrap_or(0) })
}

fn echo_upstream(rt: &tokio::runtime::Runtime) -> String {
    format!("http://{}", rt.block_on(echo()))
}

#[test]
fn readiness_does_not_depend_on_redis_but_store_readiness_does() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let up = echo_upstream(&rt);
    let mut redis = RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    let (port, admin_port) = (free_port(), free_port());
    let body = format!(
        "{}store:\n  kind: redis\n  urls: [\"{}\"]\n  timeout: 50ms\n  probe_interval: 100ms\n",
        upstream_yaml(&up),
        redis.url()
    );
    let p = write(dir.path(), port, &format!("127.0.0.1:{admin_port}"), &body, RULES);
    let _gw = run(&p, &[], port, admin_port);
    let admin = format!("http://127.0.0.1:{admin_port}");
    let base = format!("http://127.0.0.1:{port}");
    let store_up = eventually_some_blocking(Duration::from_secs(5), || {
        (status_of(&format!("{admin}/readyz?store=1")) == 200).then_some(())
    });
    assert!(store_up.is_some(), "the store never became ready");
    assert_eq!(status_of(&format!("{admin}/readyz")), 200);

    redis.kill();
    // The proxy keeps serving (fail open) and stays ready, so its Service keeps it.
    assert_eq!(status_of(&format!("{base}/open/x")), 200);
    let store_down = eventually_some_blocking(Duration::from_secs(5), || {
        (status_of(&format!("{admin}/readyz?store=1")) == 503).then_some(())
    });
    assert!(store_down.is_some(), "/readyz?store=1 did not report the dead store");
    assert_eq!(status_of(&format!("{admin}/readyz")), 200, "readiness followed Redis");
    let (s, body) = admin_call("GET", &format!("{admin}/status"), None);
    assert_eq!(s, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["ready"], true, "{v}");
    assert_eq!(v["store"]["ok"], false, "{v}");
    assert_eq!(v["store"]["kind"], "redis", "{v}");
    assert_eq!(status_of(&format!("{base}/open/x")), 200);
    assert_eq!(status_of(&format!("{base}/closed/x")), 503);
}

#[test]
fn an_unset_or_empty_key_salt_env_refuses_start_and_check_names_the_line() {
    let dir = tempfile::tempdir().unwrap();
    let body = "upstream: { url: http://127.0.0.1:9 }\nstore:\n  key_prefix: tl\n  key_salt_env: TOLLGATE_TEST_SALT\n";
    let p = write(dir.path(), free_port(), "127.0.0.1:0", body, RULES);
    let at = format!("{}:6:17: store.key_salt_env", p.display());
    for env in [&[][..], &[("TOLLGATE_TEST_SALT", "")][..]] {
        let out = check(&p, env);
        assert_eq!(out.status.code(), Some(1));
        let err = text(&out.stderr);
        assert!(err.contains(&at), "{err} (want {at})");
        let err = run_refused(&p, env);
        assert!(err.contains(&at), "run: {err} (want {at})");
    }
    let out = check(&p, &[("TOLLGATE_TEST_SALT", "pepper")]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(!text(&out.stdout).contains("pepper"), "the salt is a secret");
}

#[test]
fn check_refuses_what_run_refuses_with_file_line_col() {
    let cases = [
        (
            "store:\n  kind: redis\n  urls: [127.0.0.1:6379]\n",
            "6:10:",
            "needs a scheme",
        ),
        ("store:\n  timeout: 0ms\n", "5:12:", "store.timeout"),
        (
            "store:\n  breaker_threshold: 0\n",
            "5:22:",
            "store.breaker_threshold: 0",
        ),
        ("server:\n  max_connections: 0\n", "5:20:", "server.max_connections: 0"),
    ];
    for (extra, pos, what) in cases {
        let dir = tempfile::tempdir().unwrap();
        let body = format!("upstream: {{ url: http://127.0.0.1:9 }}\n{extra}");
        let p = write(dir.path(), free_port(), "127.0.0.1:0", &body, RULES);
        let at = format!("{}:{pos}", p.display());
        let out = check(&p, &[]);
        assert_eq!(out.status.code(), Some(1), "check passed {extra}");
        let err = text(&out.stderr);
        assert!(
            err.contains(&at) && err.contains(what),
            "check: {err} (want {at} {what})"
        );
        let err = run_refused(&p, &[]);
        assert!(err.contains(&at) && err.contains(what), "run: {err} (want {at} {what})");
    }
}

#[test]
fn check_output_never_shows_a_redis_password() {
    let dir = tempfile::tempdir().unwrap();
    let body = "upstream: { url: http://127.0.0.1:9 }\nstore:\n  kind: redis\n  urls: [\"redis://default:s3cr3t-pw@127.0.0.1:6379/0\"]\n";
    let p = write(dir.path(), free_port(), "127.0.0.1:0", body, RULES);
    let out = check(&p, &[]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let all = text(&out.stdout) + &text(&out.stderr);
    assert!(!all.contains("s3cr3t-pw"), "{all}");
    assert!(all.contains("redis://default:***@127.0.0.1:6379/0"), "{all}");
    // The same through the environment override.
    let out = check(&p, &[("TOLLGATE_REDIS_URL", "redis://u:env-pw@127.0.0.1:6380")]);
    let all = text(&out.stdout) + &text(&out.stderr);
    assert!(out.status.success(), "{all}");
    assert!(
        !all.contains("env-pw") && all.contains("redis://u:***@127.0.0.1:6380"),
        "{all}"
    );
    // A bad URL's error message is redacted too.
    let body = "upstream: { url: http://127.0.0.1:9 }\nstore:\n  kind: redis\n  urls: [\"default:s3cr3t-pw@127.0.0.1:6379\"]\n";
    let p = write(dir.path(), free_port(), "127.0.0.1:0", body, RULES);
    let out = check(&p, &[]);
    let all = text(&out.stdout) + &text(&out.stderr);
    assert_eq!(out.status.code(), Some(1));
    assert!(!all.contains("s3cr3t-pw"), "{all}");
}

/// One admin request with an optional `Authorization` value; returns (status, body).
fn admin_call(method: &str, url: &str, auth: Option<&str>) -> (u16, String) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let c = client();
        let m = reqwest::Method::from_bytes(method.as_bytes()).unwrap();
        let mut r = c.request(m, url);
        if let Some(a) = auth {
            r = r.header("authorization", a);
        }
        let resp = r.send().await.unwrap();
        let status = resp.status().as_u16();
        (status, resp.text().await.unwrap())
    })
}

fn basic(user: &str, password: &str) -> String {
    use base64::Engine;
    format!(
        "Basic {}",
        base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"))
    )
}

const TOKEN: &str = "tg-admin-7f3a9c0e5b1d";
const KEYS: &str =
    "keys:\n  - { id: cust_42, sha256: 2bb80d537b1da3e38bd30361aa855686bde0eacd7162fef6a25fe97bf527a25b, tier: pro }\n";
const USER_RULES: &str = "rules:\n  - { name: per-user, match: { path: \"/**\" }, key: user, limit: 5, window: 1m }\n";

#[test]
fn the_admin_token_guards_every_endpoint_but_health_readiness_and_metrics() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let up = echo_upstream(&rt);
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("keys.yaml"), KEYS).unwrap();
    let (port, admin_port) = (free_port(), free_port());
    let body = format!(
        "{}keys_file: keys.yaml\nadmin:\n  token_env: TOLLGATE_ADMIN_TOKEN\n",
        upstream_yaml(&up)
    );
    let p = write(dir.path(), port, &format!("127.0.0.1:{admin_port}"), &body, USER_RULES);
    let gw = run(&p, &[("TOLLGATE_ADMIN_TOKEN", TOKEN)], port, admin_port);
    let admin = format!("http://127.0.0.1:{admin_port}");

    for open in ["/healthz", "/readyz", "/metrics"] {
        assert_eq!(admin_call("GET", &format!("{admin}{open}"), None).0, 200, "{open}");
    }
    let wrong = [
        None,
        Some("Bearer wrong".to_string()),
        Some(format!("Bearer {}", &TOKEN[..TOKEN.len() - 1])),
        Some(format!("Bearer {TOKEN}x")),
        Some(basic("admin", "wrong")),
        Some(format!("Token {TOKEN}")),
    ];
    let right = [format!("Bearer {TOKEN}"), basic("admin", TOKEN), basic("", TOKEN)];
    let protected = [
        ("GET", "/rules"),
        ("GET", "/status"),
        ("GET", "/explain?method=GET&path=/x"),
        ("GET", "/keys/cust_42"),
        ("DELETE", "/keys/cust_42"),
        ("POST", "/reload"),
        ("GET", "/no-such-endpoint"),
    ];
    for (m, path) in protected {
        let url = format!("{admin}{path}");
        for w in &wrong {
            let (s, body) = admin_call(m, &url, w.as_deref());
            assert_eq!(s, 401, "{m} {path} with {w:?}: {body}");
            let v: serde_json::Value = serde_json::from_str(&body).unwrap();
            assert_eq!(v["error"], "unauthorized");
        }
        for r in &right {
            let (s, body) = admin_call(m, &url, Some(r));
            let want = if path == "/no-such-endpoint" { 404 } else { 200 };
            assert_eq!(s, want, "{m} {path} with the right token ({r}): {body}");
        }
    }
    // The audit log names the caller and what changed, never the token.
    let log = eventually_some_blocking(Duration::from_secs(5), || {
        let l = gw.log();
        (l.contains("\"action\":\"reset\"") && l.contains("\"action\":\"reload\"")).then_some(l)
    })
    .unwrap_or_else(|| panic!("no audit lines: {}", gw.log()));
    let audit: Vec<&str> = log.lines().filter(|l| l.contains("tollgate::audit")).collect();
    assert!(
        audit
            .iter()
            .any(|l| l.contains("\"action\":\"reload\"") && l.contains("\"caller\":\"127.0.0.1:")),
        "{audit:?}"
    );
    assert!(
        audit
            .iter()
            .any(|l| l.contains("\"action\":\"reset\"") && l.contains("\"caller\":\"127.0.0.1:")),
        "{audit:?}"
    );
    assert!(
        !log.contains(TOKEN) && !log.contains(&TOKEN[..TOKEN.len() - 1]),
        "a token reached the log"
    );
    let (_, metrics) = admin_call("GET", &format!("{admin}/metrics"), None);
    assert!(!metrics.contains(TOKEN));
}

#[test]
fn an_exposed_admin_listener_needs_a_token_or_insecure_true() {
    let dir = tempfile::tempdir().unwrap();
    let (port, admin_port) = (free_port(), free_port());
    let admin = format!("0.0.0.0:{admin_port}");
    let p = write(
        dir.path(),
        port,
        &admin,
        "upstream: { url: http://127.0.0.1:9 }\n",
        RULES,
    );
    let at = format!(
        "{}:2:15: admin_listen 0.0.0.0:{admin_port} is not a loopback address",
        p.display()
    );
    let out = check(&p, &[]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains(&at), "{} (want {at})", text(&out.stderr));
    let err = run_refused(&p, &[]);
    assert!(err.contains(&at), "run: {err} (want {at})");

    // A token_env naming an unset variable is refused too (never "no token").
    let p = write(
        dir.path(),
        port,
        &admin,
        "upstream: { url: http://127.0.0.1:9 }\nadmin: { token_env: TOLLGATE_ADMIN_TOKEN }\n",
        RULES,
    );
    let err = run_refused(&p, &[]);
    assert!(
        err.contains(&format!("{}:4:21: admin.token_env", p.display())) && err.contains("not set"),
        "{err}"
    );
    let out = check(&p, &[("TOLLGATE_ADMIN_TOKEN", TOKEN)]);
    assert!(out.status.success(), "{}", text(&out.stderr));

    // insecure: true starts, open, and says so at every start.
    let p = write(
        dir.path(),
        port,
        &admin,
        "upstream: { url: http://127.0.0.1:9 }\nadmin: { insecure: true }\n",
        RULES,
    );
    let out = check(&p, &[]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).contains("admin.insecure: true"),
        "{}",
        text(&out.stdout)
    );
    for _ in 0..2 {
        let gw = run(&p, &[], port, admin_port);
        let warned = eventually_some_blocking(Duration::from_secs(5), || {
            gw.log()
                .lines()
                .any(|l| l.contains("\"level\":\"WARN\"") && l.contains("admin.insecure: true"))
                .then_some(())
        });
        assert!(warned.is_some(), "no warning: {}", gw.log());
        let (s, _) = admin_call("GET", &format!("http://127.0.0.1:{admin_port}/rules"), None);
        assert_eq!(s, 200);
        drop(gw);
    }
}

#[test]
fn reloads_report_key_changes_success_and_a_stale_gateway_file() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let up = echo_upstream(&rt);
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("keys.yaml"), KEYS).unwrap();
    let (port, admin_port) = (free_port(), free_port());
    let body = format!("{}keys_file: keys.yaml\n", upstream_yaml(&up));
    let p = write(dir.path(), port, &format!("127.0.0.1:{admin_port}"), &body, USER_RULES);
    let gw = run(&p, &[], port, admin_port);
    let admin = format!("http://127.0.0.1:{admin_port}");
    let m = admin_call("GET", &format!("{admin}/metrics"), None).1;
    assert_eq!(metric(&m, "tollgate_last_reload_success").as_deref(), Some("1"), "{m}");
    let t0: u64 = metric(&m, "tollgate_last_reload_success_timestamp_seconds")
        .unwrap()
        .parse()
        .unwrap();
    assert!(t0 > 1_700_000_000, "{t0}");

    // Adding a key (rules untouched) is a change.
    let two_keys = format!("{KEYS}  - {{ id: cust_43, sha256: {}, tier: free }}\n", "a".repeat(64));
    atomic_write(&dir.path().join("keys.yaml"), &two_keys);
    let (s, body) = admin_call("POST", &format!("{admin}/reload"), None);
    assert_eq!(s, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["changed"], true, "{v}");
    assert_eq!(v["keys"]["added"], 1, "{v}");
    assert_eq!(v["rules"]["added"], 0, "{v}");
    let logged = eventually_some_blocking(Duration::from_secs(5), || {
        gw.log()
            .lines()
            .any(|l| {
                l.contains("rules and keys reloaded")
                    && l.contains("\"changed\":true")
                    && l.contains("\"keys_added\":1")
            })
            .then_some(())
    });
    assert!(logged.is_some(), "{}", gw.log());
    let m = admin_call("GET", &format!("{admin}/metrics"), None).1;
    assert_eq!(
        metric(&m, "tollgate_reload_changes_total{file=\"keys\",change=\"added\"}").as_deref(),
        Some("1"),
        "{m}"
    );

    // The rules that changed are named, in the answer and the log.
    let edited = "rules:\n  - { name: per-user, match: { path: \"/**\" }, key: user, limit: 6, window: 1m }\n  - { name: per-ip, match: { path: \"/**\" }, key: ip, limit: 60, window: 1m }\n";
    atomic_write(&dir.path().join("rules.yaml"), edited);
    let (s, body) = admin_call("POST", &format!("{admin}/reload"), None);
    assert_eq!(s, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["rule_names"]["added"], serde_json::json!(["per-ip"]), "{v}");
    assert_eq!(v["rule_names"]["changed"], serde_json::json!(["per-user"]), "{v}");
    let logged = eventually_some_blocking(Duration::from_secs(5), || {
        gw.log()
            .lines()
            .any(|l| {
                l.contains("rules and keys reloaded")
                    && l.contains("\"added\":\"per-ip\"")
                    && l.contains("\"changed_rules\":\"per-user\"")
            })
            .then_some(())
    });
    assert!(logged.is_some(), "{}", gw.log());

    // A refused reload flips the success gauge, and its audit line says why.
    atomic_write(&dir.path().join("rules.yaml"), "rules: [ {");
    let (s, _) = admin_call("POST", &format!("{admin}/reload"), None);
    assert_eq!(s, 422);
    let audited = eventually_some_blocking(Duration::from_secs(5), || {
        gw.log()
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .find(|v| v["target"] == "tollgate::audit" && v["ok"] == false)
    })
    .unwrap_or_else(|| panic!("no audit line for the refused reload: {}", gw.log()));
    assert!(
        audited["error"].as_str().is_some_and(|e| e.contains("rules.yaml")),
        "{audited}"
    );
    let m = admin_call("GET", &format!("{admin}/metrics"), None).1;
    assert_eq!(metric(&m, "tollgate_last_reload_success").as_deref(), Some("0"), "{m}");
    atomic_write(&dir.path().join("rules.yaml"), USER_RULES);
    let (s, body) = admin_call("POST", &format!("{admin}/reload"), None);
    assert_eq!(s, 200, "{body}");
    let m = admin_call("GET", &format!("{admin}/metrics"), None).1;
    assert_eq!(metric(&m, "tollgate_last_reload_success").as_deref(), Some("1"), "{m}");

    // Editing gateway.yaml is not applied live, and says so.
    let m = admin_call("GET", &format!("{admin}/metrics"), None).1;
    assert_eq!(metric(&m, "tollgate_config_file_changed").as_deref(), Some("0"), "{m}");
    let text = std::fs::read_to_string(&p).unwrap() + "limits: { deny_cache: false }\n";
    atomic_write(&p, &text);
    let stale = eventually_some_blocking(Duration::from_secs(5), || {
        let m = admin_call("GET", &format!("{admin}/metrics"), None).1;
        (metric(&m, "tollgate_config_file_changed").as_deref() == Some("1")).then_some(())
    });
    assert!(stale.is_some(), "an edited gateway.yaml went unnoticed");
    assert!(
        gw.log()
            .lines()
            .any(|l| l.contains("\"level\":\"WARN\"") && l.contains("gateway config file changed on disk")),
        "{}",
        gw.log()
    );
}

#[test]
fn keys_endpoint_answers_404_for_unknown_identities_and_lists_only_applicable_rules() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let up = echo_upstream(&rt);
    let dir = tempfile::tempdir().unwrap();
    let keys = "keys:\n  - { id: cust_42, sha256: 2bb80d537b1da3e38bd30361aa855686bde0eacd7162fef6a25fe97bf527a25b, tier: pro, org: acme }\n";
    std::fs::write(dir.path().join("keys.yaml"), keys).unwrap();
    let rules = "rules:\n  - { name: per-user, match: { path: \"/**\" }, key: user, limit: 5, window: 1m }\n  - { name: per-ip, match: { path: \"/**\" }, key: ip, limit: 50, window: 1m }\n  - { name: per-org, match: { path: \"/**\" }, key: org, algorithm: token_bucket, rate: 10/s, capacity: 100 }\n  - { name: free-only, match: { path: \"/**\", tier: free }, key: user, limit: 3, window: 1m }\n";
    let (port, admin_port) = (free_port(), free_port());
    let body = format!("{}keys_file: keys.yaml\n", upstream_yaml(&up));
    let p = write(dir.path(), port, &format!("127.0.0.1:{admin_port}"), &body, rules);
    let _gw = run(&p, &[], port, admin_port);
    let admin = format!("http://127.0.0.1:{admin_port}");
    rt.block_on(async {
        let c = client();
        for _ in 0..2 {
            let r = c
                .get(format!("http://127.0.0.1:{port}/x"))
                .header("x-api-key", "secret")
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
        }
    });
    let rules_of = |who: &str| -> (String, Vec<String>) {
        let (s, body) = admin_call("GET", &format!("{admin}/keys/{who}"), None);
        assert_eq!(s, 200, "{who}: {body}");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        let names = v["counters"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["rule"].as_str().unwrap().to_string())
            .collect();
        (body, names)
    };
    let (body, names) = rules_of("cust_42");
    assert_eq!(names, ["per-user"], "only user rules, and not the free tier's: {body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["counters"][0]["remaining"], 3, "{v}");
    assert_eq!(v["identity"], "api_key");
    assert_eq!(rules_of("127.0.0.1").1, ["per-user", "per-ip"]);
    let (body, names) = rules_of("acme");
    assert_eq!(names, ["per-org"], "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        v["counters"][0]["rate"], "10/s",
        "a bucket shows rate and capacity: {v}"
    );
    assert_eq!(v["counters"][0]["capacity"], 100);

    for m in ["GET", "DELETE"] {
        let (s, body) = admin_call(m, &format!("{admin}/keys/cust_4"), None);
        assert_eq!(s, 404, "{m} of a typo: {body}");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["error"], "unknown_identity");
    }
    let (s, body) = admin_call("DELETE", &format!("{admin}/keys/cust_42"), None);
    assert_eq!(s, 200, "{body}");
    let (body, _) = rules_of("cust_42");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["counters"][0]["remaining"], 5, "reset: {v}");
}

#[test]
fn outage_logs_are_throttled_name_their_target_and_hide_passwords_and_queries() {
    let dir = tempfile::tempdir().unwrap();
    let (port, admin_port) = (free_port(), free_port());
    let (dead_upstream, dead_redis) = (free_port(), free_port());
    let body = format!(
        "upstream:\n  url: http://127.0.0.1:{dead_upstream}\n  connect_timeout: 200ms\nstore:\n  kind: redis\n  urls: [\"redis://default:hunter2-pw@127.0.0.1:{dead_redis}\"]\n  timeout: 20ms\n"
    );
    let p = write(dir.path(), port, &format!("127.0.0.1:{admin_port}"), &body, RULES);
    let gw = run(&p, &[], port, admin_port);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let c = client();
        let t0 = std::time::Instant::now();
        let mut n = 0;
        // Long enough for several connection rebuilds (at most one per 500 ms).
        while t0.elapsed() < Duration::from_millis(1800) {
            let r = c
                .get(format!("http://127.0.0.1:{port}/open/thing?token=query-secret"))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 502, "fail open, then the dead upstream");
            n += 1;
        }
        assert!(n > 20, "{n}");
    });
    let log = gw.log();
    assert!(!log.contains("hunter2-pw"), "a Redis password reached the log");
    assert!(!log.contains("query-secret"), "a query string reached the log");
    let upstream: Vec<&str> = log.lines().filter(|l| l.contains("upstream request failed")).collect();
    assert!(!upstream.is_empty() && upstream.len() <= 3, "{upstream:?}");
    let first = upstream[0];
    for want in [
        "\"method\":\"GET\"",
        "\"path\":\"/open/thing\"",
        &format!("\"upstream\":\"http://127.0.0.1:{dead_upstream}\""),
    ] {
        assert!(first.contains(want), "{first} (want {want})");
    }
    let start = log
        .lines()
        .find(|l| l.contains("unreachable at start-up"))
        .unwrap_or_else(|| panic!("{log}"));
    assert!(
        start.contains(&format!("redis://default:***@127.0.0.1:{dead_redis}")),
        "{start}"
    );
    let rebuilds: Vec<&str> = log.lines().filter(|l| l.contains("rebuild failed")).collect();
    assert_eq!(
        rebuilds.len(),
        1,
        "rebuild failures are logged once, then throttled: {rebuilds:?}"
    );
    if let Some(l) = rebuilds.first() {
        assert!(l.contains("default:***@"), "{l}");
    }
}

#[test]
fn check_shows_each_rule_in_plain_words() {
    let dir = tempfile::tempdir().unwrap();
    let rules = "rules:\n  - { name: uploads, match: { path: \"/up/*\", methods: [POST], tier: pro }, key: user, algorithm: token_bucket, rate: 10/s, capacity: 100, failure: closed, shadow: true }\n  - { name: per-ip, match: { path: \"/**\" }, key: ip, limit: 5, window: 15m, failure: local, local_share: 3 }\n";
    let p = write(
        dir.path(),
        free_port(),
        "127.0.0.1:0",
        "upstream: { url: http://127.0.0.1:9 }\nstore: { kind: redis, urls: [\"redis://127.0.0.1:6379\"], timeout: 15ms }\n",
        rules,
    );
    let out = check(&p, &[]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{}", text(&out.stderr));
    for want in [
        "uploads: /up/* token_bucket key=user rate 10/s, capacity 100 [shadow] methods=POST tier=pro failure=closed",
        "per-ip: /** sliding_window key=ip 5 per 15m [enforced] methods=any tier=any failure=local (share 3)",
        "store redis redis://127.0.0.1:6379, timeout 15ms",
        "admin  127.0.0.1:0 (no token, loopback only)",
    ] {
        assert!(stdout.contains(want), "{stdout}\n(want {want})");
    }
    for debug in ["Some(", "None", "Redis {", "Memory", "\"", "{ "] {
        assert!(!stdout.contains(debug), "Rust debug syntax {debug:?} in: {stdout}");
    }
}

#[test]
fn each_request_is_counted_once_by_how_it_ended_and_removed_rules_lose_their_series() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let up = echo_upstream(&rt);
    let dir = tempfile::tempdir().unwrap();
    let rules = "rules:\n  - { name: per-ip, match: { path: \"/**\" }, key: ip, limit: 2, window: 1m }\n  - { name: per-user, match: { path: \"/**\" }, key: user, limit: 100, window: 1m }\n  - { name: doomed, match: { path: \"/d/**\" }, key: global, limit: 100, window: 1m }\n";
    let (port, admin_port) = (free_port(), free_port());
    let p = write(
        dir.path(),
        port,
        &format!("127.0.0.1:{admin_port}"),
        &upstream_yaml(&up),
        rules,
    );
    let _gw = run(&p, &[], port, admin_port);
    let admin = format!("http://127.0.0.1:{admin_port}");
    let codes: Vec<u16> = rt.block_on(async {
        let c = client();
        let mut v = Vec::new();
        for path in ["/a", "/status/404", "/b", "/c"] {
            v.push(
                c.get(format!("http://127.0.0.1:{port}{path}"))
                    .send()
                    .await
                    .unwrap()
                    .status()
                    .as_u16(),
            );
        }
        v
    });
    assert_eq!(codes, [200, 404, 429, 429]);
    let m = admin_call("GET", &format!("{admin}/metrics"), None).1;
    let count = |result: &str| -> u64 {
        metric(&m, &format!("tollgate_responses_total{{result=\"{result}\"}}"))
            .unwrap_or_else(|| panic!("no {result}: {m}"))
            .parse()
            .unwrap()
    };
    assert_eq!(count("upstream_2xx"), 1, "{m}");
    assert_eq!(count("upstream_4xx"), 1);
    assert_eq!(count("rate_limited"), 2);
    let total: u64 = m
        .lines()
        .filter(|l| l.starts_with("tollgate_responses_total{"))
        .map(|l| l.rsplit(' ').next().unwrap().parse::<u64>().unwrap())
        .sum();
    assert_eq!(
        total, 4,
        "one count per request, whatever number of rules decided it: {m}"
    );
    // Rule decisions are still counted per rule, in their own metric.
    assert_eq!(
        metric(&m, "tollgate_requests_total{rule=\"per-ip\",decision=\"denied\"}").as_deref(),
        Some("2")
    );
    for present in [
        "tollgate_build_info{version=",
        "tollgate_open_connections ",
        "tollgate_memory_store_keys ",
        "tollgate_leaky_bucket_queued_requests 0",
        "\nprocess_resident_memory_bytes ",
        "\nprocess_cpu_seconds_total ",
        "\nprocess_open_fds ",
        "\nprocess_start_time_seconds ",
        "tollgate_request_duration_seconds_count ",
        "tollgate_request_overhead_seconds_count ",
        "tollgate_upstream_failures_total 0",
        "tollgate_requests_total{rule=\"doomed\"",
    ] {
        assert!(m.contains(present), "no {present}: {m}");
    }
    assert!(
        metric(&m, "tollgate_memory_store_keys")
            .unwrap()
            .parse::<u64>()
            .unwrap()
            >= 2,
        "{m}"
    );
    assert!(
        !m.contains("status=\"error\""),
        "the status label means a status class only"
    );
    // Four requests timed to their response head; two went upstream, so two overheads.
    assert_eq!(
        metric(&m, "tollgate_request_duration_seconds_count").as_deref(),
        Some("4"),
        "{m}"
    );
    assert_eq!(
        metric(&m, "tollgate_request_overhead_seconds_count").as_deref(),
        Some("2"),
        "{m}"
    );
    assert_eq!(m.matches("# EOF").count(), 1, "one exposition: {m}");
    // HEAD /metrics: the headers, no body.
    let (s, body) = admin_call("HEAD", &format!("{admin}/metrics"), None);
    assert_eq!((s, body.as_str()), (200, ""));

    // Remove a rule: its series go.
    let kept = rules
        .lines()
        .filter(|l| !l.contains("doomed"))
        .collect::<Vec<_>>()
        .join("\n")
        + "\n";
    atomic_write(&dir.path().join("rules.yaml"), &kept);
    let (s, body) = admin_call("POST", &format!("{admin}/reload"), None);
    assert_eq!(s, 200, "{body}");
    let m = admin_call("GET", &format!("{admin}/metrics"), None).1;
    assert!(!m.contains("rule=\"doomed\""), "{m}");
    assert!(m.contains("rule=\"per-ip\""));
}

#[test]
fn demo_runs_from_any_directory_and_hash_key_reads_stdin() {
    let elsewhere = tempfile::tempdir().unwrap();
    let (port, admin_port) = (free_port(), free_port());
    let log = elsewhere.path().join("demo.log");
    let mut cmd = tollgate(&[]);
    cmd.current_dir(elsewhere.path())
        .args(["demo", "--listen"])
        .arg(format!("127.0.0.1:{port}"))
        .arg("--admin-listen")
        .arg(format!("127.0.0.1:{admin_port}"));
    let demo = BinaryGateway::spawn(&mut cmd, log, &[port, admin_port]);
    assert_eq!(status_of(&format!("http://127.0.0.1:{port}/anything")), 200);
    let (s, rules) = admin_call("GET", &format!("http://127.0.0.1:{admin_port}/rules"), None);
    assert_eq!(s, 200);
    assert!(rules.contains("search-pro"), "the built-in demo rules: {rules}");
    drop(demo);

    // hash-key: argument, standard input, and an empty key refused either way.
    let want = "    sha256: 2bb80d537b1da3e38bd30361aa855686bde0eacd7162fef6a25fe97bf527a25b\n";
    let out = tollgate(&[]).args(["hash-key", "secret"]).output().unwrap();
    assert_eq!(text(&out.stdout), want);
    let hash_stdin = |input: &str| {
        use std::io::Write;
        let mut c = tollgate(&[])
            .arg("hash-key")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        c.stdin.take().unwrap().write_all(input.as_bytes()).unwrap();
        c.wait_with_output().unwrap()
    };
    let out = hash_stdin("secret\n");
    assert!(out.status.success());
    assert_eq!(text(&out.stdout), want);
    for empty in ["", "\n"] {
        let out = hash_stdin(empty);
        assert_eq!(out.status.code(), Some(1), "{empty:?}");
        assert!(text(&out.stderr).contains("empty key"), "{}", text(&out.stderr));
        assert!(out.stdout.is_empty());
    }
    let out = tollgate(&[]).args(["hash-key", ""]).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let help = tollgate(&[]).args(["hash-key", "--help"]).output().unwrap();
    assert!(text(&help.stdout).contains("standard input"), "{}", text(&help.stdout));
}

#[test]
fn a_rotated_jwt_public_key_is_picked_up_without_a_restart() {
    use jsonwebtoken::{encode, Algorithm, EncodingKey, Header};
    let rt = tokio::runtime::Runtime::new().unwrap();
    let up = echo_upstream(&rt);
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("jwt.pem"), jwt_fixture("rsa_public.pem")).unwrap();
    let (port, admin_port) = (free_port(), free_port());
    let body = format!(
        "{}identity:\n  jwt:\n    algorithms: [RS256, ES256]\n    public_key_file: jwt.pem\n",
        upstream_yaml(&up)
    );
    let p = write(dir.path(), port, &format!("127.0.0.1:{admin_port}"), &body, USER_RULES);
    let _gw = run(&p, &[], port, admin_port);
    let exp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        + 3600;
    let claims = serde_json::json!({"sub": "alice", "exp": exp});
    let rsa = encode(
        &Header::new(Algorithm::RS256),
        &claims,
        &EncodingKey::from_rsa_pem(&jwt_fixture("rsa_private.pem")).unwrap(),
    )
    .unwrap();
    let ec = encode(
        &Header::new(Algorithm::ES256),
        &claims,
        &EncodingKey::from_ec_pem(&jwt_fixture("ec_private_pk8.pem")).unwrap(),
    )
    .unwrap();
    let kind = |token: &str| -> String {
        let (s, body) = admin_call(
            "GET",
            &format!("http://127.0.0.1:{admin_port}/explain?path=/x"),
            Some(&format!("Bearer {token}")),
        );
        assert_eq!(s, 200, "{body}");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        v["identity"]["kind"].as_str().unwrap().to_string()
    };
    assert_eq!(kind(&rsa), "jwt");
    assert_eq!(kind(&ec), "ip", "not signed by the configured key");
    // Rotate: the file now holds the EC key (an editor's atomic rename).
    atomic_write(
        &dir.path().join("jwt.pem"),
        &String::from_utf8(jwt_fixture("ec_public.pem")).unwrap(),
    );
    let rotated = eventually_some_blocking(Duration::from_secs(5), || (kind(&ec) == "jwt").then_some(()));
    assert!(rotated.is_some(), "the new key was not picked up");
    assert_eq!(kind(&rsa), "ip", "the old key is gone");
    // A broken key file is refused and the current key stays.
    atomic_write(&dir.path().join("jwt.pem"), "not a key");
    let (s, _) = admin_call("POST", &format!("http://127.0.0.1:{admin_port}/reload"), None);
    assert_eq!(s, 422);
    assert_eq!(kind(&ec), "jwt");
}

/// The least-privilege ACL of docs/operations.md#redis-acl, for key prefix `tl`.
const LEAST_PRIVILEGE_ACL: &[&str] = &[
    "resetkeys",
    "~tl:*",
    "~{tl:*",
    "~tollgate:probe:*",
    "resetchannels",
    "-@all",
    "+fcall",
    "+function|load",
    "+evalsha",
    "+eval",
    "+time",
    "+type",
    "+get",
    "+set",
    "+del",
    "+exists",
    "+hset",
    "+hincrby",
    "+hmget",
    "+hgetall",
    "+hdel",
    "+pexpireat",
    "+zadd",
    "+zcard",
    "+zcount",
    "+zrange",
    "+zrangebyscore",
    "+zrem",
    "+zremrangebyscore",
    "+zrevrangebyscore",
    "+zscore",
    "+wait",
    "+cluster|slots",
    "+ping",
];

#[test]
fn a_redis_user_without_the_documented_acl_is_loud_and_the_documented_acl_is_enough() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let up = echo_upstream(&rt);
    let redis = RedisServer::start();
    let user = |name: &str, perms: &[&str]| {
        let mut args = vec!["ACL", "SETUSER", name, "reset", "on", ">s3cret-acl"];
        args.extend_from_slice(perms);
        assert_eq!(redis.cli(&args).trim(), "OK");
    };
    user("least", LEAST_PRIVILEGE_ACL);
    // The set the old docs gave: enough to call the script, not for what it does.
    user("old", &["~*", "+fcall", "+function|load"]);
    // Every algorithm, so every command the scripts run is exercised.
    let rules = r#"rules:
  - { name: log, match: { path: "/log" }, key: ip, algorithm: sliding_log, limit: 3, window: 1m, failure: open }
  - { name: fixed, match: { path: "/fixed" }, key: ip, algorithm: fixed_window, limit: 3, window: 1m, failure: open }
  - { name: sliding, match: { path: "/sliding" }, key: ip, algorithm: sliding_window, limit: 3, window: 1m, failure: open }
  - { name: bucket, match: { path: "/bucket" }, key: ip, algorithm: token_bucket, rate: 1/h, capacity: 3, failure: open }
  - { name: slots, match: { path: "/slots" }, key: ip, algorithm: concurrency, limit: 3, failure: open }
  - { name: leaky, match: { path: "/leaky" }, key: ip, algorithm: leaky_bucket, rate: 100/s, capacity: 3, failure: open }
"#;
    let start = |name: &str| {
        let dir = tempfile::tempdir().unwrap();
        let (port, admin_port) = (free_port(), free_port());
        let body = format!(
            "{}store:\n  kind: redis\n  urls: [\"redis://{name}@127.0.0.1:{}\"]\n  password_env: TL_ACL_PASSWORD\n  timeout: 200ms\n",
            upstream_yaml(&up),
            redis.port()
        );
        let p = write(dir.path(), port, &format!("127.0.0.1:{admin_port}"), &body, rules);
        let gw = run(&p, &[("TL_ACL_PASSWORD", "s3cret-acl")], port, admin_port);
        (
            dir,
            gw,
            format!("http://127.0.0.1:{port}"),
            format!("http://127.0.0.1:{admin_port}"),
        )
    };

    // The documented ACL: every check decided in Redis, exactly, and ready.
    let (_d1, gw1, base, admin) = start("least");
    for path in ["log", "fixed", "sliding", "bucket"] {
        let codes: Vec<u16> = (0..5).map(|_| status_of(&format!("{base}/{path}"))).collect();
        assert_eq!(codes, [200, 200, 200, 429, 429], "{path}: {}", gw1.log());
    }
    for path in ["slots", "leaky"] {
        assert_eq!(status_of(&format!("{base}/{path}")), 200, "{path}");
    }
    let m = rt.block_on(metric_value(
        &client(),
        &admin,
        "tollgate_store_permission_errors_total",
    ));
    assert_eq!(m, 0.0);
    assert!(!gw1.log().contains("lacks a permission"), "{}", gw1.log());
    assert_eq!(status_of(&format!("{admin}/readyz")), 200);
    assert!(!gw1.log().contains("NOPERM"), "{}", gw1.log());

    // Too few permissions: checks fail open (as the rule says), but loudly: an ERROR line,
    // /readyz fails for that reason, and the metric counts it.
    let (_d2, gw2, base2, admin2) = start("old");
    let noticed = eventually_some_blocking(Duration::from_secs(5), || {
        (status_of(&format!("{admin2}/readyz")) == 503).then_some(())
    });
    assert!(
        noticed.is_some(),
        "a NOPERM Redis user left /readyz green: {}",
        gw2.log()
    );
    let log = gw2.log();
    let line = log
        .lines()
        .find(|l| l.contains("lacks a permission") && l.contains("\"ERROR\""))
        .unwrap_or_else(|| panic!("no ERROR line naming the permission: {log}"));
    assert!(!line.contains("s3cret-acl"), "{line}");
    assert_eq!(status_of(&format!("{base2}/log")), 200, "failure: open still serves");
    let m = rt.block_on(metric_value(
        &client(),
        &admin2,
        "tollgate_store_permission_errors_total",
    ));
    assert!(m >= 1.0, "tollgate_store_permission_errors_total = {m}");
    let (_, body) = admin_call("GET", &format!("{admin2}/readyz"), None);
    assert!(body.contains("permission"), "{body}");

    // Granting the documented ACL clears it at the next check.
    user("old", LEAST_PRIVILEGE_ACL);
    let cleared = eventually_some_blocking(Duration::from_secs(8), || {
        (status_of(&format!("{admin2}/readyz")) == 200).then_some(())
    });
    assert!(
        cleared.is_some(),
        "/readyz stayed failed after the ACL was fixed: {}",
        gw2.log()
    );
}

#[test]
fn a_client_that_leaves_is_logged_and_counted_and_durations_cover_the_whole_body() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let up = rt.block_on(counting_upstream());
    let dir = tempfile::tempdir().unwrap();
    let (port, admin_port) = (free_port(), free_port());
    let body = format!(
        "{}access_log: true\n",
        upstream_yaml(&up.url()).replace("request_timeout: 2s", "request_timeout: 5s")
    );
    let p = write(
        dir.path(),
        port,
        &format!("127.0.0.1:{admin_port}"),
        &body,
        "rules: []\n",
    );
    let gw = run(&p, &[], port, admin_port);
    let (base, admin) = (
        format!("http://127.0.0.1:{port}"),
        format!("http://127.0.0.1:{admin_port}"),
    );
    let aborts = "tollgate_responses_total{result=\"client_abort\"}";
    rt.block_on(async {
        let c = reqwest::Client::builder()
            .timeout(Duration::from_millis(300))
            .build()
            .unwrap();
        // Gone before the response head: the upstream takes 2 s.
        assert!(c.get(format!("{base}/slow/2000")).send().await.is_err());
        // Gone mid-body: /stream sends a chunk every 100 ms for 30 s.
        let r = client().get(format!("{base}/stream")).send().await.unwrap();
        assert_eq!(r.status(), 200);
        let mut r = r;
        let _ = r.chunk().await;
        drop(r);
        // A whole response: its duration covers the body (1 chunk after a 300 ms head).
        assert_eq!(
            client()
                .get(format!("{base}/slow/300"))
                .header("user-agent", "ops-test/1")
                .send()
                .await
                .unwrap()
                .text()
                .await
                .unwrap(),
            "chunk\n"
        );
    });
    let lines = eventually_some_blocking(Duration::from_secs(5), || {
        let log = gw.log();
        let access: Vec<serde_json::Value> = log
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|v| v["target"] == "access")
            .collect();
        (access.len() >= 3).then_some(access)
    })
    .unwrap_or_else(|| panic!("no three access lines: {}", gw.log()));
    let find = |path: &str| {
        lines
            .iter()
            .find(|v| v["fields"]["path"] == path || v["path"] == path)
            .unwrap_or_else(|| panic!("no line for {path}: {lines:?}"))
            .clone()
    };
    let field = |v: &serde_json::Value, k: &str| {
        if v["fields"].is_object() {
            v["fields"][k].clone()
        } else {
            v[k].clone()
        }
    };
    let early = find("/slow/2000");
    assert_eq!(field(&early, "status"), 499, "{early}");
    assert_eq!(field(&early, "decision"), "client_aborted", "{early}");
    assert_eq!(field(&early, "client_aborted"), true, "{early}");
    let d = field(&early, "duration_ms").as_f64().unwrap();
    // The client gives up 300 ms after its timer started; the gateway's clock starts when the
    // head arrives, later by the connect and the send (245 ms seen on a loaded machine).
    assert!(
        (150.0..2000.0).contains(&d),
        "the real duration until the client left: {d}"
    );
    let mid = find("/stream");
    assert_eq!(field(&mid, "status"), 200, "{mid}");
    assert_eq!(field(&mid, "client_aborted"), true, "{mid}");
    let whole = find("/slow/300");
    assert_eq!(field(&whole, "client_aborted"), false, "{whole}");
    assert_eq!(field(&whole, "bytes_out"), 6, "{whole}");
    // Who, over what, and which trace.
    assert!(
        field(&whole, "client").as_str().unwrap_or("").starts_with("127.0.0.1:"),
        "{whole}"
    );
    assert_eq!(field(&whole, "protocol"), "HTTP/1.1", "{whole}");
    assert_eq!(field(&whole, "host"), format!("127.0.0.1:{port}"), "{whole}");
    assert_eq!(field(&whole, "user_agent"), "ops-test/1", "{whole}");
    let trace = field(&whole, "trace_id");
    assert!(
        trace
            .as_str()
            .is_some_and(|t| t.len() == 32 && t.bytes().all(|b| b.is_ascii_hexdigit())),
        "{whole}"
    );
    assert!(field(&whole, "duration_ms").as_f64().unwrap() >= 300.0, "{whole}");
    let n = rt.block_on(metric_value(&client(), &admin, aborts));
    assert_eq!(n, 1.0, "{aborts}");
}

/// A rule that fails open while its store is down: the request goes through, and its access
/// line says `fail_open` and names the rule, not `allowed` by no rule.
#[test]
fn a_fail_open_request_is_logged_as_fail_open_with_its_rule() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let up = echo_upstream(&rt);
    let dir = tempfile::tempdir().unwrap();
    let (port, admin_port) = (free_port(), free_port());
    // A Redis that is not there.
    let body = format!(
        "{}access_log: true\nstore:\n  kind: redis\n  urls: [\"redis://127.0.0.1:{}\"]\n  timeout: 50ms\n",
        upstream_yaml(&up),
        free_port()
    );
    let p = write(dir.path(), port, &format!("127.0.0.1:{admin_port}"), &body, RULES);
    let gw = run(&p, &[], port, admin_port);
    assert_eq!(status_of(&format!("http://127.0.0.1:{port}/open/x")), 200);
    let line = eventually_some_blocking(Duration::from_secs(5), || {
        gw.log()
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .find(|v| v["target"] == "access")
    })
    .unwrap_or_else(|| panic!("no access line: {}", gw.log()));
    let f = if line["fields"].is_object() {
        &line["fields"]
    } else {
        &line
    };
    assert_eq!(f["decision"], "fail_open", "{line}");
    assert_eq!(f["rule"], "open", "{line}");
    assert_eq!(f["status"], 200, "{line}");
}

/// `admin.token_file`: every token it lists is accepted, a `read-only` one only for GET and
/// HEAD, and an edit takes effect without a restart (old and new accepted while both lines are
/// in the file, the old refused once its line is gone). A file that stops loading keeps the
/// tokens read before.
#[test]
fn admin_tokens_rotate_through_the_token_file_and_read_only_tokens_only_read() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let up = echo_upstream(&rt);
    let dir = tempfile::tempdir().unwrap();
    let tokens = dir.path().join("admin-tokens");
    std::fs::write(
        &tokens,
        "# rotation: add the new line, move clients, drop the old one\nold-token-1\nread-only viewer-token\n",
    )
    .unwrap();
    let (port, admin_port) = (free_port(), free_port());
    let body = format!("{}admin:\n  token_file: admin-tokens\n", upstream_yaml(&up));
    let p = write(dir.path(), port, &format!("127.0.0.1:{admin_port}"), &body, USER_RULES);
    let gw = run(&p, &[], port, admin_port);
    let admin = format!("http://127.0.0.1:{admin_port}");
    let call =
        |m: &str, path: &str, tok: &str| admin_call(m, &format!("{admin}{path}"), Some(&format!("Bearer {tok}"))).0;
    assert_eq!(call("GET", "/status", "old-token-1"), 200);
    assert_eq!(call("POST", "/reload", "old-token-1"), 200);
    assert_eq!(call("GET", "/status", "viewer-token"), 200, "a read-only token reads");
    assert_eq!(
        call("POST", "/reload", "viewer-token"),
        403,
        "a read-only token changes nothing"
    );
    assert_eq!(call("DELETE", "/keys/cust_42", "viewer-token"), 403);
    assert_eq!(call("GET", "/status", "new-token-2"), 401);
    assert_eq!(admin_call("GET", &format!("{admin}/status"), None).0, 401);

    // Rotation: both accepted, then only the new one.
    atomic_write(&tokens, "old-token-1\nnew-token-2\nread-only viewer-token\n");
    assert!(
        eventually_blocking(Duration::from_secs(5), || call("GET", "/status", "new-token-2") == 200),
        "the new token was never accepted: {}",
        gw.log()
    );
    assert_eq!(
        call("GET", "/status", "old-token-1"),
        200,
        "both while both lines are there"
    );
    atomic_write(&tokens, "new-token-2\n");
    assert!(
        eventually_blocking(Duration::from_secs(5), || call("GET", "/status", "old-token-1") == 401),
        "the old token stayed accepted"
    );
    assert_eq!(call("POST", "/reload", "new-token-2"), 200);
    // A file that no longer loads keeps the tokens in force, and says so.
    atomic_write(&tokens, "\n# nothing\n");
    assert!(
        // (the file is looked at on admin requests, at most once a second)
        eventually_blocking(Duration::from_secs(5), || call("GET", "/status", "new-token-2") == 200
            && gw.log().contains("admin.token_file no longer loads")),
        "{}",
        gw.log()
    );
    assert_eq!(call("GET", "/status", "new-token-2"), 200);
    assert!(
        !gw.log().contains("new-token-2") && !gw.log().contains("viewer-token"),
        "tokens never reach the log"
    );
}

/// `tollgate config`: the settings in force, each with where it came from; an environment
/// override is named, a Redis password never shown.
#[test]
fn config_prints_each_setting_with_its_source_and_no_secret() {
    let dir = tempfile::tempdir().unwrap();
    let body = "upstream: { url: http://127.0.0.1:9 }\nstore:\n  kind: redis\n  urls: [\"redis://:hunter2@127.0.0.1:6379\"]\n  timeout: 30ms\n";
    let p = write(dir.path(), free_port(), "127.0.0.1:0", body, RULES);
    let out = tollgate(&[("TOLLGATE_LISTEN", "0.0.0.0:9999")])
        .args(["config", "--config"])
        .arg(&p)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let o = text(&out.stdout);
    let line = |name: &str| {
        o.lines()
            .find(|l| l.starts_with(&format!("{name}: ")))
            .unwrap_or_else(|| panic!("no {name}: {o}"))
            .to_string()
    };
    assert!(
        line("listen").contains("0.0.0.0:9999") && line("listen").ends_with("# env TOLLGATE_LISTEN"),
        "{o}"
    );
    assert!(
        line("store.timeout").contains("30ms") && line("store.timeout").contains("gateway.yaml:7:12"),
        "{o}"
    );
    assert!(line("server.drain").ends_with("# default"), "{o}");
    assert!(line("store.urls").contains("***") && !o.contains("hunter2"), "{o}");
}
