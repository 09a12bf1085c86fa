//! Differential tests: seeded random request sequences driven through the memory store
//! (`MemoryStore::check_at`) and through the Lua script on a real Redis (`RedisStore::check_at`
//! with the same `now`), asserting the same decisions.
//!
//! Both implement the algorithms of `src/limiter/algorithm.rs` with the same integer arithmetic
//! and, for the sliding window, the same floating-point expressions in the same order, so the
//! outcomes are expected to be identical; the assertion allows the rounding slack of the design
//! (±1 µs for integer algorithms, ±2 µs for the sliding window) on times and requires exact
//! `allowed` and `remaining`.

mod support;

use std::num::NonZeroU64;
use std::sync::Arc;

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

use support::*;
use tollgate::clock::FakeClock;
use tollgate::limiter::algorithm::calendar::{days_from_civil, Calendar, CalendarUnit, DAY_US};
use tollgate::limiter::memory::MemoryStore;
use tollgate::limiter::redis::{RedisMode, RedisStore};
use tollgate::limiter::{Algorithm, LimitCheck, Outcome, Penalty, Quota, Store, StoreKey};

/// Deadline per Redis call (debug build; the tests run in parallel on a small machine).
const TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);

fn nz(v: u64) -> NonZeroU64 {
    NonZeroU64::new(v).unwrap()
}

/// A random calendar window (day, week or month at a random UTC offset) for `algorithm`.
fn calendar_quota(rng: &mut StdRng, algorithm: Algorithm) -> Quota {
    let limit = nz(*[1u64, 2, 3, 5, 7, 10, 20].choose(rng).unwrap());
    let unit = *[CalendarUnit::Day, CalendarUnit::Week, CalendarUnit::Month]
        .choose(rng)
        .unwrap();
    let mut q = Quota::window(algorithm, limit, nz(unit.nominal_us()));
    q.calendar = Some(Calendar {
        unit,
        offset_s: *[0, 7200, -5 * 3600, 5 * 3600 + 1800, -12 * 3600].choose(rng).unwrap(),
    });
    q
}

/// A random quota for `algorithm`.
fn random_quota(rng: &mut StdRng, algorithm: Algorithm) -> Quota {
    let limit = nz(*[1u64, 2, 3, 5, 7, 10, 20].choose(rng).unwrap());
    if algorithm == Algorithm::Concurrency {
        // The window of a concurrency limit is its slots' time to live.
        let ttl = *[3_000u64, 1_000_000, 30_000_000].choose(rng).unwrap();
        return Quota::window(algorithm, limit, nz(ttl));
    }
    if algorithm.is_bucket() {
        let interval = *[1_000u64, 3_333, 50_000, 333_333, 1_000_000].choose(rng).unwrap();
        Quota::bucket(algorithm, limit, nz(interval))
    } else {
        let window = *[1_000u64, 7_919, 100_000, 1_000_000, 60_000_000, 3_600_000_000]
            .choose(rng)
            .unwrap();
        Quota::window(algorithm, limit, nz(window))
    }
}

/// How one sequence spreads its limits over hash tags.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Tags {
    /// Every limit on one tag (one script call per request).
    One,
    /// Limits on two or three tags (several calls, refunds on rejection).
    Spread,
}

/// What a test runs.
struct Plan {
    /// Algorithms to draw each limit from.
    algorithms: &'static [Algorithm],
    /// Limits per sequence (drawn uniformly from this range).
    limits: std::ops::RangeInclusive<usize>,
    /// Number of sequences.
    sequences: u64,
    /// Requests per sequence.
    steps: usize,
    /// Tag layout.
    tags: Tags,
    /// Seed of the first sequence (each sequence is reproducible from its own seed).
    seed: u64,
    /// Reloads: now and then a limit gets another algorithm, window or rate under the same key,
    /// and both stores must convert its state the same way.
    reshape: bool,
    /// Some limits have a penalty box, and admitted requests' concurrency slots are
    /// released now and then (on both stores) as their responses end.
    extras: bool,
    /// Now and then an admitted request's reported cost settles its reservation (a
    /// refund below the estimate, a debit above it) on both stores.
    settle: bool,
    /// Windows follow the calendar (days, weeks, months at UTC offsets).
    calendar: bool,
}

/// Largest |a - b| seen per field, and the number of non-identical outcomes.
#[derive(Default, Debug)]
struct Stats {
    steps: usize,
    checks: usize,
    allowed: usize,
    not_identical: usize,
    max_time_diff: u64,
    /// Checks denied by a penalty box (started, escalated or served).
    penalized: usize,
    /// Concurrency checks denied for want of a free slot.
    slots_full: usize,
    /// Reservations settled (refunded or debited).
    settled: usize,
}

fn close(a: u64, b: u64, tol: u64) -> bool {
    a.abs_diff(b) <= tol
}

/// Run one plan against `store`; panics with the reproducing seed on the first difference.
async fn run(store: &RedisStore, plan: &Plan, label: &str) -> Stats {
    let mut stats = Stats::default();
    for s in 0..plan.sequences {
        let seed = plan.seed + s;
        let mut rng = StdRng::seed_from_u64(seed);
        let memory = MemoryStore::new(Arc::new(FakeClock::new(0)), 10_000);
        let n = rng.gen_range(plan.limits.clone());
        let tag_count = match plan.tags {
            Tags::One => 1,
            Tags::Spread => rng.gen_range(2..=3),
        };
        let penalties: Vec<Option<Penalty>> = (0..n)
            .map(|_| {
                (plan.extras && rng.gen_bool(0.4)).then(|| {
                    let base = *[1_000u64, 100_000, 2_000_000].choose(&mut rng).unwrap();
                    let max = if rng.gen_bool(0.5) { base } else { base * 4 };
                    Penalty {
                        base_us: nz(base),
                        max_us: nz(max),
                    }
                })
            })
            .collect();
        // Settlements of admitted requests whose reported cost comes back later.
        let mut pending: Vec<Settlement> = Vec::new();
        // Admitted requests still holding concurrency slots: (their slot checks, decided at).
        let mut holding: Vec<Vec<(LimitCheck, u64)>> = Vec::new();
        let mut limits: Vec<(StoreKey, Quota)> = (0..n)
            .map(|j| {
                let algorithm = *plan.algorithms.choose(&mut rng).unwrap();
                let tag = format!("{label}-{seed}-{}", j % tag_count);
                let key = if plan.reshape {
                    format!("d:{{{tag}}}:{j}")
                } else {
                    format!("d:{{{tag}}}:{j}:{}", algorithm.as_str())
                };
                let q = if plan.calendar {
                    calendar_quota(&mut rng, algorithm)
                } else {
                    random_quota(&mut rng, algorithm)
                };
                (StoreKey::from(key), q)
            })
            .collect();
        // A random phase in the future (year 2096+): keys expire by this clock (PEXPIREAT), so
        // none expires in wall-clock time during the test.
        let mut now: u64 = 4_000_000_000_000_000 + rng.gen_range(0..4_000_000_000_000);
        for step in 0..plan.steps {
            if plan.reshape && rng.gen_bool(0.15) {
                let j = rng.gen_range(0..n);
                let algorithm = *plan.algorithms.choose(&mut rng).unwrap();
                limits[j].1 = random_quota(&mut rng, algorithm);
            }
            // Time step: often none, else up to a fraction, one or three periods of a limit.
            let (_, q) = limits.choose(&mut rng).unwrap();
            let period = q.window_us.get();
            now += match rng.gen_range(0..10) {
                0 | 1 => 0,
                2..=5 => rng.gen_range(0..=q.interval_us.get().min(period) / 2 + 1),
                6..=8 => rng.gen_range(0..=period),
                _ => rng.gen_range(0..=3 * period),
            };
            // The request: a non-empty random subset of the limits, in random order.
            let mut idx: Vec<usize> = (0..n).filter(|_| rng.gen_bool(0.7)).collect();
            if idx.is_empty() {
                idx.push(rng.gen_range(0..n));
            }
            idx.shuffle(&mut rng);
            let checks: Vec<LimitCheck> = idx
                .iter()
                .map(|&j| {
                    let (key, quota) = &limits[j];
                    let max = if quota.algorithm == Algorithm::Concurrency {
                        1
                    } else {
                        quota.limit.get().min(4)
                    };
                    let cost = if rng.gen_bool(0.05) { 0 } else { rng.gen_range(1..=max) };
                    LimitCheck {
                        key: key.clone(),
                        quota: *quota,
                        cost,
                        shadow: rng.gen_bool(0.2),
                        holder: step as u64 + 1,
                        penalty: penalties[j],
                        lease: None,
                    }
                })
                .collect();
            // Some earlier request's reported cost comes back now.
            if !pending.is_empty() && rng.gen_bool(0.3) {
                let i = rng.gen_range(0..pending.len());
                let due = pending.swap_remove(i);
                settle(&memory, store, due, (now, seed, step), &mut stats).await;
            }
            // Some earlier request's response ends: its slots are released on both stores.
            if !holding.is_empty() && rng.gen_bool(0.4) {
                let i = rng.gen_range(0..holding.len());
                let done = holding.swap_remove(i);
                memory.refund_spent(&done);
                tokio::time::timeout(TIMEOUT, store.refund(&done))
                    .await
                    .unwrap_or_else(|_| panic!("seed {seed} step {step}: release timed out"))
                    .unwrap_or_else(|e| panic!("seed {seed} step {step}: release failed: {e}"));
            }
            let expected = memory.check_at(&checks, now);
            let got = tokio::time::timeout(TIMEOUT, store.check_at(&checks, Some(now)))
                .await
                .unwrap_or_else(|_| panic!("seed {seed} step {step}: redis timed out"))
                .into_result()
                .unwrap_or_else(|e| panic!("seed {seed} step {step}: redis failed: {e}"));
            compare(seed, step, now, &checks, &expected, &got, &mut stats);
            let admitted = checks.iter().zip(&expected).all(|(c, o)| c.shadow || o.allowed);
            if admitted && plan.settle && rng.gen_bool(0.4) {
                // The reported cost of each settling limit: 0 ..= 3 × its estimate.
                let (mut refunds, mut debits) = (Vec::new(), Vec::new());
                for (c, o) in checks.iter().zip(&expected) {
                    let settles = matches!(
                        c.quota.algorithm,
                        Algorithm::TokenBucket | Algorithm::FixedWindow | Algorithm::SlidingWindow
                    );
                    if !settles || !o.allowed || c.cost == 0 {
                        continue;
                    }
                    // Now and then far above the estimate: the debit meets its floor.
                    let actual = if rng.gen_bool(0.1) {
                        rng.gen_range(0..=3 * quota_limit(c) + c.cost)
                    } else {
                        rng.gen_range(0..=3 * c.cost)
                    };
                    let mut d = c.clone();
                    if actual < c.cost {
                        d.cost = c.cost - actual;
                        refunds.push((d, o.at_us));
                    } else if actual > c.cost {
                        d.cost = actual - c.cost;
                        debits.push(d);
                    }
                }
                // Settled at once, or a few steps later (its window may have moved on since).
                if rng.gen_bool(0.5) {
                    settle(&memory, store, (refunds, debits), (now, seed, step), &mut stats).await;
                } else {
                    pending.push((refunds, debits));
                }
            }
            if admitted {
                let slots: Vec<(LimitCheck, u64)> = checks
                    .iter()
                    .zip(&expected)
                    .filter(|(c, o)| c.is_slot() && o.allowed && c.cost > 0)
                    .map(|(c, o)| (c.clone(), o.at_us))
                    .collect();
                if !slots.is_empty() {
                    holding.push(slots);
                }
            }
        }
    }
    eprintln!("{label}: {stats:?}");
    // Within tolerance is the contract; in fact both stores run the same arithmetic, so any
    // difference at all is a divergence worth a look.
    assert_eq!(
        stats.not_identical, 0,
        "{label}: outcomes differ within tolerance: {stats:?}"
    );
    stats
}

/// One request's settlement: refunds (each in the window it was spent in), and debits.
type Settlement = (Vec<(LimitCheck, u64)>, Vec<LimitCheck>);

/// A limit's limit (a bucket's capacity).
fn quota_limit(c: &LimitCheck) -> u64 {
    c.quota.limit.get()
}

/// Settle `due` on both stores at `now` (`at` is `(now, seed, step)`).
async fn settle(memory: &MemoryStore, store: &RedisStore, due: Settlement, at: (u64, u64, usize), stats: &mut Stats) {
    let (now, seed, step) = at;
    let (refunds, debits) = due;
    memory.refund_spent(&refunds);
    memory.debit_at(&debits, now);
    store
        .refund(&refunds)
        .await
        .unwrap_or_else(|e| panic!("seed {seed} step {step}: {e}"));
    store
        .debit_at(&debits, Some(now))
        .await
        .unwrap_or_else(|e| panic!("seed {seed} step {step}: {e}"));
    stats.settled += refunds.len() + debits.len();
}

fn compare(
    seed: u64,
    step: usize,
    now: u64,
    checks: &[LimitCheck],
    expected: &[Outcome],
    got: &[Outcome],
    stats: &mut Stats,
) {
    stats.steps += 1;
    assert_eq!(expected.len(), got.len());
    for ((c, e), g) in checks.iter().zip(expected).zip(got) {
        stats.checks += 1;
        stats.allowed += usize::from(e.allowed);
        stats.penalized += usize::from(e.penalty_us > 0);
        stats.slots_full += usize::from(c.is_slot() && !e.allowed && e.penalty_us == 0);
        let tol = if c.quota.algorithm == Algorithm::SlidingWindow {
            2
        } else {
            1
        };
        let ctx = || {
            format!(
                "seed {seed} step {step} now {now} check {c:?}\n  request {checks:?}\n  \
                 memory {e:?}\n  redis  {g:?}"
            )
        };
        assert_eq!(e.allowed, g.allowed, "allowed differs: {}", ctx());
        assert_eq!(e.remaining, g.remaining, "remaining differs: {}", ctx());
        assert!(
            close(e.retry_after_us, g.retry_after_us, tol),
            "retry_after differs: {}",
            ctx()
        );
        assert!(close(e.reset_us, g.reset_us, tol), "reset differs: {}", ctx());
        assert!(close(e.delay_us, g.delay_us, tol), "delay differs: {}", ctx());
        assert_eq!(e.penalty_started, g.penalty_started, "penalty start differs: {}", ctx());
        assert!(close(e.penalty_us, g.penalty_us, tol), "penalty differs: {}", ctx());
        if e != g {
            stats.not_identical += 1;
        }
        for (a, b) in [
            (e.retry_after_us, g.retry_after_us),
            (e.reset_us, g.reset_us),
            (e.delay_us, g.delay_us),
        ] {
            stats.max_time_diff = stats.max_time_diff.max(a.abs_diff(b));
        }
    }
}

async fn standalone() -> (RedisServer, RedisStore) {
    let server = RedisServer::start();
    let store = RedisStore::connect(RedisMode::Single, &[server.url()], TIMEOUT, 3)
        .await
        .expect("connect");
    (server, store)
}

/// 300 sequences × 30 requests of 1–3 limits of one algorithm on one tag.
async fn one_algorithm(algorithm: &'static [Algorithm], seed: u64) {
    let (_server, store) = standalone().await;
    let plan = Plan {
        algorithms: algorithm,
        limits: 1..=3,
        sequences: 300,
        steps: 30,
        tags: Tags::One,
        seed,
        reshape: false,
        extras: false,
        settle: false,
        calendar: false,
    };
    let stats = run(&store, &plan, algorithm[0].as_str()).await;
    assert_eq!(stats.steps, 300 * 30);
    // The random plan must exercise both decisions.
    assert!(
        stats.allowed > stats.checks / 10 && stats.allowed < stats.checks * 9 / 10,
        "{stats:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_bucket_matches_memory() {
    one_algorithm(&[Algorithm::TokenBucket], 1_000_000).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leaky_bucket_matches_memory() {
    one_algorithm(&[Algorithm::LeakyBucket], 2_000_000).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fixed_window_matches_memory() {
    one_algorithm(&[Algorithm::FixedWindow], 3_000_000).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sliding_log_matches_memory() {
    one_algorithm(&[Algorithm::SlidingLog], 4_000_000).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sliding_window_matches_memory() {
    one_algorithm(&[Algorithm::SlidingWindow], 5_000_000).await;
}

/// Mixed algorithms, several limits per request on one tag (one script call checks them all).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mixed_algorithms_one_slot_match_memory() {
    let (_server, store) = standalone().await;
    let plan = Plan {
        algorithms: &Algorithm::ALL,
        limits: 2..=3,
        sequences: 300,
        steps: 30,
        tags: Tags::One,
        seed: 6_000_000,
        reshape: false,
        extras: false,
        settle: false,
        calendar: false,
    };
    run(&store, &plan, "mixed").await;
}

/// Mixed algorithms on two or three tags: rejected requests are refunded on the other slots,
/// which must leave exactly the memory store's all-or-nothing state.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mixed_algorithms_across_slots_match_memory() {
    let (_server, store) = standalone().await;
    let plan = Plan {
        algorithms: &Algorithm::ALL,
        limits: 2..=3,
        sequences: 200,
        steps: 30,
        tags: Tags::Spread,
        seed: 7_000_000,
        reshape: false,
        extras: false,
        settle: false,
        calendar: false,
    };
    run(&store, &plan, "spread").await;
}

/// The same against a Redis Cluster: limits on different slots (usually different masters).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_matches_memory() {
    let cluster = RedisCluster::start();
    let store = RedisStore::connect(RedisMode::Cluster, &cluster.seed_urls(), TIMEOUT, 3)
        .await
        .expect("connect to the cluster");
    let plan = Plan {
        algorithms: &Algorithm::ALL,
        limits: 1..=3,
        sequences: 40,
        steps: 20,
        tags: Tags::Spread,
        seed: 8_000_000,
        reshape: false,
        extras: false,
        settle: false,
        calendar: false,
    };
    run(&store, &plan, "cluster").await;
    // On the cluster: slots and penalties, settled costs, calendar windows.
    const SLOTS: [Algorithm; 3] = [Algorithm::Concurrency, Algorithm::FixedWindow, Algorithm::TokenBucket];
    const WINDOWS: [Algorithm; 2] = [Algorithm::FixedWindow, Algorithm::SlidingWindow];
    for (algorithms, extras, settle, calendar, seed) in [
        (&SLOTS[..], true, false, false, 8_100_000),
        (&WINDOWS[..], false, true, true, 8_200_000),
    ] {
        let plan = Plan {
            algorithms,
            limits: 1..=3,
            sequences: 30,
            steps: 20,
            tags: Tags::Spread,
            seed,
            reshape: false,
            extras,
            settle,
            calendar,
        };
        run(&store, &plan, "cluster-beyond").await;
    }
}

/// Reloads change a limit's algorithm, window or rate under the same key;
/// both stores carry the consumption over (converted the same way) and decide alike after it,
/// settlements included (a debit converts a key of another shape first, as a check does).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reloads_that_reshape_limits_match_memory() {
    let (_server, store) = standalone().await;
    for (tags, seed) in [(Tags::One, 9_000_000), (Tags::Spread, 9_500_000)] {
        let plan = Plan {
            algorithms: &Algorithm::ALL,
            limits: 1..=3,
            sequences: 200,
            steps: 30,
            tags,
            seed,
            reshape: true,
            extras: false,
            settle: true,
            calendar: false,
        };
        run(&store, &plan, "reshape").await;
    }
}

/// Concurrency slots (taken, released as responses end, expiring) and penalty boxes
/// (started, escalated, served) decide alike on both stores, on one slot and across slots.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrency_and_penalties_match_memory() {
    let (_server, store) = standalone().await;
    const WITH_SLOTS: [Algorithm; 4] = [
        Algorithm::Concurrency,
        Algorithm::FixedWindow,
        Algorithm::TokenBucket,
        Algorithm::SlidingLog,
    ];
    for (tags, seed) in [(Tags::One, 10_000_000), (Tags::Spread, 10_500_000)] {
        let plan = Plan {
            algorithms: &WITH_SLOTS,
            limits: 1..=3,
            sequences: 200,
            steps: 30,
            tags,
            seed,
            reshape: false,
            extras: true,
            settle: false,
            calendar: false,
        };
        let stats = run(&store, &plan, "extras").await;
        assert!(stats.allowed > stats.checks / 10, "{stats:?}");
        assert!(
            stats.penalized > 100 && stats.slots_full > 100,
            "the plan must exercise both: {stats:?}"
        );
    }
}

/// Reservations settled against a reported cost (refund below the estimate, debit
/// above it, possibly below zero) leave both stores deciding alike, on one slot and across.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settled_costs_match_memory() {
    let (_server, store) = standalone().await;
    const SETTLING: [Algorithm; 3] = [Algorithm::TokenBucket, Algorithm::FixedWindow, Algorithm::SlidingWindow];
    for (tags, seed) in [(Tags::One, 11_000_000), (Tags::Spread, 11_500_000)] {
        let plan = Plan {
            algorithms: &SETTLING,
            limits: 1..=3,
            sequences: 200,
            steps: 30,
            tags,
            seed,
            reshape: false,
            extras: false,
            settle: true,
            calendar: false,
        };
        let stats = run(&store, &plan, "settle").await;
        assert!(stats.settled > 500, "the plan must settle often: {stats:?}");
        assert!(
            stats.allowed > stats.checks / 10 && stats.allowed < stats.checks * 9 / 10,
            "{stats:?}"
        );
    }
}

/// Calendar windows (days, weeks from Monday, months of their real lengths, at UTC
/// offsets) decide alike on both stores, with `now` passed to the script.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calendar_windows_match_memory() {
    let (_server, store) = standalone().await;
    const WINDOWS: [Algorithm; 2] = [Algorithm::FixedWindow, Algorithm::SlidingWindow];
    let plan = Plan {
        algorithms: &WINDOWS,
        limits: 1..=3,
        sequences: 200,
        steps: 30,
        tags: Tags::One,
        seed: 12_000_000,
        reshape: false,
        extras: false,
        settle: true,
        calendar: true,
    };
    let stats = run(&store, &plan, "calendar").await;
    assert!(
        stats.allowed > stats.checks / 10 && stats.allowed < stats.checks * 9 / 10,
        "{stats:?}"
    );
}

/// Month ends of 28, 29 (leap year), 30 and 31 days, in UTC and at an offset: a
/// monthly limit resets exactly at the local first of the month, and the reset and retry times
/// of a denial point at that instant, on the memory store (injected time) and on Redis (`now`
/// passed to the script) alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn monthly_limits_reset_at_the_local_first_of_the_month() {
    let (_server, store) = standalone().await;
    let at = |y: i64, m: u32, d: u32| days_from_civil(y, m, d) as u64 * DAY_US;
    // (the month's last day, the next month's first day)
    // In the future (keys expire by PEXPIREAT in the script's time base, so a past month's
    // key would vanish at once in wall-clock time), before the script's bound of 2^52 µs.
    let cases = [
        ((2097, 2, 28), (2097, 3, 1)),
        ((2096, 2, 29), (2096, 3, 1)),
        ((2097, 4, 30), (2097, 5, 1)),
        ((2097, 12, 31), (2098, 1, 1)),
    ];
    let mut n = 0;
    for algorithm in [Algorithm::FixedWindow, Algorithm::SlidingWindow] {
        for offset_s in [0i32, 2 * 3600, -5 * 3600] {
            for ((y, m, d), (ny, nm, nd)) in cases {
                n += 1;
                let mut q = Quota::window(algorithm, nz(3), nz(CalendarUnit::Month.nominal_us()));
                q.calendar = Some(Calendar {
                    unit: CalendarUnit::Month,
                    offset_s,
                });
                let key = StoreKey::from(format!("m:{{cal-{n}}}:0"));
                let c = LimitCheck::new(key, q, 1);
                let off = i64::from(offset_s) * 1_000_000;
                // The boundary in UTC: the local first of the next month at 00:00.
                let boundary = (at(ny, nm, nd) as i64 - off) as u64;
                let last_second = boundary - 1_000_000;
                assert_eq!(at(y, m, d) + DAY_US, at(ny, nm, nd));
                let memory = MemoryStore::new(Arc::new(FakeClock::new(0)), 100);
                for i in 0..3 {
                    let e = memory.check_at(std::slice::from_ref(&c), last_second + i)[0];
                    let g = store
                        .check_at(std::slice::from_ref(&c), Some(last_second + i))
                        .await
                        .into_result()
                        .unwrap()[0];
                    assert!(e.allowed && g.allowed, "{algorithm:?} {y}-{m} {offset_s}: request {i}");
                }
                let now = last_second + 10;
                let e = memory.check_at(std::slice::from_ref(&c), now)[0];
                let g = store
                    .check_at(std::slice::from_ref(&c), Some(now))
                    .await
                    .into_result()
                    .unwrap()[0];
                assert!(
                    !e.allowed && !g.allowed,
                    "{algorithm:?} {y}-{m} {offset_s}: the 4th is denied"
                );
                if algorithm == Algorithm::FixedWindow {
                    assert_eq!(
                        e.retry_after_us,
                        boundary - now,
                        "memory: Retry-After points at the boundary"
                    );
                    assert_eq!(
                        g.retry_after_us,
                        boundary - now,
                        "redis: Retry-After points at the boundary"
                    );
                    assert_eq!((e.reset_us, g.reset_us), (boundary - now, boundary - now));
                    // At the boundary the month starts over.
                    let e = memory.check_at(std::slice::from_ref(&c), boundary)[0];
                    let g = store
                        .check_at(std::slice::from_ref(&c), Some(boundary))
                        .await
                        .into_result()
                        .unwrap()[0];
                    assert!(e.allowed && g.allowed, "{y}-{m} {offset_s}: a new month");
                    assert_eq!(e.remaining, 2);
                } else {
                    // Sliding: the full month just ended weighs nearly all of its count at the
                    // boundary; retry and reset agree between the stores and lie past it.
                    assert_eq!(e.retry_after_us, g.retry_after_us);
                    assert_eq!(e.reset_us, g.reset_us);
                    assert!(now + e.retry_after_us > boundary);
                }
            }
        }
    }
}
