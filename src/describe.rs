//! Plain-language descriptions of the loaded configuration, shared by `tollgate check` and the
//! admin API: limits as an operator writes them (`rate 10/s, capacity 100`, `1000 per 1h`),
//! failure policies, the store with passwords redacted. No Rust debug syntax reaches a user.

use crate::config::{redact_url, GatewayConfig, StoreKind};
use crate::limiter::algorithm::{Algorithm, Quota};
use crate::limiter::FailurePolicy;
use crate::rules::{window_text, Rule};

/// `rate 10/s, capacity 100` for a bucket, `1000 per 1h` for a window.
pub fn quota(q: &Quota) -> String {
    match q.algorithm {
        Algorithm::TokenBucket | Algorithm::LeakyBucket => {
            format!("rate {}, capacity {}", rate(q.interval_us.get()), q.limit)
        }
        Algorithm::Concurrency => format!("{} in flight", q.limit),
        _ if q.calendar.is_some() => {
            let cal = q.calendar.map(|c| (c.unit, c.offset_s));
            let (unit, off) = cal.unwrap_or((crate::limiter::algorithm::calendar::CalendarUnit::Day, 0));
            let unit = match unit {
                crate::limiter::algorithm::calendar::CalendarUnit::Day => "day",
                crate::limiter::algorithm::calendar::CalendarUnit::Week => "week (from Monday)",
                crate::limiter::algorithm::calendar::CalendarUnit::Month => "month",
            };
            let sign = if off < 0 { '-' } else { '+' };
            let a = off.unsigned_abs();
            format!(
                "{} per calendar {unit} (UTC{sign}{:02}:{:02})",
                q.limit,
                a / 3600,
                a % 3600 / 60
            )
        }
        _ => format!("{} per {}", q.limit, window_text(q.window_us.get())),
    }
}

/// A bucket's rate from its microseconds per unit: `10/s`, `30/m`, `5/h`, else `1/250ms`.
pub fn rate(interval_us: u64) -> String {
    for (unit_us, unit) in [(1_000_000u64, "s"), (60_000_000, "m"), (3_600_000_000, "h")] {
        if interval_us <= unit_us && unit_us % interval_us == 0 {
            return format!("{}/{unit}", unit_us / interval_us);
        }
    }
    format!("1/{}", window_text(interval_us))
}

/// `open`, `closed` or `local (share 3)`.
pub fn failure(f: &FailurePolicy) -> String {
    match f {
        FailurePolicy::Open => "open".into(),
        FailurePolicy::Closed => "closed".into(),
        FailurePolicy::Local { share } => format!("local (share {share})"),
    }
}

/// `memory`, `redis` or `redis_cluster`.
pub fn store_kind(k: StoreKind) -> &'static str {
    match k {
        StoreKind::Memory => "memory",
        StoreKind::Redis => "redis",
        StoreKind::RedisCluster => "redis_cluster",
    }
}

/// The store in one line, passwords redacted.
pub fn store(cfg: &GatewayConfig) -> String {
    let s = &cfg.store;
    match s.kind {
        StoreKind::Memory => format!("memory (at most {} keys)", s.memory_max_keys),
        kind => {
            let urls: Vec<String> = s.urls.iter().map(|u| redact_url(u)).collect();
            format!(
                "{} {}, timeout {}, breaker opens after {} failures, probe every {}, key prefix {}{}",
                store_kind(kind),
                urls.join(" "),
                humantime::format_duration(s.timeout),
                s.breaker_threshold,
                humantime::format_duration(s.probe_interval),
                s.key_prefix,
                if s.key_salt.is_empty() {
                    ", no key salt"
                } else {
                    ", key salt set"
                },
            )
        }
    }
}

/// One rule: key, algorithm, limits, path, methods, tier, failure, shadow, cost.
pub fn rule(r: &Rule) -> String {
    let algorithm = r.limits.first().map_or("-", |q| q.algorithm.as_str());
    let limits: Vec<String> = r.limits.iter().map(quota).collect();
    let methods = r.methods.as_ref().map_or("any".to_string(), |m| {
        m.iter().map(|x| x.as_str()).collect::<Vec<_>>().join(",")
    });
    let mut s = format!(
        "{}: {} {} key={} {} [{}] methods={} tier={} failure={}",
        r.name,
        r.pattern.source,
        algorithm,
        r.key.to_text(),
        limits.join("; "),
        if r.shadow { "shadow" } else { "enforced" },
        methods,
        r.tier.as_deref().unwrap_or("any"),
        failure(&r.failure),
    );
    if r.cost != 1 {
        s.push_str(&format!(" cost={}", r.cost));
    }
    if let Some(h) = &r.host {
        s.push_str(&format!(" host={h}"));
    }
    if !r.overrides.is_empty() {
        s.push_str(&format!(" overrides={}", r.overrides.len()));
    }
    if let Some(m) = &r.count_when {
        s.push_str(&format!(" count_when=[{}]", m.to_text()));
    }
    for (n, sp) in r.spends().enumerate() {
        let Some(cf) = sp.cost_from else { continue };
        if n > 0 {
            s.push_str(&format!(" limit{}:", usize::from(sp.slot) + 1));
        }
        s.push_str(&format!(" cost_from={} (max {}", cf.source, cf.max));
        if let Some(u) = &cf.unit {
            s.push_str(&format!(", in {u}"));
        }
        if let Some(q) = &cf.in_flight {
            s.push_str(&format!(", at most {} in flight per key", q.limit));
        }
        s.push(')');
        if let Some(e) = sp.estimate {
            let paths: Vec<&str> = e.paths.iter().map(|p| p.as_str()).collect();
            s.push_str(&format!(
                " estimate=json {} (default {}, within {} bytes)",
                paths.join("|"),
                e.default,
                e.within
            ));
        }
    }
    if let Some(p) = &r.penalty {
        if p.escalates() {
            s.push_str(&format!(
                " penalty={}..{} (doubling)",
                window_text(p.base_us.get()),
                window_text(p.max_us.get())
            ));
        } else {
            s.push_str(&format!(" penalty={}", window_text(p.base_us.get())));
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_read_as_written() {
        assert_eq!(rate(100_000), "10/s");
        assert_eq!(rate(2_000_000), "30/m");
        assert_eq!(rate(720_000_000), "5/h");
        assert_eq!(rate(1_000_000), "1/s");
        assert_eq!(rate(7_000), "1/7ms");
    }
}
