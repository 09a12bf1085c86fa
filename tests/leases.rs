//! Leases for hot keys, against real Redis: the script's grants on a
//! standalone server, and three gateways sharing one hot key on a real 6-node cluster — the
//! fleet never admits more than the limit, admits at least the limit minus every node's largest
//! lease, and makes at most 0.1 Redis calls per request at steady state (`INFO commandstats`).
//! The last test drives three limiters over one Redis with leases on and off and holds both to
//! the limit on the same request sequences.

mod support;

use std::num::{NonZeroU32, NonZeroU64};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use support::*;
use tollgate::clock::SystemClock;
use tollgate::limiter::lease::{LeaseAsk, LeaseConfig, LeaseMetrics, Leases};
use tollgate::limiter::memory::MemoryStore;
use tollgate::limiter::redis::{RedisMode, RedisStore};
use tollgate::limiter::{Algorithm, Backend, FailurePolicy, LimitCheck, Limiter, PolicedCheck, Quota, Store, StoreKey};

fn nz(v: u64) -> NonZeroU64 {
    NonZeroU64::new(v).unwrap()
}

fn store_yaml(kind: &str, urls: &[String], leases: &str) -> String {
    let list: Vec<String> = urls.iter().map(|u| format!("\"{u}\"")).collect();
    format!(
        "store:\n  kind: {kind}\n  urls: [{}]\n  timeout: 300ms\n  probe_interval: 100ms\n{leases}identity:\n  trusted_proxies: [127.0.0.1/32]\n",
        list.join(", ")
    )
}

/// Leases for any key seen 20 times a second, living 250 ms, at most 10 % of a limit.
const LEASES: &str = "  leases: { min_rate: 20/s, ttl: 250ms, max_share: 0.1 }\n";

/// `total` requests from client `ip`, spread round-robin over `gws` by `conc` concurrent
/// clients: (admitted, denied). Anything but 200, 429 or 503 (a check past the store's
/// deadline, with `failure: closed`) fails the test.
async fn hammer(gws: &[TestGateway], ip: &str, total: usize, conc: usize) -> (usize, usize) {
    let c = client();
    let next = Arc::new(AtomicUsize::new(0));
    let (ok, no) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let urls: Arc<Vec<String>> = Arc::new(gws.iter().map(|g| format!("{}/hot", g.url)).collect());
    let mut tasks = Vec::new();
    for _ in 0..conc {
        let (c, next, ok, no, urls, ip) = (
            c.clone(),
            next.clone(),
            ok.clone(),
            no.clone(),
            urls.clone(),
            ip.to_owned(),
        );
        tasks.push(tokio::spawn(async move {
            loop {
                let n = next.fetch_add(1, Ordering::Relaxed);
                if n >= total {
                    return;
                }
                let r = c
                    .get(&urls[n % urls.len()])
                    .header("X-Forwarded-For", &ip)
                    .send()
                    .await
                    .unwrap();
                match r.status().as_u16() {
                    200 => ok.fetch_add(1, Ordering::Relaxed),
                    429 | 503 => no.fetch_add(1, Ordering::Relaxed),
                    s => panic!("unexpected status {s}: {}", r.text().await.unwrap_or_default()),
                };
                let _ = r.bytes().await;
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    (ok.load(Ordering::Relaxed), no.load(Ordering::Relaxed))
}

async fn three(upstream: &str, store: &str, rules: &str) -> Vec<TestGateway> {
    let mut v = Vec::new();
    for _ in 0..3 {
        v.push(gateway(upstream, store, rules, None).await);
    }
    v
}

/// Sum of a metric over the gateways.
async fn fleet_metric(gws: &[TestGateway], name: &str) -> f64 {
    let c = client();
    let mut sum = 0.0;
    for g in gws {
        sum += metric_value(&c, &g.admin, name).await;
    }
    sum
}

/// One hot key, three gateways on a 6-node cluster, requests until the limit is long gone:
/// never more than the limit, never less than the limit minus 3 × the largest lease (10 % of
/// it), and leases decided requests locally.
async fn hot_key_never_over_admits(
    cluster: &RedisCluster,
    ip: &str,
    rule: &str,
    limit: usize,
    slack: impl Fn(Duration) -> usize,
) {
    let up = echo().await;
    // Fail closed: a check that passes the store deadline on this busy machine must not be
    // admitted unchecked (fail open would, by design, and count as over-admission here).
    let rules = format!("rules:\n  - {{ name: hot, match: {{ path: \"/**\" }}, key: ip, failure: closed, {rule} }}\n");
    let gws = three(
        &format!("http://{up}"),
        &store_yaml("redis_cluster", &cluster.seed_urls(), LEASES),
        &rules,
    )
    .await;
    let started = Instant::now();
    let (ok, no) = hammer(&gws, ip, limit * 4, 24).await;
    let allowed_now = limit + slack(started.elapsed());
    let largest_lease = limit / 10;
    println!(
        "{rule}: admitted {ok} of {} (limit {limit}, at most {allowed_now}), denied {no}",
        ok + no
    );
    assert!(
        ok <= allowed_now,
        "{rule}: the fleet admitted {ok}, over the limit {allowed_now}"
    );
    assert!(
        ok >= limit - 3 * largest_lease,
        "{rule}: admitted {ok}, below limit - nodes × largest lease = {}",
        limit - 3 * largest_lease
    );
    let local = fleet_metric(&gws, "tollgate_lease_decisions_total").await;
    let taken = fleet_metric(&gws, "tollgate_leases_taken_total").await;
    println!("{rule}: {local} requests decided from {taken} leases");
    assert!(
        taken >= 1.0 && local >= 1.0,
        "{rule}: no lease was ever used ({taken} taken, {local} local)"
    );
    for g in gws {
        g.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_fleet_never_over_admits_a_hot_key_under_leases() {
    let cluster = RedisCluster::start();
    // A day's window: a run never crosses it (the counters are fresh per cluster).
    hot_key_never_over_admits(
        &cluster,
        "10.14.1.1",
        "algorithm: fixed_window, limit: 600, window: 24h",
        600,
        |_| 0,
    )
    .await;
    hot_key_never_over_admits(
        &cluster,
        "10.14.1.2",
        "algorithm: sliding_window, limit: 601, window: 24h",
        601,
        |_| 0,
    )
    .await;
    // 600 tokens refilled at 1/s: at most the capacity plus what refilled during the run.
    hot_key_never_over_admits(
        &cluster,
        "10.14.1.3",
        "algorithm: token_bucket, capacity: 602, rate: 1/s",
        602,
        |d| d.as_secs() as usize + 1,
    )
    .await;
}

/// The sum of the script calls (`EVALSHA`, `EVAL`, `FCALL`) every master has served.
fn script_calls(cluster: &RedisCluster) -> u64 {
    let mut calls = 0;
    for port in cluster.masters() {
        let stats = redis_cli(port, &["INFO", "commandstats"]);
        for line in stats.lines() {
            let Some((name, rest)) = line.split_once(':') else {
                continue;
            };
            if matches!(
                name,
                "cmdstat_evalsha" | "cmdstat_eval" | "cmdstat_fcall" | "cmdstat_fcall_ro"
            ) {
                let n = rest
                    .split(',')
                    .find_map(|kv| kv.strip_prefix("calls="))
                    .and_then(|v| v.parse::<u64>().ok())
                    .unwrap_or(0);
                calls += n;
            }
        }
    }
    calls
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hot_key_costs_at_most_a_tenth_of_a_redis_call_per_request() {
    let cluster = RedisCluster::start();
    let up = echo().await;
    let rules = "rules:\n  - { name: hot, match: { path: \"/**\" }, key: ip, limit: 1000000000, window: 24h }\n";
    let gws = three(
        &format!("http://{up}"),
        &store_yaml("redis_cluster", &cluster.seed_urls(), LEASES),
        rules,
    )
    .await;
    // Warm up: the key gets hot and every gateway takes its first lease.
    let (ok, _) = hammer(&gws, "10.14.0.2", 1500, 16).await;
    assert_eq!(ok, 1500);
    let before = script_calls(&cluster);
    let n = 6000;
    let (ok, _) = hammer(&gws, "10.14.0.2", n, 16).await;
    let calls = script_calls(&cluster) - before;
    let per_request = calls as f64 / n as f64;
    println!("steady state: {calls} script calls for {n} requests = {per_request:.4} per request");
    for m in [
        "tollgate_leases_taken_total",
        "tollgate_lease_decisions_total",
        "tollgate_leases_returned_total",
        "tollgate_lease_units_unused_total",
    ] {
        println!("{m} {}", fleet_metric(&gws, m).await);
    }
    assert_eq!(ok, n);
    assert!(
        per_request <= 0.1,
        "{per_request:.4} Redis calls per request (target ≤ 0.1)"
    );
    // And without leases every request is a call (the measurement can see calls).
    let off = three(
        &format!("http://{up}"),
        &store_yaml("redis_cluster", &cluster.seed_urls(), "  leases: { enabled: false }\n"),
        rules,
    )
    .await;
    let before = script_calls(&cluster);
    hammer(&off, "10.14.0.3", 600, 1).await;
    let calls = script_calls(&cluster) - before;
    assert!(
        calls >= 590,
        "without leases 600 sequential requests made only {calls} calls"
    );
    for g in gws.into_iter().chain(off) {
        g.stop().await;
    }
}

#[tokio::test]
async fn the_script_grants_at_most_half_of_what_remains_and_spends_it() {
    let server = RedisServer::start();
    let store = RedisStore::connect(RedisMode::Single, &[server.url()], Duration::from_millis(300), 3)
        .await
        .unwrap();
    let window = Quota::window(Algorithm::FixedWindow, nz(100), nz(86_400_000_000));
    let mut c = LimitCheck::new(StoreKey("tollgate:{lease-fw}:r:0".into()), window, 1);
    c.lease = Some(LeaseAsk { want: 1000, life_us: 0 });
    let o = store.check(std::slice::from_ref(&c)).await.into_result().unwrap();
    assert!(o[0].allowed);
    assert_eq!(o[0].remaining, 99, "remaining is reported before the lease");
    assert_eq!(o[0].leased, 49, "half of the 99 left, not the 1000 wanted");
    let plain = LimitCheck::new(c.key.clone(), window, 0);
    let peek = store.peek(std::slice::from_ref(&plain)).await.unwrap();
    assert_eq!(peek[0].unwrap().remaining, 50, "the lease is spent in Redis at once");
    // Returning 20 unused units gives them back in the window they were spent in.
    store
        .refund(&[(LimitCheck::new(c.key.clone(), window, 20), o[0].at_us)])
        .await
        .unwrap();
    assert_eq!(
        store.peek(std::slice::from_ref(&plain)).await.unwrap()[0]
            .unwrap()
            .remaining,
        70
    );
    // A request whose own cost leaves less than 2 gets no lease.
    let mut big = c.clone();
    big.cost = 69;
    let o = store.check(std::slice::from_ref(&big)).await.into_result().unwrap();
    assert!(o[0].allowed);
    assert_eq!(o[0].leased, 0);

    // Token bucket: 100 tokens, one a second. The request leaves tat 1 s ahead, beyond the
    // 250 ms life of the lease: no refill could be wasted, so none is spent for the lease.
    let bucket = Quota::bucket(Algorithm::TokenBucket, nz(100), nz(1_000_000));
    let mut t = LimitCheck::new(StoreKey("tollgate:{lease-tb}:r:0".into()), bucket, 1);
    t.lease = Some(LeaseAsk {
        want: 30,
        life_us: 250_000,
    });
    let o = store.check(std::slice::from_ref(&t)).await.into_result().unwrap();
    assert_eq!(o[0].leased, 30);
    let plain = LimitCheck::new(t.key.clone(), bucket, 0);
    assert_eq!(
        store.peek(std::slice::from_ref(&plain)).await.unwrap()[0]
            .unwrap()
            .remaining,
        100 - 1 - 30
    );
    // 10 tokens a second: the request's 100 ms is inside the lease's 250 ms life, so the lease
    // counts as spent 250 ms from now: 2.5 units of refill spent as time (67.5 left, floored),
    // not 3 whole units rounded up.
    let fast = Quota::bucket(Algorithm::TokenBucket, nz(100), nz(100_000));
    let mut f = LimitCheck::new(StoreKey("tollgate:{lease-tb-fast}:r:0".into()), fast, 1);
    f.lease = Some(LeaseAsk {
        want: 30,
        life_us: 250_000,
    });
    let o = store.check(std::slice::from_ref(&f)).await.into_result().unwrap();
    assert_eq!(o[0].leased, 30);
    let plain = LimitCheck::new(f.key.clone(), fast, 0);
    assert_eq!(
        store.peek(std::slice::from_ref(&plain)).await.unwrap()[0]
            .unwrap()
            .remaining,
        67
    );
    // Sliding log and leaky bucket refuse a lease argument outright.
    let log = Quota::window(Algorithm::SlidingLog, nz(100), nz(60_000_000));
    let mut l = LimitCheck::new(StoreKey("tollgate:{lease-sl}:r:0".into()), log, 1);
    l.lease = Some(LeaseAsk { want: 10, life_us: 0 });
    assert!(store.check(std::slice::from_ref(&l)).await.into_result().is_err());
}

/// A limit planned for a request, as the proxy hands it to the limiter.
struct Planned(LimitCheck);

impl AsRef<LimitCheck> for Planned {
    fn as_ref(&self) -> &LimitCheck {
        &self.0
    }
}

impl PolicedCheck for Planned {
    fn policy(&self) -> FailurePolicy {
        FailurePolicy::Closed
    }
    fn leasable(&self) -> bool {
        true
    }
}

/// A limiter on `url` (one node of a fleet), with leases or without.
async fn node(url: &str, leases: bool) -> Limiter {
    let clock = Arc::new(SystemClock);
    let store = RedisStore::connect(RedisMode::Single, &[url.to_owned()], Duration::from_millis(300), 3)
        .await
        .unwrap();
    let limiter = Limiter::new(
        Backend::Redis(Arc::new(store)),
        Arc::new(MemoryStore::new(clock.clone(), 1000)),
        Duration::from_millis(300),
        clock,
    );
    if !leases {
        return limiter;
    }
    limiter.with_leases(Leases::new(
        LeaseConfig {
            min_rate: NonZeroU32::new(5).unwrap(),
            ttl_us: nz(100_000),
            max_share_ppm: NonZeroU32::new(200_000).unwrap(),
        },
        LeaseMetrics::default(),
    ))
}

/// The same pseudo-random request sequences (node, cost) through three limiters, leases on and
/// off, for each algorithm that leases: whatever the sequence, neither admits more than the
/// limit (the differential property "leases on or off never changes whether a sequence
/// over-admits", with "never" on both sides).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_on_or_off_never_over_admit_the_same_sequences() {
    let server = RedisServer::start();
    let quotas = [
        Quota::window(Algorithm::FixedWindow, nz(150), nz(86_400_000_000)),
        Quota::window(Algorithm::SlidingWindow, nz(150), nz(86_400_000_000)),
        Quota::bucket(Algorithm::TokenBucket, nz(150), nz(10_000_000)),
    ];
    let mut lease_decisions = 0;
    for seed in 0..3u64 {
        for (qi, q) in quotas.iter().enumerate() {
            for leases in [false, true] {
                let nodes = [
                    node(&server.url(), leases).await,
                    node(&server.url(), leases).await,
                    node(&server.url(), leases).await,
                ];
                let key = StoreKey::from(format!("tollgate:{{seq-{seed}-{qi}-{leases}}}:r:0"));
                let mut rng = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                let started = Instant::now();
                let mut admitted = 0;
                for _ in 0..600 {
                    rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    let (n, cost) = ((rng >> 33) as usize % 3, 1 + (rng >> 40) % 3);
                    let check = Planned(LimitCheck::new(key.clone(), *q, cost));
                    let v = nodes[n].check(std::slice::from_ref(&check)).await;
                    if v.outcomes[0].0.allowed {
                        admitted += cost;
                    }
                    if v.outcomes[0].1 == tollgate::limiter::Source::Lease {
                        lease_decisions += 1;
                    }
                }
                for n in &nodes {
                    n.return_leases(true).await;
                }
                // Buckets refill one unit every 10 s: at most one more during a run.
                let limit = q.limit.get() + started.elapsed().as_secs() / 10 + 1;
                let limit = if q.algorithm == Algorithm::TokenBucket {
                    limit
                } else {
                    q.limit.get()
                };
                assert!(
                    admitted <= limit,
                    "{:?} seed {seed}, leases {leases}: admitted {admitted} > {limit}",
                    q.algorithm
                );
                assert!(
                    admitted >= q.limit.get() / 2,
                    "{:?}: admitted only {admitted}",
                    q.algorithm
                );
            }
        }
    }
    assert!(lease_decisions > 100, "leases decided only {lease_decisions} requests");
}

/// The count Redis holds for the fixed-window rule `hot` (0 when the key does not exist).
fn stored_count(server: &RedisServer) -> u64 {
    let keys = server.cli(&["KEYS", "*:hot:0"]);
    let Some(key) = keys.lines().next().filter(|k| !k.is_empty()) else {
        return 0;
    };
    server.cli(&["HGET", key, "c"]).trim().parse().unwrap_or(0)
}

/// Leased units are spent in Redis ahead of use; a reload and a shutdown give the unused ones
/// back, so the count then equals exactly what was admitted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unused_lease_units_go_back_on_reload_and_on_shutdown() {
    let server = RedisServer::start();
    let up = echo().await;
    // A long ttl, so the leases are still live when the reload and the shutdown come.
    let store = store_yaml(
        "redis",
        &[server.url()],
        "  leases: { min_rate: 5/s, ttl: 10s, max_share: 0.1 }\n",
    );
    let rules = "rules:\n  - { name: hot, match: { path: \"/**\" }, key: ip, limit: 100000, window: 24h }\n";
    let gw = gateway(&format!("http://{up}"), &store, rules, None).await;
    let gws = [gw];
    let (ok, _) = hammer(&gws, "10.14.9.9", 400, 4).await;
    assert_eq!(ok, 400);
    let parked = stored_count(&server);
    assert!(
        parked > 400,
        "a live lease should hold units beyond the 400 admitted, Redis has {parked}"
    );
    let c = client();
    let r = c.post(format!("{}/reload", gws[0].admin)).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(stored_count(&server), 400, "the reload gave the unused units back");
    let (ok, _) = hammer(&gws, "10.14.9.9", 300, 4).await;
    assert_eq!(ok, 300);
    assert!(stored_count(&server) > 700);
    let [gw] = gws;
    gw.stop().await;
    assert_eq!(stored_count(&server), 700, "the shutdown gave the unused units back");
}

/// Requests of `cost` 1 for `key` under `q`, round-robin over `nodes`, `n` of them: how many
/// were admitted, and how many of those from a lease.
async fn round_robin(nodes: &[Limiter], key: &StoreKey, q: Quota, n: usize) -> (u64, u64) {
    let (mut admitted, mut local) = (0, 0);
    for i in 0..n {
        let check = Planned(LimitCheck::new(key.clone(), q, 1));
        let (o, source) = nodes[i % nodes.len()]
            .check(std::slice::from_ref(&check))
            .await
            .outcomes[0];
        if o.allowed {
            admitted += 1;
            if source == tollgate::limiter::Source::Lease {
                local += 1;
            }
        }
    }
    (admitted, local)
}

/// Requests until the fleet admits nothing more: rounds of `round` requests, every node's
/// leases given back before each, until a round admits none. How many were admitted.
async fn drain(nodes: &[Limiter], key: &StoreKey, q: Quota, round: usize) -> u64 {
    let mut admitted = 0;
    for _ in 0..100 {
        for n in nodes {
            n.return_leases(true).await;
        }
        let (got, _) = round_robin(nodes, key, q, round).await;
        admitted += got;
        if got == 0 {
            return admitted;
        }
    }
    panic!("the fleet kept admitting after 100 rounds ({admitted} admitted)");
}

/// A token bucket with slow refill (300 tokens, one an hour) leased by three limiters: every
/// token is admitted once leases are given back. Refill is spent as time, not as a whole unit
/// per lease (an hour of refill each, which lost one token per lease for good).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_refill_token_bucket_leases_lose_no_tokens() {
    let server = RedisServer::start();
    let nodes = [
        node(&server.url(), true).await,
        node(&server.url(), true).await,
        node(&server.url(), true).await,
    ];
    let q = Quota::bucket(Algorithm::TokenBucket, nz(300), nz(3_600_000_000));
    let key = StoreKey::from("tollgate:{slow-refill}:r:0".to_owned());
    let started = Instant::now();
    let (mut admitted, local) = round_robin(&nodes, &key, q, 960).await;
    admitted += drain(&nodes, &key, q, 30).await;
    let refill = started.elapsed().as_secs() / 3600;
    println!("slow refill: {admitted} admitted, {local} from leases (capacity 300 + {refill} refilled)");
    assert!(local >= 50, "leases decided only {local} requests");
    assert_eq!(admitted, 300 + refill, "the leases lost tokens");
}

/// `DELETE /keys` (Limiter::reset) while three limiters hold leases of the key: the admissions
/// after the reset never exceed the limit. The leases taken before it end with it (the
/// resetting node's at once, the others' before the counter goes), and their late returns
/// are dropped instead of giving old-count units to the new count.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_while_leases_are_held_starts_the_count_afresh() {
    let server = RedisServer::start();
    let nodes = [
        node(&server.url(), true).await,
        node(&server.url(), true).await,
        node(&server.url(), true).await,
    ];
    for (qi, q) in [
        Quota::window(Algorithm::FixedWindow, nz(3000), nz(86_400_000_000)),
        Quota::window(Algorithm::SlidingWindow, nz(3000), nz(86_400_000_000)),
        Quota::bucket(Algorithm::TokenBucket, nz(3000), nz(3_600_000_000)),
    ]
    .into_iter()
    .enumerate()
    {
        let key = StoreKey::from(format!("tollgate:{{reset-{qi}}}:r:0"));
        // Hot on every node: each holds a live lease when the reset comes.
        let (before, local) = round_robin(&nodes, &key, q, 600).await;
        assert_eq!(before, 600);
        assert!(local > 100, "{:?}: leases decided only {local}", q.algorithm);
        let live: usize = nodes.iter().map(|n| n.leases().map_or(0, |l| l.live())).sum();
        assert!(live >= 2, "{:?}: only {live} nodes hold a lease", q.algorithm);
        nodes[0].reset(&[LimitCheck::new(key.clone(), q, 1)]).await.unwrap();
        let started = Instant::now();
        // Straight on, as clients would: the leases of before the reset are neither given back
        // first nor waited for.
        let (mut after, _) = round_robin(&nodes, &key, q, 3600).await;
        after += drain(&nodes, &key, q, 300).await;
        let refill = started.elapsed().as_secs() / 3600 + 1;
        println!("{:?}: {after} admitted after the reset", q.algorithm);
        assert!(
            after <= 3000 + if qi == 2 { refill } else { 0 },
            "{:?}: {after} admitted after the reset, over the limit 3000",
            q.algorithm
        );
        assert!(
            after >= 3000 - 3 * 600,
            "{:?}: only {after} after the reset",
            q.algorithm
        );
    }
}

/// A reset does not free concurrency slots: two requests holding both slots still hold them,
/// so a third is denied until one of them ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrency_slots_held_survive_a_reset() {
    let server = RedisServer::start();
    let limiter = node(&server.url(), false).await;
    let slots = Quota::window(Algorithm::Concurrency, nz(2), nz(30_000_000));
    let key = StoreKey::from("tollgate:{reset-slots}:c:0".to_owned());
    let slot = |holder: u64| {
        let mut c = LimitCheck::new(key.clone(), slots, 1);
        c.holder = holder;
        Planned(c)
    };
    for holder in [1, 2] {
        let v = limiter.check(std::slice::from_ref(&slot(holder))).await;
        assert!(v.outcomes[0].0.allowed, "slot {holder} of 2");
    }
    assert!(
        !limiter.check(std::slice::from_ref(&slot(3))).await.outcomes[0]
            .0
            .allowed
    );
    limiter.reset(&[slot(0).0]).await.unwrap();
    let v = limiter.check(std::slice::from_ref(&slot(4))).await;
    assert!(
        !v.outcomes[0].0.allowed,
        "a reset freed a slot held by a running request"
    );
    // The slots are still released by their holders.
    Store::refund(limiter.store(), &[(slot(1).0, v.outcomes[0].0.at_us)])
        .await
        .unwrap();
    assert!(
        limiter.check(std::slice::from_ref(&slot(5))).await.outcomes[0]
            .0
            .allowed
    );
}
