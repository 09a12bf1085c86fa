//! The embedded memory store: the same algorithms as the Lua scripts, in Rust, on one node.
//!
//! # Concurrency
//! Counters live in [`SHARDS`] independently locked hash maps, so requests for different keys
//! rarely contend. A request with several limits locks each shard it needs, in ascending shard
//! order (so two requests can never deadlock), evaluates every limit, and spends only if all
//! admitted: all-or-nothing without refunds. The locks are `parking_lot` mutexes held for a few
//! hundred nanoseconds and never across an `.await` (the methods are `async` only to satisfy
//! [`Store`]; they never suspend).
//!
//! # Memory bound
//! Each shard holds at most `max_keys / SHARDS` keys. Expired state is swept when a shard fills;
//! if it is still full, the entry closest to its own expiry is evicted (forgetting it gives back
//! the least quota).

use std::collections::HashMap;
use std::hash::BuildHasher;

use parking_lot::{Mutex, MutexGuard};

use super::algorithm::{self, Outcome, State};
use super::{LimitCheck, Store, StoreError, StoreKey};
use crate::clock::SharedClock;

/// Number of independently locked shards.
pub const SHARDS: usize = 64;

/// One locked shard, tagged with its index.
type Guard<'a> = (usize, MutexGuard<'a, Shard>);

/// One shard's map. foldhash: several times cheaper than SipHash on our ~50-byte keys, and
/// randomly seeded per map (the keys are hex digests anyway, so callers cannot aim at buckets).
type Shard = HashMap<Box<str>, Entry, foldhash::fast::RandomState>;

/// One tracked limit.
#[derive(Debug)]
struct Entry {
    /// The algorithm state.
    state: Option<State>,
    /// Past this instant the state is equivalent to none and may be dropped.
    expires_at: u64,
}

/// The embedded store. See the module docs for its locking and memory bound.
pub struct MemoryStore {
    /// The shards, each a map from full store key to state.
    shards: Vec<Mutex<Shard>>,
    /// Keys one shard may hold.
    per_shard_cap: usize,
    /// Time source (a fake clock in tests).
    clock: SharedClock,
    /// Hashes keys to shards (seeded apart from the maps, so a shard's keys still spread
    /// over its map's buckets).
    hasher: foldhash::fast::RandomState,
}

impl MemoryStore {
    /// A store tracking at most about `max_keys` keys.
    pub fn new(clock: SharedClock, max_keys: usize) -> Self {
        MemoryStore {
            shards: (0..SHARDS).map(|_| Mutex::new(HashMap::default())).collect(),
            per_shard_cap: (max_keys / SHARDS).max(16),
            clock,
            hasher: Default::default(),
        }
    }

    /// Number of keys currently tracked (for tests and metrics).
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| s.lock().len()).sum()
    }

    /// True when no key is tracked.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn shard_of(&self, key: &str) -> usize {
        (self.hasher.hash_one(key) as usize) % SHARDS
    }

    /// Lock the shards `checks` touch, in ascending order (`shard[i]` is check `i`'s shard).
    fn lock_all(&self, shard: &[usize]) -> Vec<Guard<'_>> {
        let mut idx: Vec<usize> = shard.to_vec();
        idx.sort_unstable();
        idx.dedup();
        idx.into_iter().map(|i| (i, self.shards[i].lock())).collect()
    }

    /// The decision logic shared by `check`, at an explicit `now` (used by differential tests).
    pub fn check_at(&self, checks: &[LimitCheck], now: u64) -> Vec<Outcome> {
        let shard_of: Vec<usize> = checks.iter().map(|c| self.shard_of(c.key.as_str())).collect();
        let mut guards = self.lock_all(&shard_of);
        let mut outcomes = Vec::with_capacity(checks.len());
        let mut blocked = false;
        for (c, &shard) in checks.iter().zip(&shard_of) {
            let map = guard_for(&mut guards, shard);
            let o = match map.get_mut(c.key.as_str()) {
                Some(e) => algorithm::evaluate(&c.quota, &mut e.state, now, c.cost),
                None => algorithm::evaluate(&c.quota, &mut None, now, c.cost),
            };
            blocked |= !o.allowed && !c.shadow;
            outcomes.push(o);
        }
        if blocked {
            return outcomes;
        }
        for ((c, o), &shard) in checks.iter().zip(&outcomes).zip(&shard_of) {
            if !o.allowed {
                continue; // a denied shadow limit spends nothing
            }
            let cap = self.per_shard_cap;
            let map = guard_for(&mut guards, shard);
            if !map.contains_key(c.key.as_str()) && map.len() >= cap {
                make_room(map, now, cap);
            }
            let e = map.entry(Box::from(c.key.as_str())).or_insert(Entry {
                state: None,
                expires_at: 0,
            });
            algorithm::spend(&c.quota, &mut e.state, now, c.cost);
            if let Some(s) = &e.state {
                e.expires_at = algorithm::expires_at(&c.quota, s);
            }
        }
        outcomes
    }

    /// Give back `checks`' spending made at `now` (see [`Store::refund`]).
    pub fn refund_at(&self, checks: &[LimitCheck], _now: u64) {
        let shard_of: Vec<usize> = checks.iter().map(|c| self.shard_of(c.key.as_str())).collect();
        let mut guards = self.lock_all(&shard_of);
        for (c, &shard) in checks.iter().zip(&shard_of) {
            let map = guard_for(&mut guards, shard);
            if let Some(e) = map.get_mut(c.key.as_str()) {
                match &mut e.state {
                    Some(State::Bucket { tat }) => *tat = tat.saturating_sub(c.cost * c.quota.interval_us.get()),
                    Some(State::Window { count, .. }) => *count = count.saturating_sub(c.cost),
                    Some(State::Sliding { curr, .. }) => *curr = curr.saturating_sub(c.cost),
                    Some(State::Log { entries }) => {
                        for _ in 0..c.cost {
                            entries.pop_back();
                        }
                    }
                    None => {}
                }
            }
        }
    }
}

fn guard_for<'a, 'b>(guards: &'a mut [Guard<'b>], shard: usize) -> &'a mut Shard {
    // `guards` holds every shard the checks touch, so the search always finds it.
    let pos = guards.partition_point(|(i, _)| *i < shard);
    &mut guards[pos.min(guards.len() - 1)].1
}

/// Make room in a full shard: drop expired entries, then, if that freed less than an eighth of
/// the cap, the entries nearest their own expiry (forgetting those gives back the least
/// quota) until an eighth is free. Each sweep is O(n) but frees at least `cap / 8` slots, so
/// under key rotation the cost per new key stays O(1) amortised.
fn make_room(map: &mut Shard, now: u64, cap: usize) {
    map.retain(|_, e| e.expires_at > now);
    let target = cap - (cap / 8).max(1);
    if map.len() <= target {
        return;
    }
    let excess = map.len() - target;
    let mut expiries: Vec<u64> = map.values().map(|e| e.expires_at).collect();
    let (_, cutoff, _) = expiries.select_nth_unstable(excess - 1);
    let cutoff = *cutoff;
    let mut evicted = 0;
    map.retain(|_, e| {
        if evicted < excess && e.expires_at <= cutoff {
            evicted += 1;
            false
        } else {
            true
        }
    });
}

impl Store for MemoryStore {
    async fn check(&self, checks: &[LimitCheck]) -> Result<Vec<Outcome>, StoreError> {
        Ok(self.check_at(checks, self.clock.now_us()))
    }

    async fn refund(&self, checks: &[LimitCheck]) -> Result<(), StoreError> {
        self.refund_at(checks, self.clock.now_us());
        Ok(())
    }

    async fn peek(&self, checks: &[LimitCheck]) -> Result<Vec<Option<Outcome>>, StoreError> {
        let now = self.clock.now_us();
        Ok(checks
            .iter()
            .map(|c| {
                let mut shard = self.shards[self.shard_of(c.key.as_str())].lock();
                shard
                    .get_mut(c.key.as_str())
                    .map(|e| algorithm::evaluate(&c.quota, &mut e.state, now, 0))
            })
            .collect())
    }

    async fn reset(&self, keys: &[StoreKey]) -> Result<(), StoreError> {
        for k in keys {
            self.shards[self.shard_of(k.as_str())].lock().remove(k.as_str());
        }
        Ok(())
    }

    async fn probe(&self) -> Result<(), StoreError> {
        Ok(())
    }
}

#[cfg(test)]
mod tests;
