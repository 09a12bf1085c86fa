//! The admin dashboard in a real browser: headless Chromium (Debian's `chromium`, which
//! `./scripts/test` installs) loads the page of the real `tollgate` binary, the page's own JS
//! fetches `/dashboard.json` on its 2 s timer (`--virtual-time-budget` lets it run a few
//! refreshes), and the test reads the resulting DOM (`--dump-dom`). Without Chromium the test
//! fails; it never skips.
//!
//! The admin API has a token here, so the browser opens the page with HTTP Basic credentials
//! (any user name, the token as the password), as an operator's browser would.

mod support;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use support::*;

const TOKEN: &str = "dashboard-test-token";
/// The raw API key the client sends, and the id it maps to: neither may reach the page.
const API_KEY: &str = "sk-dashboard-raw-key-7f3a9c";
const KEY_ID: &str = "cust_dashboard_secret_id";

/// `per-key`: 5 per hour per caller (the API key), denies; `shadow-ip`: 3 per hour per IP, in
/// shadow (would deny, never denies); `everyone`: a global cap nobody reaches.
const RULES: &str = r#"rules:
  - { name: per-key, match: { path: "/api/**" }, key: user, algorithm: fixed_window, limit: 5, window: 1h }
  - { name: shadow-ip, match: { path: "/api/**" }, key: ip, algorithm: fixed_window, limit: 3, window: 1h, shadow: true }
  - { name: everyone, match: { path: "/**" }, key: global, algorithm: fixed_window, limit: 1000000, window: 1h }
"#;

/// The Chromium binary on PATH; panics (the test fails) when there is none.
fn chromium() -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    for name in ["chromium", "chromium-browser", "google-chrome"] {
        for dir in std::env::split_paths(&path) {
            let p = dir.join(name);
            if p.is_file() {
                return p;
            }
        }
    }
    panic!("no chromium on PATH: install Debian's `chromium` package (./scripts/test does)");
}

/// Run headless Chromium on `url` with `extra` arguments (`--dump-dom`, `--screenshot=…`) at
/// `width`×`height`, letting the page's timers run for `budget_ms` of virtual time; returns
/// stdout. Killed (and the test failed) after 60 s.
fn headless(url: &str, width: u32, height: u32, budget_ms: u32, extra: &[String]) -> String {
    let profile = tempfile::tempdir().unwrap();
    let out = profile.path().join("stdout");
    let mut child = Command::new(chromium())
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--no-default-browser-check",
            "--disable-extensions",
            "--hide-scrollbars",
        ])
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .arg(format!("--window-size={width},{height}"))
        .arg(format!("--virtual-time-budget={budget_ms}"))
        .args(extra)
        .arg(url)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out).unwrap())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let status = eventually_some_blocking(Duration::from_secs(60), || child.try_wait().unwrap());
    let Some(status) = status else {
        let _ = child.kill();
        let _ = child.wait();
        panic!("chromium did not finish within 60 s");
    };
    assert!(status.success(), "chromium failed: {status}");
    std::fs::read_to_string(&out).unwrap()
}

/// The text of the element that starts right after `marker` in serialised HTML.
fn text_after<'a>(dom: &'a str, marker: &str) -> Option<&'a str> {
    let at = dom.find(marker)? + marker.len();
    let rest = &dom[at..];
    Some(&rest[..rest.find('<')?])
}

/// A rule's total for `decision` as the page shows it.
fn shown(dom: &str, rule: &str, decision: &str) -> u64 {
    let marker = format!(r#"data-rule="{rule}" data-decision="{decision}">"#);
    let t = text_after(dom, &marker).unwrap_or_else(|| panic!("no {rule}/{decision} on the page:\n{dom}"));
    t.parse().unwrap_or_else(|_| panic!("{rule}/{decision}: {t:?}"))
}

/// A value of `/metrics`.
fn counted(metrics: &str, rule: &str, decision: &str) -> u64 {
    let name = format!(r#"tollgate_requests_total{{rule="{rule}",decision="{decision}"}}"#);
    metric(metrics, &name)
        .unwrap_or_else(|| panic!("{name} missing"))
        .parse()
        .unwrap()
}

/// The number of page refreshes the DOM records (`<body data-refreshes="N">`).
fn refreshes(dom: &str) -> u64 {
    let marker = "data-refreshes=\"";
    dom.find(marker)
        .and_then(|at| dom[at + marker.len()..].split('"').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// The per-rule request counters of a `/metrics` body.
fn rule_counters(metrics: &str) -> Vec<&str> {
    metrics
        .lines()
        .filter(|l| l.starts_with("tollgate_requests_total{"))
        .collect()
}

/// `target/<name>`: test artifacts beside the build (`CARGO_TARGET_TMPDIR` is `target/tmp`).
fn artifact(name: &str) -> PathBuf {
    let tmp = Path::new(env!("CARGO_TARGET_TMPDIR"));
    tmp.parent().unwrap_or(tmp).join(name)
}

/// A PNG screenshot of the page at `width`×`height`, saved as `target/<name>`.
fn screenshot(url: &str, name: &str, width: u32, height: u32) -> PathBuf {
    let path = artifact(name);
    let _ = std::fs::remove_file(&path);
    headless(url, width, height, 3000, &[format!("--screenshot={}", path.display())]);
    let png = std::fs::read(&path).unwrap_or_else(|e| panic!("no screenshot at {}: {e}", path.display()));
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n", "{} is not a PNG", path.display());
    // A blank page compresses to a few KB; the dashboard's text, tables and charts do not.
    assert!(
        png.len() > 20_000,
        "{} looks blank ({} bytes)",
        path.display(),
        png.len()
    );
    path
}

#[test]
fn dashboard_in_headless_chromium_matches_metrics_and_shows_no_identity() {
    let started = Instant::now();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let up = rt.block_on(echo());
    let dir = tempfile::tempdir().unwrap();
    let (port, rls_port, admin_port) = (free_port(), free_port(), free_port());
    let key_hash = {
        use sha2::{Digest, Sha256};
        hex::encode(Sha256::digest(API_KEY.as_bytes()))
    };
    std::fs::write(
        dir.path().join("keys.yaml"),
        format!("keys:\n  - {{ id: {KEY_ID}, sha256: {key_hash}, tier: pro }}\n"),
    )
    .unwrap();
    std::fs::write(dir.path().join("rules.yaml"), RULES).unwrap();
    // The Envoy rate-limit service too, with one domain: 2 a minute per tenant.
    std::fs::create_dir_all(dir.path().join("ratelimit")).unwrap();
    std::fs::write(
        dir.path().join("ratelimit").join("bench.yaml"),
        "domain: bench\ndescriptors:\n  - key: tenant\n    rate_limit: { unit: minute, requests_per_unit: 2 }\n",
    )
    .unwrap();
    let cfg = dir.path().join("gateway.yaml");
    std::fs::write(
        &cfg,
        format!(
            "listen: 127.0.0.1:{port}\nadmin_listen: 127.0.0.1:{admin_port}\nupstream:\n  url: http://{up}\nrules_file: rules.yaml\nkeys_file: keys.yaml\nadmin:\n  token_env: DASHBOARD_TEST_TOKEN\nrls:\n  listen: 127.0.0.1:{rls_port}\n  config_dir: ratelimit\n"
        ),
    )
    .unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tollgate"));
    cmd.args(["run", "--config"])
        .arg(&cfg)
        .env("DASHBOARD_TEST_TOKEN", TOKEN)
        .env("RUST_LOG", "info");
    let gw = BinaryGateway::spawn(&mut cmd, dir.path().join("tollgate.log"), &[port, rls_port, admin_port]);
    let c = client();
    let admin = gw.admin.clone();
    let page = format!("http://operator:{TOKEN}@127.0.0.1:{admin_port}/");

    // The page and its data need the token; the page is HTML with its assets inline.
    rt.block_on(async {
        for p in ["/", "/dashboard.json"] {
            let r = c.get(format!("{admin}{p}")).send().await.unwrap();
            assert_eq!(r.status(), 401, "{p} without the token");
            assert!(r
                .headers()
                .get_all("www-authenticate")
                .iter()
                .any(|v| v.to_str().unwrap().starts_with("Basic")));
        }
        let r = c.get(format!("{admin}/")).bearer_auth(TOKEN).send().await.unwrap();
        assert_eq!(r.status(), 200);
        assert!(r.headers()["content-type"].to_str().unwrap().starts_with("text/html"));
        let csp = r.headers()["content-security-policy"].to_str().unwrap().to_string();
        assert!(
            csp.contains("default-src 'none'") && csp.contains("connect-src 'self'"),
            "{csp}"
        );
        let html = r.text().await.unwrap();
        assert!(html.contains("<script>") && html.contains("<style>"));
        assert!(
            !html.contains("src=\"http") && !html.contains("href=\"http"),
            "no external assets"
        );
    });

    // Before any traffic: the page loads, refreshes on its timer, and shows zeros.
    let dom = headless(&page, 1280, 1200, 5000, &["--dump-dom".to_string()]);
    assert!(refreshes(&dom) >= 2, "the page did not refresh on its timer:\n{dom}");
    assert_eq!(shown(&dom, "per-key", "denied"), 0);
    assert!(dom.contains("no denials in the last 5 minutes"), "{dom}");

    // Traffic: 12 calls with the API key (5 allowed, 7 denied by `per-key`; `shadow-ip` would
    // deny from the 4th on), 3 without an /api path (only `everyone`).
    rt.block_on(async {
        let mut codes = Vec::new();
        for _ in 0..12 {
            let r = c
                .get(format!("{}/api/items", gw.url))
                .header("x-api-key", API_KEY)
                .send()
                .await
                .unwrap();
            codes.push(r.status().as_u16());
        }
        assert_eq!(codes.iter().filter(|&&s| s == 200).count(), 5, "{codes:?}");
        assert_eq!(codes.iter().filter(|&&s| s == 429).count(), 7, "{codes:?}");
        for _ in 0..3 {
            assert_eq!(c.get(format!("{}/other", gw.url)).send().await.unwrap().status(), 200);
        }
    });
    // A refused reload: the page lists it with its error.
    std::fs::write(
        dir.path().join("rules.yaml"),
        "rules:\n  - { name: broken, key: nonsense }\n",
    )
    .unwrap();
    rt.block_on(async {
        let r = c
            .post(format!("{admin}/reload"))
            .bearer_auth(TOKEN)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 422);
    });

    // Three calls of one tenant to the rate-limit service: 2 OK, the third over the limit.
    rt.block_on(async {
        let body = r#"{"domain":"bench","descriptors":[{"entries":[{"key":"tenant","value":"acme"}]}]}"#;
        for want in [200, 200, 429] {
            let r = c
                .post(format!("http://127.0.0.1:{rls_port}/json"))
                .header("content-type", "application/json")
                .body(body)
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), want);
        }
    });

    let metrics = rt.block_on(get_text(&c, format!("{admin}/metrics")));
    let dom = headless(&page, 1280, 1200, 5000, &["--dump-dom".to_string()]);
    let metrics_after = rt.block_on(get_text(&c, format!("{admin}/metrics")));
    assert_eq!(
        rule_counters(&metrics),
        rule_counters(&metrics_after),
        "traffic moved while the page loaded"
    );
    assert!(refreshes(&dom) >= 2, "{dom}");

    // Every rule's numbers on the page are those of /metrics.
    for rule in ["per-key", "shadow-ip", "everyone"] {
        for decision in ["allowed", "denied", "would_deny"] {
            assert_eq!(
                shown(&dom, rule, decision),
                counted(&metrics, rule, decision),
                "{rule}/{decision}: page vs /metrics"
            );
        }
    }
    // And they are the traffic above, so the comparison is not between two zeros.
    assert_eq!(shown(&dom, "per-key", "allowed"), 5);
    assert_eq!(shown(&dom, "per-key", "denied"), 7);
    // Calls 4 and 5 pass `per-key` and are over `shadow-ip` (later ones may be answered by
    // the deny cache of `per-key` alone).
    assert!(shown(&dom, "shadow-ip", "would_deny") >= 2);
    assert_eq!(shown(&dom, "everyone", "allowed"), 15);

    // The most limited hash is the caller's, as /keys reports it, with its rule and a detail
    // link; the identity itself (key, key id) appears nowhere on the page or in its data.
    let (hash, detail, json) = rt.block_on(async {
        let k = c
            .get(format!("{admin}/keys/{KEY_ID}"))
            .bearer_auth(TOKEN)
            .send()
            .await
            .unwrap();
        let hash = k.json::<serde_json::Value>().await.unwrap()["identity_hash"]
            .as_str()
            .unwrap()
            .to_string();
        let d = c
            .get(format!("{admin}/dashboard/limited/{hash}"))
            .bearer_auth(TOKEN)
            .send()
            .await
            .unwrap();
        assert_eq!(d.status(), 200);
        let detail: serde_json::Value = d.json().await.unwrap();
        let json = c
            .get(format!("{admin}/dashboard.json"))
            .bearer_auth(TOKEN)
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        (hash, detail, json)
    });
    assert!(
        dom.contains(&format!(r#"<tr data-limited="{hash}">"#)),
        "{hash} not listed:\n{dom}"
    );
    assert!(
        dom.contains(&format!(r#"href="/dashboard/limited/{hash}""#)),
        "no detail link for {hash}"
    );
    let row = &dom[dom.find(&format!(r#"<tr data-limited="{hash}">"#)).unwrap()..];
    let row = &row[..row.find("</tr>").unwrap()];
    assert!(row.contains(">per-key<") && row.contains(">7<"), "{row}");
    assert_eq!(detail["counters"][0]["rule"], "per-key");
    assert_eq!(detail["counters"][0]["remaining"], 0);
    for secret in [API_KEY, KEY_ID, key_hash.as_str()] {
        assert!(!dom.contains(secret), "{secret} on the page");
        assert!(!json.contains(secret), "{secret} in /dashboard.json");
    }

    // Reload history: the start, then the refused reload with its error.
    assert!(dom.contains(r#"<tr data-ok="false">"#), "no refused reload:\n{dom}");
    assert!(
        dom.contains("rules.yaml"),
        "the refused reload's error names its file:\n{dom}"
    );
    // Store and upstream.
    assert!(dom.contains("started: memory (ok)"), "{dom}");
    assert!(dom.contains(&format!(r#"data-upstream="http://{up}""#)), "{dom}");
    assert!(
        dom.contains("this target: ") && dom.contains("× since start"),
        "per-target figures:\n{dom}"
    );
    // The rate-limit service's domain, with its answers.
    assert!(dom.contains(r#"<li data-rls-domain="bench">"#), "rls domains:\n{dom}");
    assert!(
        dom.contains("2 calls OK · 1 over the limit · 1 descriptors over the limit since start"),
        "rls totals:\n{dom}"
    );
    // The recent-ejections list is rendered, empty: the one target was never taken out.
    assert!(
        dom.contains(r#"<ul id="ejections" class="targets"><li class="muted">no ejection since start</li></ul>"#),
        "recent ejections:\n{dom}"
    );

    // Screenshots: laptop and phone width (test artifacts in target/).
    let laptop = screenshot(&page, "dashboard.png", 1280, 1500);
    let phone = screenshot(&page, "dashboard-phone.png", 390, 2400);
    eprintln!(
        "dashboard test: {:.1} s; screenshots {} and {}",
        started.elapsed().as_secs_f64(),
        laptop.display(),
        phone.display()
    );
}

/// On Redis, the dashboard's store panel follows the breaker: a killed server opens it (state
/// `down`, an event in the history), a restarted one closes it again, each with a timestamp.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_history_records_the_breaker_opening_and_closing() {
    let mut redis = RedisServer::start();
    let up = echo().await;
    let store = format!(
        "store:\n  kind: redis\n  urls: [\"{}\"]\n  timeout: 20ms\n  probe_interval: 100ms\n",
        redis.url()
    );
    let rules = "rules:\n  - { name: open, match: { path: \"/**\" }, key: user, algorithm: fixed_window, limit: 1000000, window: 1h, failure: open }\n";
    let gw = gateway(&format!("http://{up}"), &store, rules, None).await;
    let c = client();
    let dash = format!("{}/dashboard.json", gw.admin);
    let state = |d: &serde_json::Value| d["store"]["state"].as_str().unwrap_or("").to_string();
    let events = |d: &serde_json::Value| -> Vec<String> {
        d["store"]["history"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["what"].as_str().unwrap().to_string())
            .collect()
    };
    let d = get_json(&c, &dash).await;
    assert_eq!(d["store"]["kind"], "redis");
    assert_eq!(d["upstreams"].as_array().unwrap().len(), 1);
    assert!(d["upstreams"][0]["responses_total"].as_u64().is_some(), "{d}");
    assert_eq!(d["upstreams"][0]["ejections_total"], 0, "{d}");

    redis.kill();
    // Requests fail open and open the breaker; the sampler notices within a second or two.
    let opened = eventually_some(Duration::from_secs(10), || {
        let (c, dash) = (c.clone(), dash.clone());
        let url = gw.url.clone();
        async move {
            let _ = c.get(format!("{url}/x")).send().await;
            let d = get_json(&c, &dash).await;
            (state(&d) == "down").then_some(d)
        }
    })
    .await
    .expect("the dashboard never showed the store down");
    assert!(
        events(&opened)[0].ends_with(": breaker opened"),
        "{:?}",
        events(&opened)
    );
    assert_eq!(opened["store"]["shards"][0]["breaker_open"], true);

    redis.restart();
    let closed = eventually_some(Duration::from_secs(15), || {
        let (c, dash) = (c.clone(), dash.clone());
        async move {
            let d = get_json(&c, &dash).await;
            (state(&d) == "ok").then_some(d)
        }
    })
    .await
    .expect("the dashboard never showed the store back");
    let ev = events(&closed);
    assert!(ev[0].ends_with("breaker closed, store answers again"), "{ev:?}");
    assert!(ev.iter().any(|e| e.ends_with(": breaker opened")), "{ev:?}");
    assert!(ev.last().unwrap().starts_with("started: "), "{ev:?}");
    gw.stop().await;
}

/// With `upstream.adaptive`, the page shows the limit, in flight, the limit's history as a chart
/// and the classes with their admissions and refusals, as `/status` reports them.
#[test]
fn adaptive_concurrency_card_shows_the_limit_history_and_the_classes() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let up = rt.block_on(echo());
    let dir = tempfile::tempdir().unwrap();
    let (port, admin_port) = (free_port(), free_port());
    std::fs::write(
        dir.path().join("rules.yaml"),
        "rules:\n  - { name: checkout, match: { path: \"/checkout\" }, key: global, limit: 1000000, window: 1h, priority: critical }\n  - { name: api, match: { path: \"/**\" }, key: global, limit: 1000000, window: 1h }\n",
    )
    .unwrap();
    let cfg = dir.path().join("gateway.yaml");
    std::fs::write(
        &cfg,
        format!(
            "listen: 127.0.0.1:{port}\nadmin_listen: 127.0.0.1:{admin_port}\nupstream:\n  url: http://{up}\n  adaptive: {{ min: 3, max: 50, initial: 7, window: 20ms, min_samples: 2 }}\nrules_file: rules.yaml\n"
        ),
    )
    .unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tollgate"));
    cmd.args(["run", "--config"]).arg(&cfg).env("RUST_LOG", "info");
    let gw = BinaryGateway::spawn(&mut cmd, dir.path().join("tollgate.log"), &[port, admin_port]);
    let c = client();
    // Traffic over more than a second: 5 critical requests and 30 default ones, so that windows
    // end and the history has points.
    rt.block_on(async {
        for i in 0..35 {
            let path = if i < 5 { "/checkout" } else { "/x" };
            let r = c.get(format!("{}{path}", gw.url)).send().await.unwrap();
            assert_eq!(r.status(), 200);
            tokio::time::sleep(Duration::from_millis(40)).await;
        }
    });
    let status = rt.block_on(get_json(&c, format!("{}/status", gw.admin)));
    let a = &status["adaptive"];
    assert_eq!(a["classes"][0]["admitted"], 5, "{status}");
    assert_eq!(a["classes"][1]["admitted"], 30, "{status}");
    assert!(!a["history"].as_array().unwrap().is_empty(), "{status}");
    let dom = headless(
        &format!("http://127.0.0.1:{admin_port}/"),
        1280,
        2000,
        2500,
        &["--dump-dom".into()],
    );
    assert!(refreshes(&dom) >= 1, "the page never rendered:\n{dom}");
    assert!(
        !dom.contains(r#"id="adaptive-card" hidden"#),
        "the adaptive card is hidden:\n{dom}"
    );
    let limit = text_after(&dom, r#"id="adaptive-limit">"#).unwrap_or_default();
    assert_eq!(limit, a["limit"].to_string(), "{dom}");
    let points: usize = dom
        .split(r#"data-points=""#)
        .nth(1)
        .and_then(|r| r.split('"').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    assert!(points >= 1, "no history points in the chart:\n{dom}");
    let admitted = |class: &str| {
        let row = dom
            .split(&format!(r#"data-class="{class}""#))
            .nth(1)
            .unwrap_or_default();
        text_after(row, r#"data-admitted="">"#).unwrap_or_default().to_string()
    };
    assert_eq!(admitted("critical"), "5", "{dom}");
    assert_eq!(admitted("default"), "30", "{dom}");
}
