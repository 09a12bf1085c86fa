//! The rate-limit service's listener: gRPC `envoy.service.ratelimit.v3.RateLimitService` and
//! `grpc.health.v1.Health` (HTTP/2), and envoyproxy/ratelimit's HTTP endpoints `/json` and
//! `/healthcheck` (HTTP/1.1 or HTTP/2), on one port. When the drain window begins the health
//! service says `NOT_SERVING` and `/healthcheck` fails while calls are still answered; on stop
//! the listener closes and open connections finish their calls within the grace
//! (ARCHITECTURE.md, "The Envoy rate-limit service").

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::{
    RateLimitService, RateLimitServiceServer,
};
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tonic::body::Body;
use tonic::codegen::Service;
use tonic::service::Routes;

use super::Rls;

/// Largest gRPC message or `/json` body accepted.
pub const MAX_MESSAGE: usize = 1 << 20;

/// The gRPC service over the front end.
#[derive(Clone)]
pub struct Svc(pub Arc<Rls>);

#[tonic::async_trait]
impl RateLimitService for Svc {
    async fn should_rate_limit(
        &self,
        request: tonic::Request<RateLimitRequest>,
    ) -> Result<tonic::Response<RateLimitResponse>, tonic::Status> {
        match self.0.should_rate_limit(request.get_ref()).await {
            Ok(r) => Ok(tonic::Response::new(r)),
            Err(e) => Err(tonic::Status::invalid_argument(e.0)),
        }
    }
}

/// Serve `listener` until `stop` is raised, then drain for at most `grace`.
pub async fn serve(rls: Arc<Rls>, listener: TcpListener, mut stop: watch::Receiver<bool>, grace: Duration) {
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter.set_serving::<RateLimitServiceServer<Svc>>().await;
    let svc = RateLimitServiceServer::new(Svc(rls.clone()))
        .max_decoding_message_size(MAX_MESSAGE)
        .max_encoding_message_size(MAX_MESSAGE);
    let routes = Routes::new(svc).add_service(health).prepare();
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    // The drain window (SIGTERM): still serving, but health says NOT_SERVING so Envoy's
    // health checks move calls to the other instances.
    let mut drain = rls.gateway().drain_watch();
    let mut draining = false;
    loop {
        let accepted = tokio::select! {
            _ = stop.changed() => break,
            changed = drain.changed(), if !draining => {
                if changed.is_err() || *drain.borrow() {
                    draining = true;
                    reporter.set_not_serving::<RateLimitServiceServer<Svc>>().await;
                    reporter.set_service_status("", tonic_health::ServingStatus::NotServing).await;
                }
                continue;
            }
            a = listener.accept() => a,
        };
        let stream = match accepted {
            Ok((s, _)) => s,
            Err(e) => {
                // Out of descriptors or the like: say so, and give the system a moment.
                tracing::warn!(error = %e, "rls listener: accept failed");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let (front, routes) = (rls.clone(), routes.clone());
        let service = hyper::service::service_fn(move |req: Request<Incoming>| {
            let (front, routes) = (front.clone(), routes.clone());
            async move { Ok::<_, Infallible>(route(&front, routes, req).await) }
        });
        let conn = builder.serve_connection(TokioIo::new(stream), service).into_owned();
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            let _ = conn.await;
        });
    }
    reporter.set_not_serving::<RateLimitServiceServer<Svc>>().await;
    reporter
        .set_service_status("", tonic_health::ServingStatus::NotServing)
        .await;
    drop(listener);
    if tokio::time::timeout(grace, graceful.shutdown()).await.is_err() {
        tracing::warn!("rls listener: connections still open after the shutdown grace");
    }
}

fn plain(status: StatusCode, content_type: &'static str, body: impl Into<Bytes>) -> Response<Body> {
    let mut r = Response::new(Body::new(Full::new(body.into())));
    *r.status_mut() = status;
    r.headers_mut()
        .insert(http::header::CONTENT_TYPE, http::HeaderValue::from_static(content_type));
    r
}

/// `/json` and `/healthcheck` here; everything else is gRPC.
async fn route(rls: &Arc<Rls>, mut routes: Routes, req: Request<Incoming>) -> Response<Body> {
    match (req.method(), req.uri().path()) {
        (&Method::POST, "/json") => json(rls, req).await,
        (_, "/json") => plain(
            StatusCode::METHOD_NOT_ALLOWED,
            "text/plain",
            "POST a JSON RateLimitRequest\n",
        ),
        (&Method::GET | &Method::HEAD, "/healthcheck") => {
            if rls.gateway().draining() {
                plain(StatusCode::INTERNAL_SERVER_ERROR, "text/plain", "draining\n")
            } else {
                plain(StatusCode::OK, "text/plain", "OK\n")
            }
        }
        _ => match routes.call(req).await {
            Ok(r) => r,
            Err(never) => match never {},
        },
    }
}

/// `POST /json`: a protojson `RateLimitRequest` in, the protojson response out; 200 when OK,
/// 429 when over the limit, 400 for a request that cannot be read or is refused.
async fn json(rls: &Arc<Rls>, req: Request<Incoming>) -> Response<Body> {
    let body = match Limited::new(req.into_body(), MAX_MESSAGE).collect().await {
        Ok(b) => b.to_bytes(),
        Err(_) => {
            return plain(
                StatusCode::BAD_REQUEST,
                "text/plain",
                "cannot read the body (at most 1 MiB)\n",
            )
        }
    };
    let request = match super::json::request(&body) {
        Ok(r) => r,
        Err(e) => return plain(StatusCode::BAD_REQUEST, "text/plain", format!("{e}\n")),
    };
    match rls.should_rate_limit(&request).await {
        Ok(resp) => {
            let over = resp.overall_code
                == envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code::OverLimit as i32;
            let status = if over {
                StatusCode::TOO_MANY_REQUESTS
            } else {
                StatusCode::OK
            };
            plain(status, "application/json", super::json::response(&resp))
        }
        Err(e) => plain(StatusCode::BAD_REQUEST, "text/plain", format!("{}\n", e.0)),
    }
}
