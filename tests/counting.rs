//! Exact counting, end to end: a frozen shard fails only its own limits, reloads never mint
//! quota, windows keep their own counters, the deny cache, the binding limit, and `/explain` names
//! the keys the proxy spends. The real gateway, the real echo upstream, real Redis (standalone or
//! a 6-node cluster).

mod support;

use std::time::{Duration, Instant};

use support::*;
use tollgate::identity::keys::hash_key;
use tollgate::limiter::keys::{KeyBuilder, Namespace};

/// The gateway's default key builder (prefix `tl`, no salt).
fn keys() -> KeyBuilder {
    KeyBuilder {
        prefix: "tl".into(),
        salt: String::new(),
    }
}

fn store_yaml(kind: &str, urls: &[String]) -> String {
    let list: Vec<String> = urls.iter().map(|u| format!("\"{u}\"")).collect();
    format!(
        "store:\n  kind: {kind}\n  urls: [{}]\n  timeout: 200ms\n  probe_interval: 100ms\nidentity:\n  trusted_proxies: [127.0.0.1/32]\n",
        list.join(", ")
    )
}

/// Status of a GET from client address `ip` (through the trusted `X-Forwarded-For`).
async fn get_from(c: &reqwest::Client, url: &str, ip: &str) -> reqwest::Response {
    c.get(url).header("X-Forwarded-For", ip).send().await.unwrap()
}

async fn status_from(c: &reqwest::Client, url: &str, ip: &str) -> u16 {
    get_from(c, url, ip).await.status().as_u16()
}

/// Defect 1: a frozen shard (master and replica) fails only the limits kept on it. A denial
/// from a healthy slot stands, and rules whose keys live on healthy masters keep limiting
/// while the frozen shard's breaker is open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_shard_fails_only_its_own_limits() {
    let mut cluster = RedisCluster::start();
    let kb = keys();
    let glob = kb.key(&kb.global_tag("glob"), "glob", 0);
    let frozen = cluster.master_for_key(glob.as_str());
    let ip_on_healthy = |skip: usize| {
        (1..250)
            .map(|i| format!("10.9.0.{i}"))
            .filter(|ip| {
                let k = kb.key(&kb.tag(Namespace::Ip, ip.as_bytes()), "per-ip", 0);
                cluster.master_for_key(k.as_str()) != frozen
            })
            .nth(skip)
            .expect("an address on a healthy master")
    };
    let (ip, ip2) = (ip_on_healthy(0), ip_on_healthy(1));
    let rules = r#"rules:
  - { name: per-ip, match: { path: "/a/**" }, key: ip, algorithm: fixed_window, limit: 2, window: 1h, failure: open }
  - { name: glob, match: { path: "/a/**" }, key: global, algorithm: fixed_window, limit: 1000, window: 1h, failure: open }
  - { name: per-ip-b, match: { path: "/b/**" }, key: ip, algorithm: fixed_window, limit: 2, window: 1h, failure: open }
"#;
    let up = echo().await;
    let extra = format!(
        "{}limits:\n  deny_cache: false\n",
        store_yaml("redis_cluster", &cluster.seed_urls())
    );
    let gw = gateway(&format!("http://{up}"), &extra, rules, None).await;
    let c = client();
    let a = format!("{}/a/x", gw.url);
    let b = format!("{}/b/x", gw.url);
    for want in [200, 200, 429] {
        assert_eq!(status_from(&c, &a, &ip).await, want);
    }

    let replicas = cluster.replicas_of(frozen);
    assert!(!replicas.is_empty(), "master {frozen} has no replica");
    cluster.stop_node(frozen);
    for &r in &replicas {
        cluster.stop_node(r);
    }
    // The exhausted client stays denied by its healthy slot, however often it asks (the glob
    // shard's breaker opens on the way).
    for i in 0..10 {
        assert_eq!(
            status_from(&c, &a, &ip).await,
            429,
            "request {i} of an exhausted client passed"
        );
    }
    let opened = eventually(Duration::from_secs(2), || async {
        get_text(&c, format!("{}/metrics", gw.admin))
            .await
            .contains("tollgate_store_breaker_open 1")
    })
    .await;
    assert!(opened, "the frozen shard's breaker did not open");
    // A fresh client: glob fails open, its own per-ip limit still counts.
    for want in [200, 200, 429] {
        assert_eq!(status_from(&c, &a, &ip2).await, want);
    }
    // A rule kept entirely on healthy masters limits as before.
    for want in [200, 200, 429] {
        assert_eq!(status_from(&c, &b, &ip2).await, want);
    }

    cluster.cont_node(frozen);
    for &r in &replicas {
        cluster.cont_node(r);
    }
    let healed = eventually(Duration::from_secs(10), || async {
        get_text(&c, format!("{}/metrics", gw.admin))
            .await
            .contains("tollgate_store_breaker_open 0")
    })
    .await;
    assert!(healed, "the breaker did not close after the shard came back");
    gw.stop().await;
}

/// Defect 2: spending 8 of 10, then reloading through four variants of the rule, admitted 48.
/// The consumption now carries over (converted), on Redis as on the memory store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_through_variants_never_mints_quota() {
    let server = RedisServer::start();
    let variants = [
        "algorithm: fixed_window, limit: 10, window: 1h",
        "algorithm: sliding_window, limit: 10, window: 1h",
        "algorithm: token_bucket, rate: 10/h, capacity: 10",
        "algorithm: fixed_window, limit: 10, window: 2h",
        "algorithm: sliding_log, limit: 10, window: 1h",
    ];
    let rules = |v: &str| format!("rules:\n  - {{ name: per-ip, match: {{ path: \"/**\" }}, key: ip, {v} }}\n");
    for store in [store_yaml("redis", &[server.url()]), store_yaml("memory", &[])] {
        let store = store.replace("  urls: []\n", "");
        let up = echo().await;
        let gw = gateway(&format!("http://{up}"), &store, &rules(variants[0]), None).await;
        let c = client();
        let url = format!("{}/x", gw.url);
        let mut admitted = 0;
        for _ in 0..8 {
            admitted += usize::from(status_from(&c, &url, "10.3.3.3").await == 200);
        }
        assert_eq!(admitted, 8);
        for v in &variants[1..] {
            gw.write_rules(&rules(v));
            let r = c.post(format!("{}/reload", gw.admin)).send().await.unwrap();
            assert_eq!(r.status(), 200, "{v}");
            for _ in 0..10 {
                admitted += usize::from(status_from(&c, &url, "10.3.3.3").await == 200);
            }
        }
        assert_eq!(admitted, 10, "{store}: the reloads minted quota");
        gw.stop().await;
    }
}

/// Defect 4: two windows less than 1 ms apart used to share one key (`fw1000`), so neither
/// limit held. Keys now name the limit's position.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn windows_a_microsecond_apart_keep_their_own_counters() {
    let up = echo().await;
    let rules = "rules:\n  - { name: w, match: { path: \"/**\" }, key: ip, algorithm: fixed_window, limits: [ { limit: 3, window: 1h }, { limit: 100, window: 3600000500us } ] }\n";
    let gw = gateway(&format!("http://{up}"), "", rules, None).await;
    let c = client();
    let mut codes = Vec::new();
    for _ in 0..6 {
        codes.push(c.get(format!("{}/x", gw.url)).send().await.unwrap().status().as_u16());
    }
    assert_eq!(codes, [200, 200, 200, 429, 429, 429]);
    gw.stop().await;
}

/// Defect 6: a denial that rests on units a refund is about to give back used to sit in the
/// deny cache for the whole retry time (an hour), locking every client out of a global rule.
/// It is cached for at most a second now.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transient_denial_is_cached_for_at_most_a_second() {
    let server = RedisServer::start();
    let up = echo().await;
    let rules = r#"rules:
  - { name: ip, match: { path: "/**" }, key: ip, algorithm: fixed_window, limit: 1, window: 1h }
  - { name: glob, match: { path: "/**" }, key: global, algorithm: sliding_window, limit: 10, window: 1h }
"#;
    let gw = gateway(
        &format!("http://{up}"),
        &store_yaml("redis", &[server.url()]),
        rules,
        None,
    )
    .await;
    let c = client();
    let url = format!("{}/x", gw.url);
    assert_eq!(status_from(&c, &url, "10.4.0.1").await, 200);
    let burst: Vec<_> = (0..60)
        .map(|_| {
            let (c, url) = (c.clone(), url.clone());
            tokio::spawn(async move { status_from(&c, &url, "10.4.0.1").await })
        })
        .collect();
    for h in burst {
        assert_eq!(h.await.unwrap(), 429);
    }
    // A new client is admitted within the cache's one-second bound.
    let started = Instant::now();
    let admitted = eventually(Duration::from_millis(1500), || async {
        status_from(&c, &url, "10.4.0.2").await == 200
    })
    .await;
    assert!(
        admitted,
        "a new client was still locked out after {:?}",
        started.elapsed()
    );
    // Redis holds what was really spent: the two admitted requests, once the gateway's lease of
    // the hot global key (taken along with the burst, spent in Redis ahead of use) is back,
    // which the lease sweep does within 1.5 × its 250 ms ttl.
    let glob = keys().key(&keys().global_tag("glob"), "glob", 0);
    let count = || server.cli(&["HGET", glob.as_str(), "c"]).parse::<u64>().unwrap_or(0);
    let settled = eventually(Duration::from_secs(3), || async { count() == 2 }).await;
    assert!(
        settled,
        "Redis holds {} units of the global rule, want the 2 admitted",
        count()
    );
    gw.stop().await;
}

/// One request an hour per client address: the second is denied for about an hour.
const HOURLY: &str = "rules:\n  - { name: hourly, match: { path: \"/**\" }, key: ip, algorithm: token_bucket, rate: 1/h, capacity: 1 }\n";

/// A denial answered from the deny cache says what the store said: the same `Retry-After` and
/// reset, counted down. It used to report the cache entry's own life (at most a second), so a
/// client that obeyed `Retry-After: 1` came back 3,599 s too early, every second.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cached_denial_keeps_the_stores_retry_after() {
    let server = RedisServer::start();
    let up = echo().await;
    let retry = |r: &reqwest::Response| -> u64 { r.headers()["retry-after"].to_str().unwrap().parse().unwrap() };
    let reset = |r: &reqwest::Response| -> u64 { r.headers()["x-ratelimit-reset"].to_str().unwrap().parse().unwrap() };
    let stores = [
        ("memory", "identity:\n  trusted_proxies: [127.0.0.1/32]\n".to_string()),
        ("redis", store_yaml("redis", &[server.url()])),
    ];
    for (store, extra) in stores {
        let gw = gateway(&format!("http://{up}"), &extra, HOURLY, None).await;
        let c = client();
        let url = format!("{}/x", gw.url);
        assert_eq!(get_from(&c, &url, "10.9.0.1").await.status(), 200);
        // The store's denial.
        let first = get_from(&c, &url, "10.9.0.1").await;
        assert_eq!(first.status(), 429);
        let (r1, s1) = (retry(&first), reset(&first));
        assert!(r1 > 3_500, "{store}: the store's Retry-After is about an hour: {r1}");
        let hits = "tollgate_deny_cache_hits_total";
        let before = metric_value(&c, &gw.admin, hits).await;
        for _ in 0..5 {
            let r = get_from(&c, &url, "10.9.0.1").await;
            assert_eq!(r.status(), 429);
            let (rn, sn) = (retry(&r), reset(&r));
            assert!(
                rn <= r1 && rn + 2 >= r1,
                "{store}: Retry-After {rn} after the store's {r1}"
            );
            assert!(
                sn.abs_diff(s1) <= 1,
                "{store}: X-RateLimit-Reset {sn} after the store's {s1}"
            );
            let t = r.headers()["ratelimit"].to_str().unwrap().to_owned();
            assert!(
                t.ends_with(&format!(";t={rn}")),
                "{store}: RateLimit {t} agrees with Retry-After {rn}"
            );
        }
        let after = metric_value(&c, &gw.admin, hits).await;
        assert!(
            after > before,
            "{store}: no denial came from the deny cache ({before} -> {after})"
        );
        gw.stop().await;
    }
}

/// A key flooded past its limit costs the store one call per deny-cache refresh: when the entry
/// is due, one request asks the store and the others are still answered from the cache. (Each
/// request that arrived during the refresh's round trip used to ask as well: about two calls a
/// second under a flood instead of one.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flooded_denied_key_costs_the_store_one_call_per_refresh() {
    let server = RedisServer::start();
    let up = echo().await;
    let gw = gateway(
        &format!("http://{up}"),
        &store_yaml("redis", &[server.url()]),
        HOURLY,
        None,
    )
    .await;
    let c = client();
    let url = format!("{}/x", gw.url);
    assert_eq!(get_from(&c, &url, "10.9.1.1").await.status(), 200);
    assert_eq!(get_from(&c, &url, "10.9.1.1").await.status(), 429);
    let before = command_calls(server.port(), "fcall");
    let t0 = Instant::now();
    let flood = Duration::from_millis(3_500);
    let tasks: Vec<_> = (0..24)
        .map(|_| {
            let (c, url) = (c.clone(), url.clone());
            tokio::spawn(async move {
                let mut n = 0u64;
                while t0.elapsed() < flood {
                    assert_eq!(get_from(&c, &url, "10.9.1.1").await.status(), 429);
                    n += 1;
                }
                n
            })
        })
        .collect();
    let mut requests = 0;
    for t in tasks {
        requests += t.await.unwrap();
    }
    let secs = t0.elapsed().as_secs_f64();
    let calls = command_calls(server.port(), "fcall") - before;
    eprintln!("{requests} denied requests in {secs:.1} s, {calls} store calls");
    assert!(requests > 500, "the flood was too thin to test anything: {requests}");
    // One refresh a second (an entry lives at most 1 s), plus one for the partial seconds.
    assert!(
        calls as f64 <= secs.ceil() + 1.0,
        "{calls} store calls for one denied key in {secs:.1} s"
    );
    gw.stop().await;
}

/// Defects 7 and 8: a denial cached for one caller of a shared org counter is not served to a
/// caller with a larger override; and an API key id that reads like an IP does not share the
/// counter of that IP.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cached_denials_respect_overrides_and_identities_keep_their_namespace() {
    let up = echo().await;
    let keys_yaml = format!(
        "keys:\n  - {{ id: small, sha256: {}, tier: pro, org: acme }}\n  - {{ id: big, sha256: {}, tier: pro, org: acme }}\n  - {{ id: 10.8.8.8, sha256: {}, tier: pro }}\n",
        hash_key("k-small"),
        hash_key("k-big"),
        hash_key("k-ip")
    );
    let rules = r#"rules:
  - { name: per-org, match: { path: "/org/**" }, key: org, algorithm: fixed_window, limit: 3, window: 1h, overrides: { big: { limit: 6 } } }
  - { name: per-user, match: { path: "/user/**" }, key: user, algorithm: fixed_window, limit: 2, window: 1h }
"#;
    let gw = gateway(
        &format!("http://{up}"),
        "identity:\n  trusted_proxies: [127.0.0.1/32]\n",
        rules,
        Some(&keys_yaml),
    )
    .await;
    let c = client();
    let org = format!("{}/org/x", gw.url);
    let with_key = |k: &'static str| c.get(&org).header("X-API-Key", k).send();
    for want in [200, 200, 200, 429] {
        assert_eq!(with_key("k-small").await.unwrap().status(), want);
    }
    // `big` shares the org counter (3 spent) under its own limit of 6.
    for want in [200, 200, 200, 429] {
        assert_eq!(with_key("k-big").await.unwrap().status(), want);
    }

    let user = format!("{}/user/x", gw.url);
    for want in [200, 200, 429] {
        assert_eq!(status_from(&c, &user, "10.8.8.8").await, want);
    }
    let r = c
        .get(&user)
        .header("X-Forwarded-For", "10.1.1.1")
        .header("X-API-Key", "k-ip")
        .send()
        .await
        .unwrap();
    assert_eq!(
        r.status(),
        200,
        "API key id 10.8.8.8 shared the counter of client 10.8.8.8"
    );
    gw.stop().await;
}

/// Defect 9: with several limits, the headers and Retry-After describe the limit that stays
/// exhausted the longest, not the first one listed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binding_limit_is_the_one_exhausted_longest() {
    let up = echo().await;
    // Windows are aligned to the epoch: the 1 h window resets later than the 1 s one except in
    // the last second of an hour (1 run in 3,600).
    let rules = "rules:\n  - { name: two, match: { path: \"/**\" }, key: ip, algorithm: fixed_window, limits: [ { limit: 1, window: 1s }, { limit: 1, window: 1h } ] }\n";
    let gw = gateway(&format!("http://{up}"), "", rules, None).await;
    let c = client();
    let url = format!("{}/x", gw.url);
    let r = c.get(&url).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let t = |r: &reqwest::Response| -> u64 {
        let v = r.headers()["ratelimit"].to_str().unwrap().to_owned();
        v.rsplit("t=").next().unwrap().parse().unwrap()
    };
    // Both windows are policies of their own; RateLimit names the binding one.
    assert_eq!(
        r.headers()["ratelimit-policy"],
        "\"two-1s\";q=1;w=1, \"two-1h\";q=1;w=3600"
    );
    assert!(r.headers()["ratelimit"].to_str().unwrap().starts_with("\"two-1h\";"));
    assert!(t(&r) > 1, "allowed: t={} names the 1 s window", t(&r));
    let r = c.get(&url).send().await.unwrap();
    assert_eq!(r.status(), 429);
    let retry: u64 = r.headers()["retry-after"].to_str().unwrap().parse().unwrap();
    assert!(retry > 1, "Retry-After {retry} names the 1 s window; the 1 h one binds");
    assert!(t(&r) > 1);
    gw.stop().await;
}

/// The proxy and `/explain` build their keys from one plan, so for the same request —
/// a Host with a port and a trailing dot, a query string, a header-keyed rule, a host-specific
/// rule — the keys `/explain` names are exactly the keys the proxy wrote to Redis.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_names_exactly_the_keys_the_proxy_spends() {
    let server = RedisServer::start();
    let up = echo().await;
    let rules = r#"rules:
  - { name: per-ip, match: { path: "/api/**" }, key: ip, algorithm: fixed_window, limit: 100, window: 1h }
  - { name: by-host, match: { path: "/api/**", host: api.example.com }, key: global, algorithm: sliding_window, limits: [ { limit: 100, window: 1m }, { limit: 1000, window: 1h } ] }
  - { name: by-client, match: { path: "/api/items/{id}" }, key: "header:X-Client", algorithm: token_bucket, rate: 10/s, capacity: 20 }
"#;
    let gw = gateway(
        &format!("http://{up}"),
        &store_yaml("redis", &[server.url()]),
        rules,
        None,
    )
    .await;
    let c = client();
    let target = "/api//items/7?debug=1&x=%2F";
    let r = c
        .get(format!("{}{target}", gw.url))
        .header("Host", "API.example.com.:8443")
        .header("X-Client", "mobile-7")
        .header("X-Forwarded-For", "10.7.7.7")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let mut written: Vec<String> = server
        .cli(&["--scan", "--pattern", "tl:*"])
        .lines()
        .map(str::to_owned)
        .collect();
    written.sort();
    let v: serde_json::Value = c
        .get(format!("{}/explain", gw.admin))
        // The admin API without a token answers only a loopback Host: the request's Host is
        // given as `host=`.
        .query(&[("method", "GET"), ("path", target), ("host", "API.example.com.:8443")])
        .header("X-Client", "mobile-7")
        .header("X-Forwarded-For", "10.7.7.7")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let mut named: Vec<String> = v["matches"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["chosen"] == true)
        .flat_map(|m| m["limits"].as_array().cloned().unwrap_or_default())
        .map(|l| l["store_key"].as_str().unwrap().to_owned())
        .collect();
    named.sort();
    assert_eq!(named.len(), 4, "per-ip, two by-host windows, by-client: {v}");
    assert_eq!(named, written, "explain: {v}");
    gw.stop().await;
}
