//! Which limit binds, and what the headers say about it.

use std::num::NonZeroU64;

use super::*;
use crate::limiter::Algorithm;

fn o(allowed: bool, remaining: u64, reset_us: u64, retry_after_us: u64) -> Outcome {
    Outcome::decided(1_800_000_000_400_000, allowed, remaining, reset_us, retry_after_us)
}

#[test]
fn the_binding_denial_is_the_one_exhausted_longest() {
    // [1/2s, 1/60s], both exhausted: the 60 s limit binds, not the first listed.
    let outs = [o(false, 0, 2_000_000, 1_600_000), o(false, 0, 60_000_000, 59_600_000)];
    assert_eq!(binding_index(outs.iter().map(|x| (false, *x, 1))), Some(1));
    // A shadow or unchecked limit never binds, however long.
    let outs = [o(false, 0, 2_000_000, 1_600_000), o(false, 0, 60_000_000, 59_600_000)];
    assert_eq!(
        binding_index(outs.iter().enumerate().map(|(i, x)| (i == 1, *x, 1))),
        Some(0)
    );
}

#[test]
fn on_an_allow_the_fewest_requests_left_then_the_longest_reset_bind() {
    let outs = [
        o(true, 0, 2_000_000, 0),
        o(true, 0, 60_000_000, 0),
        o(true, 3, 90_000_000, 0),
    ];
    assert_eq!(binding_index(outs.iter().map(|x| (false, *x, 1))), Some(1));
    // Remaining is compared in requests of each rule's cost: 9 units at cost 5 is 1 request.
    let outs = [o(true, 2, 1_000_000, 0), o(true, 9, 1_000_000, 0)];
    assert_eq!(
        binding_index(outs.iter().zip([1, 5]).map(|(x, c)| (false, *x, c))),
        Some(1)
    );
}

#[test]
fn q_and_r_count_requests_of_the_rules_cost() {
    let quota = Quota::window(
        Algorithm::FixedWindow,
        NonZeroU64::new(100).unwrap(),
        NonZeroU64::new(60_000_000).unwrap(),
    );
    let out = o(true, 7, 60_000_000, 0);
    let b = Binding {
        rule: "r",
        quota,
        cost: 5,
        outcome: &out,
        fixed: None,
        windows: &[],
        at: 0,
        units: &[],
    };
    assert_eq!((b.quota_requests(), b.remaining_requests()), (20, 1));
    let mut h = HeaderMap::new();
    write(&mut h, &b, true, true, 1_800_000_000_000_000);
    assert_eq!(h[&RATELIMIT_POLICY], "\"r\";q=20;w=60");
    assert_eq!(h[&RATELIMIT], "\"r\";r=1;t=60");
    assert_eq!(h[&X_LIMIT], "20");
    assert_eq!(h[&X_REMAINING], "1");
}

#[test]
fn the_reset_second_is_never_before_the_real_instant() {
    let quota = Quota::window(
        Algorithm::SlidingLog,
        NonZeroU64::new(1).unwrap(),
        NonZeroU64::new(1_000_000).unwrap(),
    );
    // Decided at x.4 s with 0.9 s to wait: free at (x+1).3 s, so the reset second is x + 2
    // (floor(now) + ceil(retry) said x + 1: 0.3 s early).
    for retry in [1u64, 300_000, 900_000, 1_000_000, 1_600_001] {
        let out = o(false, 0, retry, retry);
        let b = Binding {
            rule: "r",
            quota,
            cost: 1,
            outcome: &out,
            fixed: None,
            windows: &[],
            at: 0,
            units: &[],
        };
        let at = b.reset_at_secs(0);
        let free = out.at_us + retry;
        assert!(at * 1_000_000 >= free, "retry {retry}: reset {at} is before {free}");
        assert!(at * 1_000_000 < free + 1_000_000, "retry {retry}: reset {at} is late");
    }
}

#[test]
fn values_made_at_load_say_what_each_response_would() {
    let window = Quota::window(
        Algorithm::SlidingWindow,
        NonZeroU64::new(30).unwrap(),
        NonZeroU64::new(60_000_000).unwrap(),
    );
    let slots = Quota::window(
        Algorithm::Concurrency,
        NonZeroU64::new(4).unwrap(),
        NonZeroU64::new(30_000_000).unwrap(),
    );
    let minute = Quota::window(
        Algorithm::SlidingWindow,
        NonZeroU64::new(300).unwrap(),
        NonZeroU64::new(3_600_000_000).unwrap(),
    );
    let two = [window, minute];
    for (windows, at, cost) in [
        (&[window][..], 0, 1),
        (&[window][..], 0, 3),
        (&[slots][..], 0, 1),
        (&two[..], 0, 1),
        (&two[..], 1, 2),
    ] {
        let quota = windows[at];
        let fixed = FixedValues::new("search-free", windows, at, cost, &[]).unwrap();
        let out = o(true, 12, 41_000_000, 0);
        let mut made = HeaderMap::new();
        let mut preset = HeaderMap::new();
        let mut b = Binding {
            rule: "search-free",
            quota,
            cost,
            outcome: &out,
            fixed: None,
            windows,
            at,
            units: &[],
        };
        write(&mut made, &b, true, true, 1_800_000_000_000_000);
        b.fixed = fixed.describing(&quota, cost);
        assert!(b.fixed.is_some());
        write(&mut preset, &b, true, true, 1_800_000_000_000_000);
        assert_eq!(made, preset, "{quota:?} at cost {cost}");
        // Another quota (an override's) or cost is not described by them.
        assert!(fixed.describing(&quota, cost + 1).is_none());
    }
}

fn headers_of(rule: &str, windows: &[Quota], at: usize, out: &Outcome) -> HeaderMap {
    let b = Binding {
        rule,
        quota: windows[at],
        cost: 1,
        outcome: out,
        fixed: None,
        windows,
        at,
        units: &[],
    };
    let mut h = HeaderMap::new();
    write(&mut h, &b, true, false, 1_800_000_000_000_000);
    h
}

#[test]
fn each_window_of_a_rule_is_a_policy_of_its_own_and_ratelimit_names_the_binding_one() {
    let ten = Quota::window(
        Algorithm::FixedWindow,
        NonZeroU64::new(5).unwrap(),
        NonZeroU64::new(10_000_000).unwrap(),
    );
    let minute = Quota::window(
        Algorithm::FixedWindow,
        NonZeroU64::new(6).unwrap(),
        NonZeroU64::new(60_000_000).unwrap(),
    );
    let out = o(false, 0, 40_000_000, 40_000_000);
    let h = headers_of("api", &[ten, minute], 1, &out);
    // draft-ietf-httpapi-ratelimit-headers-12 §3: a List of String items with `q` and `w`;
    // each name has one definition.
    assert_eq!(h[&RATELIMIT_POLICY], "\"api-10s\";q=5;w=10, \"api-1m\";q=6;w=60");
    assert_eq!(h[&RATELIMIT], "\"api-1m\";r=0;t=40");
    let h = headers_of("api", &[ten, minute], 0, &o(true, 3, 4_000_000, 0));
    assert_eq!(h[&RATELIMIT_POLICY], "\"api-10s\";q=5;w=10, \"api-1m\";q=6;w=60");
    assert_eq!(h[&RATELIMIT], "\"api-10s\";r=3;t=4");
    // Two windows that read the same are told apart by position.
    let h = headers_of("api", &[ten, ten], 1, &out);
    assert_eq!(h[&RATELIMIT_POLICY], "\"api-1\";q=5;w=10, \"api-2\";q=5;w=10");
    assert_eq!(h[&RATELIMIT], "\"api-2\";r=0;t=40");
    // One window: the rule's name alone.
    let h = headers_of("api", &[minute], 0, &out);
    assert_eq!(h[&RATELIMIT_POLICY], "\"api\";q=6;w=60");
}

#[test]
fn a_concurrency_policy_says_its_quota_unit_and_has_no_window() {
    let slots = Quota::window(
        Algorithm::Concurrency,
        NonZeroU64::new(2).unwrap(),
        NonZeroU64::new(30_000_000).unwrap(),
    );
    let h = headers_of("inflight", &[slots], 0, &o(true, 1, 0, 0));
    assert_eq!(h[&RATELIMIT_POLICY], "\"inflight\";q=2;qu=\"concurrent-requests\"");
    assert_eq!(h[&RATELIMIT], "\"inflight\";r=1;t=0");
}

#[test]
fn an_upstreams_own_fields_are_kept_and_tollgates_follow() {
    let quota = Quota::window(
        Algorithm::FixedWindow,
        NonZeroU64::new(10).unwrap(),
        NonZeroU64::new(60_000_000).unwrap(),
    );
    let out = o(true, 4, 30_000_000, 0);
    let fixed = FixedValues::new("gate", &[quota], 0, 1, &[]).unwrap();
    for f in [None, Some(&fixed)] {
        let b = Binding {
            rule: "gate",
            quota,
            cost: 1,
            outcome: &out,
            fixed: f,
            windows: &[],
            at: 0,
            units: &[],
        };
        let mut h = HeaderMap::new();
        h.insert(&RATELIMIT_POLICY, HeaderValue::from_static("\"origin\";q=100;w=3600"));
        h.insert(&RATELIMIT, HeaderValue::from_static("\"origin\";r=0;t=99"));
        h.insert(&X_LIMIT, HeaderValue::from_static("100"));
        write(&mut h, &b, true, true, 1_800_000_000_000_000);
        let all = |n: &HeaderName| {
            h.get_all(n)
                .iter()
                .map(|v| v.to_str().unwrap().to_owned())
                .collect::<Vec<_>>()
        };
        assert_eq!(
            all(&RATELIMIT_POLICY),
            ["\"origin\";q=100;w=3600", "\"gate\";q=10;w=60"]
        );
        assert_eq!(all(&RATELIMIT), ["\"origin\";r=0;t=99", "\"gate\";r=4;t=30"]);
        assert_eq!(all(&X_LIMIT), ["10"], "the single-valued legacy field is replaced");
    }
}

#[test]
fn integers_stay_within_structured_field_bounds() {
    let huge = Quota::window(
        Algorithm::FixedWindow,
        NonZeroU64::new(u64::MAX).unwrap(),
        NonZeroU64::new(u64::MAX).unwrap(),
    );
    let h = headers_of("big", &[huge], 0, &o(true, u64::MAX, u64::MAX, 0));
    // q and r are capped at 15 digits; w and t (seconds of a u64 of microseconds) fit.
    assert_eq!(h[&RATELIMIT_POLICY], "\"big\";q=999999999999999;w=18446744073710");
    assert_eq!(h[&RATELIMIT], "\"big\";r=999999999999999;t=18446744073710");
}
