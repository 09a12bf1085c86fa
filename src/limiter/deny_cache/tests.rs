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
    cache.insert(&c, 10 * SEC + SEC, 10 * SEC + 60 * SEC);
    assert_eq!(cache.get(&c, 10 * SEC, GRACE), Lookup::Hit(70 * SEC));
    assert_eq!(cache.get(&c, 11 * SEC - 1, GRACE), Lookup::Hit(70 * SEC));
    // Another effective limit on the same key never gets this denial.
    assert_eq!(cache.get(&check("k", 6), 10 * SEC, GRACE), Lookup::Miss);
    assert_eq!(cache.get(&check("other", 3), 10 * SEC, GRACE), Lookup::Miss);
}

#[test]
fn one_caller_refreshes_a_due_entry_while_the_others_are_still_answered() {
    let cache = DenyCache::new(64);
    let c = check("k", 3);
    cache.insert(&c, 11 * SEC, 70 * SEC);
    let due = 11 * SEC;
    assert_eq!(cache.get(&c, due, GRACE), Lookup::Refresh);
    // During the refresh, every other caller is answered from the entry.
    for t in [due, due + 1, due + GRACE - 1] {
        assert_eq!(cache.get(&c, t, GRACE), Lookup::Hit(70 * SEC), "at {t}");
    }
    // The refresher found a new denial: it replaces the entry and ends the refresh.
    cache.insert(&c, 12 * SEC, 69 * SEC);
    cache.refreshed(&c.key);
    assert_eq!(cache.get(&c, due + GRACE, GRACE), Lookup::Hit(69 * SEC));
    assert_eq!(cache.get(&c, 12 * SEC, GRACE), Lookup::Refresh);
}

#[test]
fn a_refresh_that_finds_no_denial_lets_every_caller_ask_the_store() {
    let cache = DenyCache::new(64);
    let c = check("k", 3);
    cache.insert(&c, 11 * SEC, 70 * SEC);
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
    cache.insert(&c, 11 * SEC, 70 * SEC);
    assert_eq!(cache.get(&c, 11 * SEC, GRACE), Lookup::Refresh);
    // Its client left: no insert, no `refreshed`. After the grace, another caller refreshes.
    assert_eq!(cache.get(&c, 11 * SEC + GRACE, GRACE), Lookup::Refresh);
    assert_eq!(cache.get(&c, 11 * SEC + GRACE + 1, GRACE), Lookup::Hit(70 * SEC));
}

#[test]
fn a_key_whose_wait_is_over_is_never_answered_nor_held() {
    let cache = DenyCache::new(64);
    let c = check("k", 3);
    cache.insert(&c, 11 * SEC, 11 * SEC);
    assert_eq!(cache.get(&c, 11 * SEC, GRACE), Lookup::Miss);
    assert_eq!(cache.get(&c, 11 * SEC, GRACE), Lookup::Miss);
    // A refresh's grace never reaches past the store's pass instant.
    cache.insert(&c, 11 * SEC, 11 * SEC + 10);
    assert_eq!(cache.get(&c, 11 * SEC, GRACE), Lookup::Refresh);
    assert_eq!(cache.get(&c, 11 * SEC + 10, GRACE), Lookup::Miss);
}
