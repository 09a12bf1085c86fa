//! The Redis and Redis Cluster store.
//!
//! # The script
//! Every algorithm lives in `lua/` as a fragment; [`SCRIPT_SOURCE`] concatenates them with
//! `lua/check.lua`, the dispatcher, into **one** script. One call (`FCALL` or `EVALSHA`) checks every
//! limit of a request that lives on one Redis Cluster slot (all keys sharing one `{hash tag}`),
//! whatever their algorithms, atomically: evaluate every key, and spend only if no non-shadow
//! key denied. Time comes from Redis `TIME` inside the script (tests may pass `now`), so
//! gateways with skewed clocks agree, and every written key gets its expiry in the same script.
//!
//! How it is run (`store.scripting`, [`RedisStore::set_scripting`]):
//! * **Redis functions** (`auto`, the default, and `functions`): the script is registered as
//!   the function `tollgate_<SHA1 of the source>` of a library of the same name (see
//!   `protocol::function_library`) and called with `FCALL`. A call that finds no such function
//!   (a fresh or restarted node, `FUNCTION FLUSH`, a node added to the cluster) loads the
//!   library with `FUNCTION LOAD` on the node the call went to (routed by the call's first key,
//!   like the call; every master for a keyless probe) and repeats the call once. So each node
//!   is loaded once, on first use, with no set-up per call; and since libraries are replicated,
//!   a promoted replica already has it. The name pins the source, so loads need no `REPLACE`:
//!   a node that has it answers "already exists" without compiling, and gateways of different
//!   versions keep their own libraries side by side.
//! * **`EVALSHA`** (`eval`, and `auto` once a server answered "unknown command" to `FCALL`, as
//!   Redis 6 does; `auto` then stays on `EVALSHA` until the process restarts): the script is
//!   called by its precomputed SHA1. On `NOSCRIPT` (a fresh or restarted node, a failover to a
//!   replica that never saw the script, `SCRIPT FLUSH`) the same call is repeated as `EVAL`
//!   with the source, which also caches the script on that node; in a cluster the `EVAL` is
//!   routed by key like the `EVALSHA`, so it lands on exactly the node that lacked it.
//!
//! Both take the same keys and arguments, and run the same source.
//!
//! # Several slots: all or nothing with refunds
//! [`RedisStore::check`] groups the checks by hash tag and sends one script call per group,
//! concurrently. If any non-shadow limit in any group denied, the groups whose script spent
//! (no non-shadow denial inside that group) are refunded with the `now` their script used, so
//! a rejected request consumes nothing anywhere.
//!
//! **Transient over-count bound.** Between a group's spend and its refund (about one extra
//! round trip; at most `timeout` while the refund is in flight), each key of that group holds
//! at most `cost` extra units per concurrently rejected cross-slot request. A request checked
//! in that interval may therefore be *denied* by quota that is about to be given back; nothing
//! is ever *over-admitted*. If the refund itself fails (the node dies in between) those units
//! stay spent until the bucket refills or the window passes: again an under-admission, bounded
//! by one window. Refunds run in a spawned task so they finish even when the caller's timeout
//! drops the check future. If a group *errors* while another spent, the spend stays (the
//! rule's failure policy then decides the request; if it forwards the request, the spend was
//! right; if it rejects it, that is a bounded under-admission).
//!
//! # Batching
//! Production checks (`now` from Redis) do not call Redis themselves: they go to the store's
//! batch task (module `batch`), which keeps at most one call in flight per slot and sends what
//! queued meanwhile as one `check` call (the script's batch layout, see `lua/check.lua`). Tests
//! that pass an explicit `now` send a batch of one directly. Peek, refund and reset are rare and
//! not batched.
//!
//! # Failure, per shard
//! Each master has its own circuit breaker (module `slots`): a request's limits on a failed
//! shard fail (and follow their rule's failure policy); the rest are decided as usual.
//!
//! # Layout
//! | module | what it does |
//! |---|---|
//! | `conn` | connections, the shared state, connection rebuilds, errors |
//! | `script` | running the scripts (functions or `EVALSHA`), loading them, `WAIT` |
//! | `topology` | the slot map (`CLUSTER SLOTS`) and each shard's clock offset |
//! | `protocol` | the script, the commands it is sent, its one reply format |
//! | `slots` | slot of a key, grouping by slot, shards and their breakers |
//! | `batch` | one call in flight per slot; what queues meanwhile goes out as one batch |

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::{ArcSwap, ArcSwapOption};
use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};
use redis::{Cmd, IntoConnectionInfo};

pub use batch::MAX_BATCH;
pub use conn::REBUILD_INTERVAL;
pub use protocol::SCRIPT_SOURCE;

use super::algorithm::{Algorithm, Quota};
use super::{Checked, LimitCheck, Outcome, Store, StoreError, StoreKey};
use conn::{open, Inner, Target};
use protocol::{keyless_peek, peeked, Mode};
use script::path_of;
use slots::group_by_tag;

/// How long a reset's marker lives: a refund of units spent before a reset is dropped while
/// it does, so a request in flight at `DELETE /keys` that settles within this time gives
/// nothing to the new count.
pub const RESET_MARKER_LIFE: Duration = Duration::from_secs(3600);

/// The key [`Store::probe`] checks (a cost-0 token-bucket check: it admits nothing and expires
/// within a millisecond). Outside any key prefix so it can never collide with a limit.
pub const PROBE_KEY: &str = "tollgate:probe:{tollgate-probe}";

/// Standalone Redis or Redis Cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RedisMode {
    /// One server (`store.kind: redis`).
    Single,
    /// A cluster, from any seed nodes (`store.kind: redis_cluster`).
    Cluster,
}

/// A store on Redis or Redis Cluster. See the module docs.
pub struct RedisStore {
    /// Shared with the rebuild, refund and batch tasks.
    inner: Arc<Inner>,
    /// The batch task that sends every production check (see [`batch`]). Dropping the store
    /// drops this sender, which ends the task.
    batches: batch::Batches,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("mode", &self.inner.mode)
            .field("urls", &self.inner.urls.len())
            .field("timeout", &self.inner.timeout)
            .finish()
    }
}

/// The URLs for logs, passwords redacted.
fn redacted_targets(urls: &[String]) -> String {
    urls.iter().map(|u| redact_url(u)).collect::<Vec<_>>().join(",")
}

impl RedisStore {
    /// Connect to `urls` (one server, or cluster seeds). `timeout` is the per-check deadline;
    /// it also bounds every Redis response, and connecting takes at most a few times it.
    ///
    /// When Redis cannot be reached now, the store still starts (so the gateway serves, with each
    /// rule's failure policy) and keeps connecting in the background; only a configuration
    /// error (a malformed URL) fails here.
    /// `threshold` consecutive failed calls open one shard's breaker.
    pub async fn connect(
        mode: RedisMode,
        urls: &[String],
        timeout: Duration,
        threshold: u32,
    ) -> Result<Self, StoreError> {
        Self::connect_with(mode, urls, timeout, threshold, conn::Auth::default()).await
    }

    /// [`RedisStore::connect`] with a password and TLS roots (`store.password_env`,
    /// `store.tls.ca_file`).
    pub async fn connect_with(
        mode: RedisMode,
        urls: &[String],
        timeout: Duration,
        threshold: u32,
        auth: conn::Auth,
    ) -> Result<Self, StoreError> {
        let conn = match open(mode, urls, timeout, &auth).await {
            Ok(c) => Some(Arc::new(c)),
            Err(e) if urls.iter().all(|u| u.as_str().into_connection_info().is_ok()) && !urls.is_empty() => {
                tracing::warn!(error = %e, ?mode, targets = %redacted_targets(urls), "Redis is unreachable at start-up; serving with each rule's failure policy and retrying in the background");
                None
            }
            Err(e) => return Err(e),
        };
        let sha = redis::Script::new(SCRIPT_SOURCE).get_hash().to_owned();
        let function = protocol::function_name(&sha);
        let inner = Arc::new(Inner {
            mode,
            urls: urls.to_vec(),
            auth,
            timeout,
            conn: ArcSwapOption::new(conn),
            sha,
            library: protocol::function_library(&function),
            function,
            path: AtomicU8::new(path_of(Scripting::Auto)),
            last_rebuild_ms: AtomicU64::new(0),
            rebuilding: AtomicBool::new(false),
            rebuilds: AtomicU64::new(0),
            epoch: Instant::now(),
            topo: ArcSwap::from_pointee(slots::Topology::single(
                urls.first().map_or_else(String::new, |u| redact_url(u)),
                threshold,
            )),
            threshold: threshold.max(1),
            targets: redacted_targets(urls),
            rebuild_log: crate::log_throttle::LogThrottle::new(Duration::from_secs(60)),
            rebuilt_log: crate::log_throttle::LogThrottle::new(Duration::from_secs(60)),
            batch_calls: AtomicU64::new(0),
            batch_requests: AtomicU64::new(0),
            replicated: AtomicBool::new(false),
        });
        inner.refresh_topology().await;
        let batches = batch::Batches::spawn(Arc::clone(&inner));
        Ok(RedisStore { inner, batches })
    }

    /// `store.durability: replicated`: every write waits until a replica confirmed it (`WAIT 1`)
    /// within the store deadline, else it counts as a store failure. Trades a replica round trip
    /// per call for no over-admission when a master dies before replicating.
    pub fn set_replicated(&self, on: bool) {
        self.inner.replicated.store(on, Ordering::Relaxed);
    }

    /// `store.scripting`: how the limit script is run from now on (see the module docs, "The
    /// script"). `Auto` (the default) uses Redis functions and switches to `EVALSHA` for good
    /// the first time a server answers that it has no FCALL.
    pub fn set_scripting(&self, scripting: Scripting) {
        self.inner.path.store(path_of(scripting), Ordering::Relaxed);
    }

    /// The name of the Redis function (and of its library) that `FCALL` calls:
    /// `tollgate_<SHA1 of SCRIPT_SOURCE>`.
    pub fn function_name(&self) -> &str {
        &self.inner.function
    }

    /// Standalone or cluster.
    pub fn mode(&self) -> RedisMode {
        self.inner.mode
    }

    /// The per-call deadline this store was built with.
    pub fn timeout(&self) -> Duration {
        self.inner.timeout
    }

    /// The SHA1 of [`SCRIPT_SOURCE`] that `EVALSHA` uses.
    pub fn script_sha(&self) -> &str {
        &self.inner.sha
    }

    /// How many times the connection was rebuilt after repeated failures.
    pub fn rebuilds(&self) -> u64 {
        self.inner.rebuilds.load(Ordering::Relaxed)
    }

    /// Batched `check` calls sent so far and the requests they carried: under load there are
    /// fewer calls than requests (see the module docs, "Batching").
    pub fn batch_stats(&self) -> (u64, u64) {
        (
            self.inner.batch_calls.load(Ordering::Relaxed),
            self.inner.batch_requests.load(Ordering::Relaxed),
        )
    }

    /// Peek at `checks` grouped by slot, concurrently; one entry per check.
    async fn peek_groups(&self, checks: &[LimitCheck]) -> Result<Vec<Option<Outcome>>, StoreError> {
        if checks.is_empty() {
            return Ok(Vec::new());
        }
        let inner = &self.inner;
        let groups = group_by_tag(checks.iter().map(|c| &c.key));
        let calls = groups
            .iter()
            .map(|g| inner.call(Mode::Peek, None, g.iter().map(|&i| &checks[i]), peeked));
        let results = futures_util::future::join_all(calls).await;
        let mut out = vec![None; checks.len()];
        for (g, r) in groups.iter().zip(results) {
            let (_, outs) = r?;
            for (&i, o) in g.iter().zip(outs) {
                out[i] = o;
            }
        }
        Ok(out)
    }

    /// Probe every shard whose breaker is open (after re-reading the slot map and, at most once
    /// per [`REBUILD_INTERVAL`], rebuilding the connection) and close the breakers of those that
    /// answer the script path again. Returns how many breakers are still open.
    pub async fn heal(&self) -> usize {
        let inner = &self.inner;
        if inner.topo.load().open_shards().next().is_none() {
            return 0;
        }
        inner.maybe_rebuild();
        inner.refresh_topology().await;
        let open: Vec<Arc<slots::Shard>> = inner.topo.load().open_shards().cloned().collect();
        for shard in &open {
            // The shard itself first, on a connection of its own: the cluster client may
            // answer a call routed to a dead master from another node, which would close the
            // breaker of a shard that is still down (it flapped open and closed every probe).
            if inner.mode == RedisMode::Cluster {
                if let Err(e) = conn::ping_node(inner, &shard.addr).await {
                    tracing::debug!(shard = %shard.addr, error = %e, "store shard does not answer itself; breaker stays open");
                    continue;
                }
            }
            // A keyless peek on the shard's master: routing and the script (loaded if missing).
            let target = match shard.probe_slot {
                Some(slot) if inner.mode == RedisMode::Cluster => Target::Node(RoutingInfo::SingleNode(
                    SingleNodeRoutingInfo::SpecificNode(Route::new(slot, SlotAddr::Master)),
                )),
                _ => Target::ByKey,
            };
            let probe = inner.run_script(&keyless_peek, &target);
            match tokio::time::timeout(inner.timeout.max(Duration::from_millis(100)), probe).await {
                Ok(Ok(_)) => {
                    if shard.breaker.close() {
                        tracing::warn!(shard = %shard.addr, "store shard is back: its circuit breaker closed");
                    }
                }
                Ok(Err(e)) => {
                    tracing::debug!(shard = %shard.addr, error = %e, "store shard probe failed; breaker stays open")
                }
                Err(_) => tracing::debug!(shard = %shard.addr, "store shard probe timed out; breaker stays open"),
            }
        }
        inner.topo.load().open_shards().count()
    }

    /// Run `mode` (a refund) on what admitted checks spent: one call per slot, at the
    /// `now` that slot's check used, concurrently.
    async fn at_spent(&self, mode: Mode, spent: &[(LimitCheck, u64)]) -> Result<(), StoreError> {
        if spent.is_empty() {
            return Ok(());
        }
        let groups = group_by_tag(spent.iter().map(|(c, _)| &c.key));
        let inner = &self.inner;
        let calls = groups.iter().map(|g| {
            let at = g.first().map(|&i| spent[i].1);
            inner.call(mode, at, g.iter().map(|&i| &spent[i].0), peeked)
        });
        for r in futures_util::future::join_all(calls).await {
            r?;
        }
        Ok(())
    }

    /// Spend each check's `cost` more at `now` (`None`: Redis `TIME`, the normal case; tests
    /// pass an explicit instant), without checking: one call per slot, concurrently.
    pub async fn debit_at(&self, debits: &[LimitCheck], now: Option<u64>) -> Result<(), StoreError> {
        if debits.is_empty() {
            return Ok(());
        }
        let groups = group_by_tag(debits.iter().map(|c| &c.key));
        let inner = &self.inner;
        let calls = groups
            .iter()
            .map(|g| inner.call(Mode::Debit, now, g.iter().map(|&i| &debits[i]), peeked));
        for r in futures_util::future::join_all(calls).await {
            r?;
        }
        Ok(())
    }

    /// Reset the counters at `counters` and lift the penalties of every limit at `counters` and
    /// `slots` (concurrency keys, whose slots survive: they are requests running now, released
    /// by their holders or expiring by their time to live), such that no lease or refund from
    /// before the reset reaches the new count (ARCHITECTURE.md, "Leases never let the fleet
    /// exceed a limit"):
    ///
    /// 1. Each counter's reset marker ([`LimitCheck::reset_key`], same slot) is set to Redis'
    ///    now, for `2 × hold + 2 × store.timeout + 1 s`. While it exists the script grants no
    ///    lease of that key, and drops every refund or lease return whose spending instant is
    ///    at or before the marker (it would give old-count units to the new count).
    /// 2. Wait `hold`, the lease time to live: every lease taken before the marker has then
    ///    expired on its node (a lease lives `ttl` from before its call was sent), so none
    ///    admits from old-count units after the new count starts; meanwhile the old count
    ///    still decides.
    /// 3. Delete the counters and penalty keys: the new count starts at zero.
    ///
    /// Leases of the key are granted again once every lease taken before the marker has been
    /// returned (at most 1.5 × ttl after it was taken, within twice the store deadline). The
    /// marker itself lives [`RESET_MARKER_LIFE`], so a request in flight at the reset whose
    /// response settles later (a `count_when` refund, a `cost_from` settlement) gives nothing
    /// to the new count either, if it settles within that time.
    pub async fn reset_settled(
        &self,
        counters: &[StoreKey],
        slots: &[StoreKey],
        hold: Duration,
    ) -> Result<(), StoreError> {
        let inner = &self.inner;
        if !counters.is_empty() {
            let settling = hold.saturating_mul(2) + inner.timeout.saturating_mul(2) + Duration::from_secs(1);
            let ms = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
            let (life_ms, lease_ms) = (ms(settling.max(RESET_MARKER_LIFE)), ms(settling));
            let groups = group_by_tag(counters.iter());
            let marks = groups.iter().map(|g| {
                let keys = g.iter().map(|&i| &counters[i]);
                inner.script(true, move |how| {
                    protocol::reset_cmd(how, keys.clone(), life_ms, lease_ms)
                })
            });
            for r in futures_util::future::join_all(marks).await {
                r?;
            }
            if !hold.is_zero() {
                tokio::time::sleep(hold).await;
            }
        }
        // One DEL per slot (a multi-key DEL must stay within one slot in a cluster); a limit's
        // penalty key shares its hash tag, so it goes in the same DEL.
        let all: Vec<(&StoreKey, bool)> = counters
            .iter()
            .map(|k| (k, true))
            .chain(slots.iter().map(|k| (k, false)))
            .collect();
        let groups = group_by_tag(all.iter().map(|(k, _)| *k));
        let cmds: Vec<Cmd> = groups
            .iter()
            .map(|g| {
                let mut cmd = redis::cmd("DEL");
                for &i in g {
                    let (key, counter) = all[i];
                    if counter {
                        cmd.arg(key.as_str());
                    }
                    cmd.arg(LimitCheck::penalty_key(key));
                }
                cmd
            })
            .collect();
        let results = futures_util::future::join_all(cmds.iter().map(|c| inner.command(c))).await;
        for r in results {
            r?;
        }
        Ok(())
    }

    /// Number of shards whose breaker is open now.
    pub fn open_breakers(&self) -> usize {
        self.inner.topo.load().open_shards().count()
    }

    /// Every shard now: its address (no password), whether its breaker is open, and how many
    /// times that breaker has opened. For the admin dashboard.
    pub fn shard_states(&self) -> Vec<(String, bool, u64)> {
        self.inner
            .topo
            .load()
            .shards
            .iter()
            .map(|s| (s.addr.clone(), s.breaker.is_open(), s.breaker.opened_total()))
            .collect()
    }
}

impl Store for RedisStore {
    async fn check<C: AsRef<LimitCheck> + Sync>(&self, checks: &[C]) -> Checked {
        self.check_at(checks, None).await
    }

    /// Refund each slot's spending at the `now` its check used, so window units come off the
    /// window they were counted in.
    async fn refund(&self, spent: &[(LimitCheck, u64)]) -> Result<(), StoreError> {
        self.at_spent(Mode::Refund, spent).await
    }

    async fn peek(&self, checks: &[LimitCheck]) -> Result<Vec<Option<Outcome>>, StoreError> {
        self.peek_groups(checks).await
    }

    async fn table_load(&self, key: &str) -> Result<Vec<(String, String)>, StoreError> {
        let mut cmd = redis::cmd("HGETALL");
        cmd.arg(key);
        let v = self.inner.command(&cmd).await?;
        redis::from_redis_value::<Vec<(String, String)>>(v).map_err(|e| StoreError::Protocol(e.to_string()))
    }

    async fn table_set(&self, key: &str, field: &str, value: Option<&str>) -> Result<(), StoreError> {
        let mut cmd = match value {
            Some(_) => redis::cmd("HSET"),
            None => redis::cmd("HDEL"),
        };
        cmd.arg(key).arg(field);
        if let Some(v) = value {
            cmd.arg(v);
        }
        self.inner.command(&cmd).await.map(|_| ())
    }

    /// Debit at Redis' own `TIME`, one call per slot (see [`RedisStore::debit_at`]).
    async fn debit(&self, debits: &[LimitCheck]) -> Result<(), StoreError> {
        self.debit_at(debits, None).await
    }

    async fn renew(&self, held: &[LimitCheck]) -> Result<(), StoreError> {
        let slots: Vec<&LimitCheck> = held.iter().filter(|c| c.is_slot()).collect();
        if slots.is_empty() {
            return Ok(());
        }
        let groups = group_by_tag(slots.iter().map(|c| &c.key));
        let inner = &self.inner;
        let calls = groups
            .iter()
            .map(|g| inner.call(Mode::Renew, None, g.iter().map(|&i| slots[i]), peeked));
        let mut first = Ok(());
        for r in futures_util::future::join_all(calls).await {
            if let (Err(e), Ok(())) = (r, &first) {
                first = Err(e);
            }
        }
        first
    }

    /// [`RedisStore::reset_settled`] of `keys` as counters, without waiting for leases.
    async fn reset(&self, keys: &[StoreKey]) -> Result<(), StoreError> {
        self.reset_settled(keys, &[], Duration::ZERO).await
    }

    /// A cost-0 token-bucket check on [`PROBE_KEY`] through the real script path (routing,
    /// function or script, writes); in a cluster also a keyless run of the script on every
    /// master (loading it where it is missing), so a frozen or scriptless master fails the probe.
    async fn probe(&self) -> Result<(), StoreError> {
        let probe = LimitCheck::new(
            StoreKey::from(PROBE_KEY),
            Quota::bucket(
                Algorithm::TokenBucket,
                std::num::NonZeroU64::MIN,
                std::num::NonZeroU64::MIN,
            ),
            0,
        );
        if let Some((_, e)) = self
            .check_at(std::slice::from_ref(&probe), None)
            .await
            .failed
            .into_iter()
            .next()
        {
            return Err(e);
        }
        if self.inner.mode == RedisMode::Cluster {
            let inner = &self.inner;
            match tokio::time::timeout(inner.timeout, inner.run_script(&keyless_peek, &Target::AllMasters)).await {
                Ok(r) => r.map(|_| ()).map_err(conn::store_err)?,
                Err(_) => return Err(StoreError::Timeout),
            }
        }
        Ok(())
    }
}

/// `url` with any password replaced by `***` (for logs and `tollgate check`). Text that does not
/// parse as a URL is shown up to its last `@` only as `***@…`, so a password never leaks.
pub fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return match url.rsplit_once('@') {
            Some((_, host)) => format!("***@{host}"),
            None => url.to_string(),
        };
    };
    let (auth, tail) = match rest.find(['/', '?', '#']) {
        Some(i) => rest.split_at(i),
        None => (rest, ""),
    };
    match auth.rsplit_once('@') {
        Some((userinfo, host)) => {
            let user = userinfo.split_once(':').map_or("", |(u, _)| u);
            let shown = if userinfo.contains(':') {
                format!("{user}:***")
            } else {
                "***".to_string()
            };
            format!("{scheme}://{shown}@{host}{tail}")
        }
        None => url.to_string(),
    }
}

/// `store.scripting`: how the limit script is run on Redis.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Scripting {
    /// Redis functions (`FCALL`, the library loaded once per node) where the server has
    /// them (Redis 7+); `EVALSHA` on a server that answers "unknown command" (Redis 6).
    #[default]
    Auto,
    /// Redis functions only: a server without them fails every check (no fallback).
    Functions,
    /// `EVALSHA`, with `EVAL` on NOSCRIPT, whatever the server supports (the Redis 6 path).
    Eval,
}

mod batch;
mod conn;
pub use conn::Auth as RedisAuth;
mod protocol;
mod script;
mod slots;
mod topology;

#[cfg(test)]
mod tests;
