//! The composition root: binds the listeners, starts the admin API, the file watcher, the store
//! probe and the other background tasks, serves connections (`conn`), and owns shutdown.
//! Everything below it gets only the shared [`State`] (an immutable config, the snapshot
//! handle, the limiter and the metrics).

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};

use crate::config::{GatewayConfig, Runtime};
use crate::state::{StartError, State};

mod conn;
mod h2_idle;
mod per_ip;

use conn::{accept_loop, bind, per_ip_of, spawn_worker, Worker};
pub use conn::{serve, serve_with, H2_MAX_STREAMS, H2_PING_TIMEOUT};

/// A running gateway: its bound addresses and how to stop it.
pub struct Running {
    /// The proxy's bound address.
    pub addr: SocketAddr,
    /// The admin listener's bound address.
    pub admin_addr: SocketAddr,
    /// The shared state.
    pub gateway: Arc<State>,
    /// Send `true` to begin graceful shutdown.
    pub shutdown: watch::Sender<bool>,
    /// Resolves when the proxy has drained.
    pub done: tokio::task::JoinHandle<()>,
    /// The Envoy rate-limit service's bound address, when it runs (`rls.listen`, or
    /// `tollgate rls`).
    pub rls_addr: Option<SocketAddr>,
}

impl Running {
    /// Begin graceful shutdown and wait for the drain.
    pub async fn stop(self) {
        let _ = self.shutdown.send(true);
        let _ = self.done.await;
    }

    /// What SIGTERM does: the drain window (`server.drain`) first — still serving, `/readyz`
    /// failing, HTTP/1.1 answered with `Connection: close`, HTTP/2 sent GOAWAY, idle connections
    /// left open — then [`Running::stop`]. Balancers that keep existing connections pinned to a
    /// terminating instance get every request answered (ARCHITECTURE.md, "Shutdown without
    /// dropping a request").
    pub async fn drain_then_stop(self) {
        let window = self.gateway.config().server.drain;
        if !window.is_zero() {
            let open = self.gateway.metrics().traffic.open_connections.get();
            tracing::info!(
                drain_ms = window.as_millis() as u64,
                open_connections = open,
                "draining: still serving; /readyz fails, HTTP/1.1 responses carry Connection: close, HTTP/2 connections get GOAWAY"
            );
            self.gateway.start_drain();
            tokio::time::sleep(window).await;
            tracing::info!(
                served = self.gateway.drained_requests(),
                open_connections = self.gateway.metrics().traffic.open_connections.get(),
                "drain window over: closing idle connections and finishing in-flight requests"
            );
        }
        self.stop().await;
    }
}

/// Bind the listeners and start serving. Use port 0 in `config` to get free ports.
pub async fn start(config: GatewayConfig) -> Result<Running, StartError> {
    let gw = State::new(config).await?;
    start_with(gw).await
}

/// Start serving an already-built gateway: bind every listener (a port that cannot be bound,
/// or a certificate that cannot be loaded, refuses to start before anything runs), start the
/// background tasks, then the workers that accept connections.
pub async fn start_with(gw: Arc<State>) -> Result<Running, StartError> {
    let bound = Bound::bind(&gw).await?;
    let (tx, rx) = watch::channel(false);
    if let Some((_, resolver)) = &bound.tls {
        spawn_cert_watcher(&gw, resolver.clone(), rx.clone());
    }
    spawn_background(&gw, &rx);
    let rls = match gw.config().rls.clone() {
        Some(settings) => match settings.listen {
            Some(listen) => Some(start_rls(&gw, settings, listen, rx.clone()).await?),
            None => None,
        },
        None => None,
    };
    let rls_addr = rls.as_ref().map(|r| r.addr);
    // The admin listener stays up until the proxy has drained, so the drain can be scraped.
    let (admin_stop, admin_rx) = watch::channel(false);
    let (addr, admin_addr, tls_on) = (bound.addr, bound.admin_addr, bound.tls.is_some());
    let Bound {
        listener,
        more,
        admin,
        tls,
        ..
    } = bound;
    tokio::spawn(crate::admin::serve(gw.clone(), admin, admin_rx));
    let accept = Accept {
        listener,
        more,
        addr,
        tls: tls.map(|(a, _)| a),
    };
    let done = spawn_workers(&gw, accept, rx, admin_stop, rls.map(|r| r.done))?;
    announce(&gw, addr, admin_addr, tls_on);
    Ok(Running {
        addr,
        admin_addr,
        gateway: gw,
        shutdown: tx,
        done,
        rls_addr,
    })
}

/// Every listener bound and the listener's TLS loaded, before anything starts.
struct Bound {
    /// The proxy listener (worker 0's, under thread-per-core).
    listener: TcpListener,
    /// The other workers' listeners (thread-per-core).
    more: Vec<std::net::TcpListener>,
    /// The admin listener.
    admin: TcpListener,
    /// Where the proxy and the admin API listen.
    addr: SocketAddr,
    admin_addr: SocketAddr,
    /// The TLS acceptor and its certificate resolver, when the listener speaks TLS.
    tls: Option<(tokio_rustls::TlsAcceptor, Arc<crate::http::tls::CertResolver>)>,
}

impl Bound {
    /// Bind the proxy (one listener per worker) and admin addresses and load the certificate.
    async fn bind(gw: &Arc<State>) -> Result<Self, StartError> {
        let listen = gw.config().listen;
        let (listener, more) = bind(listen, workers(gw)).map_err(|source| StartError::Bind { addr: listen, source })?;
        let (admin, admin_addr) = bind_admin(gw).await?;
        let addr = listener
            .local_addr()
            .map_err(|source| StartError::Bind { addr: listen, source })?;
        let tls = match &gw.config().tls {
            Some(t) => {
                let (cfg, resolver) = crate::http::tls::server_config(t)?;
                Some((tokio_rustls::TlsAcceptor::from(cfg), resolver))
            }
            None => None,
        };
        Ok(Bound {
            listener,
            more,
            admin,
            addr,
            admin_addr,
            tls,
        })
    }
}

/// Bind the admin listener (`admin_listen`), and the address it got.
async fn bind_admin(gw: &State) -> Result<(TcpListener, SocketAddr), StartError> {
    let at = gw.config().admin_listen;
    let bind_err = |source| StartError::Bind { addr: at, source };
    let admin = TcpListener::bind(at).await.map_err(bind_err)?;
    let addr = admin.local_addr().map_err(bind_err)?;
    Ok((admin, addr))
}

/// How many workers accept connections: 1 on the work-stealing runtime (its threads share the
/// one listener), one per core under thread-per-core.
fn workers(gw: &State) -> usize {
    match gw.config().server.runtime {
        Runtime::WorkStealing => 1,
        Runtime::ThreadPerCore => Runtime::workers(),
    }
}

/// The background tasks, each stopping when `stop` turns true: upstream health checks, the
/// store probe and permission check, slot renewal, the lease sweep, override refresh, and the
/// file watcher that reloads rules, keys and JWT key files.
fn spawn_background(gw: &Arc<State>, stop: &watch::Receiver<bool>) {
    spawn_health_check(gw, stop.clone());
    spawn_store_tasks(gw, stop);
    let mut files = vec![gw.config().rules_file.clone()];
    files.extend(gw.config().keys_file.clone());
    // The gateway file is watched too, not to apply it (that needs a restart) but to say that
    // the running config no longer matches it (`State::check_config_file`).
    files.push(gw.config().path.clone());
    // JWT public key / JWKS files reload like the rules (key rotation without a restart).
    if let Some(jwt) = &gw.config().identity.jwt {
        files.extend(jwt.files());
    }
    let reloader = gw.clone();
    crate::config::reload::spawn_watcher(files, stop.clone(), move |why| {
        let gw = reloader.clone();
        async move {
            let _ = gw.reload(why).await;
        }
    });
}

/// The background work every mode needs while it decides with the store: the breaker probe,
/// the permission check, slot renewal, the lease sweep, the runtime-override refresh.
fn spawn_store_tasks(gw: &Arc<State>, stop: &watch::Receiver<bool>) {
    spawn_probe(gw, stop.clone());
    spawn_permission_check(gw, stop.clone());
    spawn_slot_renewal(gw, stop.clone());
    spawn_lease_sweep(gw, stop.clone());
    spawn_override_refresh(gw, stop.clone());
    if let Some(regions) = gw.regions() {
        let store = &gw.config().store;
        let own = crate::regions::sync::StoreAt {
            cluster: store.kind == crate::config::StoreKind::RedisCluster,
            urls: store.urls.clone(),
            password: store.auth.password.clone(),
            ca_pem: store.auth.ca_file.as_ref().and_then(|f| std::fs::read(f).ok()),
        };
        tokio::spawn(crate::regions::sync::run(
            regions.clone(),
            own,
            format!("{}:region", store.key_prefix),
            gw.metrics().regions.clone(),
            stop.clone(),
        ));
    }
}

/// The proxy listeners, as the workers take them.
struct Accept {
    /// Worker 0's listener.
    listener: TcpListener,
    /// The other workers' listeners.
    more: Vec<std::net::TcpListener>,
    /// The proxy's address (for errors).
    addr: SocketAddr,
    /// The TLS acceptor, when the listener speaks TLS.
    tls: Option<tokio_rustls::TlsAcceptor>,
}

/// Start the workers on `bound`'s listeners. The task returned ends once every worker (and
/// the rate-limit service, `rls`, when it runs) has drained, the leases' unused units have gone
/// back to the store, and the admin listener has been told to stop (`admin_stop`).
fn spawn_workers(
    gw: &Arc<State>,
    bound: Accept,
    stop: watch::Receiver<bool>,
    admin_stop: watch::Sender<bool>,
    rls: Option<tokio::task::JoinHandle<()>>,
) -> Result<tokio::task::JoinHandle<()>, StartError> {
    let acceptor = bound.tls;
    let conns = Arc::new(Semaphore::new(gw.config().server.max_connections));
    let per_ip = per_ip_of(gw);
    let worker = || Worker {
        gw: gw.clone(),
        stop: stop.clone(),
        tls: acceptor.clone(),
        conns: conns.clone(),
        per_ip: per_ip.clone(),
    };
    // Thread-per-core: the other workers, each a single-threaded runtime on its own thread
    // with its own listener. They drain on `stop` like this one, and keep their runtimes (and
    // whatever store or upstream connections were opened on them) running until `release`, so
    // the leases can still be returned through them below.
    let (release, released) = watch::channel(false);
    let mut others = Vec::with_capacity(bound.more.len());
    for (i, l) in bound.more.into_iter().enumerate() {
        others.push(
            spawn_worker(i + 1, l, worker(), released.clone()).map_err(|source| StartError::Bind {
                addr: bound.addr,
                source,
            })?,
        );
    }
    let w = worker();
    let gw_done = gw.clone();
    Ok(tokio::spawn(async move {
        accept_loop(bound.listener, w).await;
        for drained in others {
            let _ = drained.await;
        }
        if let Some(r) = rls {
            let _ = r.await;
        }
        // Exchanges whose client left, and costs still to settle, finish first (at most the
        // upstream's deadline and a store call): what a client owes is charged before exit.
        let within = gw_done.config().upstream.request_timeout + gw_done.config().store.timeout * 4;
        if !gw_done.limiter().settled(within).await {
            tracing::warn!(
                waited_ms = within.as_millis() as u64,
                "shutdown: some upstream exchanges or settlements were still under way; their estimates stay spent"
            );
        }
        // Nothing is admitted any more: give every lease's unused units back to the fleet.
        gw_done.limiter().return_leases(true).await;
        let _ = release.send(true);
        let _ = admin_stop.send(true);
    }))
}

/// The start-up log line, then every configuration note (`admin.insecure`, ignored overrides,
/// risky timeouts): on every start, not only the first.
fn announce(gw: &State, addr: SocketAddr, admin_addr: SocketAddr, tls_on: bool) {
    let targets: Vec<String> = gw.upstream().status().into_iter().map(|(t, _)| t).collect();
    tracing::info!(
        %addr,
        %admin_addr,
        tls = tls_on,
        workers = workers(gw).max(1),
        runtime = ?gw.config().server.runtime,
        store = crate::describe::store_kind(gw.config().store.kind),
        upstream = %targets.join(","),
        admin_token = gw.config().admin.has_token(),
        "tollgate listening"
    );
    for note in &gw.config().notes {
        tracing::warn!("{note}");
    }
}

/// The Envoy rate-limit service, serving.
struct RlsRunning {
    /// Its bound address.
    addr: SocketAddr,
    /// Ends once it has drained after the stop signal.
    done: tokio::task::JoinHandle<()>,
}

/// How often the rate-limit config directory is looked at: an edit is in force within about
/// this much (plus the compile).
const RLS_CONFIG_POLL: std::time::Duration = std::time::Duration::from_millis(200);

/// Load the rate-limit config directory, bind `listen`, watch the directory (a broken file
/// keeps the config in force), and serve until `stop` (ARCHITECTURE.md, "The Envoy rate-limit
/// service").
async fn start_rls(
    gw: &Arc<State>,
    settings: crate::config::rls::RlsSettings,
    listen: SocketAddr,
    stop: watch::Receiver<bool>,
) -> Result<RlsRunning, StartError> {
    let at = Some(settings.config_dir_at);
    let rls =
        crate::rls::Rls::new(gw.clone(), settings).map_err(|e| e.named_in(&gw.config().path, "rls.config_dir", at))?;
    let listener = TcpListener::bind(listen)
        .await
        .map_err(|source| StartError::Bind { addr: listen, source })?;
    let addr = listener
        .local_addr()
        .map_err(|source| StartError::Bind { addr: listen, source })?;
    let watched = rls.clone();
    let mut seen = watched.fingerprint();
    spawn_every(RLS_CONFIG_POLL, stop.clone(), move || {
        let rls = watched.clone();
        let now = rls.fingerprint();
        let changed = now != seen;
        seen = now;
        async move {
            if changed {
                let r = rls.clone();
                let _ = crate::background::run("rls reload", move || r.reload()).await;
            }
        }
    });
    let grace = gw.config().server.shutdown_grace;
    let domains = rls.domains().by_name.len();
    let done = tokio::spawn(crate::rls::serve::serve(rls, listener, stop, grace));
    tracing::info!(%addr, domains, "envoy rate-limit service listening");
    Ok(RlsRunning { addr, done })
}

/// `tollgate rls`: the Envoy rate-limit service (on `rls.listen`, default
/// [`crate::config::rls::DEFAULT_RLS_LISTEN`]) and the admin listener, with no proxy listener.
pub async fn start_rls_only(config: GatewayConfig) -> Result<Running, StartError> {
    let Some(settings) = config.rls.clone() else {
        return Err(StartError::Config(crate::yaml::ConfigError::file(
            &config.path,
            "tollgate rls needs an rls: section (rls.config_dir)",
        )));
    };
    let gw = State::new(config).await?;
    let listen = match settings.listen {
        Some(l) => l,
        None => crate::config::rls::DEFAULT_RLS_LISTEN.parse().map_err(|_| {
            StartError::Config(crate::yaml::ConfigError::file(
                &gw.config().path,
                "bad default rls address",
            ))
        })?,
    };
    let (admin, admin_addr) = bind_admin(&gw).await?;
    let (tx, rx) = watch::channel(false);
    spawn_store_tasks(&gw, &rx);
    let rls = start_rls(&gw, settings, listen, rx).await?;
    let (admin_stop, admin_rx) = watch::channel(false);
    tokio::spawn(crate::admin::serve(gw.clone(), admin, admin_rx));
    let gw_done = gw.clone();
    let addr = rls.addr;
    let done = tokio::spawn(async move {
        let _ = rls.done.await;
        gw_done.limiter().return_leases(true).await;
        let _ = admin_stop.send(true);
    });
    tracing::info!(
        %addr,
        %admin_addr,
        store = crate::describe::store_kind(gw.config().store.kind),
        "tollgate rls: rate-limit service only (no proxy listener)"
    );
    for note in &gw.config().notes {
        tracing::warn!("{note}");
    }
    Ok(Running {
        addr,
        admin_addr,
        gateway: gw,
        shutdown: tx,
        done,
        rls_addr: Some(addr),
    })
}

/// Re-read the listener's certificate and key when their files change (and on `SIGHUP`). A
/// new pair that fails to load is refused, logged and counted; the old one keeps serving.
fn spawn_cert_watcher(gw: &Arc<State>, resolver: Arc<crate::http::tls::CertResolver>, stop: watch::Receiver<bool>) {
    set_cert_expiry(gw, &resolver);
    let gw = gw.clone();
    let files = resolver.files().to_vec();
    crate::config::reload::spawn_watcher(files, stop, move |why| {
        let (gw, resolver) = (gw.clone(), resolver.clone());
        async move {
            let reloading = resolver.clone();
            match tokio::task::spawn_blocking(move || reloading.reload()).await {
                Ok(Ok(())) => {
                    gw.metrics().tls.reload_ok.inc();
                    set_cert_expiry(&gw, &resolver);
                    tracing::info!(trigger = why.as_str(), "TLS certificate reloaded");
                }
                Ok(Err(e)) => {
                    gw.metrics().tls.reload_error.inc();
                    tracing::error!(trigger = why.as_str(), error = %e, "TLS certificate reload refused; the previous certificate keeps serving");
                }
                Err(e) => tracing::error!(error = %e, "TLS certificate reload task failed"),
            }
        }
    });
}

/// `tollgate_tls_certificate_expiry_timestamp_seconds` from the certificate now served.
fn set_cert_expiry(gw: &Arc<State>, resolver: &crate::http::tls::CertResolver) {
    if let Some(t) = resolver.serving().and_then(|c| crate::http::tls::not_after(&c)) {
        gw.metrics().tls.cert_expiry.set(i64::try_from(t).unwrap_or(i64::MAX));
    }
}

/// Run `job` every `every` until `stop` changes. A tick missed while a job ran late is delayed,
/// not bunched: a slow store never makes the background work pile up.
fn spawn_every<F, Fut>(every: std::time::Duration, mut stop: watch::Receiver<bool>, mut job: F)
where
    F: FnMut() -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = stop.changed() => return,
            }
            job().await;
        }
    });
}

/// Ask every upstream target `health_check.path` every `interval`, when configured.
fn spawn_health_check(gw: &Arc<State>, stop: watch::Receiver<bool>) {
    let Some(hc) = gw.config().upstream.health_check.clone() else {
        return;
    };
    let up = gw.upstream().clone();
    let (path, timeout) = (hc.path.clone(), hc.timeout);
    spawn_every(hc.interval, stop, move || {
        let (up, path) = (up.clone(), path.clone());
        async move { up.health_check(&path, timeout).await }
    });
}

/// Renew the concurrency slots of running requests every third of `store.concurrency_ttl`, so
/// a long request keeps its slot while a crashed gateway's slots expire. Cheap when no request
/// holds a slot (one lock, an empty map).
fn spawn_slot_renewal(gw: &Arc<State>, stop: watch::Receiver<bool>) {
    let gw = gw.clone();
    spawn_every(gw.config().store.concurrency_ttl / 3, stop, move || {
        let gw = gw.clone();
        async move { gw.limiter().renew_held().await }
    });
}

/// End expired leases and give their unused units back, every half lease time to live (so a
/// lease's units are back in the store at most 1.5 × ttl after it was taken).
fn spawn_lease_sweep(gw: &Arc<State>, stop: watch::Receiver<bool>) {
    let Some(cfg) = gw.config().store.leases else {
        return;
    };
    let gw = gw.clone();
    let every = std::time::Duration::from_micros(cfg.ttl_us.get() / 2);
    spawn_every(every, stop, move || {
        let gw = gw.clone();
        async move { gw.limiter().return_leases(false).await }
    });
}

/// How often each node re-reads the runtime override table: a change made on one node is in
/// force on every node within this (the admin API promises a second).
const OVERRIDE_REFRESH: std::time::Duration = std::time::Duration::from_millis(500);

/// Re-read the runtime overrides from the store every [`OVERRIDE_REFRESH`].
fn spawn_override_refresh(gw: &Arc<State>, stop: watch::Receiver<bool>) {
    let gw = gw.clone();
    spawn_every(OVERRIDE_REFRESH, stop, move || {
        let gw = gw.clone();
        async move {
            if let Err(e) = gw.refresh_overrides().await {
                tracing::debug!(error = %e, "runtime overrides not refreshed; the last ones stay in force");
            }
        }
    });
}

/// How often the Redis user's permissions are checked (at start, then this often).
const PERMISSION_CHECK_EVERY: std::time::Duration = std::time::Duration::from_secs(5);

/// Check the Redis user's permissions at start and every [`PERMISSION_CHECK_EVERY`]
/// ([`State::check_store_permissions`]): a missing permission is loud, not a silent fail-open.
fn spawn_permission_check(gw: &Arc<State>, stop: watch::Receiver<bool>) {
    if gw.limiter().store().is_memory() {
        return;
    }
    let gw = gw.clone();
    spawn_every(PERMISSION_CHECK_EVERY, stop, move || {
        let gw = gw.clone();
        async move { gw.check_store_permissions().await }
    });
}

/// While a shard's breaker is open, probe that shard and close its breaker when it answers.
fn spawn_probe(gw: &Arc<State>, stop: watch::Receiver<bool>) {
    if gw.limiter().store().is_memory() {
        return;
    }
    let gw = gw.clone();
    spawn_every(gw.config().store.probe_interval, stop, move || {
        let gw = gw.clone();
        async move {
            gw.limiter().heal().await;
            gw.refresh_breaker_gauges();
        }
    });
}
