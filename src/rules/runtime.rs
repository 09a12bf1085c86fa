//! Runtime overrides: per-identity limits set through the admin API (`PUT /overrides/...`),
//! kept in the store so every node of the fleet sees them, each with an expiry. They beat the
//! overrides of the rules file and survive reloads (they are stored apart from it).
//!
//! Stored as one JSON document per (rule, key value), under the key value's **tag** (the same
//! salted hash the rule's counters use), never the raw value: a key id or user id set through
//! the API is not kept anywhere in clear. Every node reads the whole table twice a second and
//! compiles it against its current rules; the request path looks it up by the tag it computes
//! anyway, only when the table is not empty.

use std::collections::HashMap;
use std::num::NonZeroU64;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::{parse_rate, Rule, RuleSet};
use crate::limiter::algorithm::calendar::{Calendar, CalendarUnit};
use crate::limiter::{Algorithm, Quota};

/// Longest an override may live: a year (a longer one belongs in the rules file).
pub const MAX_OVERRIDE_SECS: u64 = 366 * 86_400;

/// One limit of an override, as the admin API takes it: `{limit, window}` for the window
/// algorithms, `{rate, capacity}` for the buckets, `{limit}` for concurrency.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OverrideLimit {
    /// Units per window, the bucket capacity, or slots.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<u64>,
    /// Window (`1m`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub window: Option<String>,
    /// Bucket rate (`10/s`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate: Option<String>,
    /// Bucket capacity.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity: Option<u64>,
}

/// One override as stored (and listed by `GET /overrides`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredOverride {
    /// The rule it replaces the limits of.
    pub rule: String,
    /// The key kind it was set for: `user`, `ip`, `org` or `header:<Name>`.
    pub kind: String,
    /// The key value's tag (salted hash), as in the rule's store keys.
    pub tag: String,
    /// The limits in force for this identity instead of the rule's.
    pub limits: Vec<OverrideLimit>,
    /// Unix seconds after which it no longer applies.
    pub expires_at: u64,
    /// Unix seconds when it was set.
    pub set_at: u64,
}

impl StoredOverride {
    /// The field it is stored under: one per (rule, key value).
    pub fn field(&self) -> String {
        format!("{}|{}", self.rule, self.tag)
    }
}

/// Why an override's limits are refused.
pub fn quotas(rule: &Rule, limits: &[OverrideLimit]) -> Result<Vec<Quota>, String> {
    let alg = rule.limits.first().map_or(Algorithm::SlidingWindow, |q| q.algorithm);
    if limits.is_empty() {
        return Err("limits is empty".into());
    }
    let mut out = Vec::with_capacity(limits.len());
    for l in limits {
        let positive = |v: Option<u64>, what: &str| {
            v.and_then(NonZeroU64::new)
                .ok_or_else(|| format!("{} needs a positive {what}", alg.as_str()))
        };
        let q = match alg {
            Algorithm::TokenBucket | Algorithm::LeakyBucket => {
                if l.limit.is_some() || l.window.is_some() {
                    return Err(format!("{} takes rate and capacity", alg.as_str()));
                }
                let rate = l
                    .rate
                    .as_deref()
                    .ok_or_else(|| format!("{} needs rate", alg.as_str()))?;
                Quota::bucket(alg, positive(l.capacity, "capacity")?, parse_rate(rate)?)
            }
            Algorithm::Concurrency => {
                if l.window.is_some() || l.rate.is_some() || l.capacity.is_some() {
                    return Err("concurrency takes only limit".into());
                }
                let ttl = rule.limits.first().map_or(NonZeroU64::MIN, |q| q.window_us);
                Quota::window(alg, positive(l.limit, "limit")?, ttl)
            }
            _ => {
                if l.rate.is_some() || l.capacity.is_some() {
                    return Err(format!("{} takes limit and window", alg.as_str()));
                }
                let w = l
                    .window
                    .as_deref()
                    .ok_or_else(|| format!("{} needs window", alg.as_str()))?;
                let limit = positive(l.limit, "limit")?;
                match rule.limits.first().and_then(|q| q.calendar) {
                    Some(cal) => {
                        let unit = CalendarUnit::parse(w).ok_or("a calendar rule takes window 1d, 1w or 1mo")?;
                        let mut q = Quota::window(
                            alg,
                            limit,
                            NonZeroU64::new(unit.nominal_us()).unwrap_or(NonZeroU64::MIN),
                        );
                        q.calendar = Some(Calendar { unit, ..cal });
                        q
                    }
                    None => {
                        let d = humantime::parse_duration(w.trim()).map_err(|e| format!("window {w:?}: {e}"))?;
                        let us = u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
                        if us < 1000 {
                            return Err("window must be at least 1ms".into());
                        }
                        Quota::window(alg, limit, NonZeroU64::new(us).unwrap_or(NonZeroU64::MIN))
                    }
                }
            }
        };
        if let Some(m) = q.bounds_error(rule.cost) {
            return Err(m);
        }
        if rule.cost > q.limit.get() {
            return Err(format!("the rule's cost {} is above the limit {}", rule.cost, q.limit));
        }
        if out.iter().any(|o: &Quota| o.window_us == q.window_us) {
            return Err("two limits with the same window".into());
        }
        out.push(q);
    }
    Ok(out)
}

/// One compiled override.
#[derive(Debug, Clone)]
pub struct Applied {
    /// The rule's name.
    pub rule: Arc<str>,
    /// Its limits.
    pub quotas: Vec<Quota>,
    /// Microseconds since the epoch after which it no longer applies.
    pub expires_at_us: u64,
}

/// The runtime overrides in force, compiled against the loaded rules: tag → overrides.
#[derive(Debug, Default)]
pub struct RuntimeOverrides {
    /// By key-value tag; a value overridden on several rules has one entry per rule.
    by_tag: HashMap<Box<str>, Vec<Applied>>,
    /// What the store held, as read (listing, change detection).
    pub stored: Vec<StoredOverride>,
}

impl RuntimeOverrides {
    /// Compile `stored` against `rules`; overrides of rules that no longer exist, or whose
    /// limits no longer fit the rule (a reload changed its algorithm), are skipped with a
    /// warning.
    pub fn compile(stored: Vec<StoredOverride>, rules: &RuleSet) -> Self {
        let mut by_tag: HashMap<Box<str>, Vec<Applied>> = HashMap::new();
        for o in &stored {
            let Some(rule) = rules.rules.iter().find(|r| *r.name == *o.rule) else {
                tracing::warn!(rule = %o.rule, "runtime override of a rule that is not loaded; ignored");
                continue;
            };
            match quotas(rule, &o.limits) {
                Ok(q) => by_tag.entry(Box::from(o.tag.as_str())).or_default().push(Applied {
                    rule: rule.name.clone(),
                    quotas: q,
                    expires_at_us: o.expires_at.saturating_mul(1_000_000),
                }),
                Err(e) => {
                    tracing::warn!(rule = %o.rule, error = %e, "runtime override no longer fits its rule; ignored")
                }
            }
        }
        RuntimeOverrides { by_tag, stored }
    }

    /// True when no override is in force (the request path then skips the lookup).
    pub fn is_empty(&self) -> bool {
        self.by_tag.is_empty()
    }

    /// The override of `rule` for the key value tagged `tag`, unless it expired by `now_us`.
    pub fn get(&self, tag: &str, rule: &str, now_us: u64) -> Option<&Applied> {
        self.by_tag
            .get(tag)?
            .iter()
            .find(|a| *a.rule == *rule && a.expires_at_us > now_us)
    }
}
