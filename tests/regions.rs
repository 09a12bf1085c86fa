//! Regions (`store.region`, `scope: global`): two regions, each with its own real
//! `redis-server` and two real `tollgate` binaries, joined by a latency-adding TCP proxy (50 ms
//! on every reply) that can also cut them apart. A global limit's admissions are counted per
//! window by the clients, and checked against each region's own counters in its own store.
//!
//! The load offers twice the limit across both regions, evenly, and never sends within 40 ms of
//! a window boundary, so every answer belongs to the window it was sent in.

mod support;

use std::collections::BTreeMap;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::Value;
use support::*;

/// The global limit: units per window.
const LIMIT: u64 = 200;
/// The window, in microseconds.
const WINDOW_US: u64 = 2_000_000;
/// Added to every reply between regions.
const RTT_MS: u64 = 50;

fn rules() -> String {
    format!(
        "rules:
  - name: chat
    match: {{ path: \"/g/**\" }}
    key: ip
    algorithm: fixed_window
    limit: {LIMIT}
    window: 2s
    scope: global
  - name: local
    match: {{ path: \"/r/**\" }}
    key: ip
    algorithm: fixed_window
    limit: 100
    window: 2s
"
    )
}

struct Region {
    name: &'static str,
    redis: RedisServer,
    gateways: Vec<BinaryGateway>,
}

struct Stack {
    eu: Region,
    us: Region,
    /// eu's gateways reach us's store through this.
    to_us: FaultProxy,
    /// us's gateways reach eu's store through this.
    to_eu: FaultProxy,
    interval_ms: u64,
}

fn region_yaml(name: &str, own: &RedisServer, peer: &str, peer_port: u16, mode: &str, interval_ms: u64) -> String {
    let extra = format!(
        "  region: {name}\n  regions:\n    mode: {mode}\n    sync_interval: {interval_ms}ms\n    peers:\n      - name: {peer}\n        urls: [\"redis://127.0.0.1:{peer_port}\"]\n"
    );
    trusting_store_yaml("redis", &[own.url()], &extra)
}

async fn stack(mode: &str, interval_ms: u64) -> Stack {
    let up = echo().await;
    let upstream = format!("http://{up}");
    let (eu_redis, us_redis) = (RedisServer::start(), RedisServer::start());
    let to_us = FaultProxy::start(us_redis.port()).await;
    let to_eu = FaultProxy::start(eu_redis.port()).await;
    to_us.latency(RTT_MS);
    to_eu.latency(RTT_MS);
    let eu_yaml = region_yaml("eu", &eu_redis, "us", to_us.port, mode, interval_ms);
    let us_yaml = region_yaml("us", &us_redis, "eu", to_eu.port, mode, interval_ms);
    let rules = rules();
    let eu = (0..2).map(|_| binary(&upstream, &eu_yaml, &rules)).collect();
    let us = (0..2).map(|_| binary(&upstream, &us_yaml, &rules)).collect();
    Stack {
        eu: Region {
            name: "eu",
            redis: eu_redis,
            gateways: eu,
        },
        us: Region {
            name: "us",
            redis: us_redis,
            gateways: us,
        },
        to_us,
        to_eu,
        interval_ms,
    }
}

fn now_us() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_micros() as u64
}

/// Admitted and denied answers of one region in one window.
#[derive(Debug, Default, Clone, Copy)]
struct Tally {
    admitted: u64,
    denied: u64,
}

/// Per window index, per region name.
type Tallies = BTreeMap<u64, BTreeMap<&'static str, Tally>>;

/// The next window boundary after now, and the end of `windows` whole windows from it.
fn next_windows(windows: u64) -> (u64, u64) {
    let start = (now_us() / WINDOW_US + 1) * WINDOW_US;
    (start, start + windows * WINDOW_US)
}

/// Send `per_window` requests a window to `url` from client IP `ip`, evenly, from `start` to
/// `end` (unix µs), never within 40 ms of a window boundary, so each answer is of the window it
/// was sent in; each answer's window and status.
async fn paced(url: String, ip: String, per_window: u64, (start, end): (u64, u64)) -> Vec<(u64, u16)> {
    let gap = Duration::from_micros(WINDOW_US / per_window);
    let c = client();
    let mut out = Vec::new();
    tokio::time::sleep(Duration::from_micros(start.saturating_sub(now_us()))).await;
    let mut next = Instant::now();
    loop {
        let t = now_us();
        if t >= end {
            break;
        }
        if !(40_000..=WINDOW_US - 40_000).contains(&(t % WINDOW_US)) {
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        }
        if let Ok(r) = c.get(&url).header("x-forwarded-for", &ip).send().await {
            out.push((t / WINDOW_US, r.status().as_u16()));
        }
        next += gap;
        tokio::time::sleep_until(next.into()).await;
    }
    out
}

/// Offer `per_gateway_per_window` requests to `path` on every gateway of both regions for
/// `windows` whole windows (starting at the next boundary), each from client IP `ip`; tally
/// the answers by the window they were sent in.
async fn offer(stack: &Stack, path: &str, ip: &str, per_gateway_per_window: u64, windows: u64) -> Tallies {
    let span = next_windows(windows);
    let mut tasks = Vec::new();
    for region in [&stack.eu, &stack.us] {
        for gw in &region.gateways {
            let url = format!("{}{path}", gw.url);
            let run = paced(url, ip.to_string(), per_gateway_per_window, span);
            tasks.push((region.name, tokio::spawn(run)));
        }
    }
    let mut all = Tallies::new();
    for (name, t) in tasks {
        for (w, status) in t.await.unwrap() {
            assert!(status == 200 || status == 429, "unexpected {status} from {name}");
            let e = all.entry(w).or_default().entry(name).or_default();
            if status == 200 {
                e.admitted += 1;
            } else {
                e.denied += 1;
            }
        }
    }
    all
}

/// Each region's admissions in each window of `t` (whole windows only: the first and last of
/// a run are whole by construction), and the total.
fn totals(t: &Tallies) -> Vec<(u64, u64, u64, u64)> {
    t.iter()
        .map(|(w, r)| {
            let eu = r.get("eu").map_or(0, |t| t.admitted);
            let us = r.get("us").map_or(0, |t| t.admitted);
            (*w, eu, us, eu + us)
        })
        .collect()
}

/// The `/status` region section of `gw`.
async fn region_status(gw: &BinaryGateway) -> Value {
    get_json(&client(), format!("{}/status", gw.admin)).await["region"].clone()
}

/// The longest any gateway of `stack` decided on one read's numbers (`max_staleness_ms`: from
/// the start of a read to the end of the next), in microseconds.
async fn worst_staleness_us(stack: &Stack) -> u64 {
    let mut worst = 0.0f64;
    for gw in stack.eu.gateways.iter().chain(&stack.us.gateways) {
        for p in region_status(gw).await["peers"].as_array().cloned().unwrap_or_default() {
            worst = worst.max(p["max_staleness_ms"].as_f64().unwrap_or(0.0));
        }
    }
    (worst * 1000.0) as u64
}

/// One request to `path` on `gw` from `ip`; its status.
async fn one(gw: &BinaryGateway, path: &str, ip: &str) -> u16 {
    client()
        .get(format!("{}{path}", gw.url))
        .header("x-forwarded-for", ip)
        .send()
        .await
        .unwrap()
        .status()
        .as_u16()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sync_mode_over_admits_by_at_most_the_stated_bound() {
    let stack = stack("sync", 100).await;
    // 2 × the limit across both regions: each of 4 gateways offers half the limit a window.
    let t = offer(&stack, "/g/a", "10.1.0.1", LIMIT / 2, 4).await;
    let stale_us = worst_staleness_us(&stack).await;
    // The bound: regions × rate × (interval + lag), the rate being what a region is offered
    // (LIMIT per window each) and interval + lag the longest any gateway decided on one read's
    // numbers (measured: the start of a read to the end of the next).
    let rate_per_us = LIMIT as f64 / WINDOW_US as f64;
    assert!(stale_us >= stack.interval_ms * 1000, "staleness {stale_us} µs");
    let bound = (2.0 * rate_per_us * stale_us as f64).ceil() as u64;
    let windows = totals(&t);
    eprintln!("sync: LIMIT {LIMIT}, bound +{bound} (interval + lag at most {stale_us} µs); windows (eu, us, total): {windows:?}");
    assert!(windows.len() >= 3, "{windows:?}");
    let mut over = 0;
    for (w, eu, us, total) in &windows {
        assert!(
            *total <= LIMIT + bound,
            "window {w}: {eu} + {us} = {total} > {LIMIT} + {bound}"
        );
        assert!(
            *total >= LIMIT,
            "window {w}: {total} < {LIMIT}: sync mode never under-admits"
        );
        assert!(*eu > 0 && *us > 0, "window {w}: both regions admit");
        over = over.max(total - LIMIT);
    }
    eprintln!(
        "sync: largest over-admission {over} of a bound of {bound} ({:.1} % of the limit)",
        over as f64 * 100.0 / LIMIT as f64
    );
    // Each region has its own counter, in its own store (read within the window they live in).
    assert_eq!(one(&stack.eu.gateways[0], "/g/a2", "10.1.0.11").await, 200);
    assert_eq!(one(&stack.us.gateways[0], "/g/a2", "10.1.0.11").await, 200);
    assert!(
        !scan(&stack.eu.redis, "*:chat@eu:0").is_empty(),
        "eu's counter in eu's store"
    );
    assert!(
        !scan(&stack.us.redis, "*:chat@us:0").is_empty(),
        "us's counter in us's store"
    );
    assert!(
        scan(&stack.eu.redis, "*:chat@us:0").is_empty(),
        "no region writes another's store"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn budget_mode_never_over_admits_and_splits_by_use() {
    let stack = stack("budget", 100).await;
    let t = offer(&stack, "/g/b", "10.1.0.2", LIMIT / 2, 5).await;
    let windows = totals(&t);
    eprintln!("budget: LIMIT {LIMIT}; windows (eu, us, total): {windows:?}");
    assert!(windows.len() >= 4, "{windows:?}");
    for (w, eu, us, total) in &windows {
        assert!(*total <= LIMIT, "window {w}: {eu} + {us} = {total} > {LIMIT}");
    }
    // Once the first window's reports are settled, the split follows use: near the whole limit.
    let (_, _, _, first) = windows[0];
    assert!(
        first >= LIMIT / 2 - 2,
        "the first windows run on the floor share: {windows:?}"
    );
    let settled: Vec<u64> = windows[2..].iter().map(|w| w.3).collect();
    assert!(
        settled.iter().all(|&t| t >= LIMIT * 9 / 10),
        "after two windows each region has its share of the whole limit: {windows:?}"
    );
    // Uneven use: only eu is offered the key; from its second window eu has all but us's floor.
    let t = offer_one(&stack.eu, "/g/c", "10.1.0.3", LIMIT, 4).await;
    eprintln!("budget, eu alone (window, admitted, offered): {t:?}");
    let floor = LIMIT / 4; // budget_floor 0.5 of an equal share of 2 regions
    assert!(t[0].1 <= floor, "the first window runs on the floor: {t:?}");
    for (w, admitted, offered) in &t[1..] {
        assert!(
            *admitted <= LIMIT - floor,
            "window {w}: never more than eu's share: {t:?}"
        );
        assert!(
            *admitted >= (LIMIT - floor - 2).min(*offered),
            "window {w}: eu gets the limit less us's floor: {t:?}"
        );
    }
    assert!(t[1..].iter().any(|w| w.1 > floor + 10), "the split follows use: {t:?}");
}

/// Offer `per_window` requests a window to `path` on `region`'s first gateway alone; per
/// window, the admissions and the requests offered.
async fn offer_one(region: &Region, path: &str, ip: &str, per_window: u64, windows: u64) -> Vec<(u64, u64, u64)> {
    let url = format!("{}{path}", region.gateways[0].url);
    let mut out: BTreeMap<u64, (u64, u64)> = BTreeMap::new();
    for (w, status) in paced(url, ip.to_string(), per_window, next_windows(windows)).await {
        let e = out.entry(w).or_default();
        e.1 += 1;
        if status == 200 {
            e.0 += 1;
        }
    }
    out.into_iter().map(|(w, (a, o))| (w, a, o)).collect()
}

/// The units of `key`'s counter in its window `index`, read from `redis` (0 when it holds
/// another window).
fn counter(redis: &RedisServer, key: &str, index: u64) -> u64 {
    let out = redis.cli(&["HMGET", key, "i", "c"]);
    let mut lines = out.lines();
    let i: u64 = lines.next().and_then(|l| l.trim().parse().ok()).unwrap_or(u64::MAX);
    let c: u64 = lines.next().and_then(|l| l.trim().parse().ok()).unwrap_or(0);
    if i == index {
        c
    } else {
        0
    }
}

fn scan(redis: &RedisServer, pattern: &str) -> String {
    redis
        .cli(&["--scan", "--pattern", pattern])
        .lines()
        .find(|l| !l.contains('#'))
        .unwrap_or_default()
        .trim()
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_30s_partition_keeps_both_regions_limiting_within_the_bounds_then_heals() {
    let stack = stack("budget", 100).await;
    // Before: shares settle.
    let before = totals(&offer(&stack, "/g/p", "10.1.0.4", LIMIT / 2, 3).await);
    assert!(before.iter().all(|w| w.3 <= LIMIT), "{before:?}");
    // Cut the regions apart for 30 s under the same load.
    stack.to_us.blackhole(true);
    stack.to_eu.blackhole(true);
    let during = totals(&offer(&stack, "/g/p", "10.1.0.4", LIMIT / 2, 15).await);
    eprintln!("partition (eu, us, total): {during:?}");
    for (w, eu, us, total) in &during {
        assert!(
            *total <= LIMIT,
            "window {w}: {eu} + {us} = {total} > {LIMIT} while partitioned"
        );
        assert!(
            *eu > 0 && *us > 0,
            "window {w}: both regions keep admitting: {during:?}"
        );
    }
    // Each region keeps limiting (on its floor share once it can no longer read the reports).
    let floor = LIMIT / 4;
    assert!(
        during[2..].iter().all(|w| w.1 <= floor && w.2 <= floor),
        "the floor share, {floor}, per region while partitioned: {during:?}"
    );
    let stale = region_status(&stack.eu.gateways[0]).await;
    assert!(stale["peers"][0]["errors"].as_u64().unwrap_or(0) > 0, "{stale}");
    let lag = metric_value(
        &client(),
        &stack.eu.gateways[0].admin,
        "tollgate_region_sync_lag_seconds{peer=\"us\"}",
    )
    .await;
    assert!(lag >= 20.0, "the lag metric shows the partition: {lag}");
    // Heal.
    stack.to_us.blackhole(false);
    stack.to_eu.blackhole(false);
    let after = totals(&offer(&stack, "/g/p", "10.1.0.4", LIMIT / 2, 4).await);
    eprintln!("healed (eu, us, total): {after:?}");
    assert!(after.iter().all(|w| w.3 <= LIMIT), "{after:?}");
    assert!(
        after.last().is_some_and(|w| w.3 >= LIMIT * 9 / 10),
        "shares are back: {after:?}"
    );
    // Nothing is counted twice: early in a fresh window, requests to both regions, then each
    // region's counter (in its own store) is exactly what the clients saw it admit there.
    let index = loop {
        let into = now_us() % WINDOW_US;
        if (100_000..300_000).contains(&into) {
            break now_us() / WINDOW_US;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let (mut eu_ok, mut us_ok) = (0, 0);
    for n in 0..20 {
        let region = if n % 2 == 0 { &stack.us } else { &stack.eu };
        if one(&region.gateways[n / 2 % 2], "/g/p", "10.1.0.4").await == 200 {
            if region.name == "eu" {
                eu_ok += 1;
            } else {
                us_ok += 1;
            }
        }
    }
    let eu_key = scan(&stack.eu.redis, "*:chat@eu:0");
    let us_key = scan(&stack.us.redis, "*:chat@us:0");
    assert!(!eu_key.is_empty() && !us_key.is_empty());
    let us_now = counter(&stack.us.redis, &us_key, index);
    assert_eq!(
        counter(&stack.eu.redis, &eu_key, index),
        eu_ok,
        "eu's counter is eu's admissions"
    );
    assert_eq!(us_now, us_ok, "us's counter is us's admissions");
    assert!(us_ok > 0 && eu_ok > 0);
    // The counters agree within one sync interval (plus the 50 ms between regions): what eu
    // knows of us's spend in this window is us's own counter.
    let c = client();
    let admin = stack.eu.gateways[0].admin.clone();
    let seen = eventually_some(Duration::from_millis(stack.interval_ms + 2 * RTT_MS + 400), || {
        let (c, admin) = (c.clone(), admin.clone());
        async move {
            let v = get_json(&c, format!("{admin}/keys/10.1.0.4")).await;
            let chat = v["counters"].as_array()?.iter().find(|x| x["rule"] == "chat")?.clone();
            (chat["regions"]["us"] == us_now).then_some(chat)
        }
    })
    .await;
    assert!(now_us() / WINDOW_US == index, "the check ran past its window");
    let chat = seen.expect("eu's view of us's spend agrees within one sync interval");
    assert_eq!(chat["scope"], "global");
    assert_eq!(chat["regions"]["eu"], eu_ok, "{chat}");
    // The dashboard's key detail (what its "spent by region" column shows) says the same.
    let hash = get_json(&c, format!("{admin}/keys/10.1.0.4")).await["identity_hash"]
        .as_str()
        .unwrap()
        .to_string();
    let detail = get_json(&c, format!("{admin}/dashboard/limited/{hash}")).await;
    let row = detail["counters"]
        .as_array()
        .unwrap()
        .iter()
        .find(|x| x["rule"] == "chat")
        .cloned()
        .unwrap_or_else(|| panic!("no chat counter in {detail}"));
    if now_us() / WINDOW_US == index {
        assert_eq!(row["regions"]["us"], us_now, "{row}");
        assert_eq!(row["regions"]["eu"], eu_ok, "{row}");
    }
    assert!(row["regions"].as_object().is_some_and(|r| r.len() == 2), "{row}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn region_scoped_rules_stay_exact_and_global_checks_add_no_latency() {
    let stack = stack("sync", 100).await;
    // The region rule (100 a window) offered twice its limit in each region: each region
    // admits exactly its own 100.
    let t = totals(&offer(&stack, "/r/x", "10.1.0.5", 100, 3).await);
    eprintln!("region scope (eu, us, total): {t:?}");
    for (w, eu, us, _) in &t {
        assert_eq!((*eu, *us), (100, 100), "window {w}: each region exact and on its own");
    }
    assert_eq!(one(&stack.eu.gateways[0], "/r/x2", "10.1.0.12").await, 200);
    assert!(
        !scan(&stack.eu.redis, "*:local:0").is_empty(),
        "a region rule's key names no region"
    );
    assert!(scan(&stack.eu.redis, "*:local@*").is_empty());
    // Latency: a global check against a regional one on the same gateway, one request at a
    // time, each from its own address (never limited).
    let c = client();
    let gw = &stack.eu.gateways[0];
    let (mut global, mut regional) = (Vec::new(), Vec::new());
    for i in 0..400u32 {
        let ip = format!("10.3.{}.{}", i / 250, i % 250 + 1);
        for (path, out) in [("/g/lat", &mut global), ("/r/lat", &mut regional)] {
            let started = Instant::now();
            let r = c
                .get(format!("{}{path}", gw.url))
                .header("x-forwarded-for", &ip)
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
            let _ = r.bytes().await;
            out.push(started.elapsed());
        }
    }
    let p99 = |v: &mut Vec<Duration>| {
        v.sort();
        v[v.len() * 99 / 100]
    };
    let (g, r) = (p99(&mut global), p99(&mut regional));
    eprintln!("p99: global {g:?}, region {r:?}");
    assert!(
        g <= r + Duration::from_millis(2),
        "global p99 {g:?} vs region p99 {r:?}"
    );
}

fn check_config(dir: &std::path::Path, store: &str, rules: &str) -> (bool, String) {
    let p = write_config(dir, "http://127.0.0.1:9", store, rules, None);
    tollgate_check(&p)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_region_configs_are_refused_and_an_unreachable_peer_is_survived() {
    let dir = tempfile::tempdir().unwrap();
    let global_rule = "rules:\n  - { name: g, match: { path: \"/**\" }, key: ip, algorithm: fixed_window, limit: 5, window: 10s, scope: global }\n";
    let redis_store = |extra: &str| format!("store:\n  kind: redis\n  urls: [\"redis://127.0.0.1:6379\"]\n{extra}");
    let peers = "  region: eu\n  regions:\n    peers:\n      - { name: us, urls: [\"redis://127.0.0.1:6380\"] }\n";
    // Each refusal names the line and says why.
    let cases = [
        (
            redis_store("  region: eu\n  regions:\n    peers:\n      - { name: eu, urls: [\"redis://127.0.0.1:6380\"] }\n"),
            global_rule.to_string(),
            "named twice",
        ),
        (
            redis_store("  region: eu\n  regions:\n    peers:\n      - { name: us, urls: [\"redis://a:1\"] }\n      - { name: us, urls: [\"redis://b:1\"] }\n"),
            global_rule.to_string(),
            "named twice",
        ),
        (
            "store:\n  kind: memory\n  region: eu\n".to_string(),
            global_rule.to_string(),
            "needs a Redis store",
        ),
        ("store:\n  kind: memory\n".to_string(), global_rule.to_string(), "scope: global needs store.region"),
        (
            redis_store(peers),
            global_rule.replace("algorithm: fixed_window, limit: 5, window: 10s", "algorithm: token_bucket, rate: 5/s, capacity: 5"),
            "fixed_window",
        ),
        (redis_store(peers), global_rule.replace("scope: global", "scope: planet"), "not region or global"),
        (
            redis_store(peers),
            global_rule.replace("scope: global", "scope: global, penalty: 1m"),
            "does not take penalty",
        ),
        (
            redis_store("  region: eu\n  regions:\n    peers:\n      - { name: us, urls: [\"redis://a:1\"] }\n      - { name: US, urls: [\"redis://b:1\"] }\n"),
            global_rule.to_string(),
            "named twice",
        ),
        (
            redis_store(&peers.replace("    peers:", "    mode: budget\n    peers:")),
            global_rule.replace("limit: 5,", "limit: 3,"),
            "too small to split",
        ),
        (redis_store("  regions:\n    peers: []\n"), global_rule.to_string(), "needs store.region"),
        (redis_store("  region: eu\n"), global_rule.to_string(), "at least one other region"),
        (
            redis_store("  region: eu\n  regions:\n    mode: strict\n    peers:\n      - { name: us, urls: [\"redis://127.0.0.1:6380\"] }\n"),
            global_rule.to_string(),
            "not sync or budget",
        ),
    ];
    for (store, rules, want) in &cases {
        let (ok, out) = check_config(dir.path(), store, rules);
        assert!(
            !ok && out.contains(want),
            "{want:?} expected for\n{store}{rules}\ngot: {out}"
        );
        let at = out.split(".yaml:").nth(1).unwrap_or("");
        assert!(
            at.split(':')
                .next()
                .is_some_and(|l| l.parse::<u64>().is_ok_and(|l| l > 0)),
            "the error names its line: {out}"
        );
    }
    let (ok, out) = check_config(dir.path(), &redis_store(peers), global_rule);
    assert!(ok, "{out}");

    // A peer that is unreachable at start: the gateway starts, limits on what it knows (this
    // region's spend alone), and says so in its log and /status.
    let up = echo().await;
    let redis = RedisServer::start();
    let dead = free_port();
    let extra = format!(
        "  region: eu\n  regions:\n    sync_interval: 50ms\n    peers:\n      - name: us\n        urls: [\"redis://127.0.0.1:{dead}\"]\n"
    );
    let gw = binary(
        &format!("http://{up}"),
        &trusting_store_yaml("redis", &[redis.url()], &extra),
        global_rule,
    );
    let c = client();
    let st = eventually_some(Duration::from_secs(5), || {
        let (c, admin) = (c.clone(), gw.admin.clone());
        async move {
            let v = get_json(&c, format!("{admin}/status")).await["region"].clone();
            (v["peers"][0]["errors"].as_u64().unwrap_or(0) > 0).then_some(v)
        }
    })
    .await
    .expect("/status counts the failed rounds");
    assert_eq!(st["name"], "eu");
    assert_eq!(st["mode"], "sync");
    assert!(st["peers"][0]["last_sync_ms"].is_null(), "{st}");
    assert!(gw.log().contains("region peer unreachable"), "{}", gw.log());
    // Not in the last second of a 10 s window, so 6 calls share one window.
    while now_us() % 10_000_000 > 8_500_000 {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut codes = Vec::new();
    for _ in 0..6 {
        let r = c
            .get(format!("{}/x", gw.url))
            .header("x-forwarded-for", "10.9.9.9")
            .send()
            .await
            .unwrap();
        codes.push(r.status().as_u16());
    }
    assert_eq!(codes, [200, 200, 200, 200, 200, 429]);

    // A peer that is this region's own store (a copied config): its store names itself eu, so
    // it is never read as `us` (which would count eu's own reports as us's).
    let extra = format!(
        "  region: eu\n  regions:\n    sync_interval: 50ms\n    peers:\n      - name: us\n        urls: [\"{}\"]\n",
        redis.url()
    );
    let selfish = binary(
        &format!("http://{up}"),
        &trusting_store_yaml("redis", &[redis.url()], &extra),
        global_rule,
    );
    let st = eventually_some(Duration::from_secs(5), || {
        let (c, admin) = (c.clone(), selfish.admin.clone());
        async move {
            let v = get_json(&c, format!("{admin}/status")).await["region"].clone();
            (v["peers"][0]["errors"].as_u64().unwrap_or(0) > 0).then_some(v)
        }
    })
    .await
    .expect("reading a store that names another region fails the round");
    assert!(st["peers"][0]["last_sync_ms"].is_null(), "{st}");
    assert!(selfish.log().contains("region peer misconfigured"), "{}", selfish.log());
}
