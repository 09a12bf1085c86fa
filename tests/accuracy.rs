//! The fleet shares one exact count: three gateway instances on a real 6-node Redis Cluster,
//! 24 concurrent clients on one identity, exactly `limit` admitted for every algorithm; and a
//! layered request denied by its per-IP rule spends none of its per-user quota.

mod support;

use std::sync::Arc;

use support::*;

const KEY: &str = "fleet-key";

fn keys_yaml() -> String {
    let sha = tollgate::identity::keys::hash_key(KEY);
    format!("keys:\n  - {{ id: cust_fleet, sha256: {sha}, tier: pro }}\n")
}

/// Start `n` gateways with the same config (rules, keys, one cluster), each stopped on drop.
async fn fleet(n: usize, cluster: &RedisCluster, rules: &str) -> Vec<TestGateway> {
    let up = echo().await;
    let urls: Vec<String> = cluster.seed_urls().iter().map(|u| format!("\"{u}\"")).collect();
    let store = format!(
        "store:\n  kind: redis_cluster\n  urls: [{}]\n  timeout: 250ms\n",
        urls.join(", ")
    );
    let mut out = Vec::new();
    for _ in 0..n {
        out.push(gateway(&format!("http://{up}"), &store, rules, Some(&keys_yaml())).await);
    }
    out
}

/// 24 clients send `total` requests for one identity, round-robin over the gateways.
async fn hammer(gws: &[TestGateway], path: &str, total: usize) -> (usize, usize) {
    let urls: Arc<Vec<String>> = Arc::new(gws.iter().map(|g| format!("{}{path}", g.url)).collect());
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..24 {
        let (urls, next) = (urls.clone(), next.clone());
        tasks.push(tokio::spawn(async move {
            let c = client();
            let (mut ok, mut denied) = (0, 0);
            loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if i >= total {
                    return (ok, denied);
                }
                let r = c
                    .get(&urls[i % urls.len()])
                    .header("x-api-key", KEY)
                    .send()
                    .await
                    .unwrap();
                match r.status().as_u16() {
                    200 => ok += 1,
                    429 => denied += 1,
                    s => panic!("unexpected status {s}"),
                }
            }
        }));
    }
    let mut sum = (0, 0);
    for t in tasks {
        let (a, b) = t.await.unwrap();
        sum.0 += a;
        sum.1 += b;
    }
    sum
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_gateways_admit_exactly_the_limit_for_every_algorithm() {
    let cluster = RedisCluster::start();
    let rules = r#"
rules:
  - { name: fw, match: { path: "/fw" }, key: user, algorithm: fixed_window, limit: 40, window: 1h }
  - { name: sw, match: { path: "/sw" }, key: user, algorithm: sliding_window, limit: 40, window: 1h }
  - { name: sl, match: { path: "/sl" }, key: user, algorithm: sliding_log, limit: 40, window: 1h }
  - { name: tb, match: { path: "/tb" }, key: user, algorithm: token_bucket, rate: 1/h, capacity: 40 }
  - { name: lb, match: { path: "/lb" }, key: user, algorithm: leaky_bucket, rate: 2/s, capacity: 5 }
"#;
    let gws = fleet(3, &cluster, rules).await;
    for (path, limit, total) in [
        ("/fw", 40, 120),
        ("/sw", 40, 120),
        ("/sl", 40, 120),
        ("/tb", 40, 120),
        ("/lb", 5, 24),
    ] {
        let (ok, denied) = hammer(&gws, path, total).await;
        assert_eq!(ok, limit, "{path}: admitted {ok}, denied {denied}");
        assert_eq!(ok + denied, total);
    }
    for g in gws {
        g.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_denied_by_the_ip_rule_spend_no_user_quota() {
    let cluster = RedisCluster::start();
    let rules = r#"
rules:
  - { name: per-ip,   match: { path: "/**" }, key: ip,   algorithm: fixed_window, limit: 10, window: 1h }
  - { name: per-user, match: { path: "/**" }, key: user, algorithm: sliding_log,  limit: 100, window: 1h }
"#;
    let gws = fleet(3, &cluster, rules).await;
    // The two counters live on different slots (different hash tags).
    let (ok, denied) = hammer(&gws, "/layered", 60).await;
    assert_eq!((ok, denied), (10, 50));
    let admin = &gws[0].admin;
    let v: serde_json::Value = client()
        .get(format!("{admin}/keys/cust_fleet"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let user = v["counters"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["rule"] == "per-user")
        .unwrap()
        .clone();
    assert_eq!(
        user["remaining"], 90,
        "only the 10 admitted requests spent user quota: {v}"
    );
    for g in gws {
        g.stop().await;
    }
}
