//! Several upstream targets, against real parts: one killed under load (zero failed GETs, the
//! POSTs that failed got 502), passive ejection and return, the active health check, the
//! request id round trip, and the access log.

mod support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use support::*;

/// A gateway in front of `targets` with `upstream_extra` lines under `upstream:`.
async fn gateway_to(targets: &[String], upstream_extra: &str, extra: &str) -> TestGateway {
    let dir = tempfile::tempdir().unwrap();
    let p = write_config(dir.path(), "PLACEHOLDER", extra, OPEN_RULES, None);
    let text = std::fs::read_to_string(&p).unwrap().replace(
        "url: PLACEHOLDER",
        &format!("targets: [{}]\n{upstream_extra}", targets.join(", ")),
    );
    std::fs::write(&p, text).unwrap();
    gateway_from(&p, dir).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_targets_one_killed_under_load_no_get_fails_and_failed_posts_are_502() {
    let a = Instance::start().await;
    let b = Instance::start().await;
    let gw = gateway_to(&[a.url(), b.url()], "  eject_after: 3\n  eject_for: 10s\n", "").await;
    let c = client();
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for i in 0..6 {
        let (c, url, stop) = (c.clone(), gw.url.clone(), stop.clone());
        let post = i >= 4;
        tasks.push(tokio::spawn(async move {
            let mut statuses = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                let r = if post {
                    c.post(format!("{url}/slow/5")).body("payload").send().await
                } else {
                    c.get(format!("{url}/slow/5")).send().await
                };
                statuses.push(r.map(|r| r.status().as_u16()).unwrap_or(0));
            }
            (post, statuses)
        }));
    }
    assert!(
        eventually(Duration::from_secs(10), || async {
            a.served() >= 30 && b.served() >= 30
        })
        .await
    );
    a.kill();
    let b_at_kill = b.served();
    assert!(eventually(Duration::from_secs(20), || async { b.served() >= b_at_kill + 300 }).await);
    stop.store(true, Ordering::Relaxed);
    let (mut gets, mut posts, mut posts_502) = (0, 0, 0);
    for t in tasks {
        let (post, statuses) = t.await.unwrap();
        for s in statuses {
            if post {
                posts += 1;
                assert!(s == 200 || s == 502, "a POST got {s}");
                posts_502 += usize::from(s == 502);
            } else {
                gets += 1;
                assert_eq!(s, 200, "a GET failed");
            }
        }
    }
    assert!(gets > 150 && posts > 50, "{gets} GETs, {posts} POSTs");
    let ejections = metric_value(&c, &gw.admin, "tollgate_upstream_ejections_total").await;
    assert!(ejections >= 1.0, "the killed target was never ejected");
    // Per target: the killed one was ejected and failed, the other answered and never was.
    let body = get_text(&c, format!("{}/metrics", gw.admin)).await;
    let per = |name: &str, target: &str, status: Option<&str>| {
        let labels = match status {
            Some(s) => format!("{{target=\"{target}\",status=\"{s}\"}}"),
            None => format!("{{target=\"{target}\"}}"),
        };
        metric(&body, &format!("{name}{labels}")).map_or(0.0, |v| v.parse::<f64>().unwrap_or(0.0))
    };
    let (au, bu) = (a.url(), b.url());
    assert!(per("tollgate_upstream_target_ejections_total", &au, None) >= 1.0);
    assert_eq!(per("tollgate_upstream_target_ejections_total", &bu, None), 0.0);
    assert!(per("tollgate_upstream_target_responses_total", &au, Some("failed")) >= 1.0);
    assert!(per("tollgate_upstream_target_responses_total", &bu, Some("2xx")) >= 300.0);
    // The dashboard lists the ejection: the killed target, with why and for how long.
    let d = get_json(&c, format!("{}/dashboard.json", gw.admin)).await;
    let recent = d["recent_ejections"].as_array().unwrap_or_else(|| panic!("{d}"));
    assert!(!recent.is_empty(), "{d}");
    assert!(
        recent.iter().all(|e| e["target"] == au.as_str()),
        "only the killed target: {d}"
    );
    assert_eq!(recent[0]["out_for_ms"], 10_000, "eject_for: 10s: {d}");
    assert!(!recent[0]["why"].as_str().unwrap_or("").is_empty(), "{d}");
    assert!(recent[0]["at"].as_u64().unwrap_or(0) > 1_700_000_000, "{d}");
    eprintln!(
        "{gets} GETs all 200; {posts} POSTs, {posts_502} got 502; retries {}",
        metric_value(&c, &gw.admin, "tollgate_upstream_retries_total").await
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ejected_target_comes_back_after_its_period() {
    let mut a = Instance::start().await;
    let b = Instance::start().await;
    let gw = gateway_to(&[a.url(), b.url()], "  eject_after: 2\n  eject_for: 300ms\n", "").await;
    let c = client();
    a.kill();
    let ejected = eventually(Duration::from_secs(10), || async {
        let r = c.get(format!("{}/x", gw.url)).send().await.unwrap();
        assert_eq!(r.status(), 200, "a GET failed while a target was down");
        metric_value(&c, &gw.admin, "tollgate_upstream_ejections_total").await >= 1.0
    })
    .await;
    assert!(ejected);
    let before = a.served();
    a.revive().await;
    let back = eventually(Duration::from_secs(10), || async {
        let r = c.get(format!("{}/x", gw.url)).send().await.unwrap();
        assert_eq!(r.status(), 200);
        a.served() > before
    })
    .await;
    assert!(back, "the revived target never got traffic again");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_health_check_takes_a_dead_target_out_and_brings_it_back() {
    let mut a = Instance::start().await;
    let b = Instance::start().await;
    // Passive ejection would keep it out for an hour: only the health check brings it back.
    let gw = gateway_to(
        &[a.url(), b.url()],
        "  eject_for: 1h\n  health_check: { path: /healthz, interval: 100ms, timeout: 500ms }\n",
        "",
    )
    .await;
    let c = client();
    a.kill();
    // No client traffic at all: the check alone ejects it.
    let out = eventually(Duration::from_secs(10), || async {
        metric_value(&c, &gw.admin, "tollgate_upstream_ejections_total").await >= 1.0
    })
    .await;
    assert!(out, "the health check did not eject the dead target");
    let (a0, b0) = (a.served(), b.served());
    for _ in 0..20 {
        assert_eq!(c.get(format!("{}/x", gw.url)).send().await.unwrap().status(), 200);
    }
    assert_eq!(a.served(), a0, "an ejected target got traffic");
    assert_eq!(b.served(), b0 + 20);
    a.revive().await;
    let back = eventually(Duration::from_secs(10), || async {
        let r = c.get(format!("{}/x", gw.url)).send().await.unwrap();
        assert_eq!(r.status(), 200);
        a.served() > a0
    })
    .await;
    assert!(back, "the health check did not bring the target back");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_request_id_reaches_the_upstream_and_comes_back() {
    let echo = echo().await;
    let rules =
        "rules:\n  - { name: tiny, match: { path: /tiny }, key: ip, algorithm: fixed_window, limit: 1, window: 1h }\n";
    let gw = gateway(&format!("http://{echo}"), "", rules, None).await;
    let c = client();
    let seen = |v: &serde_json::Value| v["headers"]["x-request-id"].as_str().unwrap_or("").to_string();

    let r = c
        .get(format!("{}/a", gw.url))
        .header("x-request-id", "client-id-42")
        .send()
        .await
        .unwrap();
    assert_eq!(r.headers()["x-request-id"], "client-id-42");
    assert_eq!(seen(&r.json().await.unwrap()), "client-id-42");

    let r = c.get(format!("{}/b", gw.url)).send().await.unwrap();
    let id = r.headers()["x-request-id"].to_str().unwrap().to_string();
    assert_eq!(id.len(), 32);
    assert!(id.bytes().all(|b| b.is_ascii_hexdigit()));
    assert_eq!(seen(&r.json().await.unwrap()), id);

    let r = c
        .get(format!("{}/c", gw.url))
        .header("x-request-id", "bad id!")
        .send()
        .await
        .unwrap();
    let id2 = r.headers()["x-request-id"].to_str().unwrap().to_string();
    assert_eq!(id2.len(), 32, "an invalid id is replaced");
    assert_ne!(id2, id);
    assert_eq!(seen(&r.json().await.unwrap()), id2);

    // Local answers carry it too.
    assert_eq!(c.get(format!("{}/tiny", gw.url)).send().await.unwrap().status(), 200);
    let r = c
        .get(format!("{}/tiny", gw.url))
        .header("x-request-id", "limited-1")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 429);
    assert_eq!(r.headers()["x-request-id"], "limited-1");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_access_log_has_one_line_per_request_and_never_a_key_token_or_query() {
    let echo = echo().await;
    // Unregistered credentials count as the IP here, so the request is forwarded and logged.
    let gw = binary(
        &format!("http://{echo}"),
        "access_log: true\nidentity:\n  invalid_credentials: ip\n",
        OPEN_RULES,
    );
    let c = client();
    let r = c
        .get(format!("{}/orders/7?token=SECRET-QUERY&x=1", gw.url))
        .header("x-api-key", "SECRET-KEY")
        .header("authorization", "Bearer SECRET-JWT")
        .header("x-request-id", "access-1")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let r = c
        .post(format!("{}/orders", gw.url))
        .header("x-request-id", "access-2")
        .body("b")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let logged = eventually(Duration::from_secs(5), || async {
        let l = gw.log();
        l.contains("\"access-1\"") && l.contains("\"access-2\"")
    })
    .await;
    let log = gw.log();
    assert!(logged, "{log}");
    let line = log.lines().find(|l| l.contains("\"access-1\"")).unwrap();
    let v: serde_json::Value = serde_json::from_str(line).unwrap();
    assert_eq!(v["target"], "access");
    assert_eq!(v["path"], "/orders/7");
    assert_eq!(v["method"], "GET");
    assert_eq!(v["status"], 200);
    assert_eq!(v["decision"], "allowed");
    assert_eq!(v["rule"], "open");
    assert!(v["upstream"].as_str().unwrap().starts_with("http://127.0.0.1:"));
    assert!(v["duration_ms"].as_f64().is_some());
    assert_eq!(log.lines().filter(|l| l.contains("\"access-1\"")).count(), 1);
    assert!(!log.contains("SECRET"), "a secret reached the log: {log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_upstream_never_sees_more_connections_than_the_per_target_cap() {
    let up = counting_upstream().await;
    // Cap 3; a request at the cap waits up to connect_timeout (500 ms in the test config).
    let gw = gateway_to(&[up.url()], "  max_connections_per_target: 3\n", "").await;
    // Twelve at once, each on a client connection of its own, each 300 ms upstream: three get
    // the connections, three more get them when those answer (waiting ~300 ms), the rest wait
    // out connect_timeout and get 503.
    let tasks: Vec<_> = (0..12)
        .map(|_| {
            let url = format!("{}/slow/300", gw.url);
            tokio::spawn(async move {
                let c = reqwest::Client::builder().pool_max_idle_per_host(0).build().unwrap();
                let r = c.get(url).send().await.unwrap();
                let status = r.status().as_u16();
                let body = r.text().await.unwrap_or_default();
                (status, body)
            })
        })
        .collect();
    let mut ok = 0;
    let mut unavailable = 0;
    for t in tasks {
        let (status, body) = t.await.unwrap();
        match status {
            200 => ok += 1,
            503 => {
                unavailable += 1;
                let v: serde_json::Value = serde_json::from_str(&body).unwrap();
                assert_eq!(v["error"], "unavailable", "{body}");
            }
            other => panic!("got {other}: {body}"),
        }
    }
    assert!(
        up.max_open_connections() <= 3,
        "the upstream saw {} connections open at once",
        up.max_open_connections()
    );
    assert!(
        ok > 3,
        "requests at the cap waited for a connection to come free: {ok} served"
    );
    assert!(
        unavailable >= 1,
        "past the wait, requests get 503: {ok} served, {unavailable} 503"
    );
    // The cap is tollgate's, not the target's failure: nothing counted against the upstream.
    let c = client();
    assert_eq!(
        metric_value(&c, &gw.admin, "tollgate_upstream_failures_total").await,
        0.0
    );
    // Once the burst is over the target serves again at once.
    let r = c.get(format!("{}/x", gw.url)).send().await.unwrap();
    assert_eq!(r.status(), 200);
    gw.stop().await;
}
