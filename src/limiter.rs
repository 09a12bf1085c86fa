//! Limits: the algorithms, the [`Store`] trait and its memory and Redis implementations, the
//! deny cache, and the failure policy that decides what happens when the store is down.
//!
//! The request path talks to [`Limiter`] only. It owns the primary store, the local fallback
//! store, the deny cache and the circuit breaker, and returns a [`Verdict`]; it never builds an
//! HTTP response (that happens in `crate::http`).

pub mod algorithm;
pub mod breaker;
mod check;
pub mod deny_cache;
mod held;
pub use held::PendingGuard;
pub mod keys;
pub mod lease;
pub mod memory;
pub mod redis;
mod store;

use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use smallvec::SmallVec;

pub use algorithm::{Algorithm, Outcome, Quota};
use deny_cache::{DenyCache, Lookup};
use memory::MemoryStore;
pub use store::{Backend, Checked, Outcomes, Store, StoreError};

pub use check::{FailurePolicy, LimitCheck, Penalty, PolicedCheck, Source, StoreKey, Verdict};

use crate::clock::SharedClock;

/// Longest a denial is answered from the deny cache before the store is asked again. A denial
/// may rest on units that a refund is about to give back (a cross-slot request rejected
/// elsewhere, a queued leaky-bucket client that leaves): caching it for its whole retry time
/// could lock every client out of a global rule for an hour. One second bounds that error and
/// still spares the store all but one call a second per denied key.
pub const DENY_CACHE_MAX_US: u64 = 1_000_000;

/// The request path's entry point to limiting.
pub struct Limiter {
    /// The primary store (memory, Redis or Redis Cluster). For Redis it holds one circuit
    /// breaker per shard, so a failed shard costs no timeout and fails only its own limits.
    store: Backend,
    /// This node's memory store, for `failure: local` while the primary is down. When the
    /// primary is the memory store this is a separate instance, never used.
    local: Arc<MemoryStore>,
    /// Denials remembered until they can pass; `None` when `limits.deny_cache: false`.
    deny: Option<DenyCache>,
    /// Hard deadline on one check (each Redis slot's call has it; the whole check gets twice
    /// that, refunds of a cross-slot denial included).
    timeout: Duration,
    /// Time source for the deny cache.
    clock: SharedClock,
    /// Concurrency slots taken by requests still running, by holder, renewed by
    /// [`Limiter::renew_held`]. A `parking_lot` mutex held only to insert, remove or copy out
    /// (never across an `.await`); only requests of concurrency rules touch it.
    held: parking_lot::Mutex<std::collections::HashMap<u64, Vec<(LimitCheck, Source)>>>,
    /// The next holder id. Starts at a random point per process, so the holders of several
    /// gateways sharing one Redis never meet (64 bits: two nodes' ranges would have to overlap
    /// within the requests in flight).
    next_holder: std::sync::atomic::AtomicU64,
    /// This node's leases of hot keys (`store.leases`); `None` on the memory store or when
    /// leases are off.
    leases: Option<lease::Leases>,
    /// Units this node's requests reserved and have not settled yet, by store key (rules whose
    /// cost the response body reports): what `/keys` shows as reserved. Held only to add or
    /// subtract (never across an `.await`).
    reserved: parking_lot::Mutex<std::collections::HashMap<StoreKey, u64>>,
    /// Upstream exchanges and settlements still under way after their client's request ended
    /// (a client that left, a cost still to settle): shutdown waits for them.
    pending: Arc<held::Pending>,
}

/// A check [`Limiter::begin`] could not decide without the store: what [`Limiter::ask`] needs
/// to go on.
#[derive(Debug)]
pub struct Ask {
    /// The instant the check began (this limiter's clock).
    now: u64,
    /// The deny-cache entries this request refreshes (indices into the checks).
    refreshing: SmallVec<[usize; 2]>,
}

/// A random 64-bit start for [`Limiter::next_holder`].
pub fn random_holder_start() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    // RandomState is seeded from the OS; two of them hashed with the time and pid give 64 bits
    // that differ per process without another dependency.
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.write_u32(std::process::id());
    h.finish() | 1
}

impl Limiter {
    /// A limiter deciding on `store`, with `local` for `failure: local` while the primary is
    /// down (a separate memory store), `timeout` as the deadline of one store call, and `clock`
    /// for the deny cache and leases. No deny cache and no leases until added with
    /// [`Limiter::with_deny_cache`] and [`Limiter::with_leases`]. Holder ids start at a random
    /// point ([`random_holder_start`]).
    pub fn new(store: Backend, local: Arc<MemoryStore>, timeout: Duration, clock: SharedClock) -> Self {
        Limiter {
            store,
            local,
            deny: None,
            timeout,
            clock,
            held: Default::default(),
            reserved: Default::default(),
            pending: Default::default(),
            next_holder: std::sync::atomic::AtomicU64::new(random_holder_start()),
            leases: None,
        }
    }

    /// Remember up to `max` denials until they can pass (`limits.deny_cache`).
    pub fn with_deny_cache(mut self, max: usize) -> Self {
        self.deny = Some(DenyCache::new(max));
        self
    }

    /// Take leases of hot keys (`store.leases`; the Redis stores only).
    pub fn with_leases(mut self, leases: lease::Leases) -> Self {
        self.leases = Some(leases);
        self
    }

    /// The primary store.
    pub fn store(&self) -> &Backend {
        &self.store
    }

    /// This node's memory store for `failure: local`.
    pub fn local(&self) -> &Arc<MemoryStore> {
        &self.local
    }

    /// The deny cache, when `limits.deny_cache` is on.
    pub fn deny_cache(&self) -> Option<&DenyCache> {
        self.deny.as_ref()
    }

    /// This node's leases, when on.
    pub fn leases(&self) -> Option<&lease::Leases> {
        self.leases.as_ref()
    }

    /// Check `checks`, each with its rule's failure policy.
    pub async fn check<P: PolicedCheck>(&self, checks: &[P]) -> Verdict {
        match self.begin(checks, self.clock.now_us()) {
            Ok(v) => v,
            Err(ask) => self.ask(checks, ask).await,
        }
    }

    /// Decide `checks` at `now` (this limiter's clock) without waiting, when that can be done:
    /// a cached denial, a live lease for every limit, or the memory store (which never waits).
    /// `Err` says the store must be asked: pass it to [`Limiter::ask`]. A plain function, so
    /// the request path carries no store call's state when it decides locally.
    pub fn begin<P: PolicedCheck>(&self, checks: &[P], now: u64) -> Result<Verdict, Ask> {
        // Deny-cache entries this request refreshes (see `deny_cache`: one refresh at a time).
        let mut refreshing: SmallVec<[usize; 2]> = SmallVec::new();
        if let Some(deny) = &self.deny {
            // Every cached denial of the request first: the answer names the binding one (the
            // longest wait), so a client is never told to come back before it can pass.
            let mut outcomes: Option<SmallVec<[(Outcome, Source); 2]>> = None;
            for (i, c) in checks.iter().map(AsRef::as_ref).enumerate() {
                if c.shadow {
                    continue;
                }
                if let Some(wait) = deny.peek(c, now) {
                    let o =
                        outcomes.get_or_insert_with(|| checks.iter().map(|_| (full(), Source::DenyCache)).collect());
                    // The store's own wait, counted down: not the cache entry's life (≤ 1 s),
                    // which would tell the client to come back before it can pass.
                    let wait = wait.max(1);
                    o[i].0 = Outcome {
                        allowed: false,
                        reset_us: wait,
                        retry_after_us: wait,
                        at_us: now,
                        ..Outcome::default()
                    };
                }
            }
            if let Some(outcomes) = outcomes {
                return Ok(Verdict {
                    outcomes,
                    store_error: None,
                });
            }
            let grace = u64::try_from(self.timeout.saturating_mul(2).as_micros()).unwrap_or(u64::MAX);
            for (i, c) in checks.iter().map(AsRef::as_ref).enumerate() {
                if !c.shadow && deny.get(c, now, grace) == Lookup::Refresh {
                    refreshing.push(i);
                }
            }
        }
        if let Some(leases) = &self.leases {
            // Lease lives run on the monotonic clock (ARCHITECTURE.md, "Leases never let the
            // fleet exceed a limit"): a wall clock stepped back must not stretch one.
            if let Some(outcomes) = leases.decide(checks, self.clock.mono_us()) {
                return Ok(lease_verdict(outcomes));
            }
        }
        if let Backend::Memory(m) = &self.store {
            let checked = m.decide_at(checks, now);
            if checked.failed.is_empty() {
                return Ok(self.answered(checks, checked, now, &refreshing).0);
            }
            // Refused for want of room: the failure policies decide, which may await a refund.
            return Err(Ask { now, refreshing });
        }
        Err(Ask { now, refreshing })
    }

    /// Ask the store what [`Limiter::begin`] could not decide (taking or topping up leases on
    /// the way), and apply each failed check's policy.
    pub async fn ask<P: PolicedCheck>(&self, checks: &[P], ask: Ask) -> Verdict {
        let Ask { now, refreshing } = ask;
        let mut asked: Option<Vec<LimitCheck>> = None;
        let mut asking = None;
        if let Some(leases) = &self.leases {
            let mut prep = leases.prepare(checks, self.clock.mono_us(), true);
            if let Some((key, n)) = prep.wait.take() {
                // Another request is asking for this key's lease: its grant will most likely
                // decide this one too.
                leases.wait(&key, &n, self.timeout).await;
                let mono = self.clock.mono_us();
                if let Some(outcomes) = leases.decide(checks, mono) {
                    return lease_verdict(outcomes);
                }
                prep = leases.prepare(checks, mono, false);
            }
            if !prep.back.is_empty() {
                // Before the check, so the store never denies it for this node's own unused units.
                self.give_back(&prep.back).await;
            }
            if prep.asks.iter().any(Option::is_some) {
                asked = Some(
                    checks
                        .iter()
                        .zip(prep.asks)
                        .map(|(c, a)| LimitCheck {
                            lease: a,
                            ..c.as_ref().clone()
                        })
                        .collect(),
                );
            }
            asking = Some(prep.asking);
        }
        // A lease lives from before its call was sent, on the monotonic clock.
        let sent_mono = self.clock.mono_us();
        let checked = match &asked {
            Some(a) => self.store_check(a).await,
            None => self.store_check(checks).await,
        };
        if let (Some(leases), Some(a)) = (&self.leases, &asked) {
            let replaced = leases.granted(a, &checked.outcomes, sent_mono);
            // The asks are answered: wake the requests waiting for them.
            drop(asking);
            if !replaced.is_empty() {
                self.give_back(&replaced).await;
            }
        }
        let (mut verdict, failed) = self.answered(checks, checked, now, &refreshing);
        if !failed.is_empty() {
            self.on_failure(checks, &failed, &mut verdict).await;
        }
        verdict
    }

    /// The verdict of what the store answered at `now`: its denials remembered in the deny
    /// cache, the entries this request refreshed released, and the checks that failed.
    fn answered<P: PolicedCheck>(
        &self,
        checks: &[P],
        checked: Checked,
        now: u64,
        refreshing: &[usize],
    ) -> (Verdict, Vec<(usize, StoreError)>) {
        if let Some(deny) = &self.deny {
            for (i, (o, c)) in checked
                .outcomes
                .iter()
                .zip(checks.iter().map(AsRef::as_ref))
                .enumerate()
            {
                // A concurrency denial is not cached: a slot frees the moment a request ends.
                if !o.allowed
                    && !c.shadow
                    && !c.is_slot()
                    && o.retry_after_us > 0
                    && !checked.failed.iter().any(|(f, _)| *f == i)
                {
                    deny.insert(
                        c,
                        now,
                        now + o.retry_after_us.min(DENY_CACHE_MAX_US),
                        now + o.retry_after_us,
                    );
                }
            }
            // A refresh that found no new denial lets the next requests ask the store.
            for &i in refreshing {
                if let Some(c) = checks.get(i) {
                    deny.refreshed(&c.as_ref().key);
                }
            }
        }
        let verdict = Verdict {
            outcomes: checked.outcomes.into_iter().map(|o| (o, Source::Store)).collect(),
            store_error: checked.failed.first().map(|(_, e)| e.clone()),
        };
        (verdict, checked.failed)
    }

    /// One call to the primary store, within twice the store deadline.
    async fn store_check<C: AsRef<LimitCheck> + Sync>(&self, checks: &[C]) -> Checked {
        if self.store.is_memory() {
            return self.store.check(checks).await;
        }
        match tokio::time::timeout(self.timeout.saturating_mul(2), self.store.check(checks)).await {
            Ok(c) => c,
            Err(_) => Checked::all_failed(checks.len(), StoreError::Timeout),
        }
    }

    /// Give leased units back to the primary store (each `(limit, at)` with its unused units as
    /// the cost, in the window they were spent in).
    async fn give_back(&self, back: &[lease::Return]) {
        match tokio::time::timeout(self.timeout.saturating_mul(2), self.store.refund(back)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                tracing::warn!(error = %e, leases = back.len(), "returning unused lease units failed; they stay spent until their window passes or their bucket refills")
            }
            Err(_) => tracing::warn!(leases = back.len(), "returning unused lease units timed out"),
        }
    }

    /// End the leases that expired (every lease with `all`: a reload or shutdown) and give
    /// their unused units back. Called every half lease time to live by the server.
    pub async fn return_leases(&self, all: bool) {
        if let Some(leases) = &self.leases {
            let back = leases.take_back(self.clock.mono_us(), all);
            if !back.is_empty() {
                self.give_back(&back).await;
            }
        }
    }

    /// Decide the checks the store could not (each by its rule's failure policy). The local
    /// fallback runs only when nothing else already rejects the request; when the policies
    /// reject a request the store had admitted elsewhere, the store's spending is refunded.
    async fn on_failure<P: PolicedCheck>(&self, checks: &[P], failed: &[(usize, StoreError)], verdict: &mut Verdict) {
        // A denial among the answered checks: the store already refunded what the request spent.
        let store_denied = verdict
            .outcomes
            .iter()
            .zip(checks.iter().map(AsRef::as_ref))
            .enumerate()
            .any(|(i, ((o, _), c))| !o.allowed && !c.shadow && !failed.iter().any(|(f, _)| *f == i));
        let mut local = Vec::new();
        for &(i, _) in failed {
            let entry = &mut verdict.outcomes[i];
            match checks.get(i).map_or(FailurePolicy::Open, PolicedCheck::policy) {
                FailurePolicy::Open => *entry = (full(), Source::FailOpen),
                FailurePolicy::Closed => {
                    *entry = (
                        Outcome {
                            allowed: false,
                            retry_after_us: 1_000_000,
                            ..Outcome::default()
                        },
                        Source::FailClosed,
                    )
                }
                FailurePolicy::Local { share } => {
                    *entry = (full(), Source::Local);
                    local.push((i, local_share(checks[i].as_ref(), share)));
                }
            }
        }
        if !local.is_empty() && verdict.admits(checks) {
            let local_checks: Vec<LimitCheck> = local.iter().map(|(_, c)| c.clone()).collect();
            // A check the local store refused for want of room reads as denied.
            let decided = self.local.check_at(&local_checks, self.clock.now_us());
            for ((i, _), o) in local.iter().zip(decided) {
                verdict.outcomes[*i].0 = o;
            }
        }
        if !store_denied && !verdict.admits(checks) {
            // Rejected by a failure policy: nothing the store granted may stay spent.
            let spent: Vec<(LimitCheck, u64, Source)> = verdict
                .spent(checks)
                .into_iter()
                .filter(|(_, _, s)| *s == Source::Store)
                .collect();
            if !spent.is_empty() {
                self.refund(&spent).await;
            }
        }
    }

    /// Give back what an admitted request spent (a leaky-bucket client that left while waiting,
    /// a request rejected by another limit's failure policy), each in the store that spent it.
    pub async fn refund(&self, spent: &[(LimitCheck, u64, Source)]) {
        if let Some(leases) = &self.leases {
            for (c, at, _) in spent.iter().filter(|(_, _, s)| *s == Source::Lease) {
                leases.unspend(&c.key, *at, c.cost);
            }
        }
        let (store, local) = by_source(spent);
        if !store.is_empty() {
            if let Ok(Err(e)) = tokio::time::timeout(self.timeout, self.store.refund(&store)).await {
                tracing::warn!(error = %e, "refund failed; the units stay spent until their window passes");
            }
        }
        if !local.is_empty() {
            self.local.refund_spent(&local);
        }
    }

    /// Reset the limits of `checks` (`DELETE /keys/…`): their counters start again from zero
    /// and their penalties are lifted, on every node. Concurrency slots are current usage and
    /// survive (released by their holders, or expired by their time to live).
    ///
    /// No unit of the old count reaches the new one (ARCHITECTURE.md, "Leases never let the
    /// fleet exceed a limit"): this node's leases of the keys end at once; on Redis the reset
    /// waits one lease time to live before the counters go, so every node's lease of them has
    /// expired, and the store drops their late returns (see
    /// [`redis::RedisStore::reset_settled`]).
    pub async fn reset(&self, checks: &[LimitCheck]) -> Result<(), StoreError> {
        let counters: Vec<StoreKey> = checks.iter().filter(|c| !c.is_slot()).map(|c| c.key.clone()).collect();
        let slot_keys: Vec<StoreKey> = checks.iter().filter(|c| c.is_slot()).map(|c| c.key.clone()).collect();
        if let Some(leases) = &self.leases {
            leases.forget(&counters);
        }
        let done = match &self.store {
            Backend::Redis(r) => {
                let slots = slot_keys.clone();
                let hold = self
                    .leases
                    .as_ref()
                    .map_or(Duration::ZERO, |l| Duration::from_micros(l.config().ttl_us.get()));
                // In a task of its own: a reset begun (markers written) always ends with the
                // counters deleted, even if the admin client leaves during the wait.
                let (r, keys) = (Arc::clone(r), counters.clone());
                let task = tokio::spawn(async move { r.reset_settled(&keys, &slots, hold).await });
                task.await
                    .unwrap_or_else(|e| Err(StoreError::Redis(format!("the reset task failed: {e}"))))
            }
            Backend::Memory(m) => {
                m.lift_penalties(&slot_keys);
                m.reset(&counters).await
            }
        };
        self.local.lift_penalties(&slot_keys);
        self.local.reset(&counters).await?;
        // After the wait: a denial cached meanwhile came from the old count.
        if let Some(deny) = &self.deny {
            for c in checks {
                deny.remove(&c.key);
            }
        }
        done
    }

    /// Probe the shards whose breaker is open and close those that answer; how many stay open.
    pub async fn heal(&self) -> usize {
        match &self.store {
            Backend::Memory(_) => 0,
            Backend::Redis(r) => r.heal().await,
        }
    }
}

/// Split `(check, at, source)` entries into the primary store's and this node's local ones
/// (the failure-policy sources spent nothing and are dropped).
type AtList = Vec<(LimitCheck, u64)>;
fn by_source(spent: &[(LimitCheck, u64, Source)]) -> (AtList, AtList) {
    let mut store = Vec::new();
    let mut local = Vec::new();
    for (c, at, s) in spent {
        match s {
            Source::Store => store.push((c.clone(), *at)),
            Source::Local => local.push((c.clone(), *at)),
            _ => {}
        }
    }
    (store, local)
}

/// A verdict decided from this node's leases.
fn lease_verdict(outcomes: Outcomes) -> Verdict {
    Verdict {
        outcomes: outcomes.into_iter().map(|o| (o, Source::Lease)).collect(),
        store_error: None,
    }
}

/// An allowed outcome that reports nothing spent.
fn full() -> Outcome {
    Outcome {
        allowed: true,
        ..Outcome::default()
    }
}

/// The limit this node enforces alone while the store is down: `limit / share`, at least 1.
pub fn local_share(c: &LimitCheck, share: NonZeroU32) -> LimitCheck {
    let mut c = c.clone();
    let s = u64::from(share.get());
    if s > 1 {
        let q = &mut c.quota;
        let limit = (q.limit.get() / s).max(1);
        let new_limit = std::num::NonZeroU64::new(limit).unwrap_or(std::num::NonZeroU64::MIN);
        if q.algorithm.is_bucket() {
            // Same capacity share, refilled `share` times slower.
            let interval = q.interval_us.get().saturating_mul(s);
            *q = Quota::bucket(
                q.algorithm,
                new_limit,
                std::num::NonZeroU64::new(interval).unwrap_or(std::num::NonZeroU64::MIN),
            );
        } else {
            q.limit = new_limit;
        }
        c.cost = c.cost.min(limit);
    }
    c
}
