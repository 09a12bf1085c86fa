//! Serving connections: the listeners (one, or one per worker with `SO_REUSEPORT`), the
//! accept loop with its connection limit and drain, and each connection: the h2c sniff, the TLS
//! handshake, hyper's HTTP/1.1 (parked while idle) or HTTP/2 connection (closed when idle,
//! `h2_idle`), graceful shutdown, and the 503 for a connection over `max_connections` or
//! `max_connections_per_ip` (`per_ip`).

use std::future::Future;
use std::net::SocketAddr;
use std::pin::pin;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};

use super::h2_idle::{H2Streams, StreamBody};
use super::per_ip::{Entry, PerIp};
use crate::rt::stop::{Level, StopSignal, StopWatch};
use crate::state::State;

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
/// a rewind wrapper in front of every read of the connection's life; its cost is in
/// docs/performance.md.) Shutdown: every connection task watches the loop's [`StopSignal`]
/// (raised when `stop` fires), asks its connection to finish gracefully, and holds a clone of
/// `drained`; the loop waits until all are dropped.
pub async fn serve(gw: Arc<State>, listener: TcpListener, stop: watch::Receiver<bool>) {
    serve_with(gw, listener, stop, None).await
}

/// [`serve`], with TLS when `tls` is given: each connection's handshake (bounded by
/// `header_read_timeout`) comes first, and ALPN picks HTTP/2 or HTTP/1.1.
pub async fn serve_with(
    gw: Arc<State>,
    listener: TcpListener,
    stop: watch::Receiver<bool>,
    tls: Option<tokio_rustls::TlsAcceptor>,
) {
    let conns = Arc::new(Semaphore::new(gw.config().server.max_connections));
    let w = Worker {
        per_ip: per_ip_of(&gw),
        gw: gw.clone(),
        stop,
        tls,
        conns,
    };
    accept_loop(listener, w).await;
    // Nothing is admitted any more: give every lease's unused units back to the fleet.
    gw.limiter().return_leases(true).await;
}

/// What one accepting worker shares with the others.
pub(super) struct Worker {
    /// The shared state.
    pub(super) gw: Arc<State>,
    /// Fires `true` for graceful shutdown.
    pub(super) stop: watch::Receiver<bool>,
    /// The listener's TLS, if any.
    pub(super) tls: Option<tokio_rustls::TlsAcceptor>,
    /// `server.max_connections`, for all workers together.
    pub(super) conns: Arc<Semaphore>,
    /// `server.max_connections_per_ip`, for all workers together (`None`: no cap).
    pub(super) per_ip: Option<Arc<PerIp>>,
}

/// The per-address connection count `gw`'s config asks for, if any.
pub(super) fn per_ip_of(gw: &State) -> Option<Arc<PerIp>> {
    let c = gw.config();
    PerIp::new(
        c.server.max_connections_per_ip,
        c.identity.ipv6_prefix,
        c.identity.trusted_proxies.clone(),
    )
}

/// Accept and serve connections from `listener` until `stop` fires, then drain them (bounded
/// by `shutdown_grace`).
pub(super) async fn accept_loop(listener: TcpListener, w: Worker) {
    let Worker {
        gw,
        mut stop,
        tls,
        conns,
        per_ip,
    } = w;
    let sc = gw.config().server.clone();
    let mut h1 = hyper::server::conn::http1::Builder::new();
    // The header-read timeout is armed for every request head: a coarse deadline, not a
    // tokio timer (`http::coarse_timer`).
    h1.timer(crate::rt::coarse_timer::CoarseTimer)
        .header_read_timeout(sc.header_read_timeout)
        // Twice the configured size: within it tollgate checks the limit itself and answers a
        // JSON 431 (`respond.rs`); past it hyper's parser answers a bare one, which
        // `http::parse_reply` swaps for the same JSON 431. The field count is hyper's default
        // (100, `proxy::MAX_HEADERS`): any other value makes hyper fill a heap array of that
        // many entries before every parse, an allocation per request (docs/performance.md);
        // past 100 fields hyper answers the 431 itself (made JSON the same way).
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
    // What the connections watch: raised to `Graceful` when `stop` fires, to `Killed` when
    // `shutdown_grace` has passed (every connection still open is dropped).
    let signal = StopSignal::new();
    // The drain window (`State::start_drain`): connections keep being accepted and served.
    let mut drain = gw.drain_watch();
    let mut draining = false;
    loop {
        let (stream, peer) = tokio::select! {
            x = crate::http::accept(&listener) => x,
            _ = stop.changed() => break,
            r = drain.changed(), if !draining => {
                draining = true;
                if r.is_ok() {
                    signal.raise(Level::Draining);
                }
                continue;
            }
        };
        let Ok(permit) = conns.clone().try_acquire_owned() else {
            gw.metrics().traffic.local_response(503);
            tokio::spawn(reject_over_capacity(stream, "too many connections"));
            continue;
        };
        let counted = match per_ip.as_ref().map(|p| (p, p.enter(peer.ip()))) {
            Some((p, Entry::Refused)) => {
                drop(permit);
                gw.metrics().traffic.local_response(503);
                if let Some(suppressed) = p.log.allow() {
                    tracing::warn!(peer = %peer.ip(), cap = sc.max_connections_per_ip.unwrap_or(0), suppressed, "connection refused: its address holds server.max_connections_per_ip connections already (repeats logged at most once a second, `suppressed` counts the others)");
                }
                tokio::spawn(reject_over_capacity(stream, "too many connections from this address"));
                continue;
            }
            Some((_, Entry::Counted(c))) => Some(c),
            _ => None,
        };
        let _ = stream.set_nodelay(true);
        let gw2 = gw.clone();
        let (h1, h2, drained) = (h1.clone(), h2.clone(), drained.clone());
        let watch = signal.watch();
        let open = crate::metrics::InFlight::enter(&gw.metrics().traffic.open_connections);
        let first_byte = sc.header_read_timeout;
        let tls = tls.clone();
        tokio::spawn(async move {
            let with = Serve {
                gw: gw2,
                h1: &h1,
                h2: &h2,
                stop: &watch,
                first_byte,
            };
            let mut serve = pin!(serve_stream(stream, peer, tls, with));
            let result = std::future::poll_fn(|cx| {
                // The grace period passed: drop the connection, whatever it was doing.
                if watch.poll_level(cx) == Level::Killed {
                    return Poll::Ready(Ok(()));
                }
                serve.as_mut().poll(cx)
            })
            .await;
            if let Err(e) = result {
                tracing::debug!(error = %e, %peer, "connection ended with error");
            }
            drop(counted);
            drop(permit);
            drop(open);
            drop(drained);
        });
    }
    drop(listener);
    drop(drained);
    signal.raise(Level::Graceful);
    tracing::info!("shutting down: draining in-flight requests");
    tokio::select! {
        _ = all_drained.recv() => tracing::info!("drained"),
        _ = tokio::time::sleep(sc.shutdown_grace) => {
            tracing::warn!("shutdown grace period passed; closing the remaining connections");
            signal.raise(Level::Killed);
        }
    }
}

/// Bind the proxy listener; with `workers` > 1 (thread-per-core), `workers - 1` more on the same
/// address, all with `SO_REUSEPORT`, for the other workers' runtimes to take over.
pub(super) fn bind(addr: SocketAddr, workers: usize) -> std::io::Result<(TcpListener, Vec<std::net::TcpListener>)> {
    if workers <= 1 {
        let l = std::net::TcpListener::bind(addr)?;
        l.set_nonblocking(true)?;
        return Ok((TcpListener::from_std(l)?, Vec::new()));
    }
    let first = bind_shared(addr)?;
    // Port 0: the others take the port the first one got.
    let addr = first.local_addr()?;
    let mut more = Vec::with_capacity(workers - 1);
    for _ in 1..workers {
        more.push(bind_shared(addr)?.into_std()?);
    }
    Ok((first, more))
}

/// A listener on `addr` with `SO_REUSEPORT`: the kernel spreads new connections over every
/// socket bound so.
fn bind_shared(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let s = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    s.set_reuseaddr(true)?;
    s.set_reuseport(true)?;
    s.bind(addr)?;
    s.listen(1024)
}

/// Start worker `n` of a thread-per-core gateway: a thread with a single-threaded runtime that
/// serves `listener` like the first worker does. The receiver resolves once it has drained;
/// its runtime keeps running until `release` turns `true`.
pub(super) fn spawn_worker(
    n: usize,
    listener: std::net::TcpListener,
    w: Worker,
    mut release: watch::Receiver<bool>,
) -> std::io::Result<tokio::sync::oneshot::Receiver<()>> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let (drained, done) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name(format!("tollgate-worker-{n}"))
        .spawn(move || {
            rt.block_on(async move {
                match TcpListener::from_std(listener) {
                    Ok(l) => accept_loop(l, w).await,
                    Err(e) => tracing::error!(error = %e, worker = n, "worker cannot use its listener"),
                }
                let _ = drained.send(());
                let _ = release.wait_for(|r| *r).await;
            });
        })?;
    Ok(done)
}

/// What every connection of a listener is served with: the gateway, hyper's HTTP/1.1 and HTTP/2
/// builders, the shutdown watch, and the deadline on a new connection's first bytes (and, on
/// plain HTTP/1.1, on the next request of an idle keep-alive connection).
#[derive(Clone)]
struct Serve<'a> {
    gw: Arc<State>,
    h1: &'a hyper::server::conn::http1::Builder,
    h2: &'a hyper::server::conn::http2::Builder<TokioExecutor>,
    stop: &'a StopWatch,
    first_byte: Duration,
}

/// Serve one accepted connection until it ends: the TLS handshake when `tls` is given, then
/// HTTP/2 or HTTP/1.1. `first_byte` bounds the wait for a new connection's first bytes (and the
/// handshake) and, on plain HTTP/1.1, for the next request on an idle keep-alive connection.
///
/// Everything that lives only while a connection is busy (the TLS handshake, hyper's
/// connection) is boxed, so that the task of an idle connection is small.
async fn serve_stream(
    stream: tokio::net::TcpStream,
    peer: SocketAddr,
    tls: Option<tokio_rustls::TlsAcceptor>,
    serve: Serve<'_>,
) -> Result<(), hyper::Error> {
    let first_byte = serve.first_byte;
    let stop = serve.stop;
    match tls {
        None => {
            // hyper's header timer starts only with the first request: a client that connects
            // and sends nothing would hold its connection (and permit) forever.
            let is_h2 = tokio::select! {
                r = tokio::time::timeout(first_byte, sniff_h2(&stream)) => match r {
                    Ok(Some(h2)) => h2,
                    _ => return Ok(()),
                },
                _ = stop.reached(Level::Graceful) => return Ok(()),
            };
            if is_h2 {
                Box::pin(serve_conn(
                    TokioIo::new(stream),
                    true,
                    crate::proxy::Peer::plain(peer),
                    serve,
                ))
                .await
            } else {
                serve_h1_parking(stream, peer, serve).await
            }
        }
        Some(acceptor) => Box::pin(serve_tls(stream, acceptor, peer, serve)).await,
    }
}

/// [`serve_stream`] over TLS: the handshake (bounded by `first_byte`), then ALPN picks HTTP/2
/// or HTTP/1.1.
async fn serve_tls(
    stream: tokio::net::TcpStream,
    acceptor: tokio_rustls::TlsAcceptor,
    peer: SocketAddr,
    serve: Serve<'_>,
) -> Result<(), hyper::Error> {
    let (first_byte, stop) = (serve.first_byte, serve.stop);
    let s = tokio::select! {
        r = tokio::time::timeout(first_byte, acceptor.accept(stream)) => match r {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => {
                tracing::debug!(error = %e, %peer, "TLS handshake failed");
                return Ok(());
            }
            Err(_) => return Ok(()),
        },
        _ = stop.reached(Level::Graceful) => return Ok(()),
    };
    let is_h2 = s.get_ref().1.alpn_protocol() == Some(b"h2");
    let tls = match s.get_ref().1.protocol_version() {
        Some(rustls::ProtocolVersion::TLSv1_3) => "TLSv1.3",
        Some(rustls::ProtocolVersion::TLSv1_2) => "TLSv1.2",
        _ => "TLS",
    };
    let peer = crate::proxy::Peer {
        addr: peer,
        tls: Some(tls),
    };
    // hyper's own answers to request heads it cannot parse become JSON (`http::parse_reply`;
    // an HTTP/2 connection never writes one, and passes through after its first write).
    let s = crate::http::parse_reply::ParseReply::new(s);
    serve_conn(TokioIo::new(s), is_h2, peer, serve).await
}

/// Serve one connection (TLS, or h2c) with hyper's HTTP/1.1 or HTTP/2 connection, until it
/// ends; once `stop` fires it finishes gracefully.
async fn serve_conn<I>(io: I, is_h2: bool, peer: crate::proxy::Peer, serve: Serve<'_>) -> Result<(), hyper::Error>
where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let Serve { gw, h1, h2, stop, .. } = serve;
    if is_h2 {
        let idle = gw.config().server.idle_timeout;
        let streams = H2Streams::new();
        let counted = streams.clone();
        // Each stream's future lives in its own task (hyper spawns one per request).
        let svc = service_fn(move |req: hyper::Request<Incoming>| {
            let gw = gw.clone();
            let open = counted.open();
            async move { Ok::<_, std::convert::Infallible>(gw.handle(req, peer).await.map(|b| StreamBody::new(b, open))) }
        });
        let mut conn = Box::pin(h2.serve_connection(io, svc));
        // Finish gracefully (GOAWAY, then close) on shutdown, or once no stream has been open
        // for `idle_timeout`.
        let mut timer = Box::pin(tokio::time::sleep(idle));
        let mut finishing = false;
        std::future::poll_fn(|cx| {
            if !finishing {
                // GOAWAY from the drain window on: the client opens its next streams on a new
                // connection (to another gateway, once this one is out of the balancer).
                let stopping = stop.poll_level(cx) >= Level::Draining;
                if stopping || streams.poll_idle(&mut timer, idle, cx) {
                    if !stopping {
                        tracing::debug!(peer = %peer.addr, idle_ms = idle.as_millis() as u64, "closing an idle HTTP/2 connection");
                    }
                    finishing = true;
                    conn.as_mut().graceful_shutdown();
                }
            }
            conn.as_mut().poll(cx)
        })
        .await
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
/// the client is idle between requests (`crate::rt::idle`): the idle connection is the
/// socket and this task's state only. It is closed when no request starts within
/// `idle_timeout` (`server.header_read_timeout`, as hyper's header timer did for an idle
/// connection) or once `stop` fires.
async fn serve_h1_parking(
    mut stream: tokio::net::TcpStream,
    peer: SocketAddr,
    serve: Serve<'_>,
) -> Result<(), hyper::Error> {
    let Serve {
        gw,
        h1,
        stop,
        first_byte: idle_timeout,
        ..
    } = serve;
    use crate::http::parse_reply::ParseReply;
    use crate::rt::idle::{ConnShared, IdleIo, Tracked};
    let shared = Arc::new(ConnShared::default());
    loop {
        // hyper's own answers to request heads it cannot parse become JSON (`http::parse_reply`).
        let io = TokioIo::new(ParseReply::new(IdleIo::new(stream, shared.clone())));
        let (gw, conn_shared) = (gw.clone(), shared.clone());
        let svc = service_fn(move |req: hyper::Request<Incoming>| {
            conn_shared.on_request(crate::proxy::facts::framing(req.method(), req.headers()));
            let (gw, shared) = (gw.clone(), conn_shared.clone());
            async move {
                Ok::<_, std::convert::Infallible>(
                    gw.handle(req, crate::proxy::Peer::plain(peer))
                        .await
                        .map(|b| Tracked::new(b, shared)),
                )
            }
        });
        let conn = Box::pin(h1.serve_connection(io, svc).with_upgrades());
        let ended = until_stopped(conn, stop, |c| c.graceful_shutdown()).await;
        // Parked: hyper saw the end of the stream between two requests, with nothing unread.
        // An error instead means it held bytes it did not get to parse: close.
        let parked = shared.take_parked();
        ended?;
        let Some(s) = parked else { return Ok(()) };
        if stop.level() >= Level::Graceful {
            return Ok(());
        }
        tokio::select! {
            r = tokio::time::timeout(idle_timeout, s.readable()) => match r {
                Ok(Ok(())) => {}
                _ => return Ok(()),
            },
            _ = stop.reached(Level::Graceful) => return Ok(()),
        }
        stream = s;
    }
}

/// Drive `conn` to its end; once `stop` is raised, ask it to finish gracefully (`shutdown`:
/// answer what is in flight, then close) and keep driving it. Polling `stop` is an atomic load
/// ([`StopWatch`]), so the connection's every wake-up pays nothing for it.
async fn until_stopped<C, T>(
    mut conn: std::pin::Pin<Box<C>>,
    stop: &StopWatch,
    shutdown: impl FnOnce(std::pin::Pin<&mut C>),
) -> Result<T, hyper::Error>
where
    C: Future<Output = Result<T, hyper::Error>>,
{
    let mut shutdown = Some(shutdown);
    std::future::poll_fn(|cx| {
        if shutdown.is_some() && stop.poll_level(cx) >= Level::Graceful {
            if let Some(f) = shutdown.take() {
                f(conn.as_mut());
            }
        }
        conn.as_mut().poll(cx)
    })
    .await
}

/// How long to wait before peeking again while a connection's first bytes trickle in (the
/// whole sniff is bounded by `header_read_timeout`).
const SNIFF_RETRY: Duration = Duration::from_millis(1);

/// An HTTP/2 peer that does not answer a keep-alive ping within this is gone: close it.
pub const H2_PING_TIMEOUT: Duration = Duration::from_secs(20);

/// Streams one HTTP/2 client may have open at once: enough for a busy multiplexing client,
/// few enough that one connection cannot hold a large share of the gateway's memory.
pub const H2_MAX_STREAMS: u32 = 256;

/// How long a connection over `max_connections` (or `max_connections_per_ip`) is served its
/// 503 before it is closed.
const REJECT_WITHIN: Duration = Duration::from_secs(1);

/// Over `max_connections` or `max_connections_per_ip`: answer the connection's request with the
/// 503 of `respond.rs` (`why` its message), in the protocol the client speaks (HTTP/1.1, or h2c
/// with prior knowledge), then close. Bounded by [`REJECT_WITHIN`], so a slow client cannot
/// hold the extra connection.
async fn reject_over_capacity(stream: tokio::net::TcpStream, why: &'static str) {
    let svc = service_fn(move |_req: hyper::Request<Incoming>| async move {
        Ok::<_, std::convert::Infallible>(crate::http::respond::GatewayError::Unavailable(why).into_response())
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
