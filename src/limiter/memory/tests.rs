use std::num::NonZeroU64;
use std::sync::Arc;

use super::*;
use crate::clock::FakeClock;
use crate::limiter::{Algorithm, Quota};

const T0: u64 = 1_700_000_000_000_000;

fn check(key: &str, limit: u64, shadow: bool) -> LimitCheck {
    LimitCheck {
        key: StoreKey(key.to_string()),
        quota: Quota::window(
            Algorithm::FixedWindow,
            NonZeroU64::new(limit).unwrap(),
            NonZeroU64::new(1_000_000).unwrap(),
        ),
        cost: 1,
        shadow,
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
