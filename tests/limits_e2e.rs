//! What clients and operators see, end to end on the memory store: headers on every limited
//! response, 429 bodies, shadow mode, leaky-bucket shaping, admin endpoints, metrics.

mod support;

use std::time::{Duration, Instant};

use support::*;

fn header(r: &reqwest::Response, name: &str) -> String {
    r.headers()
        .get(name)
        .map(|v| v.to_str().unwrap().to_string())
        .unwrap_or_default()
}

/// Parse `"name";r=12;t=41` into (name, r, t).
fn parse_ratelimit(v: &str) -> (String, u64, u64) {
    let mut parts = v.split(';');
    let name = parts.next().unwrap().trim_matches('"').to_string();
    let mut r = u64::MAX;
    let mut t = u64::MAX;
    for p in parts {
        if let Some(x) = p.strip_prefix("r=") {
            r = x.parse().unwrap();
        }
        if let Some(x) = p.strip_prefix("t=") {
            t = x.parse().unwrap();
        }
    }
    (name, r, t)
}

const LAYERED: &str = r#"
rules:
  - { name: per-ip, match: { path: "/**" }, key: ip, algorithm: fixed_window, limit: 100, window: 1h }
  - { name: search, match: { path: /search }, key: user, algorithm: sliding_log, limits: [ { limit: 3, window: 10s }, { limit: 50, window: 1h } ] }
"#;

/// `RateLimit-Policy` of the `search` rule of [`LAYERED`]: both windows, each named.
const SEARCH_POLICIES: &str = "\"search-10s\";q=3;w=10, \"search-1h\";q=50;w=3600";

#[tokio::test]
async fn every_limited_response_carries_the_binding_limit() {
    let up = echo().await;
    let gw = gateway(&format!("http://{up}"), "", LAYERED, None).await;
    let c = client();
    for i in 0..3u64 {
        let r = c.get(format!("{}/search", gw.url)).send().await.unwrap();
        assert_eq!(r.status(), 200);
        // Each window of the rule is a policy of its own (draft-ietf-httpapi-ratelimit-headers
        // -12: one definition per name); RateLimit names the binding one, the one with the
        // least remaining: the 3-per-10s window.
        assert_eq!(header(&r, "ratelimit-policy"), SEARCH_POLICIES);
        let (name, rem, t) = parse_ratelimit(&header(&r, "ratelimit"));
        assert_eq!((name.as_str(), rem), ("search-10s", 2 - i));
        assert!(t <= 10);
        assert_eq!(header(&r, "x-ratelimit-limit"), "3");
        assert_eq!(header(&r, "x-ratelimit-remaining"), (2 - i).to_string());
        let reset: u64 = header(&r, "x-ratelimit-reset").parse().unwrap();
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs();
        assert!(reset >= now && reset <= now + 11, "reset {reset} now {now}");
    }
    let r = c.get(format!("{}/search", gw.url)).send().await.unwrap();
    assert_eq!(r.status(), 429);
    let retry: u64 = header(&r, "retry-after").parse().unwrap();
    let (name, rem, t) = parse_ratelimit(&header(&r, "ratelimit"));
    assert_eq!((name.as_str(), rem), ("search-10s", 0));
    assert!((1..=10).contains(&retry));
    assert_eq!(t, retry, "RateLimit t agrees with Retry-After");
    assert_eq!(header(&r, "ratelimit-policy"), SEARCH_POLICIES);
    assert_eq!(header(&r, "content-type"), "application/json");
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(body["error"], "rate_limit_exceeded");
    assert_eq!(body["rule"], "search");
    assert_eq!(body["limit"], 3);
    assert_eq!(body["window"], "10s");
    assert_eq!(body["retry_after"], retry);
    assert!(body["reset_at"].as_str().unwrap().ends_with('Z'));
    assert!(body["message"].as_str().unwrap().contains("search"));
    // Another path: only the per-IP rule binds; its counter saw the 3 admitted + 1 more.
    let r = c.get(format!("{}/other", gw.url)).send().await.unwrap();
    assert_eq!(header(&r, "ratelimit-policy"), "\"per-ip\";q=100;w=3600");
    assert_eq!(
        parse_ratelimit(&header(&r, "ratelimit")).1,
        96,
        "3 admitted + this one; the denied request spent no per-IP quota"
    );
    gw.stop().await;
}

#[tokio::test]
async fn header_families_are_configurable() {
    let up = echo().await;
    let gw = gateway(&format!("http://{up}"), "limits:\n  headers: [ietf]\n", LAYERED, None).await;
    let r = client().get(format!("{}/x", gw.url)).send().await.unwrap();
    assert!(r.headers().contains_key("ratelimit"));
    assert!(!r.headers().contains_key("x-ratelimit-limit"));
    gw.stop().await;
    let gw = gateway(
        &format!("http://{up}"),
        "limits:\n  headers: [x-ratelimit]\n",
        LAYERED,
        None,
    )
    .await;
    let r = client().get(format!("{}/x", gw.url)).send().await.unwrap();
    assert!(!r.headers().contains_key("ratelimit"));
    assert!(r.headers().contains_key("x-ratelimit-remaining"));
    gw.stop().await;
}

#[tokio::test]
async fn a_client_following_the_headers_never_sees_a_429() {
    let up = echo().await;
    let rules =
        "rules:\n  - { name: w, match: { path: \"/**\" }, key: user, algorithm: fixed_window, limit: 4, window: 1s }\n";
    let gw = gateway(&format!("http://{up}"), "", rules, None).await;
    let c = client();
    let end = Instant::now() + Duration::from_millis(3500);
    let mut ok = 0;
    while Instant::now() < end {
        let r = c.get(format!("{}/x", gw.url)).send().await.unwrap();
        assert_eq!(r.status(), 200, "a well-behaved client got a 429");
        ok += 1;
        let (_, rem, t) = parse_ratelimit(&header(&r, "ratelimit"));
        if rem == 0 {
            // Not synchronisation: a well-behaved client waits out the window the headers name
            // (that is what is tested).
            tokio::time::sleep(Duration::from_secs(t)).await;
        }
    }
    assert!(ok >= 8, "made progress: {ok}");
    gw.stop().await;
}

#[tokio::test]
async fn shadow_rules_spend_and_report_but_never_reject() {
    let up = echo().await;
    let rules = "rules:\n  - { name: dark, match: { path: \"/**\" }, key: user, limit: 2, window: 1m, shadow: true }\n";
    let gw = gateway(&format!("http://{up}"), "", rules, None).await;
    let c = client();
    for _ in 0..6 {
        assert_eq!(c.get(format!("{}/x", gw.url)).send().await.unwrap().status(), 200);
    }
    let m = get_text(&c, format!("{}/metrics", gw.admin)).await;
    assert!(
        m.contains("tollgate_requests_total{rule=\"dark\",decision=\"would_deny\"} 4"),
        "{m}"
    );
    assert!(
        m.contains("tollgate_requests_total{rule=\"dark\",decision=\"allowed\"} 2"),
        "{m}"
    );
    gw.stop().await;
}

#[tokio::test]
async fn leaky_bucket_spaces_concurrent_requests_and_denies_past_capacity() {
    let up = echo().await;
    let rules = "rules:\n  - { name: shaper, match: { path: \"/**\" }, key: global, algorithm: leaky_bucket, rate: 5/s, capacity: 3 }\n";
    let gw = gateway(&format!("http://{up}"), "", rules, None).await;
    let c = client();
    let admitted = || async {
        metric_value(
            &c,
            &gw.admin,
            "tollgate_requests_total{rule=\"shaper\",decision=\"allowed\"}",
        )
        .await
    };
    let start = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..3 {
        let url = format!("{}/x", gw.url);
        tasks.push(tokio::spawn(async move {
            let r = client().get(url).send().await.unwrap();
            (r.status().as_u16(), start.elapsed())
        }));
        // One at a time: the next request is sent once the bucket has taken this one.
        let taken = eventually(Duration::from_secs(1), || async {
            admitted().await >= f64::from(i + 1)
        })
        .await;
        assert!(taken, "request {i} was not admitted into the bucket");
    }
    let fourth = client().get(format!("{}/x", gw.url)).send().await.unwrap();
    assert_eq!(fourth.status(), 429, "the queue is bounded by capacity");
    let mut done: Vec<(u16, Duration)> = Vec::new();
    for t in tasks {
        done.push(t.await.unwrap());
    }
    done.sort_by_key(|d| d.1);
    assert!(done.iter().all(|d| d.0 == 200));
    let ms: Vec<u128> = done.iter().map(|d| d.1.as_millis()).collect();
    assert!(ms[0] < 120, "{ms:?}");
    assert!((160..=330).contains(&ms[1]), "{ms:?}");
    assert!((360..=530).contains(&ms[2]), "{ms:?}");
    gw.stop().await;
}

#[tokio::test]
async fn a_client_that_leaves_the_queue_frees_its_slot() {
    let up = echo().await;
    let rules = "rules:\n  - { name: shaper, match: { path: \"/**\" }, key: global, algorithm: leaky_bucket, rate: 2/s, capacity: 2 }\n";
    let gw = gateway(&format!("http://{up}"), "", rules, None).await;
    let c = client();
    assert_eq!(c.get(format!("{}/x", gw.url)).send().await.unwrap().status(), 200);
    // The second waits ~500 ms; it gives up after 100 ms.
    let r = tokio::time::timeout(Duration::from_millis(100), c.get(format!("{}/x", gw.url)).send()).await;
    assert!(r.is_err(), "should still be queued");
    // The gateway noticed the client left: the waiting request is gone from the queue (its
    // drop is what gives the slot back).
    let left = eventually(Duration::from_secs(2), || async {
        metric_value(&c, &gw.admin, "tollgate_leaky_bucket_queued_requests").await == 0.0
    })
    .await;
    assert!(left, "the abandoned request is still queued");
    // Its slot was given back: the next request is admitted (with a delay), and so is one more.
    let t0 = Instant::now();
    let a = c.get(format!("{}/x", gw.url)).send().await.unwrap();
    assert_eq!(a.status(), 200);
    assert!(t0.elapsed() < Duration::from_millis(600), "{:?}", t0.elapsed());
    gw.stop().await;
}

#[tokio::test]
async fn admin_endpoints() {
    let up = echo().await;
    let keys = "keys:\n  - { id: cust_42, sha256: 2bb80d537b1da3e38bd30361aa855686bde0eacd7162fef6a25fe97bf527a25b, tier: pro }\n";
    let rules = "rules:\n  - { name: per-user, match: { path: \"/**\" }, key: user, limit: 5, window: 1m, overrides: { cust_42: { limit: 7 } } }\n";
    let gw = gateway(&format!("http://{up}"), "", rules, Some(keys)).await;
    let c = client();
    assert_eq!(
        c.get(format!("{}/healthz", gw.admin)).send().await.unwrap().status(),
        200
    );
    assert_eq!(
        c.get(format!("{}/readyz", gw.admin)).send().await.unwrap().status(),
        200
    );
    let v: serde_json::Value = get_json(&c, format!("{}/rules", gw.admin)).await;
    assert_eq!(v["rules"][0]["name"], "per-user");
    assert_eq!(v["version"].as_str().unwrap().len(), 16);
    assert!(v["loaded_at"].as_str().unwrap().ends_with('Z'));
    // "secret" is the key; its hash is in keys.yaml.
    for _ in 0..3 {
        c.get(format!("{}/x", gw.url))
            .header("x-api-key", "secret")
            .send()
            .await
            .unwrap();
    }
    let v: serde_json::Value = c
        .get(format!("{}/explain?method=GET&path=/x", gw.admin))
        .header("x-api-key", "secret")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v["identity"]["kind"], "api_key");
    assert_eq!(v["matches"][0]["rule"], "per-user");
    assert_eq!(v["matches"][0]["override"]["source"], "rules_file");
    assert_eq!(v["matches"][0]["limits"][0]["limit"], 7);
    let key = v["matches"][0]["limits"][0]["store_key"].as_str().unwrap();
    assert!(!key.contains("secret") && !key.contains("cust_42"), "{key}");
    let v: serde_json::Value = get_json(&c, format!("{}/keys/cust_42", gw.admin)).await;
    assert_eq!(v["counters"][0]["remaining"], 4, "{v}");
    assert!(!v.to_string().contains("secret"));
    let r = c.delete(format!("{}/keys/cust_42", gw.admin)).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let v: serde_json::Value = get_json(&c, format!("{}/keys/cust_42", gw.admin)).await;
    assert_eq!(v["counters"][0]["remaining"], 7, "reset restores the full quota: {v}");
    let r = c.post(format!("{}/reload", gw.admin)).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let m = get_text(&c, format!("{}/metrics", gw.admin)).await;
    for needle in [
        "tollgate_requests_total{rule=\"per-user\",decision=\"allowed\"} 3",
        "tollgate_reloads_total{result=\"ok\"} 1",
        "tollgate_limit_check_duration_seconds_bucket",
        "tollgate_upstream_responses_total{status=\"2xx\"} 3",
        "tollgate_rules_info{version=",
    ] {
        assert!(m.contains(needle), "missing {needle}");
    }
    // The per-target upstream series name the configured upstream (here on 127.0.0.1 too), never
    // a caller: every other line must hold no address, key id or secret.
    let callers: String = m
        .lines()
        .filter(|l| !l.starts_with("tollgate_upstream_target_"))
        .collect();
    assert!(
        !callers.contains("127.0.0.1") && !m.contains("cust_42") && !m.contains("secret"),
        "no identity in metrics"
    );
    assert_eq!(c.get(format!("{}/nope", gw.admin)).send().await.unwrap().status(), 404);
    gw.stop().await;
}

/// Every value of header `name`, in order.
fn all_of(r: &reqwest::Response, name: &str) -> Vec<String> {
    r.headers()
        .get_all(name)
        .iter()
        .map(|v| v.to_str().unwrap().to_owned())
        .collect()
}

#[tokio::test]
async fn an_upstreams_own_ratelimit_fields_are_kept_beside_tollgates() {
    // The counting upstream's `/ratelimit` answers with its own RateLimit and RateLimit-Policy.
    let up = counting_upstream().await;
    let rules = "rules:\n  - { name: gate, match: { path: \"/**\" }, key: ip, algorithm: fixed_window, limit: 10, window: 1m }\n";
    let gw = gateway(&up.url(), "", rules, None).await;
    let c = client();
    let r = c.get(format!("{}/ratelimit", gw.url)).send().await.unwrap();
    assert_eq!(r.status(), 200);
    // draft-ietf-httpapi-ratelimit-headers-12 §5.3: an intermediary does not remove them; both
    // are lists, so tollgate's policy follows as another member.
    assert_eq!(
        all_of(&r, "ratelimit-policy"),
        ["\"origin\";q=100;w=3600", "\"gate\";q=10;w=60"]
    );
    let limits = all_of(&r, "ratelimit");
    assert_eq!(limits.len(), 2, "{limits:?}");
    assert_eq!(limits[0], "\"origin\";r=7;t=1200");
    assert_eq!(parse_ratelimit(&limits[1]).0, "gate");
    assert_eq!(parse_ratelimit(&limits[1]).1, 9);
    gw.stop().await;
}

#[tokio::test]
async fn a_concurrency_policy_names_its_quota_unit() {
    let up = counting_upstream().await;
    let rules = "rules:\n  - { name: inflight, match: { path: \"/**\" }, key: ip, algorithm: concurrency, limit: 2 }\n";
    let gw = gateway(&up.url(), "", rules, None).await;
    let r = client().get(format!("{}/x", gw.url)).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(
        header(&r, "ratelimit-policy"),
        "\"inflight\";q=2;qu=\"concurrent-requests\""
    );
    assert_eq!(parse_ratelimit(&header(&r, "ratelimit")).0, "inflight");
    gw.stop().await;
}
