//! Fleet-wide concurrency limits and the penalty box, on the real
//! gateway (three of them sharing one store), real Redis (standalone and a 6-node cluster), a
//! real upstream that counts what it serves at once, and the real binary for a crash.

mod support;

use std::time::{Duration, Instant};

use support::*;

fn store_yaml(kind: &str, urls: &[String], extra: &str) -> String {
    let list: Vec<String> = urls.iter().map(|u| format!("\"{u}\"")).collect();
    format!(
        "store:\n  kind: {kind}\n  urls: [{}]\n  timeout: 200ms\n  probe_interval: 100ms\n{extra}identity:\n  trusted_proxies: [127.0.0.1/32]\n",
        list.join(", ")
    )
}

const SLOTS: &str = r#"rules:
  - { name: inflight, match: { path: "/**" }, key: ip, algorithm: concurrency, limit: 5 }
"#;

async fn three(upstream: &str, store: &str, rules: &str) -> Vec<TestGateway> {
    let mut v = Vec::new();
    for _ in 0..3 {
        v.push(gateway(upstream, store, rules, None).await);
    }
    v
}

/// 40 concurrent slow requests spread over three gateways with a limit of 5 in flight: the
/// upstream never serves more than 5 at once, the others get 429 with `Retry-After: 1`, and
/// the fleet's count returns to 0.
async fn never_more_than_the_limit_in_flight(kind: &str, urls: &[String]) {
    let up = counting_upstream().await;
    let gws = three(&up.url(), &store_yaml(kind, urls, ""), SLOTS).await;
    let c = client();
    let mut tasks = Vec::new();
    for i in 0..40 {
        let url = format!("{}/slow/300", gws[i % 3].url);
        let c = c.clone();
        tasks.push(tokio::spawn(async move {
            let r = c.get(&url).header("X-Forwarded-For", "10.7.0.1").send().await.unwrap();
            let retry = r.headers().get("retry-after").map(|v| v.to_str().unwrap().to_owned());
            let status = r.status().as_u16();
            let _ = r.bytes().await;
            (status, retry)
        }));
    }
    let mut ok = 0;
    for t in tasks {
        match t.await.unwrap() {
            (200, _) => ok += 1,
            (429, retry) => assert_eq!(retry.as_deref(), Some("1")),
            other => panic!("unexpected {other:?}"),
        }
    }
    assert!(up.max() <= 5, "the upstream served {} at once (limit 5)", up.max());
    assert!(
        ok >= 5,
        "only {ok} of 40 were admitted: the 5 slots were never all used"
    );
    // Every slot is released once the responses ended: a fresh burst of 5 is admitted at once.
    let freed = eventually(Duration::from_secs(3), || async {
        let v = get_json(&c, format!("{}/keys/10.7.0.1", gws[0].admin)).await;
        v["counters"][0]["in_flight"] == 0
    })
    .await;
    assert!(freed, "slots still held after every response ended");
    for g in &gws {
        let n = metric_value(&c, &g.admin, "tollgate_concurrency_in_flight{rule=\"inflight\"}").await;
        assert_eq!(n, 0.0);
    }
    for g in gws {
        g.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_never_more_than_the_limit_in_flight() {
    let server = RedisServer::start();
    never_more_than_the_limit_in_flight("redis", &[server.url()]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_never_more_than_the_limit_in_flight() {
    let cluster = RedisCluster::start();
    never_more_than_the_limit_in_flight("redis_cluster", &cluster.seed_urls()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_never_more_than_the_limit_in_flight() {
    let up = counting_upstream().await;
    let gw = gateway(&up.url(), "identity:\n  trusted_proxies: [127.0.0.1/32]\n", SLOTS, None).await;
    let c = client();
    let tasks: Vec<_> = (0..40)
        .map(|_| {
            let (c, url) = (c.clone(), format!("{}/slow/300", gw.url));
            tokio::spawn(async move { c.get(&url).send().await.unwrap().status().as_u16() })
        })
        .collect();
    let mut ok = 0;
    for t in tasks {
        ok += usize::from(t.await.unwrap() == 200);
    }
    assert!(up.max() <= 5, "the upstream served {} at once", up.max());
    assert!(ok >= 5);
    gw.stop().await;
}

/// In flight returns to 0 after a client that leaves mid-response, an upstream that fails
/// mid-body, and an upstream timeout; an upgrade-free streaming response holds its slot while
/// it streams.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slots_are_released_however_the_request_ends() {
    let server = RedisServer::start();
    let up = counting_upstream().await;
    let rules = r#"rules:
  - { name: inflight, match: { path: "/**" }, key: ip, algorithm: concurrency, limit: 2 }
"#;
    let store = store_yaml("redis", &[server.url()], "");
    let gw = gateway(&up.url(), &store, rules, None).await;
    let c = client();
    let in_flight = |c: reqwest::Client, admin: String| async move {
        let v = get_json(&c, format!("{admin}/keys/127.0.0.1")).await;
        v["counters"][0]["in_flight"].as_u64().unwrap_or(99)
    };
    // A streaming response holds its slot while it streams...
    let mut stream = c.get(format!("{}/stream", gw.url)).send().await.unwrap();
    assert_eq!(stream.status(), 200);
    assert!(stream.chunk().await.unwrap().is_some());
    assert_eq!(in_flight(c.clone(), gw.admin.clone()).await, 1);
    // ... and the client leaving mid-response releases it once tollgate stops reading the rest
    // (the stream runs 30 s; at most `request_timeout`, 2 s here, after the client left).
    drop(stream);
    assert!(
        eventually(Duration::from_secs(4), || async {
            in_flight(c.clone(), gw.admin.clone()).await == 0
        })
        .await,
        "a client that left kept its slot"
    );
    // An upstream that cuts the body.
    let r = c.get(format!("{}/reset", gw.url)).send().await.unwrap();
    let _ = r.bytes().await;
    assert!(
        eventually(Duration::from_secs(3), || async {
            in_flight(c.clone(), gw.admin.clone()).await == 0
        })
        .await,
        "an upstream error kept the slot"
    );
    // An upstream that never answers: 504 after request_timeout (2 s in the test config).
    let r = c.get(format!("{}/hang", gw.url)).send().await.unwrap();
    assert_eq!(r.status(), 504);
    assert!(
        eventually(Duration::from_secs(3), || async {
            in_flight(c.clone(), gw.admin.clone()).await == 0
        })
        .await,
        "a timed-out request kept its slot"
    );
    let n = metric_value(&c, &gw.admin, "tollgate_concurrency_in_flight{rule=\"inflight\"}").await;
    assert_eq!(n, 0.0);
    // Both slots are usable again.
    let a = c.get(format!("{}/stream", gw.url)).send().await.unwrap();
    let b = c.get(format!("{}/stream", gw.url)).send().await.unwrap();
    assert_eq!((a.status().as_u16(), b.status().as_u16()), (200, 200));
    let third = c.get(format!("{}/x", gw.url)).send().await.unwrap();
    assert_eq!(third.status(), 429);
    let policy = third.headers()["ratelimit-policy"].to_str().unwrap().to_owned();
    assert_eq!(
        policy, "\"inflight\";q=2;qu=\"concurrent-requests\"",
        "a concurrency policy has no window, and says its quota unit"
    );
    drop((a, b));
    gw.stop().await;
}

/// A gateway killed with SIGKILL while its requests hold slots: the slots are free again
/// after `store.concurrency_ttl` (3 s here), and not before it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashed_gateways_slots_expire_after_the_ttl() {
    let server = RedisServer::start();
    let up = counting_upstream().await;
    let rules = r#"rules:
  - { name: inflight, match: { path: "/**" }, key: ip, algorithm: concurrency, limit: 2 }
"#;
    let store = store_yaml("redis", &[server.url()], "  concurrency_ttl: 3s\n");
    let mut doomed = binary(&up.url(), &store, rules);
    let c = client();
    let mut held = Vec::new();
    for _ in 0..2 {
        let mut r = c
            .get(format!("{}/stream", doomed.url))
            .header("X-Forwarded-For", "10.7.1.1")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        assert!(r.chunk().await.unwrap().is_some());
        held.push(r);
    }
    doomed.child.kill().unwrap(); // SIGKILL: no release, no shutdown
    let killed = Instant::now();
    doomed.child.wait().unwrap();
    let other = gateway(&up.url(), &store, rules, None).await;
    let status = || async {
        c.get(format!("{}/x", other.url))
            .header("X-Forwarded-For", "10.7.1.1")
            .send()
            .await
            .unwrap()
            .status()
            .as_u16()
    };
    assert_eq!(status().await, 429, "the dead gateway's slots are still held");
    let freed = eventually(Duration::from_secs(8), || async { status().await == 200 }).await;
    let after = killed.elapsed();
    assert!(freed, "slots of a crashed gateway never expired");
    assert!(
        after >= Duration::from_millis(1500),
        "slots expired after {after:?}, long before the 3 s TTL (the last renewal was at most 1 s before the kill)"
    );
    drop(held);
    other.stop().await;
}

const PENALTY: &str = r#"rules:
  - { name: login, match: { path: "/**" }, key: ip, algorithm: fixed_window, limit: 2, window: 1s, penalty: 3s }
"#;

async fn status_via(c: &reqwest::Client, gw: &TestGateway, ip: &str) -> (u16, u64) {
    let r = c
        .get(format!("{}/login", gw.url))
        .header("X-Forwarded-For", ip)
        .send()
        .await
        .unwrap();
    let retry = r
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok()?.parse().ok())
        .unwrap_or(0);
    (r.status().as_u16(), retry)
}

/// A key denied once stays denied on all three gateways for the penalty (though its window
/// resets meanwhile), and passes right after it.
async fn penalty_holds_on_every_gateway(kind: &str, urls: &[String]) {
    let up = counting_upstream().await;
    let gws = three(&up.url(), &store_yaml(kind, urls, ""), PENALTY).await;
    let c = client();
    let ip = "10.7.2.1";
    // Requests round the fleet until the first breach (two a second pass; a pair can straddle
    // a window boundary on a busy machine, so the breach is the first 429, not the third call).
    let mut breach = None;
    for i in 0..12 {
        let (s, retry) = status_via(&c, &gws[i % 3], ip).await;
        if s == 429 {
            breach = Some(retry);
            break;
        }
    }
    let started = Instant::now();
    let retry = breach.expect("two a second were never exceeded");
    assert!(retry >= 3, "the breach's Retry-After is the penalty: {retry}");
    // Past the 1 s window, every gateway still denies.
    let later = eventually(Duration::from_secs(3), || async {
        started.elapsed() > Duration::from_millis(1300)
    })
    .await;
    assert!(later);
    for g in &gws {
        let (s, retry) = status_via(&c, g, ip).await;
        assert_eq!(s, 429, "a gateway let a penalised key through");
        assert!((1..=2).contains(&retry), "Retry-After counts down the penalty: {retry}");
    }
    let v = get_json(&c, format!("{}/keys/{ip}", gws[0].admin)).await;
    let left = v["counters"][0]["penalty_left_ms"].as_u64().unwrap();
    assert!(left > 0 && left <= 3000, "/keys shows the penalty left: {v}");
    let e = get_json(&c, format!("{}/explain?path=/login&ip={ip}", gws[1].admin)).await;
    assert!(
        e["live"][0]["penalty_left_ms"].as_u64().unwrap() > 0,
        "/explain shows it: {e}"
    );
    // Right after the penalty, it passes (the 1 s window reset long ago).
    let passed = eventually(Duration::from_secs(4), || async {
        status_via(&c, &gws[1], ip).await.0 == 200
    })
    .await;
    let at = started.elapsed();
    assert!(passed, "still denied after the penalty");
    assert!(
        at >= Duration::from_millis(2900) && at <= Duration::from_millis(4500),
        "passed at {at:?}, the penalty is 3 s"
    );
    let started_n: f64 = {
        let mut n = 0.0;
        for g in &gws {
            n += metric_value(
                &c,
                &g.admin,
                "tollgate_penalties_total{rule=\"login\",event=\"started\"}",
            )
            .await;
        }
        n
    };
    assert_eq!(started_n, 1.0, "one breach, one penalty");
    for g in gws {
        g.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_penalty_holds_on_every_gateway() {
    let server = RedisServer::start();
    penalty_holds_on_every_gateway("redis", &[server.url()]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_penalty_holds_on_every_gateway() {
    let cluster = RedisCluster::start();
    penalty_holds_on_every_gateway("redis_cluster", &cluster.seed_urls()).await;
}

/// Escalation: a request that reaches the store during a penalty doubles it (up to max); an
/// admin DELETE lifts it at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn penalties_escalate_and_an_admin_lifts_them() {
    let server = RedisServer::start();
    let up = counting_upstream().await;
    let rules = r#"rules:
  - { name: login, match: { path: "/**" }, key: ip, algorithm: fixed_window, limit: 1, window: 1s, penalty: { base: 2s, max: 16s } }
"#;
    let gws = three(&up.url(), &store_yaml("redis", &[server.url()], ""), rules).await;
    let c = client();
    let ip = "10.7.3.1";
    // The first breach (one a second; two calls can straddle a window boundary).
    let mut first = None;
    for _ in 0..6 {
        let (s, retry) = status_via(&c, &gws[0], ip).await;
        if s == 429 {
            first = Some(retry);
            break;
        }
    }
    assert_eq!(first, Some(2), "the first penalty is the base");
    // Another gateway (no cached denial there) asks the store during the penalty: doubled.
    let (s, second) = status_via(&c, &gws[1], ip).await;
    assert_eq!((s, second), (429, 4), "a breach during the penalty doubles it");
    let (s, third) = status_via(&c, &gws[2], ip).await;
    assert_eq!((s, third), (429, 8));
    // Lift it through the admin API of one gateway: that gateway admits at once.
    let r = c.delete(format!("{}/keys/{ip}", gws[2].admin)).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(body["penalties_lifted"], 1, "{body}");
    assert_eq!(status_via(&c, &gws[2], ip).await.0, 200);
    let lifted = metric_value(
        &c,
        &gws[2].admin,
        "tollgate_penalties_total{rule=\"login\",event=\"lifted\"}",
    )
    .await;
    assert_eq!(lifted, 1.0);
    for g in gws {
        g.stop().await;
    }
}

/// A request that runs longer than `store.concurrency_ttl` keeps its slot: the gateway renews
/// it every third of the TTL, so the limit still holds after several TTLs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_request_keeps_its_slot_past_the_ttl() {
    let server = RedisServer::start();
    let up = counting_upstream().await;
    let rules = r#"rules:
  - { name: inflight, match: { path: "/**" }, key: ip, algorithm: concurrency, limit: 1 }
"#;
    let gw = gateway(
        &up.url(),
        &store_yaml("redis", &[server.url()], "  concurrency_ttl: 3s\n"),
        rules,
        None,
    )
    .await;
    let c = client();
    let mut long = c.get(format!("{}/stream", gw.url)).send().await.unwrap();
    assert_eq!(long.status(), 200);
    // The stream sends a chunk every 100 ms: 75 chunks is 7.5 s, two and a half TTLs.
    for _ in 0..75 {
        assert!(long.chunk().await.unwrap().is_some(), "the stream ended early");
    }
    let r = c.get(format!("{}/x", gw.url)).send().await.unwrap();
    assert_eq!(r.status(), 429, "the long request's slot expired while it ran");
    // Released once tollgate stops reading the stream: `request_timeout` (2 s) after the client left.
    drop(long);
    let freed = eventually(Duration::from_secs(4), || async {
        c.get(format!("{}/x", gw.url)).send().await.unwrap().status() == 200
    })
    .await;
    assert!(freed, "the slot was not released when the long request ended");
    gw.stop().await;
}

/// A client that leaves does not free its slot while the upstream still works on its request
/// (the upstream here goes on after its connection closed, as a WSGI worker does): on the real
/// binary with a limit of 2, 12 clients that give up 100 ms into a 1 s request and 6 that leave
/// after the first chunk of a 1 s response never have the upstream working on more than 2 at
/// once; the slots free when the upstream is done, and at the latest `request_timeout` (2 s)
/// after the client left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_keeps_its_slot_until_the_upstream_is_done() {
    let up = counting_upstream().await;
    let rules = r#"rules:
  - { name: inflight, match: { path: "/**" }, key: ip, algorithm: concurrency, limit: 2 }
"#;
    let gw = binary(&up.url(), "store:\n  kind: memory\n", rules);
    let c = client();
    let status = |path: &'static str| {
        let (c, url) = (c.clone(), format!("{}{path}", gw.url));
        async move { c.get(url).send().await.unwrap().status().as_u16() }
    };
    // Leaving before the response head.
    for i in 0..12 {
        match c
            .get(format!("{}/busy/1000", gw.url))
            .timeout(Duration::from_millis(100))
            .send()
            .await
        {
            Ok(r) => assert_eq!(r.status(), 429, "client {i}"),
            Err(e) => assert!(e.is_timeout(), "client {i}: {e}"),
        }
    }
    assert!(up.max() <= 2, "the upstream worked on {} at once (limit 2)", up.max());
    assert!(
        eventually(Duration::from_secs(3), || async { status("/x").await == 200 }).await,
        "the slots were not freed once the upstream was done"
    );
    // Leaving in the middle of the body.
    for i in 0..6 {
        let mut r = c.get(format!("{}/busy-stream/1000", gw.url)).send().await.unwrap();
        match r.status().as_u16() {
            200 => assert!(r.chunk().await.unwrap().is_some(), "client {i}"),
            429 => {}
            other => panic!("client {i}: {other}"),
        }
        drop(r);
    }
    assert!(up.max() <= 2, "the upstream worked on {} at once (limit 2)", up.max());
    // An upstream that takes 30 s: the slot is held until `request_timeout`, then freed. Both
    // slots must be free first (the mid-body clients' slots free when their upstream is done).
    assert!(eventually(Duration::from_secs(4), || async { up.current() == 0 }).await);
    assert!(
        eventually(Duration::from_secs(3), || async {
            let (a, b) = tokio::join!(status("/busy/300"), status("/busy/300"));
            a == 200 && b == 200
        })
        .await,
        "both slots never came free"
    );
    let left = Instant::now();
    for i in 0..2 {
        // A 429 here is a slot of the pair above whose release has not run yet (the client can
        // read a whole response a moment before the gateway drops its body): ask again. Each
        // timeout is a request admitted and left, holding its slot.
        let admitted = eventually(Duration::from_secs(3), || async {
            let r = c
                .get(format!("{}/busy/30000", gw.url))
                .timeout(Duration::from_millis(100))
                .send()
                .await;
            r.is_err_and(|e| e.is_timeout())
        })
        .await;
        assert!(admitted, "long request {i} was never admitted");
    }
    assert_eq!(status("/x").await, 429, "a client that left freed its slot at once");
    let freed = eventually(Duration::from_secs(4), || async { status("/x").await == 200 }).await;
    assert!(freed, "the slots were still held long after request_timeout");
    assert!(
        left.elapsed() >= Duration::from_millis(1800),
        "freed after {:?}",
        left.elapsed()
    );
}
