//! The floor under tollgate's request path: the least a reverse proxy built on
//! hyper 1 does per request, with none of tollgate's work.
//!
//! `hyper_floor allow <listen> <upstream>`: hyper's HTTP/1.1 server connection, the request
//! passed to hyper's HTTP/1.1 client connection (a pool of `SendRequest` handles, a task per
//! upstream connection, as tollgate does), the upstream's response streamed back. No rules,
//! no identity, no limiter, no forwarding or rate-limit headers, no hop-by-hop stripping, no
//! request id, no timeout, no idle parking.
//!
//! `hyper_floor deny <listen>`: hyper's HTTP/1.1 server connection answering every request
//! with a fixed 429 (a static body and two static headers).
//!
//! One current-thread runtime (tollgate's one-worker configuration), mimalloc like tollgate.
//! `bench/run` and `bench/profile` run it beside nginx and tollgate as `hyper-floor-allow` and
//! `hyper-floor-deny`: whatever tollgate costs above it is tollgate's; whatever it costs above
//! nginx is hyper's.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use http::{Request, Response, StatusCode, Uri};
use http_body_util::{combinators::UnsyncBoxBody, BodyExt, Full};
use hyper::body::Incoming;
use hyper::client::conn::http1::SendRequest;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, TcpStream};

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

type Body = UnsyncBoxBody<Bytes, hyper::Error>;

/// The upstream and its idle connections.
struct Pool {
    /// Where requests go.
    upstream: SocketAddr,
    /// Idle connections, most recently used last.
    idle: parking_lot::Mutex<Vec<SendRequest<Incoming>>>,
}

impl Pool {
    /// A ready idle connection, or a new one.
    async fn checkout(&self) -> Result<SendRequest<Incoming>, Box<dyn std::error::Error + Send + Sync>> {
        {
            let mut idle = self.idle.lock();
            while let Some(s) = idle.pop() {
                if s.is_ready() {
                    return Ok(s);
                }
            }
        }
        let stream = TcpStream::connect(self.upstream).await?;
        stream.set_nodelay(true)?;
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        Ok(sender)
    }

    /// Forward `req` and return the upstream's response, streamed.
    async fn forward(self: Arc<Self>, mut req: Request<Incoming>) -> Response<Body> {
        let Some(pq) = req.uri().path_and_query().cloned() else {
            return status(StatusCode::BAD_REQUEST);
        };
        *req.uri_mut() = Uri::from(pq);
        let mut sender = match self.checkout().await {
            Ok(s) => s,
            Err(_) => return status(StatusCode::BAD_GATEWAY),
        };
        let resp = sender.send_request(req).await;
        // Back to the pool at once: it is handed out again only once `is_ready` (the body
        // was read), as tollgate's pool does.
        self.idle.lock().push(sender);
        match resp {
            Ok(r) => r.map(BodyExt::boxed_unsync),
            Err(_) => status(StatusCode::BAD_GATEWAY),
        }
    }
}

/// An empty response with `code`.
fn status(code: StatusCode) -> Response<Body> {
    let mut r = Response::new(Full::new(Bytes::new()).map_err(|never| match never {}).boxed_unsync());
    *r.status_mut() = code;
    r
}

/// The fixed 429.
fn denied() -> Response<Body> {
    let body = Bytes::from_static(b"{\"error\":\"rate_limit_exceeded\"}");
    let mut r = Response::new(Full::new(body).map_err(|never| match never {}).boxed_unsync());
    *r.status_mut() = StatusCode::TOO_MANY_REQUESTS;
    r.headers_mut()
        .insert(http::header::RETRY_AFTER, http::HeaderValue::from_static("60"));
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    r
}

fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let args: Vec<String> = std::env::args().collect();
    let usage = "usage: hyper_floor allow <listen> <upstream> | hyper_floor deny <listen>";
    let (mode, listen) = match (args.get(1), args.get(2)) {
        (Some(m), Some(l)) => (m.as_str(), l.parse::<SocketAddr>()?),
        _ => return Err(usage.into()),
    };
    let pool = match mode {
        "allow" => Some(Arc::new(Pool {
            upstream: args.get(3).ok_or(usage)?.parse()?,
            idle: parking_lot::Mutex::new(Vec::new()),
        })),
        "deny" => None,
        _ => return Err(usage.into()),
    };
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(async move {
        let listener = TcpListener::bind(listen).await?;
        loop {
            let (stream, _) = listener.accept().await?;
            stream.set_nodelay(true)?;
            let pool = pool.clone();
            tokio::spawn(async move {
                let svc = service_fn(move |req: Request<Incoming>| {
                    let pool = pool.clone();
                    async move {
                        Ok::<_, Infallible>(match pool {
                            Some(p) => p.forward(req).await,
                            None => denied(),
                        })
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    })
}
