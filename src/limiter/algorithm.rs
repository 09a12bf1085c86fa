//! The five algorithms, as pure functions over integer microseconds.
//!
//! This file is the reference the Lua scripts in `lua/` mirror line for line: the same integer
//! arithmetic (exact in a Lua double below 2^53) and, for the sliding window, the same
//! floating-point expressions in the same order, so both stores reach identical decisions.
//!
//! Every check is split in two steps so a request with several limits is all-or-nothing:
//! [`evaluate`] decides without spending (it may only normalise state, e.g. drop expired log
//! entries, which changes no decision), and [`spend`] is called on every limit only once all of
//! them admitted.

use std::collections::VecDeque;
use std::num::NonZeroU64;

/// Largest limit, capacity or cost a rule may have. Counts stay far below 2^53 even after a
/// window's worth of spending on top, so the Lua scripts (whose numbers are doubles) count
/// exactly, and Redis never sees a number it would print in exponent form (`1e+17`), which
/// `HINCRBY` refuses. Mirrored in `lua/common.lua` (`TG_MAX_UNITS`).
pub const MAX_UNITS: u64 = 1_000_000_000_000;

/// Longest window, and longest time a bucket may take to refill from empty (capacity ×
/// interval): ten years in microseconds. Every instant the algorithms compute is at most
/// `now + 2 × span`, which stays below 2^53 µs (year 2255) for any `now` before 2200. Mirrored
/// in `lua/common.lua` (`TG_MAX_SPAN`).
pub const MAX_SPAN_US: u64 = 10 * 366 * 86_400 * 1_000_000;

/// Largest sliding-log limit. A sliding log keeps one entry per admitted unit, so this bounds
/// the work of one request (at most this many `ZADD` members, or entries scanned to find the
/// retry time) and the memory of one key (about 1 MB in Redis at the bound). Mirrored in
/// `lua/common.lua` (`TG_MAX_LOG`).
pub const MAX_LOG_ENTRIES: u64 = 10_000;

/// Which algorithm a limit uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Algorithm {
    /// Starts full at `capacity`, refills at `rate`; bursts up to capacity.
    TokenBucket,
    /// Starts empty, drains at `rate`; admitted requests are delayed instead of bursting.
    LeakyBucket,
    /// Epoch-aligned windows with one counter each.
    FixedWindow,
    /// Exact count of admissions in the trailing window.
    SlidingLog,
    /// Weighted estimate over the previous and the current fixed window.
    SlidingWindow,
    /// At most `limit` requests in flight at once (not a rate): a slot is taken before the
    /// request is forwarded and released when its response ends (see [`concurrency`]).
    Concurrency,
}

impl Algorithm {
    /// Every rate algorithm, in code order ([`Algorithm::Concurrency`] counts requests in
    /// flight, not a rate, and is tested on its own).
    pub const ALL: [Algorithm; 5] = [
        Algorithm::TokenBucket,
        Algorithm::LeakyBucket,
        Algorithm::FixedWindow,
        Algorithm::SlidingLog,
        Algorithm::SlidingWindow,
    ];

    /// The config spelling, also used in logs and the admin API.
    pub fn as_str(self) -> &'static str {
        match self {
            Algorithm::TokenBucket => "token_bucket",
            Algorithm::LeakyBucket => "leaky_bucket",
            Algorithm::FixedWindow => "fixed_window",
            Algorithm::SlidingLog => "sliding_log",
            Algorithm::SlidingWindow => "sliding_window",
            Algorithm::Concurrency => "concurrency",
        }
    }

    /// Parse the config spelling.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "token_bucket" => Algorithm::TokenBucket,
            "leaky_bucket" => Algorithm::LeakyBucket,
            "fixed_window" => Algorithm::FixedWindow,
            "sliding_log" => Algorithm::SlidingLog,
            "sliding_window" => Algorithm::SlidingWindow,
            "concurrency" => Algorithm::Concurrency,
            _ => return None,
        })
    }

    /// The small integer the Lua dispatcher switches on.
    pub fn code(self) -> u8 {
        match self {
            Algorithm::TokenBucket => 1,
            Algorithm::LeakyBucket => 2,
            Algorithm::FixedWindow => 3,
            Algorithm::SlidingLog => 4,
            Algorithm::SlidingWindow => 5,
            Algorithm::Concurrency => 6,
        }
    }

    /// True for the two bucket algorithms (rate + capacity).
    pub fn is_bucket(self) -> bool {
        matches!(self, Algorithm::TokenBucket | Algorithm::LeakyBucket)
    }
}

/// One validated limit. It cannot be built with a zero limit or a zero window.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Quota {
    /// How the limit counts: fixed or sliding window, token or leaky bucket, or concurrency.
    pub algorithm: Algorithm,
    /// Units per window, or the bucket capacity.
    pub limit: NonZeroU64,
    /// The window in microseconds; for buckets, the time to refill the whole capacity.
    pub window_us: NonZeroU64,
    /// Buckets: microseconds per unit (1 / rate). Windows: equal to `window_us`.
    pub interval_us: NonZeroU64,
    /// Fixed and sliding windows with `align: calendar`: days, weeks or months of a clock
    /// (`window_us` is then nominal; see [`calendar`]). `None` for epoch-aligned windows.
    pub calendar: Option<calendar::Calendar>,
}

impl Quota {
    /// A window algorithm: `limit` units per `window_us`.
    pub fn window(algorithm: Algorithm, limit: NonZeroU64, window_us: NonZeroU64) -> Self {
        Quota {
            algorithm,
            limit,
            window_us,
            interval_us: window_us,
            calendar: None,
        }
    }

    /// A bucket algorithm: `capacity` units, one unit refilled (or drained) every `interval_us`.
    pub fn bucket(algorithm: Algorithm, capacity: NonZeroU64, interval_us: NonZeroU64) -> Self {
        let window = capacity.get().saturating_mul(interval_us.get());
        Quota {
            algorithm,
            limit: capacity,
            window_us: NonZeroU64::new(window).unwrap_or(NonZeroU64::MIN),
            interval_us,
            calendar: None,
        }
    }

    /// Why this quota, with requests of `cost` units, lies outside what both stores compute
    /// exactly (see [`MAX_UNITS`], [`MAX_SPAN_US`], [`MAX_LOG_ENTRIES`]); `None` when it is fine.
    pub fn bounds_error(&self, cost: u64) -> Option<String> {
        let what = if self.algorithm.is_bucket() {
            "capacity"
        } else {
            "limit"
        };
        let limit = self.limit.get();
        if limit > MAX_UNITS {
            return Some(format!("{what} {limit} is above the largest supported, {MAX_UNITS}"));
        }
        if cost > MAX_UNITS {
            return Some(format!("cost {cost} is above the largest supported, {MAX_UNITS}"));
        }
        if self.algorithm == Algorithm::SlidingLog && limit > MAX_LOG_ENTRIES {
            return Some(format!(
                "sliding_log keeps one entry per unit, so its limit is at most {MAX_LOG_ENTRIES} (got {limit}); use sliding_window for larger limits"
            ));
        }
        let span = u128::from(limit) * u128::from(self.interval_us.get());
        let span = if self.algorithm.is_bucket() {
            span
        } else {
            u128::from(self.window_us.get())
        };
        if span > u128::from(MAX_SPAN_US) {
            return Some(if self.algorithm.is_bucket() {
                "capacity / rate (the time to refill from empty) is above 10 years".to_owned()
            } else {
                "window is above 10 years".to_owned()
            });
        }
        None
    }

    /// True when state written under `self` means the same under `other`, so a reload from one
    /// to the other keeps the state as it is: the two buckets share their state (GCRA) when the
    /// interval is the same, a sliding log's timestamps hold under any window, and the windowed
    /// algorithms need the same algorithm and window. A limit or capacity change alone never
    /// needs a conversion: every state counts absolute units.
    pub fn same_shape(&self, other: &Quota) -> bool {
        match (self.algorithm, other.algorithm) {
            (a, b) if a.is_bucket() && b.is_bucket() => self.interval_us == other.interval_us,
            (Algorithm::SlidingLog, Algorithm::SlidingLog) => true,
            (Algorithm::Concurrency, Algorithm::Concurrency) => true,
            (a, b) => a == b && self.window_us == other.window_us && self.calendar == other.calendar,
        }
    }
}

/// The decision for one limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Outcome {
    /// The request fits this limit.
    pub allowed: bool,
    /// Units left after this request (if admitted), floored.
    pub remaining: u64,
    /// Microseconds until the quota is fully restored.
    pub reset_us: u64,
    /// On a denial: microseconds until the same request would be admitted. 0 when allowed.
    pub retry_after_us: u64,
    /// Leaky bucket only: microseconds the admitted request waits before it is forwarded.
    pub delay_us: u64,
    /// The store's clock when it decided (µs since the epoch): a refund of this spending
    /// names it, so the units come off the window they were counted in.
    pub at_us: u64,
    /// Denied because the key is in its rule's penalty box: microseconds the penalty still
    /// runs (then equal to `retry_after_us`). 0 otherwise.
    pub penalty_us: u64,
    /// This check's denial put the key in the penalty box (or, escalating, doubled its time).
    pub penalty_started: bool,
    /// Units the store spent for this node's lease along with the request (0: none asked or
    /// none granted).
    pub leased: u64,
}

impl Outcome {
    /// A decision at `now` with no wait, penalty or lease: what an algorithm's arithmetic
    /// returns before the leaky-bucket wait, the penalty box and leases look at it.
    pub(crate) fn decided(now: u64, allowed: bool, remaining: u64, reset_us: u64, retry_after_us: u64) -> Self {
        Outcome {
            allowed,
            remaining,
            reset_us,
            retry_after_us,
            delay_us: 0,
            at_us: now,
            penalty_us: 0,
            penalty_started: false,
            leased: 0,
        }
    }
}

/// The state one limit keeps in the memory store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum State {
    /// Buckets: the theoretical arrival time (GCRA); the bucket is full/empty at `tat`.
    Bucket {
        /// Microseconds since the epoch.
        tat: u64,
    },
    /// Fixed window: the window index and its count.
    Window {
        /// `floor(now / window)`.
        index: u64,
        /// Units admitted in that window.
        count: u64,
    },
    /// Sliding log: one timestamp per admitted unit, oldest first.
    Log {
        /// Admission times, microseconds since the epoch.
        entries: VecDeque<u64>,
    },
    /// Concurrency: the holders of a slot, each with the instant its slot expires unless
    /// renewed.
    Slots {
        /// (holder id, expiry in microseconds since the epoch), in the order taken.
        held: Vec<(u64, u64)>,
    },
    /// Sliding window counter.
    Sliding {
        /// Index of the current window.
        index: u64,
        /// Units admitted in the previous window.
        prev: u64,
        /// Units admitted in the current window.
        curr: u64,
    },
}

/// Decide whether `cost` units fit `q` at `now`, without spending. May normalise `state`
/// (expire old log entries, roll windows) in ways that change no decision under `q`. The Lua
/// script normalises at the same points (a log is pruned whenever a check evaluates it), so
/// both stores always hold the same state, whatever a later reload reads from it.
pub fn evaluate(q: &Quota, state: &mut Option<State>, now: u64, cost: u64) -> Outcome {
    match q.algorithm {
        Algorithm::TokenBucket | Algorithm::LeakyBucket => bucket_eval(q, state, now, cost),
        Algorithm::FixedWindow => fixed_eval(q, state, now, cost),
        Algorithm::SlidingLog => {
            if let Some(State::Log { entries }) = state {
                let floor = now.saturating_sub(q.window_us.get());
                while entries.front().is_some_and(|t| *t <= floor) {
                    entries.pop_front();
                }
            }
            log_eval(q, state, now, cost)
        }
        Algorithm::SlidingWindow => sliding_eval(q, state, now, cost),
        Algorithm::Concurrency => concurrency::evaluate(q, state, now, cost),
    }
}

/// Would `cost` units fit `q` at `now`? [`evaluate`] without touching `state`.
pub fn admits(q: &Quota, state: &Option<State>, now: u64, cost: u64) -> bool {
    match q.algorithm {
        Algorithm::TokenBucket | Algorithm::LeakyBucket => bucket_eval(q, state, now, cost).allowed,
        Algorithm::FixedWindow => fixed_eval(q, state, now, cost).allowed,
        Algorithm::SlidingLog => log_eval(q, state, now, cost).allowed,
        Algorithm::SlidingWindow => sliding_eval(q, &mut state.clone(), now, cost).allowed,
        Algorithm::Concurrency => concurrency::evaluate(q, &mut state.clone(), now, cost).allowed,
    }
}

/// Spend `cost` units. Call only after [`evaluate`] admitted the request at the same `now`.
/// A concurrency slot names its holder and is taken with [`concurrency::take`] instead; here it
/// is left alone.
pub fn spend(q: &Quota, state: &mut Option<State>, now: u64, cost: u64) {
    match q.algorithm {
        Algorithm::Concurrency => {}
        Algorithm::TokenBucket | Algorithm::LeakyBucket => {
            let tat = match state {
                Some(State::Bucket { tat }) => *tat,
                _ => now,
            };
            let base = tat.max(now);
            *state = Some(State::Bucket {
                tat: base.saturating_add(cost.saturating_mul(q.interval_us.get())),
            });
        }
        Algorithm::FixedWindow => {
            let index = calendar::index(q, now);
            match state {
                Some(State::Window { index: i, count }) if *i == index => *count += cost,
                _ => *state = Some(State::Window { index, count: cost }),
            }
        }
        Algorithm::SlidingLog => match state {
            Some(State::Log { entries }) => {
                // `evaluate` at this `now` dropped the entries that left the window.
                entries.extend(std::iter::repeat_n(now, cost as usize))
            }
            _ => {
                *state = Some(State::Log {
                    entries: std::iter::repeat_n(now, cost as usize).collect(),
                })
            }
        },
        Algorithm::SlidingWindow => {
            roll_sliding(q, state, now);
            if let Some(State::Sliding { curr, .. }) = state {
                *curr += cost;
            }
        }
    }
}

/// When the memory store may forget this state: past this instant it is equivalent to none.
pub fn expires_at(q: &Quota, state: &State) -> u64 {
    let w = q.window_us.get();
    match state {
        State::Bucket { tat } => *tat,
        State::Window { index, .. } => calendar::start(q, index + 1),
        State::Log { entries } => entries.back().map_or(0, |t| t + w),
        State::Sliding { index, .. } => calendar::start(q, index + 2),
        State::Slots { held } => held.iter().map(|(_, e)| *e).max().unwrap_or(0),
    }
}

fn bucket_eval(q: &Quota, state: &Option<State>, now: u64, cost: u64) -> Outcome {
    let t = q.interval_us.get();
    let cap = q.limit.get().saturating_mul(t);
    let tat = match state {
        Some(State::Bucket { tat }) => *tat,
        _ => now,
    };
    let base = tat.max(now);
    let new_tat = base.saturating_add(cost.saturating_mul(t));
    if new_tat - now <= cap {
        Outcome {
            delay_us: if q.algorithm == Algorithm::LeakyBucket {
                base - now
            } else {
                0
            },
            ..Outcome::decided(now, true, (cap - (new_tat - now)) / t, new_tat - now, 0)
        }
    } else {
        Outcome::decided(
            now,
            false,
            (cap.saturating_sub(base - now)) / t,
            base - now,
            new_tat - cap - now,
        )
    }
}

fn fixed_eval(q: &Quota, state: &Option<State>, now: u64, cost: u64) -> Outcome {
    let limit = q.limit.get();
    let index = calendar::index(q, now);
    let count = match state {
        Some(State::Window { index: i, count }) if *i == index => *count,
        _ => 0,
    };
    let reset = calendar::start(q, index + 1) - now;
    if count + cost <= limit {
        Outcome::decided(now, true, limit - count - cost, reset, 0)
    } else {
        Outcome::decided(now, false, limit.saturating_sub(count), reset, reset)
    }
}

fn log_eval(q: &Quota, state: &Option<State>, now: u64, cost: u64) -> Outcome {
    let w = q.window_us.get();
    let limit = q.limit.get();
    // Entries at or before now - window have left (now - window, now] (`evaluate` drops them;
    // `admits` looks without dropping).
    let (count, skipped) = match state {
        Some(State::Log { entries }) => {
            let first = entries.partition_point(|t| *t <= now.saturating_sub(w));
            (entries.len() - first, first)
        }
        _ => (0, 0),
    };
    let nth = |k: usize| match state {
        Some(State::Log { entries }) => entries.get(skipped + k).copied(),
        _ => None,
    };
    let count = count as u64;
    let oldest = nth(0);
    if count + cost <= limit {
        Outcome::decided(now, true, limit - count - cost, oldest.unwrap_or(now) + w - now, 0)
    } else {
        // The (count + cost - limit)-th oldest entry must leave the window first.
        let k = (count + cost - limit) as usize;
        let tk = nth(k - 1).unwrap_or(now);
        Outcome::decided(
            now,
            false,
            limit.saturating_sub(count),
            oldest.unwrap_or(now) + w - now,
            tk + w - now,
        )
    }
}

fn roll_sliding(q: &Quota, state: &mut Option<State>, now: u64) {
    let index = calendar::index(q, now);
    let (prev, curr) = match state {
        Some(State::Sliding { index: i, prev, curr }) => {
            if *i == index {
                (*prev, *curr)
            } else if *i + 1 == index {
                (*curr, 0)
            } else {
                (0, 0)
            }
        }
        _ => (0, 0),
    };
    *state = Some(State::Sliding { index, prev, curr });
}

fn sliding_eval(q: &Quota, state: &mut Option<State>, now: u64, cost: u64) -> Outcome {
    roll_sliding(q, state, now);
    let (prev, curr) = match state {
        Some(State::Sliding { prev, curr, .. }) => (*prev, *curr),
        _ => (0, 0),
    };
    // This window [start, end), the next one ends at `next_end` (all equal lengths unless the
    // window follows the calendar).
    let index = calendar::index(q, now);
    let (start, end, next_end) = (
        calendar::start(q, index),
        calendar::start(q, index + 1),
        calendar::start(q, index + 2),
    );
    let w = end - start;
    let limit = q.limit.get();
    let elapsed = now - start;
    let (wf, pf, cf, lf, costf) = (w as f64, prev as f64, curr as f64, limit as f64, cost as f64);
    let estimate = pf * (wf - elapsed as f64) / wf + cf;
    if estimate + costf <= lf {
        let reset = if curr + cost > 0 { next_end - now } else { end - now };
        Outcome::decided(now, true, (lf - estimate - costf).floor().max(0.0) as u64, reset, 0)
    } else {
        let retry = if curr + cost <= limit {
            // Wait inside this window for the previous window's weight to decay.
            let e = (wf - (lf - cf - costf) * wf / pf).ceil();
            (e - elapsed as f64).max(1.0)
        } else {
            // Wait for the next window, where this window's count becomes `previous`.
            let nf = (next_end - end) as f64;
            let e = (nf - (lf - costf) * nf / cf).ceil().max(0.0);
            (wf - elapsed as f64) + e
        };
        let reset = if curr > 0 { next_end - now } else { end - now };
        Outcome::decided(now, false, (lf - estimate).floor().max(0.0) as u64, reset, retry as u64)
    }
}

pub mod calendar;
pub mod concurrency;
mod reshape;
pub use reshape::{debit, refund, seeded, used};

#[cfg(test)]
mod tests;
