//! The lease tables alone: local decisions, expiry, heat, sizing. The store side (grants,
//! returns, the fleet never over-admitting) is tested against real Redis in tests/leases.rs.

use super::*;
use crate::clock::Clock;
use crate::limiter::FailurePolicy;

/// A planned check as the limiter sees it.
struct C(LimitCheck, bool);

impl AsRef<LimitCheck> for C {
    fn as_ref(&self) -> &LimitCheck {
        &self.0
    }
}

impl PolicedCheck for C {
    fn policy(&self) -> FailurePolicy {
        FailurePolicy::Open
    }
    fn leasable(&self) -> bool {
        self.1
    }
}

fn nz(n: u64) -> NonZeroU64 {
    NonZeroU64::new(n).unwrap()
}

fn window(limit: u64) -> Quota {
    Quota::window(Algorithm::FixedWindow, nz(limit), nz(60_000_000))
}

fn check(key: &str, q: Quota, cost: u64) -> C {
    C(LimitCheck::new(StoreKey(key.into()), q, cost), true)
}

fn leases() -> Leases {
    Leases::new(
        LeaseConfig {
            min_rate: NonZeroU32::new(10).unwrap(),
            ..LeaseConfig::default()
        },
        LeaseMetrics::default(),
    )
}

/// Grant `units` on `c` as the store would: the outcome of a check at store time `at`.
fn grant(l: &Leases, c: &C, units: u64, at: u64, sent: u64) -> Vec<Return> {
    let mut asked = c.0.clone();
    asked.lease = Some(LeaseAsk {
        want: units,
        life_us: 0,
    });
    let o = Outcome {
        allowed: true,
        remaining: 500,
        reset_us: 30_000_000,
        at_us: at,
        leased: units,
        ..Outcome::default()
    };
    l.granted(&[asked], &[o], sent)
}

/// One request for `c` at `now` as the limiter makes it (local decision first), up to the asks
/// it would send.
fn seen(l: &Leases, c: &C, now: u64) -> Option<LeaseAsk> {
    assert!(l.decide(std::slice::from_ref(c), now).is_none());
    first_ask(&l.prepare(std::slice::from_ref(c), now, false))
}

/// The ask of a one-check request (the asks are empty when nothing is asked).
fn first_ask(p: &Prepared<'_>) -> Option<LeaseAsk> {
    p.asks.first().copied().flatten()
}

#[test]
fn a_lease_decides_until_its_units_run_out() {
    let l = leases();
    let c = check("k", window(1000), 2);
    assert!(l.decide(std::slice::from_ref(&c), 1_000).is_none(), "no lease yet");
    assert!(grant(&l, &c, 5, 60_000_001, 1_000).is_empty());
    let a = l.decide(std::slice::from_ref(&c), 2_000).unwrap();
    assert!(a[0].allowed);
    assert_eq!(
        a[0].at_us, 60_000_001,
        "refunds must name the window the units were spent in"
    );
    assert_eq!(
        a[0].remaining, 498,
        "remaining is the store's figure minus local spending"
    );
    assert!(l.decide(std::slice::from_ref(&c), 3_000).is_some());
    // 1 unit left, the request costs 2: the store decides it, and the lease is given back.
    assert!(l.decide(std::slice::from_ref(&c), 4_000).is_none());
    let back = l.prepare(std::slice::from_ref(&c), 4_000, false).back;
    assert_eq!(back.len(), 1);
    assert_eq!((back[0].0.cost, back[0].1), (1, 60_000_001));
    assert_eq!(l.live(), 0);
}

#[test]
fn all_or_nothing_across_a_requests_limits() {
    let l = leases();
    let (a, b) = (check("a", window(1000), 1), check("b", window(1000), 1));
    grant(&l, &a, 10, 60_000_000, 0);
    let both = [a, b];
    assert!(l.decide(&both, 10).is_none(), "b has no lease: the store decides");
    // Nothing was spent from a's lease by the refused local decision.
    let back = l.take_back(u64::MAX, true);
    assert_eq!(back[0].0.cost, 10);
}

#[test]
fn limits_that_may_not_lease_are_never_decided_locally() {
    let l = leases();
    let mut c = check("k", window(1000), 1);
    grant(&l, &c, 10, 60_000_000, 0);
    c.1 = false;
    assert!(l.decide(std::slice::from_ref(&c), 10).is_none());
}

#[test]
fn a_lease_ends_at_its_ttl_and_its_unused_units_go_back() {
    let l = leases();
    let c = check("k", window(1000), 1);
    grant(&l, &c, 10, 60_000_000, 1_000);
    assert!(l.decide(std::slice::from_ref(&c), 1_000 + 249_999).is_some());
    assert!(
        l.decide(std::slice::from_ref(&c), 1_000 + 250_000).is_none(),
        "expired at ttl"
    );
    assert!(l.take_back(1_000 + 249_999, false).is_empty(), "not expired yet");
    let back = l.take_back(1_000 + 250_000, false);
    assert_eq!(back.len(), 1);
    assert_eq!(back[0].0.cost, 9);
    assert_eq!(l.metrics.unused.get(), 9);
    assert_eq!(l.metrics.returned.get(), 1);
}

#[test]
fn a_window_lease_ends_with_its_window() {
    let l = leases();
    let c = check("k", window(1000), 1);
    // Taken 100 ms before the window (60 s, epoch-aligned) ends: it lives 100 ms, not 250.
    grant(&l, &c, 10, 120_000_000 - 100_000, 5_000);
    assert!(l.decide(std::slice::from_ref(&c), 5_000 + 99_999).is_some());
    assert!(l.decide(std::slice::from_ref(&c), 5_000 + 100_000).is_none());
}

#[test]
fn another_quota_does_not_use_the_lease() {
    let l = leases();
    grant(&l, &check("k", window(1000), 1), 10, 60_000_000, 0);
    let other = check("k", window(2000), 1);
    assert!(l.decide(std::slice::from_ref(&other), 10).is_none());
    let back = l.prepare(std::slice::from_ref(&other), 10, false).back;
    assert_eq!(
        back[0].0.quota,
        window(1000),
        "given back under the quota it was taken for"
    );
}

#[test]
fn only_keys_seen_at_min_rate_ask_and_asks_are_capped() {
    let l = leases();
    let c = check("hot", window(1000), 1);
    for i in 0..9 {
        assert!(seen(&l, &c, 1_000_000 + i).is_none(), "cold after {} requests", i + 1);
    }
    let ask = seen(&l, &c, 1_000_000 + 10).unwrap();
    // 10/s × 250 ms = 2.5, at least 1 per request's cost; at most 10 % of 1000.
    assert_eq!(ask, LeaseAsk { want: 2, life_us: 0 });
    for i in 0..1000 {
        seen(&l, &c, 1_000_000 + 11 + i);
    }
    assert_eq!(
        seen(&l, &c, 1_500_000).unwrap().want,
        100,
        "capped at max_share of the limit"
    );
}

#[test]
fn a_request_with_a_limit_that_may_not_lease_asks_for_none() {
    let l = leases();
    let hot = check("hot", window(1000), 1);
    let mut cold = check("other", window(1000), 1);
    cold.1 = false;
    let both = [hot, cold];
    for i in 0..50 {
        let asks = l.prepare(&both, 1_000_000 + i, false).asks;
        assert!(asks.iter().all(Option::is_none));
    }
}

#[test]
fn token_bucket_leases_carry_their_life_as_time() {
    let l = leases();
    // A 250 ms lease carries its life in µs, whatever the refill rate (no unit rounded up).
    let q = Quota::bucket(Algorithm::TokenBucket, nz(1000), nz(10_000));
    assert_eq!(
        l.ask(&q, 1, 400).unwrap(),
        LeaseAsk {
            want: 100,
            life_us: 250_000
        }
    );
    let slow = Quota::bucket(Algorithm::TokenBucket, nz(1000), nz(3_600_000_000));
    assert_eq!(l.ask(&slow, 1, 400).unwrap().life_us, 250_000);
    assert!(l.ask(&q, 1, 0).is_some_and(|a| a.want == 1));
    // A limit too small for a 10 % share gets no lease.
    assert!(l.ask(&window(5), 1, 1000).is_none());
}

#[test]
fn cold_rotating_keys_do_not_push_a_hot_key_out_of_its_heat_slot() {
    let l = leases();
    let hot = StoreKey("hot".into());
    let mut rate = 0;
    for i in 0..200_000u64 {
        let now = 5_000_000 + i * 5; // 1 s of traffic: 200k requests
        if i % 100 == 0 {
            rate = l.note(&hot, now); // 2,000 requests a second for the hot key
        } else {
            l.note(&StoreKey::from(format!("cold-{i}")), now);
        }
    }
    assert!(rate >= 1_900, "the hot key's rate was lost to cold keys: {rate}");
    // And no cold key ever looks hot.
    assert!(l.note(&StoreKey("cold-3".into()), 6_000_000) < 10);
}

#[test]
fn units_of_a_request_that_did_not_go_through_return_to_the_lease() {
    let l = leases();
    let c = check("k", window(1000), 3);
    grant(&l, &c, 3, 60_000_000, 0);
    assert!(l.decide(std::slice::from_ref(&c), 10).is_some());
    assert!(l.decide(std::slice::from_ref(&c), 11).is_none(), "spent");
    l.unspend(&c.0.key, 60_000_000, 3);
    assert!(
        l.decide(std::slice::from_ref(&c), 12).is_some(),
        "given back to the lease"
    );
}

#[tokio::test]
async fn one_ask_per_key_at_a_time_and_the_others_wait_for_it() {
    let l = leases();
    let c = check("k", window(1000), 1);
    for i in 0..20 {
        seen(&l, &c, 1_000_000 + i);
    }
    let first = l.prepare(std::slice::from_ref(&c), 1_000_100, true);
    assert!(first_ask(&first).is_some() && first.wait.is_none());
    let second = l.prepare(std::slice::from_ref(&c), 1_000_101, true);
    assert!(
        second.asks[0].is_none(),
        "a second ask for a key already being asked for"
    );
    let (key, n) = second.wait.clone().unwrap();
    // The first request's answer arrives (its asks end when it is dropped): the waiter wakes
    // long before its 10 s timeout.
    let waiter = async {
        let t = std::time::Instant::now();
        l.wait(&key, &n, std::time::Duration::from_secs(10)).await;
        t.elapsed()
    };
    let answer = async {
        tokio::task::yield_now().await;
        drop(first);
    };
    let (waited, ()) = tokio::join!(waiter, answer);
    assert!(waited < std::time::Duration::from_secs(5), "waited {waited:?}");
    // With the ask over, the next request may ask again.
    assert!(first_ask(&l.prepare(std::slice::from_ref(&c), 1_000_102, true)).is_some());
}

#[test]
fn a_request_going_to_the_store_takes_its_keys_leases_back_first() {
    let l = leases();
    let (a, b) = (check("a", window(1000), 1), check("b", window(1000), 1));
    grant(&l, &a, 10, 60_000_000, 0);
    // a's lease could cover a, but b has none: the request goes to the store, and a's 10 unused
    // units go back before it, so the store never denies it for them.
    let both = [a, b];
    assert!(l.decide(&both, 10).is_none());
    let back = l.prepare(&both, 10, false).back;
    assert_eq!(back.len(), 1);
    assert_eq!((back[0].0.key.as_str(), back[0].0.cost), ("a", 10));
    assert_eq!(l.live(), 0);
}

/// A limiter on the memory store with leases, over `clock` (the memory store never grants a
/// lease itself: the tests grant them by hand, as the Redis store would).
fn limiter_with_leases(clock: &crate::clock::FakeClock) -> crate::limiter::Limiter {
    let shared: crate::clock::SharedClock = Arc::new(clock.clone());
    crate::limiter::Limiter::new(
        crate::limiter::Backend::Memory(Arc::new(crate::limiter::memory::MemoryStore::new(shared.clone(), 1000))),
        Arc::new(crate::limiter::memory::MemoryStore::new(shared.clone(), 1000)),
        std::time::Duration::from_millis(100),
        shared,
    )
    .with_leases(leases())
}

#[test]
fn a_wall_clock_stepped_back_does_not_stretch_a_lease() {
    let clock = crate::clock::FakeClock::new(1_700_000_000_000_000);
    let limiter = limiter_with_leases(&clock);
    let Some(l) = &limiter.leases else {
        unreachable!("built with leases") // allow-panic: test
    };
    let c = check("k", window(1000), 1);
    // Granted with the instant the limiter's lease clock read when the call was sent.
    grant(l, &c, 100, 60_000_001, clock.mono_us());
    let decide = |what: &str| {
        let v = limiter.begin(std::slice::from_ref(&c), clock.now_us()).unwrap(); // allow-panic: test
        assert!(v.outcomes[0].0.allowed, "{what}");
        v.outcomes[0].1
    };
    assert_eq!(decide("fresh lease"), crate::limiter::Source::Lease);
    // 200 ms on, the wall clock steps back 100 ms; 100 ms more and the lease has lived 300 ms,
    // past its 250 ms ttl, although the wall clock shows only 200 ms since the grant.
    clock.advance_ms(200);
    assert_eq!(decide("200 ms old"), crate::limiter::Source::Lease);
    clock.set_us(clock.now_us() - 100_000);
    clock.advance_ms(100);
    assert_ne!(
        decide("300 ms old by the monotonic clock"),
        crate::limiter::Source::Lease,
        "a lease outlived its ttl because the wall clock stepped back"
    );
    let back = l.take_back(clock.mono_us(), false);
    assert_eq!(back.len(), 1, "the sweep ends it as expired");
    assert_eq!(back[0].0.cost, 98);
}

#[test]
fn a_fake_clock_steps_its_wall_time_back_without_moving_the_monotonic_one() {
    let clock = crate::clock::FakeClock::new(5_000_000);
    clock.advance_us(10);
    assert_eq!((clock.now_us(), clock.mono_us()), (5_000_010, 10));
    clock.set_us(1_000_000);
    assert_eq!((clock.now_us(), clock.mono_us()), (1_000_000, 10));
    clock.set_us(1_000_005);
    assert_eq!((clock.now_us(), clock.mono_us()), (1_000_005, 15));
}
