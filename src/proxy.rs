//! The request path, as named phases over one per-request context ([`ctx::Exchange`]),
//! each a function in the file named after it (ARCHITECTURE.md, "The request lifecycle"):
//!
//! | phase | file | what it does |
//! |---|---|---|
//! | validate | `proxy/validate.rs` | framing, Host, method case and header caps; the target and host settled (`proxy/target.rs`); `_` spellings of read headers refused |
//! | plan | `proxy/plan.rs` | the engine identifies the caller and picks the limits (no I/O) |
//! | estimate | `proxy/estimate.rs` | a limit that reserves from the body (`estimate`) has the body's start read and its cost set |
//! | check | `proxy/check.rs` | the limiter checks and spends them, the engine judges: a 429 / 503 now, or what the admitted request holds; a leaky bucket's wait |
//! | admit | `proxy/admit.rs` | adaptive concurrency: room under the upstream's learned limit, or a 503 naming the request's priority class |
//! | forward | `proxy/forward.rs` | the outbound request (hop-by-hop, forwarding headers, upgrades), the upstream exchange |
//! | settle | `proxy/settle.rs` | `count_when` / `cost_from` settlement after the response; its rate-limit headers |
//! | log | `proxy/log.rs` | the access line (`proxy/access.rs`) and the request's metrics; errors rendered as local answers |
//!
//! Per request: one `ArcSwap` load of the rule snapshot, identity and matching on borrowed
//! data, one hash per distinct key value, one store call (one round trip per Redis slot), and
//! then either the upstream's streamed response or a local 429/503. No lock is held across an
//! `.await`; metric handles were resolved when the rules loaded.

use std::net::SocketAddr;
use std::sync::Arc;

use http::{Request, Response};
use hyper::body::Incoming;

use crate::http::respond::GatewayError;
use crate::http::ProxyBody;
use crate::state::State;

pub mod access;
mod account;
mod admit;
mod check;
mod ctx;
mod estimate;
pub(crate) mod facts;
mod forward;
mod log;
mod plan;
mod settle;
mod slots;
mod target;
mod validate;
pub use validate::MAX_HEADERS;

pub use crate::engine::plan::host_for_matching;
use ctx::Exchange;

impl State {
    /// Serve one request; never fails (errors become responses in `crate::http::respond`).
    /// The request id (kept or generated) goes upstream and back; the access log, when on,
    /// gets one line.
    pub async fn handle(self: Arc<Self>, mut req: Request<Incoming>, from: Peer) -> Response<ProxyBody> {
        let mut x = Exchange::new(&self, &mut req, from);
        log::open(&self, &mut x, &mut req);
        // Dropped with this future if the client leaves before the response, `x` counts the
        // request and logs it (`access::Pending`).
        let result = self.phases(&mut x, req).await;
        log::phase(&self, &mut x, result)
    }

    /// The phases between the request's arrival and its log: the response, or the error that
    /// ends the request early. The steps before the upstream exchange are plain functions (the
    /// limiter waits only when it has to ask the store), so this future holds little.
    async fn phases(
        self: &Arc<Self>,
        x: &mut Exchange<'_>,
        mut req: Request<Incoming>,
    ) -> Result<Response<ProxyBody>, GatewayError> {
        validate::phase(self, x, &mut req)?;
        plan::phase(self, x, &req)?;
        // The body, cut off past `server.max_body_bytes`, as it goes upstream.
        let max_body = usize::try_from(self.config().server.max_body_bytes).unwrap_or(usize::MAX);
        let mut req = req.map(|b| ProxyBody::Request(http_body_util::Limited::new(b, max_body)));
        estimate::phase(self, x, &mut req).await?;
        if let Some(limited) = check::phase(self, x).await? {
            return Ok(limited);
        }
        if let Err(refused) = admit::phase(self, x).await {
            return settle::phase(self, x, Err(refused));
        }
        let result = forward::phase(self, x, req).await;
        settle::phase(self, x, result)
    }
}

/// Where a request came from: the connection's peer, and the TLS version when it came over
/// TLS. Copied into every request of the connection (no allocation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Peer {
    /// The client's address (the connection's peer).
    pub addr: SocketAddr,
    /// `TLSv1.2` / `TLSv1.3` on a TLS listener; `None` in cleartext.
    pub tls: Option<&'static str>,
}

impl Peer {
    /// A cleartext connection from `addr`.
    pub fn plain(addr: SocketAddr) -> Self {
        Peer { addr, tls: None }
    }
}
