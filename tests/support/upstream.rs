//! A real HTTP upstream that counts the requests it is serving at once (from the head's arrival
//! until its response body ends or is dropped) and the most it ever served at once: the witness
//! of a concurrency limit, counted on the far side of the gateway.
//!
//! Paths: `/slow/<ms>` answers after `<ms>`; `/stream` answers at once and then sends a chunk
//! every 100 ms for 30 s; `/reset` sends one chunk and then fails the body (the connection is
//! cut mid-response); `/hang` answers after 30 s; `/status/<code>` answers that status after
//! 200 ms; `/cost/<n>` answers with `X-Tokens-Used: n`; `/trailer-cost/<n>` streams two chunks
//! and then `X-Tokens-Used: n` as a trailer; `/ratelimit` answers with its own `RateLimit` and
//! `RateLimit-Policy`; anything else answers at once. It also counts the connections open now and
//! the most ever open at once.
//!
//! Like a WSGI worker, which learns that its client left only when it writes, `/busy/<ms>`
//! works for `<ms>` whatever happens to the connection (counted all that time), then answers,
//! with `X-Tokens-Used: n` for `/busy/<ms>/<n>`; `/busy-stream/<ms>/<n>` answers the head and a
//! first chunk at once, works `<ms>` the same way, then sends a second chunk and
//! `X-Tokens-Used: n` as a trailer.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;
use http_body_util::{BodyExt, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};

type Body = http_body_util::combinators::UnsyncBoxBody<Bytes, std::io::Error>;

/// Counts held by the upstream.
#[derive(Debug, Default)]
pub struct Counts {
    /// Requests being served now.
    pub current: AtomicUsize,
    /// The most ever served at once.
    pub max: AtomicUsize,
    /// Requests that arrived.
    pub total: AtomicUsize,
    /// Connections accepted.
    pub connections: AtomicUsize,
    /// Connections open now.
    pub open_connections: AtomicUsize,
    /// The most connections ever open at once.
    pub max_open_connections: AtomicUsize,
}

/// One request being served: counted until dropped (with its response body).
struct Serving(Arc<Counts>);

impl Serving {
    fn start(c: &Arc<Counts>) -> Self {
        let now = c.current.fetch_add(1, Ordering::SeqCst) + 1;
        c.max.fetch_max(now, Ordering::SeqCst);
        c.total.fetch_add(1, Ordering::SeqCst);
        Serving(c.clone())
    }
}

impl Drop for Serving {
    fn drop(&mut self) {
        self.0.current.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The counting upstream: its address and its counts. The server task runs until the test ends.
pub struct CountingUpstream {
    /// Where it listens.
    pub addr: SocketAddr,
    /// What it counted.
    pub counts: Arc<Counts>,
}

impl CountingUpstream {
    /// Requests being served now.
    pub fn current(&self) -> usize {
        self.counts.current.load(Ordering::SeqCst)
    }

    /// The most served at once so far.
    pub fn max(&self) -> usize {
        self.counts.max.load(Ordering::SeqCst)
    }

    /// `http://addr`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The most connections open at once so far.
    pub fn max_open_connections(&self) -> usize {
        self.counts.max_open_connections.load(Ordering::SeqCst)
    }
}

/// A body that yields `frames` (one every `every`), then ends or fails, holding `serving`.
fn body(serving: Serving, frames: usize, every: Duration, fail: bool) -> Body {
    let stream = futures_util::stream::unfold((0usize, serving), move |(i, s)| async move {
        if i > 0 {
            tokio::time::sleep(every).await;
        }
        if i < frames {
            Some((Ok(Frame::data(Bytes::from_static(b"chunk\n"))), (i + 1, s)))
        } else if fail && i == frames {
            Some((Err(std::io::Error::other("cut mid-body")), (i + 1, s)))
        } else {
            drop(s);
            None
        }
    });
    StreamBody::new(stream).boxed_unsync()
}

async fn serve(counts: Arc<Counts>, req: Request<Incoming>) -> Result<Response<Body>, Infallible> {
    let serving = Serving::start(&counts);
    let path = req.uri().path().to_owned();
    if let Some(rest) = path.strip_prefix("/busy/") {
        let (ms, cost) = busy_args(rest);
        let serving = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(ms)).await;
            serving
        })
        .await
        .unwrap();
        let mut r = Response::new(body(serving, 1, Duration::ZERO, false));
        if let Some(n) = cost {
            r.headers_mut().insert("x-tokens-used", n.into());
        }
        return Ok(r);
    }
    if let Some(rest) = path.strip_prefix("/busy-stream/") {
        let (ms, cost) = busy_args(rest);
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, std::io::Error>>(4);
        tokio::spawn(async move {
            let _ = tx.send(Ok(Frame::data(Bytes::from_static(b"chunk\n")))).await;
            tokio::time::sleep(Duration::from_millis(ms)).await;
            let _ = tx.send(Ok(Frame::data(Bytes::from_static(b"chunk\n")))).await;
            let mut trailers = hyper::HeaderMap::new();
            trailers.insert("x-tokens-used", cost.unwrap_or(0).into());
            let _ = tx.send(Ok(Frame::trailers(trailers))).await;
            drop(serving);
        });
        let stream = futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|f| (f, rx)) });
        let mut r = Response::new(StreamBody::new(stream).boxed_unsync());
        r.headers_mut().insert("trailer", "x-tokens-used".parse().unwrap());
        return Ok(r);
    }
    let b = if let Some(ms) = path.strip_prefix("/slow/") {
        tokio::time::sleep(Duration::from_millis(ms.parse().unwrap_or(300))).await;
        body(serving, 1, Duration::ZERO, false)
    } else if path == "/stream" {
        body(serving, 300, Duration::from_millis(100), false)
    } else if path == "/reset" {
        body(serving, 1, Duration::from_millis(50), true)
    } else if let Some(code) = path.strip_prefix("/status/") {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let mut r = Response::new(body(serving, 1, Duration::ZERO, false));
        *r.status_mut() = hyper::StatusCode::from_u16(code.parse().unwrap_or(200)).unwrap_or(hyper::StatusCode::OK);
        return Ok(r);
    } else if let Some(n) = path.strip_prefix("/cost/") {
        let mut r = Response::new(body(serving, 1, Duration::ZERO, false));
        r.headers_mut().insert("x-tokens-used", n.parse().unwrap());
        return Ok(r);
    } else if let Some(n) = path.strip_prefix("/trailer-cost/") {
        let mut trailers = hyper::HeaderMap::new();
        trailers.insert("x-tokens-used", n.parse().unwrap());
        let frames = vec![
            Ok(Frame::data(Bytes::from_static(b"chunk\n"))),
            Ok(Frame::data(Bytes::from_static(b"chunk\n"))),
            Ok(Frame::trailers(trailers)),
        ];
        let stream = futures_util::stream::iter(frames).chain(
            futures_util::stream::once(async move {
                drop(serving);
                Err(std::io::Error::other("unreachable"))
            })
            .filter(|_| futures_util::future::ready(false)),
        );
        let mut r = Response::new(StreamBody::new(stream).boxed_unsync());
        // hyper sends only the trailer fields the head announces.
        r.headers_mut().insert("trailer", "x-tokens-used".parse().unwrap());
        return Ok(r);
    } else if path == "/ratelimit" {
        let mut r = Response::new(body(serving, 1, Duration::ZERO, false));
        r.headers_mut()
            .insert("ratelimit-policy", "\"origin\";q=100;w=3600".parse().unwrap());
        r.headers_mut()
            .insert("ratelimit", "\"origin\";r=7;t=1200".parse().unwrap());
        return Ok(r);
    } else if path == "/hang" {
        tokio::time::sleep(Duration::from_secs(30)).await;
        body(serving, 1, Duration::ZERO, false)
    } else {
        body(serving, 1, Duration::ZERO, false)
    };
    Ok(Response::new(b))
}

/// `<ms>` or `<ms>/<n>`: how long to work, and the cost to report.
fn busy_args(rest: &str) -> (u64, Option<u64>) {
    let mut it = rest.split('/');
    let ms = it.next().and_then(|v| v.parse().ok()).unwrap_or(300);
    (ms, it.next().and_then(|v| v.parse().ok()))
}

/// Start the counting upstream on a free loopback port.
pub async fn counting_upstream() -> CountingUpstream {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let counts = Arc::new(Counts::default());
    let c = counts.clone();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = l.accept().await else { continue };
            c.connections.fetch_add(1, Ordering::SeqCst);
            let open = c.open_connections.fetch_add(1, Ordering::SeqCst) + 1;
            c.max_open_connections.fetch_max(open, Ordering::SeqCst);
            let c = c.clone();
            tokio::spawn(async move {
                let counts = c.clone();
                let svc = hyper::service::service_fn(move |req| serve(c.clone(), req));
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
                counts.open_connections.fetch_sub(1, Ordering::SeqCst);
            });
        }
    });
    CountingUpstream { addr, counts }
}

/// An upstream instance that can be killed (listener closed, every open connection cut) and
/// brought back on the same port: one of several targets. It answers every request with 200
/// and `x-instance: <port>` (after `<ms>` for `/slow/<ms>`), and counts what it served (health
/// checks, `/healthz`, are not counted).
pub struct Instance {
    /// Where it listens.
    pub addr: SocketAddr,
    /// Requests it answered.
    pub served: Arc<AtomicUsize>,
    /// The accept loop and the connection tasks, aborted by `kill`.
    tasks: Arc<parking_lot::Mutex<Vec<tokio::task::AbortHandle>>>,
}

impl Instance {
    /// Start on a free loopback port.
    pub async fn start() -> Instance {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut i = Instance {
            addr: l.local_addr().unwrap(),
            served: Arc::new(AtomicUsize::new(0)),
            tasks: Arc::default(),
        };
        i.serve(l);
        i
    }

    fn serve(&mut self, l: tokio::net::TcpListener) {
        let (served, tasks, port) = (self.served.clone(), self.tasks.clone(), self.addr.port());
        let t2 = tasks.clone();
        let h = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = l.accept().await else { continue };
                let served = served.clone();
                let conn = tokio::spawn(async move {
                    let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
                        let served = served.clone();
                        async move {
                            if let Some(ms) = req.uri().path().strip_prefix("/slow/") {
                                tokio::time::sleep(Duration::from_millis(ms.parse().unwrap_or(10))).await;
                            }
                            if req.uri().path() != "/healthz" {
                                served.fetch_add(1, Ordering::SeqCst);
                            }
                            let mut r = Response::new(http_body_util::Full::new(Bytes::from_static(b"ok")));
                            r.headers_mut().insert("x-instance", port.into());
                            Ok::<_, Infallible>(r)
                        }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
                t2.lock().push(conn.abort_handle());
            }
        });
        tasks.lock().push(h.abort_handle());
    }

    /// `http://addr`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Requests answered so far.
    pub fn served(&self) -> usize {
        self.served.load(Ordering::SeqCst)
    }

    /// Close the listener and cut every open connection (like a crashed process).
    pub fn kill(&self) {
        for t in self.tasks.lock().drain(..) {
            t.abort();
        }
    }

    /// Listen again on the same port (retried until the port is free).
    pub async fn revive(&mut self) {
        let addr = self.addr;
        let l = super::poll::eventually_some(Duration::from_secs(10), || async move {
            tokio::net::TcpListener::bind(addr).await.ok()
        })
        .await
        .expect("rebind the instance's port");
        self.serve(l);
    }
}
