use std::num::NonZeroU64;
use std::sync::Arc;

use super::*;
use crate::limiter::{Algorithm, Quota};

fn config(mode: Mode, peers: &[&str]) -> RegionsConfig {
    RegionsConfig {
        name: Arc::from("eu"),
        mode,
        sync_interval: std::time::Duration::from_millis(100),
        budget_floor: 0.5,
        peers: peers
            .iter()
            .map(|p| PeerConfig {
                name: Arc::from(*p),
                cluster: false,
                urls: vec!["redis://127.0.0.1:1".into()],
                password: None,
            })
            .collect(),
    }
}

fn check(limit: u64) -> LimitCheck {
    let q = Quota::window(
        Algorithm::FixedWindow,
        NonZeroU64::new(limit).unwrap(),
        NonZeroU64::new(10_000_000).unwrap(),
    );
    LimitCheck::new("tl:{abc}:chat@eu:0".into(), q, 1)
}

#[test]
fn peer_keys_name_the_peer_region() {
    let r = Regions::new(config(Mode::Sync, &["us"]));
    assert_eq!(
        r.peer_key("tl:{abc}:chat@eu:0", "us").as_deref(),
        Some("tl:{abc}:chat@us:0")
    );
    assert_eq!(r.peer_key("tl:{abc}:chat:0", "us"), None);
}

#[test]
fn sync_mode_checks_the_limit_less_what_peers_spent_in_this_window() {
    let r = Regions::new(config(Mode::Sync, &["us", "ap"]));
    let now = 25_000_000; // window index 2
    let mut c = check(100);
    assert_eq!(r.apply(&mut c, now), Applied::Check);
    assert_eq!(c.quota.limit.get(), 100, "nothing known yet");
    let key: Arc<str> = c.key.0.clone();
    r.learn(&key, 0, PeerCount { index: 2, units: 30 });
    r.learn(&key, 1, PeerCount { index: 1, units: 50 }); // an old window: not counted
    let mut c = check(100);
    assert_eq!(r.apply(&mut c, now), Applied::Check);
    assert_eq!(c.quota.limit.get(), 70);
    r.learn(&key, 1, PeerCount { index: 2, units: 80 });
    let mut c = check(100);
    assert_eq!(r.apply(&mut c, now), Applied::Exhausted { reset_us: 5_000_000 });
    assert_eq!(r.peer_units(&key, 2)[0].1, 30);
}

#[test]
fn budget_shares_never_add_up_to_more_than_the_limit() {
    // Every region computes from the same uses; the floor is what a region that could not
    // read every report takes.
    let floor = 250_000; // 0.5 / 2 regions
    for uses in [[0, 0], [10, 0], [0, 10], [7, 3], [1, 999_999], [u64::MAX / 4, 1]] {
        let a = share_ppm(&uses, floor, 2);
        let b = share_ppm(&[uses[1], uses[0]], floor, 2);
        assert!(a + b <= PPM, "{uses:?}: {a} + {b}");
        assert!(a >= floor && b >= floor, "{uses:?}: {a}, {b}");
        // Either region falling back to the floor keeps the sum under the limit.
        assert!(floor + b <= PPM && a + floor <= PPM);
        for limit in [1, 7, 100, 1_000_003] {
            assert!(share_of(limit, a) + share_of(limit, b) <= limit);
        }
    }
    assert_eq!(share_ppm(&[0, 0], floor, 2), 500_000);
    assert_eq!(share_ppm(&[3, 1], floor, 2), 250_000 + 375_000);
}

#[test]
fn budget_mode_takes_the_floor_until_the_reports_are_settled() {
    let r = Regions::new(config(Mode::Budget, &["us"]));
    let now = 25_000_000;
    let mut c = check(100);
    assert_eq!(r.apply(&mut c, now), Applied::Check);
    assert_eq!(c.quota.limit.get(), 25, "the floor: 0.5 of an equal share");
    let key: Arc<str> = c.key.0.clone();
    assert!(r.unreported(&key, 1));
    r.settle(&key, 1, Some(&[30, 10]));
    assert!(!r.unreported(&key, 1));
    let mut c = check(100);
    assert_eq!(r.apply(&mut c, now), Applied::Check);
    assert_eq!(c.quota.limit.get(), 25 + 37, "the floor plus 3/4 of the rest");
    // A report that could not be read: the floor again for the next window.
    r.settle(&key, 2, None);
    let mut c = check(100);
    assert_eq!(r.apply(&mut c, 35_000_000), Applied::Check);
    assert_eq!(c.quota.limit.get(), 25);
}

#[test]
fn keys_unused_for_two_windows_are_forgotten() {
    let r = Regions::new(config(Mode::Sync, &["us"]));
    let mut c = check(100);
    r.apply(&mut c, 25_000_000);
    let key: Arc<str> = c.key.0.clone();
    r.learn(&key, 0, PeerCount { index: 2, units: 1 });
    assert_eq!(r.live_keys(35_000_000).len(), 1, "the next window still syncs it");
    assert!(r.live_keys(45_000_000).is_empty());
    assert!(r.known_of(&key).is_none());
}

#[test]
fn a_peer_counter_of_another_shape_counts_all_its_units_now() {
    use redis::Value;
    let reply = |i: &str, c: &str, q: &str| {
        Value::Array(vec![
            Value::BulkString(i.as_bytes().to_vec()),
            Value::BulkString(c.as_bytes().to_vec()),
            Value::BulkString(q.as_bytes().to_vec()),
        ])
    };
    let now = 25_000_000;
    // Its own shape: its own window.
    assert_eq!(
        link::count_of(&reply("2", "7", "f:10000000"), 10_000_000, now),
        PeerCount { index: 2, units: 7 }
    );
    // Another window (an override on a shared key): all of it, in this window.
    assert_eq!(
        link::count_of(&reply("1", "9", "f:20000000"), 10_000_000, now),
        PeerCount { index: 2, units: 9 }
    );
    // No counter: nothing.
    assert_eq!(
        link::count_of(&Value::Array(vec![Value::Nil, Value::Nil, Value::Nil]), 10_000_000, now),
        PeerCount::default()
    );
}
