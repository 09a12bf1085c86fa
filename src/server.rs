//! The composition root: binds the listeners, starts the admin API, the file watcher and the
//! store probe, serves connections, and owns shutdown. Everything below it gets only the shared
//! [`State`] (an immutable config, the snapshot handle, the limiter and the metrics).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};

use crate::config::GatewayConfig;
use crate::state::{StartError, State};

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
    let gw = State::new(config).await?;
    start_with(gw).await
}

/// Start serving an already-built gateway.
pub async fn start_with(gw: Arc<State>) -> Result<Running, StartError> {
    let listen = gw.config().listen;
    let listener = TcpListener::bind(listen)
        .await
        .map_err(|source| StartError::Bind { addr: listen, source })?;
    let admin_listen = gw.config().admin_listen;
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
    // TLS before anything starts: a certificate that cannot be loaded refuses to start.
    let tls = match &gw.config().tls {
        Some(t) => {
            let (cfg, resolver) = crate::http::tls::server_config(t)?;
            Some((tokio_rustls::TlsAcceptor::from(cfg), resolver))
        }
        None => None,
    };
    let (tx, rx) = watch::channel(false);
    if let Some((_, resolver)) = &tls {
        spawn_cert_watcher(&gw, resolver.clone(), rx.clone());
    }
    spawn_health_check(&gw, rx.clone());
    spawn_probe(&gw, rx.clone());
    spawn_slot_renewal(&gw, rx.clone());
    spawn_lease_sweep(&gw, rx.clone());
    spawn_override_refresh(&gw, rx.clone());
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
    crate::config::reload::spawn_watcher(files, rx.clone(), move |why| {
        let gw = reloader.clone();
        async move {
            let _ = gw.reload(why).await;
        }
    });
    tokio::spawn(crate::admin::serve(gw.clone(), admin, rx.clone()));
    let acceptor = tls.map(|(a, _)| a);
    let tls_on = acceptor.is_some();
    let done = tokio::spawn(serve_with(gw.clone(), listener, rx, acceptor));
    let targets: Vec<String> = gw.upstream().status().into_iter().map(|(t, _)| t).collect();
    tracing::info!(
        %addr,
        %admin_addr,
        tls = tls_on,
        store = crate::describe::store_kind(gw.config().store.kind),
        upstream = %targets.join(","),
        admin_token = gw.config().admin.token.is_some(),
        "tollgate listening"
    );
    // Every start, not only the first: `admin.insecure`, ignored overrides, risky timeouts.
    for note in &gw.config().notes {
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
        tokio::time::sleep(SNIFF_RETRY).await;
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
pub async fn serve(gw: Arc<State>, listener: TcpListener, stop: watch::Receiver<bool>) {
    serve_with(gw, listener, stop, None).await
}

/// [`serve`], with TLS when `tls` is given: each connection's handshake (bounded by
/// `header_read_timeout`) comes first, and ALPN picks HTTP/2 or HTTP/1.1.
pub async fn serve_with(
    gw: Arc<State>,
    listener: TcpListener,
    mut stop: watch::Receiver<bool>,
    tls: Option<tokio_rustls::TlsAcceptor>,
) {
    let sc = gw.config().server.clone();
    let mut h1 = hyper::server::conn::http1::Builder::new();
    h1.timer(TokioTimer::new())
        .header_read_timeout(sc.header_read_timeout)
        // Twice the configured size: within it tollgate checks the limit itself and answers a
        // JSON 431 (`respond.rs`); past it hyper's parser answers an empty one. The field count
        // is hyper's default (100, `proxy::MAX_HEADERS`): any other value makes hyper fill a
        // heap array of that many entries before every parse, ≈ 2,500 instructions and an
        // allocation per request; past 100 fields hyper answers the 431 itself.
        .max_buf_size(sc.max_header_bytes.saturating_mul(2).max(8192))
        .keep_alive(true);
    let mut h2 = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
    h2.timer(TokioTimer::new())
        .keep_alive_interval(Some(sc.idle_timeout))
        .keep_alive_timeout(H2_PING_TIMEOUT)
        .max_concurrent_streams(H2_MAX_STREAMS);
    let (h1, h2) = (Arc::new(h1), Arc::new(h2));
    // Every connection task holds a sender; `recv` returns `None` once all of them are gone.
    let (drained, mut all_drained) = tokio::sync::mpsc::channel::<()>(1);
    // Flipped when `shutdown_grace` has passed: every connection still open is dropped.
    let (kill, killed) = watch::channel(false);
    let conns = Arc::new(Semaphore::new(sc.max_connections));
    loop {
        let (stream, peer) = tokio::select! {
            x = crate::http::accept(&listener) => x,
            _ = stop.changed() => break,
        };
        let Ok(permit) = conns.clone().try_acquire_owned() else {
            gw.metrics().local_response(503);
            tokio::spawn(reject_over_capacity(stream));
            continue;
        };
        let _ = stream.set_nodelay(true);
        let gw2 = gw.clone();
        let (h1, h2, drained, mut stop) = (h1.clone(), h2.clone(), drained.clone(), stop.clone());
        let mut killed = killed.clone();
        let open = crate::metrics::InFlight::enter(&gw.metrics().open_connections);
        let first_byte = sc.header_read_timeout;
        let tls = tls.clone();
        tokio::spawn(async move {
            let serve = serve_stream(stream, peer, tls, gw2, &h1, &h2, &mut stop, first_byte);
            let result = tokio::select! {
                r = serve => r,
                // The grace period passed: drop the connection, whatever it was doing.
                _ = killed.changed() => Ok(()),
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
        _ = tokio::time::sleep(sc.shutdown_grace) => {
            tracing::warn!("shutdown grace period passed; closing the remaining connections");
            let _ = kill.send(true);
        }
    }
    // Nothing is admitted any more: give every lease's unused units back to the fleet.
    gw.limiter().return_leases(true).await;
}

/// Serve one accepted connection until it ends: the TLS handshake when `tls` is given, then
/// HTTP/2 or HTTP/1.1. `first_byte` bounds the wait for a new connection's first bytes (and the
/// handshake) and, on plain HTTP/1.1, for the next request on an idle keep-alive connection.
///
/// Everything that lives only while a connection is busy (the TLS handshake, hyper's
/// connection) is boxed, so that the task of an idle connection is small.
#[allow(clippy::too_many_arguments)]
async fn serve_stream(
    stream: tokio::net::TcpStream,
    peer: SocketAddr,
    tls: Option<tokio_rustls::TlsAcceptor>,
    gw: Arc<State>,
    h1: &hyper::server::conn::http1::Builder,
    h2: &hyper::server::conn::http2::Builder<TokioExecutor>,
    stop: &mut watch::Receiver<bool>,
    first_byte: Duration,
) -> Result<(), hyper::Error> {
    match tls {
        None => {
            // hyper's header timer starts only with the first request: a client that connects
            // and sends nothing would hold its connection (and permit) forever.
            let is_h2 = tokio::select! {
                r = tokio::time::timeout(first_byte, sniff_h2(&stream)) => match r {
                    Ok(Some(h2)) => h2,
                    _ => return Ok(()),
                },
                _ = stop.changed() => return Ok(()),
            };
            if is_h2 {
                Box::pin(serve_conn(TokioIo::new(stream), true, gw, peer, h1, h2, stop)).await
            } else {
                serve_h1_parking(stream, gw, peer, h1, stop, first_byte).await
            }
        }
        Some(acceptor) => Box::pin(serve_tls(stream, acceptor, gw, peer, h1, h2, stop, first_byte)).await,
    }
}

/// [`serve_stream`] over TLS: the handshake (bounded by `first_byte`), then ALPN picks HTTP/2
/// or HTTP/1.1.
#[allow(clippy::too_many_arguments)]
async fn serve_tls(
    stream: tokio::net::TcpStream,
    acceptor: tokio_rustls::TlsAcceptor,
    gw: Arc<State>,
    peer: SocketAddr,
    h1: &hyper::server::conn::http1::Builder,
    h2: &hyper::server::conn::http2::Builder<TokioExecutor>,
    stop: &mut watch::Receiver<bool>,
    first_byte: Duration,
) -> Result<(), hyper::Error> {
    let s = tokio::select! {
        r = tokio::time::timeout(first_byte, acceptor.accept(stream)) => match r {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => {
                tracing::debug!(error = %e, %peer, "TLS handshake failed");
                return Ok(());
            }
            Err(_) => return Ok(()),
        },
        _ = stop.changed() => return Ok(()),
    };
    let is_h2 = s.get_ref().1.alpn_protocol() == Some(b"h2");
    serve_conn(TokioIo::new(s), is_h2, gw, peer, h1, h2, stop).await
}

/// Serve one connection (TLS, or h2c) with hyper's HTTP/1.1 or HTTP/2 connection, until it
/// ends; once `stop` fires it finishes gracefully.
async fn serve_conn<I>(
    io: I,
    is_h2: bool,
    gw: Arc<State>,
    peer: SocketAddr,
    h1: &hyper::server::conn::http1::Builder,
    h2: &hyper::server::conn::http2::Builder<TokioExecutor>,
    stop: &mut watch::Receiver<bool>,
) -> Result<(), hyper::Error>
where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    if is_h2 {
        // Each stream's future lives in its own task (hyper spawns one per request).
        let svc = service_fn(move |req: hyper::Request<Incoming>| {
            let gw = gw.clone();
            async move { Ok::<_, std::convert::Infallible>(gw.handle(req, peer).await) }
        });
        let conn = Box::pin(h2.serve_connection(io, svc));
        until_stopped(conn, stop, |c| c.graceful_shutdown()).await
    } else {
        // hyper's HTTP/1 connection allocates room for one service future for its whole life:
        // boxed, that room is a pointer, and the request handler's state (several KiB) is
        // allocated only while a request is in flight.
        let svc = service_fn(move |req: hyper::Request<Incoming>| {
            let gw = gw.clone();
            Box::pin(async move { Ok::<_, std::convert::Infallible>(gw.handle(req, peer).await) })
        });
        let conn = Box::pin(h1.serve_connection(io, svc).with_upgrades());
        until_stopped(conn, stop, |c| c.graceful_shutdown()).await
    }
}

/// Serve a plain HTTP/1.1 connection, dropping hyper's connection (and its buffers) whenever
/// the client is idle between requests (`crate::http::idle`): the idle connection is the
/// socket and this task's state only. It is closed when no request starts within
/// `idle_timeout` (`server.header_read_timeout`, as hyper's header timer did for an idle
/// connection) or once `stop` fires.
async fn serve_h1_parking(
    mut stream: tokio::net::TcpStream,
    gw: Arc<State>,
    peer: SocketAddr,
    h1: &hyper::server::conn::http1::Builder,
    stop: &mut watch::Receiver<bool>,
    idle_timeout: Duration,
) -> Result<(), hyper::Error> {
    use crate::http::idle::{ConnShared, IdleIo, Tracked};
    let shared = Arc::new(ConnShared::default());
    loop {
        let io = TokioIo::new(IdleIo::new(stream, shared.clone()));
        let (gw, conn_shared) = (gw.clone(), shared.clone());
        let svc = service_fn(move |req: hyper::Request<Incoming>| {
            conn_shared.on_request(&req);
            let (gw, shared) = (gw.clone(), conn_shared.clone());
            async move { Ok::<_, std::convert::Infallible>(gw.handle(req, peer).await.map(|b| Tracked::new(b, shared))) }
        });
        let conn = Box::pin(h1.serve_connection(io, svc).with_upgrades());
        let ended = until_stopped(conn, stop, |c| c.graceful_shutdown()).await;
        // Parked: hyper saw the end of the stream between two requests, with nothing unread.
        // An error instead means it held bytes it did not get to parse: close.
        let parked = shared.take_parked();
        ended?;
        let Some(s) = parked else { return Ok(()) };
        if *stop.borrow() {
            return Ok(());
        }
        tokio::select! {
            r = tokio::time::timeout(idle_timeout, s.readable()) => match r {
                Ok(Ok(())) => {}
                _ => return Ok(()),
            },
            _ = stop.changed() => return Ok(()),
        }
        stream = s;
    }
}

/// Re-read the listener's certificate and key when their files change (and on `SIGHUP`). A
/// new pair that fails to load is refused, logged and counted; the old one keeps serving.
fn spawn_cert_watcher(gw: &Arc<State>, resolver: Arc<crate::http::tls::CertResolver>, stop: watch::Receiver<bool>) {
    let gw = gw.clone();
    let files = resolver.files().to_vec();
    crate::config::reload::spawn_watcher(files, stop, move |why| {
        let (gw, resolver) = (gw.clone(), resolver.clone());
        async move {
            match tokio::task::spawn_blocking(move || resolver.reload()).await {
                Ok(Ok(())) => {
                    gw.metrics().tls_reload_ok.inc();
                    tracing::info!(trigger = why.as_str(), "TLS certificate reloaded");
                }
                Ok(Err(e)) => {
                    gw.metrics().tls_reload_error.inc();
                    tracing::error!(trigger = why.as_str(), error = %e, "TLS certificate reload refused; the previous certificate keeps serving");
                }
                Err(e) => tracing::error!(error = %e, "TLS certificate reload task failed"),
            }
        }
    });
}

/// Ask every upstream target `health_check.path` every `interval`, when configured.
fn spawn_health_check(gw: &Arc<State>, mut stop: watch::Receiver<bool>) {
    let Some(hc) = gw.config().upstream.health_check.clone() else {
        return;
    };
    let up = gw.upstream().clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(hc.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = stop.changed() => return,
            }
            up.health_check(&hc.path, hc.timeout).await;
        }
    });
}

/// Drive `conn` to its end; once `stop` fires, ask it to finish gracefully (`shutdown`: answer
/// what is in flight, then close) and keep driving it.
async fn until_stopped<C, T>(
    mut conn: std::pin::Pin<Box<C>>,
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

/// How long to wait before peeking again while a connection's first bytes trickle in (the
/// whole sniff is bounded by `header_read_timeout`).
const SNIFF_RETRY: Duration = Duration::from_millis(1);

/// An HTTP/2 peer that does not answer a keep-alive ping within this is gone: close it.
pub const H2_PING_TIMEOUT: Duration = Duration::from_secs(20);

/// Streams one HTTP/2 client may have open at once: enough for a busy multiplexing client,
/// few enough that one connection cannot hold a large share of the gateway's memory.
pub const H2_MAX_STREAMS: u32 = 256;

/// How long a connection over `max_connections` is served its 503 before it is closed.
const REJECT_WITHIN: Duration = Duration::from_secs(1);

/// Over `max_connections`: answer the connection's request with the 503 of `respond.rs`, in
/// the protocol the client speaks (HTTP/1.1, or h2c with prior knowledge), then close. Bounded
/// by [`REJECT_WITHIN`], so a slow client cannot hold the extra connection.
async fn reject_over_capacity(stream: tokio::net::TcpStream) {
    let svc = service_fn(|_req: hyper::Request<Incoming>| async {
        Ok::<_, std::convert::Infallible>(
            crate::http::respond::GatewayError::Unavailable("too many connections").into_response(),
        )
    });
    let _ = tokio::time::timeout(REJECT_WITHIN, async move {
        let Some(is_h2) = sniff_h2(&stream).await else {
            return;
        };
        let io = TokioIo::new(stream);
        let _ = if is_h2 {
            hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                .serve_connection(io, svc)
                .await
        } else {
            hyper::server::conn::http1::Builder::new()
                .keep_alive(false)
                .serve_connection(io, svc)
                .await
        };
    })
    .await;
}
/// Renew the concurrency slots of running requests every third of `store.concurrency_ttl`, so
/// a long request keeps its slot while a crashed gateway's slots expire. Cheap when no request
/// holds a slot (one lock, an empty map).
fn spawn_slot_renewal(gw: &Arc<State>, mut stop: watch::Receiver<bool>) {
    let gw = gw.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(gw.config().store.concurrency_ttl / 3);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = stop.changed() => return,
            }
            gw.limiter().renew_held().await;
        }
    });
}

/// End expired leases and give their unused units back, every half lease time to live (so a
/// lease's units are back in the store at most 1.5 × ttl after it was taken).
fn spawn_lease_sweep(gw: &Arc<State>, mut stop: watch::Receiver<bool>) {
    let Some(cfg) = gw.config().store.leases else {
        return;
    };
    let gw = gw.clone();
    tokio::spawn(async move {
        let every = std::time::Duration::from_micros(cfg.ttl_us.get() / 2);
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = stop.changed() => return,
            }
            gw.limiter().return_leases(false).await;
        }
    });
}

/// How often each node re-reads the runtime override table: a change made on one node is in
/// force on every node within this (the admin API promises a second).
const OVERRIDE_REFRESH: std::time::Duration = std::time::Duration::from_millis(500);

/// Re-read the runtime overrides from the store every [`OVERRIDE_REFRESH`].
fn spawn_override_refresh(gw: &Arc<State>, mut stop: watch::Receiver<bool>) {
    let gw = gw.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(OVERRIDE_REFRESH);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = stop.changed() => return,
            }
            if let Err(e) = gw.refresh_overrides().await {
                tracing::debug!(error = %e, "runtime overrides not refreshed; the last ones stay in force");
            }
        }
    });
}

/// While a shard's breaker is open, probe that shard and close its breaker when it answers.
fn spawn_probe(gw: &Arc<State>, mut stop: watch::Receiver<bool>) {
    if gw.limiter().store.is_memory() {
        return;
    }
    let gw = gw.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(gw.config().store.probe_interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = stop.changed() => return,
            }
            let open = gw.limiter().heal().await;
            gw.metrics().breaker_open.set(i64::try_from(open).unwrap_or(i64::MAX));
        }
    });
}
