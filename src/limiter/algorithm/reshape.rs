//! What happens to a limit's state after its check: a refund, and the conversion a reload
//! that changes the limit's shape applies (the units still held, carried over). Mirrored by
//! each algorithm's `*_refund` and by `tg_used` in `lua/`.

use super::{calendar, roll_sliding, Algorithm, Quota, State};

/// Give back `cost` units that a check decided at `at` spent, in the window and bucket state
/// it spent them in: a window that has moved on since keeps what it has (the units no longer
/// count there anyway); a sliding window that moved on by one window takes them off its
/// previous count; a log loses its `cost` newest entries at or before `at`.
/// Mirrors each algorithm's `*_refund` in `lua/`.
pub fn refund(q: &Quota, state: &mut Option<State>, at: u64, cost: u64) {
    let spent_in = calendar::index(q, at);
    match state {
        Some(State::Bucket { tat }) => *tat = tat.saturating_sub(cost.saturating_mul(q.interval_us.get())),
        Some(State::Window { index, count }) if *index == spent_in => *count = count.saturating_sub(cost),
        Some(State::Sliding { index, prev, curr }) => {
            if *index == spent_in {
                *curr = curr.saturating_sub(cost);
            } else if *index == spent_in + 1 {
                *prev = prev.saturating_sub(cost);
            }
        }
        Some(State::Log { entries }) => {
            let end = entries.partition_point(|t| *t <= at);
            let start = end.saturating_sub(usize::try_from(cost).unwrap_or(usize::MAX));
            entries.drain(start..end);
        }
        // A slot names its holder: released with `concurrency::release`, not refunded.
        Some(State::Window { .. }) | Some(State::Slots { .. }) | None => {}
    }
}

/// Spend `cost` more units at `now`, without checking: the real cost of an admitted request,
/// learned after its response, was above what it reserved (`cost_from`). The debit lands in the
/// window of `now`: the window of the check while that one lasts, else the window the cost was
/// learned in, so it is never dropped (a window that moved on since the check takes it). A
/// bucket's `tat` moves on from `max(tat, now)`. A debit never takes a key more than one quota
/// below zero: a bucket's `tat` stays within twice its capacity of `now`, a window's count
/// (a sliding window's current count) within twice its limit; state already past that is left
/// as it is. A state of another shape must be converted first (as a check does). Mirrors
/// `*_debit` in `lua/`.
pub fn debit(q: &Quota, state: &mut Option<State>, now: u64, cost: u64) {
    let limit = q.limit.get();
    let ceiling = |count: u64| count.max(count.saturating_add(cost).min(limit.saturating_mul(2)));
    match q.algorithm {
        Algorithm::TokenBucket => {
            let t = q.interval_us.get();
            let tat = match state {
                Some(State::Bucket { tat }) => *tat,
                _ => now,
            };
            let floor = now.saturating_add(limit.saturating_mul(t).saturating_mul(2));
            let moved = tat.max(now).saturating_add(cost.saturating_mul(t)).min(floor);
            *state = Some(State::Bucket { tat: moved.max(tat) });
        }
        Algorithm::FixedWindow => {
            let index = calendar::index(q, now);
            let count = match state {
                Some(State::Window { index: i, count }) if *i == index => *count,
                _ => 0,
            };
            *state = Some(State::Window {
                index,
                count: ceiling(count),
            });
        }
        Algorithm::SlidingWindow => {
            roll_sliding(q, state, now);
            if let Some(State::Sliding { curr, .. }) = state {
                *curr = ceiling(*curr);
            }
        }
        // Sliding logs, leaky buckets and concurrency take no debits (validation refuses
        // `cost_from` on them).
        _ => {}
    }
}

/// Units that `state`, written under `old`, still holds at `now`, counted the way `new` would
/// count them and rounded up (conservative), at most `new`'s limit. A reload that changes a
/// limit's shape (see [`Quota::same_shape`]) carries this much consumption over, so it never
/// hands out a fresh quota. A log counts its entries inside `new`'s span (its window, or a
/// bucket's time to refill from empty). Mirrored by `tg_used` in `lua/common.lua`.
pub fn used(old: &Quota, state: &State, new: &Quota, now: u64) -> u64 {
    let units = match state {
        State::Bucket { tat } => tat.saturating_sub(now).div_ceil(old.interval_us.get()),
        State::Window { index, count } => {
            if *index == calendar::index(old, now) {
                *count
            } else {
                0
            }
        }
        State::Sliding { .. } => {
            let mut st = Some(state.clone());
            roll_sliding(old, &mut st, now);
            let (prev, curr) = match st {
                Some(State::Sliding { prev, curr, .. }) => (prev, curr),
                _ => (0, 0),
            };
            let i = calendar::index(old, now);
            let start = calendar::start(old, i);
            let w = calendar::start(old, i + 1) - start;
            let elapsed = now - start;
            let (wf, pf, cf) = (w as f64, prev as f64, curr as f64);
            let estimate = pf * (wf - elapsed as f64) / wf + cf;
            estimate.ceil().max(0.0) as u64
        }
        State::Log { entries } => {
            let floor = now.saturating_sub(new.window_us.get());
            (entries.len() - entries.partition_point(|t| *t <= floor)) as u64
        }
        // Requests in flight are not spent quota of a rate, nor the other way round: a reload
        // between a concurrency limit and a rate starts the new limit empty.
        State::Slots { .. } => 0,
    };
    if (old.algorithm == Algorithm::Concurrency) != (new.algorithm == Algorithm::Concurrency) {
        return 0;
    }
    units.min(new.limit.get())
}

/// A state of `q` holding `used` units spent at `now` (none for 0). With [`used`], the
/// conservative conversion of a limit's state across a reload.
pub fn seeded(q: &Quota, used: u64, now: u64) -> Option<State> {
    if used == 0 || q.algorithm == Algorithm::Concurrency {
        return None;
    }
    Some(match q.algorithm {
        Algorithm::TokenBucket | Algorithm::LeakyBucket => State::Bucket {
            tat: now + used * q.interval_us.get(),
        },
        Algorithm::FixedWindow => State::Window {
            index: calendar::index(q, now),
            count: used,
        },
        Algorithm::SlidingWindow => State::Sliding {
            index: calendar::index(q, now),
            prev: 0,
            curr: used,
        },
        Algorithm::SlidingLog => State::Log {
            entries: std::iter::repeat_n(now, usize::try_from(used).unwrap_or(0)).collect(),
        },
        Algorithm::Concurrency => return None,
    })
}
