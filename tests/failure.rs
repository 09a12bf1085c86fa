//! Failure policy end to end, against real `redis-server` processes: kill, freeze (SIGSTOP),
//! restart and `FUNCTION FLUSH` / `SCRIPT FLUSH` a standalone server, and kill / freeze a Cluster master under load.
//! For each policy: the statuses, and the latency bound while the store is down.

mod support;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use support::*;

const RULES: &str = r#"
rules:
  - { name: open,   match: { path: "/open/**" },   key: user, limit: 1000000, window: 1h, failure: open }
  - { name: closed, match: { path: "/closed/**" }, key: user, limit: 1000000, window: 1h, failure: closed }
  - { name: local,  match: { path: "/local/**" },  key: user, limit: 6, window: 1h, failure: local, local_share: 2 }
  - { name: exact,  match: { path: "/exact/**" },  key: header:X-Who, algorithm: sliding_log, limit: 5, window: 1h, failure: open }
"#;

fn store_yaml(kind: &str, urls: &[String]) -> String {
    let list: Vec<String> = urls.iter().map(|u| format!("\"{u}\"")).collect();
    format!(
        "store:\n  kind: {kind}\n  urls: [{}]\n  timeout: 20ms\n  probe_interval: 100ms\n",
        list.join(", ")
    )
}

async fn status(c: &reqwest::Client, url: &str) -> u16 {
    c.get(url).send().await.map(|r| r.status().as_u16()).unwrap_or(0)
}

/// p99 of `n` sequential requests' latency, and their statuses.
async fn p99(c: &reqwest::Client, url: &str, n: usize) -> (Duration, Vec<u16>) {
    let mut lat = Vec::with_capacity(n);
    let mut codes = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        codes.push(status(c, url).await);
        lat.push(t.elapsed());
    }
    lat.sort();
    (lat[(n * 99) / 100], codes)
}

/// Wait until `url` answers `want`, returning how long it took.
async fn until_status(c: &reqwest::Client, url: &str, want: u16, limit: Duration) -> Duration {
    let t0 = Instant::now();
    let seen = eventually(limit, || async { status(c, url).await == want }).await;
    assert!(seen, "{url} did not return {want} within {limit:?}");
    t0.elapsed()
}

/// How many of `tries` counted answers for caller `who` were admitted. A 200 without
/// `RateLimit` fields went unchecked (the store was slow or down for this fail-open rule, and
/// nothing was spent): it is not one of the `tries`, and up to 50 of them are skipped.
async fn exactly_n_admitted(c: &reqwest::Client, base: &str, who: &str, tries: usize) -> usize {
    let (mut ok, mut answered, mut unchecked) = (0, 0, 0);
    while answered < tries && unchecked < 50 {
        let r = c
            .get(format!("{base}/exact/x"))
            .header("x-who", who)
            .send()
            .await
            .unwrap();
        if r.status() == 200 && r.headers().get("ratelimit").is_none() {
            unchecked += 1;
            continue;
        }
        answered += 1;
        if r.status() == 200 {
            ok += 1;
        }
    }
    ok
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standalone_kill_then_restart() {
    let mut redis = RedisServer::start();
    let up = echo().await;
    let gw = gateway(
        &format!("http://{up}"),
        &store_yaml("redis", &[redis.url()]),
        RULES,
        None,
    )
    .await;
    let c = client();
    let (baseline, codes) = p99(&c, &format!("{}/open/x", gw.url), 200).await;
    assert!(codes.iter().all(|s| *s == 200));
    assert_eq!(
        c.get(format!("{}/readyz", gw.admin)).send().await.unwrap().status(),
        200
    );

    redis.kill();
    // fail open: forwarded, and after the breaker opens, fast.
    let (down, codes) = p99(&c, &format!("{}/open/x", gw.url), 500).await;
    assert!(codes.iter().all(|s| *s == 200), "fail-open must never error: {codes:?}");
    eprintln!("killed: fail-open p99 {down:?} (baseline p99 {baseline:?})");
    assert!(
        down < baseline + Duration::from_millis(5),
        "p99 {down:?} vs baseline {baseline:?}"
    );
    // Unchecked limits advertise nothing (an `r=0` would stall header-following clients).
    let r = c.get(format!("{}/open/x", gw.url)).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert!(
        r.headers().get("ratelimit").is_none(),
        "fail-open response carried RateLimit"
    );
    // fail closed: 503 with Retry-After and the JSON error.
    let r = c.get(format!("{}/closed/x", gw.url)).send().await.unwrap();
    assert_eq!(r.status(), 503);
    assert_eq!(r.headers()["retry-after"], "1");
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(v["error"], "rate_limiter_unavailable");
    assert_eq!(v["rule"], "closed");
    // local: this node enforces limit / local_share = 3.
    let mut codes = Vec::new();
    for _ in 0..5 {
        codes.push(status(&c, &format!("{}/local/x", gw.url)).await);
    }
    assert_eq!(codes, vec![200, 200, 200, 429, 429]);
    // The headers show the limit this node enforces alone, not the fleet's.
    let r = c.get(format!("{}/local/x", gw.url)).send().await.unwrap();
    assert_eq!(r.headers()["ratelimit-policy"], "\"local\";q=3;w=3600");
    assert_eq!(r.headers()["x-ratelimit-limit"], "3");
    // Readiness never depends on the store (fail-open keeps serving, so the pod stays in its
    // Service); the store's own health is `/readyz?store=1` and the breaker gauge.
    assert_eq!(
        c.get(format!("{}/readyz", gw.admin)).send().await.unwrap().status(),
        200
    );
    assert_eq!(
        c.get(format!("{}/readyz?store=1", gw.admin))
            .send()
            .await
            .unwrap()
            .status(),
        503
    );
    let m = get_text(&c, format!("{}/metrics", gw.admin)).await;
    for needle in [
        "tollgate_requests_total{rule=\"open\",decision=\"fail_open\"}",
        "tollgate_requests_total{rule=\"closed\",decision=\"fail_closed\"}",
        "tollgate_requests_total{rule=\"local\",decision=\"local\"}",
        "tollgate_store_errors_total{kind=\"circuit_open\"}",
        "tollgate_store_breaker_open 1",
    ] {
        let line = m
            .lines()
            .find(|l| l.starts_with(needle))
            .unwrap_or_else(|| panic!("no {needle}"));
        assert!(!line.ends_with(" 0"), "{line}");
    }

    redis.restart();
    let took = until_status(&c, &format!("{}/closed/x", gw.url), 200, Duration::from_secs(3)).await;
    eprintln!("limits enforced again {took:?} after restart");
    assert_eq!(exactly_n_admitted(&c, &gw.url, "after-restart", 8).await, 5);
    assert_eq!(
        c.get(format!("{}/readyz?store=1", gw.admin))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    gw.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standalone_freeze_then_thaw() {
    let redis = RedisServer::start();
    let up = echo().await;
    let gw = gateway(
        &format!("http://{up}"),
        &store_yaml("redis", &[redis.url()]),
        RULES,
        None,
    )
    .await;
    let c = client();
    let (baseline, _) = p99(&c, &format!("{}/open/x", gw.url), 200).await;
    redis.stop();
    let t = Instant::now();
    let first = status(&c, &format!("{}/open/x", gw.url)).await;
    assert_eq!(first, 200);
    assert!(
        t.elapsed() < Duration::from_millis(200),
        "one check never waits past store.timeout: {:?}",
        t.elapsed()
    );
    let first_took = t.elapsed();
    let (down, codes) = p99(&c, &format!("{}/open/x", gw.url), 500).await;
    assert!(codes.iter().all(|s| *s == 200));
    eprintln!("frozen: first request {first_took:?}, fail-open p99 {down:?} (baseline p99 {baseline:?})");
    assert!(
        down < baseline + Duration::from_millis(5),
        "frozen: p99 {down:?} vs baseline {baseline:?}"
    );
    assert_eq!(status(&c, &format!("{}/closed/x", gw.url)).await, 503);
    redis.cont();
    let took = until_status(&c, &format!("{}/closed/x", gw.url), 200, Duration::from_secs(3)).await;
    eprintln!("limits enforced again {took:?} after SIGCONT");
    assert_eq!(exactly_n_admitted(&c, &gw.url, "after-thaw", 8).await, 5);
    gw.stop().await;
}

/// A gateway on `store.scripting: <scripting>`; the server's functions and cached scripts are
/// flushed mid-way: the next requests reload what they need, and the counts carry on.
async fn flush_is_invisible_to_clients(scripting: &str, fcall_calls: impl Fn(u64) -> bool) {
    let redis = RedisServer::start();
    let up = echo().await;
    // The first call after the flush compiles the script on the server (FUNCTION LOAD or EVAL,
    // a few ms): a deadline with room for that on a loaded 2-core machine, since what is tested
    // here is that no request fails, not the latency of that one call.
    let store = format!(
        "store:\n  kind: redis\n  urls: [\"{}\"]\n  timeout: 250ms\n  scripting: {scripting}\n",
        redis.url()
    );
    let gw = gateway(&format!("http://{up}"), &store, RULES, None).await;
    let c = client();
    assert_eq!(exactly_n_admitted(&c, &gw.url, "a", 2).await, 2);
    assert_eq!(redis.cli(&["FUNCTION", "FLUSH"]), "OK");
    assert_eq!(redis.cli(&["SCRIPT", "FLUSH"]), "OK");
    // FCALL finds no function and loads it; EVALSHA gets NOSCRIPT and falls back to EVAL.
    assert_eq!(exactly_n_admitted(&c, &gw.url, "a", 5).await, 3);
    assert_eq!(status(&c, &format!("{}/closed/x", gw.url)).await, 200);
    let fcalls = command_calls(redis.port(), "fcall");
    assert!(fcall_calls(fcalls), "store.scripting: {scripting}: {fcalls} FCALLs");
    gw.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn function_flush_is_invisible_to_clients() {
    flush_is_invisible_to_clients("auto", |n| n >= 6).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn script_flush_is_invisible_to_clients_on_the_eval_path() {
    flush_is_invisible_to_clients("eval", |n| n == 0).await;
}

/// Load on fail-open rules; counts any non-200 answer.
fn spawn_load(
    url: String,
    stop: Arc<AtomicBool>,
    bad: Arc<AtomicU64>,
    ok: Arc<AtomicU64>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let c = client();
        let mut i = 0u64;
        while !stop.load(Ordering::Relaxed) {
            i += 1;
            // Many identities, so the load touches every master.
            let r = c
                .get(format!("{url}/open/{i}"))
                .header("x-api-key", format!("k{}", i % 64))
                .send()
                .await;
            match r {
                Ok(r) if r.status() == 200 => ok.fetch_add(1, Ordering::Relaxed),
                _ => bad.fetch_add(1, Ordering::Relaxed),
            };
        }
    })
}

async fn cluster_fault(freeze: bool) {
    let mut cluster = RedisCluster::start();
    let up = echo().await;
    let gw = gateway(
        &format!("http://{up}"),
        // The load's unregistered keys count as its IP, as they always did.
        &format!(
            "{}identity:\n  invalid_credentials: ip\n",
            store_yaml("redis_cluster", &cluster.seed_urls())
        ),
        RULES,
        None,
    )
    .await;
    let c = client();
    assert_eq!(exactly_n_admitted(&c, &gw.url, "before", 8).await, 5);
    let stop = Arc::new(AtomicBool::new(false));
    let bad = Arc::new(AtomicU64::new(0));
    let ok = Arc::new(AtomicU64::new(0));
    let load: Vec<_> = (0..4)
        .map(|_| spawn_load(gw.url.clone(), stop.clone(), bad.clone(), ok.clone()))
        .collect();
    // The fault hits a gateway under load: wait until the load is flowing.
    let flowing = eventually(Duration::from_secs(5), || async { ok.load(Ordering::Relaxed) >= 50 }).await;
    assert!(flowing, "the load did not start: {} ok", ok.load(Ordering::Relaxed));
    let victim = cluster.masters()[0];
    let slot = cluster.first_slot_of(victim).unwrap();
    if freeze {
        cluster.stop_node(victim);
    } else {
        cluster.kill_node(victim);
    }
    let fault_at = Instant::now();
    let promoted = tokio::task::block_in_place(|| cluster.wait_failover(slot, victim, Duration::from_secs(15)));
    eprintln!(
        "{} master: failover took {:?}",
        if freeze { "frozen" } else { "killed" },
        fault_at.elapsed()
    );
    assert!(promoted.is_some(), "no failover");
    // Give the gateway its 3 s to find the new topology, then check exact limits again.
    let t0 = Instant::now();
    let mut n = 0;
    let exact_ok = eventually(Duration::from_secs(5), || {
        n += 1;
        let who = format!("after-{n}");
        let (c, url) = (&c, &gw.url);
        async move { exactly_n_admitted(c, url, &who, 7).await == 5 }
    })
    .await;
    eprintln!("exact again {:?} after failover (attempt {n})", t0.elapsed());
    stop.store(true, Ordering::Relaxed);
    for l in load {
        l.await.unwrap();
    }
    if freeze {
        cluster.cont_node(victim);
    }
    assert_eq!(
        bad.load(Ordering::Relaxed),
        0,
        "fail-open requests errored ({} ok)",
        ok.load(Ordering::Relaxed)
    );
    assert!(ok.load(Ordering::Relaxed) > 100);
    assert!(exact_ok, "limits not exact within 5 s of the failover");
    gw.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_master_killed_under_load() {
    cluster_fault(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_master_frozen_under_load() {
    cluster_fault(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn starts_while_redis_is_down_and_picks_it_up_later() {
    let mut redis = RedisServer::start();
    redis.kill();
    let up = echo().await;
    let gw = gateway(
        &format!("http://{up}"),
        &store_yaml("redis", &[redis.url()]),
        RULES,
        None,
    )
    .await;
    let c = client();
    assert_eq!(
        status(&c, &format!("{}/open/x", gw.url)).await,
        200,
        "fail open from the start"
    );
    assert_eq!(status(&c, &format!("{}/closed/x", gw.url)).await, 503);
    assert_eq!(
        c.get(format!("{}/readyz", gw.admin)).send().await.unwrap().status(),
        200,
        "ready without Redis: the listener is up and fail-open rules serve"
    );
    assert_eq!(
        c.get(format!("{}/readyz?store=1", gw.admin))
            .send()
            .await
            .unwrap()
            .status(),
        503
    );
    redis.restart();
    let took = until_status(&c, &format!("{}/closed/x", gw.url), 200, Duration::from_secs(3)).await;
    eprintln!("store picked up {took:?} after it came up");
    assert_eq!(exactly_n_admitted(&c, &gw.url, "late", 8).await, 5);
    gw.stop().await;
}

/// A Cluster master killed with no replica to take over: its shard's breaker opens and stays
/// open (it used to close on every probe, which the cluster client answered from another
/// node, and open again: 25 times in 6 s), the gauges show it, and fail-open requests on that
/// shard answer fast instead of paying `store.timeout` again and again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_cluster_master_without_a_replica_keeps_its_breaker_open() {
    let mut cluster = RedisCluster::start();
    let up = echo().await;
    // A store timeout far above what a loaded test machine adds to a request, so that a
    // request that paid it cannot be mistaken for noise.
    let store = store_yaml("redis_cluster", &cluster.seed_urls()).replace("timeout: 20ms", "timeout: 250ms");
    let gw = gateway(&format!("http://{up}"), &store, RULES, None).await;
    let c = client();
    let victim = cluster.masters()[0];
    for r in cluster.replicas_of(victim) {
        cluster.kill_node(r);
    }
    cluster.kill_node(victim);
    // Callers spread over every shard (`header:X-Who` keys hash to all slots): a third of
    // them live on the dead one.
    let url = format!("{}/exact/x", gw.url);
    let n = AtomicU64::new(0);
    let on_any = |c: &reqwest::Client| {
        let i = n.fetch_add(1, Ordering::Relaxed);
        c.get(&url).header("x-who", format!("w{i}")).send()
    };
    let shard_open = |metrics: &str| {
        metrics
            .lines()
            .filter(|l| l.starts_with("tollgate_store_shard_breaker_open{") && l.contains(&format!(":{victim}\"")))
            .any(|l| l.ends_with(" 1"))
    };
    let opened = eventually(Duration::from_secs(5), || async {
        for _ in 0..10 {
            let _ = on_any(&c).await;
        }
        metric_value(&c, &gw.admin, "tollgate_store_breaker_open").await >= 1.0
    })
    .await;
    assert!(opened, "the dead shard's breaker never opened");
    // Two seconds of probes every 100 ms: it stays open, and the shard's own gauge says so.
    let t0 = Instant::now();
    let (mut scrapes, mut lat) = (0, Vec::new());
    while t0.elapsed() < Duration::from_secs(2) {
        assert_eq!(
            metric_value(&c, &gw.admin, "tollgate_store_breaker_open").await,
            1.0,
            "after {:?}",
            t0.elapsed()
        );
        let metrics = get_text(&c, format!("{}/metrics", gw.admin)).await;
        assert!(shard_open(&metrics), "no open shard gauge for :{victim}");
        for _ in 0..5 {
            let t = Instant::now();
            assert_eq!(on_any(&c).await.unwrap().status(), 200, "failure: open");
            lat.push(t.elapsed());
        }
        scrapes += 1;
    }
    lat.sort();
    let p99 = lat[(lat.len() * 99) / 100];
    eprintln!("dead master, no replica: {scrapes} scrapes all open; fail-open p99 {p99:?}");
    assert!(
        p99 < Duration::from_millis(150),
        "fail-open requests paid the 250 ms store timeout: p99 {p99:?}"
    );
    let status = get_json(&c, format!("{}/status", gw.admin)).await;
    assert_eq!(status["store"]["breakers_open"], 1, "{status}");
    gw.stop().await;
}

/// A gateway on `redis` with one `failure: closed` sliding-log rule (3 a minute per `X-Who`)
/// under `/log/`, and a `store.timeout` of `timeout`.
async fn log_gateway(redis: &RedisServer, timeout: &str) -> TestGateway {
    let up = echo().await;
    let rules = r#"
rules:
  - { name: log, match: { path: "/log/**" }, key: header:X-Who, algorithm: sliding_log, limit: 3, window: 1m, failure: closed }
"#;
    let store = format!(
        "store:\n  kind: redis\n  urls: [\"{}\"]\n  timeout: {timeout}\n  probe_interval: 100ms\n",
        redis.url()
    );
    gateway(&format!("http://{up}"), &store, rules, None).await
}

/// The status `url` answers caller `who` (0 when the request fails).
async fn log_status(c: &reqwest::Client, url: &str, who: &str) -> u16 {
    c.get(url)
        .header("x-who", who)
        .send()
        .await
        .map(|r| r.status().as_u16())
        .unwrap_or(0)
}

/// A check that timed out never spends later. Redis is frozen (SIGSTOP) while a `failure:
/// closed` sliding-log rule (3 a minute) answers five requests 503 by timeout; their script
/// calls wait in the server's socket and run when it resumes (SIGCONT). Each carries its
/// deadline, long past by then, so none of them spends: the key still admits exactly 3.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_check_that_timed_out_spends_nothing_when_redis_resumes() {
    let redis = RedisServer::start();
    let gw = log_gateway(&redis, "100ms").await;
    let c = client();
    let url = format!("{}/log/x", gw.url);
    let get = |who: &'static str| log_status(&c, &url, who);
    assert_eq!(get("warm-up").await, 200, "the script path works");
    redis.stop();
    let mut codes = Vec::new();
    for _ in 0..5 {
        codes.push(get("frozen").await);
    }
    assert_eq!(codes, [503; 5], "failure: closed while Redis is frozen");
    redis.cont();
    // Back: the calls queued while frozen ran first (the server reads its sockets in order).
    let back = eventually(Duration::from_secs(5), || async { get("probe").await == 200 }).await;
    assert!(back, "limits are not enforced again after SIGCONT");
    let mut after = Vec::new();
    for _ in 0..5 {
        after.push(get("frozen").await);
    }
    assert_eq!(
        after,
        [200, 200, 200, 429, 429],
        "the timed-out checks spent once Redis resumed"
    );
    gw.stop().await;
}

/// A check whose caller went away while its script call was in flight is given back. Redis is
/// frozen for 400 ms (well inside `store.timeout: 2s`); each client gives up after 100 ms and
/// closes its connection, so the gateway drops the request. On SIGCONT the queued calls run
/// before their deadline and spend, and the replies find no one waiting: the gateway refunds
/// them before the slot's next call, so the key still admits exactly 3 (it admitted 0 before).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_check_whose_client_left_mid_flight_is_refunded() {
    let redis = RedisServer::start();
    let gw = log_gateway(&redis, "2s").await;
    let c = client();
    let url = format!("{}/log/x", gw.url);
    let get = |who: &'static str| log_status(&c, &url, who);
    assert_eq!(get("warm-up").await, 200, "the script path works");
    redis.stop();
    let quitter = reqwest::Client::builder()
        .timeout(Duration::from_millis(100))
        .pool_max_idle_per_host(0)
        .build()
        .unwrap();
    for _ in 0..3 {
        let r = quitter.get(&url).header("x-who", "quitter").send().await;
        assert!(r.is_err(), "the client gives up while Redis is frozen: {r:?}");
    }
    tokio::time::sleep(Duration::from_millis(300)).await; // the freeze lasts 400 ms in all
    redis.cont();
    let back = eventually(Duration::from_secs(5), || async { get("probe").await == 200 }).await;
    assert!(back, "limits are not enforced again after SIGCONT");
    let mut after = Vec::new();
    for _ in 0..4 {
        after.push(get("quitter").await);
    }
    assert_eq!(after, [200, 200, 200, 429], "checks whose client left stayed spent");
    gw.stop().await;
}
