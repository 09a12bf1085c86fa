//! The plan phase: the engine identifies the caller and picks the limits the request must pass
//! (`engine::plan`, pure: no I/O). A request whose credentials are refused is answered here,
//! before any limit is spent.

use http::Request;

use crate::engine::plan::RequestParts;
use crate::http::respond::GatewayError;
use crate::rules::caller;
use crate::state::State;

use super::ctx::{self, Exchange};

/// Plan `req` into `x.plan`, and name its caller on the access line.
pub(super) fn phase<B>(gw: &State, x: &mut Exchange<'_>, req: &Request<B>) -> Result<(), GatewayError> {
    let parts = RequestParts {
        method: req.method(),
        uri: req.uri(),
        headers: req.headers(),
        peer: x.peer.addr.ip(),
    };
    let plan = ctx::engine(gw, &x.snap).plan(&gw.runtime().load(), parts, x.now_us);
    if let Some(p) = plan.refused {
        return Err(p.into());
    }
    if let Some(n) = x.note() {
        let ident = &plan.identity;
        n.identity_kind = ident.kind.as_str();
        if n.logged {
            n.identity = caller(ident).tag(gw.keys(), "").to_string();
        }
        n.decision = if plan.checks.is_empty() { "unmatched" } else { "allowed" };
    }
    x.plan = Some(plan);
    Ok(())
}
