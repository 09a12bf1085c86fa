//! Running the limit scripts: `FCALL` of the tollgate library, or `EVALSHA` / `EVAL` on a
//! server without functions; loading the library where it is missing (a fresh node, a flush, a
//! restart without persistence); `WAIT` for a replica when `store.durability` asks; and the
//! batched check call that parses the packed reply.

use std::sync::atomic::Ordering;

use redis::cluster_routing::RoutingInfo;
use redis::{Cmd, ErrorKind, RedisError, ServerErrorKind, Value};

use super::conn::{first_key_route, store_err, Conn, Inner, Target};
use super::protocol::{check_cmd, checked, parse_packed, script_cmd, Invoke, Mode};
use super::Scripting;
use crate::limiter::{LimitCheck, Outcome, StoreError};

/// `Inner::path`: Redis functions, falling back to `EVALSHA` on "unknown command".
const PATH_AUTO: u8 = 0;
/// `Inner::path`: Redis functions only.
const PATH_FUNCTIONS: u8 = 1;
/// `Inner::path`: `EVALSHA`, `EVAL` on NOSCRIPT.
const PATH_EVAL: u8 = 2;

/// The `Inner::path` value that starts `scripting`.
pub(super) fn path_of(scripting: Scripting) -> u8 {
    match scripting {
        Scripting::Auto => PATH_AUTO,
        Scripting::Functions => PATH_FUNCTIONS,
        Scripting::Eval => PATH_EVAL,
    }
}

/// True for a NOSCRIPT reply.
pub(super) fn is_noscript(e: &RedisError) -> bool {
    e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) || e.code() == Some("NOSCRIPT")
}

/// The detail of an `ERR` reply (Redis answers these with the generic code), else `""`.
fn err_detail(e: &RedisError) -> &str {
    match e.code() {
        Some("ERR") => e.detail().unwrap_or(""),
        _ => "",
    }
}

/// True for the reply of FCALL naming a function the node does not have (a fresh node,
/// `FUNCTION FLUSH`, a restart without persistence): `ERR Function not found`.
pub(super) fn is_function_missing(e: &RedisError) -> bool {
    err_detail(e).eq_ignore_ascii_case("Function not found")
}

/// True for the reply of `FUNCTION LOAD` (without `REPLACE`) when the library is already
/// there: a concurrent call loaded it first. Same name, same source (see
/// `protocol::function_name`), so that is success.
fn is_library_loaded(e: &RedisError) -> bool {
    let d = err_detail(e);
    d.starts_with("Library '") && d.ends_with("' already exists")
}

/// True for the reply of a server that does not know a command (FCALL and FUNCTION on
/// Redis 6): `ERR unknown command 'FCALL', with args beginning with: ...`.
pub(super) fn is_unknown_command(e: &RedisError) -> bool {
    err_detail(e)
        .get(..15)
        .is_some_and(|d| d.eq_ignore_ascii_case("unknown command"))
}

impl Inner {
    /// Run the limit script built by `build` (given how to invoke it) on `target` and return
    /// the raw reply.
    ///
    /// * Functions (`PATH_AUTO`, `PATH_FUNCTIONS`): `FCALL`; on "Function not found", load the
    ///   library on the node that answered so (the call's own route) and repeat the call once.
    ///   In `PATH_AUTO`, an "unknown command" (a server without functions: Redis 6) switches the
    ///   store to `EVALSHA` for good, and this call goes that way.
    /// * `EVALSHA`, and on NOSCRIPT the same call as `EVAL` with the source (which caches it).
    pub(super) async fn run_script(
        &self,
        build: &impl Fn(Invoke<'_>) -> Cmd,
        target: &Target,
    ) -> Result<Value, RedisError> {
        let mut conn = self.conn()?;
        if self.path.load(Ordering::Relaxed) != PATH_EVAL {
            let cmd = build(Invoke::Fcall(&self.function));
            match conn.send(&cmd, target).await {
                Err(e) if is_function_missing(&e) => {
                    self.load_function(&mut conn, &cmd, target).await?;
                    return conn.send(&cmd, target).await;
                }
                Err(e) if is_unknown_command(&e) && self.fall_back_to_eval(&e) => {}
                r => return r,
            }
        }
        let cmd = build(Invoke::EvalSha(&self.sha));
        match conn.send(&cmd, target).await {
            Err(e) if is_noscript(&e) => {
                drop(cmd);
                conn.send(&build(Invoke::Eval), target).await
            }
            r => r,
        }
    }

    /// `FUNCTION LOAD` the library where `call` (an FCALL to `target`) found it missing: the
    /// master of the call's first key in a cluster (the node the call went to), every master
    /// for a keyless call, the server when standalone. Without `REPLACE`: a node that already
    /// has the library (another call loaded it meanwhile) answers before compiling anything,
    /// so a burst of calls that all found it missing costs the node one compilation.
    async fn load_function(&self, conn: &mut Conn, call: &Cmd, target: &Target) -> Result<(), RedisError> {
        let mut load = redis::cmd("FUNCTION");
        load.arg("LOAD").arg(&self.library);
        let at = match (target, &*conn) {
            (Target::ByKey, Conn::Cluster(_)) => first_key_route(call).map_or(Target::AllMasters, Target::Node),
            (t, _) => t.clone(),
        };
        let loaded = match at {
            Target::AllMasters => conn.query_all_masters(load, is_library_loaded).await,
            at => match conn.send(&load, &at).await {
                Err(e) if !is_library_loaded(&e) => Err(e),
                _ => Ok(()),
            },
        };
        if loaded.is_ok() {
            tracing::info!(function = %self.function, "loaded the limit script's Redis function library on a node that did not have it");
        }
        loaded
    }

    /// In `PATH_AUTO`, switch to `EVALSHA` for good after `e` said the server lacks functions;
    /// `false` when the path was forced to functions (the error then stands).
    fn fall_back_to_eval(&self, e: &RedisError) -> bool {
        match self
            .path
            .compare_exchange(PATH_AUTO, PATH_EVAL, Ordering::Relaxed, Ordering::Relaxed)
        {
            Ok(_) => {
                tracing::warn!(error = %e, "Redis has no functions (FCALL: unknown command; Redis < 7): running the limit script with EVALSHA from now on");
                true
            }
            Err(now) => now == PATH_EVAL,
        }
    }

    /// One script call bounded by the deadline; the raw reply. (Failures are counted by the
    /// caller, against the breaker of the shard it called.)
    pub(super) async fn script(&self, write: bool, build: impl Fn(Invoke<'_>) -> Cmd) -> Result<Value, StoreError> {
        let replicated = write && self.replicated.load(Ordering::Relaxed);
        let call = async {
            let routing = if replicated {
                first_key_route(&build(Invoke::EvalSha(&self.sha)))
            } else {
                None
            };
            let value = self.run_script(&build, &Target::ByKey).await.map_err(store_err)?;
            if replicated {
                self.wait_replica(routing).await?;
            }
            Ok(value)
        };
        match tokio::time::timeout(self.timeout, call).await {
            Ok(r) => r,
            Err(_) => Err(StoreError::Timeout),
        }
    }

    /// `WAIT 1 <deadline>` on the connection (the node) that just ran a write: `Ok` once a
    /// replica acknowledged it. WAIT covers every earlier write of the connection, ours included.
    async fn wait_replica(&self, routing: Option<RoutingInfo>) -> Result<(), StoreError> {
        let ms = u64::try_from(self.timeout.as_millis()).unwrap_or(u64::MAX).max(1);
        let mut cmd = redis::cmd("WAIT");
        cmd.arg(1).arg(ms);
        let mut conn = self.conn().map_err(store_err)?;
        let acked = match (&mut conn, routing) {
            (Conn::Cluster(c), Some(r)) => c.route_command(cmd, r).await,
            _ => conn.query(&cmd).await,
        }
        .map_err(store_err)?;
        match acked {
            Value::Int(n) if n >= 1 => Ok(()),
            other => Err(StoreError::Redis(format!(
                "store.durability: replicated: no replica confirmed the write within {ms} ms ({other:?})"
            ))),
        }
    }

    /// A `peek` or `refund` call on `checks` (all on one slot): Redis' `now` and one entry per
    /// check, built by `map` from the reply's `allowed` integer and the outcome.
    pub(super) async fn call<'c, I, T>(
        &self,
        mode: Mode,
        now: Option<u64>,
        checks: I,
        map: fn(u64, Outcome) -> T,
    ) -> Result<(u64, Vec<T>), StoreError>
    where
        I: Iterator<Item = &'c LimitCheck> + Clone + ExactSizeIterator,
    {
        let n = checks.len();
        let write = mode != Mode::Peek;
        let value = self
            .script(write, |how| script_cmd(how, mode, now, checks.clone()))
            .await?;
        parse_packed(
            value,
            if matches!(mode, Mode::Refund | Mode::Renew | Mode::Debit) {
                0
            } else {
                n
            },
            map,
        )
    }

    /// A `check` call on a batch of requests (all on one slot), each with its deadline in
    /// Redis time (0: none): Redis' `now` and, per limit, request after request, whether its
    /// request was too late (nothing spent) and its outcome.
    pub(super) async fn check_batch<'c, R>(
        &self,
        now: Option<u64>,
        requests: R,
    ) -> Result<(u64, Vec<(bool, Outcome)>), StoreError>
    where
        R: Iterator<Item = (&'c [LimitCheck], u64)> + Clone,
    {
        let n = requests.clone().map(|(r, _)| r.len()).sum();
        let value = self.script(true, |how| check_cmd(how, now, requests.clone())).await?;
        parse_packed(value, n, checked)
    }

    /// Any command, bounded by the deadline.
    pub(super) async fn command(&self, cmd: &Cmd) -> Result<Value, StoreError> {
        let mut conn = self.conn().map_err(store_err)?;
        match tokio::time::timeout(self.timeout, conn.query(cmd)).await {
            Ok(r) => r.map_err(store_err),
            Err(_) => Err(StoreError::Timeout),
        }
    }
}
