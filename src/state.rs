//! The gateway's shared, immutable state: the config, the rules-and-keys snapshot handle, the
//! limiter and the metrics, and the reload that swaps the snapshot (`reload`). `server` builds it and hands
//! an `Arc` of it to the proxy and the admin API; nothing here starts a task or binds a socket.

use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use arc_swap::ArcSwap;

use crate::clock::{SharedClock, SystemClock};
use crate::config::{ConfigError, GatewayConfig, StoreKind};
use crate::identity::KeyRegistry;
use crate::limiter::keys::KeyBuilder;
use crate::limiter::memory::MemoryStore;
use crate::limiter::redis::{RedisMode, RedisStore};
use crate::limiter::{Backend, Limiter, Store, StoreError};
use crate::metrics::{Metrics, RuleMetrics};
use crate::rules::runtime::{RuntimeOverrides, StoredOverride};
use crate::rules::RuleSet;

mod reload;

pub use crate::activity::Changes;
pub use reload::ReloadReport;

/// Upstream failures are logged at most once per this, with a count of those suppressed.
const UPSTREAM_LOG_EVERY: Duration = Duration::from_secs(1);

/// The store-health probe waits at least this long (a store check's own deadline is shorter,
/// and a probe also loads the script where it is missing).
const READY_PROBE_MIN: Duration = Duration::from_millis(200);

/// Everything one request reads, swapped whole on reload.
pub struct Snapshot {
    /// The compiled rules.
    pub rules: RuleSet,
    /// The API key registry.
    pub keys: KeyRegistry,
    /// Metric handles, one per rule, same order.
    pub rule_metrics: Vec<RuleMetrics>,
    /// Per rule: the cost metrics of each spend that settles (`cost_from`), by spend slot.
    pub cost_metrics: Vec<Vec<(u8, crate::metrics::CostHandles)>>,
    /// When this snapshot was loaded.
    pub loaded_at: SystemTime,
    /// Per rule: the store keys of a `global` rule's limits (empty for other kinds), built
    /// once here instead of hashing the rule name on every request.
    pub global_keys: Vec<Vec<crate::limiter::StoreKey>>,
    /// Some rule spends by response (`count_when` or `cost_from`): only then does the request
    /// path look at what each rule reserved after the response.
    pub settles: bool,
    /// Some rule reserves from the request body (`estimate`): only then does the request path
    /// read a body before its check.
    pub estimates: bool,
    /// Per rule, per limit: what its rate-limit headers count ([`crate::http::headers::Unit`]);
    /// empty for a rule whose limits all count requests of its `cost`.
    pub rule_units: Vec<Vec<crate::http::headers::Unit>>,
    /// Per rule, per limit: the rate-limit header values every response it binds carries
    /// unchanged (`RateLimit-Policy`, `X-RateLimit-Limit`), made once here.
    pub rule_headers: Vec<Vec<crate::http::headers::FixedValues>>,
    /// Per rule: the position of its priority class in `upstream.adaptive.classes`
    /// ([`NO_CLASS`] when it names none).
    pub rule_class: Vec<u8>,
}

pub use crate::adaptive::NO_CLASS;

/// The gateway's shared state.
pub struct State {
    /// The validated gateway config (fixed for the process lifetime).
    config: GatewayConfig,
    /// Rules + keys; requests `load()` it once.
    snapshot: ArcSwap<Snapshot>,
    /// Runtime overrides (admin API, kept in the store), compiled against the loaded rules;
    /// refreshed from the store twice a second and after every reload.
    runtime: ArcSwap<RuntimeOverrides>,
    /// The store key of the runtime override table: `{<prefix>:overrides}`.
    overrides_key: String,
    /// The limiter (store, local fallback, deny cache, breaker).
    limiter: Limiter,
    /// Every counter, gauge and histogram `/metrics` exposes (shared with the upstream pool).
    metrics: Arc<Metrics>,
    /// Builds store keys.
    keys: KeyBuilder,
    /// The upstream's targets and their pools.
    upstream: Arc<crate::http::upstream::Upstream>,
    /// Which requests the access log writes.
    access: crate::proxy::access::Sampler,
    /// Time source.
    clock: SharedClock,
    /// Shadow denials seen (for log sampling).
    shadow_seen: AtomicU64,
    /// Serialises reloads (never held across request handling).
    reload_lock: tokio::sync::Mutex<()>,
    /// Upstream failures are logged at most once a second.
    upstream_log: crate::log_throttle::LogThrottle,
    /// SHA-256 of the gateway config file as it was read at start (`None`: not readable then).
    config_digest: Option<[u8; 32]>,
    /// What the admin dashboard shows over time (rates, limited hashes, store and reload history).
    activity: crate::activity::Activity,
    /// The last permission check's refusal (`NOPERM`), while it stands: `/readyz` fails with it.
    store_permission: parking_lot::Mutex<Option<String>>,
    /// Raised to `true` when the drain window begins ([`State::start_drain`]).
    drain: tokio::sync::watch::Sender<bool>,
    /// Requests answered during the drain window.
    drained_requests: AtomicU64,
    /// Span export over OTLP (`tracing.otlp`; `None`: off).
    exporter: Option<Arc<crate::telemetry::Exporter>>,
    /// Adaptive concurrency toward the upstream (`upstream.adaptive`; `None`: off).
    adaptive: Option<Arc<crate::adaptive::Adaptive>>,
    /// What is known of the peer regions (`store.region`; `None`: one region).
    regions: Option<Arc<crate::regions::Regions>>,
}

/// Seconds since the Unix epoch (0 before it).
fn unix_secs(t: SystemTime) -> u64 {
    t.duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// SHA-256 of a file's bytes, `None` if it cannot be read.
fn file_digest(path: &std::path::Path) -> Option<[u8; 32]> {
    use sha2::{Digest, Sha256};
    std::fs::read(path).ok().map(|b| Sha256::digest(&b).into())
}

/// Load rules and keys into a snapshot, resolving metric handles.
pub fn load_snapshot(config: &GatewayConfig, metrics: &Metrics) -> Result<Snapshot, ConfigError> {
    // A file for `tollgate rls` alone needs no rules: none, unless it names a rules file.
    let no_rules = !config.proxied && config.rules_file_at.is_none() && !config.rules_file.exists();
    let rules = if no_rules {
        RuleSet::from_str(&config.rules_file, "rules: []\n")
    } else {
        RuleSet::load(&config.rules_file, config.limits.max_rules)
    }
    .map_err(|e| e.named_in(&config.path, "rules_file", config.rules_file_at))?
    .with_slot_ttl(u64::try_from(config.store.concurrency_ttl.as_micros()).unwrap_or(u64::MAX));
    let keys = match &config.keys_file {
        Some(k) => KeyRegistry::load_max(k, config.limits.max_keys)
            .map_err(|e| e.named_in(&config.path, "keys_file", config.keys_file_at))?,
        None => KeyRegistry::empty(),
    };
    let rule_class = crate::adaptive::rule_classes(&rules, config.adaptive.as_ref(), &config.rules_file)?;
    let mut rules = rules;
    let global = crate::regions::rule_scopes(&rules, config.regions.as_ref(), &config.rules_file)?;
    if let Some(region) = &config.regions {
        // A global rule's counter in this region's store is this region's spend alone.
        for (r, _) in rules.rules.iter_mut().zip(&global).filter(|(_, g)| **g) {
            r.key_name = std::sync::Arc::from(format!("{}@{}", r.name, region.name));
        }
    }
    let rule_metrics = rules.rules.iter().map(|r| metrics.traffic.rule(&r.name)).collect();
    let cost_metrics = rules
        .rules
        .iter()
        .map(|r| {
            r.spends()
                .filter_map(|s| {
                    s.cost_from
                        .map(|cf| (s.slot, metrics.cost.handles(&r.name, &cf.source.to_string())))
                })
                .collect()
        })
        .collect();
    let kb = key_builder(config);
    let global_keys = rules
        .rules
        .iter()
        .map(|r| {
            if r.key != crate::rules::KeyKind::Global {
                return Vec::new();
            }
            let tag = kb.global_tag(&r.name);
            (0..r.limits.len()).map(|n| kb.key(&tag, &r.key_name, n)).collect()
        })
        .collect();
    let settles = rules.rules.iter().any(|r| r.count_when.is_some() || r.settles_cost());
    let estimates = rules.rules.iter().any(|r| r.estimates());
    let rule_units: Vec<Vec<crate::http::headers::Unit>> = rules
        .rules
        .iter()
        .map(|r| {
            if r.limit_spends.is_empty() && r.cost_from.as_ref().is_none_or(|c| c.unit.is_none()) {
                return Vec::new();
            }
            (0..r.limits.len()).map(|n| r.header_unit(n)).collect()
        })
        .collect();
    let rule_headers = rules
        .rules
        .iter()
        .zip(&rule_units)
        .map(|(r, units)| {
            (0..r.limits.len())
                .filter_map(|at| crate::http::headers::FixedValues::new(&r.name, &r.limits, at, r.cost, units))
                .collect()
        })
        .collect();
    Ok(Snapshot {
        rule_class,
        settles,
        estimates,
        rule_units,
        rule_headers,
        rules,
        keys,
        rule_metrics,
        cost_metrics,
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
    /// The upstream (its TLS client config) could not be set up.
    #[error("upstream: {0}")]
    Upstream(#[from] crate::http::upstream::UpstreamError),
    /// The OTLP exporter could not be started.
    #[error("tracing.otlp: {0}")]
    Telemetry(String),
    /// The listener's TLS could not be set up.
    #[error("tls: {0}")]
    Tls(#[from] crate::http::tls::TlsError),
    /// A listener could not bind.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The error.
        source: std::io::Error,
    },
}

impl State {
    /// The validated gateway config, fixed for the process lifetime.
    pub fn config(&self) -> &GatewayConfig {
        &self.config
    }

    /// The rules-and-keys snapshot handle: a request `load()`s it once.
    pub fn snapshot(&self) -> &ArcSwap<Snapshot> {
        &self.snapshot
    }

    /// The limiter: store, local fallback, deny cache, per-shard breakers.
    pub fn limiter(&self) -> &Limiter {
        &self.limiter
    }

    /// The metrics, with handles resolved when the rules loaded.
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// The store-key builder (prefix and salt).
    pub fn keys(&self) -> &KeyBuilder {
        &self.keys
    }

    /// The upstream's targets and their pools.
    pub fn upstream(&self) -> &Arc<crate::http::upstream::Upstream> {
        &self.upstream
    }

    /// The OTLP span exporter, when `tracing.otlp` is on.
    pub fn exporter(&self) -> Option<&Arc<crate::telemetry::Exporter>> {
        self.exporter.as_ref()
    }

    /// Which requests the access log writes.
    pub fn access_sampler(&self) -> &crate::proxy::access::Sampler {
        &self.access
    }

    /// The time source (a fake clock in tests).
    pub fn clock(&self) -> &SharedClock {
        &self.clock
    }

    /// Shadow denials seen so far (for log sampling).
    pub fn shadow_seen(&self) -> &AtomicU64 {
        &self.shadow_seen
    }

    /// What the admin dashboard shows over time: sampled rates, the most limited identity
    /// hashes, store and reload history.
    pub fn activity(&self) -> &crate::activity::Activity {
        &self.activity
    }

    /// Throttles the log lines of upstream failures.
    pub fn upstream_log(&self) -> &crate::log_throttle::LogThrottle {
        &self.upstream_log
    }

    /// Build the gateway: load rules and keys, connect the store.
    pub async fn new(config: GatewayConfig) -> Result<Arc<Self>, StartError> {
        Self::with_clock(config, Arc::new(SystemClock)).await
    }

    /// As [`State::new`] with an injected clock.
    pub async fn with_clock(config: GatewayConfig, clock: SharedClock) -> Result<Arc<Self>, StartError> {
        crate::http::tls::install_default_provider();
        let metrics = Metrics::new();
        let snap = load_snapshot(&config, &metrics)?;
        metrics.reload.set_rules_version(&snap.rules.version);
        metrics.reload.succeeded(snap.loaded_at);
        let config_digest = file_digest(&config.path);
        let sc = &config.store;
        let store = match sc.kind {
            StoreKind::Memory => Backend::Memory(Arc::new(
                MemoryStore::new(clock.clone(), sc.memory_max_keys).with_eviction_counters(
                    metrics.store.memory_evicted.clone(),
                    metrics.store.memory_refused.clone(),
                ),
            )),
            StoreKind::Redis | StoreKind::RedisCluster => {
                let mode = if sc.kind == StoreKind::Redis {
                    RedisMode::Single
                } else {
                    RedisMode::Cluster
                };
                let ca_pem = match &sc.auth.ca_file {
                    Some(p) => Some(
                        std::fs::read(p)
                            .map_err(|e| StoreError::Redis(format!("store.tls.ca_file {}: {e}", p.display())))?,
                    ),
                    None => None,
                };
                let auth = crate::limiter::redis::RedisAuth {
                    password: sc.auth.password.clone(),
                    ca_pem,
                };
                let store = RedisStore::connect_with(mode, &sc.urls, sc.timeout, sc.breaker_threshold, auth).await?;
                store.set_replicated(sc.replicated);
                store.set_scripting(sc.scripting);
                Backend::Redis(Arc::new(store))
            }
        };
        let local = Arc::new(
            MemoryStore::new(clock.clone(), sc.memory_max_keys).with_eviction_counters(
                metrics.store.memory_evicted.clone(),
                metrics.store.memory_refused.clone(),
            ),
        );
        let mut limiter = Limiter::new(store, local, sc.timeout, clock.clone());
        if config.limits.deny_cache {
            limiter = limiter.with_deny_cache(config.limits.deny_cache_max);
        }
        if let Some(cfg) = sc.leases {
            limiter = limiter.with_leases(crate::limiter::lease::Leases::new(cfg, metrics.store.leases.clone()));
        }
        let upstream = crate::http::upstream::Upstream::new(&config.upstream, &metrics)?;
        let access = crate::proxy::access::Sampler::new(config.access_log);
        let keys = key_builder(&config);
        let activity = crate::activity::Activity::new(clock.now_us() / 1_000_000);
        activity.reloaded(crate::activity::ReloadEvent {
            at: unix_secs(snap.loaded_at),
            trigger: "start",
            ok: true,
            version: snap.rules.version.clone(),
            changed: true,
            rules: None,
            keys: None,
            error: None,
        });
        let exporter = match &config.otlp {
            Some(c) => Some(crate::telemetry::Exporter::start(c, &metrics.otlp).map_err(StartError::Telemetry)?),
            None => None,
        };
        let overrides_key = format!("{{{}:overrides}}", config.store.key_prefix);
        let adaptive = config
            .adaptive
            .as_ref()
            .map(|c| crate::adaptive::Adaptive::new(c.clone(), metrics.adaptive.gauges(c.classes())));
        let regions = config
            .regions
            .as_ref()
            .map(|c| Arc::new(crate::regions::Regions::new(c.clone())));
        let gw = Arc::new(State {
            regions,
            snapshot: ArcSwap::from_pointee(snap),
            runtime: ArcSwap::from_pointee(RuntimeOverrides::default()),
            overrides_key,
            limiter,
            metrics,
            keys,
            upstream,
            access,
            clock,
            shadow_seen: AtomicU64::new(0),
            reload_lock: tokio::sync::Mutex::new(()),
            upstream_log: crate::log_throttle::LogThrottle::new(UPSTREAM_LOG_EVERY),
            config_digest,
            config,
            activity,
            store_permission: parking_lot::Mutex::new(None),
            drain: tokio::sync::watch::channel(false).0,
            drained_requests: AtomicU64::new(0),
            exporter,
            adaptive,
        });
        Ok(gw)
    }

    /// What is known of the peer regions (`None`: `store.region` is not set).
    pub fn regions(&self) -> Option<&Arc<crate::regions::Regions>> {
        self.regions.as_ref()
    }

    /// The adaptive concurrency limiter (`None`: `upstream.adaptive` is off).
    pub fn adaptive(&self) -> Option<&Arc<crate::adaptive::Adaptive>> {
        self.adaptive.as_ref()
    }

    /// The runtime overrides in force.
    pub fn runtime(&self) -> &ArcSwap<RuntimeOverrides> {
        &self.runtime
    }

    /// Read the runtime override table from the store and install it (compiled against the
    /// loaded rules) when it changed. Expired entries are dropped from the store on the way.
    pub async fn refresh_overrides(&self) -> Result<(), crate::limiter::StoreError> {
        let rows = self.limiter.store().table_load(&self.overrides_key).await?;
        let now = unix_secs(SystemTime::now());
        let mut stored = Vec::with_capacity(rows.len());
        for (field, json) in rows {
            match serde_json::from_str::<StoredOverride>(&json) {
                Ok(o) if o.expires_at > now => stored.push(o),
                Ok(_) => {
                    let _ = self.limiter.store().table_set(&self.overrides_key, &field, None).await;
                }
                Err(e) => tracing::warn!(field = %field, error = %e, "unreadable runtime override; ignored"),
            }
        }
        stored.sort_by(|a, b| (&a.rule, &a.tag).cmp(&(&b.rule, &b.tag)));
        if stored != self.runtime.load().stored {
            let snap = self.snapshot.load();
            self.runtime
                .store(Arc::new(RuntimeOverrides::compile(stored, &snap.rules)));
        }
        Ok(())
    }

    /// Store `o` (set or replace) and install it on this node at once; other nodes see it at
    /// their next refresh (within half a second).
    pub async fn put_override(&self, o: &StoredOverride) -> Result<(), crate::limiter::StoreError> {
        let json = serde_json::to_string(o).map_err(|e| crate::limiter::StoreError::Protocol(e.to_string()))?;
        self.limiter
            .store()
            .table_set(&self.overrides_key, &o.field(), Some(&json))
            .await?;
        self.refresh_overrides().await
    }

    /// Remove the override stored under `field`; true when there was one.
    pub async fn delete_override(&self, field: &str) -> Result<bool, crate::limiter::StoreError> {
        let existed = self.runtime.load().stored.iter().any(|o| o.field() == field);
        self.limiter.store().table_set(&self.overrides_key, field, None).await?;
        self.refresh_overrides().await?;
        Ok(existed)
    }

    /// Refresh the gauges that are read rather than counted (memory store size, the store's
    /// breakers, process memory and descriptors); `/metrics` calls this before encoding, so a
    /// scrape sees a breaker the moment it opens, not when the probe task next runs (a probe
    /// waiting on a cut-off shard can take longer than a scrape interval).
    pub fn refresh_gauges(&self) {
        self.refresh_breaker_gauges();
        let mem = match self.limiter.store() {
            Backend::Memory(m) => m,
            Backend::Redis(_) => self.limiter.local(),
        };
        self.metrics
            .store
            .memory_keys
            .set(i64::try_from(mem.len()).unwrap_or(i64::MAX));
        self.metrics.process.refresh();
    }

    /// `tollgate_store_breaker_open` (shards whose breaker is open) and the per-shard
    /// `tollgate_store_shard_breaker_open{shard}`, from the breakers as they are now.
    pub fn refresh_breaker_gauges(&self) {
        let Backend::Redis(r) = self.limiter.store() else {
            return;
        };
        let shards = r.shard_states();
        let open = shards.iter().filter(|(_, is_open, _)| *is_open).count();
        self.metrics
            .store
            .breaker_open
            .set(i64::try_from(open).unwrap_or(i64::MAX));
        for (shard, is_open, _) in shards {
            let g = self
                .metrics
                .store
                .shard_breaker_open
                .get_or_create(&crate::metrics::ShardLabels { shard });
            g.set(i64::from(is_open));
        }
    }

    /// Compare the gateway config file with the one read at start. Its settings are not applied
    /// live (listeners, store and identity are built once), so an edit is reported: a warning
    /// when the file starts to differ, and the `tollgate_config_file_changed` gauge while it does.
    pub fn check_config_file(&self) -> bool {
        let now = file_digest(&self.config.path);
        let differs = now != self.config_digest;
        let was = self.metrics.reload.config_file_changed.get() == 1;
        if differs && !was {
            tracing::warn!(
                file = %self.config.path.display(),
                "the gateway config file changed on disk; its settings are not reloaded live: restart tollgate to apply them (rules and keys files do reload)"
            );
        } else if !differs && was {
            tracing::info!(file = %self.config.path.display(), "the gateway config file matches the running config again");
        }
        self.metrics.reload.config_file_changed.set(i64::from(differs));
        differs
    }

    /// Check that the Redis user has every permission the scripts need (the real script path,
    /// which writes): a refusal (`NOPERM`) is logged at ERROR, counted, and fails `/readyz` until
    /// a later check passes. Other failures (the store down) say nothing about permissions and
    /// leave the verdict as it was.
    pub async fn check_store_permissions(&self) {
        match self.store_ready().await {
            Err(StoreError::Permission(e)) => {
                self.metrics.store.permission_errors.inc();
                tracing::error!(error = %e, "the Redis user lacks a permission tollgate needs: every check fails and follows its rule's failure policy; /readyz fails until this is fixed (the ACL to grant is in docs/operations.md#redis-acl)");
                *self.store_permission.lock() = Some(e);
            }
            Ok(()) => {
                if self.store_permission.lock().take().is_some() {
                    tracing::warn!("the Redis user has the permissions tollgate needs again");
                }
            }
            Err(_) => {}
        }
    }

    /// Begin the drain window: `/readyz` fails, HTTP/1.1 responses carry `Connection: close`
    /// and HTTP/2 connections get GOAWAY, while every request is still served (ARCHITECTURE.md,
    /// "Shutdown without dropping a request").
    pub fn start_drain(&self) {
        self.drain.send_replace(true);
    }

    /// In the drain window (or past it)? One atomic load.
    pub fn draining(&self) -> bool {
        *self.drain.borrow()
    }

    /// Count a request answered during the drain window; the count so far.
    pub fn drained_request(&self) -> u64 {
        self.drained_requests.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1
    }

    /// Requests answered during the drain window.
    pub fn drained_requests(&self) -> u64 {
        self.drained_requests.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Resolves (with `changed()`) when the drain window begins.
    pub fn drain_watch(&self) -> tokio::sync::watch::Receiver<bool> {
        self.drain.subscribe()
    }

    /// The standing permission refusal, if any (see [`State::check_store_permissions`]).
    pub fn store_permission_error(&self) -> Option<String> {
        self.store_permission.lock().clone()
    }

    /// Does the store answer the real script path (within a short deadline)? `/readyz?store=1`
    /// asks this; `/readyz` itself does not (readiness never depends on the store).
    pub async fn store_ready(&self) -> Result<(), StoreError> {
        match tokio::time::timeout(
            self.config.store.timeout.max(READY_PROBE_MIN),
            self.limiter.store().probe(),
        )
        .await
        {
            Ok(r) => r,
            Err(_) => Err(StoreError::Timeout),
        }
    }
}
