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
//! if it is still full, the admitting entries closest to their own expiry are evicted
//! (forgetting one gives back the least quota). An entry that is **denying** (spent, or in its
//! penalty box) or holding a concurrency slot is never evicted: forgetting it would let its
//! caller straight back in, so a client could reset its own exhausted key by flooding the store
//! with fresh ones. When only such entries are left, a check that needs a new key is *refused*
//! ([`StoreError::Full`]) and the rule's failure policy decides (ARCHITECTURE.md, "Never
//! over-admit").

use smallvec::SmallVec;
use std::collections::HashMap;
use std::hash::BuildHasher;

use parking_lot::{Mutex, MutexGuard};

use prometheus_client::metrics::counter::Counter;

use super::algorithm::{self, concurrency, Outcome, Quota, State};
use super::{Checked, LimitCheck, Store, StoreError, StoreKey};
use crate::clock::SharedClock;

/// Number of independently locked shards.
pub const SHARDS: usize = 64;

/// One locked shard, tagged with its index.
type Guard<'a> = (usize, MutexGuard<'a, Shard>);

/// Checks per request handled without allocating shard lists.
const INLINE_CHECKS: usize = 4;

/// One shard's map. foldhash: several times cheaper than SipHash on our ~50-byte keys, and
/// randomly seeded per map (the keys are hex digests anyway, so callers cannot aim at buckets).
type Shard = HashMap<Box<str>, Entry, foldhash::fast::RandomState>;

/// One tracked limit.
#[derive(Debug)]
struct Entry {
    /// The algorithm state.
    state: Option<State>,
    /// The quota the state was last written under. A check under a quota of another shape (a
    /// reload changed the algorithm, window or rate) converts the state first.
    quota: Quota,
    /// Past this instant the state is equivalent to none and may be dropped.
    expires_at: u64,
    /// The penalty box: (until, length of the penalty being served), microseconds.
    penalty: Option<(u64, u64)>,
    /// When this entry was made: a refund of units spent before it (at the count a reset
    /// deleted or that expired) is dropped, so nothing spent in an old count reaches the new
    /// one (ARCHITECTURE.md, "A refund undoes exactly what its check spent").
    born: u64,
}

impl Entry {
    /// A new entry for `q` made at `now`, holding nothing.
    fn empty(q: Quota, now: u64) -> Self {
        Entry {
            state: None,
            quota: q,
            expires_at: 0,
            penalty: None,
            born: now,
        }
    }

    /// Recompute `expires_at` from the state under `q` and the penalty.
    fn refresh_expiry(&mut self, q: &Quota) {
        let state = self.state.as_ref().map_or(0, |s| algorithm::expires_at(q, s));
        self.expires_at = state.max(self.penalty.map_or(0, |(until, _)| until));
    }

    /// Time left in the penalty box at `now`, if the key is in it.
    fn penalized(&self, now: u64) -> Option<u64> {
        self.penalty.and_then(|(until, _)| (until > now).then(|| until - now))
    }

    /// True when forgetting this entry now can only give back quota its caller may use anyway:
    /// it admits a request and holds no concurrency slot. A denying entry (evicting it would
    /// let its caller in) or a held slot (evicting it would let more run at once) is not.
    fn evictable(&self, now: u64) -> bool {
        let holds_slot = matches!(&self.state, Some(State::Slots { held }) if held.iter().any(|(_, exp)| *exp > now));
        !holds_slot && self.penalized(now).is_none() && algorithm::admits(&self.quota, &self.state, now, 1)
    }

    /// Bring the state to `q`'s shape at `now` (see [`algorithm::used`]): the consumption it
    /// holds carries over, so a reload never mints quota.
    fn convert_to(&mut self, q: &Quota, now: u64) {
        if !self.quota.same_shape(q) {
            self.state = self
                .state
                .take()
                .and_then(|s| algorithm::seeded(q, algorithm::used(&self.quota, &s, q, now), now));
            self.refresh_expiry(q);
        }
        self.quota = *q;
    }
}

/// The embedded store. See the module docs for its locking and memory bound.
pub struct MemoryStore {
    /// The shards, each a map from full store key to state.
    shards: Vec<Mutex<Shard>>,
    /// Keys one shard may hold.
    per_shard_cap: usize,
    /// Time source (a fake clock in tests).
    clock: SharedClock,
    /// Live entries dropped to make room (not expired ones): `tollgate_memory_evictions_total
    /// {kind="live"}` once registered (see [`MemoryStore::with_eviction_counters`]).
    evicted: Counter,
    /// Checks refused because their key was new and the shard held only entries that may not
    /// be evicted (denying ones, held slots): `{kind="refused"}`.
    refused: Counter,
    /// Hashes keys to shards (seeded apart from the maps, so a shard's keys still spread
    /// over its map's buckets).
    hasher: foldhash::fast::RandomState,
    /// Small shared tables (the runtime overrides): table key → field → value. Read twice a
    /// second and written by the admin API; never touched by the request path.
    tables: Mutex<HashMap<String, std::collections::BTreeMap<String, String>>>,
}

impl MemoryStore {
    /// A store tracking at most about `max_keys` keys.
    pub fn new(clock: SharedClock, max_keys: usize) -> Self {
        MemoryStore {
            shards: (0..SHARDS).map(|_| Mutex::new(HashMap::default())).collect(),
            per_shard_cap: (max_keys / SHARDS).max(16),
            clock,
            evicted: Counter::default(),
            refused: Counter::default(),
            hasher: Default::default(),
            tables: Mutex::new(HashMap::new()),
        }
    }

    /// Count on these (registered) counters: live entries evicted, and checks refused for
    /// want of room.
    pub fn with_eviction_counters(mut self, live: Counter, refused: Counter) -> Self {
        self.evicted = live;
        self.refused = refused;
        self
    }

    /// Live entries evicted to make room so far, and checks refused for want of room.
    pub fn evictions(&self) -> (u64, u64) {
        (self.evicted.get(), self.refused.get())
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
    /// Inline for up to [`INLINE_CHECKS`] checks: a request's usual one to three limits cost no
    /// allocation.
    fn lock_all(&self, shard: &[usize]) -> SmallVec<[Guard<'_>; INLINE_CHECKS]> {
        let mut idx: SmallVec<[usize; INLINE_CHECKS]> = SmallVec::from_slice(shard);
        idx.sort_unstable();
        idx.dedup();
        idx.into_iter().map(|i| (i, self.shards[i].lock())).collect()
    }

    /// [`MemoryStore::decide_at`]'s outcomes alone (a refused check reads as denied for a
    /// second): for tests that never fill the store.
    pub fn check_at<C: AsRef<LimitCheck>>(&self, checks: &[C], now: u64) -> super::Outcomes {
        let mut checked = self.decide_at(checks, now);
        for (i, _) in checked.failed.drain(..) {
            checked.outcomes[i] = refused(now);
        }
        checked.outcomes
    }

    /// The decision logic shared by `check`, at an explicit `now` (used by differential tests).
    /// All or nothing: either every non-shadow check admits and each spends, or nothing is
    /// spent. A check whose key is new while its shard holds only entries that may not be
    /// evicted is refused (`failed`, [`StoreError::Full`]), and then nothing is spent either.
    pub fn decide_at<C: AsRef<LimitCheck>>(&self, checks: &[C], now: u64) -> Checked {
        let shard_of: SmallVec<[usize; INLINE_CHECKS]> =
            checks.iter().map(|c| self.shard_of(c.as_ref().key.as_str())).collect();
        let mut guards = self.lock_all(&shard_of);
        let mut outcomes = super::Outcomes::with_capacity(checks.len());
        for (c, &shard) in checks.iter().map(AsRef::as_ref).zip(&shard_of) {
            let map = guard_for(&mut guards, shard);
            let o = match map.get_mut(c.key.as_str()) {
                Some(e) => {
                    e.convert_to(&c.quota, now);
                    match e.penalized(now).filter(|_| c.penalty.is_some()) {
                        Some(left) => penalized(now, left),
                        None => algorithm::evaluate(&c.quota, &mut e.state, now, c.cost),
                    }
                }
                None => algorithm::evaluate(&c.quota, &mut None, now, c.cost),
            };
            outcomes.push(o);
        }
        // Penalties are written whatever the request's fate: a denial starts one, a request
        // that reaches the store during one escalates it (doubling, up to `max`).
        for ((c, o), &shard) in checks.iter().map(AsRef::as_ref).zip(outcomes.iter_mut()).zip(&shard_of) {
            if let (Some(p), false) = (c.penalty, o.allowed) {
                let map = guard_for(&mut guards, shard);
                let Some(e) = entry_for(map, c, now) else { continue };
                let len = match e.penalty {
                    Some((_, len)) if o.penalty_us > 0 && p.escalates() => p.escalated(len),
                    Some(_) if o.penalty_us > 0 => continue,
                    _ => p.base_us.get(),
                };
                e.penalty = Some((now.saturating_add(len), len));
                e.refresh_expiry(&c.quota);
                o.retry_after_us = o.retry_after_us.max(len);
                o.reset_us = o.reset_us.max(len);
                o.penalty_us = o.retry_after_us;
                o.penalty_started = true;
            }
        }
        let blocked = checks
            .iter()
            .zip(&outcomes)
            .any(|(c, o)| !o.allowed && !c.as_ref().shadow);
        if blocked {
            return Checked {
                outcomes,
                failed: Vec::new(),
            };
        }
        // Room for every new key first, so a refusal spends nothing anywhere.
        let cap = self.per_shard_cap;
        let mut failed = Vec::new();
        for (i, ((c, o), &shard)) in checks
            .iter()
            .map(AsRef::as_ref)
            .zip(&outcomes)
            .zip(&shard_of)
            .enumerate()
        {
            let map = guard_for(&mut guards, shard);
            if o.allowed && !map.contains_key(c.key.as_str()) && map.len() >= cap {
                self.evicted.inc_by(make_room(map, now, cap));
                if map.len() >= cap {
                    self.refused.inc();
                    failed.push((i, StoreError::Full));
                }
            }
        }
        if !failed.is_empty() {
            return Checked { outcomes, failed };
        }
        for ((c, o), &shard) in checks.iter().map(AsRef::as_ref).zip(&outcomes).zip(&shard_of) {
            if !o.allowed {
                continue; // a denied shadow limit spends nothing
            }
            let map = guard_for(&mut guards, shard);
            let Some(e) = entry_for(map, c, now) else { continue };
            if c.is_slot() {
                if c.cost > 0 {
                    concurrency::take(&c.quota, &mut e.state, c.holder, now);
                }
            } else {
                algorithm::spend(&c.quota, &mut e.state, now, c.cost);
            }
            e.refresh_expiry(&c.quota);
        }
        Checked {
            outcomes,
            failed: Vec::new(),
        }
    }

    /// Give back what admitted checks spent, each in the window it was decided in
    /// (`Outcome::at_us`; see [`algorithm::refund`]). A key whose shape changed since (a reload
    /// converted it) keeps the units: under-admission, never over-admission.
    pub fn refund_spent(&self, spent: &[(LimitCheck, u64)]) {
        let shard_of: Vec<usize> = spent.iter().map(|(c, _)| self.shard_of(c.key.as_str())).collect();
        let mut guards = self.lock_all(&shard_of);
        for ((c, at), &shard) in spent.iter().zip(&shard_of) {
            let map = guard_for(&mut guards, shard);
            if let Some(e) = map.get_mut(c.key.as_str()) {
                if c.is_slot() {
                    concurrency::release(&mut e.state, c.holder);
                } else if e.quota.same_shape(&c.quota) && *at >= e.born {
                    algorithm::refund(&c.quota, &mut e.state, *at, c.cost);
                }
            }
        }
    }

    /// Spend `c.cost` more on each check of `debits`, without checking, now (this store's
    /// clock): the real cost of an admitted request was above its estimate (see
    /// [`algorithm::debit`] for where it lands and how far below zero it may take a key).
    pub fn debit_spent(&self, debits: &[LimitCheck]) {
        self.debit_at(debits, self.clock.now_us());
    }

    /// [`MemoryStore::debit_spent`] at an explicit `now` (used by differential tests). A key of
    /// another shape is converted first, as a check would.
    pub fn debit_at(&self, debits: &[LimitCheck], now: u64) {
        for c in debits {
            let mut shard = self.shards[self.shard_of(c.key.as_str())].lock();
            let e = shard
                .entry(Box::from(c.key.as_str()))
                .or_insert_with(|| Entry::empty(c.quota, now));
            e.convert_to(&c.quota, now);
            algorithm::debit(&c.quota, &mut e.state, now, c.cost);
            e.refresh_expiry(&c.quota);
        }
    }

    /// Lift the penalty box of each key, keeping its state (a reset of a concurrency key: its
    /// slots are current usage, released by their holders, and survive).
    pub fn lift_penalties(&self, keys: &[StoreKey]) {
        for k in keys {
            if let Some(e) = self.shards[self.shard_of(k.as_str())].lock().get_mut(k.as_str()) {
                e.penalty = None;
                let q = e.quota;
                e.refresh_expiry(&q);
            }
        }
    }

    /// Push the slots of `held` (concurrency checks of requests still running) out to a full
    /// time to live from now; how many were no longer held (they had expired).
    pub fn renew_slots(&self, held: &[LimitCheck]) -> usize {
        let now = self.clock.now_us();
        let mut lost = 0;
        for c in held.iter().filter(|c| c.is_slot()) {
            let mut shard = self.shards[self.shard_of(c.key.as_str())].lock();
            let renewed = match shard.get_mut(c.key.as_str()) {
                Some(e) => {
                    let ok = concurrency::renew(&c.quota, &mut e.state, c.holder, now);
                    e.refresh_expiry(&c.quota);
                    ok
                }
                None => false,
            };
            lost += usize::from(!renewed);
        }
        lost
    }
}

/// The outcome of a check whose key is in its penalty box for `left` more microseconds.
fn penalized(now: u64, left: u64) -> Outcome {
    Outcome {
        allowed: false,
        reset_us: left,
        retry_after_us: left,
        penalty_us: left,
        at_us: now,
        ..Outcome::default()
    }
}

/// What [`MemoryStore::check_at`] reports for a refused check: denied, retry in a second.
fn refused(now: u64) -> Outcome {
    Outcome {
        allowed: false,
        reset_us: 1_000_000,
        retry_after_us: 1_000_000,
        at_us: now,
        ..Outcome::default()
    }
}

/// `c`'s entry in `map`, made empty if it has none; the key is copied only then (`entry`
/// wants an owned key, which would allocate on every hit, and the hit is what every request
/// of a known caller takes). Always `Some`: the `Option` only spares a panic path.
fn entry_for<'a>(map: &'a mut Shard, c: &LimitCheck, now: u64) -> Option<&'a mut Entry> {
    if map.contains_key(c.key.as_str()) {
        map.get_mut(c.key.as_str())
    } else {
        Some(
            map.entry(Box::from(c.key.as_str()))
                .or_insert_with(|| Entry::empty(c.quota, now)),
        )
    }
}

fn guard_for<'a, 'b>(guards: &'a mut [Guard<'b>], shard: usize) -> &'a mut Shard {
    // `guards` holds every shard the checks touch, so the search always finds it.
    let pos = guards.partition_point(|(i, _)| *i < shard);
    &mut guards[pos.min(guards.len() - 1)].1
}

/// Make room in a full shard: drop expired entries, then, if that freed less than an eighth of
/// the cap, entries that would admit a request now and hold no slot, nearest their own expiry
/// first (forgetting those gives back the least quota), until an eighth is free or none is
/// left. A denying entry or a held slot is never dropped (see the module docs). Each sweep is
/// O(n) but frees up to `cap / 8` slots, so under key rotation the cost per new key stays O(1)
/// amortised. Returns the live entries evicted.
fn make_room(map: &mut Shard, now: u64, cap: usize) -> u64 {
    map.retain(|_, e| e.expires_at > now);
    let target = cap - (cap / 8).max(1);
    if map.len() <= target {
        return 0;
    }
    let excess = map.len() - target;
    let mut expiries: Vec<u64> = map
        .values()
        .filter(|e| e.evictable(now))
        .map(|e| e.expires_at)
        .collect();
    if expiries.is_empty() {
        return 0;
    }
    let n = excess.min(expiries.len());
    let (_, cutoff, _) = expiries.select_nth_unstable(n - 1);
    let cutoff = *cutoff;
    let mut evicted = 0;
    map.retain(|_, e| {
        if evicted < n && e.expires_at <= cutoff && e.evictable(now) {
            evicted += 1;
            false
        } else {
            true
        }
    });
    evicted as u64
}

impl Store for MemoryStore {
    async fn check<C: AsRef<LimitCheck> + Sync>(&self, checks: &[C]) -> Checked {
        self.decide_at(checks, self.clock.now_us())
    }

    async fn refund(&self, spent: &[(LimitCheck, u64)]) -> Result<(), StoreError> {
        self.refund_spent(spent);
        Ok(())
    }

    async fn peek(&self, checks: &[LimitCheck]) -> Result<Vec<Option<Outcome>>, StoreError> {
        let now = self.clock.now_us();
        Ok(checks
            .iter()
            .map(|c| {
                let shard = self.shards[self.shard_of(c.key.as_str())].lock();
                shard.get(c.key.as_str()).map(|e| {
                    if let Some(left) = e.penalized(now).filter(|_| c.penalty.is_some()) {
                        return penalized(now, left);
                    }
                    let mut state = if e.quota.same_shape(&c.quota) {
                        e.state.clone()
                    } else {
                        e.state
                            .as_ref()
                            .and_then(|s| algorithm::seeded(&c.quota, algorithm::used(&e.quota, s, &c.quota, now), now))
                    };
                    algorithm::evaluate(&c.quota, &mut state, now, 0)
                })
            })
            .collect())
    }

    async fn renew(&self, held: &[LimitCheck]) -> Result<(), StoreError> {
        self.renew_slots(held);
        Ok(())
    }

    async fn debit(&self, debits: &[LimitCheck]) -> Result<(), StoreError> {
        self.debit_spent(debits);
        Ok(())
    }

    async fn table_load(&self, key: &str) -> Result<Vec<(String, String)>, StoreError> {
        Ok(self
            .tables
            .lock()
            .get(key)
            .map(|t| t.iter().map(|(f, v)| (f.clone(), v.clone())).collect())
            .unwrap_or_default())
    }

    async fn table_set(&self, key: &str, field: &str, value: Option<&str>) -> Result<(), StoreError> {
        let mut tables = self.tables.lock();
        let t = tables.entry(key.to_owned()).or_default();
        match value {
            Some(v) => t.insert(field.to_owned(), v.to_owned()),
            None => t.remove(field),
        };
        Ok(())
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
