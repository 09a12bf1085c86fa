//! Limits: the algorithms, the [`Store`] trait and its memory and Redis implementations, the
//! deny cache, and the failure policy that decides what happens when the store is down.
//!
//! The request path talks to [`Limiter`] only. It owns the primary store, the local fallback
//! store, the deny cache and the circuit breaker, and returns a [`Verdict`]; it never builds an
//! HTTP response (that happens in `crate::http`).

pub mod algorithm;
pub mod breaker;
pub mod deny_cache;
pub mod memory;
pub mod redis;

use std::future::Future;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

pub use algorithm::{Algorithm, Outcome, Quota};
use breaker::Breaker;
use deny_cache::DenyCache;
use memory::MemoryStore;

use crate::clock::SharedClock;

/// The full store key of one limit: `{prefix}:{<hash>}:<rule>:<window>`.
///
/// The part in braces is a hash of the key value, so every limit of one caller lands on one
/// Redis Cluster slot and no caller-controlled byte ever reaches Redis.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct StoreKey(pub String);

impl StoreKey {
    /// The key as a string.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The hash tag (the part inside `{}`), which decides the Redis Cluster slot.
    pub fn hash_tag(&self) -> &str {
        let s = self.0.as_str();
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
}

/// Why a store could not answer. Any of these is a *store failure*; the rule's `failure`
/// policy decides what the request gets.
#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    /// The check did not finish within `store.timeout`.
    #[error("store check timed out")]
    Timeout,
    /// The circuit breaker is open: the store is known to be down and was not asked.
    #[error("store circuit breaker is open")]
    CircuitOpen,
    /// Redis answered with an error, or the connection failed.
    #[error("redis: {0}")]
    Redis(String),
    /// The reply had an unexpected shape.
    #[error("unexpected store reply: {0}")]
    Protocol(String),
}

/// A place where counters live. Implementations are all-or-nothing: when any non-shadow limit
/// in `checks` denies, no limit's quota is spent (a limit on another Redis slot may be spent and
/// refunded within the same call).
pub trait Store: Send + Sync + 'static {
    /// Check and spend every limit in `checks`; one [`Outcome`] per check, in order.
    fn check(&self, checks: &[LimitCheck]) -> impl Future<Output = Result<Vec<Outcome>, StoreError>> + Send;

    /// Give back what an admitted `checks` spent (a leaky-bucket request whose client left
    /// while it waited).
    fn refund(&self, checks: &[LimitCheck]) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Current state of each limit, as the outcome a cost-0 request would get. `None` where the
    /// store holds nothing for that key.
    fn peek(&self, checks: &[LimitCheck]) -> impl Future<Output = Result<Vec<Option<Outcome>>, StoreError>> + Send;

    /// Forget the counters at `keys`.
    fn reset(&self, keys: &[StoreKey]) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Run the real script path once (readiness): `Ok` means a limit check would work now.
    fn probe(&self) -> impl Future<Output = Result<(), StoreError>> + Send;
}

/// The configured store, chosen at start-up. An enum rather than a `dyn Store` so the hot path
/// is a direct, inlinable call with no boxed future.
#[derive(Clone)]
pub enum Backend {
    /// The embedded memory store (one node).
    Memory(Arc<MemoryStore>),
    /// Redis or Redis Cluster.
    Redis(Arc<redis::RedisStore>),
}

impl Backend {
    /// True for the memory store, which cannot fail.
    pub fn is_memory(&self) -> bool {
        matches!(self, Backend::Memory(_))
    }
}

impl Store for Backend {
    async fn check(&self, checks: &[LimitCheck]) -> Result<Vec<Outcome>, StoreError> {
        match self {
            Backend::Memory(m) => m.check(checks).await,
            Backend::Redis(r) => r.check(checks).await,
        }
    }
    async fn refund(&self, checks: &[LimitCheck]) -> Result<(), StoreError> {
        match self {
            Backend::Memory(m) => m.refund(checks).await,
            Backend::Redis(r) => r.refund(checks).await,
        }
    }
    async fn peek(&self, checks: &[LimitCheck]) -> Result<Vec<Option<Outcome>>, StoreError> {
        match self {
            Backend::Memory(m) => m.peek(checks).await,
            Backend::Redis(r) => r.peek(checks).await,
        }
    }
    async fn reset(&self, keys: &[StoreKey]) -> Result<(), StoreError> {
        match self {
            Backend::Memory(m) => m.reset(keys).await,
            Backend::Redis(r) => r.reset(keys).await,
        }
    }
    async fn probe(&self) -> Result<(), StoreError> {
        match self {
            Backend::Memory(m) => m.probe().await,
            Backend::Redis(r) => r.probe().await,
        }
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
}

/// The limiter's answer for one request: one outcome per check, plus how it was reached.
#[derive(Debug, Clone)]
pub struct Verdict {
    /// One per check, in order. Fail-open checks get an allowed outcome with full quota.
    pub outcomes: Vec<(Outcome, Source)>,
    /// Set when the store failed (the error, for logs).
    pub store_error: Option<StoreError>,
}

impl Verdict {
    /// True when the request may go upstream: no non-shadow limit denied or failed closed.
    pub fn admitted(&self, checks: &[LimitCheck]) -> bool {
        self.outcomes
            .iter()
            .zip(checks)
            .all(|((o, s), c)| c.shadow || (o.allowed && *s != Source::FailClosed))
    }
}

/// The request path's entry point to limiting.
pub struct Limiter {
    /// The primary store (memory, Redis or Redis Cluster).
    pub store: Backend,
    /// This node's memory store, for `failure: local` while the primary is down. When the
    /// primary is the memory store this is a separate instance, never used.
    pub local: Arc<MemoryStore>,
    /// Denials remembered until they can pass; `None` when `limits.deny_cache: false`.
    pub deny: Option<DenyCache>,
    /// Stops paying the timeout while the store is down.
    pub breaker: Arc<Breaker>,
    /// Hard deadline on one check.
    pub timeout: Duration,
    /// Time source for the deny cache.
    pub clock: SharedClock,
}

impl Limiter {
    /// Check `checks` (each with its rule's failure policy, same order).
    pub async fn check(&self, checks: &[LimitCheck], policies: &[FailurePolicy]) -> Verdict {
        let now = self.clock.now_us();
        if let Some(deny) = &self.deny {
            for (i, c) in checks.iter().enumerate() {
                if c.shadow {
                    continue;
                }
                if let Some(until) = deny.get(&c.key, now) {
                    let mut outcomes: Vec<(Outcome, Source)> =
                        checks.iter().map(|_| (full(), Source::DenyCache)).collect();
                    outcomes[i].0 = Outcome {
                        allowed: false,
                        remaining: 0,
                        reset_us: until - now,
                        retry_after_us: until - now,
                        delay_us: 0,
                    };
                    return Verdict {
                        outcomes,
                        store_error: None,
                    };
                }
            }
        }
        let result = if self.store.is_memory() {
            self.store.check(checks).await
        } else if !self.breaker.allow() {
            Err(StoreError::CircuitOpen)
        } else {
            match tokio::time::timeout(self.timeout, self.store.check(checks)).await {
                Ok(Ok(v)) => {
                    self.breaker.success();
                    Ok(v)
                }
                Ok(Err(e)) => {
                    self.note_failure(&e);
                    Err(e)
                }
                Err(_) => {
                    self.note_failure(&StoreError::Timeout);
                    Err(StoreError::Timeout)
                }
            }
        };
        match result {
            Ok(outcomes) => {
                if let Some(deny) = &self.deny {
                    for (o, c) in outcomes.iter().zip(checks) {
                        if !o.allowed && !c.shadow && o.retry_after_us > 0 {
                            deny.insert(&c.key, now + o.retry_after_us);
                        }
                    }
                }
                Verdict {
                    outcomes: outcomes.into_iter().map(|o| (o, Source::Store)).collect(),
                    store_error: None,
                }
            }
            Err(e) => self.on_failure(checks, policies, e).await,
        }
    }

    /// Count a failed check; log when it opens the breaker (a store state change).
    fn note_failure(&self, e: &StoreError) {
        if self.breaker.failure() {
            tracing::error!(error = %e, "store failing: circuit breaker opened; rules now follow their failure policy");
        }
    }

    async fn on_failure(&self, checks: &[LimitCheck], policies: &[FailurePolicy], err: StoreError) -> Verdict {
        let mut outcomes: Vec<(Outcome, Source)> = Vec::with_capacity(checks.len());
        let mut local_checks = Vec::new();
        let mut local_idx = Vec::new();
        for (i, (c, p)) in checks.iter().zip(policies).enumerate() {
            match p {
                FailurePolicy::Open => outcomes.push((full(), Source::FailOpen)),
                FailurePolicy::Closed => outcomes.push((
                    Outcome {
                        allowed: false,
                        retry_after_us: 1_000_000,
                        ..Outcome::default()
                    },
                    Source::FailClosed,
                )),
                FailurePolicy::Local { share } => {
                    outcomes.push((full(), Source::Local));
                    local_checks.push(local_share(c, *share));
                    local_idx.push(i);
                }
            }
        }
        if !local_checks.is_empty() {
            if let Ok(local) = self.local.check(&local_checks).await {
                for (o, i) in local.into_iter().zip(local_idx) {
                    outcomes[i].0 = o;
                }
            }
        }
        Verdict {
            outcomes,
            store_error: Some(err),
        }
    }

    /// Give back what an admitted request spent (a leaky-bucket client that left while waiting).
    pub async fn refund(&self, checks: &[LimitCheck]) {
        let _ = tokio::time::timeout(self.timeout, self.store.refund(checks)).await;
    }

    /// Forget every counter and deny-cache entry at `keys`.
    pub async fn reset(&self, keys: &[StoreKey]) -> Result<(), StoreError> {
        if let Some(deny) = &self.deny {
            for k in keys {
                deny.remove(k);
            }
        }
        self.local.reset(keys).await?;
        self.store.reset(keys).await
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
fn local_share(c: &LimitCheck, share: NonZeroU32) -> LimitCheck {
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
