//! Connections to Redis: opening them, the shared state every call reads, and rebuilding the
//! whole connection when a shard keeps failing.
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
//! [`ArcSwapOption`]: each call loads it, clones it out and drops the guard *before* awaiting, so
//! no lock or guard is ever held across an `.await` and requests never contend on it.
//!
//! # A frozen node
//! A master stopped with `SIGSTOP` keeps its TCP connections open: the client keeps routing its
//! slots to it and times out forever, even after a replica took over. When a shard's breaker
//! opens (see `slots`), and then every probe period while one is open, the store rebuilds the
//! whole connection from the configured URLs (which re-reads the cluster topology) in a spawned
//! task — at most once per [`REBUILD_INTERVAL`], one at a time — and swaps it in. Requests never
//! wait for a rebuild.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::{ArcSwap, ArcSwapOption};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClientBuilder;
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{MultipleNodeRoutingInfo, Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};
use redis::io::tcp::TcpSettings;
use redis::{Cmd, ErrorKind, IntoConnectionInfo, RedisError, ServerErrorKind, Value};

use super::{slots, RedisMode};
use crate::limiter::StoreError;

/// Minimum time between two connection rebuilds.
pub const REBUILD_INTERVAL: Duration = Duration::from_millis(500);

/// A live connection of either kind. Cloning is cheap and shares the underlying connection.
#[derive(Clone)]
pub(super) enum Conn {
    /// Standalone server.
    Single(ConnectionManager),
    /// Cluster.
    Cluster(ClusterConnection),
}

impl Conn {
    /// Send one command, routed by its first key in a cluster.
    pub(super) async fn query(&mut self, cmd: &Cmd) -> Result<Value, RedisError> {
        match self {
            Conn::Single(c) => cmd.query_async(c).await,
            Conn::Cluster(c) => cmd.query_async(c).await,
        }
    }

    /// Send one command to every master (the server itself when standalone); `Ok` only if
    /// every one of them succeeded or answered an error `fine` accepts. Each node's reply is
    /// inspected: the client's aggregating response policies pass a node's error reply through
    /// as a value.
    pub(super) async fn query_all_masters(
        &mut self,
        cmd: Cmd,
        fine: fn(&RedisError) -> bool,
    ) -> Result<(), RedisError> {
        let check = |r: Result<Value, RedisError>| match r.and_then(Value::extract_error) {
            Err(e) if !fine(&e) => Err(e),
            _ => Ok(()),
        };
        match self {
            Conn::Single(c) => check(cmd.query_async::<Value>(c).await),
            Conn::Cluster(c) => {
                let routing = RoutingInfo::MultiNode((MultipleNodeRoutingInfo::AllMasters, None));
                match c.route_command(cmd, routing).await? {
                    Value::Map(replies) => {
                        for (_, reply) in replies {
                            check(Ok(reply))?;
                        }
                        Ok(())
                    }
                    other => check(Ok(other)),
                }
            }
        }
    }

    /// Send `cmd` to `target`.
    pub(super) async fn send(&mut self, cmd: &Cmd, target: &Target) -> Result<Value, RedisError> {
        match target {
            Target::AllMasters => self
                .query_all_masters(cmd.clone(), |_| false)
                .await
                .map(|()| Value::Okay),
            Target::Node(route) => match self {
                Conn::Cluster(c) => c.route_command(cmd.clone(), route.clone()).await,
                Conn::Single(_) => self.query(cmd).await,
            },
            Target::ByKey => self.query(cmd).await,
        }
    }
}

/// Where a script call goes.
#[derive(Debug, Clone)]
pub(super) enum Target {
    /// Routed by the command's first key in a cluster; the one server when standalone.
    ByKey,
    /// One cluster node (the server itself when standalone).
    Node(RoutingInfo),
    /// Every master (the server itself when standalone); the reply is `Okay` when every one of
    /// them succeeded.
    AllMasters,
}

/// State shared by every clone of the store and by the rebuild task.
pub(super) struct Inner {
    /// Standalone or cluster.
    pub(super) mode: RedisMode,
    /// The configured URLs (the server, or cluster seeds), for rebuilds.
    pub(super) urls: Vec<String>,
    /// Password and TLS roots, for rebuilds.
    pub(super) auth: Auth,
    /// Deadline of one store call.
    pub(super) timeout: Duration,
    /// The current connection; swapped whole by a rebuild, loaded and cloned by every call.
    pub(super) conn: ArcSwapOption<Conn>,
    /// SHA1 of [`SCRIPT_SOURCE`], for EVALSHA.
    pub(super) sha: String,
    /// Name of the Redis function (and of its library) that runs the script, for FCALL.
    pub(super) function: String,
    /// The function library (`FUNCTION LOAD`), loaded on a node when a call finds it missing.
    pub(super) library: String,
    /// How calls are sent now (`store.scripting`): `PATH_AUTO` until a server answers
    /// "unknown command" to FCALL (Redis 6), then `PATH_EVAL` for good; or a forced path.
    pub(super) path: AtomicU8,
    /// When the last rebuild started, in milliseconds since `epoch` (0 = never).
    pub(super) last_rebuild_ms: AtomicU64,
    /// A rebuild task is running (single flight).
    pub(super) rebuilding: AtomicBool,
    /// Connection rebuilds completed so far (for tests and logs).
    pub(super) rebuilds: AtomicU64,
    /// Origin of `last_rebuild_ms`.
    pub(super) epoch: Instant,
    /// Which shard owns each slot, with one breaker per shard (see [`slots`]). Loaded once per
    /// check and swapped whole by a refresh.
    pub(super) topo: ArcSwap<slots::Topology>,
    /// Consecutive failed calls that open a shard's breaker.
    pub(super) threshold: u32,
    /// The configured URLs with passwords redacted, for logs.
    pub(super) targets: String,
    /// Repeated rebuild failures are logged at most once a minute.
    pub(super) rebuild_log: crate::log_throttle::LogThrottle,
    /// Rebuilds that succeeded are logged at most once a minute too: with a Cluster node down,
    /// the client reconnects every `REBUILD_INTERVAL` and each one "succeeds".
    pub(super) rebuilt_log: crate::log_throttle::LogThrottle,
    /// Batched `check` calls sent so far (see [`batch`]).
    pub(super) batch_calls: AtomicU64,
    /// Requests those calls carried.
    pub(super) batch_requests: AtomicU64,
    /// `store.durability: replicated`: every call that writes waits (`WAIT 1`) until a replica
    /// has its writes, within the call's deadline; a write no replica confirmed in time is a
    /// store failure (the rule's failure policy decides the request).
    pub(super) replicated: AtomicBool,
}

/// Where a script call with keys goes in a cluster: the master of its first key's slot (the
/// 4th argument: `EVALSHA sha numkeys key ...`, `FCALL name numkeys key ...`); `None` for a
/// keyless call.
pub(super) fn first_key_route(cmd: &Cmd) -> Option<RoutingInfo> {
    let key = cmd.args_iter().nth(3).and_then(|a| match a {
        redis::Arg::Simple(b) => std::str::from_utf8(b).ok(),
        _ => None,
    })?;
    let slot = slots::slot_of(key);
    Some(RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(
        Route::new(slot, SlotAddr::Master),
    )))
}

/// Map a client error to a store error: a timeout, a connection-level (transient) failure, or
/// an error the script or a command raised on a healthy server (permanent).
pub(super) fn store_err(e: RedisError) -> StoreError {
    // A command the ACL refuses answers NOPERM; inside a script Redis says "The user executing
    // the script can't run this command".
    let text = e.to_string();
    if e.kind() == ErrorKind::Server(ServerErrorKind::NoPerm)
        || text.contains("NOPERM")
        || text.contains("user executing the script can't run")
    {
        StoreError::Permission(text)
    } else if e.is_timeout() {
        StoreError::Timeout
    } else if is_health_error(&e) {
        StoreError::Redis(e.to_string())
    } else {
        StoreError::Script(e.to_string())
    }
}

/// True when `e` says something about the connection's health (as opposed to an error the
/// script or a command raised on a healthy server).
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

/// The connection timeout used when (re)connecting: a few call deadlines, within [100ms, 1s].
pub(super) fn connect_timeout(timeout: Duration) -> Duration {
    timeout
        .saturating_mul(4)
        .clamp(Duration::from_millis(100), Duration::from_secs(1))
}

/// How to authenticate to Redis and which roots its TLS certificates chain to
/// (`store.password_env`, `store.tls.ca_file`). Its `Debug` never shows the password.
#[derive(Debug, Clone, Default)]
pub struct Auth {
    /// `AUTH` password (overrides one in the URL).
    pub password: Option<crate::yaml::Secret>,
    /// PEM roots for `rediss://` (else the system's roots).
    pub ca_pem: Option<Vec<u8>>,
}

impl Auth {
    /// The roots as the client takes them, when a CA was given.
    fn certs(&self) -> Option<redis::TlsCertificates> {
        self.ca_pem.as_ref().map(|ca| redis::TlsCertificates {
            client_tls: None,
            root_cert: Some(ca.clone()),
        })
    }
}

/// Open a connection of `mode` to `urls`.
pub(super) async fn open(mode: RedisMode, urls: &[String], timeout: Duration, auth: &Auth) -> Result<Conn, StoreError> {
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
            let mut info = info.set_tcp_settings(nodelay);
            if let Some(p) = &auth.password {
                let redis_settings = info.redis_settings().clone().set_password(p.expose());
                info = info.set_redis_settings(redis_settings);
            }
            let tls = matches!(info.addr(), redis::ConnectionAddr::TcpTls { .. });
            let client = match auth.certs() {
                Some(certs) if tls => redis::Client::build_with_tls(info, certs),
                _ => redis::Client::open(info),
            }
            .map_err(store_err)?;
            // No reconnect retries inside the client: a retry sleeps its backoff (5-10 ms with
            // jitter) while every request on the connection waits for it, which is what the
            // first requests after Redis died used to pay. A failed reconnect fails fast, the
            // breaker opens, and the store's probe and rebuild bring the connection back.
            let config = ConnectionManagerConfig::new()
                .set_response_timeout(Some(timeout))
                .set_connection_timeout(Some(ct))
                .set_number_of_retries(0)
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
            let mut builder = ClusterClientBuilder::new(urls.iter().map(String::as_str))
                .connection_timeout(ct)
                .response_timeout(timeout)
                .retries(2)
                .min_retry_wait(1)
                .max_retry_wait(10)
                .tcp_settings(nodelay);
            if let Some(p) = &auth.password {
                builder = builder.password(p.expose());
            }
            if let Some(certs) = auth.certs().filter(|_| urls.iter().all(|u| u.starts_with("rediss://"))) {
                builder = builder.certs(certs);
            }
            let client = builder.build().map_err(store_err)?;
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
    pub(super) fn conn(&self) -> Result<Conn, RedisError> {
        match &*self.conn.load() {
            Some(c) => Ok(Conn::clone(c)),
            None => Err(RedisError::from((ErrorKind::Io, "not connected to Redis yet"))),
        }
    }

    /// Start a rebuild in the background unless one runs or one started recently.
    pub(super) fn maybe_rebuild(self: &Arc<Self>) {
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
            match open(inner.mode, &inner.urls, inner.timeout, &inner.auth).await {
                Ok(conn) => {
                    inner.conn.store(Some(Arc::new(conn)));
                    inner.rebuilds.fetch_add(1, Ordering::Relaxed);
                    inner.refresh_topology().await;
                    let unlogged_failures = inner.rebuild_log.reset();
                    if let Some(suppressed) = inner.rebuilt_log.allow() {
                        tracing::warn!(
                            mode = ?inner.mode,
                            targets = %inner.targets,
                            unlogged_failures,
                            suppressed,
                            "redis connection rebuilt after repeated failures (repeats are logged at most once a minute, `suppressed` counts the others)"
                        );
                    }
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

    /// Count one call to `shard` towards its breaker; log when it opens, and rebuild the
    /// connection then (a frozen master is never given up on by the client by itself).
    pub(super) fn shard_failure(self: &Arc<Self>, shard: &slots::Shard, e: &StoreError) {
        if shard.breaker.failure() {
            tracing::error!(shard = %shard.addr, error = %e, "store shard failing: its circuit breaker opened; limits kept on it now follow their rule's failure policy");
            self.maybe_rebuild();
        }
    }
}

/// `url` (a configured seed URL: scheme, user, database) pointed at `addr` (`host:port`)
/// instead of its own host and port.
fn url_for_node(url: &str, addr: &str) -> String {
    let (scheme, rest) = url.split_once("://").unwrap_or(("redis", url));
    let (user, rest) = match rest.rsplit_once('@') {
        Some((u, r)) => (format!("{u}@"), r),
        None => (String::new(), rest),
    };
    let path = rest.find('/').map_or("", |i| &rest[i..]);
    format!("{scheme}://{user}{addr}{path}")
}

/// `PING` the node at `addr` on a connection of its own (the store's auth and TLS), within the
/// store's timeout (at least 100 ms): whether that node itself answers, whatever the cluster
/// client would route to.
pub(super) async fn ping_node(inner: &Inner, addr: &str) -> Result<(), StoreError> {
    let seed = inner
        .urls
        .first()
        .ok_or_else(|| StoreError::Redis("no Redis URL configured".into()))?;
    let url = url_for_node(seed, addr);
    let wait = inner.timeout.max(Duration::from_millis(100));
    let ping = async {
        let conn = open(RedisMode::Single, std::slice::from_ref(&url), wait, &inner.auth).await?;
        let Conn::Single(mut cm) = conn else {
            return Err(StoreError::Redis("not a single-node connection".into()));
        };
        redis::cmd("PING")
            .query_async::<String>(&mut cm)
            .await
            .map(|_| ())
            .map_err(store_err)
    };
    match tokio::time::timeout(wait.saturating_mul(4), ping).await {
        Ok(r) => r,
        Err(_) => Err(StoreError::Timeout),
    }
}

#[cfg(test)]
mod node_url_tests {
    use super::url_for_node;

    #[test]
    fn a_seed_url_is_pointed_at_another_node() {
        assert_eq!(
            url_for_node("redis://10.0.0.1:7000", "10.0.0.2:7001"),
            "redis://10.0.0.2:7001"
        );
        assert_eq!(
            url_for_node("rediss://user@seed:7000/0", "10.0.0.2:7001"),
            "rediss://user@10.0.0.2:7001/0"
        );
    }
}
