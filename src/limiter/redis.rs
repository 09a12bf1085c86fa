//! The Redis and Redis Cluster store.
//!
//! # The script
//! Every algorithm lives in `lua/` as a fragment; [`SCRIPT_SOURCE`] concatenates them with
//! `lua/check.lua`, the dispatcher, into **one** script. One `EVALSHA` therefore checks every
//! limit of a request that lives on one Redis Cluster slot (all keys sharing one `{hash tag}`),
//! whatever their algorithms, atomically: evaluate every key, and spend only if no non-shadow
//! key denied. Time comes from Redis `TIME` inside the script (tests may pass `now`), so
//! gateways with skewed clocks agree, and every written key gets its expiry in the same script.
//!
//! The script is called by its precomputed SHA1. On `NOSCRIPT` (a fresh or restarted node, a
//! failover to a replica that never saw the script, `SCRIPT FLUSH`) the same call is repeated
//! as `EVAL` with the source, which also caches the script on that node; in a cluster the
//! `EVAL` is routed by key like the `EVALSHA`, so it lands on exactly the node that lacked it.
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
//! # Connections and concurrency
//! * Standalone: one [`ConnectionManager`] (a multiplexed, pipelined connection that reconnects
//!   by itself when the TCP connection drops) with connection and response timeouts and
//!   `TCP_NODELAY`.
//! * Cluster: one async [`ClusterConnection`] (multiplexed connections to every node) with
//!   `response_timeout`, `connection_timeout`, two retries and millisecond retry waits —
//!   `MOVED`/`ASK`/`TRYAGAIN`/`READONLY` are retried by the client within the deadline.
//!
//! Both are cheap to clone (an `Arc` or a channel sender). The current connection sits in an
//! [`ArcSwapOption`]: each call loads it, clones it out and drops the guard *before* awaiting, so no
//! lock or guard is ever held across an `.await` and requests never contend on it.
//!
//! # A frozen node
//! A master stopped with `SIGSTOP` keeps its TCP connections open: the client keeps routing its
//! slots to it and times out forever, even after a replica took over. The store counts
//! consecutive failed calls (errors, its own timeouts, and calls dropped by the caller's
//! timeout, detected by a drop guard); after [`REBUILD_AFTER`] of them it rebuilds the whole
//! connection from the configured URLs (which re-reads the cluster topology) in a spawned task
//! — at most once per [`REBUILD_INTERVAL`], one at a time — and swaps it in. Requests never
//! wait for a rebuild.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::{ArcSwap, ArcSwapOption};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClientBuilder;
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{MultipleNodeRoutingInfo, Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};
use redis::io::tcp::TcpSettings;
use redis::{Cmd, ErrorKind, IntoConnectionInfo, RedisError, ServerErrorKind, Value};

pub use batch::MAX_BATCH;

use super::algorithm::{Algorithm, Quota};
use super::{Checked, LimitCheck, Outcome, Store, StoreError, StoreKey};

/// The combined limit script: the shared helpers, one fragment per algorithm, and the
/// dispatcher `lua/check.lua` (see each file's header for KEYS, ARGV and the reply).
pub const SCRIPT_SOURCE: &str = concat!(
    include_str!("../../lua/common.lua"),
    include_str!("../../lua/token_bucket.lua"),
    include_str!("../../lua/leaky_bucket.lua"),
    include_str!("../../lua/fixed_window.lua"),
    include_str!("../../lua/sliding_log.lua"),
    include_str!("../../lua/sliding_window.lua"),
    include_str!("../../lua/check.lua"),
);

/// Consecutive failed calls after which the connection is rebuilt.
pub const REBUILD_AFTER: u32 = 3;

/// Minimum time between two connection rebuilds.
pub const REBUILD_INTERVAL: Duration = Duration::from_millis(500);

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

/// A live connection of either kind. Cloning is cheap and shares the underlying connection.
#[derive(Clone)]
enum Conn {
    /// Standalone server.
    Single(ConnectionManager),
    /// Cluster.
    Cluster(ClusterConnection),
}

impl Conn {
    /// Send one command, routed by its first key in a cluster.
    async fn query(&mut self, cmd: &Cmd) -> Result<Value, RedisError> {
        match self {
            Conn::Single(c) => cmd.query_async(c).await,
            Conn::Cluster(c) => cmd.query_async(c).await,
        }
    }

    /// Send one command to every master (the server itself when standalone); `Ok` only if
    /// every one of them succeeded. Each node's reply is inspected: the client's aggregating
    /// response policies pass a node's error reply through as a value.
    async fn query_all_masters(&mut self, cmd: Cmd) -> Result<(), RedisError> {
        match self {
            Conn::Single(c) => cmd.query_async::<Value>(c).await.map(|_| ()),
            Conn::Cluster(c) => {
                let routing = RoutingInfo::MultiNode((MultipleNodeRoutingInfo::AllMasters, None));
                match c.route_command(cmd, routing).await? {
                    Value::Map(replies) => {
                        for (_, reply) in replies {
                            reply.extract_error()?;
                        }
                        Ok(())
                    }
                    other => other.extract_error().map(|_| ()),
                }
            }
        }
    }
}

/// What the script should do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Evaluate every key; spend all admitted ones unless a non-shadow key denied.
    Check,
    /// Give back `cost` on every key.
    Refund,
    /// Evaluate with cost 0, write nothing.
    Peek,
}

impl Mode {
    fn as_str(self) -> &'static str {
        match self {
            Mode::Check => "check",
            Mode::Refund => "refund",
            Mode::Peek => "peek",
        }
    }
}

/// State shared by every clone of the store and by the rebuild task.
struct Inner {
    /// Standalone or cluster.
    mode: RedisMode,
    /// The configured URLs (the server, or cluster seeds), for rebuilds.
    urls: Vec<String>,
    /// Deadline of one store call.
    timeout: Duration,
    /// The current connection; swapped whole by a rebuild, loaded and cloned by every call.
    conn: ArcSwapOption<Conn>,
    /// SHA1 of [`SCRIPT_SOURCE`], for EVALSHA.
    sha: String,
    /// Failed calls in a row (reset by any success).
    failures: AtomicU32,
    /// When the last rebuild started, in milliseconds since `epoch` (0 = never).
    last_rebuild_ms: AtomicU64,
    /// A rebuild task is running (single flight).
    rebuilding: AtomicBool,
    /// Connection rebuilds completed so far (for tests and logs).
    rebuilds: AtomicU64,
    /// Origin of `last_rebuild_ms`.
    epoch: Instant,
    /// Which shard owns each slot, with one breaker per shard (see [`slots`]). Loaded once per
    /// check and swapped whole by a refresh.
    topo: ArcSwap<slots::Topology>,
    /// Consecutive failed calls that open a shard's breaker.
    threshold: u32,
    /// The configured URLs with passwords redacted, for logs.
    targets: String,
    /// Repeated rebuild failures are logged at most once a minute.
    rebuild_log: crate::log_throttle::LogThrottle,
    /// Batched `check` calls sent so far (see [`batch`]).
    batch_calls: AtomicU64,
    /// Requests those calls carried.
    batch_requests: AtomicU64,
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

/// Map a client error to a store error.
fn store_err(e: RedisError) -> StoreError {
    if e.is_timeout() {
        StoreError::Timeout
    } else {
        StoreError::Redis(e.to_string())
    }
}

/// True when `e` says something about the connection's health (as opposed to an error the
/// script or a command raised on a healthy server), so it counts towards a rebuild.
fn is_health_error(e: &RedisError) -> bool {
    !matches!(
        e.kind(),
        ErrorKind::Server(
            ServerErrorKind::ResponseError
                | ServerErrorKind::ExecAbort
                | ServerErrorKind::NoScript
                | ServerErrorKind::CrossSlot
                | ServerErrorKind::NoPerm
                | ServerErrorKind::NotBusy
                | ServerErrorKind::NoSub
        ) | ErrorKind::Extension
            | ErrorKind::UnexpectedReturnType
            | ErrorKind::Client
            | ErrorKind::InvalidClientConfig
    )
}

/// True for a NOSCRIPT reply.
fn is_noscript(e: &RedisError) -> bool {
    e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) || e.code() == Some("NOSCRIPT")
}

/// The URLs for logs, passwords redacted.
fn redacted_targets(urls: &[String]) -> String {
    urls.iter()
        .map(|u| crate::config::redact_url(u))
        .collect::<Vec<_>>()
        .join(",")
}

/// The connection timeout used when (re)connecting: a few call deadlines, within [100ms, 1s].
fn connect_timeout(timeout: Duration) -> Duration {
    timeout
        .saturating_mul(4)
        .clamp(Duration::from_millis(100), Duration::from_secs(1))
}

/// Open a connection of `mode` to `urls`.
async fn open(mode: RedisMode, urls: &[String], timeout: Duration) -> Result<Conn, StoreError> {
    let ct = connect_timeout(timeout);
    // Bound the whole handshake (several nodes for a cluster, one retry for a server).
    let deadline = ct.saturating_mul(3);
    let nodelay = TcpSettings::default().set_nodelay(true);
    match mode {
        RedisMode::Single => {
            let url = urls
                .first()
                .ok_or_else(|| StoreError::Redis("no Redis URL configured".into()))?;
            let info = url.as_str().into_connection_info().map_err(store_err)?;
            let info = info.set_tcp_settings(nodelay);
            let client = redis::Client::open(info).map_err(store_err)?;
            let config = ConnectionManagerConfig::new()
                .set_response_timeout(Some(timeout))
                .set_connection_timeout(Some(ct))
                .set_number_of_retries(1)
                .set_min_delay(Duration::from_millis(5))
                .set_max_delay(Duration::from_millis(50));
            let cm = tokio::time::timeout(deadline, ConnectionManager::new_with_config(client, config))
                .await
                .map_err(|_| StoreError::Timeout)?
                .map_err(store_err)?;
            Ok(Conn::Single(cm))
        }
        RedisMode::Cluster => {
            if urls.is_empty() {
                return Err(StoreError::Redis("no Redis Cluster seed URL configured".into()));
            }
            let client = ClusterClientBuilder::new(urls.iter().map(String::as_str))
                .connection_timeout(ct)
                .response_timeout(timeout)
                .retries(2)
                .min_retry_wait(1)
                .max_retry_wait(10)
                .tcp_settings(nodelay)
                .build()
                .map_err(store_err)?;
            let cc = tokio::time::timeout(deadline, client.get_async_connection())
                .await
                .map_err(|_| StoreError::Timeout)?
                .map_err(store_err)?;
            Ok(Conn::Cluster(cc))
        }
    }
}

impl Inner {
    /// A clone of the current connection (the guard is dropped before any await). `Err` while
    /// no connection was ever established (Redis was down at start-up): the failure counts
    /// towards a rebuild, which keeps trying in the background.
    fn conn(&self) -> Result<Conn, RedisError> {
        match &*self.conn.load() {
            Some(c) => Ok(Conn::clone(c)),
            None => Err(RedisError::from((ErrorKind::Io, "not connected to Redis yet"))),
        }
    }

    fn success(&self) {
        if self.failures.load(Ordering::Relaxed) != 0 {
            self.failures.store(0, Ordering::Relaxed);
        }
    }

    /// Count one failed call; rebuild the connection when they pile up.
    fn failure(self: &Arc<Self>) {
        let n = self.failures.fetch_add(1, Ordering::Relaxed).saturating_add(1);
        if n >= REBUILD_AFTER {
            self.maybe_rebuild();
        }
    }

    /// Start a rebuild in the background unless one runs or one started recently.
    fn maybe_rebuild(self: &Arc<Self>) {
        let now_ms = u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX);
        let last = self.last_rebuild_ms.load(Ordering::Relaxed);
        let interval = u64::try_from(REBUILD_INTERVAL.as_millis()).unwrap_or(500);
        if last != 0 && now_ms.saturating_sub(last) < interval {
            return;
        }
        let Ok(handle) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if self
            .rebuilding
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Relaxed)
            .is_err()
        {
            return;
        }
        self.last_rebuild_ms.store(now_ms.max(1), Ordering::Relaxed);
        let inner = Arc::clone(self);
        handle.spawn(async move {
            match open(inner.mode, &inner.urls, inner.timeout).await {
                Ok(conn) => {
                    inner.conn.store(Some(Arc::new(conn)));
                    inner.failures.store(0, Ordering::Relaxed);
                    inner.rebuilds.fetch_add(1, Ordering::Relaxed);
                    inner.refresh_topology().await;
                    let unlogged_failures = inner.rebuild_log.reset();
                    tracing::warn!(
                        mode = ?inner.mode,
                        targets = %inner.targets,
                        unlogged_failures,
                        "redis connection rebuilt after repeated failures"
                    );
                }
                Err(e) => {
                    if let Some(suppressed) = inner.rebuild_log.allow() {
                        tracing::warn!(
                            mode = ?inner.mode,
                            targets = %inner.targets,
                            error = %e,
                            suppressed,
                            "redis connection rebuild failed (repeats are logged at most once a minute, `suppressed` counts the others)"
                        );
                    }
                }
            }
            inner.rebuilding.store(false, Ordering::Release);
        });
    }

    /// Re-read which master owns which slot (cluster only; a failed read keeps the old map).
    async fn refresh_topology(&self) {
        if self.mode != RedisMode::Cluster {
            return;
        }
        let Ok(mut conn) = self.conn() else { return };
        let cmd = redis::cmd("CLUSTER").arg("SLOTS").to_owned();
        if let Ok(Ok(reply)) = tokio::time::timeout(connect_timeout(self.timeout), conn.query(&cmd)).await {
            if let Some(t) = self.topo.load().refreshed(&reply, self.threshold) {
                self.topo.store(Arc::new(t));
            }
        }
    }

    /// Count one call to `shard` towards its breaker; log when it opens, and rebuild the
    /// connection then (a frozen master is never given up on by the client by itself).
    fn shard_failure(self: &Arc<Self>, shard: &slots::Shard, e: &StoreError) {
        if shard.breaker.failure() {
            tracing::error!(shard = %shard.addr, error = %e, "store shard failing: its circuit breaker opened; limits kept on it now follow their rule's failure policy");
            self.maybe_rebuild();
        }
    }

    /// Run the limit script built by `build` (given the SHA for `EVALSHA`, or `None` for
    /// `EVAL` with the source) and return the raw reply: `EVALSHA` first, `EVAL` on NOSCRIPT.
    async fn run_script(&self, build: impl Fn(Option<&str>) -> Cmd) -> Result<Value, RedisError> {
        let mut conn = self.conn()?;
        let cmd = build(Some(&self.sha));
        match conn.query(&cmd).await {
            Err(e) if is_noscript(&e) => {
                drop(cmd);
                conn.query(&build(None)).await
            }
            r => r,
        }
    }

    /// One script call with health accounting and the deadline; the raw reply.
    async fn script(self: &Arc<Self>, build: impl Fn(Option<&str>) -> Cmd) -> Result<Value, StoreError> {
        let guard = CallGuard::new(self);
        let res = tokio::time::timeout(self.timeout, self.run_script(build)).await;
        guard.finish(res)
    }

    /// A `peek` or `refund` call on `checks` (all on one slot): Redis' `now` and one entry per
    /// check, built by `map` from the reply's `allowed` integer and the outcome.
    async fn call<'c, I, T>(
        self: &Arc<Self>,
        mode: Mode,
        now: Option<u64>,
        checks: I,
        map: fn(i64, Outcome) -> T,
    ) -> Result<(u64, Vec<T>), StoreError>
    where
        I: Iterator<Item = &'c LimitCheck> + Clone + ExactSizeIterator,
    {
        let n = checks.len();
        let value = self.script(|sha| script_cmd(sha, mode, now, checks.clone())).await?;
        parse_reply(value, if mode == Mode::Refund { 0 } else { n }, map)
    }

    /// A `check` call on a batch of requests (all on one slot): Redis' `now` and one outcome
    /// per limit, request after request.
    async fn check_batch<'c, R>(
        self: &Arc<Self>,
        now: Option<u64>,
        requests: R,
    ) -> Result<(u64, Vec<Outcome>), StoreError>
    where
        R: Iterator<Item = &'c [LimitCheck]> + Clone,
    {
        let n = requests.clone().map(<[LimitCheck]>::len).sum();
        let value = self.script(|sha| check_cmd(sha, now, requests.clone())).await?;
        parse_packed(value, n)
    }

    /// Any command with health accounting and the deadline.
    async fn command(self: &Arc<Self>, cmd: &Cmd) -> Result<Value, StoreError> {
        let guard = CallGuard::new(self);
        let res = match self.conn() {
            Ok(mut conn) => tokio::time::timeout(self.timeout, async move { conn.query(cmd).await }).await,
            Err(e) => Ok(Err(e)),
        };
        guard.finish(res)
    }
}

/// Counts a call as failed unless it finishes successfully — including when the caller's
/// `tokio::time::timeout` drops the call's future (then `Drop` runs without `finish`). A call
/// dropped early (a client that went away) is not counted: only one that ran for at least
/// half the deadline.
struct CallGuard<'a> {
    /// The store's shared state.
    inner: &'a Arc<Inner>,
    /// When the call started.
    start: Instant,
    /// `finish` ran.
    done: bool,
}

impl<'a> CallGuard<'a> {
    fn new(inner: &'a Arc<Inner>) -> Self {
        CallGuard {
            inner,
            start: Instant::now(),
            done: false,
        }
    }

    /// Account the result of a call bounded by our own deadline.
    fn finish(
        mut self,
        res: Result<Result<Value, RedisError>, tokio::time::error::Elapsed>,
    ) -> Result<Value, StoreError> {
        self.done = true;
        match res {
            Ok(Ok(v)) => {
                self.inner.success();
                Ok(v)
            }
            Ok(Err(e)) => {
                if is_health_error(&e) {
                    self.inner.failure();
                } else {
                    self.inner.success();
                }
                Err(store_err(e))
            }
            Err(_) => {
                self.inner.failure();
                Err(StoreError::Timeout)
            }
        }
    }
}

impl Drop for CallGuard<'_> {
    fn drop(&mut self) {
        if !self.done && self.start.elapsed() >= self.inner.timeout / 2 {
            self.inner.failure();
        }
    }
}

/// `EVALSHA sha` (or `EVAL source` when `sha` is `None`), before the key count.
fn script_head(sha: Option<&str>) -> Cmd {
    match sha {
        Some(sha) => {
            let mut c = redis::cmd("EVALSHA");
            c.arg(sha);
            c
        }
        None => {
            let mut c = redis::cmd("EVAL");
            c.arg(SCRIPT_SOURCE);
            c
        }
    }
}

/// Append the 5 script arguments of one limit.
fn limit_args(cmd: &mut Cmd, c: &LimitCheck) {
    cmd.arg(c.quota.algorithm.code())
        .arg(c.quota.limit.get())
        .arg(c.quota.interval_us.get())
        .arg(c.cost)
        .arg(if c.shadow { "1" } else { "0" });
}

/// The script's `now` argument: explicit, or "" for Redis `TIME`.
fn now_arg(cmd: &mut Cmd, now: Option<u64>) {
    match now {
        Some(now) => cmd.arg(now),
        None => cmd.arg(""),
    };
}

/// Build the `check` call for a batch of `requests` (each one request's limits, all on one
/// slot), in the script's batch layout: keys of every request, then `check`, `now`, the
/// request count, and per request its limit count and 5 arguments per limit.
fn check_cmd<'c, R>(sha: Option<&str>, now: Option<u64>, requests: R) -> Cmd
where
    R: Iterator<Item = &'c [LimitCheck]> + Clone,
{
    let mut cmd = script_head(sha);
    cmd.arg(requests.clone().map(<[LimitCheck]>::len).sum::<usize>());
    for r in requests.clone() {
        for c in r {
            cmd.arg(c.key.as_str());
        }
    }
    cmd.arg(Mode::Check.as_str());
    now_arg(&mut cmd, now);
    cmd.arg(requests.clone().count());
    for r in requests {
        cmd.arg(r.len());
        for c in r {
            limit_args(&mut cmd, c);
        }
    }
    cmd
}

/// Build a `peek` or `refund` call for `checks` (all on one slot): 5 arguments per key.
fn script_cmd<'c>(
    sha: Option<&str>,
    mode: Mode,
    now: Option<u64>,
    checks: impl Iterator<Item = &'c LimitCheck> + Clone,
) -> Cmd {
    let mut cmd = script_head(sha);
    cmd.arg(checks.clone().count());
    for c in checks.clone() {
        cmd.arg(c.key.as_str());
    }
    cmd.arg(mode.as_str());
    now_arg(&mut cmd, now);
    for c in checks {
        limit_args(&mut cmd, c);
    }
    cmd
}

/// A peek reply entry: `allowed == -1` marks a key that does not exist.
fn peeked(allowed: i64, o: Outcome) -> Option<Outcome> {
    (allowed >= 0).then_some(o)
}

/// Parse `[now, (allowed, remaining, reset, retry, delay) * n]`, mapping each entry with `map`
/// (straight into the caller's vector: no intermediate allocation).
fn parse_reply<T>(value: Value, n: usize, map: fn(i64, Outcome) -> T) -> Result<(u64, Vec<T>), StoreError> {
    let items = match value {
        Value::Array(items) => items,
        other => return Err(StoreError::Protocol(format!("expected an array, got {other:?}"))),
    };
    if items.len() != 1 + 5 * n {
        return Err(StoreError::Protocol(format!(
            "expected {} integers, got {}",
            1 + 5 * n,
            items.len()
        )));
    }
    let mut ints = items.into_iter().map(|v| match v {
        Value::Int(i) => Ok(i),
        other => Err(StoreError::Protocol(format!("expected an integer, got {other:?}"))),
    });
    let mut next = || ints.next().unwrap_or(Ok(0));
    let now = u64::try_from(next()?).unwrap_or(0);
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let allowed = next()?;
        let mut field = || next().map(|v| u64::try_from(v).unwrap_or(0));
        let outcome = Outcome {
            allowed: allowed == 1,
            remaining: field()?,
            reset_us: field()?,
            retry_after_us: field()?,
            delay_us: field()?,
            at_us: now,
        };
        out.push(map(allowed, outcome));
    }
    Ok((now, out))
}

/// Parse a `check` reply: `[now, (allowed, remaining, reset, retry, delay) * n]` packed as
/// little-endian doubles in one bulk string (see `lua/check.lua`).
fn parse_packed(value: Value, n: usize) -> Result<(u64, Vec<Outcome>), StoreError> {
    let bytes = match value {
        Value::BulkString(b) => b,
        other => return Err(StoreError::Protocol(format!("expected a packed reply, got {other:?}"))),
    };
    if bytes.len() != 8 * (1 + 5 * n) {
        return Err(StoreError::Protocol(format!(
            "expected {} packed numbers, got {} bytes",
            1 + 5 * n,
            bytes.len()
        )));
    }
    // Every value is an integer in 0 ..= 2^53; anything else (never sent) reads as 0.
    let mut nums = bytes.chunks_exact(8).map(|c| {
        let f = c.try_into().map_or(0.0, f64::from_le_bytes);
        if (0.0..=9_007_199_254_740_992.0).contains(&f) {
            f as u64
        } else {
            0
        }
    });
    let mut next = || nums.next().unwrap_or(0);
    let now = next();
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        out.push(Outcome {
            allowed: next() == 1,
            remaining: next(),
            reset_us: next(),
            retry_after_us: next(),
            delay_us: next(),
            at_us: now,
        });
    }
    Ok((now, out))
}

/// Group check indexes by hash tag (one group per Redis Cluster slot), in first-seen order.
/// Requests carry a handful of limits, so a linear scan beats hashing.
fn group_by_tag<'a>(keys: impl Iterator<Item = &'a StoreKey>) -> Vec<Vec<usize>> {
    let mut tags: Vec<&str> = Vec::new();
    let mut groups: Vec<Vec<usize>> = Vec::new();
    for (i, k) in keys.enumerate() {
        let tag = k.hash_tag();
        match tags.iter().position(|t| *t == tag) {
            Some(g) => groups[g].push(i),
            None => {
                tags.push(tag);
                groups.push(vec![i]);
            }
        }
    }
    groups
}

/// True when every key shares the first key's hash tag (the common case: no grouping needed).
fn one_tag<'a>(mut keys: impl Iterator<Item = &'a StoreKey>) -> bool {
    match keys.next() {
        Some(first) => {
            let tag = first.hash_tag();
            keys.all(|k| k.hash_tag() == tag)
        }
        None => true,
    }
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
        let conn = match open(mode, urls, timeout).await {
            Ok(c) => Some(Arc::new(c)),
            Err(e) if urls.iter().all(|u| u.as_str().into_connection_info().is_ok()) && !urls.is_empty() => {
                tracing::warn!(error = %e, ?mode, targets = %redacted_targets(urls), "Redis is unreachable at start-up; serving with each rule's failure policy and retrying in the background");
                None
            }
            Err(e) => return Err(e),
        };
        let sha = redis::Script::new(SCRIPT_SOURCE).get_hash().to_owned();
        let inner = Arc::new(Inner {
            mode,
            urls: urls.to_vec(),
            timeout,
            conn: ArcSwapOption::new(conn),
            sha,
            failures: AtomicU32::new(0),
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
            batch_calls: AtomicU64::new(0),
            batch_requests: AtomicU64::new(0),
        });
        inner.refresh_topology().await;
        let batches = batch::Batches::spawn(Arc::clone(&inner));
        Ok(RedisStore { inner, batches })
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

    /// [`Store::check`] at an explicit `now` (microseconds since the epoch) instead of Redis
    /// `TIME` when `now` is `Some` — differential tests drive Redis and the memory store with
    /// the same clock. `None` is the production path.
    ///
    /// Each slot's call is bounded by `store.timeout` and gated by its shard's breaker, so a
    /// failed shard fails only its own checks (in [`Checked::failed`]); a denial from a healthy
    /// slot stands, and the healthy slots that spent for a denied request are refunded.
    pub async fn check_at(&self, checks: &[LimitCheck], now: Option<u64>) -> Checked {
        if checks.is_empty() {
            return Checked::default();
        }
        let start = Instant::now();
        if one_tag(checks.iter().map(|c| &c.key)) {
            // Fast path: one slot, one script call, no grouping.
            return match self.check_group(now, checks.to_vec()).await {
                Ok((_, outcomes)) => Checked {
                    outcomes,
                    failed: Vec::new(),
                },
                Err(e) => Checked::all_failed(checks.len(), e),
            };
        }
        let groups = group_by_tag(checks.iter().map(|c| &c.key));
        let calls = groups
            .iter()
            .map(|g| self.check_group(now, g.iter().map(|&i| checks[i].clone()).collect()));
        let results = futures_util::future::join_all(calls).await;
        let mut out = Checked {
            outcomes: vec![Outcome::default(); checks.len()],
            failed: Vec::new(),
        };
        let mut answered: Vec<(&[usize], u64)> = Vec::with_capacity(groups.len());
        for (g, r) in groups.iter().zip(results) {
            match r {
                Ok((group_now, outs)) => {
                    answered.push((g, group_now));
                    for (&i, o) in g.iter().zip(outs) {
                        out.outcomes[i] = o;
                    }
                }
                Err(e) => out.failed.extend(g.iter().map(|&i| (i, e.clone()))),
            }
        }
        let outcomes = &out.outcomes;
        let denied = |i: usize| !outcomes[i].allowed && !checks[i].shadow;
        if !answered.iter().any(|(g, _)| g.iter().any(|&i| denied(i))) {
            return out;
        }
        // Blocked by a healthy slot: give back what the groups that spent (no non-shadow denial
        // inside) took, in the window their script counted it in.
        let mut refunds: Vec<(u64, Vec<LimitCheck>)> = Vec::new();
        for (g, group_now) in &answered {
            if g.iter().any(|&i| denied(i)) {
                continue; // this group's script wrote nothing
            }
            let spent: Vec<LimitCheck> = g
                .iter()
                .filter(|&&i| outcomes[i].allowed && checks[i].cost > 0)
                .map(|&i| checks[i].clone())
                .collect();
            if !spent.is_empty() {
                refunds.push((*group_now, spent));
            }
        }
        if !refunds.is_empty() {
            self.spawn_refunds(refunds, start).await;
        }
        out
    }

    /// One slot's checks: refused at once while its shard's breaker is open, else one call
    /// bounded by `store.timeout` whose result counts towards that breaker.
    async fn check_group(&self, now: Option<u64>, checks: Vec<LimitCheck>) -> batch::Answer {
        let slot = checks.first().map_or(0, |c| slots::slot_of(c.key.as_str()));
        let shard = Arc::clone(self.inner.topo.load().shard_for(slot));
        if shard.breaker.is_open() {
            return Err(StoreError::CircuitOpen);
        }
        let res = match tokio::time::timeout(self.inner.timeout, self.check_slot(now, slot, checks)).await {
            Ok(r) => r,
            Err(_) => Err(StoreError::Timeout),
        };
        match &res {
            Ok(_) => shard.breaker.success(),
            Err(e) => self.inner.shard_failure(&shard, e),
        }
        res
    }

    /// Check one request's limits on one slot: through the batch task in production
    /// (`now == None`); as a call of its own when a test drives time.
    async fn check_slot(&self, now: Option<u64>, slot: u16, checks: Vec<LimitCheck>) -> batch::Answer {
        match now {
            None => self.batches.check(slot, checks).await,
            Some(_) => self.inner.check_batch(now, std::iter::once(checks.as_slice())).await,
        }
    }

    /// Refund `(now, checks)` groups in a spawned task, so they complete even if the caller
    /// drops this future, and wait for them for at most half of the remaining deadline (a slow
    /// refund never turns a denial into a store failure).
    async fn spawn_refunds(&self, refunds: Vec<(u64, Vec<LimitCheck>)>, start: Instant) {
        let inner = Arc::clone(&self.inner);
        let task = async move {
            let calls = refunds
                .iter()
                .map(|(now, cs)| inner.call(Mode::Refund, Some(*now), cs.iter(), peeked));
            for r in futures_util::future::join_all(calls).await {
                if let Err(e) = r {
                    tracing::warn!(error = %e, "refund of a rejected cross-slot request failed");
                }
            }
        };
        match tokio::runtime::Handle::try_current() {
            Ok(handle) => {
                let join = handle.spawn(task);
                let budget = self.inner.timeout.saturating_sub(start.elapsed()) / 2;
                let _ = tokio::time::timeout(budget, join).await;
            }
            Err(_) => task.await,
        }
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
            let mut cmd = redis::cmd("EVALSHA");
            cmd.arg(&inner.sha).arg(0).arg("peek").arg("");
            let probe = async {
                let mut conn = inner.conn()?;
                match (&mut conn, shard.probe_slot) {
                    (Conn::Cluster(c), Some(slot)) => {
                        let route = RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(Route::new(
                            slot,
                            SlotAddr::Master,
                        )));
                        match c.route_command(cmd.clone(), route.clone()).await {
                            Err(e) if is_noscript(&e) => {
                                let mut load = redis::cmd("SCRIPT");
                                load.arg("LOAD").arg(SCRIPT_SOURCE);
                                c.route_command(load, route.clone()).await?;
                                c.route_command(cmd, route).await
                            }
                            r => r,
                        }
                    }
                    _ => match conn.query(&cmd).await {
                        Err(e) if is_noscript(&e) => {
                            let mut load = redis::cmd("SCRIPT");
                            load.arg("LOAD").arg(SCRIPT_SOURCE);
                            conn.query(&load).await?;
                            conn.query(&cmd).await
                        }
                        r => r,
                    },
                }
            };
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

    /// Number of shards whose breaker is open now.
    pub fn open_breakers(&self) -> usize {
        self.inner.topo.load().open_shards().count()
    }
}

impl Store for RedisStore {
    async fn check(&self, checks: &[LimitCheck]) -> Checked {
        self.check_at(checks, None).await
    }

    /// Refund each slot's spending at the `now` its check used, so window units come off the
    /// window they were counted in.
    async fn refund(&self, spent: &[(LimitCheck, u64)]) -> Result<(), StoreError> {
        if spent.is_empty() {
            return Ok(());
        }
        let groups = group_by_tag(spent.iter().map(|(c, _)| &c.key));
        let inner = &self.inner;
        let calls = groups.iter().map(|g| {
            let at = g.first().map(|&i| spent[i].1);
            inner.call(Mode::Refund, at, g.iter().map(|&i| &spent[i].0), peeked)
        });
        for r in futures_util::future::join_all(calls).await {
            r?;
        }
        Ok(())
    }

    async fn peek(&self, checks: &[LimitCheck]) -> Result<Vec<Option<Outcome>>, StoreError> {
        self.peek_groups(checks).await
    }

    async fn reset(&self, keys: &[StoreKey]) -> Result<(), StoreError> {
        if keys.is_empty() {
            return Ok(());
        }
        // One DEL per slot (a multi-key DEL must stay within one slot in a cluster).
        let groups = group_by_tag(keys.iter());
        let cmds: Vec<Cmd> = groups
            .iter()
            .map(|g| {
                let mut cmd = redis::cmd("DEL");
                for &i in g {
                    cmd.arg(keys[i].as_str());
                }
                cmd
            })
            .collect();
        let results = futures_util::future::join_all(cmds.iter().map(|c| self.inner.command(c))).await;
        for r in results {
            r?;
        }
        Ok(())
    }

    /// A cost-0 token-bucket check on [`PROBE_KEY`] through the real EVALSHA path (routing,
    /// script, writes); in a cluster also a keyless run of the script on every master (loading
    /// it where it is missing), so a frozen or scriptless master fails the probe.
    async fn probe(&self) -> Result<(), StoreError> {
        let probe = LimitCheck {
            key: StoreKey(PROBE_KEY.to_owned()),
            quota: Quota::bucket(
                Algorithm::TokenBucket,
                std::num::NonZeroU64::MIN,
                std::num::NonZeroU64::MIN,
            ),
            cost: 0,
            shadow: false,
        };
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
            let peek = || {
                let mut c = redis::cmd("EVALSHA");
                c.arg(&self.inner.sha).arg(0).arg("peek").arg("");
                c
            };
            let inner = &self.inner;
            let guard = CallGuard::new(inner);
            let res = tokio::time::timeout(inner.timeout, async {
                let mut conn = inner.conn()?;
                match conn.query_all_masters(peek()).await {
                    Err(e) if is_noscript(&e) => {
                        let mut load = redis::cmd("SCRIPT");
                        load.arg("LOAD").arg(SCRIPT_SOURCE);
                        conn.query_all_masters(load).await?;
                        conn.query_all_masters(peek()).await
                    }
                    r => r,
                }
                .map(|()| Value::Okay)
            })
            .await;
            guard.finish(res)?;
        }
        Ok(())
    }
}

mod batch;
mod slots;

/// `url` with any password replaced by `***`, for logs.
pub fn redact_url(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            let creds = &url[scheme + 3..at];
            match creds.split_once(':') {
                Some((user, _)) => format!("{}{user}:***{}", &url[..scheme + 3], &url[at..]),
                None => format!("{}***{}", &url[..scheme + 3], &url[at..]),
            }
        }
        _ => url.to_owned(),
    }
}

#[cfg(test)]
mod tests;
