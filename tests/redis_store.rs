//! The Redis store against real `redis-server` processes: script recovery, Redis time, key
//! expiry, all-or-nothing across slots, peek/reset/probe, and Redis Cluster behaviour (MOVED,
//! a killed master, a frozen master).

mod support;

use std::num::NonZeroU64;
use std::time::{Duration, Instant};

use support::*;
use tollgate::config::Scripting;
use tollgate::limiter::redis::{RedisMode, RedisStore, SCRIPT_SOURCE};
use tollgate::limiter::{Algorithm, LimitCheck, Penalty, Quota, Store, StoreError, StoreKey};

/// Per-call deadline for these tests (generous: debug build, parallel tests, 2 cores).
const T: Duration = Duration::from_millis(300);

/// A fixed "now" in the future (year 2096): keys written at it expire by that clock, never
/// during the test.
const NOW: u64 = 4_000_000_000_000_000;

fn nz(v: u64) -> NonZeroU64 {
    NonZeroU64::new(v).unwrap()
}

/// A limit of `limit` units: buckets refill one unit per `period_us / limit`; windows span
/// `period_us`.
fn lc(key: &str, algorithm: Algorithm, limit: u64, period_us: u64, cost: u64) -> LimitCheck {
    let quota = if algorithm.is_bucket() {
        Quota::bucket(algorithm, nz(limit), nz(period_us / limit))
    } else {
        Quota::window(algorithm, nz(limit), nz(period_us))
    };
    LimitCheck::new(StoreKey::from(key.to_owned()), quota, cost)
}

fn shadow(mut c: LimitCheck) -> LimitCheck {
    c.shadow = true;
    c
}

async fn single(s: &RedisServer) -> RedisStore {
    RedisStore::connect(RedisMode::Single, &[s.url()], T, 3)
        .await
        .expect("connect to redis-server")
}

async fn cluster_store(c: &RedisCluster) -> RedisStore {
    RedisStore::connect(RedisMode::Cluster, &c.seed_urls(), T, 3)
        .await
        .expect("connect to the cluster")
}

/// The raw state of a key, whatever its type, as text (to compare before/after).
fn raw_state(port: u16, key: &str) -> String {
    let ty = redis_cli(port, &["TYPE", key]);
    let body = match ty.as_str() {
        "string" => redis_cli(port, &["GET", key]),
        "hash" => {
            let mut v: Vec<String> = redis_cli(port, &["HGETALL", key])
                .lines()
                .map(str::to_owned)
                .collect::<Vec<_>>()
                .chunks(2)
                .map(|c| c.join("="))
                .collect();
            v.sort();
            v.join(",")
        }
        "zset" => redis_cli(port, &["ZRANGE", key, "0", "-1", "WITHSCORES"]),
        _ => String::new(),
    };
    format!("{ty}:{body}")
}

/// Retry `check` until it succeeds (after a restart, failover, ...) or `timeout` passes.
async fn until_ok(store: &RedisStore, checks: &[LimitCheck], timeout: Duration) -> tollgate::limiter::Outcomes {
    let last = std::cell::RefCell::new(String::from("never tried"));
    let ok = eventually_some(timeout, || {
        let last = &last;
        async move {
            match tokio::time::timeout(T, store.check(checks))
                .await
                .map(|c| c.into_result())
            {
                Ok(Ok(v)) => Some(v),
                failed => {
                    *last.borrow_mut() = match failed {
                        Ok(Err(e)) => e.to_string(),
                        _ => "timeout".into(),
                    };
                    // What the gateway's probe loop does: probe open shards, close their breakers.
                    store.heal().await;
                    None
                }
            }
        }
    })
    .await;
    ok.unwrap_or_else(|| panic!("store never recovered: {}", last.borrow()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eval_path_noscript_recovery_after_script_flush_and_restart() {
    let mut server = RedisServer::start();
    let store = single(&server).await;
    store.set_scripting(Scripting::Eval);
    let c = [lc("tl:{ns}:r:1h", Algorithm::FixedWindow, 10, 3_600_000_000, 1)];
    assert!(store.check(&c).await.into_result().unwrap()[0].allowed);
    assert_eq!(server.cli(&["SCRIPT", "EXISTS", store.script_sha()]), "1");

    assert_eq!(server.cli(&["SCRIPT", "FLUSH"]), "OK");
    assert_eq!(server.cli(&["SCRIPT", "EXISTS", store.script_sha()]), "0");
    let o = store.check(&c).await.into_result().unwrap();
    assert!(o[0].allowed);
    assert_eq!(o[0].remaining, 8, "the count survived the flush");
    assert_eq!(
        server.cli(&["SCRIPT", "EXISTS", store.script_sha()]),
        "1",
        "EVAL cached it"
    );
    assert!(command_calls(server.port(), "evalsha") >= 2);
    assert_eq!(
        command_calls(server.port(), "fcall"),
        0,
        "store.scripting: eval never calls a function"
    );
    assert!(!has_library(server.port(), store.function_name()), "nor loads one");

    // A restart loses data and scripts; the connection manager reconnects.
    server.restart();
    let o = until_ok(&store, &c, Duration::from_secs(5)).await;
    assert!(o[0].allowed);
    assert_eq!(o[0].remaining, 9, "fresh server, fresh counter");
    assert!(store.probe().await.is_ok());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn functions_path_loads_once_and_recovers_after_function_flush_and_restart() {
    let mut server = RedisServer::start();
    let store = single(&server).await; // store.scripting: auto, on Redis 7: functions
    let name = store.function_name().to_owned();
    assert_eq!(name, format!("tollgate_{}", store.script_sha()));
    assert!(!has_library(server.port(), &name));
    // An hour's window: a loaded machine may take over a second between these checks.
    let c = [lc("tl:{fn}:r:1h", Algorithm::FixedWindow, 10, 3_600_000_000, 1)];
    assert!(store.check(&c).await.into_result().unwrap()[0].allowed);
    assert!(has_library(server.port(), &name), "the first call loaded the library");
    for _ in 0..3 {
        assert!(store.check(&c).await.into_result().unwrap()[0].allowed);
    }
    // The failed first FCALL, then one per check; no script was ever cached.
    assert_eq!(command_calls(server.port(), "fcall"), 5);
    assert_eq!(command_calls(server.port(), "function|load"), 1, "loaded once");
    assert_eq!(
        command_calls(server.port(), "evalsha") + command_calls(server.port(), "eval"),
        0
    );
    assert_eq!(server.cli(&["SCRIPT", "EXISTS", store.script_sha()]), "0");

    assert_eq!(server.cli(&["FUNCTION", "FLUSH"]), "OK");
    assert!(!has_library(server.port(), &name));
    let o = store.check(&c).await.into_result().unwrap();
    assert!(o[0].allowed);
    assert_eq!(o[0].remaining, 5, "the count survived the flush");
    assert!(has_library(server.port(), &name), "reloaded where it was missing");
    assert_eq!(command_calls(server.port(), "function|load"), 2);

    // Other gateways (of the same version) find the library there: no load.
    let loads = command_calls(server.port(), "function|load");
    let stores = [single(&server).await, single(&server).await];
    for s in &stores {
        assert!(s.check(&c).await.into_result().unwrap()[0].allowed);
    }
    assert_eq!(
        command_calls(server.port(), "function|load"),
        loads,
        "a second gateway finds it loaded"
    );

    // A restart loses data and functions (no persistence); the call loads it again.
    server.restart();
    let o = until_ok(&store, &c, Duration::from_secs(5)).await;
    assert!(o[0].allowed);
    assert_eq!(o[0].remaining, 9, "fresh server, fresh counter");
    assert!(has_library(server.port(), &name));
    assert!(store.probe().await.is_ok());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_without_functions_is_run_with_evalsha() {
    // FCALL and FUNCTION answer "unknown command", as on Redis 6.
    let server = RedisServer::start_without_functions();
    let store = single(&server).await;
    let c = [lc("tl:{r6}:r:1s", Algorithm::SlidingWindow, 10, 60_000_000, 1)];
    for want in [9, 8] {
        let o = store.check(&c).await.into_result().unwrap();
        assert!(o[0].allowed);
        assert_eq!(o[0].remaining, want);
    }
    assert_eq!(server.cli(&["SCRIPT", "EXISTS", store.script_sha()]), "1");
    let evalsha = command_calls(server.port(), "evalsha");
    assert!(evalsha >= 2, "{evalsha}");
    // The fallback is for good: later calls go straight to EVALSHA.
    let batches = store.batch_stats().0;
    assert!(store.check(&c).await.into_result().unwrap()[0].allowed);
    assert_eq!(store.batch_stats().0, batches + 1);
    assert_eq!(command_calls(server.port(), "evalsha"), evalsha + 1);
    // NOSCRIPT recovery works there as before.
    assert_eq!(server.cli(&["SCRIPT", "FLUSH"]), "OK");
    assert_eq!(store.check(&c).await.into_result().unwrap()[0].remaining, 6);
    assert!(store.probe().await.is_ok());

    // Forced to functions, a server without them fails every check, with the server's answer.
    let forced = single(&server).await;
    forced.set_scripting(Scripting::Functions);
    match forced.check(&c).await.into_result() {
        Err(StoreError::Script(m)) => assert!(m.contains("unknown command"), "{m}"),
        other => panic!("expected the server's error, got {other:?}"),
    }
    assert_eq!(
        store.check(&c).await.into_result().unwrap()[0].remaining,
        5,
        "nothing spent"
    );
}

/// Checks from 8 concurrent tasks over 512 hash tags (every master of a cluster) through the
/// production path (batched, Redis time) while `flush` runs three times; after each flush,
/// waits until `loaded` holds again and 200 more checks succeeded. Asserts that no check
/// failed, and returns how many succeeded.
async fn no_failed_check_across_flushes(store: RedisStore, flush: impl Fn(), loaded: impl Fn() -> bool) -> u64 {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::{Arc, Mutex};
    let store = Arc::new(store);
    let stop = Arc::new(AtomicBool::new(false));
    let ok = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(Mutex::new(Vec::<String>::new()));
    let tasks: Vec<_> = (0..8)
        .map(|t| {
            let (store, stop, ok, failed) = (store.clone(), stop.clone(), ok.clone(), failed.clone());
            tokio::spawn(async move {
                let mut i = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    i += 1;
                    let key = format!("tl:{{flush{t}-{}}}:r:1h", i % 64);
                    let c = [lc(&key, Algorithm::FixedWindow, 1_000_000_000, 3_600_000_000, 1)];
                    match store.check(&c).await.into_result() {
                        Ok(o) if o[0].allowed => ok.fetch_add(1, Ordering::Relaxed),
                        Ok(o) => {
                            failed.lock().unwrap().push(format!("denied: {o:?}"));
                            0
                        }
                        Err(e) => {
                            failed.lock().unwrap().push(e.to_string());
                            0
                        }
                    };
                    // A check that fails at once (an open breaker) never yields by itself.
                    tokio::task::yield_now().await;
                }
            })
        })
        .collect();
    let warm = eventually(Duration::from_secs(10), || {
        let ok = ok.clone();
        async move { ok.load(Ordering::Relaxed) >= 200 }
    })
    .await;
    assert!(warm, "the load never got going: {:?}", failed.lock().unwrap());
    for round in 0..3 {
        flush();
        let before = ok.load(Ordering::Relaxed);
        let back = eventually(Duration::from_secs(10), || {
            let ok = ok.clone();
            let loaded = &loaded;
            async move { ok.load(Ordering::Relaxed) >= before + 200 && loaded() }
        })
        .await;
        assert!(
            back,
            "round {round}: not reloaded under load: {:?}",
            failed.lock().unwrap()
        );
    }
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await.unwrap();
    }
    let failed = failed.lock().unwrap();
    assert!(
        failed.is_empty(),
        "{} checks failed across the flushes: {:?}",
        failed.len(),
        &failed[..failed.len().min(5)]
    );
    ok.load(Ordering::Relaxed)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn function_flush_under_load_fails_no_check() {
    let server = RedisServer::start();
    let store = single(&server).await;
    let name = store.function_name().to_owned();
    let port = server.port();
    no_failed_check_across_flushes(
        store,
        || assert_eq!(redis_cli(port, &["FUNCTION", "FLUSH"]), "OK"),
        || has_library(port, &name),
    )
    .await;
    assert!(command_calls(port, "fcall") > 0);
    assert!(
        command_calls(port, "function|load") >= 4,
        "loaded at first, then after each flush"
    );
    assert_eq!(command_calls(port, "evalsha") + command_calls(port, "eval"), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn script_flush_under_load_fails_no_check_on_the_eval_path() {
    let server = RedisServer::start();
    let store = single(&server).await;
    store.set_scripting(Scripting::Eval);
    let sha = store.script_sha().to_owned();
    let port = server.port();
    no_failed_check_across_flushes(
        store,
        || assert_eq!(redis_cli(port, &["SCRIPT", "FLUSH"]), "OK"),
        || redis_cli(port, &["SCRIPT", "EXISTS", &sha]) == "1",
    )
    .await;
    assert!(command_calls(port, "eval") >= 3, "EVAL after each NOSCRIPT");
    assert_eq!(command_calls(port, "fcall"), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_function_flush_under_load_fails_no_check() {
    let cluster = RedisCluster::start();
    let store = cluster_store(&cluster).await;
    let name = store.function_name().to_owned();
    let masters = cluster.masters();
    no_failed_check_across_flushes(
        store,
        || cluster.function_flush_all(),
        || masters.iter().all(|&m| has_library(m, &name)),
    )
    .await;
    for &m in &masters {
        assert!(command_calls(m, "fcall") > 0, "master {m} served FCALLs");
        assert_eq!(command_calls(m, "evalsha"), 0, "master {m}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_script_flush_under_load_fails_no_check_on_the_eval_path() {
    let cluster = RedisCluster::start();
    let store = cluster_store(&cluster).await;
    store.set_scripting(Scripting::Eval);
    let sha = store.script_sha().to_owned();
    let masters = cluster.masters();
    no_failed_check_across_flushes(
        store,
        || cluster.script_flush_all(),
        || {
            masters
                .iter()
                .all(|&m| redis_cli(m, &["SCRIPT", "EXISTS", &sha]) == "1")
        },
    )
    .await;
    for &m in &masters {
        assert!(command_calls(m, "evalsha") > 0, "master {m} served EVALSHAs");
        assert_eq!(command_calls(m, "fcall"), 0, "master {m}");
        assert!(!has_library(m, &format!("tollgate_{sha}")), "master {m}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_time_is_used_when_no_now_is_passed() {
    let server = RedisServer::start();
    let store = single(&server).await;
    let window = 10_000_000u64;
    let c = [lc("tl:{time}:r:10s", Algorithm::FixedWindow, 5, window, 1)];
    let sys_now = tollgate::clock::Clock::now_us(&tollgate::clock::SystemClock);
    let o = store.check(&c).await.into_result().unwrap();
    assert!(o[0].allowed);
    // reset = end of the epoch-aligned window that Redis' clock is in (same machine clock).
    let expected = window - sys_now % window;
    let diff = o[0].reset_us.abs_diff(expected);
    assert!(
        diff < 1_000_000 || diff > window - 1_000_000,
        "reset {} vs {}",
        o[0].reset_us,
        expected
    );
    let index: u64 = server.cli(&["HGET", "tl:{time}:r:10s", "i"]).parse().unwrap();
    assert!(index.abs_diff(sys_now / window) <= 1);

    // An explicit now is honoured instead.
    let o = store.check_at(&c, Some(NOW)).await.into_result().unwrap();
    assert_eq!(o[0].reset_us, window - NOW % window);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sliding_log_counts_requests_in_the_same_microsecond() {
    let server = RedisServer::start();
    let store = single(&server).await;
    let key = "tl:{log}:r:1m";
    let c = |cost| [lc(key, Algorithm::SlidingLog, 5, 60_000_000, cost)];
    let a = store.check_at(&c(1), Some(NOW)).await.into_result().unwrap();
    let b = store.check_at(&c(2), Some(NOW)).await.into_result().unwrap();
    assert!(a[0].allowed && b[0].allowed);
    assert_eq!((a[0].remaining, b[0].remaining), (4, 2));
    assert_eq!(server.cli(&["ZCARD", key]), "3");

    // A cross-slot rejection at the same microsecond spends and refunds on this key; members
    // stay unique afterwards.
    let other = "tl:{log-other}:r:1m";
    let o = store
        .check_at(&[lc(other, Algorithm::FixedWindow, 1, 60_000_000, 1)], Some(NOW))
        .await
        .into_result()
        .unwrap();
    assert!(o[0].allowed);
    let blocked = [
        lc(key, Algorithm::SlidingLog, 5, 60_000_000, 1),
        lc(other, Algorithm::FixedWindow, 1, 60_000_000, 1),
    ];
    let o = store.check_at(&blocked, Some(NOW)).await.into_result().unwrap();
    assert!(o[0].allowed && !o[1].allowed);
    assert_eq!(server.cli(&["ZCARD", key]), "3", "refunded");
    let d = store.check_at(&c(2), Some(NOW)).await.into_result().unwrap();
    assert!(d[0].allowed);
    assert_eq!(d[0].remaining, 0);
    assert_eq!(server.cli(&["ZCARD", key]), "5", "every unit is its own member");
    let e = store.check_at(&c(1), Some(NOW)).await.into_result().unwrap();
    assert!(!e[0].allowed);
    assert_eq!(e[0].retry_after_us, 60_000_000);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cross_slot_rejection_refunds_every_algorithm() {
    let server = RedisServer::start();
    let store = single(&server).await;
    for algo in Algorithm::ALL {
        let a = format!("tl:{{a-{}}}:r:p", algo.as_str());
        let b = format!("tl:{{b-{}}}:r:p", algo.as_str());
        let la = |cost| lc(&a, algo, 10, 10_000_000, cost);
        let lb = lc(&b, Algorithm::FixedWindow, 1, 10_000_000, 1);
        // A has one unit spent; B is exhausted.
        assert!(store.check_at(&[la(1)], Some(NOW)).await.into_result().unwrap()[0].allowed);
        assert!(
            store
                .check_at(std::slice::from_ref(&lb), Some(NOW))
                .await
                .into_result()
                .unwrap()[0]
                .allowed
        );
        let before_a = raw_state(server.port(), &a);
        let before_b = raw_state(server.port(), &b);

        let o = store
            .check_at(&[la(2), lb.clone()], Some(NOW + 10))
            .await
            .into_result()
            .unwrap();
        assert!(o[0].allowed, "{algo:?}: A alone would admit");
        assert!(!o[1].allowed, "{algo:?}: B denies");
        assert_eq!(raw_state(server.port(), &a), before_a, "{algo:?}: A refunded exactly");
        assert_eq!(raw_state(server.port(), &b), before_b, "{algo:?}: B untouched");

        let o = store.check_at(&[la(8)], Some(NOW + 20)).await.into_result().unwrap();
        assert!(o[0].allowed, "{algo:?}: 9 of 10 units still free");
        assert_eq!(o[0].remaining, 1, "{algo:?}");

        // A denied *shadow* limit on another slot blocks nothing.
        let o = store
            .check_at(&[la(1), shadow(lb.clone())], Some(NOW + 30))
            .await
            .into_result()
            .unwrap();
        assert!(!o[1].allowed);
        assert_eq!(o[0].remaining, 0, "{algo:?}: A spent its last unit");
        assert_eq!(raw_state(server.port(), &b), before_b, "{algo:?}: shadow B untouched");

        // The same with Redis time (other keys: Redis' clock is far from NOW).
        let a2 = format!("tl:{{a2-{}}}:r:p", algo.as_str());
        let b2 = format!("tl:{{b2-{}}}:r:p", algo.as_str());
        let la2 = lc(&a2, algo, 10, 10_000_000, 3);
        let lb2 = lc(&b2, Algorithm::FixedWindow, 1, 10_000_000, 1);
        assert!(store.check(std::slice::from_ref(&lb2)).await.into_result().unwrap()[0].allowed);
        let o = store.check(&[la2.clone(), lb2.clone()]).await.into_result().unwrap();
        assert!(o[0].allowed && !o[1].allowed);
        let p = store.peek(&[la2]).await.unwrap()[0];
        assert!(p.is_none_or(|p| p.remaining == 10), "{algo:?}: {p:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_slot_rejection_writes_nothing() {
    let server = RedisServer::start();
    let store = single(&server).await;
    let a = "tl:{same}:a";
    let b = "tl:{same}:b";
    assert!(
        store
            .check_at(&[lc(b, Algorithm::SlidingWindow, 1, 1_000_000, 1)], Some(NOW))
            .await
            .into_result()
            .unwrap()[0]
            .allowed
    );
    let o = store
        .check_at(
            &[
                lc(a, Algorithm::TokenBucket, 5, 1_000_000, 1),
                lc(b, Algorithm::SlidingWindow, 1, 1_000_000, 1),
            ],
            Some(NOW + 1),
        )
        .await
        .into_result()
        .unwrap();
    assert!(o[0].allowed && !o[1].allowed);
    assert_eq!(
        server.cli(&["EXISTS", a]),
        "0",
        "nothing written for a rejected request"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_written_key_gets_an_expiry() {
    let server = RedisServer::start();
    let store = single(&server).await;
    let period = 2_000_000;
    let checks: Vec<LimitCheck> = Algorithm::ALL
        .iter()
        .map(|&a| lc(&format!("tl:{{ttl}}:{}", a.as_str()), a, 4, period, 1))
        .collect();
    // The fixed window's key lives until the end of its 2 s window by Redis time: check early
    // in a window, or the key may be gone before its PTTL is read.
    let early = eventually(Duration::from_secs(3), || async {
        let time = server.cli(&["TIME"]);
        let mut parts = time.lines().map(|l| l.trim().parse::<u64>().unwrap());
        let (secs, micros) = (parts.next().unwrap(), parts.next().unwrap());
        (secs * 1_000_000 + micros) % period < period / 2
    })
    .await;
    assert!(early, "Redis TIME never reached the first half of a window");
    let o = store.check(&checks).await.into_result().unwrap();
    assert!(o.iter().all(|o| o.allowed));
    for c in &checks {
        let pttl: i64 = server.cli(&["PTTL", c.key.as_str()]).parse().unwrap();
        let max = match c.quota.algorithm {
            Algorithm::TokenBucket | Algorithm::LeakyBucket => 500, // one unit of 4 per 2 s
            Algorithm::FixedWindow | Algorithm::SlidingLog => 2_000,
            Algorithm::SlidingWindow => 4_000,
            Algorithm::Concurrency => unreachable!("not in Algorithm::ALL"),
        };
        assert!(
            pttl > 0 && pttl <= max,
            "{}: PTTL {pttl} not in (0, {max}]",
            c.key.as_str()
        );
    }
    // Cost 0 on a fresh bucket: its state is "full" already, so it expires at once.
    let z = lc("tl:{ttl}:zero", Algorithm::TokenBucket, 4, period, 0);
    store.check(&[z]).await.into_result().unwrap();
    let pttl: i64 = server.cli(&["PTTL", "tl:{ttl}:zero"]).parse().unwrap();
    assert!(pttl == -2 || (0..=1).contains(&pttl), "PTTL {pttl}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peek_reset_and_trait_refund() {
    let server = RedisServer::start();
    let store = single(&server).await;
    let checks: Vec<LimitCheck> = Algorithm::ALL
        .iter()
        .map(|&a| lc(&format!("tl:{{peek}}:{}", a.as_str()), a, 4, 60_000_000, 1))
        .collect();
    assert_eq!(store.peek(&checks).await.unwrap(), vec![None; 5]);
    store.check(&checks).await.into_result().unwrap();
    let second = store.check(&checks).await.into_result().unwrap();
    for (p, c) in store.peek(&checks).await.unwrap().into_iter().zip(&checks) {
        let p = p.unwrap_or_else(|| panic!("{} exists", c.key.as_str()));
        assert!(p.allowed);
        assert_eq!(p.remaining, 2, "{:?}", c.quota.algorithm);
    }
    // Peek writes nothing.
    assert_eq!(store.peek(&checks).await.unwrap()[2].unwrap().remaining, 2);

    // Give one request back (a leaky-bucket client that left while waiting).
    let spent: Vec<(LimitCheck, u64)> = checks.iter().cloned().zip(second.iter().map(|o| o.at_us)).collect();
    store.refund(&spent).await.unwrap();
    for (p, c) in store.peek(&checks).await.unwrap().into_iter().zip(&checks) {
        assert!(p.unwrap().remaining >= 3, "{:?} refunded", c.quota.algorithm);
    }

    let keys: Vec<StoreKey> = checks.iter().map(|c| c.key.clone()).collect();
    store.reset(&keys).await.unwrap();
    assert_eq!(store.peek(&checks).await.unwrap(), vec![None; 5]);
    // Keys on several slots reset fine too.
    let spread: Vec<LimitCheck> = (0..4)
        .map(|i| lc(&format!("tl:{{r{i}}}:x"), Algorithm::FixedWindow, 3, 60_000_000, 1))
        .collect();
    store.check(&spread).await.into_result().unwrap();
    let keys: Vec<StoreKey> = spread.iter().map(|c| c.key.clone()).collect();
    store.reset(&keys).await.unwrap();
    // Only the reset markers (`<key>:r`, expiring) remain.
    let left = server.cli(&["KEYS", "*"]);
    assert!(left.lines().all(|k| k.ends_with(":r")), "{left}");
    assert_eq!(left.lines().count(), 5 + 4, "{left}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_of_another_type_is_replaced_not_an_error() {
    let server = RedisServer::start();
    let store = single(&server).await;
    for algo in Algorithm::ALL {
        let key = format!("tl:{{type}}:{}", algo.as_str());
        // Leave a key of a type this algorithm does not use.
        if algo.is_bucket() {
            server.cli(&["HSET", &key, "i", "1", "c", "9"]);
        } else {
            server.cli(&["SET", &key, "junk"]);
        }
        let c = [lc(&key, algo, 3, 1_000_000, 1)];
        assert!(store.peek(&c).await.unwrap()[0].is_some());
        let o = store.check(&c).await.into_result().unwrap();
        assert!(o[0].allowed, "{algo:?}");
        assert_eq!(o[0].remaining, 2, "{algo:?}: starts afresh");
        let o = store.check(&c).await.into_result().unwrap();
        assert_eq!(o[0].remaining, 1, "{algo:?}: and counts from there");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probe_and_a_killed_then_restarted_server() {
    let mut server = RedisServer::start();
    let store = single(&server).await;
    store.probe().await.unwrap();
    assert_eq!(
        server.cli(&["EXISTS", tollgate::limiter::redis::PROBE_KEY]),
        "0",
        "expired in 1 ms"
    );

    server.kill();
    let err = store.probe().await.unwrap_err();
    assert!(matches!(err, StoreError::Redis(_) | StoreError::Timeout), "{err:?}");
    let c = [lc("tl:{kill}:x", Algorithm::FixedWindow, 3, 1_000_000, 1)];
    assert!(store.check(&c).await.into_result().is_err());

    server.restart();
    until_ok(&store, &c, Duration::from_secs(5)).await;
    store.probe().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_server_times_out_then_recovers() {
    let server = RedisServer::start();
    let store = single(&server).await;
    let c = [lc("tl:{frozen}:x", Algorithm::TokenBucket, 100, 1_000_000, 1)];
    store.check(&c).await.into_result().unwrap();
    server.stop();
    let started = Instant::now();
    let err = store.check(&c).await.into_result().unwrap_err();
    assert!(matches!(err, StoreError::Timeout), "{err:?}");
    assert!(
        started.elapsed() < T * 3,
        "bounded by the deadline: {:?}",
        started.elapsed()
    );
    // Piling timeouts start (rate-limited) rebuilds, which fail while it is frozen.
    for _ in 0..4 {
        assert!(store.check(&c).await.into_result().is_err());
    }
    server.cont();
    let o = until_ok(&store, &c, Duration::from_secs(5)).await;
    assert!(o[0].allowed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_arguments_are_a_script_error_not_a_panic() {
    let server = RedisServer::start();
    // `EVAL <the script> <args>`, the args split on spaces, `''` standing for an empty one.
    let eval = |args: &str| {
        let mut all = vec!["EVAL", SCRIPT_SOURCE];
        all.extend(args.split(' ').map(|a| if a == "''" { "" } else { a }));
        server.cli(&all)
    };
    // The combined script refuses a wrong argument count with an error reply.
    let out = eval("1 k check ''");
    assert!(out.contains("tollgate: bad arguments"), "{out}");
    let out = eval("1 k check '' 1 1 0 9:1:1:1:0");
    assert!(out.contains("bad arguments for limit 1"), "{out}");
    // A batch whose layout does not add up is refused before anything is written.
    let out = eval("1 k check '' 2 1 0 3:5:1000000:1:0");
    assert!(out.contains("request layout"), "{out}");
    // A request's deadline must be a whole instant (0: none).
    let out = eval("1 k check '' 1 1 -1 3:5:1000000:1:0");
    assert!(out.contains("request layout"), "{out}");
    let out = eval("2 k k check '' 1 1 0 3:5:1000000:1:0");
    assert!(out.contains("bad arguments"), "{out}");
    assert_eq!(server.cli(&["EXISTS", "k"]), "0");
    let out = eval("0 nope ''");
    assert!(out.contains("unknown mode"), "{out}");
    // Probe-style keyless peek answers [now], packed like every reply.
    let mut con = redis::Client::open(server.url())
        .and_then(|c| c.get_connection())
        .expect("connect to redis-server");
    let packed: Vec<u8> = redis::cmd("EVAL")
        .arg(SCRIPT_SOURCE)
        .arg(0)
        .arg("peek")
        .arg(123)
        .query(&mut con)
        .expect("keyless peek");
    assert_eq!(packed, 123f64.to_le_bytes());
    // Arguments the gateway never sends are refused before anything is
    // written: a negative cost (which used to mint quota), fractions, non-finite and huge
    // numbers, a sliding log past its bound, a bucket past 10 years of refill, a bad `now`.
    let now = "1800000000000000";
    for (what, limit_args) in [
        ("negative cost", "3:5:1000000:-10:0"),
        ("fractional cost", "3:5:1000000:1.5:0"),
        ("fractional limit", "3:5.5:1000000:1:0"),
        ("non-finite limit", "3:inf:1000000:1:0"),
        ("NaN interval", "3:5:nan:1:0"),
        ("huge cost", "3:5:1000000:100000000000000000:0"),
        ("huge limit", "5:10000000000000:1000000:1:0"),
        ("zero interval", "1:5:0:1:0"),
        ("bucket refill over 10 years", "1:1000000000:1000000000:1:0"),
        ("sliding log over its bound", "4:3000000:1000000:1:0"),
        ("sliding log cost over its bound", "4:10000:1000000:3000000:0"),
        ("shadow flag", "3:5:1000000:1:yes"),
        ("unknown flag", "3:5:1000000:1:4"),
        ("concurrency cost over 1", "6:5:30000000:2:0 00ab"),
        ("concurrency holder missing", "6:5:30000000:1:0"),
        ("concurrency holder with bad bytes", "6:5:30000000:1:0 a-b"),
        ("penalty max under base", "3:5:1000000:1:2 5000000 1000000"),
        ("penalty of 0", "3:5:1000000:1:2 0 0"),
        ("a spec of 4 numbers", "3:5:1000000:1"),
        ("a spec of 6 numbers", "3:5:1000000:1:0:1"),
        ("a number in hex", "3:0x5:1000000:1:0"),
        ("a number with a sign", "3:+5:1000000:1:0"),
        ("the 5 numbers as 5 arguments", "3 5 1000000 1 0"),
    ] {
        let out = eval(&format!("1 k check {now} 1 1 0 {limit_args}"));
        assert!(out.contains("bad arguments for limit 1"), "{what}: {out}");
        let out = eval(&format!("2 k k:r refund {now} {limit_args}"));
        assert!(out.contains("bad arguments for limit 1"), "{what} (refund): {out}");
    }
    for bad_now in ["-5", "1.5", "inf", "99999999999999999"] {
        let out = eval(&format!("1 k check {bad_now} 1 1 0 3:5:1000000:1:0"));
        assert!(out.contains("bad arguments (now)"), "now {bad_now}: {out}");
    }
    assert_eq!(server.cli(&["EXISTS", "k"]), "0", "a refused call wrote");
}

/// One limit as the script takes it: (key, algorithm code, limit, interval, cost, shadow).
type RawLimit<'a> = (&'a str, u8, u64, u64, u64, bool);

/// Run the script's `check` mode on a batch of requests; returns the reply's numbers (the
/// script packs them as little-endian doubles in one string).
fn eval_batch(server: &RedisServer, now: u64, requests: &[&[RawLimit<'_>]]) -> Vec<i64> {
    let mut cmd = redis::cmd("EVAL");
    cmd.arg(SCRIPT_SOURCE);
    let keys: Vec<&str> = requests.iter().flat_map(|r| r.iter().map(|l| l.0)).collect();
    cmd.arg(keys.len()).arg(&keys).arg("check").arg(now).arg(requests.len());
    for r in requests {
        cmd.arg(r.len()).arg(0); // no deadline
        for &(_, algo, limit, interval, cost, shadow) in r.iter() {
            cmd.arg(format!("{algo}:{limit}:{interval}:{cost}:{}", u8::from(shadow)));
        }
    }
    let mut con = redis::Client::open(server.url())
        .and_then(|c| c.get_connection())
        .expect("connect to redis-server");
    let packed: Vec<u8> = cmd.query(&mut con).expect("EVAL check");
    assert_eq!(packed.len() % 8, 0, "a whole number of doubles");
    packed
        .chunks_exact(8)
        .map(|c| f64::from_le_bytes(c.try_into().unwrap()) as i64)
        .collect()
}

/// What a key holds, whatever its type, with its expiry: for comparing two keys written alike.
fn stored(server: &RedisServer, key: &str) -> String {
    let kind = server.cli(&["TYPE", key]);
    let mut value = match kind.as_str() {
        "string" => server.cli(&["GET", key]),
        "hash" => server.cli(&["HGETALL", key]),
        "zset" => server.cli(&["ZRANGE", key, "0", "-1", "WITHSCORES"]),
        _ => String::new(),
    };
    if kind == "hash" {
        // Field, value pairs, in field order.
        let words: Vec<&str> = value.split_whitespace().collect();
        let mut pairs: Vec<String> = words.chunks(2).map(|p| p.join("=")).collect();
        pairs.sort();
        value = pairs.join(" ");
    }
    format!("{kind} {value} pexpiretime {}", server.cli(&["PEXPIRETIME", key]))
}

/// A request whose only limit is a bucket or a window takes the script's one-read path (its
/// algorithm's `check`, lua/check.lua); the same request with a second limit that never denies
/// takes the general one (evaluate every limit, then spend each). Both must answer and write
/// the same, request after request: shadow or not, costs of 0 to 3, denials, time moving on,
/// after state of every other algorithm under the same key (a reload's conversion), in calls
/// of their own, and in one batch mixing both kinds of request on one key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_limit_requests_decide_as_the_general_path_does() {
    use rand::{Rng, SeedableRng};
    let server = RedisServer::start();
    // (code, limit, interval): token and leaky bucket, fixed window, sliding log, sliding window.
    let shapes = [
        (1u8, 3u64, 400_000u64),
        (2, 3, 400_000),
        (3, 4, 1_000_000),
        (4, 4, 1_000_000),
        (5, 4, 1_000_000),
    ];
    let mut rng = rand::rngs::StdRng::seed_from_u64(41);
    let mut compared = [0usize; 2];
    for &(code, limit, interval) in &shapes {
        for &(was, was_limit, was_interval) in &shapes {
            let tag = format!("{{g{code}w{was}}}");
            let (a, b, free) = (format!("{tag}a"), format!("{tag}b"), format!("{tag}f"));
            let never = (free.as_str(), 3u8, 1_000_000_000u64, 60_000_000u64, 1u64, false);
            let mut now = NOW + rng.gen_range(0..1_000_000);
            // History under the earlier shape, alike on both keys.
            for _ in 0..3 {
                let old = |k| (k, was, was_limit, was_interval, 1u64, false);
                eval_batch(&server, now, &[&[old(a.as_str())]]);
                eval_batch(&server, now, &[&[old(b.as_str()), never]]);
                now += rng.gen_range(0..300_000);
            }
            for step in 0..40 {
                let cost = rng.gen_range(0..=3u64);
                let shadow = rng.gen_bool(0.2);
                let one = eval_batch(&server, now, &[&[(a.as_str(), code, limit, interval, cost, shadow)]]);
                let two = eval_batch(
                    &server,
                    now,
                    &[&[(b.as_str(), code, limit, interval, cost, shadow), never]],
                );
                assert_eq!(
                    one[..6],
                    two[..6],
                    "code {code} after {was}, step {step}: one-read path vs general"
                );
                assert_eq!(
                    stored(&server, &a),
                    stored(&server, &b),
                    "code {code} after {was}, step {step}: what was written"
                );
                compared[usize::from(one[1] == 1)] += 1;
                now += rng.gen_range(0..250_000);
            }
        }
        // One batch mixing one-limit and two-limit requests on one key, against the same
        // requests in calls of their own.
        let tag = format!("{{m{code}}}");
        let (x, xf, y, yf) = (
            format!("{tag}x"),
            format!("{tag}xf"),
            format!("{tag}y"),
            format!("{tag}yf"),
        );
        let plan: Vec<(u64, bool)> = (0..12).map(|_| (rng.gen_range(0..=2u64), rng.gen_bool(0.5))).collect();
        fn request<'a>(keys: (&'a str, &'a str), shape: (u8, u64, u64), cost: u64, two: bool) -> Vec<RawLimit<'a>> {
            let mut r = vec![(keys.0, shape.0, shape.1, shape.2, cost, false)];
            if two {
                r.push((keys.1, 3u8, 1_000_000_000u64, 60_000_000u64, 1u64, false));
            }
            r
        }
        let shape = (code, limit, interval);
        let owned: Vec<Vec<RawLimit<'_>>> = plan.iter().map(|&(c, two)| request((&x, &xf), shape, c, two)).collect();
        let batch: Vec<&[RawLimit<'_>]> = owned.iter().map(|r| r.as_slice()).collect();
        let batched = eval_batch(&server, NOW, &batch);
        let mut separate = vec![batched[0]];
        for &(c, two) in &plan {
            let r = request((&y, &yf), shape, c, two);
            separate.extend_from_slice(&eval_batch(&server, NOW, &[&r])[1..]);
        }
        assert_eq!(batched, separate, "code {code}: a batch mixing both paths on one key");
        assert_eq!(
            stored(&server, &x),
            stored(&server, &y),
            "code {code}: what the batch wrote"
        );
    }
    // The random plan exercised both answers.
    assert!(compared[0] > 50 && compared[1] > 50, "denied, admitted: {compared:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_is_evaluated_request_by_request() {
    let server = RedisServer::start();
    // Fixed window (code 3), 2 per minute: three one-key requests in one call are admitted,
    // admitted, denied, each seeing what the earlier ones spent.
    let fw = |k| (k, 3u8, 2u64, 60_000_000u64, 1u64, false);
    let r = eval_batch(&server, NOW, &[&[fw("{b}a")], &[fw("{b}a")], &[fw("{b}a")]]);
    assert_eq!(r.len(), 1 + 3 * 5);
    let allowed: Vec<i64> = (0..3).map(|i| r[1 + 5 * i]).collect();
    let remaining: Vec<i64> = (0..3).map(|i| r[2 + 5 * i]).collect();
    assert_eq!(allowed, [1, 1, 0]);
    assert_eq!(remaining, [1, 0, 0]);
    assert_eq!(
        server.cli(&["HGET", "{b}a", "c"]),
        "2",
        "the denied request spent nothing"
    );

    // All-or-nothing per request inside a batch: request 1 has a free key and a full one, so
    // it spends nothing; request 2 uses only the free key and is admitted; request 3 is a
    // token bucket (code 1) that the others do not touch.
    let free = |k| (k, 3u8, 5u64, 60_000_000u64, 1u64, false);
    let tb = (("{b}t"), 1u8, 3u64, 1_000_000u64, 1u64, false);
    let r = eval_batch(&server, NOW, &[&[free("{b}f"), fw("{b}a")], &[free("{b}f")], &[tb]]);
    assert_eq!(r.len(), 1 + 4 * 5);
    assert_eq!([r[1], r[6], r[11], r[16]], [1, 0, 1, 1], "allowed flags");
    assert_eq!(r[12], 4, "request 2 saw nothing spent by the blocked request 1");
    assert_eq!(server.cli(&["HGET", "{b}f", "c"]), "1");
    assert_eq!(r[17], 2, "token bucket remaining");

    // The same requests as separate calls give the same answers: a batch changes nothing.
    let r1 = eval_batch(&server, NOW, &[&[fw("{b}s")]]);
    let r2 = eval_batch(&server, NOW, &[&[fw("{b}s")]]);
    let r3 = eval_batch(&server, NOW, &[&[fw("{b}s")]]);
    let batched = eval_batch(&server, NOW, &[&[fw("{b}z")], &[fw("{b}z")], &[fw("{b}z")]]);
    assert_eq!([&r1[1..], &r2[1..], &r3[1..]].concat(), batched[1..]);

    // A batch bigger than one packing chunk (1,000 numbers): 300 requests, limit 250.
    let big = (("{b}big"), 3u8, 250u64, 60_000_000u64, 1u64, false);
    let one = [big];
    let requests: Vec<&[RawLimit<'_>]> = (0..300).map(|_| &one[..]).collect();
    let r = eval_batch(&server, NOW, &requests);
    assert_eq!(r.len(), 1 + 300 * 5);
    let admitted = (0..300).filter(|i| r[1 + 5 * i] == 1).count();
    assert_eq!(admitted, 250);
    assert_eq!(r[1 + 5 * 249 + 1], 0, "the 250th sees nothing remaining");
    assert_eq!(r[1 + 5 * 299 + 3], r[1 + 5 * 299 + 2], "denied: retry after = reset");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_checks_are_batched_and_exact() {
    let server = RedisServer::start();
    let store = std::sync::Arc::new(single(&server).await);
    for algorithm in Algorithm::ALL {
        let key = format!("tl:{{c}}:{algorithm:?}");
        let limit = lc(&key, algorithm, 100, 3_600_000_000, 1);
        let (calls0, reqs0) = store.batch_stats();
        let tasks: Vec<_> = (0..300)
            .map(|_| {
                let store = std::sync::Arc::clone(&store);
                let limit = limit.clone();
                tokio::spawn(async move { store.check(&[limit]).await.into_result().expect("check")[0].allowed })
            })
            .collect();
        let mut admitted = 0;
        for t in tasks {
            admitted += usize::from(t.await.unwrap());
        }
        assert_eq!(admitted, 100, "{algorithm:?}: exactly the limit is admitted");
        let (calls, reqs) = store.batch_stats();
        assert!(
            reqs - reqs0 >= 300,
            "{algorithm:?}: every request went through the batch task"
        );
        assert!(
            calls - calls0 < reqs - reqs0,
            "{algorithm:?}: 300 concurrent requests were sent in fewer calls ({} calls)",
            calls - calls0
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Redis Cluster
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_checks_across_masters_all_or_nothing_and_moved() {
    let cluster = RedisCluster::start();
    let masters = cluster.masters();
    assert_eq!(masters.len(), 3);
    // Seed with one node only: the client discovers the rest.
    let store = RedisStore::connect(RedisMode::Cluster, &cluster.seed_urls()[..1], T, 3)
        .await
        .unwrap();
    store.probe().await.unwrap();

    let tags: Vec<String> = masters.iter().map(|&m| cluster.tag_on(m, "m")).collect();
    let key = |i: usize| format!("tl:{{{}}}:r:1m", tags[i]);
    let limit = |i: usize, l: u64| lc(&key(i), Algorithm::FixedWindow, l, 60_000_000, 1);
    // One request, three slots on three masters.
    let o = store
        .check_at(&[limit(0, 5), limit(1, 5), limit(2, 1)], Some(NOW))
        .await
        .into_result()
        .unwrap();
    assert!(o.iter().all(|o| o.allowed));
    for (i, &m) in masters.iter().enumerate() {
        assert_eq!(redis_cli(m, &["HGET", &key(i), "c"]), "1", "stored on its master");
    }
    // The third denies: the first two are refunded on their masters.
    let o = store
        .check_at(&[limit(0, 5), limit(1, 5), limit(2, 1)], Some(NOW + 1))
        .await
        .into_result()
        .unwrap();
    assert!(o[0].allowed && o[1].allowed && !o[2].allowed);
    for (i, &m) in masters.iter().enumerate() {
        assert_eq!(redis_cli(m, &["HGET", &key(i), "c"]), "1", "refunded on master {m}");
    }

    // Reshard the first key's slot to another master: the store follows MOVED and finds the
    // migrated counter there.
    let slot = cluster.keyslot(&key(0));
    cluster.move_slot(slot, masters[0], masters[1]);
    let o = store
        .check_at(&[limit(0, 5)], Some(NOW + 2))
        .await
        .into_result()
        .unwrap();
    assert!(o[0].allowed);
    assert_eq!(o[0].remaining, 3, "count 2 after the move: the migrated key was used");
    assert_eq!(redis_cli(masters[1], &["HGET", &key(0), "c"]), "2");

    // No function anywhere: reloaded on the node a call finds without it, and the probe
    // reloads every master.
    cluster.function_flush_all();
    let o = store
        .check_at(&[limit(1, 5)], Some(NOW + 3))
        .await
        .into_result()
        .unwrap();
    assert_eq!(o[0].remaining, 3);
    assert!(has_library(cluster.master_for_key(&key(1)), store.function_name()));
    cluster.function_flush_all();
    store.probe().await.unwrap();
    for &m in &masters {
        assert!(has_library(m, store.function_name()), "master {m}");
    }

    // The same on the EVALSHA path: NOSCRIPT everywhere, EVAL per node, the probe reloads.
    store.set_scripting(Scripting::Eval);
    cluster.script_flush_all();
    let o = store
        .check_at(&[limit(1, 5)], Some(NOW + 4))
        .await
        .into_result()
        .unwrap();
    assert_eq!(o[0].remaining, 2);
    cluster.script_flush_all();
    store.probe().await.unwrap();
    for &m in &masters {
        assert_eq!(redis_cli(m, &["SCRIPT", "EXISTS", store.script_sha()]), "1");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_killed_master_fails_then_recovers_after_failover() {
    let mut cluster = RedisCluster::start();
    let store = cluster_store(&cluster).await;
    let key = "tl:{failover}:r:1m";
    let c = [lc(key, Algorithm::SlidingWindow, 1000, 60_000_000, 1)];
    assert!(store.check(&c).await.into_result().unwrap()[0].allowed);
    let slot = cluster.keyslot(key);
    let old = cluster.master_for_key(key);
    // The first check loaded the library on the master; replication to its replica is
    // asynchronous, so wait for it before the kill (else a busy machine races the two).
    let replicas = cluster.replicas_of(old);
    let replicated = eventually(Duration::from_secs(10), || async {
        replicas.iter().all(|&r| has_library(r, store.function_name()))
    })
    .await;
    assert!(replicated, "the library never reached the replicas of {old}");

    cluster.kill_node(old);
    let r = tokio::time::timeout(T * 2, store.check(&c)).await;
    assert!(
        !matches!(r.map(|c| c.into_result()), Ok(Ok(_))),
        "a dead master cannot answer"
    );

    let started = Instant::now();
    let new = cluster
        .wait_failover(slot, old, Duration::from_secs(15))
        .expect("a replica took over");
    assert_ne!(new, old);
    // Function libraries are replicated (unlike cached scripts): the promoted replica has it.
    assert!(
        has_library(new, store.function_name()),
        "the promoted replica has the library"
    );
    let o = until_ok(&store, &c, Duration::from_secs(10)).await;
    assert!(o[0].allowed);
    eprintln!("failover and recovery took {:?}", started.elapsed());
    store.probe().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_frozen_master_is_abandoned_after_failover() {
    let mut cluster = RedisCluster::start();
    let store = cluster_store(&cluster).await;
    let key = "tl:{frozen}:r:1m";
    let c = [lc(key, Algorithm::TokenBucket, 1000, 60_000_000, 1)];
    assert!(store.check(&c).await.into_result().unwrap()[0].allowed);
    let slot = cluster.keyslot(key);
    let old = cluster.master_for_key(key);

    cluster.stop_node(old);
    let err = store.check(&c).await.into_result().unwrap_err();
    assert!(matches!(err, StoreError::Timeout), "{err:?}");

    cluster
        .wait_failover(slot, old, Duration::from_secs(15))
        .expect("a replica took over");
    // The client alone would keep waiting on the frozen node's open socket; the store's
    // rebuild after repeated timeouts re-reads the topology.
    let o = until_ok(&store, &c, Duration::from_secs(15)).await;
    assert!(o[0].allowed);
    assert!(store.rebuilds() >= 1, "recovered by a connection rebuild");
    cluster.cont_node(old);
}

/// On Redis: a refund names the instant its check was decided
/// (`Outcome::at_us`), so units spent in window [0, 2 s) are not taken off window [2 s, 4 s)
/// (Redis used to refund at its current `TIME`, in whatever window that was).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refund_comes_off_the_window_it_was_spent_in() {
    let server = RedisServer::start();
    let store = single(&server).await;
    let w = 2_000_000;
    let t0 = NOW - NOW % w;
    for algo in [Algorithm::FixedWindow, Algorithm::SlidingWindow] {
        let c = lc(&format!("tl:{{refund-{}}}:r:0", algo.as_str()), algo, 2, w, 1);
        let one = |now| {
            let c = c.clone();
            let store = &store;
            async move { store.check_at(&[c], Some(now)).await.into_result().unwrap()[0] }
        };
        // R1 at 0.2 s, counted in [0, 2).
        let first = one(t0 + 200_000).await;
        assert!(first.allowed);
        assert_eq!(
            first.at_us,
            t0 + 200_000,
            "{algo:?}: the outcome names when it was decided"
        );
        // Just after the boundary the previous window still weighs (sliding window): one fits.
        assert!(one(t0 + w + 1).await.allowed, "{algo:?}");
        // R1's client leaves now; its unit comes off [0, 2), not the current window.
        store.refund(&[(c.clone(), first.at_us)]).await.unwrap();
        let mut admitted = 0;
        for _ in 0..3 {
            admitted += usize::from(one(t0 + w + 2).await.allowed);
        }
        assert_eq!(admitted, 1, "{algo:?}: one more fits in [2, 4)");
        // Two units are counted in [2, 4): the next window starts with them (sliding window)
        // or empty (fixed window), never with one of them minted back by the refund.
        let next = one(t0 + 2 * w + 1).await;
        if algo == Algorithm::SlidingWindow {
            assert!(!next.allowed, "the refund was taken off the wrong window");
        } else {
            assert!(next.allowed);
        }
    }
}

/// A request of a batch whose deadline passed before the script ran (its gateway gave up on
/// it) is answered "late" (allowed code 6) and spends nothing; the next one, in time, spends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_past_its_deadline_is_answered_late_and_spends_nothing() {
    let server = RedisServer::start();
    let now: u64 = 1_800_000_000_000_000;
    let mut cmd = redis::cmd("EVAL");
    cmd.arg(SCRIPT_SOURCE)
        .arg(2)
        .arg("{late}k")
        .arg("{late}k")
        .arg("check")
        .arg(now)
        .arg(2);
    for deadline in [now - 1, now + 1] {
        cmd.arg(1).arg(deadline).arg("3:5:60000000:1:0");
    }
    let mut con = redis::Client::open(server.url())
        .and_then(|c| c.get_connection())
        .expect("connect to redis-server");
    let packed: Vec<u8> = cmd.query(&mut con).expect("EVAL check");
    let r: Vec<i64> = packed
        .chunks_exact(8)
        .map(|c| f64::from_le_bytes(c.try_into().unwrap()) as i64)
        .collect();
    assert_eq!((r[1], r[6]), (6, 1), "late, then admitted: {r:?}");
    assert_eq!(server.cli(&["HGET", "{late}k", "c"]), "1", "the late request spent");
}

/// The loaded function keeps its tables from one call to the next: a limit with a penalty box
/// in one call leaves nothing behind for the limit in the same position of the next call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_inherits_nothing_from_the_one_before() {
    let server = RedisServer::start();
    let store = single(&server).await; // FCALL: the library and its tables stay loaded
    let mut boxed = lc("tl:{keep}:a", Algorithm::FixedWindow, 1, 3_600_000_000, 1);
    boxed.penalty = Some(Penalty {
        base_us: nz(60_000_000),
        max_us: nz(60_000_000),
    });
    let boxed = [boxed];
    assert!(store.check(&boxed).await.into_result().unwrap()[0].allowed);
    assert!(!store.check(&boxed).await.into_result().unwrap()[0].allowed);
    assert_eq!(
        server.cli(&["EXISTS", "tl:{keep}:a:p"]),
        "1",
        "the denial started a penalty"
    );
    // The same position, no penalty: admitted, and nothing written beside its own key.
    let plain = [lc("tl:{keep}:b", Algorithm::FixedWindow, 5, 3_600_000_000, 1)];
    for remaining in [4, 3] {
        let o = store.check(&plain).await.into_result().unwrap();
        assert!(o[0].allowed);
        assert_eq!(o[0].remaining, remaining);
    }
    assert_eq!(server.cli(&["EXISTS", "tl:{keep}:b:p"]), "0");
    // Two limits, then one: the second call's reply has one 5-tuple, its own.
    let two = [
        lc("tl:{keep}:c", Algorithm::TokenBucket, 3, 3_000_000, 1),
        lc("tl:{keep}:d", Algorithm::SlidingWindow, 2, 3_600_000_000, 1),
    ];
    assert_eq!(store.check(&two).await.into_result().unwrap().len(), 2);
    let o = store.check(&plain).await.into_result().unwrap();
    assert_eq!(o.len(), 1);
    assert_eq!(o[0].remaining, 2);
    assert_eq!(
        command_calls(server.port(), "evalsha") + command_calls(server.port(), "eval"),
        0
    );
}
