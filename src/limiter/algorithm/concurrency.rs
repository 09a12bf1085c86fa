//! Concurrency slots: at most `limit` requests of a key in flight at once, across the fleet.
//!
//! A slot is an entry (holder id, expiry). A request takes one when it is admitted, renews it
//! while it runs (so a long download keeps its slot) and releases it when its response ends.
//! A slot whose holder stopped renewing (its node crashed) expires by itself. Mirrored by
//! `lua/concurrency.lua`. The quota's window is the slot's time to live.

use super::{Outcome, Quota, State};

/// What a concurrency denial asks the client to wait: slots free up when requests end, which
/// no one can predict, so one second (`Retry-After: 1`).
pub const RETRY_US: u64 = 1_000_000;

/// Drop the slots that expired at or before `now`.
fn prune(state: &mut Option<State>, now: u64) {
    if let Some(State::Slots { held }) = state {
        held.retain(|(_, exp)| *exp > now);
        if held.is_empty() {
            *state = None;
        }
    }
}

/// Would `cost` more slots (1 for a request, 0 for a look) fit `q` at `now`? Expired slots go
/// first. `remaining` is the slots still free after this request; a denial asks for
/// [`RETRY_US`].
pub fn evaluate(q: &Quota, state: &mut Option<State>, now: u64, cost: u64) -> Outcome {
    prune(state, now);
    let in_flight = match state {
        Some(State::Slots { held }) => held.len() as u64,
        _ => 0,
    };
    let limit = q.limit.get();
    if in_flight + cost <= limit {
        Outcome {
            allowed: true,
            remaining: limit - in_flight - cost,
            at_us: now,
            ..Outcome::default()
        }
    } else {
        Outcome {
            allowed: false,
            remaining: limit.saturating_sub(in_flight),
            reset_us: RETRY_US,
            retry_after_us: RETRY_US,
            at_us: now,
            ..Outcome::default()
        }
    }
}

/// Take a slot for `holder` until `now + q.window`. Call only after [`evaluate`] admitted it
/// at the same `now`. A holder that already has a slot keeps one (renewed).
pub fn take(q: &Quota, state: &mut Option<State>, holder: u64, now: u64) {
    let exp = now.saturating_add(q.window_us.get());
    match state {
        Some(State::Slots { held }) => match held.iter_mut().find(|(h, _)| *h == holder) {
            Some(slot) => slot.1 = exp,
            None => held.push((holder, exp)),
        },
        _ => {
            *state = Some(State::Slots {
                held: vec![(holder, exp)],
            })
        }
    }
}

/// Push `holder`'s slot out to `now + q.window`; false when it has none any more (it expired).
pub fn renew(q: &Quota, state: &mut Option<State>, holder: u64, now: u64) -> bool {
    match state {
        Some(State::Slots { held }) => match held.iter_mut().find(|(h, e)| *h == holder && *e > now) {
            Some(slot) => {
                slot.1 = now.saturating_add(q.window_us.get());
                true
            }
            None => false,
        },
        _ => false,
    }
}

/// Free `holder`'s slot (nothing when it has none).
pub fn release(state: &mut Option<State>, holder: u64) {
    if let Some(State::Slots { held }) = state {
        held.retain(|(h, _)| *h != holder);
        if held.is_empty() {
            *state = None;
        }
    }
}
