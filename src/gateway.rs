//! The running gateway: shared state, the proxy and admin listeners, graceful shutdown, and the
//! background tasks (store probe, file watching).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use arc_swap::ArcSwap;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};

use crate::clock::{SharedClock, SystemClock};
use crate::config::{ConfigError, GatewayConfig, StoreKind};
use crate::identity::KeyRegistry;
use crate::limiter::deny_cache::DenyCache;
use crate::limiter::keys::KeyBuilder;
use crate::limiter::memory::MemoryStore;
use crate::limiter::redis::{RedisMode, RedisStore};
use crate::limiter::{Backend, Limiter, Store, StoreError};
use crate::metrics::{Metrics, RuleMetrics};
use crate::rules::RuleSet;

/// Everything one request reads, swapped whole on reload.
pub struct Snapshot {
    /// The compiled rules.
    pub rules: RuleSet,
    /// The API key registry.
    pub keys: KeyRegistry,
    /// Metric handles, one per rule, same order.
    pub rule_metrics: Vec<RuleMetrics>,
    /// When this snapshot was loaded.
    pub loaded_at: SystemTime,
    /// Per rule: the store keys of a `global` rule's limits (empty for other kinds), built
    /// once here instead of hashing the rule name on every request.
    pub global_keys: Vec<Vec<crate::limiter::StoreKey>>,
}

/// The gateway's shared state.
pub struct Gateway {
    /// The validated gateway config (fixed for the process lifetime).
    pub config: GatewayConfig,
    /// Rules + keys; requests `load()` it once.
    pub snapshot: ArcSwap<Snapshot>,
    /// The limiter (store, local fallback, deny cache, breaker).
    pub limiter: Limiter,
    /// Metrics.
    pub metrics: Arc<Metrics>,
    /// Builds store keys.
    pub keys: KeyBuilder,
    /// Pooled connections to the upstream.
    pub upstream: crate::http::upstream::Upstream,
    /// Time source.
    pub clock: SharedClock,
    /// Shadow denials seen (for log sampling).
    pub shadow_seen: AtomicU64,
    /// Serialises reloads (never held across request handling).
    reload_lock: tokio::sync::Mutex<()>,
    /// Upstream failures are logged at most once a second.
    pub upstream_log: crate::log_throttle::LogThrottle,
    /// SHA-256 of the gateway config file as it was read at start (`None`: not readable then).
    config_digest: Option<[u8; 32]>,
}

/// What one successful reload changed.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct ReloadReport {
    /// The rules version now in force.
    pub version: String,
    /// Did anything change (rules or keys)?
    pub changed: bool,
    /// Rules added, removed, changed (by name).
    pub rules: Changes,
    /// API keys added, removed, changed (by key hash).
    pub keys: Changes,
}

/// Counts of added, removed and changed entries.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Changes {
    /// New entries.
    pub added: u64,
    /// Entries gone.
    pub removed: u64,
    /// Entries present before and after, but different.
    pub changed: u64,
}

impl Changes {
    /// Compare two maps of name → comparable value.
    fn between<K: Ord, V: PartialEq>(old: &BTreeMap<K, V>, new: &BTreeMap<K, V>) -> Self {
        let mut c = Changes::default();
        for (k, v) in new {
            match old.get(k) {
                None => c.added += 1,
                Some(o) if o != v => c.changed += 1,
                Some(_) => {}
            }
        }
        c.removed = old.keys().filter(|k| !new.contains_key(k)).count() as u64;
        c
    }

    fn any(&self) -> bool {
        *self != Changes::default()
    }
}

/// Each rule's name → everything that decides its behaviour, as comparable text.
fn rule_signatures(rules: &RuleSet) -> BTreeMap<String, String> {
    rules
        .rules
        .iter()
        .map(|r| {
            let overrides: BTreeMap<&String, String> = r.overrides.iter().map(|(k, v)| (k, format!("{v:?}"))).collect();
            let sig = format!(
                "{}|{:?}|{:?}|{:?}|{overrides:?}",
                crate::describe::rule(r),
                r.limits,
                r.headers,
                r.host
            );
            (r.name.to_string(), sig)
        })
        .collect()
}

/// Each key hash → its entry.
fn key_entries(keys: &KeyRegistry) -> BTreeMap<[u8; 32], crate::identity::keys::KeyEntry> {
    keys.entries().map(|(h, e)| (*h, e.clone())).collect()
}

/// SHA-256 of a file's bytes, `None` if it cannot be read.
fn file_digest(path: &std::path::Path) -> Option<[u8; 32]> {
    use sha2::{Digest, Sha256};
    std::fs::read(path).ok().map(|b| Sha256::digest(&b).into())
}

/// Load rules and keys into a snapshot, resolving metric handles.
pub fn load_snapshot(config: &GatewayConfig, metrics: &Metrics) -> Result<Snapshot, ConfigError> {
    let rules =
        RuleSet::load(&config.rules_file).map_err(|e| e.named_in(&config.path, "rules_file", config.rules_file_at))?;
    let keys = match &config.keys_file {
        Some(k) => KeyRegistry::load(k).map_err(|e| e.named_in(&config.path, "keys_file", config.keys_file_at))?,
        None => KeyRegistry::empty(),
    };
    let rule_metrics = rules.rules.iter().map(|r| metrics.rule(&r.name)).collect();
    let kb = key_builder(config);
    let global_keys = rules
        .rules
        .iter()
        .map(|r| {
            if r.key != crate::rules::KeyKind::Global {
                return Vec::new();
            }
            let tag = kb.global_tag(&r.name);
            (0..r.limits.len()).map(|n| kb.key(&tag, &r.name, n)).collect()
        })
        .collect();
    Ok(Snapshot {
        rules,
        keys,
        rule_metrics,
        loaded_at: SystemTime::now(),
        global_keys,
    })
}

/// The store-key builder for `config` (prefix and salt).
pub fn key_builder(config: &GatewayConfig) -> KeyBuilder {
    KeyBuilder {
        prefix: config.store.key_prefix.clone(),
        salt: config.store.key_salt.clone(),
    }
}

/// Why the gateway could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// Bad config.
    #[error("{0}")]
    Config(#[from] ConfigError),
    /// The store could not be set up.
    #[error("store: {0}")]
    Store(#[from] StoreError),
    /// A listener could not bind.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The error.
        source: std::io::Error,
    },
}

impl Gateway {
    /// Build the gateway: load rules and keys, connect the store.
    pub async fn new(config: GatewayConfig) -> Result<Arc<Self>, StartError> {
        Self::with_clock(config, Arc::new(SystemClock)).await
    }

    /// As [`Gateway::new`] with an injected clock.
    pub async fn with_clock(config: GatewayConfig, clock: SharedClock) -> Result<Arc<Self>, StartError> {
        let metrics = Metrics::new();
        let snap = load_snapshot(&config, &metrics)?;
        metrics.set_rules_version(&snap.rules.version);
        metrics.reload_succeeded(snap.loaded_at);
        let config_digest = file_digest(&config.path);
        let sc = &config.store;
        let store = match sc.kind {
            StoreKind::Memory => Backend::Memory(Arc::new(
                MemoryStore::new(clock.clone(), sc.memory_max_keys)
                    .with_eviction_counters(metrics.memory_evicted.clone(), metrics.memory_evicted_denying.clone()),
            )),
            StoreKind::Redis | StoreKind::RedisCluster => {
                let mode = if sc.kind == StoreKind::Redis {
                    RedisMode::Single
                } else {
                    RedisMode::Cluster
                };
                Backend::Redis(Arc::new(
                    RedisStore::connect(mode, &sc.urls, sc.timeout, sc.breaker_threshold).await?,
                ))
            }
        };
        let limiter = Limiter {
            store,
            local: Arc::new(
                MemoryStore::new(clock.clone(), sc.memory_max_keys)
                    .with_eviction_counters(metrics.memory_evicted.clone(), metrics.memory_evicted_denying.clone()),
            ),
            deny: config
                .limits
                .deny_cache
                .then(|| DenyCache::new(config.limits.deny_cache_max)),
            timeout: sc.timeout,
            clock: clock.clone(),
        };
        let upstream = crate::http::upstream::Upstream::new(
            config.upstream.authority.as_str().to_string(),
            config.upstream.connect_timeout,
            config.upstream.pool_max_idle_per_host,
        );
        let keys = key_builder(&config);
        let gw = Arc::new(Gateway {
            snapshot: ArcSwap::from_pointee(snap),
            limiter,
            metrics,
            keys,
            upstream,
            clock,
            shadow_seen: AtomicU64::new(0),
            reload_lock: tokio::sync::Mutex::new(()),
            upstream_log: crate::log_throttle::LogThrottle::new(Duration::from_secs(1)),
            config_digest,
            config,
        });
        Ok(gw)
    }

    /// Reload rules and keys. On error the old snapshot stays in force. Also notices (warning
    /// and `tollgate_config_file_changed`) when the gateway config file itself was edited: its
    /// settings (listeners, store, identity) need a restart.
    pub async fn reload(&self, why: &str) -> Result<ReloadReport, ConfigError> {
        let _guard = self.reload_lock.lock().await;
        self.check_config_file();
        match load_snapshot(&self.config, &self.metrics) {
            Ok(snap) => {
                let old = self.snapshot.load();
                let rules = Changes::between(&rule_signatures(&old.rules), &rule_signatures(&snap.rules));
                let keys = Changes::between(&key_entries(&old.keys), &key_entries(&snap.keys));
                let version = snap.rules.version.clone();
                let changed = rules.any() || keys.any() || old.rules.version != version;
                let old_rules: Vec<String> = old.rules.rules.iter().map(|r| r.name.to_string()).collect();
                drop(old);
                self.metrics.set_rules_version(&version);
                self.metrics.reload_succeeded(snap.loaded_at);
                self.metrics
                    .reload_changed("rules", rules.added, rules.removed, rules.changed);
                self.metrics
                    .reload_changed("keys", keys.added, keys.removed, keys.changed);
                if rules.removed > 0 {
                    // Drop the series of rules that no longer exist.
                    let now: std::collections::HashSet<&str> = snap.rules.rules.iter().map(|r| &*r.name).collect();
                    for r in old_rules.iter().filter(|r| !now.contains(r.as_str())) {
                        self.metrics.forget_rule(r);
                    }
                }
                self.snapshot.store(Arc::new(snap));
                if let Some(d) = &self.limiter.deny {
                    // Limits may have changed: cached denials may no longer be true.
                    d.clear();
                }
                self.metrics.reload_ok.inc();
                tracing::info!(
                    trigger = why,
                    version = %version,
                    changed,
                    rules_added = rules.added,
                    rules_removed = rules.removed,
                    rules_changed = rules.changed,
                    keys_added = keys.added,
                    keys_removed = keys.removed,
                    keys_changed = keys.changed,
                    "rules and keys reloaded"
                );
                Ok(ReloadReport {
                    version,
                    changed,
                    rules,
                    keys,
                })
            }
            Err(e) => {
                self.metrics.reload_error.inc();
                self.metrics.last_reload_success.set(0);
                tracing::error!(trigger = why, error = %e, "reload refused; previous rules stay in force");
                Err(e)
            }
        }
    }

    /// Refresh the gauges that are read rather than counted (memory store size, process memory
    /// and descriptors); `/metrics` calls this before encoding.
    pub fn refresh_gauges(&self) {
        let mem = match &self.limiter.store {
            Backend::Memory(m) => m,
            Backend::Redis(_) => &self.limiter.local,
        };
        self.metrics
            .memory_store_keys
            .set(i64::try_from(mem.len()).unwrap_or(i64::MAX));
        self.metrics.refresh_process();
    }

    /// Compare the gateway config file with the one read at start. Its settings are not applied
    /// live (listeners, store and identity are built once), so an edit is reported: a warning
    /// when the file starts to differ, and the `tollgate_config_file_changed` gauge while it does.
    pub fn check_config_file(&self) -> bool {
        let now = file_digest(&self.config.path);
        let differs = now != self.config_digest;
        let was = self.metrics.config_file_changed.get() == 1;
        if differs && !was {
            tracing::warn!(
                file = %self.config.path.display(),
                "the gateway config file changed on disk; its settings are not reloaded live: restart tollgate to apply them (rules and keys files do reload)"
            );
        } else if !differs && was {
            tracing::info!(file = %self.config.path.display(), "the gateway config file matches the running config again");
        }
        self.metrics.config_file_changed.set(i64::from(differs));
        differs
    }

    /// Does the store answer the real script path (within a short deadline)? `/readyz?store=1`
    /// asks this; `/readyz` itself does not (readiness never depends on the store).
    pub async fn store_ready(&self) -> Result<(), StoreError> {
        match tokio::time::timeout(
            self.config.store.timeout.max(Duration::from_millis(200)),
            self.limiter.store.probe(),
        )
        .await
        {
            Ok(r) => r,
            Err(_) => Err(StoreError::Timeout),
        }
    }

    /// While a shard's breaker is open, probe that shard and close its breaker when it answers.
    pub fn spawn_probe(self: &Arc<Self>, mut stop: watch::Receiver<bool>) {
        if self.limiter.store.is_memory() {
            return;
        }
        let gw = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(gw.config.store.probe_interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = tick.tick() => {}
                    _ = stop.changed() => return,
                }
                let open = gw.limiter.heal().await;
                gw.metrics.breaker_open.set(i64::try_from(open).unwrap_or(i64::MAX));
            }
        });
    }
}

/// A running gateway: its bound addresses and how to stop it.
pub struct Running {
    /// The proxy's bound address.
    pub addr: SocketAddr,
    /// The admin listener's bound address.
    pub admin_addr: SocketAddr,
    /// The shared state.
    pub gateway: Arc<Gateway>,
    /// Send `true` to begin graceful shutdown.
    pub shutdown: watch::Sender<bool>,
    /// Resolves when the proxy has drained.
    pub done: tokio::task::JoinHandle<()>,
}

impl Running {
    /// Begin graceful shutdown and wait for the drain.
    pub async fn stop(self) {
        let _ = self.shutdown.send(true);
        let _ = self.done.await;
    }
}

/// Bind the listeners and start serving. Use port 0 in `config` to get free ports.
pub async fn start(config: GatewayConfig) -> Result<Running, StartError> {
    let gw = Gateway::new(config).await?;
    start_with(gw).await
}

/// Start serving an already-built gateway.
pub async fn start_with(gw: Arc<Gateway>) -> Result<Running, StartError> {
    let listen = gw.config.listen;
    let listener = TcpListener::bind(listen)
        .await
        .map_err(|source| StartError::Bind { addr: listen, source })?;
    let admin_listen = gw.config.admin_listen;
    let admin = TcpListener::bind(admin_listen)
        .await
        .map_err(|source| StartError::Bind {
            addr: admin_listen,
            source,
        })?;
    let addr = listener
        .local_addr()
        .map_err(|source| StartError::Bind { addr: listen, source })?;
    let admin_addr = admin.local_addr().map_err(|source| StartError::Bind {
        addr: admin_listen,
        source,
    })?;
    let (tx, rx) = watch::channel(false);
    gw.spawn_probe(rx.clone());
    crate::config::reload::spawn_watcher(gw.clone(), rx.clone());
    tokio::spawn(crate::admin::serve(gw.clone(), admin, rx.clone()));
    let done = tokio::spawn(serve(gw.clone(), listener, rx));
    tracing::info!(
        %addr,
        %admin_addr,
        store = crate::describe::store_kind(gw.config.store.kind),
        upstream = %gw.config.upstream.url,
        admin_token = gw.config.admin.token.is_some(),
        "tollgate listening"
    );
    // Every start, not only the first: `admin.insecure`, ignored overrides, risky timeouts.
    for note in &gw.config.notes {
        tracing::warn!("{note}");
    }
    Ok(Running {
        addr,
        admin_addr,
        gateway: gw,
        shutdown: tx,
        done,
    })
}

/// The HTTP/2 connection preface (RFC 9113 §3.4): a client speaking h2c with prior knowledge
/// starts with it; anything else is HTTP/1.
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Peek (without consuming) at a new connection's first bytes: `Some(true)` for the HTTP/2
/// preface, `Some(false)` for HTTP/1, `None` if the client closed or failed before sending.
/// Only a client that has sent a strict prefix of the preface so far ("P", "PRI * ...") makes
/// this wait; it re-peeks every millisecond (the caller bounds the whole wait).
async fn sniff_h2(stream: &tokio::net::TcpStream) -> Option<bool> {
    let mut buf = [0u8; H2_PREFACE.len()];
    loop {
        let n = stream.peek(&mut buf).await.ok()?;
        if n == 0 {
            return None;
        }
        if buf[..n] != H2_PREFACE[..n] {
            return Some(false);
        }
        if n == H2_PREFACE.len() {
            return Some(true);
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// The proxy accept loop. Returns after shutdown was signalled and in-flight requests drained
/// (or `shutdown_grace` passed).
///
/// Each connection is sniffed once (`sniff_h2`, a peek) and then served by hyper's HTTP/1 or
/// HTTP/2 connection directly. (hyper-util's `auto` connection did the same detection but kept
/// a rewind wrapper in front of every read of the connection's life: about 2 % of the request
/// path's instructions.) Shutdown: every connection task watches `stop`, asks its connection
/// to finish gracefully, and holds a clone of `drained`; the loop waits until all are dropped.
pub async fn serve(gw: Arc<Gateway>, listener: TcpListener, mut stop: watch::Receiver<bool>) {
    let sc = gw.config.server.clone();
    let mut h1 = hyper::server::conn::http1::Builder::new();
    h1.timer(TokioTimer::new())
        .header_read_timeout(sc.header_read_timeout)
        // Twice the configured limits: within them tollgate checks the limits itself and
        // answers a JSON 431 (`respond.rs`); past them hyper's parser answers an empty one.
        .max_buf_size(sc.max_header_bytes.saturating_mul(2).max(8192))
        .max_headers(2 * crate::proxy::MAX_HEADERS)
        .keep_alive(true);
    let mut h2 = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
    h2.timer(TokioTimer::new())
        .keep_alive_interval(Some(sc.idle_timeout))
        .keep_alive_timeout(Duration::from_secs(20))
        .max_concurrent_streams(256);
    let (h1, h2) = (Arc::new(h1), Arc::new(h2));
    // Every connection task holds a sender; `recv` returns `None` once all of them are gone.
    let (drained, mut all_drained) = tokio::sync::mpsc::channel::<()>(1);
    let conns = Arc::new(Semaphore::new(sc.max_connections));
    loop {
        let (stream, peer) = tokio::select! {
            r = listener.accept() => match r {
                Ok(x) => x,
                Err(e) => {
                    // EMFILE and friends: back off instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = stop.changed() => break,
        };
        let Ok(permit) = conns.clone().try_acquire_owned() else {
            gw.metrics.local_response(503);
            tokio::spawn(reject_over_capacity(stream));
            continue;
        };
        let _ = stream.set_nodelay(true);
        let gw2 = gw.clone();
        let svc = service_fn(move |req: hyper::Request<Incoming>| {
            let gw = gw2.clone();
            async move { Ok::<_, std::convert::Infallible>(gw.handle(req, peer).await) }
        });
        let (h1, h2, drained, mut stop) = (h1.clone(), h2.clone(), drained.clone(), stop.clone());
        let open = crate::metrics::InFlight::enter(&gw.metrics.open_connections);
        let first_byte = sc.header_read_timeout;
        tokio::spawn(async move {
            // hyper's header timer starts only with the first request: a client that connects
            // and sends nothing would hold its connection (and permit) forever.
            let is_h2 = tokio::select! {
                r = tokio::time::timeout(first_byte, sniff_h2(&stream)) => match r {
                    Ok(Some(h2)) => h2,
                    _ => return,
                },
                _ = stop.changed() => return,
            };
            let io = TokioIo::new(stream);
            let result = if is_h2 {
                let conn = std::pin::pin!(h2.serve_connection(io, svc));
                until_stopped(conn, &mut stop, |c| c.graceful_shutdown()).await
            } else {
                let conn = std::pin::pin!(h1.serve_connection(io, svc).with_upgrades());
                until_stopped(conn, &mut stop, |c| c.graceful_shutdown()).await
            };
            if let Err(e) = result {
                tracing::debug!(error = %e, %peer, "connection ended with error");
            }
            drop(permit);
            drop(open);
            drop(drained);
        });
    }
    drop(listener);
    drop(drained);
    tracing::info!("shutting down: draining in-flight requests");
    tokio::select! {
        _ = all_drained.recv() => tracing::info!("drained"),
        _ = tokio::time::sleep(sc.shutdown_grace) => tracing::warn!("shutdown grace period passed; closing remaining connections"),
    }
}

/// Drive `conn` to its end; once `stop` fires, ask it to finish gracefully (`shutdown`: answer
/// what is in flight, then close) and keep driving it.
async fn until_stopped<C, T>(
    mut conn: std::pin::Pin<&mut C>,
    stop: &mut watch::Receiver<bool>,
    shutdown: impl FnOnce(std::pin::Pin<&mut C>),
) -> Result<T, hyper::Error>
where
    C: std::future::Future<Output = Result<T, hyper::Error>>,
{
    tokio::select! {
        r = conn.as_mut() => return r,
        _ = stop.changed() => {}
    }
    shutdown(conn.as_mut());
    conn.await
}

/// Over `max_connections`: answer 503 and close, without reading the request.
async fn reject_over_capacity(mut stream: tokio::net::TcpStream) {
    use tokio::io::AsyncWriteExt;
    let body = br#"{"error":"unavailable","message":"too many connections"}"#;
    let head = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\nconnection: close\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
        let _ = stream.write_all(head.as_bytes()).await;
        let _ = stream.write_all(body).await;
        let _ = stream.shutdown().await;
    })
    .await;
}
