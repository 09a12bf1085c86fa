//! Leases: hot keys decided on this node without a Redis call per request.
//!
//! A lease is quota that Redis has already **spent** on this node's behalf. The check that
//! takes it spends the request's own cost plus the lease in one script call, so no other node
//! can spend those units; this node then admits from the lease locally and gives back what it
//! did not use when the lease ends (expiry, reload, shutdown). The fleet therefore never admits
//! more than the limit; the price is under-admission, at most the unused part of each node's
//! live lease.
//!
//! Why each algorithm stays exact:
//! - **Fixed and sliding window**: the lease's units are counted in the window of the call that
//!   took them, and the lease ends no later than that window (measured from when the call was
//!   *sent*, so never after Redis's window ends). Units used inside the window they were counted
//!   in are exactly what a per-request call would have counted.
//! - **Token bucket**: a unit spent early and used later would let the bucket refill meanwhile
//!   (Redis sees the units gone; the bucket's clamp at capacity no longer wastes that refill), so
//!   the script accounts the lease as spent at its expiry, the latest instant it can be used:
//!   the bucket's `tat` becomes `max(tat, now + life) + units × interval`, `life` being the
//!   lease's life in µs ([`LeaseAsk::life_us`]). That is refill spent as *time*, exactly what the
//!   clamp could have wasted and nothing when the bucket was not full: never a whole unit
//!   rounded up per lease, which with slow refill (1/h) cost a unit of capacity per lease. The
//!   lease is granted only when it fits at the instant it is taken. A return gives back only the
//!   unused units, never the life.
//!
//! Sliding log, leaky bucket and concurrency never take leases: their exactness rests on
//! per-request timestamps, spacing or holders. Nor do shadow limits, limits with a penalty box
//! (a penalty must reach every node at once) and rules that settle after the response.
//!
//! # Time
//! Every instant the tables take (`now_us`, `sent_us`) is this node's **monotonic** clock
//! ([`crate::clock::Clock::mono_us`]): a lease's life and a key's heat are local durations, and
//! the wall clock may step (back, which would stretch a lease past its window, or forward).
//! Only `at_us`, the store's instant a lease was spent at, is wall time, and it comes from the
//! store.
//!
//! # Concurrency
//! Both tables are behind `parking_lot` mutexes held only to read or update a few integers,
//! never across an `.await`: the heat table is striped (one mutex per slot) so concurrent
//! requests for different keys never meet; the lease table has one mutex, taken once per
//! request that has leasable limits.

use std::collections::HashMap;
use std::hash::BuildHasher;
use std::num::{NonZeroU32, NonZeroU64};

use std::sync::Arc;

use parking_lot::Mutex;
use prometheus_client::metrics::counter::Counter;
use tokio::sync::Notify;

use super::algorithm::{calendar, Algorithm, Outcome, Quota};
use super::{LimitCheck, PolicedCheck, StoreKey};

/// `store.leases`, validated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseConfig {
    /// A key this node sees less often than this many times a second never gets a lease.
    pub min_rate: NonZeroU32,
    /// Longest life of a lease, microseconds.
    pub ttl_us: NonZeroU64,
    /// Most of a limit one lease may hold, in millionths (0.1 is 100,000).
    pub max_share_ppm: NonZeroU32,
}

impl Default for LeaseConfig {
    fn default() -> Self {
        LeaseConfig {
            min_rate: NonZeroU32::new(50).unwrap_or(NonZeroU32::MIN),
            ttl_us: NonZeroU64::new(250_000).unwrap_or(NonZeroU64::MIN),
            max_share_ppm: NonZeroU32::new(100_000).unwrap_or(NonZeroU32::MIN),
        }
    }
}

/// What a check asks the script to lease along with the request: up to `want` more units,
/// capped by the script at half of what remains after the request and at what fits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LeaseAsk {
    /// Units wanted for this node's lease (≥ 1).
    pub want: u64,
    /// Token bucket: the lease's longest life in µs; the script counts its units as spent at
    /// its end (see the module docs). 0 for windows, whose leases end with their window.
    pub life_us: u64,
}

/// True when limits of this algorithm may be leased.
pub fn algorithm_leases(a: Algorithm) -> bool {
    matches!(
        a,
        Algorithm::TokenBucket | Algorithm::FixedWindow | Algorithm::SlidingWindow
    )
}

/// Counters the leases keep (resolved once, at start-up).
#[derive(Debug, Clone, Default)]
pub struct LeaseMetrics {
    /// Leases granted by the store.
    pub taken: Counter,
    /// Leases given back (expired, replaced, reloaded, shut down).
    pub returned: Counter,
    /// Units given back unused.
    pub unused: Counter,
    /// Requests decided on this node from its leases.
    pub local: Counter,
}

/// One live lease of this node.
#[derive(Debug, Clone)]
struct Lease {
    /// The limit it was taken for; a request with another quota (a reload, an override) does
    /// not use it.
    quota: Quota,
    /// The store's clock when it was taken: a return gives the units back in that window.
    at_us: u64,
    /// Units not used yet.
    left: u64,
    /// Units granted.
    granted: u64,
    /// This node's monotonic clock when the lease ends (from when the taking call was sent).
    expires_us: u64,
    /// This node's monotonic clock when the taking call was sent.
    since_us: u64,
    /// `remaining` the store reported when the lease was taken (an estimate afterwards).
    remaining: u64,
    /// `reset_us` the store reported when the lease was taken.
    reset_us: u64,
}

impl Lease {
    /// True while the lease may decide requests: from when its call was sent until it expires
    /// (`now_us` on the monotonic clock, so a wall clock step changes nothing).
    fn live_at(&self, now_us: u64) -> bool {
        self.since_us <= now_us && now_us < self.expires_us
    }
}

/// Heat of one key: requests this node saw in the current and the previous second.
#[derive(Debug, Clone, Copy, Default)]
struct Heat {
    /// Hash of the key counted here (0: empty).
    tag: u64,
    /// The second `cur` counts.
    sec: u64,
    /// Requests in second `sec`.
    cur: u32,
    /// Requests in second `sec - 1`.
    prev: u32,
}

/// Number of heat slots. Keys that share a slot compete for it; a hot key keeps its slot
/// against cold ones (a slot changes hands only when its key saw fewer than 2 requests in two
/// seconds), so 100,000 rotating cold keys cost one slot update each and never get a lease.
const HEAT_SLOTS: usize = 8192;

/// A unit to give back to the store: the limit (its `cost` the units) and the store instant
/// the units were spent at.
pub type Return = (LimitCheck, u64);

/// This node's leases and the heat of its keys. See the module docs.
pub struct Leases {
    /// The configuration.
    cfg: LeaseConfig,
    /// Requests seen per key, by hash slot (striped: one mutex per slot).
    heat: Box<[Mutex<Heat>]>,
    /// Live leases by limit key.
    live: Mutex<HashMap<StoreKey, Lease, foldhash::fast::FixedState>>,
    /// Keys whose lease is being asked for right now, with what wakes the requests waiting for
    /// it. One ask per key at a time: without this, every request that arrives while the ask
    /// is in flight would ask too, and each grant would replace (and return) the one before.
    asking: Mutex<HashMap<StoreKey, Arc<Notify>, foldhash::fast::FixedState>>,
    /// Hasher for the heat slots.
    hasher: foldhash::fast::FixedState,
    /// Counters.
    metrics: LeaseMetrics,
}

impl std::fmt::Debug for Leases {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Leases")
            .field("cfg", &self.cfg)
            .field("live", &self.live.lock().len())
            .finish()
    }
}

/// What [`Leases::prepare`] found for a request about to go to the store.
pub struct Prepared<'a> {
    /// Units of leases this request cannot use, to give back before its check.
    pub back: Vec<Return>,
    /// Per check: the lease to ask for in the same call.
    pub asks: Vec<Option<LeaseAsk>>,
    /// Another request is asking for a lease of this key: wait for it ([`Leases::wait`]), then
    /// try [`Leases::decide`] again.
    pub wait: Option<(StoreKey, Arc<Notify>)>,
    /// The asks this request owns; they end (and wake the waiters) when it is dropped, however
    /// the request ends.
    pub asking: Asking<'a>,
}

/// The keys one request is asking leases for. Dropping it ends the asks and wakes the requests
/// waiting for them, so a request that fails, times out or is dropped never leaves a key
/// waiting.
pub struct Asking<'a> {
    /// The tables.
    leases: &'a Leases,
    /// Keys this request asks for.
    keys: Vec<StoreKey>,
}

impl Asking<'_> {
    /// End the asks now.
    pub fn done(&mut self) {
        if self.keys.is_empty() {
            return;
        }
        let mut asking = self.leases.asking.lock();
        for k in self.keys.drain(..) {
            if let Some(n) = asking.remove(&k) {
                n.notify_waiters();
            }
        }
    }
}

impl Drop for Asking<'_> {
    fn drop(&mut self) {
        self.done();
    }
}

impl Leases {
    /// Empty tables with `cfg`, counting into `metrics`.
    pub fn new(cfg: LeaseConfig, metrics: LeaseMetrics) -> Self {
        Leases {
            cfg,
            heat: (0..HEAT_SLOTS).map(|_| Mutex::new(Heat::default())).collect(),
            live: Mutex::new(HashMap::with_hasher(foldhash::fast::FixedState::default())),
            asking: Mutex::new(HashMap::with_hasher(foldhash::fast::FixedState::default())),
            hasher: foldhash::fast::FixedState::with_seed(0x7011_6a7e),
            metrics,
        }
    }

    /// The configuration.
    pub fn config(&self) -> LeaseConfig {
        self.cfg
    }

    /// Count one request for `key` at `now_us`; the key's rate as requests in the last full
    /// second (or this one, when already higher).
    fn note(&self, key: &StoreKey, now_us: u64) -> u32 {
        let tag = self.tag(key);
        let sec = now_us / 1_000_000;
        let Some(slot) = self.heat.get((tag as usize) % HEAT_SLOTS) else {
            return 0;
        };
        let mut s = slot.lock();
        // Roll the slot forward to this second.
        if s.sec != sec {
            s.prev = if s.sec + 1 == sec { s.cur } else { 0 };
            s.cur = 0;
            s.sec = sec;
        }
        if s.tag != tag {
            if s.cur + s.prev >= 2 {
                return 0; // another key is using this slot and is not cold
            }
            *s = Heat {
                tag,
                sec,
                cur: 0,
                prev: 0,
            };
        }
        s.cur = s.cur.saturating_add(1);
        s.cur.max(s.prev)
    }

    /// The heat tag of `key` (never 0, which marks an empty slot).
    fn tag(&self, key: &StoreKey) -> u64 {
        self.hasher.hash_one(key) | 1
    }

    /// The rate `note` last measured for `key` (0 when another key holds its slot).
    fn rate(&self, key: &StoreKey, now_us: u64) -> u32 {
        let tag = self.tag(key);
        let sec = now_us / 1_000_000;
        match self.heat.get((tag as usize) % HEAT_SLOTS).map(|s| *s.lock()) {
            Some(s) if s.tag == tag && s.sec == sec => s.cur.max(s.prev),
            Some(s) if s.tag == tag && s.sec + 1 == sec => s.cur,
            _ => 0,
        }
    }

    /// Decide the request from this node's leases, or `None` when any of its limits is not
    /// covered by a live lease (then nothing was spent). All or nothing across its limits.
    pub fn decide<C: PolicedCheck>(&self, checks: &[C], now_us: u64) -> Option<super::Outcomes> {
        if checks.is_empty() || !checks.iter().all(PolicedCheck::leasable) {
            return None;
        }
        // Every request counts toward its keys' heat, local or not: the heat sizes the leases.
        for c in checks {
            self.note(&c.as_ref().key, now_us);
        }
        let mut live = self.live.lock();
        for (i, c) in checks.iter().map(AsRef::as_ref).enumerate() {
            // A key listed twice would need its costs summed: rare, so the store decides it.
            if checks[..i].iter().any(|d| d.as_ref().key == c.key) {
                return None;
            }
            match live.get(&c.key) {
                Some(l) if l.quota == c.quota && l.live_at(now_us) && l.left >= c.cost => {}
                _ => return None,
            }
        }
        let mut out = super::Outcomes::with_capacity(checks.len());
        for c in checks.iter().map(AsRef::as_ref) {
            if let Some(l) = live.get_mut(&c.key) {
                l.left -= c.cost;
                let used = l.granted - l.left;
                out.push(Outcome {
                    allowed: true,
                    remaining: l.remaining.saturating_sub(used),
                    reset_us: l.reset_us.saturating_sub(now_us.saturating_sub(l.since_us)),
                    at_us: l.at_us,
                    ..Outcome::default()
                });
            }
        }
        drop(live);
        self.metrics.local.inc();
        Some(out)
    }

    /// Before a request goes to the store: count its keys' heat, end the leases of its keys (it
    /// could not be decided from them) and give their units back first, so the store never
    /// denies it because of this node's own unused units, and say which limits should ask for a lease in
    /// the same call. When another request is already asking for one of its keys, the answer
    /// says what to wait for instead (with `may_wait`), after which the request should try
    /// [`Leases::decide`] again.
    pub fn prepare<C: PolicedCheck>(&self, checks: &[C], now_us: u64, may_wait: bool) -> Prepared<'_> {
        // Nothing is allocated unless a lease is given back or asked for (the common case of
        // a cold key is a heat update and one map lookup).
        let mut p = Prepared {
            back: Vec::new(),
            asks: Vec::new(),
            wait: None,
            asking: Asking {
                leases: self,
                keys: Vec::new(),
            },
        };
        let every_leasable = !checks.is_empty() && checks.iter().all(PolicedCheck::leasable);
        let mut live = self.live.lock();
        for (i, c) in checks.iter().map(AsRef::as_ref).enumerate() {
            if !checks[i].leasable() {
                continue;
            }
            // `decide` counted a request whose every limit may lease; count the others here.
            let rate = if every_leasable {
                self.rate(&c.key, now_us)
            } else {
                self.note(&c.key, now_us)
            };
            // This request goes to the store: any lease of its keys goes back first, even one
            // that could still cover it (another of its limits was not covered), so the store
            // never denies it for units this very node holds unused.
            if let Some(l) = live.remove(&c.key) {
                self.ended(&l);
                if l.left > 0 {
                    p.back.push((LimitCheck::new(c.key.clone(), l.quota, l.left), l.at_us));
                }
            }
            // Only a request whose every limit may lease takes leases: a lease that can never
            // decide a request alone would only park quota.
            if every_leasable && rate >= self.cfg.min_rate.get() {
                if let Some(a) = self.ask(&c.quota, c.cost, rate) {
                    p.asks.resize(checks.len(), None);
                    p.asks[i] = Some(a);
                }
            }
        }
        drop(live);
        if p.asks.iter().any(Option::is_some) {
            let mut asking = self.asking.lock();
            for (c, a) in checks.iter().map(AsRef::as_ref).zip(p.asks.iter_mut()) {
                if a.is_none() {
                    continue;
                }
                if let Some(n) = asking.get(&c.key) {
                    // Someone else is asking for this key: no second ask; wait for theirs.
                    *a = None;
                    if may_wait && p.wait.is_none() {
                        p.wait = Some((c.key.clone(), n.clone()));
                    }
                } else {
                    asking.insert(c.key.clone(), Arc::new(Notify::new()));
                    p.asking.keys.push(c.key.clone());
                }
            }
        }
        if p.wait.is_some() {
            // The request waits instead of going to the store: it asks for nothing itself.
            p.asks.iter_mut().for_each(|a| *a = None);
            p.asking.done();
        }
        p
    }

    /// Wait (at most `timeout`) until the ask for `key` that `n` belongs to has been answered.
    pub async fn wait(&self, key: &StoreKey, n: &Notify, timeout: std::time::Duration) {
        let notified = n.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        // Answered between `prepare` and now: nothing to wait for.
        if !self.asking.lock().contains_key(key) {
            return;
        }
        let _ = tokio::time::timeout(timeout, notified).await;
    }

    /// The lease to ask for a limit `q` seen `rate` times a second with requests of `cost`:
    /// about rate × ttl, at most `max_share` of the limit, at least the cost.
    fn ask(&self, q: &Quota, cost: u64, rate: u32) -> Option<LeaseAsk> {
        let ttl = self.cfg.ttl_us.get();
        let by_rate = (u64::from(rate) * ttl / 1_000_000).max(1) * cost.max(1);
        let cap = q.limit.get() / 1_000_000 * u64::from(self.cfg.max_share_ppm.get())
            + q.limit.get() % 1_000_000 * u64::from(self.cfg.max_share_ppm.get()) / 1_000_000;
        let want = by_rate.max(cost).min(cap);
        if want == 0 || want < cost {
            return None;
        }
        let life_us = match q.algorithm {
            Algorithm::TokenBucket => ttl,
            _ => 0,
        };
        Some(LeaseAsk { want, life_us })
    }

    /// Record the leases the store granted with a request: `checks[i]` asked and `outcomes[i]`
    /// says how many units it got. `sent_us` is this node's monotonic clock when the call was
    /// sent.
    /// Returns the units of leases these replace (two calls for one key raced), to give back.
    pub fn granted(&self, checks: &[LimitCheck], outcomes: &[Outcome], sent_us: u64) -> Vec<Return> {
        let mut back = Vec::new();
        let mut live = self.live.lock();
        for (c, o) in checks.iter().zip(outcomes) {
            if c.lease.is_none() || o.leased == 0 || !o.allowed {
                continue;
            }
            let life = self.cfg.ttl_us.get().min(window_left(&c.quota, o.at_us));
            let lease = Lease {
                quota: c.quota,
                at_us: o.at_us,
                left: o.leased,
                granted: o.leased,
                expires_us: sent_us.saturating_add(life),
                since_us: sent_us,
                remaining: o.remaining,
                reset_us: o.reset_us,
            };
            self.metrics.taken.inc();
            if let Some(old) = live.insert(c.key.clone(), lease) {
                self.ended(&old);
                if old.left > 0 {
                    back.push((LimitCheck::new(c.key.clone(), old.quota, old.left), old.at_us));
                }
            }
        }
        back
    }

    /// Give `cost` units back to the lease they were taken from (a locally admitted request
    /// that did not go through after all), if it is still live.
    pub fn unspend(&self, key: &StoreKey, at_us: u64, cost: u64) {
        if let Some(l) = self.live.lock().get_mut(key) {
            if l.at_us == at_us {
                l.left = (l.left + cost).min(l.granted);
            }
        }
    }

    /// End the leases that expired by `now_us` (all of them with `all`): the units to give back.
    pub fn take_back(&self, now_us: u64, all: bool) -> Vec<Return> {
        let mut live = self.live.lock();
        let mut back = Vec::new();
        live.retain(|k, l| {
            if !all && l.live_at(now_us) {
                return true;
            }
            self.ended(l);
            if l.left > 0 {
                back.push((LimitCheck::new(k.clone(), l.quota, l.left), l.at_us));
            }
            false
        });
        back
    }

    /// End this node's leases of `keys` without giving their units back (a reset: the count
    /// they were spent from is being deleted).
    pub fn forget(&self, keys: &[StoreKey]) {
        let mut live = self.live.lock();
        for k in keys {
            if let Some(l) = live.remove(k) {
                self.ended(&l);
            }
        }
    }

    /// How many leases are live.
    pub fn live(&self) -> usize {
        self.live.lock().len()
    }

    /// Count the end of lease `l`.
    fn ended(&self, l: &Lease) {
        self.metrics.returned.inc();
        self.metrics.unused.inc_by(l.left);
    }
}

/// Microseconds from `at_us` to the end of the window `q` counts `at_us` in (a lease of a window
/// limit must end with it); unbounded for a token bucket.
fn window_left(q: &Quota, at_us: u64) -> u64 {
    match q.algorithm {
        Algorithm::FixedWindow | Algorithm::SlidingWindow => {
            calendar::start(q, calendar::index(q, at_us) + 1).saturating_sub(at_us)
        }
        _ => u64::MAX,
    }
}

#[cfg(test)]
mod tests;
