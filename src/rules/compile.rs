//! Validation: a parsed rules file into a [`RuleSet`], every error naming file, line, column
//! and rule; specificity; unreachable rules.

use std::collections::{HashMap, HashSet};
use std::num::NonZeroU64;
use std::path::Path;
use std::sync::Arc;

use http::{HeaderName, Method};
use serde_saphyr::{Location, Spanned};
use sha2::Digest;

use super::{KeyKind, Pattern, Rule, RuleSet, Specificity, Spend, RULE_SPEND};
use crate::rules::raw::{RawCostFrom, RawEstimate, RawOverride, RawRule, RawRules, RawWindow};
use crate::yaml::{duration, ConfigError};
use crate::yaml::{parse_str_sized, Sized};

/// Rules a rules file may hold unless `limits.max_rules` says otherwise.
pub const DEFAULT_MAX_RULES: usize = 50_000;
use crate::limiter::algorithm::calendar::CalendarUnit;
use crate::limiter::{Algorithm, FailurePolicy, Quota};

/// How long a concurrency slot lives without renewal unless `store.concurrency_ttl` says
/// otherwise: a running request renews its slots every third of it, and the slots of a gateway
/// that died free themselves after it.
pub const DEFAULT_SLOT_TTL_US: u64 = 30_000_000;

mod fields;
pub use fields::MAX_PENALTY_US;
use fields::{align, calendar_of, cost_from, count_when, estimate, failure_policy, penalty};

fn name_ok(s: &str) -> bool {
    !s.is_empty() && s.len() <= 64 && s.chars().all(|c| c.is_ascii_alphanumeric() || "_-.".contains(c))
}

/// Parse `N/s`, `N/m`, `N/h`, `N/d` or `N/<duration>` into µs per unit.
pub fn parse_rate(s: &str) -> Result<NonZeroU64, String> {
    let (n, per) = s
        .split_once('/')
        .ok_or_else(|| format!("rate {s:?}: want N/s, N/m, N/h or N/<duration>"))?;
    let n: u64 = n
        .trim()
        .parse()
        .map_err(|_| format!("rate {s:?}: {n:?} is not a positive integer"))?;
    if n == 0 {
        return Err(format!("rate {s:?} must be positive"));
    }
    let per_us: u64 = match per.trim() {
        "s" | "sec" | "second" => 1_000_000,
        "m" | "min" | "minute" => 60_000_000,
        "h" | "hour" => 3_600_000_000,
        "d" | "day" => 86_400_000_000,
        other => humantime::parse_duration(other)
            .map_err(|_| format!("rate {s:?}: unknown unit {other:?}"))?
            .as_micros() as u64,
    };
    let interval = (per_us + n / 2) / n;
    NonZeroU64::new(interval).ok_or_else(|| format!("rate {s:?} is faster than one per microsecond"))
}

/// The compiler's context: file and defaults.
struct Ctx<'a> {
    file: &'a Path,
    default_alg: Algorithm,
    /// The rule being compiled follows the calendar at this UTC offset (`align: calendar`).
    calendar: std::cell::Cell<Option<i32>>,
}

/// A rule's (or an override's) limit fields as written: `limit`/`window`, `limits:`, or
/// `rate`/`capacity`.
#[derive(Clone, Copy)]
struct LimitFields<'a> {
    limit: &'a Option<Spanned<i64>>,
    window: &'a Option<Spanned<String>>,
    limits: &'a Option<Vec<Spanned<RawWindow>>>,
    rate: &'a Option<Spanned<String>>,
    capacity: &'a Option<Spanned<i64>>,
}

/// A spend's fields as the YAML gives them: the rule's, or one limit's.
struct SpendFields<'a> {
    /// `cost`.
    cost: &'a Option<Spanned<i64>>,
    /// `cost_from`.
    cost_from: &'a Option<Spanned<RawCostFrom>>,
    /// `estimate`.
    estimate: &'a Option<Spanned<RawEstimate>>,
}

impl Ctx<'_> {
    /// What one request spends of `limits` (algorithm `alg`): a fixed `cost` (default 1), or a
    /// reservation (`cost`, or an `estimate` read from the request body) settled by
    /// `cost_from`. An estimate needs a `cost_from` to settle it, and replaces `cost` (its
    /// `default` is the reservation until the body is read).
    fn spend(&self, rule: &str, alg: Algorithm, f: SpendFields<'_>, limits: &[Quota]) -> Result<Spend, ConfigError> {
        let cost = match f.cost {
            Some(c) if alg == Algorithm::Concurrency => {
                return Err(self.err(
                    &c.referenced,
                    format!("rule {rule:?}: concurrency counts requests in flight; cost does not apply"),
                ))
            }
            Some(c) => self.positive(rule, "cost", c)?.get(),
            None => 1,
        };
        if let Some(cf) = f.cost_from {
            if matches!(
                alg,
                Algorithm::Concurrency | Algorithm::SlidingLog | Algorithm::LeakyBucket
            ) {
                return Err(self.err(
                    &cf.referenced,
                    format!(
                        "rule {rule:?}: cost_from does not work with {} (use token_bucket, fixed_window or sliding_window)",
                        alg.as_str()
                    ),
                ));
            }
        }
        let (cost_from, estimate) = match (f.cost_from, f.estimate) {
            (None, None) => (None, None),
            (None, Some(e)) => {
                return Err(self.err(
                    &e.referenced,
                    format!("rule {rule:?}: estimate needs a cost_from to settle it against"),
                ))
            }
            (Some(cf), None) => (Some(cost_from(self.file, rule, cf, (cost, false), limits)?), None),
            (Some(cf), Some(e)) => {
                if let Some(c) = f.cost {
                    return Err(self.err(
                        &c.referenced,
                        format!("rule {rule:?}: give cost or estimate, not both (the estimate's default is the reservation when the body has none)"),
                    ));
                }
                let default = u64::try_from(e.value.default.value).unwrap_or(0).max(1);
                let cf = cost_from(self.file, rule, cf, (default, true), limits)?;
                let e = estimate(self.file, rule, e, cf.max)?;
                (Some(cf), Some(e))
            }
        };
        Ok(Spend {
            cost: estimate.as_ref().map_or(cost, |e| e.default),
            cost_from,
            estimate,
        })
    }

    fn err(&self, loc: &Location, msg: impl Into<String>) -> ConfigError {
        ConfigError::at(self.file, loc, msg)
    }

    fn positive(&self, rule: &str, field: &str, v: &Spanned<i64>) -> Result<NonZeroU64, ConfigError> {
        u64::try_from(v.value).ok().and_then(NonZeroU64::new).ok_or_else(|| {
            self.err(
                &v.referenced,
                format!("rule {rule:?}: {field} must be a positive integer, got {}", v.value),
            )
        })
    }

    /// `q` when both stores compute it exactly (see [`Quota::bounds_error`]).
    fn bounded(&self, rule: &str, at: &Location, q: Quota) -> Result<Quota, ConfigError> {
        match q.bounds_error(0) {
            None => Ok(q),
            Some(m) => Err(self.err(at, format!("rule {rule:?}: {m}"))),
        }
    }

    fn window(&self, rule: &str, w: &Spanned<String>) -> Result<NonZeroU64, ConfigError> {
        // With `align: calendar`, days, weeks and months follow the clock; other windows of
        // the rule (a per-minute budget beside a monthly one) stay epoch-aligned.
        if let (Some(_), Some(u)) = (self.calendar.get(), CalendarUnit::parse(&w.value)) {
            return NonZeroU64::new(u.nominal_us()).ok_or_else(|| self.err(&w.referenced, "window must be positive"));
        }
        if CalendarUnit::parse(&w.value) == Some(CalendarUnit::Month) {
            return Err(self.err(
                &w.referenced,
                format!("rule {rule:?}: a 1mo window needs align: calendar (months differ in length)"),
            ));
        }
        let d = duration(self.file, w)?;
        let us = u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        if us < 1000 {
            return Err(self.err(&w.referenced, format!("rule {rule:?}: window must be at least 1ms")));
        }
        NonZeroU64::new(us).ok_or_else(|| self.err(&w.referenced, "window must be positive"))
    }

    /// Build the quotas from limit/window, limits:, or rate/capacity.
    fn quotas(
        &self,
        rule: &str,
        loc: &Location,
        alg: Algorithm,
        fields: LimitFields<'_>,
    ) -> Result<Vec<Quota>, ConfigError> {
        let LimitFields {
            limit,
            window,
            limits,
            rate,
            capacity,
        } = fields;
        if alg == Algorithm::Concurrency {
            if window.is_some() || limits.is_some() || rate.is_some() || capacity.is_some() {
                return Err(self.err(
                    loc,
                    format!("rule {rule:?}: concurrency takes only limit (requests in flight at once), no window, limits, rate or capacity"),
                ));
            }
            let l = limit
                .as_ref()
                .ok_or_else(|| self.err(loc, format!("rule {rule:?}: concurrency needs limit")))?;
            let ttl = NonZeroU64::new(DEFAULT_SLOT_TTL_US).unwrap_or(NonZeroU64::MIN);
            let q = Quota::window(Algorithm::Concurrency, self.positive(rule, "limit", l)?, ttl);
            return self.bounded(rule, &l.referenced, q).map(|q| vec![q]);
        }
        if alg.is_bucket() {
            if limit.is_some() || window.is_some() || limits.is_some() {
                return Err(self.err(
                    loc,
                    format!(
                        "rule {rule:?}: {} takes rate and capacity, not limit/window",
                        alg.as_str()
                    ),
                ));
            }
            let rate = rate
                .as_ref()
                .ok_or_else(|| self.err(loc, format!("rule {rule:?}: {} needs rate", alg.as_str())))?;
            let interval =
                parse_rate(&rate.value).map_err(|m| self.err(&rate.referenced, format!("rule {rule:?}: {m}")))?;
            let cap = capacity
                .as_ref()
                .ok_or_else(|| self.err(loc, format!("rule {rule:?}: {} needs capacity", alg.as_str())))?;
            let q = Quota::bucket(alg, self.positive(rule, "capacity", cap)?, interval);
            return self.bounded(rule, &cap.referenced, q).map(|q| vec![q]);
        }
        if rate.is_some() || capacity.is_some() {
            return Err(self.err(
                loc,
                format!(
                    "rule {rule:?}: {} takes limit and window, not rate/capacity",
                    alg.as_str()
                ),
            ));
        }
        let mut out = Vec::new();
        match (limit, window, limits) {
            (Some(l), Some(w), None) => {
                let q = Quota::window(alg, self.positive(rule, "limit", l)?, self.window(rule, w)?);
                out.push(self.bounded(rule, &l.referenced, q)?)
            }
            (None, None, Some(ls)) if !ls.is_empty() => {
                for lw in ls {
                    let q = Quota::window(
                        alg,
                        self.positive(rule, "limit", &lw.value.limit)?,
                        self.window(rule, &lw.value.window)?,
                    );
                    out.push(self.bounded(rule, &lw.value.limit.referenced, q)?);
                }
                // Two limits of one window spend the same way only by mistake; limits that
                // spend their own way (tokens in, tokens out, requests) may share a window.
                let mut seen = HashSet::new();
                for (q, lw) in out.iter().zip(ls) {
                    let own = lw.value.cost.is_some() || lw.value.cost_from.is_some() || lw.value.estimate.is_some();
                    if !own && !seen.insert(q.window_us) {
                        return Err(self.err(
                            &lw.referenced,
                            format!("rule {rule:?}: two limits with the same window"),
                        ));
                    }
                }
            }
            (Some(_), None, None) => return Err(self.err(loc, format!("rule {rule:?}: limit needs a window"))),
            (None, Some(_), None) => return Err(self.err(loc, format!("rule {rule:?}: window needs a limit"))),
            (None, None, None) => return Err(self.err(loc, format!("rule {rule:?}: needs limit + window, or limits:"))),
            _ => {
                return Err(self.err(
                    loc,
                    format!("rule {rule:?}: use either limit + window or limits:, not both"),
                ))
            }
        }
        Ok(out)
    }

    fn algorithm(&self, rule: &str, a: &Option<Spanned<String>>) -> Result<Algorithm, ConfigError> {
        match a {
            None => Ok(self.default_alg),
            Some(a) => Algorithm::parse(&a.value).ok_or_else(|| {
                self.err(
                    &a.referenced,
                    format!(
                        "rule {rule:?}: unknown algorithm {:?} (token_bucket | leaky_bucket | fixed_window | sliding_log | sliding_window | concurrency)",
                        a.value
                    ),
                )
            }),
        }
    }
}

impl RuleSet {
    /// Load and validate a rules file of at most `max_rules` rules (`limits.max_rules`).
    pub fn load(path: &Path, max_rules: usize) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError::file(path, format!("cannot read: {e}")))?;
        Self::from_str_max(path, &text, max_rules)
    }

    /// Parse and validate rules text (`path` names it in errors), at most the default
    /// `limits.max_rules` rules.
    pub fn from_str(path: &Path, text: &str) -> Result<Self, ConfigError> {
        Self::from_str_max(path, text, DEFAULT_MAX_RULES)
    }

    /// Parse and validate rules text of at most `max_rules` rules.
    pub fn from_str_max(path: &Path, text: &str, max_rules: usize) -> Result<Self, ConfigError> {
        let size = Sized {
            entries: max_rules,
            // A rule with match conditions, several windows and a few overrides.
            nodes_per_entry: 96,
            bytes_per_entry: 4096,
            what: "limits.max_rules",
        };
        let raw: RawRules = parse_str_sized(path, text, size)?;
        if raw.rules.len() > max_rules {
            return Err(ConfigError::file(
                path,
                format!(
                    "{} rules is over limits.max_rules ({max_rules}); raise it in gateway.yaml",
                    raw.rules.len()
                ),
            ));
        }
        let mut set = Self::compile(path, raw)?;
        set.version = hex::encode(&sha2::Sha256::digest(text.as_bytes())[..8]);
        Ok(set)
    }

    /// Validate parsed rules.
    pub fn compile(file: &Path, raw: RawRules) -> Result<Self, ConfigError> {
        let default_alg = match &raw.defaults.algorithm {
            Some(a) => Algorithm::parse(&a.value)
                .ok_or_else(|| ConfigError::at(file, &a.referenced, format!("unknown algorithm {:?}", a.value)))?,
            None => Algorithm::SlidingWindow,
        };
        let default_failure = failure_policy(
            file,
            &raw.defaults.failure,
            raw.defaults.local_share.as_ref(),
            FailurePolicy::Open,
        )?;
        let ctx = Ctx {
            file,
            default_alg,
            calendar: std::cell::Cell::new(None),
        };
        let mut rules: Vec<Rule> = Vec::new();
        let mut names: std::collections::HashMap<String, (u64, u64)> = std::collections::HashMap::new();
        for (index, sr) in raw.rules.iter().enumerate() {
            let r: &RawRule = &sr.value;
            let loc = &sr.referenced;
            let name = r.name.value.as_str();
            if !name_ok(name) {
                return Err(ctx.err(
                    &r.name.referenced,
                    format!("rule name {name:?}: use 1-64 letters, digits, '_', '-', '.'"),
                ));
            }
            let here = (r.name.referenced.line(), r.name.referenced.column());
            if let Some((line, col)) = names.insert(name.to_string(), here) {
                return Err(ctx.err(
                    &r.name.referenced,
                    format!("duplicate rule name {name:?} (first defined at line {line}, column {col})"),
                ));
            }
            let key = KeyKind::parse(&r.key.value).ok_or_else(|| {
                ctx.err(
                    &r.key.referenced,
                    format!(
                        "rule {name:?}: unknown key kind {:?} (user | ip | org | global | header:<Name>)",
                        r.key.value
                    ),
                )
            })?;
            let alg = ctx.algorithm(name, &r.algorithm)?;
            ctx.calendar.set(calendar_of(file, name, alg, &r.align, &r.timezone)?);
            let mut limits = ctx.quotas(
                name,
                loc,
                alg,
                LimitFields {
                    limit: &r.limit,
                    window: &r.window,
                    limits: &r.limits,
                    rate: &r.rate,
                    capacity: &r.capacity,
                },
            )?;
            align(&mut limits, ctx.calendar.get());
            if let (Some(_), Some(a)) = (ctx.calendar.get(), &r.align) {
                if !limits.iter().any(|q| q.calendar.is_some()) {
                    return Err(ctx.err(
                        &a.referenced,
                        format!("rule {name:?}: align: calendar needs a window of 1d, 1w or 1mo"),
                    ));
                }
            }
            let rule_spend = ctx.spend(
                name,
                alg,
                SpendFields {
                    cost: &r.cost,
                    cost_from: &r.cost_from,
                    estimate: &r.estimate,
                },
                &limits,
            )?;
            let mut limit_spends: Vec<Option<Spend>> = Vec::new();
            for (n, w) in r.limits.iter().flatten().enumerate() {
                let wv = &w.value;
                if wv.cost.is_none() && wv.cost_from.is_none() && wv.estimate.is_none() {
                    continue;
                }
                if n >= usize::from(RULE_SPEND) {
                    return Err(ctx.err(
                        &w.referenced,
                        format!("rule {name:?}: at most 254 limits may spend in their own way"),
                    ));
                }
                let own = ctx.spend(
                    name,
                    alg,
                    SpendFields {
                        cost: &wv.cost,
                        cost_from: &wv.cost_from,
                        estimate: &wv.estimate,
                    },
                    limits.get(n..=n).unwrap_or(&[]),
                )?;
                limit_spends.resize(n + 1, None);
                limit_spends[n] = Some(own);
            }
            let cost = rule_spend.cost;
            let cost_of = |n: usize| match limit_spends.get(n) {
                Some(Some(s)) => s.cost,
                _ => cost,
            };
            let penalty = match &r.penalty {
                None => None,
                Some(p) => Some(penalty(file, name, p)?),
            };
            let count_when = match &r.count_when {
                None => None,
                Some(_) if alg == Algorithm::Concurrency => {
                    return Err(ctx.err(loc, format!("rule {name:?}: count_when does not apply to concurrency")))
                }
                Some(cw) => Some(count_when(file, name, cw)?),
            };
            let check_cost = |qs: &[Quota], at: &Location| -> Result<(), ConfigError> {
                for (n, q) in qs.iter().enumerate() {
                    let cost = cost_of(n);
                    if let Some(m) = q.bounds_error(cost) {
                        return Err(ctx.err(at, format!("rule {name:?}: {m}")));
                    }
                    if cost > q.limit.get() {
                        let what = if q.algorithm.is_bucket() { "capacity" } else { "limit" };
                        return Err(ctx.err(
                            at,
                            format!(
                                "rule {name:?}: cost {cost} is above the {what} {}: no request could ever pass",
                                q.limit
                            ),
                        ));
                    }
                }
                Ok(())
            };
            check_cost(&limits, r.cost.as_ref().map_or(loc, |c| &c.referenced))?;
            let failure = failure_policy(
                file,
                &r.failure,
                r.local_share.as_ref().or(raw.defaults.local_share.as_ref()),
                default_failure,
            )?;
            if r.local_share.is_some() && !matches!(failure, FailurePolicy::Local { .. }) {
                return Err(ctx.err(loc, format!("rule {name:?}: local_share needs failure: local")));
            }
            let mut overrides = HashMap::new();
            for (who, o) in &r.overrides {
                let ov: &RawOverride = &o.value;
                // An override replaces the limits; unspecified fields inherit the rule's.
                let (limit, window, limits_o, rate, capacity) = if alg.is_bucket() {
                    (
                        None,
                        None,
                        None,
                        ov.rate.clone().or_else(|| r.rate.clone()),
                        ov.capacity.clone().or_else(|| r.capacity.clone()),
                    )
                } else if ov.limits.is_some() {
                    (None, None, clone_windows(&ov.limits), None, None)
                } else if ov.limit.is_some() || ov.window.is_some() {
                    let window = ov.window.clone().or_else(|| r.window.clone());
                    (ov.limit.clone().or_else(|| r.limit.clone()), window, None, None, None)
                } else {
                    return Err(ctx.err(&o.referenced, format!("rule {name:?}: override {who:?} sets no limit")));
                };
                if !alg.is_bucket() && (ov.rate.is_some() || ov.capacity.is_some()) {
                    return Err(ctx.err(
                        &o.referenced,
                        format!("rule {name:?}: override {who:?}: rate/capacity on a window algorithm"),
                    ));
                }
                if ov
                    .limits
                    .iter()
                    .flatten()
                    .any(|w| w.value.cost.is_some() || w.value.cost_from.is_some() || w.value.estimate.is_some())
                {
                    return Err(ctx.err(
                        &o.referenced,
                        format!("rule {name:?}: override {who:?}: an override sets limits only (each spends as the rule's limit at its position)"),
                    ));
                }
                let mut qs = ctx.quotas(
                    name,
                    &o.referenced,
                    alg,
                    LimitFields {
                        limit: &limit,
                        window: &window,
                        limits: &limits_o,
                        rate: &rate,
                        capacity: &capacity,
                    },
                )?;
                align(&mut qs, ctx.calendar.get());
                check_cost(&qs, &o.referenced)?;
                overrides.insert(who.clone(), qs);
            }
            let m = &r.matcher;
            let mut pattern = Pattern::parse(&m.path.value)
                .map_err(|e| ctx.err(&m.path.referenced, format!("rule {name:?}: {e}")))?;
            if m.ignore_case {
                pattern.lowercase();
            }
            let methods = match &m.methods {
                None => None,
                Some(ms) => {
                    let mut out = Vec::new();
                    for x in ms {
                        let up = x.value.to_ascii_uppercase();
                        let meth = Method::from_bytes(up.as_bytes()).map_err(|_| {
                            ctx.err(&x.referenced, format!("rule {name:?}: invalid method {:?}", x.value))
                        })?;
                        out.push(meth);
                    }
                    if out.is_empty() {
                        None
                    } else {
                        Some(out)
                    }
                }
            };
            let mut headers = Vec::new();
            for (h, v) in &m.header {
                let hn = HeaderName::from_bytes(h.as_bytes())
                    .map_err(|_| ctx.err(&m.path.referenced, format!("rule {name:?}: invalid header name {h:?}")))?;
                headers.push((hn, v.clone()));
            }
            let specificity = Specificity {
                class: pattern.class,
                literal_len: pattern.literal_len,
                methods: methods.is_some(),
                tier: m.tier.is_some(),
                extra: usize::from(m.host.is_some()) + headers.len(),
            };
            let global_scope = match r.scope.as_ref().map(|s| (s.value.as_str(), s)) {
                None | Some(("region", _)) => None,
                Some(("global", s)) => Some((s.referenced.line(), s.referenced.column())),
                Some((other, s)) => {
                    return Err(ConfigError::at(
                        file,
                        &s.referenced,
                        format!("rule {name:?}: scope {other:?} is not region or global"),
                    ))
                }
            };
            rules.push(Rule {
                name: Arc::from(name),
                key_name: Arc::from(name),
                global_scope,
                index,
                pattern,
                methods,
                method_override: m.method_override.unwrap_or(true),
                ignore_case: m.ignore_case,
                tier: m.tier.clone(),
                host: m.host.as_ref().map(|h| h.to_ascii_lowercase()),
                headers,
                key,
                limits,
                overrides,
                cost,
                failure,
                shadow: r.shadow,
                // A global rule's limit moves with the other regions' spend: no lease is sized
                // against it.
                lease: r.lease.unwrap_or(true)
                    && global_scope.is_none()
                    && !r.shadow
                    && penalty.is_none()
                    && count_when.is_none()
                    && rule_spend.cost_from.is_none()
                    && limit_spends.iter().flatten().all(|s| s.cost_from.is_none()),
                penalty,
                count_when,
                cost_from: rule_spend.cost_from,
                estimate: rule_spend.estimate,
                limit_spends,
                specificity,
                line: loc.line(),
                priority: r
                    .priority
                    .as_ref()
                    .map(|p| (Arc::from(p.value.as_str()), p.referenced.line(), p.referenced.column())),
            });
        }
        // Unreachable rules: B is shadowed when an earlier-or-more-specific A of the same key kind
        // matches every request B matches. `covers` needs the same path pattern, so only rules
        // of one (key kind, pattern) group are compared: linear in the rule count for distinct
        // patterns, instead of every pair.
        let mut groups: HashMap<(String, &str), Vec<&Rule>> = HashMap::new();
        for r in &rules {
            groups
                .entry((r.key.to_text(), r.pattern.source.as_str()))
                .or_default()
                .push(r);
        }
        let mut shadowed: Option<(&Rule, &Rule)> = None;
        for group in groups.values().filter(|g| g.len() > 1) {
            for b in group {
                for a in group {
                    if a.index != b.index
                        && covers(a, b)
                        && (a.specificity > b.specificity || (a.specificity == b.specificity && a.index < b.index))
                        && shadowed.is_none_or(|(sb, _)| b.index < sb.index)
                    {
                        shadowed = Some((b, a));
                    }
                }
            }
        }
        if let Some((b, a)) = shadowed {
            let loc = &raw.rules[b.index].referenced;
            return Err(ctx.err(
                loc,
                format!(
                    "rule {:?} is unreachable: rule {:?} (line {}) matches every request it does and wins",
                    b.name, a.name, a.line
                ),
            ));
        }
        let mut set = RuleSet {
            rules,
            ..Default::default()
        };
        set.index();
        Ok(set)
    }
}

fn clone_windows(w: &Option<Vec<Spanned<RawWindow>>>) -> Option<Vec<Spanned<RawWindow>>> {
    w.as_ref().map(|v| {
        v.iter()
            .map(|s| {
                Spanned::new(
                    RawWindow {
                        limit: s.value.limit.clone(),
                        window: s.value.window.clone(),
                        cost: s.value.cost.clone(),
                        cost_from: s.value.cost_from.clone(),
                        estimate: s.value.estimate.clone(),
                    },
                    s.referenced,
                    s.defined,
                )
            })
            .collect()
    })
}

/// Does `a` match every request `b` matches? Conservative: only when the paths are the same
/// pattern and each of `a`'s conditions is implied by `b`'s.
fn covers(a: &Rule, b: &Rule) -> bool {
    if a.pattern.source != b.pattern.source {
        return false;
    }
    let methods = match (&a.methods, &b.methods) {
        (None, _) => true,
        (Some(_), None) => false,
        (Some(am), Some(bm)) => bm.iter().all(|m| am.contains(m)),
    };
    let tier = a.tier.is_none() || a.tier == b.tier;
    let host = a.host.is_none() || a.host == b.host;
    let headers = a.headers.iter().all(|h| b.headers.contains(h));
    methods && tier && host && headers
}
