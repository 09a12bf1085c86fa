//! The limit itself: revised once a window from what the window measured, with no I/O and no
//! clock of its own (the caller says when a window ends), so it is tested on made-up windows.
//!
//! - The **baseline** is the learned no-load latency: the lowest `percentile` (95th by
//!   default) of a window seen (the same statistic the windows are judged by, so an upstream whose latencies are
//!   spread wide at any load is not taken for a slow one). It moves down halfway to a faster window (a run of fast windows proves the upstream can be that fast; one lucky window does not). It moves up only
//!   when the limit sits at its floor and windows there are still too slow
//!   ([`FLOOR_WINDOWS_TO_RELEARN`] in a row): the upstream itself got slower, not busier. A
//!   busy upstream never raises it, so moderate overload cannot talk the limit into growing
//!   (the failure of a baseline that follows recent latencies), and no probe phase is needed.
//! - A window is **too slow** when its percentile is above `tolerance × baseline`, or when a
//!   tenth or more of its requests failed (no answer, or 5xx). A percentile, not the mean or the
//!   maximum: one slow request in a window cannot move it; a high one rather than the median,
//!   so that the tail the clients see, not only the middle, is kept near the target.
//! - Too slow twice in a row (one slow window may be a hiccup of the machine, stalling every
//!   request in flight at once): `gradient` shrinks the limit by `target / percentile` (to
//!   three quarters at most in one window), which moves it toward where a queueing upstream's
//!   latency is back on target; `aimd` multiplies it by `backoff`.
//! - A window in which fewer than half the limit were in flight and nobody waited changes
//!   nothing but the baseline: its latency says nothing about the limit, and a limit shrunk on
//!   the jitter of a quiet upstream would refuse the next burst.
//! - On target (and not quiet): it grows by one, or by 5 % for `gradient` when that is more.
//!   It floats above what is in flight, up to twice that, so a burst finds room; only a slow
//!   window brings it down.

use super::Algorithm;

/// Windows in a row at the floor, still too slow, before the baseline is learned again.
pub const FLOOR_WINDOWS_TO_RELEARN: u32 = 3;

/// Slow windows in a row before the limit shrinks.
pub const SLOW_WINDOWS_TO_SHRINK: u32 = 2;

/// The most `gradient` shrinks the limit in one window (to three quarters).
const MOST_SHRINK: f64 = 0.75;

/// A window's share of failed requests at or above which it counts as too slow.
const FAILING_SHARE: f64 = 0.1;

/// What one window measured.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WindowSummary {
    /// The median latency to the upstream's response head, microseconds.
    pub median_us: f64,
    /// The configured percentile of the same (95th by default), microseconds.
    pub tail_us: f64,
    /// Latencies measured.
    pub samples: u32,
    /// Requests that got no answer or a 5xx.
    pub failed: u32,
    /// The most requests in flight at once.
    pub peak_in_flight: u32,
    /// Some request had to wait for room, or was refused.
    pub pressure: bool,
}

/// The controller's settings (validated by `AdaptiveConfig::compile`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Tuning {
    /// How the limit reacts to a slow window.
    pub algorithm: Algorithm,
    /// Floor of the limit (at least 1).
    pub min: u32,
    /// Ceiling of the limit (at least `min`).
    pub max: u32,
    /// A window's percentile above `tolerance × baseline` is too slow (above 1).
    pub tolerance: f64,
    /// `aimd`'s factor for a slow window (between 0.5 and 1).
    pub backoff: f64,
}

/// The adaptive limit and what it has learned.
#[derive(Debug, Clone)]
pub struct Controller {
    tuning: Tuning,
    limit: f64,
    baseline_us: Option<f64>,
    slow_at_floor: u32,
    slow_streak: u32,
}

impl Controller {
    /// A controller at `initial` (clamped to `min..=max`), with nothing learned yet.
    pub fn new(tuning: Tuning, initial: u32) -> Self {
        Controller {
            limit: f64::from(initial.clamp(tuning.min, tuning.max)),
            tuning,
            baseline_us: None,
            slow_at_floor: 0,
            slow_streak: 0,
        }
    }

    /// Requests allowed in flight now: the limit rounded down, never below `min`.
    pub fn limit(&self) -> u32 {
        (self.limit as u32).clamp(self.tuning.min, self.tuning.max)
    }

    /// The learned no-load latency, microseconds (`None` before the first window).
    pub fn baseline_us(&self) -> Option<f64> {
        self.baseline_us
    }

    /// The latency above which a window is too slow, microseconds.
    pub fn target_us(&self) -> Option<f64> {
        self.baseline_us.map(|b| b * self.tuning.tolerance)
    }

    /// Revise the limit from one window; returns the new limit.
    pub fn update(&mut self, w: &WindowSummary) -> u32 {
        if w.samples == 0 || !w.median_us.is_finite() || !w.tail_us.is_finite() {
            return self.limit();
        }
        // Down halfway to a faster window (one lucky window is not the upstream's no-load
        // latency; a run of them is), never up here.
        let baseline = match self.baseline_us {
            Some(b) if b <= w.tail_us => b,
            Some(b) => (b + w.tail_us) / 2.0,
            None => w.tail_us.max(1.0),
        };
        self.baseline_us = Some(baseline);
        // Fewer than half the limit in flight and nobody waiting: the latency says nothing
        // about the limit (the requests did not press on it), so it stays as it is.
        if f64::from(w.peak_in_flight) * 2.0 < self.limit && !w.pressure {
            return self.limit();
        }
        let target = baseline * self.tuning.tolerance;
        let failing = f64::from(w.failed) >= FAILING_SHARE * f64::from(w.samples);
        let slow = w.tail_us > target;
        let (min, max) = (f64::from(self.tuning.min), f64::from(self.tuning.max));
        if slow || failing {
            // One slow window may be a hiccup of the machine (every request in flight stalls
            // at once); two in a row are the upstream.
            self.slow_streak += 1;
            if self.slow_streak < SLOW_WINDOWS_TO_SHRINK {
                return self.limit();
            }
            let factor = match self.tuning.algorithm {
                Algorithm::Gradient if slow => (target / w.tail_us).clamp(MOST_SHRINK, 1.0),
                _ => self.tuning.backoff,
            };
            let at_floor = self.limit <= min;
            self.limit = (self.limit * factor).max(min);
            // At the floor and still slow without failures: the upstream itself is slower now.
            if at_floor && slow && !failing {
                self.slow_at_floor += 1;
                if self.slow_at_floor >= FLOOR_WINDOWS_TO_RELEARN {
                    self.baseline_us = Some(w.tail_us);
                    self.slow_at_floor = 0;
                }
            } else {
                self.slow_at_floor = 0;
            }
        } else {
            self.slow_at_floor = 0;
            self.slow_streak = 0;
            let step = match self.tuning.algorithm {
                Algorithm::Gradient => (self.limit * 0.05).max(1.0),
                Algorithm::Aimd => 1.0,
            };
            self.limit = (self.limit + step).min(max);
        }
        self.limit()
    }
}
