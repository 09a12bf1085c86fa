//! The wire protocol of the limit script: the commands the store sends and the replies it
//! reads. See `lua/check.lua` for the layout of KEYS, ARGV and the reply.

use redis::{Cmd, Value};

use crate::limiter::{LimitCheck, Outcome, StoreError, StoreKey};

/// The combined limit script's definitions: the shared helpers, one fragment per algorithm,
/// and the dispatcher `lua/check.lua`, which defines `tg_run(KEYS, ARGV)` (see each file's
/// header for KEYS, ARGV and the reply). Its top level only defines: it reads no global, so
/// it loads as a function library, where the helpers are built once per load, not per call.
macro_rules! script_definitions {
    () => {
        concat!(
            include_str!("../../../lua/common.lua"),
            include_str!("../../../lua/token_bucket.lua"),
            include_str!("../../../lua/leaky_bucket.lua"),
            include_str!("../../../lua/fixed_window.lua"),
            include_str!("../../../lua/sliding_log.lua"),
            include_str!("../../../lua/sliding_window.lua"),
            include_str!("../../../lua/concurrency.lua"),
            include_str!("../../../lua/check.lua"),
        )
    };
}

/// The definitions alone, for the function library ([`function_library`]).
pub(super) const SCRIPT_DEFINITIONS: &str = script_definitions!();

/// The limit script as one `EVAL` script: the script's global `KEYS` and `ARGV`, kept before
/// the definitions declare locals of those names, then the definitions and a call of `tg_run`.
/// Its SHA1 names the function library too.
pub const SCRIPT_SOURCE: &str = concat!(
    "local TG_EVAL_KEYS, TG_EVAL_ARGV = KEYS, ARGV\n",
    script_definitions!(),
    "\nreturn tg_run(TG_EVAL_KEYS, TG_EVAL_ARGV)\n"
);

/// What the script should do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Mode {
    /// Evaluate every key; spend all admitted ones unless a non-shadow key denied.
    Check,
    /// Give back `cost` on every key.
    Refund,
    /// Evaluate with cost 0, write nothing.
    Peek,
    /// Push the concurrency slots still held out to a full time to live.
    Renew,
    /// Spend `cost` more on every key without checking (a reported cost above the estimate).
    Debit,
    /// Write each key's reset marker (the instant of the reset), see `lua/check.lua`.
    Reset,
}

impl Mode {
    pub(super) fn as_str(self) -> &'static str {
        match self {
            Mode::Check => "check",
            Mode::Refund => "refund",
            Mode::Peek => "peek",
            Mode::Renew => "renew",
            Mode::Debit => "debit",
            Mode::Reset => "reset",
        }
    }
}

/// How one call of the limit script is written: the command and its first argument, before
/// the key count (`FCALL name`, `EVALSHA sha` and `EVAL source` take the same keys and
/// arguments after it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Invoke<'a> {
    /// `FCALL <function>`: the library of [`function_library`] is loaded on the node (Redis 7+).
    Fcall(&'a str),
    /// `EVALSHA <sha>`: the script is cached on the node.
    EvalSha(&'a str),
    /// `EVAL <source>`: after NOSCRIPT (it caches the script on the node, too).
    Eval,
}

/// The command head of `how`, before the key count.
fn script_head(how: Invoke<'_>) -> Cmd {
    let (name, first) = match how {
        Invoke::Fcall(function) => ("FCALL", function),
        Invoke::EvalSha(sha) => ("EVALSHA", sha),
        Invoke::Eval => ("EVAL", SCRIPT_SOURCE),
    };
    let mut c = redis::cmd(name);
    c.arg(first);
    c
}

/// The name of the function (and of its library) that runs [`SCRIPT_SOURCE`] whose SHA1 is
/// `sha`: `tollgate_<sha>`. The whole hash is in the name, so a library of that name on a
/// node holds exactly this source: gateways of different versions each load their own, and a
/// load never needs `REPLACE` (see [`function_library`]).
pub(super) fn function_name(sha: &str) -> String {
    format!("tollgate_{sha}")
}

/// The Redis function library (`FUNCTION LOAD`) that registers the script's `tg_run` as the
/// function `name`. A function gets its keys and arguments as parameters, which `tg_run`
/// takes; everything else the script uses (`redis.call`/`pcall` with `TIME`,
/// `redis.error_reply`, `struct.pack`, `unpack`) is the same in a function, and a function's
/// writes are replicated as effects, which is what lets it write after `TIME`. The helpers are
/// defined once, when the library loads (a script run defined them on every call: about a
/// third of a one-request call's cost); `tg_run` sets all per-call state afresh.
pub(super) fn function_library(name: &str) -> String {
    format!(
        "#!lua name={name}\n{SCRIPT_DEFINITIONS}\nredis.register_function{{function_name='{name}', callback=tg_run}}\n"
    )
}

/// Append the script arguments of one limit: its spec, `code:limit:interval:cost:flags` (flags
/// 1 shadow, 2 penalty box, 4 calendar window, 8 lease), then the holder for a concurrency
/// slot, the penalty's base and max, the calendar unit and UTC offset, and the lease wanted and
/// its life.
fn limit_args(cmd: &mut Cmd, c: &LimitCheck) {
    let flags = u8::from(c.shadow)
        | if c.penalty.is_some() { 2 } else { 0 }
        | if c.quota.calendar.is_some() { 4 } else { 0 }
        | if c.lease.is_some() { 8 } else { 0 };
    cmd.arg(
        LimitSpec::new([
            u64::from(c.quota.algorithm.code()),
            c.quota.limit.get(),
            c.quota.interval_us.get(),
            c.cost,
            u64::from(flags),
        ])
        .as_bytes(),
    );
    if c.is_slot() {
        cmd.arg(holder_member(c.holder));
    }
    if let Some(p) = c.penalty {
        cmd.arg(p.base_us.get()).arg(p.max_us.get());
    }
    if let Some(cal) = c.quota.calendar {
        cmd.arg(cal.unit.code()).arg(cal.offset_s);
    }
    if let Some(l) = c.lease {
        cmd.arg(l.want).arg(l.life_us);
    }
}

/// A limit's spec argument, its 5 numbers in decimal joined by `:`, built on the stack (at
/// most 5 * 20 digits and 4 separators). The script validates a spec once and then knows it by
/// its string: one argument and one table probe per limit, where 5 numbers were 5 arguments
/// for Redis to parse and 5 for the script to check (`docs/redis.md`).
struct LimitSpec(smallvec::SmallVec<[u8; 104]>);

impl LimitSpec {
    fn new(numbers: [u64; 5]) -> Self {
        let mut out = smallvec::SmallVec::new();
        let mut digits = itoa::Buffer::new();
        for (j, n) in numbers.into_iter().enumerate() {
            if j > 0 {
                out.push(b':');
            }
            out.extend_from_slice(digits.format(n).as_bytes());
        }
        LimitSpec(out)
    }

    fn as_bytes(&self) -> &[u8] {
        &self.0
    }
}

/// The ZSET member of a concurrency slot: its holder in hex (16 bytes, no allocation beyond
/// the argument itself).
fn holder_member(holder: u64) -> String {
    format!("{holder:016x}")
}

/// True when a limit sends its reset marker key in `mode`: every refund (a refund of units
/// spent before a reset is dropped) and a check that asks for a lease (none is granted while
/// a reset settles). See `lua/check.lua`.
fn marked(mode: Mode, c: &LimitCheck) -> bool {
    match mode {
        Mode::Refund => true,
        Mode::Check => c.lease.is_some(),
        _ => false,
    }
}

/// Append the keys of one limit in `mode`: its own, then its penalty key when it has one, then
/// its reset marker key when [`marked`].
fn limit_keys(cmd: &mut Cmd, c: &LimitCheck, mode: Mode) {
    cmd.arg(c.key.as_str());
    if c.penalty.is_some() {
        cmd.arg(LimitCheck::penalty_key(&c.key));
    }
    if marked(mode, c) {
        cmd.arg(LimitCheck::reset_key(&c.key));
    }
}

/// Keys one limit sends in `mode`.
fn key_count(c: &LimitCheck, mode: Mode) -> usize {
    1 + usize::from(c.penalty.is_some()) + usize::from(marked(mode, c))
}

/// The script's `now` argument: explicit, or "" for Redis `TIME`.
fn now_arg(cmd: &mut Cmd, now: Option<u64>) {
    match now {
        Some(now) => cmd.arg(now),
        None => cmd.arg(""),
    };
}

/// Build the `check` call for a batch of `requests` (each one request's limits, all on one
/// slot, and its deadline in Redis time, 0 for none), in the script's batch layout: keys of
/// every request, then `check`, `now`, the request count, and per request its limit count, its
/// deadline and each limit's arguments ([`limit_args`]).
pub(super) fn check_cmd<'c, R>(how: Invoke<'_>, now: Option<u64>, requests: R) -> Cmd
where
    R: Iterator<Item = (&'c [LimitCheck], u64)> + Clone,
{
    let mut cmd = script_head(how);
    cmd.arg(
        requests
            .clone()
            .flat_map(|(r, _)| r.iter())
            .map(|c| key_count(c, Mode::Check))
            .sum::<usize>(),
    );
    for (r, _) in requests.clone() {
        for c in r {
            limit_keys(&mut cmd, c, Mode::Check);
        }
    }
    cmd.arg(Mode::Check.as_str());
    now_arg(&mut cmd, now);
    cmd.arg(requests.clone().count());
    for (r, deadline) in requests {
        cmd.arg(r.len()).arg(deadline);
        for c in r {
            limit_args(&mut cmd, c);
        }
    }
    cmd
}

/// Build a `peek`, `refund` or `renew` call for `checks` (all on one slot).
pub(super) fn script_cmd<'c>(
    how: Invoke<'_>,
    mode: Mode,
    now: Option<u64>,
    checks: impl Iterator<Item = &'c LimitCheck> + Clone,
) -> Cmd {
    let mut cmd = script_head(how);
    cmd.arg(checks.clone().map(|c| key_count(c, mode)).sum::<usize>());
    for c in checks.clone() {
        limit_keys(&mut cmd, c, mode);
    }
    cmd.arg(mode.as_str());
    now_arg(&mut cmd, now);
    for c in checks {
        limit_args(&mut cmd, c);
    }
    cmd
}

/// The `reset` call for `keys` (all on one slot): writes each key's reset marker
/// ([`LimitCheck::reset_key`]) holding Redis' now, living `life_ms`.
pub(super) fn reset_cmd<'k>(
    how: Invoke<'_>,
    keys: impl Iterator<Item = &'k StoreKey> + Clone,
    life_ms: u64,
    lease_ms: u64,
) -> Cmd {
    let mut cmd = script_head(how);
    cmd.arg(keys.clone().count());
    for k in keys {
        cmd.arg(LimitCheck::reset_key(k));
    }
    cmd.arg(Mode::Reset.as_str()).arg("").arg(life_ms).arg(lease_ms);
    cmd
}

/// A keyless `peek` (no limits): runs the script on a node and changes nothing, for probes.
pub(super) fn keyless_peek(how: Invoke<'_>) -> Cmd {
    script_cmd(how, Mode::Peek, None, std::iter::empty())
}

/// A peek reply entry: `allowed == 2` marks a key that does not exist.
pub(super) fn peeked(allowed: u64, o: Outcome) -> Option<Outcome> {
    (allowed != 2).then_some(o)
}

/// A check reply entry: whether its request came too late (allowed code 6: the script ran
/// after the request's deadline and spent nothing), and its outcome.
pub(super) fn checked(allowed: u64, o: Outcome) -> (bool, Outcome) {
    (allowed == 6, o)
}

/// Parse a reply, the one format of every mode: `[now, (allowed, remaining, reset, retry,
/// delay) * n]` packed as little-endian doubles in one bulk string (see `lua/check.lua`); each
/// entry mapped by `map` from its `allowed` code and outcome, straight into the result.
pub(super) fn parse_packed<T>(value: Value, n: usize, map: fn(u64, Outcome) -> T) -> Result<(u64, Vec<T>), StoreError> {
    let bytes = match value {
        Value::BulkString(b) => b,
        other => return Err(StoreError::Protocol(format!("expected a packed reply, got {other:?}"))),
    };
    if bytes.len() != 8 * (1 + 5 * n) {
        return Err(StoreError::Protocol(format!(
            "expected {} packed numbers, got {} bytes",
            1 + 5 * n,
            bytes.len()
        )));
    }
    // Every value is an integer in 0 ..= 2^53; anything else (never sent) reads as 0.
    let mut nums = bytes.chunks_exact(8).map(|c| {
        let f = c.try_into().map_or(0.0, f64::from_le_bytes);
        if (0.0..=9_007_199_254_740_992.0).contains(&f) {
            f as u64
        } else {
            0
        }
    });
    let mut next = || nums.next().unwrap_or(0);
    let now = next();
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let allowed = next();
        let (remaining, reset_us, retry_after_us, delay_us) = (next(), next(), next(), next());
        // 3: in the penalty box; 4: this denial started (or lengthened) a penalty; 5: admitted
        // with a lease, whose units come in the delay slot (leased limits have no delay).
        let penalty = allowed == 3 || allowed == 4;
        let leased = if allowed == 5 { delay_us } else { 0 };
        out.push(map(
            allowed,
            Outcome {
                allowed: allowed == 1 || allowed == 5,
                remaining,
                reset_us,
                retry_after_us,
                delay_us: delay_us - leased,
                at_us: now,
                penalty_us: if penalty { retry_after_us } else { 0 },
                penalty_started: allowed == 4,
                leased,
            },
        ));
    }
    Ok((now, out))
}
