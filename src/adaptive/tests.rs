//! The controller on modelled upstreams, admission by class, the queue, and the config's
//! validation.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::*;
use crate::yaml::ConfigError;

fn config(yaml: &str) -> Result<AdaptiveConfig, ConfigError> {
    let raw: raw::RawAdaptive = crate::yaml::parse_str(Path::new("gateway.yaml"), yaml)?;
    AdaptiveConfig::compile(Path::new("gateway.yaml"), &raw)
}

fn adaptive(yaml: &str) -> Arc<Adaptive> {
    match config(yaml) {
        Ok(c) => Adaptive::new(c, Gauges::default()),
        Err(e) => panic!("{e}"),
    }
}

fn tuning(algorithm: Algorithm) -> Tuning {
    Tuning {
        algorithm,
        min: 2,
        max: 1000,
        tolerance: 1.5,
        backoff: 0.9,
    }
}

/// One window against a modelled upstream with `slots` servers of `service_ms` each, FIFO
/// beyond them: with the gateway saturated, `limit` requests are in flight and the median
/// waits `service × limit / slots` once the servers are all busy.
fn saturated_window(ctl: &Controller, slots: u32, service_ms: f64) -> WindowSummary {
    let l = ctl.limit();
    WindowSummary {
        median_us: service_ms * 1000.0 * (f64::from(l) / f64::from(slots)).max(1.0),
        tail_us: service_ms * 1000.0 * (f64::from(l) / f64::from(slots)).max(1.0),
        samples: 100,
        failed: 0,
        peak_in_flight: l,
        pressure: true,
    }
}

fn run(ctl: &mut Controller, windows: usize, slots: u32, service_ms: f64) -> Vec<u32> {
    (0..windows)
        .map(|_| {
            let w = saturated_window(ctl, slots, service_ms);
            ctl.update(&w)
        })
        .collect()
}

// ---- the controller -------------------------------------------------------------------------

/// A controller at `initial` whose first window, below the servers' count, set the baseline
/// at 5 ms.
fn learned(alg: Algorithm, initial: u32) -> Controller {
    let mut ctl = Controller::new(tuning(alg), initial);
    ctl.update(&WindowSummary {
        median_us: 5000.0,
        tail_us: 5000.0,
        samples: 100,
        failed: 0,
        peak_in_flight: 4,
        pressure: false,
    });
    ctl
}

#[test]
fn under_overload_the_limit_settles_near_the_upstreams_slots_times_tolerance() {
    for alg in [Algorithm::Gradient, Algorithm::Aimd] {
        let mut ctl = learned(alg, 20);
        let limits = run(&mut ctl, 600, 8, 5.0);
        let tail = &limits[100..];
        let most = tail.iter().copied().max().unwrap_or(0);
        let least = tail.iter().copied().min().unwrap_or(0);
        assert!(most <= 14, "{alg:?}: limit grew to {most} (8 slots × 1.5 = 12)");
        assert!(least >= 6, "{alg:?}: limit fell to {least}");
        assert_eq!(ctl.baseline_us(), Some(5000.0), "{alg:?}: overload moved the baseline");
    }
}

#[test]
fn moderate_overload_for_a_long_time_does_not_grow_the_limit_without_bound() {
    // Gradient2's failure mode: a baseline that follows recent latency lets the limit climb.
    let mut ctl = Controller::new(tuning(Algorithm::Gradient), 8);
    ctl.update(&WindowSummary {
        median_us: 5000.0,
        tail_us: 5000.0,
        samples: 100,
        failed: 0,
        peak_in_flight: 8,
        pressure: true,
    });
    // An hour of 100 ms windows, the upstream queueing a little beyond its 8 servers.
    let limits = run(&mut ctl, 36_000, 8, 5.0);
    let most = limits.iter().copied().max().unwrap_or(0);
    assert!(most <= 14, "limit reached {most}");
    assert_eq!(ctl.baseline_us(), Some(5000.0));
}

#[test]
fn one_slow_request_does_not_halve_the_limit() {
    let ad = adaptive("initial: 20\nmin_samples: 10\n");
    let t0 = Instant::now();
    // A first window sets the baseline at 5 ms.
    for i in 0..20 {
        take(&ad, 1);
        ad.record(Duration::from_millis(5), true, t0 + Duration::from_millis(i));
        ad.release(1);
    }
    ad.release_window_at(t0 + Duration::from_millis(150));
    let before = ad.status()["limit"].as_u64().unwrap_or(0);
    // The next window: 99 requests at 5 ms, one at 2 s.
    for i in 0..100u64 {
        take(&ad, 1);
        let l = if i == 50 {
            Duration::from_secs(2)
        } else {
            Duration::from_millis(5)
        };
        ad.record(l, true, t0 + Duration::from_millis(200 + i));
        ad.release(1);
    }
    ad.release_window_at(t0 + Duration::from_millis(400));
    let after = ad.status()["limit"].as_u64().unwrap_or(0);
    assert!(after >= before, "limit went from {before} to {after}");
}

#[test]
fn halved_capacity_is_found_and_recovery_follows_when_it_returns() {
    let mut ctl = learned(Algorithm::Gradient, 12);
    run(&mut ctl, 200, 8, 5.0);
    // 4 servers instead of 8: within 50 windows (5 s of 100 ms windows) the limit is at most
    // 4 × tolerance and a little.
    let halved = run(&mut ctl, 50, 4, 5.0);
    assert!(halved[halved.len() - 10..].iter().all(|l| *l <= 7), "{halved:?}");
    let back = run(&mut ctl, 50, 8, 5.0);
    assert!(back[back.len() - 10..].iter().all(|l| *l >= 8), "{back:?}");
}

#[test]
fn an_upstream_that_got_slower_is_relearned_at_the_floor() {
    let mut ctl = learned(Algorithm::Gradient, 12);
    run(&mut ctl, 100, 8, 5.0);
    // Every request now takes 12 ms even alone: the limit falls to the floor, the baseline is
    // learned again there, and the limit climbs back to the servers' count.
    let limits = run(&mut ctl, 100, 8, 12.0);
    assert!(limits.contains(&2), "never reached the floor: {limits:?}");
    assert_eq!(ctl.baseline_us(), Some(12_000.0));
    assert!(limits[limits.len() - 10..].iter().all(|l| *l >= 8), "{limits:?}");
}

#[test]
fn failures_shrink_the_limit_and_an_unused_limit_does_not_grow() {
    let mut ctl = Controller::new(tuning(Algorithm::Aimd), 100);
    let fast = |failed, peak| WindowSummary {
        median_us: 1000.0,
        tail_us: 1000.0,
        samples: 100,
        failed,
        peak_in_flight: peak,
        pressure: false,
    };
    ctl.update(&fast(0, 3));
    assert_eq!(ctl.limit(), 100, "a window using 3 of 100 does not grow it");
    ctl.update(&fast(20, 3));
    assert_eq!(
        ctl.limit(),
        100,
        "failures with 3 of 100 in flight are not the limit's doing"
    );
    ctl.update(&fast(20, 60));
    assert_eq!(ctl.limit(), 100, "one failing window may be a hiccup");
    ctl.update(&fast(20, 60));
    assert_eq!(ctl.limit(), 90, "two in a row, with the limit pressed, back off by 0.9");
}

#[test]
fn a_quiet_upstreams_jitter_does_not_shrink_the_limit() {
    let mut ctl = Controller::new(tuning(Algorithm::Gradient), 20);
    for i in 0..100 {
        // One or two in flight, latencies between 1 and 3 ms.
        let ms = 1.0 + f64::from(i % 3);
        ctl.update(&WindowSummary {
            median_us: ms * 1000.0,
            tail_us: ms * 1500.0,
            samples: 20,
            failed: 0,
            peak_in_flight: 1 + i % 2,
            pressure: false,
        });
    }
    assert_eq!(ctl.limit(), 20);
}

// ---- admission ------------------------------------------------------------------------------

fn take(ad: &Arc<Adaptive>, class: usize) {
    let mut g = ad.inner.lock();
    g.take(class);
}

impl Adaptive {
    /// End the window at `now` with no new sample.
    fn release_window_at(&self, now: Instant) {
        let mut g = self.inner.lock();
        self.roll(&mut g, now);
    }
}

#[tokio::test]
async fn a_guaranteed_share_stays_free_for_its_class() {
    // Limit 10: critical keeps 2 (0.2 × 10); default may fill the other 8.
    let ad = adaptive("min: 10\nmax: 10\nqueue_timeout: 0s\n");
    let mut held = Vec::new();
    for _ in 0..8 {
        held.push(ad.acquire(1).await.unwrap_or_else(|e| panic!("{e:?}")));
    }
    assert_eq!(ad.acquire(1).await.err(), Some(Refusal::QueueFull));
    assert_eq!(ad.acquire(2).await.err(), Some(Refusal::QueueFull));
    let c1 = ad.acquire(0).await;
    let c2 = ad.acquire(0).await;
    assert!(c1.is_ok() && c2.is_ok());
    assert_eq!(ad.acquire(0).await.err(), Some(Refusal::QueueFull), "the limit is 10");
    drop(held);
}

#[tokio::test]
async fn a_small_limit_still_keeps_a_slot_for_a_class_with_a_share() {
    // Limit 4: a fifth is 0.8 of a slot, rounded down to none, so a limit that had shrunk under
    // a slow upstream let the default class take every slot from critical. It keeps one.
    let ad = adaptive("min: 4\nmax: 4\nqueue_timeout: 0s\n");
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(ad.acquire(1).await.unwrap_or_else(|e| panic!("{e:?}")));
    }
    assert_eq!(
        ad.acquire(1).await.err(),
        Some(Refusal::QueueFull),
        "the fourth slot is critical's"
    );
    assert!(ad.acquire(0).await.is_ok(), "critical gets its slot");
    drop(held);
    // Limit 1 has no slot to keep: the classes without a share are not shut out.
    let one = adaptive("min: 1\nmax: 1\nqueue_timeout: 0s\n");
    assert!(one.acquire(1).await.is_ok(), "default gets the only slot");
}

#[tokio::test]
async fn freed_room_goes_to_the_highest_class_waiting() {
    let ad = adaptive(
        "min: 1\nmax: 1\nqueue_timeout: 2s\nclasses: [{name: critical}, {name: default}, {name: sheddable}]\n",
    );
    let first = ad.acquire(1).await.unwrap_or_else(|e| panic!("{e:?}"));
    let (a, b) = (ad.clone(), ad.clone());
    let low = tokio::spawn(async move { a.acquire(2).await.map(|p| p.class()) });
    let high = tokio::spawn(async move { b.acquire(0).await.map(|p| p.class()) });
    let queued = crate::adaptive::tests::eventually(|| ad.status()["queued"].as_u64() == Some(2)).await;
    assert!(queued, "both wait");
    drop(first);
    let got = high.await.unwrap_or(Err(Refusal::Timeout));
    assert_eq!(got, Ok(0), "critical gets the room");
    // The critical permit was dropped by the task when it ended: sheddable gets it next.
    let got = low.await.unwrap_or(Err(Refusal::Timeout));
    assert_eq!(got, Ok(2));
}

/// The order in which one slot serves `n` waiters of `class`, queued one after the other
/// (each in the queue before the next starts) while `ad`'s only slot is held. Each waiter
/// notes its place in line once admitted and gives the slot back at once, which admits the
/// next.
async fn served_order(ad: &Arc<Adaptive>, class: usize, n: usize) -> Vec<usize> {
    let held = ad.acquire(1).await.unwrap_or_else(|e| panic!("{e:?}"));
    let order = Arc::new(parking_lot::Mutex::new(Vec::new()));
    let mut waiters = Vec::new();
    for i in 0..n {
        let (a, order) = (ad.clone(), order.clone());
        waiters.push(tokio::spawn(async move {
            if let Ok(p) = a.acquire(class).await {
                order.lock().push(i);
                drop(p);
            }
        }));
        assert!(eventually(|| ad.status()["queued"].as_u64() == Some(i as u64 + 1)).await);
    }
    drop(held);
    for w in waiters {
        let _ = w.await;
    }
    let v = order.lock().clone();
    v
}

#[tokio::test]
async fn a_class_with_a_share_is_served_oldest_first_the_others_newest_first() {
    // One slot; of the default classes critical has a share, default and sheddable none.
    let ad = adaptive("min: 1\nmax: 1\nqueue_timeout: 5s\n");
    assert_eq!(served_order(&ad, 0, 3).await, [0, 1, 2], "critical: oldest first");
    assert_eq!(served_order(&ad, 1, 3).await, [2, 1, 0], "default: newest first");
    assert_eq!(served_order(&ad, 2, 3).await, [2, 1, 0], "sheddable: newest first");
}

#[tokio::test]
async fn a_wait_ends_in_a_refusal_after_the_queue_timeout() {
    let ad = adaptive("min: 1\nmax: 1\nqueue_timeout: 30ms\n");
    let _held = ad.acquire(1).await.unwrap_or_else(|e| panic!("{e:?}"));
    let t = Instant::now();
    assert_eq!(ad.acquire(1).await.err(), Some(Refusal::Timeout));
    assert!(t.elapsed() >= Duration::from_millis(30));
    assert_eq!(ad.status()["queued"].as_u64(), Some(0), "it left the queue");
    assert_eq!(ad.status()["classes"][1]["refused"].as_u64(), Some(1));
}

#[tokio::test]
async fn a_full_queue_refuses_the_lowest_class_first() {
    let ad = adaptive("min: 1\nmax: 1\nqueue_timeout: 5s\nmax_queue: 1\n");
    let held = ad.acquire(1).await.unwrap_or_else(|e| panic!("{e:?}"));
    let a = ad.clone();
    let low = tokio::spawn(async move { a.acquire(2).await.map(|p| p.class()) });
    assert!(eventually(|| ad.status()["queued"].as_u64() == Some(1)).await);
    // The queue is full: a second sheddable request has nothing below it.
    assert_eq!(ad.acquire(2).await.err(), Some(Refusal::QueueFull));
    // A critical one takes the sheddable one's place.
    let b = ad.clone();
    let high = tokio::spawn(async move { b.acquire(0).await.map(|p| p.class()) });
    assert_eq!(low.await.unwrap_or(Err(Refusal::Timeout)), Err(Refusal::QueueFull));
    drop(held);
    assert_eq!(high.await.unwrap_or(Err(Refusal::Timeout)), Ok(0));
}

#[tokio::test]
async fn a_waiter_that_leaves_gives_up_its_place_and_any_room_granted_to_it() {
    let ad = adaptive("min: 1\nmax: 1\nqueue_timeout: 5s\n");
    let held = ad.acquire(1).await.unwrap_or_else(|e| panic!("{e:?}"));
    let a = ad.clone();
    let waiter = tokio::spawn(async move { a.acquire(1).await.is_ok() });
    assert!(eventually(|| ad.status()["queued"].as_u64() == Some(1)).await);
    waiter.abort();
    let _ = waiter.await;
    assert_eq!(ad.status()["queued"].as_u64(), Some(0));
    drop(held);
    assert_eq!(ad.status()["in_flight"].as_u64(), Some(0), "nothing leaked");
    // The room is free for the next request.
    assert!(ad.acquire(2).await.is_ok());
}

/// Poll `f` until it holds (2 s at most).
async fn eventually(mut f: impl FnMut() -> bool) -> bool {
    let until = Instant::now() + Duration::from_secs(2);
    while Instant::now() < until {
        if f() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    f()
}

// ---- config ---------------------------------------------------------------------------------

#[test]
fn defaults_are_gradient_with_three_classes() {
    let c = config("{}\n").unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(c.tuning().algorithm, Algorithm::Gradient);
    assert_eq!((c.tuning().min, c.tuning().max, c.initial()), (4, 1000, 20));
    let names: Vec<&str> = c.classes().iter().map(|k| &*k.name).collect();
    assert_eq!(names, ["critical", "default", "sheddable"]);
    assert_eq!(c.default_class(), 1);
}

#[test]
fn bad_values_are_refused_with_their_line() {
    for (yaml, line, says) in [
        ("algorithm: vegas\n", 1, "not gradient or aimd"),
        ("min: 10\nmax: 5\n", 2, "below min"),
        ("tolerance: 1.0\n", 1, "above 1"),
        (
            "classes:\n  - {name: a, guaranteed: 0.6}\n  - {name: b, guaranteed: 0.5}\n",
            2,
            "less than 1",
        ),
        ("classes:\n  - {name: a}\n  - {name: a}\n", 3, "named twice"),
        ("default_class: gold\n", 1, "not one of the classes"),
        ("window: 1ms\n", 1, "window"),
    ] {
        match config(yaml) {
            Ok(_) => panic!("{yaml:?} was accepted"),
            Err(e) => {
                assert_eq!(e.line, line, "{yaml:?}: {e}");
                assert!(e.message.contains(says), "{yaml:?}: {e}");
            }
        }
    }
}
