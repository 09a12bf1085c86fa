use std::num::NonZeroU64;
use std::sync::Arc;

use super::*;
use crate::clock::FakeClock;
use crate::limiter::{Algorithm, Quota};

const T0: u64 = 1_700_000_000_000_000;

fn check(key: &str, limit: u64, shadow: bool) -> LimitCheck {
    LimitCheck {
        key: StoreKey::from(key.to_string()),
        quota: Quota::window(
            Algorithm::FixedWindow,
            NonZeroU64::new(limit).unwrap(),
            NonZeroU64::new(1_000_000).unwrap(),
        ),
        cost: 1,
        shadow,
        holder: 0,
        penalty: None,
        lease: None,
    }
}

#[test]
fn a_denial_on_one_limit_spends_none_of_the_others() {
    let store = MemoryStore::new(Arc::new(FakeClock::new(T0)), 1000);
    let ip = check("tl:{a}:per-ip:1s", 2, false);
    let user = check("tl:{b}:per-user:1s", 100, false);
    let both = [ip.clone(), user.clone()];
    for _ in 0..2 {
        assert!(store.check_at(&both, T0).iter().all(|o| o.allowed));
    }
    for _ in 0..10 {
        let o = store.check_at(&both, T0);
        assert!(!o[0].allowed);
        assert!(o[1].allowed);
    }
    // The user limit only saw the two admitted requests.
    let o = store.check_at(&[user], T0);
    assert_eq!(o[0].remaining, 97);
}

#[test]
fn shadow_limits_never_block_but_spend() {
    let store = MemoryStore::new(Arc::new(FakeClock::new(T0)), 1000);
    let shadow = check("tl:{a}:shadow:1s", 1, true);
    let real = check("tl:{a}:real:1s", 10, false);
    let both = [shadow, real.clone()];
    let o = store.check_at(&both, T0);
    assert!(o[0].allowed && o[1].allowed);
    let o = store.check_at(&both, T0);
    assert!(!o[0].allowed, "shadow limit is over");
    assert!(o[1].allowed);
    assert_eq!(store.check_at(&[real], T0)[0].remaining, 7);
}

#[test]
fn key_count_is_bounded() {
    let store = MemoryStore::new(Arc::new(FakeClock::new(T0)), 64 * 16);
    for i in 0..100_000 {
        store.check_at(&[check(&format!("tl:{{{i}}}:r:1s"), 5, false)], T0);
    }
    assert!(store.len() <= 64 * 16, "{} keys", store.len());
}

#[test]
fn expired_keys_are_swept_first() {
    let store = MemoryStore::new(Arc::new(FakeClock::new(T0)), 64 * 16);
    let hot = check("tl:{hot}:r:1s", 3, false);
    store.check_at(std::slice::from_ref(&hot), T0 + 5_000_000);
    for i in 0..10_000 {
        store.check_at(&[check(&format!("tl:{{{i}}}:r:1s"), 5, false)], T0);
    }
    // Filling the store with old keys must not have evicted the live one.
    let later = T0 + 5_000_000;
    for i in 0..300 {
        store.check_at(&[check(&format!("tl:{{n{i}}}:r:1s"), 5, false)], later);
    }
    assert_eq!(store.check_at(&[hot], later)[0].remaining, 1);
}

#[tokio::test]
async fn time_comes_from_the_injected_clock() {
    let clock = FakeClock::new(T0);
    let store = MemoryStore::new(Arc::new(clock.clone()), 1000);
    let c = [check("tl:{a}:r:1s", 2, false)];
    let mut admitted = 0;
    for _ in 0..5 {
        admitted += usize::from(store.check(&c).await.outcomes[0].allowed);
    }
    assert_eq!(admitted, 2);
    clock.advance_ms(1000);
    assert!(
        store.check(&c).await.outcomes[0].allowed,
        "a new window after 1 s of fake time"
    );
}

/// A limit of `alg` with `limit` units per `window_us` (buckets: `limit` capacity refilled over
/// `window_us`).
fn quota(alg: Algorithm, limit: u64, window_us: u64) -> Quota {
    let l = NonZeroU64::new(limit).unwrap();
    if alg.is_bucket() {
        Quota::bucket(alg, l, NonZeroU64::new((window_us / limit).max(1)).unwrap())
    } else {
        Quota::window(alg, l, NonZeroU64::new(window_us).unwrap())
    }
}

const ALL: [Algorithm; 5] = Algorithm::ALL;

fn on(key: &str, q: Quota, cost: u64) -> LimitCheck {
    LimitCheck {
        key: StoreKey::from(key.to_string()),
        quota: q,
        cost,
        shadow: false,
        holder: 0,
        penalty: None,
        lease: None,
    }
}

/// Admit `n` requests of `c` at `now`; how many passed.
fn admit(store: &MemoryStore, c: &LimitCheck, now: u64, n: usize) -> usize {
    (0..n)
        .filter(|_| store.check_at(std::slice::from_ref(c), now)[0].allowed)
        .count()
}

/// Spending 8 of 10 and then reloading through four variants of the rule
/// (another algorithm, window or rate each time) used to hand out a fresh quota per variant.
#[test]
fn a_reload_through_variants_never_mints_quota() {
    let store = MemoryStore::new(Arc::new(FakeClock::new(T0)), 1000);
    let variants = [
        quota(Algorithm::FixedWindow, 10, 3_600_000_000),
        quota(Algorithm::SlidingWindow, 10, 3_600_000_000),
        quota(Algorithm::TokenBucket, 10, 3_600_000_000),
        quota(Algorithm::FixedWindow, 10, 7_200_000_000),
        quota(Algorithm::SlidingLog, 10, 3_600_000_000),
        quota(Algorithm::LeakyBucket, 10, 1_800_000_000),
    ];
    let key = "tl:{k}:r:0";
    let mut admitted = admit(&store, &on(key, variants[0], 1), T0, 8);
    assert_eq!(admitted, 8);
    for (i, q) in variants.iter().enumerate().skip(1) {
        admitted += admit(&store, &on(key, *q, 1), T0 + i as u64 * 1000, 20);
    }
    assert_eq!(admitted, 10, "the chain admitted more than any one variant's limit");
}

/// After a reload from any rule to any other, the new rule
/// admits at most its limit minus what the old one had admitted (the consumption carries over),
/// so the two together never admit more than the larger limit.
#[test]
fn a_reload_never_admits_more_than_the_new_rule_would_have() {
    use proptest::prelude::*;
    let mut runner = proptest::test_runner::TestRunner::new(proptest::test_runner::Config::with_cases(512));
    let rule = (
        0usize..5,
        1u64..30,
        prop_oneof![Just(1_000_000u64), Just(60_000_000), Just(3_600_000_000)],
    );
    runner
        .run(
            &(rule.clone(), rule, 0usize..40, 0usize..40),
            |((a, la, wa), (b, lb, wb), n1, n2)| {
                let store = MemoryStore::new(Arc::new(FakeClock::new(T0)), 1000);
                let (qa, qb) = (quota(ALL[a], la, wa), quota(ALL[b], lb, wb));
                let before = admit(&store, &on("tl:{p}:r:0", qa, 1), T0, n1) as u64;
                let after = admit(&store, &on("tl:{p}:r:0", qb, 1), T0, n2) as u64;
                prop_assert!(
                    after <= lb - before.min(lb),
                    "{qa:?} -> {qb:?}: {before} before, {after} after"
                );
                prop_assert!(before + after <= la.max(lb));
                Ok(())
            },
        )
        .unwrap();
}

/// A refund names the instant its check was decided, so units spent in
/// window [0, 2) are not taken off window [2, 4).
#[test]
fn a_refund_comes_off_the_window_it_was_spent_in() {
    // Fixed window 2/2s: R1 at 0.2 s, two more in [2, 4); R1's client leaves at 3.9 s.
    let store = MemoryStore::new(Arc::new(FakeClock::new(T0)), 1000);
    let c = on("tl:{u}:user:0", quota(Algorithm::FixedWindow, 2, 2_000_000), 1);
    let first = store.check_at(std::slice::from_ref(&c), T0 + 200_000);
    assert!(first[0].allowed);
    assert_eq!(first[0].at_us, T0 + 200_000);
    let t = T0 + 3_900_000;
    assert_eq!(admit(&store, &c, t, 2), 2);
    store.refund_spent(&[(c.clone(), first[0].at_us)]);
    assert_eq!(admit(&store, &c, t, 1), 0, "the refund minted quota in [2, 4)");

    // Sliding window 2/2s: R1's unit is the previous window's when it is refunded, so it comes
    // off `previous`, and the current window's count still weighs fully in the next one.
    let store = MemoryStore::new(Arc::new(FakeClock::new(T0)), 1000);
    let c = on("tl:{u}:user:0", quota(Algorithm::SlidingWindow, 2, 2_000_000), 1);
    let first = store.check_at(std::slice::from_ref(&c), T0 + 200_000);
    assert_eq!(admit(&store, &c, T0 + 2_000_001, 1), 1);
    store.refund_spent(&[(c.clone(), first[0].at_us)]);
    assert_eq!(admit(&store, &c, T0 + 2_000_001, 2), 1);
    assert_eq!(
        admit(&store, &c, T0 + 4_000_001, 1),
        0,
        "the refund was taken off the wrong window"
    );
}

/// Random interleavings of checks and refunds of checks that
/// were admitted never leave more than the limit outstanding at one instant.
#[test]
fn checks_and_refunds_never_exceed_a_limit() {
    use proptest::prelude::*;
    let mut runner = proptest::test_runner::TestRunner::new(proptest::test_runner::Config::with_cases(256));
    let ops = proptest::collection::vec((any::<bool>(), 1u64..4, any::<prop::sample::Index>()), 1..80);
    runner
        .run(&(0usize..5, 1u64..12, ops), |(a, limit, ops)| {
            let store = MemoryStore::new(Arc::new(FakeClock::new(T0)), 1000);
            let q = quota(ALL[a], limit.max(3), 60_000_000);
            let mut held: Vec<(LimitCheck, u64)> = Vec::new();
            for (is_check, cost, pick) in ops {
                if is_check || held.is_empty() {
                    let c = on("tl:{r}:r:0", q, cost);
                    let o = store.check_at(std::slice::from_ref(&c), T0);
                    if o[0].allowed {
                        held.push((c, o[0].at_us));
                    }
                } else {
                    let spent = held.swap_remove(pick.index(held.len()));
                    store.refund_spent(&[spent]);
                }
                let outstanding: u64 = held.iter().map(|(c, _)| c.cost).sum();
                prop_assert!(outstanding <= q.limit.get(), "{outstanding} > {}", q.limit);
            }
            Ok(())
        })
        .unwrap();
}

/// Under key pressure the store forgets keys that would admit before a
/// key that is denying, and counts what it had to evict.
#[test]
fn eviction_keeps_denying_keys_and_counts_evictions() {
    let store = MemoryStore::new(Arc::new(FakeClock::new(T0)), 64 * 16);
    let login = on("tl:{login}:login:0", quota(Algorithm::SlidingLog, 3, 900_000_000), 1);
    assert_eq!(admit(&store, &login, T0, 5), 3);
    for i in 0..3000 {
        let spam = on(
            &format!("tl:{{h{i}}}:hdr:0"),
            quota(Algorithm::FixedWindow, 100, 3_600_000_000),
            1,
        );
        store.check_at(std::slice::from_ref(&spam), T0 + 1);
    }
    assert_eq!(
        admit(&store, &login, T0 + 2, 3),
        0,
        "the denying login counter was evicted"
    );
    let (forced, denying) = store.evictions();
    assert!(forced > 0, "evictions were not counted");
    assert_eq!(denying, 0);
}

/// A concurrency limit of `limit` slots living `ttl` µs.
fn slots(limit: u64, ttl: u64) -> Quota {
    Quota::window(
        Algorithm::Concurrency,
        NonZeroU64::new(limit).unwrap(),
        NonZeroU64::new(ttl).unwrap(),
    )
}

/// Under random interleavings of take, release, renew and time passing, the slots
/// held never exceed the limit, and the store agrees exactly with a model of the live holders
/// (admitted, not released, renewed or taken less than a time to live ago).
#[test]
fn slots_in_flight_never_exceed_the_limit() {
    use proptest::prelude::*;
    const TTL: u64 = 30_000_000;
    let mut runner = proptest::test_runner::TestRunner::new(proptest::test_runner::Config::with_cases(256));
    // op: 0 take, 1 release, 2 renew, 3 time passes (by `dt`).
    let ops = proptest::collection::vec((0u8..4, any::<prop::sample::Index>(), 0u64..TTL), 1..120);
    runner
        .run(&(1u64..8, ops), |(limit, ops)| {
            let clock = Arc::new(FakeClock::new(T0));
            let store = MemoryStore::new(clock.clone(), 1000);
            let q = slots(limit, TTL);
            let mut now = T0;
            let mut next = 1u64;
            // holder -> expiry, as the model sees it
            let mut live: Vec<(u64, u64)> = Vec::new();
            for (op, pick, dt) in ops {
                live.retain(|(_, exp)| *exp > now);
                match op {
                    0 => {
                        let mut c = on("tl:{c}:c:0", q, 1);
                        c.holder = next;
                        next += 1;
                        let o = store.check_at(std::slice::from_ref(&c), now);
                        prop_assert_eq!(
                            o[0].allowed,
                            (live.len() as u64) < limit,
                            "take with {} live",
                            live.len()
                        );
                        if o[0].allowed {
                            live.push((c.holder, now + TTL));
                        }
                    }
                    1 | 2 if !live.is_empty() => {
                        let i = pick.index(live.len());
                        let mut c = on("tl:{c}:c:0", q, 1);
                        c.holder = live[i].0;
                        if op == 1 {
                            store.refund_spent(&[(c, now)]);
                            live.swap_remove(i);
                        } else {
                            clock.set_us(now);
                            prop_assert_eq!(store.renew_slots(&[c]), 0);
                            live[i].1 = now + TTL;
                        }
                    }
                    _ => {
                        now += dt;
                        clock.set_us(now);
                    }
                }
                live.retain(|(_, exp)| *exp > now);
                clock.set_us(now);
                let peek = futures_util::FutureExt::now_or_never(store.peek(&[on("tl:{c}:c:0", q, 0)]))
                    .unwrap()
                    .unwrap();
                let free = peek[0].map_or(limit, |o| o.remaining);
                prop_assert_eq!(limit - free, live.len() as u64, "in flight");
                prop_assert!(live.len() as u64 <= limit);
            }
            Ok(())
        })
        .unwrap();
}

/// A denial puts the key in the penalty box (denied though its window resets), a
/// request during an escalating penalty doubles it up to `max`, the key passes right after the
/// penalty, and a reset lifts it.
#[test]
fn the_penalty_box_holds_escalates_and_lifts() {
    let clock = Arc::new(FakeClock::new(T0));
    let store = MemoryStore::new(clock.clone(), 1000);
    let q = Quota::window(
        Algorithm::FixedWindow,
        NonZeroU64::new(1).unwrap(),
        NonZeroU64::new(1_000_000).unwrap(),
    );
    let mut c = on("tl:{p}:login:0", q, 1);
    c.penalty = Some(crate::limiter::Penalty {
        base_us: NonZeroU64::new(2_000_000).unwrap(),
        max_us: NonZeroU64::new(5_000_000).unwrap(),
    });
    let at = |t: u64| store.check_at(std::slice::from_ref(&c), T0 + t)[0];
    assert!(at(0).allowed);
    let breach = at(1);
    assert!(!breach.allowed && breach.penalty_started);
    assert_eq!(breach.retry_after_us, 2_000_000, "the base penalty");
    // The window reset at 1 s, but the penalty holds; asking doubles it from now.
    let during = at(1_500_000);
    assert!(!during.allowed && during.penalty_started);
    assert_eq!(during.retry_after_us, 4_000_000);
    let again = at(2_000_000);
    assert_eq!(again.retry_after_us, 5_000_000, "capped at max");
    // Passes right after it.
    assert!(at(7_000_001).allowed);
    // A new breach starts over from base (the last one served its time).
    let b2 = at(7_000_002);
    assert!(b2.penalty_started);
    // A reset lifts it.
    futures_util::FutureExt::now_or_never(store.reset(std::slice::from_ref(&c.key)))
        .unwrap()
        .unwrap();
    assert!(at(7_000_003).allowed);
}

/// A client that spent its limit, then floods the store with fresh keys (a header rule with a
/// new value each time), must not get its own exhausted key evicted: once only denying keys are
/// left, new keys are refused and the exhausted key keeps denying.
#[test]
fn flooding_with_new_keys_never_evicts_a_denying_key() {
    let store = MemoryStore::new(Arc::new(FakeClock::new(T0)), 640);
    let own = on("tl:{me}:per-ip:1h", quota(Algorithm::FixedWindow, 5, 3_600_000_000), 1);
    assert_eq!(admit(&store, &own, T0, 10), 5, "the client's own limit");
    // 1 per day per junk value: each new key is spent at once, so it is denying too.
    let mut refused = 0;
    for i in 0..2_100 {
        let junk = on(
            &format!("tl:{{j{i}}}:junk:1d"),
            quota(Algorithm::FixedWindow, 1, 86_400_000_000),
            1,
        );
        let checked = store.decide_at(&[own.clone(), junk], T0 + 1);
        assert!(!checked.outcomes[0].allowed, "request {i}: the exhausted key denies");
        let alone = on(
            &format!("tl:{{k{i}}}:junk:1d"),
            quota(Algorithm::FixedWindow, 1, 86_400_000_000),
            1,
        );
        let checked = store.decide_at(&[alone], T0 + 1);
        refused += checked.failed.len();
        assert!(checked.failed.iter().all(|(_, e)| matches!(e, StoreError::Full)));
    }
    assert!(refused > 0, "a full store of denying keys refuses new ones");
    assert_eq!(
        admit(&store, &own, T0 + 2, 10),
        0,
        "the exhausted key was never forgotten"
    );
    assert_eq!(store.evictions().1, refused as u64, "refusals are counted");
    assert!(store.len() <= 64 * 16, "{} keys", store.len());
}

/// Admitting keys are still evicted to make room (closest to expiry first), so a store full of
/// ordinary callers keeps taking new ones.
#[test]
fn admitting_keys_are_evicted_to_make_room() {
    let store = MemoryStore::new(Arc::new(FakeClock::new(T0)), 64 * 16);
    for i in 0..10_000 {
        let c = on(
            &format!("tl:{{{i}}}:r:1h"),
            quota(Algorithm::FixedWindow, 5, 3_600_000_000),
            1,
        );
        assert!(store.decide_at(&[c], T0).failed.is_empty(), "key {i} refused");
    }
    assert!(store.evictions().0 > 0);
    assert_eq!(store.evictions().1, 0);
}

/// A held concurrency slot is never evicted: forgetting it would let more requests run at once.
#[test]
fn held_slots_are_never_evicted() {
    let store = MemoryStore::new(Arc::new(FakeClock::new(T0)), 64 * 16);
    let q = Quota::window(
        Algorithm::Concurrency,
        NonZeroU64::new(2).unwrap(),
        NonZeroU64::new(60_000_000).unwrap(),
    );
    let mut slot = on("tl:{me}:conc:c", q, 1);
    for holder in [1, 2] {
        slot.holder = holder;
        assert!(store.check_at(std::slice::from_ref(&slot), T0)[0].allowed);
    }
    for i in 0..10_000 {
        let c = on(
            &format!("tl:{{{i}}}:r:1h"),
            quota(Algorithm::FixedWindow, 5, 3_600_000_000),
            1,
        );
        store.decide_at(&[c], T0);
    }
    slot.holder = 3;
    assert!(
        !store.check_at(std::slice::from_ref(&slot), T0)[0].allowed,
        "both slots are still held"
    );
}

/// A reset of a concurrency key lifts its penalty box and keeps its held slots.
#[test]
fn lifting_a_concurrency_keys_penalty_keeps_its_slots() {
    let store = MemoryStore::new(Arc::new(FakeClock::new(T0)), 1000);
    let q = Quota::window(
        Algorithm::Concurrency,
        NonZeroU64::new(1).unwrap(),
        NonZeroU64::new(60_000_000).unwrap(),
    );
    let mut slot = on("tl:{me}:conc:c", q, 1);
    slot.penalty = Some(crate::limiter::Penalty {
        base_us: NonZeroU64::new(30_000_000).unwrap(),
        max_us: NonZeroU64::new(30_000_000).unwrap(),
    });
    slot.holder = 1;
    assert!(store.check_at(std::slice::from_ref(&slot), T0)[0].allowed);
    slot.holder = 2;
    let o = store.check_at(std::slice::from_ref(&slot), T0)[0];
    assert!(
        !o.allowed && o.penalty_started,
        "the second request is denied into the penalty box"
    );
    store.lift_penalties(std::slice::from_ref(&slot.key));
    let plain = LimitCheck {
        penalty: None,
        ..slot.clone()
    };
    assert!(
        !store.check_at(std::slice::from_ref(&plain), T0)[0].allowed,
        "holder 1 still holds the slot"
    );
    store.refund_spent(&[(
        LimitCheck {
            holder: 1,
            ..slot.clone()
        },
        T0,
    )]);
    assert!(
        store.check_at(std::slice::from_ref(&slot), T0)[0].allowed,
        "the penalty is lifted: the freed slot is taken"
    );
}
