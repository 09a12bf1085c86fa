//! The parts of a rule compiled on their own: its penalty, calendar alignment, `count_when`,
//! `cost_from` and failure policy, each validated with the file position of its field.

use std::num::{NonZeroU32, NonZeroU64};
use std::path::Path;

use http::HeaderName;
use serde_saphyr::Spanned;

use super::super::{CostFrom, CostSource, Estimate, StatusMatch};
use crate::limiter::algorithm::calendar::{self, Calendar, CalendarUnit};
use crate::limiter::{Algorithm, FailurePolicy, Penalty, Quota};
use crate::rules::raw::{RawCostFrom, RawCountWhen, RawEstimate, RawPaths, RawPenalty, RawStatus};
use crate::usage::JsonPath;
use crate::yaml::ConfigError;

/// Longest penalty a rule may set (a penalty key expires with it; a day is long enough to mean
/// "blocked" and short enough that a mistake lifts itself).
pub const MAX_PENALTY_US: u64 = 86_400_000_000;

/// `penalty: 10m` or `penalty: {base: 1m, max: 1h}`, validated: at least 1 s, at most a day,
/// and `max` not below `base`.
pub(super) fn penalty(file: &Path, rule: &str, p: &Spanned<RawPenalty>) -> Result<Penalty, ConfigError> {
    let at = |m: String| ConfigError::at(file, &p.referenced, format!("rule {rule:?}: penalty: {m}"));
    let parse = |s: &str| -> Result<u64, ConfigError> {
        let d = humantime::parse_duration(s.trim()).map_err(|e| at(format!("invalid duration {s:?}: {e}")))?;
        let us = u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        if us < 1_000_000 {
            return Err(at(format!("{s:?} is under 1s")));
        }
        if us > MAX_PENALTY_US {
            return Err(at(format!("{s:?} is over the longest penalty, 24h")));
        }
        Ok(us)
    };
    let (base, max) = match &p.value {
        RawPenalty::Fixed(d) => {
            let b = parse(d)?;
            (b, b)
        }
        RawPenalty::Escalating { base, max } => (parse(base)?, parse(max)?),
    };
    if max < base {
        return Err(at("max is shorter than base".to_owned()));
    }
    Ok(Penalty {
        base_us: NonZeroU64::new(base).unwrap_or(NonZeroU64::MIN),
        max_us: NonZeroU64::new(max).unwrap_or(NonZeroU64::MIN),
    })
}

/// `align: calendar` (with an optional `timezone`) on a fixed or sliding window: the UTC
/// offset its windows follow; `None` for epoch-aligned windows.
pub(super) fn calendar_of(
    file: &Path,
    rule: &str,
    alg: Algorithm,
    align: &Option<Spanned<String>>,
    timezone: &Option<Spanned<String>>,
) -> Result<Option<i32>, ConfigError> {
    let Some(a) = align else {
        if let Some(tz) = timezone {
            return Err(ConfigError::at(
                file,
                &tz.referenced,
                format!("rule {rule:?}: timezone needs align: calendar"),
            ));
        }
        return Ok(None);
    };
    if a.value.trim() != "calendar" {
        return Err(ConfigError::at(
            file,
            &a.referenced,
            format!("rule {rule:?}: unknown align {:?} (calendar)", a.value),
        ));
    }
    if !matches!(alg, Algorithm::FixedWindow | Algorithm::SlidingWindow) {
        return Err(ConfigError::at(
            file,
            &a.referenced,
            format!(
                "rule {rule:?}: align: calendar works with fixed_window and sliding_window, not {}",
                alg.as_str()
            ),
        ));
    }
    match timezone {
        None => Ok(Some(0)),
        Some(tz) => calendar::parse_offset(&tz.value).map(Some).ok_or_else(|| {
            ConfigError::at(
                file,
                &tz.referenced,
                format!(
                    "rule {rule:?}: timezone {:?}: want UTC or +HH:MM / -HH:MM (at most 18h)",
                    tz.value
                ),
            )
        }),
    }
}

/// Give calendar-aligned quotas their unit (from the nominal window) and offset.
pub(super) fn align(qs: &mut [Quota], offset: Option<i32>) {
    let Some(offset_s) = offset else { return };
    for q in qs {
        let unit = [CalendarUnit::Day, CalendarUnit::Week, CalendarUnit::Month]
            .into_iter()
            .find(|u| u.nominal_us() == q.window_us.get());
        if let Some(unit) = unit {
            q.calendar = Some(Calendar { unit, offset_s });
        }
    }
}

/// `count_when: {status: [...]}`: codes 100-599 and classes `1xx`-`5xx`, at least one.
pub(super) fn count_when(file: &Path, rule: &str, cw: &Spanned<RawCountWhen>) -> Result<StatusMatch, ConfigError> {
    let at = |m: String| ConfigError::at(file, &cw.referenced, format!("rule {rule:?}: count_when: {m}"));
    let mut out = StatusMatch::default();
    for s in &cw.value.status {
        match s {
            RawStatus::Code(c) if (100..=599).contains(c) => out.codes.push(*c as u16),
            RawStatus::Code(c) => return Err(at(format!("{c} is not an HTTP status (100-599)"))),
            RawStatus::Class(t) => {
                let b = t.trim().as_bytes();
                match b {
                    [d @ b'1'..=b'5', b'x' | b'X', b'x' | b'X'] => out.classes |= 1 << (d - b'0'),
                    _ => return Err(at(format!("{t:?} is neither a status nor a class like 4xx"))),
                }
            }
        }
    }
    if out.classes == 0 && out.codes.is_empty() {
        return Err(at("status lists nothing".to_owned()));
    }
    Ok(out)
}

/// Most requests in flight `cost_from.in_flight` may allow per key.
pub(super) const MAX_IN_FLIGHT: u64 = 1_000_000;

/// Largest request body prefix `estimate.within` may ask to read (the body is held in memory
/// while it is read).
pub(super) const MAX_ESTIMATE_WITHIN: u64 = 16 * 1024 * 1024;

/// `estimate.within` when not given: 1 MiB.
pub(super) const DEFAULT_ESTIMATE_WITHIN: usize = 1024 * 1024;

/// `estimate: {json, default, within}`: valid dotted paths, `default` from 1 to `max` (the
/// spend's `cost_from.max`), `within` from 1 byte to [`MAX_ESTIMATE_WITHIN`].
pub(super) fn estimate(file: &Path, rule: &str, e: &Spanned<RawEstimate>, max: u64) -> Result<Estimate, ConfigError> {
    let at = |m: String| ConfigError::at(file, &e.referenced, format!("rule {rule:?}: estimate: {m}"));
    let parse = |field: &str, raw: &RawPaths| -> Result<Vec<JsonPath>, ConfigError> {
        let raw = match raw {
            RawPaths::One(p) => vec![p.clone()],
            RawPaths::Many(v) => v.clone(),
        };
        if raw.is_empty() || raw.len() > 8 {
            return Err(at(format!("{field} names 1 to 8 paths")));
        }
        raw.iter()
            .map(|p| JsonPath::parse(p.trim()).map_err(|m| at(format!("{field} {p:?}: {m}"))))
            .collect()
    };
    let paths = parse("json", &e.value.json)?;
    let times = match &e.value.times {
        Some(t) => parse("times", t)?,
        None => Vec::new(),
    };
    let default = u64::try_from(e.value.default.value)
        .ok()
        .filter(|d| (1..=max).contains(d))
        .ok_or_else(|| {
            ConfigError::at(
                file,
                &e.value.default.referenced,
                format!(
                    "rule {rule:?}: estimate: default must be 1 to cost_from.max ({max}), got {}",
                    e.value.default.value
                ),
            )
        })?;
    let within = match &e.value.within {
        None => DEFAULT_ESTIMATE_WITHIN,
        Some(w) => u64::try_from(w.value)
            .ok()
            .filter(|w| (1..=MAX_ESTIMATE_WITHIN).contains(w))
            .and_then(|w| usize::try_from(w).ok())
            .ok_or_else(|| {
                ConfigError::at(
                    file,
                    &w.referenced,
                    format!(
                        "rule {rule:?}: estimate: within must be 1 to {MAX_ESTIMATE_WITHIN} bytes, got {}",
                        w.value
                    ),
                )
            })?,
    };
    Ok(Estimate {
        paths,
        default,
        within,
        times,
    })
}

/// `cost_from: {header | json, max, in_flight}`: a valid header name or dotted JSON path (one of
/// the two), `max` from the spend's `cost` (the estimate) up to the largest supported cost, and
/// the cap on requests in flight per key (1 to [`MAX_IN_FLIGHT`]). Without `in_flight` the cap
/// is `max(2, least limit / (max - cost))` (what a key can spend before it settles is then about
/// one quota, and a client sending one request after another never waits for its last slot's
/// release); none when `max` is the estimate, and none when the reservation is read from the
/// request (`per_request`: an `estimate`), whose overshoot is bounded by the requests in
/// flight × (actual − estimate).
pub(super) fn cost_from(
    file: &Path,
    rule: &str,
    cf: &Spanned<RawCostFrom>,
    (estimate, per_request): (u64, bool),
    limits: &[Quota],
) -> Result<CostFrom, ConfigError> {
    let at = |m: String| ConfigError::at(file, &cf.referenced, format!("rule {rule:?}: cost_from: {m}"));
    let source = match (&cf.value.header, &cf.value.json) {
        (Some(h), None) => CostSource::Header(
            HeaderName::from_bytes(h.trim().as_bytes()).map_err(|_| at(format!("invalid header name {h:?}")))?,
        ),
        (None, Some(p)) => CostSource::Json(JsonPath::parse(p.trim()).map_err(|m| at(format!("json {p:?}: {m}")))?),
        _ => return Err(at("name exactly one of header and json".to_owned())),
    };
    let max = u64::try_from(cf.value.max).unwrap_or(0);
    if max < estimate || max > crate::limiter::algorithm::MAX_UNITS {
        let what = if per_request {
            "the estimate's default"
        } else {
            "the rule's cost"
        };
        return Err(at(format!(
            "max must be at least {what} ({estimate}) and at most {}",
            crate::limiter::algorithm::MAX_UNITS
        )));
    }
    let in_flight = match &cf.value.in_flight {
        Some(n) => Some(
            u64::try_from(n.value)
                .ok()
                .filter(|n| (1..=MAX_IN_FLIGHT).contains(n))
                .ok_or_else(|| {
                    ConfigError::at(
                        file,
                        &n.referenced,
                        format!(
                            "rule {rule:?}: cost_from: in_flight must be 1 to {MAX_IN_FLIGHT}, got {}",
                            n.value
                        ),
                    )
                })?,
        ),
        None if max > estimate && !per_request => {
            let least = limits.iter().map(|q| q.limit.get()).min().unwrap_or(1);
            Some((least / (max - estimate)).clamp(2, MAX_IN_FLIGHT))
        }
        None => None,
    };
    let ttl = NonZeroU64::new(super::DEFAULT_SLOT_TTL_US).unwrap_or(NonZeroU64::MIN);
    let in_flight = in_flight
        .and_then(NonZeroU64::new)
        .map(|n| Quota::window(Algorithm::Concurrency, n, ttl));
    let unit = match (&cf.value.unit, &source) {
        (Some(u), _) => {
            let u = u.trim();
            let ok = (1..=32).contains(&u.len())
                && u.bytes().next().is_some_and(|b| b.is_ascii_lowercase())
                && u.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
            if !ok {
                return Err(at(format!(
                    "unit {u:?}: use 1-32 lower-case letters, digits and '-', starting with a letter"
                )));
            }
            Some(std::sync::Arc::from(u))
        }
        (None, CostSource::Json(_)) => Some(std::sync::Arc::from("tokens")),
        (None, CostSource::Header(_)) => None,
    };
    let missing_max = match (&cf.value.missing, &source) {
        (None, _) => false,
        (Some(m), CostSource::Json(_)) if m.value.trim() == "max" => true,
        (Some(m), CostSource::Json(_)) if m.value.trim() == "reservation" => false,
        (Some(m), CostSource::Json(_)) => {
            return Err(ConfigError::at(
                file,
                &m.referenced,
                format!(
                    "rule {rule:?}: cost_from: missing must be reservation or max, got {:?}",
                    m.value
                ),
            ))
        }
        (Some(m), CostSource::Header(_)) => {
            return Err(ConfigError::at(
                file,
                &m.referenced,
                format!("rule {rule:?}: cost_from: missing applies to json costs only"),
            ))
        }
    };
    Ok(CostFrom {
        source,
        max,
        in_flight,
        unit,
        missing_max,
    })
}

pub(super) fn failure_policy(
    file: &Path,
    f: &Option<Spanned<String>>,
    share: Option<&Spanned<u32>>,
    default: FailurePolicy,
) -> Result<FailurePolicy, ConfigError> {
    let share = match share {
        Some(s) => Some(
            NonZeroU32::new(s.value)
                .ok_or_else(|| ConfigError::at(file, &s.referenced, "local_share must be at least 1"))?,
        ),
        None => None,
    };
    let mut p = match f {
        None => default,
        Some(f) => match f.value.as_str() {
            "open" => FailurePolicy::Open,
            "closed" => FailurePolicy::Closed,
            "local" => FailurePolicy::Local { share: NonZeroU32::MIN },
            other => {
                return Err(ConfigError::at(
                    file,
                    &f.referenced,
                    format!("unknown failure policy {other:?} (open | closed | local)"),
                ))
            }
        },
    };
    if let (FailurePolicy::Local { share: s }, Some(n)) = (&mut p, share) {
        *s = n;
    }
    Ok(p)
}
