//! The deny cache: a denial says when the same key can next pass; until then this node answers
//! 429 itself, without a store round trip, so a client in a tight loop costs the store nothing.
//!
//! Entries are keyed by a 64-bit hash of the store key (no secret is kept) and hold the
//! instant the key can pass again (what the store said: a hit answers with the same
//! `Retry-After`) and the instant the store is asked again (at most a second later, see
//! `DENY_CACHE_MAX_US`), tagged with the *effective limit* that denied (quota and
//! cost, overrides included): callers sharing one counter under different limits (an org key
//! with a per-identity override) never get each other's denial. One entry per key; a hit
//! needs the same effective limit. The cache is sharded like the memory store and bounded:
//! a full shard first drops expired entries, then refuses new ones (a missed cache entry only
//! costs a store round trip, never a wrong answer).
//!
//! **One refresh at a time.** When an entry's recheck instant passes while the store's wait
//! has not, the first request to see it ([`Lookup::Refresh`]) asks the store; until it has
//! its answer (at most `grace`), the others are still answered from the entry. Without this,
//! every request arriving during that round trip asked too, and a flooded key cost the store
//! about two calls a second instead of one. The price is that those requests are denied for
//! the length of one store round trip even if the refresh finds the key can pass.

use std::collections::HashMap;
use std::hash::BuildHasher;

use parking_lot::Mutex;

use super::{LimitCheck, StoreKey};

const SHARDS: usize = 16;

/// One remembered denial.
#[derive(Debug, Clone, Copy)]
struct Entry {
    /// Hash of the effective limit that denied.
    limit: u64,
    /// Until this instant (µs since the epoch) the cache answers; then the store is asked.
    recheck_at: u64,
    /// The instant the store said the key can pass again (≥ `recheck_at`).
    pass_at: u64,
    /// The instant of the request whose store answer this is: a request that began earlier
    /// but looks later is told `pass_at - since` at most, never more than the store said.
    since: u64,
    /// True once a request was sent to the store to refresh this entry (`recheck_at` then
    /// marks the end of that request's grace).
    refreshing: bool,
}

/// What the cache says of one check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lookup {
    /// Denied: the instant the store said the key can pass.
    Hit(u64),
    /// Nothing cached under this limit, or the key can pass by now: ask the store.
    Miss,
    /// This caller refreshes the entry: ask the store, then [`DenyCache::insert`] the new
    /// denial or [`DenyCache::remove`] the key. The others are answered from the entry
    /// meanwhile.
    Refresh,
}

/// One shard: key hash → the denial remembered for it.
type Shard = HashMap<u64, Entry, foldhash::fast::RandomState>;

/// Locally remembered denials. Correct under any interleaving: an entry only ever says "denied
/// until T", which the store itself said, and the state it describes can only be reset by
/// [`DenyCache::remove`] / [`DenyCache::clear`] (admin reset, rule reload).
pub struct DenyCache {
    /// key hash → the denial remembered for it, under the effective limit that denied.
    shards: Vec<Mutex<Shard>>,
    /// Entries one shard may hold.
    per_shard_cap: usize,
    /// Hashes store keys.
    hasher: foldhash::fast::RandomState,
}

impl DenyCache {
    /// A cache of at most about `max_entries` denials.
    pub fn new(max_entries: usize) -> Self {
        DenyCache {
            shards: (0..SHARDS).map(|_| Mutex::new(HashMap::default())).collect(),
            per_shard_cap: (max_entries / SHARDS).max(16),
            hasher: Default::default(),
        }
    }

    fn slot(&self, key: &StoreKey) -> (usize, u64) {
        let v = self.hasher.hash_one(key.as_str());
        ((v as usize) % SHARDS, v)
    }

    /// The effective limit of a check: what a cached denial must match.
    fn limit_of(&self, c: &LimitCheck) -> u64 {
        self.hasher.hash_one((c.quota, c.cost))
    }

    /// Whether `c`'s denial under `c`'s effective limit is answered from the cache at `now`.
    /// Once the entry is due for a recheck, one caller gets [`Lookup::Refresh`] and the others
    /// keep getting hits for at most `grace` µs (the longest a store call may take); a caller
    /// that never reports back only holds the entry that long.
    pub fn get(&self, c: &LimitCheck, now: u64, grace: u64) -> Lookup {
        let (s, h) = self.slot(&c.key);
        let mut shard = self.shards[s].lock();
        match shard.get_mut(&h) {
            Some(e) if e.limit == self.limit_of(c) => {
                if e.recheck_at > now {
                    Lookup::Hit(e.pass_at)
                } else if e.pass_at > now {
                    e.refreshing = true;
                    e.recheck_at = now.saturating_add(grace).min(e.pass_at);
                    Lookup::Refresh
                } else {
                    Lookup::Miss
                }
            }
            _ => Lookup::Miss,
        }
    }

    /// How long until the store said `c` can pass (µs), if a denial under `c`'s effective
    /// limit is answered from the cache at `now` (as [`DenyCache::get`]'s [`Lookup::Hit`],
    /// marking no refresh): a request with several limits looks at all of them first, so it is
    /// told the longest wait of the whole request, not the first one found. Never more than the
    /// store's own wait: a request whose `now` was read before the denial was stored counts
    /// from the denial's instant.
    pub fn peek(&self, c: &LimitCheck, now: u64) -> Option<u64> {
        let (s, h) = self.slot(&c.key);
        let shard = self.shards[s].lock();
        shard
            .get(&h)
            .filter(|e| e.limit == self.limit_of(c) && e.recheck_at > now)
            .map(|e| e.pass_at.saturating_sub(now.max(e.since)))
    }

    /// Remember that `c` (its key under its effective limit) is denied until `pass_at`, as the
    /// store said to a request at `since`; the cache answers for it until `recheck_at` (at most
    /// `pass_at`).
    pub fn insert(&self, c: &LimitCheck, since: u64, recheck_at: u64, pass_at: u64) {
        let until = recheck_at.min(pass_at);
        let limit = self.limit_of(c);
        let (s, h) = self.slot(&c.key);
        let mut shard = self.shards[s].lock();
        if shard.len() >= self.per_shard_cap && !shard.contains_key(&h) {
            // Full: drop expired denials, and if that frees less than an eighth, the ones that
            // expire soonest (a forgotten denial only costs one store round trip). O(n) per
            // sweep, at most one sweep per cap/8 inserts.
            let now = crate::clock::Clock::now_us(&crate::clock::SystemClock);
            shard.retain(|_, e| e.recheck_at > now.min(until));
            let target = self.per_shard_cap - (self.per_shard_cap / 8).max(1);
            if shard.len() > target {
                let excess = shard.len() - target;
                let mut untils: Vec<u64> = shard.values().map(|e| e.recheck_at).collect();
                let cutoff = *untils.select_nth_unstable(excess - 1).1;
                let mut evicted = 0;
                shard.retain(|_, e| {
                    if evicted < excess && e.recheck_at <= cutoff {
                        evicted += 1;
                        false
                    } else {
                        true
                    }
                });
            }
        }
        shard.insert(
            h,
            Entry {
                limit,
                recheck_at: until,
                pass_at: pass_at.max(until),
                since: since.min(until),
                refreshing: false,
            },
        );
    }

    /// Forget `key`'s denial.
    pub fn remove(&self, key: &StoreKey) {
        let (s, h) = self.slot(key);
        self.shards[s].lock().remove(&h);
    }

    /// The refresh of `key` ended without a new denial (the store admitted it, or failed):
    /// forget the entry if it is still the one being refreshed, so the next requests ask the
    /// store themselves.
    pub fn refreshed(&self, key: &StoreKey) {
        let (s, h) = self.slot(key);
        let mut shard = self.shards[s].lock();
        if shard.get(&h).is_some_and(|e| e.refreshing) {
            shard.remove(&h);
        }
    }

    /// Forget every denial (the rules changed).
    pub fn clear(&self) {
        for s in &self.shards {
            s.lock().clear();
        }
    }

    /// Number of remembered denials.
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| s.lock().len()).sum()
    }

    /// True when nothing is remembered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests;
