use super::*;

const SEC: u64 = 1_000_000;
/// An epoch-aligned start, so window boundaries fall on whole seconds.
const T0: u64 = 1_700_000_000 * SEC;

const ALL: [Algorithm; 5] = Algorithm::ALL;

fn nz(v: u64) -> NonZeroU64 {
    NonZeroU64::new(v).unwrap()
}

fn five_per_second(alg: Algorithm) -> Quota {
    if alg.is_bucket() {
        Quota::bucket(alg, nz(5), nz(SEC / 5))
    } else {
        Quota::window(alg, nz(5), nz(SEC))
    }
}

/// Runs `n` requests of cost 1 at `at`, returning how many were admitted.
fn burst(q: &Quota, state: &mut Option<State>, at: u64, n: u32) -> u32 {
    let mut ok = 0;
    for _ in 0..n {
        let o = evaluate(q, state, at, 1);
        if o.allowed {
            spend(q, state, at, 1);
            ok += 1;
        }
    }
    ok
}

/// The boundary-burst case: limit 5/s, 5 requests at t=0.9, 5 at t=1.0, 5 at t=1.5.
#[test]
fn boundary_burst_per_algorithm() {
    let cases = [
        // Fixed windows let 10 through in 100 ms across the boundary: the known weakness.
        (Algorithm::FixedWindow, [5, 5, 0]),
        (Algorithm::SlidingLog, [5, 0, 0]),
        // At 1.5 the previous window weighs 2.5, so two more fit.
        (Algorithm::SlidingWindow, [5, 0, 2]),
        // 0.6 s of refill at 5/s is 3 tokens.
        (Algorithm::TokenBucket, [5, 0, 3]),
        (Algorithm::LeakyBucket, [5, 0, 3]),
    ];
    for (alg, want) in cases {
        let q = five_per_second(alg);
        let mut st = None;
        let got = [
            burst(&q, &mut st, T0 + 900_000, 5),
            burst(&q, &mut st, T0 + SEC, 5),
            burst(&q, &mut st, T0 + SEC + 500_000, 5),
        ];
        assert_eq!(got, want, "{alg:?}");
    }
}

#[test]
fn rejected_requests_change_no_state() {
    for alg in ALL {
        let q = five_per_second(alg);
        let mut st = None;
        assert_eq!(burst(&q, &mut st, T0, 5), 5);
        let before = st.clone();
        for _ in 0..100 {
            assert!(!evaluate(&q, &mut st, T0, 1).allowed, "{alg:?}");
        }
        assert_eq!(st, before, "{alg:?}: a denial changed state");
    }
}

#[test]
fn retry_after_is_the_earliest_admission() {
    for alg in ALL {
        let q = five_per_second(alg);
        let mut st = None;
        let start = T0 + 300_000;
        assert_eq!(burst(&q, &mut st, start, 5), 5);
        let denied = evaluate(&q, &mut st, start + 1, 1);
        assert!(!denied.allowed);
        assert!(denied.retry_after_us > 0, "{alg:?}");
        let at = start + 1 + denied.retry_after_us;
        let mut probe = st.clone();
        assert!(
            !evaluate(&q, &mut probe, at - 1, 1).allowed,
            "{alg:?}: admitted before retry_after"
        );
        let mut probe = st.clone();
        assert!(
            evaluate(&q, &mut probe, at, 1).allowed,
            "{alg:?}: denied at retry_after"
        );
    }
}

#[test]
fn token_bucket_remaining_and_refill() {
    let q = Quota::bucket(Algorithm::TokenBucket, nz(100), nz(SEC / 10));
    let mut st = None;
    let o = evaluate(&q, &mut st, T0, 5);
    assert!(o.allowed);
    assert_eq!(o.remaining, 95);
    spend(&q, &mut st, T0, 5);
    // One second refills 10 tokens, capped at capacity.
    let o = evaluate(&q, &mut st, T0 + SEC, 5);
    assert_eq!(o.remaining, 95);
}

#[test]
fn leaky_bucket_spaces_admissions() {
    let q = Quota::bucket(Algorithm::LeakyBucket, nz(3), nz(SEC / 5));
    let mut st = None;
    let mut delays = vec![];
    for _ in 0..3 {
        let o = evaluate(&q, &mut st, T0, 1);
        assert!(o.allowed);
        spend(&q, &mut st, T0, 1);
        delays.push(o.delay_us);
    }
    assert_eq!(delays, vec![0, 200_000, 400_000]);
    let o = evaluate(&q, &mut st, T0, 1);
    assert!(!o.allowed);
    assert_eq!(o.retry_after_us, 200_000);
}

#[test]
fn cost_counts_units() {
    let q = Quota::window(Algorithm::SlidingLog, nz(10), nz(SEC));
    let mut st = None;
    assert!(evaluate(&q, &mut st, T0, 6).allowed);
    spend(&q, &mut st, T0, 6);
    let o = evaluate(&q, &mut st, T0 + 10, 6);
    assert!(!o.allowed);
    assert_eq!(o.remaining, 4);
    assert!(evaluate(&q, &mut st, T0 + 10, 4).allowed);
}

#[test]
fn sliding_log_forgets_after_window() {
    let q = Quota::window(Algorithm::SlidingLog, nz(2), nz(SEC));
    let mut st = None;
    assert_eq!(burst(&q, &mut st, T0, 3), 2);
    // (now - window, now]: an entry at T0 is out of the window exactly at T0 + 1s.
    assert_eq!(burst(&q, &mut st, T0 + SEC - 1, 1), 0);
    assert_eq!(burst(&q, &mut st, T0 + SEC, 3), 2);
}

/// A debit learned after its window ended lands in the window it is learned in (never dropped);
/// one learned in the check's window lands there.
#[test]
fn a_debit_lands_in_the_live_window() {
    for alg in [Algorithm::FixedWindow, Algorithm::SlidingWindow] {
        let q = Quota::window(alg, nz(100), nz(SEC));
        let mut st = None;
        let at = T0 + SEC * 9 / 10;
        assert!(evaluate(&q, &mut st, at, 10).allowed);
        spend(&q, &mut st, at, 10);
        // Same window: 10 + 40 spent, 50 left.
        debit(&q, &mut st, at + SEC / 20, 40);
        assert_eq!(evaluate(&q, &mut st, at + SEC / 20, 0).remaining, 50, "{alg:?}");
        // The next window: the debit of a request checked at `at` counts in full there.
        let later = T0 + SEC + SEC / 10;
        let before = evaluate(&q, &mut st, later, 0).remaining;
        debit(&q, &mut st, later, 30);
        assert_eq!(
            evaluate(&q, &mut st, later, 0).remaining,
            before - 30,
            "{alg:?}: a debit after the boundary was dropped"
        );
    }
}

/// A debit takes a key at most one quota below zero: a window's count at most twice its limit,
/// a bucket's tat at most twice its capacity ahead of now; state already past that stays.
#[test]
fn a_debit_stops_one_quota_below_zero() {
    let now = T0 + SEC / 2;
    let fw = Quota::window(Algorithm::FixedWindow, nz(100), nz(SEC));
    let mut st = None;
    debit(&fw, &mut st, now, 1_000_000);
    assert_eq!(
        st,
        Some(State::Window {
            index: T0 / SEC,
            count: 200
        })
    );
    let sw = Quota::window(Algorithm::SlidingWindow, nz(100), nz(SEC));
    let mut st = None;
    debit(&sw, &mut st, now, 1_000_000);
    assert!(matches!(st, Some(State::Sliding { curr: 200, .. })), "{st:?}");
    let tb = Quota::bucket(Algorithm::TokenBucket, nz(100), nz(SEC / 100));
    let mut st = None;
    debit(&tb, &mut st, now, 1_000_000);
    assert_eq!(st, Some(State::Bucket { tat: now + 2 * SEC }));
    let mut st = Some(State::Bucket { tat: now + 5 * SEC });
    debit(&tb, &mut st, now, 1);
    assert_eq!(
        st,
        Some(State::Bucket { tat: now + 5 * SEC }),
        "a debit never lowers a tat"
    );
    // Within the floor, a bucket's debit moves tat on from max(tat, now).
    let mut st = Some(State::Bucket { tat: now - SEC });
    debit(&tb, &mut st, now, 10);
    assert_eq!(st, Some(State::Bucket { tat: now + SEC / 10 }));
}
