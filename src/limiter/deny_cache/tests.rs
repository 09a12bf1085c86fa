//! The deny cache's answers, on explicit instants (no clock, no sleeping).

use std::num::NonZeroU64;

use super::{DenyCache, Lookup};
use crate::limiter::{Algorithm, LimitCheck, Quota, StoreKey};

const SEC: u64 = 1_000_000;
const GRACE: u64 = 40_000;

fn check(key: &str, limit: u64) -> LimitCheck {
    let quota = Quota::window(
        Algorithm::FixedWindow,
        NonZeroU64::new(limit).unwrap_or(NonZeroU64::MIN),
        NonZeroU64::new(3_600 * SEC).unwrap_or(NonZeroU64::MIN),
    );
    LimitCheck::new(StoreKey::from(key.to_string()), quota, 1)
}

#[test]
fn a_denial_is_answered_until_its_recheck_with_the_stores_pass_instant() {
    let cache = DenyCache::new(64);
    let c = check("k", 3);
    cache.insert(&c, 10 * SEC, 10 * SEC + SEC, 10 * SEC + 60 * SEC);
    assert_eq!(cache.get(&c, 10 * SEC, GRACE), Lookup::Hit(70 * SEC));
    assert_eq!(cache.get(&c, 11 * SEC - 1, GRACE), Lookup::Hit(70 * SEC));
    // Another effective limit on the same key never gets this denial.
    assert_eq!(cache.get(&check("k", 6), 10 * SEC, GRACE), Lookup::Miss);
    assert_eq!(cache.get(&check("other", 3), 10 * SEC, GRACE), Lookup::Miss);
}

/// A request that read its clock before another's denial was stored, and looks afterwards, is
/// told the store's wait, never more (a 4 s penalty once said `Retry-After: 5` this way).
#[test]
fn a_request_older_than_the_denial_is_told_no_more_than_the_stores_wait() {
    let cache = DenyCache::new(64);
    let c = check("k", 3);
    cache.insert(&c, 10 * SEC, 11 * SEC, 14 * SEC);
    assert_eq!(cache.peek(&c, 10 * SEC - 300_000), Some(4 * SEC));
    assert_eq!(cache.peek(&c, 10 * SEC + 500_000), Some(3 * SEC + 500_000));
    assert_eq!(cache.peek(&c, 11 * SEC), None);
}

#[test]
fn one_caller_refreshes_a_due_entry_while_the_others_are_still_answered() {
    let cache = DenyCache::new(64);
    let c = check("k", 3);
    cache.insert(&c, 10 * SEC, 11 * SEC, 70 * SEC);
    let due = 11 * SEC;
    assert_eq!(cache.get(&c, due, GRACE), Lookup::Refresh);
    // During the refresh, every other caller is answered from the entry.
    for t in [due, due + 1, due + GRACE - 1] {
        assert_eq!(cache.get(&c, t, GRACE), Lookup::Hit(70 * SEC), "at {t}");
    }
    // The refresher found a new denial: it replaces the entry and ends the refresh.
    cache.insert(&c, 10 * SEC, 12 * SEC, 69 * SEC);
    cache.refreshed(&c.key);
    assert_eq!(cache.get(&c, due + GRACE, GRACE), Lookup::Hit(69 * SEC));
    assert_eq!(cache.get(&c, 12 * SEC, GRACE), Lookup::Refresh);
}

#[test]
fn a_refresh_that_finds_no_denial_lets_every_caller_ask_the_store() {
    let cache = DenyCache::new(64);
    let c = check("k", 3);
    cache.insert(&c, 10 * SEC, 11 * SEC, 70 * SEC);
    assert_eq!(cache.get(&c, 11 * SEC, GRACE), Lookup::Refresh);
    cache.refreshed(&c.key);
    assert_eq!(cache.get(&c, 11 * SEC + 1, GRACE), Lookup::Miss);
    assert_eq!(cache.get(&c, 11 * SEC + 2, GRACE), Lookup::Miss);
    assert!(cache.is_empty());
}

#[test]
fn a_refresher_that_never_reports_back_holds_the_entry_only_for_its_grace() {
    let cache = DenyCache::new(64);
    let c = check("k", 3);
    cache.insert(&c, 10 * SEC, 11 * SEC, 70 * SEC);
    assert_eq!(cache.get(&c, 11 * SEC, GRACE), Lookup::Refresh);
    // Its client left: no insert, no `refreshed`. After the grace, another caller refreshes.
    assert_eq!(cache.get(&c, 11 * SEC + GRACE, GRACE), Lookup::Refresh);
    assert_eq!(cache.get(&c, 11 * SEC + GRACE + 1, GRACE), Lookup::Hit(70 * SEC));
}

#[test]
fn a_key_whose_wait_is_over_is_never_answered_nor_held() {
    let cache = DenyCache::new(64);
    let c = check("k", 3);
    cache.insert(&c, 10 * SEC, 11 * SEC, 11 * SEC);
    assert_eq!(cache.get(&c, 11 * SEC, GRACE), Lookup::Miss);
    assert_eq!(cache.get(&c, 11 * SEC, GRACE), Lookup::Miss);
    // A refresh's grace never reaches past the store's pass instant.
    cache.insert(&c, 10 * SEC, 11 * SEC, 11 * SEC + 10);
    assert_eq!(cache.get(&c, 11 * SEC, GRACE), Lookup::Refresh);
    assert_eq!(cache.get(&c, 11 * SEC + 10, GRACE), Lookup::Miss);
}

/// Two windows of one rule, 5 per 10 s and 6 per minute, sliding: once the minute is spent,
/// the 10 s window (still weighted by the last window) denies too, with a wait of a second or
/// two. Every later 429 answered from the cache must name the minute's wait, as the store's
/// first answer did: waiting only the 10 s window's time would get another 429.
#[tokio::test]
async fn a_cached_denial_carries_the_binding_limit_of_the_whole_request() {
    use std::sync::Arc;

    use crate::clock::FakeClock;
    use crate::limiter::memory::MemoryStore;
    use crate::limiter::{Backend, FailurePolicy, Limiter, PolicedCheck};

    struct Closed(LimitCheck);
    impl AsRef<LimitCheck> for Closed {
        fn as_ref(&self) -> &LimitCheck {
            &self.0
        }
    }
    impl PolicedCheck for Closed {
        fn policy(&self) -> FailurePolicy {
            FailurePolicy::Closed
        }
    }
    let window = |limit: u64, secs: u64| {
        Quota::window(
            Algorithm::SlidingWindow,
            NonZeroU64::new(limit).unwrap_or(NonZeroU64::MIN),
            NonZeroU64::new(secs * SEC).unwrap_or(NonZeroU64::MIN),
        )
    };
    let t0 = 1_700_000_040 * SEC;
    let clock = FakeClock::new(t0);
    for deny_cache in [false, true] {
        let mut limiter = Limiter::new(
            Backend::Memory(Arc::new(MemoryStore::new(Arc::new(clock.clone()), 1000))),
            Arc::new(MemoryStore::new(Arc::new(clock.clone()), 1000)),
            std::time::Duration::from_millis(20),
            Arc::new(clock.clone()),
        );
        if deny_cache {
            limiter = limiter.with_deny_cache(1000);
        }
        let checks = [
            Closed(LimitCheck::new(
                StoreKey::from(format!("tl:{{a{deny_cache}}}:r:10s")),
                window(5, 10),
                1,
            )),
            Closed(LimitCheck::new(
                StoreKey::from(format!("tl:{{a{deny_cache}}}:r:1m")),
                window(6, 60),
                1,
            )),
        ];
        // 3 at 0 s, 2 at 12 s, 1 at 15 s: 6 in the minute, and the 10 s window weighs the
        // last one's 3 at about half.
        let mut admitted = 0;
        for (at, n) in [(0, 3), (12, 2), (15, 1)] {
            clock.set_us(t0 + at * SEC);
            for _ in 0..n {
                admitted += usize::from(limiter.check(&checks).await.admits(&checks));
            }
        }
        assert_eq!(admitted, 6, "the minute is spent");
        for n in 0..4 {
            clock.advance_us(SEC / 10);
            let v = limiter.check(&checks).await;
            assert!(!v.admits(&checks));
            let wait = v
                .outcomes
                .iter()
                .filter(|(o, _)| !o.allowed)
                .map(|(o, _)| o.retry_after_us)
                .max();
            let wait = wait.unwrap_or(0);
            assert!(
                wait > 40 * SEC,
                "denial {n} (deny cache {deny_cache}): told to retry in {wait} µs, but the minute binds"
            );
        }
    }
}
