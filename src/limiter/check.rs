//! What the request path hands the limiter and gets back: the store key, one limit check with
//! its failure policy, and the verdict with where each outcome came from.

use std::num::NonZeroU32;
use std::sync::Arc;

use smallvec::SmallVec;

use super::{lease, Algorithm, Outcome, Quota, StoreError};

/// The full store key of one limit: `{prefix}:{<hash>}:<rule>:<window>`.
///
/// The part in braces is a hash of the key value, so every limit of one caller lands on one
/// Redis Cluster slot and no caller-controlled byte ever reaches Redis.
///
/// Shared text: a clone (a global rule's key, built when the rules load, goes into every
/// request's check) counts a reference and allocates nothing.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct StoreKey(pub Arc<str>);

impl From<&str> for StoreKey {
    fn from(s: &str) -> Self {
        StoreKey(Arc::from(s))
    }
}

impl From<String> for StoreKey {
    fn from(s: String) -> Self {
        StoreKey(Arc::from(s))
    }
}

impl StoreKey {
    /// The key as a string.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The hash tag (the part inside `{}`), which decides the Redis Cluster slot.
    pub fn hash_tag(&self) -> &str {
        let s = &*self.0;
        match (s.find('{'), s.find('}')) {
            (Some(a), Some(b)) if b > a + 1 => &s[a + 1..b],
            _ => s,
        }
    }
}

/// One limit to check for one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LimitCheck {
    /// Where the counter lives.
    pub key: StoreKey,
    /// The limit.
    pub quota: Quota,
    /// Units this request spends.
    pub cost: u64,
    /// A shadow limit never blocks the request (and its own denial spends nothing).
    pub shadow: bool,
    /// Concurrency limits: the request holding the slot (unique per request and node, see
    /// [`Limiter::holder`]); 0 for rate limits.
    pub holder: u64,
    /// The rule's penalty box, if it has one.
    pub penalty: Option<Penalty>,
    /// A lease this node asks for in the same call (set by the limiter for hot keys only).
    pub lease: Option<lease::LeaseAsk>,
}

impl LimitCheck {
    /// A check of `quota` at `key` for `cost` units: no shadow, no holder, no penalty.
    pub fn new(key: StoreKey, quota: Quota, cost: u64) -> Self {
        LimitCheck {
            key,
            quota,
            cost,
            shadow: false,
            holder: 0,
            penalty: None,
            lease: None,
        }
    }

    /// True for a concurrency slot (released when the request ends, not refunded).
    pub fn is_slot(&self) -> bool {
        self.quota.algorithm == Algorithm::Concurrency
    }

    /// Where this limit's penalty state lives: the limit's key with `:p` appended (same hash
    /// tag, so the same Redis Cluster slot).
    pub fn penalty_key(key: &StoreKey) -> String {
        let mut k = String::with_capacity(key.0.len() + 2);
        k.push_str(&key.0);
        k.push_str(":p");
        k
    }

    /// Where the instant of this limit's last reset lives while the reset settles: the limit's
    /// key with `:r` appended (same hash tag, so the same Redis Cluster slot). See
    /// `RedisStore::reset_settled`.
    pub fn reset_key(key: &StoreKey) -> String {
        let mut k = String::with_capacity(key.0.len() + 2);
        k.push_str(&key.0);
        k.push_str(":r");
        k
    }
}

/// A rule's penalty box: after the rule denies a key, the key is denied everywhere for `base`;
/// each request that reaches the store during the penalty doubles the time left, up to `max`
/// (no escalation when `max == base`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Penalty {
    /// The first penalty, microseconds.
    pub base_us: std::num::NonZeroU64,
    /// The longest penalty, microseconds (≥ `base_us`).
    pub max_us: std::num::NonZeroU64,
}

impl Penalty {
    /// The penalty after one served for `len_us`: doubled, at most `max`.
    pub fn escalated(&self, len_us: u64) -> u64 {
        len_us.saturating_mul(2).clamp(self.base_us.get(), self.max_us.get())
    }

    /// True when breaches during a penalty lengthen it.
    pub fn escalates(&self) -> bool {
        self.max_us > self.base_us
    }
}

impl AsRef<LimitCheck> for LimitCheck {
    fn as_ref(&self) -> &LimitCheck {
        self
    }
}

/// A limit to check together with what happens to it when the store fails: the unit of a
/// request's plan, as the limiter reads it.
pub trait PolicedCheck: AsRef<LimitCheck> + Sync {
    /// The failure policy of the rule this limit belongs to.
    fn policy(&self) -> FailurePolicy;

    /// True when this limit may be decided from a lease ([`lease`] says which may not).
    fn leasable(&self) -> bool {
        false
    }
}

/// What a rule does when the store fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailurePolicy {
    /// Forward the request (and count it as `fail_open`).
    Open,
    /// Answer 503 `rate_limiter_unavailable`.
    Closed,
    /// Enforce the limit on this node's memory store, divided by `share`.
    Local {
        /// How many nodes share the limit while the store is down (≥ 1).
        share: NonZeroU32,
    },
}

/// How one limit was decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// The primary store answered.
    Store,
    /// The deny cache answered without asking the store.
    DenyCache,
    /// The store failed and the rule fails open: not checked.
    FailOpen,
    /// The store failed and the rule fails closed.
    FailClosed,
    /// The store failed and this node's memory store decided.
    Local,
    /// This node decided from its leases (quota the store already spent for it).
    Lease,
}

/// The limiter's answer for one request: one outcome per check, plus how it was reached.
#[derive(Debug, Clone, Default)]
pub struct Verdict {
    /// One per check, in order. Fail-open checks get an allowed outcome with full quota.
    pub outcomes: SmallVec<[(Outcome, Source); 2]>,
    /// Set when the store failed for some check (the first error, for logs and metrics).
    pub store_error: Option<StoreError>,
}

impl Verdict {
    /// True when the request may go upstream: no non-shadow limit denied or failed closed.
    pub(super) fn admits<C: AsRef<LimitCheck>>(&self, checks: &[C]) -> bool {
        self.outcomes
            .iter()
            .zip(checks.iter().map(AsRef::as_ref))
            .all(|((o, s), c)| c.shadow || (o.allowed && *s != Source::FailClosed))
    }

    /// What the admitted checks of this verdict spent, and where: the argument of
    /// [`Limiter::refund`] when the request does not go through after all.
    pub fn spent<C: AsRef<LimitCheck>>(&self, checks: &[C]) -> Vec<(LimitCheck, u64, Source)> {
        self.outcomes
            .iter()
            .zip(checks.iter().map(AsRef::as_ref))
            .filter(|((o, s), c)| o.allowed && c.cost > 0 && matches!(s, Source::Store | Source::Local | Source::Lease))
            .map(|((o, s), c)| (c.clone(), o.at_us, *s))
            .collect()
    }
}
