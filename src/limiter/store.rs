//! The [`Store`] trait every counter store implements, its errors, and [`Backend`], the store
//! chosen at start-up.

use std::future::Future;
use std::sync::Arc;

use super::memory::MemoryStore;
use smallvec::SmallVec;

use super::{redis, LimitCheck, Outcome, StoreKey};

/// One outcome per check, inline for the usual one or two limits of a request (no allocation).
pub type Outcomes = SmallVec<[Outcome; 2]>;

/// Why a store could not answer. Any of these is a *store failure*; the rule's `failure`
/// policy decides what the request gets. [`StoreError::is_transient`] tells the failures that
/// may pass by themselves from those that will not.
#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    /// The check did not finish within `store.timeout`.
    #[error("store check timed out")]
    Timeout,
    /// The circuit breaker is open: the store is known to be down and was not asked.
    #[error("store circuit breaker is open")]
    CircuitOpen,
    /// The connection to Redis failed (transient: the next call may succeed).
    #[error("redis: {0}")]
    Redis(String),
    /// Redis refused a command or the script raised an error on a healthy server (permanent:
    /// the same call fails again).
    #[error("redis refused the call: {0}")]
    Script(String),
    /// The reply had an unexpected shape.
    #[error("unexpected store reply: {0}")]
    Protocol(String),
    /// The Redis user lacks a permission the scripts or the gateway need (`NOPERM`): a
    /// configuration mistake, never transient (docs/operations.md, "Redis ACL").
    #[error("the Redis user lacks a permission tollgate needs (see docs/operations.md#redis-acl): {0}")]
    Permission(String),
    /// The memory store is full of entries it may not forget (denying keys, held slots) and
    /// refused a new key (`store.memory_max_keys`); passes as those entries expire.
    #[error("the memory store is full of denying keys (store.memory_max_keys)")]
    Full,
}

impl StoreError {
    /// True for failures that may pass by themselves (timeouts, an open breaker, a broken
    /// connection); false for a reply Redis will give again (a refused script call, a malformed
    /// reply).
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            StoreError::Timeout | StoreError::CircuitOpen | StoreError::Redis(_) | StoreError::Full
        )
    }
}

/// What a store answered for one request's checks.
#[derive(Debug, Clone, Default)]
pub struct Checked {
    /// One per check, in order. Where a check failed (see `failed`) this is a placeholder.
    pub outcomes: Outcomes,
    /// The checks the store could not decide (their shard failed or timed out), with why. Empty
    /// when every check was decided, which is the common case (no allocation).
    pub failed: Vec<(usize, StoreError)>,
}

impl Checked {
    /// The outcomes when every check was decided, else the first failure.
    pub fn into_result(self) -> Result<Outcomes, StoreError> {
        match self.failed.into_iter().next() {
            None => Ok(self.outcomes),
            Some((_, e)) => Err(e),
        }
    }

    /// Every one of `n` checks failed with `e`.
    pub fn all_failed(n: usize, e: StoreError) -> Self {
        Checked {
            outcomes: smallvec::smallvec![Outcome::default(); n],
            failed: (0..n).map(|i| (i, e.clone())).collect(),
        }
    }
}

/// A place where counters live. Implementations are all-or-nothing: when any non-shadow limit
/// in `checks` denies, no limit's quota is spent (a limit on another Redis slot may be spent and
/// refunded within the same call).
pub trait Store: Send + Sync + 'static {
    /// Check and spend every limit in `checks`; one [`Outcome`] per check, in order. Checks whose
    /// part of the store failed are listed in [`Checked::failed`]; the others were decided (a
    /// denial among them stands, and nothing of a denied request stays spent).
    fn check<C: AsRef<LimitCheck> + Sync>(&self, checks: &[C]) -> impl Future<Output = Checked> + Send;

    /// Give back exactly what admitted checks spent: each `(check, at_us)` names the instant
    /// its check was decided ([`Outcome::at_us`]), so window units come off the window they
    /// were counted in.
    fn refund(&self, spent: &[(LimitCheck, u64)]) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Current state of each limit, as the outcome a cost-0 request would get. `None` where the
    /// store holds nothing for that key.
    fn peek(&self, checks: &[LimitCheck]) -> impl Future<Output = Result<Vec<Option<Outcome>>, StoreError>> + Send;

    /// Spend each check's `cost` more, without checking, at the store's now: the real cost of a
    /// request, reported after its response, was above what it reserved (`cost_from`). The
    /// debit lands in the window of now (the check's window while it lasts), never dropped, and
    /// takes a key at most one quota below zero (see [`crate::limiter::algorithm::debit`]).
    fn debit(&self, debits: &[LimitCheck]) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Push the concurrency slots of `held` (requests still running) out to a full time to
    /// live, so a long request keeps its slot; checks that are not slots are ignored.
    fn renew(&self, held: &[LimitCheck]) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Every field and value of the small shared table at `key` (the runtime overrides).
    fn table_load(&self, key: &str) -> impl Future<Output = Result<Vec<(String, String)>, StoreError>> + Send;

    /// Set `field` of the table at `key` to `value`, or remove it when `value` is `None`.
    fn table_set(
        &self,
        key: &str,
        field: &str,
        value: Option<&str>,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Forget the counters at `keys`, and lift their penalties.
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
    async fn check<C: AsRef<LimitCheck> + Sync>(&self, checks: &[C]) -> Checked {
        match self {
            Backend::Memory(m) => m.check(checks).await,
            // Boxed: the Redis call's state machine is kilobytes, and inline it would make
            // every request's future that large, memory store included (memcpy per request).
            // One allocation per store round trip is nothing beside the round trip.
            Backend::Redis(r) => Box::pin(r.check(checks)).await,
        }
    }
    async fn refund(&self, spent: &[(LimitCheck, u64)]) -> Result<(), StoreError> {
        match self {
            Backend::Memory(m) => m.refund(spent).await,
            Backend::Redis(r) => r.refund(spent).await,
        }
    }
    async fn peek(&self, checks: &[LimitCheck]) -> Result<Vec<Option<Outcome>>, StoreError> {
        match self {
            Backend::Memory(m) => m.peek(checks).await,
            Backend::Redis(r) => r.peek(checks).await,
        }
    }
    async fn debit(&self, debits: &[LimitCheck]) -> Result<(), StoreError> {
        match self {
            Backend::Memory(m) => m.debit(debits).await,
            Backend::Redis(r) => r.debit(debits).await,
        }
    }
    async fn table_load(&self, key: &str) -> Result<Vec<(String, String)>, StoreError> {
        match self {
            Backend::Memory(m) => m.table_load(key).await,
            Backend::Redis(r) => r.table_load(key).await,
        }
    }
    async fn table_set(&self, key: &str, field: &str, value: Option<&str>) -> Result<(), StoreError> {
        match self {
            Backend::Memory(m) => m.table_set(key, field, value).await,
            Backend::Redis(r) => r.table_set(key, field, value).await,
        }
    }
    async fn renew(&self, held: &[LimitCheck]) -> Result<(), StoreError> {
        match self {
            Backend::Memory(m) => m.renew(held).await,
            Backend::Redis(r) => r.renew(held).await,
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
